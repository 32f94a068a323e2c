"""Fault schedule, config rules, detectors and the recovery accounting (no ranks started)."""

from __future__ import annotations

import math

import pytest
import torch

from framework.base.config.schema import ConfigError
from framework.base.faults.events import FaultLog
from framework.base.faults.schedule import build_schedule
from framework.driver.faults.accounting import recovery_figures
from framework.driver.validate import load_run_config, validate
from framework.rank.faults.detect import RunningMean, StepHealth, gather_health
from tests.conftest import CONF_DIR


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


@pytest.mark.parametrize("option", _options("fault"))
def test_every_fault_preset_composes_and_validates(compose, option):
    extra = ["resilience=restart"] if option == "hang" else []
    run = validate(load_run_config(compose(f"fault={option}", *extra))).run
    assert run.fault.name == option
    if option not in ("none", "random"):
        assert [e.kind for e in run.fault.events][-1] in (option, "rank_crash")
        assert option in [e.kind for e in run.fault.events]


@pytest.mark.parametrize("option", _options("resilience"))
def test_every_resilience_preset_composes_and_validates(compose, option):
    extra = ["checkpoint=memory"] if option == "rollback" else []
    run = validate(load_run_config(compose(f"resilience={option}", *extra))).run
    assert run.resilience.name == option and run.resilience.policy == option


def test_issue_default_scenarios(compose):
    """The presets hold the issue's scenarios: nan_grad rank 1 at 30, rank_crash rank 1 at 40."""
    nan = load_run_config(compose("fault=nan_grad")).fault.events
    crash = load_run_config(compose("fault=rank_crash")).fault.events
    assert [(e.kind, e.step, list(e.ranks)) for e in nan] == [("nan_grad", 30, [1])]
    assert [(e.kind, e.step, list(e.ranks)) for e in crash] == [("rank_crash", 40, [1])]


def test_fault_recovery_preset_sweeps_kinds_by_policies(compose):
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    preset = OmegaConf.load(CONF_DIR / "experiment" / "fault_recovery.yaml")
    sweep = preset.hydra.sweeper.params
    (glob,) = OverridesParser.create().parse_overrides([f"fault={sweep['fault']}"])
    faults = glob.value().filter(_options("fault"))  # every fault preset but none and random, a new kind's too
    assert set(faults) == set(_options("fault")) - {"none", "random"} and len(faults) >= 9
    assert set(sweep["resilience"].split(",")) == set(_options("resilience")) - {"none"}
    # every sweep point (faults x policies) composes and validates: test_config.py's
    # test_every_point_of_a_study_preset_validates[fault_recovery]; here the preset's own settings reach a job
    run = validate(load_run_config(compose("experiment=fault_recovery", "fault=nan_grad", "resilience=restart"))).run
    assert run.checkpoint.every_n_steps == 25 and run.experiment_name == "fault_recovery"


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        (
            ["fault.events=[{kind:nan_grud,step:3}]"],
            "fault.events[0].kind='nan_grud' is not a fault kind; allowed: bad_batch,",
        ),
        (
            ["fault.mtbf_steps=5", "fault.random_kinds=[rank_crash,oom]"],
            "fault.random_kinds has 'oom', which is not a fault kind; allowed: bad_batch,",
        ),
        (["fault.events=[{kind:nan_grad,step:0}]"], "fault.events.step=0 must be >= 1"),
        (["fault.events=[{kind:nan_grad,step:9999}]"], "fault.events[0].step=9999 is after trainer.max_steps=800"),
        (["fault.events=[{kind:rank_crash,step:3,ranks:[5]}]"], "rank 5 does not exist (world_size=2"),
        (["fault=hang"], "fault kind 'hang' needs the watchdog: set resilience.hang_timeout_s > 0"),
        (["resilience.policy=retry"], "resilience.policy='retry' is not a policy; allowed: none, skip_step"),
        (["resilience=rollback"], "resilience.policy=rollback needs in-memory snapshots"),
        (
            ["resilience=rollback", "checkpoint=memory", "checkpoint.every_n_steps=25"],
            "checkpoint.every_n_steps=25 must be a multiple of checkpoint.memory_every_n_steps=10",
        ),
        (["resilience=shrink", "resilience.min_world_size=3"], "world_size=2 < resilience.min_world_size=3"),
        (["resilience.loss_spike_factor=0.5"], "resilience.loss_spike_factor=0.5 must be > 1 (or 0 = off)"),
        (["fault.mtbf_steps=-1"], "fault.mtbf_steps=-1.0 must be >= 0"),
    ],
)
def test_bad_fault_config_is_one_line(compose, overrides, fragment):
    with pytest.raises(ConfigError) as info:
        validate(load_run_config(compose(*overrides)))
    assert fragment in str(info.value) and "\n" not in str(info.value)


