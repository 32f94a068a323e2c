"""The guide's four dimensions in one report: candidate designs for a 175B GPT on 1024 x 8 H100.

    PYTHONPATH=$PWD python experiments/evaluation/report.py      # ~1 min, no ranks

Scores 3 layouts x 2 checkpoint policies on

- **efficiency**: MFU (the planner's step-time model, :func:`framework.driver.plan.search.search`);
- **scalability**: job tokens/s and scaling efficiency from 128 to 1024 nodes (the same TP x PP,
  dp scaled with the nodes, global batch fixed);
- **reliability**: mean recovery time and recomputed steps per failure, and goodput at the stated
  failure rate (the failure simulator, :func:`framework.base.cost.failure_sim.goodput_over_seeds`);
- **cost**: GPU-hours, dollars per day and energy for 300B tokens at that goodput;

and sets beside them what this machine measured of the same quantities (the other studies'
result files, read here, so a re-run of those studies shows up). Writes ``results.md`` and
``results.json`` next to this file. The planner is called, not copied: after a cost-model change
re-run this script. Every assumption is a named constant below.
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
EXP = HERE.parent
sys.path.insert(0, str(EXP.parent))

from framework.base.cost.estimate import estimate  # noqa: E402
from framework.base.cost.failure_sim import Policy, goodput_over_seeds  # noqa: E402
from framework.base.cost.interval import TwoTier, daly_interval  # noqa: E402
from framework.driver.plan.__main__ import compose, load_inputs  # noqa: E402
from framework.driver.plan.search import SearchSpace, search  # noqa: E402

# ---- the scenario (the guide's; the same as experiments/cluster_layout) ---------------------------
PLAN = ["model=gpt3_175b", "cluster=h100_sxm", "data.seq_len=2048", "tracking.enabled=false"]
NODES = 1024
GLOBAL_BATCH = 1536
TRAIN_TOKENS = 300e9  # GPT-3's budget (Brown et al. 2020 §2.2)
PARAMS = 175e9
# ---- reliability (stated) -----------------------------------------------------------------------
MTBF_PER_GPU_S = 54 * 86400 / 419 * 16384  # Llama 3 §3.3.4: 419 unexpected interruptions in 54 days on 16,384 GPUs
CKPT_BYTES = 14 * PARAMS  # bf16 weights + fp32 master + Adam m, v (ZeRO §3.1)
STORAGE_BW = 50e9  # aggregate write = read bytes/s to persistent storage (stated)
RESTART_S = 10 * 60  # detection + rescheduling + start (stated; MegaScale: "within 15 min")
MEM_DELTA_S, MEM_RESTART_S, MEM_FRACTION = 2.0, 3 * 60, 0.8  # in-memory tier (stated, as checkpoint_interval)
SEEDS = range(8)
# ---- cost (stated; from conf/cluster/h100_sxm.yaml unless overridden) ----------------------------
# price_per_gpu_hour and power_w are read from the cluster file ($2.50, 700 W: an assumption and the datasheet TDP)
PUE = 1.0  # GPU board power only; multiply by a site's PUE (~1.1-1.4) for the facility


def _planner(nodes: int, **space_kw):
    cfg = compose([*PLAN, f"plan.nodes={nodes}", f"trainer.global_batch_size={GLOBAL_BATCH}"])
    shape, cluster, space, params = load_inputs(cfg)
    if space_kw:
        space = SearchSpace(**{**space.__dict__, **space_kw})
    res = search(
        shape, cluster, world=nodes * cluster.gpus_per_node, global_batch_size=GLOBAL_BATCH, space=space, params=params
    )
    return res, shape, cluster, params


def candidates():
    """Three layouts: the planner's best; the best with TP 4 (half a node); the best with a pipeline of <= 8 stages."""
    best, shape, cluster, params = _planner(NODES)
    tp4 = _planner(NODES, tp_degrees=(4,))[0]
    shallow = _planner(NODES, pp_degrees=(1, 2, 4, 8))[0]
    return (
        {"best (planner)": best.fitting[0], "TP 4": tp4.fitting[0], "PP <= 8": shallow.fitting[0]},
        shape,
        cluster,
        params,
    )


