"""The fault-kind registry: one module per kind, discovered; its presets; the injector driving the kinds' hooks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from framework.base.faults.events import FaultLog
from framework.base.faults.kinds import FaultKind, fault_kind_names, fault_kinds, get_fault_kind, register_fault_kind
from framework.rank.faults.inject import FaultInjector
from framework.rank.step import StepState
from tests.conftest import CONF_DIR

REPO = Path(__file__).resolve().parents[2]


def test_every_kind_is_a_module_with_a_preset_of_its_name():
    """A kind is one module in framework/base/faults/kinds/ plus conf/fault/<kind>.yaml: the two lists match."""
    modules = sorted(
        p.stem for p in (REPO / "framework" / "base" / "faults" / "kinds").glob("*.py") if not p.stem.startswith("_")
    )
    presets = sorted(p.stem for p in (CONF_DIR / "fault").glob("*.yaml"))
    assert fault_kind_names() == modules and len(modules) >= 9
    assert sorted(set(presets) - {"none", "random"}) == modules
    assert all(k.summary and k.name == n for n, k in fault_kinds().items())


def test_an_unknown_kind_and_a_second_class_under_a_name_are_refused():
    with pytest.raises(KeyError, match="'oom' is not a fault kind; allowed: bad_batch, "):
        get_fault_kind("oom")

    class Other(FaultKind):
        name = "hang"

    with pytest.raises(ValueError, match="fault kind 'hang' is registered twice"):
        register_fault_kind(Other)
    assert type(get_fault_kind("hang")).__name__ == "Hang"


@pytest.mark.slow
def test_the_cli_lists_every_kind():
    out = subprocess.run(
        [sys.executable, "-m", "framework.base.faults.kinds"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert [line.split(":")[0] for line in out] == fault_kind_names()


class _Module(torch.nn.Module):
    vocab_size = 50

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(3))
        self.step_state = StepState()


def _event(i, kind, step, **kw):
    return {
        "id": f"e{i}",
        "kind": kind,
        "step": step,
        "ranks": [0],
        "factor": 10.0,
        "delay_s": 0.0,
        "duration_steps": 1,
        **kw,
    }


def test_the_injector_runs_each_kind_in_its_step_once(tmp_path, monkeypatch):
    """Drives the injector's hooks over 3 steps of 2 micro-batches: loss_spike sets the loss transform for its
    step only, bad_batch replaces both micro-batches of its step, nan_grad poisons the gradients of its step,
    slow_rank sleeps once in each of its duration_steps steps; every firing is in the fault log, once."""
    import framework.base.faults.kinds.slow_rank as slow

    slept = []
    monkeypatch.setattr(slow.time, "sleep", slept.append)
    schedule = [
        _event(0, "loss_spike", 1, factor=3.0),
        _event(1, "bad_batch", 2),
        _event(2, "nan_grad", 2),
        _event(3, "slow_rank", 1, delay_s=0.25, duration_steps=2),
    ]
    inj = FaultInjector(schedule=schedule, rank=0, log=FaultLog(tmp_path), checkpoint_dir=str(tmp_path))
    module, trainer = _Module(), SimpleNamespace(global_step=0)
    seen = []
    for step in (1, 2, 3):
        for micro in range(2):
            batch = (torch.zeros(2, 4, dtype=torch.long), torch.zeros(2, 4, dtype=torch.long))
            inj.on_train_batch_start(trainer, module, batch, micro)
            module.w.grad = torch.ones(3)
            inj.on_before_optimizer_step(trainer, module, None)
            seen.append(
                (
                    step,
                    module.step_state.loss_transform(torch.tensor(1.0)).item()
                    if module.step_state.loss_transform
                    else None,
                    bool(batch[0].any()),
                    bool(module.w.grad.isnan().all()),
                )
            )
        trainer.global_step = step
        inj.on_train_batch_end(trainer, module, None, None, 1)
    assert seen == [
        (1, 3.0, False, False),
        (1, 3.0, False, False),
        (2, None, True, True),
        (2, None, True, True),
        (3, None, False, False),
        (3, None, False, False),
    ]
    assert slept == [0.25, 0.25] and module.step_state.loss_transform is None
    assert FaultLog(tmp_path).fired_ids() == {"e0@0", "e1@0", "e2@0", "e3@0"}
    again = FaultInjector(schedule=schedule, rank=0, log=FaultLog(tmp_path), checkpoint_dir=str(tmp_path))
    trainer.global_step = 0
    again.on_train_batch_start(trainer, module, (torch.zeros(1, 1), torch.zeros(1, 1)), 0)
    assert module.step_state.loss_transform is None  # a replayed step runs clean


def test_a_kind_declares_its_own_rules_and_random_defaults(compose):
    from framework.base.faults.schedule import build_schedule
    from framework.driver.validate import load_run_config

    run = load_run_config(compose("fault.mtbf_steps=5", "fault.random_kinds=[hang]", "resilience.hang_timeout_s=5"))
    assert get_fault_kind("hang").check(run) == []
    assert {e["delay_s"] for e in build_schedule(run, world_size=2)} == {3600.0}
    run.resilience.hang_timeout_s = 0
    (problem,) = get_fault_kind("hang").check(run)
    assert "resilience.hang_timeout_s > 0" in problem and "\n" not in problem
