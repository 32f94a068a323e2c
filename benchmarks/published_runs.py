"""Predict published training runs from their shape, layout, batch and hardware alone, fit set vs held out.

    PYTHONPATH=$PWD python benchmarks/published_runs.py           # the table with the cost model as configured
    PYTHONPATH=$PWD python benchmarks/published_runs.py --fit     # refit the fitted numbers on the fit sources, then the table
    PYTHONPATH=$PWD python benchmarks/published_runs.py --terms   # each model term on/off: median/worst per set, before -> after
    PYTHONPATH=$PWD python benchmarks/published_runs.py --sensitivity  # the unpublished settings the worst misses hang on

The runs, their sources (paper and table), the settings assumed where a source does not publish
them, and the split into a ``fit`` and a ``heldout`` set BY SOURCE (one source = one publication,
its ``document``) are in
``benchmarks/published_runs.yaml``. The cost model (:mod:`framework.base.cost`) predicts each row's
step time and this script prints the published figure beside the prediction in the source's own
metric, the error per row, whether the run is predicted to fit the GPU's memory (it ran, so it
must), and the median and worst |error| on each set. ``--fit`` fits every fitted number (the
achievable fraction of the dense peak per GPU type, :data:`FIT_GROUPS`, and the memory-bound
elementwise traffic per layer, ``StepTimeParams.elementwise_bytes_per_h``) on the fit rows
only (grid search, median |log error|).
"""

from __future__ import annotations

import argparse
import functools
import math
import statistics
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import yaml

from framework.base.cost.collectives import layout_collectives
from framework.base.cost.comm import ZERO3_COLLECTIVES
from framework.base.cost.estimate import estimate
from framework.base.cost.flops import megatron_flops_per_step
from framework.base.cost.hardware import cluster_from_dict
from framework.base.cost.layout import PlanLayout
from framework.base.cost.memory import stage_layers
from framework.base.cost.shape import ModelShape
from framework.base.cost.steptime import StepTimeParams, step_time
from framework.driver.cli import CONF_DIR

DATA = Path(__file__).with_name("published_runs.yaml")
FIT_GROUPS = {"a100": ("a100_80gb", "a100_40gb"), "h100": ("h100_sxm", "h100_96gb", "h200")}
"""GPU types sharing one achievable fraction (same compute die): the fitted value is written to each file."""
METRICS = ("hfu_tflops", "tflops_8n", "model_tflops", "mfu", "step_s", "tokens_per_gpu")


@dataclass(frozen=True)
class Row:
    """One published run: source, set (fit | heldout), shape, cluster file, layout, metric and figure."""

    source: str
    set: str
    name: str
    model: str
    shape: ModelShape
    cluster: str
    layout: PlanLayout
    metric: str
    published: float
    assumed: str = ""
    params: tuple = ()  # (name, value) StepTimeParams overrides of the source (the framework it ran), then of the row
    memory_gib: float | None = None  # peak memory per GPU the source reports (GiB), where it does


def load_rows(path: Path = DATA) -> tuple[dict, list[Row]]:
    """The sources and the rows of ``published_runs.yaml``.

    Raises:
        ValueError: a row naming an unknown source, model or metric, or whose GPU count is not tp·pp·dp;
            two sources with one ``document`` (one publication is one source, whatever its tables).
    """
    raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    sources, models = raw["sources"], raw["models"]
    docs: dict[str, str] = {}
    for name, src in sources.items():
        if src["document"] in docs:
            raise ValueError(
                f"{path.name}: sources {docs[src['document']]!r} and {name!r} are one document "
                f"({src['document']}): one publication is one source"
            )
        docs[src["document"]] = name
    rows = []
    for r in raw["runs"]:
        where = f"{path.name}: run {r.get('name')!r}"
        if r["source"] not in sources or r["model"] not in models or r["metric"] not in METRICS:
            raise ValueError(f"{where}: unknown source, model or metric ({r['source']}, {r['model']}, {r['metric']})")
        shape = ModelShape(**models[r["model"]], seq_len=r["seq_len"], max_seq_len=r["seq_len"])
        tp, pp = r["tp"], r["pp"]
        if r["gpus"] % (tp * pp):
            raise ValueError(f"{where}: gpus={r['gpus']} is not a multiple of tp*pp={tp * pp}")
        lay = PlanLayout(
            dp=r["gpus"] // (tp * pp),
            tp=tp,
            pp=pp,
            micro_batch_size=r.get("micro_batch", 1),
            global_batch_size=r["global_batch"],
            schedule=r.get("schedule", "1F1B"),
            virtual_stages=r.get("virtual_stages", 1),
            zero_stage=r.get("zero_stage", 0),
            recompute=r.get("recompute", "none"),
            sequence_parallel=r.get("sequence_parallel", False),
            precision=r.get("precision", "bf16"),
        )
        rows.append(
            Row(
                r["source"],
                sources[r["source"]]["set"],
                r["name"],
                r["model"],
                shape,
                r["gpu"],
                lay,
                r["metric"],
                float(r["published"]),
                r.get("assumed", ""),
                tuple(sorted({**(sources[r["source"]].get("params") or {}), **(r.get("params") or {})}.items())),
                r.get("memory_gib"),
            )
        )
    return sources, rows


