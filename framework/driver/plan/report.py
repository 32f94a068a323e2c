"""Print a plan (rich) and log it to MLflow (params, the table as CSV and Markdown, plots)."""

from __future__ import annotations

import csv
import io
import os
import tempfile
import warnings

from omegaconf import OmegaConf

GIB = 2**30


def rows(result, cluster, *, tokens: float, top_k: int) -> list[dict]:
    """One dict per top layout: memory by part (GiB), bytes by link (GB), bubble, step time,
    tokens/s, MFU, days, GPU-hours, money, energy."""
    out = []
    for rank, e in enumerate(result.fitting[:top_k], 1):
        link = e.bytes_by_link
        c = e.train_cost(tokens, cluster)
        out.append(
            {
                "rank": rank,
                "layout": e.layout.describe(),
                "m": e.layout.n_microbatches,
                "weights_gib": e.states.weights / GIB,
                "grads_gib": e.states.grads / GIB,
                "optimizer_gib": e.states.optimizer / GIB,
                "activations_gib": e.activations["total"] / GIB,
                "memory_gib": e.memory_bytes / GIB,
                "nvlink_gb": link["nvlink"] / 1e9,
                "nic_gb": link["nic"] / 1e9,
                "bubble": e.bubble,
                "step_s": e.time.total,
                "tokens_per_sec": e.tokens_per_sec,
                "tokens_per_sec_per_gpu": e.tokens_per_sec / e.layout.world_size,
                "mfu": e.mfu,
                "days": c["days"],
                "gpu_hours": c["gpu_hours"],
                "money": c["money"],
                "energy_mwh": c["energy_mwh"],
            }
        )
    return out


def print_plan(cfg, shape, cluster, result, *, world: int, wall_s: float) -> None:
    """The top layouts as a rich table, the drop counts, the search wall time, and the best layout's
    step-time parts and trainlab overrides."""
    from rich.console import Console
    from rich.table import Table

    from framework.driver.plan.runs import trainlab_overrides

    con = Console(width=None if os.isatty(1) else 240)
    p = cfg.plan
    con.print(
        f"[bold]{cfg.model.name}[/] ({shape.num_params() / 1e9:.3g}B params, s={shape.seq_len}) on "
        f"{p.nodes} x {cluster.gpus_per_node} {cluster.name} = {world} GPUs, global batch "
        f"{cfg.trainer.global_batch_size} sequences, {p.precision}; usable {cluster.usable_memory_bytes / GIB:.1f} GiB/GPU"
    )
    t = Table(
        title=f"top {p.top_k} of {len(result.fitting)} fitting layouts (of {result.evaluated} priced in {wall_s:.2f} s)"
    )
    cols = [
        ("#", "rank", "{}"),
        ("layout", "layout", "{}"),
        ("m", "m", "{}"),
        ("W GiB", "weights_gib", "{:.3g}"),
        ("G GiB", "grads_gib", "{:.3g}"),
        ("Opt GiB", "optimizer_gib", "{:.3g}"),
        ("Act GiB", "activations_gib", "{:.3g}"),
        ("Mem GiB", "memory_gib", "{:.3g}"),
        ("NVLink GB", "nvlink_gb", "{:.3g}"),
        ("NIC GB", "nic_gb", "{:.3g}"),
        ("bubble", "bubble", "{:.3f}"),
        ("step s", "step_s", "{:.3g}"),
        ("tok/s/GPU", "tokens_per_sec_per_gpu", "{:.0f}"),
        ("MFU", "mfu", "{:.1%}"),
        ("days", "days", "{:.1f}"),
        ("GPU-h", "gpu_hours", "{:.3g}"),
        ("money", "money", "{:.3g}"),
        ("MWh", "energy_mwh", "{:.0f}"),
    ]
    for name, _, _ in cols:
        t.add_column(name, justify="left" if name == "layout" else "right")
    rs = rows(result, cluster, tokens=float(p.train_tokens), top_k=int(p.top_k))
    for r in rs:
        t.add_row(*(fmt.format(r[k]) for _, k, fmt in cols))
    con.print(t)
    con.print(
        f"per GPU per step; time/cost for {float(p.train_tokens):.3g} tokens at {cluster.price_per_gpu_hour} "
        f"per GPU-hour and {cluster.power_w:.0f} W per GPU. Dropped: "
        + (", ".join(f"{n} {k}" for k, n in sorted(result.dropped.items())) or "none")
    )
    best = result.fitting[0]
    parts = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in best.time.parts().items() if v > 0)
    con.print(f"best: {best.layout.describe()}: {parts}")
    over, notes = trainlab_overrides(
        best.layout,
        model=cfg.model.name,
        seq_len=shape.seq_len,
        nodes=int(p.nodes),
        run_with=OmegaConf.to_container(p.run_with, resolve=True),
    )
    con.print("run it: python -m framework.train " + over, soft_wrap=True)
    for n in notes:
        con.print(f"note: {n}")


