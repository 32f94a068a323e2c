"""``python -m framework.plan [overrides]``: rank the layouts of a cluster by predicted step time.

Composes ``conf/plan.yaml`` (the same conf/ tree as training: ``model=``, ``cluster=``,
``trainer.global_batch_size=``, ``data.seq_len=``, ``plan.nodes=`` ...; ``-h``/``--help`` prints
the usage and the ``plan.*`` keys), checks the input (one
``trainlab: error:`` line naming the key, exit code 2: an unknown option, a search-space value not allowed
(``plan.zero_stages``, ``plan.schedules``, ``plan.recompute``, ``plan.precision``, a micro-batch,
virtual-stage, TP or PP entry < 1, a TP degree that neither divides nor is a multiple of the GPUs
per node, a TP/PP degree that does not divide the world size), a ``plan.run_with`` list without
one entry per ZeRO stage, a cluster file missing a field, a global batch no layout divides, a
model that fits no layout with the smallest memory it would need); a TP group spanning nodes is
warned about (``trainlab: warning:``) and priced on the NIC; searches (:mod:`framework.driver.plan.search`), prints the top layouts (:mod:`framework.driver.plan.report`)
and logs the plan to MLflow.
"""

from __future__ import annotations

import sys
import time

from omegaconf import OmegaConf

from framework.base.config import CONF_DIR, fail

USAGE = """usage: python -m framework.plan [-h] [KEY=VALUE ...]

Rank the TP x PP x DP layouts of a cluster by the cost model's step time (framework/base/cost) and
print the top plan.top_k with memory, bytes per link, bubble, step time, MFU and cost.
Overrides use the training conf/ tree (Hydra syntax); the plan's own keys are plan.*.

examples:
  python -m framework.plan model=gpt3_175b cluster=h100_sxm plan.nodes=1024 trainer.global_batch_size=1536 data.seq_len=2048
  python -m framework.plan model=llama3_70b cluster=h200 plan.nodes=8 trainer.global_batch_size=512 data.seq_len=8192 plan.zero_stages=[1,3]

config groups: model={models}  cluster={clusters}
read from the other groups: data.seq_len, data.vocab_size (when model.vocab_size is null), trainer.global_batch_size,
tracking.enabled / tracking.uri (the MLflow run of the plan)

plan.* keys (conf/plan.yaml, defaults shown):
{plan}
Bad input is one 'trainlab: error:' line naming the key; exit code 2."""


