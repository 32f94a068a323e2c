"""FLOPs per token, GPU peak table, CPU peak measurement + cache, MFU/HFU."""

from __future__ import annotations

import json
import os

import pytest
import torch

from framework.base.config.schema import ModelConfig
from framework.base.metrics import flops as F
from framework.base.model import GPT

# GPT-2 small: L=12, h=768, V=50257, max_seq_len=1024, biases, tied head.
# Per layer: attention qkv 3h^2+3h + proj h^2+h = 4h^2+4h = 2,362,368
#            MLP fc 4h^2+4h + proj 4h^2+h       = 8h^2+5h = 4,722,432
#            two LayerNorms 2*(2h)              = 4h      =     3,072
#            total 12h^2+13h                              = 7,087,872
# 12 layers = 85,054,464; + final LayerNorm 2h = 1,536 -> 85,056,000 non-embedding
# head / wte V*h = 50257*768 = 38,597,376; wpe 1024*768 = 786,432
GPT2_NON_EMBEDDING = 85_056_000
GPT2_WTE = 38_597_376
GPT2_WPE = 786_432
GPT2_N = GPT2_NON_EMBEDDING + GPT2_WTE  # 123,653,376
GPT2_TOTAL = GPT2_N + GPT2_WPE  # 124,439,808: the known GPT-2 small count
# 6N = 741,920,256; 12*L*h*s = 12*12*768*1024 = 113,246,208
GPT2_FLOPS_PER_TOKEN_S1024 = 855_166_464


def gpt2_small() -> GPT:
    cfg = ModelConfig(name="gpt2_124m", n_layer=12, n_head=12, d_model=768, max_seq_len=1024, vocab_size=50257)
    with torch.device("meta"):
        return GPT(cfg, 50257)


def test_hand_arithmetic_is_consistent():
    h = 768
    assert 12 * (12 * h * h + 13 * h) + 2 * h == GPT2_NON_EMBEDDING
    assert GPT2_TOTAL == 124_439_808
    assert 6 * GPT2_N + 12 * 12 * h * 1024 == GPT2_FLOPS_PER_TOKEN_S1024


def test_flops_per_token_gpt2_small():
    assert F.flops_per_token(n_params=GPT2_N, n_layer=12, d_model=768, seq_len=1024) == GPT2_FLOPS_PER_TOKEN_S1024
    model = gpt2_small()
    assert model.num_params(exclude_position_embedding=False) == GPT2_TOTAL
    assert model.num_flops_params() == GPT2_N
    got = model.flops_per_token(1024)
    assert isinstance(got, int) and got == GPT2_FLOPS_PER_TOKEN_S1024


def test_matches_megatron_matmul_count_up_to_bias_and_norm_terms():
    """Megatron (Narayanan eq. 3 x 3/4): 72*L*h^2*(1 + s/(6h) + V/(12*L*h)) per token counts
    only the matmuls; 6N adds 6 * (13*L*h + 2*h) for biases and LayerNorms."""
    L, h, s, V = 12, 768, 1024, 50257
    megatron = 72 * L * h * h + 12 * L * h * s + 6 * V * h  # the expanded bracket
    assert GPT2_FLOPS_PER_TOKEN_S1024 - megatron == 6 * (13 * L * h + 2 * h)


def test_mfu_llama3_table4_consistency():
    # Llama 3 Table 4: 430 TFLOP/s per GPU <-> 43% MFU on H100 (989 TFLOP/s dense BF16).
    fpt = 1e9
    tokens_per_sec = 430e12 * 16 / fpt  # 16 GPUs each doing 430 TFLOP/s of model FLOPs
    got = F.mfu(
        tokens_per_sec=tokens_per_sec,
        flops_per_token=fpt,
        num_devices=16,
        peak_flops_per_device=F.PEAK_FLOPS_BF16["H100-SXM"],
    )
    assert got == pytest.approx(0.4346, abs=1e-3)
    assert 0.43 <= round(got, 2) <= 0.44
    # HFU with full recompute: 8N instead of 6N on the parameter term.
    assert F.hfu(
        tokens_per_sec=1.0, hardware_flops_per_token=8.0, num_devices=1, peak_flops_per_device=6.0
    ) == pytest.approx(4 / 3)
    with pytest.raises(ValueError):
        F.mfu(tokens_per_sec=1.0, flops_per_token=1.0, num_devices=0, peak_flops_per_device=1.0)


