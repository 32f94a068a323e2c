"""``PipelineBubble``: measured vs modelled pipeline idle fraction, logged with the step metrics.

At each logging step every rank turns its pipeline runner's per-step ``(busy_s, wall_s)``
records (after the warm-up steps) into an idle fraction ``1 - sum(busy) / sum(wall)``; the
ranks' figures are averaged (and their maximum taken) over the whole job, and rank 0 logs
``perf/pp_bubble_frac`` (mean over ranks), ``perf/pp_bubble_frac_max`` and the model
``perf/pp_bubble_frac_model`` = ``(p-1)/(v·m+p-1)`` (Narayanan et al. 2021 §2.2).
"""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl
import torch

from framework.base.cost.bubble import pp_bubble_fraction


class PipelineBubble(pl.Callback):
    """Args: ``runner`` getter (the rank's PipelineRunner once built), degrees, cadence and the run's metric emitter."""

    def __init__(
        self,
        *,
        runner: Any,
        pp: int,
        n_microbatches: int,
        virtual_stages: int,
        log_every_n_steps: int,
        warmup_steps_excluded: int,
        emit: Any,
    ) -> None:
        self.runner = runner
        self.model = pp_bubble_fraction(pp=pp, n_microbatches=n_microbatches, virtual_stages=virtual_stages)
        self.log_every = log_every_n_steps
        self.warmup = warmup_steps_excluded
        self.emit = emit
        self._busy = self._wall = 0.0
        self._start_step = 0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start_step = trainer.global_step

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        runner = self.runner()
        recs = runner.take_step_records()
        if step - self._start_step > self.warmup:
            for busy, wall in recs:
                self._busy += busy
                self._wall += wall
        if not (step % self.log_every == 0 or step == trainer.max_steps):
            return
        idle = 1.0 - self._busy / self._wall if self._wall > 0 else float("nan")
        local = torch.tensor([idle], dtype=torch.float64, device=pl_module.device)
        mean = float(trainer.strategy.reduce(local.clone(), reduce_op="mean"))
        top = float(trainer.strategy.reduce(local.clone(), reduce_op="max"))
        self._busy = self._wall = 0.0
        if idle == idle:  # the emitter writes on rank 0 only
            self.emit(
                {"perf/pp_bubble_frac": mean, "perf/pp_bubble_frac_max": top, "perf/pp_bubble_frac_model": self.model},
                step,
            )
