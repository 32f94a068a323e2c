"""How often to checkpoint a 175B GPT on 1024 x 8 H100: goodput against the interval (sync, async, two-tier).

    python experiments/checkpoint_interval/cluster_scale.py [--out experiments/checkpoint_interval]

Pure model (framework/base/cost/interval.py) plus the failure simulator (framework/base/cost/failure_sim.py,
8 seeds) for the spread; prints the tables of the README and writes ``goodput_vs_interval.png``
and ``guide_claim.png``. Every input is a named constant below with its source.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from framework.base.cost.failure_sim import Policy, goodput_over_seeds  # noqa: E402
from framework.base.cost.interval import (
    TwoTier,
    daly_goodput,
    daly_interval,
    incremental_costs,
    young_interval,
    young_waste,
)  # noqa: E402

# ---- the model and the cluster (stated) -------------------------------------------------------
PARAMS = 175e9  # GPT-3 175B (96 layers, d_model 12288)
N_LAYER, D_MODEL, SEQ = 96, 12288, 2048
GLOBAL_BATCH = 1536  # sequences per step (GPT-3's 3.2M-token batch)
GPUS = 1024 * 8  # 1024 nodes x 8 H100 SXM
PEAK = 989.4e12  # dense BF16 FLOP/s per H100 (docs/references.md §1, NVIDIA datasheet)
MFU = 0.45  # MegaScale reports 55.2% for 175B on 12,288 GPUs; 45% is a round, lower figure
FLOPS_PER_TOKEN = 6 * PARAMS + 12 * N_LAYER * D_MODEL * SEQ  # PaLM App. B
STEP_S = FLOPS_PER_TOKEN * GLOBAL_BATCH * SEQ / (GPUS * PEAK * MFU)
CKPT_BYTES = 14 * PARAMS  # bf16 weights (2) + fp32 master, Adam m, v (12): ZeRO §3.1's K=12, no gradients
# ---- failures ---------------------------------------------------------------------------------
# Llama 3 (§3.3.4): 419 unexpected interruptions in 54 days on 16,384 H100 -> per-GPU rate, scaled to GPUS
MTBF_LLAMA3_S = 54 * 86400 / 419 * 16384 / GPUS
# Meta RSC (Kokolis et al. 2024): a 1024-GPU job's MTTF is 7.9 h -> scaled to GPUS
MTBF_RSC_S = 7.9 * 3600 * 1024 / GPUS
RESTART_S = 10 * 60  # detection + rescheduling + restart + load: stated (MegaScale: catch-up "within 15 min")
# ---- checkpoint bandwidth (aggregate, to persistent storage) ----------------------------------
# Llama 3's storage: 2 TB/s sustained, 7 TB/s peak for the whole 16K-GPU cluster (§3.3.1); a job of
# half the GPUs sharing it at 1/4 is ~ 0.5 TB/s; 100 GB/s is a typical parallel file system share.
BANDWIDTHS = {"50 GB/s": 50e9, "500 GB/s": 500e9}
ASYNC_BLOCK_S = 2.0  # GPU -> pinned CPU copy of a 300 MB shard per GPU (~25 GB/s PCIe) + barrier: stated
MEM_FRACTION, MEM_RESTART_S, MEM_DELTA_S = 0.8, 3 * 60, 2.0  # two-tier (Gemini-style peer memory): stated
INTERVALS = (50, 100, 200, 500, 1000, 2000, 5000)
# incremental saves: trainlab's lossless XOR deltas write 0.73-0.86 of a full save's bytes (issue 16, measured
# with benchmarks/checkpoint_bench.py); the codec (XOR + zlib): 720.7 MB of gpt_50m checkpoint in 10.8 s on 2 CPU
# threads here (benchmarks/checkpoint_bench.py --saves 3), ~70 MB/s per rank
DELTA_RATIOS = (0.73, 0.86, 0.3)  # 0.3: a hypothetical lossy or sparse delta, for contrast
FULL_EVERY = 4
CODEC_BPS = 70e6


def policies(bw: float, every: int, mtbf: float, step_s: float = STEP_S) -> dict[str, tuple[Policy, float]]:
    """(policy, restart seconds) per name, at ``every`` steps and persistent bandwidth ``bw``.

    Two-tier: in-memory snapshots every ``every`` steps; the persistent tier is written in the
    background from the snapshot (blocking ``ASYNC_BLOCK_S``) at its own optimum
    ``sqrt(2 delta_sync M / (1 - q))`` (TwoTier.optimum), rounded up to a multiple of ``every``.
    """
    sync_s = CKPT_BYTES / bw
    load_s = CKPT_BYTES / bw
    _, td = TwoTier(MEM_DELTA_S, MEM_RESTART_S, sync_s, RESTART_S + load_s, MEM_FRACTION).optimum(mtbf)
    disk_every = every * max(1, math.ceil(td / step_s / every))
    return {
        "sync": (Policy("sync", every, sync_s), RESTART_S + load_s),
        "async": (Policy("async", every, ASYNC_BLOCK_S, write_s=sync_s), RESTART_S + load_s),
        "two_tier": (
            Policy(
                "two_tier",
                every,
                MEM_DELTA_S,
                disk_every=disk_every,
                disk_delta_s=ASYNC_BLOCK_S,
                mem_fraction=MEM_FRACTION,
                mem_restart_s=MEM_RESTART_S,
            ),
            RESTART_S + load_s,
        ),
    }


def goodput_table(steps: int, seeds: range) -> list[dict]:
    rows = []
    for mtbf_name, mtbf in (("Llama 3", MTBF_LLAMA3_S), ("RSC", MTBF_RSC_S)):
        for bw_name, bw in BANDWIDTHS.items():
            for every in INTERVALS:
                row = {"mtbf": mtbf_name, "bw": bw_name, "every": every}
                for name, (pol, r) in policies(bw, every, mtbf).items():
                    s = goodput_over_seeds(seeds, steps=steps, step_s=STEP_S, policy=pol, restart_s=r, mtbf_s=mtbf)
                    row[name] = (s.mean, s.std)
                row["model_sync"] = daly_goodput(every * STEP_S, CKPT_BYTES / bw, RESTART_S + CKPT_BYTES / bw, mtbf)
                rows.append(row)
    return rows


def guide_claim(mtbf: float, delta: float, restart: float, step_s: float = STEP_S, load_s: float = 0.0) -> dict:
    """500 -> 2000 steps under Young's first-order terms: relative change of save I/O (saves + loads),
    recomputed work, and total cost (wall time per unit of work)."""

    def terms(k: int) -> tuple[float, float, float, float]:
        tau = k * step_s
        io = delta / tau + load_s / mtbf  # per second of work
        recompute = (tau / 2) / mtbf
        failure = (tau / 2 + restart + load_s) / mtbf  # recompute + restart + load
        w = young_waste(tau, delta, restart + load_s, mtbf)
        return io, recompute, failure, (1.0 / (1.0 - w) if w < 1 else math.inf)

    (io1, rc1, f1, t1), (io2, rc2, f2, t2) = terms(500), terms(2000)
    return {"io": io2 / io1 - 1, "recompute": rc2 / rc1 - 1, "failure": f2 / f1 - 1, "cost": t2 / t1 - 1}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent)
    p.add_argument("--steps", type=int, default=100_000, help="simulated steps per run")
    p.add_argument("--seeds", type=int, default=8)
    args = p.parse_args()
    print(
        f"175B GPT on {GPUS} H100: {FLOPS_PER_TOKEN:.3e} FLOPs/token, {GLOBAL_BATCH * SEQ:,} tokens/step, step"
        f" {STEP_S:.2f} s at MFU {MFU}; checkpoint {CKPT_BYTES / 1e12:.2f} TB"
    )
    print(
        f"MTBF: Llama 3 scaled {MTBF_LLAMA3_S / 3600:.2f} h; RSC scaled {MTBF_RSC_S / 3600:.2f} h; restart {RESTART_S / 60:.0f} min + load"
    )
    for bw_name, bw in BANDWIDTHS.items():
        d = CKPT_BYTES / bw
        for mtbf_name, m in (("Llama 3", MTBF_LLAMA3_S), ("RSC", MTBF_RSC_S)):
            print(
                f"  {bw_name}: sync delta {d:.0f} s; {mtbf_name}: Young {young_interval(d, m) / STEP_S:,.0f} steps,"
                f" Daly {daly_interval(d, m) / STEP_S:,.0f} steps; async (blocking {ASYNC_BLOCK_S:.0f} s) Young"
                f" {young_interval(ASYNC_BLOCK_S, m) / STEP_S:,.0f} steps"
            )
    rows = goodput_table(args.steps, range(args.seeds))
    print(
        f"\ngoodput (mean ± std over {args.seeds} seeds of {args.steps:,} simulated steps; model_sync = Daly's closed form)"
    )
    print(f"{'MTBF':<8} {'bandwidth':<10} {'every':>6} {'sync':>15} {'model_sync':>10} {'async':>15} {'two_tier':>15}")
    for r in rows:
        f = lambda x: f"{x[0]:.4f} ± {x[1]:.4f}"  # noqa: E731
        print(
            f"{r['mtbf']:<8} {r['bw']:<10} {r['every']:>6} {f(r['sync']):>15} {r['model_sync']:>10.4f}"
            f" {f(r['async']):>15} {f(r['two_tier']):>15}"
        )

    print("\nthe guide's 500 -> 2000 steps (I/O -40%, recompute +12%, cost +5%) under Young's terms:")
    for bw_name, bw in BANDWIDTHS.items():
        for mtbf_name, m in (("Llama 3", MTBF_LLAMA3_S), ("RSC", MTBF_RSC_S)):
            g = guide_claim(m, CKPT_BYTES / bw, RESTART_S, load_s=CKPT_BYTES / bw)
            print(
                f"  {bw_name:<9} {mtbf_name:<8} save+load I/O {g['io']:+.0%}  recomputed work {g['recompute']:+.0%}"
                f"  failure cost (recompute+restart+load) {g['failure']:+.0%}  cost {g['cost']:+.1%}"
            )
    # The conditions, from the same terms (k: 500 -> 2000 steps, tau1 = 500 steps):
    #   save+load I/O -40%:  (d/(4 tau1) + L/M) = 0.6 (d/tau1 + L/M)  <=>  L/M = 0.875 d/tau1
    #   failure cost +12%:   (2 tau1 + R + L) = 1.12 (tau1/2 + R + L)   <=>  R + L = 12.0 tau1
    tau1 = 500 * STEP_S
    print(
        f"  I/O -40% needs load/MTBF = 0.875 x delta/tau(500): with load = save time, MTBF = {tau1 / 0.875 / 60:.1f} min"
        f" ({tau1 / 0.875 / STEP_S:.0f} steps)"
    )
    print(
        f"  recompute +12% cannot hold for the recomputed work itself (x4 = +300% whatever M); for the whole"
        f" failure cost it needs restart + load = 12 x tau(500) = {12 * tau1 / 60:.0f} min"
    )
    # Where does the cost go +5% going 500 -> 2000? a sweep of MTBF at each delta
    print("\nMTBF (h) at which 500 -> 2000 steps costs +5% (sync, Young's terms, restart 10 min):")
    for delta in (2.0, 10.0, 30.0, 60.0, 120.0, 300.0):
        lo, hi = 60.0, 1e7
        for _ in range(100):
            mid = math.sqrt(lo * hi)
            if guide_claim(mid, delta, RESTART_S)["cost"] > 0.05:
                lo = mid
            else:
                hi = mid
        print(f"  delta {delta:>5.0f} s: M = {lo / 3600:.2f} h  (I/O {guide_claim(lo, delta, RESTART_S)['io']:+.0%})")

    print(
        f"\nincremental saves (XOR + zlib deltas; a full save every {FULL_EVERY}; each rank codes its"
        f" {CKPT_BYTES / GPUS / 1e6:.0f} MB shard at {CODEC_BPS / 1e6:.0f} MB/s), Llama 3 MTBF, each at its Young optimum:"
    )
    print(
        f"  {'bandwidth':>10} {'ratio':>5} {'full save/load s':>17} {'incr save/load s':>17} {'goodput full':>12} {'incr':>7}"
    )
    for bw in (5e9, 20e9, 50e9, 100e9, 200e9, 500e9):
        for ratio in DELTA_RATIOS:
            g = {}
            for name, every in (("full", 1), ("incr", FULL_EVERY)):
                save, load, _ = incremental_costs(
                    CKPT_BYTES, ratio, every, write_bw=bw, read_bw=bw, delta_compute_s=CKPT_BYTES / GPUS / CODEC_BPS
                )
                m = MTBF_LLAMA3_S
                g[name] = (save, load, 1 - young_waste(young_interval(save, m), save, RESTART_S + load, m))
            print(
                f"  {bw / 1e9:>6.0f} GB/s {ratio:>5.2f} {g['full'][0]:>8.0f}/{g['full'][1]:<8.0f} {g['incr'][0]:>8.0f}/"
                f"{g['incr'][1]:<8.0f} {g['full'][2]:>12.4f} {g['incr'][2]:>7.4f}"
            )
    _plots(rows, args.out)


def _plots(rows: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 8), sharex=True)
    for ax, (mtbf, bw) in zip(axes.flat, [(m, b) for m in ("Llama 3", "RSC") for b in BANDWIDTHS]):
        sel = [r for r in rows if r["mtbf"] == mtbf and r["bw"] == bw]
        x = [r["every"] for r in sel]
        for name in ("sync", "async", "two_tier"):
            ax.errorbar(x, [r[name][0] for r in sel], yerr=[r[name][1] for r in sel], marker="o", capsize=3, label=name)
        ax.plot(x, [r["model_sync"] for r in sel], "k--", label="sync, Daly closed form")
        for k in (500, 2000):
            ax.axvline(k, color="grey", lw=0.8, ls=":")
        ax.set_xscale("log")
        ax.set_title(f"MTBF {mtbf}, storage {bw}")
        ax.set_ylabel("goodput")
        ax.grid(alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("checkpoint interval (steps)")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"175B GPT on {GPUS} H100 (step {STEP_S:.2f} s, checkpoint {CKPT_BYTES / 1e12:.2f} TB)")
    fig.tight_layout()
    fig.savefig(out / "goodput_vs_interval.png", dpi=110)
    print(f"\nwrote {out / 'goodput_vs_interval.png'}")


if __name__ == "__main__":
    main()
