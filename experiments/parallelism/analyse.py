"""The parallelism study's tables and plot: bytes and memory per rank, measured vs modelled vs the field.

Reads the child runs of one or more ``parallelism`` sweeps from their MLflow stores and writes
``results.md`` (one row per run, sorted by world size then plugin) and ``parallelism.png``
(ring bytes on the wire per rank per optimizer step, and model-state bytes per rank: measured,
the plugin's cost model, and the field's formula).

Each run's ZeRO stage is what its plugin declares (``ParallelPlugin.zero_stage``, MLflow param
``derived.zero_stage``; for stores logged before that param, asked of the plugin built from the
run's ``parallelism.*`` params): 0 ddp, 1-3 DeepSpeed's stage, 3 fsdp.

The field's formulas (docs/references.md §3, §5), per rank per optimizer step, N = dp ranks,
t = tp degree, Psi parameters, a = grad_accum_steps, b = micro-batch, s = seq_len, h = d_model,
L = n_layer; ring bytes on the wire, fp32 (4 bytes per element):

- ZeRO stage 0-2 (ddp, zero1, zero2): 2(N-1)/N * 4Psi (ZeRO §7.1, §7: reduce-scatter + all-gather);
- ZeRO stage 3 (zero3, fsdp): 3(N-1)/N * 4Psi (ZeRO §7.2, once per step: the paper has no accumulation);
- tp: 8 b s h (t-1)/t per layer per micro-batch * L * a * 4 (Shoeybi 2019 Fig. 4);
- pp: b s h per micro-batch sent by each stage (activations forward, gradients backward) * a * 4
  (Narayanan §3.2); the tied embedding's gradient all-reduce is not in the formula.

Model states, fp32 AdamW (params 4 + grads 4 + moments 8 = 16 bytes/param; ZeRO §3.1's count
with K = 8), :func:`framework.base.cost.memory.model_states_per_rank` (``precision="fp32"``, the
paper's accounting) at the run's ZeRO stage: ddp 16Psi; zero1 8Psi + 8Psi/N; zero2 4Psi + 12Psi/N;
zero3 and fsdp 16Psi/N; tp and pp: no closed form here (the embedding is replicated), '-'.

Usage: python experiments/parallelism/analyse.py STORE.db [STORE.db ...] --out experiments/parallelism
"""

from __future__ import annotations

import argparse
from pathlib import Path

KEYS = {
    "tps": "metrics.perf/tokens_per_sec_mean",
    "step": "metrics.perf/step_time_s_mean",
    "std": "metrics.perf/step_time_std_s_run",
    "peak": "metrics.mem/peak_bytes",
    "ms": "metrics.mem/model_states_bytes",
    "ms_model": "metrics.mem/model_states_bytes_model",
    "payload": "metrics.perf/comm_bytes",
    "wire": "metrics.perf/comm_bytes_wire",
    "wire_model": "metrics.perf/comm_bytes_wire_model",
    "loss": "metrics.train/loss_final",
}
KINDS = ("allreduce", "allgather", "reduce_scatter", "p2p")
ORDER = ["ddp", "zero1", "zero2", "zero3", "fsdp", "tp", "pp"]


def field_figures(r) -> tuple[float, float | None]:
    """(wire bytes per rank per step, model-state bytes per rank or None) from the field's formulas above."""
    psi = float(r["params.model.num_params"])
    n = int(r["params.derived.dp_degree"])
    t = int(r["params.derived.tp_degree"])
    a = int(r["params.derived.grad_accum_steps"])
    b = int(r["params.derived.micro_batch_size"])
    s = int(r["params.data.seq_len"])
    h = int(r["params.model.d_model"])
    layers = int(r["params.model.n_layer"])
    from framework.base.cost.memory import model_states_per_rank

    z = int(r["zero_stage"])
    if t > 1:
        return 8 * b * s * h * (t - 1) / t * layers * a * 4, None
    if int(r["params.derived.pp_degree"]) > 1:
        return b * s * h * a * 4, None
    wire = (3 if z == 3 else 2) * (n - 1) / n * 4 * psi
    return wire, model_states_per_rank(psi, dp=n, zero_stage=z, precision="fp32").total


def zero_stage_of(r) -> int:
    """The ZeRO stage the run's plugin declares: param ``derived.zero_stage``, or (a store logged before it)
    ``ParallelPlugin.zero_stage`` of the plugin built from the run's ``parallelism.*`` params."""
    import dataclasses

    import yaml

    from framework.base.registry import get_plugin_class

    logged = r.get("params.derived.zero_stage")
    if isinstance(logged, str):
        return int(logged)
    cls = get_plugin_class(r["params.parallelism.name"])
    kw = {}
    for f in dataclasses.fields(cls.config_cls):
        v = r.get(f"params.parallelism.{f.name}")
        if isinstance(v, str):
            kw[f.name] = None if v == "None" else yaml.safe_load(v)
    return cls(cls.config_cls(**kw)).zero_stage


