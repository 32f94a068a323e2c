"""``ddp``: replicated model, gradients all-reduced once per optimizer step.

Lightning's ``DDPStrategy`` wraps the model in ``torch.nn.parallel.DistributedDataParallel``.
During gradient accumulation Lightning enters ``no_sync()`` on every micro-batch but the last,
so gradients are all-reduced once per optimizer step, not once per micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from pytorch_lightning.strategies import DDPStrategy

from framework.config.schema import ConfigError, ParallelConfig
from framework.distributed import process_group_backend, resolve_accelerator
from framework.registry import ParallelLayout, register_plugin


@dataclass
class DDPConfig(ParallelConfig):
    """DDP options (``torch.nn.parallel.DistributedDataParallel`` keyword arguments)."""

    name: str = "ddp"
    world_size: int = 2
    bucket_cap_mb: float = 25.0  # gradient bucket size for overlapping all-reduce with backward (MB)
    gradient_as_bucket_view: bool = True  # grads are views into buckets: saves one gradient copy
    find_unused_parameters: bool = False  # needed only when some parameters get no gradient
    static_graph: bool = False  # promise the graph never changes (enables more overlap)
    timeout_s: int = 600  # collective timeout before a hung rank is reported (seconds)


@register_plugin
class DDPPlugin:
    """Data parallelism with full replicas (Li et al. 2020, PyTorch DDP)."""

    name = "ddp"
    config_cls = DDPConfig

    def __init__(self, cfg: DDPConfig) -> None:
        self.cfg = cfg

    def validate(self, run: Any) -> None:
        par = run.parallelism
        if par.tp_degree != 1 or par.pp_degree != 1:
            raise ConfigError(
                f"parallelism.tp_degree={par.tp_degree}, pp_degree={par.pp_degree}: plugin 'ddp' is data parallel only"
                " (allowed: 1); use a tensor/pipeline plugin"
            )

    def layout(self) -> ParallelLayout:
        return ParallelLayout(dp=self.cfg.world_size)

    def build_strategy(self, resolved: Any) -> Any:
        accelerator = resolve_accelerator(resolved.run.trainer.accelerator)
        return DDPStrategy(
            process_group_backend=process_group_backend(self.cfg.backend, accelerator),
            bucket_cap_mb=self.cfg.bucket_cap_mb,
            gradient_as_bucket_view=self.cfg.gradient_as_bucket_view,
            find_unused_parameters=self.cfg.find_unused_parameters,
            static_graph=self.cfg.static_graph,
            timeout=timedelta(seconds=self.cfg.timeout_s),
        )
