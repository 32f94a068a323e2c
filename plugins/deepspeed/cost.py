"""The ZeRO cost model and the meter on DeepSpeed's collectives.
(placeholder, filled below)"""
from __future__ import annotations
from typing import Any
from framework.metrics.comm import CommEstimate, ModelStats
from framework.metrics.comm import replicated_adamw_model_states_bytes


def zero_comm_volume(stats: ModelStats, cfg: Any, resolved: Any) -> CommEstimate:
    return CommEstimate(group_size=resolved.layout.dp)


def zero_model_states_bytes(stats: ModelStats, cfg: Any, resolved: Any) -> int:
    return replicated_adamw_model_states_bytes(stats)


def meter_deepspeed_comm(meter: Any) -> None:
    pass
