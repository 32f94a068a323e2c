"""The checkpoint-interval model and the failure simulator against closed forms (no ranks started)."""

from __future__ import annotations

import importlib.util
import math

import pytest

from framework.base.cost.failure_sim import Policy, goodput_over_seeds, simulate
from framework.base.cost.interval import (
    TwoTier,
    daly_goodput,
    daly_interval,
    incremental_costs,
    optimum_interval,
    young_interval,
    young_waste,
)
from framework.base.faults.schedule import build_schedule
from framework.driver.validate import load_run_config
from tests.conftest import REPO


def test_young_and_daly_optima_match_the_published_figures():
    assert young_interval(60.0, 3.1 * 3600) == pytest.approx(math.sqrt(2 * 60 * 3.1 * 3600))
    # Daly 2006's captions (delta = 5 min): M = 24 h -> 117 min, 6 h -> 57, 15 min -> 9.1
    for m_min, want in ((24 * 60, 116.7), (6 * 60, 56.7), (15, 9.14)):
        assert daly_interval(5.0, m_min) == pytest.approx(want, abs=0.05)
    assert daly_interval(10.0, 4.0) == 4.0  # delta >= 2M: the MTBF itself


def test_the_exact_optimum_lies_near_daly_and_young_is_its_first_order():
    delta, restart, mtbf = 30.0, 120.0, 3600.0 * 3
    best = optimum_interval(delta, restart, mtbf)
    assert best == pytest.approx(daly_interval(delta, mtbf), rel=0.02)
    assert young_interval(delta, mtbf) == pytest.approx(best, rel=0.05)
    g = daly_goodput(best, delta, restart, mtbf)
    assert g > daly_goodput(best / 2, delta, restart, mtbf) and g > daly_goodput(best * 2, delta, restart, mtbf)
    # first order: 1 - goodput ~ waste at the optimum, sqrt(2 delta / M) + R/M
    assert 1 - g == pytest.approx(young_waste(best, delta, restart, mtbf), rel=0.05)


def test_no_failures_waste_is_delta_over_tau():
    assert young_waste(100.0, 5.0, 60.0, math.inf) == pytest.approx(0.05)
    assert daly_goodput(100.0, 5.0, 60.0, math.inf) == pytest.approx(100 / 105)
    r = simulate(steps=10_000, step_s=1.0, policy=Policy("sync", every=100, delta_s=5.0), restart_s=60.0)
    assert r.failures == 0 and r.saves == 100
    assert r.wall_s == pytest.approx(10_000 + 100 * 5.0)
    assert r.checkpoint_s / r.productive_s == pytest.approx(5.0 / 100)  # delta / tau per step of work


def test_simulated_sync_goodput_matches_daly_closed_form():
    step_s, every, delta, restart, mtbf = 1.0, 200, 10.0, 30.0, 2000.0
    spread = goodput_over_seeds(
        range(8), steps=200_000, step_s=step_s, policy=Policy("sync", every, delta), restart_s=restart, mtbf_s=mtbf
    )
    want = daly_goodput(every * step_s, delta, restart, mtbf)
    assert spread.mean == pytest.approx(want, rel=0.01)
    r = spread.results[0]
    assert r.productive_s + r.checkpoint_s + r.lost_s + r.restart_s == pytest.approx(r.wall_s)


def test_failure_trace_and_async_in_flight_loss():
    # one failure at 150 s, steps of 1 s, saves every 100 steps: sync loses 150 - 105 = 45 s of interval 2
    sync = simulate(steps=300, step_s=1.0, policy=Policy("sync", 100, 5.0), restart_s=20.0, failure_times=[150.0])
    assert sync.failures == 1 and sync.lost_s == pytest.approx(45.0) and sync.restart_s == pytest.approx(20.0)
    assert sync.wall_s == pytest.approx(300 + 3 * 5 + 45 + 20)
    # async: blocking 1 s, write 60 s; the save at step 100 (durable at 161) is in flight at 150:
    # back to step 0, losing the 100 steps before it too
    asy = simulate(
        steps=300, step_s=1.0, policy=Policy("async", 100, 1.0, write_s=60.0), restart_s=20.0, failure_times=[150.0]
    )
    assert asy.lost_s == pytest.approx((150 - 101) + 100)
    late = simulate(
        steps=300, step_s=1.0, policy=Policy("async", 100, 1.0, write_s=20.0), restart_s=20.0, failure_times=[150.0]
    )  # durable at 121: only the interval in progress is lost
    assert late.lost_s == pytest.approx(150 - 101)


