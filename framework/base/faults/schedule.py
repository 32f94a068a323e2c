"""The fault schedule and the fault/resilience rules checked before any rank starts.

A schedule is a list of plain dicts ``{"id", "kind", "step", "ranks", "factor", "delay_s",
"duration_steps"}`` (JSON-able: the driver puts it in the launch file, so every rank and every
restart sees the same one). Listed events get ids ``e0, e1, ...``; the random process adds
``r0, r1, ...``: gaps between faults are exponential with mean ``fault.mtbf_steps`` optimizer
steps (a Poisson process, the usual model behind MTBF and Young/Daly's interval), drawn from
``random.Random(fault.random_seed)``, so the same config always gives the same schedule.
"""

from __future__ import annotations

import dataclasses
import math
import random
from typing import Any

from framework.base.config.schema import ConfigError, FaultEventConfig, RunConfig
from framework.base.faults.kinds import fault_kind_names, fault_kinds


def build_schedule(run: RunConfig, world_size: int) -> list[dict[str, Any]]:
    """Every fault of the run, sorted by step (listed events first at equal steps)."""
    events = [{"id": f"e{i}", **dataclasses.asdict(e)} for i, e in enumerate(run.fault.events)]
    f = run.fault
    if f.mtbf_steps > 0:
        rng = random.Random(f.random_seed)
        t, i = 0.0, 0
        while True:
            t += rng.expovariate(1.0 / f.mtbf_steps)
            step = max(1, math.ceil(t))
            if step > run.trainer.max_steps:
                break
            kind = rng.choice(list(f.random_kinds))
            e = dataclasses.asdict(FaultEventConfig(kind=kind, step=step, ranks=[rng.randrange(world_size)]))
            events.append({"id": f"r{i}", **fault_kinds()[kind].random_event(e)})
            i += 1
    return sorted(events, key=lambda e: e["step"])


def check_fault_config(run: RunConfig, world_size: int | None, tp_degree: int = 1, pp_degree: int = 1) -> None:
    """Cross-field rules of ``fault`` and ``resilience`` (one line per problem, joined by ``; ``).

    ``world_size`` None: the layout did not hold (its own error is reported); the rules that need it
    (event ranks, shrink) are left out and the others still checked, so that one run reports every problem.

    Fault kinds are those registered in :mod:`framework.base.faults.kinds`; each kind the run schedules
    (listed, or drawn at random) adds its own rules (:meth:`~framework.base.faults.kinds.FaultKind.check`).

    Raises:
        ConfigError: a kind that is not registered, an event after ``trainer.max_steps`` or on a rank
            that does not exist, a kind's own rule (a hang without a watchdog), rollback without
            in-memory snapshots, shrink of a non-DP layout.
    """
    errors = []
    r, max_steps = run.resilience, run.trainer.max_steps
    registry, allowed = fault_kinds(), ", ".join(fault_kind_names())
    bad_random = [k for k in run.fault.random_kinds if k not in registry]
    if bad_random:
        errors.append(f"fault.random_kinds has {bad_random[0]!r}, which is not a fault kind; allowed: {allowed}")
    for i, e in enumerate(run.fault.events):
        if e.kind not in registry:
            errors.append(f"fault.events[{i}].kind={e.kind!r} is not a fault kind; allowed: {allowed}")
        if e.step > max_steps:
            errors.append(f"fault.events[{i}].step={e.step} is after trainer.max_steps={max_steps}")
        bad = [k for k in e.ranks if k >= world_size] if world_size is not None else []
        if bad:
            errors.append(
                f"fault.events[{i}].ranks={list(e.ranks)}: rank {bad[0]} does not exist (world_size={world_size};"
                f" allowed: 0..{world_size - 1})"
            )
    kinds = {e.kind for e in run.fault.events} | (set(run.fault.random_kinds) if run.fault.mtbf_steps > 0 else set())
    for kind in sorted(kinds & registry.keys()):
        errors.extend(registry[kind].check(run))
    if r.policy == "rollback":
        ck = run.checkpoint
        if ck.memory_every_n_steps <= 0:
            errors.append(
                "resilience.policy=rollback needs in-memory snapshots: set checkpoint.memory_every_n_steps > 0"
                " (or checkpoint=memory)"
            )
        elif ck.every_n_steps > 0 and ck.every_n_steps % ck.memory_every_n_steps:
            errors.append(
                f"resilience.policy=rollback: checkpoint.every_n_steps={ck.every_n_steps} must be a multiple of"
                f" checkpoint.memory_every_n_steps={ck.memory_every_n_steps} (the snapshot is then never older"
                " than the newest saved checkpoint)"
            )
    if r.policy == "shrink" and world_size is not None:
        if tp_degree != 1 or pp_degree != 1:
            errors.append(
                f"resilience.policy=shrink drops data-parallel ranks; tp_degree={tp_degree}, pp_degree={pp_degree}"
                " must be 1"
            )
        if world_size < r.min_world_size:
            errors.append(
                f"resilience.policy=shrink: world_size={world_size} < resilience.min_world_size={r.min_world_size}"
                f" (allowed: 1..{world_size})"
            )
    late = [s for s in r.skip_steps if s > max_steps]
    if late:
        errors.append(f"resilience.skip_steps has step {late[0]} after trainer.max_steps={max_steps}")
    if errors:
        raise ConfigError("; ".join(errors))


def faults_enabled(run: RunConfig) -> bool:
    """Whether the fault machinery runs at all (a fault scheduled or a policy chosen)."""
    return (
        bool(run.fault.events)
        or run.fault.mtbf_steps > 0
        or run.resilience.policy != "none"
        or bool(run.resilience.skip_steps)
        or run.resilience.hang_timeout_s > 0
    )
