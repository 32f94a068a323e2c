"""Measured vs modelled bytes of the sharded data-parallel family: model states per rank and comm per step.

    python benchmarks/sharding_bytes.py                          # gpt_tiny and gpt_50m; ddp, fsdp, fsdp reshard=false
    python benchmarks/sharding_bytes.py --models gpt_tiny --plugins ddp fsdp --steps 4

Runs the real driver (2 CPU ranks, gloo, fp32, a small slice of the stdlib corpus with a
1024-token vocabulary, seq_len 64, micro-batch 1, global batch 4 = 2 micro-batches per rank
per step) for each model x plugin and prints, from each run's ``metrics.jsonl`` (last logged
step):

- ``mem/model_states_bytes`` (parameters + gradients + AdamW state a rank holds, distinct
  storages, max over ranks) next to the plugin's model ``mem/model_states_bytes_model``
  (ZeRO §3.1/§5: 16 bytes/param replicated; 16/dp sharded; + 4 bytes per tensor for AdamW's
  step counter);
- ``perf/comm_bytes_<kind>`` (payload handed to the collectives per rank per optimizer step,
  counted by the plugin's metered collectives) next to ``perf/comm_bytes_<kind>_model``
  (ZeRO §7: DDP one all-reduce of Psi per step; FSDP per micro-batch an all-gather of Psi for
  forward, another for backward when resharding, and a reduce-scatter of Psi), and the ring
  bytes on the wire derived from each.

The figures are byte counts, not times, so a busy machine does not change them.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from framework.base.cost.comm import KINDS  # noqa: E402
from framework.base.tracking import read_jsonl_metrics  # noqa: E402

PLUGINS = {
    "ddp": ("parallelism=ddp",),
    "fsdp": ("parallelism=fsdp",),
    "fsdp_noreshard": ("parallelism=fsdp", "parallelism.reshard_after_forward=false"),
}
DATA = ("data.max_bytes=1500000", "data.vocab_size=1024", "data.seq_len=64")


def run(workdir: Path, model: str, plugin: str, steps: int) -> dict:
    """One driver run; returns the last record holding measured comm bytes (merged with the memory figures)."""
    name = f"{model}-{plugin}"
    args = [
        sys.executable,
        "-m",
        "framework.train",
        *DATA,
        f"data.cache_dir={workdir / 'cache'}",
        f"model={model}",
        *PLUGINS[plugin],
        "tracking=none",
        "checkpoint=none",
        "trainer.progress_bar=false",
        "trainer.log_every_n_steps=1",
        "trainer.warmup_steps_excluded=1",
        f"trainer.max_steps={steps}",
        "trainer.global_batch_size=4",
        "trainer.micro_batch_size=1",
        "trainer.grad_accum_steps=null",
        "trainer.val_sequences=8",
        f"run_name={name}",
    ]
    proc = subprocess.run(args, cwd=workdir, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    records = read_jsonl_metrics(workdir / "outputs" / "default" / name / "metrics.jsonl")
    last = [r for r in records if "perf/comm_bytes" in r][-1]
    return last


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["gpt_tiny", "gpt_50m"])
    ap.add_argument("--plugins", nargs="+", default=list(PLUGINS), choices=list(PLUGINS))
    ap.add_argument("--steps", type=int, default=3, help="optimizer steps per run (the first is excluded from timing)")
    ap.add_argument("--dir", type=Path, default=None, help="work folder (default: a temporary one)")
    args = ap.parse_args()
    workdir = args.dir or Path(tempfile.mkdtemp(prefix="sharding_bytes_"))
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"work folder {workdir}; 2 CPU ranks, fp32 AdamW, micro-batch 1, 2 micro-batches per rank per step\n")
    head = (
        f"{'model':<9} {'plugin':<15} {'states/rank':>12} {'model':>12} {'ratio':>6}  "
        f"{'kind':<15} {'payload/step':>13} {'model':>13} {'wire':>12} {'wire model':>12}"
    )
    print(head)
    print("-" * len(head))
    for model in args.models:
        for plugin in args.plugins:
            r = run(workdir, model, plugin, args.steps)
            ms, mm = r["mem/model_states_bytes"], r["mem/model_states_bytes_model"]
            kinds = [k for k in KINDS if f"perf/comm_bytes_{k}_model" in r]
            first = True
            for kind in kinds:
                left = f"{model:<9} {plugin:<15} {ms:>12,.0f} {mm:>12,.0f} {ms / mm:>6.3f}" if first else " " * 58
                wire = f"{r['perf/comm_bytes_wire']:>12,.0f} {r['perf/comm_bytes_wire_model']:>12,.0f}" if first else ""
                print(
                    f"{left}  {kind:<15} {r.get(f'perf/comm_bytes_{kind}', 0.0):>13,.0f}"
                    f" {r[f'perf/comm_bytes_{kind}_model']:>13,.0f} {wire}"
                )
                first = False


if __name__ == "__main__":
    main()
