"""One model-state formula: the planner's breakdown and every plugin's cost function are the same
function (framework.base.cost.memory.model_states_per_rank), equal in fp32 and in mixed precision."""

import math
from types import SimpleNamespace

import pytest

from framework.base.cost.comm import ModelStats
from framework.base.cost.estimate import memory_per_rank
from framework.base.cost.layout import PlanLayout
from framework.base.cost.memory import (
    ACCOUNTINGS,
    adamw_fp32_local_states_bytes,
    fsdp_model_states_bytes,
    model_states_per_rank,
    precision_of,
    replicated_adamw_model_states_bytes,
    stage_params,
)
from framework.base.cost.shape import ModelShape
from plugins.deepspeed import DeepSpeedConfig
from plugins.deepspeed.cost import zero_model_states_bytes

SHAPE = ModelShape(n_layer=2, d_model=64, n_head=4, vocab_size=256, seq_len=32)


def _stats(bytes_per_param: int) -> ModelStats:
    return ModelStats(
        num_params=SHAPE.num_params(), num_param_tensors=7, param_bytes=bytes_per_param, grad_bytes=bytes_per_param
    )


def test_the_planner_holds_every_parameter_at_tp1_pp1():
    assert stage_params(SHAPE, tp=1, pp=1, stage=0) == SHAPE.num_params()


@pytest.mark.parametrize("bytes_per_param,precision", [(4, "fp32"), (2, "bf16")])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("accum", [1, 4])
def test_deepspeed_plugin_equals_the_planner(bytes_per_param, precision, stage, accum):
    """The DeepSpeed plugin's figure == the planner's memory for the same layout in DeepSpeed's accounting."""
    dp = 4
    lay = PlanLayout(
        dp=dp,
        tp=1,
        pp=1,
        micro_batch_size=1,
        global_batch_size=dp * accum,
        zero_stage=stage,
        precision=precision,
        state_accounting="master_copy",
    )
    planner, _ = memory_per_rank(SHAPE, lay)
    plugin = zero_model_states_bytes(
        _stats(bytes_per_param),
        DeepSpeedConfig(zero_stage=stage),
        SimpleNamespace(layout=SimpleNamespace(dp=dp), grad_accum_steps=accum),
    )
    assert plugin == int(planner.total)


@pytest.mark.parametrize("bytes_per_param,precision", [(4, "fp32"), (2, "bf16")])
def test_ddp_and_fsdp_plugins_equal_the_planner(bytes_per_param, precision):
    shapes = ((64, 32), (32,), (128, 32))  # every dim 0 divides by 4: no FSDP padding
    psi = sum(math.prod(s) for s in shapes)
    stats = ModelStats(
        num_params=psi,
        num_param_tensors=3,
        param_bytes=bytes_per_param,
        grad_bytes=bytes_per_param,
        param_shapes=shapes,
    )
    assert (
        replicated_adamw_model_states_bytes(stats)
        == model_states_per_rank(psi, dp=4, zero_stage=0, precision=precision).total + 4 * 3
    )
    assert (
        fsdp_model_states_bytes(stats, dp_degree=4)
        == model_states_per_rank(psi, dp=4, zero_stage=3, precision=precision).total + 4 * 3
    )
    assert (
        adamw_fp32_local_states_bytes(list(shapes))
        == model_states_per_rank(psi, dp=1, zero_stage=0, precision="fp32").total + 4 * 3
    )


def test_the_issue_figures_by_accounting():
    """1B parameters, dp 8, fp32 (issue 25): the paper counts K = 8 (AdamW moments), DeepSpeed K = 12
    (an fp32 master copy even of fp32 weights); ZeRO-1 with accumulation keeps full gradients in DeepSpeed."""
    psi, n = 1e9, 8
    paper = {z: model_states_per_rank(psi, dp=n, zero_stage=z, precision="fp32").total for z in (1, 2, 3)}
    ds = {
        z: model_states_per_rank(
            psi, dp=n, zero_stage=z, precision="fp32", accounting="master_copy", grad_accum_steps=4
        ).total
        for z in (1, 2, 3)
    }
    assert paper == pytest.approx({1: 9.0e9, 2: 5.5e9, 3: 2.0e9})
    assert ds == pytest.approx({1: 9.5e9, 2: 6.0e9, 3: 2.5e9})


def test_mixed_precision_as_deepspeed_allocates_it():
    """bf16: DeepSpeed's fp32 master is K = 12 whatever the weights' bytes (the old plugin formula took the
    master at the parameters' 2 bytes: ZeRO-2 8Ψ at dp 2 instead of 9Ψ; measured 9.1Ψ on 2 CPU ranks);
    ZeRO-2 is the paper's 2Ψ + 14Ψ/N; ZeRO-1 keeps full bf16 gradients while accumulating."""
    psi, n = 1e9, 8
    paper = model_states_per_rank(psi, dp=n, zero_stage=2, precision="bf16")
    ds = model_states_per_rank(psi, dp=n, zero_stage=2, precision="bf16", accounting="master_copy")
    assert paper.total == pytest.approx(2 * psi + 14 * psi / n) and ds.total == pytest.approx(paper.total)
    z1 = model_states_per_rank(psi, dp=n, zero_stage=1, precision="bf16", accounting="master_copy", grad_accum_steps=2)
    assert z1.total == pytest.approx(2 * psi + 2 * psi + 12 * psi / n)
    z1_single = model_states_per_rank(psi, dp=n, zero_stage=1, precision="bf16", accounting="master_copy")
    assert z1_single.total == pytest.approx(2 * psi + 14 * psi / n)


def test_bad_accounting_and_precision_are_one_line():
    with pytest.raises(ValueError, match="accounting='zero'.*allowed: paper, master_copy"):
        model_states_per_rank(1e6, dp=2, zero_stage=1, precision="bf16", accounting="zero")
    with pytest.raises(ValueError, match="param_bytes=8"):
        precision_of(ModelStats(num_params=10, num_param_tensors=1, param_bytes=8, grad_bytes=8))
    assert ACCOUNTINGS == ("paper", "master_copy")
