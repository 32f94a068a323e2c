"""Compare the runs of a sweep (or of an experiment) by their swept keys: a table and plots.

``python -m framework.compare (--parent-run ID | --experiment NAME) [--x KEY] [--metrics M,...]
[--filter MLFLOW_FILTER] [--tracking-uri URI] [--out DIR] [--no-log] [--quiet]``

The runs: the children of a sweep's parent run (:mod:`framework.driver.sweep`; the newest run per job),
or every training run of an experiment (sweep parents and report runs left out). The tracking
URI defaults, as MLflow's does, to ``$MLFLOW_TRACKING_URI``, else ``sqlite:///mlruns.db``.
``--filter`` is an MLflow search filter (e.g. ``"params.`parallelism.name` = 'ddp'"``).

**Swept keys** (:func:`swept_keys`): a sweep's children carry their swept values (tag
``trainlab.swept``); other runs are compared by the params that differ between them, paths,
tracking settings and derived values left out. One column per swept key; rows are labelled by
their swept values and sorted by them, numbers numerically (``every_n_steps=5`` before ``10``).

**Figures** (run-level values trainlab logs): tokens/s and MFU (``perf/*_mean``), the step-time
fractions (``perf/<category>_frac_mean``), communication bytes per step (``perf/comm_bytes``, and
by kind ``perf/comm_bytes_<kind>`` next to the plugin's model ``perf/comm_bytes_<kind>_model``),
peak and model-state memory (``mem/peak_bytes`` max over ranks, ``mem/model_states_bytes``; GiB),
checkpoint blocking (``ckpt/blocking_s`` summed over the run, seconds), ``goodput`` when logged,
final loss. ``--metrics`` picks table columns (names below or any MLflow metric key). When the
runs' MFU were computed against different peak FLOP/s (on CPU a GEMM measured per run), a note
under the table says so.

**Plots** (``--x``: the swept key on the x axis, default the first numeric one; a second swept
key draws one line per value): ``throughput.png`` (tokens/s, MFU), ``memory.png`` (peak,
model states), ``breakdown.png`` (stacked step-time fractions per row), ``comm.png`` (bytes by
kind, measured and modelled), ``checkpoint.png`` (blocking seconds; when saved), ``goodput.png``
(when logged), ``loss.png`` (train loss vs step per row; final loss vs ``--x``).

When runs logged recovery figures (fault injection), a second table puts them side by side
(:mod:`framework.driver.faults.report`; ``compare_recovery.csv``, appended to ``compare.md``).

Outputs go to ``--out`` (default ``reports/<experiment>[/<sweep>]``): ``compare.csv`` (raw
values, run id and name), ``compare.md`` and the PNGs. They are logged to MLflow: on a sweep's
parent run (``log_table`` ``compare.json`` and ``log_figure`` per plot, plus the files), else on
an experiment's report run (named ``compare-report``, tag ``trainlab.report=true``). ``--no-log``
skips that. Exit code 2 on a bad argument (an unknown experiment, run or key).
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import re
import sys
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from framework.base.tables import Column, format_table

REPORT_TAG = "trainlab.report"
REPORT_RUN_NAME = "compare-report"
FRACTIONS = ("data_wait", "compute", "comm", "optimizer", "ckpt_blocking", "other")
GIB = 1024**3

# (column, metric key, format, scale): the figures of a row; scale turns the logged unit into the column's.
METRICS: list[tuple[str, str, str, float]] = [
    ("tokens_per_sec", "perf/tokens_per_sec_mean", ",.0f", 1.0),
    ("mfu", "perf/mfu_mean", ".4f", 1.0),
    ("step_time_s", "perf/step_time_s_mean", ".4f", 1.0),
    *[(f"{f}_frac", f"perf/{f}_frac_mean", ".3f", 1.0) for f in FRACTIONS],
    ("comm_bytes", "perf/comm_bytes", ",.0f", 1.0),
    ("comm_bytes_model", "perf/comm_bytes_model", ",.0f", 1.0),
    ("peak_mem_GiB", "mem/peak_bytes", ".3f", 1 / GIB),
    ("model_states_GiB", "mem/model_states_bytes", ".4f", 1 / GIB),
    ("ckpt_blocking_s", "ckpt/blocking_s", ".3f", 1.0),  # summed over the run's history
    ("goodput", "goodput", ".3f", 1.0),
    ("final_loss", "train/loss_final", ".4f", 1.0),
    (
        "other_cpu_share",
        "load/other_cpu_share_mean",
        ".2f",
        1.0,
    ),  # the load monitor: other processes' share of the CPUs
]
DEFAULT_METRICS = [m[0] for m in METRICS]
SUMMED = {"ckpt/blocking_s"}

# Params that differ between runs without being what a study compares: paths, tracking, names, derived values.
NOISE_PARAMS = re.compile(
    r"^(derived\.|model\.num_|mfu\.|tracking\.|run_name$|experiment_name$|resume$|checkpoint\.dir$|sweep\.repeats?$"
    r"|data\.cache_dir$|trainer\.progress_bar$|changed\.)"
)


def default_tracking_uri() -> str:
    """``$MLFLOW_TRACKING_URI`` if set, else ``sqlite:///mlruns.db``."""
    return os.environ.get("MLFLOW_TRACKING_URI") or "sqlite:///mlruns.db"


