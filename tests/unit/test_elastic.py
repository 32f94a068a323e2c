"""Elastic shrink (framework/driver/faults/elastic.py): the target world size, the run resolved there at the
same global batch, the one-line refusal when no layout keeps it, the LR re-warm-up and the MLflow tags."""

from __future__ import annotations

import pytest

from framework.base.config.schema import ConfigError
from framework.driver.faults.elastic import check_first_shrink, resolve_shrunk, shrink_tags, shrink_targets
from framework.driver.validate import load_run_config, validate
from framework.rank.faults.guard import rewarmup_factor


def _resolved(compose, *overrides):
    """The driver's checks before any rank starts: the config's rules, then whether its first shrink can keep the batch."""
    resolved = validate(
        load_run_config(compose("checkpoint=none", "tracking=none", "parallelism=ddp", "resilience=shrink", *overrides))
    )
    check_first_shrink(resolved)
    return resolved


def test_shrink_targets_a_fraction_a_size_or_one_less():
    assert shrink_targets(1024, 0.75, 1)[0] == 768  # the guide's case: a quarter of the GPUs lost
    assert shrink_targets(4, 0.75, 1) == [3, 2, 1]
    assert shrink_targets(100, 0.29, 1)[0] == 29  # 100 * 0.29 = 28.999999999999996 in floating point
    assert shrink_targets(4, None, 2) == [3, 2]
    assert shrink_targets(8, 2, 1) == [2, 1]
    assert shrink_targets(3, 3, 1) == [2, 1]  # a second shrink from the target size: below it
    assert shrink_targets(4, 0.75, 4) == []


def test_a_shrink_to_three_quarters_keeps_the_global_batch(compose):
    resolved = _resolved(
        compose,
        "parallelism.world_size=4",
        "trainer.micro_batch_size=1",
        "trainer.global_batch_size=12",
        "trainer.grad_accum_steps=null",
        "resilience.shrink_to=0.75",
    )
    assert (resolved.layout.dp, resolved.grad_accum_steps) == (4, 3)
    shrunk = resolve_shrunk(resolved.run, resolved.world_size)
    assert (shrunk.world_size, shrunk.layout.dp, shrunk.grad_accum_steps) == (3, 3, 4)
    assert (shrunk.global_batch_size, shrunk.micro_batch_size) == (12, 1)
    # a config that gives micro-batch and accumulation (no global batch) keeps its global batch too
    by_accum = _resolved(
        compose,
        "parallelism.world_size=4",
        "trainer.micro_batch_size=1",
        "trainer.global_batch_size=null",
        "trainer.grad_accum_steps=3",
        "resilience.shrink_to=3",
    )
    again = resolve_shrunk(by_accum.run, 4)
    assert (again.world_size, again.global_batch_size, again.grad_accum_steps) == (3, 12, 4)


def test_a_shrink_that_scales_the_batch_keeps_the_accumulation_and_scales_the_lr(compose):
    resolved = _resolved(
        compose,
        "parallelism.world_size=4",
        "trainer.micro_batch_size=1",
        "trainer.global_batch_size=12",
        "trainer.grad_accum_steps=null",
        "resilience.shrink_to=0.75",
        "resilience.shrink_batch=scale",
        "optim.lr=0.004",
    )
    shrunk = resolve_shrunk(resolved.run, resolved.world_size)
    assert (shrunk.world_size, shrunk.grad_accum_steps, shrunk.global_batch_size, shrunk.micro_batch_size) == (
        3,
        3,
        9,
        1,
    )
    assert shrunk.run.optim.lr == pytest.approx(0.003)
    # a batch 8 that 3 ranks cannot keep is no obstacle when the batch shrinks with the ranks
    odd = _resolved(
        compose,
        "parallelism.world_size=4",
        "trainer.micro_batch_size=1",
        "trainer.global_batch_size=8",
        "trainer.grad_accum_steps=null",
        "resilience.shrink_to=0.75",
        "resilience.shrink_batch=scale",
    )
    assert resolve_shrunk(odd.run, 4).global_batch_size == 6
    with pytest.raises(ConfigError, match="resilience.shrink_batch='half' is not allowed; allowed: keep, scale"):
        _resolved(compose, "resilience.shrink_batch=half")


