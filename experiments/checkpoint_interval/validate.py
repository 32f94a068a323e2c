"""Young/Daly against real runs: goodput vs checkpoint interval under seeded random rank crashes.

    python experiments/checkpoint_interval/validate.py --workdir /dev/shm/ckpt_interval \\
        --mtbf-steps 18 --max-steps 120 --seeds 0 1 2 3 --extra trainer.preload_ranks=true tracking=none \\
        model.n_layer=2 model.d_model=512 model.n_head=8 trainer.micro_batch_size=1 trainer.global_batch_size=2 \\
        data.seq_len=64

(the setup of experiments/checkpoint_interval/README.md, "Validation on real runs", and why).

Every run's outputs stay in ``--workdir``; a run whose outputs are complete is not run again, so
the sweep can be run in chunks (``--intervals`` / ``--seeds`` subsets) and ``--collect`` reports
from what is on disk without running anything.

1. **Calibration** (cached in ``calibration.json``): one run with a save every ``--calib-every``
   steps and one rank crash, ``resilience=restart``. From its event log
   (:func:`framework.driver.faults.accounting.goodput_figures`): the step time s (median step), the
   blocking save time delta (median checkpoint seconds per save) and the restart cost R
   (detection + restart seconds per failure), and the restart's parts.
2. **Prediction**, in steps: trainlab's random faults are tied to training progress (a fault
   fires at the start of its step the first time the job reaches it, never on a replay, a save or
   a restart), so the waste per productive second is exactly
   ``n_saves*delta/(N s) + F/N * (R + s*E[lost steps])`` with ``E[lost steps] = (k-1)/2``: Young's
   first-order form without its approximations, optimum ``k* = sqrt(2 delta M)/s`` (M = MTBF
   in seconds = ``--mtbf-steps`` x s). Daly's eq. 37 (also printed) lets failures strike saves and
   restarts too, which these failures cannot.
3. **Sweep**: intervals ``--multipliers`` x k* (plus ``--intervals``), each under ``fault=random``
   (rank crashes, mean ``--mtbf-steps`` apart, ``fault.random_seed`` = each of ``--seeds``; the
   same seed gives the same failure steps at every interval: a paired design),
   ``resilience=restart``. Measured "training goodput" G = productive / (productive + checkpoint
   + lost + detect + restart): the run's goodput without its first start-up, shutdown and
   validation, which no interval changes and the model leaves out.
4. **Simulation** (:mod:`framework.base.cost.failure_sim`) with the calibrated costs, with the sweep's
   costs (median step and save, restart seconds per failure over all runs) and with each run's
   own: paired (each run's failure steps) and unpaired (200 other seeds, the sweep's costs).
5. **Optima**: the waste ``1/G - 1`` averaged over seeds is fitted (least squares) with
   ``a*n_saves(k)/N + b*k + c``; the fitted optimum is ``sqrt(a/b)`` (the argmin of a/k + b k).
   The same fit is made to the paired and unpaired simulations; the best grid point is printed too,
   and the design's power: the spread of the fitted optimum over 200 simulated sweeps with other
   seeds (the same costs, no timing noise), i.e. what failure sampling alone allows.

Writes ``validate.json`` (every number printed) and ``validation.png`` (``--plot``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from framework.base.cost.failure_sim import Policy, simulate  # noqa: E402
from framework.base.cost.interval import daly_interval, young_interval  # noqa: E402
from framework.base.faults.events import FaultLog  # noqa: E402
from framework.driver.faults.accounting import goodput_figures  # noqa: E402

EXPERIMENT = "checkpoint_interval"
COMMON = ["trainer.progress_bar=false", "trainer.val_every_n_steps=100000", f"experiment_name={EXPERIMENT}"]
UNPAIRED_SEEDS = range(1000, 1200)


def run_dir(workdir: Path, name: str) -> Path:
    return workdir / "outputs" / EXPERIMENT / name


def complete(workdir: Path, name: str) -> bool:
    """Whether run ``name`` finished (its event log ends with the driver's end record)."""
    path = run_dir(workdir, name)
    if not (path / "faults.jsonl").exists():
        return False
    recs = FaultLog(path).read()
    return bool(recs) and recs[-1]["ev"] == "driver_end"


def run(workdir: Path, name: str, *overrides: str) -> list[dict]:
    """Run the driver (cwd ``workdir``) as run ``name`` unless it already finished; its event log records."""
    if not complete(workdir, name):
        for stale in (run_dir(workdir, name), workdir / "checkpoints" / EXPERIMENT / name):
            shutil.rmtree(stale, ignore_errors=True)  # a killed run would otherwise resume from its checkpoint
        t0 = time.time()
        cmd = [sys.executable, "-m", "framework.train", *COMMON, f"run_name={name}", *overrides]
        proc = subprocess.run(
            cmd, cwd=workdir, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)}
        )
        if proc.returncode != 0:
            raise SystemExit(f"{name}: driver exited {proc.returncode}\n{proc.stderr[-3000:]}")
        print(f"  ran {name} in {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
        shutil.rmtree(workdir / "checkpoints" / EXPERIMENT / name, ignore_errors=True)  # only the event log is read
    return FaultLog(run_dir(workdir, name)).read()


def schedule_steps(mtbf_steps: float, max_steps: int, seed: int) -> list[int]:
    """Failure steps drawn as ``fault=random`` draws them (framework.base.faults.schedule.build_schedule)."""
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
    return {
        "step_s": statistics.median(steps),
        "delta_s": statistics.median(saves) if saves else 0.0,
        "restart_s": (figs["goodput/detect_s"] + figs["goodput/restart_s"]) / failures if failures else 0.0,
        "failures": failures,
        "saves": len(saves),
        "figs": figs,
        "attempts": attempts,
    }


def fit_optimum(ks: list[int], waste: list[float], max_steps: int) -> dict:
    """Least-squares fit of ``waste = a*ceil(N/k)/N + b*k + c``; optimum ``sqrt(a/b)`` steps (nan if a or b <= 0)."""
    import numpy as np

    x = np.array([[math.ceil(max_steps / k) / max_steps, k, 1.0] for k in ks])
    (a, b, c), *_ = np.linalg.lstsq(x, np.array(waste), rcond=None)
    opt = math.sqrt(a / b) if a > 0 and b > 0 else math.nan
    return {"a": float(a), "b": float(b), "c": float(c), "optimum": opt}


def sd(xs: list[float]) -> float:
    return statistics.stdev(xs) if len(xs) > 1 else 0.0


def plot(
    path: Path,
    summary: list[dict],
    fits: dict,
    k_young: float,
    k_young_own: float,
    k_daly: float,
    max_steps: int,
    title: str,
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ks = [s["every"] for s in summary]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.errorbar(
        ks,
        [s["measured"] for s in summary],
        yerr=[s["measured_sd"] for s in summary],
        fmt="o-",
        capsize=3,
        label="measured (mean ± sd over seeds)",
    )
    ax.plot(ks, [s["sim_paired"] for s in summary], "s--", label="simulated, same failure steps")
    ax.fill_between(
        ks,
        [s["sim_unpaired"] - s["sim_unpaired_sd"] for s in summary],
        [s["sim_unpaired"] + s["sim_unpaired_sd"] for s in summary],
        alpha=0.15,
        color="gray",
        label="simulated, 200 other seeds (± sd)",
    )
    grid = [ks[0] * (ks[-1] / ks[0]) ** (i / 200) for i in range(201)]
    f = fits["measured"]
    ax.plot(
        grid,
        [1 / (1 + f["a"] * math.ceil(max_steps / k) / max_steps + f["b"] * k + f["c"]) for k in grid],
        ":",
        color="C0",
        label=f"fit to measured, optimum {f['optimum']:.1f}",
    )
    ax.axvline(k_young, color="k", lw=0.8, label=f"Young k* = {k_young:.1f} (calibration)")
    ax.axvline(k_young_own, color="C3", lw=0.8, label=f"Young k* = {k_young_own:.1f} (the sweep's costs)")
    ax.axvline(k_daly, color="k", lw=0.8, ls="--", label=f"Daly = {k_daly:.1f} (calibration)")
    ax.set_xscale("log")
    ax.set_xlabel("checkpoint interval (steps)")
    ax.set_ylabel("training goodput")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", type=Path, required=True, help="scratch folder (outputs/, checkpoints/, results)")
    p.add_argument("--mtbf-steps", type=float, default=18.0)
    p.add_argument("--max-steps", type=int, default=120)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    p.add_argument(
        "--multipliers",
        type=float,
        nargs="+",
        default=[0.25, 0.5, 1.0, 1.5, 2.0, 4.0],
        help="intervals as multiples of Young's k* (unless --intervals)",
    )
    p.add_argument(
        "--intervals",
        type=int,
        nargs="+",
        help="run only these intervals (steps; added to the grid); default: the whole grid",
    )
    p.add_argument("--calib-every", type=int, default=10)
    p.add_argument("--calibrate-only", action="store_true")
    p.add_argument("--collect", action="store_true", help="run nothing: report the runs already on disk")
    p.add_argument("--plot", type=Path, help="write the goodput-vs-interval plot here")
    p.add_argument("--extra", nargs="*", default=[], help="more overrides for every run (calibration included)")
    args = p.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)

    cal_file = args.workdir / "calibration.json"
    if cal_file.exists():
        cal = json.loads(cal_file.read_text())
    else:
        if args.collect:
            raise SystemExit(f"--collect: no {cal_file}; run the calibration first")
        crash_at = args.calib_every * 2 + args.calib_every // 2
        cal = costs(
            run(
                args.workdir,
                "calibrate",
                f"trainer.max_steps={args.calib_every * 4}",
                f"checkpoint.every_n_steps={args.calib_every}",
                "resilience=restart",
                f"fault.events=[{{kind:rank_crash,step:{crash_at},ranks:[1]}}]",
                *args.extra,
            )
        )
        cal = {k: v for k, v in cal.items() if k != "figs"} | {"extra": args.extra}
        cal_file.write_text(json.dumps(cal, indent=1))
    step_s, delta, restart = cal["step_s"], cal["delta_s"], cal["restart_s"]
    print(
        f"calibration: step {step_s:.4f} s, save (blocking) {delta:.4f} s, restart (detect + restart) {restart:.2f} s"
    )
    for i, a in enumerate(cal["attempts"]):
        print(f"  attempt {i}: " + ", ".join(f"{k} {v:.2f}" for k, v in a.items() if k.endswith("_s")))
    m_s = args.mtbf_steps * step_s
    k_young, k_daly = young_interval(delta, m_s) / step_s, daly_interval(delta, m_s) / step_s
    print(f"MTBF {args.mtbf_steps} steps = {m_s:.2f} s: Young k* {k_young:.2f} steps (Daly {k_daly:.2f})")
    if args.calibrate_only:
        return
    # the grid: multipliers x k*, any --intervals, and any interval already run in this workdir
    on_disk = {
        int(d.name[1:].split("_s")[0])
        for d in run_dir(args.workdir, "").glob("k*_s*")
        if complete(args.workdir, d.name)
    }
    grid = sorted({max(1, round(m * k_young)) for m in args.multipliers} | set(args.intervals or []) | on_disk)
    todo = set(args.intervals or grid)
    sweep = {"trainer.max_steps": args.max_steps, "fault.mtbf_steps": args.mtbf_steps}
    runs = []
    for k in grid:
        for seed in args.seeds:
            name = f"k{k}_s{seed}"
            if args.collect or k not in todo:
                if not complete(args.workdir, name):
                    continue
            recs = run(
                args.workdir,
                name,
                *(f"{key}={v}" for key, v in sweep.items()),
                f"checkpoint.every_n_steps={k}",
                "fault=random",
                f"fault.random_seed={seed}",
                "fault.random_kinds=[rank_crash]",
                "resilience=restart",
                "resilience.max_restarts=1000",
                *args.extra,
            )
            c = costs(recs)
            runs.append(
                {
                    "every": k,
                    "seed": seed,
                    "failure_steps": sorted({r["step"] for r in recs if r["ev"] == "injected"}),
                    "measured": training_goodput(c["figs"]),
                    "goodput": c["figs"]["goodput"],
                    **{key: c[key] for key in ("step_s", "delta_s", "restart_s", "failures", "saves")},
                }
            )
    if not runs:
        return
    # The sweep's own costs: medians of step and save time, R = all restart seconds / all failures.
    own = {
        "step_s": statistics.median(r["step_s"] for r in runs),
        "delta_s": statistics.median(r["delta_s"] for r in runs),
        "restart_s": sum(r["restart_s"] * r["failures"] for r in runs) / max(1, sum(r["failures"] for r in runs)),
    }
    k_young_own = young_interval(own["delta_s"], args.mtbf_steps * own["step_s"]) / own["step_s"]
    print(
        f"sweep's own costs: step {own['step_s']:.4f} s, save {own['delta_s']:.4f} s, restart {own['restart_s']:.2f} s:"
        f" Young k* {k_young_own:.2f} steps"
    )

    def sim(k: int, fsteps: list[int], c: dict) -> float:
        return simulate(
            steps=args.max_steps,
            step_s=c["step_s"],
            policy=Policy("sync", k, c["delta_s"]),
            restart_s=c["restart_s"],
            failure_steps=fsteps,
        ).goodput

    print(
        f"\n{'every':>5} {'seed':>4} {'fail':>4} {'step_s':>6} {'save_s':>6} {'R_s':>5} {'measured':>8} {'sim_cal':>7} {'sim_own':>7}"
        f" {'sim_run':>7}"
    )
    for r in runs:
        r["sim_cal"], r["sim_own"] = sim(r["every"], r["failure_steps"], cal), sim(r["every"], r["failure_steps"], own)
        r["sim_run"] = sim(r["every"], r["failure_steps"], r)  # the run's own step, save and restart times
        print(
            f"{r['every']:>5} {r['seed']:>4} {r['failures']:>4} {r['step_s']:>6.3f} {r['delta_s']:>6.3f} {r['restart_s']:>5.2f}"
            f" {r['measured']:>8.4f} {r['sim_cal']:>7.4f} {r['sim_own']:>7.4f} {r['sim_run']:>7.4f}",
            flush=True,
        )
    seeds_done = {k: {r["seed"] for r in runs if r["every"] == k} for k in grid}
    ks = [k for k in grid if seeds_done[k] == set(args.seeds)]  # intervals with every seed
    summary = []
    for k in ks:
        sel = [r for r in runs if r["every"] == k]
        unpaired = [sim(k, schedule_steps(args.mtbf_steps, args.max_steps, s), own) for s in UNPAIRED_SEEDS]
        summary.append(
            {
                "every": k,
                "x_young": k / k_young,
                "failures": sum(r["failures"] for r in sel),
                "measured": statistics.fmean(r["measured"] for r in sel),
                "measured_sd": sd([r["measured"] for r in sel]),
                "sim_paired": statistics.fmean(r["sim_own"] for r in sel),
                "sim_paired_cal": statistics.fmean(r["sim_cal"] for r in sel),
                "sim_unpaired": statistics.fmean(unpaired),
                "sim_unpaired_sd": sd(unpaired),
                "waste": statistics.fmean(1 / r["measured"] - 1 for r in sel),
                "waste_sim": statistics.fmean(1 / r["sim_own"] - 1 for r in sel),
                "waste_unpaired": statistics.fmean(1 / g - 1 for g in unpaired),
            }
        )
    print(
        f"\n{'every':>5} {'x k*':>5} {'fail':>4} {'measured':>16} {'sim paired':>10} {'(cal costs)':>11} {'sim 200 seeds':>16}"
    )
    for s in summary:
        print(
            f"{s['every']:>5} {s['x_young']:>5.2f} {s['failures']:>4} {s['measured']:>8.4f} ± {s['measured_sd']:.4f}"
            f" {s['sim_paired']:>10.4f} {s['sim_paired_cal']:>11.4f} {s['sim_unpaired']:>8.4f} ± {s['sim_unpaired_sd']:.4f}"
        )
    result = {
        "calibration": cal,
        "own_costs": own,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "k_young": k_young,
        "k_daly": k_daly,
        "k_young_own": k_young_own,
        "runs": runs,
        "summary": summary,
    }
    if len(ks) >= 3:
        agree = {
            name: statistics.fmean(abs(r["measured"] - r[name]) for r in runs if r["every"] in ks)
            for name in ("sim_own", "sim_cal", "sim_run")
        }
        fits = {
            "measured": fit_optimum(ks, [s["waste"] for s in summary], args.max_steps),
            "sim_paired": fit_optimum(ks, [s["waste_sim"] for s in summary], args.max_steps),
            "sim_unpaired": fit_optimum(ks, [s["waste_unpaired"] for s in summary], args.max_steps),
        }
        jack = []  # leave one seed out: how much the measured optimum rests on any one seed
        for out in args.seeds:
            w = [
                statistics.fmean(1 / r["measured"] - 1 for r in runs if r["every"] == k and r["seed"] != out)
                for k in ks
            ]
            jack.append(fit_optimum(ks, w, args.max_steps)["optimum"])
        # The design's power: the fitted optimum of exact-cost simulations over 200 other sets of as many seeds
        # (failure sampling alone; no timing noise), against Young's k* for the same costs.
        sets = []
        for i in range(200):
            seeds = [2000 + len(args.seeds) * i + j for j in range(len(args.seeds))]
            w = [
                statistics.fmean(1 / sim(k, schedule_steps(args.mtbf_steps, args.max_steps, s), own) - 1 for s in seeds)
                for k in ks
            ]
            sets.append(fit_optimum(ks, w, args.max_steps)["optimum"])
        sets = [x for x in sets if math.isfinite(x)]
        power = {
            "median": statistics.median(sets),
            "sd": sd(sets),
            "within_10pct": sum(abs(x / k_young_own - 1) <= 0.1 for x in sets) / len(sets),
        }
        best = max(summary, key=lambda s: s["measured"])["every"]
        print(
            f"\nagreement, |measured - simulated| per run (goodput points): sweep's costs {100 * agree['sim_own']:.2f},"
            f" calibration costs {100 * agree['sim_cal']:.2f}, each run's own costs {100 * agree['sim_run']:.2f}"
        )
        for name, f in fits.items():
            print(
                f"fit {name:>12}: waste = {f['a']:.4f} n_saves/N + {f['b']:.5f} k + {f['c']:.4f} -> optimum {f['optimum']:.2f} steps"
            )
        opt = fits["measured"]["optimum"]
        print(
            f"optimum: measured (fit) {opt:.2f} steps = {opt / k_young:.3f} x Young {k_young:.2f} ({100 * (opt / k_young - 1):+.1f} %);"
            f" leave-one-seed-out {min(jack):.2f}..{max(jack):.2f}; best grid point {best}; Daly {k_daly:.2f};"
            f" Young with the sweep's costs {k_young_own:.2f} ({100 * (opt / k_young_own - 1):+.1f} %)"
        )
        print(
            f"design power: fitted optimum of simulated sweeps over 200 other seed sets: median {power['median']:.2f},"
            f" sd {power['sd']:.2f} steps; within 10 % of Young {k_young_own:.2f}: {100 * power['within_10pct']:.0f} % of sets"
        )
        result |= {"agreement": agree, "fits": fits, "jackknife": jack, "best_grid": best, "power": power}
        if args.plot:
            plot(
                args.plot,
                summary,
                fits,
                k_young,
                k_young_own,
                k_daly,
                args.max_steps,
                f"{len(args.seeds)} seeds x {args.max_steps} steps, MTBF {args.mtbf_steps:g} steps, "
                f"step {own['step_s']:.3f} s, save {own['delta_s']:.3f} s, R {own['restart_s']:.2f} s",
            )
    (args.workdir / "validate.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
