"""``ddp_rsag``: DDP whose gradient all-reduce is done as a reduce-scatter followed by an all-gather.

An all-reduce of S bytes over n ranks *is* a reduce-scatter (each rank ends with the sum of one
1/n slice) followed by an all-gather of the slices (ZeRO §7.1, Rajbhandari et al. 2020; the
ring all-reduce of nccl-tests is built the same way). Both halves move (n-1)/n * S bytes per
rank on a ring, so the wire bytes equal DDP's all-reduce, 2(n-1)/n * S. This plugin makes that
decomposition explicit — it is the gradient path of ZeRO-2 and FSDP, minus the sharding — and
lets the lab measure it: ``perf/comm_bytes_reduce_scatter`` and ``perf/comm_bytes_allgather``
(payload S each per optimizer step) next to ``ddp``'s ``perf/comm_bytes_allreduce`` (S), with the
same ``perf/comm_bytes_wire``.

Everything else is trainlab's ``ddp`` plugin (subclassed): the Lightning ``DDPStrategy``, the
replicated model-state cost, the one-file checkpoints that resume at any world size.

The hook waits for the reduce-scatter inside the backward pass (it overlaps less than the
default all-reduce hook) and pads each bucket to a multiple of n elements with zeros; the
padding (< n elements per bucket) is sent but not counted in the payload.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from framework.base.cost.comm import CommEstimate, ModelStats
from framework.base.metrics.timing import CommMeter
from plugins.ddp import DDPConfig, DDPPlugin


@dataclass
class DDPReduceScatterConfig(DDPConfig):
    """The ``ddp`` options; only the name differs (conf/parallelism/ddp_rsag.yaml)."""

    name: str = "ddp_rsag"


def reduce_scatter_all_gather_hook(meter, bucket):  # no annotations: DDP rejects string ones
    """DDP comm hook: average bucket ``bucket`` over the ranks by reduce-scatter + all-gather.

    ``meter``: a :class:`CommMeter` (payload bytes of the bucket for each collective, launch and
    completion marks). Returns a future holding the averaged flat bucket (same shape and dtype).
    """
    buf = bucket.buffer()  # [numel] flat gradients
    n = dist.get_world_size()
    nbytes = buf.numel() * buf.element_size()
    pad = (-buf.numel()) % n
    full = torch.cat([buf, buf.new_zeros(pad)]) if pad else buf
    full = full.div(n)  # average, as PyTorch's allreduce_hook does (before the sum)
    shard = full.new_empty(full.numel() // n)
    rec = meter.launch("reduce_scatter", nbytes)
    dist.reduce_scatter_tensor(shard, full)  # shard r = sum over ranks of slice r
    meter.complete(rec)
    out = full.new_empty(full.numel())
    rec = meter.launch("allgather", nbytes)
    work = dist.all_gather_into_tensor(out, shard, async_op=True)

    def done(fut: torch.futures.Future) -> torch.Tensor:
        meter.complete(rec)
        return out[: buf.numel()]

    return work.get_future().then(done)


class DDPReduceScatterPlugin(DDPPlugin):
    """``ddp`` with the gradient all-reduce replaced by reduce-scatter + all-gather."""

    name = "ddp_rsag"
    config_cls = DDPReduceScatterConfig

    def comm_volume(self, stats: ModelStats, resolved: Any) -> CommEstimate:
        """Per optimizer step: reduce-scatter and all-gather of every gradient, Psi * grad_bytes payload each."""
        n = resolved.layout.dp
        if n <= 1:
            return CommEstimate(group_size=1)
        grads = stats.num_params * stats.grad_bytes
        return CommEstimate(payload_bytes={"reduce_scatter": grads, "allgather": grads}, group_size=n)

    def install_comm_meter(self, model: Any, meter: CommMeter) -> None:
        """Register :func:`reduce_scatter_all_gather_hook` on the DDP-wrapped ``model``."""
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model.register_comm_hook(meter, reduce_scatter_all_gather_hook)
