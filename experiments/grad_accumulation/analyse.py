"""Gradient-accumulation study: repeats of the sweep side by side, activation memory against the cost model.

Reads the ``compare.csv`` of one or more runs of ``experiment=grad_accumulation`` (each made with
``python -m framework.compare ... --metrics tokens_per_sec,data_wait_frac,comm_frac,comm_bytes,peak_mem_GiB,mem/activation_peak_bytes,final_loss``)
and writes, per micro-batch size: tokens/s of each repeat and their mean, the measured activation
peak (``mem/activation_peak_bytes``, max over ranks) beside the cost model's
(:func:`framework.base.cost.activations.activation_bytes_per_rank`, fp32, no dropout, fused attention
as ``recompute="selective"``, as ``benchmarks/cost_model_validation.py`` uses it) and Korthikanti
Table 2's bf16 figure ``s·b·h·(34 + 5·a·s/h)`` per layer (with dropout, no logits), the final loss.

    python experiments/grad_accumulation/analyse.py REP1/compare.csv REP2/compare.csv \
        --out experiments/grad_accumulation
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

MIB = 2**20
# gpt_tiny at the preset's data shape (conf/model/gpt_tiny.yaml, conf/data/stdlib_code.yaml)
SHAPE = dict(n_layer=4, d_model=128, n_head=4, vocab_size=4096, seq_len=128, d_ff=512, max_seq_len=256)


def model_bytes(micro: int) -> tuple[float, float]:
    """(cost model fp32 bytes per rank, Korthikanti Table 2 bf16 bytes for the layers) at micro-batch ``micro``."""
    from framework.base.cost.activations import activation_bytes_per_rank
    from framework.base.cost.shape import ModelShape

    shape = ModelShape(**SHAPE)
    ours = activation_bytes_per_rank(
        shape,
        micro_batch_size=micro,
        tp=1,
        pp=1,
        n_microbatches=1,
        sequence_parallel=False,
        recompute="selective",
        act_bytes=4,
        dropout=False,
    )["total"]
    s, h, a, L = SHAPE["seq_len"], SHAPE["d_model"], SHAPE["n_head"], SHAPE["n_layer"]
    table2 = L * s * micro * h * (34 + 5 * a * s / h)
    return ours, table2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv", nargs="+", type=Path, help="compare.csv of each repeat")
    parser.add_argument("--out", type=Path, required=True, help="folder for results.md and the PNGs")
    args = parser.parse_args()
    reps = [{int(r["trainer.micro_batch_size"]): r for r in csv.DictReader(open(p))} for p in args.csv]
    micros = sorted(set.intersection(*(set(r) for r in reps)))
    lines = [
        "| micro_batch_size | grad_accum_steps | tokens/s per repeat | tokens/s mean | data_wait | comm | "
        "activations MiB meas | cost model (fp32) | Table 2 (bf16, layers) | peak RSS GiB | final loss |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    rows = []
    for m in micros:
        tps = [float(r[m]["tokens_per_sec"]) for r in reps]
        act = max(float(r[m]["mem/activation_peak_bytes"]) for r in reps)
        ours, t2 = model_bytes(m)
        mean = sum(tps) / len(tps)
        rows.append((m, tps, mean, act, ours, t2))
        last = reps[-1][m]
        lines.append(
            f"| {m} | {16 // (2 * m)} | {' / '.join(f'{t:,.0f}' for t in tps)} | {mean:,.0f} | "
            f"{float(last['data_wait_frac']):.3f} | {float(last['comm_frac']):.3f} | {act / MIB:.2f} | "
            f"{ours / MIB:.2f} | {t2 / MIB:.2f} | {float(last['peak_mem_GiB']):.3f} | "
            f"{' / '.join(str(round(float(r[m]['final_loss']), 4)) for r in reps)} |"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    xs = [r[0] for r in rows]
    a1.plot(xs, [r[3] / MIB for r in rows], "o-", label="measured (saved tensors, max over ranks)")
    a1.plot(xs, [r[4] / MIB for r in rows], "s--", label="cost model, fp32 no dropout")
    a1.plot(xs, [r[5] / MIB for r in rows], "^:", label="Korthikanti Table 2, bf16 + dropout, layers only")
    a1.set(
        xscale="log",
        yscale="log",
        xlabel="micro_batch_size (grad_accum_steps = 8 / micro)",
        ylabel="MiB per rank",
        title="Activation memory at global batch 16",
    )
    a1.set_xticks(xs, [str(x) for x in xs])
    a1.legend(fontsize=7)
    a1.grid(alpha=0.3)
    for i in range(len(reps)):
        a2.plot(xs, [r[1][i] for r in rows], "o", alpha=0.6, label=f"repeat {i + 1}")
    a2.plot(xs, [r[2] for r in rows], "k-", label="mean")
    a2.set(xscale="log", xlabel="micro_batch_size", ylabel="tokens/s", title="Throughput (2 DDP ranks, shared 2 cores)")
    a2.set_xticks(xs, [str(x) for x in xs])
    a2.set_ylim(bottom=0)
    a2.legend(fontsize=7)
    a2.grid(alpha=0.3)
    for ax in (a1, a2):
        ax.minorticks_off()
    fig.tight_layout()
    fig.savefig(args.out / "grad_accumulation.png", dpi=110)


if __name__ == "__main__":
    main()
