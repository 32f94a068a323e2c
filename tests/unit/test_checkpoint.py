"""Checkpoint folders: atomic writes, checksums, safe loading, deltas, async saves, RNG, snapshots, the tool."""

from __future__ import annotations

import json
import pathlib
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from framework.base.checkpoint.__main__ import main as ckpt_tool
from framework.base.checkpoint.delta import apply_delta, encode_delta
from framework.base.checkpoint.format import (
    CheckpointError,
    UnsafeCheckpointError,
    find_latest_valid,
    list_checkpoints,
    load_state,
    prune,
    read_manifest,
    remove_partial,
    verify,
    write_checkpoint,
)
from framework.base.checkpoint.io import FolderCheckpointIO
from framework.rank.checkpoint.memory import MemorySnapshot
from framework.rank.checkpoint.rng import capture_rng_state, restore_rng_state


def _state(step: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "global_step": step,
        "state_dict": {"model.w": torch.randn(64, 32, generator=g), "model.b": torch.zeros(32, dtype=torch.bfloat16)},
        "optimizer_states": [
            {
                "state": {0: {"exp_avg": torch.randn(64, 32, generator=g), "step": torch.tensor(float(step))}},
                "param_groups": [{"lr": 1e-3, "params": [0]}],
            }
        ],
        "loops": {"progress": step},
    }


def _assert_same(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same(x, y)
    else:
        assert a == b


def _io(**kw) -> FolderCheckpointIO:
    args = dict(
        keep_last_k=3,
        asynchronous=False,
        full_every_n_saves=1,
        manifest_fields={"layout": {"plugin": "single"}},
        tokens_per_step=100,
    )
    return FolderCheckpointIO(**{**args, **kw})


def test_folder_round_trip_and_manifest(tmp_path):
    state = _state(7)
    path = write_checkpoint(tmp_path, 7, state, {"kind": "full", "base": None, "tokens_seen": 700})
    assert path.name == "step00000007" and list_checkpoints(tmp_path) == [(7, path)]
    m = read_manifest(path)
    assert (
        m["step"] == 7
        and m["tokens_seen"] == 700
        and m["files"]["state.pt"]["bytes"] == (path / "state.pt").stat().st_size
    )
    assert len(m["files"]["state.pt"]["sha256"]) == 64
    assert verify(path) == []
    _assert_same(load_state(path), state)


def test_partial_save_is_never_listed_and_is_cleaned(tmp_path):
    good = write_checkpoint(tmp_path, 1, _state(1), {"kind": "full", "base": None, "tokens_seen": 0})
    partial = tmp_path / ".step00000002.tmp-abc"  # what a kill during a save leaves
    partial.mkdir()
    (partial / "state.pt").write_bytes(b"half")
    assert find_latest_valid(tmp_path) == good
    assert remove_partial(tmp_path) == [partial] and not partial.exists()


def test_flipped_bytes_are_detected_and_skipped_with_a_warning(tmp_path):
    older = write_checkpoint(tmp_path, 1, _state(1), {"kind": "full", "base": None, "tokens_seen": 0})
    newer = write_checkpoint(tmp_path, 2, _state(2), {"kind": "full", "base": None, "tokens_seen": 0})
    f = newer / "state.pt"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))
    assert "sha256 mismatch" in verify(newer)[0]
    warnings: list[str] = []
    assert find_latest_valid(tmp_path, warn=warnings.append) == older
    assert len(warnings) == 1 and str(newer) in warnings[0]
    with pytest.raises(CheckpointError, match="sha256 mismatch"):
        load_state(newer)


class _CreatesAFile:
    def __init__(self, marker: pathlib.Path) -> None:
        self.marker = marker

    def __reduce__(self):  # unpickling this would call Path.touch(marker)
        return (pathlib.Path.touch, (self.marker,))


def test_malicious_pickle_is_refused_and_runs_nothing(tmp_path):
    marker = tmp_path / "pwned"
    # A checkpoint with a valid manifest and checksum, whose state file carries a code-running pickle.
    path = write_checkpoint(
        tmp_path / "ckpt",
        3,
        {"state_dict": {}, "evil": _CreatesAFile(marker)},
        {"kind": "full", "base": None, "tokens_seen": 0},
    )
    assert verify(path) == []
    with pytest.raises(UnsafeCheckpointError, match="refused to load") as info:
        load_state(path)
    assert str(path / "state.pt") in str(info.value) and "\n" not in str(info.value)
    assert not marker.exists()


