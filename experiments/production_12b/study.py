"""A 12B model to production in three months on 10 TB of text a day: GPUs, data pipeline, checkpoint tiers.

    PYTHONPATH=$PWD python experiments/production_12b/study.py [--cache-dir .cache/trainlab] [--repeats 5]
    PYTHONPATH=$PWD python experiments/production_12b/study.py --reuse-measured   # planner + interval only (seconds)

Three parts, written to ``results.md`` and ``results.json`` next to this file:

1. **Planner** (:func:`framework.driver.plan.search.search` on the config ``python -m framework.plan``
   composes): for 8, 16, ... nodes of 8 H100, the best layout of a 12B GPT and the days to train
   ``TOKEN_BUDGET`` tokens at the failure simulator's goodput; the smallest cluster that finishes
   inside ``TRAIN_DAYS`` is the answer.
2. **Data pipeline** (measured here): the project's byte-level BPE (``tokenizers``, one thread)
   encoding the stdlib corpus, and the pre-tokenized memmap loader (one process), each the best
   of ``--repeats`` runs (the machine is shared: the best run is the least disturbed one). From
   them: the tokens/s that 10 TB of text a day is, the cores that tokenizing it takes, and the
   cores that feeding the trainer takes.
3. **Checkpoint interval 1000 vs 5000 steps** (:mod:`framework.base.cost.interval`,
   :mod:`framework.base.cost.failure_sim`): expected recovery time and recomputed steps with full
   persistent saves only, with an in-memory tier, with incremental persistent saves, and both.

Every assumption is a named constant below.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("RAYON_NUM_THREADS", "1")  # the tokenizer on one core: throughput per core
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from framework.base.cost.failure_sim import Policy, goodput_over_seeds  # noqa: E402
from framework.base.cost.interval import incremental_costs, young_interval  # noqa: E402
from framework.driver.plan.__main__ import compose, load_inputs  # noqa: E402
from framework.driver.plan.search import search  # noqa: E402

# ---- the model and the plan (stated) ------------------------------------------------------------
MODEL = [
    "model=gpt3_175b",
    "model.name=gpt_12b",
    "model.n_layer=40",
    "model.d_model=5120",
    "model.n_head=40",
    "model.max_seq_len=4096",
    "model.dropout=0.0",
]  # a GPT of 12.6B parameters (12·L·h² + embeddings)
SEQ_LEN = 4096
GLOBAL_BATCH = 1024  # sequences: 4.2M tokens a step (stated; Llama 3 8B used 4M-16M)
# ASSUMPTION, the answer's main input: 15T tokens, the budget Llama 3 8B was pre-trained on (Dubey et al. 2024 §1);
# for contrast Chinchilla's compute-optimal 20 tokens/parameter (Hoffmann et al. 2022: ~0.26T) and 2T.
TOKEN_BUDGETS = {"15T (Llama 3 8B's budget)": 15e12, "2T": 2e12, "0.26T (Chinchilla, 20/param)": 0.26e12}
TOKEN_BUDGET = 15e12  # the one the data and interval parts use
TRAIN_DAYS = 60  # of the 90: a month left for data preparation, evaluation and deployment (stated)
NODE_COUNTS = (8, 16, 32, 64, 128, 256, 512)  # powers of two: the dp degree must divide the batch of 1024
# ---- data (stated) -------------------------------------------------------------------------------
TEXT_BYTES_PER_DAY = 10e12  # the guide's 10 TB of text a day
# ---- failures and checkpoints (stated) ---------------------------------------------------------
MTBF_PER_GPU_S = 54 * 86400 / 419 * 16384  # Llama 3 §3.3.4: 419 unexpected interruptions in 54 days, 16,384 GPUs
CKPT_BYTES_PER_PARAM = 14  # bf16 weights + fp32 master + Adam m, v (ZeRO §3.1), no gradients
STORAGE_WRITE_BW = 50e9  # aggregate bytes/s to the persistent store (a parallel-file-system share)
STORAGE_READ_BW = 50e9
RESTART_S = 5 * 60  # detection + rescheduling + process start (stated; MegaScale: back "within 15 min")
MEM_SNAPSHOT_EVERY = 100  # steps between in-memory snapshots (Gemini-style, a peer node's RAM)
MEM_DELTA_S = 1.0  # blocking copy of a 12B shard to pinned host memory (stated)
MEM_RESTART_S = 60  # restart from the memory tier: no storage read, no rescheduling (stated)
MEM_FRACTION = 0.8  # failures after which the memory tier is usable (one node lost, its peer replica survives; stated)
INCR_EVERY = 100  # steps between incremental persistent saves (deltas)
DELTA_RATIO = 0.73  # trainlab's lossless XOR deltas: 0.73-0.86 of a full save's bytes (checkpoint_policy, issue 16)
CODEC_BPS_PER_RANK = 70e6  # XOR + zlib on one rank, measured here (experiments/checkpoint_interval)
INTERVALS = (1000, 5000)
SEEDS = range(8)


def plan_12b(nodes: int):
    cfg = compose(
        [
            *MODEL,
            f"plan.nodes={nodes}",
            f"trainer.global_batch_size={GLOBAL_BATCH}",
            f"data.seq_len={SEQ_LEN}",
            "tracking.enabled=false",
        ]
    )
    shape, cluster, space, params = load_inputs(cfg)
    res = search(
        shape, cluster, world=nodes * cluster.gpus_per_node, global_batch_size=GLOBAL_BATCH, space=space, params=params
    )
    return res, shape, cluster


def part_planner() -> dict:
    rows, answer = [], None
    for nodes in NODE_COUNTS:
        try:
            res, shape, cluster = plan_12b(nodes)
        except Exception as err:  # PlanError: the batch does not divide at this size
            rows.append({"nodes": nodes, "error": str(err).splitlines()[0]})
            continue
        if not res.fitting:
            rows.append({"nodes": nodes, "error": "no layout fits memory"})
            continue
        est = res.fitting[0]
        gpus = est.layout.world_size
        step_s = est.time.total
        steps = math.ceil(TOKEN_BUDGET / (GLOBAL_BATCH * SEQ_LEN))
        mtbf = MTBF_PER_GPU_S / gpus
        delta = shape.num_params() * CKPT_BYTES_PER_PARAM / STORAGE_WRITE_BW
        every = max(1, round(young_interval(delta, mtbf) / step_s))
        sim_steps = min(steps, 200_000)  # goodput is a rate: simulate up to 200k steps of the run
        g = goodput_over_seeds(
            SEEDS,
            steps=sim_steps,
            step_s=step_s,
            policy=Policy("sync", every, delta),
            restart_s=RESTART_S + shape.num_params() * CKPT_BYTES_PER_PARAM / STORAGE_READ_BW,
            mtbf_s=mtbf,
        )
        cost = est.train_cost(TOKEN_BUDGET, cluster)
        row = {
            "nodes": nodes,
            "gpus": gpus,
            "layout": est.layout.describe(),
            "step_s": step_s,
            "tokens_per_s": est.tokens_per_sec,
            "tokens_per_s_per_gpu": est.tokens_per_sec / gpus,
            "mfu": est.mfu,
            "memory_gib": est.memory_bytes / 2**30,
            "compute_days": cost["days"],
            "goodput": g.mean,
            "wall_days": cost["days"] / g.mean,
            "gpu_hours": cost["gpu_hours"] / g.mean,
            "money": cost["money"] / g.mean,
            "energy_mwh": cost["energy_mwh"] / g.mean,
            "ckpt_every_sync": every,
            "params": shape.num_params(),
            "price_per_gpu_hour": cluster.price_per_gpu_hour,
            "power_w": cluster.power_w,
        }
        row["days_by_budget"] = {k: v / TOKEN_BUDGET * row["wall_days"] for k, v in TOKEN_BUDGETS.items()}
        rows.append(row)
        if answer is None and row["wall_days"] <= TRAIN_DAYS:
            answer = row
    answers = {
        k: next((r["nodes"] for r in rows if "error" not in r and r["days_by_budget"][k] <= TRAIN_DAYS), None)
        for k in TOKEN_BUDGETS
    }
    return {"rows": rows, "answer": answer, "nodes_by_budget": answers}


def best_of(fn, repeats: int) -> tuple[float, list[float]]:
    vals = [fn() for _ in range(repeats)]
    return max(vals), vals


def part_data(cache_dir: str, repeats: int) -> dict:
    import numpy as np
    import torch

    from framework.base.config.schema import DataConfig
    from framework.base.data.dataset import WindowDataset
    from framework.base.data.tokens import prepare_data

    cache = prepare_data(DataConfig(cache_dir=cache_dir), progress=False)
    tok = cache.tokenizer()
    text = (cache.dir / "train.txt").read_text(encoding="utf-8")[:8_000_000]
    docs = [text[i : i + 4096] for i in range(0, len(text), 4096)]
    nbytes = sum(len(d.encode("utf-8")) for d in docs)
    ntok = sum(len(e.ids) for e in tok.encode_batch(docs[:200]))  # warm-up

    def tokenize() -> float:
        t0 = time.perf_counter()
        enc = tok.encode_batch(docs)
        dt = time.perf_counter() - t0
        tokenize.tokens = sum(len(e.ids) for e in enc)
        return nbytes / dt

    tok_bps, tok_runs = best_of(tokenize, repeats)
    bytes_per_token = nbytes / tokenize.tokens
    torch.set_num_threads(1)
    ds = WindowDataset(cache.open_train(), seq_len=SEQ_LEN)
    loader_batch = 8
    rng = np.random.default_rng(0)

    def load() -> float:
        idx = rng.permutation(len(ds))[: 64 * loader_batch]
        dl = torch.utils.data.DataLoader(
            torch.utils.data.Subset(ds, idx.tolist()), batch_size=loader_batch, num_workers=0
        )
        t0 = time.perf_counter()
        n = sum(x.numel() for x, _ in dl)
        return n / (time.perf_counter() - t0)

    load_tps, load_runs = best_of(load, repeats)
    text_tokens_per_s = TEXT_BYTES_PER_DAY / 86400 / bytes_per_token
    return {
        "tokenizer_bytes_per_s_per_core": tok_bps,
        "tokenizer_runs": tok_runs,
        "bytes_per_token": bytes_per_token,
        "tokenizer_tokens_per_s_per_core": tok_bps / bytes_per_token,
        "sample_bytes": nbytes,
        "warmup_tokens": ntok,
        "loader_tokens_per_s_per_core": load_tps,
        "loader_runs": load_runs,
        "repeats": repeats,
        "text_bytes_per_s": TEXT_BYTES_PER_DAY / 86400,
        "text_tokens_per_s": text_tokens_per_s,
        "tokenizer_cores": TEXT_BYTES_PER_DAY / 86400 / tok_bps,
        "vocab_size": cache.vocab_size,
    }


def part_interval(plan: dict) -> dict:
    a = plan["answer"]
    step_s, gpus, params = a["step_s"], a["gpus"], a["params"]
    full = params * CKPT_BYTES_PER_PARAM
    mtbf = MTBF_PER_GPU_S / gpus
    load_full = full / STORAGE_READ_BW
    r_disk = RESTART_S + load_full
    rows = []
    for every in INTERVALS:
        # full persistent saves only: a failure goes back to the last one (every/2 steps on average)
        sync_rec = (every / 2, r_disk + every / 2 * step_s)
        # + in-memory snapshots every MEM_SNAPSHOT_EVERY: q of the failures go back to RAM
        q = MEM_FRACTION
        mem_steps = q * MEM_SNAPSHOT_EVERY / 2 + (1 - q) * every / 2
        mem_rec = (mem_steps, q * (MEM_RESTART_S + MEM_SNAPSHOT_EVERY / 2 * step_s) + (1 - q) * sync_rec[1])
        # + incremental persistent saves every INCR_EVERY steps, a full save every `every`: load base + deltas
        full_every = every // INCR_EVERY
        save_s, load_s, bytes_mean = incremental_costs(
            full,
            DELTA_RATIO,
            full_every,
            STORAGE_WRITE_BW,
            STORAGE_READ_BW,
            delta_compute_s=full / gpus / CODEC_BPS_PER_RANK,
        )
        incr_rec = (INCR_EVERY / 2, RESTART_S + load_s + INCR_EVERY / 2 * step_s)
        both_rec = (
            q * MEM_SNAPSHOT_EVERY / 2 + (1 - q) * INCR_EVERY / 2,
            q * (MEM_RESTART_S + MEM_SNAPSHOT_EVERY / 2 * step_s) + (1 - q) * incr_rec[1],
        )
        steps = 100_000
        g_sync = goodput_over_seeds(
            SEEDS,
            steps=steps,
            step_s=step_s,
            policy=Policy("sync", every, full / STORAGE_WRITE_BW),
            restart_s=r_disk,
            mtbf_s=mtbf,
        )
        g_two = goodput_over_seeds(
            SEEDS,
            steps=steps,
            step_s=step_s,
            policy=Policy(
                "two_tier",
                MEM_SNAPSHOT_EVERY,
                MEM_DELTA_S,
                disk_every=every,
                disk_delta_s=full / STORAGE_WRITE_BW,
                mem_fraction=q,
                mem_restart_s=MEM_RESTART_S,
            ),
            restart_s=r_disk,
            mtbf_s=mtbf,
        )
        full_s = full / STORAGE_WRITE_BW
        overhead = {
            "full_only": full_s / (every * step_s),
            "memory_tier": full_s / (every * step_s) + MEM_DELTA_S / (MEM_SNAPSHOT_EVERY * step_s),
            "incremental": save_s / (INCR_EVERY * step_s),
        }
        overhead["memory_and_incremental"] = overhead["incremental"] + MEM_DELTA_S / (MEM_SNAPSHOT_EVERY * step_s)
        rows.append(
            {
                "every": every,
                "save_overhead": overhead,
                "full_only": sync_rec,
                "memory_tier": mem_rec,
                "incremental": incr_rec,
                "memory_and_incremental": both_rec,
                "goodput_full_only": g_sync.mean,
                "goodput_memory_tier": g_two.mean,
                "incremental_save_s": save_s,
                "incremental_load_s": load_s,
                "incremental_bytes_per_save": bytes_mean,
                "full_bytes": full,
                "full_save_s": full / STORAGE_WRITE_BW,
            }
        )
    return {
        "step_s": step_s,
        "gpus": gpus,
        "mtbf_h": mtbf / 3600,
        "full_bytes": full,
        "load_full_s": load_full,
        "rows": rows,
    }


def render(res: dict) -> str:
    p, d, iv = res["planner"], res["data"], res["interval"]
    a = p["answer"]
    out = [
        "<!-- written by experiments/production_12b/study.py; the planner and interval parts are the cost model's, "
        "the data part measured here (best of several runs under load) -->",
        "",
        f"## 1. Planner: 12B GPT ({a['params'] / 1e9:.1f}B parameters), seq {SEQ_LEN}, global batch {GLOBAL_BATCH} "
        f"({GLOBAL_BATCH * SEQ_LEN / 1e6:.1f}M tokens), {TOKEN_BUDGET / 1e12:.0f}T tokens, H100 SXM",
        "",
        "| nodes | GPUs | best layout | step s | tok/s/GPU | MFU | GiB/GPU | goodput | days | GPU-hours | $ | MWh |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in p["rows"]:
        if "error" in r:
            out.append(f"| {r['nodes']} | | {r['error']} | | | | | | | | | |")
            continue
        mark = "**" if r is a or r["nodes"] == a["nodes"] else ""
        out.append(
            f"| {mark}{r['nodes']}{mark} | {r['gpus']} | {r['layout']} | {r['step_s']:.2f} | "
            f"{r['tokens_per_s_per_gpu']:,.0f} | {r['mfu']:.1%} | {r['memory_gib']:.1f} | {r['goodput']:.3f} | "
            f"{mark}{r['wall_days']:.1f}{mark} | {r['gpu_hours'] / 1e6:.2f}M | ${r['money'] / 1e6:.2f}M | "
            f"{r['energy_mwh']:,.0f} |"
        )
    out += [
        "",
        f"Days to train (wall, at the goodput above) by token budget; the smallest cluster inside {TRAIN_DAYS} days:",
        "",
        "| budget | " + " | ".join(str(r["nodes"]) for r in p["rows"] if "error" not in r) + " | nodes needed |",
        "|---|" + "---|" * (sum("error" not in r for r in p["rows"]) + 1),
    ]
    for k in TOKEN_BUDGETS:
        out.append(
            f"| {k} | "
            + " | ".join(f"{r['days_by_budget'][k]:.1f}" for r in p["rows"] if "error" not in r)
            + f" | **{p['nodes_by_budget'][k]}** |"
        )
    out += [
        "",
        f"## 2. Data pipeline: 10 TB of text a day (measured here, best of {d['repeats']} runs, one core each)",
        "",
        "| quantity | value |",
        "|---|---|",
        f"| 10 TB/day as bytes/s | {d['text_bytes_per_s'] / 1e6:,.1f} MB/s |",
        f"| bytes per token (our BPE, vocab {d['vocab_size']}, on Python source) | {d['bytes_per_token']:.2f} |",
        f"| 10 TB/day as tokens/s | {d['text_tokens_per_s'] / 1e6:,.1f} M tokens/s |",
        f"| tokenizer, one core (best of {d['repeats']}; all runs MB/s: "
        f"{', '.join(f'{x / 1e6:.2f}' for x in d['tokenizer_runs'])}) | {d['tokenizer_bytes_per_s_per_core'] / 1e6:.2f} MB/s = "
        f"{d['tokenizer_tokens_per_s_per_core'] / 1e6:.2f} M tokens/s |",
        f"| **cores to tokenize 10 TB/day** | **{d['tokenizer_cores']:,.0f}** |",
        f"| trainer's consumption ({a['nodes']} nodes) | {a['tokens_per_s'] / 1e6:.2f} M tokens/s "
        f"= {a['tokens_per_s'] * 86400 * d['bytes_per_token'] / 1e12:.2f} TB of text a day |",
        f"| memmap loader, one process (best of {d['repeats']}; all runs M tok/s: "
        f"{', '.join(f'{x / 1e6:.1f}' for x in d['loader_runs'])}) | {d['loader_tokens_per_s_per_core'] / 1e6:.1f} M tokens/s |",
        f"| loader cores to feed the trainer | {a['tokens_per_s'] / d['loader_tokens_per_s_per_core']:.2f} "
        f"(of {a['gpus']} GPUs' hosts) |",
        f"| cores to tokenize only what the trainer reads | {a['tokens_per_s'] / d['tokenizer_tokens_per_s_per_core']:.0f} |",
        "",
        f"## 3. Checkpoint interval 1000 vs 5000 steps ({iv['gpus']} GPUs, step {iv['step_s']:.2f} s, "
        f"job MTBF {iv['mtbf_h']:.1f} h, checkpoint {iv['full_bytes'] / 1e9:.0f} GB)",
        "",
        "| full save every | tiers | saves' blocking time, % of compute | recomputed steps (mean per failure) | "
        "recovery min (mean per failure) | goodput (simulated) |",
        "|---|---|---|---|---|---|",
    ]
    for r in iv["rows"]:
        for key, label, g in (
            ("full_only", "full persistent saves only", r["goodput_full_only"]),
            (
                "memory_tier",
                f"+ in-memory snapshots every {MEM_SNAPSHOT_EVERY} (q = {MEM_FRACTION})",
                r["goodput_memory_tier"],
            ),
            ("incremental", f"+ incremental persistent saves every {INCR_EVERY}", None),
            ("memory_and_incremental", "+ both", None),
        ):
            steps, secs = r[key]
            out.append(
                f"| {r['every']} | {label} | {r['save_overhead'][key]:.2%} | {steps:,.0f} | {secs / 60:.1f} | "
                f"{'–' if g is None else f'{g:.3f}'} |"
            )
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--cache-dir", default=".cache/trainlab", help="data.cache_dir (the stdlib corpus is tokenized there once)"
    )
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--reuse-measured",
        action="store_true",
        help="take the data-pipeline measurement from results.json (re-run only the planner and interval parts)",
    )
    args = ap.parse_args()
    res = {"planner": part_planner()}
    if args.reuse_measured:
        res["data"] = json.loads((HERE / "results.json").read_text())["data"]
    else:
        res["data"] = part_data(args.cache_dir, args.repeats)
    res["interval"] = part_interval(res["planner"])
    (HERE / "results.json").write_text(json.dumps(res, indent=1))
    text = render(res)
    (HERE / "results.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
