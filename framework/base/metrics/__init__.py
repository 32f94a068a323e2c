"""Performance accounting: FLOPs per token, peak FLOP/s per device, MFU and HFU."""

from framework.base.metrics.flops import (
    FLOPS_CONVENTION,
    PEAK_FLOPS_BF16,
    flops_per_token,
    hfu,
    match_gpu_peak,
    mfu,
    peak_flops,
)

__all__ = [
    "FLOPS_CONVENTION",
    "PEAK_FLOPS_BF16",
    "flops_per_token",
    "hfu",
    "match_gpu_peak",
    "mfu",
    "peak_flops",
]
