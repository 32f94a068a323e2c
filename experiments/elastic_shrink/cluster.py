"""Elastic shrink at the guide's scale: a 175B GPT on 1024 x 8 H100 loses 256 nodes halfway through.

    PYTHONPATH=$PWD python experiments/elastic_shrink/cluster.py     # seconds, no ranks

Calls the planner (:func:`framework.driver.plan.search.search` on the config ``python -m framework.plan``
composes, so a change to the cost model or the cluster file shows up here when this is re-run)
and the failure simulator (:func:`framework.base.cost.failure_sim.goodput_over_seeds`). Writes
``cluster.md`` and ``cluster.json`` next to this file. Every input is a named constant below.

Cases, each training ``TRAIN_TOKENS`` tokens, the first ``LOSS_AT`` of them on 1024 nodes:

- ``no loss``: 1024 nodes to the end (the reference).
- ``keep batch``: 768 nodes after the loss, the planner's 1024-node layout with dp x 3/4, global
  batch 1536 kept (each pipeline runs 4/3 the micro-batches).
- ``shrink batch``: the same 768-node layout at global batch 1152 (3/4; LR x 3/4): each
  pipeline runs the micro-batches it ran before, and 4/3 the steps are needed for the tokens.
- ``... replanned``: the planner's best layout for 768 nodes at that batch (a fresh search).

Goodput: failures at Llama 3's per-GPU rate (docs/references.md §8), scaled to the GPUs in use;
synchronous saves of a 14-byte/parameter checkpoint at ``CKPT_BW`` every Young-optimal interval;
``RESTART_S`` per failure; the shrink itself is one more failure (restart + half an interval).
What the cost model cannot say: whether the smaller batch (and its scaled LR) needs more or
fewer tokens to the same loss; the measured small runs (``measure.py``) are the only evidence here.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from framework.base.cost.estimate import estimate  # noqa: E402
from framework.base.cost.failure_sim import Policy, goodput_over_seeds  # noqa: E402
from framework.base.cost.interval import young_interval  # noqa: E402
from framework.driver.plan.__main__ import compose, load_inputs  # noqa: E402
from framework.driver.plan.search import search  # noqa: E402

PLAN = [
    "model=gpt3_175b",
    "cluster=h100_sxm",
    "trainer.global_batch_size=1536",
    "data.seq_len=2048",
    "tracking.enabled=false",
]
NODES, LOST = 1024, 256
GLOBAL_BATCH = 1536
TRAIN_TOKENS = 300e9  # GPT-3's 300B tokens (Brown et al. 2020 §2.2)
LOSS_AT = 0.5  # share of the tokens trained before the 256 nodes are lost
PARAMS = 175e9
CKPT_BYTES = 14 * PARAMS  # bf16 weights + fp32 master + Adam m, v (ZeRO §3.1), no gradients
CKPT_BW = 500e9  # aggregate bytes/s to storage: a quarter of Llama 3's 2 TB/s (§3.3.1), as checkpoint_interval
RESTART_S = 10 * 60  # detection + rescheduling + restart + load (stated; MegaScale: back "within 15 min")
MTBF_PER_GPU_S = 54 * 86400 / 419 * 16384  # Llama 3 §3.3.4: 419 unexpected interruptions in 54 days on 16,384 GPUs
SEEDS = range(8)


def plan(nodes: int, gbs: int):
    """The planner's ranked estimates for ``nodes`` nodes at global batch ``gbs`` (and the cluster)."""
    cfg = compose([*PLAN, f"plan.nodes={nodes}", f"trainer.global_batch_size={gbs}"])
    shape, cluster, space, params = load_inputs(cfg)
    return (
        search(shape, cluster, world=nodes * cluster.gpus_per_node, global_batch_size=gbs, space=space, params=params),
        shape,
        cluster,
        params,
    )


def phase(est, cluster, tokens: float, seq_len: int) -> dict:
    """Steps, wall time and goodput of training ``tokens`` tokens with estimate ``est`` under failures."""
    lay = est.layout
    step_s = est.time.total
    steps = math.ceil(tokens / (lay.global_batch_size * seq_len))
    mtbf = MTBF_PER_GPU_S / lay.world_size
    delta = CKPT_BYTES / CKPT_BW
    every = max(1, round(young_interval(delta, mtbf) / step_s))
    spread = goodput_over_seeds(
        SEEDS, steps=steps, step_s=step_s, policy=Policy("sync", every, delta), restart_s=RESTART_S, mtbf_s=mtbf
    )
    compute_s = steps * step_s
    wall_s = compute_s / spread.mean
    return {
        "layout": lay.describe(),
        "gpus": lay.world_size,
        "global_batch": lay.global_batch_size,
        "micro_batches": lay.n_microbatches,
        "step_s": step_s,
        "tokens_per_s_per_gpu": est.tokens_per_sec / lay.world_size,
        "mfu": est.mfu,
        "bubble": est.bubble,
        "steps": steps,
        "ckpt_every": every,
        "mtbf_h": mtbf / 3600,
        "goodput": spread.mean,
        "goodput_std": spread.std,
        "compute_days": compute_s / 86400,
        "wall_days": wall_s / 86400,
        "gpu_hours": wall_s / 3600 * lay.world_size,
    }


