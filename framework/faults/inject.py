"""The fault injector: a Lightning callback that makes the scheduled faults happen on purpose.

Each event fires once on each of its ranks, in optimizer step ``step`` (1-based): the rank
appends an ``injected`` record to the fault log (fsync'd) *before* the fault acts, and skips
every event already in the log, so a step replayed after a restart or rollback runs clean.

What each kind does on the faulty ranks:

- ``nan_grad``: after backward (gradients already all-reduced), this rank's gradients become
  NaN, as after an ECC error in the optimizer's input.
- ``inf_loss`` / ``loss_spike``: the step's micro-batch losses are multiplied by ``inf`` /
  ``factor`` (through ``StepState.loss_transform``, :mod:`framework.step`), so the logged loss
  and the gradients show it.
- ``bad_batch``: the step's input and target tokens are replaced by uniform random tokens.
- ``rank_crash``: the process SIGKILLs itself (no Python cleanup, like a machine failure).
- ``hang``: the rank sleeps ``delay_s`` inside the step (its peers block in the next collective).
- ``slow_rank``: the rank sleeps ``delay_s`` in each of ``duration_steps`` steps, after the
  gradient sync (a straggler in its optimizer phase).
- ``ckpt_corrupt``: a byte in the middle of the newest complete checkpoint's ``state.pt`` is flipped.
- ``ckpt_write_error``: the next checkpoint write fails with ``OSError(ENOSPC)`` where the file
  would be written (:func:`framework.checkpoint.format.write_checkpoint` as called by the
  checkpoint IO), leaving no partial folder.
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch

from framework.faults.events import FaultLog


def corrupt_newest_checkpoint(checkpoint_dir: str | Path) -> Path | None:
    """Flip one byte in the middle of the newest complete checkpoint's ``state.pt``; return its folder."""
    from framework.checkpoint.format import STATE_FILE, list_checkpoints

    found = list_checkpoints(checkpoint_dir)
    if not found:
        return None
    folder = found[-1][1]
    path = folder / STATE_FILE
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x5A]))
        f.flush()
        os.fsync(f.fileno())
    return folder


def arm_checkpoint_write_error() -> None:
    """Make the next checkpoint write of this process fail with ``OSError(ENOSPC)`` (one shot)."""
    import framework.checkpoint.io as ckio

    original = ckio.write_checkpoint

    def failing(*args: Any, **kwargs: Any) -> Path:
        ckio.write_checkpoint = original
        raise OSError(errno.ENOSPC, "injected checkpoint write error (fault kind ckpt_write_error)")

    ckio.write_checkpoint = failing


class FaultInjector(pl.Callback):
    """Fires this rank's events of ``schedule`` (see :func:`framework.faults.schedule.build_schedule`).

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
        self._active: list[dict[str, Any]] = []  # events acting in this step
        self._slow_until = 0
        self._slow_s = 0.0
        self._slept_step = -1

    def _fire(self, e: dict[str, Any], step: int) -> None:
        self.fired.add(f"{e['id']}@{self.rank}")
        self.fault_log.append("injected", id=e["id"], kind=e["kind"], step=step, rank=self.rank)
        print(f"trainlab: fault: injecting {e['kind']} on rank {self.rank} in step {step}", file=sys.stderr, flush=True)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        state = pl_module.step_state
        if state.end_epoch_requested:
            return  # a batch dropped by a rollback: it does not run
        step = trainer.global_step + 1
        if step != self._step:  # first micro-batch of a step
            self._step = step
            self._active = []
            state.loss_transform = None
            for e in self.mine:
                if e["step"] == step and f"{e['id']}@{self.rank}" not in self.fired:
                    self._fire(e, step)
                    self._start(e, trainer, pl_module)
        for e in self._active:
            if e["kind"] == "bad_batch":
                gen = torch.Generator().manual_seed(step * 1000 + self.rank)
                for t in batch[:2]:  # x and y: [micro_batch_size, seq_len] token ids, replaced in place (not n)
                    t.copy_(torch.randint(0, pl_module.vocab_size, t.shape, generator=gen).to(t.device))

    def _start(self, e: dict[str, Any], trainer: pl.Trainer, pl_module: Any) -> None:
        kind = e["kind"]
        if kind == "rank_crash":
            os.kill(os.getpid(), signal.SIGKILL)
        elif kind == "hang":
            time.sleep(e["delay_s"])  # the watchdog ends this
        elif kind == "slow_rank":
            self._slow_until, self._slow_s = e["step"] + e["duration_steps"] - 1, e["delay_s"]
        elif kind == "loss_spike":
            factor = e["factor"]
            pl_module.step_state.loss_transform = lambda loss: loss * factor
        elif kind == "inf_loss":
            pl_module.step_state.loss_transform = lambda loss: loss * float("inf")
        elif kind == "ckpt_corrupt":
            folder = corrupt_newest_checkpoint(self.checkpoint_dir)
            print(f"trainlab: fault: corrupted {folder}", file=sys.stderr, flush=True)
        elif kind == "ckpt_write_error":
            arm_checkpoint_write_error()
        if kind in ("nan_grad", "bad_batch"):
            self._active.append(e)

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        # The straggler's extra time sits after the gradient sync (a slow optimizer phase or host), before
        # the step's health check: earlier, every sync point would make all ranks wait alike.
        if self._step <= self._slow_until and self._slept_step != self._step:
            self._slept_step = self._step
            time.sleep(self._slow_s)
        if any(e["kind"] == "nan_grad" for e in self._active):
            for p in pl_module.parameters():
                if p.grad is not None:
                    p.grad.fill_(float("nan"))

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self._step:  # the step is done: its faults stop acting
            pl_module.step_state.loss_transform = None
            self._active = []