def test_delta_is_lossless_and_smaller():
    base = _state(1)
    new = _state(1)
    new["state_dict"]["model.w"] = base["state_dict"]["model.w"] + 1e-4  # a small update changes low bits only
    new["state_dict"]["model.extra"] = torch.arange(5)  # no counterpart in the base: kept as is
    new["loops"]["progress"] = 2
    delta = encode_delta(base, new)
    _assert_same(apply_delta(base, delta), new)
    planes = delta["state_dict"]["model.w"]["__xor_planes__"]
    assert len(planes) == 4 and delta["state_dict"]["model.w"]["zlib"][3] == 1  # the top byte plane compresses
    assert sum(p.numel() for p in planes) < new["state_dict"]["model.w"].numel() * 4


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_incremental_chain_loads_bitwise_and_prune_keeps_the_base(tmp_path, asynchronous):
    io = _io(asynchronous=asynchronous, full_every_n_saves=3, keep_last_k=1)
    states = {}
    for step in range(1, 6):  # full, delta, delta, full, delta
        states[step] = _state(step, seed=step % 2)
        io.save_checkpoint(states[step], tmp_path / f"step{step:08d}")
        if step == 3:
            io.wait()
            _assert_same(io.load_checkpoint(tmp_path / "step00000003"), states[3])
    io.teardown()
    results = io.pop_results()
    assert [r.kind for r in results] == ["full", "delta", "delta", "full", "delta"]
    assert all(r.error is None and r.save_s > 0 for r in results)
    assert results[2].delta_ratio < 0.5  # step 3 has the base's tensors (same seed): the XOR is all zeros
    # keep_last_k=1 keeps the newest (a delta) and the base it needs
    assert [s for s, _ in list_checkpoints(tmp_path)] == [4, 5]
    assert read_manifest(tmp_path / "step00000005")["base"] == "step00000004"
    _assert_same(load_state(tmp_path / "step00000005"), states[5])
    assert io._thread is None or not io._thread.is_alive()


def test_async_save_copies_state_so_later_updates_do_not_leak(tmp_path):
    io = _io(asynchronous=True)
    state = _state(1)
    expected = {k: v.clone() for k, v in state["state_dict"].items()}
    io.save_checkpoint(state, tmp_path / "step00000001")
    state["state_dict"]["model.w"].add_(1.0)  # the training step continues while the save runs
    io.teardown()
    _assert_same(load_state(tmp_path / "step00000001")["state_dict"], expected)


def test_async_saves_reusing_cpu_buffers_each_hold_their_own_step(tmp_path):
    io = _io(asynchronous=True)
    state = _state(1)
    expected = {}
    for step in (1, 2, 3):  # saves 2 and 3 copy into the buffers of the save before
        state["global_step"] = step
        expected[step] = {k: v.clone() for k, v in state["state_dict"].items()}
        io.save_checkpoint(state, tmp_path / f"step{step:08d}")
        state["state_dict"]["model.w"].mul_(1.5)
    io.teardown()
    for step in (1, 2, 3):
        _assert_same(load_state(tmp_path / f"step{step:08d}")["state_dict"], expected[step])


def test_failed_save_leaves_nothing_and_keeps_the_newest_valid(tmp_path):
    io = _io(asynchronous=True, keep_last_k=1)
    io.save_checkpoint(_state(1), tmp_path / "step00000001")
    bad = {**_state(2), "unpicklable": lambda: None}
    io.save_checkpoint(bad, tmp_path / "step00000002")
    io.teardown()
    first, second = io.pop_results()
    assert first.error is None and second.error is not None and second.path is None
    assert [s for s, _ in list_checkpoints(tmp_path)] == [1]
    assert not list(tmp_path.glob(".step*"))
    with pytest.raises(OSError, match="step 2 failed"):
        _io(asynchronous=False, keep_last_k=1).save_checkpoint(bad, tmp_path / "step00000002")
    assert [s for s, _ in list_checkpoints(tmp_path)] == [1] and not list(tmp_path.glob(".step*"))


