"""Exact resume: runs SIGKILLed at several steps (and once in the middle of a save, once with a
corrupt newest checkpoint) end bitwise-identical to an uninterrupted run, for ``single`` and ``ddp``.

``single`` runs the ``incremental`` policy (so the final checkpoints compared are rebuilt from
XOR deltas) and ``ddp`` the ``async`` one; the default ``interval`` policy is resumed in
``test_train_e2e.py`` and all three share the folder format and the RNG restore.
"""

from __future__ import annotations

import re
import signal

import pytest
import torch

from framework.base.checkpoint.format import TEST_PAUSE_ENV, load_state
from tests.integration.conftest import kill_group, losses, records, shared_run, wait_for

pytestmark = pytest.mark.slow

MAX_STEPS = 20
# A small model and few validation windows keep each start to seconds on 2 cores; accumulation
# (2 micro-batches per step) is on, so resume must also land on an optimizer-step boundary.
SMALL = [
    "model.n_layer=2",
    "model.n_head=2",
    "model.d_model=64",
    "trainer.val_sequences=16",
    "tracking=none",
    f"trainer.max_steps={MAX_STEPS}",
    "trainer.log_every_n_steps=1",
    "checkpoint.every_n_steps=5",
    "checkpoint.keep_last_k=2",
    "trainer.global_batch_size=8",
]
LAYOUT = {
    "single": [
        "parallelism=single",
        "trainer.micro_batch_size=4",
        "checkpoint=incremental",
        "checkpoint.full_every_n_saves=3",
    ],
    "ddp": ["parallelism=ddp", "trainer.micro_batch_size=2", "checkpoint=async"],
}


