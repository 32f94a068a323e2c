"""The fault injector: a Lightning callback that makes the scheduled faults happen on purpose.

Each event fires once on each of its ranks, in optimizer step ``step`` (1-based): the rank
appends an ``injected`` record to the fault log (fsync'd) *before* the fault acts, and skips
every event already in the log, so a step replayed after a restart or rollback runs clean.

What each kind does is its own module in :mod:`framework.base.faults.kinds` (the registry): the
injector calls the kind's ``start`` when the event fires and, while the returned
:class:`~framework.base.faults.kinds.Acting` lasts, its ``on_batch`` on every micro-batch and its
``before_optimizer_step`` after the gradient sync. A loss transform a kind sets
(``StepState.loss_transform``, :mod:`framework.rank.step`) lasts for the event's step.
"""

from __future__ import annotations

import sys
from typing import Any

import pytorch_lightning as pl

from framework.base.faults.events import FaultLog
from framework.base.faults.kinds import Acting, FaultContext, get_fault_kind


class FaultInjector(pl.Callback):
    """Fires this rank's events of ``schedule`` (see :func:`framework.base.faults.schedule.build_schedule`).

    Args:
        schedule: the run's events (dicts with id, kind, step, ranks, factor, delay_s, duration_steps).
        rank: this process's global rank.
        log: the run's fault log.
        checkpoint_dir: where ``ckpt_corrupt`` looks for the newest checkpoint.
    """

    def __init__(self, *, schedule: list[dict[str, Any]], rank: int, log: FaultLog, checkpoint_dir: str) -> None:
        self.mine = [e for e in schedule if rank in e["ranks"]]
        self.rank = rank
        self.fault_log = log
        self.checkpoint_dir = checkpoint_dir
        self.fired = log.fired_ids()
        self._step = -1  # the optimizer step whose micro-batches are running
        self._acting: list[Acting] = []  # faults still acting in this step

    def _ctx(self, trainer: pl.Trainer, pl_module: Any) -> FaultContext:
        return FaultContext(
            step=self._step, rank=self.rank, trainer=trainer, module=pl_module, checkpoint_dir=self.checkpoint_dir
        )

    def _fire(self, e: dict[str, Any], step: int) -> None:
        self.fired.add(f"{e['id']}@{self.rank}")
        self.fault_log.append("injected", id=e["id"], kind=e["kind"], step=step, rank=self.rank)
        print(f"trainlab: fault: injecting {e['kind']} on rank {self.rank} in step {step}", file=sys.stderr, flush=True)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        state = pl_module.step_state
        if state.end_epoch_requested:
            return  # a batch dropped by a rollback: it does not run
        step = trainer.global_step + 1
        if step != self._step:  # first micro-batch of a step
            self._step = step
            self._acting = [a for a in self._acting if a.last_step >= step]
            pl_module.step_state.loss_transform = None
            for e in self.mine:
                if e["step"] == step and f"{e['id']}@{self.rank}" not in self.fired:
                    self._fire(e, step)
                    acting = get_fault_kind(e["kind"]).start(e, self._ctx(trainer, pl_module))
                    if acting is not None:
                        self._acting.append(acting)
        for a in self._acting:
            a.on_batch(self._ctx(trainer, pl_module), batch)

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        for a in self._acting:
            a.before_optimizer_step(self._ctx(trainer, pl_module))

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step == self._step:  # the step is done: faults acting only in it stop
            pl_module.step_state.loss_transform = None
            self._acting = [a for a in self._acting if a.last_step > self._step]
