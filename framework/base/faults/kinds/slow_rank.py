"""``slow_rank``: the rank sleeps ``delay_s`` in each of ``duration_steps`` steps, after the gradient sync (a
straggler in its optimizer phase): earlier, every sync point would make all ranks wait alike."""

from __future__ import annotations

import time
from typing import Any

from framework.base.faults.kinds import Acting, FaultContext, FaultKind, register_fault_kind


class _Slow(Acting):
    def __init__(self, last_step: int, delay_s: float) -> None:
        super().__init__(last_step)
        self.delay_s = delay_s
        self._slept_step = -1

    def before_optimizer_step(self, ctx: FaultContext) -> None:
        if self._slept_step != ctx.step:  # once per step (some strategies call the hook per micro-batch)
            self._slept_step = ctx.step
            time.sleep(self.delay_s)


@register_fault_kind
class SlowRank(FaultKind):
    name = "slow_rank"
    summary = "the rank sleeps delay_s per step for duration_steps steps, after the gradient sync"

    def start(self, event: dict[str, Any], ctx: FaultContext) -> Acting:
        return _Slow(last_step=event["step"] + event["duration_steps"] - 1, delay_s=event["delay_s"])
