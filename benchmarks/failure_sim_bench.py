"""Speed of the failure simulator (framework/base/cost/failure_sim.py): simulated steps per second.

    python benchmarks/failure_sim_bench.py            # 10^6 steps per policy and interval, one seed

Each row simulates a million optimizer steps of 1 s with an MTBF of 5,000 s and a restart of
60 s; the event loop advances an interval at a time, so the cost grows with the number of
intervals (steps / every) and failures, not with the steps themselves.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from framework.base.cost.failure_sim import Policy, simulate  # noqa: E402

STEPS = 1_000_000


def main() -> None:
    print(f"{'policy':<9} {'every':>6} {'seconds':>8} {'steps/s':>12} {'failures':>9} {'goodput':>8}")
    for every in (1, 10, 100, 1000):
        for pol in (
            Policy("sync", every, 2.0),
            Policy("async", every, 0.2, write_s=5.0),
            Policy(
                "two_tier", every, 0.1, disk_every=every * 10, disk_delta_s=2.0, mem_fraction=0.5, mem_restart_s=10.0
            ),
        ):
            t0 = time.perf_counter()
            r = simulate(steps=STEPS, step_s=1.0, policy=pol, restart_s=60.0, mtbf_s=5000.0, seed=0)
            dt = time.perf_counter() - t0
            print(f"{pol.kind:<9} {every:>6} {dt:>8.3f} {STEPS / dt:>12,.0f} {r.failures:>9} {r.goodput:>8.4f}")


if __name__ == "__main__":
    main()
