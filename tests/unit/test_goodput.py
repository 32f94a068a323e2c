"""Goodput and its parts, and the recovery counters, from the run's event log (no ranks started)."""

from __future__ import annotations

import pytest

from framework.driver.faults.accounting import GOODPUT_PARTS, attempt_parts, goodput_figures, recovery_figures
from framework.driver.validate import load_run_config, validate


def _rec(ev, t, **kw):
    return {"ev": ev, "t": float(t), **kw}


def _start(t, step, *, proc, restart=0, loaded=True):
    """A timeline start record: process at ``proc``, main +1, fit +2, rendezvous +0.5, checkpoint +0.25, restore +0.25."""
    return _rec(
        "start",
        t,
        launch=0,
        restart=restart,
        step=step,
        t_proc=proc,
        t_main=proc + 1,
        t_fit=proc + 3,
        t_rdzv=proc + 3.5,
        t_loaded=proc + 3.75 if loaded else None,
    )


def _crash_then_rerun():
    """Invocation 1: start at 0, steps 1..7 of 1 s (a 0.5 s save in step 5), rank crash at 12.5 in step 8;
    the driver ends at 14. Invocation 2 (the same command again): resumes from step 5 and finishes 6..10."""
    recs = [_rec("driver_start", 0.0), _start(4.0, 0, proc=0.0, loaded=False)]
    t = 4.0
    for s in range(1, 8):
        c = 0.5 if s == 5 else 0.0
        t += 1.0 + c
        recs.append(_rec("step", t, step=s, d=1.0, c=c, v=0.0, seg="0.0"))
    recs += [_rec("injected", 12.0 + 0.5, id="e0", kind="rank_crash", step=8, rank=1), _rec("driver_end", 14.0)]
    recs += [_rec("driver_start", 100.0), _start(104.5, 5, proc=100.5)]
    t = 104.5
    for s in range(6, 11):
        t += 1.0
        recs.append(_rec("step", t, step=s, d=1.0, c=0.0, v=0.0, seg="0.0"))
    recs += [_rec("end", t + 0.25, step=10, d=0.0, c=0.25, v=0.0), _rec("driver_end", t + 1.25)]
    return recs


def test_recovery_counters_of_a_crash_and_the_same_command_again():
    """Issue 13.5: the crashed step is not recomputed (it never completed); running the command
    again after the crash is a restart."""
    f = recovery_figures(_crash_then_rerun(), now=1e9)
    assert f["recovery/restarts"] == 1  # was 0: a rerun starts with launch=0, restart=0
    assert f["recovery/recomputed_steps"] == 2  # steps 6 and 7 ran twice; was 3 (step 8 counted)
    assert f["fault/detected"] == 1 and f["fault/injected"] == 1
    assert f["recovery/time_s"] == pytest.approx(107.5 - 12.5)  # to the end of step 8 in the rerun


def test_goodput_parts_of_a_crash_and_rerun_sum_to_the_wall_time():
    figs, attempts = goodput_figures(_crash_then_rerun(), now=1e9)
    wall = 14.0 + (110.75 - 100.0)
    assert figs["goodput/wall_s"] == pytest.approx(wall)
    assert figs["goodput/productive_s"] == pytest.approx(10.0)  # the last execution of steps 1..10
    assert figs["goodput/lost_s"] == pytest.approx(2.0 + 1.0)  # first executions of 6, 7; step 8 in flight 11.5 -> 12.5
    assert figs["goodput/checkpoint_s"] == pytest.approx(0.5 + 0.25)
    assert figs["goodput/detect_s"] == pytest.approx(14.0 - 12.5)  # crash -> end of the failed invocation
    assert figs["goodput/startup_s"] == pytest.approx(4.0 + 1.0)  # first start-up; shutdown after the end
    assert figs["goodput/restart_s"] == pytest.approx(104.5 - 100.0)  # the rerun's start-up
    assert figs["goodput/unaccounted_s"] == pytest.approx(0.0, abs=1e-9)
    assert sum(figs[f"goodput/{p}_s"] for p in GOODPUT_PARTS) == pytest.approx(wall)
    assert figs["goodput"] == pytest.approx(10.0 / wall)
    assert figs["goodput/ettr"] == pytest.approx(10 * 1.0 / wall)
    first, rerun = attempts
    assert (first["restart"], rerun["restart"], rerun["step"]) == (0.0, 1.0, 5.0)
    # rerun: driver start 100 -> process 100.5 -> main 101.5 -> fit 103.5 -> rdzv 104 -> loaded 104.25 -> 104.5
    assert rerun["process_start_s"] == pytest.approx(1.5) and rerun["setup_s"] == pytest.approx(2.0)
    assert rerun["rendezvous_s"] == pytest.approx(0.5) and rerun["ckpt_load_s"] == pytest.approx(0.25)
    assert rerun["restore_s"] == pytest.approx(0.25)
    assert rerun["first_step_s"] == pytest.approx(1.0)


