"""Checkpoint-policy study: per-save figures of each job of the sweep, from its ``metrics.jsonl``.

The compare report sums ``ckpt/blocking_s`` over a run and shows the last ``ckpt/save_s`` and
``ckpt/bytes``; this prints, per job, the number of saves and the median over saves of the
blocking time (how long the save held the training step, s), the save time (call to renamed
folder, s), the bytes written and the delta ratio (incremental saves), plus tokens/s, so that
policies are compared per save rather than per run.

    python experiments/checkpoint_policy/per_save.py /tmp/studies-work/cp/outputs/checkpoint_policy/sweep \
        [--out experiments/checkpoint_policy/per_save.md]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def per_save(path: Path) -> dict[str, float]:
    """Median per-save figures and the run's tokens/s from one job's ``metrics.jsonl``."""
    by_step: dict[int, dict[str, float]] = {}  # a save's figures come in several records of its step
    last: dict[str, float] = {}
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        rec = json.loads(line)
        last.update(rec)
        if any(k.startswith("ckpt/") for k in rec):
            by_step.setdefault(rec["step"], {}).update(rec)
    saves = [s for s in by_step.values() if "ckpt/blocking_s" in s]

    def med(key: str) -> float:
        vals = [s[key] for s in saves if key in s]
        return statistics.median(vals) if vals else float("nan")

    return {
        "saves": len(saves),
        "blocking_s": med("ckpt/blocking_s"),
        "save_s": med("ckpt/save_s"),
        "bytes": med("ckpt/bytes"),
        "delta_ratio": med("ckpt/delta_ratio"),
        "blocking_total_s": sum(s["ckpt/blocking_s"] for s in saves),
        "steps": last.get("step", float("nan")),
        "tokens_per_sec": last.get("perf/tokens_per_sec_mean", float("nan")),
        "step_s": last.get("perf/step_time_s_mean", float("nan")),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweep_dir", type=Path, help="outputs/checkpoint_policy/<sweep> (one folder per job)")
    parser.add_argument("--out", type=Path, default=None, help="also write the table here (Markdown)")
    args = parser.parse_args()
    lines = [
        "| job | saves | blocking s / save (median) | save s (median) | MB / save (median) | delta ratio | "
        "blocking s total | step s mean | blocking / (blocking + steps) | tokens/s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for f in sorted(args.sweep_dir.glob("*/metrics.jsonl")):
        r = per_save(f)
        share = r["blocking_total_s"] / (r["blocking_total_s"] + r["step_s"] * r["steps"])
        lines.append(
            f"| {f.parent.name} | {r['saves']} | {r['blocking_s']:.4f} | {r['save_s']:.4f} | {r['bytes'] / 1e6:.2f} | "
            f"{r['delta_ratio']:.3f} | {r['blocking_total_s']:.3f} | {r['step_s']:.3f} | {share:.3f} | {r['tokens_per_sec']:,.0f} |"
        )
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
