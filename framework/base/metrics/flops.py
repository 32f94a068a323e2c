"""FLOPs per token, peak FLOP/s per device, MFU and HFU.

Conventions (docs/references.md §2):

- ``flops_per_token = 6N + 12 * L * h * s`` (:mod:`framework.base.cost.flops`, re-exported here) (PaLM, Chowdhery et al. 2022, Appendix B; also
  nanoGPT's ``estimate_mfu``). 6N is the forward (2N) and backward (4N) matmuls over the
  parameters; ``12 * L * h * s`` is the attention score and value matmuls, forward and
  backward. N is the non-embedding parameters plus the output projection V * h; for a tied
  head that is all parameters except the position embedding (:data:`FLOPS_CONVENTION`).
- MFU (PaLM section 4.1): observed tokens/s times model FLOPs per token, over the devices'
  summed peak FLOP/s. Model FLOPs exclude rematerialization; HFU counts it.
- On CUDA the peak is the dense BF16 tensor-core figure of :data:`PEAK_FLOPS_BF16` whatever the
  run's precision (the usual way MFU is reported). On CPU, and on a GPU not in the table, it is
  measured by a timed GEMM and cached on disk (:func:`peak_flops_info`): the best of several
  short timings, with its date and the load during it (the CPU share of other processes); a peak
  measured under load is measured again by a later run (at most hourly) and the cache keeps the
  highest; a run whose achieved FLOP/s exceed the peak (:func:`check_mfu`) is a calibration error,
  not an MFU above 1: the figure is not logged and the peak is measured again (:func:`recalibrate`).
"""

from __future__ import annotations

import json
import os
import platform
import re
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from framework.base.cost.flops import flops_per_token, recompute_flops_per_token  # noqa: F401  (the formulas live in the cost model)

FLOPS_CONVENTION = "palm_appB:6N+12*L*h*s;N=params-wpe(tied head once)"
"""Log as an MLflow param next to ``perf/mfu`` so the N convention is on record."""

PEAK_FLOPS_BF16: dict[str, float] = {
    # Dense (no sparsity) BF16 tensor-core FLOP/s per GPU.
    "A100": 312e12,  # NVIDIA A100 datasheet; nanoGPT estimate_mfu; Megatron-LM gpu_peak_flops.py
    "H100-SXM": 989.4e12,  # NVIDIA H100 datasheet: 1,979 "with sparsity", half without
    "H100-PCIe": 756e12,  # Megatron-LM megatron/training/gpu_peak_flops.py ("H100-PCIe": 756)
    "H200": 989e12,  # same GH100 compute as H100 SXM; Megatron-LM gpu_peak_flops.py ("H200": 989)
    "B200": 2250e12,  # Megatron-LM gpu_peak_flops.py ("B200": 2250, dense)
}
"""Sources: docs/references.md §1 (hardware figures)."""

# (pattern on the CUDA device name, table key); the first match wins, so PCIe precedes SXM.
# "H100 NVL" (a different clock and power budget) is left out on purpose: it is measured.
_GPU_PATTERNS: list[tuple[str, str]] = [
    (r"\bH100\b.*\bPCIE\b", "H100-PCIe"),
    (r"\bH100\b(?!.*\bNVL\b)", "H100-SXM"),
    (r"\bH200\b", "H200"),
    (r"\bB200\b", "B200"),
    (r"\bA100\b", "A100"),
]

_CACHE_FILE = "peak_flops.json"
_DTYPES = {
    "fp32": torch.float32,
    "32-true": torch.float32,
    "32": torch.float32,
    "bf16": torch.bfloat16,
    "bf16-mixed": torch.bfloat16,
    "bf16-true": torch.bfloat16,
    "fp16": torch.float16,
    "16-mixed": torch.float16,
    "16-true": torch.float16,
}
_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def _gpu_key(device_name: str) -> str | None:
    name = device_name.upper()
    for pattern, key in _GPU_PATTERNS:
        if re.search(pattern, name):
            return key
    return None


def match_gpu_peak(device_name: str) -> float | None:
    """Dense BF16 peak FLOP/s for a CUDA device name (``torch.cuda.get_device_name()``), e.g.
    ``"NVIDIA H100 80GB HBM3"`` -> 989.4e12; None when the GPU is not in the table."""
    key = _gpu_key(device_name)
    return PEAK_FLOPS_BF16[key] if key else None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown-cpu"


def _measure_gemm_flops(
    device: torch.device,
    dtype: torch.dtype,
    *,
    n: int,
    repeat_s: float = 0.2,
    repeats: int = 3,
    timer: Callable[[], float] = time.perf_counter,
) -> float:
    """Best-of-``repeats`` FLOP/s of ``n x n`` matmuls (2 * n^3 FLOPs each), each repeat ~``repeat_s``."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(n, n, generator=gen).to(device=device, dtype=dtype)
    b = torch.randn(n, n, generator=gen).to(device=device, dtype=dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def run(k: int) -> float:
        sync()
        t0 = timer()
        for _ in range(k):
            torch.mm(a, b, out=out)
        sync()
        return max(timer() - t0, 1e-9)

    one = run(1)  # warm-up (allocations, kernel selection)
    one = min(one, run(1))
    k = max(1, int(repeat_s / one))
    best = min(run(k) for _ in range(repeats))
    return 2.0 * n**3 * k / best


def _read_cache(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_cache_entry(path: str, key: str, entry: dict) -> None:
    """Merge one entry into the JSON cache atomically (temp file + os.replace); concurrent
    writers may drop each other's new entries, which only costs a re-measurement."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    data = _read_cache(path)
    data[key] = entry
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path) or ".", prefix=".peak_flops.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2, sort_keys=True)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