def test_a_bad_fault_kind_and_a_bad_layout_are_reported_together(compose):
    """The fault rules that need no layout run when the layout does not hold: one line names both problems
    (before, the fault kind was reported only once the layout was fixed); the rank rule waits for a layout."""
    with pytest.raises(ConfigError) as info:
        validate(
            load_run_config(
                compose(
                    "parallelism=tp",
                    "parallelism.tp_degree=3",
                    "fault.events=[{kind:nan_grud,step:3,ranks:[7]}]",
                )
            )
        )
    text = str(info.value)
    assert "tp_degree(3)" in text and "fault.events[0].kind='nan_grud' is not a fault kind" in text, text
    assert "rank 7 does not exist" not in text and "\n" not in text


def test_random_schedule_is_seeded_and_exponential(compose):
    run = load_run_config(
        compose(
            "fault.mtbf_steps=20",
            "fault.random_seed=7",
            "trainer.max_steps=20000",
            "fault.random_kinds=[rank_crash,nan_grad]",
        )
    )
    a, b = build_schedule(run, world_size=4), build_schedule(run, world_size=4)
    assert a == b and len(a) > 100
    steps = [e["step"] for e in a]
    assert steps == sorted(steps) and steps[-1] <= 20000
    gaps = [y - x for x, y in zip([0] + steps, steps)]
    assert sum(gaps) / len(gaps) == pytest.approx(20, rel=0.15)  # mean gap = MTBF (ceil adds < 1 step)
    assert {e["kind"] for e in a} == {"rank_crash", "nan_grad"} and {r for e in a for r in e["ranks"]} == {0, 1, 2, 3}
    other = load_run_config(compose("fault.mtbf_steps=20", "fault.random_seed=8", "trainer.max_steps=20000"))
    assert [e["step"] for e in build_schedule(other, world_size=4)] != steps


def test_fault_log_survives_and_lists_fired(tmp_path):
    log = FaultLog(tmp_path)
    log.append("injected", id="e0", kind="nan_grad", step=3, rank=1)
    log.append("injected", id="e1", kind="rank_crash", step=5, rank=0)
    with open(log.path, "a") as f:
        f.write('{"ev": "torn')  # a record cut by a crash mid-write is ignored
    assert FaultLog(tmp_path).fired_ids() == {"e0@1", "e1@0"}


def test_health_and_spike_statistics():
    h = gather_health(grad_norm=float("nan"), loss=2.0, busy_s=0.1, device=torch.device("cpu"))
    assert h.grad_nonfinite and h.nonfinite and not h.loss_nonfinite and h.grad_norm == 0.0
    assert StepHealth(False, False, 1.0, 2.0, [0.1, 0.5, 0.1]).straggler(2.0) == 1
    assert StepHealth(False, False, 1.0, 2.0, [0.1, 0.15]).straggler(2.0) is None
    assert StepHealth(False, False, 1.0, 2.0, [0.05, 0.55]).straggler(2.0) == 1  # 2 ranks: vs the other one
    m = RunningMean(beta=0.5, warmup=2)
    m.update(2.0)
    assert not m.is_spike(100.0, 3.0)  # not warmed up yet
    m.update(4.0)  # mean = 3
    assert m.mean == 3.0 and m.is_spike(9.1, 3.0) and not m.is_spike(8.9, 3.0) and not m.is_spike(1e9, 0.0)


def _rec(ev, t, **kw):
    return {"ev": ev, "t": float(t), **kw}