@functools.cache
def load_cluster(name: str, fraction: float | None = None, peak_flops: float | None = None):
    """``conf/cluster/<name>.yaml`` (``fraction`` replaces its achievable fraction, ``peak_flops`` its peak)."""
    raw = yaml.safe_load((CONF_DIR / "cluster" / f"{name}.yaml").read_text(encoding="utf-8"))
    if fraction is not None:
        raw["achievable_fraction"] = fraction
    if peak_flops is not None:
        raw["peak_flops"] = peak_flops
    return cluster_from_dict(raw, where=name)


def group_of(cluster: str) -> str:
    """The :data:`FIT_GROUPS` key of a cluster file."""
    return next(g for g, names in FIT_GROUPS.items() if cluster in names)


def predict(
    row: Row,
    params: StepTimeParams = StepTimeParams(),
    fractions: dict | None = None,
    off: tuple[str, ...] = (),
    peaks: dict | None = None,
):
    """``(predicted metric, Estimate)`` for ``row`` (``fractions``: achievable fraction per :data:`FIT_GROUPS`
    key; ``off``: model terms switched off for the term-by-term report, :data:`TERMS`; ``peaks``: peak
    FLOP/s per cluster file, replacing the file's, for :func:`sensitivity_report`)."""
    c = load_cluster(row.cluster, (fractions or {}).get(group_of(row.cluster)), (peaks or {}).get(row.cluster))
    params = replace(params, **dict(row.params))
    e = estimate(row.shape, row.layout, c, params)
    if off:
        colls = layout_collectives(row.shape, row.layout, c.gpus_per_node)
        layers = stage_layers(row.shape.n_layer, row.layout.pp)
        if "per_layer" in off:
            colls = [
                replace(x, payload_bytes=x.payload_bytes * layers, calls=x.calls / layers)
                if x.name in ZERO3_COLLECTIVES
                else x
                for x in colls
            ]
        if "k_rings" in off:
            colls = [replace(x, ranks_per_node=1) for x in colls]
        e = replace(e, time=step_time(row.shape, row.layout, c, params, colls))
    lay, sh = row.layout, row.shape
    step = e.time.total
    if row.metric == "hfu_tflops":
        f = megatron_flops_per_step(
            batch=lay.global_batch_size,
            seq_len=sh.seq_len,
            n_layer=sh.n_layer,
            d_model=sh.d_model,
            vocab=sh.vocab_size,
            recompute=True,
        )
        return f / step / lay.world_size / 1e12, e
    if row.metric == "tflops_8n":
        return 8 * sh.num_params() * lay.global_batch_size * sh.seq_len / step / lay.world_size / 1e12, e
    if row.metric == "model_tflops":
        return e.mfu * c.peak_flops / 1e12, e
    if row.metric == "step_s":
        return step, e
    if row.metric == "tokens_per_gpu":
        return e.tokens_per_sec / lay.world_size, e
    return e.mfu, e


def error(row: Row, pred: float) -> float:
    """Signed relative error of the prediction, in the sense of throughput (a step time's error is inverted:
    +10% = predicted 10% faster than published)."""
    return row.published / pred - 1 if row.metric == "step_s" else pred / row.published - 1


def errors(
    rows: list[Row], params: StepTimeParams, fractions: dict | None = None, off: tuple[str, ...] = ()
) -> list[float]:
    """Signed errors of ``rows`` (:func:`error`)."""
    return [error(r, predict(r, params, fractions, off)[0]) for r in rows]


