"""hydra/launcher=submitit_slurm|submitit_local (framework/driver/slurm.py): trainlab's config mapped onto
hydra-submitit-launcher's keys, and the one-line error for a Slurm launcher without Slurm."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

import framework.driver.cli  # noqa: F401 (registers the launchers and resolvers)
from framework.base.config import CONF_DIR
from framework.driver.slurm import check_launcher, cpus_per_task, gpus_per_node

REPO = Path(__file__).resolve().parents[2]


def _launcher(*overrides: str) -> dict:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[*overrides, "run_name=x"], return_hydra_config=True)
    keys = (
        "_target_",
        "nodes",
        "tasks_per_node",
        "cpus_per_task",
        "gpus_per_node",
        "timeout_min",
        "mem_gb",
        "partition",
        "signal_delay_s",
        "max_num_timeout",
    )
    return {k: cfg.hydra.launcher.get(k) for k in keys}


def test_slurm_launcher_gets_nodes_one_driver_per_node_cpus_gpus_and_limits():
    got = _launcher(
        "hydra/launcher=submitit_slurm",
        "parallelism=ddp",
        "parallelism.world_size=8",
        "parallelism.nnodes=2",
        "trainer.accelerator=cuda",
        "trainer.threads_per_rank=3",
        "slurm.partition=gpu",
        "slurm.timeout_min=90",
        "slurm.signal_delay_s=300",
        "slurm.max_timeouts=5",
        "slurm.mem_gb=64",
    )
    assert got == {
        "_target_": "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher",
        "nodes": 2,
        "tasks_per_node": 1,
        "cpus_per_task": 4 * 3,
        "gpus_per_node": 4,
        "timeout_min": 90,
        "mem_gb": 64,
        "partition": "gpu",
        "signal_delay_s": 300,
        "max_num_timeout": 5,
    }


def test_defaults_one_core_per_rank_no_gpus_on_cpu_and_single_has_one_node():
    ddp = _launcher("hydra/launcher=submitit_slurm", "parallelism=ddp")  # world_size 2, one node
    assert (ddp["nodes"], ddp["cpus_per_task"], ddp["gpus_per_node"], ddp["partition"]) == (1, 2, None, None)
    single = _launcher("hydra/launcher=submitit_local", "parallelism=single")  # its preset has no nnodes key
    assert single["_target_"].endswith("LocalLauncher")
    assert (single["nodes"], single["tasks_per_node"], single["cpus_per_task"]) == (1, 1, 1)


def test_resolvers():
    assert cpus_per_task(16, 2, None, None, 2) == 16  # 8 ranks per node x 2 cores
    assert cpus_per_task(16, 2, 8, 4, 2) == 32  # threads_per_rank wins
    assert gpus_per_node(None, "cuda", 16, 2, None) == 8 and gpus_per_node(None, "auto", 16, 2, None) is None
    assert gpus_per_node(2, "cpu", 16, 2, None) == 2


def test_slurm_launcher_without_sbatch_is_one_line_naming_the_launcher_and_the_install():
    err = check_launcher(["-m", "hydra/launcher=submitit_slurm", "parallelism=single,ddp"], which=lambda c: None)
    assert err.startswith("hydra/launcher=submitit_slurm needs Slurm, but sbatch and srun are not on PATH")
    assert "apt-get install slurm-wlm munge" in err and "\n" not in err
    assert check_launcher(["hydra/launcher=submitit_local"], which=lambda c: None) is None  # no Slurm needed
    assert check_launcher(["parallelism=ddp"], which=lambda c: None) is None


@pytest.mark.slow  # starts Python processes (the fast tier leaves it out)
def test_the_driver_refuses_it_before_anything_starts(tmp_path):
    """The real command line, with a PATH that has python but no sbatch: exit 2, one line, no output folder."""
    env = {**os.environ, "PATH": str(Path(sys.executable).parent), "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-m", "framework.train", "-m", "hydra/launcher=submitit_slurm", "parallelism=single,ddp"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(
        "trainlab: error: hydra/launcher=submitit_slurm needs Slurm, but sbatch and srun are not on PATH"
    )
    assert not (tmp_path / "outputs").exists()
