"""``hang``: the rank sleeps ``delay_s`` inside the step (its peers block in the next collective); only the
watchdog (``resilience.hang_timeout_s``) ends it, so a run that schedules one needs it."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from framework.base.faults.kinds import FaultContext, FaultKind, register_fault_kind

if TYPE_CHECKING:
    from framework.base.config.schema import RunConfig

RANDOM_DELAY_S = 3600.0  # a random hang lasts "forever": only the watchdog ends it


@register_fault_kind
class Hang(FaultKind):
    name = "hang"
    summary = "the rank sleeps delay_s inside the step (needs resilience.hang_timeout_s > 0)"

    def check(self, run: RunConfig) -> list[str]:
        if run.resilience.hang_timeout_s <= 0:
            return [
                "fault kind 'hang' needs the watchdog: set resilience.hang_timeout_s > 0 (seconds without"
                " step progress before a rank is declared hung)"
            ]
        return []

    def random_event(self, event: dict[str, Any]) -> dict[str, Any]:
        return {**event, "delay_s": RANDOM_DELAY_S}

    def start(self, event: dict[str, Any], ctx: FaultContext) -> None:
        time.sleep(event["delay_s"])  # the watchdog ends this