def summary(errs: list[float]) -> tuple[float, float]:
    """``(median |error|, worst |error|)``."""
    a = [abs(x) for x in errs]
    return statistics.median(a), max(a)


def objective(rows: list[Row], params: StepTimeParams, fractions: dict | None = None) -> float:
    """Mean over sources of each source's median |log error| (every source weighs the same, however many rows)."""
    by_source: dict[str, list[float]] = {}
    for r, x in zip(rows, errors(rows, params, fractions)):
        by_source.setdefault(r.source, []).append(abs(math.log1p(x)))
    return statistics.mean(statistics.median(v) for v in by_source.values())


def fit(rows: list[Row], params: StepTimeParams) -> tuple[dict, StepTimeParams]:
    """Fit on ``rows`` (the fit set): the achievable fraction per GPU type (grid 0.40-1.00 by 0.01) for each
    ``StepTimeParams.elementwise_bytes_per_h`` of a grid (0-256), keeping the pair that minimises the
    mean over sources of the per-source median |log error| (:func:`objective`)."""
    best = None
    for ew in (0.0, 16.0, 32.0, 48.0, 64.0, 80.0, 96.0, 128.0, 160.0, 192.0, 256.0):
        p = replace(params, elementwise_bytes_per_h=ew)
        fractions = {}
        for g in FIT_GROUPS:
            rs = [r for r in rows if group_of(r.cluster) == g]
            if not rs:
                continue
            fractions[g] = min(range(40, 101), key=lambda f: objective(rs, p, {g: f / 100}))
            fractions[g] /= 100
        score = objective(rows, p, fractions)
        if best is None or score < best[0]:
            best = (score, fractions, p)
    return best[1], best[2]


def table(rows: list[Row], params: StepTimeParams, fractions: dict | None = None) -> list[str]:
    """The printed table: one line per row, then median and worst |error| per set."""
    out = [
        f"{'set':<8} {'source':<19} {'run':<24} {'layout':<46} {'metric':<14} {'published':>10} {'predicted':>10} "
        f"{'error':>7} {'mem GiB':>8} {'mem pub':>8}"
    ]
    by_set: dict[str, list[float]] = {}
    for r in sorted(rows, key=lambda r: (r.set != "fit", r.source)):
        pred, e = predict(r, params, fractions)
        err = error(r, pred)
        by_set.setdefault(r.set, []).append(err)
        fmt = "{:.1%}" if r.metric == "mfu" else ("{:.2f}" if r.metric == "step_s" else "{:.0f}")
        out.append(
            f"{r.set:<8} {r.source:<19} {r.name:<24} {r.layout.describe():<46} {r.metric:<14} "
            f"{fmt.format(r.published):>10} {fmt.format(pred):>10} {err:>+7.1%} {e.memory_bytes / 2**30:>8.1f} "
            + (f"{r.memory_gib:>8.1f}" if r.memory_gib else f"{'':>8}")
            + ("" if e.fits else f"  DOES NOT FIT ({e.memory_limit / 2**30:.1f} GiB usable)")
        )
    for s, errs in by_set.items():
        med, worst = summary(errs)
        n_src = len({r.source for r in rows if r.set == s})
        out.append(f"{s}: {len(errs)} rows from {n_src} sources: median |error| {med:.1%}, worst {worst:.1%}")
    return out


TERMS = {
    "per_layer": "ZeRO-3/FSDP gathers per layer (latency per layer; prefetch hides a layer behind the previous one)",
    "k_rings": "a group with k ranks per node rings over k NICs (bus bandwidth min(k x NIC, NVLink))",
    "elementwise": "memory-bound elementwise traffic per layer (elementwise_bytes_per_h) with the fractions refitted",
}
"""The model terms :func:`terms_report` adds one at a time (cumulative), with what each is about."""

BEFORE_FRACTIONS = {"a100": 0.62, "h100": 0.77}
"""The achievable fractions of the cluster files before this table (A100: Narayanan T1 + torchtitan; H100: Llama 3's 8192-GPU row)."""


