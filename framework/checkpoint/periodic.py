"""Save full training state every N optimizer steps, keep the newest K, and find the newest to resume.

A checkpoint is Lightning's full state (model, optimizer, LR scheduler, loop progress, and the
data module's position) in ``<dir>/step<NNNNNNNN>.ckpt``. It is written to a hidden temporary
file, flushed to disk and then renamed, so a save killed midway never leaves a file that
:func:`find_latest_checkpoint` would pick up.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Any

import pytorch_lightning as pl

from framework.callbacks.step_metrics import MetricSink

_NAME = re.compile(r"^step(\d{8})\.ckpt$")


def checkpoint_path(dirpath: str | Path, step: int) -> Path:
    """Path of the checkpoint taken after optimizer step ``step``."""
    return Path(dirpath) / f"step{step:08d}.ckpt"


def list_checkpoints(dirpath: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints in ``dirpath`` as ``(step, path)``, oldest first (temporary files ignored)."""
    d = Path(dirpath)
    if not d.is_dir():
        return []
    found = []
    for p in d.iterdir():
        m = _NAME.match(p.name)
        if m and p.is_file():
            found.append((int(m.group(1)), p))
    return sorted(found)


def find_latest_checkpoint(dirpath: str | Path) -> Path | None:
    """The newest complete checkpoint in ``dirpath``, or None."""
    found = list_checkpoints(dirpath)
    return found[-1][1] if found else None


class PeriodicCheckpoint(pl.Callback):
    """Every ``every_n_steps`` optimizer steps (and at the end if ``save_last``) save atomically.

    Args:
        dirpath: checkpoint folder (created on rank 0).
        every_n_steps: optimizer steps between saves; 0 = only at the end.
        keep_last_k: newest checkpoints to keep; older ones are deleted after a save.
        save_last: also save when training ends.
        sinks: called on rank 0 with ``ckpt/save_s`` (seconds the step was held) and ``ckpt/bytes``.
        on_time_spent: told the seconds each save took, to keep them out of throughput.
    """

    def __init__(
        self,
        *,
        dirpath: str,
        every_n_steps: int,
        keep_last_k: int,
        save_last: bool,
        sinks: list[MetricSink],
        on_time_spent=None,
    ) -> None:
        self.dirpath = Path(dirpath)
        self.every = every_n_steps
        self.keep = keep_last_k
        self.save_last = save_last
        self.sinks = sinks
        self.on_time_spent = on_time_spent
        self._last_saved = -1

    def _save(self, trainer: pl.Trainer) -> None:
        step = trainer.global_step
        if step == self._last_saved:
            return
        self._last_saved = step
        t0 = time.perf_counter()
        final = checkpoint_path(self.dirpath, step)
        tmp = final.with_name(f".{final.name}.tmp")
        if trainer.is_global_zero:
            self.dirpath.mkdir(parents=True, exist_ok=True)
        trainer.strategy.barrier("trainlab.ckpt.mkdir")
        trainer.save_checkpoint(tmp, weights_only=False)  # every rank calls; the strategy decides who writes
        if trainer.is_global_zero:
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            os.replace(tmp, final)
            dir_fd = os.open(self.dirpath, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
            for _, old in list_checkpoints(self.dirpath)[: -self.keep]:
                old.unlink(missing_ok=True)
        trainer.strategy.barrier("trainlab.ckpt.saved")
        seconds = time.perf_counter() - t0
        if self.on_time_spent is not None:
            self.on_time_spent(seconds)
        if trainer.is_global_zero:
            for sink in self.sinks:
                sink({"ckpt/save_s": seconds, "ckpt/bytes": float(final.stat().st_size)}, step)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last_saved = trainer.global_step  # a resumed run does not re-save its starting step

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if self.every > 0 and step > 0 and step % self.every == 0:
            self._save(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.save_last and trainer.global_step > 0:
            self._save(trainer)
