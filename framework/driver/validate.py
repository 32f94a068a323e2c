"""Load and check a composed config into a validated, frozen :class:`ResolvedRun`.

:func:`load_run_config` (:mod:`framework.base.load`) builds the typed dataclasses (single-field
checks run in their ``__post_init__``); :func:`validate` applies the cross-field rules, derives
the batch arithmetic and the parallel layout (:class:`~framework.base.layout.ParallelLayout`), checks
the run against the plugin's declared capabilities and its own rules, and raises one
:class:`ConfigError` listing every problem, before any process group, rank or MLflow run exists.
It runs once, in the driver; ranks receive the :class:`ResolvedRun`.
"""

from __future__ import annotations

from framework.base.config.schema import ARCH_SHAPE, ConfigError, RunConfig
from framework.base.layout import ParallelLayout
from framework.base.load import load_run_config
from framework.base.plugin import check_capabilities
from framework.base.registry import get_plugin_class
from framework.base.resolved import ResolvedRun

__all__ = ["ConfigError", "ResolvedRun", "derive_batch", "load_run_config", "validate"]


def derive_batch(
    *, micro_batch_size: int | None, global_batch_size: int | None, grad_accum_steps: int | None, dp_degree: int
) -> tuple[int, int, int]:
    """Derive (micro_batch_size, grad_accum_steps, global_batch_size) from any two of them.

    ``global_batch_size = micro_batch_size * grad_accum_steps * dp_degree``.

    Raises:
        ConfigError: fewer than two given, a remainder, or three given that disagree.
    """
    mbs, gbs, acc = micro_batch_size, global_batch_size, grad_accum_steps
    given = sum(v is not None for v in (mbs, gbs, acc))
    if given < 2:
        raise ConfigError(
            "trainer: give at least two of micro_batch_size, global_batch_size, grad_accum_steps "
            f"(got micro_batch_size={mbs}, global_batch_size={gbs}, grad_accum_steps={acc})"
        )
    if gbs is None:
        gbs = mbs * acc * dp_degree
    elif acc is None:
        if gbs % (mbs * dp_degree):
            raise ConfigError(
                f"trainer.global_batch_size={gbs} is not divisible by micro_batch_size {mbs} x dp_degree {dp_degree}"
                f" = {mbs * dp_degree}"
            )
        acc = gbs // (mbs * dp_degree)
    elif mbs is None:
        if gbs % (acc * dp_degree):
            raise ConfigError(
                f"trainer.global_batch_size={gbs} is not divisible by grad_accum_steps {acc} x dp_degree {dp_degree}"
                f" = {acc * dp_degree}"
            )
        mbs = gbs // (acc * dp_degree)
    if mbs * acc * dp_degree != gbs:
        raise ConfigError(
            f"trainer.global_batch_size={gbs} != micro_batch_size {mbs} x grad_accum_steps {acc} x dp_degree {dp_degree}"
            f" = {mbs * acc * dp_degree}; set one of them to null to derive it"
        )
    return mbs, acc, gbs


