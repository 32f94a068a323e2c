"""Cost models (communication, model-state memory) and the instruments that measure them."""

from __future__ import annotations

import threading

import pytest
import torch

from framework.base.config.schema import ModelConfig
from framework.base.cost.comm import (
    CommEstimate,
    ModelStats,
    ddp_comm_volume,
    dim0_sharded_numel,
    ring_wire_bytes,
)
from framework.base.cost.memory import replicated_adamw_model_states_bytes
from framework.base.metrics.memory import model_states_bytes, model_stats, peak_memory_bytes, torch_held_state
from framework.base.metrics.timing import (
    WORLD,
    CommMeter,
    HostClock,
    call_group,
    comm_paused,
    group_spans_nodes,
    make_clock,
)
from framework.base.model import GPT
from framework.base.registry import get_plugin_class


def test_ring_wire_bytes_follow_nccl_tests_bus_factors():
    S = 1000.0
    assert ring_wire_bytes("allreduce", S, 1) == 0.0
    assert ring_wire_bytes("allreduce", S, 2) == pytest.approx(1000.0)  # 2(n-1)/n = 1
    assert ring_wire_bytes("allreduce", S, 8) == pytest.approx(1750.0)  # 2 * 7/8
    assert ring_wire_bytes("allgather", S, 4) == pytest.approx(750.0)  # (n-1)/n
    assert ring_wire_bytes("reduce_scatter", S, 4) == pytest.approx(750.0)
    assert ring_wire_bytes("p2p", S, 4) == S
    assert (
        ring_wire_bytes("reduce", S, 4) == ring_wire_bytes("broadcast", S, 4) == pytest.approx(750.0)
    )  # chain, mean per rank
    with pytest.raises(ValueError, match="kind='gather'"):
        ring_wire_bytes("gather", S, 2)
    with pytest.raises(ValueError, match="n=0"):
        ring_wire_bytes("allreduce", S, 0)


def test_ddp_model_is_one_gradient_allreduce_per_step():
    stats = ModelStats(num_params=1_000_000, num_param_tensors=10)
    est = ddp_comm_volume(stats, dp_degree=4)
    assert est.payload_bytes == {"allreduce": 4_000_000}
    assert est.total_wire_bytes == pytest.approx(2 * 3 / 4 * 4_000_000)
    assert ddp_comm_volume(stats, dp_degree=1) == CommEstimate(group_size=1)


def test_wire_bytes_use_each_kinds_own_group():
    # HSDP-like: all-reduce on a 2-rank replicate group, all-gather / reduce-scatter on a 4-rank shard group.
    est = CommEstimate(
        payload_bytes={"allreduce": 1000, "allgather": 800, "reduce_scatter": 800},
        group_size=4,
        group_sizes={"allreduce": 2},
    )
    assert est.group_size_of("allreduce") == 2 and est.group_size_of("allgather") == 4
    assert est.total_wire_bytes == 1000 * 1.0 + 800 * 0.75 + 800 * 0.75
    assert est.wire_bytes({"allreduce": 500}) == 500.0  # measured payload, the same factors
    assert CommEstimate(payload_bytes={"allreduce": 1000}, group_size=1).total_wire_bytes == 0.0  # a 1-rank group


def test_dim0_sharding_pads_every_tensor_to_whole_rows_per_rank():
    assert dim0_sharded_numel(((1024, 128), (128,), ()), 2) == 512 * 128 + 64 + 1
    assert dim0_sharded_numel(((1024, 128), (128,)), 3) == 342 * 128 + 43  # ceil(1024/3) rows, ceil(128/3)
    with pytest.raises(ValueError, match="n=0"):
        dim0_sharded_numel(((4,),), 0)


def test_model_stats_carry_the_full_parameter_shapes():
    stats = model_stats(_tiny_gpt())
    assert len(stats.param_shapes) == stats.num_param_tensors
    assert sum(torch.Size(s).numel() for s in stats.param_shapes) == stats.num_params
    assert stats.param_shapes[0] == (300, 32)  # the tied token embedding, once


def test_fsdp_model_follows_fsdp2_padding():
    from types import SimpleNamespace

    from plugins.fsdp import FSDPConfig, FSDPPlugin

    stats = ModelStats(num_params=1024 * 128 + 128, num_param_tensors=2, param_shapes=((1024, 128), (128,)))
    plugin = FSDPPlugin(FSDPConfig())
    at = lambda dp: SimpleNamespace(layout=SimpleNamespace(dp=dp), grad_accum_steps=1)  # noqa: E731
    # dp 2 divides every dim 0: Psi exactly (ZeRO §7.2, 3 Psi with resharding)
    assert plugin.comm_volume(stats, at(2)).payload_bytes == {
        "allgather": 2 * 4 * stats.num_params,
        "reduce_scatter": 4 * stats.num_params,
    }
    padded = 3 * (342 * 128 + 43)  # dp 3: every rank moves ceil(d0/3) rows of each tensor
    est = plugin.comm_volume(stats, at(3))
    assert est.payload_bytes == {"allgather": 2 * 4 * padded, "reduce_scatter": 4 * padded} and est.group_size == 3
    assert plugin.model_states_bytes(stats, at(3)) == 16 * (342 * 128 + 43) + 4 * 2


def test_comm_meter_counts_inside_its_window_only():
    meter = CommMeter(HostClock())
    meter.close()
    dropped = meter.launch("allreduce", 100)
    assert dropped is None
    meter.complete(dropped)  # a dropped launch completes as a no-op
    meter.open()
    meter.report("allgather", 30)
    with meter.paused():
        assert meter.launch("allreduce", 7) is None
    with comm_paused():  # every meter of the process (validation, the framework's reductions)
        meter.report("allreduce", 5)
    meter.report("allreduce", 50)
    assert meter.counting and CommMeter.bytes_by_kind(meter.take()) == {"allgather": 30, "allreduce": 50}


