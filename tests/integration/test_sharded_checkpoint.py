"""fsdp's sharded (DCP) checkpoints beyond the conformance suite: the checkpoint tool, per-rank
RNG at another world size, corruption, and one-line errors for FSDP options.

Reuses the conformance session's fsdp run (no extra training runs, except a 2-step resume).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from framework.base.checkpoint.__main__ import main as ckpt_tool
from framework.base.checkpoint.format import STATE_FILE, find_latest_valid, read_manifest, safe_torch_load
from framework.base.testing.conformance import SAVE_AT, STEPS, PluginCase
from framework.driver.cli import precheck

pytestmark = pytest.mark.slow

FSDP = PluginCase("fsdp", select=("parallelism=fsdp",))  # the same run as test_conformance's fsdp case


def test_fsdp_checkpoint_is_a_checksummed_sharded_folder(conformance, capsys):
    ckpt = conformance.plugin_run(FSDP).ckpt_dir
    step = ckpt / f"step{SAVE_AT:08d}"
    manifest = read_manifest(step)
    assert manifest["kind"] == "dcp" and manifest["layout"]["world_size"] == 2
    assert {"dcp/.metadata", "dcp/__0_0.distcp", "dcp/__1_0.distcp", STATE_FILE} == set(manifest["files"])
    assert ckpt_tool(["ls", str(ckpt)]) == 0 and "fsdp x2" in capsys.readouterr().out
    assert ckpt_tool(["verify", str(ckpt)]) == 0
    out = ckpt.parent / "fsdp-weights.pt"
    assert ckpt_tool(["convert", str(step), "--out", str(out)]) == 0
    from framework.base.config.schema import ModelConfig
    from framework.base.model import GPT

    weights = torch.load(out, weights_only=True)
    model = GPT(ModelConfig(), vocab_size=weights["wte.weight"].shape[0])
    model.load_state_dict(weights)  # strict: every key of the plain model, full (unsharded) shapes
    # Every rank is seeded alike and draws alike, so the saved per-rank RNG states are equal: a
    # resume at another world size hands that one state to every rank (framework.rank.checkpoint.reshard).
    rng = safe_torch_load(step / STATE_FILE)["trainlab"]["rng"]
    assert (
        len(rng) == 2 and torch.equal(rng[0]["torch_cpu"], rng[1]["torch_cpu"]) and rng[0]["python"] == rng[1]["python"]
    )


def test_a_corrupt_shard_is_named_and_skipped(conformance, tmp_path, capsys):
    import shutil

    src = conformance.plugin_run(FSDP).ckpt_dir
    ckpt = tmp_path / "ckpts"
    shutil.copytree(src, ckpt)
    shard = ckpt / f"step{STEPS:08d}" / "dcp" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert ckpt_tool(["verify", str(ckpt)]) == 1
    assert "__1_0.distcp: sha256 mismatch" in capsys.readouterr().out
    warnings: list[str] = []
    assert find_latest_valid(ckpt, warn=warnings.append) == ckpt / f"step{SAVE_AT:08d}"
    assert "__1_0.distcp" in warnings[0]


def test_resume_auto_picks_the_newest_sharded_checkpoint(conformance, tmp_path):
    import shutil

    full = conformance.plugin_run(FSDP)
    ckpt = tmp_path / "ckpts"
    shutil.copytree(full.ckpt_dir / f"step{SAVE_AT:08d}", ckpt / f"step{SAVE_AT:08d}")
    again = conformance.run("fsdp-auto", FSDP.select, max_steps=SAVE_AT + 2, save_every=0, resume="auto", ckpt_dir=ckpt)
    assert f"resuming from {ckpt / f'step{SAVE_AT:08d}'}" in again.stdout
    assert sorted(again.losses) == [SAVE_AT + 1, SAVE_AT + 2]
    for step, loss in again.losses.items():
        assert loss == full.losses[step], f"step {step}"  # same layout: bitwise the uninterrupted run
    assert read_manifest(ckpt / f"step{SAVE_AT + 2:08d}")["kind"] == "dcp"  # save_last at the end


def _one_line_error(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as info:
        precheck(argv)
    assert info.value.code == 2
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(lines) == 1, lines
    return lines[0]


def test_fsdp_options_that_do_not_exist_fail_in_one_line_before_any_rank(capsys, tmp_path):
    # End to end: the driver exits 2 before Hydra makes a folder or any rank starts.
    proc = subprocess.run(
        [sys.executable, "-m", "framework.train", "parallelism=fsdp", "parallelism.reshard_after_forwad=false"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert [ln for ln in proc.stderr.splitlines() if ln.strip()] == [
        "trainlab: error: parallelism.reshard_after_forwad is not a config key; did you mean"
        " parallelism.reshard_after_forward? (to add a new key write +parallelism.reshard_after_forwad=...)"
    ]
    assert not (tmp_path / "outputs").exists()
    err = _one_line_error(capsys, ["parallelism=fsdp", "+parallelism.cpu_offload=true"])
    assert err.startswith("trainlab: error: parallelism.cpu_offload is not an option of plugin 'fsdp'; allowed: ")
    assert "reshard_after_forward" in err and "mixed_precision" in err
    assert _one_line_error(capsys, ["parallelism=fsdp", "parallelism.mixed_precision=fp8"]) == (
        "trainlab: error: parallelism.mixed_precision='fp8' is not allowed; allowed: none, bf16"
    )
    assert _one_line_error(capsys, ["parallelism=fsdp", "checkpoint=async"]) == (
        "trainlab: error: checkpoint.mode='async': plugin 'fsdp' saves sharded (DCP) checkpoints synchronously only;"
        " allowed: sync"
    )
    assert (
        "checkpoint.full_every_n_saves=4: plugin 'fsdp' saves sharded (DCP) checkpoints without deltas"
        in _one_line_error(capsys, ["parallelism=fsdp", "checkpoint=incremental"])
    )