def test_two_tier_memory_recovery_and_model():
    pol = Policy(
        "two_tier", every=10, delta_s=0.1, disk_every=100, disk_delta_s=10.0, mem_fraction=1.0, mem_restart_s=1.0
    )
    r = simulate(steps=300, step_s=1.0, policy=pol, restart_s=50.0, failure_times=[155.0])
    # saves: 20 snapshots + 3 persistent by 155? at step 150 (t = 150 + 14*0.1 + 10 = 161.4) the fault lies in
    # the interval 140..150 (started at 140 + 13*0.1 + 10 = 151.3): back to snapshot 140, restart 1 s
    assert r.restart_s == pytest.approx(1.0) and r.lost_s == pytest.approx(155.0 - 151.3)
    tt = TwoTier(delta_mem=0.1, restart_mem=1.0, delta_disk=10.0, restart_disk=50.0, mem_fraction=0.5)
    tm, td = tt.optimum(3600.0)
    assert tm == pytest.approx(math.sqrt(2 * 0.1 * 3600 / 0.5)) and td == pytest.approx(math.sqrt(2 * 10 * 3600 / 0.5))
    assert tt.waste(tm, td, 3600.0) < tt.waste(tm * 2, td, 3600.0) and tt.waste(tm, td, 3600.0) < tt.waste(
        tm, td / 2, 3600.0
    )


def test_incremental_costs():
    save, load, nbytes = incremental_costs(1e9, 0.8, 4, write_bw=1e8, read_bw=2e8)
    assert nbytes == pytest.approx(1e9 * (1 + 3 * 0.8) / 4)
    assert save == pytest.approx(nbytes / 1e8) and load == pytest.approx(1e9 * (1 + 0.8 * 1.5) / 2e8)
    assert incremental_costs(1e9, 0.8, 1, write_bw=1e8, read_bw=1e8)[:2] == pytest.approx((10.0, 10.0))
    with pytest.raises(ValueError, match="full_every=0"):
        incremental_costs(1e9, 0.8, 0, write_bw=1e8, read_bw=1e8)


def test_progress_tied_failures_fire_once_like_trainlab_schedule():
    # saves every 10 steps of 1 s (delta 1 s); a fault at the start of step 15: steps 11..14 lost (4 s), restart 5 s
    r = simulate(steps=30, step_s=1.0, policy=Policy("sync", 10, 1.0), restart_s=5.0, failure_steps=[15])
    assert r.failures == 1 and r.lost_s == pytest.approx(4.0) and r.restart_s == pytest.approx(5.0)
    assert r.wall_s == pytest.approx(30 + 3 * 1.0 + 4.0 + 5.0)  # the replayed step 15 does not fail again


def _validate_script():
    """experiments/checkpoint_interval/validate.py as a module (it is a script, not a package)."""
    path = REPO / "experiments" / "checkpoint_interval" / "validate.py"
    spec = importlib.util.spec_from_file_location("checkpoint_interval_validate", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_validation_replays_trainlabs_fault_schedule(compose):
    # the script's copy of the schedule must give the failure steps the runs draw (2 ranks, rank crashes only)
    v = _validate_script()
    for seed in (0, 1, 2, 3, 11):
        run = load_run_config(
            compose(
                "fault=random",
                "fault.mtbf_steps=18",
                f"fault.random_seed={seed}",
                "trainer.max_steps=120",
                "fault.random_kinds=[rank_crash]",
            )
        )
        steps = [e["step"] for e in build_schedule(run, world_size=2)]
        assert v.schedule_steps(18, 120, seed) == steps and len(steps) > 2


def test_progress_tied_failures_have_youngs_optimum_and_the_fit_finds_it():
    # Failures tied to first-time steps never strike saves, restarts or replays: the expected waste is
    # n_saves*delta + F*(R + s*E[(k-1)/2]) exactly, so the fitted optimum over many seeds is Young's sqrt(2 delta M)/s.
    v = _validate_script()
    s, delta, r, mtbf, n = 0.2, 0.15, 2.5, 18, 1200
    k_young = young_interval(delta, mtbf * s) / s  # 5.2 steps
    grid = [1, 2, 3, 5, 8, 12, 20]
    waste = [
        sum(
            1
            / simulate(
                steps=n,
                step_s=s,
                policy=Policy("sync", k, delta),
                restart_s=r,
                failure_steps=v.schedule_steps(mtbf, n, seed),
            ).goodput
            - 1
            for seed in range(100)
        )
        / 100
        for k in grid
    ]
    fit = v.fit_optimum(grid, waste, n)
    assert fit["optimum"] == pytest.approx(k_young, rel=0.05)
    assert fit["optimum"] > 1.1 * daly_interval(delta, mtbf * s) / s  # Daly's -delta term does not apply here
    # the fit recovers the optimum of exact a/k + b k + c data
    exact = [0.3 * math.ceil(600 / k) / 600 + 0.004 * k + 0.1 for k in grid]
    assert v.fit_optimum(grid, exact, 600)["optimum"] == pytest.approx(math.sqrt(0.3 / 0.004), rel=1e-9)
