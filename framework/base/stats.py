"""Statistics of repeated measurements: medians with confidence intervals, and verdicts.

A difference between two configurations is a finding only when it is beyond the noise. This
module says how far the noise reaches, with numpy only (pure functions, no I/O):

- **Between repeats** (a sweep with ``sweep.repeats=N``): the median of a configuration's N
  run-level figures (e.g. ``perf/tokens_per_sec_mean``), its 95% interval by the percentile
  bootstrap (:func:`bootstrap_median_ci`; Efron & Tibshirani, *An Introduction to the
  Bootstrap*, 1993, ch. 13), and the coefficient of variation (sample std / mean).
- **Within one run** (N = 1): the mean of the run's logged windows (``perf/tokens_per_sec`` every
  ``trainer.log_every_n_steps`` steps) with a 95% interval by non-overlapping **batch means**
  (:func:`batch_means_ci`; Law & Kelton, *Simulation Modeling and Analysis*, 3rd ed., section
  9.5.3; Schmeiser 1982, "Batch size effects in the analysis of simulation output"): consecutive
  windows are autocorrelated (the machine's load drifts), so the series is cut into about
  ``sqrt(n)`` batches whose means are nearly independent, and the interval is Student's t over
  the batch means. It says how precisely *this* run was measured, not how another run of the same
  configuration would come out (that needs repeats).
- **Verdicts** (:func:`verdicts`): every configuration against the best one, from a bootstrap of
  the repeats of both: the ratio of medians ``median(other) / median(best)`` resampled
  (each configuration's repeats with replacement, independently, :data:`N_BOOT` times); the
  95% percentile interval of the ratio decides. An interval that excludes 1 gives
  ``slower by 12% [7%, 17%]`` (``faster by ...`` for the best against the runner-up); one that
  contains 1 gives ``indistinguishable``. With fewer than :data:`MIN_REPEATS` repeats on either
  side no verdict is given: ``n=1: repeats needed to rank``.

The median (not the mean) is what is compared: a repeat that ran while another job loaded the
machine is an outlier on the slow side, and the median of 5 ignores up to 2 of them (its
interval does not: one slow repeat of 5 widens it, so a contended sweep tends to
``indistinguishable``, the safe side). Simulated on normal samples, 1,000 seed pairs
(``benchmarks/verdict_error_rates.py --pairs 1000``): with 5 repeats each, two equal
distributions were called different in 3.5% of pairs; a 20% shift was detected in 60% at CV 10%
and 99% at CV 5% (78% with 7 repeats, 91% with 10, at CV 10%); with 3 repeats the false
positives rose to 9.9%, hence :data:`MIN_REPEATS`. ``tests/unit/test_stats.py`` asserts the
first two.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

LEVEL = 0.95
"""Confidence level of every interval."""
N_BOOT = 4000
"""Bootstrap resamples per interval."""
MIN_REPEATS = 5
"""Repeats a configuration needs before it is ranked against another (fewer: no verdict). The
percentile bootstrap of a median is too narrow below 5: on two equal normal samples it called a
difference in 9.9% of 1,000 seed pairs at n=3, 3.5% at n=5 (``benchmarks/verdict_error_rates.py``)."""
SEED = 0
"""Seed of the bootstrap's generator: the same samples give the same interval."""

# Student's t, two-sided 95% (0.975 quantile), by degrees of freedom; larger df: the normal 1.96.
_T975 = {
    1: 12.706,
    2: 4.303,
    3: 3.182,
    4: 2.776,
    5: 2.571,
    6: 2.447,
    7: 2.365,
    8: 2.306,
    9: 2.262,
    10: 2.228,
    11: 2.201,
    12: 2.179,
    13: 2.160,
    14: 2.145,
    15: 2.131,
    16: 2.120,
    17: 2.110,
    18: 2.101,
    19: 2.093,
    20: 2.086,
    25: 2.060,
    30: 2.042,
    40: 2.021,
    60: 2.000,
    120: 1.980,
}


def t_quantile_975(df: int) -> float:
    """The 0.975 quantile of Student's t with ``df`` degrees of freedom (table; the next smaller
    tabulated df, which errs wide; 1.96 above 120).

    Raises:
        ValueError: ``df < 1``.
    """
    if df < 1:
        raise ValueError(f"df={df} must be >= 1")
    if df > 120:
        return 1.96
    return _T975[max(k for k in _T975 if k <= df)]


def _clean(samples: Sequence[float]) -> np.ndarray:
    """``samples`` as a 1-D float array without NaN/inf."""
    x = np.asarray([s for s in samples if s is not None], dtype=float).ravel()
    return x[np.isfinite(x)]