# --- pure functions (unit-tested on synthetic runs) --------------------------------------------


def swept_values(tag: str) -> dict[str, str]:
    """``"a.b=1,c=x"`` (a child's ``trainlab.swept`` tag) -> ``{"a.b": "1", "c": "x"}`` (values have no ``,=``)."""
    out = {}
    for part in re.split(r",(?=[^,=]+=)", tag) if tag else []:
        k, _, v = part.partition("=")
        out[k] = v
    return out


def swept_keys(runs: Sequence[Mapping[str, Any]]) -> list[str]:
    """The keys a set of runs varies: each run is ``{"swept": {key: value} or None, "params": {...}}``.

    Keys of the runs' swept values first (in the order they appear), then params that differ
    between runs and are not :data:`NOISE_PARAMS` nor already named by a swept key (a group
    choice ``parallelism`` covers ``parallelism.*``). Runs with no swept values are compared by
    their differing params only.
    """
    keys: list[str] = []
    for r in runs:
        for k in r.get("swept") or {}:
            if k not in keys:
                keys.append(k)
    if keys and all(r.get("swept") for r in runs):
        return keys
    names = sorted({k for r in runs for k in r["params"]})
    for name in names:
        if NOISE_PARAMS.match(name) or any(name == k or name.startswith(k + ".") for k in keys):
            continue
        if len({r["params"].get(name) for r in runs}) > 1:
            keys.append(name)
    return keys


def natural_key(value: Any) -> tuple:
    """Sort key: numbers (also numeric strings) by value, before text; None last."""
    if value is None:
        return (2, "")
    try:
        f = float(value)
        if not math.isnan(f):
            return (0, f, "")
    except (TypeError, ValueError):
        pass
    return (1, 0.0, str(value))


def sort_rows(rows: list[dict[str, Any]], keys: Sequence[str]) -> list[dict[str, Any]]:
    """Rows sorted by their swept values, key by key, numerically where numeric."""
    return sorted(rows, key=lambda r: tuple(natural_key(r.get(k)) for k in keys))


def short_names(keys: Sequence[str]) -> dict[str, str]:
    """Column names for swept keys: the last dotted part (``checkpoint.every_n_steps`` -> ``every_n_steps``) where unique."""
    last = [k.rsplit(".", 1)[-1] for k in keys]
    return {k: (s if last.count(s) == 1 else k) for k, s in zip(keys, last)}


def row_label(row: Mapping[str, Any], keys: Sequence[str]) -> str:
    """A row's label: its swept values, ``every_n_steps=5 plugin=ddp``."""
    short = short_names(keys)
    return " ".join(f"{short[k]}={row.get(k)}" for k in keys) or str(row.get("run", ""))


def pick_x(rows: Sequence[Mapping[str, Any]], keys: Sequence[str]) -> str | None:
    """The default x-axis key: the first swept key whose values are all numeric, else the first."""
    for k in keys:
        if all(natural_key(r.get(k))[0] == 0 for r in rows):
            return k
    return keys[0] if keys else None


# --- reading MLflow ----------------------------------------------------------------------------


def _client(uri: str) -> Any:
    import logging

    from mlflow.tracking import MlflowClient

    logging.getLogger("mlflow").setLevel(logging.WARNING)
    return MlflowClient(tracking_uri=uri)