def test_prune_never_deletes_the_newest(tmp_path):
    for step in (1, 2, 3):
        write_checkpoint(tmp_path, step, _state(step), {"kind": "full", "base": None, "tokens_seen": 0})
    prune(tmp_path, 1)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [3]


def test_rng_states_round_trip_through_a_weights_only_file(tmp_path):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    torch.save(capture_rng_state(), tmp_path / "rng.pt")
    expected = (random.random(), np.random.rand(3).tolist(), torch.rand(3))
    restore_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    got = (random.random(), np.random.rand(3).tolist(), torch.rand(3))
    assert got[0] == expected[0] and got[1] == expected[1] and torch.equal(got[2], expected[2])


def test_memory_snapshot_restores_bitwise():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    trainer = SimpleNamespace(
        lightning_module=model, optimizers=[opt], lr_scheduler_configs=[SimpleNamespace(scheduler=sched)], global_step=0
    )

    def step() -> None:
        model(torch.randn(2, 8)).sum().backward()  # torch.randn: the RNG must be restored too
        opt.step()
        opt.zero_grad()
        sched.step()
        trainer.global_step += 1

    step()
    snap = MemorySnapshot(every_n_steps=1)
    snap.take(trainer)
    step()
    after_one = ({k: v.clone() for k, v in model.state_dict().items()}, sched.state_dict())
    step()  # diverge further, then roll back and redo the same step
    assert snap.restore(trainer) == 1
    step()
    _assert_same(model.state_dict(), after_one[0])
    assert sched.state_dict() == after_one[1]
    snap.restore(trainer)  # the snapshot survived the optimizer step after the first restore
    step()
    _assert_same(model.state_dict(), after_one[0])


def test_tool_lists_verifies_and_converts(tmp_path, capsys):
    state = _state(4)
    ckpt = write_checkpoint(tmp_path, 4, state, {"kind": "full", "base": None, "tokens_seen": 400})
    (tmp_path / ".step00000005.tmp-x").mkdir()
    assert ckpt_tool(["ls", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "step00000004" in out and "unfinished save" in out
    assert ckpt_tool(["verify", str(tmp_path)]) == 0
    out_file = tmp_path / "model.pt"
    assert ckpt_tool(["convert", str(tmp_path), "--out", str(out_file)]) == 0
    weights = torch.load(out_file, weights_only=True)
    _assert_same(weights, {"w": state["state_dict"]["model.w"], "b": state["state_dict"]["model.b"]})
    manifest = json.loads((ckpt / "manifest.json").read_text())
    (ckpt / "state.pt").write_bytes(b"x" * manifest["files"]["state.pt"]["bytes"])
    assert ckpt_tool(["verify", str(ckpt)]) == 1
    assert "CORRUPT" in capsys.readouterr().out


def test_buffered_metrics_are_sent_before_the_checkpoint_that_covers_their_step(tmp_path):
    """A kill right after a save must not lose the saved step's metrics (the resumed run does not replay
    that step): ``before_save`` (the worker's metric flush) runs before the folder is written."""
    from framework.base.metrics.emit import MetricEmitter
    from framework.rank.checkpoint.periodic import PeriodicCheckpoint

    order = []
    io = FolderCheckpointIO(
        keep_last_k=1, asynchronous=False, full_every_n_saves=1, manifest_fields={}, tokens_per_step=1
    )
    cb = PeriodicCheckpoint(
        dirpath=str(tmp_path),
        io=io,
        every_n_steps=2,
        save_last=False,
        emit=MetricEmitter([lambda m, step: order.append(("metrics", step, sorted(m)))]),
        before_save=lambda: order.append(("flush", trainer.global_step)),
    )
    trainer = SimpleNamespace(
        global_step=0, is_global_zero=True, save_checkpoint=lambda path: order.append(("save", pathlib.Path(path).name))
    )
    for step in (1, 2, 3):
        trainer.global_step = step
        cb.on_train_batch_end(trainer, None, None, None, step - 1)
    assert order[:2] == [("flush", 2), ("save", "step00000002")]
    assert order[2] == ("metrics", 2, ["ckpt/blocking_s", "ckpt/interval_steps"])  # the save's figures: after it
    assert all(e[0] != "save" for e in order[3:])
