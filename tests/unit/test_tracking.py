"""Rank 0's metrics for MLflow: its outbox holds one record per logged step (two for a checkpoint step), and the
driver's forwarder sends each step of a metric once after a resume or a rollback, with rank 0's timestamps.

Against a real MLflow store (a SIGINT-ed run resumed by the same command): tests/integration/test_train_e2e.py."""

from __future__ import annotations

import json
from types import SimpleNamespace

from framework.base.metrics.emit import MetricEmitter
from framework.base.tracking import MetricForwarder, MetricOutbox, outbox_path
from framework.rank.callbacks.clock import StepClock
from framework.rank.callbacks.metric_flush import FlushMetrics


class CountingClient:
    """An ``MlflowClient`` stand-in: records each ``log_batch`` request; ``newest`` = what the run already holds."""

    def __init__(self, newest: dict[str, int] | None = None, fail: bool = False) -> None:
        from mlflow.entities import Metric, RunData

        self.requests: list[list] = []
        self.params: dict[str, str] = {}
        self.tags: dict[str, str] = {}
        self.fail = fail
        self.run = SimpleNamespace(data=RunData(metrics=[Metric(k, 0.0, 0, s) for k, s in (newest or {}).items()]))

    def get_run(self, run_id):
        return self.run

    def log_batch(self, run_id, metrics=()):
        if self.fail:
            raise ConnectionError("tracking server unreachable")
        self.requests.append([(m.key, m.step, m.value) for m in metrics])

    def log_param(self, run_id, key, value):
        if key in self.params and self.params[key] != value:
            raise ValueError("changing a param is refused")
        self.params[key] = value

    def set_tag(self, run_id, key, value):
        self.tags[key] = value


def _records(outbox: MetricOutbox) -> list[dict]:
    return [json.loads(line) for line in outbox.path.read_text().splitlines()]


def _sent(client: CountingClient) -> list[tuple[str, int]]:
    return [(k, s) for r in client.requests for k, s, _ in r]


def _drive(sink: MetricOutbox, steps: range, *, accum: int, max_steps: int, log_every: int = 1) -> None:
    """What the Trainer does with the callbacks: micro-batches, step ends, the callbacks' writes, the flush."""
    clock = StepClock()
    flush = FlushMetrics(clock=clock, emit=MetricEmitter([sink]))
    trainer = SimpleNamespace(global_step=steps[0] - 1, max_steps=max_steps)
    clock.on_train_start(trainer, None)
    flush.on_train_start(trainer, None)
    for step in steps:
        for micro in range(accum):
            if micro == accum - 1:
                trainer.global_step = step
            clock.on_train_batch_end(trainer, None, None, None, 0)
            if clock.step_ended and step % log_every == 0:  # StepMetrics, checkpoint, breakdown: three writers
                sink({"train/loss": 1.0 / step, "train/lr": 0.1}, step)
                sink({"ckpt/blocking_s": 0.5}, step)
                sink({"perf/compute_s": 0.2, "mem/model_states_bytes": 100.0}, step)
            flush.on_train_batch_end(trainer, None, None, None, 0)
    sink({"train/loss_final": 0.5, "mem/model_states_bytes": 200.0}, trainer.global_step)  # the summaries
    flush.on_train_end(trainer, None)


def test_one_record_per_logged_step_with_every_callbacks_metrics(tmp_path):
    outbox = MetricOutbox(outbox_path(tmp_path, "run"))
    _drive(outbox, range(1, 9), accum=2, max_steps=8, log_every=2)
    records = _records(outbox)
    assert [r["step"] for r in records] == [2, 4, 6, 8]
    assert records[-1]["metrics"]["mem/model_states_bytes"] == 200.0, "the summary written at the end replaces it"
    assert {"train/loss", "train/lr", "ckpt/blocking_s", "perf/compute_s", "train/loss_final"} <= records[-1][
        "metrics"
    ].keys()
    assert len(records[0]["metrics"]) == 5
    client = CountingClient()
    assert MetricForwarder(client, "run", outbox.path).forward() == 5 + 5 + 5 + 6
    assert len(client.requests) == 1, "one request for what one poll found"


def test_a_resumed_run_does_not_send_the_steps_it_already_holds(tmp_path):
    # the run logged train/loss up to step 5, checkpoint metrics up to step 4, then crashed; resumed from step 2
    client = CountingClient(newest={"train/loss": 5, "train/lr": 5, "ckpt/blocking_s": 4})
    outbox = MetricOutbox(outbox_path(tmp_path, "run"))
    forwarder = MetricForwarder(client, "run", outbox.path)
    _drive(outbox, range(3, 6), accum=1, max_steps=8)
    forwarder.forward()
    _drive(outbox, range(6, 9), accum=1, max_steps=8)
    forwarder.forward()
    sent = _sent(client)
    assert sorted(s for k, s in sent if k == "train/loss") == [6, 7, 8]
    assert sorted(s for k, s in sent if k == "ckpt/blocking_s") == [5, 6, 7, 8]
    assert sorted(s for k, s in sent if k == "perf/compute_s") == [3, 4, 5, 6, 7, 8], "new keys start where they start"
    assert len(client.requests) == 2 and len(sent) == len(set(sent))


