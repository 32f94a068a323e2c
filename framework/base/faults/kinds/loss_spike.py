"""``loss_spike``: the step's micro-batch losses on the rank are multiplied by the event's ``factor`` (through
``StepState.loss_transform``), so the logged loss and the gradients show it."""

from __future__ import annotations

from typing import Any

from framework.base.faults.kinds import FaultContext, FaultKind, register_fault_kind


@register_fault_kind
class LossSpike(FaultKind):
    name = "loss_spike"
    summary = "the rank's loss (and so its gradients) x factor in the step"

    def start(self, event: dict[str, Any], ctx: FaultContext) -> None:
        factor = event["factor"]
        ctx.module.step_state.loss_transform = lambda loss: loss * factor
