"""The study scripts that price designs (experiments/evaluation, experiments/production_12b) import against the
current cost-model API and order the checkpoint tiers as their READMEs say."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load(rel: str):
    spec = importlib.util.spec_from_file_location(rel.replace("/", "_"), ROOT / rel)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_two_tier_checkpoints_recover_faster_than_sync_at_the_guides_scale():
    ev = _load("experiments/evaluation/report.py")
    sync, two = (ev.reliability(1.22, 8192, p) for p in ("sync", "two_tier"))
    assert sync["mtbf_h"] == pytest.approx(6.19, abs=0.01)  # Llama 3's rate at 8192 GPUs
    assert two["recovery_s"] < sync["recovery_s"] and two["recomputed_steps"] < sync["recomputed_steps"]
    assert two["goodput"] > sync["goodput"]


def test_the_production_tiers_bound_recovery_as_the_interval_grows():
    pr = _load("experiments/production_12b/study.py")
    plan = {"answer": {"step_s": 1.0, "gpus": 512, "params": 12.9e9}}
    rows = {r["every"]: r for r in pr.part_interval(plan)["rows"]}
    for every, r in rows.items():
        assert r["full_only"][0] == every / 2  # half an interval recomputed per failure
        assert r["memory_and_incremental"][1] < r["memory_tier"][1] < r["full_only"][1]
        assert r["incremental"][0] == pr.INCR_EVERY / 2
    assert rows[5000]["full_only"][1] > rows[1000]["full_only"][1]
    # incremental recovery reads the base and more deltas at the longer interval
    assert rows[5000]["incremental_load_s"] > rows[1000]["incremental_load_s"]