def load(stores: list[str]):
    """Child runs of the stores' ``parallelism`` experiments as one DataFrame."""
    import mlflow
    import pandas as pd

    frames = []
    for store in stores:
        mlflow.set_tracking_uri(f"sqlite:///{Path(store).resolve()}")
        df = mlflow.search_runs(experiment_names=["parallelism"])
        frames.append(df[df["tags.mlflow.parentRunId"].notna()])
    df = pd.concat(frames, ignore_index=True)
    df["ws"] = df["params.parallelism.world_size"].astype(int)
    df["zero_stage"] = [zero_stage_of(r) for _, r in df.iterrows()]
    df["plugin_label"] = [
        f"zero{z}" if name == "deepspeed" else name for name, z in zip(df["params.parallelism.name"], df["zero_stage"])
    ]
    df["layout"] = df["tags.layout"]
    df["order"] = df["plugin_label"].map(ORDER.index)
    return df.sort_values(["ws", "order"]).reset_index(drop=True)


def _bytes(v) -> str:
    """A byte count with thousands separators, '-' when the run did not log it (NaN or missing)."""
    return "-" if v is None or v != v else f"{v:,.0f}"


def table(df) -> str:
    """The markdown table of results.md."""
    mib = 2**20
    head = (
        "| plugin | layout | tokens/s | step s mean ± std | peak RSS GiB | model states MiB meas / model / field "
        "| payload bytes by kind (AR / AG / RS / p2p) | wire bytes meas / model / field | final loss |"
    )
    lines = [head, "|" + "---|" * 9]
    for _, r in df.iterrows():
        wire_f, states_f = field_figures(r)
        kinds = " / ".join(_bytes(r.get(f"metrics.perf/comm_bytes_{k}")) for k in KINDS)
        states_field = f"{states_f / mib:.2f}" if states_f is not None else "-"
        lines.append(
            f"| {r['plugin_label']} | {r['layout']} | {r[KEYS['tps']]:,.0f} | {r[KEYS['step']]:.3f} ± {r[KEYS['std']]:.3f} "
            f"| {r[KEYS['peak']] / 2**30:.3f} | {r[KEYS['ms']] / mib:.2f} / {r[KEYS['ms_model']] / mib:.2f} / {states_field} "
            f"| {kinds} | {r[KEYS['wire']]:,.0f} / {r[KEYS['wire_model']]:,.0f} / {wire_f:,.0f} | {r[KEYS['loss']]:.4f} |"
        )
    return "\n".join(lines)


def plot(df, path: Path) -> None:
    """Two bar panels per run: wire bytes (measured, model, field) and model states (measured, field)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    labels = [f"{p}\n{w} ranks" for p, w in zip(df["plugin_label"], df["ws"])]
    x = np.arange(len(df))
    field = [field_figures(r) for _, r in df.iterrows()]
    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(max(8, len(df) * 0.9), 10), sharex=True)
    w = 0.27
    ax1.bar(x - w, df[KEYS["wire"]] / 1e6, w, label="measured")
    ax1.bar(x, df[KEYS["wire_model"]] / 1e6, w, label="cost model")
    ax1.bar(x + w, [f[0] / 1e6 for f in field], w, label="field formula")
    ax1.set_ylabel("ring MB on the wire\nper rank per step")
    ax1.legend(fontsize=8)
    ax2.bar(x - w / 2, df[KEYS["ms"]] / 2**20, w, label="measured")
    ax2.bar(x + w / 2, [(f[1] or 0) / 2**20 for f in field], w, label="field (fp32 AdamW; 0 = none)")
    ax2.set_ylabel("model states MiB\nper rank")
    ax2.legend(fontsize=8)
    ax3.bar(x, df[KEYS["tps"]], 0.5)
    ax3.set_ylabel("tokens/s (whole job)")
    ax3.set_xticks(x, labels, fontsize=8)
    fig.suptitle("parallelism: same global batch (16 x 128 tokens), gpt_tiny, gloo on 2 CPU cores")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("stores", nargs="+", help="mlruns.db files of parallelism sweeps")
    ap.add_argument("--out", required=True, help="folder for results.md and parallelism.png")
    args = ap.parse_args()
    out = Path(args.out)
    df = load(args.stores)
    md = table(df)
    (out / "results.md").write_text(md + "\n")
    plot(df, out / "parallelism.png")
    print(md)


if __name__ == "__main__":
    main()