def terms_report(rows: list[Row], params: StepTimeParams) -> list[str]:
    """Median / worst |error| per set with the model terms added one at a time (:data:`TERMS`), starting from
    the model before them (fractions :data:`BEFORE_FRACTIONS`, no elementwise term), and for each term the rows
    it moves most (before -> after error)."""
    base = replace(params, elementwise_bytes_per_h=0.0)
    fitted_fr, fitted_p = fit([r for r in rows if r.set == "fit"], params)
    steps = [
        ("before", base, BEFORE_FRACTIONS, ("per_layer", "k_rings")),
        ("+ per_layer", base, BEFORE_FRACTIONS, ("k_rings",)),
        ("+ k_rings", base, BEFORE_FRACTIONS, ()),
        ("+ elementwise, refit", fitted_p, fitted_fr, ()),
    ]
    out, prev = [], None
    for label, p, fr, off in steps:
        errs = errors(rows, p, fr, off)
        line = f"{label:<22}"
        for s in ("fit", "heldout"):
            med, worst = summary([e for r, e in zip(rows, errs) if r.set == s])
            line += f"  {s}: median {med:5.1%} worst {worst:5.1%}"
        out.append(line)
        if prev is not None:
            moved = sorted(zip(rows, prev, errs), key=lambda t: -abs(abs(t[2]) - abs(t[1])))[:4]
            out.append("    moved most: " + "; ".join(f"{r.name} ({r.set}) {a:+.0%} -> {b:+.0%}" for r, a, b in moved))
        prev = errs
    out.append(
        f"fitted (fit set only): achievable_fraction {fitted_fr}, elementwise_bytes_per_h {fitted_p.elementwise_bytes_per_h:g}"
    )
    return out


SENSITIVITY = (
    ("MT-NLG's micro-batch (§2.4 does not publish it; the table assumes 1)", "mtnlg", "micro_batch_size", (1, 2, 4)),
    (
        "H100 96GB dense peak at 500 W (torchtitan's footnote: between the NVL and SXM parts, not known; the table "
        "assumes 886.8 TFLOP/s, linear in board power)",
        "h100_96gb",
        "peak_flops",
        (835.5e12, 886.8e12, 989.4e12),
    ),
)
"""The settings the held-out worst rows hang on that no source publishes: (what, the source or cluster file
whose rows it moves, the setting, its values: the table's assumption and the ends of a plausible range)."""


def sensitivity_report(rows: list[Row], params: StepTimeParams = StepTimeParams()) -> list[str]:
    """For each :data:`SENSITIVITY` setting and value: the moved rows' errors and the held-out median/worst
    with that value. A report, never applied: choosing the value by these errors would fit held-out rows."""
    out = []
    for what, target, key, values in SENSITIVITY:
        out.append(what + ":")
        for v in values:
            peaks, moved = {}, []
            if key == "peak_flops":
                peaks = {target: v}
                new = rows
                moved = [r for r in rows if r.cluster == target]
                label = f"{v / 1e12:.1f} TFLOP/s"
            else:
                new = [replace(r, layout=replace(r.layout, **{key: v})) if r.source == target else r for r in rows]
                moved = [r for r in new if r.source == target]
                label = f"{key} {v}"
            errs = {id(r): error(r, predict(r, params, peaks=peaks)[0]) for r in new}
            med, worst = summary([errs[id(r)] for r in new if r.set == "heldout"])
            fits = all(predict(r, params, peaks=peaks)[1].fits for r in moved)
            out.append(
                f"  {label:<22} "
                + ", ".join(f"{r.name} {errs[id(r)]:+.1%}" for r in moved)
                + f"{'' if fits else ' (some do not fit)'}; held out: median {med:.1%}, worst {worst:.1%}"
            )
    return out