def plot_plan(result, path_prefix: str, *, top_k: int = 30) -> list[str]:
    """``<prefix>_step_time.png`` (step time by parts over the top layouts) and ``<prefix>_memory.png``
    (memory per GPU by part); returns the paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    es = result.fitting[:top_k]
    labels = [e.layout.describe() for e in es]
    x = range(len(es))
    paths = []
    fig, ax = plt.subplots(figsize=(12, 5))
    bottom = [0.0] * len(es)
    for part in es[0].time.parts():
        vals = [e.time.parts()[part] for e in es]
        if any(vals):
            ax.bar(x, vals, bottom=bottom, label=part)
            bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_xticks(list(x), labels, rotation=90, fontsize=6)
    ax.set_ylabel("predicted step time (s)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(path_prefix + "_step_time.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(12, 5))
    parts = {
        "weights": [e.states.weights / GIB for e in es],
        "grads": [e.states.grads / GIB for e in es],
        "optimizer": [e.states.optimizer / GIB for e in es],
        "activations": [e.activations["total"] / GIB for e in es],
    }
    bottom = [0.0] * len(es)
    for name, vals in parts.items():
        ax.bar(x, vals, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.axhline(es[0].memory_limit / GIB, color="k", ls="--", lw=1, label="usable")
    ax.set_xticks(list(x), labels, rotation=90, fontsize=6)
    ax.set_ylabel("memory per GPU (GiB)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(path_prefix + "_memory.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


def log_plan(cfg, shape, cluster, result, *, world: int, wall_s: float) -> None:
    """Log the plan as one MLflow run (experiment ``plan.experiment_name``): the composed config
    as params, the best layout's figures as metrics, ``plan.csv`` / ``plan.md`` and the plots as
    artifacts. MLflow failures only warn."""
    try:
        import mlflow

        mlflow.set_tracking_uri(cfg.tracking.uri)
        mlflow.set_experiment(cfg.plan.experiment_name)
        flat = {}
        for group in ("model", "cluster", "plan"):
            for k, v in OmegaConf.to_container(cfg[group], resolve=True).items():
                flat[f"{group}.{k}"] = str(v)[:500]
        flat.update(
            {
                "data.seq_len": cfg.data.seq_len,
                "trainer.global_batch_size": cfg.trainer.global_batch_size,
                "world_size": world,
            }
        )
        rs = rows(result, cluster, tokens=float(cfg.plan.train_tokens), top_k=max(int(cfg.plan.top_k), 30))
        with mlflow.start_run(run_name=f"plan-{cfg.model.name}-{cluster.name}-{world}"):
            mlflow.log_params(flat)
            best = rs[0]
            mlflow.log_metrics(
                {
                    "plan/step_time_s": best["step_s"],
                    "plan/mfu": best["mfu"],
                    "plan/tokens_per_sec": best["tokens_per_sec"],
                    "plan/memory_gib": best["memory_gib"],
                    "plan/search_wall_s": wall_s,
                    "plan/fitting_layouts": len(result.fitting),
                }
            )
            mlflow.set_tag("plan.best_layout", best["layout"])
            with tempfile.TemporaryDirectory() as tmp:
                buf = io.StringIO()
                w = csv.DictWriter(buf, fieldnames=list(rs[0]))
                w.writeheader()
                w.writerows(rs)
                with open(os.path.join(tmp, "plan.csv"), "w", encoding="utf-8") as f:
                    f.write(buf.getvalue())
                with open(os.path.join(tmp, "plan.md"), "w", encoding="utf-8") as f:
                    f.write(markdown_table(rs))
                for path in [
                    os.path.join(tmp, "plan.csv"),
                    os.path.join(tmp, "plan.md"),
                    *plot_plan(result, os.path.join(tmp, "plan")),
                ]:
                    mlflow.log_artifact(path)
    except Exception as err:  # noqa: BLE001 - logging never fails the plan
        warnings.warn(f"MLflow logging of the plan failed: {err}")


def markdown_table(rs: list[dict], keys: list[str] | None = None) -> str:
    """A Markdown table of ``rs`` (floats to 3 significant figures)."""
    keys = keys or list(rs[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for r in rs:
        lines.append("| " + " | ".join(f"{r[k]:.3g}" if isinstance(r[k], float) else str(r[k]) for k in keys) + " |")
    return "\n".join(lines) + "\n"
