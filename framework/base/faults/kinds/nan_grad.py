"""``nan_grad``: after backward (gradients already all-reduced), the rank's gradients become NaN, as after an
ECC error in the optimizer's input."""

from __future__ import annotations

from typing import Any

from framework.base.faults.kinds import Acting, FaultContext, FaultKind, register_fault_kind


class _NanGrads(Acting):
    def before_optimizer_step(self, ctx: FaultContext) -> None:
        for p in ctx.module.parameters():
            if p.grad is not None:
                p.grad.fill_(float("nan"))


@register_fault_kind
class NanGrad(FaultKind):
    name = "nan_grad"
    summary = "the rank's gradients become NaN after the gradient all-reduce (the ECC case)"

    def start(self, event: dict[str, Any], ctx: FaultContext) -> Acting:
        return _NanGrads(last_step=ctx.step)
