"""framework/base/stats.py on synthetic samples: interval coverage, verdicts, the batch-means interval."""

from __future__ import annotations

import numpy as np
import pytest

from framework.base.stats import (
    MIN_REPEATS,
    Verdict,
    batch_means_ci,
    bootstrap_median_ci,
    compare_to,
    cv,
    established,
    summarize,
    t_quantile_975,
    verdicts,
)


def _pair(seed: int, shift: float, cv_: float, n: int = 5) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1000 + seed)
    base = rng.normal(1000.0, 1000.0 * cv_, n)
    other = rng.normal(1000.0 * (1 + shift), 1000.0 * (1 + shift) * cv_, n)
    return other, base


def test_two_equal_distributions_are_indistinguishable_in_at_least_95_percent_of_seeds():
    calls = [compare_to(*_pair(s, 0.0, 0.10)).kind for s in range(400)]
    assert set(calls) <= {"indistinguishable", "faster", "slower"}
    assert calls.count("indistinguishable") / len(calls) >= 0.95


def test_a_20_percent_shift_at_cv_10_percent_with_5_repeats_is_detected_and_its_interval_covers_it():
    found = [compare_to(*_pair(s, 0.20, 0.10)) for s in range(200)]
    detected = [v for v in found if v.kind == "faster"]
    assert not any(v.kind == "slower" for v in found)  # never the wrong direction
    assert len(detected) / len(found) >= 0.5  # about 60%: 5 repeats at CV 10% is the edge of what can be told
    covered = sum(v.lo <= 0.20 <= v.hi for v in detected)
    assert covered / len(detected) >= 0.9
    # at CV 5% the same shift is (almost) always found
    tight = [compare_to(*_pair(s, 0.20, 0.05)).kind for s in range(100)]
    assert tight.count("faster") >= 90


def test_a_slower_configuration_reads_slower_and_step_time_is_minimised():
    a, base = _pair(3, -0.30, 0.03)
    v = compare_to(a, base)
    assert v.kind == "slower" and -0.4 < v.diff < -0.2 and v.lo < v.diff < v.hi
    assert str(v).startswith("slower by ") and "%" in str(v)
    # the same numbers as step times: lower is faster
    assert compare_to(a, base, maximize=False).kind == "faster"


def test_fewer_than_min_repeats_is_unranked_and_says_so():
    v = compare_to([1000.0], [1200.0, 1210.0, 1190.0, 1205.0, 1195.0])
    assert v.kind == "unranked" and "n=1" in str(v) and "repeats needed to rank" in str(v)
    assert compare_to([1.0] * (MIN_REPEATS - 1), [2.0] * MIN_REPEATS).kind == "unranked"


def test_verdicts_name_the_best_with_its_margin_and_every_other_against_it():
    rng = np.random.default_rng(0)
    groups = {"single": rng.normal(2000, 40, 5), "ddp": rng.normal(3000, 60, 5), "ddp2": rng.normal(3010, 60, 5)}
    out = verdicts(groups)
    assert out["ddp2"].kind == "best" or out["ddp"].kind == "best"
    best = "ddp2" if out["ddp2"].kind == "best" else "ddp"
    other = "ddp" if best == "ddp2" else "ddp2"
    assert out[other].kind == "indistinguishable" and not established(out[other])
    assert "indistinguishable from" in str(out[best]) and not established(out[best])
    assert out["single"].kind == "slower" and established(out["single"])
    assert 0.25 < -out["single"].diff < 0.40
    two = verdicts({"a": rng.normal(2000, 20, 5), "b": rng.normal(1000, 10, 5)})
    assert str(two["a"]).startswith("best (faster by ") and established(two["a"])
    assert verdicts({"only": [5.0]})["only"].kind == "best"
    assert verdicts({}) == {}


def test_bootstrap_median_interval_brackets_the_median_and_is_reproducible():
    x = [10.0, 11.0, 9.5, 10.5, 30.0]
    med, lo, hi = bootstrap_median_ci(x)
    assert med == 10.5 and lo <= med <= hi
    assert bootstrap_median_ci(x) == (med, lo, hi)
    assert bootstrap_median_ci([7.0]) == (7.0, 7.0, 7.0)
    with pytest.raises(ValueError):
        bootstrap_median_ci([float("nan")])
    assert cv([1.0]) is None and abs(cv([9.0, 11.0]) - np.std([9.0, 11.0], ddof=1) / 10.0) < 1e-12


def test_batch_means_interval_is_wider_than_the_naive_one_on_an_autocorrelated_series():
    """An AR(1) series (phi=0.9): the naive t-interval over its points ignores the correlation and
    covers the true mean far less often than batch means do."""
    naive_hits = bm_hits = 0
    trials = 200
    for seed in range(trials):
        rng = np.random.default_rng(seed)
        e = rng.normal(0, 1, 400)
        x = np.empty(400)
        x[0] = e[0]
        for i in range(1, 400):
            x[i] = 0.9 * x[i - 1] + e[i]
        x += 100.0
        m, lo, hi = batch_means_ci(x)
        bm_hits += lo <= 100.0 <= hi
        half = 1.96 * x.std(ddof=1) / np.sqrt(x.size)
        naive_hits += m - half <= 100.0 <= m + half
    assert naive_hits / trials < 0.6
    assert bm_hits / trials >= 0.85
    assert batch_means_ci([1.0, 2.0, 3.0]) is None


def test_summary_of_repeats_uses_the_bootstrap_and_of_one_run_its_windows():
    s = summarize([100.0, 110.0, 90.0, 105.0, 95.0])
    assert s.method == "bootstrap" and s.n == 5 and s.center == 100.0 and s.cv is not None
    one = summarize([100.0], within=[99.0, 101.0, 100.0, 98.0, 102.0, 100.0, 99.5, 100.5])
    assert one.method == "batch-means" and one.n == 1 and one.lo < 100.0 < one.hi and "within-run" in one.describe()
    assert summarize([100.0]).method == "none" and summarize([]) is None


def test_t_table():
    assert t_quantile_975(4) == 2.776 and t_quantile_975(22) == 2.086 and t_quantile_975(1000) == 1.96
    with pytest.raises(ValueError):
        t_quantile_975(0)
    assert str(Verdict("unranked", note="x")) == "x"
