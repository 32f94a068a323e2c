"""The training step in one place: its state (:class:`StepState`) and what runs its phases (:class:`TrainStep`).

One optimizer step of a rank, in the order things happen (``docs/training_step.md`` has the
full table, and where each plugin takes part):

1. **fetch** -- the next micro-batch arrives (``on_train_batch_start``): the probes open their
   windows, the fault injector fires the step's scheduled faults, the breakdown marks the data
   wait. A rollback ends the epoch here instead (``StepState.end_epoch_requested``).
2. **forward/backward** over the step's micro-batches (``LMModule.training_step``, Lightning's or
   the strategy's backward): each micro-batch adds its loss to ``StepState.loss_sum``. Under
   Lightning's accumulation steps 1-2 repeat ``grad_accum_steps`` times; a pipeline schedule runs
   all of a step's micro-batches inside one ``training_step``; DeepSpeed's engine accumulates itself.
3. **guard** (``on_before_optimizer_step``, at the step's last micro-batch): the injector's
   gradient faults, then the fault guard judges the step's health and may set
   ``StepState.drop_update``; the norm it judged becomes the step's ``grad_norm``.
4. **clip** (``LMModule.configure_gradient_clipping``, the plugin's global-norm clip; DeepSpeed: its engine's).
5. **optimizer** (AdamW; a dropped update finds no gradient, ``LMModule._drop_if_requested``) and
   the LR schedule (advances only on an applied update, ``LMModule.lr_scheduler_step``).
6. **step end** (``on_train_batch_end`` of the batch that closed the step), by phase:
   ``boundary`` (the step clock decides that the step ended) -> ``metrics`` (loss, LR, grad norm,
   throughput; validation; activation memory) -> ``faults`` (skip audit, rollback) ->
   ``checkpoint`` (in-memory snapshot, periodic save, preemption stop) -> ``plugin`` (a plugin's
   own metrics) -> ``accounting`` (step-time breakdown, the run's timeline for goodput) ->
   ``send`` (one tracking request for the step). Then ``StepState.drop_update`` is cleared.

Lightning still runs the loop (automatic optimization keeps every strategy's own backward and
step: DDP's bucketed all-reduce, FSDP, DeepSpeed ZeRO's engine, a pipeline's schedule), but it
calls one callback, :class:`TrainStep`; the parts (the metric, fault and checkpoint callbacks) are
ordered by their declared phase in :data:`PHASES`, not by where they sit in a list, and they
tell each other what happened through :class:`StepState` and the step clock, not through flags
on the module.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import pytorch_lightning as pl
import torch

PHASES = ("probe", "boundary", "metrics", "faults", "checkpoint", "plugin", "accounting", "send")
"""The phases of the step's parts, in the order their hooks run (every hook: start, micro-batch, step end).

- ``probe``: diagnostics that must see everything else (host-sync counter, profiler);
- ``boundary``: the step clock (:class:`~framework.rank.callbacks.clock.StepClock`), which decides
  whether a batch closed an optimizer step before anything at the step's end asks;
- ``metrics``: step metrics, validation, activation memory (they read the finished step);
- ``faults``: the fault injector, then the fault guard (judges in ``on_before_optimizer_step``;
  audits and rolls back at the step's end, before any save of that step);
- ``checkpoint``: in-memory snapshot, periodic checkpoint (a save sees the step whole, after
  its metrics), preemption (reuses a save of the same step);
- ``plugin``: a plugin's own callbacks (:meth:`~framework.base.plugin.ParallelPlugin.callbacks`);
- ``accounting``: the step-time breakdown (validation and saves ran inside the step it times)
  and the run's timeline for goodput (it sees the step's save, validation and rollback);
