"""Per-optimizer-step metrics: loss, LR, grad norm, step counters, step time, tokens/s and MFU, the layout in force
(``elastic/world_size``, ``elastic/dp_degree``, ``elastic/grad_accum_steps``), plus a progress bar.

Step ends, the steps since a (re)start and the seconds spent outside training (validation,
checkpoint blocking) come from the run's :class:`~framework.rank.callbacks.clock.StepClock`.
``perf/step_time_s`` is the wall time between consecutive step ends less those seconds, so it
contains data wait, forward/backward, communication and the optimizer. On CUDA the device is synchronised
only at logging steps, so the window average is exact without stalling every step.

The first ``trainer.warmup_steps_excluded`` steps after every (re)start are left out of the
throughput and MFU figures (allocator warm-up, first-touch of data, lazy initialisation).

MFU follows PaLM §4.1: ``tokens_per_sec * flops_per_token / (num_devices * peak_flops)``.
HFU is the same ratio with the FLOPs the hardware runs, recomputation included
(``GPT.hardware_flops_per_token``): ``perf/hfu == perf/mfu`` unless
``model.activation_checkpointing`` is on. A value above 1 is a calibration error of the peak,
not a figure: it is not logged, and ``calibration_error`` holds the achieved FLOP/s per device
(the worker then measures the peak again, :func:`framework.base.metrics.flops.recalibrate`).
"""

from __future__ import annotations

import time
from typing import Any

import pytorch_lightning as pl
import torch

from framework.base.metrics.emit import MetricEmitter
from framework.base.metrics.flops import check_mfu, hfu, mfu
from framework.rank.callbacks.clock import StepClock