def test_attempt_parts_follow_the_marks_and_tolerate_missing_ones():
    start = _start(10.0, 3, proc=4.0)  # marks 4, 5, 7, 7.5, 7.75; training starts at 10
    assert attempt_parts(start, begin=4.0) == pytest.approx(
        {"process_start": 1.0, "setup": 2.0, "rendezvous": 0.5, "ckpt_load": 0.25, "restore": 2.25}
    )
    fresh = _start(10.0, 0, proc=4.0, loaded=False)  # no checkpoint: its time goes into restore
    assert attempt_parts(fresh, begin=4.0)["ckpt_load"] == 0.0
    assert sum(attempt_parts(fresh, begin=4.0).values()) == pytest.approx(6.0)


def test_a_fault_free_run_has_goodput_and_no_recovery():
    recs = [_rec("driver_start", 0.0), _start(5.0, 0, proc=1.0, loaded=False)]
    recs += [_rec("step", 5.0 + s, step=s, d=0.8, c=0.0, v=0.2 if s == 2 else 0.0, seg="0.0") for s in range(1, 4)]
    recs += [_rec("end", 8.0, step=3, d=0.0, c=0.0, v=0.0), _rec("driver_end", 9.0)]
    f = recovery_figures(recs, now=1e9)
    assert f["recovery/restarts"] == 0 and f["recovery/recomputed_steps"] == 0
    assert f["goodput"] == pytest.approx(2.4 / 9.0) and f["goodput/validation_s"] == pytest.approx(0.2)
    assert f["goodput/unaccounted_s"] == pytest.approx(9.0 - 2.4 - 0.2 - 5.0 - 1.0)  # steps' gaps (0.2 each) not in d


class _Tracker:
    def __init__(self):
        self.logged: list[tuple[dict, int]] = []

    def log_metrics(self, metrics, step=0):
        self.logged.append((dict(metrics), step))

    def set_tags(self, tags):
        pass


def test_supervise_logs_goodput_and_recovery_for_a_run_without_fault_config(compose, tmp_path, monkeypatch):
    """Issue 13.5: a run with no fault config that crashes and is restarted (``trainer.max_restarts``)
    logs ``recovery/*`` and ``goodput``, at the last step reached, not at step 0."""
    import framework.driver.launcher
    from framework.base.faults.events import FaultLog
    from framework.base.launch import LaunchSpec
    from framework.driver.faults.supervisor import supervise

    resolved = validate(load_run_config(compose("trainer.max_restarts=1", "parallelism=single")))
    assert not resolved.run.fault.events and resolved.run.resilience.policy == "none"
    log = FaultLog(tmp_path)

    def fake_launch(launch, max_restarts=None):  # what the ranks write: a crash in step 4, a restart from 2
        log.append("start", launch=0, restart=0, step=0, seg="0.0")
        for s in (1, 2, 3):
            log.append("step", step=s, d=0.01, c=0.0, v=0.0, seg="0.0")
        log.append("start", launch=0, restart=1, step=2, seg="0.1")
        for s in (3, 4, 5):
            log.append("step", step=s, d=0.01, c=0.0, v=0.0, seg="0.1")
        log.append("end", step=5, d=0.0, c=0.0, v=0.0, seg="0.1")

    monkeypatch.setattr(framework.driver.launcher, "launch_ranks", fake_launch)
    tracker = _Tracker()
    supervise(
        LaunchSpec(
            resolved=resolved, run_dir=tmp_path, mlflow_run_id=None, resume_from=None, token_cache_dir=str(tmp_path)
        ),
        tracker,
    )
    totals = [(m, step) for m, step in tracker.logged if "recovery/restarts" in m]
    assert len(totals) == 1
    m, step = totals[0]
    assert m["recovery/restarts"] == 1 and m["recovery/recomputed_steps"] == 1 and "goodput" in m
    assert step == 5, "the totals concern the run's last step"
    restarts = [(m, step) for m, step in tracker.logged if "restart/rendezvous_s" in m]
    assert [step for _, step in restarts] == [0, 2], "one point per attempt, at the step it resumed from"