def experiment_runs(client: Any, experiment: str, filter_string: str = "") -> tuple[str, list[Any]]:
    """``(experiment_id, runs)``: the experiment's training runs (no sweep parents, no report runs).

    Raises:
        ValueError: no experiment with that name.
    """
    from framework.base.tracking import SWEEP_TAG

    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        names = sorted(e.name for e in client.search_experiments())
        raise ValueError(f"--experiment {experiment!r} not found; available: {', '.join(names) or '(none)'}")
    runs = client.search_runs([exp.experiment_id], filter_string=filter_string, max_results=5000)
    return exp.experiment_id, [
        r for r in runs if r.data.tags.get(REPORT_TAG) != "true" and SWEEP_TAG not in r.data.tags
    ]


def parent_runs(client: Any, parent_run_id: str, filter_string: str = "") -> tuple[Any, list[Any]]:
    """``(parent run, its children)``: the newest child run per job.

    Raises:
        ValueError: no such run.
    """
    from framework.base.tracking import sweep_children

    try:
        parent = client.get_run(parent_run_id)
    except Exception:
        raise ValueError(f"--parent-run {parent_run_id!r} is not a run of this tracking store") from None
    runs = sweep_children(client, parent_run_id)
    if filter_string:
        keep = {
            r.info.run_id
            for r in client.search_runs([parent.info.experiment_id], filter_string=filter_string, max_results=5000)
        }
        runs = [r for r in runs if r.info.run_id in keep]
    return parent, runs


def build_rows(client: Any, runs: Sequence[Any], metric_cols: Sequence[str]) -> tuple[list[dict[str, Any]], list[str]]:
    """One row per run (swept values, status, plugin, layout, the figures) and the swept keys; rows sorted by them."""
    from framework.base.load_monitor import CONTENDED_TAG
    from framework.base.tracking import SWEPT_TAG
    from framework.driver.repeats import REPEAT_KEY

    info = [{"swept": swept_values(r.data.tags.get(SWEPT_TAG, "")), "params": r.data.params} for r in runs]
    keys = [k for k in swept_keys(info) if k != REPEAT_KEY]  # repeats of a configuration are one row (aggregate_rows)
    rows = []
    for r, i in zip(runs, info):
        row: dict[str, Any] = {
            "run": r.info.run_id[:8],
            "run_id": r.info.run_id,
            "run_name": r.info.run_name,
            "status": r.info.status,
            "plugin": r.data.tags.get("plugin"),
            "layout": r.data.tags.get("layout"),
            "global_batch": r.data.params.get("derived.global_batch_size"),
            "repeat": i["swept"].get(REPEAT_KEY, r.data.params.get(REPEAT_KEY, "0")),
            "contended": r.data.tags.get(CONTENDED_TAG),
        }
        for k in keys:
            row[k] = i["swept"].get(k, r.data.params.get(k))
        for col in metric_cols:
            row[col] = _metric_value(client, r, col)
        for key in sorted(r.data.metrics):  # communication by kind (measured and modelled)
            m = re.fullmatch(r"perf/comm_bytes_(\w+?)(_model)?", key)
            if m and m.group(1) not in ("wire", "model"):
                row[f"comm:{m.group(1)}{m.group(2) or ''}"] = r.data.metrics[key]
        rows.append(row)
    return sort_rows(rows, keys), keys


def _metric_value(client: Any, run: Any, col: str) -> float | None:
    spec = next((m for m in METRICS if m[0] == col), None)
    key, scale = (spec[1], spec[3]) if spec else (col, 1.0)
    if key in SUMMED:
        hist = client.get_metric_history(run.info.run_id, key)
        return sum(m.value for m in hist) * scale if hist else None
    v = run.data.metrics.get(key)
    return None if v is None else v * scale


def mfu_peak_note(runs: Sequence[Any]) -> str | None:
    """A note when the runs' MFU denominators, the peak FLOP/s of all their devices (params
    ``mfu.peak_flops_per_device`` x ``derived.world_size``), are more than 10% apart, else None.

    On CPU a device is a rank with its threads, and its peak a GEMM timed once per machine and
    thread count: 1 rank x 2 threads and 2 ranks x 1 thread should total about the same, unless
    one was timed while the machine was busy.
    """
    peaks = []
    for r in runs:
        per_device, devices = (
            r.data.params.get("mfu.peak_flops_per_device"),
            r.data.params.get("derived.world_size", "1"),
        )
        if per_device not in (None, "None"):
            peaks.append(float(per_device) * int(devices))
    peaks.sort()
    if len(peaks) > 1 and peaks[-1] > 1.1 * peaks[0]:
        return (
            f"note: MFU denominators differ between these runs: peak FLOP/s of all devices {peaks[0]:.3g} .. {peaks[-1]:.3g}"
            " (on CPU a GEMM timed per thread count; one timed on a busy machine reads low); compare tokens/s, not MFU"
        )
    return None