- ``send``: the flush of the buffered tracking sink, once every part wrote its metrics.
"""


@dataclass
class StepState:
    """What the phases of one optimizer step tell each other (one per rank, held by the LightningModule).

    Attributes:
        loss_sum: sum of this rank's micro-batch losses in the running step (0-dim float tensor, on the loss's device).
        micro_batches: this rank's micro-batches run so far in the running step.
        loss_transform: a ``loss -> loss`` map applied to every micro-batch loss of the step (fault
            injection: ``inf_loss``, ``loss_spike``), or None.
        judged_grad_norm: the norm the fault guard judged the step by (e.g. one rank's NaN where
            this rank's is finite), for the step's ``grad_norm``; None when no guard ran.
        drop_update: set on every rank at the step's last micro-batch to drop its update: the
            optimizer step changes nothing and the LR schedule stays. Cleared at the step's end.
        drop_reason: why the update is dropped (the guard's detector or ``skip_steps``), or None.
        grad_norm: the last closed step's global gradient norm before clipping (a device tensor
            until a logging step reads it; NaN before the first step).
        lr: the LR the last closed step's update used (NaN before the first step).
        end_epoch_requested: end the epoch at the next batch (a rollback: the next epoch re-reads
            the data from the step rolled back to).
    """

    loss_sum: torch.Tensor = field(default_factory=lambda: torch.zeros(()))
    micro_batches: int = 0
    loss_transform: Callable[[torch.Tensor], torch.Tensor] | None = None
    judged_grad_norm: float | None = None
    drop_update: bool = False
    drop_reason: str | None = None
    grad_norm: float | torch.Tensor = math.nan
    lr: float = math.nan
    end_epoch_requested: bool = False

    def add_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Phase 2, per micro-batch: apply the fault transform to ``loss`` (0-dim), add it to the step's sum;
        return it."""
        if self.loss_transform is not None:
            loss = self.loss_transform(loss)
        self.loss_sum = self.loss_sum.to(loss.device) + loss.detach().float()
        self.micro_batches += 1
        return loss

    def mean_loss(self) -> torch.Tensor:
        """This rank's mean micro-batch loss over the running step so far (0-dim tensor)."""
        return self.loss_sum / max(1, self.micro_batches)

    def take_loss(self) -> torch.Tensor:
        """This rank's mean micro-batch loss over the step just finished; resets the sum (phase 6, metrics)."""
        mean = self.mean_loss()
        self.loss_sum = torch.zeros((), device=mean.device)
        self.micro_batches = 0
        return mean

    def drop(self, reason: str) -> None:
        """Drop the running step's update (phase 3, guard): the optimizer step and the LR schedule leave
        everything as it was."""
        self.drop_update, self.drop_reason = True, reason

    def end_step(self) -> None:
        """After the step's last phase: the next step's update is applied unless dropped again."""
        self.drop_update, self.drop_reason = False, None


_HOOKS = (
    "setup",
    "on_fit_start",
    "on_train_start",
    "on_train_epoch_start",
    "on_train_batch_start",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_before_zero_grad",
    "on_train_batch_end",
    "on_train_epoch_end",
    "on_train_end",
    "on_fit_end",
    "teardown",
    "on_exception",
    "on_save_checkpoint",
    "on_load_checkpoint",
)


class TrainStep(pl.Callback):
    """The one callback Lightning calls: runs each hook's parts in phase order (see the module docstring).

    Args:
        state: the rank's :class:`StepState` (the LightningModule's ``step_state``).
        parts: ``(phase, callback)`` pairs, phase one of :data:`PHASES`; within a phase, parts run
            in the order given. None callbacks are left out.

    Raises:
        ValueError: a phase not in :data:`PHASES`, or a part that keeps callback state
            (``state_dict``): Lightning would save it under this object's key, not the part's.
    """

    def __init__(self, state: StepState, parts: Iterable[tuple[str, pl.Callback | None]]) -> None:
        given = [(phase, cb) for phase, cb in parts if cb is not None]
        for phase, cb in given:
            if phase not in PHASES:
                raise ValueError(f"step part {type(cb).__name__}: phase {phase!r} is not one of {PHASES}")
            if type(cb).state_dict is not pl.Callback.state_dict:
                raise ValueError(f"step part {type(cb).__name__} keeps callback state; TrainStep does not save it")
        self.state = state
        self.parts: list[tuple[str, pl.Callback]] = sorted(given, key=lambda pc: PHASES.index(pc[0]))  # stable
        # Per hook, the parts that define it, in phase order.
        self._by_hook = {
            hook: [cb for _, cb in self.parts if getattr(type(cb), hook) is not getattr(pl.Callback, hook)]
            for hook in _HOOKS
        }

    def part(self, kind: type) -> Any:
        """The part of class ``kind`` (the first), or None."""
        return next((cb for _, cb in self.parts if isinstance(cb, kind)), None)

    def _each(self, hook: str, *args: Any) -> None:
        for cb in self._by_hook[hook]:
            getattr(cb, hook)(*args)

    # -- the run around the steps --------------------------------------------------------------
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Process group up (the timeline's rendezvous mark)."""
        self._each("setup", trainer, pl_module, stage)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._each("on_fit_start", trainer, pl_module)

    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """Resume: the checkpoint callback takes its RNG states; the timeline marks the load."""
        self._each("on_load_checkpoint", trainer, pl_module, checkpoint)

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """A save (inside phase 6, checkpoint): every rank's RNG states go into the state."""
        self._each("on_save_checkpoint", trainer, pl_module, checkpoint)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Before the first step: clocks and windows start, step 0 is validated, RNG states of a resume are restored."""
        self._each("on_train_start", trainer, pl_module)

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.state.end_epoch_requested = False  # a new epoch began (the old one may have ended by itself)
        self._each("on_train_epoch_start", trainer, pl_module)

    # -- one optimizer step ----------------------------------------------------------------------
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        """Phase 1, fetch: a micro-batch arrived."""
        self._each("on_train_batch_start", trainer, pl_module, batch, batch_idx)

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        """Phase 2: the forward is done, the backward begins."""
        self._each("on_before_backward", trainer, pl_module, loss)

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Phase 2: the backward (and the gradient reductions it waits for) ended."""
        self._each("on_after_backward", trainer, pl_module)

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        """Phase 3, guard: gradients complete, not clipped; the injector's, the guard's, then the breakdown's mark.

        The module's own hook runs next (Lightning: callbacks first) and records the step's norm and LR.
        """
        self._each("on_before_optimizer_step", trainer, pl_module, optimizer)

    def on_before_zero_grad(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self._each("on_before_zero_grad", trainer, pl_module, optimizer)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Phase 6, step end (on every micro-batch; the parts act when the step clock says the step closed)."""
        self._each("on_train_batch_end", trainer, pl_module, outputs, batch, batch_idx)
        self.state.end_step()

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._each("on_train_epoch_end", trainer, pl_module)

    # -- the end ---------------------------------------------------------------------------------
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """After the last step: summaries, final validation and save, the run's end record."""
        self._each("on_train_end", trainer, pl_module)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._each("on_fit_end", trainer, pl_module)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._each("teardown", trainer, pl_module, stage)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        """Training failed: stop watchdogs and counters, send what was written."""
        self._each("on_exception", trainer, pl_module, exception)
