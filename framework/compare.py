"""Compare the runs of one MLflow experiment: a table and plots.

``python -m framework.compare --experiment NAME [--tracking-uri URI] [--out DIR] [--no-log]``

The tracking URI defaults, as MLflow's does, to ``$MLFLOW_TRACKING_URI``, else trainlab's
default ``sqlite:///mlruns.db``. One row per training run (newest first is not promised; rows
are sorted by run name): plugin, layout degrees, global batch, tokens/s, MFU, the step-time
fractions, communication bytes per step, peak memory and final loss. The figures are the
run-level values trainlab logs at the end of a run (``perf/tokens_per_sec_mean``,
``perf/mfu_mean``, ``perf/<category>_frac_mean``, ``train/loss_final``) and the last logged
``perf/comm_bytes`` and ``mem/peak_bytes`` (max over ranks).

When runs logged recovery figures (fault injection), a second table puts them side by side
(:mod:`framework.faults.report`; ``compare_recovery.csv``, appended to ``compare.md``).

Writes ``compare.csv``, ``compare.md`` and three PNGs (``loss.png``: train loss vs step;
``throughput.png``: tokens/s and MFU by run; ``breakdown.png``: stacked step-time fractions)
to ``--out`` (default ``reports/<experiment>``), and logs them as artifacts of a run of its own
in the experiment, named ``compare-report`` and tagged ``trainlab.report=true`` (reused on
later calls, and never itself a row of the table). ``--no-log`` skips the artifact upload.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
from pathlib import Path
from typing import Any

from framework.tables import Column, format_table, row_of

REPORT_TAG = "trainlab.report"
REPORT_RUN_NAME = "compare-report"
FRACTIONS = ("data_wait", "compute", "comm", "optimizer", "ckpt_blocking", "other")

# (column, source kind, key, format): the table's columns and where each comes from.
COLUMNS: list[Column] = [
    ("run", "id", "", "s"),  # first 8 characters of the MLflow run id (names are long; the CSV has them)
    ("plugin", "tag", "plugin", "s"),
    ("layout", "tag", "layout", "s"),
    ("global_batch", "param", "derived.global_batch_size", "s"),
    ("tokens_per_sec", "metric", "perf/tokens_per_sec_mean", ",.0f"),
    ("mfu", "metric", "perf/mfu_mean", ".4f"),
    *[(f"{f}_frac", "metric", f"perf/{f}_frac_mean", ".3f") for f in FRACTIONS],
    ("comm_bytes", "metric", "perf/comm_bytes", ",.0f"),
    ("peak_mem_bytes", "metric", "mem/peak_bytes", ",.0f"),
    ("final_loss", "metric", "train/loss_final", ".4f"),
]


def default_tracking_uri() -> str:
    """``$MLFLOW_TRACKING_URI`` if set, else ``sqlite:///mlruns.db``."""
    return os.environ.get("MLFLOW_TRACKING_URI") or "sqlite:///mlruns.db"


def training_runs(client: Any, experiment: str) -> tuple[str, list[Any]]:
    """``(experiment_id, runs)``: the experiment's runs except report runs, sorted by run name.

    Raises:
        ValueError: no experiment with that name.
    """
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        names = sorted(e.name for e in client.search_experiments())
        raise ValueError(f"--experiment {experiment!r} not found; available: {', '.join(names) or '(none)'}")
    runs = [r for r in client.search_runs([exp.experiment_id], max_results=5000) if r.data.tags.get(REPORT_TAG) != "true"]
    return exp.experiment_id, sorted(runs, key=lambda r: r.info.run_name or r.info.run_id)


def _labels(rows: list[dict[str, Any]]) -> list[str]:
    """``plugin layout`` per row, with the short run id added where that is not unique."""
    base = [f"{r['plugin']} {r['layout']}" for r in rows]
    return [b if base.count(b) == 1 else f"{b} {r['run']}" for b, r in zip(base, rows)]


