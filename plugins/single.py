"""``single``: one process, no parallelism. The reference every other plugin is checked against."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from framework.base.config.schema import ParallelConfig
from framework.base.cost.comm import CommEstimate, ModelStats
from framework.base.cost.memory import replicated_adamw_model_states_bytes
from framework.base.plugin import ParallelPlugin, PluginCapabilities
from framework.base.registry import register_plugin


@dataclass
class SingleConfig(ParallelConfig):
    """One rank; ``world_size`` must stay 1."""

    name: str = "single"


@register_plugin
class SinglePlugin(ParallelPlugin):
    """One process on one device (Lightning's single-device strategy)."""

    name = "single"
    config_cls = SingleConfig
    capabilities = PluginCapabilities(mesh_axes=())  # one rank; full checkpoints, every checkpoint policy

    def build_strategy(self, resolved: Any) -> Any:
        return "auto"

    def comm_volume(self, stats: ModelStats, resolved: Any) -> CommEstimate:
        """No communication."""
        return CommEstimate(group_size=1)

    def model_states_bytes(self, stats: ModelStats, resolved: Any) -> int:
        """fp32 parameters + gradients + AdamW state (ZeRO §3.1)."""
        return replicated_adamw_model_states_bytes(stats)