def test_no_layout_that_keeps_the_global_batch_is_one_line_before_any_rank(compose):
    # 8 sequences of 1 cannot be split over 3 ranks, and min_world_size forbids 2
    with pytest.raises(ConfigError) as err:
        _resolved(
            compose,
            "parallelism.world_size=4",
            "trainer.micro_batch_size=1",
            "trainer.global_batch_size=8",
            "trainer.grad_accum_steps=null",
            "resilience.shrink_to=0.75",
            "resilience.min_world_size=3",
        )
    msg = str(err.value)
    assert "\n" not in msg
    assert msg == (
        "resilience.policy=shrink: no smaller layout keeps global_batch_size=8 at micro_batch_size=1 (from"
        " world_size 4, resilience.shrink_to=0.75, resilience.min_world_size=3); dp degrees tried: 3 (each"
        " must divide global_batch_size / micro_batch_size = 8)"
    )
    with pytest.raises(
        ConfigError,
        match=r"dp degrees tried: 5, 4 \(each must divide global_batch_size / "
        r"micro_batch_size = 6\)",
    ):  # one rank less at a time (shrink_to null)
        _resolved(
            compose,
            "parallelism.world_size=6",
            "trainer.micro_batch_size=2",
            "trainer.global_batch_size=12",
            "trainer.grad_accum_steps=null",
            "resilience.min_world_size=4",
        )


@pytest.mark.parametrize(
    "value, fragment",
    [
        ("1.5", "resilience.shrink_to=1.5 is not a target; allowed: null (one rank less), a fraction in (0, 1)"),
        ("0", "resilience.shrink_to=0.0 is not a target"),
        ("4", "resilience.shrink_to=4 ranks is not below world_size=4"),
    ],
)
def test_bad_shrink_targets_are_one_line(compose, value, fragment):
    with pytest.raises(ConfigError) as err:
        _resolved(compose, "parallelism.world_size=4", "trainer.micro_batch_size=1", f"resilience.shrink_to={value}")
    assert fragment in str(err.value) and "\n" not in str(err.value)


def test_rewarmup_ramps_the_scheduled_lr_after_the_resumed_step():
    # resumed from step 3 after a shrink, 3 re-warm-up steps: steps 4, 5, 6 at 1/3, 2/3, 3/3 of the schedule
    got = [rewarmup_factor(global_step, 3, 3) for global_step in range(2, 8)]
    assert got == [1.0, 1 / 3, 2 / 3, 1.0, 1.0, 1.0]
    assert rewarmup_factor(3, None, 3) == 1.0 and rewarmup_factor(3, 3, 0) == 1.0


def test_shrink_tags_name_the_launch_in_force(compose):
    first = _resolved(
        compose,
        "parallelism.world_size=4",
        "trainer.micro_batch_size=1",
        "trainer.global_batch_size=12",
        "trainer.grad_accum_steps=null",
        "resilience.shrink_to=0.75",
    )
    second = resolve_shrunk(first.run, 4)
    third = resolve_shrunk(second.run, 3)
    assert shrink_tags([]) == {}
    tags = shrink_tags([(first, second, 3), (second, third, 7)])
    assert tags == {
        "world_size": "2",
        "layout": "dp2-tp1-pp1",
        "elastic.shrinks": "2",
        "elastic.history": "step 3: 4 -> 3 ranks, dp 4 -> 3, grad_accum_steps 3 -> 4; step 7: 3 -> 2 ranks,"
        " dp 3 -> 2, grad_accum_steps 4 -> 6",
    }


def test_a_checkpoint_resumed_at_another_lr_goes_on_at_the_new_one():
    """``resilience.shrink_batch=scale`` sets ``optim.lr`` x 3/4; the optimizer and scheduler states restored from
    the checkpoint would otherwise bring the old LR back (Lightning loads them after ``configure_optimizers``)."""
    import torch

    from framework.rank.module import rescale_lr_state, warmup_cosine

    def make(lr):
        w = torch.nn.Parameter(torch.ones(3))
        opt = torch.optim.AdamW([{"params": [w]}, {"params": [torch.nn.Parameter(torch.ones(1))]}], lr=lr)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: warmup_cosine(s, warmup_steps=2, max_steps=10, min_lr_ratio=0.1)
        )
        return w, opt, sched

    w, opt, sched = make(4e-3)
    for _ in range(4):
        w.sum().backward()
        opt.step()
        sched.step()
    ckpt = {"optimizer_states": [opt.state_dict()], "lr_schedulers": [sched.state_dict()]}
    saved_lr = opt.param_groups[0]["lr"]
    assert rescale_lr_state(ckpt, 3e-3) == pytest.approx(0.75)
    _, opt2, sched2 = make(3e-3)
    opt2.load_state_dict(ckpt["optimizer_states"][0])
    sched2.load_state_dict(ckpt["lr_schedulers"][0])
    assert [g["lr"] for g in opt2.param_groups] == pytest.approx([0.75 * saved_lr] * 2)
    opt2.step()
    sched2.step()
    assert opt2.param_groups[1]["lr"] == pytest.approx(
        3e-3 * warmup_cosine(5, warmup_steps=2, max_steps=10, min_lr_ratio=0.1)
    )
    same = {"optimizer_states": [opt.state_dict()], "lr_schedulers": [sched.state_dict()]}
    assert rescale_lr_state(same, 4e-3) == 1.0 and same["lr_schedulers"][0]["base_lrs"] == [4e-3, 4e-3]