def cv(samples: Sequence[float]) -> float | None:
    """Coefficient of variation: sample standard deviation (ddof=1) over the mean; None for fewer than 2 samples."""
    x = _clean(samples)
    if x.size < 2 or x.mean() == 0:
        return None
    return float(x.std(ddof=1) / abs(x.mean()))


def bootstrap_median_ci(
    samples: Sequence[float], *, level: float = LEVEL, n_boot: int = N_BOOT, seed: int = SEED
) -> tuple[float, float, float]:
    """``(median, lo, hi)``: the sample median and its percentile-bootstrap interval.

    Args:
        samples: run-level figures of one configuration, one per repeat (shape ``(N,)``).
        level: confidence level (0.95 = the 2.5% and 97.5% percentiles of the resampled medians).
        n_boot: resamples.
        seed: the generator's seed.

    Raises:
        ValueError: no finite sample.
    """
    x = _clean(samples)
    if x.size == 0:
        raise ValueError("bootstrap_median_ci: no finite samples")
    med = float(np.median(x))
    if x.size == 1:
        return med, med, med
    rng = np.random.default_rng(seed)
    boot = np.median(x[rng.integers(0, x.size, size=(n_boot, x.size))], axis=1)
    a = (1 - level) / 2
    lo, hi = np.quantile(boot, [a, 1 - a])
    return med, float(lo), float(hi)


