"""One translation between a run and the planner's layout: layout -> overrides -> resolved run -> layout, every plugin."""

from __future__ import annotations

import pytest

from framework.base.config.schema import ModelConfig
from framework.base.cost.layout import PlanLayout
from framework.base.cost.shape import ModelShape
from framework.base.load import load_run_config
from framework.base.registry import get_plugin_class
from framework.driver.cli import CONF_DIR
from framework.driver.plan.runs import default_run_with, plan_layout_of, trainlab_overrides
from framework.driver.plan.search import SearchSpace, enumerate_layouts
from framework.driver.validate import validate

PRESETS = sorted(p.stem for p in (CONF_DIR / "parallelism").glob("*.yaml"))
PER_PRESET = 3  # layouts round-tripped per preset (spread over the enumeration; each composes a config)


def _plugin(run):
    return get_plugin_class(run.parallelism.name)(run.parallelism)


def _round_trip(compose, lay: PlanLayout, run_with: dict) -> tuple[PlanLayout, object]:
    over, notes = trainlab_overrides(lay, model="gpt_tiny", seq_len=128, nodes=1, run_with=run_with)
    assert notes == [], notes
    resolved = validate(load_run_config(compose(*over.split(), "checkpoint=none")))
    plugin = _plugin(resolved.run)
    return plan_layout_of(
        resolved, plugin.zero_stage, run_with=run_with, state_accounting=lay.state_accounting
    ), resolved


@pytest.mark.parametrize("preset", PRESETS)
def test_layout_overrides_run_layout_round_trip(compose, preset):
    """Every layout the planner enumerates that ``preset`` runs (fp32 and bf16, with and without full recompute)
    comes back equal through its overrides, the composed and validated run, and :func:`plan_layout_of`."""
    plugin = _plugin(load_run_config(compose(f"parallelism={preset}")))
    axes = plugin.capabilities.mesh_axes
    run_with = default_run_with()
    if "tp" in axes or "pp" in axes:
        run_with["model_parallel"] = f"parallelism={preset}"
        worlds = (2, 4)
    elif (
        not axes
    ):  # one rank: the planner runs a 1-rank layout with its stage-0 preset (the single plugin has no nnodes)
        run = validate(load_run_config(compose(f"parallelism={preset}", "checkpoint=none")))
        lay = plan_layout_of(run, plugin.zero_stage, run_with=run_with)
        back, _ = _round_trip(compose, lay, run_with)
        assert back == lay and lay.world_size == 1
        return
    else:
        run_with["data_parallel"][plugin.zero_stage] = f"parallelism={preset}"
        worlds = (2, 4)
    shape = ModelShape.from_model_config(
        ModelConfig(**dict(compose("model=gpt_tiny").model)), seq_len=128, vocab_size=512
    )
    candidates = []
    for world in worlds:
        for precision in ("fp32", "bf16"):
            space = SearchSpace(micro_batch_sizes=(1, 2, 4), recompute=("none", "full"), precision=precision)
            for lay in enumerate_layouts(shape, world, 16, world, space, {}):
                over, notes = trainlab_overrides(lay, model="gpt_tiny", seq_len=128, nodes=1, run_with=run_with)
                if not notes and f"parallelism={preset}" in over.split():
                    candidates.append(lay)
    assert candidates, f"no planner layout runs with parallelism={preset}"
    step = max(1, len(candidates) // PER_PRESET)
    for lay in candidates[::step][:PER_PRESET]:
        back, resolved = _round_trip(compose, lay, run_with)
        assert back == lay, f"{lay.describe()} came back as {back.describe()}"
        assert _plugin(resolved.run).name == plugin.name


def test_a_run_gives_its_plugins_declared_zero_stage(compose):
    """The ZeRO stage of a run's layout is what its plugin declares, not a table of names."""
    run_with = default_run_with()
    got = {}
    for preset in ("ddp", "zero1", "zero2", "zero3", "fsdp"):
        resolved = validate(
            load_run_config(compose(f"parallelism={preset}", "parallelism.world_size=2", "checkpoint=none"))
        )
        got[preset] = plan_layout_of(resolved, _plugin(resolved.run).zero_stage, run_with=run_with).zero_stage
    assert got == {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3, "fsdp": 3}
    one_rank = validate(load_run_config(compose("parallelism=fsdp", "parallelism.world_size=1", "checkpoint=none")))
    assert plan_layout_of(one_rank, 3, run_with=run_with).zero_stage == 0  # a 1-rank dp group shards nothing


def test_the_declared_zero_stage_is_a_derived_mlflow_param(compose):
    from framework.base.tracking import derived_params

    class Model:  # derived_params reads the model's size only
        vocab_size = 512

        def num_params(self, **_):
            return 1

        def num_flops_params(self):
            return 1

    for preset, stage in (("zero2", 2), ("fsdp", 3), ("ddp", 0)):
        resolved = validate(
            load_run_config(compose(f"parallelism={preset}", "parallelism.world_size=2", "checkpoint=none"))
        )
        assert derived_params(resolved, Model())["derived.zero_stage"] == stage


def test_the_planners_node_placement_is_the_runs():
    """PlanLayout's closed form for a group crossing nodes (rank order tp, dp, pp) agrees with the run's
    ParallelLayout, which enumerates the ranks, on every layout of up to 32 ranks on nodes of 1-8."""
    from framework.base.layout import ParallelLayout

    checked = 0
    for gpn in (1, 2, 4, 8):
        for world in (gpn, 2 * gpn, 4 * gpn):
            for tp in (t for t in (1, 2, 4, 8) if gpn % t == 0 and world % t == 0):
                for pp in (p for p in (1, 2, 4) if world % (tp * p) == 0):
                    dp = world // (tp * pp)
                    run = ParallelLayout(dp=dp, tp=tp, pp=pp, nnodes=world // gpn)
                    plan = PlanLayout(dp=dp, tp=tp, pp=pp, micro_batch_size=1, global_batch_size=dp)
                    for axis in ("tp", "dp", "pp"):
                        assert plan.group_inter_node(axis, gpn) == (
                            run.degree(axis) > 1 and run.nodes_per_group(axis) > 1
                        ), (run.describe(), gpn, axis)
                        checked += 1
    assert checked > 50
