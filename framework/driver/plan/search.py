"""Enumerate the layouts of a cluster and price each with the cost model.

Candidates: TP a power of two up to a node that divides the heads (and the KV heads); PP a
divisor of the layers or a power of two (uneven stages: the busiest holds ``ceil(L/p)``); DP = world / (TP·PP) dividing the global batch; a micro-batch size
dividing the per-replica batch; for PP > 1 each schedule (interleaved: ``v`` chunks with
``L % (p·v) == 0`` and ``m % p == 0``, Narayanan et al. 2021 §2.2.2); the dp group's ZeRO stage
0-3 (0 = plain DDP all-reduce; 1-3 only for DP > 1); recompute none/selective/full; SP with
TP > 1. A layout that does not fit the usable memory per GPU is dropped with its overshoot; the
rest are ranked by step time.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

from framework.base.cost.estimate import Estimate, estimate
from framework.base.cost.layout import PlanLayout
from framework.base.cost.memory import ZERO_STAGES
from framework.base.cost.steptime import StepTimeParams


class PlanError(ValueError):
    """Bad planning input (one line)."""


@dataclass
class SearchSpace:
    """What to enumerate (``conf/plan.yaml`` ``plan.*``)."""

    micro_batch_sizes: tuple[int, ...] = (1, 2, 4, 8)
    tp_degrees: tuple[int, ...] | None = None
    pp_degrees: tuple[int, ...] | None = None
    virtual_stages: tuple[int, ...] = (2, 3, 4, 6, 8)
    schedules: tuple[str, ...] = ("1F1B", "Interleaved1F1B", "GPipe")
    zero_stages: tuple[int, ...] = ZERO_STAGES
    recompute: tuple[str, ...] = ("none", "selective", "full")
    sequence_parallel: tuple[bool, ...] = (False, True)
    precision: str = "bf16"
    state_accounting: str = "paper"


@dataclass
class SearchResult:
    """Ranked fitting estimates, the smallest non-fitting one, and how many were dropped why."""

    fitting: list[Estimate]
    closest_miss: Estimate | None
    dropped: dict[str, int] = field(default_factory=dict)
    evaluated: int = 0


def degree_candidates(shape, world: int, gpus_per_node: int, space: SearchSpace) -> list[tuple[int, int, int]]:
    """``(tp, pp, dp)`` with ``tp·pp·dp == world`` (TP within a node, dividing heads and KV heads;
    PP dividing the layers)."""
    tps = space.tp_degrees or tuple(2**i for i in range(0, 8) if 2**i <= gpus_per_node)
    tps = [
        t
        for t in tps
        if shape.n_head % t == 0 and (shape.kv_heads % t == 0 or t % shape.kv_heads == 0) and world % t == 0
    ]
    out = []
    for t in tps:
        pps = space.pp_degrees or tuple(
            sorted(
                {p for p in range(1, shape.n_layer + 1) if shape.n_layer % p == 0}
                | {2**i for i in range(1, 12) if 2**i <= shape.n_layer // 2}
            )
        )
        for p in pps:
            if (world // t) % p == 0 and p <= shape.n_layer:
                out.append((t, p, world // (t * p)))
    return out


def enumerate_layouts(
    shape, world: int, global_batch_size: int, gpus_per_node: int, space: SearchSpace, dropped: dict[str, int]
) -> list[PlanLayout]:
    """Every valid :class:`~framework.base.cost.layout.PlanLayout` (module docstring); counts what does not divide in ``dropped``."""
    out = []
    for t, p, d in degree_candidates(shape, world, gpus_per_node, space):
        if global_batch_size % d:
            dropped["dp does not divide global batch"] = dropped.get("dp does not divide global batch", 0) + 1
            continue
        per_replica = global_batch_size // d
        for b in space.micro_batch_sizes:
            if per_replica % b:
                dropped["micro-batch does not divide"] = dropped.get("micro-batch does not divide", 0) + 1
                continue
            m = per_replica // b
            scheds: list[tuple[str, int]] = [("1F1B", 1)]
            if p > 1:
                scheds = [(s, 1) for s in space.schedules if s != "Interleaved1F1B"]
                if "Interleaved1F1B" in space.schedules and m % p == 0:
                    scheds += [("Interleaved1F1B", v) for v in space.virtual_stages if shape.n_layer % (p * v) == 0]
            stages = space.zero_stages if d > 1 else (0,)
            sps = space.sequence_parallel if t > 1 else (False,)
            for (sched, v), z, rc, sp in itertools.product(scheds, stages, space.recompute, sps):
                out.append(
                    PlanLayout(
                        dp=d,
                        tp=t,
                        pp=p,
                        micro_batch_size=b,
                        global_batch_size=global_batch_size,
                        schedule=sched,
                        virtual_stages=v,
                        zero_stage=z,
                        recompute=rc,
                        sequence_parallel=sp,
                        precision=space.precision,
                        state_accounting=space.state_accounting,
                    )
                )
    return out


def search(
    shape,
    cluster,
    *,
    world: int,
    global_batch_size: int,
    space: SearchSpace = SearchSpace(),
    params: StepTimeParams = StepTimeParams(),
    progress: Callable[[int, int], None] | None = None,
) -> SearchResult:
    """Price every layout; keep those that fit, ranked by step time (fastest first).

    Raises:
        PlanError: no layout divides the global batch (one line naming the batch and the dp degrees tried).
    """
    dropped: dict[str, int] = {}
    layouts = enumerate_layouts(shape, world, global_batch_size, cluster.gpus_per_node, space, dropped)
    if not layouts:
        dps = sorted({d for _, _, d in degree_candidates(shape, world, cluster.gpus_per_node, space)})
        raise PlanError(
            f"trainer.global_batch_size={global_batch_size}: no layout of {world} GPUs divides it (dp degrees possible: "
            f"{', '.join(map(str, dps)) or 'none'}; micro-batch sizes {list(space.micro_batch_sizes)}); "
            f"use a multiple of one of the dp degrees"
        )
    fitting, miss = [], None
    for i, lay in enumerate(layouts):
        e = estimate(shape, lay, cluster, params)
        if e.fits:
            fitting.append(e)
        else:
            dropped["does not fit memory"] = dropped.get("does not fit memory", 0) + 1
            if miss is None or e.memory_bytes < miss.memory_bytes:
                miss = e
        if progress is not None and (i % 500 == 0 or i == len(layouts) - 1):
            progress(i + 1, len(layouts))
    fitting.sort(key=lambda e: (round(e.time.total, 9), e.memory_bytes))  # ties (GPipe vs 1F1B): less memory first
    return SearchResult(fitting=fitting, closest_miss=miss, dropped=dropped, evaluated=len(layouts))