def batch_means_ci(series: Sequence[float], *, n_batches: int | None = None) -> tuple[float, float, float] | None:
    """``(mean, lo, hi)``: the mean of an autocorrelated series and its 95% batch-means interval.

    The series (e.g. a run's logged tokens/s windows, in step order, shape ``(n,)``) is cut into
    ``b`` consecutive non-overlapping batches (``b = n_batches``, default ``floor(sqrt(n))``
    clamped to 2..20; the first ``n mod b`` points are dropped, nearest the warm-up); the interval
    is ``mean ± t_{b-1} · sd(batch means) / sqrt(b)`` (Law & Kelton 2000, section 9.5.3).
    None for fewer than 4 points (no batches of 2).
    """
    x = _clean(series)
    n = x.size
    if n < 4:
        return None
    b = n_batches or min(20, max(2, int(math.isqrt(n))))
    b = min(b, n // 2)
    m = n // b
    batches = x[n - b * m :].reshape(b, m).mean(axis=1)
    mean = float(x.mean())
    half = t_quantile_975(b - 1) * float(batches.std(ddof=1)) / math.sqrt(b)
    return mean, mean - half, mean + half


@dataclass(frozen=True)
class Summary:
    """One configuration's figure: ``n`` repeats (or 1 run), centre (median of repeats; the mean of
    the windows for one run), 95% interval ``[lo, hi]`` (None when it cannot be computed), CV
    between repeats (None for one run) and the interval's ``method`` (``bootstrap`` | ``batch-means`` | ``none``)."""

    n: int
    center: float
    lo: float | None
    hi: float | None
    cv: float | None
    method: str

    def describe(self, spec: str = ",.0f") -> str:
        """``2,761 [2,600, 2,900] (n=5, CV 4.1%)``."""
        ci = f" [{self.lo:{spec}}, {self.hi:{spec}}]" if self.lo is not None else ""
        extra = (
            f", CV {100 * self.cv:.1f}%"
            if self.cv is not None
            else (", within-run" if self.method == "batch-means" else "")
        )
        return f"{self.center:{spec}}{ci} (n={self.n}{extra})"


def summarize(repeats: Sequence[float], within: Sequence[float] | None = None) -> Summary | None:
    """A :class:`Summary` of one configuration: its run-level figures (one per repeat) and, for a
    single run, the run's window series ``within`` for the batch-means interval. None when no
    repeat has a finite figure."""
    x = _clean(repeats)
    if x.size == 0:
        return None
    if x.size >= 2:
        med, lo, hi = bootstrap_median_ci(x)
        return Summary(int(x.size), med, lo, hi, cv(x), "bootstrap")
    ci = batch_means_ci(within) if within is not None else None
    if ci is None:
        return Summary(1, float(x[0]), None, None, None, "none")
    return Summary(1, float(x[0]), ci[1], ci[2], None, "batch-means")


@dataclass(frozen=True)
class Verdict:
    """One configuration against the best (or the best against the runner-up).

    ``kind``: ``best`` | ``faster`` | ``slower`` | ``indistinguishable`` | ``unranked``;
    ``diff``: the relative difference of medians (0.12 = 12%, signed: the figure of this row over
    the other's, minus 1) with its interval ``[lo, hi]``; ``other``: the configuration compared with;
    ``note``: why a row is unranked (for the best: its margin over the runner-up, as text);
    ``margin``: for the best, the kind of that margin (``faster`` | ``indistinguishable`` | ``unranked`` | ...)."""

    kind: str
    diff: float | None = None
    lo: float | None = None
    hi: float | None = None
    other: str | None = None
    note: str = ""
    words: tuple[str, str] = ("faster", "slower")
    margin: str = ""

    def __str__(self) -> str:
        if self.kind == "unranked":
            return self.note
        if self.kind == "indistinguishable":
            return "indistinguishable" + (f" from {self.other}" if self.other else "")
        if self.kind == "best":
            return "best" + (f" ({self.note})" if self.note else "")
        a, b = sorted((abs(self.lo), abs(self.hi)))
        return f"{self.kind} by {100 * abs(self.diff):.0f}% [{100 * a:.0f}%, {100 * b:.0f}%]" + (
            f" than {self.other}" if self.other else ""
        )


def ratio_ci(
    a: Sequence[float], b: Sequence[float], *, level: float = LEVEL, n_boot: int = N_BOOT, seed: int = SEED
) -> tuple[float, float, float]:
    """``(r, lo, hi)``: ``r = median(a) / median(b)`` and its percentile-bootstrap interval (each
    sample resampled with replacement, independently, ``n_boot`` times).

    Raises:
        ValueError: an empty sample or a median of ``b`` that is 0.
    """
    x, y = _clean(a), _clean(b)
    if x.size == 0 or y.size == 0:
        raise ValueError("ratio_ci: both samples need a finite value")
    if np.median(y) == 0:
        raise ValueError("ratio_ci: the median of the reference sample is 0")
    rng = np.random.default_rng(seed)
    mx = np.median(x[rng.integers(0, x.size, size=(n_boot, x.size))], axis=1)
    my = np.median(y[rng.integers(0, y.size, size=(n_boot, y.size))], axis=1)
    my = np.where(my == 0, np.nan, my)
    al = (1 - level) / 2
    lo, hi = np.nanquantile(mx / my, [al, 1 - al])
    return float(np.median(x) / np.median(y)), float(lo), float(hi)


def compare_to(
    a: Sequence[float],
    ref: Sequence[float],
    *,
    maximize: bool = True,
    other: str | None = None,
    words: tuple[str, str] = ("faster", "slower"),
    min_repeats: int = MIN_REPEATS,
) -> Verdict:
    """The verdict of ``a`` (repeats of one configuration) against ``ref`` (another's).

    ``maximize``: a higher figure is better (tokens/s, MFU); False for step time. ``words``: what
    better and worse are called (``("higher", "lower")`` for a figure that is not a speed).
    Fewer than ``min_repeats`` (:data:`MIN_REPEATS`) repeats on either side: ``unranked``
    (``benchmarks/verdict_error_rates.py`` lowers it to show why).
    """
    na, nr = _clean(a).size, _clean(ref).size
    if min(na, nr) < min_repeats:
        return Verdict(
            "unranked",
            other=other,
            words=words,
            note=f"n={min(na, nr)}: repeats needed to rank (sweep.repeats>={min_repeats})",
        )
    r, lo, hi = ratio_ci(a, ref)
    d, dlo, dhi = r - 1, lo - 1, hi - 1
    if dlo <= 0 <= dhi:
        return Verdict("indistinguishable", d, dlo, dhi, other, words=words)
    better = (d > 0) == maximize
    return Verdict(words[0] if better else words[1], d, dlo, dhi, other, words=words)


def verdicts(
    groups: Mapping[str, Sequence[float]], *, maximize: bool = True, words: tuple[str, str] = ("faster", "slower")
) -> dict[str, Verdict]:
    """A verdict per configuration against the best (the highest median when ``maximize``, else the lowest).

    ``groups``: configuration label -> its repeats' figures. The best gets ``best`` with its
    margin over the runner-up (``faster by 8% [3%, 12%] than <runner-up>``, or ``indistinguishable
    from <runner-up>``); every other configuration its :func:`compare_to` against the best.
    Configurations without a finite figure are left out.
    """
    meds = {k: float(np.median(_clean(v))) for k, v in groups.items() if _clean(v).size}
    if not meds:
        return {}
    order = sorted(meds, key=lambda k: meds[k], reverse=maximize)
    best = order[0]
    out = {k: compare_to(groups[k], groups[best], maximize=maximize, other=None, words=words) for k in order[1:]}
    if len(order) == 1:
        return {best: Verdict("best", words=words)}
    margin = compare_to(groups[best], groups[order[1]], maximize=maximize, other=order[1], words=words)
    out[best] = Verdict(
        "best", margin.diff, margin.lo, margin.hi, order[1], note=str(margin), words=words, margin=margin.kind
    )
    return out


def established(v: Verdict) -> bool:
    """Whether a verdict states a difference beyond the noise (faster/slower, or a best that leads its runner-up)."""
    if v.kind == "best":
        return v.margin in v.words
    return v.kind in v.words
