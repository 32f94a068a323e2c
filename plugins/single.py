"""``single``: one process, no parallelism. The reference every other plugin is checked against."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from framework.config.schema import ConfigError, ParallelConfig
from framework.metrics.comm import CommEstimate, ModelStats, replicated_adamw_model_states_bytes
from framework.metrics.timing import CommMeter
from framework.registry import ParallelLayout, register_plugin


@dataclass
class SingleConfig(ParallelConfig):
    """One rank; ``world_size`` must stay 1."""

    name: str = "single"


@register_plugin
class SinglePlugin:
    """One process on one device (Lightning's single-device strategy)."""

    name = "single"
    config_cls = SingleConfig

    def __init__(self, cfg: SingleConfig) -> None:
        self.cfg = cfg

    def validate(self, run: Any) -> None:
        par = run.parallelism
        if (par.world_size, par.tp_degree, par.pp_degree, par.nnodes) != (1, 1, 1, 1) or par.dp_degree not in (-1, 1):
            raise ConfigError(
                f"parallelism.world_size={par.world_size} (and every degree) must be 1 for plugin 'single';"
                " use parallelism=ddp for several ranks"
            )

    def layout(self) -> ParallelLayout:
        return ParallelLayout(dp=1)

    def build_strategy(self, resolved: Any) -> Any:
        return "auto"

    def comm_volume(self, stats: ModelStats, resolved: Any) -> CommEstimate:
        """No communication."""
        return CommEstimate(group_size=1)

    def model_states_bytes(self, stats: ModelStats, resolved: Any) -> int:
        """fp32 parameters + gradients + AdamW state (ZeRO §3.1)."""
        return replicated_adamw_model_states_bytes(stats)

    def install_comm_meter(self, model: Any, meter: CommMeter) -> None:
        """Nothing communicates, so nothing to instrument."""
