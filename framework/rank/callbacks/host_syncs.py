"""``perf/host_syncs``: host-device synchronisations per optimizer step (``trainer.count_host_syncs=true``).

Counts, on every rank, the calls that make the host wait for the device
(:mod:`framework.rank.metrics.syncs`: ``.item()``, ``.tolist()``, ``.cpu()``, ``bool()``/``float()``/
``int()`` of a tensor ...; on CUDA the syncs the runtime reports) between the start of one
optimizer step's first batch and the next's: the forward/backward of every micro-batch, the
optimizer step, every callback's work at the step's end (logging, validation, checkpointing)
and fetching the next batch. Rank 0 logs ``perf/host_syncs`` for every step and writes
``host_syncs.json`` (per step: the count and the call sites) in the run folder, and prints the
call sites of the steps that are neither logging nor validation steps (there should be none).

A diagnostic: the counting mode costs a Python call per torch operation while on, so the
run's timings are not representative (leave it off for timed runs).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytorch_lightning as pl

from framework.base.metrics.emit import MetricEmitter
from framework.rank.metrics.syncs import CudaSyncCounter, HostSyncCounter, summarize


class HostSyncs(pl.Callback):
    """Host-device syncs per optimizer step (see the module docstring); put it first among the callbacks.

    Args:
        log_every_n_steps, val_every_n_steps: the run's logging and validation intervals (for the report).
        emit: the run's metric emitter (writes on rank 0).
        out_dir: where rank 0 writes ``host_syncs.json`` (None: nowhere).
        cuda: count with the CUDA runtime's sync reports instead of the function mode.
    """

    def __init__(
        self,
        *,
        log_every_n_steps: int,
        val_every_n_steps: int,
        emit: MetricEmitter,
        out_dir: Path | None,
        cuda: bool = False,
    ) -> None:
        self.log_every, self.val_every = log_every_n_steps, val_every_n_steps
        self.emit = emit
        self.out_dir = out_dir
        self.counter = CudaSyncCounter() if cuda else HostSyncCounter()
        self.per_step: dict[int, list[tuple[str, str]]] = {}
        self._step: int | None = None  # the optimizer step the open window belongs to

    def _close(self, trainer: pl.Trainer) -> None:
        self.counter.stop()
        if self._step is None:
            return
        records = self.counter.take()
        self.per_step.setdefault(self._step, []).extend(records)
        if trainer.global_step >= self._step:  # the step is complete
            self.emit({"perf/host_syncs": float(len(self.per_step[self._step]))}, self._step)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step + 1
        if step != self._step:
            self._close(trainer)
            self._step = step
        self.counter.start()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._close(trainer)
        self._step = None
        if not trainer.is_global_zero:
            return
        quiet = {
            s: r
            for s, r in self.per_step.items()
            if s % self.log_every and s % self.val_every and s != trainer.max_steps
        }
        busy = [r for recs in quiet.values() for r in recs]
        print(
            f"trainlab: host syncs per step {[len(self.per_step[s]) for s in sorted(self.per_step)]};"
            f" on steps without logging or validation: {len(busy)}" + (f" ({summarize(busy)})" if busy else ""),
            flush=True,
        )
        if self.out_dir is not None:
            doc = {
                str(s): {"count": len(r), "sites": {f"{k} at {site}": n for (k, site), n in Counter(r).items()}}
                for s, r in sorted(self.per_step.items())
            }
            (self.out_dir / "host_syncs.json").write_text(json.dumps(doc, indent=1))

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.counter.stop()
