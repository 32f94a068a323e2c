"""The host-sync counter (framework/rank/metrics/syncs.py) and AdamW's implementation choice."""

from __future__ import annotations

import torch

from framework.rank.metrics.syncs import HostSyncCounter, host_read, summarize
from framework.rank.module import adamw_implementation


def test_counts_each_read_back_with_its_call_site():
    t = torch.tensor([1.5, -2.0])
    with HostSyncCounter() as counter:
        t.sum().item()
        t.tolist()
        t.cpu()
        if (t > 0).any():  # bool() of a tensor
            pass
        float(t[0])
        int(t[1])
        f"{t[0]:.2f}"
        y = t * 2 + 1  # device work only: not counted
        y.to("cpu")  # already on the host: a no-op, not counted
    kinds = [k for k, _ in counter.records]
    assert kinds == ["item", "tolist", "cpu", "bool", "float", "int", "format"]
    assert all("test_host_syncs.py" in site for _, site in counter.records), counter.records
    assert summarize(counter.records).startswith("item at ") and "test_host_syncs.py:" in summarize(counter.records)


def test_reads_marked_as_host_side_are_not_counted():
    flag = torch.tensor([0], dtype=torch.int32)  # e.g. a signal flag all-reduced over a gloo CPU group
    with HostSyncCounter() as counter:
        with host_read():
            int(flag.item())
        int(flag.item())
    assert [k for k, _ in counter.records] == ["item"]


def test_start_stop_window_and_take():
    counter = HostSyncCounter()
    t = torch.ones(3)
    t.sum().item()  # before the window
    counter.start()
    counter.start()  # idempotent
    t.sum().item()
    counter.stop()
    counter.stop()
    t.sum().item()  # after it
    assert len(counter.take()) == 1 and counter.take() == []


def test_a_training_step_with_fused_adamw_and_the_norm_kept_on_the_device_reads_nothing_back():
    """The step trainlab runs (forward, backward, norm clipping, AdamW) with its implementation choice: no read-back;
    the per-tensor AdamW reads its host step counter back every step (what the fused choice removes)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))
    x = torch.randn(4, 8)

    def syncs_of_step(opt) -> list:
        with HostSyncCounter() as counter:
            loss = model(x).pow(2).mean()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        return counter.records

    fused = torch.optim.AdamW(model.parameters(), lr=1e-3, **adamw_implementation(None, "cpu"))
    assert syncs_of_step(fused) == [] and syncs_of_step(fused) == []
    loop = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    assert [k for k, _ in syncs_of_step(loop)] == ["item"] * 4  # one per parameter: optimizer._get_value


def test_adamw_is_fused_where_torch_has_the_kernel_unless_the_plugin_needs_the_loop():
    assert adamw_implementation(None, "cuda") == {"fused": True}
    assert adamw_implementation(None, "cpu") == {"fused": True}
    assert adamw_implementation(False, "cuda") == {"foreach": False}  # TP: DTensor shards mixed with plain tensors
    assert adamw_implementation(None, "mps") == {"foreach": None}
    assert adamw_implementation(None, "cuda", "16-mixed") == {
        "foreach": None
    }  # fp16: Lightning must unscale before clipping


def test_a_loaded_state_keeps_this_runs_implementation():
    """A fused run's checkpoint loaded by a run that needs the per-tensor loop (tensor parallelism) keeps the loop,
    and the other way round; the step counters move to where the implementation keeps them."""
    from framework.rank.module import keep_implementation

    def make(**impl):
        model = torch.nn.Linear(4, 2)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, **impl)
        opt.register_load_state_dict_post_hook(keep_implementation)
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        return opt

    fused, loop = make(fused=True), make(foreach=False)
    loop.load_state_dict(fused.state_dict())
    assert all(g["fused"] in (None, False) and g["foreach"] is False for g in loop.param_groups)
    fused.load_state_dict(make(foreach=False).state_dict())
    assert all(g["fused"] is True for g in fused.param_groups)
    assert all(s["step"].dtype == torch.float32 for s in fused.state.values())