PEAK_REPEATS = 5
"""Timed GEMM repeats of a peak measurement (~0.2 s each); the fastest counts."""
UNDER_LOAD_SHARE = 0.10
"""A peak measured while other processes used at least this share of the CPUs is under load (it reads low)."""
REMEASURE_AFTER_S = 3600.0
"""A peak measured under load is measured again by the first run this long after it (and the highest kept)."""


@dataclass(frozen=True)
class PeakInfo:
    """A device's peak FLOP/s and its provenance: ``method`` (``table:..`` | ``measured:..``), when it
    was measured (Unix s; None for the table) and the CPU share of other processes during the
    measurement (None for the table)."""

    flops: float
    method: str
    measured_at: float | None = None
    other_cpu_share: float | None = None

    @property
    def under_load(self) -> bool:
        return self.other_cpu_share is not None and self.other_cpu_share >= UNDER_LOAD_SHARE


def _measure_under(device: torch.device, tdtype: torch.dtype, n: int) -> tuple[float, dict]:
    """The GEMM's best FLOP/s and the load during it (``other_cpu_share`` of all cores: /proc/stat's
    busy time less this process's CPU time; ``loadavg_1m``)."""
    from framework.base.load_monitor import other_cpu_share, read_cpu_jiffies

    hz = float(os.sysconf("SC_CLK_TCK")) if hasattr(os, "sysconf") else 100.0
    j0, c0, t0 = read_cpu_jiffies(), time.process_time(), time.perf_counter()
    flops = _measure_gemm_flops(device, tdtype, n=n, repeats=PEAK_REPEATS)
    j1, c1, t1 = read_cpu_jiffies(), time.process_time(), time.perf_counter()
    load: dict = {}
    if j0 is not None and j1 is not None:
        load["other_cpu_share"] = other_cpu_share((j1[0] - j0[0]) / hz, c1 - c0, t1 - t0, os.cpu_count() or 1)
    try:
        load["loadavg_1m"] = os.getloadavg()[0]
    except OSError:
        pass
    return flops, load


def peak_flops(device: torch.device, *, dtype: str, threads: int | None = None, cache_dir: str) -> tuple[float, str]:
    """``(flop_per_s, method)`` of :func:`peak_flops_info` (log the method as a param)."""
    info = peak_flops_info(device, dtype=dtype, threads=threads, cache_dir=cache_dir)
    return info.flops, info.method


def _key(device: torch.device, dtype: str, threads: int | None) -> tuple:
    """``(hardware, n, tag, method, cache key, threads, torch dtype)`` of a measured peak, or None for a GPU in the table."""
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r} is not known; allowed: {', '.join(_DTYPES)}")
    tdtype = _DTYPES[dtype]
    dname = _DTYPE_NAMES[tdtype]
    if device.type == "cuda":
        gpu_name = torch.cuda.get_device_name(device)
        hw, n, tag = gpu_name, 4096, f"cuda-{dname}-gemm"
    elif device.type == "cpu":
        hw, n, tag = _cpu_model(), 1024, f"cpu-{dname}-gemm"
    else:
        raise ValueError(f"peak_flops: device type {device.type!r} is not supported (cpu, cuda)")
    n_threads = threads or torch.get_num_threads()
    method = f"measured:{tag}:threads={n_threads}" if device.type == "cpu" else f"measured:{tag}"
    return hw, n, tag, method, f"{hw}|{tag}|threads={n_threads}|torch={torch.__version__}", n_threads, tdtype


