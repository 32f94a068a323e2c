"""Data-pipeline study: pre-tokenized memmap vs BPE in the loader, without and with workers.

Runs ``python -m framework.train experiment=data_pipeline`` (4 single-process runs, the same
windows in each) in a work folder and prints, per run, the data-wait fraction of the step, the
mean and standard deviation of the step time and tokens/s, from each run's ``metrics.jsonl``.
The last line is the headline: data-wait fraction per run.

    python benchmarks/data_pipeline.py [--workdir DIR] [hydra overrides ...]
    e.g. python benchmarks/data_pipeline.py data.max_bytes=3000000 trainer.max_steps=40

Timings on a shared or small machine are noisy; repeat and compare medians before concluding.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def final_record(path: Path) -> dict[str, float]:
    """The union of the run's records at its last step (the end-of-run summaries)."""
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    last = max(r["step"] for r in records)
    out: dict[str, float] = {}
    for r in records:
        if r["step"] == last:
            out.update(r)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--workdir", default="bench-data-pipeline", help="folder for outputs/, mlruns.db (default: %(default)s)"
    )
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides")
    args = parser.parse_args()
    work = Path(args.workdir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "framework.train",
        "experiment=data_pipeline",
        "trainer.progress_bar=false",
        *args.overrides,
    ]
    subprocess.run(cmd, cwd=work, check=True, stdout=subprocess.DEVNULL)
    rows = []
    for f in sorted((work / "outputs" / "data_pipeline").glob("*/*/metrics.jsonl")):  # <sweep>/<job>/
        r = final_record(f)
        rows.append(
            (
                f.parent.name,
                r["perf/data_wait_frac_mean"],
                r["perf/step_time_s_mean"],
                r["perf/step_time_std_s_run"],
                r["perf/tokens_per_sec_mean"],
            )
        )
    print(f"{'run':40s} {'data_wait_frac':>14s} {'step_s_mean':>12s} {'step_s_std':>11s} {'tokens_per_s':>13s}")
    for name, dw, mean, std, tps in rows:
        print(f"{name:40s} {dw:14.3f} {mean:12.4f} {std:11.4f} {tps:13,.0f}")
    print("data_wait_frac: " + ", ".join(f"{name} {dw:.3f}" for name, dw, *_ in rows))


if __name__ == "__main__":
    main()
