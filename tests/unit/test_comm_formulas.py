"""One set of communication formulas: the planner's collectives of a layout and the plugins' payloads are sums
over the same per-stage and per-layer tables (framework/base/cost/comm.py)."""

from __future__ import annotations

import pytest

from framework.base.cost.collectives import layout_collectives
from framework.base.cost.comm import (
    ModelStats,
    ddp_comm_volume,
    dp_collectives,
    fsdp_comm_volume,
    tp_payload_bytes_per_microbatch,
    zero_comm_volume,
)
from framework.base.cost.layout import PlanLayout
from framework.base.cost.memory import stage_params
from framework.base.cost.shape import ModelShape

SHAPE = ModelShape(n_layer=4, d_model=64, n_head=4, vocab_size=256, seq_len=32, max_seq_len=32)


def _planner_dp_payload(zero_stage: int, *, dp: int, m: int) -> dict[str, float]:
    lay = PlanLayout(
        dp=dp, tp=1, pp=1, micro_batch_size=1, global_batch_size=dp * m, zero_stage=zero_stage, precision="fp32"
    )
    out: dict[str, float] = {}
    for c in layout_collectives(SHAPE, lay, gpus_per_node=8):
        out[c.kind] = out.get(c.kind, 0.0) + c.payload_bytes * c.calls
    return out


@pytest.mark.parametrize("zero_stage", [0, 1, 2, 3])
@pytest.mark.parametrize("m", [1, 3])
def test_planner_and_plugins_price_the_dp_group_alike(zero_stage, m):
    """Per step, the planner's dp collectives move what the plugins' figures say; the one difference is labelled: stages
    1 and 2 reduce gradients with the paper's reduce-scatter in the planner and DeepSpeed's all-reduce in its plugin."""
    psi = stage_params(SHAPE, tp=1, pp=1, stage=0)
    stats = ModelStats(num_params=int(psi), num_param_tensors=1)
    planner = _planner_dp_payload(zero_stage, dp=4, m=m)
    if zero_stage in (1, 2):
        planner["allreduce"] = planner.pop("reduce_scatter")
    plugin = zero_comm_volume(stats, zero_stage=zero_stage, dp_degree=4, grad_accum_steps=m).payload_bytes
    assert planner == pytest.approx(plugin)
    if zero_stage == 0:
        assert plugin == ddp_comm_volume(stats, 4).payload_bytes
    if zero_stage == 3:
        assert (
            plugin == fsdp_comm_volume(stats, dp_degree=4, grad_accum_steps=m, reshard_after_forward=True).payload_bytes
        )


def test_dp_collectives_by_stage_and_reduction():
    kinds = {
        z: [(c.kind, c.tensor, c.per_microbatch) for c in dp_collectives(z, grad_reduce="allreduce")] for z in range(4)
    }
    assert kinds[0] == [("allreduce", "grads", False)]
    assert kinds[1] == [("allreduce", "grads", False), ("allgather", "params", False)]
    assert kinds[2] == [("allreduce", "grads", True), ("allgather", "params", False)]
    assert kinds[3] == [("allgather", "params", True), ("allgather", "params", True), ("reduce_scatter", "grads", True)]
    assert len(dp_collectives(3, keeps_gathered=True)) == 2
    with pytest.raises(ValueError, match="grad_reduce='ring' is not allowed"):
        dp_collectives(1, grad_reduce="ring")


@pytest.mark.parametrize("sp", [False, True])
def test_planner_tp_collectives_are_the_plugins_per_layer_calls(sp):
    """The planner's TP calls per micro-batch are the plugin's payload formula, less the two boundary all-gathers
    trainlab's GPT adds under sequence parallelism."""
    lay = PlanLayout(dp=1, tp=2, pp=1, micro_batch_size=2, global_batch_size=2, sequence_parallel=sp, precision="fp32")
    planner: dict[str, float] = {}
    for c in layout_collectives(SHAPE, lay, gpus_per_node=8):
        planner[c.kind] = planner.get(c.kind, 0.0) + c.payload_bytes * c.calls
    plugin = tp_payload_bytes_per_microbatch(
        micro_batch_size=2,
        seq_len=SHAPE.seq_len,
        d_model=SHAPE.d_model,
        n_layer=SHAPE.n_layer,
        tp=2,
        sequence_parallel=sp,
    )
    if sp:
        plugin["allgather"] -= 2 * 2 * SHAPE.seq_len * SHAPE.d_model * 4
    assert planner == plugin
