"""The driver layer: one process per node (the Hydra app and CLI, validation, sweeps and search, the
supervisor, launcher, nodes, Slurm, compare report, planner). Imports framework.base, and the rank
layer only through framework.driver.launcher (it starts framework.rank.worker)."""
