"""Write each logged optimizer step's metrics out of the buffering sinks as one record (rank 0's MLflow outbox).

The metric callbacks (step metrics, validation, checkpoints, breakdown, plugin callbacks) each
write a step's metrics to the buffering sinks (:class:`~framework.base.tracking.MetricOutbox`, which the driver
sends to MLflow); :class:`FlushMetrics`, the step's last part (phase ``send``, :mod:`framework.rank.step`), writes
them out once all of them ran:

- at the start of training (a fresh run's ``val/loss`` of step 0);
- at the end of every optimizer step, except the last one, whose metrics go out at the end of
  training together with the run's summary (``train/loss_final``, ``perf/*_mean``, ...);
- right before a checkpoint is saved (:meth:`flush`, the checkpoint callback's ``before_save``):
  what the step wrote until then (loss, LR, validation, memory, fault figures) is written before a
  checkpoint covers the step, so a kill or Ctrl-C right after the save loses no point of a step
  the resumed run will not replay; the save's own figures and the rest of that step
  (``ckpt/*``, the step-time breakdown) go out in the end-of-step record, so a checkpoint step
  takes two records;
- when training fails with a Python exception (what was written so far).

A step rewound by a rollback (:func:`framework.rank.faults.guard.rewind_to_snapshot`, which runs in
that step's ``on_train_batch_end``, before this callback) is discarded unsent: its replay is
logged instead. The seconds a flush takes are reported to ``on_time_spent`` (the step-time
breakdown counts them as ``other``, like any metric write).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytorch_lightning as pl

from framework.base.metrics.emit import MetricEmitter
from framework.rank.callbacks.clock import StepClock


class FlushMetrics(pl.Callback):
    """Flushes buffering metric sinks once per logged step (see the module docstring).

    Args:
        clock: the run's step clock (whether a batch closed an optimizer step).
        emit: the run's metric emitter (its buffering sinks, e.g. ``MetricOutbox``, are flushed).
        on_time_spent: called with the seconds each flush took; None = not reported.
    """

    def __init__(
        self, *, clock: StepClock, emit: MetricEmitter, on_time_spent: Callable[[float], None] | None = None
    ) -> None:
        self.clock = clock
        self.emit = emit
        self.on_time_spent = on_time_spent

    def flush(self) -> None:
        """Send what the sinks hold now (every rank; sinks that buffer nothing send nothing).

        Called inside a step (the checkpoint callback's ``before_save``), so its seconds are not
        reported to ``on_time_spent``: they already lie in the step's own span, which the
        breakdown counts as ``other``; only the end-of-step flush, which runs after the
        breakdown closed the step, is carried into the next step.
        """
        self.emit.flush()

    def _flush(self) -> None:
        t0 = time.perf_counter()
        self.flush()
        if self.on_time_spent is not None:
            self.on_time_spent(time.perf_counter() - t0)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._flush()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.emit.discard_after(trainer.global_step)  # a rollback in this batch's hooks rewound the step
        if self.clock.step_ended and trainer.global_step < trainer.max_steps:
            self._flush()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._flush()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._flush()
