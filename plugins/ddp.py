"""``ddp``: replicated model, gradients all-reduced once per optimizer step.

Lightning's ``DDPStrategy`` wraps the model in ``torch.nn.parallel.DistributedDataParallel``.
During gradient accumulation Lightning enters ``no_sync()`` on every micro-batch but the last,
so gradients are all-reduced once per optimizer step, not once per micro-batch.

Measurement (:meth:`DDPPlugin.install_comm_meter`): a DDP comm hook wraps PyTorch's default
``allreduce_hook`` and reports each gradient bucket (payload bytes, launch and completion) to
the run's :class:`~framework.base.metrics.timing.CommMeter`; it changes nothing else (the bucket is
divided by the world size and all-reduced exactly as without a hook). Bucket all-reduces
overlap the rest of the backward pass, so only the *exposed* part (from the last bucket's
launch until backward returns) can be told apart from compute; see
:mod:`framework.rank.callbacks.breakdown`. The hook reports every bucket; the framework's window
decides what counts (a training backward's buckets, nothing else).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from framework.base.config.schema import ParallelConfig
from framework.base.cost.comm import CommEstimate, ModelStats, ddp_comm_volume
from framework.base.cost.memory import replicated_adamw_model_states_bytes
from framework.base.distributed import process_group_backend, resolve_accelerator
from framework.base.metrics.timing import WORLD, CommMeter
from framework.base.plugin import ParallelPlugin, PluginCapabilities
from framework.base.registry import register_plugin


@dataclass
class DDPConfig(ParallelConfig):
    """DDP options (``torch.nn.parallel.DistributedDataParallel`` keyword arguments)."""

    name: str = "ddp"
    world_size: int = 2
    bucket_cap_mb: float = 25.0  # gradient bucket size for overlapping all-reduce with backward (MB)
    gradient_as_bucket_view: bool = True  # grads are views into buckets: saves one gradient copy
    find_unused_parameters: bool = False  # needed only when some parameters get no gradient
    static_graph: bool = False  # promise the graph never changes (enables more overlap)


def _metered_allreduce_hook(meter, bucket):  # no annotations: DDP rejects string ones (``from __future__``)
    """PyTorch's default bucket all-reduce, reported to ``meter`` (launch with the bucket's bytes, then completion).

    ``meter``: a :class:`CommMeter`; ``bucket``: a ``dist.GradBucket``; returns the future of the averaged bucket.
    """
    buf = bucket.buffer()
    rec = meter.launch("allreduce", buf.numel() * buf.element_size(), WORLD)  # the default hook: the world group

    def done(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
        meter.complete(rec)
        return fut.value()

    return allreduce_hook(None, bucket).then(done)


@register_plugin
class DDPPlugin(ParallelPlugin):
    """Data parallelism with full replicas (Li et al. 2020, PyTorch DDP)."""

    name = "ddp"
    config_cls = DDPConfig
    capabilities = PluginCapabilities(mesh_axes=("dp",))  # full checkpoints, every checkpoint policy

    def build_strategy(self, resolved: Any) -> Any:
        accelerator = resolve_accelerator(resolved.run.trainer.accelerator)
        # Lightning is imported here, not at module level: the driver's pre-check loads this module
        # to validate the config, and Lightning's import costs ~2 s of CPU per run.
        from pytorch_lightning.strategies import DDPStrategy

        return DDPStrategy(
            process_group_backend=process_group_backend(self.cfg.backend, accelerator),
            bucket_cap_mb=self.cfg.bucket_cap_mb,
            gradient_as_bucket_view=self.cfg.gradient_as_bucket_view,
            find_unused_parameters=self.cfg.find_unused_parameters,
            static_graph=self.cfg.static_graph,
            timeout=timedelta(seconds=self.cfg.timeout_s),
        )

    def comm_volume(self, stats: ModelStats, resolved: Any) -> CommEstimate:
        """One all-reduce of all gradients per optimizer step (ZeRO §7.1)."""
        return ddp_comm_volume(stats, resolved.layout.dp)

    def model_states_bytes(self, stats: ModelStats, resolved: Any) -> int:
        """A full fp32 replica + gradients + AdamW state on every rank (ZeRO §3.1 baseline DP)."""
        return replicated_adamw_model_states_bytes(stats)

    def install_comm_meter(self, model: Any, meter: CommMeter) -> None:
        """Register the metered all-reduce comm hook on the DDP-wrapped ``model`` (before the first backward)."""
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model.register_comm_hook(meter, _metered_allreduce_hook)
