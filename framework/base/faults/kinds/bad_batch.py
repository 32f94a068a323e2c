"""``bad_batch``: the step's input and target tokens on the rank are replaced by uniform random tokens
(seeded by step and rank), in every micro-batch of the step."""

from __future__ import annotations

from typing import Any

from framework.base.faults.kinds import Acting, FaultContext, FaultKind, register_fault_kind


class _RandomTokens(Acting):
    def on_batch(self, ctx: FaultContext, batch: Any) -> None:
        import torch

        gen = torch.Generator().manual_seed(ctx.step * 1000 + ctx.rank)
        for t in batch[:2]:  # x and y: [micro_batch_size, seq_len] token ids, replaced in place (not n)
            t.copy_(torch.randint(0, ctx.module.vocab_size, t.shape, generator=gen).to(t.device))


@register_fault_kind
class BadBatch(FaultKind):
    name = "bad_batch"
    summary = "the rank's batch of the step becomes uniform random tokens"

    def start(self, event: dict[str, Any], ctx: FaultContext) -> Acting:
        return _RandomTokens(last_step=ctx.step)
