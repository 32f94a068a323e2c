"""Young/Daly against real runs: goodput vs checkpoint interval under seeded random rank crashes.

    python experiments/checkpoint_interval/validate.py \\
        --workdir /tmp/ckpt_interval --mtbf-steps 40 --max-steps 160 --seeds 0 1 2

1. **Calibration**: one run of the default config (gpt_tiny, ddp on 2 CPU ranks) with a save
   every ``--calib-every`` steps and one rank crash, ``resilience=restart``. From its event log
   (:func:`framework.faults.accounting.goodput_figures`): the step time (median productive
   step), the blocking save time delta (checkpoint seconds per save) and the restart cost R
   (detection + restart seconds per failure), and the restart's parts.
2. **Prediction**: M = ``--mtbf-steps`` x step time; Young's and Daly's interval
   (:mod:`framework.cost.interval`), in steps.
3. **Sweep**: intervals ``--multipliers`` x Daly's, each under ``fault=random`` (rank crashes,
   mean ``--mtbf-steps`` apart, ``fault.random_seed`` = each of ``--seeds``), ``resilience=restart``.
   Measured "training goodput" = productive / (productive + checkpoint + lost + detect +
   restart): the run's goodput without its first start-up, shutdown and validation, which no
   interval changes and the model leaves out.
4. **Simulation** with the calibrated costs (:mod:`framework.cost.failure_sim`): paired (the
   same failure steps the run drew) and unpaired (200 other seeds of the same step-tied process).

Prints one row per run and a summary per interval, then the measured and modelled optima.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from framework.cost.failure_sim import Policy, simulate  # noqa: E402
from framework.cost.interval import daly_interval, young_interval  # noqa: E402
from framework.faults.accounting import goodput_figures  # noqa: E402
from framework.faults.events import FaultLog  # noqa: E402

EXPERIMENT = "checkpoint_interval"
COMMON = ["trainer.progress_bar=false", "trainer.val_every_n_steps=100000", f"experiment_name={EXPERIMENT}"]


def run(workdir: Path, name: str, *overrides: str) -> list[dict]:
    """Run the driver (cwd ``workdir``) as run ``name``; returns the run's event log records."""
    t0 = time.time()
    cmd = [sys.executable, "-m", "framework.train", *COMMON, f"run_name={name}", *overrides]
    proc = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    if proc.returncode != 0:
        raise SystemExit(f"{name}: driver exited {proc.returncode}\n{proc.stderr[-3000:]}")
    print(f"  ran {name} in {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    return FaultLog(workdir / "outputs" / EXPERIMENT / name).read()


def schedule_steps(mtbf_steps: float, max_steps: int, seed: int) -> list[int]:
    """Failure steps drawn as ``fault=random`` draws them (framework.faults.schedule.build_schedule)."""
    rng, t, out = random.Random(seed), 0.0, []
    while True:
        t += rng.expovariate(1.0 / mtbf_steps)
        if max(1, math.ceil(t)) > max_steps:
            return out
        out.append(max(1, math.ceil(t)))
        rng.choice([0]), rng.randrange(2)  # the draws of the kind and the rank (2 ranks), as the schedule makes them


def training_goodput(figs: dict) -> float:
    busy = sum(figs[f"goodput/{p}_s"] for p in ("productive", "checkpoint", "lost", "detect", "restart"))
    return figs["goodput/productive_s"] / busy if busy > 0 else 0.0


def costs(records: list[dict]) -> dict:
    """Step time, delta per save and restart seconds per failure of one run's records."""
    figs, attempts = goodput_figures(records)
    steps = [r["d"] for r in records if r["ev"] == "step"]
    saves = [r["c"] for r in records if r["ev"] in ("step", "end") and r.get("c", 0) > 0]
    failures = sum(1 for a in attempts if a["restart"])
    return {"step_s": statistics.median(steps), "delta_s": statistics.median(saves) if saves else 0.0,
            "restart_s": (figs["goodput/detect_s"] + figs["goodput/restart_s"]) / failures if failures else 0.0,
            "figs": figs, "attempts": attempts}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", type=Path, required=True, help="scratch folder (mlruns.db, outputs/, checkpoints/)")
    p.add_argument("--mtbf-steps", type=float, default=40.0)
    p.add_argument("--max-steps", type=int, default=160)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--multipliers", type=float, nargs="+", default=[0.25, 0.5, 1.0, 2.0, 4.0])
    p.add_argument("--calib-every", type=int, default=10)
    p.add_argument("--calibrate-only", action="store_true")
    p.add_argument("--extra", nargs="*", default=[], help="more overrides for every run")
    args = p.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)

    crash_at = args.calib_every * 2 + args.calib_every // 2
    cal = costs(run(args.workdir, "calibrate", f"trainer.max_steps={args.calib_every * 4}",
                    f"checkpoint.every_n_steps={args.calib_every}", "resilience=restart",
                    f"fault.events=[{{kind:rank_crash,step:{crash_at},ranks:[1]}}]", *args.extra))
    step_s, delta, restart = cal["step_s"], cal["delta_s"], cal["restart_s"]
    print(f"calibration: step {step_s:.4f} s, save (blocking) {delta:.4f} s, restart (detect + restart) {restart:.2f} s")
    for i, a in enumerate(cal["attempts"]):
        print(f"  attempt {i}: " + ", ".join(f"{k} {v:.2f}" for k, v in a.items() if k.endswith("_s")))
    m_s = args.mtbf_steps * step_s
    k_young, k_daly = young_interval(delta, m_s) / step_s, daly_interval(delta, m_s) / step_s
    print(f"MTBF {args.mtbf_steps} steps = {m_s:.1f} s: Young {k_young:.1f} steps, Daly {k_daly:.1f} steps")
    if args.calibrate_only:
        return
    intervals = sorted({max(1, round(m * k_daly)) for m in args.multipliers})
    rows = []
    print(f"\n{'every':>5} {'seed':>4} {'failures':>8} {'measured':>9} {'sim_paired':>10} {'goodput(all)':>12}")
    for k in intervals:
        for seed in args.seeds:
            recs = run(args.workdir, f"k{k}_s{seed}", f"trainer.max_steps={args.max_steps}", f"checkpoint.every_n_steps={k}",
                       "fault=random", f"fault.mtbf_steps={args.mtbf_steps}", f"fault.random_seed={seed}",
                       "fault.random_kinds=[rank_crash]", "resilience=restart", "resilience.max_restarts=1000", *args.extra)
            figs, _ = goodput_figures(recs)
            fsteps = [r["step"] for r in recs if r["ev"] == "injected"]
            sim = simulate(steps=args.max_steps, step_s=step_s, policy=Policy("sync", k, delta), restart_s=restart,
                           failure_steps=fsteps)
            row = {"every": k, "seed": seed, "failures": len(set(fsteps)), "measured": training_goodput(figs),
                   "sim_paired": sim.goodput, "goodput": figs["goodput"]}
            rows.append(row)
            print(f"{k:>5} {seed:>4} {row['failures']:>8} {row['measured']:>9.4f} {row['sim_paired']:>10.4f} {row['goodput']:>12.4f}",
                  flush=True)
    print(f"\n{'every':>5} {'x Daly':>6} {'measured':>17} {'sim paired':>17} {'sim 200 seeds':>17}")
    summary = []
    for k in intervals:
        sel = [r for r in rows if r["every"] == k]
        meas = [r["measured"] for r in sel]
        pair = [r["sim_paired"] for r in sel]
        unpaired = [simulate(steps=args.max_steps, step_s=step_s, policy=Policy("sync", k, delta), restart_s=restart,
                             failure_steps=schedule_steps(args.mtbf_steps, args.max_steps, 1000 + s)).goodput
                    for s in range(200)]
        sd = lambda xs: statistics.stdev(xs) if len(xs) > 1 else 0.0  # noqa: E731
        summary.append((k, statistics.fmean(meas), statistics.fmean(pair), statistics.fmean(unpaired)))
        print(f"{k:>5} {k / k_daly:>6.2f} {statistics.fmean(meas):>9.4f} ± {sd(meas):.4f} {statistics.fmean(pair):>9.4f}"
              f" ± {sd(pair):.4f} {statistics.fmean(unpaired):>9.4f} ± {sd(unpaired):.4f}")
    best_meas = max(summary, key=lambda s: s[1])[0]
    best_sim = max(summary, key=lambda s: s[3])[0]
    print(f"\noptimum: measured {best_meas} steps; simulated {best_sim} steps; Daly {k_daly:.1f}, Young {k_young:.1f} steps")
    (args.workdir / "validate.json").write_text(json.dumps({"calibration": {k: v for k, v in cal.items() if k != "figs"},
                                                            "rows": rows, "k_daly": k_daly, "k_young": k_young}, indent=1))


if __name__ == "__main__":
    main()
