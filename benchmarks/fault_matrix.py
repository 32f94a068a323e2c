"""Print the fault x policy matrix (framework/base/testing/fault_matrix.py) as a markdown table.

Runs the matrix's driver runs (one rank, gpt_tiny, 11 steps; about 2-3 minutes on 2 CPU cores) in a
scratch folder and prints, per cell, the fault, the policy, the expected and the observed
outcome and the loss difference against the fault-free reference the policy promises to match.

    python benchmarks/fault_matrix.py [--workdir DIR] [--cache DIR] [--lanes N]

Exit status 1 when a cell does not behave as its policy claims.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from framework.base.testing.fault_matrix import evaluate, markdown, run_matrix  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", type=Path, default=None, help="scratch folder (default: a temporary one)")
    ap.add_argument("--cache", type=Path, default=None, help="token cache folder (default: <workdir>/token_cache)")
    ap.add_argument("--lanes", type=int, default=1, help="runs side by side (each rank one thread; at most the cores)")
    args = ap.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="fault_matrix_"))
    workdir.mkdir(parents=True, exist_ok=True)
    runs = run_matrix(workdir, args.cache or workdir / "token_cache", lanes=args.lanes)
    outcomes = evaluate(runs)
    print(markdown(outcomes, runs))
    for o in outcomes:
        for p in o.problems:
            print(f"FAIL {o.cell.fault} x {o.cell.policy}: {p}", file=sys.stderr)
    return 0 if all(o.ok for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