def scalability(est, shape, cluster, params) -> list[dict]:
    """Tokens/s of ``est``'s TP x PP at 128..1024 nodes, dp scaled, global batch fixed (where dp divides it)."""
    import dataclasses

    lay, out = est.layout, []
    for nodes in (128, 256, 512, 1024):
        dp = nodes * cluster.gpus_per_node // (lay.tp * lay.pp)
        if dp < 1 or GLOBAL_BATCH % (dp * lay.micro_batch_size):
            continue
        kw = {"dp": dp}
        if lay.schedule == "Interleaved1F1B" and (GLOBAL_BATCH // (dp * lay.micro_batch_size)) % lay.pp:
            kw.update(schedule="1F1B", virtual_stages=1)
        e = estimate(shape, dataclasses.replace(lay, **kw), cluster, params)
        out.append({"nodes": nodes, "tokens_per_s": e.tokens_per_sec, "mfu": e.mfu, "fits": e.fits})
    ref = out[0]
    for r in out:
        r["scaling_efficiency"] = (r["tokens_per_s"] / ref["tokens_per_s"]) / (r["nodes"] / ref["nodes"])
    return out


def reliability(step_s: float, gpus: int, policy: str) -> dict:
    mtbf = MTBF_PER_GPU_S / gpus
    delta = CKPT_BYTES / STORAGE_BW
    load = CKPT_BYTES / STORAGE_BW
    r_disk = RESTART_S + load
    steps = 50_000
    if policy == "sync":
        every = max(1, round(daly_interval(delta, mtbf) / step_s))
        pol = Policy("sync", every, delta)
        lost_steps = every / 2
        rec_s = r_disk + lost_steps * step_s
        name = f"sync every {every} (Daly)"
    else:
        # the persistent tier is written from the snapshot in the background (blocking MEM_DELTA_S), at the optimum
        # its full write time would give (sqrt(2 delta_sync M / (1 - q)): bandwidth-bound, as in checkpoint_interval)
        tt = TwoTier(
            delta_mem=MEM_DELTA_S,
            restart_mem=MEM_RESTART_S,
            delta_disk=delta,
            restart_disk=r_disk,
            mem_fraction=MEM_FRACTION,
        )
        tm, td = tt.optimum(mtbf)
        every = max(1, round(tm / step_s))
        disk_every = max(every, round(td / step_s / every) * every)
        pol = Policy(
            "two_tier",
            every,
            MEM_DELTA_S,
            disk_every=disk_every,
            disk_delta_s=MEM_DELTA_S,
            mem_fraction=MEM_FRACTION,
            mem_restart_s=MEM_RESTART_S,
        )
        lost_steps = MEM_FRACTION * every / 2 + (1 - MEM_FRACTION) * disk_every / 2
        rec_s = MEM_FRACTION * (MEM_RESTART_S + every / 2 * step_s) + (1 - MEM_FRACTION) * (
            r_disk + disk_every / 2 * step_s
        )
        name = f"two-tier: RAM every {every}, disk every {disk_every}"
    g = goodput_over_seeds(SEEDS, steps=steps, step_s=step_s, policy=pol, restart_s=r_disk, mtbf_s=mtbf)
    return {
        "policy": name,
        "mtbf_h": mtbf / 3600,
        "recomputed_steps": lost_steps,
        "recovery_s": rec_s,
        "goodput": g.mean,
        "goodput_std": g.std,
    }


def measured_here() -> list[tuple[str, str, str, str]]:
    """(dimension, this machine's figure, its source file, the cluster figure it stands beside)."""
    rows = []
    cv = EXP / "cost_model_validation" / "results.md"
    rows.append(
        (
            "efficiency",
            "step time predicted within 20% on 20 of 26 layouts, rank order Spearman 0.87 / 0.68; "
            "comm bytes exact, model states within 5% on 26 of 26",
            str(cv.relative_to(EXP.parent)),
            "the step-time model behind every MFU above",
        )
    )
    pr = EXP / "parallelism" / "compare_2ranks.csv"
    if pr.exists():
        with pr.open() as f:
            mfu = {r.get("parallelism") or r.get("plugin"): float(r["mfu"]) for r in csv.DictReader(f) if r.get("mfu")}
        rows.append(
            (
                "efficiency",
                "MFU on 2 CPU ranks (vs the CPU's measured GEMM peak): "
                + ", ".join(f"{k} {v:.2f}" for k, v in sorted(mfu.items(), key=lambda kv: -kv[1])),
                str(pr.relative_to(EXP.parent)),
                "MFU column",
            )
        )
    rows.append(
        (
            "scalability",
            "2 -> 4 ranks: bytes per rank x1.5 = the ring's (n-1)/n, exactly; tokens/s noise ±30%",
            "experiments/parallelism/README.md",
            "tokens/s vs nodes",
        )
    )
    fr = EXP / "fault_recovery" / "compare_recovery.csv"
    with fr.open() as f:
        crash = next(r for r in csv.DictReader(f) if r["faults"] == "rank_crash" and r["resilience"] == "restart")
    rows.append(
        (
            "reliability",
            f"a rank crash under restart: recovery {float(crash['recovery_time_s']):.1f} s "
            f"(restart {float(crash['restart_s']):.1f} s), {float(crash['recomputed_steps']):.0f} steps recomputed of a "
            f"25-step interval, run goodput {float(crash['goodput']):.3f}",
            str(fr.relative_to(EXP.parent)),
            "recovery time, recomputed steps",
        )
    )
    vq = EXP / "checkpoint_interval" / "validation_quiet.json"
    if vq.exists():
        rows.append(
            (
                "reliability",
                "checkpoint-interval optimum measured on real runs within 10% of the model's "
                "(fitted 5.17 steps vs calibrated Young 5.66)",
                str(vq.relative_to(EXP.parent)),
                "the Daly/Young intervals above",
            )
        )
    es = HERE.parent / "elastic_shrink" / "results.json"
    if es.exists():
        s = json.loads(es.read_text()).get("_summary", {})
        if "keep_k0" in s:
            rows.append(
                (
                    "reliability",
                    f"losing 1 of 4 ranks, batch kept: final val loss {s['keep_k0']['delta_vs_ref']:+.4f} "
                    f"vs uninterrupted, {s['keep_k0']['recomputed_steps']:.0f} steps recomputed",
                    "experiments/elastic_shrink/results.json",
                    "losing nodes for good",
                )
            )
    cp = EXP / "checkpoint_policy" / "compare.csv"
    with cp.open() as f:
        blk = {(r["checkpoint"], r["checkpoint.every_n_steps"]): float(r["ckpt_blocking_s"]) for r in csv.DictReader(f)}
    rows.append(
        (
            "cost",
            "checkpoint blocking per run (s, 100 steps): "
            + ", ".join(f"{k[0]}/{k[1]} {v:.2f}" for k, v in sorted(blk.items())),
            str(cp.relative_to(EXP.parent)),
            "the checkpoint share of GPU-hours",
        )
    )
    return rows


def main() -> None:
    cands, shape, cluster, params = candidates()
    designs, scal = [], {}
    for lname, est in cands.items():
        scal[lname] = scalability(est, shape, cluster, params)
        gpus = est.layout.world_size
        for pol in ("sync", "two_tier"):
            rel = reliability(est.time.total, gpus, pol)
            cost = est.train_cost(TRAIN_TOKENS, cluster)
            wall_days = cost["days"] / rel["goodput"]
            gpu_hours = cost["gpu_hours"] / rel["goodput"]
            designs.append(
                {
                    "layout_name": lname,
                    "layout": est.layout.describe(),
                    "policy": rel["policy"],
                    "gpus": gpus,
                    "mfu": est.mfu,
                    "step_s": est.time.total,
                    "tokens_per_s": est.tokens_per_sec,
                    "memory_gib": est.memory_bytes / 2**30,
                    "bubble": est.bubble,
                    "scaling_efficiency_128_to_1024": scal[lname][-1]["scaling_efficiency"],
                    **{k: rel[k] for k in ("mtbf_h", "recomputed_steps", "recovery_s", "goodput", "goodput_std")},
                    "wall_days": wall_days,
                    "gpu_hours": gpu_hours,
                    "dollars_per_day": gpus * 24 * cluster.price_per_gpu_hour,
                    "dollars_total": gpu_hours * cluster.price_per_gpu_hour,
                    "energy_mwh": gpu_hours * cluster.power_w * PUE / 1e6,
                }
            )
    meas = measured_here()
    out = {
        "inputs": {
            "nodes": NODES,
            "global_batch": GLOBAL_BATCH,
            "train_tokens": TRAIN_TOKENS,
            "mtbf_per_gpu_h": MTBF_PER_GPU_S / 3600,
            "ckpt_bytes": CKPT_BYTES,
            "storage_bw": STORAGE_BW,
            "restart_s": RESTART_S,
            "price_per_gpu_hour": cluster.price_per_gpu_hour,
            "power_w": cluster.power_w,
            "pue": PUE,
        },
        "designs": designs,
        "scalability": scal,
        "measured_here": [dict(zip(("dimension", "figure", "source", "beside"), r)) for r in meas],
    }
    (HERE / "results.json").write_text(json.dumps(out, indent=1))
    text = render(out)
    (HERE / "results.md").write_text(text)
    print(text)


def render(out: dict) -> str:
    i, d = out["inputs"], out["designs"]
    lines = [
        "<!-- written by experiments/evaluation/report.py (planner + failure simulator + the studies' result files) -->",
        "",
        f"175B GPT, {i['nodes']} x 8 H100 SXM, global batch {i['global_batch']} x 2048 tokens, "
        f"{i['train_tokens'] / 1e9:.0f}B tokens; failures at Llama 3's rate (job MTBF {d[0]['mtbf_h']:.2f} h); "
        f"checkpoint {i['ckpt_bytes'] / 1e12:.2f} TB at {i['storage_bw'] / 1e9:.0f} GB/s; restart "
        f"{i['restart_s'] / 60:.0f} min + load; ${i['price_per_gpu_hour']:.2f}/GPU-hour (assumed), "
        f"{i['power_w']:.0f} W/GPU (board only, PUE {i['pue']:.1f}).",
        "",
        "| layout | checkpoint policy | MFU | scaling eff. 128→1024 nodes | recovery min / failure | "
        "recomputed steps / failure | goodput | days | GPU-hours (k) | $/day (k) | $ total (M) | MWh |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in d:
        lines.append(
            f"| {r['layout_name']}: {r['layout']} | {r['policy']} | {r['mfu']:.1%} | "
            f"{r['scaling_efficiency_128_to_1024']:.2f} | {r['recovery_s'] / 60:.1f} | {r['recomputed_steps']:,.0f} | "
            f"{r['goodput']:.3f} ± {r['goodput_std']:.3f} | {r['wall_days']:.2f} | {r['gpu_hours'] / 1e3:,.0f} | "
            f"{r['dollars_per_day'] / 1e3:,.0f} | {r['dollars_total'] / 1e6:.2f} | {r['energy_mwh']:,.0f} |"
        )
    lines += [
        "",
        "Scalability (job tokens/s, same TP x PP, dp scaled, batch fixed):",
        "",
        "| layout | " + " | ".join(f"{r['nodes']} nodes" for r in next(iter(out["scalability"].values()))) + " |",
        "|---|" + "---|" * len(next(iter(out["scalability"].values()))),
    ]
    for name, rows in out["scalability"].items():
        lines.append(
            f"| {name} | "
            + " | ".join(f"{r['tokens_per_s'] / 1e6:.2f}M ({r['scaling_efficiency']:.2f})" for r in rows)
            + " |"
        )
    lines += [
        "",
        "This machine's measured counterparts:",
        "",
        "| dimension | measured here | source | beside |",
        "|---|---|---|---|",
    ]
    for m in out["measured_here"]:
        lines.append(f"| {m['dimension']} | {m['figure']} | `{m['source']}` | {m['beside']} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
