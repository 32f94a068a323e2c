"""What a short run costs end to end: the wall time of ``python -m framework.train`` for a few steps,
most of which is starting processes (the driver, its rank server, the ranks), not training.

This is the cost the test suite pays per driver run (docs/tests.md), so it is the figure to watch when
the driver's start-up changes. Given one or more source trees (``--tree``, default: this checkout), it
runs the same short command from each, interleaved, ``--repeats`` times, in a scratch folder per tree
with a token cache built once beforehand, and prints each tree's median wall time with a 95% bootstrap
interval and the verdict of each tree against the first (framework/base/stats.py; a difference is a
finding only when its interval excludes 0). On Linux it also prints the CPU seconds each run kept the
machine busy (all processes, from ``/proc/stat``: the driver, its rank server and ranks, anything else
running), the cost that the 2-core test suite pays, which drifts less than the wall time.

    python benchmarks/run_startup.py --repeats 5
    python benchmarks/run_startup.py --tree /path/to/old/checkout --tree . --repeats 7 -- parallelism=single
    python benchmarks/run_startup.py --tree /path/to/old/checkout --tree . -- -m trainer.seed=1,2,3,4  # a sweep

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

from framework.base.load_monitor import read_cpu_jiffies  # noqa: E402
from framework.base.stats import compare_to  # noqa: E402
from framework.base.testing.conformance import SMALL_DATA  # noqa: E402

RUN = ["parallelism=ddp", "trainer.max_steps=3", "tracking=none", "checkpoint=none", "trainer.progress_bar=false"]


def busy_seconds() -> float | None:
    """CPU seconds the machine has been busy since boot, all cores (the busy jiffies of
    :func:`~framework.base.load_monitor.read_cpu_jiffies`); None where there is no ``/proc/stat``."""
    jiffies = read_cpu_jiffies()
    return None if jiffies is None else jiffies[0] / os.sysconf("SC_CLK_TCK")


def one_run(tree: Path, work: Path, cache: Path, extra: list[str], name: str) -> tuple[float, float | None]:
    """``(wall, cpu)``: seconds from starting the driver to its exit, and the machine's busy CPU seconds
    meanwhile (:func:`busy_seconds`; None without ``/proc/stat``). Raises SystemExit on a non-zero exit."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    flags = [e for e in extra if e.startswith("-")]  # Hydra's flags (-m) precede the overrides
    overrides = [e for e in extra if not e.startswith("-")]
    cmd = [sys.executable, "-m", "framework.train", *flags, *SMALL_DATA, f"data.cache_dir={cache}", *RUN, *overrides]
    b0, t0 = busy_seconds(), time.perf_counter()
    named = f"experiment_name={name}" if flags else f"run_name={name}"  # a sweep names its jobs itself
    proc = subprocess.run([*cmd, named], cwd=work, env=env, capture_output=True, text=True)
    wall, b1 = time.perf_counter() - t0, busy_seconds()
    if proc.returncode != 0:
        raise SystemExit(f"run_startup: {tree} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return wall, (None if b0 is None or b1 is None else b1 - b0)


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
        cpus: dict[Path, list[float]] = {t: [] for t in trees}
        for r in range(args.repeats):
            for t in trees if r % 2 == 0 else reversed(trees):
                wall, cpu = one_run(t, works[t], cache, args.extra, f"r{r}")
                walls[t].append(wall)
                if cpu is not None:
                    cpus[t].append(cpu)
                print(
                    f"  repeat {r}: {t}: {wall:.2f} s" + (f", {cpu:.2f} CPU-s" if cpu is not None else ""), flush=True
                )
    print(f"\nper run ({args.repeats} repeats, interleaved): {' '.join(RUN + args.extra)}")
    _report("wall seconds", walls, trees, ("faster", "slower"))
    if all(cpus.values()):
        _report("busy CPU seconds (all cores)", cpus, trees, ("less", "more"))


def _report(what: str, values: dict[Path, list[float]], trees: list[Path], words: tuple[str, str]) -> None:
    """Each tree's median, min and max of ``values`` (lower is better), and its verdict against the first tree's."""
    import numpy as np

    ref = trees[0]
    print(what)
    for t in trees:
        line = f"  {float(np.median(values[t])):6.2f} median  (min {min(values[t]):.2f}, max {max(values[t]):.2f})  {t}"
        if t != ref:
            v = compare_to(values[t], values[ref], maximize=False, other=str(ref), words=words)
            line += f"\n         {v}"
        print(line)


if __name__ == "__main__":
    main()
