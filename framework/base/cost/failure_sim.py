"""A discrete-event failure simulator of a training job's checkpoint policy (seeded, pure Python).

It replays a job of ``steps`` optimizer steps of ``step_s`` seconds under a checkpoint policy
(:class:`Policy`: synchronous, asynchronous or two-tier saves every ``every`` steps) and a
failure process (exponential gaps of mean ``mtbf_s``, or a trace of failure times), and returns
where the wall time went (:class:`SimResult`). The events are interval ends, save completions,
failures and restarts, not steps, so a million simulated steps at an interval of 100 take
about 10^4 events (``benchmarks/failure_sim_bench.py`` prints the rate).

Semantics (those of :mod:`framework.base.cost.interval`, whose closed forms the tests check):

- An interval is ``every`` steps of compute followed by the save's blocking part; a failure
  anywhere in it (the save included) loses the whole interval in progress. The last interval
  may be shorter; the job ends with a save.
- A failure costs ``restart_s`` (detection + restart + load); a failure during a restart
  restarts the restart (Daly 2006's model).
- ``async``: only ``delta_s`` blocks; the save becomes durable ``write_s`` later. A failure
  before that rolls back to the newest durable checkpoint. A save that starts while the one
  before it is still in flight waits for it (one write in flight, as PyTorch DCP async_save).
- ``two_tier``: an in-memory snapshot (``delta_s``) every ``every`` steps and a persistent save
  (``disk_delta_s``, the snapshot included) every ``disk_every`` steps; a failure is
  memory-recoverable with probability ``mem_fraction`` (restart ``mem_restart_s``, back to the
  newest snapshot), else it goes back to the newest persistent save (``restart_s``).
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

POLICIES = ("sync", "async", "two_tier")


@dataclass(frozen=True)
class Policy:
    """A checkpoint policy (times in seconds; intervals in optimizer steps).

    Attributes:
        kind: ``sync`` | ``async`` | ``two_tier``.
        every: steps between saves (two_tier: between in-memory snapshots).
        delta_s: seconds a save holds training (async: the copy only; two_tier: a snapshot).
        write_s: async: seconds the background write takes after the blocking part.
        disk_every: two_tier: steps between persistent saves (a multiple of ``every``).
        disk_delta_s: two_tier: seconds a persistent save holds training.
        mem_fraction: two_tier: probability that a failure leaves the memory tier usable.
        mem_restart_s: two_tier: restart seconds from the memory tier.
    """

    kind: str
    every: int
    delta_s: float
    write_s: float = 0.0
    disk_every: int = 0
    disk_delta_s: float = 0.0
    mem_fraction: float = 0.0
    mem_restart_s: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in POLICIES:
            raise ValueError(f"policy kind={self.kind!r}; allowed: {', '.join(POLICIES)}")
        if self.every < 1:
            raise ValueError(f"every={self.every}: must be >= 1 step")
        if self.kind == "two_tier" and (self.disk_every < self.every or self.disk_every % self.every):
            raise ValueError(f"disk_every={self.disk_every} must be a positive multiple of every={self.every}")
        if not 0.0 <= self.mem_fraction <= 1.0:
            raise ValueError(f"mem_fraction={self.mem_fraction}: must be in [0, 1]")


@dataclass
class SimResult:
    """Where the simulated wall time went (seconds); ``goodput = productive_s / wall_s``."""

    wall_s: float = 0.0
    productive_s: float = 0.0
    checkpoint_s: float = 0.0
    lost_s: float = 0.0
    restart_s: float = 0.0
    failures: int = 0
    saves: int = 0

    @property
    def goodput(self) -> float:
        return self.productive_s / self.wall_s if self.wall_s > 0 else 0.0


def _exponential(mtbf_s: float, rng: random.Random) -> Iterator[float]:
    t = 0.0
    while True:
        t += rng.expovariate(1.0 / mtbf_s)
        yield t


def _trace(times: Sequence[float]) -> Iterator[float]:
    yield from sorted(times)
    while True:
        yield math.inf


def simulate(
    *,
    steps: int,
    step_s: float,
    policy: Policy,
    restart_s: float,
    mtbf_s: float = math.inf,
    seed: int = 0,
    failure_times: Sequence[float] | None = None,
    failure_steps: Sequence[int] | None = None,
) -> SimResult:
    """Simulate ``steps`` optimizer steps of ``step_s`` seconds under ``policy`` and failures.

    Failures: ``failure_times`` (a trace, seconds of wall clock from the start) if given, else
    exponential gaps of mean ``mtbf_s`` from ``random.Random(seed)`` (``inf``: none). Either
    way ``failure_steps`` adds failures tied to progress, as trainlab's fault schedule fires
    them: at the start of step ``s`` the first time the job reaches it (never on a replay).

    Raises:
        ValueError: a non-positive ``steps`` or ``step_s``, or a negative time.
    """
    if steps < 1 or not step_s > 0:
        raise ValueError(f"steps={steps}, step_s={step_s}: must be >= 1 and > 0")
    if restart_s < 0 or policy.delta_s < 0 or policy.write_s < 0:
        raise ValueError("restart_s, delta_s and write_s must be >= 0 seconds")
    rng = random.Random(seed)
    fails = (
        _trace(failure_times)
        if failure_times is not None
        else (_exponential(mtbf_s, rng) if math.isfinite(mtbf_s) else _trace([]))
    )
    next_fail = next(fails)
    step_faults = sorted(set(failure_steps or []))  # progress-tied failures not fired yet
    res = SimResult()
    t = 0.0
    pos = 0  # steps done since the newest checkpoint we would restart from (tracked as absolute positions)
    durable = 0  # step of the newest durable (persistent) checkpoint
    mem = 0  # two_tier: step of the newest in-memory snapshot
    pending: tuple[int, float] | None = None  # async: (step, time it becomes durable)
    kind, every = policy.kind, policy.every

    def restart(t_fail: float, r: float) -> float:
        """Time training resumes after a failure at ``t_fail`` (failures during the restart restart it)."""
        nonlocal next_fail
        start = t_fail
        while next_fail < start + r:
            res.failures += 1
            res.restart_s += next_fail - start
            start = next_fail
            next_fail = next(fails)
        res.restart_s += r
        return start + r

    while pos < steps:
        n = min(every, steps - pos)
        end_pos = pos + n
        if kind == "two_tier":
            save = policy.disk_delta_s if (end_pos % policy.disk_every == 0 or end_pos == steps) else policy.delta_s
        else:
            save = policy.delta_s
        wait = 0.0
        if kind == "async" and pending is not None and pending[1] > t + n * step_s:
            wait = pending[1] - (t + n * step_s)  # the previous write is still in flight: this save waits
        seg = n * step_s + wait + save
        by_step = step_faults[0] if step_faults and step_faults[0] <= end_pos else None
        t_step_fail = t + (by_step - pos - 1) * step_s if by_step is not None else math.inf
        if min(next_fail, t_step_fail) < t + seg:  # the interval is lost
            res.failures += 1
            if t_step_fail <= next_fail:
                t_fail = t_step_fail
                step_faults.pop(0)
            else:
                t_fail = next_fail
                next_fail = next(fails)
            res.lost_s += t_fail - t
            if kind == "async" and pending is not None and pending[1] <= t_fail:
                durable, pending = pending[0], None
            elif kind == "async":
                pending = None  # its write dies with the job
            if kind == "two_tier" and rng.random() < policy.mem_fraction:
                back, r = mem, policy.mem_restart_s
            else:
                back, r = durable, restart_s
                mem = durable
            res.lost_s += (pos - back) * step_s  # work since the checkpoint we go back to
            pos = back
            t = restart(t_fail, r)
            continue
        res.productive_s += n * step_s
        res.checkpoint_s += wait + save
        res.saves += 1
        t += seg
        pos = end_pos
        if kind == "async":
            if pending is not None and pending[1] <= t:
                durable = pending[0]
            pending = (pos, t + policy.write_s)
        elif kind == "two_tier":
            mem = pos
            if pos % policy.disk_every == 0 or pos == steps:
                durable = pos
        else:
            durable = pos
    res.wall_s = t
    # Replayed work was counted productive when first done and lost when thrown away: net it out.
    res.productive_s = steps * step_s
    return res


@dataclass
class Spread:
    """Goodput over seeds: mean, standard deviation (sample) and the results."""

    mean: float
    std: float
    results: list[SimResult] = field(default_factory=list)


def goodput_over_seeds(seeds: Sequence[int], **kwargs) -> Spread:
    """:func:`simulate` once per seed; the goodput's mean and sample standard deviation."""
    results = [simulate(seed=s, **kwargs) for s in seeds]
    g = [r.goodput for r in results]
    return Spread(mean=statistics.fmean(g), std=statistics.stdev(g) if len(g) > 1 else 0.0, results=results)