STAT_COLS = ("tokens_per_sec", "step_time_s", "mfu")
"""Figures given a 95% interval per configuration (``<col>_lo``, ``<col>_hi``)."""
SERIES = {"tokens_per_sec": "perf/tokens_per_sec", "step_time_s": "perf/step_time_s", "mfu": "perf/mfu"}
"""The logged window series of each, for the within-run interval of a single run."""


def aggregate_rows(
    client: Any,
    rows: Sequence[Mapping[str, Any]],
    keys: Sequence[str],
    metric_cols: Sequence[str],
    *,
    rank_by: str = "tokens_per_sec",
    maximize: bool = True,
) -> list[dict[str, Any]]:
    """One row per configuration (the runs with the same swept values: a sweep's repeats).

    A configuration row holds its swept values, ``n`` (runs with the figure), ``status`` (``FINISHED``,
    or ``3/5 FINISHED``), plugin and layout, the median over its runs of every figure, for
    :data:`STAT_COLS` a 95% interval (``<col>_lo``/``<col>_hi``: bootstrap over repeats; for a
    single run, batch means over its logged windows, :mod:`framework.base.stats`), ``cv`` of
    ``rank_by`` between repeats, ``verdict`` (``rank_by`` against the best configuration;
    ``maximize``: higher is better), ``contended`` (how many of its runs were measured under
    contention, :mod:`framework.base.load_monitor`) and ``run_id`` (``;``-joined). Order: ``rows``' order
    of each configuration's first run.
    """
    from framework.base.stats import summarize, verdicts

    groups: dict[tuple, list[Mapping[str, Any]]] = {}
    for r in rows:
        groups.setdefault(tuple(r.get(k) for k in keys), []).append(r)
    out = []
    for key, runs in groups.items():
        runs = sorted(runs, key=lambda r: natural_key(r.get("repeat")))
        finished = sum(r.get("status") == "FINISHED" for r in runs)
        row: dict[str, Any] = {
            **{k: v for k, v in zip(keys, key)},
            "n": len(runs),
            "status": "FINISHED" if finished == len(runs) else f"{finished}/{len(runs)} FINISHED",
            "plugin": runs[0].get("plugin"),
            "layout": runs[0].get("layout"),
            "global_batch": runs[0].get("global_batch"),
            "run_id": ";".join(r["run_id"] for r in runs),
            "run_name": runs[0].get("run_name"),
            "run": runs[0].get("run"),
        }
        contended = sum(str(r.get("contended")).lower() == "true" for r in runs)
        row["contended"] = f"{contended}/{len(runs)}" if contended else ""
        extra = sorted({c for r in runs for c in r if c.startswith("comm:")})
        for col in [*metric_cols, *extra, *[c for c in STAT_COLS if c not in metric_cols]]:
            vals = [float(r[col]) for r in runs if r.get(col) is not None]
            row[col] = float(np.median(vals)) if vals else None
            if col in STAT_COLS and vals:
                within = None
                if len(vals) == 1 and client is not None:
                    hist = sorted((m.step, m.value) for m in client.get_metric_history(runs[0]["run_id"], SERIES[col]))
                    within = [v for _, v in hist]
                stat = summarize(vals, within)
                row[f"{col}_lo"], row[f"{col}_hi"] = (stat.lo, stat.hi) if stat else (None, None)
                row[f"{col}_n"] = stat.n if stat else 0
                if col == rank_by:
                    row["cv"] = stat.cv if stat else None
                    row[f"{col}_ci"] = (
                        f"[{stat.lo:,.0f}, {stat.hi:,.0f}]" + ("" if stat.method == "bootstrap" else " within-run")
                        if stat and stat.lo is not None
                        else None
                    )
        row["_samples"] = [float(r[rank_by]) for r in runs if r.get(rank_by) is not None]
        out.append(row)
    verdict = verdicts({_label(r, keys): r["_samples"] for r in out if r["_samples"]}, maximize=maximize)
    for r in out:
        v = verdict.get(_label(r, keys))
        r["verdict"] = None if v is None else str(v)
        r["verdict_kind"] = None if v is None else v.kind
        r.pop("_samples")
    return out


