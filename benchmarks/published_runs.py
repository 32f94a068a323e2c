"""Reproduce published per-GPU throughput / MFU from model shape, layout, batch and hardware alone.

    PYTHONPATH=$PWD python benchmarks/published_runs.py                 # the cluster files' calibration
    PYTHONPATH=$PWD python benchmarks/published_runs.py --calibrate     # fit achievable_fraction per GPU type

Each row gives the published layout (TP, PP, DP, global batch, sequence length) and hardware;
the cost model (:mod:`framework.cost`) predicts the step time and this script prints the
published figure beside the prediction in the source's own metric, with the error per row and
the median and worst error.

Sources (rows transcribed; check them against the papers before quoting):

- Narayanan et al. SC'21 ("Efficient Large-Scale Language Model Training on GPU Clusters Using
  Megatron-LM"), Table 1: A100 80GB (DGX A100, 8 x 200 Gb/s HDR per node), achieved TFLOP/s per
  GPU by eq. 3 (hardware FLOPs: full recompute, 4 passes), s = 2048, V = 51200. Not published
  per row and assumed here: micro-batch 1, the plain 1F1B schedule, full recompute, DDP without a
  distributed optimizer, fp16/bf16 with fp32 main grads.
- Llama 3 (Dubey et al. 2024), Table 4: 405B on H100 (400 Gb/s RoCE per GPU), TP 8, PP 16,
  s = 8192, 16M tokens per batch; BF16 MFU (430 TFLOP/s <-> 43%: docs/references.md §8). The CP = 16
  row (131K context) is left out: the cost model has no context parallelism. Assumed: micro-batch
  1, 1F1B (the paper's uneven interleaving not modelled), FSDP without resharding after forward
  modelled as ZeRO stage 2, FlashAttention (= ``selective``: no s x s scores kept).
- torchtitan ``docs/performance.md`` (the Llama 3 section): 64 A100 80GB, FSDP2 on all 64
  (ZeRO stage 3), local batch 1, s = 8192; WPS (tokens/s per GPU) and MFU; 8B with selective op AC,
  70B with full AC.

MegaScale (NSDI'24) Table 2 is not reproduced: its per-row layout and batch were not available
to transcribe here (docs/references.md quotes only its 175B MFU).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass, replace

import yaml

from framework.cli import CONF_DIR
from framework.cost.estimate import estimate
from framework.cost.flops import megatron_flops_per_step
from framework.cost.hardware import cluster_from_dict
from framework.cost.layout import PlanLayout
from framework.cost.shape import ModelShape


def gpt(L: int, h: int, a: int, s: int = 2048) -> ModelShape:
    """Narayanan et al.'s GPT shapes: V = 51200, s = 2048, learned positions, 4h MLP."""
    return ModelShape(n_layer=L, d_model=h, n_head=a, vocab_size=51200, seq_len=s, max_seq_len=s)


def llama(L: int, h: int, a: int, ff: int, s: int = 8192) -> ModelShape:
    """Llama 3 shapes: 8 KV heads, SwiGLU, V = 128256, untied, RoPE, no biases, no dropout."""
    return ModelShape(n_layer=L, d_model=h, n_head=a, n_kv_head=8, d_ff=ff, mlp="swiglu", vocab_size=128256, seq_len=s,
                      bias=False, tied_embeddings=False, learned_positions=False, dropout=False)


@dataclass(frozen=True)
class Row:
    source: str
    name: str
    shape: ModelShape
    cluster: str
    layout: PlanLayout
    metric: str  # "hfu_tflops" (Narayanan eq. 3 per GPU), "mfu", "tokens_per_gpu"
    published: float


def N(name, L, h, a, t, p, gpus, B, tflops):
    d = gpus // (t * p)
    return Row("Narayanan SC'21 T1", name, gpt(L, h, a), "a100_80gb",
               PlanLayout(dp=d, tp=t, pp=p, micro_batch_size=1, global_batch_size=B, recompute="full",
                          sequence_parallel=False, precision="bf16_main_grad"), "hfu_tflops", tflops)


