"""Validation loss at the start of a fresh run, every N optimizer steps, and at the end (not at a preemption's stop).

Each rank evaluates its shard of a fixed set of validation windows (the same set every time
and for every layout, so the curve compares across steps, runs and plugins); per-rank loss
sums and window counts are all-reduced, so the result is the exact mean over the set.
Every communication meter is paused during a pass (:func:`~framework.base.metrics.timing.comm_paused`):
its forwards' collectives (FSDP's all-gathers, a pipeline's sends) are not training traffic.
"""

from __future__ import annotations

import time
from typing import Any

import pytorch_lightning as pl

from framework.base.metrics.emit import MetricEmitter
from framework.base.metrics.timing import comm_paused


class ValidationLoss(pl.Callback):
    """Logs ``val/loss`` (and ``val/loss_initial`` on a fresh start) on rank 0.

    Args:
        every_n_steps: optimizer steps between evaluations.
        emit: the run's metric emitter (writes on rank 0).
        on_time_spent: called with the seconds each evaluation took (e.g. ``StepClock.add_validation``).
    """

    def __init__(self, *, every_n_steps: int, emit: MetricEmitter, on_time_spent=None) -> None:
        self.every = every_n_steps
        self.emit = emit
        self.on_time_spent = on_time_spent  # told the seconds spent, to keep them out of throughput
        self._last_step = -1
        self.history: list[tuple[int, float]] = []

    def _evaluate(self, trainer: pl.Trainer, pl_module: Any, extra: dict[str, float] | None = None) -> None:
        step = trainer.global_step
        if step == self._last_step:
            return
        self._last_step = step
        t0 = time.perf_counter()
        loader = trainer.datamodule.val_dataloader()
        with comm_paused():
            total, count = trainer.strategy.reduce(pl_module.eval_loss_sum(loader), reduce_op="sum").tolist()
        loss = total / max(1.0, count)
        self.history.append((step, loss))
        if self.on_time_spent is not None:
            self.on_time_spent(time.perf_counter() - t0)
        self.emit({"val/loss": loss, **(extra or {})}, step)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last_step = -1 if trainer.global_step == 0 else trainer.global_step
        if trainer.global_step == 0:
            self._evaluate(trainer, pl_module)
            self.emit({"val/loss_initial": self.history[-1][1]}, 0)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if step > 0 and step % self.every == 0 and step != self._last_step:
            self._evaluate(trainer, pl_module)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_step < trainer.max_steps:
            return  # stopped early (preempted): the resumed run evaluates at its end
        self._evaluate(trainer, pl_module)
        self.emit({"val/loss_final": self.history[-1][1]}, trainer.global_step)
