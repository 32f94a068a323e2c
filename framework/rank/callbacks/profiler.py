"""A ``torch.profiler`` trace of optimizer steps ``[a, b]`` (``trainer.profile_steps``).

Optimizer steps are numbered as the metrics are (step ``k`` is the k-th optimizer step). The
profiler starts at the first micro-batch of step ``a`` and stops after step ``b``, on every
rank; each rank writes a Chrome trace (open in ``chrome://tracing`` or https://ui.perfetto.dev)
to ``<run_dir>/profile/rank<r>-steps<a>-<b>.json``, and the driver logs the ``profile/``
folder as MLflow artifacts when the run ends. CPU activity always, CUDA kernels on GPUs.
The profiled steps are slower than the others (the profiler's own overhead); their timings
stay in the step metrics.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch


class StepProfiler(pl.Callback):
    """Profiles optimizer steps ``first..last`` (inclusive, 1-based) into a Chrome trace per rank.

    Args:
        first, last: the optimizer steps to profile (``1 <= first <= last``).
        out_dir: folder for the traces (created).
    """

    def __init__(self, *, first: int, last: int, out_dir: str | Path) -> None:
        if not 1 <= first <= last:
            raise ValueError(f"profile steps [{first}, {last}] must satisfy 1 <= first <= last")
        self.first, self.last = first, last
        self.out_dir = Path(out_dir)
        self._prof: torch.profiler.profile | None = None
        self.trace_path: Path | None = None

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        # global_step counts finished optimizer steps: step ``first`` begins once first - 1 are done.
        if self._prof is None and self.trace_path is None and trainer.global_step == self.first - 1:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if pl_module.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._prof = torch.profiler.profile(activities=activities, record_shapes=True)
            self._prof.start()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._prof is not None and trainer.global_step >= self.last:
            self._finish(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._prof is not None:  # training ended inside the window
            self._finish(trainer)

    def _finish(self, trainer: pl.Trainer) -> None:
        self._prof.stop()
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.trace_path = self.out_dir / f"rank{trainer.global_rank}-steps{self.first}-{self.last}.json"
        self._prof.export_chrome_trace(str(self.trace_path))
        self._prof = None
