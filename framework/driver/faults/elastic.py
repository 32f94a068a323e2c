"""Elastic shrink: which world size a run shrinks to, the run resolved there, and how it is recorded.

After a rank is lost for good (``resilience.policy=shrink``, restarts used up) the driver
relaunches the run with fewer data-parallel ranks, keeping ``global_batch_size`` and
``micro_batch_size`` and re-deriving ``grad_accum_steps``, so the optimisation problem is the
same one (the loss of a step is still the mean over the same global batch). This is the
large-run case of losing a quarter of the machines (1024 -> 768 GPUs) and going on at the same
global batch with a short LR re-warm-up.

- Target (:func:`shrink_targets`): ``resilience.shrink_to`` null = one rank less; a fraction in
  (0, 1) = that share of the world size at the failure, rounded down (0.75: 1024 -> 768, 4 -> 3);
  a whole number >= 1 = that world size. When the target does not keep the global batch, the
  next smaller sizes are tried down to ``resilience.min_world_size``.
- Feasible (:func:`resolve_shrunk`): the first size whose data-parallel degree divides
  ``global_batch_size / micro_batch_size`` (and that the plugin accepts). When none does, the
  run stops with one line naming the global batch, the micro-batch and the dp degrees tried;
  for the first shrink this is checked by :func:`check_first_shrink`, which the driver calls
  right after :func:`framework.driver.validate.validate`, before any rank starts.
- Or a smaller batch (``resilience.shrink_batch=scale``): ``grad_accum_steps`` kept, the global
  batch and the peak LR scaled by new/old ranks (the alternative the elastic study compares).
- LR re-warm-up (:func:`rewarmup_factor`): the scheduled LR is scaled linearly from
  ``1/rewarmup_steps`` to 1 over the first ``resilience.rewarmup_steps`` steps after the step
  the shrunk launch resumed from.
- Records (:func:`shrink_tags`): the MLflow tags ``world_size`` and ``layout`` follow the
  launch in force, ``elastic.shrinks`` counts the shrinks and ``elastic.history`` lists them;
  the per-step metrics ``elastic/world_size``, ``elastic/dp_degree`` and
  ``elastic/grad_accum_steps`` come from :class:`~framework.rank.callbacks.step_metrics.StepMetrics`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from framework.base.config.schema import ConfigError
from framework.base.resolved import ResolvedRun


def shrink_targets(world_size: int, shrink_to: float | None, min_world_size: int) -> list[int]:
    """World sizes to try after losing ranks of a ``world_size``-rank run, best first.

    ``shrink_to``: None = ``world_size - 1``; a fraction in (0, 1) = ``floor(world_size *
    shrink_to)`` (1e-9 tolerance, so 0.29 x 100 is 29); >= 1 = that many ranks. Capped below
    ``world_size``; then every smaller size down to ``min_world_size``. Empty when nothing is
    below ``world_size`` and at least ``min_world_size``.
    """
    if shrink_to is None:
        top = world_size - 1
    elif shrink_to < 1:
        top = math.floor(world_size * shrink_to + 1e-9)
    else:
        top = int(shrink_to)
    return list(range(min(top, world_size - 1), min_world_size - 1, -1))


def resolve_shrunk(run: Any, world_size: int) -> ResolvedRun:
    """``run`` resolved at the first world size of :func:`shrink_targets` that validates.

    ``global_batch_size`` and ``micro_batch_size`` are kept and ``grad_accum_steps`` re-derived
    (data parallel only: ``dp_degree == world_size``). With ``resilience.shrink_batch=scale``
    ``micro_batch_size`` and ``grad_accum_steps`` are kept instead: the global batch shrinks to
    ``micro_batch_size x grad_accum_steps x new ranks`` and ``optim.lr`` by new/old ranks (the
    linear scaling rule, Goyal et al. 2017 §2.1, applied downwards); the data stream goes on at
    the sample the checkpoint reached (:meth:`framework.rank.data.datamodule.TextDataModule.load_state_dict`). A multi-node run (``parallelism.nnodes > 1``)
    shrinks to node 0 alone: ``world_size / nnodes`` ranks on one node (``resilience.shrink_to``
    and ``min_world_size`` do not apply). The listed faults are dropped from the copy
    (the schedule already lives in the launch object; ranks that no longer exist cannot be
    checked against the new world size). Called by the driver (and by ``validate`` for the first
    shrink); the ranks of the next launch receive the result and validate nothing.

    Raises:
        ConfigError: no size keeps the global batch; one line naming ``global_batch_size``,
            ``micro_batch_size``, the dp degrees tried and ``shrink_to`` / ``min_world_size``.
    """
    from framework.driver.validate import derive_batch, validate

    t, r = run.trainer, run.resilience
    gbs, mbs, acc = _batch(run, world_size, derive_batch)
    tried, other = [], []
    nnodes = run.parallelism.nnodes
    # several nodes: a lost node leaves node 0 alone (its driver relaunches only its own ranks), at its ranks per node
    targets = [world_size // nnodes] if nnodes > 1 else shrink_targets(world_size, r.shrink_to, r.min_world_size)
    for w in targets:
        if r.shrink_batch == "scale":  # same micro-batches per rank: the global batch and the LR shrink with the ranks
            trainer = dataclasses.replace(
                t, global_batch_size=mbs * acc * w, micro_batch_size=mbs, grad_accum_steps=acc
            )
            optim = dataclasses.replace(run.optim, lr=run.optim.lr * w / world_size)
        else:
            trainer = dataclasses.replace(t, global_batch_size=gbs, micro_batch_size=mbs, grad_accum_steps=None)
            optim = run.optim
        new = dataclasses.replace(
            run,
            parallelism=dataclasses.replace(run.parallelism, world_size=w, dp_degree=-1, nnodes=1, nproc_per_node=None),
            trainer=trainer,
            optim=optim,
            fault=dataclasses.replace(run.fault, events=[], mtbf_steps=0.0),
        )
        try:
            return validate(new, first_launch=False)
        except ConfigError as err:
            tried.append(w)
            if gbs % (mbs * w) == 0:  # the batch divides: another rule refused this size
                other.append(f"dp {w}: {err}")
    target = (
        "node 0 alone"
        if nnodes > 1
        else "one rank less"
        if r.shrink_to is None
        else f"resilience.shrink_to={_fmt(r.shrink_to)}"
    )
    raise ConfigError(
        f"resilience.policy=shrink: no smaller layout keeps global_batch_size={gbs} at micro_batch_size={mbs}"
        f" (from world_size {world_size}, {target}, resilience.min_world_size={r.min_world_size}); dp degrees tried:"
        f" {', '.join(map(str, tried)) or 'none'} (each must divide global_batch_size / micro_batch_size = {gbs // mbs})"
        + "".join(f"; {o}" for o in other)
    )


def check_first_shrink(resolved: ResolvedRun) -> None:
    """Refuse, before any rank starts, a ``resilience.policy=shrink`` run whose first shrink cannot keep its global batch.

    Raises:
        ConfigError: the one line of :func:`resolve_shrunk`; nothing for other policies or when
            the run is already at ``resilience.min_world_size``.
    """
    run, world_size = resolved.run, resolved.layout.world_size
    r = run.resilience
    if r.policy == "shrink" and world_size > r.min_world_size:
        resolve_shrunk(run, world_size)


def _batch(run: Any, world_size: int, derive_batch: Any) -> tuple[int, int, int]:
    """``(global_batch_size, micro_batch_size, grad_accum_steps)`` of ``run`` at ``world_size`` data-parallel ranks."""
    t = run.trainer
    mbs, acc, gbs = derive_batch(
        micro_batch_size=t.micro_batch_size,
        global_batch_size=t.global_batch_size,
        grad_accum_steps=t.grad_accum_steps,
        dp_degree=world_size,
    )
    return gbs, mbs, acc


def _fmt(x: float) -> str:
    return str(int(x)) if x >= 1 else f"{x:g}"


def shrink_tags(shrinks: list[tuple[ResolvedRun, ResolvedRun, int]]) -> dict[str, str]:
    """MLflow tags after the shrinks ``[(before, after, resumed_step), ...]`` (in order): the
    launch in force (``world_size``, ``layout``), ``elastic.shrinks`` and ``elastic.history``
    (``"step 3: 4 -> 3 ranks, dp 4 -> 3, grad_accum_steps 3 -> 4"``, ``; ``-separated)."""
    if not shrinks:
        return {}
    last = shrinks[-1][1]
    history = "; ".join(
        f"step {step}: {a.world_size} -> {b.world_size} ranks, dp {a.layout.dp} -> {b.layout.dp},"
        f" grad_accum_steps {a.grad_accum_steps} -> {b.grad_accum_steps}"
        for a, b, step in shrinks
    )
    return {
        "world_size": str(last.world_size),
        "layout": last.layout.describe(),
        "elastic.shrinks": str(len(shrinks)),
        "elastic.history": history,
    }
