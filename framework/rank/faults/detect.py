"""Detectors: per-step health gathered from every rank, running statistics, the hang watchdog.

Every rank contributes ``[grad_nonfinite, grad_norm, loss, loss_nonfinite, busy_s]`` for the
step and one ``all_gather`` gives every rank the same ``[world_size, 5]`` table, so every rank
takes the same decision without a second round (a NaN on one rank is seen by all; DDP would
have spread it anyway, a sharded or post-sync fault would not).

- Non-finite: any rank's gradient L2 norm or loss is NaN/Inf.
- Spikes: the step's value (gradient norm: the plugin's global norm,
  :meth:`~framework.base.plugin.ParallelPlugin.grad_norm`, the run's one gradient-norm function,
  averaged over ranks; loss: mean over ranks = the global-batch loss, since every rank holds
  the same number of tokens) above ``factor`` x its running mean. The running mean is an exponential
  moving average over accepted steps only (``m = beta*m + (1-beta)*x``), judged only after
  ``stat_warmup_steps`` accepted steps, as in the loss-spike guards of large runs (PaLM §5.1
  restarts ~100 steps before a spike and skips the batches; OPT-175B's logbook rolls back on
  loss/grad-norm spikes).
- Stragglers: a rank's ``busy_s`` (seconds from the step's start to the health check) above
  ``straggler_factor`` x the median of the other ranks. Every sync point in the step (DDP's
  gradient all-reduce, its buffer broadcast in forward) makes the fast ranks wait for the slow
  one, so only what a rank does after the last sync shows up as skew; a straggler that is
  slow in forward/backward shows up as a longer step on every rank instead (telling them apart
  needs per-rank compute timers such as CUDA events; see framework/rank/callbacks/breakdown.py).
- Hangs: :class:`Watchdog`, a thread per rank that exits the process when no step progress
  was seen for ``timeout_s`` seconds; the elastic agent then restarts the ranks (it polls its
  workers every 0.2 s). Progress is seen at the start, the optimizer step and the end of each
  step, so the timeout must exceed the longest stretch between them: a step's micro-batches, a
  validation pass, a checkpoint save.
"""

from __future__ import annotations

import math
import os
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

HANG_EXIT_CODE = 75  # a watchdog exit (EX_TEMPFAIL): "try again", i.e. restart


@dataclass
class StepHealth:
    """One step's health over all ranks (identical on every rank)."""

    grad_nonfinite: bool
    loss_nonfinite: bool
    grad_norm: (
        float  # mean over ranks of their finite global norms (ParallelPlugin.grad_norm: L2, all parameters); 0 if none
    )
    loss: float  # mean over ranks of their micro-batch mean losses
    busy_s: list[float]  # per rank: seconds from the step's start to its health check
    grad_norms: list[float] = field(default_factory=list)  # per rank: its global norm as measured (NaN/Inf kept)

    @property
    def nonfinite(self) -> bool:
        return self.grad_nonfinite or self.loss_nonfinite

    @property
    def reported_grad_norm(self) -> float:
        """The step's gradient norm as the run logs it (``train/grad_norm``): the first rank's
        non-finite norm when there is one (the value a skip rests on; rank 0's own norm may be
        finite), else :attr:`grad_norm` (a spike shows as the spiking value)."""
        return next((g for g in self.grad_norms if not math.isfinite(g)), self.grad_norm)

    def straggler(self, factor: float, min_s: float = 0.0) -> int | None:
        """The slowest rank if its ``busy_s`` exceeds ``factor`` x the median of the other ranks (and that
        median by more than ``min_s`` seconds, so that noise on millisecond steps is not flagged), else None.

        (The others' median, not everyone's: with 2 ranks the median is the mean, which a
        straggler can never exceed by 2x.)
        """
        if factor <= 0 or len(self.busy_s) < 2:
            return None
        worst = max(range(len(self.busy_s)), key=lambda r: self.busy_s[r])
        med = statistics.median(b for r, b in enumerate(self.busy_s) if r != worst)
        slow = self.busy_s[worst]
        return worst if med > 0 and slow > factor * med and slow - med > min_s else None


def gather_health(*, grad_norm: float, loss: float, busy_s: float, device: torch.device) -> StepHealth:
    """All-gather this rank's figures (``torch.distributed`` when initialized); every rank gets the same result."""
    g_bad, l_bad = not math.isfinite(grad_norm), not math.isfinite(loss)
    mine = torch.tensor(
        [float(g_bad), grad_norm, 0.0 if l_bad else loss, float(l_bad), busy_s], dtype=torch.float64, device=device
    )
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        parts = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, mine)
        table = torch.stack(parts).cpu()
    else:
        table = mine.unsqueeze(0).cpu()
    norms = [float(v) for v in table[:, 1]]
    finite = [g for g in norms if math.isfinite(g)]
    return StepHealth(
        grad_nonfinite=bool(table[:, 0].sum() > 0),
        loss_nonfinite=bool(table[:, 3].sum() > 0),
        grad_norm=sum(finite) / len(finite) if finite else 0.0,
        loss=float(table[:, 2].mean()),
        busy_s=[float(v) for v in table[:, 4]],
        grad_norms=norms,
    )


class RunningMean:
    """Exponential moving average ``m = beta*m + (1-beta)*x`` that judges spikes after ``warmup`` updates."""

    def __init__(self, beta: float, warmup: int) -> None:
        self.beta = beta
        self.warmup = warmup
        self.mean: float | None = None
        self.count = 0

    def is_spike(self, x: float, factor: float) -> bool:
        """``x > factor * mean`` once warmed up (``factor == 0`` disables)."""
        return factor > 0 and self.mean is not None and self.count >= self.warmup and x > factor * self.mean

    def update(self, x: float) -> None:
        self.mean = x if self.mean is None else self.beta * self.mean + (1 - self.beta) * x
        self.count += 1


class Watchdog:
    """Exits this process (code :data:`HANG_EXIT_CODE`) after ``timeout_s`` seconds without :meth:`beat`.

    A daemon thread checks every ``min(1, timeout_s / 4)`` seconds, so a hang is acted on between
    ``timeout_s`` and ``timeout_s + poll`` seconds after the last progress. ``on_hang(stalled_s)``
    runs first (to log the detection). Sleeping and blocked collectives release the GIL, so
    the thread runs while the training thread is stuck.
    """

    def __init__(self, timeout_s: float, on_hang: Callable[[float], None]) -> None:
        self.timeout_s = timeout_s
        self.poll_s = min(1.0, timeout_s / 4)
        self.on_hang = on_hang
        self._last = time.monotonic()
        self._armed = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="trainlab-watchdog")

    def start(self) -> None:
        self.beat()
        self._armed = True
        if not self._thread.is_alive():
            self._thread.start()

    def beat(self) -> None:
        self._last = time.monotonic()

    def stop(self) -> None:
        self._armed = False
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            stalled = time.monotonic() - self._last
            if self._armed and stalled > self.timeout_s:
                try:
                    self.on_hang(stalled)
                finally:
                    os._exit(HANG_EXIT_CODE)