def test_the_next_driver_sends_what_a_killed_driver_left_and_nothing_twice(tmp_path):
    from mlflow.entities import Metric, RunData

    outbox = MetricOutbox(outbox_path(tmp_path, "run"))
    client = CountingClient()
    _drive(outbox, range(1, 4), accum=1, max_steps=8)
    MetricForwarder(client, "run", outbox.path).forward()  # the first driver sent steps 1-3, then was killed
    _drive(outbox, range(4, 6), accum=1, max_steps=8)  # rank 0 wrote 4-5 before it died with it
    client.run.data = RunData(metrics=[Metric(k, 0.0, 0, s) for k, s in _sent(client)])  # what MLflow holds now
    _drive(outbox, range(4, 9), accum=1, max_steps=8)  # the resumed run replays 4-5 (from a step-3 checkpoint)
    MetricForwarder(client, "run", outbox.path).forward()
    loss = [s for k, s in _sent(client) if k == "train/loss"]
    assert loss == [1, 2, 3, 4, 5, 6, 7, 8]


def test_a_rolled_back_step_is_discarded_and_its_replay_sent_once(tmp_path):
    outbox = MetricOutbox(outbox_path(tmp_path, "run"))
    clock = StepClock()
    flush = FlushMetrics(clock=clock, emit=MetricEmitter([outbox]))
    trainer = SimpleNamespace(global_step=0, max_steps=10)
    clock.on_train_start(trainer, None)
    for step, value in [(1, 1.0), (2, 2.0), (3, 99.0), (2, 2.0), (3, 3.0), (4, 4.0)]:  # a spike in step 3 -> back to 1
        trainer.global_step = step
        clock.on_train_batch_end(trainer, None, None, None, 0)
        outbox({"train/loss": value}, step)
        if value == 99.0:
            trainer.global_step = 1  # the guard's rollback, in the same on_train_batch_end
            clock.on_rollback(1)
        flush.on_train_batch_end(trainer, None, None, None, 0)
    assert [(r["step"], r["metrics"]) for r in _records(outbox)] == [
        (1, {"train/loss": 1.0}),
        (2, {"train/loss": 2.0}),
        (2, {"train/loss": 2.0}),
        (3, {"train/loss": 3.0}),
        (4, {"train/loss": 4.0}),
    ]
    client = CountingClient()
    MetricForwarder(client, "run", outbox.path).forward()
    assert client.requests == [
        [("train/loss", 1, 1.0), ("train/loss", 2, 2.0), ("train/loss", 3, 3.0), ("train/loss", 4, 4.0)]
    ]


def test_the_forwarder_keeps_a_line_being_written_for_its_next_poll_and_rank_0s_timestamps(tmp_path):
    path = outbox_path(tmp_path, "run")
    path.write_text(
        json.dumps({"step": 1, "ts": 1000, "metrics": {"train/loss": 1.0}})
        + "\n"
        + '{"step": 2, "ts": 2000, "metr'  # rank 0's write of step 2, half done
    )
    client = CountingClient()
    forwarder = MetricForwarder(client, "run", path)
    assert forwarder.forward() == 1
    with open(path, "a") as f:
        f.write('ics": {"train/loss": 2.0}}\n')
    assert forwarder.forward() == 1 and forwarder.forward() == 0
    assert client.requests == [[("train/loss", 1, 1.0)], [("train/loss", 2, 2.0)]]
    stamps = []
    client.log_batch = lambda run_id, metrics=(): stamps.extend(m.timestamp for m in metrics)
    with open(path, "a") as f:
        f.write(json.dumps({"step": 3, "ts": 3000, "metrics": {"train/loss": 3.0, "train/lr": 0.1}}) + "\n")
    forwarder.forward()
    assert stamps == [3000, 3000]  # rank 0's flush time, not the forwarder's


def test_a_line_cut_by_a_killed_rank_0_is_skipped_and_the_next_rank_0s_records_are_sent(tmp_path):
    path = outbox_path(tmp_path, "run")
    first = MetricOutbox(path)
    first({"train/loss": 1.0}, 1)
    first.flush()
    with open(path, "a") as f:
        f.write('{"step": 2, "ts": 2000, "metrics": {"train/lo')  # SIGKILL in the middle of a write
    client = CountingClient()
    forwarder = MetricForwarder(client, "run", path)
    assert forwarder.forward() == 1, "step 1; the cut line waits"
    restarted = MetricOutbox(path)  # the restarted rank 0 ends the cut line first
    restarted({"train/loss": 2.0}, 2)
    restarted.flush()
    assert forwarder.forward() == 1
    assert client.requests == [[("train/loss", 1, 1.0)], [("train/loss", 2, 2.0)]]
    assert len(path.read_text().splitlines()) == 3, "the cut line stays, alone on its line"


