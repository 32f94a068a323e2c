"""Rank 0's MLflow writes: one request per logged step, one point per step after a resume or a rollback.

Against a real MLflow store (a SIGINT-ed run resumed by the same command): tests/integration/test_train_e2e.py."""

from __future__ import annotations

from types import SimpleNamespace

from framework.base.metrics.emit import MetricEmitter
from framework.base.tracking import MLflowMetricSink
from framework.rank.callbacks.clock import StepClock
from framework.rank.callbacks.metric_flush import FlushMetrics


class CountingClient:
    """An ``MlflowClient`` stand-in: records each ``log_batch`` request; ``newest`` = what the run already holds."""

    def __init__(self, newest: dict[str, int] | None = None) -> None:
        from mlflow.entities import Metric, RunData

        self.requests: list[list] = []
        self.run = SimpleNamespace(data=RunData(metrics=[Metric(k, 0.0, 0, s) for k, s in (newest or {}).items()]))

    def get_run(self, run_id):
        return self.run

    def log_batch(self, run_id, metrics=()):
        self.requests.append([(m.key, m.step, m.value) for m in metrics])


def _drive(sink: MLflowMetricSink, steps: range, *, accum: int, max_steps: int, log_every: int = 1) -> None:
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


def test_one_request_per_logged_step_with_every_callbacks_metrics():
    client = CountingClient()
    sink = MLflowMetricSink("unused", "run", client=client)
    _drive(sink, range(1, 9), accum=2, max_steps=8, log_every=2)
    assert [sorted({s for _, s, _ in r}) for r in client.requests] == [[2], [4], [6], [8]]
    last = {k: v for k, _, v in client.requests[-1]}
    assert last["mem/model_states_bytes"] == 200.0, "the summary written at the end replaces the step's sample"
    assert {"train/loss", "train/lr", "ckpt/blocking_s", "perf/compute_s", "train/loss_final"} <= last.keys()
    assert len(client.requests[0]) == 5


def test_a_resumed_run_does_not_send_the_steps_it_already_holds():
    # the run logged train/loss up to step 5, checkpoint metrics up to step 4, then crashed; resumed from step 2
    client = CountingClient(newest={"train/loss": 5, "train/lr": 5, "ckpt/blocking_s": 4})
    sink = MLflowMetricSink("unused", "run", client=client)
    _drive(sink, range(3, 9), accum=1, max_steps=8)
    sent = [(k, s) for r in client.requests for k, s, _ in r]
    assert sorted(s for k, s in sent if k == "train/loss") == [6, 7, 8]
    assert sorted(s for k, s in sent if k == "ckpt/blocking_s") == [5, 6, 7, 8]
    assert sorted(s for k, s in sent if k == "perf/compute_s") == [3, 4, 5, 6, 7, 8], "new keys start where they start"
    assert len(client.requests) == 6 and len(sent) == len(set(sent))


def test_a_rolled_back_step_is_discarded_and_its_replay_sent_once():
    client = CountingClient()
    sink = MLflowMetricSink("unused", "run", client=client)
    clock = StepClock()
    flush = FlushMetrics(clock=clock, emit=MetricEmitter([sink]))
    trainer = SimpleNamespace(global_step=0, max_steps=10)
    clock.on_train_start(trainer, None)
    for step, value in [(1, 1.0), (2, 2.0), (3, 99.0), (2, 2.0), (3, 3.0), (4, 4.0)]:  # a spike in step 3 -> back to 1
        trainer.global_step = step
        clock.on_train_batch_end(trainer, None, None, None, 0)
        sink({"train/loss": value}, step)
        if value == 99.0:
            trainer.global_step = 1  # the guard's rollback, in the same on_train_batch_end
            clock.on_rollback(1)
        flush.on_train_batch_end(trainer, None, None, None, 0)
    assert [r for r in client.requests] == [
        [("train/loss", 1, 1.0)],
        [("train/loss", 2, 2.0)],
        [("train/loss", 3, 3.0)],
        [("train/loss", 4, 4.0)],
    ]


def test_only_the_end_of_step_flush_is_carried_into_the_next_step():
    """The breakdown moves a flush's seconds from the next step's data wait to ``other`` (the flush ran after
    it closed the step); the flush before a checkpoint save runs inside the step, so it must not be reported."""
    client = CountingClient()
    sink = MLflowMetricSink("unused", "run", client=client)
    reported = []
    clock = StepClock()
    flush = FlushMetrics(clock=clock, emit=MetricEmitter([sink]), on_time_spent=reported.append)
    trainer = SimpleNamespace(global_step=0, max_steps=4)
    clock.on_train_start(trainer, None)
    trainer.global_step = 1
    clock.on_train_batch_end(trainer, None, None, None, 0)
    sink({"train/loss": 1.0}, 1)
    flush.flush()  # the checkpoint callback's before_save
    assert len(client.requests) == 1 and reported == []
    sink({"ckpt/blocking_s": 0.5}, 1)
    flush.on_train_batch_end(trainer, None, None, None, 0)  # the step's end
    assert len(client.requests) == 2 and len(reported) == 1 and reported[0] >= 0
