"""Elastic shrink measured on this machine: 4 -> 3 DDP ranks (a quarter lost, the guide's 1024 -> 768).

Runs, one after another, in a scratch folder (default /tmp/elastic_shrink_work; its mlruns.db holds
every run), gpt_tiny, 4 ranks, global batch 12 (micro-batch 1 x 3 accumulation steps), 80 steps,
checkpoints every 10; rank 3 crashes in step 35 with no restarts left, so the driver relaunches on 3
ranks from the step-30 checkpoint:

- ``ref``         uninterrupted, 4 ranks
- ``keep_k0``     shrink, global batch 12 kept (accumulation 3 -> 4), no LR re-warm-up
- ``keep_k5``     ... LR re-warmed over 5 steps (``resilience.rewarmup_steps=5``)
- ``keep_k20``    ... over 20 steps
- ``scale_k0``    shrink, the batch shrunk with the ranks (12 -> 9) and the LR scaled by 3/4
                  (``resilience.shrink_batch=scale``)

then writes ``results.json``, ``results.md`` and ``loss.png`` next to this file. Losses are
independent of the machine's load (fp32, fixed seeds); times are not (a shared 2-core machine):
the report names them "measured under load".

    python experiments/elastic_shrink/measure.py            # runs + report (~10 min on 2 shared cores)
    python experiments/elastic_shrink/measure.py --report   # the report again from the scratch folder
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
EXPERIMENT = "elastic_shrink"
MAX_STEPS, CRASH_STEP, EVERY = 80, 35, 10
COMMON = [
    "model=gpt_tiny",
    "parallelism=ddp",
    "parallelism.world_size=4",
    "trainer.global_batch_size=12",
    "trainer.micro_batch_size=1",
    "trainer.grad_accum_steps=null",
    f"trainer.max_steps={MAX_STEPS}",
    "trainer.log_every_n_steps=1",
    "trainer.val_every_n_steps=10",
    "trainer.val_sequences=48",
    "trainer.progress_bar=false",
    f"checkpoint.every_n_steps={EVERY}",
    "checkpoint.keep_last_k=2",
    f"experiment_name={EXPERIMENT}",
    "tracking.system_metrics_interval_s=0",
]
SHRINK = [
    "resilience=shrink",
    "resilience.max_restarts=0",
    "resilience.shrink_to=0.75",
    f"fault.events=[{{kind:rank_crash,step:{CRASH_STEP},ranks:[3]}}]",
]
ARMS = {
    "ref": [],
    "keep_k0": [*SHRINK, "resilience.rewarmup_steps=0"],
    "keep_k5": [*SHRINK, "resilience.rewarmup_steps=5"],
    "keep_k20": [*SHRINK, "resilience.rewarmup_steps=20"],
    "scale_k0": [*SHRINK, "resilience.shrink_batch=scale", "resilience.rewarmup_steps=0"],
}
LABEL = {
    "ref": "uninterrupted, 4 ranks, batch 12",
    "keep_k0": "shrink 4->3, batch 12 kept (accum 3->4), no re-warm",
    "keep_k5": "shrink 4->3, batch 12 kept, LR re-warm 5 steps",
    "keep_k20": "shrink 4->3, batch 12 kept, LR re-warm 20 steps",
    "scale_k0": "shrink 4->3, batch 12->9, LR x 3/4",
}


def run_arm(workdir: Path, name: str) -> float:
    """Run one arm with the driver (``cwd=workdir``); returns its wall seconds (under load)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    shutil.rmtree(workdir / "checkpoints" / EXPERIMENT / name, ignore_errors=True)  # a re-run starts afresh
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "framework.train", *COMMON, f"run_name={name}", *ARMS[name]],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - t0
    (workdir / f"{name}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed (exit {proc.returncode}); see {workdir / (name + '.log')}")
    return wall


def collect(workdir: Path) -> dict:
    """Loss curves and recovery figures of every arm from the scratch folder's MLflow store."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{workdir / 'mlruns.db'}")
    exp = client.get_experiment_by_name(EXPERIMENT)
    out = {}
    for name in ARMS:
        runs = client.search_runs(
            [exp.experiment_id],
            filter_string=f"attributes.run_name = '{name}'",
            order_by=["attributes.start_time DESC"],
        )
        run = runs[0]

        def hist(key):
            return {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}

        m = run.data.metrics
        out[name] = {
            "status": run.info.status,
            "train_loss": hist("train/loss"),
            "val_loss": hist("val/loss"),
            "lr": hist("train/lr"),
            "world_size": hist("elastic/world_size"),
            "wall_s": (run.info.end_time - run.info.start_time) / 1000,
            **{
                k: m.get(k)
                for k in (
                    "recovery/time_s",
                    "recovery/recomputed_steps",
                    "recovery/restarts",
                    "goodput",
                    "goodput/lost_s",
                    "goodput/restart_s",
                    "goodput/wall_s",
                )
            },
            "history": run.data.tags.get("elastic.history", ""),
        }
    return out


def ref_step_at(ref_val: dict[int, float], loss: float) -> float:
    """The (linearly interpolated) step at which the reference's val loss first fell to ``loss``."""
    pts = sorted(ref_val.items())
    for (s0, l0), (s1, l1) in zip(pts, pts[1:]):
        if l1 <= loss <= l0:
            return s0 + (l0 - loss) / (l0 - l1) * (s1 - s0) if l0 != l1 else s1
    return float(pts[-1][0]) if loss <= pts[-1][1] else float(pts[0][0])


