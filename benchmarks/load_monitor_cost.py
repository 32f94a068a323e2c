"""The load monitor's cost (framework/base/load_monitor.py): CPU time per sample, and its share of one core.

One sample reads /proc/stat and the CPU times of this process's tree (psutil); the monitor takes
one every ``tracking.load_interval_s`` seconds (default 5). This times ``--samples`` samples back
to back in this process (CPU time, ``time.process_time``: what the monitor takes from the run,
little affected by other processes' load) with ``--children`` idle child processes in the tree (a
run's ranks and loader workers), and prints the share of one core the monitor uses at the
default interval.

    python benchmarks/load_monitor_cost.py [--samples 200] [--children 4]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

from framework.base.load_monitor import LoadMonitor


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=200)
    parser.add_argument("--children", type=int, default=4, help="idle child processes in the tree (ranks, workers)")
    parser.add_argument(
        "--interval", type=float, default=5.0, help="the monitor's interval (s) for the share of a core"
    )
    args = parser.parse_args()
    kids = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]) for _ in range(args.children)]
    try:
        mon = LoadMonitor(args.interval)
        mon._t_start = time.perf_counter()
        prev = mon._snapshot()
        c0, w0 = time.process_time(), time.perf_counter()
        for _ in range(args.samples):
            now = mon._snapshot()
            mon._sample(prev, now)
            prev = now
        cpu = (time.process_time() - c0) / args.samples
        wall = (time.perf_counter() - w0) / args.samples
    finally:
        for k in kids:
            k.kill()
    print(f"load monitor: {args.samples} samples, {args.children} child processes in the tree")
    print(f"  CPU per sample   {cpu * 1e3:.2f} ms (wall {wall * 1e3:.2f} ms)")
    print(f"  share of one core at one sample per {args.interval:g} s: {100 * cpu / args.interval:.3f}%")


if __name__ == "__main__":
    main()