def _label(row: Mapping[str, Any], keys: Sequence[str]) -> str:
    return row_label(row, keys) or str(row.get("run"))


def contention_note(rows: Sequence[Mapping[str, Any]], keys: Sequence[str]) -> str | None:
    """A warning under the table when any run was measured under contention (tag ``contended=true``), else None."""
    hit = [r for r in rows if r.get("contended")]
    if not hit:
        return None
    return (
        "warning: measured under contention (tag contended=true, load/* metrics; docs/metrics.md): "
        + ", ".join(f"{_label(r, keys)} ({r['contended']} runs)" for r in hit)
        + "; their throughput is not this machine's: re-run them on an idle machine, or with repeats"
    )


def table_columns(keys: Sequence[str], metric_cols: Sequence[str], rows: Sequence[Mapping[str, Any]]) -> list[Column]:
    """The printed table's columns: swept keys, status, plugin, layout, then the figures any row has."""
    short = short_names(keys)
    cols: list[Column] = [(k, "", short[k], "s") for k in keys]
    cols += [("status", "", "status", "s"), ("plugin", "", "plugin", "s"), ("layout", "", "layout", "s")]
    # aggregated rows (aggregate_rows): the verdict, the interval and contention (text first: left-aligned)
    for col, header in (("verdict", "verdict"), ("tokens_per_sec_ci", "tokens/s 95% CI"), ("contended", "contended")):
        if any(r.get(col) for r in rows):
            cols.append((col, "", header, "s"))
    if any(r.get("n") is not None for r in rows):
        cols.append(("n", "", "n", "d"))
    for col in metric_cols:
        if any(r.get(col) is not None for r in rows):
            spec = next((m for m in METRICS if m[0] == col), (col, col, ".4g", 1.0))
            cols.append((col, "", col, spec[2]))
        if col == "tokens_per_sec" and any(r.get("cv") is not None for r in rows):
            cols.append(("cv", "", "cv", ".1%"))
    return cols


def render_table(rows: Sequence[Mapping[str, Any]], cols: Sequence[Column]) -> str:
    """The fixed-width table, headed by the short names of the swept keys."""
    renamed = [(header, "", "", spec) for _, _, header, spec in cols]
    data = [{header: r.get(name) for name, _, header, _ in cols} for r in rows]
    return format_table(data, renamed, text_columns=len([c for c in cols if c[3] == "s"]))


# --- plots ---------------------------------------------------------------------------------------


def _series(
    rows: Sequence[Mapping[str, Any]], x: str | None, hue: str | None
) -> tuple[list[str], dict[str, list[Mapping[str, Any]]]]:
    """x tick values (sorted) and, per value of ``hue`` (or one series ``""``), its rows in x order."""
    xs = sorted({str(r.get(x)) for r in rows}, key=natural_key) if x else [row_label(r, []) for r in rows]
    groups: dict[str, list[Mapping[str, Any]]] = {}
    for r in rows:
        groups.setdefault(str(r.get(hue)) if hue else "", []).append(r)
    return xs, {
        h: sorted(g, key=lambda r: natural_key(r.get(x)))
        for h, g in sorted(groups.items(), key=lambda kv: natural_key(kv[0]))
    }


def _line_panel(
    ax: Any, rows: Sequence[Mapping[str, Any]], x: str, hue: str | None, col: str, title: str, ylabel: str
) -> bool:
    """``col`` against ``x``, one series per ``hue`` value, the 95% interval as error bars where a row
    has one (``<col>_lo``/``<col>_hi``, :func:`aggregate_rows`): lines over a numeric ``x``, grouped
    bars over categories; the y axis starts at 0 (a cropped axis makes noise look like a finding).
    False when no data."""
    xs, groups = _series(rows, x, hue)
    pos = {v: i for i, v in enumerate(xs)}
    numeric = all(natural_key(v)[0] == 0 for v in xs)
    width = 0.8 / max(1, len(groups))
    drawn = False
    short = short_names([k for k in (x, hue) if k])
    for i, (h, g) in enumerate(groups.items()):
        pts = [
            (pos[str(r.get(x))], r[col], r.get(f"{col}_lo"), r.get(f"{col}_hi")) for r in g if r.get(col) is not None
        ]
        if not pts:
            continue
        p, v = [q for q, *_ in pts], [y for _, y, *_ in pts]
        err = None
        if any(lo is not None for *_, lo, _ in pts):
            err = [
                [max(0.0, y - lo) if lo is not None else 0.0 for _, y, lo, _ in pts],
                [max(0.0, hi - y) if hi is not None else 0.0 for _, y, _, hi in pts],
            ]
        label = f"{short[hue]}={h}" if hue else None
        if numeric:
            ax.errorbar(p, v, yerr=err, marker="o", capsize=3, label=label)
        else:
            ax.bar([q + (i - (len(groups) - 1) / 2) * width for q in p], v, width, yerr=err, capsize=3, label=label)
        drawn = True
    if drawn and all(y >= 0 for r in rows if r.get(col) is not None for y in [r[col]]):
        ax.set_ylim(bottom=0)
    ax.set_xticks(range(len(xs)), xs)
    ax.set_xlabel(short[x])
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if hue and drawn:
        ax.legend(fontsize=8)
    return drawn