def test_a_failed_request_is_sent_again_at_the_next_poll_and_nothing_twice(tmp_path):
    from mlflow.entities import Metric, RunData

    outbox = MetricOutbox(outbox_path(tmp_path, "run"))
    client = CountingClient(newest={"train/loss": 2})  # a resumed run: MLflow holds steps 1-2
    forwarder = MetricForwarder(client, "run", outbox.path)
    forwarder.MAX_METRICS_PER_REQUEST = 2
    _drive(outbox, range(1, 6), accum=1, max_steps=8)  # rank 0 replays 1-2, then 3-5
    get_run, client.get_run = client.get_run, lambda run_id: (_ for _ in ()).throw(ConnectionError("down"))
    assert forwarder.forward() == 0, "without the run's newest steps nothing is sent"
    client.get_run = get_run
    real_log_batch, calls = client.log_batch, []

    def second_request_fails(run_id, metrics=()):
        calls.append(len(metrics))
        if len(calls) == 2:
            raise ConnectionError("timeout")
        real_log_batch(run_id, metrics)

    client.log_batch = second_request_fails
    assert forwarder.forward() == 2, "the first request went, the second failed"
    client.log_batch = real_log_batch
    forwarder.forward()  # the next poll: the rest
    loss = [s for k, s in _sent(client) if k == "train/loss"]
    assert loss == [3, 4, 5] and len(_sent(client)) == len(set(_sent(client)))
    assert forwarder.forward() == 0
    client.run.data = RunData(metrics=[Metric(k, 0.0, 0, s) for k, s in _sent(client)])
    again = MetricForwarder(client, "run", outbox.path)  # the next driver starts where this one's sending ended
    assert again._read_new() == ([], outbox.path.stat().st_size)
    assert int(outbox.path.with_name(outbox.path.name + ".sent").read_text()) == outbox.path.stat().st_size


def test_params_keep_their_first_value_tags_are_set_and_errors_warn_once(tmp_path, monkeypatch):
    import framework.base.tracking as tracking

    warnings = []  # the module logger's warnings (counted directly: another test may have configured logging)
    monkeypatch.setattr(tracking.log, "warning", lambda msg, *args: warnings.append(msg % args))
    outbox = MetricOutbox(outbox_path(tmp_path, "run"))
    outbox.log_params({"mfu.peak_flops_method": "measured"})
    outbox.log_params({"mfu.peak_flops_method": "table"})  # a resumed run measured again: the first value stays
    outbox.set_tags({"mfu.calibration_error": "above the peak"})
    outbox({"train/loss": 1.0}, 1)
    outbox.flush()
    client = CountingClient()
    MetricForwarder(client, "run", outbox.path).forward()
    assert client.params == {"mfu.peak_flops_method": "measured"}
    assert client.tags == {"mfu.calibration_error": "above the peak"}
    failing = CountingClient(fail=True)
    forwarder = MetricForwarder(failing, "run", outbox.path)
    forwarder.forward()
    outbox({"train/loss": 2.0}, 2)
    outbox.flush()
    forwarder.forward()  # never raises; warned once
    assert len(warnings) == 1 and "MLflow logging failed" in warnings[0], warnings


def test_the_forwarder_polls_while_it_runs_and_sends_the_rest_when_it_stops(tmp_path):
    import time

    outbox = MetricOutbox(outbox_path(tmp_path, "run"))
    client = CountingClient()
    with MetricForwarder(client, "run", outbox.path, interval_s=0.05):
        outbox({"train/loss": 1.0}, 1)
        outbox.flush()
        deadline = time.monotonic() + 10
        while not client.requests and time.monotonic() < deadline:
            time.sleep(0.01)
        assert client.requests == [[("train/loss", 1, 1.0)]], "sent by a poll, before the forwarder stopped"
        outbox({"train/loss": 2.0}, 2)
        outbox.flush()
        outbox({"train/loss": 3.0}, 3)
        outbox.flush()
    assert _sent(client) == [("train/loss", 1), ("train/loss", 2), ("train/loss", 3)]


def test_only_the_end_of_step_flush_is_carried_into_the_next_step(tmp_path):
    """The breakdown moves a flush's seconds from the next step's data wait to ``other`` (the flush ran after
    it closed the step); the flush before a checkpoint save runs inside the step, so it must not be reported."""
    outbox = MetricOutbox(outbox_path(tmp_path, "run"))
    reported = []
    clock = StepClock()
    flush = FlushMetrics(clock=clock, emit=MetricEmitter([outbox]), on_time_spent=reported.append)
    trainer = SimpleNamespace(global_step=0, max_steps=4)
    clock.on_train_start(trainer, None)
    trainer.global_step = 1
    clock.on_train_batch_end(trainer, None, None, None, 0)
    outbox({"train/loss": 1.0}, 1)
    flush.flush()  # the checkpoint callback's before_save
    assert len(_records(outbox)) == 1 and reported == []
    outbox({"ckpt/blocking_s": 0.5}, 1)
    flush.on_train_batch_end(trainer, None, None, None, 0)  # the step's end
    assert len(_records(outbox)) == 2 and len(reported) == 1 and reported[0] >= 0
