"""Model-state bytes and communication per rank: measured vs the ZeRO model, ddp and zero1/2/3.

For each model preset (default ``gpt_tiny`` and ``gpt_50m``) runs ``ddp``, ``zero1``,
``zero2`` and ``zero3`` on 2 CPU ranks (fp32, global batch 8 = 2 ranks x micro-batch 2 x
grad_accum_steps 2, a few steps, no checkpoints) in a work folder and prints, from each run's
``metrics.jsonl`` (last logged step), per rank:

- ``mem/model_states_bytes`` (measured: distinct storages of parameters, gradients and
  optimizer-held tensors, the largest sample within the step) vs ``mem/model_states_bytes_model``;
- payload bytes per optimizer step by collective, measured vs modelled.

    python benchmarks/zero_memory.py [--workdir DIR] [--models gpt_tiny gpt_50m] [hydra overrides ...]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

PLUGINS = ("ddp", "zero1", "zero2", "zero3")
KINDS = ("allreduce", "allgather", "reduce_scatter")


def last_logged(path: Path) -> dict[str, float]:
    """The last record that carries the per-step comm and memory figures."""
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in records if "perf/comm_bytes" in r][-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="bench-zero-memory", help="folder for outputs/ (default: %(default)s)")
    parser.add_argument("--models", nargs="+", default=["gpt_tiny", "gpt_50m"], help="conf/model presets")
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides")
    args = parser.parse_args()
    work = Path(args.workdir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    common = [
        "trainer.max_steps=4",
        "trainer.log_every_n_steps=2",
        "trainer.warmup_steps_excluded=1",
        "trainer.global_batch_size=8",
        "trainer.micro_batch_size=2",
        "trainer.grad_accum_steps=null",
        "trainer.val_sequences=0",
        "checkpoint=none",
        "tracking=none",
        "trainer.progress_bar=false",
        "data.seq_len=64",
        *args.overrides,
    ]
    print(
        f"{'model':9s} {'plugin':6s} {'states_MB':>10s} {'model_MB':>9s} {'ratio':>6s}  "
        + "  ".join(f"{k + '_MB meas/model':>26s}" for k in KINDS)
    )
    for model in args.models:
        for plugin in PLUGINS:
            name = f"{model}-{plugin}"
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "framework.train",
                    f"model={model}",
                    f"parallelism={plugin}",
                    f"run_name={name}",
                    *common,
                ],
                cwd=work,
                check=True,
                stdout=subprocess.DEVNULL,
            )
            r = last_logged(work / "outputs" / "default" / name / "metrics.jsonl")
            meas, mod = r["mem/model_states_bytes"], r["mem/model_states_bytes_model"]
            comm = "  ".join(
                f"{r.get(f'perf/comm_bytes_{k}', 0) / 1e6:12.3f}/{r.get(f'perf/comm_bytes_{k}_model', 0) / 1e6:<13.3f}"
                for k in KINDS
            )
            print(f"{model:9s} {plugin:6s} {meas / 1e6:10.3f} {mod / 1e6:9.3f} {meas / mod:6.3f}  {comm}", flush=True)


if __name__ == "__main__":
    main()