def write_plots(
    client: Any, rows: Sequence[Mapping[str, Any]], keys: Sequence[str], x: str | None, out: Path
) -> list[tuple[Path, Any]]:
    """The report's PNGs in ``out``; returns ``(path, figure)`` pairs (figures closed by the caller)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hue = next((k for k in keys if k != x), None)
    labels = [row_label(r, keys) for r in rows]
    figs: list[tuple[Path, Any]] = []

    def panels(name: str, specs: list[tuple[str, str, str]]) -> None:
        if x is None or not any(r.get(c) is not None for c, _, _ in specs for r in rows):
            return
        fig, axes = plt.subplots(1, len(specs), figsize=(5 * len(specs), 4), squeeze=False)
        for ax, (col, title, ylabel) in zip(axes[0], specs):
            ci = any(r.get(f"{col}_lo") is not None for r in rows)
            _line_panel(ax, rows, x, hue, col, title + ("\n(error bars: 95% CI)" if ci else ""), ylabel)
        fig.tight_layout()
        figs.append((out / name, fig))

    panels(
        "throughput.png", [("tokens_per_sec", "tokens/s (whole job, timed steps)", "tokens/s"), ("mfu", "MFU", "MFU")]
    )
    panels(
        "memory.png",
        [
            ("peak_mem_GiB", "peak memory (max over ranks)", "GiB"),
            ("model_states_GiB", "model states (params+grads+optimizer)", "GiB"),
        ],
    )

    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(rows) + 3), 4))
    bottom = [0.0] * len(rows)
    for f in FRACTIONS:
        vals = [r.get(f"{f}_frac") or 0.0 for r in rows]
        ax.bar(range(len(rows)), vals, bottom=bottom, label=f)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_xticks(range(len(rows)), labels, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("fraction of step time")
    ax.set_ylim(0, 1.05)
    ax.set_title("Step-time breakdown (mean over timed steps)")
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.tight_layout()
    figs.append((out / "breakdown.png", fig))

    kinds = sorted({k[5:].removesuffix("_model") for r in rows for k in r if k.startswith("comm:")})
    if kinds:
        fig, ax = plt.subplots(figsize=(max(6, 1.4 * len(rows) + 3), 4))
        width = 0.8 / (2 * len(kinds))
        for i, kind in enumerate(kinds):
            for j, (suffix, hatch) in enumerate((("", None), ("_model", "//"))):
                vals = [r.get(f"comm:{kind}{suffix}") or 0.0 for r in rows]
                off = (2 * i + j) * width - 0.4 + width / 2
                ax.bar(
                    [p + off for p in range(len(rows))],
                    vals,
                    width,
                    hatch=hatch,
                    alpha=0.6 if suffix else 1.0,
                    color=f"C{i}",
                    label=f"{kind} ({'model' if suffix else 'measured'})",
                )
        ax.set_xticks(range(len(rows)), labels, rotation=20, ha="right", fontsize=8)
        ax.set_ylabel("bytes per optimizer step (payload)")
        ax.set_title("Communication by kind: measured vs cost model")
        ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
        fig.tight_layout()
        figs.append((out / "comm.png", fig))

    panels("checkpoint.png", [("ckpt_blocking_s", "checkpoint blocking (summed over the run)", "s")])
    panels("goodput.png", [("goodput", "goodput", "fraction of wall time")])

    fig, axes = plt.subplots(1, 2 if x else 1, figsize=(11 if x else 7, 4), squeeze=False)
    ax = axes[0][0]
    for row, label in zip(rows, labels):  # in the table's order
        hist = sorted((m.step, m.value) for m in client.get_metric_history(row["run_id"].split(";")[0], "train/loss"))
        if hist:
            ax.plot([s for s, _ in hist], [v for _, v in hist], label=label)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("train loss")
    ax.set_title("Train loss")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    if x:
        _line_panel(axes[0][1], rows, x, hue, "final_loss", "final train loss", "loss")
    fig.tight_layout()
    figs.append((out / "loss.png", fig))
    for path, fig in figs:
        fig.savefig(path, dpi=110)
    return figs


def write_tables(
    rows: Sequence[Mapping[str, Any]],
    cols: Sequence[Column],
    table: str,
    out: Path,
    run_rows: Sequence[Mapping[str, Any]] | None = None,
) -> list[Path]:
    """``compare.csv`` (one row per configuration, raw values: the table's columns, the intervals,
    communication by kind, run ids and name), ``compare.md`` and, given ``run_rows``,
    ``compare_runs.csv`` (one row per run, with its repeat index)."""
    csv_path, md_path = out / "compare.csv", out / "compare.md"
    extra = sorted({k for r in rows for k in r if k.startswith("comm:") or k.endswith(("_lo", "_hi"))})
    fields = [c[0] for c in cols] + extra + ["run_id", "run_name"]
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    md_path.write_text("```\n" + table + "\n```\n")
    paths = [csv_path, md_path]
    if run_rows is not None:
        runs_path = out / "compare_runs.csv"
        names = [c[0] for c in cols if c[0] not in ("n", "verdict", "tokens_per_sec_ci", "cv")]
        fields = (
            names
            + ["repeat"]
            + sorted({k for r in run_rows for k in r if k.startswith("comm:")})
            + ["run_id", "run_name"]
        )
        with open(runs_path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(run_rows)
        paths.append(runs_path)
    return paths


def log_to_run(
    client: Any,
    run_id: str,
    paths: Iterable[Path],
    figs: Sequence[tuple[Path, Any]],
    rows: Sequence[Mapping[str, Any]],
    cols: Sequence[Column],
) -> None:
    """The report on ``run_id``: ``log_table`` (``compare.json``), ``log_figure`` per plot (``compare/<name>``) and the files.
    A report logged again (a sweep run again) replaces ``compare.json``; MLflow's ``log_table`` would append its rows."""
    data = {c[2]: [r.get(c[0]) for r in rows] for c in cols}
    if any(f.path == "compare.json" for f in client.list_artifacts(run_id)):
        import pandas as pd

        with tempfile.TemporaryDirectory() as tmp:  # the same file log_table writes (orient="split"), over the old one
            path = Path(tmp) / "compare.json"
            pd.DataFrame(data).to_json(path, orient="split", index=False, date_format="iso")
            client.log_artifact(run_id, str(path))
    else:
        client.log_table(run_id, data=data, artifact_file="compare.json")
    for path, fig in figs:
        client.log_figure(run_id, fig, f"compare/{path.name}")
    for p in paths:
        client.log_artifact(run_id, str(p))