def main() -> None:
    full, shape, cluster, params = plan(NODES, GLOBAL_BATCH)
    best = full.fitting[0]
    lay = best.layout
    dp_after = lay.dp * (NODES - LOST) // NODES
    before = phase(best, cluster, TRAIN_TOKENS * LOSS_AT, shape.seq_len)
    after_full = phase(best, cluster, TRAIN_TOKENS * (1 - LOSS_AT), shape.seq_len)
    cases = {"no loss": (before, after_full)}
    for name, gbs in (("keep batch", GLOBAL_BATCH), ("shrink batch", GLOBAL_BATCH * (NODES - LOST) // NODES)):
        same = dataclasses.replace(lay, dp=dp_after, global_batch_size=gbs)
        cases[name] = (
            before,
            phase(estimate(shape, same, cluster, params), cluster, TRAIN_TOKENS * (1 - LOSS_AT), shape.seq_len),
        )
        replanned = plan(NODES - LOST, gbs)[0].fitting[0]
        cases[name + ", replanned"] = (before, phase(replanned, cluster, TRAIN_TOKENS * (1 - LOSS_AT), shape.seq_len))
    shrink_event_s = RESTART_S + before["ckpt_every"] * before["step_s"] / 2
    rows = [
        "| case | layout after the loss | m | step s | tok/s/GPU | MFU | bubble | steps after | goodput after | "
        "days (wall, total) | vs no loss | GPU-hours (M) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    out = {
        "inputs": {
            "model": "gpt3_175b",
            "nodes": NODES,
            "lost_nodes": LOST,
            "global_batch": GLOBAL_BATCH,
            "train_tokens": TRAIN_TOKENS,
            "loss_at": LOSS_AT,
            "ckpt_bytes": CKPT_BYTES,
            "ckpt_bw": CKPT_BW,
            "restart_s": RESTART_S,
            "mtbf_per_gpu_h": MTBF_PER_GPU_S / 3600,
            "shrink_event_s": shrink_event_s,
        },
        "cases": {},
    }
    ref_days = None
    for name, (b, a) in cases.items():
        extra = 0.0 if name == "no loss" else shrink_event_s
        days = b["wall_days"] + a["wall_days"] + extra / 86400
        gpu_h = b["gpu_hours"] + a["gpu_hours"] + extra / 3600 * b["gpus"]
        ref_days = days if ref_days is None else ref_days
        out["cases"][name] = {"before": b, "after": a, "total_wall_days": days, "total_gpu_hours": gpu_h}
        rows.append(
            f"| {name} | {a['layout']} | {a['micro_batches']} | {a['step_s']:.2f} | {a['tokens_per_s_per_gpu']:.0f} | "
            f"{a['mfu']:.1%} | {a['bubble']:.2f} | {a['steps']:,} | {a['goodput']:.3f} ± {a['goodput_std']:.3f} | "
            f"{days:.2f} | {days / ref_days - 1:+.1%} | {gpu_h / 1e6:.3f} |"
        )
    head = (
        f"Before the loss (all cases): {before['layout']}, {before['gpus']} GPUs, m {before['micro_batches']}, "
        f"step {before['step_s']:.2f} s, {before['tokens_per_s_per_gpu']:.0f} tok/s/GPU, MFU {before['mfu']:.1%}, "
        f"{before['steps']:,} steps, goodput {before['goodput']:.3f}, {before['wall_days']:.2f} days; "
        f"checkpoint {CKPT_BYTES / 1e12:.2f} TB at {CKPT_BW / 1e9:.0f} GB/s every {before['ckpt_every']} steps; "
        f"the shrink itself: {shrink_event_s / 60:.1f} min (restart + half an interval)."
    )
    text = (
        "<!-- written by experiments/elastic_shrink/cluster.py (planner + failure simulator); re-run after a "
        "cost-model change -->\n" + head + "\n\n" + "\n".join(rows) + "\n"
    )
    (HERE / "cluster.md").write_text(text)
    (HERE / "cluster.json").write_text(json.dumps(out, indent=1))
    print(text)


if __name__ == "__main__":
    main()
