"""How often the verdict of framework/base/stats.py is wrong, on synthetic samples (no training, no timing).

For each number of repeats and CV: the share of seed pairs in which two *equal* normal
distributions are called different (false positives; the goal is <= 5%), and the share in
which a 20% shift is detected as ``faster`` (power). Seeds 1000+.

    python benchmarks/verdict_error_rates.py [--pairs 300]
"""

from __future__ import annotations

import argparse

import numpy as np

from framework.base.stats import compare_to


def rates(n: int, cv: float, pairs: int, shift: float = 0.20) -> tuple[float, float]:
    """``(false-positive share, detection share)`` over ``pairs`` seed pairs."""
    fp = det = 0
    for s in range(pairs):
        rng = np.random.default_rng(1000 + s)
        a, b = rng.normal(1000, 1000 * cv, n), rng.normal(1000, 1000 * cv, n)
        c = rng.normal(1000 * (1 + shift), 1000 * (1 + shift) * cv, n)
        fp += compare_to(a, b, min_repeats=1).kind != "indistinguishable"
        det += compare_to(c, b, min_repeats=1).kind == "faster"
    return fp / pairs, det / pairs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=300)
    args = parser.parse_args()
    print(f"{'repeats':>7}  {'CV':>4}  {'false positives':>15}  {'20% shift found':>15}   ({args.pairs} seed pairs)")
    for n, cv in [(3, 0.10), (5, 0.05), (5, 0.10), (7, 0.10), (10, 0.10)]:
        fp, det = rates(n, cv, args.pairs)
        print(f"{n:>7}  {cv:>4.0%}  {fp:>15.1%}  {det:>15.1%}")


if __name__ == "__main__":
    main()
