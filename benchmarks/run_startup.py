"""What a short run costs end to end: the wall time of ``python -m framework.train`` for a few steps,
most of which is starting processes (the driver, its rank server, the ranks), not training.

This is the cost the test suite pays per driver run (docs/tests.md), so it is the figure to watch when
the driver's start-up changes. Given one or more source trees (``--tree``, default: this checkout), it
runs the same short command from each, interleaved, ``--repeats`` times, in a scratch folder per tree
with a token cache built once beforehand, and prints each tree's median wall time with a 95% bootstrap
interval and the verdict of each tree against the first (framework/base/stats.py; a difference is a
finding only when its interval excludes 0).

    python benchmarks/run_startup.py --repeats 5
    python benchmarks/run_startup.py --tree /path/to/old/checkout --tree . --repeats 7 -- parallelism=single

Extra arguments after ``--`` are overrides added to the default run
(``parallelism=ddp trainer.max_steps=3 tracking=none checkpoint=none``, the small corpus slice of the
tests). Run it on an idle machine: every process competes for the same 2 cores.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from framework.base.stats import compare_to  # noqa: E402
from framework.base.testing.conformance import SMALL_DATA  # noqa: E402

RUN = ["parallelism=ddp", "trainer.max_steps=3", "tracking=none", "checkpoint=none", "trainer.progress_bar=false"]


def one_run(tree: Path, work: Path, cache: Path, extra: list[str], name: str) -> float:
    """Seconds from starting the driver to its exit (raises on a non-zero exit)."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [sys.executable, "-m", "framework.train", *SMALL_DATA, f"data.cache_dir={cache}", *RUN, *extra]
    t0 = time.perf_counter()
    proc = subprocess.run([*cmd, f"run_name={name}"], cwd=work, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"run_startup: {tree} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", action="append", type=Path, help="a source tree to run (repeatable; default: this one)")
    ap.add_argument("--repeats", type=int, default=5, help="runs per tree, interleaved (default 5)")
    ap.add_argument("extra", nargs="*", help="overrides added to every run (after --)")
    args = ap.parse_args()
    trees = [t.resolve() for t in (args.tree or [REPO])]
    with tempfile.TemporaryDirectory(prefix="run_startup_") as tmp:
        cache = Path(tmp) / "cache"
        works = {t: Path(tmp) / f"tree{i}" for i, t in enumerate(trees)}
        for w in works.values():
            w.mkdir()
        print(f"building the token cache with {trees[0]} ...", flush=True)
        for t in trees:  # one unmeasured run per tree: the token cache, and each folder's MLflow store (its schema)
            one_run(t, works[t], cache, args.extra, "warmup")
        walls: dict[Path, list[float]] = {t: [] for t in trees}
        for r in range(args.repeats):
            for t in trees if r % 2 == 0 else reversed(trees):
                walls[t].append(one_run(t, works[t], cache, args.extra, f"r{r}"))
                print(f"  repeat {r}: {t}: {walls[t][-1]:.2f} s", flush=True)
    import numpy as np

    ref = trees[0]
    print(f"\nwall seconds per run ({args.repeats} repeats, interleaved): {' '.join(RUN + args.extra)}")
    for t in trees:
        med = float(np.median(walls[t]))
        line = f"  {med:6.2f} s median  (min {min(walls[t]):.2f}, max {max(walls[t]):.2f})  {t}"
        if t != ref:
            v = compare_to(walls[t], walls[ref], maximize=False, other=str(ref), words=("faster", "slower"))
            line += f"\n         {v}"
        print(line)


if __name__ == "__main__":
    main()
