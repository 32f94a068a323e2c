"""The cluster-layout study: a 175B GPT on 1024 x 8 H100 (the cost model, no run).

    PYTHONPATH=$PWD python experiments/cluster_layout/study.py    # writes results.md and *.png here

Every figure comes from framework.base.cost (the planner's model) with conf/cluster/h100_sxm.yaml and
conf/model/gpt3_175b.yaml; see README.md for the question and the reading.
"""

from __future__ import annotations

import os
import sys
from dataclasses import replace

import yaml

from framework.base.config.schema import ModelConfig
from framework.base.cost.estimate import estimate
from framework.base.cost.hardware import cluster_from_dict
from framework.base.cost.layout import PlanLayout
from framework.base.cost.shape import ModelShape
from framework.driver.cli import CONF_DIR
from framework.driver.plan.report import markdown_table, plot_plan, rows
from framework.driver.plan.search import SearchSpace, search

HERE = os.path.dirname(os.path.abspath(__file__))
GIB = 2**30
NODES, B, S = 1024, 1536, 2048  # GPT-3's batch: 1536 x 2048 = 3.1M tokens (Brown et al. 2020, Table 2.1)
TOKENS = 300e9  # GPT-3's training tokens


def load():
    mc = ModelConfig(**yaml.safe_load((CONF_DIR / "model" / "gpt3_175b.yaml").read_text()))
    shape = ModelShape.from_model_config(mc, seq_len=S)
    cluster = cluster_from_dict(yaml.safe_load((CONF_DIR / "cluster" / "h100_sxm.yaml").read_text()))
    return shape, cluster


def per_gpu(e) -> float:
    return e.tokens_per_sec / e.layout.world_size


def top_layouts(shape, cluster, out: list[str]):
    res = search(shape, cluster, world=NODES * 8, global_batch_size=B)
    rs = rows(res, cluster, tokens=TOKENS, top_k=10)
    keys = [
        "rank",
        "layout",
        "m",
        "weights_gib",
        "grads_gib",
        "optimizer_gib",
        "activations_gib",
        "memory_gib",
        "nvlink_gb",
        "nic_gb",
        "bubble",
        "step_s",
        "tokens_per_sec_per_gpu",
        "mfu",
        "days",
        "gpu_hours",
        "money",
        "energy_mwh",
    ]
    out += [
        f"## 1. Top layouts: 175B, {NODES} x 8 H100, global batch {B} x {S} tokens\n",
        f"{res.evaluated} layouts priced, {len(res.fitting)} fit; dropped: {res.dropped}.\n",
        markdown_table(rs, keys),
    ]
    best = res.fitting[0]
    out.append(
        "Best layout's step time by part (ms): "
        + ", ".join(f"{k} {v * 1e3:.0f}" for k, v in best.time.parts().items() if v > 0)
        + "\n"
    )
    plot_plan(res, os.path.join(HERE, "top_layouts"), top_k=30)
    return res


def dp_vs_3d(shape, cluster, out: list[str]):
    out.append("## 2. Pure DP (ZeRO) vs TP+PP+DP\n")
    lines = [
        "| global batch (seqs) | GPUs | best pure DP | tok/s/GPU | best TP+PP+DP | tok/s/GPU | 3D / DP |",
        "|---|---|---|---|---|---|---|",
    ]
    for gpus, gbs in ((NODES * 8, 8192), (NODES * 8, 16384), (512, 1536), (512, 4096)):
        dp = search(
            shape, cluster, world=gpus, global_batch_size=gbs, space=SearchSpace(tp_degrees=(1,), pp_degrees=(1,))
        )
        full = search(shape, cluster, world=gpus, global_batch_size=gbs)
        d = dp.fitting[0] if dp.fitting else None
        f = full.fitting[0]
        lines.append(
            f"| {gbs} | {gpus} | {d.layout.describe() if d else 'none fits (smallest ' + format(dp.closest_miss.memory_bytes / GIB, '.0f') + ' GiB)'} | "
            f"{per_gpu(d) if d else 0:.0f} | {f.layout.describe()} | {per_gpu(f):.0f} | "
            f"{per_gpu(f) / per_gpu(d) if d else float('inf'):.2f} |"
        )
        if d and gpus == NODES * 8 and gbs == 8192:
            out_parts = d.time.parts()
    out += [
        "\n".join(lines) + "\n",
        "Pure DP's step at 8192 GPUs, batch 8192, by part (ms): "
        + ", ".join(f"{k} {v * 1e3:.0f}" for k, v in out_parts.items() if v > 0)
        + "\n",
    ]


