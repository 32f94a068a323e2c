""" "TP 2 -> 4: how does communication change?" - measured, next to the Megatron cost model.

Trains the same model and global batch with ``parallelism=tp`` at tp_degree 2 and 4 (2 and 4
CPU ranks) and prints, per rank per optimizer step, the payload handed to the all-reduces and
the ring bytes on the wire (measured by metering DTensor's functional collectives; model
:func:`framework.base.cost.comm.tp_payload_bytes_per_microbatch`), the job-wide wire bytes, and
the step time. The payload per rank stays ``4·L·b·s·h`` per micro-batch whatever ``t``; the
ring bytes grow as ``2(t-1)/t`` (1.0 -> 1.5) while each rank's matmul work halves.

    python benchmarks/tp_comm.py [--workdir DIR] [--steps 20] [hydra overrides ...]
    e.g. python benchmarks/tp_comm.py parallelism.sequence_parallel=true

Step times on a shared 2-core machine (4 ranks oversubscribe it) are not a speed claim.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="bench-tp-comm", help="folder for outputs/ (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per run (default: %(default)s)")
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides")
    args = parser.parse_args()
    work = Path(args.workdir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    common = [
        "parallelism=tp",
        "checkpoint=none",
        "tracking=none",
        "trainer.progress_bar=false",
        f"trainer.max_steps={args.steps}",
        "trainer.log_every_n_steps=5",
        "trainer.global_batch_size=8",
        "trainer.micro_batch_size=4",
        "trainer.grad_accum_steps=null",
        *args.overrides,
    ]
    rows = []
    for t in (2, 4):
        name = f"tp{t}"
        cmd = [
            sys.executable,
            "-m",
            "framework.train",
            *common,
            f"parallelism.tp_degree={t}",
            f"parallelism.world_size={t}",
            f"run_name={name}",
        ]
        subprocess.run(cmd, cwd=work, check=True, stdout=subprocess.DEVNULL)
        recs = records(work / "outputs" / "default" / name / "metrics.jsonl")
        comm = [r for r in recs if "perf/comm_bytes" in r][-1]
        end = {k: v for r in recs for k, v in r.items()}
        rows.append(
            (
                t,
                comm["perf/comm_bytes"],
                comm["perf/comm_bytes_model"],
                comm["perf/comm_bytes_wire"],
                comm["perf/comm_bytes_wire_model"],
                end.get("perf/step_time_s_mean", float("nan")),
            )
        )
    print(
        f"{'tp':>3s} {'payload/rank MB':>16s} {'model':>8s} {'wire/rank MB':>13s} {'model':>8s} {'wire/job MB':>12s} {'step_s':>7s}"
    )
    for t, pay, pay_m, wire, wire_m, step in rows:
        print(
            f"{t:3d} {pay / 1e6:16.3f} {pay_m / 1e6:8.3f} {wire / 1e6:13.3f} {wire_m / 1e6:8.3f} {t * wire / 1e6:12.3f} {step:7.3f}"
        )
    (t2, p2, _, w2, _, s2), (t4, p4, _, w4, _, s4) = rows
    print(
        f"tp {t2} -> {t4}: payload/rank x{p4 / p2:.2f}, wire/rank x{w4 / w2:.2f}, wire/job x{t4 * w4 / (t2 * w2):.2f},"
        f" measured == model: {all(r[1] == r[2] and r[3] == r[4] for r in rows)}"
    )


if __name__ == "__main__":
    main()