def usage() -> str:
    """The ``--help`` text: usage, examples, the config groups' options and ``conf/plan.yaml``'s ``plan`` keys with their comments."""
    text = (CONF_DIR / "plan.yaml").read_text(encoding="utf-8")
    lines, inside = [], False
    for line in text.splitlines():
        if line.startswith("plan:"):
            inside = True
            continue
        if inside and line and not line.startswith(" "):
            break
        if inside:
            lines.append(line)
    names = lambda group: ", ".join(sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml")))  # noqa: E731
    return USAGE.format(models=names("model"), clusters=names("cluster"), plan="\n".join(lines))


def compose(argv: list[str]):
    """The composed ``plan`` config for command-line ``argv`` overrides.

    Raises:
        SystemExit(2): a Hydra compose error (one line).
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
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
    from framework.base.cost.activations import RECOMPUTE
    from framework.base.cost.bubble import SCHEDULES
    from framework.base.cost.memory import ZERO_STAGES, is_zero_stage

    for key, allowed, ok in (
        ("zero_stages", ZERO_STAGES, is_zero_stage),
        ("schedules", SCHEDULES, SCHEDULES.__contains__),
        ("recompute", RECOMPUTE, RECOMPUTE.__contains__),
    ):
        bad = [x for x in p[key] if not ok(x)]
        if bad:
            fail(f"plan.{key}: {bad[0]!r} is not allowed; allowed: {', '.join(map(str, allowed))}")
    for key in ("data_parallel", "model_parallel_dp"):
        got = p.run_with[key]
        if not OmegaConf.is_list(got) or len(got) != len(ZERO_STAGES):
            fail(
                f"plan.run_with.{key} must be a list of {len(ZERO_STAGES)} overrides, entry i for ZeRO stage i "
                f"({', '.join(map(str, ZERO_STAGES))}); got {OmegaConf.to_container(got) if OmegaConf.is_config(got) else got!r}"
            )


def _ints(p, key: str, *, minimum: int = 1) -> list[int]:
    """``plan.<key>`` as a list of ints >= ``minimum`` (null = empty), else exit with one line."""
    got = p.get(key)
    if got is None:
        return []
    vals = list(got) if OmegaConf.is_list(got) else [got]
    if not vals:
        fail(f"plan.{key} is empty; give at least one int >= {minimum}")
    for x in vals:
        if not isinstance(x, int) or isinstance(x, bool) or x < minimum:
            fail(f"plan.{key}: {x!r} is not allowed; every entry must be an int >= {minimum}")
    return vals


def check_numbers(p) -> None:
    """Exit with one line when a numeric ``plan.*`` key is out of range: the degree and batch lists
    (ints >= 1), ``plan.top_k`` >= 1, ``plan.train_tokens`` > 0, the overlap fractions in [0, 1],
    the fixed costs >= 0, ``plan.allreduce_algorithm``, ``plan.precision``, ``plan.state_accounting``."""
    from framework.base.cost.memory import ACCOUNTINGS, PRECISIONS

    for key in ("micro_batch_sizes", "virtual_stages", "tp_degrees", "pp_degrees"):
        _ints(p, key)
    for key, allowed in (
        ("precision", tuple(PRECISIONS)),
        ("state_accounting", ACCOUNTINGS),
        ("allreduce_algorithm", ("ring", "tree")),
    ):
        if p[key] not in allowed:
            fail(f"plan.{key}={p[key]!r} is not allowed; allowed: {', '.join(allowed)}")
    checks = [
        ("top_k", lambda x: isinstance(x, int) and x >= 1, "an int >= 1"),
        ("nodes", lambda x: isinstance(x, int) and x >= 1, "an int >= 1"),
        ("train_tokens", lambda x: isinstance(x, (int, float)) and x > 0, "a number > 0"),
    ]
    checks += [
        (k, lambda x: isinstance(x, (int, float)) and 0 <= x <= 1, "a number in [0, 1]")
        for k in ("tp_overlap", "pp_handoff_exposed", "dp_overlap", "param_gather_overlap", "zero3_prefetch")
    ]
    checks += [
        (k, lambda x: isinstance(x, (int, float)) and x >= 0, "a number >= 0")
        for k in ("bucket_bytes", "microbatch_overhead_s", "handoff_s", "step_overhead_s")
    ]
    for key, ok, what in checks:
        if isinstance(p[key], bool) or not ok(p[key]):
            fail(f"plan.{key}={p[key]!r} is not allowed; must be {what}")


def check_degrees(p, shape, cluster, world: int) -> list[str]:
    """Exit with one line when an explicit ``plan.tp_degrees`` / ``plan.pp_degrees`` entry cannot
    split ``world`` GPUs (TP: divide the GPUs per node or be a multiple of them, divide the world
    and the heads; PP: divide the world and be at most the layers); return warnings (one line each)
    for TP groups that span nodes (priced on the NIC)."""
    warnings = []
    gpn = cluster.gpus_per_node
    for t in _ints(p, "tp_degrees"):
        if gpn % t and t % gpn:
            fail(f"plan.tp_degrees: {t} neither divides cluster.gpus_per_node={gpn} nor is a multiple of it")
        if world % t:
            fail(f"plan.tp_degrees: {t} does not divide the world size {world} (plan.nodes={p.nodes} x {gpn})")
        if shape.n_head % t:
            fail(f"plan.tp_degrees: {t} does not divide model.n_head={shape.n_head}")
        if t > gpn:
            warnings.append(
                f"plan.tp_degrees: tp {t} spans {t // gpn} nodes of {gpn} GPUs; its collectives are "
                f"priced on the NIC (cluster.nic_bandwidth), not NVLink"
            )
    for pp in _ints(p, "pp_degrees"):
        if world % pp:
            fail(f"plan.pp_degrees: {pp} does not divide the world size {world} (plan.nodes={p.nodes} x {gpn})")
        if pp > shape.n_layer:
            fail(f"plan.pp_degrees: {pp} is more than model.n_layer={shape.n_layer}")
    tps, pps = _ints(p, "tp_degrees"), _ints(p, "pp_degrees")
    if tps and pps and not any(world % (t * q) == 0 for t in tps for q in pps):
        fail(f"plan.tp_degrees={tps} x plan.pp_degrees={pps}: no pair divides the world size {world}")
    return warnings


def load_inputs(cfg):
    """``(ModelShape, Cluster, SearchSpace, StepTimeParams)`` from the composed config; bad input exits (one line)."""
    from framework.base.config.schema import ConfigError, ModelConfig
    from framework.base.cost.hardware import ClusterError
    from framework.base.cost.shape import ModelShape
    from framework.base.cost.steptime import StepTimeParams
    from framework.base.metrics.local_cpu import cluster_of
    from framework.driver.plan.search import SearchSpace

    p = cfg.plan
    check_numbers(p)
    for key in ("seq_len",):
        v = cfg.data.get(key)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            fail(f"data.{key}={v!r} is not allowed; must be an int >= 1")
    gbs = cfg.trainer.get("global_batch_size")
    if not isinstance(gbs, int) or isinstance(gbs, bool) or gbs < 1:
        fail(f"trainer.global_batch_size={gbs!r} is not allowed; must be an int >= 1")
    try:
        model = ModelConfig(**OmegaConf.to_container(cfg.model, resolve=True))
        shape = ModelShape.from_model_config(model, seq_len=int(cfg.data.seq_len), vocab_size=int(cfg.data.vocab_size))
    except (ConfigError, TypeError, ValueError) as err:
        fail(str(err).splitlines()[0])
    if shape.seq_len > model.max_seq_len and model.learned_positions:
        fail(f"data.seq_len={shape.seq_len} is longer than model.max_seq_len={model.max_seq_len}")
    try:
        cluster = cluster_of(
            OmegaConf.to_container(cfg.cluster, resolve=True),
            where=f"conf/cluster/{cfg.cluster.get('name', '?')}.yaml",
            cache_dir=p.cache_dir,
        )
    except ClusterError as err:
        fail(str(err))
    check_search_space(p)
    space = SearchSpace(
        micro_batch_sizes=tuple(p.micro_batch_sizes),
        tp_degrees=tuple(p.tp_degrees) if p.tp_degrees else None,
        pp_degrees=tuple(p.pp_degrees) if p.pp_degrees else None,
        virtual_stages=tuple(p.virtual_stages),
        schedules=tuple(p.schedules),
        zero_stages=tuple(p.zero_stages),
        recompute=tuple(p.recompute),
        sequence_parallel=tuple(bool(x) for x in p.sequence_parallel),
        precision=str(p.precision),
        state_accounting=str(p.state_accounting),
    )
    params = StepTimeParams(
        tp_overlap=p.tp_overlap,
        pp_handoff_exposed=p.pp_handoff_exposed,
        dp_overlap=p.dp_overlap,
        bucket_bytes=p.bucket_bytes,
        param_gather_overlap=p.param_gather_overlap,
        zero3_prefetch=p.zero3_prefetch,
        allreduce_algorithm=str(p.allreduce_algorithm),
        microbatch_overhead_s=p.microbatch_overhead_s,
        handoff_s=p.handoff_s,
        step_overhead_s=p.step_overhead_s,
    )
    return shape, cluster, space, params


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code (2 = bad input, printed as one line)."""
    from rich.console import Console
    from rich.progress import Progress

    from framework.driver.plan.report import log_plan, print_plan
    from framework.driver.plan.search import PlanError, search

    argv = sys.argv[1:] if argv is None else argv
    if "-h" in argv or "--help" in argv:
        print(usage())
        return 0
    cfg = compose(argv)
    shape, cluster, space, params = load_inputs(cfg)
    world = int(cfg.plan.nodes) * cluster.gpus_per_node
    for w in check_degrees(cfg.plan, shape, cluster, world):
        print(f"trainlab: warning: {w}", file=sys.stderr, flush=True)
    gbs = int(cfg.trainer.global_batch_size)
    err = Console(stderr=True)
    t0 = time.perf_counter()
    try:
        with Progress(console=err, transient=True) as prog:
            task = prog.add_task(f"pricing layouts of {world} GPUs", total=None)
            result = search(
                shape,
                cluster,
                world=world,
                global_batch_size=gbs,
                space=space,
                params=params,
                progress=lambda i, n: prog.update(task, completed=i, total=n),
            )
    except PlanError as e:
        fail(str(e))
    wall = time.perf_counter() - t0
    if not result.fitting:
        miss = result.closest_miss
        fail(
            f"model={cfg.model.name} fits no layout of {world} x {cluster.name}: the smallest needs "
            f"{miss.memory_bytes / 2**30:.1f} GiB per GPU ({miss.layout.describe()}) > usable "
            f"{cluster.usable_memory_bytes / 2**30:.1f} GiB; add GPUs (plan.nodes) or pick a bigger-memory cluster"
        )
    print_plan(cfg, shape, cluster, result, world=world, wall_s=wall)
    if cfg.tracking.enabled:
        log_plan(cfg, shape, cluster, result, world=world, wall_s=wall)
    return 0


if __name__ == "__main__":
    sys.exit(main())
