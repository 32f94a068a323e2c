"""Fault injection and recovery end to end, on 2 CPU ranks (``ddp``, gloo), 12 optimizer steps.

The issue's scenarios at a smaller scale (the presets put the faults at steps 30-60 of longer
runs; here the steps are scaled down with ``fault.events=[...]`` overrides): every run shares
one small model and data slice, checkpoints every 5 steps and
2 micro-batches per rank per step, and is compared with one uninterrupted reference run.
The runs the selected tests need are made first, together, in one Hydra sweep (one driver and rank server for
all of them, :func:`fr`), and log into one MLflow experiment, which the compare report then puts side by side.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from framework.base.faults.events import FaultLog
from framework.base.testing.variants import checkpoint_dir
from tests.integration.conftest import Runner, losses, records
from tests.integration.test_checkpoint_resume import assert_bitwise_equal

pytestmark = pytest.mark.slow

MAX_STEPS = 12
EXPERIMENT = "faults"
COMMON = [
    "parallelism=ddp",
    "model.n_layer=2",
    "model.n_head=2",
    "model.d_model=64",
    "trainer.val_sequences=16",
    f"trainer.max_steps={MAX_STEPS}",
    "trainer.log_every_n_steps=1",
    "trainer.val_every_n_steps=100",
    "trainer.global_batch_size=8",
    "trainer.micro_batch_size=2",
    "checkpoint.every_n_steps=5",
    "checkpoint.keep_last_k=2",
    "tracking.system_metrics_interval_s=0",
]
RUNS: dict[str, tuple[str, ...]] = {
    "hang_corrupt_crash": (
        "resilience=restart",
        "resilience.hang_timeout_s=6",
        "fault.events=[{kind:hang,step:7,ranks:[1],delay_s:3600},{kind:ckpt_corrupt,step:11,ranks:[0]},"
        "{kind:rank_crash,step:12,ranks:[1]}]",
    ),
    "ref": (),
    "nan_skip": ("fault.events=[{kind:nan_grad,step:8,ranks:[1]}]", "resilience=skip_step"),
    "skip8_ref": ("resilience=skip_step", "resilience.skip_steps=[8]"),
    "spike_rollback": (
        "fault.events=[{kind:loss_spike,step:8,ranks:[1],factor:10}]",
        "resilience=rollback",
        "checkpoint=memory",
        "checkpoint.memory_every_n_steps=5",
    ),
    "shrink": (
        "resilience=shrink",
        "fault.events=[{kind:rank_crash,step:7,ranks:[1]},{kind:rank_crash,step:9,ranks:[1]}]",
    ),
    "shrink_3of4": (
        "parallelism.world_size=4",
        "trainer.max_steps=6",  # later overrides win over COMMON's
        "trainer.global_batch_size=12",
        "trainer.micro_batch_size=1",
        "checkpoint.every_n_steps=3",
        "resilience=shrink",
        "resilience.max_restarts=0",
        "resilience.shrink_to=0.75",
        "resilience.rewarmup_steps=3",
        "fault.events=[{kind:rank_crash,step:4,ranks:[3]}]",
    ),
}
"""The module's runs: name -> overrides after ``COMMON``'s."""
NEEDS = {
    "test_nan_grad_skip_step_equals_a_run_without_that_update": ("nan_skip", "skip8_ref", "ref"),
    "test_hang_corrupt_checkpoint_and_crash_restart_bitwise": ("hang_corrupt_crash", "ref"),
    "test_loss_spike_rollback_leaves_no_spike": ("spike_rollback", "ref"),
    "test_repeated_crash_shrinks_to_one_rank_with_the_same_global_batch": ("shrink", "ref"),
    "test_shrink_to_three_quarters_is_recorded_in_mlflow": ("shrink_3of4",),
    "test_compare_report_shows_recovery_side_by_side": ("nan_skip", "spike_rollback"),
}
"""The runs each test reads."""


@pytest.fixture(scope="module")
def fr(request, tmp_path_factory, data_cache):
    """The runs the selected tests of this module read (:data:`NEEDS`), made in one Hydra sweep into the
    experiment ``faults`` (one lane: the hang run's watchdog timing is checked); ``fr.dirs``: name -> output folder."""
    selected = {item.originalname for item in request.session.items if item.module.__name__ == __name__}
    wanted = [name for name in RUNS if any(name in NEEDS[test] for test in selected)]
    runner = Runner(tmp_path_factory.mktemp("faults"), data_cache)
    runner.dirs = runner.run_variants(
        {name: [*COMMON, *RUNS[name]] for name in wanted}, lanes=1, check=False, experiment=EXPERIMENT
    )
    return runner


def _dir(fr, name) -> Path:
    """Run ``name``'s output folder; fails (only) the tests that read a run that did not finish, with its error."""
    if name not in fr.dirs:
        pytest.fail(f"run {name} did not finish: {fr.why_not_finished(name)}")
    return fr.dirs[name]


def _log(fr, name):
    return FaultLog(_dir(fr, name)).read()


def _metrics(fr, name) -> list[dict]:
    return records(_dir(fr, name))


def _losses(fr, name):
    return losses(_metrics(fr, name))


def _ckpt(fr, name, step=MAX_STEPS):
    return checkpoint_dir(_dir(fr, name), fr.workdir) / f"step{step:08d}"


def _sweep_log(fr) -> str:
    """The sweep's output (the driver's and its ranks' stdout and stderr)."""
    (log,) = Path(fr.workdir).glob("variants*-0/sweep.log")
    return log.read_text()


def _mlflow(fr):
    """The module's MLflow client and ``name -> the run's MLflow run`` (by the run id in its launch object)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{fr.workdir / 'mlruns.db'}")

    def run(name):
        found = client.get_run(json.loads((_dir(fr, name) / "launch.json").read_text())["mlflow_run_id"])
        same_name = client.search_runs(
            [found.info.experiment_id], filter_string=f"attributes.run_name = '{found.info.run_name}'"
        )
        assert len(same_name) == 1, f"one MLflow run for {name}: {[r.info.run_id for r in same_name]}"
        return found

    return client, run


def _mlflow_metrics(fr, name) -> dict[str, float]:
    run = _mlflow(fr)[1](name)
    assert run.info.status == "FINISHED"
    return run.data.metrics


def _mlflow_history(fr, name, key) -> dict[int, float]:
    """step -> value of ``key`` in the run's MLflow history (asserting one point per step)."""
    client, run = _mlflow(fr)
    points = [(m.step, m.value) for m in client.get_metric_history(run(name).info.run_id, key)]
    assert len(points) == len({s for s, _ in points}), f"{key}: more than one point at a step: {sorted(points)}"
    return dict(points)


def test_nan_grad_skip_step_equals_a_run_without_that_update(fr):
    """(1) NaN gradients on rank 1 in step 8, ``skip_step``: every rank drops step 8's update, and the
    losses equal (exactly) a fault-free run told to drop step 8's update (``resilience.skip_steps``).
    The LR schedule does not advance in step 8, and step 8 logs the NaN grad norm (issue 13, items 1 and 3)."""
    log = _log(fr, "nan_skip")
    skipped = {(r["rank"], r["step"]) for r in log if r["ev"] == "skipped"}
    assert skipped == {(0, 8), (1, 8)}, "every rank skipped step 8, and only step 8"
    (det,) = [r for r in log if r["ev"] == "detected"]
    assert det["detector"] == "nonfinite_grad" and det["step"] == 8
    got, ref_skip, ref = _losses(fr, "nan_skip"), _losses(fr, "skip8_ref"), _losses(fr, "ref")
    assert sorted(got) == list(range(1, MAX_STEPS + 1))
    assert got == ref_skip, "the same losses as the fault-free run without step 8's update, exactly"
    assert all(got[s] == ref[s] for s in range(1, 9)) and got[9] != ref[9], "step 8's update mattered"
    assert_bitwise_equal(_ckpt(fr, "nan_skip"), _ckpt(fr, "skip8_ref"))
    # Issue 13 (1): the LR schedule counts applied updates: from step 9 on each step has the LR the fault-free
    # run had one step earlier; both counters are logged. (3): the logged grad norm of step 8 is rank 1's NaN.
    rec = {int(r["step"]): r for r in _metrics(fr, "nan_skip") if "train/lr" in r}
    ref_lr = {int(r["step"]): r["train/lr"] for r in _metrics(fr, "ref") if "train/lr" in r}
    assert [rec[s]["train/lr"] for s in range(1, MAX_STEPS + 1)] == [
        ref_lr[s - (s > 8)] for s in range(1, MAX_STEPS + 1)
    ]
    assert rec[9]["train/lr"] == rec[8]["train/lr"] < ref_lr[9]
    assert [(rec[s]["train/steps_attempted"], rec[s]["train/optimizer_updates"]) for s in (7, 8, 9, MAX_STEPS)] == [
        (7, 7),
        (8, 7),
        (9, 8),
        (MAX_STEPS, MAX_STEPS - 1),
    ]
    assert math.isnan(rec[8]["train/grad_norm"]) and all(
        math.isfinite(rec[s]["train/grad_norm"]) for s in rec if s != 8
    )
    m = _mlflow_metrics(fr, "nan_skip")
    assert m["fault/injected"] == 1 and m["fault/detected"] == 1 and m["fault/detect_latency_steps"] == 0
    assert m["recovery/skipped_steps"] == 1 and m["recovery/restarts"] == 0 and 0 < m["goodput"] < 1


def test_hang_corrupt_checkpoint_and_crash_restart_bitwise(fr):
    """(4) rank 1 hangs in step 7 -> the watchdog (6 s) fires on the ranks, which restart from
    checkpoint 5: 1 step recomputed (6; 7 never completed); (5) the newest checkpoint (10) is corrupted in step 11 and
    (2) rank 1 crashes in step 12 -> the restart skips checkpoint 10 (checksum) and resumes from 5:
    6 steps recomputed. Final weights, optimizer and RNG states bitwise-identical to an
    uninterrupted run; the driver logged it all into the same MLflow run."""
    log = _log(fr, "hang_corrupt_crash")
    starts = [r for r in log if r["ev"] == "start"]
    assert [(s["restart"], s["step"]) for s in starts] == [(0, 0), (1, 5), (2, 5)]
    hangs = [r for r in log if r["ev"] == "detected" and r["detector"] == "hang_watchdog"]
    assert hangs and all(h["step"] == 7 for h in hangs)
    (hang_inj,) = [r for r in log if r["ev"] == "injected" and r["kind"] == "hang"]
    # each rank's watchdog counts from its own last progress, which may precede the injection by part of a
    # step (rank 0 waits in the collective that rank 1 never joins): the stall is >= the timeout on every
    # detecting rank, and the first detection follows the injection within the timeout (+ poll + slack)
    assert all(h["stalled_s"] >= 6.0 for h in hangs), hangs
    first = min(h["t"] for h in hangs)
    assert 0.0 < first - hang_inj["t"] <= 6.0 + 1.5 + 2.0, "detected within the timeout (+ poll + slack)"
    (corrupt,) = [r for r in log if r["ev"] == "resume_skipped_corrupt"]
    assert "step00000010" in corrupt["detail"] and "skipping corrupt checkpoint" in _sweep_log(fr)
    assert [r["kind"] for r in log if r["ev"] == "injected"] == ["hang", "ckpt_corrupt", "rank_crash"], (
        "each fired once"
    )
    assert_bitwise_equal(_ckpt(fr, "hang_corrupt_crash"), _ckpt(fr, "ref"))
    assert _losses(fr, "hang_corrupt_crash") == _losses(fr, "ref")
    m = _mlflow_metrics(fr, "hang_corrupt_crash")
    assert m["recovery/restarts"] == 2
    assert m["recovery/recomputed_steps"] == (6 - 5) + (11 - 5)  # completed steps run again (7 hung, 12 crashed)
    assert m["fault/injected"] == 3 and m["fault/detected"] == 3  # hang, corrupt checkpoint, crash
    assert m["recovery/time_s"] > 0 and 0 < m["goodput"] < 1
    # goodput's parts cover the wall time, for this run and for the fault-free one (issue 16.1)
    ref = _mlflow_metrics(fr, "ref")
    for figs, restarted in ((m, True), (ref, False)):
        assert 0 < figs["goodput"] < 1 and figs["goodput/productive_s"] > 0
        assert abs(figs["goodput/unaccounted_s"]) < 0.02 * figs["goodput/wall_s"], (
            "parts sum to the wall time within 2%"
        )
        assert (
            figs["goodput/restart_s"] > 0 and figs["goodput/lost_s"] > 0 and figs["goodput/detect_s"] > 0
        ) == restarted
    assert ref["recovery/restarts"] == 0 and ref["recovery/recomputed_steps"] == 0


def test_loss_spike_rollback_leaves_no_spike(fr):
    """(6) rank 1's loss x10 in step 8, ``rollback`` to the in-memory snapshot of step 5: steps 6-8
    are replayed, the spike is gone from the final loss history, which equals the uninterrupted run's."""
    log = _log(fr, "spike_rollback")
    (rb,) = [r for r in log if r["ev"] == "rollback"]
    assert (rb["from_step"], rb["to_step"]) == (8, 5)
    spike = [r["train/loss"] for r in _metrics(fr, "spike_rollback") if r["step"] == 8 and "train/loss" in r]
    ref = _losses(fr, "ref")
    assert len(spike) == 2 and spike[0] > 3 * ref[8], "the spike was logged, then replaced by the replay"
    final = _losses(fr, "spike_rollback")
    assert final == ref and spike[0] not in final.values()
    assert_bitwise_equal(_ckpt(fr, "spike_rollback"), _ckpt(fr, "ref"))
    m = _mlflow_metrics(fr, "spike_rollback")
    assert m["recovery/rollbacks"] == 1 and m["recovery/recomputed_steps"] == 3 and m["recovery/restarts"] == 0
    # MLflow: one point per step; the rolled-back step 8 was never sent, its replay was
    assert _mlflow_history(fr, "spike_rollback", "train/loss") == ref


def test_repeated_crash_shrinks_to_one_rank_with_the_same_global_batch(fr):
    """(3) rank 1 crashes in step 7, is restarted (from 5) and crashes again in step 9: restarts
    used up (``max_restarts=1``), the driver relaunches on 1 rank, global batch 8 kept with
    grad_accum_steps 2 -> 4, resumed from the 2-rank checkpoint of step 5. Losses match the
    uninterrupted 2-rank run within rel 1e-5 (fp32; only the summation order differs)."""
    log = _log(fr, "shrink")
    starts = [
        (s["launch"], s["restart"], s["world_size"], s["grad_accum_steps"], s["step"])
        for s in log
        if s["ev"] == "start"
    ]
    assert starts == [(0, 0, 2, 2, 0), (0, 1, 2, 2, 5), (1, 0, 1, 4, 5)]
    (shrink,) = [r for r in log if r["ev"] == "shrink"]
    assert (shrink["from_world"], shrink["to_world"], shrink["grad_accum_steps"]) == (2, 1, 4)
    got, ref = _losses(fr, "shrink"), _losses(fr, "ref")
    assert sorted(got) == list(range(1, MAX_STEPS + 1))
    for s in ref:
        assert got[s] == pytest.approx(ref[s], rel=1e-5), f"step {s}"
    m = _mlflow_metrics(fr, "shrink")
    assert m["recovery/restarts"] == 2 and m["recovery/recomputed_steps"] == (6 - 5) + (8 - 5)


def test_shrink_to_three_quarters_is_recorded_in_mlflow(fr):
    """The guide's quarter of the ranks lost (1024 -> 768), at 4 -> 3 ranks: rank 3 crashes in step 4
    with no restarts left, ``resilience.shrink_to=0.75`` relaunches on 3 ranks from checkpoint 3 with the
    global batch of 12 kept (micro-batch 1: grad_accum_steps 3 -> 4) and the LR re-warmed over 3 steps.
    MLflow: the tags name the launch in force, ``elastic/*`` show the change at step 4, ``train/lr`` is the
    schedule x 1/3, 2/3, 3/3, the fault log is an artifact, and each step is one record of rank 0 (one
    timestamp), a checkpoint step two (before and after its save)."""
    import math

    from framework.rank.module import warmup_cosine

    log = _log(fr, "shrink_3of4")
    starts = [(s["launch"], s["world_size"], s["grad_accum_steps"], s["step"]) for s in log if s["ev"] == "start"]
    assert starts == [(0, 4, 3, 0), (1, 3, 4, 3)]
    client, mlflow_run = _mlflow(fr)
    run = mlflow_run("shrink_3of4")
    assert run.info.status == "FINISHED"
    tags = run.data.tags
    assert (tags["world_size"], tags["layout"], tags["elastic.shrinks"]) == ("3", "dp3-tp1-pp1", "1")
    assert tags["elastic.history"] == "step 3: 4 -> 3 ranks, dp 4 -> 3, grad_accum_steps 3 -> 4"
    assert run.data.params["derived.world_size"] == "4", "params keep the configured run"

    def history(key):
        return {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}

    assert history("elastic/world_size") == {1: 4, 2: 4, 3: 4, 4: 3, 5: 3, 6: 3}
    assert history("elastic/dp_degree") == {1: 4, 2: 4, 3: 4, 4: 3, 5: 3, 6: 3}
    assert history("elastic/grad_accum_steps") == {1: 3, 2: 3, 3: 3, 4: 4, 5: 4, 6: 4}
    lr = history("train/lr")
    o = {"warmup_steps": 20, "max_steps": 6, "min_lr_ratio": 0.1}  # conf/config.yaml optim, lr 3e-3
    for step, rewarm in [(1, 1), (2, 1), (3, 1), (4, 1 / 3), (5, 2 / 3), (6, 1)]:
        assert math.isclose(lr[step], 3e-3 * warmup_cosine(step - 1, **o) * rewarm, rel_tol=1e-6), step
    assert "faults.jsonl" in {a.path for a in client.list_artifacts(run.info.run_id)}
    stamps: dict[int, dict[int, set[str]]] = {}  # step -> request timestamp -> keys sent in it
    for key in run.data.metrics:
        if key.split("/")[0] in ("train", "val", "perf", "mem", "ckpt", "elastic"):
            for m in client.get_metric_history(run.info.run_id, key):
                stamps.setdefault(m.step, {}).setdefault(m.timestamp, set()).add(key)
    assert sorted(stamps) == [0, 1, 2, 3, 4, 5, 6]
    # One record per step; a checkpoint step (3, and 6: the last save) two: what the step logged before
    # the save is written before it (train/loss among it), the save's own figures after it.
    for step, requests in stamps.items():
        if step not in (3, 6):
            assert len(requests) == 1, (step, requests)
            continue
        assert len(requests) == 2, (step, requests)
        before, after = (requests[t] for t in sorted(requests))
        assert "train/loss" in before and "ckpt/blocking_s" in after and not any(k.startswith("ckpt/") for k in before)
    print(f"shrink 3/4 MLflow tags: { {k: v for k, v in tags.items() if not k.startswith('mlflow.')} }")
    for key in ("elastic/world_size", "elastic/dp_degree", "elastic/grad_accum_steps", "train/lr", "train/loss"):
        print(f"shrink 3/4 {key}: {sorted(history(key).items())}")


def test_compare_report_shows_recovery_side_by_side(fr):
    """(7) The compare report of the experiment holds one recovery row per faulty run."""
    out = fr.workdir / "report"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "framework.compare",
            "--experiment",
            EXPERIMENT,
            "--out",
            str(out),
            "--tracking-uri",
            f"sqlite:///{fr.workdir / 'mlruns.db'}",
            "--no-log",
        ],
        cwd=fr.workdir,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "recovery" in proc.stdout and "recomputed_steps" in proc.stdout
    import csv

    rows = {r["run"]: r for r in csv.DictReader(open(out / "compare_recovery.csv"))}
    assert len(rows) == len([n for n in fr.dirs if n != "ref"])  # every run with a policy or faults; not ref
    by_kinds = {(r["faults"], r["resilience"]): r for r in rows.values()}
    rb = by_kinds["loss_spike", "rollback"]
    assert float(rb["rollbacks"]) == 1 and float(rb["recomputed_steps"]) == 3 and float(rb["injected"]) == 1
    nan = by_kinds["nan_grad", "skip_step"]
    assert float(nan["skipped_steps"]) == 1 and float(nan["restarts"]) == 0 and 0 < float(nan["goodput"]) < 1
    assert "Recovery" in (out / "compare.md").read_text()