def test_accounting_of_a_crash_restart_and_a_rollback():
    recs = [_rec("driver_start", 0.0)]
    recs += [_rec("start", 1, launch=0, restart=0, step=0)]
    recs += [_rec("step", 1 + s, step=s, d=0.5) for s in range(1, 8)]
    recs += [_rec("injected", 8.2, id="e0", kind="rank_crash", step=8, rank=1)]
    recs += [_rec("start", 20, launch=0, restart=1, step=5)]  # resumed from step 5 after the crash in step 8
    recs += [_rec("step", 20 + s, step=s, d=0.5) for s in range(6, 11)]
    recs += [
        _rec("injected", 30.1, id="e1", kind="loss_spike", step=11, rank=1),
        _rec("detected", 30.5, detector="loss_spike", step=11, seg="0.1"),
        _rec("skipped", 30.5, step=11, rank=0),
        _rec("rollback", 30.6, from_step=11, to_step=10),
        _rec("step", 30.6, step=11, d=0.5, rolled_back=True),
    ]  # the timeline's record of the rolled-back step
    recs += [_rec("step", 31, step=11, d=0.5), _rec("step", 32, step=12, d=0.5), _rec("end", 32.5, step=12)]
    recs += [_rec("driver_end", 40.0)]
    f = recovery_figures(recs)
    assert f["fault/injected"] == 2 and f["fault/detected"] == 2  # the loss spike + the rank failure (seen at restart)
    assert f["recovery/restarts"] == 1 and f["recovery/rollbacks"] == 1
    assert f["recovery/recomputed_steps"] == (7 - 5) + (11 - 10)  # steps 6, 7 (8 never completed); 11 rolled back
    assert f["fault/detect_latency_steps"] == 0
    assert f["recovery/time_s"] == pytest.approx((28 - 8.2) + (31 - 30.1))  # to the end of step 8 again; of step 11
    assert f["goodput"] == pytest.approx(12 * 0.5 / 40.0)  # the last execution of each of the 12 steps, over 40 s
    assert math.isfinite(f["fault/detect_latency_s"])


def test_reported_grad_norm_is_the_value_a_skip_rests_on():
    """Issue 13 (3): rank 1's NaN is what the step logs, although rank 0's norm is finite; a finite step logs the mean."""
    h = StepHealth(True, False, 2.0, 1.0, [0.1, 0.1], grad_norms=[2.0, float("nan")])
    assert math.isnan(h.reported_grad_norm) and h.grad_norm == 2.0
    assert StepHealth(True, False, 0.0, 1.0, [0.1], grad_norms=[float("inf")]).reported_grad_norm == float("inf")
    assert StepHealth(False, False, 7.5, 1.0, [0.1, 0.1], grad_norms=[7.5, 7.5]).reported_grad_norm == 7.5
    g = gather_health(grad_norm=float("inf"), loss=2.0, busy_s=0.1, device=torch.device("cpu"))
    assert g.grad_norms == [float("inf")] and g.reported_grad_norm == float("inf") and g.grad_norm == 0.0


def _module_and_optimizer(compose, *overrides):
    """The LMModule's own AdamW + LambdaLR (configure_optimizers) over a small stand-in model."""
    from framework.base.registry import get_plugin_class
    from framework.rank.module import LMModule

    resolved = validate(load_run_config(compose("parallelism=single", *overrides)))
    module = LMModule(resolved, vocab_size=16, plugin=get_plugin_class("single")(resolved.run.parallelism))
    torch.manual_seed(0)
    module.model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 3))
    cfg = module.configure_optimizers()
    return module, cfg["optimizer"], cfg["lr_scheduler"]["scheduler"]


def _train(module, opt, sched, steps: int, dropped: set[int]) -> list[float]:
    """Steps 1..steps as Lightning runs them: the optimizer step with a closure (forward, backward, then the
    drop decision, as the fault guard takes it in on_before_optimizer_step) on odd steps, and without one after
    the backward (as DeepSpeed steps the optimizer it wraps) on even steps; then the scheduler hook.
    Returns the LR each step used."""
    from framework.rank.faults.audit import max_abs_diff

    lrs = []
    for step in range(1, steps + 1):
        lrs.append(opt.param_groups[0]["lr"])
        x = torch.randn(5, 4)
        before = {
            **{f"p{i}": p.detach().clone().double() for i, p in enumerate(module.model.parameters())},
            **{
                f"s{i}/{k}": v.detach().clone().double()
                for i, st in enumerate(opt.state.values())
                for k, v in st.items()
            },
        }

        def closure():
            loss = module.model(x).square().mean()
            loss.backward()
            module.step_state.drop_update = step in dropped
            return loss

        if step % 2:
            opt.step(closure=closure)
        else:
            closure()
            opt.step()
        module.lr_scheduler_step(sched)
        after = {
            **{f"p{i}": p.detach().clone().double() for i, p in enumerate(module.model.parameters())},
            **{
                f"s{i}/{k}": v.detach().clone().double()
                for i, st in enumerate(opt.state.values())
                for k, v in st.items()
            },
        }
        moved = max_abs_diff(before, after)
        assert (moved == 0.0) == (step in dropped), f"step {step}: max |after - before| = {moved}"
        opt.zero_grad()
        module.step_state.drop_update = False
    return lrs