def report(data: dict) -> str:
    ref = data["ref"]
    ref_final = ref["val_loss"][max(ref["val_loss"])]
    rows = [
        "| arm | what | val loss @80 | Δ vs ref | steps behind ref (val) | mean train loss 36-45 | "
        "recomputed steps | recovery s | wall s | goodput |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    summary = {}
    ref_window = _mean(ref["train_loss"], CRASH_STEP + 1, CRASH_STEP + 10)
    for name, d in data.items():
        final = d["val_loss"][max(d["val_loss"])]
        behind = MAX_STEPS - ref_step_at(ref["val_loss"], final)
        window = _mean(d["train_loss"], CRASH_STEP + 1, CRASH_STEP + 10)
        summary[name] = {
            "val_loss_final": final,
            "delta_vs_ref": final - ref_final,
            "steps_behind_ref": behind,
            "train_loss_36_45": window,
            "train_loss_36_45_delta": window - ref_window,
            "recomputed_steps": d["recovery/recomputed_steps"],
            "recovery_s": d["recovery/time_s"],
            "wall_s": d["wall_s"],
            "goodput": d["goodput"],
        }
        rows.append(
            f"| `{name}` | {LABEL[name]} | {final:.4f} | {final - ref_final:+.4f} | {behind:.1f} | "
            f"{window:.4f} ({window - ref_window:+.4f}) | {_fmt(d['recovery/recomputed_steps'], '.0f')} | "
            f"{_fmt(d['recovery/time_s'], '.1f')} | {d['wall_s']:.0f} | {_fmt(d['goodput'], '.3f')} |"
        )
    data["_summary"] = summary
    return "\n".join(rows)


def _mean(series: dict[int, float], a: int, b: int) -> float:
    vals = [v for s, v in series.items() if a <= s <= b]
    return sum(vals) / len(vals)


def _fmt(x, spec):
    return "–" if x is None else format(x, spec)


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(16, 4.5))
    for name in ARMS:
        d = data[name]
        tl = sorted(d["train_loss"].items())
        ax1.plot([s for s, _ in tl], [v for _, v in tl], label=name, lw=1)
        vl = sorted(d["val_loss"].items())
        ax2.plot([s for s, _ in vl], [v for _, v in vl], marker="o", label=name)
        lr = sorted(d["lr"].items())
        ax3.plot([s for s, _ in lr], [v for _, v in lr], label=name)
    for ax, title in ((ax1, "train loss per step"), (ax2, "val loss"), (ax3, "learning rate")):
        ax.axvline(CRASH_STEP, color="grey", ls=":", lw=1)
        ax.set_xlabel("optimizer step")
        ax.set_title(title)
        ax.legend(fontsize=7)
    ax1.set_xlim(CRASH_STEP - 10, MAX_STEPS)
    ax1.set_ylim(
        min(min(d["train_loss"].values()) for d in data.values() if isinstance(d, dict) and "train_loss" in d) - 0.05,
        max(data["ref"]["train_loss"][s] for s in range(CRASH_STEP - 10, CRASH_STEP)) + 0.3,
    )
    fig.suptitle(f"gpt_tiny, 4 -> 3 DDP ranks (rank 3 lost in step {CRASH_STEP}, resumed from step 30)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/elastic_shrink_work"))
    ap.add_argument("--report", action="store_true", help="only rebuild the report from the scratch folder")
    ap.add_argument("--arms", default=",".join(ARMS), help="comma-separated arms to run")
    args = ap.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    if not args.report:
        for name in args.arms.split(","):
            print(f"{name}: {' '.join(ARMS[name]) or '(no fault)'}", flush=True)
            print(f"  {run_arm(args.workdir, name):.0f} s (under load)", flush=True)
    data = collect(args.workdir)
    table = report(data)
    (HERE / "results.md").write_text(
        "<!-- written by experiments/elastic_shrink/measure.py; losses are load-independent, seconds were measured "
        "under load on a shared 2-core machine -->\n" + table + "\n"
    )
    (HERE / "results.json").write_text(json.dumps({k: v for k, v in data.items()}, indent=1, default=str))
    plot(data, HERE / "loss.png")
    print(table)


if __name__ == "__main__":
    main()