def tp_sweep(shape, cluster, out: list[str]):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.append(
        "## 3. TP 1 -> 2 -> 4 -> 8 (pp 16, dp = 8192 / (16 tp), ZeRO-1, b 1, selective recompute, SP when tp > 1)\n"
    )
    lines = [
        "| tp | dp | weights GiB | grads GiB | optimizer GiB | activations GiB | total GiB | TP calls/step | TP NVLink GB/step | "
        "TP time ms | TP exposed ms | step s | tok/s/GPU |",
        "|" + "---|" * 13,
    ]
    es = []
    for t in (1, 2, 4, 8):
        lay = PlanLayout(
            dp=8192 // (16 * t),
            tp=t,
            pp=16,
            micro_batch_size=1,
            global_batch_size=B,
            zero_stage=1,
            recompute="selective",
            sequence_parallel=t > 1,
        )
        e = estimate(shape, lay, cluster)
        es.append(e)
        tpc = [c for c in e.collectives if c.group == "tp"]
        calls = sum(c.calls for c in tpc)
        tp_bytes = sum(c.wire_bytes for c in tpc)
        tp_time = sum(v for k, v in e.time.comm_total.items() if k.startswith("tp_"))
        lines.append(
            f"| {t} | {lay.dp} | {e.states.weights / GIB:.1f} | {e.states.grads / GIB:.1f} | {e.states.optimizer / GIB:.1f} | "
            f"{e.activations['total'] / GIB:.1f} | {e.memory_bytes / GIB:.1f}{'' if e.fits else ' (> usable)'} | {calls:.0f} | "
            f"{tp_bytes / 1e9:.1f} | {tp_time * 1e3:.0f} | {e.time.tp_exposed * 1e3:.0f} | {e.time.total:.3f} | {per_gpu(e):.0f} |"
        )
    out.append("\n".join(lines) + "\n")
    e2, e4 = es[1], es[2]
    b2 = sum(c.wire_bytes for c in e2.collectives if c.group == "tp")
    b4 = sum(c.wire_bytes for c in e4.collectives if c.group == "tp")
    out.append(
        f"TP 2 -> 4: TP wire bytes per GPU per step x{b4 / b2:.2f} (ring factor (t-1)/t: 1/2 -> 3/4 = x1.5), TP calls per "
        f"step x{sum(c.calls for c in e4.collectives if c.group == 'tp') / sum(c.calls for c in e2.collectives if c.group == 'tp'):.2f}, "
        f"exposed TP time {e2.time.tp_exposed * 1e3:.0f} -> {e4.time.tp_exposed * 1e3:.0f} ms, memory "
        f"{e2.memory_bytes / GIB:.1f} -> {e4.memory_bytes / GIB:.1f} GiB, step {e2.time.total:.3f} -> {e4.time.total:.3f} s.\n"
    )
    fig, ax = plt.subplots(figsize=(6, 4))
    bottom = [0.0] * 4
    for name, vals in (
        ("weights", [e.states.weights for e in es]),
        ("grads", [e.states.grads for e in es]),
        ("optimizer", [e.states.optimizer for e in es]),
        ("activations", [e.activations["total"] for e in es]),
    ):
        ax.bar(["tp1", "tp2", "tp4", "tp8"], [v / GIB for v in vals], bottom=bottom, label=name)
        bottom = [b + v / GIB for b, v in zip(bottom, vals)]
    ax.axhline(cluster.usable_memory_bytes / GIB, color="k", ls="--", lw=1, label="usable")
    ax.set_ylabel("memory per GPU (GiB)")
    ax.set_title("175B, pp16, ZeRO-1, b1, selective recompute")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(HERE, "memory_vs_tp.png"), dpi=110)
    plt.close(fig)


def scaling(shape, cluster, res, out: list[str]):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    chosen = next(e for e in res.fitting if e.layout.tp * e.layout.pp <= 64)  # runs from 64 GPUs up
    lay0 = chosen.layout
    per_replica = B // lay0.dp  # sequences per data-parallel replica at 8192 GPUs
    out.append(f"## 4. Scaling {lay0.describe()} (the best layout with tp x pp <= 64) from 64 to 8192 GPUs\n")
    lines = [
        "| GPUs | dp | fixed global batch 1536: step s | tok/s/GPU | MFU | fixed batch per replica ("
        f"{per_replica}): global batch | step s | tok/s/GPU | MFU |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    xs, strong, weak = [], [], []
    for gpus in (64, 128, 256, 512, 1024, 2048, 4096, 8192):
        dp = gpus // (lay0.tp * lay0.pp)
        row = [str(gpus), str(dp)]
        for gbs, store in ((B, strong), (per_replica * dp, weak)):
            if gbs % (dp * lay0.micro_batch_size):
                row += ([str(gbs)] if store is weak else []) + ["-", "-", "-"]
                store.append(float("nan"))
                continue
            e = estimate(shape, replace(lay0, dp=dp, global_batch_size=gbs), cluster)
            row += ([str(gbs)] if store is weak else []) + [
                f"{e.time.total:.2f}{'' if e.fits else ' (no fit)'}",
                f"{per_gpu(e):.0f}",
                f"{e.mfu:.1%}",
            ]
            store.append(per_gpu(e))
        xs.append(gpus)
        lines.append("| " + " | ".join(row) + " |")
    out.append("\n".join(lines) + "\n")
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(xs, strong, "o-", label=f"fixed global batch {B}")
    ax.plot(xs, weak, "s-", label=f"fixed batch per replica {per_replica}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("GPUs")
    ax.set_ylabel("predicted tokens/s per GPU")
    ax.set_title(lay0.describe(), fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(HERE, "scaling.png"), dpi=110)
    plt.close(fig)


def main() -> int:
    shape, cluster = load()
    out = [
        "# Cluster layout study: results (generated by study.py)\n",
        f"Model gpt3_175b ({shape.num_params() / 1e9:.1f}B), cluster h100_sxm (achievable_fraction "
        f"{cluster.achievable_fraction}, usable {cluster.usable_memory_bytes / GIB:.1f} GiB/GPU), bf16 with fp32 master "
        f"weights, {TOKENS:.0e} tokens priced at {cluster.price_per_gpu_hour}/GPU-hour and {cluster.power_w:.0f} W.\n",
    ]
    res = top_layouts(shape, cluster, out)
    dp_vs_3d(shape, cluster, out)
    tp_sweep(shape, cluster, out)
    scaling(shape, cluster, res, out)
    with open(os.path.join(HERE, "results.md"), "w", encoding="utf-8") as f:
        f.write("\n".join(out))
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