def write_plots(client: Any, runs: list[Any], rows: list[dict[str, Any]], out: Path) -> list[Path]:
    """``loss.png``, ``throughput.png``, ``breakdown.png`` in ``out``; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = _labels(rows)
    paths = []

    fig, ax = plt.subplots(figsize=(7, 4))
    for run, label in zip(runs, labels):
        hist = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "train/loss"))
        if hist:
            ax.plot([s for s, _ in hist], [v for _, v in hist], label=label)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("train loss")
    ax.set_title("Train loss")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    paths.append(out / "loss.png")
    fig.tight_layout()
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 4))
    x = range(len(rows))
    ax1.bar(x, [r["tokens_per_sec"] or 0 for r in rows], color="tab:blue")
    ax1.set_title("tokens/s (whole job)")
    ax2.bar(x, [r["mfu"] or 0 for r in rows], color="tab:orange")
    ax2.set_title("MFU")
    for ax in (ax1, ax2):
        ax.set_xticks(list(x), labels, rotation=20, ha="right", fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    paths.append(out / "throughput.png")
    fig.tight_layout()
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    bottom = [0.0] * len(rows)
    for f in FRACTIONS:
        vals = [r[f"{f}_frac"] or 0.0 for r in rows]
        ax.bar(x, vals, bottom=bottom, label=f)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_xticks(list(x), labels, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("fraction of step time")
    ax.set_ylim(0, 1.05)
    ax.set_title("Step-time breakdown (mean over timed steps)")
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.0, 0.5))
    paths.append(out / "breakdown.png")
    fig.tight_layout()
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


def write_tables(runs: list[Any], rows: list[dict[str, Any]], table: str, out: Path) -> list[Path]:
    """``compare.csv`` (raw values, plus full run id and name) and ``compare.md`` (the printed table)."""
    csv_path, md_path = out / "compare.csv", out / "compare.md"
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[c for c, *_ in COLUMNS] + ["run_id", "run_name"])
        writer.writeheader()
        for run, row in zip(runs, rows):
            writer.writerow({**row, "run_id": run.info.run_id, "run_name": run.info.run_name})
    md_path.write_text("```\n" + table + "\n```\n")
    return [csv_path, md_path]


def log_report(client: Any, experiment_id: str, paths: list[Path]) -> str:
    """Upload ``paths`` as artifacts of the experiment's report run (created once); returns its id."""
    found = client.search_runs([experiment_id], filter_string=f"tags.`{REPORT_TAG}` = 'true'", max_results=1)
    run_id = found[0].info.run_id if found else client.create_run(experiment_id, run_name=REPORT_RUN_NAME, tags={REPORT_TAG: "true"}).info.run_id
    for p in paths:
        client.log_artifact(run_id, str(p))
    client.set_terminated(run_id, status="FINISHED")
    return run_id


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the exit code (2 for a bad argument, e.g. an unknown experiment)."""
    parser = argparse.ArgumentParser(prog="python -m framework.compare", description=__doc__.splitlines()[0])
    parser.add_argument("--experiment", required=True, help="MLflow experiment name (trainlab's experiment_name)")
    parser.add_argument("--tracking-uri", default=None, help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else sqlite:///mlruns.db)")
    parser.add_argument("--out", default=None, help="output folder for the tables and PNGs (default: reports/<experiment>)")
    parser.add_argument("--no-log", action="store_true", help="do not log the outputs as MLflow artifacts")
    args = parser.parse_args(argv)

    from mlflow.tracking import MlflowClient

    uri = args.tracking_uri or default_tracking_uri()
    client = MlflowClient(tracking_uri=uri)
    try:
        experiment_id, runs = training_runs(client, args.experiment)
    except ValueError as err:
        print(f"trainlab: error: {err}", file=sys.stderr)
        return 2
    if not runs:
        print(f"trainlab: error: experiment {args.experiment!r} has no training runs", file=sys.stderr)
        return 2
    rows = [row_of(r, COLUMNS) for r in runs]
    table = format_table(rows, COLUMNS)
    print(table)
    out = Path(args.out or Path("reports") / args.experiment)
    out.mkdir(parents=True, exist_ok=True)
    paths = write_tables(runs, rows, table, out) + write_plots(client, runs, rows, out)
    from framework.faults.report import format_recovery_table, recovery_rows, write_recovery

    recovery = recovery_rows(runs)
    if recovery:  # runs with injected faults: their recovery figures side by side
        recovery_table = format_recovery_table(recovery)
        print("\nrecovery\n" + recovery_table)
        paths += write_recovery(recovery, recovery_table, out)
    print(f"\nwrote {', '.join(p.name for p in paths)} to {out}")
    if not args.no_log:
        run_id = log_report(client, experiment_id, paths)
        print(f"logged as artifacts of run {run_id} ({REPORT_RUN_NAME!r}) in experiment {args.experiment!r} ({uri})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
