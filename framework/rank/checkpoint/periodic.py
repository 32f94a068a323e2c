"""When to save, what trainlab adds to Lightning's state (per-rank RNG), and the ``ckpt/`` metrics.

A save is ``trainer.save_checkpoint(<dir>/step%08d)``: Lightning collects the state on every
rank and the strategy hands it to :class:`~framework.base.checkpoint.io.FolderCheckpointIO`, which
writes the folder (synchronously or in the background). This callback

- saves after every ``every_n_steps``-th optimizer step and at the end (``save_last``); it runs
  in the step's ``checkpoint`` phase (:mod:`framework.rank.step`), after the metric and fault parts,
  so that a save sees the state after everything else of that step;
- adds every rank's RNG states (python, numpy, torch CPU/CUDA) to the state, and restores this
  rank's on resume at ``on_train_start`` (at another world size see
  :mod:`framework.rank.checkpoint.reshard`): the data loader's iterator (which draws one number
  from torch's RNG when it is created) exists by then, so the RNGs continue exactly where the
  saved run was at the end of the saved step;
- deletes temporary folders of saves that a kill interrupted (rank 0, before training);
- logs on rank 0 ``ckpt/blocking_s`` (seconds the step was held), ``ckpt/interval_steps`` (steps
  since the previous save), and per finished save ``ckpt/save_s`` (call to renamed folder),
  ``ckpt/bytes`` and, for deltas, ``ckpt/delta_ratio``; a failed background save is a warning
  on stderr naming the step and the error.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch.distributed as dist

from framework.base.checkpoint.format import checkpoint_name, remove_partial
from framework.base.checkpoint.io import FolderCheckpointIO
from framework.base.metrics.emit import MetricEmitter
from framework.rank.checkpoint.reshard import rescale_batch_progress, rng_state_for_rank
from framework.rank.checkpoint.rng import capture_rng_state, restore_rng_state

STATE_KEY = "trainlab"  # top-level key of trainlab's own entries in the checkpoint dict


class PeriodicCheckpoint(pl.Callback):
    """Save every ``every_n_steps`` optimizer steps (and at the end if ``save_last``) through ``io``.

    Args:
        dirpath: checkpoint folder.
        io: the Trainer's checkpoint plugin (its results feed the metrics).
        every_n_steps: optimizer steps between saves; 0 = only at the end.
        save_last: also save when training ends.
        emit: the run's metric emitter (the ``ckpt/`` metrics; writes on rank 0).
        on_time_spent: told the seconds each save held the step, to keep them out of throughput.
        before_save: called right before each save (not timed as part of it), e.g. to send the
            step's buffered metrics first: a kill after the save then loses no metric of a step
            the run will not replay.
    """

    def __init__(
        self,
        *,
        dirpath: str,
        io: FolderCheckpointIO,
        every_n_steps: int,
        save_last: bool,
        emit: MetricEmitter,
        on_time_spent: Callable[[float], None] | None = None,
        before_save: Callable[[], None] | None = None,
    ) -> None:
        self.dirpath = Path(dirpath)
        self.io = io
        self.every = every_n_steps
        self.save_last = save_last
        self.emit = emit
        self.on_time_spent = on_time_spent
        self.before_save = before_save
        self._last_saved = -1
        self._pending_rng: dict[str, Any] | None = None

    # -- RNG state in and out of the checkpoint -----------------------------------------------
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        mine = capture_rng_state()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            per_rank: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(per_rank, mine)
        else:
            per_rank = [mine]
        # the layout the state was saved under, for a resume at another world size (framework.rank.checkpoint.reshard)
        checkpoint[STATE_KEY] = {
            "rng": per_rank,
            "world_size": trainer.world_size,
            "batches_per_step": trainer.accumulate_grad_batches,
        }

    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        ours = checkpoint.get(STATE_KEY, {})
        self._pending_rng, warning = rng_state_for_rank(ours.get("rng", []), trainer.global_rank, trainer.world_size)
        if warning and trainer.is_global_zero:
            print(f"trainlab: warning: {warning}", file=sys.stderr, flush=True)
        # Another data-parallel degree at the same global batch: Lightning's micro-batch counter follows.
        rescale_batch_progress(checkpoint, trainer.accumulate_grad_batches, ours.get("batches_per_step"))

    # -- hooks --------------------------------------------------------------------------------
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last_saved = trainer.global_step  # a resumed run does not re-save its starting step
        if self._pending_rng is not None:
            restore_rng_state(self._pending_rng)
            self._pending_rng = None
        if trainer.is_global_zero:
            for p in remove_partial(self.dirpath):
                print(f"trainlab: removed unfinished checkpoint {p}", file=sys.stderr, flush=True)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if self.every > 0 and step > 0 and step % self.every == 0:
            self.save(trainer)
        else:
            self._report(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.save_last and trainer.global_step > 0:
            self.save(trainer)
        self.io.wait()
        self._report(trainer)

    # -- saving and metrics ---------------------------------------------------------------------
    def save(self, trainer: pl.Trainer) -> None:
        """Save the current optimizer step on every rank (a collective; call it at a step's end), unless
        it is saved already; also :class:`~framework.rank.callbacks.preemption.Preemption`'s save."""
        step = trainer.global_step
        if step == self._last_saved:
            return
        interval = step - self._last_saved
        self._last_saved = step
        if self.before_save is not None:
            self.before_save()
        t0 = time.perf_counter()
        trainer.save_checkpoint(self.dirpath / checkpoint_name(step))  # every rank; ends with a barrier
        blocking = time.perf_counter() - t0
        if self.on_time_spent is not None:
            self.on_time_spent(blocking)
        self.emit({"ckpt/blocking_s": blocking, "ckpt/interval_steps": float(interval)}, step)
        self._report(trainer)

    def _report(self, trainer: pl.Trainer) -> None:
        for r in self.io.pop_results():  # only rank 0 writes, so only rank 0 has results
            if r.error is not None:
                print(
                    f"trainlab: warning: checkpoint save of step {r.step} failed: {r.error}"
                    " (no partial checkpoint is left; the previous complete one stays)",
                    file=sys.stderr,
                    flush=True,
                )
                continue
            metrics = {"ckpt/save_s": r.save_s, "ckpt/bytes": float(r.bytes)}
            if r.delta_ratio is not None:
                metrics["ckpt/delta_ratio"] = r.delta_ratio
            self.emit(metrics, r.step)