def ranking_report(rows: list[Row], params: StepTimeParams = StepTimeParams()) -> tuple[list[str], dict]:
    """Two checks of the model's ordering.

    1. Within a source, rows of one model with one metric (several layouts, GPU counts or recompute
       policies of one model): every pair ordered by throughput as published (a step time counts
       inverted) is ordered the same by the prediction (ties in the published figure within 1% skipped).
    2. The authors' layout under the options they had: for every row with model parallelism (tp or
       pp > 1), the planner searches that GPU count and batch with the row's micro-batch, schedule,
       ZeRO stage, recompute, SP and precision fixed and TP (within a node) x PP free, and the row's
       (tp, pp) must be among the three fastest (tp, pp) pairs.

    Returns the printed lines and ``{"pairs": (concordant, total), "top3": (hits, total)}``.
    """
    from framework.driver.plan.search import SearchSpace, search

    out = ["ordering within a source and model (published vs predicted throughput):"]
    groups: dict[tuple, list] = {}
    for r in rows:
        groups.setdefault((r.source, r.model, r.metric), []).append(r)
    conc = total = 0
    for (src, _model, metric), rs in groups.items():
        if len(rs) < 2:
            continue
        sign = -1 if metric == "step_s" else 1
        vals = [(r, sign * r.published, sign * predict(r, params)[0]) for r in rs]
        for i in range(len(vals)):
            for j in range(i + 1, len(vals)):
                (a, pa, qa), (b, pb, qb) = vals[i], vals[j]
                if abs(pa - pb) <= 0.01 * max(abs(pa), abs(pb)):
                    continue
                total += 1
                ok = (pa > pb) == (qa > qb)
                conc += ok
                out.append(
                    f"  {'ok  ' if ok else 'MISS'} {src}: {a.name} {'>' if pa > pb else '<'} {b.name} "
                    f"(published {abs(pa):.3g} vs {abs(pb):.3g}; predicted {abs(qa):.3g} vs {abs(qb):.3g})"
                )
    out.append(f"  {conc} of {total} pairs ordered as published")
    out.append("the authors' (tp, pp) among the planner's three fastest (tp, pp) under the options they had:")
    hits = n = 0
    for r in rows:
        lay = r.layout
        if lay.tp == 1 and lay.pp == 1:
            continue
        c = load_cluster(r.cluster)
        L = r.shape.n_layer
        pps = sorted(
            {q for q in range(1, L + 1) if L % q == 0} | {2**i for i in range(1, 12) if 2**i <= L // 2} | {lay.pp}
        )
        space = SearchSpace(
            micro_batch_sizes=(lay.micro_batch_size,),
            pp_degrees=tuple(pps),
            virtual_stages=(lay.virtual_stages,),
            schedules=(lay.schedule,),
            zero_stages=(lay.zero_stage,),
            recompute=(lay.recompute,),
            sequence_parallel=(lay.sequence_parallel,),
            precision=lay.precision,
        )
        p = replace(params, **dict(r.params))
        res = search(r.shape, c, world=lay.world_size, global_batch_size=lay.global_batch_size, space=space, params=p)
        ranked: list[tuple[int, int]] = []
        for e in res.fitting + sorted([x for x in [res.closest_miss] if x], key=lambda e: e.time.total):
            key = (e.layout.tp, e.layout.pp)
            if key not in ranked:
                ranked.append(key)
        pos = ranked.index((lay.tp, lay.pp)) + 1 if (lay.tp, lay.pp) in ranked else None
        n += 1
        hits += pos is not None and pos <= 3
        out.append(
            f"  {'ok  ' if pos and pos <= 3 else 'MISS'} {r.source} {r.name}: authors tp{lay.tp} pp{lay.pp} is #{pos} "
            f"of {len(ranked)}; planner's top 3: " + ", ".join(f"tp{t} pp{q}" for t, q in ranked[:3])
        )
    out.append(f"  {hits} of {n} authors' layouts in the top 3")
    return out, {"pairs": (conc, total), "top3": (hits, n)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python benchmarks/published_runs.py", description=__doc__.splitlines()[0])
    ap.add_argument("--fit", action="store_true", help="refit the fitted numbers on the fit sources and use them")
    ap.add_argument(
        "--terms", action="store_true", help="median/worst per set with the model terms added one at a time"
    )
    ap.add_argument(
        "--rankings",
        action="store_true",
        help="orderings within a source, and the authors' layout in the planner's top 3",
    )
    ap.add_argument(
        "--sensitivity",
        action="store_true",
        help="the held-out worst rows under other values of the settings their sources do not publish",
    )
    args = ap.parse_args(argv)
    sources, rows = load_rows()
    if args.sensitivity:
        print("\n".join(sensitivity_report(rows)))
        return 0
    if args.terms:
        print("\n".join(terms_report(rows, StepTimeParams())))
        return 0
    if args.rankings:
        print("\n".join(ranking_report(rows)[0]))
        return 0
    params, fractions = StepTimeParams(), None
    if args.fit:
        fractions, params = fit([r for r in rows if r.set == "fit"], params)
        print(
            "fitted on the fit set: achievable_fraction "
            + ", ".join(f"{k}={v:.2f}" for k, v in fractions.items())
            + f"; elementwise_bytes_per_h={params.elementwise_bytes_per_h:g}"
        )
    print("\n".join(table(rows, params, fractions)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