def report_run(client: Any, experiment_id: str) -> str:
    """The experiment's report run (created once, tag ``trainlab.report=true``); returns its id."""
    found = client.search_runs([experiment_id], filter_string=f"tags.`{REPORT_TAG}` = 'true'", max_results=1)
    return (
        found[0].info.run_id
        if found
        else client.create_run(experiment_id, run_name=REPORT_RUN_NAME, tags={REPORT_TAG: "true"}).info.run_id
    )


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the exit code (2 for a bad argument, e.g. an unknown experiment)."""
    parser = argparse.ArgumentParser(prog="python -m framework.compare", description=__doc__.splitlines()[0])
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument(
        "--experiment", help="MLflow experiment name (trainlab's experiment_name): all its training runs"
    )
    which.add_argument("--parent-run", help="a sweep's parent MLflow run id: its child runs")
    parser.add_argument(
        "--x",
        default=None,
        help="swept key on the plots' x axis, whole or its column name (default: the first numeric swept key)",
    )
    parser.add_argument(
        "--metrics",
        default=None,
        help=f"comma-separated table columns (default: all; names: {', '.join(DEFAULT_METRICS)}; or MLflow metric keys)",
    )
    parser.add_argument(
        "--filter", default="", help="MLflow search filter on the runs, e.g. \"params.`parallelism.name` = 'ddp'\""
    )
    parser.add_argument(
        "--tracking-uri",
        default=None,
        help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else sqlite:///mlruns.db)",
    )
    parser.add_argument("--out", default=None, help="output folder (default: reports/<experiment>[/<sweep>])")
    parser.add_argument("--no-log", action="store_true", help="do not log the outputs to MLflow")
    parser.add_argument("--quiet", action="store_true", help="print only the table")
    parser.add_argument(
        "--rank-by",
        default="tokens_per_sec",
        help=f"the figure the verdicts rank ({', '.join(STAT_COLS)}; step_time_s: lower is better)",
    )
    args = parser.parse_args(argv)

    def bad(msg: str) -> int:
        print(f"trainlab: error: {msg}", file=sys.stderr)
        return 2

    uri = args.tracking_uri or default_tracking_uri()
    client = _client(uri)
    try:
        if args.parent_run:
            parent, runs = parent_runs(client, args.parent_run, args.filter)
            experiment = client.get_experiment(parent.info.experiment_id).name
            log_id = parent.info.run_id
            default_out = Path("reports") / experiment / parent.info.run_id[:8]
        else:
            experiment_id, runs = experiment_runs(client, args.experiment, args.filter)
            experiment, log_id, default_out = args.experiment, None, Path("reports") / args.experiment
    except ValueError as err:
        return bad(str(err))
    except Exception as err:  # e.g. a malformed --filter
        return bad(f"--filter {args.filter!r}: {str(err).splitlines()[0]}")
    if not runs:
        return bad(
            f"no training runs in {'sweep ' + args.parent_run if args.parent_run else 'experiment ' + repr(experiment)}"
            + (f" match --filter {args.filter!r}" if args.filter else "")
        )
    metric_cols = [m.strip() for m in args.metrics.split(",")] if args.metrics else DEFAULT_METRICS
    run_rows, keys = build_rows(client, runs, metric_cols)
    if args.rank_by not in STAT_COLS:
        return bad(f"--rank-by {args.rank_by!r}: allowed {', '.join(STAT_COLS)}")
    rows = aggregate_rows(
        client, run_rows, keys, metric_cols, rank_by=args.rank_by, maximize=args.rank_by != "step_time_s"
    )
    by_short = {v: k for k, v in short_names(keys).items()}
    if args.x is not None and args.x not in keys and args.x not in by_short:
        return bad(f"--x {args.x!r} is not a swept key of these runs; swept keys: {', '.join(keys) or '(none)'}")
    x = by_short.get(args.x, args.x) or pick_x(rows, keys)
    cols = table_columns(keys, metric_cols, rows)
    table = render_table(rows, cols)
    for note in (mfu_peak_note(runs), contention_note(rows, keys)):
        if note:
            table += "\n" + note
    if any(r["n"] > 1 for r in rows):
        table += (
            "\nmedians over each configuration's runs; 95% CI: bootstrap over repeats (within-run: batch means"
            " over logged windows); verdicts: ratio of medians against the best, bootstrap (docs/sweeps.md)"
        )
    print(table)
    out = Path(args.out) if args.out else default_out
    out.mkdir(parents=True, exist_ok=True)
    paths = write_tables(rows, cols, table, out, run_rows)
    figs = write_plots(client, rows, keys, x, out)
    paths += [p for p, _ in figs]
    from framework.driver.faults.report import format_recovery_table, recovery_rows, write_recovery

    recovery = recovery_rows(list(runs))
    if recovery:  # runs with injected faults: their recovery figures side by side
        recovery_table = format_recovery_table(recovery)
        print("\nrecovery\n" + recovery_table)
        paths += write_recovery(recovery, recovery_table, out)
    if not args.quiet:
        print(f"\nwrote {', '.join(p.name for p in paths)} to {out}")
    try:
        if not args.no_log:
            if log_id is None:
                log_id = report_run(client, experiment_id)
                for p in paths:
                    client.log_artifact(log_id, str(p))
                client.set_terminated(log_id, status="FINISHED")
            else:
                log_to_run(client, log_id, [p for p in paths if p.suffix != ".png"], figs, rows, cols)
            if not args.quiet:
                print(f"logged to MLflow run {log_id} in experiment {experiment!r} ({uri})")
    finally:
        import matplotlib.pyplot as plt

        for _, fig in figs:
            plt.close(fig)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