class StepMetrics(pl.Callback):
    """Computes step metrics on every rank (the loss reduction is collective) and logs on rank 0.

    Args:
        clock: the run's step clock (step ends, warm-up, excluded seconds).
        tokens_per_step: ``global_batch_size * seq_len`` (tokens).
        flops_per_token: model FLOPs per token (6N + 12·L·h·s, PaLM App. B).
        peak_flops: peak FLOP/s of one device.
        num_devices: devices the run uses (world size).
        log_every_n_steps: optimizer steps between logged points.
        warmup_steps_excluded: steps after a (re)start left out of throughput.
        emit: the run's metric emitter (writes on rank 0: MLflow, JSONL file).
        progress_bar: show a tqdm bar on rank 0.
        hardware_flops_per_token: FLOPs per token the hardware runs (recompute included);
            None = ``flops_per_token`` (no activation recomputation).
        dp_degree: data-parallel degree of this launch (``elastic/dp_degree``).
        grad_accum_steps: micro-batches per optimizer step per rank of this launch
            (``elastic/grad_accum_steps``); with ``num_devices`` (``elastic/world_size``) logged at
            every logged step, so a shrink shows in the history at the step it took effect.
    """

    def __init__(
        self,
        *,
        clock: StepClock,
        tokens_per_step: int,
        flops_per_token: float,
        peak_flops: float,
        num_devices: int,
        log_every_n_steps: int,
        warmup_steps_excluded: int,
        emit: MetricEmitter,
        progress_bar: bool = True,
        hardware_flops_per_token: float | None = None,
        dp_degree: int = 1,
        grad_accum_steps: int = 1,
    ) -> None:
        self.clock = clock
        self.tokens_per_step = tokens_per_step
        self.flops_per_token = flops_per_token
        self.hw_flops_per_token = flops_per_token if hardware_flops_per_token is None else hardware_flops_per_token
        self.peak_flops = peak_flops
        self.num_devices = num_devices
        self.log_every = log_every_n_steps
        self.warmup = warmup_steps_excluded
        self.emit = emit
        self.show_bar = progress_bar
        self._bar = None
        # Periods are (start time, clock.excluded_s at the start): elapsed = now - t0 - excluded since.
        self._window_t0: float | None = None
        self._window_excl = 0.0
        self._window_steps = 0
        self._timed_t0: float | None = None  # start of the post-warm-up period
        self._timed_excl = 0.0
        self._timed_steps = 0
        self.last_loss = float("nan")
        self.summary: dict[str, float] = {}
        self.calibration_error: float | None = None  # achieved FLOP/s per device above the peak (MFU > 1), if any
        self.elastic = {
            "elastic/world_size": float(num_devices),
            "elastic/dp_degree": float(dp_degree),
            "elastic/grad_accum_steps": float(grad_accum_steps),
        }

    # -- helpers -------------------------------------------------------------------------
    def _sync(self, pl_module: pl.LightningModule) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)

    def _utilization(self, tps: float, prefix: str, suffix: str = "") -> dict[str, float]:
        """``{prefix}mfu{suffix}`` and ``{prefix}hfu{suffix}`` at ``tps`` tokens/s (whole job)."""
        common = {"tokens_per_sec": tps, "num_devices": self.num_devices, "peak_flops_per_device": self.peak_flops}
        out = {
            f"{prefix}mfu{suffix}": mfu(flops_per_token=self.flops_per_token, **common),
            f"{prefix}hfu{suffix}": hfu(hardware_flops_per_token=self.hw_flops_per_token, **common),
        }
        if all(check_mfu(v) for v in out.values()):
            return out
        achieved = tps * self.hw_flops_per_token / self.num_devices  # FLOP/s per device, above the peak
        self.calibration_error = max(self.calibration_error or 0.0, achieved)
        return {}

    def _elapsed(self, now: float, t0: float, excl0: float) -> float:
        """Training seconds from ``t0`` to ``now``: wall time less what the clock excluded since ``excl0``."""
        return now - t0 - (self.clock.excluded_s - excl0)

    def _start_periods(self) -> None:
        self._timed_t0 = self._window_t0 = time.perf_counter()
        self._timed_excl = self._window_excl = self.clock.excluded_s

    # -- hooks ---------------------------------------------------------------------------
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.warmup == 0:
            self._sync(pl_module)
            self._start_periods()
        if self.show_bar and trainer.is_global_zero:
            import sys

            from tqdm.auto import tqdm

            # In a log file (not a terminal) redraw rarely instead of on every step.
            self._bar = tqdm(
                total=trainer.max_steps,
                initial=trainer.global_step,
                desc="train",
                unit="step",
                dynamic_ncols=True,
                mininterval=0.1 if sys.stderr.isatty() else 30.0,
            )

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self.clock.step_ended:
            return  # inside gradient accumulation
        step = trainer.global_step
        state = pl_module.step_state
        local_loss = state.take_loss()
        steps_since_start = self.clock.steps_since_start
        if self.warmup > 0 and steps_since_start == self.warmup:
            self._sync(pl_module)
            self._start_periods()
            self._timed_steps = self._window_steps = 0
        elif steps_since_start > self.warmup:
            self._timed_steps += 1
            self._window_steps += 1
        is_log_step = step % self.log_every == 0 or step == trainer.max_steps
        if not is_log_step:
            if self._bar is not None:
                self._bar.update(1)
            return
        loss = trainer.strategy.reduce(local_loss, reduce_op="mean")
        self.last_loss = float(loss)
        self._sync(pl_module)
        now = time.perf_counter()
        metrics = {
            "train/loss": self.last_loss,
            "train/lr": state.lr,
            "train/grad_norm": float(state.grad_norm),
            # Both counters: a dropped update (fault guard) counts as attempted, not applied.
            "train/steps_attempted": float(step),
            "train/optimizer_updates": float(pl_module.optimizer_updates),
            **self.elastic,
        }
        if self._window_t0 is not None and self._window_steps > 0:
            step_time = self._elapsed(now, self._window_t0, self._window_excl) / self._window_steps
            tps = self.tokens_per_step / step_time
            metrics.update(
                {
                    "perf/step_time_s": step_time,
                    "perf/tokens_per_sec": tps,
                    "perf/tokens_per_sec_per_rank": tps / self.num_devices,
                    **self._utilization(tps, "perf/"),
                }
            )
            self._window_t0, self._window_excl, self._window_steps = now, self.clock.excluded_s, 0
        self.emit(metrics, step)
        if self._bar is not None:
            self._bar.set_postfix(
                loss=f"{self.last_loss:.3f}",
                tok_s=f"{metrics.get('perf/tokens_per_sec', float('nan')):,.0f}",
                refresh=False,
            )
            self._bar.update(1)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._bar is not None:
            self._bar.close()
        self._sync(pl_module)
        summary = {"train/loss_final": self.last_loss, "train/steps": float(trainer.global_step)}
        if self._timed_t0 is not None and self._timed_steps > 0:
            elapsed = self._elapsed(time.perf_counter(), self._timed_t0, self._timed_excl)
            tps = self.tokens_per_step * self._timed_steps / elapsed
            summary["perf/tokens_per_sec_mean"] = tps
            summary["perf/tokens_per_sec_per_rank_mean"] = tps / self.num_devices
            summary["perf/step_time_s_mean"] = elapsed / self._timed_steps
            summary.update(self._utilization(tps, "perf/", "_mean"))
        self.summary = summary
        self.emit(summary, trainer.global_step)
