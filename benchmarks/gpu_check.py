"""The GPU check of a 1B model on one GPU: MFU, trainlab vs a plain PyTorch loop, host syncs per step, peak memory vs the planner.

For each model (``gpt_1b``, ``llama_1b`` by default), on one device:

1. trainlab ``single`` through the real driver (``python -m framework.train``): bf16 autocast,
   ``torch.compile`` per the config, fused AdamW, ``trainer.count_host_syncs=true`` (on CUDA the
   runtime's own sync reports: ``torch.cuda.set_sync_debug_mode``), ``tracking=none``. Its
   ``perf/mfu_mean`` and ``perf/tokens_per_sec_mean`` leave out the first
   ``warmup_steps_excluded`` steps (compilation) and validation.
2. the plain loop of ``benchmarks/plain_vs_trainlab.py`` on the same config (same model, batch,
   steps, warm-up, autocast, compile, fused AdamW), in a child process.
3. the planner's memory for the layout (:func:`framework.base.cost.activations.activation_bytes_per_rank`,
   16 B per parameter of fp32 weights, gradients and AdamW moments) beside the measured peak.

Prints one table and writes ``gpu_check.json`` in ``--out``. ``--smoke`` runs the same path on the
CPU with the tiny models in seconds (to check the script, not to measure)::

    python benchmarks/gpu_check.py [--out gpu_check_out] [--steps 50] [--warmup 10] [--models gpt_1b llama_1b]
    python benchmarks/gpu_check.py --smoke
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this checkout's framework, also where another is installed
GIB = 1024**3


def register_entry_points(site: Path) -> bool:
    """When trainlab is not installed (a bare GPU image with this checkout on ``PYTHONPATH``), write a
    ``dist-info`` folder under ``site`` declaring pyproject.toml's ``trainlab.parallelism`` entry points,
    so that ``importlib.metadata`` finds the plugins; returns whether it did (then put ``site`` on the path)."""
    import importlib.metadata

    import tomllib

    if importlib.metadata.entry_points(group="trainlab.parallelism"):
        return False
    eps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["entry-points"]["trainlab.parallelism"]
    info = site / "trainlab_checkout-0.0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: trainlab-checkout\nVersion: 0.0\n")
    (info / "entry_points.txt").write_text("[trainlab.parallelism]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()))
    return True


def _last_json_records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def run_trainlab(out: Path, name: str, overrides: list[str], timeout: int) -> dict:
    """One driver run; returns its summary figures (empty on failure, with the log's tail printed)."""
    cmd = [
        sys.executable,
        "-m",
        "framework.train",
        "parallelism=single",
        "tracking=none",
        "checkpoint=none",
        "trainer.progress_bar=false",
        "trainer.count_host_syncs=true",
        "experiment_name=gpu_check",
        f"run_name={name}",
        *overrides,
    ]
    t0 = time.time()
    log = out / f"{name}.log"
    try:
        with log.open("w") as f:
            rc = subprocess.run(cmd, cwd=out, stdout=f, stderr=subprocess.STDOUT, timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    print(f"== {name}: exit {rc} in {time.time() - t0:.0f} s (log {log})", flush=True)
    run_dir = out / "outputs" / "gpu_check" / name
    if rc != 0 or not (run_dir / "summary.json").exists():
        print("\n".join(log.read_text().splitlines()[-25:]), flush=True)
        return {}
    summary = json.loads((run_dir / "summary.json").read_text())
    records = _last_json_records(run_dir / "metrics.jsonl")
    syncs = json.loads((run_dir / "host_syncs.json").read_text()) if (run_dir / "host_syncs.json").exists() else {}
    peaks = [r["mem/peak_bytes"] for r in records if "mem/peak_bytes" in r]
    return {
        "tokens_per_sec": summary.get("perf/tokens_per_sec_mean"),
        "mfu": summary.get("perf/mfu_mean"),
        "step_time_s": summary.get("perf/step_time_s_mean"),
        "peak_bytes": max(peaks) if peaks else None,
        "syncs": {int(k): v for k, v in syncs.items()},
    }


def run_plain(out: Path, steps: int, overrides: list[str], timeout: int, name: str) -> dict:
    """The plain loop of plain_vs_trainlab.py in a child process: ``{"tokens_per_sec", "peak_bytes"}`` (empty on failure)."""
    cmd = [sys.executable, str(REPO / "benchmarks" / "plain_vs_trainlab.py"), "--_plain", str(steps), *overrides]
    t0 = time.time()
    log = out / f"{name}.log"
    try:
        proc = subprocess.run(cmd, cwd=out, capture_output=True, text=True, timeout=timeout)
        log.write_text(proc.stdout + proc.stderr)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    print(f"== {name}: exit {rc} in {time.time() - t0:.0f} s (log {log})", flush=True)
    if rc != 0:
        print("\n".join(log.read_text().splitlines()[-25:]) if log.exists() else "", flush=True)
        return {}
    tps, peak = proc.stdout.strip().splitlines()[-1].split()
    return {"tokens_per_sec": float(tps), "peak_bytes": float(peak)}


def planner_memory(model: str, overrides: list[str]) -> dict:
    """The cost model's bytes for one rank training ``model`` with ``overrides`` (no data, no device)."""
    from hydra import compose, initialize_config_dir

    import framework.driver.cli  # noqa: F401  (registers the run-name resolver)
    from framework.base.cost.activations import activation_bytes_per_rank
    from framework.base.cost.shape import ModelShape
    from framework.driver.validate import load_run_config, validate

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["parallelism=single", "run_name=plan", *overrides])
    run = load_run_config(cfg)
    resolved = validate(run)
    shape = ModelShape.from_model_config(run.model, seq_len=run.data.seq_len, vocab_size=run.data.vocab_size)
    states = 16 * shape.num_params()  # fp32 weights + grads + AdamW moments (autocast keeps fp32 weights)
    act_bytes = 2 if run.trainer.precision.startswith("bf16") else 4
    kw = dict(
        micro_batch_size=resolved.micro_batch_size,
        tp=1,
        pp=1,
        n_microbatches=resolved.grad_accum_steps,
        sequence_parallel=False,
        recompute="full" if run.model.activation_checkpointing else "none",
        act_bytes=act_bytes,
        dropout=run.model.dropout > 0,
    )
    acts = activation_bytes_per_rank(shape, **kw)
    # The table's a·s² score term is what a kernel without flash attention keeps; SDPA's flash/efficient kernels do not.
    scores = shape.n_head * shape.seq_len**2 * resolved.micro_batch_size * act_bytes * shape.n_layer
    return {
        "params": shape.num_params(),
        "states_bytes": states,
        "activations_bytes": acts["total"],
        "scores_bytes": scores,
        "total_bytes": states + acts["total"],
        "total_flash_bytes": states + acts["total"] - scores,
    }


def sync_summary(per_step: dict[int, dict], log_every: int, val_every: int, max_steps: int) -> str:
    """``quiet steps: max N | logging steps: N..M`` from host_syncs.json's records."""
    if not per_step:
        return "n/a"
    quiet = {s: v["count"] for s, v in per_step.items() if s % log_every and s % val_every and s != max_steps and s > 1}
    loud = {s: v["count"] for s, v in per_step.items() if s not in quiet}
    sites = sorted({site for s in quiet for site in per_step[s]["sites"]})
    counts = [per_step[s]["count"] for s in sorted(per_step)]
    text = (
        f"{max(quiet.values()) if quiet else 0} on {len(quiet)} quiet steps (max), {sorted(set(loud.values()))} on"
        f" logging/validation/first steps; per step {counts}"
    )
    return text + (f"; quiet-step sites: {'; '.join(sites[:4])}" if sites else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="gpu_check_out", help="output folder (default: %(default)s)")
    parser.add_argument("--models", nargs="+", default=["gpt_1b", "llama_1b"])
    parser.add_argument("--steps", type=int, default=50, help="optimizer steps per run (default: %(default)s)")
    parser.add_argument(
        "--warmup", type=int, default=10, help="first steps left out of the timings (default: %(default)s)"
    )
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--no-compile", action="store_true", help="eager (no torch.compile) on both sides")
    parser.add_argument(
        "--timeout", type=int, default=240, help="seconds per run before it is given up (default: %(default)s)"
    )
    parser.add_argument(
        "--smoke", action="store_true", help="CPU, tiny models, few steps: checks the script end to end"
    )
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides for every run")
    args = parser.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    models, steps, warmup, mb, seq, extra = (
        args.models,
        args.steps,
        args.warmup,
        args.micro_batch_size,
        args.seq_len,
        [],
    )
    if args.smoke:
        models = ["gpt_tiny", "llama_tiny"]
        steps, warmup, mb, seq = 6, 2, 2, 64
        extra = ["trainer.accelerator=cpu", "data.vocab_size=1024"]
    log_every = max(2, steps // 5)
    common = [
        f"data.seq_len={seq}",
        f"trainer.micro_batch_size={mb}",
        f"trainer.global_batch_size={mb}",
        f"trainer.max_steps={steps}",
        f"trainer.warmup_steps_excluded={warmup}",
        f"trainer.log_every_n_steps={log_every}",
        f"trainer.val_every_n_steps={steps}",
        "trainer.val_sequences=16",
        "trainer.precision=bf16-mixed",
        f"trainer.compile={'false' if args.no_compile or args.smoke else 'true'}",
        f"data.max_bytes={3_000_000 if args.smoke else 12_000_000}",
        f"data.cache_dir={out / 'cache'}",
        *extra,
        *args.overrides,
    ]
    site = out / "site"
    if register_entry_points(site):
        sys.path.insert(0, str(site))
        print(f"trainlab is not installed: its plugins' entry points declared in {site}", flush=True)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), str(site), os.environ.get("PYTHONPATH", "")) if p)
    import torch

    print(
        f"torch {torch.__version__}; device {torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'cpu'}",
        flush=True,
    )
    results = {}
    for model in models:
        ov = [f"model={model}", *common]
        lab = run_trainlab(out, f"{model}-trainlab", ov, args.timeout)
        plain = run_plain(out, steps, ov, args.timeout, f"{model}-plain")
        plan = planner_memory(model, ov)
        results[model] = {"trainlab": lab, "plain": plain, "planner": plan}
        (out / "gpu_check.json").write_text(json.dumps(results, indent=1, default=str))
    print(
        f"\n{'model':11s} {'params':>7s} {'MFU':>6s} {'tok/s trainlab':>15s} {'tok/s plain':>12s} {'ratio':>6s}"
        f" {'peak GiB':>9s} {'plain GiB':>9s} {'plan GiB':>9s} {'plan-flash':>10s}"
    )
    for model, r in results.items():
        lab, plain, plan = r["trainlab"], r["plain"], r["planner"]

        def f(x, fmt):
            return format(x, fmt) if isinstance(x, (int, float)) else "n/a"

        ratio = (
            lab["tokens_per_sec"] / plain["tokens_per_sec"]
            if lab.get("tokens_per_sec") and plain.get("tokens_per_sec")
            else None
        )
        print(
            f"{model:11s} {plan['params'] / 1e9:6.2f}B {f(lab.get('mfu'), '6.3f')} {f(lab.get('tokens_per_sec'), '15,.0f')}"
            f" {f(plain.get('tokens_per_sec'), '12,.0f')} {f(ratio, '6.3f')}"
            f" {f(lab['peak_bytes'] / GIB if lab.get('peak_bytes') else None, '9.2f')}"
            f" {f(plain['peak_bytes'] / GIB if plain.get('peak_bytes') else None, '9.2f')}"
            f" {plan['total_bytes'] / GIB:9.2f} {plan['total_flash_bytes'] / GIB:10.2f}"
        )
        print(f"  host syncs per step: {sync_summary(lab.get('syncs', {}), log_every, steps, steps)}")
    print(
        "(MFU: trainlab's perf/mfu_mean, model FLOPs 6N + 12·L·h·s over the device's bf16 peak; ratio = trainlab / plain"
        " tokens/s, one run each; plan = 16 B/param + Korthikanti activations (bf16), plan-flash without the a·s² scores)"
    )


if __name__ == "__main__":
    main()
