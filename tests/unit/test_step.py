"""framework.rank.step (the step's state and the one callback that runs its parts in phase order) and
framework.base.metrics.emit (the one metric emitter)."""

from __future__ import annotations

import pytest
import pytorch_lightning as pl
import torch

from framework.base.metrics.emit import MetricEmitter
from framework.rank.step import PHASES, StepState, TrainStep


class _Part(pl.Callback):
    """Records its name in ``calls`` for the hooks it defines (batch start, batch end)."""

    def __init__(self, name: str, calls: list) -> None:
        self.name, self.calls = name, calls

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.calls.append(("start", self.name))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.calls.append(("end", self.name, pl_module.step_state.drop_update))


class _EndOnly(pl.Callback):
    def __init__(self, calls: list) -> None:
        self.calls = calls

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.calls.append(("end", "end_only"))


def test_parts_run_in_phase_order_whatever_order_they_are_given_in():
    calls: list = []
    state = StepState()
    module = type("M", (), {"step_state": state})()
    given = [
        ("send", _Part("flush", calls)),
        ("checkpoint", _Part("save", calls)),
        ("boundary", _Part("clock", calls)),
        ("faults", _Part("guard", calls)),
        ("metrics", _Part("loss", calls)),
        ("metrics", _EndOnly(calls)),
        ("accounting", None),
    ]
    step = TrainStep(state, given)
    assert [p for p, _ in step.parts] == sorted((p for p, cb in given if cb is not None), key=PHASES.index)
    step.on_train_batch_start(None, module, None, 0)
    state.drop("skip_steps")  # the guard's decision, seen by every part at the step's end
    step.on_train_batch_end(None, module, None, None, 0)
    assert [c for c in calls if c[0] == "start"] == [("start", n) for n in ("clock", "loss", "guard", "save", "flush")]
    assert [c[1] for c in calls if c[0] == "end"] == ["clock", "loss", "end_only", "guard", "save", "flush"]
    assert all(c[2] for c in calls if c[0] == "end" and len(c) == 3), "the drop stays set until every part ran"
    assert not state.drop_update and state.drop_reason is None, "cleared after the step's last phase"


def test_an_unknown_phase_or_a_part_with_callback_state_is_refused():
    with pytest.raises(ValueError, match="phase 'later'"):
        TrainStep(StepState(), [("later", pl.Callback())])

    class Stateful(pl.Callback):
        def state_dict(self):
            return {"x": 1}

    with pytest.raises(ValueError, match="keeps callback state"):
        TrainStep(StepState(), [("metrics", Stateful())])


def test_a_new_epoch_clears_a_rollbacks_end_of_epoch_request():
    state = StepState(end_epoch_requested=True)
    TrainStep(state, []).on_train_epoch_start(None, None)
    assert not state.end_epoch_requested


def test_step_state_sums_micro_batch_losses_with_the_fault_transform():
    state = StepState()
    assert state.add_loss(torch.tensor(1.0)) == 1.0
    state.loss_transform = lambda loss: loss * 3
    assert state.add_loss(torch.tensor(2.0)) == 6.0
    assert state.micro_batches == 2 and float(state.mean_loss()) == 3.5
    assert float(state.take_loss()) == 3.5 and state.micro_batches == 0 and float(state.loss_sum) == 0.0


class _Buffered:
    def __init__(self) -> None:
        self.points: list = []
        self.sent: list = []

    def __call__(self, metrics, step):
        self.points.append((step, dict(metrics)))

    def flush(self):
        self.sent += self.points
        self.points = []

    def discard_after(self, step):
        self.points = [p for p in self.points if p[0] <= step]


def test_the_emitter_writes_on_rank_0_only_and_sends_buffered_sinks():
    plain: list = []
    buffered = _Buffered()
    rank0 = MetricEmitter([lambda m, s: plain.append((s, dict(m))), buffered])
    other = MetricEmitter([lambda m, s: plain.append(("other", s))], enabled=False)
    rank0({"train/loss": 1.0}, 1)
    rank0.emit({"train/loss": 0.5}, 2)
    other({"train/loss": 9.0}, 1)
    assert plain == [(1, {"train/loss": 1.0}), (2, {"train/loss": 0.5})]
    assert rank0.buffered == [buffered] and other.buffered == []
    rank0.discard_after(1)  # step 2 was rolled back before it was sent
    rank0.flush()
    assert buffered.sent == [(1, {"train/loss": 1.0})]


def test_the_worker_puts_every_part_of_a_run_in_its_documented_phase(compose, tmp_path):
    """The program order of a run with every optional part (host syncs, profiler, faults with rollback,
    in-memory snapshots, a buffering sink): the table of docs/training_step.md."""
    from types import SimpleNamespace

    from framework.base.faults.events import FaultLog
    from framework.base.faults.schedule import build_schedule
    from framework.base.launch import LaunchSpec
    from framework.base.registry import get_plugin_class
    from framework.driver.validate import load_run_config, validate
    from framework.rank.faults.guard import FaultGuard
    from framework.rank.worker import _build_step

    resolved = validate(
        load_run_config(
            compose(
                "tracking=none",
                "fault=nan_grad",
                "resilience=rollback",
                "checkpoint.memory_every_n_steps=5",
                "trainer.count_host_syncs=true",
                "trainer.profile_steps=[2,3]",
                f"checkpoint.dir={tmp_path}/ckpt",
            )
        )
    )
    launch = LaunchSpec(
        resolved=resolved,
        run_dir=tmp_path,
        mlflow_run_id=None,
        resume_from=None,
        token_cache_dir=str(tmp_path),
        fault_schedule=build_schedule(resolved.run, resolved.world_size),
    )
    plugin = get_plugin_class(resolved.run.parallelism.name)(resolved.run.parallelism)
    buffered = _Buffered()
    flops = SimpleNamespace(per_token=1, hardware_per_token=1, peak=1.0)
    state = StepState()
    _, step, _ = _build_step(launch, plugin, 0, state, MetricEmitter([buffered]), flops, {}, FaultLog(tmp_path), "0.0")
    assert step.state is state
    assert [(phase, type(cb).__name__) for phase, cb in step.parts] == [
        ("probe", "HostSyncs"),
        ("probe", "StepProfiler"),
        ("boundary", "StepClock"),
        ("metrics", "StepMetrics"),
        ("metrics", "ValidationLoss"),
        ("metrics", "ActivationMemory"),
        ("faults", "FaultInjector"),
        ("faults", "FaultGuard"),
        ("checkpoint", "MemorySnapshot"),
        ("checkpoint", "PeriodicCheckpoint"),
        ("checkpoint", "Preemption"),
        ("accounting", "StepBreakdown"),
        ("accounting", "RunTimeline"),
        ("send", "FlushMetrics"),
    ]
    guard = step.part(FaultGuard)
    assert guard.snapshot is step.parts[8][1] and guard.clock is step.parts[2][1]
