"""Checking that a dropped update changed nothing: this rank's training state before and after.

``resilience.audit_skips=true`` makes the fault guard copy, at every dropped update, this rank's
model and optimizer state (every tensor of ``LightningModule.state_dict()`` and of each
``optimizer.state_dict()``: whatever this rank holds, e.g. its ZeRO partitions of the fp32
weights and AdamW moments, or its FSDP shards) before the optimizer step, and compare it with
the state after the step and the LR scheduler. The result goes to the fault log as a
``skip_audit`` record per rank (``max_abs_diff``: 0.0 when the skip was real; ``parts``: the same
per state dict, ``model`` and ``optimizer0``, so a moved weight is told from a counted step). It costs one CPU
copy of the rank's state per dropped step, so it is off by default; the conformance suite
(:mod:`framework.base.testing.conformance`, check ``skipped_step``) turns it on.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def local_state(trainer: Any) -> dict[str, torch.Tensor]:
    """``{path: CPU float64 copy}`` of every tensor in this rank's model and optimizer state dicts.

    DTensors contribute their local shard. Non-tensor entries (hyperparameters) are left out.
    """
    out: dict[str, torch.Tensor] = {}
    _collect("model", trainer.lightning_module.state_dict(), out)
    for i, opt in enumerate(trainer.optimizers):
        _collect(f"optimizer{i}", opt.state_dict(), out)
    return out


def _collect(path: str, value: Any, out: dict[str, torch.Tensor]) -> None:
    if isinstance(value, torch.Tensor):
        t = value.to_local() if hasattr(value, "to_local") else value
        out[path] = t.detach().to("cpu", torch.float64, copy=True)
    elif isinstance(value, dict):
        for k, v in value.items():
            _collect(f"{path}/{k}", v, out)
    elif isinstance(value, (list, tuple)):
        for k, v in enumerate(value):
            _collect(f"{path}/{k}", v, out)


def max_abs_diff(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> float:
    """Largest ``|after - before|`` over all tensors of two :func:`local_state` results.

    ``inf`` when the two do not hold the same tensors (names or shapes: e.g. AdamW created its
    moments in the step), NaN-safe (a NaN on one side only counts as ``inf``); 0.0 for two
    empty states.
    """
    if before.keys() != after.keys():
        return math.inf
    worst = 0.0
    for k, a in before.items():
        b = after[k]
        if a.shape != b.shape:
            return math.inf
        if a.numel() == 0:
            continue
        if not torch.equal(torch.isnan(a), torch.isnan(b)):
            return math.inf
        d = (b - a).abs()
        d = torch.where(torch.isnan(d), torch.zeros_like(d), d)  # NaN in place on both sides, or inf - inf
        worst = max(worst, float(d.max()))
    return worst


def max_abs_diff_by_part(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> dict[str, float]:
    """:func:`max_abs_diff` per state dict (the first path component: ``model``, ``optimizer0``, ...)."""
    parts = sorted({k.split("/", 1)[0] for k in (*before, *after)})

    def part(d: dict[str, torch.Tensor], name: str) -> dict[str, torch.Tensor]:
        return {k: v for k, v in d.items() if k.split("/", 1)[0] == name}

    return {name: max_abs_diff(part(before, name), part(after, name)) for name in parts}