def test_replicated_adamw_is_16_bytes_per_param_plus_step_counters():
    stats = ModelStats(num_params=7_500_000_000, num_param_tensors=0)
    assert replicated_adamw_model_states_bytes(stats) == 16 * 7_500_000_000  # ZeRO §3.1 baseline: 120 GB
    assert replicated_adamw_model_states_bytes(ModelStats(num_params=10, num_param_tensors=3)) == 160 + 12


def _tiny_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(ModelConfig(n_layer=2, n_head=2, d_model=32, max_seq_len=16), vocab_size=300)


def test_measured_model_states_equal_the_model_after_an_adamw_step():
    model = _tiny_gpt()
    stats = model_stats(model)
    assert stats.num_params == model.num_params(exclude_position_embedding=False)  # tied head counted once
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 300, (2, 16))
    model(x, x).backward()
    opt.step()
    measured = model_states_bytes(torch_held_state(model.parameters(), opt))
    assert measured["params"] == measured["grads"] == 4 * stats.num_params
    assert measured["optimizer"] == 8 * stats.num_params + 4 * stats.num_param_tensors
    for name in ("single", "ddp"):
        plugin = get_plugin_class(name)(get_plugin_class(name).config_cls())
        assert plugin.model_states_bytes(stats, None) == measured["total"], name


def test_views_into_one_buffer_count_once():
    flat = torch.zeros(10)
    a, b = torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(6))
    a.grad, b.grad = flat[:4], flat[4:]  # like DDP's gradient_as_bucket_view
    measured = model_states_bytes(torch_held_state([a, b], None))
    assert measured == {"params": 40, "grads": 40, "optimizer": 0, "total": 80}


def test_peak_memory_is_positive_and_monotone_on_cpu():
    first = peak_memory_bytes(torch.device("cpu"))
    blob = torch.ones(64 * 1024 * 1024 // 4)  # 64 MiB touched
    assert first > 0 and peak_memory_bytes(torch.device("cpu")) >= first
    del blob


def test_comm_meter_counts_bytes_by_kind_across_threads():
    meter = CommMeter(HostClock())
    assert meter.last_launch() is None
    recs = [meter.launch("allreduce", 100), meter.launch("allgather", 30), meter.launch("allreduce", 50)]
    t = threading.Thread(target=lambda: [meter.complete(r) for r in recs])
    t.start()
    t.join()
    assert meter.last_launch() is recs[-1].launched
    taken = meter.take()
    assert CommMeter.bytes_by_kind(taken) == {"allreduce": 150, "allgather": 30}
    assert all(r.completed >= r.launched for r in taken)
    assert meter.take() == [] and meter.last_launch() is None


def test_cpu_device_gets_the_host_clock():
    clock = make_clock(torch.device("cpu"))
    a = clock.mark()
    b = clock.mark()
    assert isinstance(clock, HostClock) and clock.seconds(a, b) >= 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.gpu
def test_cuda_event_clock_times_gpu_work():
    clock = make_clock(torch.device("cuda", 0))
    a = clock.mark()
    torch.ones(4096, 4096, device="cuda") @ torch.ones(4096, 4096, device="cuda")
    b = clock.mark()
    clock.wait(b)
    assert clock.seconds(a, b) > 0


def test_activation_checkpointing_counts_the_recompute_in_hfu_not_mfu():
    """(That checkpointed blocks give the same loss and gradients: tests/unit/test_parallelize.py.)"""
    import dataclasses

    cfg = ModelConfig(n_layer=2, n_head=2, d_model=32, max_seq_len=16)
    ref, ckpt = (GPT(dataclasses.replace(cfg, activation_checkpointing=flag), vocab_size=300) for flag in (False, True))
    # HFU's FLOPs: the blocks' forward once more (2 N_blocks + 4 L h s per token); MFU's unchanged.
    n_blocks = sum(p.numel() for p in ref.blocks.parameters())
    assert ref.hardware_flops_per_token(16) == ref.flops_per_token(16) == ckpt.flops_per_token(16)
    assert ckpt.hardware_flops_per_token(16) == ckpt.flops_per_token(16) + 2 * n_blocks + 4 * 2 * 32 * 16


def test_the_meter_splits_bytes_by_whether_the_group_spans_nodes():
    # 2 ranks per node: ranks [0, 1] are node 0's, [1, 2] span nodes 0 and 1; the world group is unknown without a
    # process group (then the step's bytes are not split)
    assert group_spans_nodes([0, 1], 2) is False and group_spans_nodes([1, 2], 2) is True
    assert group_spans_nodes([0, 1], 0) is None and group_spans_nodes(WORLD, 2) is None
    meter = CommMeter(HostClock(), ranks_per_node=2)
    meter.report("allreduce", 100, [0, 1])
    meter.report("allgather", 40, [0, 2])
    recs = meter.take()
    assert CommMeter.inter_node_bytes(recs) == 40 and CommMeter.bytes_by_kind(recs) == {
        "allreduce": 100,
        "allgather": 40,
    }
    meter.report("allreduce", 8)  # the default group, no process group here: unknown
    assert CommMeter.inter_node_bytes(meter.take()) is None


def test_call_group_finds_the_group_argument_of_a_collective_call():
    def all_gather_single(output, input, group=None, async_op=False):
        pass

    assert call_group(all_gather_single, ("o", "i", "g"), {}) == "g"
    assert call_group(all_gather_single, ("o", "i"), {"group": "h"}) == "h"
    assert call_group(all_gather_single, ("o", "i"), {}) is None