def _tensors(obj, prefix=""):
    """(path, tensor) of every tensor in a nested state."""
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _tensors(v, f"{prefix}/{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _tensors(v, f"{prefix}/{i}")


def assert_bitwise_equal(got_dir, ref_dir):
    got, ref = load_state(got_dir), load_state(ref_dir)
    got_t, ref_t = dict(_tensors(got)), dict(_tensors(ref))
    assert got_t.keys() == ref_t.keys()
    assert any(k.startswith("/state_dict/") for k in ref_t) and any(k.startswith("/optimizer_states/") for k in ref_t)
    assert any(k.startswith("/trainlab/rng/") for k in ref_t)
    for key, t in ref_t.items():
        assert t.dtype == got_t[key].dtype and torch.equal(t, got_t[key]), f"{key} differs"
    # the non-tensor parts of the RNG states (python's, numpy's position) and the LR schedule
    for a, b in zip(got["trainlab"]["rng"], ref["trainlab"]["rng"]):
        assert a["python"] == b["python"]
        assert {k: v for k, v in a["numpy"].items() if k != "keys"} == {
            k: v for k, v in b["numpy"].items() if k != "keys"
        }
    assert got["lr_schedulers"][0]["last_epoch"] == ref["lr_schedulers"][0]["last_epoch"]


def assert_converted_gives_the_next_step_loss(run_dir, ckpt_dir, step: int, scratch) -> None:
    """``python -m framework.checkpoint convert`` of step ``step`` of the run whose output folder is ``run_dir``
    (checkpoints in ``ckpt_dir``; the converted file in the folder ``scratch``) loads into a plain GPT whose loss
    on step ``step + 1``'s global batch is the ``train/loss`` the run logged for that step."""
    import json
    import subprocess
    import sys

    from framework.base.config.schema import ModelConfig
    from framework.base.data.dataset import WindowDataset
    from framework.base.data.tokens import TokenCache
    from framework.base.model import GPT
    from framework.rank.data.sampler import StepBatchSampler

    out = scratch / "model.pt"
    subprocess.run(
        [sys.executable, "-m", "framework.checkpoint", "convert", str(ckpt_dir / f"step{step:08d}"), "--out", str(out)],
        check=True,
        capture_output=True,
    )
    launch = json.loads((run_dir / "launch.json").read_text())
    run = launch["resolved"]["run"]
    cache = TokenCache.open(launch["token_cache_dir"])
    model = GPT(ModelConfig(**run["model"]), vocab_size=cache.vocab_size)
    model.load_state_dict(torch.load(out, weights_only=True), strict=True)
    ds = WindowDataset(cache.open_train(), run["data"]["seq_len"])
    gbs = run["trainer"]["global_batch_size"]
    sampler = StepBatchSampler(
        len(ds),
        global_batch_size=gbs,
        micro_batch_size=gbs,
        dp_rank=0,
        dp_size=1,
        seed=run["data"]["seed"],
        max_steps=MAX_STEPS,
    )
    x, y = (torch.stack(t) for t in zip(*(ds[i] for i in sampler.step_windows(step))))  # 0-based: step k+1's batch
    with torch.no_grad():
        loss = float(model(x, y))
    logged = losses(records(run_dir))[step + 1]
    assert loss == pytest.approx(logged, rel=1e-5)  # one batch of 8 vs 2 micro-batches of 4: summation order only


def _resumed_step(output: str) -> int:
    m = re.search(r"resuming from \S*step(\d{8})", output)
    assert m, output[-3000:]
    return int(m.group(1))


def _kill_after(proc, ready) -> str:
    wait_for(ready, timeout=300, proc=proc)
    kill_group(proc, signal.SIGKILL)
    return proc.stdout.read()


for _plugin, _overrides in LAYOUT.items():  # the uninterrupted runs: the session's shared runs (conftest)
    shared_run(f"exact-ref-{_plugin}", *SMALL, *_overrides, used_by=__name__)


@pytest.mark.parametrize("plugin", ["single", "ddp"])
def test_sigkilled_runs_resume_bitwise(runner, shared_runs, plugin):
    name = f"exact_{plugin}"
    common = [*SMALL, *LAYOUT[plugin], f"run_name={name}"]
    ref_run, ref_records = shared_runs.run_dir(f"exact-ref-{plugin}"), shared_runs.records(f"exact-ref-{plugin}")
    ref_dir = shared_runs.checkpoint_dir(f"exact-ref-{plugin}")
    ckpt_metrics = {r["step"]: r for r in ref_records if "ckpt/save_s" in r}
    assert sorted(ckpt_metrics) == [5, 10, 15, 20]
    for r in ref_records:
        if "ckpt/blocking_s" in r:
            assert r["ckpt/interval_steps"] == 5 and r["ckpt/blocking_s"] > 0
    assert all(r["ckpt/bytes"] > 0 for r in ckpt_metrics.values())
    if plugin == "single":  # full, delta, delta, full
        assert [("ckpt/delta_ratio" in ckpt_metrics[s]) for s in (5, 10, 15, 20)] == [False, True, True, False]
        assert 0 < ckpt_metrics[10]["ckpt/delta_ratio"] < 1
        # step 15 is a delta: rebuilt, then converted
        assert_converted_gives_the_next_step_loss(ref_run, ref_dir, 15, runner.workdir)
    ckpt = runner.workdir / "checkpoints" / "default" / name
    done = lambda step: (ckpt / f"step{step:08d}" / "manifest.json").exists()  # noqa: E731
    resumed = []

    if plugin == "single":
        # 1) SIGKILL in the middle of writing the step-10 save (the test hook pauses it between files).
        proc = runner.start(*common, env={TEST_PAUSE_ENV: "10:600"})
        _kill_after(proc, lambda: any((p / "state.pt").exists() for p in ckpt.glob(".step00000010.tmp-*")))
        assert not done(10) and done(5)
        # 2) Resumes from the previous complete checkpoint (5); killed again once step 15 is saved
        #    (the pause at 20 keeps the run from finishing before the kill lands).
        proc = runner.start(*common, env={TEST_PAUSE_ENV: f"{MAX_STEPS}:600"})
        resumed.append(_resumed_step(_kill_after(proc, lambda: done(15))))
        assert resumed == [5]
        # 3) Flip bytes in the newest checkpoint: it is skipped with a warning naming it.
        newest = sorted(ckpt.glob("step*"))[-1]
        data = bytearray((newest / "state.pt").read_bytes())
        data[len(data) // 3] ^= 0x5A
        (newest / "state.pt").write_bytes(bytes(data))
        final = runner.run(*common)
        assert f"skipping corrupt checkpoint {newest.relative_to(runner.workdir)}" in final.stderr
        resumed.append(_resumed_step(final.stdout))
        assert newest.name == "step00000015" and resumed[1] == 10
        assert not list(ckpt.glob(".step*.tmp-*")), "the unfinished save was cleaned up"
    else:
        # SIGKILL once step 5 is saved, again once step 15 is saved (the pause at 20 keeps the run
        # from finishing before the kill lands), then run to the end.
        proc = runner.start(*common)
        _kill_after(proc, lambda: done(5))
        proc = runner.start(*common, env={TEST_PAUSE_ENV: f"{MAX_STEPS}:600"})
        resumed.append(_resumed_step(_kill_after(proc, lambda: done(15))))
        resumed.append(_resumed_step(runner.run(*common).stdout))

    assert len(set(resumed)) == 2, f"two different resume steps, got {resumed}"
    ref, got = losses(ref_records), losses(runner.metrics(name))
    assert sorted(got) == sorted(ref) == list(range(1, MAX_STEPS + 1))
    # every execution of every step (the killed runs' too, in the order they ran) has the uninterrupted loss:
    # a mismatch names the first step (and so the run) that went off
    executed = [(int(r["step"]), r["train/loss"]) for r in runner.metrics(name) if "train/loss" in r]
    off = [(i, step, loss, ref[step]) for i, (step, loss) in enumerate(executed) if loss != ref[step]]
    assert not off, (
        f"(record, step, loss, uninterrupted loss) of the first steps that differ: {off[:3]}; resumed at {resumed}"
    )
    assert_bitwise_equal(ckpt / f"step{MAX_STEPS:08d}", ref_dir / f"step{MAX_STEPS:08d}")
