"""The step clock: where optimizer steps end, and the time to leave out of them.

One :class:`StepClock` per Trainer, read by the metric callbacks
(:class:`~framework.rank.callbacks.step_metrics.StepMetrics`,
:class:`~framework.rank.callbacks.breakdown.StepBreakdown`), so they agree on which batch closed an
optimizer step, on the warm-up steps after a (re)start, and on the seconds spent outside
training:

- an optimizer step ends at the ``on_train_batch_end`` in which ``trainer.global_step`` has
  advanced (Lightning increments it inside the optimizer step of the last micro-batch); a
  rollback (:func:`framework.rank.faults.guard.rewind_to_snapshot`) moves the clock back with it;
- validation passes (:class:`~framework.rank.callbacks.validation.ValidationLoss`) and the seconds a
  checkpoint save blocked training (:mod:`framework.rank.checkpoint.periodic`) are reported to it and
  kept as running totals, :attr:`StepClock.validation_s` and :attr:`StepClock.checkpoint_s`;
  a reader takes the difference of a total between two of its own marks, so the readers need
  not be told one by one.

It is the step's ``boundary`` phase (:mod:`framework.rank.step`), before every reader: its
``on_train_batch_end`` decides whether the batch closed a step before the readers' hooks ask.
"""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl


class StepClock(pl.Callback):
    """Optimizer-step boundaries and excluded time shared by the metric callbacks (see the module docstring).

    Attributes:
        start_step: ``trainer.global_step`` when training (re)started.
        step: the last finished optimizer step (``trainer.global_step`` at its end).
        step_ended: whether the batch whose ``on_train_batch_end`` runs now closed an optimizer
            step (False inside gradient accumulation).
        validation_s: seconds of validation passes since this clock was built (running total).
        checkpoint_s: seconds checkpoint saves blocked training since this clock was built (running total).
    """

    def __init__(self) -> None:
        self.start_step = 0
        self.step = 0
        self.step_ended = False
        self.validation_s = 0.0
        self.checkpoint_s = 0.0

    @property
    def excluded_s(self) -> float:
        """Seconds spent outside training so far (validation + checkpoint blocking): kept out of throughput."""
        return self.validation_s + self.checkpoint_s

    @property
    def steps_since_start(self) -> int:
        """Optimizer steps finished since training (re)started."""
        return self.step - self.start_step

    def add_validation(self, seconds: float) -> None:
        """A validation pass took ``seconds`` (wall time)."""
        self.validation_s += seconds

    def add_checkpoint(self, seconds: float) -> None:
        """A checkpoint save blocked training for ``seconds`` (wall time)."""
        self.checkpoint_s += seconds

    def on_rollback(self, step: int) -> None:
        """Training was rewound to optimizer step ``step`` (framework.base.faults rollback); the next step end is ``step + 1``."""
        self.step = step

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.start_step = self.step = trainer.global_step
        self.step_ended = False

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.step_ended = trainer.global_step != self.step
        self.step = trainer.global_step
