"""``mem/activation_peak_bytes``: the most activation memory a rank held for backward.

A :class:`~framework.base.metrics.memory.SavedTensorMeter` counts the tensors autograd saves for
backward from ``on_train_batch_start`` to ``on_train_batch_end`` (the training forward and
backward of each micro-batch; a pipeline schedule runs all of a step's micro-batches inside one
batch). Parameters are model state and not counted; validation runs without autograd and saves
nothing. The peak is the largest live total in the logging window: under gradient accumulation
one micro-batch's graph (freed by its backward before the next forward), under a pipeline
schedule the micro-batches in flight on that stage (GPipe: all ``m``; 1F1B: up to ``p`` on the
first stage).

Logged on rank 0 at logging steps, max over ranks: ``mem/activation_peak_bytes`` (the window's
peak); at the end the run's largest. The model beside it is Korthikanti et al. 2022, Table 2
(see the cost model). Off under ``trainer.compile`` (compiled graphs save their own tensors).
"""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl
import torch

from framework.base.metrics.emit import MetricEmitter
from framework.base.metrics.memory import SavedTensorMeter
from framework.base.metrics.timing import comm_paused
from framework.rank.callbacks.clock import StepClock


class ActivationMemory(pl.Callback):
    """Peak bytes saved for backward per rank (see the module docstring).

    Args:
        clock: the run's step clock (whether a batch closed an optimizer step).
        log_every_n_steps: optimizer steps between logged points.
        emit: the run's metric emitter (writes on rank 0).
    """

    def __init__(self, *, clock: StepClock, log_every_n_steps: int, emit: MetricEmitter) -> None:
        self.clock = clock
        self.log_every = log_every_n_steps
        self.emit = emit
        self.meter = SavedTensorMeter()
        self._run_peak = 0.0

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self.meter.start()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.meter.stop()
        step = trainer.global_step
        if not self.clock.step_ended or not (step % self.log_every == 0 or step == trainer.max_steps):
            return  # inside gradient accumulation, or not a logging step
        peak = self._reduce_max(trainer, pl_module, self.meter.peak_bytes)
        self.meter.reset_peak()
        self._run_peak = max(self._run_peak, peak)
        self.emit({"mem/activation_peak_bytes": peak}, step)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.meter.stop()
        peak = max(self._run_peak, self._reduce_max(trainer, pl_module, self.meter.peak_bytes))
        self.emit({"mem/activation_peak_bytes": peak}, trainer.global_step)

    @staticmethod
    def _reduce_max(trainer: pl.Trainer, pl_module: pl.LightningModule, value: int) -> float:
        local = torch.tensor([float(value)], dtype=torch.float64, device=pl_module.device)
        with comm_paused():
            return float(trainer.strategy.reduce(local, reduce_op="max"))
