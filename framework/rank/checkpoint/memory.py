"""In-RAM snapshots of the last good state, for rollback without touching the disk.

Every ``every_n_steps`` optimizer steps each rank copies its model, optimizer and LR-scheduler
state and its RNG states into CPU memory (one snapshot, replaced each time). ``restore`` puts
them back in place, bit for bit. It does not rewind Lightning's step counter or the data
position: after a rollback, whether to replay the same batches or skip past a bad one is the
caller's decision (the fault-tolerance policy).
"""

from __future__ import annotations

import time
from typing import Any

import pytorch_lightning as pl

from framework.base.checkpoint.io import cpu_copy
from framework.rank.checkpoint.rng import capture_rng_state, restore_rng_state


class MemorySnapshot(pl.Callback):
    """Keep a CPU copy of the training state taken after every ``every_n_steps``-th optimizer step.

    Attributes:
        step: optimizer step of the snapshot held, or None before the first one.
        last_copy_s: seconds the last snapshot held the training step.
    """

    def __init__(self, *, every_n_steps: int) -> None:
        self.every = every_n_steps
        self.step: int | None = None
        self.last_copy_s = 0.0
        self._state: dict[str, Any] | None = None

    def take(self, trainer: pl.Trainer) -> None:
        """Replace the snapshot with the current state of this rank."""
        t0 = time.perf_counter()
        self._state = cpu_copy(
            {
                "model": trainer.lightning_module.state_dict(),
                "optimizers": [opt.state_dict() for opt in trainer.optimizers],
                "schedulers": [cfg.scheduler.state_dict() for cfg in trainer.lr_scheduler_configs],
                "rng": capture_rng_state(),
            }
        )
        self.step = trainer.global_step
        self.last_copy_s = time.perf_counter() - t0

    def restore(self, trainer: pl.Trainer) -> int:
        """Put the snapshot's model, optimizer, scheduler and RNG states back in place; return its step.

        The snapshot is kept, so it can be restored again.

        Raises:
            RuntimeError: no snapshot has been taken yet.
        """
        if self._state is None:
            raise RuntimeError(
                "no in-memory snapshot to restore yet (checkpoint.memory_every_n_steps steps have not passed)"
            )
        # Fresh tensors: Optimizer.load_state_dict keeps same-device tensors as they are, so the
        # optimizer would otherwise update the snapshot itself in its next step.
        state = cpu_copy(self._state)
        trainer.lightning_module.load_state_dict(state["model"])
        for opt, s in zip(trainer.optimizers, state["optimizers"]):
            opt.load_state_dict(s)
        for cfg, s in zip(trainer.lr_scheduler_configs, state["schedulers"]):
            cfg.scheduler.load_state_dict(s)
        restore_rng_state(state["rng"])
        return self.step

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if step > 0 and step % self.every == 0 and step != self.step:
            self.take(trainer)