def test_a_dropped_update_changes_nothing_and_the_lr_schedule_counts_applied_updates(compose):
    """Issue 13 (1): with steps 3 and 4 dropped, weights and AdamW state do not move in those steps (the module's
    optimizer pre-hook; step 3 with Lightning's closure, step 4 without), and the LR of every step is the fault-free schedule shifted by the skips before it:
    lr(s) = schedule(s - 1 - skips before s) (warm-up over 4 updates, peak 1e-3): 2.5e-4, 5e-4, 7.5e-4, 7.5e-4,
    7.5e-4, 1e-3 in steps 1-6 (fault-free: 2.5e-4, 5e-4, 7.5e-4, 1e-3, ...)."""
    from framework.rank.module import warmup_cosine

    module, opt, sched = _module_and_optimizer(compose, "optim.warmup_steps=4", "optim.lr=1e-3", "trainer.max_steps=10")
    lrs = _train(module, opt, sched, 8, dropped={3, 4})
    ref_module, ref_opt, ref_sched = _module_and_optimizer(
        compose, "optim.warmup_steps=4", "optim.lr=1e-3", "trainer.max_steps=10"
    )
    ref = _train(ref_module, ref_opt, ref_sched, 8, dropped=set())
    schedule = [1e-3 * warmup_cosine(u, warmup_steps=4, max_steps=10, min_lr_ratio=0.1) for u in range(8)]
    assert ref == pytest.approx(schedule, rel=1e-12)
    skips_before = [sum(1 for d in (3, 4) if d < s) for s in range(1, 9)]
    assert lrs == [ref[s - 1 - k] for s, k in zip(range(1, 9), skips_before)]
    assert lrs[:6] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 7.5e-4, 7.5e-4, 1e-3])
    assert sched.last_epoch == 6  # applied updates: 8 attempted - 2 dropped
    assert all(int(st["step"]) == 6 for st in opt.state.values())  # AdamW counted 6 updates too


def test_a_dropped_step_leaves_the_lr_the_schedule_set(compose):
    """A dropped step undoes in-step LR scaling (the post-shrink re-warm-up multiplies the LR before the step):
    the next step starts from the schedule's LR, not from the scaled one (no compounding)."""
    module, opt, sched = _module_and_optimizer(compose, "optim.warmup_steps=0", "optim.lr=1e-3", "trainer.max_steps=10")
    module.model(torch.randn(5, 4)).sum().backward()
    opt.param_groups[0]["lr"] *= 0.5
    module.step_state.drop_update = True
    opt.step()
    module.lr_scheduler_step(sched)
    assert opt.param_groups[0]["lr"] == sched.get_last_lr()[0] == 1e-3 and sched.last_epoch == 0


def test_skip_audit_sees_any_change_of_the_state():
    from framework.rank.faults.audit import max_abs_diff

    a = {"w": torch.zeros(3, dtype=torch.float64), "m": torch.tensor([1.0, float("nan")], dtype=torch.float64)}
    assert max_abs_diff(a, {k: v.clone() for k, v in a.items()}) == 0.0
    assert max_abs_diff(a, {**a, "w": torch.tensor([0.0, 0.25, 0.0], dtype=torch.float64)}) == 0.25
    assert max_abs_diff(a, {**a, "m": torch.tensor([1.0, 2.0], dtype=torch.float64)}) == math.inf  # NaN replaced
    assert max_abs_diff(a, {**a, "exp_avg": torch.zeros(3, dtype=torch.float64)}) == math.inf  # AdamW state created
    assert max_abs_diff({}, {}) == 0.0
    from framework.rank.faults.audit import max_abs_diff_by_part

    b = {
        "model/w": torch.zeros(2, dtype=torch.float64),
        "optimizer0/state/0/step": torch.tensor(2.0, dtype=torch.float64),
    }
    assert max_abs_diff_by_part(b, {**b, "optimizer0/state/0/step": torch.tensor(3.0, dtype=torch.float64)}) == {
        "model": 0.0,
        "optimizer0": 1.0,
    }
