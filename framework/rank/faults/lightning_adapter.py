"""The fault guard's edits of Lightning's private loop state, in one place.

Lightning has no public "go back to optimizer step N" nor "re-align the micro-batch counter"; the
resilience policy (:mod:`framework.rank.faults.guard`) needs both, so it edits the fit loop's progress
trackers directly. Everything here relies on these internals of ``pytorch-lightning>=2.5,<2.7``
(the range ``pyproject.toml`` pins; checked on 2.6.6) and must be re-checked when that range moves:

- ``trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer.step.total``:
  a ``ReadyCompletedTracker`` whose ``completed`` is the optimizer-step count that
  ``trainer.global_step`` reads and checkpoints save (automatic optimization only);
- ``trainer.fit_loop.epoch_loop.batch_progress.current``: a ``ProcessedTracker``
  (``ready``/``started``/``processed``/``completed``) counting the epoch's micro-batches; the
  epoch loop closes an accumulation window when ``ready`` is a multiple of
  ``trainer.accumulate_grad_batches``;
- ``trainer.fit_loop.epoch_loop._should_accumulate()``: whether the running micro-batch is inside
  gradient accumulation, the very test Lightning uses to count an optimizer step and to step
  the LR scheduler (a strategy that handles accumulation itself, DeepSpeed, has its
  ``optimizer_step`` and so ``on_before_optimizer_step`` called on every micro-batch);
- ``trainer.train_dataloader.batch_sampler``: trainlab's own
  :class:`~framework.rank.data.sampler.StepBatchSampler` (``start_step``), reached through the loader
  Lightning holds.

Ending the epoch early (``LightningModule.on_train_batch_start`` returning ``-1``) is public API
and is not here.
"""

from __future__ import annotations

from typing import Any


def set_optimizer_step(trainer: Any, step: int) -> None:
    """Set Lightning's optimizer-step counter (what ``trainer.global_step`` reads) to ``step``
    and start trainlab's batch sampler at ``step``.

    The caller then ends the epoch: the next epoch re-iterates the loader from ``step`` with
    fresh in-epoch counters, so gradient accumulation stays aligned to step boundaries.
    """
    progress = trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer.step.total
    progress.ready = progress.completed = step
    trainer.train_dataloader.batch_sampler.start_step = step


def closes_optimizer_step(trainer: Any) -> bool:
    """Whether the micro-batch running now is the last of its optimizer step (its update follows).

    ``on_before_optimizer_step`` runs once per optimizer step under Lightning's own accumulation,
    but on every micro-batch under a strategy that accumulates itself (DeepSpeed: its engine
    applies the update at the accumulation boundary only); a hook that judges or edits a whole
    step's gradients asks this first.
    """
    return not trainer.fit_loop.epoch_loop._should_accumulate()


def align_batch_counter(trainer: Any) -> bool:
    """Make Lightning's in-epoch micro-batch counter a whole number of current optimizer steps.

    Call in the first ``on_train_batch_start`` of a (resumed) fit. Lightning cuts optimizer steps
    where that counter is a multiple of ``accumulate_grad_batches``, and a checkpoint stores it
    in micro-batches of the run that saved it: after a shrink (grad_accum_steps 2 -> 4) the
    first step would end after half a global batch. The counter is set to ``global_step *
    grad_accum_steps`` (as if the epoch began at step 0, which the sampler's length assumes),
    plus the batch whose start hook is running. Returns whether it had to change.
    """
    current = trainer.fit_loop.epoch_loop.batch_progress.current
    done = trainer.global_step * trainer.accumulate_grad_batches
    if (current.ready - 1) % trainer.accumulate_grad_batches == 0:
        return False
    current.ready, current.started, current.processed, current.completed = done + 1, done, done, done
    return True
