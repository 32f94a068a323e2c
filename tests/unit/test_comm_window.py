"""The framework's comm-meter window (framework/rank/callbacks/breakdown.py) on a one-process Lightning run.

A stand-in plugin reports a collective on *every* forward of the model (training and
evaluation), one in every optimizer step, and, like a wrapper of a process-wide function, every
call of the framework's own reductions (another callback's, after the backward and at the end
of each batch); only the training ones may count: validation passes run inside the logged
steps, and their forwards must be dropped, as must the framework's reductions.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytorch_lightning as pl
import torch

from framework.base.cost.comm import CommEstimate
from framework.base.layout import ParallelLayout
from framework.base.metrics.emit import MetricEmitter
from framework.base.plugin import ParallelPlugin
from framework.rank.callbacks.breakdown import StepBreakdown
from framework.rank.callbacks.clock import StepClock
from framework.rank.callbacks.validation import ValidationLoss

ACCUM = 2  # micro-batches per optimizer step


class _Module(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.model(x), y)

    @torch.no_grad()
    def eval_loss_sum(self, batches):
        acc = torch.zeros(2)
        for x, y in batches:
            acc += torch.stack([torch.nn.functional.mse_loss(self.model(x), y) * len(x), torch.tensor(float(len(x)))])
        return acc

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _Data(pl.LightningDataModule):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(list(zip(self.x, self.y)), batch_size=4)

    def val_dataloader(self):
        return torch.utils.data.DataLoader(list(zip(self.x[:8], self.y[:8])), batch_size=2)  # 4 evaluation forwards


class _EveryForwardPlugin(ParallelPlugin):
    """Reports 10 bytes per forward (training or not) and 1 byte per optimizer step, unconditionally."""

    name = "every_forward"

    def __init__(self) -> None:
        super().__init__(cfg=None)

    def comm_volume(self, stats, resolved):
        return CommEstimate(
            payload_bytes={"allreduce": 10 * ACCUM, "allgather": 1}, group_size=2, group_sizes={"allgather": 4}
        )

    def model_states_bytes(self, stats, resolved):
        return 0

    def install_comm_meter(self, model, meter):
        _WRAPPED.append(meter)  # "wraps" _framework_reduction process-wide
        model.model.register_forward_hook(lambda *args: meter.report("allreduce", 10))
        opt = model.trainer.optimizers[0]
        opt.register_step_pre_hook(lambda *args: meter.report("allgather", 1))


_WRAPPED: list = []


def _framework_reduction() -> None:
    for meter in _WRAPPED:
        meter.report("broadcast", 1000)


class _FrameworkReductions(pl.Callback):
    """Reduces like the fault guard (before the optimizer step) and StepMetrics (at the end of a batch)."""

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        _framework_reduction()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        _framework_reduction()


def test_only_training_collectives_count_even_on_steps_with_validation(tmp_path):
    records: list[tuple[int, dict]] = []
    sink = lambda metrics, step: records.append((step, dict(metrics)))  # noqa: E731
    clock = StepClock()
    breakdown = StepBreakdown(
        plugin=_EveryForwardPlugin(),
        resolved=SimpleNamespace(layout=ParallelLayout(dp=1)),
        log_every_n_steps=1,
        warmup_steps_excluded=0,
        emit=MetricEmitter([sink]),
        clock=clock,
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=4,
        accumulate_grad_batches=ACCUM,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        default_root_dir=str(tmp_path),
        callbacks=[
            clock,
            _FrameworkReductions(),
            ValidationLoss(every_n_steps=1, emit=MetricEmitter([sink]), on_time_spent=clock.add_validation),
            breakdown,
        ],
    )
    trainer.fit(_Module(), datamodule=_Data())
    validated = {step for step, m in records if "val/loss" in m}
    comm = {step: m for step, m in records if "perf/comm_bytes" in m}
    assert {1, 2, 3, 4} <= validated and sorted(comm) == [1, 2, 3, 4]
    for step, m in comm.items():
        assert "perf/comm_bytes_broadcast" not in m, step  # the framework's reductions
        assert m["perf/comm_bytes_allreduce"] == m["perf/comm_bytes_allreduce_model"] == 10 * ACCUM, step
        assert m["perf/comm_bytes_allgather"] == m["perf/comm_bytes_allgather_model"] == 1, (
            step
        )  # the optimizer step counts
        # each kind on its own group: all-reduce 2 ranks (factor 1), all-gather 4 ranks (factor 3/4)
        assert m["perf/comm_bytes_wire"] == m["perf/comm_bytes_wire_model"] == 10 * ACCUM + 0.75, step
    assert not breakdown.meter.counting, "closed after training"
