"""framework.rank.callbacks.clock: step ends, rollback and the seconds kept out of the metric callbacks' steps."""

from __future__ import annotations

from types import SimpleNamespace

from framework.base.metrics.emit import MetricEmitter
from framework.rank.callbacks.clock import StepClock
from framework.rank.callbacks.step_metrics import StepMetrics


def test_step_ends_warmup_and_rollback():
    clock, trainer = StepClock(), SimpleNamespace(global_step=3)
    clock.on_train_start(trainer, None)
    ends = []
    for global_step in (3, 4, 4, 5):  # a micro-batch inside accumulation, then step 4, ..., step 5
        trainer.global_step = global_step
        clock.on_train_batch_end(trainer, None, None, None, 0)
        ends.append(clock.step_ended)
    assert ends == [False, True, False, True] and clock.steps_since_start == 2
    clock.on_rollback(2)  # rewound to step 2: the next step end is step 3
    trainer.global_step = 3
    clock.on_train_batch_end(trainer, None, None, None, 0)
    assert clock.step_ended and clock.step == 3 and clock.steps_since_start == 0


def test_excluded_seconds_are_running_totals_that_step_metrics_subtracts():
    clock = StepClock()
    clock.add_validation(0.5)
    clock.add_checkpoint(0.25)
    clock.add_validation(1.0)
    assert (clock.validation_s, clock.checkpoint_s, clock.excluded_s) == (1.5, 0.25, 1.75)
    metrics = StepMetrics(
        clock=clock,
        tokens_per_step=1,
        flops_per_token=1.0,
        peak_flops=1.0,
        num_devices=1,
        log_every_n_steps=1,
        warmup_steps_excluded=0,
        emit=MetricEmitter(),
        progress_bar=False,
    )
    excl0 = clock.excluded_s  # a period starting now: what was excluded before it does not count
    clock.add_checkpoint(2.0)
    assert metrics._elapsed(10.0, 5.0, excl0) == 3.0  # 5 s of wall time, 2 s of it a checkpoint save