def validate(run: RunConfig, *, first_launch: bool = True) -> ResolvedRun:
    """Check cross-field rules, derive layout and batch, check the plugin's capabilities and rules.

    ``first_launch``: the run as configured (True), or a relaunch the driver resolves itself (an
    elastic shrink, :func:`framework.driver.faults.elastic.resolve_shrunk`), for which the rules about
    the first launch only (``resilience.shrink_to`` below the world size) are not checked. Whether
    the first shrink keeps the global batch is the driver's next check
    (:func:`framework.driver.faults.elastic.check_first_shrink`), since it validates the shrunk run.

    Raises:
        ConfigError: every violated rule, joined into one line with ``"; "``.
    """
    errors: list[str] = []

    def check(fn):
        try:
            return fn()
        except ConfigError as err:
            errors.append(str(err))
            return None

    layout = check(lambda: ParallelLayout.from_config(run.parallelism))
    if layout is not None and layout.nnodes != 1:
        from framework.driver.nodes import resolve_nodes

        check(lambda: resolve_nodes(run))  # endpoint, node rank, what runs on one node only (framework/driver/nodes.py)
        if layout.nproc_per_node % layout.tp:
            errors.append(
                f"parallelism.tp_degree={layout.tp} does not divide the {layout.nproc_per_node} ranks per node:"
                " a tensor-parallel group stays inside a node"
            )
    batch = None
    if layout is not None:
        t = run.trainer
        batch = check(
            lambda: derive_batch(
                micro_batch_size=t.micro_batch_size,
                global_batch_size=t.global_batch_size,
                grad_accum_steps=t.grad_accum_steps,
                dp_degree=layout.dp,
            )
        )
    for key, want in ARCH_SHAPE[run.model.arch].items():
        if getattr(run.model, key) != want:
            errors.append(
                f"model.{key}={getattr(run.model, key)!r} does not go with model.arch={run.model.arch!r}"
                f" (it trains only model.{key}={want!r}; python -m framework.plan sizes any shape)"
            )
    if run.data.seq_len > run.model.max_seq_len:
        errors.append(f"data.seq_len={run.data.seq_len} is longer than model.max_seq_len={run.model.max_seq_len}")
    if run.model.vocab_size is not None and run.model.vocab_size < run.data.vocab_size:
        errors.append(
            f"model.vocab_size={run.model.vocab_size} is smaller than data.vocab_size={run.data.vocab_size}"
            " (the tokenizer's); set it >= that or null"
        )
    threads = 1
    if layout is not None:
        import os

        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        ranks = layout.nproc_per_node
        threads = run.trainer.threads_per_rank if run.trainer.threads_per_rank is not None else max(1, cores // ranks)
    if run.trainer.threads_per_rank is not None and layout is not None:
        # 1 thread per rank is always allowed (as null gives): more ranks than cores oversubscribe
        # whatever the thread count, and the launcher's own choice would be 1 too.
        if (
            run.trainer.threads_per_rank > 1
            and run.trainer.threads_per_rank * ranks > cores
            and run.trainer.accelerator != "cuda"
        ):
            errors.append(
                f"trainer.threads_per_rank={run.trainer.threads_per_rank} x {ranks} ranks > {cores} cores: CPU ranks"
                f" would thrash; allowed: <= {max(1, cores // ranks)} (or null = cores // ranks)"
            )
    if run.trainer.accelerator == "cuda":
        import torch

        if not torch.cuda.is_available():
            errors.append("trainer.accelerator='cuda' but no CUDA device is visible; allowed here: auto, cpu")
    plugin = get_plugin_class(run.parallelism.name)(run.parallelism)
    resolved = None
    from framework.base.faults.schedule import check_fault_config

    if layout is not None:
        check(lambda: check_capabilities(plugin, run, layout))
        check(lambda: check_fault_config(run, layout.world_size, layout.tp, layout.pp))
    else:  # the fault rules that need no layout, so that both errors come in one line
        check(lambda: check_fault_config(run, None))
    if batch is not None:
        mbs, acc, gbs = batch
        resolved = ResolvedRun(
            run=run,
            layout=layout,
            micro_batch_size=mbs,
            grad_accum_steps=acc,
            global_batch_size=gbs,
            checkpoint_dir=checkpoint_dir_of(run),
            owns_microbatching=plugin.capabilities.owns_microbatching_for(layout),
            threads_per_rank=threads,
        )
        check(lambda: plugin.validate(resolved))  # the plugin's own rules see a layout and batch split that hold
        r = run.resilience
        if first_launch and r.policy == "shrink" and r.shrink_to is not None and r.shrink_to >= layout.world_size:
            errors.append(
                f"resilience.shrink_to={int(r.shrink_to)} ranks is not below world_size={layout.world_size}"
                f" (allowed: 1..{layout.world_size - 1} ranks, a fraction in (0, 1), or null)"
            )
    if errors:
        raise ConfigError("; ".join(errors))
    return resolved


def checkpoint_dir_of(run: RunConfig) -> str:
    """The run's checkpoint folder: ``checkpoint.dir``, or ``checkpoints/<experiment_name>/<run_name>``."""
    return run.checkpoint.dir or f"checkpoints/{run.experiment_name}/{run.run_name}"