def peak_flops_info(
    device: torch.device, *, dtype: str, threads: int | None = None, cache_dir: str, at_least: float = 0.0
) -> PeakInfo:
    """Peak FLOP/s of one device and how it was obtained (:class:`PeakInfo`).

    Args:
        device: the device a rank trains on.
        dtype: ``fp32`` | ``bf16`` | ``fp16``, or a trainer precision (``32-true``, ``bf16-mixed``,
            ``16-mixed``); on CPU (and unknown GPUs) the GEMM is timed in this dtype.
        threads: torch CPU threads to measure with; None = the current ``torch.get_num_threads()``.
        cache_dir: folder of ``peak_flops.json``, the measurement cache.
        at_least: measure again unless the cached peak is above this (FLOP/s; :func:`recalibrate`).

    CUDA GPUs in :data:`PEAK_FLOPS_BF16` use the table (dense BF16, whatever ``dtype``;
    ``table:H100-SXM:bf16``). Anything else is measured (< 2 s, the best of
    :data:`PEAK_REPEATS` timings, with the load during it) and cached under a key of (CPU model or
    GPU name, threads, dtype, torch version); later calls reuse it, so the runs of a study share one
    MFU denominator, except that a peak measured under load (other processes >=
    :data:`UNDER_LOAD_SHARE` of the CPUs) is measured again once it is :data:`REMEASURE_AFTER_S`
    old. The cache keeps the highest measurement (a GEMM cannot run faster than the peak, so the
    highest is the closest), with its date and load.

    Raises:
        ValueError: an unknown dtype or device type.
    """
    device = torch.device(device)
    if device.type == "cuda":
        key = _gpu_key(torch.cuda.get_device_name(device))
        if key is not None:
            return PeakInfo(PEAK_FLOPS_BF16[key], f"table:{key}:bf16")
    hw, n, tag, method, cache_key, n_threads, tdtype = _key(device, dtype, threads)
    path = os.path.join(cache_dir, _CACHE_FILE)
    entry = _read_cache(path).get(cache_key)
    entry = entry if isinstance(entry, dict) else {}
    cached = float(entry.get("flops", 0) or 0)
    share = entry.get("other_cpu_share")
    old = PeakInfo(cached, method, entry.get("measured_at"), share)
    unknown_load = cached > 0 and share is None  # cached before the load was recorded: treated as under load
    stale = (old.under_load or unknown_load) and time.time() - float(entry.get("measured_at") or 0) > REMEASURE_AFTER_S
    if cached > 0 and cached > at_least and not stale:
        return old

    prev_threads = torch.get_num_threads()
    if n_threads != prev_threads:
        torch.set_num_threads(n_threads)
    try:
        flops, load = _measure_under(device, tdtype, n)
    finally:
        if n_threads != prev_threads:
            torch.set_num_threads(prev_threads)
    now = time.time()
    history = list(entry.get("history", []))[-9:] + [
        {"flops": flops, "date": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(now)), **load}
    ]
    if flops >= cached:
        entry = {
            "flops": flops,
            "method": method,
            "n": n,
            "measured_at": now,
            "date": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(now)),
            **load,
        }
    else:  # a lower reading (the machine is busier now): keep the best, but stop re-measuring it for a while
        entry = {**entry, "measured_at": now}
    entry["history"] = history
    _write_cache_entry(path, cache_key, entry)
    return PeakInfo(float(entry["flops"]), method, entry["measured_at"], entry.get("other_cpu_share"))


def check_mfu(value: float) -> bool:
    """Whether an MFU (or HFU) is a figure: ``0 <= value <= 1``. Above 1 the run did more FLOP/s than
    the peak says a device can: the peak is wrong (a calibration error, :func:`recalibrate`), and the
    value must not be logged."""
    return 0.0 <= value <= 1.0


def recalibrate(
    device: torch.device, *, dtype: str, threads: int | None = None, cache_dir: str, achieved: float
) -> PeakInfo:
    """Measure the peak again because a run achieved ``achieved`` FLOP/s per device, more than the
    cached peak; the cache keeps the highest. A table peak (a GPU in :data:`PEAK_FLOPS_BF16`) is not
    measured: exceeding it means the FLOPs count or the table is wrong, and is returned as it is."""
    return peak_flops_info(device, dtype=dtype, threads=threads, cache_dir=cache_dir, at_least=achieved)


def _ratio(tokens_per_sec: float, flops_per_token: float, num_devices: int, peak_flops_per_device: float) -> float:  # noqa: F811 (the keyword names the quantity; the function is the cost model's, re-exported)
    if num_devices <= 0 or peak_flops_per_device <= 0:
        raise ValueError(f"num_devices={num_devices} and peak_flops_per_device={peak_flops_per_device} must be > 0")
    return tokens_per_sec * flops_per_token / (num_devices * peak_flops_per_device)


def mfu(*, tokens_per_sec: float, flops_per_token: float, num_devices: int, peak_flops_per_device: float) -> float:  # noqa: F811 (as above)
    """Model FLOPs utilization, a fraction (PaLM section 4.1).

    ``tokens_per_sec * flops_per_token / (num_devices * peak_flops_per_device)``, with
    ``tokens_per_sec`` the whole job's throughput and ``flops_per_token`` the model FLOPs
    (:func:`flops_per_token`; no rematerialization).
    """
    return _ratio(tokens_per_sec, flops_per_token, num_devices, peak_flops_per_device)


def hfu(
    *, tokens_per_sec: float, hardware_flops_per_token: float, num_devices: int, peak_flops_per_device: float
) -> float:
    """Hardware FLOPs utilization, a fraction (PaLM section 4.1): the MFU formula with the FLOPs
    the hardware actually runs, recomputation included.

    With full activation recompute the forward runs twice, so hardware FLOPs per token are
    ``8N + 16 * L * h * s`` instead of ``6N + 12 * L * h * s`` (HFU/MFU = 4/3); selective
    recompute lands in between (PaLM: 57.8% HFU vs 46.2% MFU).
    """
    return _ratio(tokens_per_sec, hardware_flops_per_token, num_devices, peak_flops_per_device)