@pytest.mark.parametrize(
    "name, peak",
    [
        ("NVIDIA H100 80GB HBM3", 989.4e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA A100-PCIE-40GB", 312e12),
        ("NVIDIA B200", 2250e12),
        ("NVIDIA A10", None),
        ("NVIDIA GeForce RTX 4090", None),
        ("NVIDIA H100 NVL", None),
    ],
)
def test_match_gpu_peak(name, peak):
    assert F.match_gpu_peak(name) == peak


def test_cpu_peak_measured_then_cached(tmp_path, monkeypatch):
    prev = torch.get_num_threads()
    flops, method = F.peak_flops(torch.device("cpu"), dtype="32-true", threads=1, cache_dir=str(tmp_path))
    assert flops > 1e8 and method == "measured:cpu-fp32-gemm:threads=1"
    assert torch.get_num_threads() == prev  # restored
    cache = json.loads((tmp_path / "peak_flops.json").read_text())
    assert len(cache) == 1 and "threads=1" in next(iter(cache)) and torch.__version__ in next(iter(cache))

    # Later calls reuse it without measuring: every run on this machine shares one MFU denominator.
    def no_measuring(*a, **k):
        raise AssertionError("measured again although the cache holds this key")

    monkeypatch.setattr(F, "_measure_gemm_flops", no_measuring)
    assert F.peak_flops(torch.device("cpu"), dtype="fp32", threads=1, cache_dir=str(tmp_path)) == (flops, method)

    # Another thread count is another key: measured (fake 1 GFLOP/s here) and added beside the first.
    monkeypatch.setattr(F, "_measure_gemm_flops", lambda *a, **k: 1e9)
    got = F.peak_flops(torch.device("cpu"), dtype="fp32", threads=2, cache_dir=str(tmp_path))
    assert got == (1e9, "measured:cpu-fp32-gemm:threads=2")
    assert len(json.loads((tmp_path / "peak_flops.json").read_text())) == 2
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


def test_cpu_peak_uses_current_thread_count_by_default(tmp_path, monkeypatch):
    monkeypatch.setattr(F, "_measure_gemm_flops", lambda *a, **k: 2e9)
    _, method = F.peak_flops(torch.device("cpu"), dtype="fp32", cache_dir=str(tmp_path))
    assert method == f"measured:cpu-fp32-gemm:threads={torch.get_num_threads()}"


def test_measurement_arithmetic_with_fake_timer():
    ticks = iter(range(0, 10_000))  # every timer call advances 1 "second"
    got = F._measure_gemm_flops(
        torch.device("cpu"), torch.float32, n=8, repeat_s=0.2, repeats=2, timer=lambda: float(next(ticks))
    )
    assert got == 2 * 8**3  # k = 1 matmul per 1-second repeat


def test_corrupt_cache_is_remeasured(tmp_path, monkeypatch):
    (tmp_path / "peak_flops.json").write_text("{not json")
    monkeypatch.setattr(F, "_measure_gemm_flops", lambda *a, **k: 3e9)
    assert F.peak_flops(torch.device("cpu"), dtype="bf16", threads=1, cache_dir=str(tmp_path))[0] == 3e9


def test_unknown_dtype_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="dtype='int8'"):
        F.peak_flops(torch.device("cpu"), dtype="int8", cache_dir=str(tmp_path))


def test_a_peak_measured_under_load_is_measured_again_later_and_the_cache_keeps_the_highest(tmp_path, monkeypatch):
    readings = iter([1e9, 3e9, 2e9])
    loads = iter([0.6, 0.0, 0.0])
    monkeypatch.setattr(
        F, "_measure_under", lambda *a, **k: (next(readings), {"other_cpu_share": next(loads), "loadavg_1m": 1.0})
    )
    cpu = torch.device("cpu")
    first = F.peak_flops_info(cpu, dtype="fp32", threads=1, cache_dir=str(tmp_path))
    assert first.flops == 1e9 and first.under_load  # the machine was busy: on record, with its date
    (entry,) = json.loads((tmp_path / "peak_flops.json").read_text()).values()
    assert entry["other_cpu_share"] == 0.6 and entry["date"] and len(entry["history"]) == 1
    assert (
        F.peak_flops_info(cpu, dtype="fp32", threads=1, cache_dir=str(tmp_path)).flops == 1e9
    )  # not an hour old: reused
    now = __import__("time").time()
    monkeypatch.setattr(F.time, "time", lambda: now + F.REMEASURE_AFTER_S + 1)
    second = F.peak_flops_info(cpu, dtype="fp32", threads=1, cache_dir=str(tmp_path))
    assert second.flops == 3e9 and not second.under_load  # measured again on a quiet machine
    # a run that achieved more than the peak: measured again; a lower reading never lowers the peak
    third = F.recalibrate(cpu, dtype="fp32", threads=1, cache_dir=str(tmp_path), achieved=4e9)
    assert third.flops == 3e9
    (entry,) = json.loads((tmp_path / "peak_flops.json").read_text()).values()
    assert [h["flops"] for h in entry["history"]] == [1e9, 3e9, 2e9]


def test_an_mfu_above_1_is_a_calibration_error_not_a_figure():
    from framework.base.metrics.emit import MetricEmitter
    from framework.rank.callbacks.step_metrics import StepMetrics

    sm = StepMetrics(
        clock=None,
        tokens_per_step=256,
        flops_per_token=100,
        peak_flops=1000.0,
        num_devices=2,
        log_every_n_steps=1,
        warmup_steps_excluded=0,
        emit=MetricEmitter(),
    )
    assert sm._utilization(10.0, "perf/") == {"perf/mfu": 0.5, "perf/hfu": 0.5}
    assert sm.calibration_error is None
    assert sm._utilization(40.0, "perf/", "_mean") == {}  # MFU 2.0: not logged
    assert sm.calibration_error == 40.0 * 100 / 2  # achieved FLOP/s per device
    assert F.check_mfu(1.0) and not F.check_mfu(1.01) and not F.check_mfu(-0.1)


def test_a_peak_cached_without_its_load_is_measured_again_after_an_hour(tmp_path, monkeypatch):
    key = F._key(torch.device("cpu"), "fp32", 1)[4]
    (tmp_path / "peak_flops.json").write_text(json.dumps({key: {"flops": 1e9, "measured_at": 0.0}}))
    monkeypatch.setattr(F, "_measure_under", lambda *a, **k: (2e9, {"other_cpu_share": 0.0}))
    info = F.peak_flops_info(torch.device("cpu"), dtype="fp32", threads=1, cache_dir=str(tmp_path))
    assert info.flops == 2e9 and info.other_cpu_share == 0.0