ROWS = [
    N("18.4B", 40, 6144, 48, 8, 1, 256, 1024, 135),
    N("39.1B", 48, 8192, 64, 8, 2, 512, 1536, 138),
    N("76.1B", 60, 10240, 80, 8, 4, 1024, 1792, 140),
    N("145.6B", 80, 12288, 96, 8, 8, 1536, 2304, 148),
    N("310.1B", 96, 16384, 128, 8, 16, 1920, 2160, 155),
    N("529.6B", 105, 20480, 128, 8, 35, 2520, 2520, 163),
    N("1008B", 128, 25600, 160, 8, 64, 3072, 3072, 163),
    Row("Llama 3 T4", "405B 8192 GPUs", llama(126, 16384, 128, 53248), "h100_sxm",
        PlanLayout(dp=64, tp=8, pp=16, micro_batch_size=1, global_batch_size=2048, zero_stage=2,
                   recompute="selective", sequence_parallel=True), "mfu", 0.43),
    Row("Llama 3 T4", "405B 16384 GPUs", llama(126, 16384, 128, 53248), "h100_sxm",
        PlanLayout(dp=128, tp=8, pp=16, micro_batch_size=1, global_batch_size=2048, zero_stage=2,
                   recompute="selective", sequence_parallel=True), "mfu", 0.41),
    Row("torchtitan perf", "Llama3 8B FSDP 64xA100", llama(32, 4096, 32, 14336), "a100_80gb",
        PlanLayout(dp=64, tp=1, pp=1, micro_batch_size=1, global_batch_size=64, zero_stage=3,
                   recompute="selective"), "mfu", 0.582),
    Row("torchtitan perf", "Llama3 70B FSDP 64xA100", llama(80, 8192, 64, 28672), "a100_80gb",
        PlanLayout(dp=64, tp=1, pp=1, micro_batch_size=1, global_batch_size=64, zero_stage=3,
                   recompute="full"), "mfu", 0.517),
]


def load_cluster(name: str, fraction: float | None = None):
    raw = yaml.safe_load((CONF_DIR / "cluster" / f"{name}.yaml").read_text())
    if fraction is not None:
        raw["achievable_fraction"] = fraction
    return cluster_from_dict(raw, where=name)


def predict(row: Row, fraction: float | None = None) -> tuple[float, object]:
    """The row's metric as the cost model predicts it, and the estimate."""
    c = load_cluster(row.cluster, fraction)
    e = estimate(row.shape, row.layout, c)
    if row.metric == "hfu_tflops":
        sh = row.shape
        f = megatron_flops_per_step(batch=row.layout.global_batch_size, seq_len=sh.seq_len, n_layer=sh.n_layer,
                                    d_model=sh.d_model, vocab=sh.vocab_size, recompute=True)
        return f / e.time.total / row.layout.world_size / 1e12, e
    if row.metric == "tokens_per_gpu":
        return e.tokens_per_sec / row.layout.world_size, e
    return e.mfu, e


def calibrate() -> dict[str, float]:
    """Per GPU type, the achievable fraction (grid 0.30-1.00, step 0.01) minimising the median |log error|."""
    out = {}
    for cl in sorted({r.cluster for r in ROWS}):
        rows = [r for r in ROWS if r.cluster == cl]
        best = min((statistics.median(abs(predict(r, f / 100)[0] / r.published - 1) for r in rows), f / 100)
                   for f in range(30, 101))
        out[cl] = best[1]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calibrate", action="store_true", help="fit achievable_fraction per GPU type and use it")
    args = ap.parse_args()
    fractions = calibrate() if args.calibrate else {}
    if fractions:
        print("calibrated achievable_fraction: " + ", ".join(f"{k}={v:.2f}" for k, v in fractions.items()))
    errs = []
    print(f"{'source':<18} {'run':<26} {'layout':<44} {'metric':<11} {'published':>10} {'predicted':>10} {'error':>7}")
    for r in ROWS:
        pred, e = predict(r, fractions.get(r.cluster))
        err = pred / r.published - 1
        errs.append(abs(err))
        fmt = "{:.1%}" if r.metric == "mfu" else "{:.1f}"
        print(f"{r.source:<18} {r.name:<26} {r.layout.describe():<44} {r.metric:<11} {fmt.format(r.published):>10} "
              f"{fmt.format(pred):>10} {err:>+7.1%}" + ("" if e.fits else "  (model: does not fit memory)"))
    print(f"rows {len(ROWS)}, sources {len({r.source for r in ROWS})}: median |error| {statistics.median(errs):.1%}, "
          f"worst {max(errs):.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
