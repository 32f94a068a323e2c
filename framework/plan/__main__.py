"""``python -m framework.plan [overrides]``: rank the layouts of a cluster by predicted step time.

Composes ``conf/plan.yaml`` (the same conf/ tree as training: ``model=``, ``cluster=``,
``trainer.global_batch_size=``, ``data.seq_len=``, ``plan.nodes=`` ...), checks the input (one
``trainlab: error:`` line, exit code 2: an unknown option, a search-space value not allowed
(``plan.zero_stages``, ``plan.schedules``, ``plan.recompute``), a ``plan.run_with`` list without
one entry per ZeRO stage, a cluster file missing a field, a global batch no layout divides, a
model that fits no layout with the smallest memory it would need), searches (:mod:`framework.plan.search`), prints the top layouts (:mod:`framework.plan.report`)
and logs the plan to MLflow.
"""

from __future__ import annotations

import sys
import time

from omegaconf import OmegaConf

from framework.config import CONF_DIR, fail


def compose(argv: list[str]):
    """The composed ``plan`` config for command-line ``argv`` overrides.

    Raises:
        SystemExit(2): a Hydra compose error (one line).
    """
    from hydra import compose as hydra_compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            return hydra_compose(config_name="plan", overrides=argv)
    except (HydraException, OmegaConfBaseException) as err:
        fail(str(err).strip().splitlines()[0])


def check_search_space(p) -> None:
    """Exit with one line when ``plan.zero_stages``, ``plan.schedules`` or ``plan.recompute`` holds a
    value not allowed, or ``plan.run_with.data_parallel`` / ``model_parallel_dp`` is not a list of
    one entry per ZeRO stage (entry ``i`` = stage ``i``)."""
    from framework.cost.activations import RECOMPUTE
    from framework.cost.bubble import SCHEDULES
    from framework.cost.memory import ZERO_STAGES, is_zero_stage

    for key, allowed, ok in (("zero_stages", ZERO_STAGES, is_zero_stage), ("schedules", SCHEDULES, SCHEDULES.__contains__),
                             ("recompute", RECOMPUTE, RECOMPUTE.__contains__)):
        bad = [x for x in p[key] if not ok(x)]
        if bad:
            fail(f"plan.{key}: {bad[0]!r} is not allowed; allowed: {', '.join(map(str, allowed))}")
    for key in ("data_parallel", "model_parallel_dp"):
        got = p.run_with[key]
        if not OmegaConf.is_list(got) or len(got) != len(ZERO_STAGES):
            fail(f"plan.run_with.{key} must be a list of {len(ZERO_STAGES)} overrides, entry i for ZeRO stage i "
                 f"({', '.join(map(str, ZERO_STAGES))}); got {OmegaConf.to_container(got) if OmegaConf.is_config(got) else got!r}")


def load_inputs(cfg):
    """``(ModelShape, Cluster, SearchSpace, StepTimeParams)`` from the composed config; bad input exits (one line)."""
    from framework.config.schema import ConfigError, ModelConfig
    from framework.cost.hardware import ClusterError, cluster_from_dict
    from framework.cost.shape import ModelShape
    from framework.cost.steptime import StepTimeParams
    from framework.plan.search import SearchSpace

    p = cfg.plan
    try:
        model = ModelConfig(**OmegaConf.to_container(cfg.model, resolve=True))
        shape = ModelShape.from_model_config(model, seq_len=int(cfg.data.seq_len), vocab_size=int(cfg.data.vocab_size))
    except (ConfigError, TypeError, ValueError) as err:
        fail(str(err).splitlines()[0])
    if shape.seq_len > model.max_seq_len and model.learned_positions:
        fail(f"data.seq_len={shape.seq_len} is longer than model.max_seq_len={model.max_seq_len}")
    try:
        cluster = cluster_from_dict(OmegaConf.to_container(cfg.cluster, resolve=True),
                                    where=f"conf/cluster/{cfg.cluster.get('name', '?')}.yaml", cache_dir=p.cache_dir)
    except ClusterError as err:
        fail(str(err))
    if int(p.nodes) < 1 or cfg.trainer.global_batch_size is None or int(cfg.trainer.global_batch_size) < 1:
        fail(f"plan.nodes={p.nodes} and trainer.global_batch_size={cfg.trainer.global_batch_size} must be >= 1")
    check_search_space(p)
    space = SearchSpace(
        micro_batch_sizes=tuple(p.micro_batch_sizes), tp_degrees=tuple(p.tp_degrees) if p.tp_degrees else None,
        pp_degrees=tuple(p.pp_degrees) if p.pp_degrees else None, virtual_stages=tuple(p.virtual_stages),
        schedules=tuple(p.schedules), zero_stages=tuple(p.zero_stages), recompute=tuple(p.recompute),
        sequence_parallel=tuple(bool(x) for x in p.sequence_parallel), precision=str(p.precision),
        state_accounting=str(p.state_accounting),
    )
    params = StepTimeParams(tp_overlap=p.tp_overlap, pp_handoff_exposed=p.pp_handoff_exposed, dp_overlap=p.dp_overlap,
                            bucket_bytes=p.bucket_bytes, param_gather_overlap=p.param_gather_overlap,
                            zero3_prefetch=p.zero3_prefetch, allreduce_algorithm=str(p.allreduce_algorithm),
                            microbatch_overhead_s=p.microbatch_overhead_s, handoff_s=p.handoff_s,
                            step_overhead_s=p.step_overhead_s)
    return shape, cluster, space, params


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code (2 = bad input, printed as one line)."""
    from rich.console import Console
    from rich.progress import Progress

    from framework.plan.report import log_plan, print_plan
    from framework.plan.search import PlanError, search

    argv = sys.argv[1:] if argv is None else argv
    cfg = compose(argv)
    shape, cluster, space, params = load_inputs(cfg)
    world = int(cfg.plan.nodes) * cluster.gpus_per_node
    gbs = int(cfg.trainer.global_batch_size)
    err = Console(stderr=True)
    t0 = time.perf_counter()
    try:
        with Progress(console=err, transient=True) as prog:
            task = prog.add_task(f"pricing layouts of {world} GPUs", total=None)
            result = search(shape, cluster, world=world, global_batch_size=gbs, space=space, params=params,
                            progress=lambda i, n: prog.update(task, completed=i, total=n))
    except PlanError as e:
        fail(str(e))
    wall = time.perf_counter() - t0
    if not result.fitting:
        miss = result.closest_miss
        fail(f"model={cfg.model.name} fits no layout of {world} x {cluster.name}: the smallest needs "
             f"{miss.memory_bytes / 2**30:.1f} GiB per GPU ({miss.layout.describe()}) > usable "
             f"{cluster.usable_memory_bytes / 2**30:.1f} GiB; add GPUs (plan.nodes) or pick a bigger-memory cluster")
    print_plan(cfg, shape, cluster, result, world=world, wall_s=wall)
    if cfg.tracking.enabled:
        log_plan(cfg, shape, cluster, result, world=world, wall_s=wall)
    return 0


if __name__ == "__main__":
    sys.exit(main())