def test_recovery_table_rows_only_for_runs_with_faults_policy_or_recovery():
    from types import SimpleNamespace as NS

    from framework.driver.faults.report import recovery_rows

    def run(rid, metrics, tags=None):
        return NS(info=NS(run_id=rid * 8, status="FINISHED"), data=NS(metrics=metrics, tags=tags or {}, params={}))

    zero = {"fault/injected": 0.0, "recovery/restarts": 0.0, "goodput": 0.8}
    rows = recovery_rows(
        [
            run("a", zero),
            run("b", {**zero, "recovery/restarts": 1.0}),
            run("c", zero, {"resilience.policy": "skip_step"}),
        ]
    )
    assert [r["run"] for r in rows] == ["bbbbbbbb", "cccccccc"]  # every run logs the figures; a plain one has no row


def test_run_timeline_records_steps_saves_and_a_rollback(tmp_path):
    """RunTimeline's records (rank 0): start marks, one step record per optimizer step with the
    save taken out of its time, a rolled-back step marked, and nothing on another rank."""
    from types import SimpleNamespace

    from framework.base.faults.events import FaultLog
    from framework.rank.callbacks.clock import StepClock
    from framework.rank.callbacks.goodput import RunTimeline

    log = FaultLog(tmp_path)
    clock = StepClock()
    trainer = SimpleNamespace(global_step=2, world_size=2, accumulate_grad_batches=2)
    tl = RunTimeline(
        log=log, clock=clock, segment="0.1", launch_index=0, marks={"t_proc": 1.0, "t_main": 2.0, "t_fit": 3.0}
    )
    other = RunTimeline(log=log, clock=clock, segment="0.1", launch_index=0, marks={}, enabled=False)
    tl.setup(trainer, None, "fit")
    tl.on_load_checkpoint(trainer, None, {})
    clock.on_train_start(trainer, None)
    tl.on_train_start(trainer, None)

    def batch_end(global_step, save_s=0.0, rewind_to=None):
        trainer.global_step = global_step
        clock.on_train_batch_end(trainer, None, None, None, 0)
        clock.add_checkpoint(save_s)
        if rewind_to is not None:  # the guard's rollback, between the clock and the timeline
            trainer.global_step = rewind_to
            clock.on_rollback(rewind_to)
        tl.on_train_batch_end(trainer, None, None, None, 0)
        other.on_train_batch_end(trainer, None, None, None, 0)

    batch_end(2)  # first micro-batch of step 3: inside accumulation
    batch_end(3, save_s=0.5)
    batch_end(4, rewind_to=3)  # step 4 rolled back to 3
    batch_end(4)
    tl.on_train_end(trainer, None)
    recs = log.read()
    assert [r["ev"] for r in recs] == ["start", "step", "step", "step", "end"]
    start = recs[0]
    assert (
        start["step"] == 2 and start["t_proc"] == 1.0 and start["t_fit"] == 3.0 and start["t_rdzv"] <= start["t_loaded"]
    )
    assert (start["restart"], start["world_size"], start["grad_accum_steps"], start["seg"]) == (0, 2, 2, "0.1")
    assert [(r["step"], r.get("rolled_back", False)) for r in recs[1:4]] == [(3, False), (4, True), (4, False)]
    assert recs[1]["c"] == 0.5 and all(r["d"] >= 0 for r in recs[1:])
