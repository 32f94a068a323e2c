"""framework.base.cost: closed forms (ZeRO, Korthikanti Table 2, Narayanan bubble, nccl-tests factors), the
plugins' figures vs the planner's breakdown, the step-time and what-if arithmetic, cluster files and the planner's
one-line errors."""

from __future__ import annotations

import json
import math

import pytest
import yaml

from framework.base.config.schema import ModelConfig
from framework.base.cost import activations as A
from framework.base.cost.bubble import microbatches_in_flight, pp_bubble_fraction
from framework.base.cost.collectives import layout_collectives
from framework.base.cost.comm import (
    ZERO3_COLLECTIVES,
    ModelStats,
    ddp_comm_volume,
    fsdp_comm_volume,
    tp_payload_bytes_per_microbatch,
)
from framework.base.cost.estimate import estimate
from framework.base.cost.hardware import REQUIRED, ClusterError, Link, cluster_from_dict
from framework.base.cost.layout import PlanLayout
from framework.base.cost.memory import (
    ZERO_STAGES,
    fsdp_model_states_bytes,
    model_states_per_rank,
    replicated_adamw_model_states_bytes,
    stage_params,
)
from framework.base.cost.shape import ModelShape
from framework.base.cost.steptime import (
    MeasuredBreakdown,
    MeasuredCollective,
    StepTimeParams,
    collective_time,
    step_time,
    whatif,
)
from framework.base.metrics.local_cpu import cluster_of
from framework.driver.cli import CONF_DIR
from framework.driver.plan.search import PlanError, search

GPT3 = ModelShape(n_layer=96, d_model=12288, n_head=96, vocab_size=51200, seq_len=2048, max_seq_len=2048)


def _cluster(**kw):
    raw = yaml.safe_load((CONF_DIR / "cluster" / "h100_sxm.yaml").read_text())
    raw.update(kw)
    return cluster_from_dict(raw)


@pytest.mark.parametrize("cfg", [dict(), dict(n_layer=3, n_head=2, d_model=64, d_ff=200, bias=False, max_seq_len=96)])
def test_shape_counts_equal_the_gpt(cfg):
    from framework.base.model import GPT

    mc = ModelConfig(**cfg)
    model = GPT(mc, vocab_size=300)
    shape = ModelShape.from_model_config(mc, seq_len=64, vocab_size=300)
    assert shape.num_params() == model.num_params(exclude_position_embedding=False)
    assert shape.num_flops_params() == model.num_flops_params()
    assert stage_params(shape, tp=1, pp=1, stage=0) == shape.num_params()


def test_presets_have_their_published_sizes():
    sizes = {}
    for name in ("gpt3_175b", "gpt_1t", "llama3_70b", "llama3_405b"):
        mc = ModelConfig(**yaml.safe_load((CONF_DIR / "model" / f"{name}.yaml").read_text()))
        sizes[name] = ModelShape.from_model_config(mc, seq_len=2048).num_params() / 1e9
    assert sizes["gpt3_175b"] == pytest.approx(175, rel=0.01)  # Brown et al. 2020
    assert sizes["gpt_1t"] == pytest.approx(1008.0, rel=0.001)  # Narayanan et al. 2021 Table 1
    assert sizes["llama3_70b"] == pytest.approx(70.6, rel=0.005)
    assert sizes["llama3_405b"] == pytest.approx(405.9, rel=0.005)


def test_zero_paper_table_is_reproduced():
    """ZeRO Fig. 1 / Table 1: Ψ = 7.5B, N_d = 64, K = 12: 120, 31.4, 16.6, 1.88 GB."""
    psi, n = 7.5e9, 64
    got = [model_states_per_rank(psi, dp=n, zero_stage=z, precision="bf16").total / 1e9 for z in ZERO_STAGES]
    assert got == pytest.approx([120, 31.4, 16.6, 1.875], abs=0.05)


def test_plugin_figures_equal_the_planner_breakdown():
    shapes = ((64, 32), (32,), (128, 32))  # every dim 0 divides by 4: no FSDP padding
    stats = ModelStats(num_params=sum(math.prod(s) for s in shapes), num_param_tensors=3, param_shapes=shapes)
    assert (
        replicated_adamw_model_states_bytes(stats)
        == model_states_per_rank(stats.num_params, dp=4, zero_stage=0, precision="fp32").total + 4 * 3
    )
    assert (
        fsdp_model_states_bytes(stats, dp_degree=4)
        == model_states_per_rank(stats.num_params, dp=4, zero_stage=3, precision="fp32").total + 4 * 3
    )


@pytest.mark.parametrize("bad", [4, -1, "zero1", "1", True, 1.0])
def test_zero_stage_must_be_an_int_0_to_3(bad):
    with pytest.raises(ValueError, match=r"^zero_stage=.* is not allowed; allowed: 0, 1, 2, 3$"):
        model_states_per_rank(1e6, dp=2, zero_stage=bad, precision="bf16")
    with pytest.raises(ValueError, match=r"^zero_stage=.* is not allowed; allowed: 0, 1, 2, 3$"):
        PlanLayout(dp=2, tp=1, pp=1, micro_batch_size=1, global_batch_size=2, zero_stage=bad)


def test_zero_stage_label_and_collectives():
    """The label keeps the names of experiments/cluster_layout/results.md; only stage 3 runs the per-micro-batch
    gathers whose exposed time step_time reports as ``zero3_exposed``; stages 1-2 the step's parameter all-gather."""
    sh, c = _gpt_table2_shape(), _cluster()
    names, exposed = {}, {}
    for z in ZERO_STAGES:
        lay = PlanLayout(dp=4, tp=1, pp=1, micro_batch_size=1, global_batch_size=8, zero_stage=z)
        assert lay.describe() == f"tp1 pp1 dp4 {('none', 'zero1', 'zero2', 'zero3')[z]} b1 rc=none"
        names[z] = [c.name for c in layout_collectives(sh, lay, 8)]
        exposed[z] = step_time(sh, lay, c).zero3_exposed
    assert names == {0: ["dp_grad"], 1: ["dp_grad", "dp_param"], 2: ["dp_grad", "dp_param"], 3: list(ZERO3_COLLECTIVES)}
    assert exposed[0] == exposed[1] == exposed[2] == 0 < exposed[3]


def _gpt_table2_shape(s=2048, h=1024, a=16):
    return ModelShape(n_layer=4, d_model=h, n_head=a, vocab_size=1000, seq_len=s)


@pytest.mark.parametrize("t", [1, 2, 8])
def test_korthikanti_table2(t):
    sh = _gpt_table2_shape()
    s, b, h, a = sh.seq_len, 2, sh.d_model, sh.n_head
    f = lambda **kw: A.activation_bytes_per_layer(sh, micro_batch_size=b, tp=t, **kw)  # noqa: E731
    assert f() == pytest.approx(s * b * h * (10 + 24 / t + 5 * a * s / (h * t)))
    assert f(sequence_parallel=True) == pytest.approx(s * b * h / t * (34 + 5 * a * s / h))
    assert f(sequence_parallel=True, recompute="selective") == pytest.approx(34 * s * b * h / t)
    assert f(recompute="full") == pytest.approx(2 * s * b * h)
    if t == 1:
        assert f() == pytest.approx(s * b * h * (34 + 5 * a * s / h))


def test_bubble_and_microbatches_in_flight():
    assert pp_bubble_fraction(pp=4, n_microbatches=8) == pytest.approx(3 / 11)
    assert pp_bubble_fraction(pp=4, n_microbatches=8, virtual_stages=2) == pytest.approx(3 / 19)
    assert microbatches_in_flight(schedule="1F1B", pp=4, n_microbatches=8) == 4
    assert microbatches_in_flight(schedule="1F1B", pp=4, n_microbatches=2) == 2
    assert microbatches_in_flight(schedule="GPipe", pp=4, n_microbatches=8) == 8
    assert microbatches_in_flight(
        schedule="Interleaved1F1B", pp=4, n_microbatches=8, virtual_stages=2
    ) == pytest.approx(4 * (1 + 3 / 8))


def test_planner_collectives_equal_the_plugins_closed_forms():
    sh = _gpt_table2_shape(s=128, h=64, a=4)
    lay = PlanLayout(dp=1, tp=2, pp=1, micro_batch_size=2, global_batch_size=8, precision="fp32")
    tp = sum(c.payload_bytes * c.calls for c in layout_collectives(sh, lay, 8) if c.group == "tp")
    ref = tp_payload_bytes_per_microbatch(
        micro_batch_size=2, seq_len=128, d_model=64, n_layer=4, tp=2, sequence_parallel=False
    )
    assert tp == ref["allreduce"] * lay.n_microbatches
    psi = sh.num_params()
    stats = ModelStats(num_params=psi, num_param_tensors=1)
    ddp = PlanLayout(dp=4, tp=1, pp=1, micro_batch_size=1, global_batch_size=8, precision="fp32")
    (c,) = layout_collectives(sh, ddp, 8)
    assert (c.kind, c.payload_bytes * c.calls) == ("allreduce", ddp_comm_volume(stats, 4).payload_bytes["allreduce"])
    z3 = PlanLayout(dp=4, tp=1, pp=1, micro_batch_size=1, global_batch_size=8, zero_stage=3, precision="fp32")
    got = {}
    for c in layout_collectives(sh, z3, 8):
        got[c.kind] = got.get(c.kind, 0) + c.payload_bytes * c.calls
    ref = fsdp_comm_volume(stats, dp_degree=4, grad_accum_steps=2, reshard_after_forward=True).payload_bytes
    # FSDP pads Ψ to a multiple of dp (flat tensor here: < 4 elements): equal within that padding
    assert got["allgather"] == pytest.approx(ref["allgather"], abs=2 * 2 * 4 * 4) and got[
        "reduce_scatter"
    ] == pytest.approx(ref["reduce_scatter"], abs=2 * 4 * 4)


def test_alpha_beta_collective_time():
    from framework.base.cost.collectives import Collective

    c = Collective("dp_grad", "allreduce", "dp", 8, True, 1e9, 1, False)
    link = Link(alpha_s=1e-5, bandwidth=50e9)
    assert collective_time(c, link) == pytest.approx(1e-5 * 14 + 2 * 7 / 8 * 1e9 / 50e9)
    assert collective_time(c, link, algorithm="tree") == pytest.approx(1e-5 * 6 + 2 * 7 / 8 * 1e9 / 50e9)


def test_step_time_pipeline_bubble_matches_the_schedule():
    fast = _cluster(nvlink_bandwidth=1e30, nic_bandwidth=1e30, nvlink_alpha_s=0, nic_alpha_s=0)
    lay = PlanLayout(dp=1, tp=1, pp=4, micro_batch_size=1, global_batch_size=8)
    st = step_time(GPT3, lay, fast)
    assert st.bubble / (st.forward + st.backward) == pytest.approx(3 / 8)
    single = step_time(GPT3, PlanLayout(dp=1, tp=1, pp=1, micro_batch_size=1, global_batch_size=8), fast)
    assert st.forward == pytest.approx(single.forward / 4)  # 96 layers split evenly over 4 stages
    assert single.total == pytest.approx(single.forward + single.backward + single.optimizer)


def test_step_overhead_adds_once_and_a_replicated_head_adds_its_flops_on_each_tp_rank():
    fast = _cluster(nvlink_bandwidth=1e30, nic_bandwidth=1e30, nvlink_alpha_s=0, nic_alpha_s=0)
    tp2 = PlanLayout(dp=1, tp=2, pp=1, micro_batch_size=2, global_batch_size=4)
    base = step_time(GPT3, tp2, fast)
    assert step_time(GPT3, tp2, fast, StepTimeParams(step_overhead_s=0.25)).total == pytest.approx(base.total + 0.25)
    whole = step_time(GPT3, tp2, fast, StepTimeParams(replicated_head=True))
    tokens = tp2.global_batch_size * GPT3.seq_len
    head_flops = 6 * GPT3.d_model * GPT3.vocab_size * tokens  # forward 2hV + backward 4hV per token
    extra = (whole.forward + whole.backward) - (base.forward + base.backward)
    assert extra == pytest.approx(head_flops / 2 / fast.achievable_flops)  # the half of the head the other rank did
    tp1 = PlanLayout(dp=1, tp=1, pp=1, micro_batch_size=2, global_batch_size=4)
    assert step_time(GPT3, tp1, fast, StepTimeParams(replicated_head=True)).total == pytest.approx(
        step_time(GPT3, tp1, fast).total
    )


def test_whatif_respects_overlap():
    hidden = MeasuredBreakdown(
        data_wait=2e-3,
        forward=5e-3,
        backward=10e-3,
        collectives=(MeasuredCollective("dp_allreduce", 8e-3, "backward", tail_s=1e-3),),
    )
    assert hidden.step_time() == pytest.approx(2e-3 + 5e-3 + 10e-3 + 1e-3)
    g = whatif(hidden)
    assert (
        g["backward"] == pytest.approx(1e-3)
        and g["dp_allreduce"] == pytest.approx(0)
        and g["data_wait"] == pytest.approx(1e-3)
    )
    exposed = MeasuredBreakdown(
        forward=5e-3,
        backward=10e-3,
        collectives=(
            MeasuredCollective("dp_allreduce", 15e-3, "backward", tail_s=1e-3),
            MeasuredCollective("tp", 3e-3),
        ),
    )
    g = whatif(exposed)
    assert (
        g["backward"] == pytest.approx(0)
        and g["dp_allreduce"] == pytest.approx(1e-3)
        and g["tp"] == pytest.approx(1e-3)
    )


def test_every_cluster_file_loads_and_a_missing_field_is_one_line(tmp_path):
    (tmp_path / "local_cpu.json").write_text(
        json.dumps(
            {
                "gemm_flops": 5e10,
                "memory_gib": 16.0,
                "ranks": 2,
                "links": {"allreduce": [1e-4, 1e9], "allgather": [2e-4, 5e8], "p2p": [5e-5, 2e9]},
            }
        )
    )
    for path in sorted((CONF_DIR / "cluster").glob("*.yaml")):
        c = cluster_of(yaml.safe_load(path.read_text()), cache_dir=str(tmp_path), measure=False)
        assert c.peak_flops > 0 and c.usable_memory_bytes > 0
        if path.stem == "local_cpu":
            assert c.nic.params("allgather") == (2e-4, 5e8) and c.peak_flops == 5e10 and c.hbm_bytes == 8 * 2**30
    with pytest.raises(
        ClusterError, match="python -m framework.base.metrics.local_cpu"
    ):  # the cost model measures nothing
        cluster_from_dict(yaml.safe_load((CONF_DIR / "cluster" / "local_cpu.yaml").read_text()), where="local_cpu")
    raw = yaml.safe_load((CONF_DIR / "cluster" / "b200.yaml").read_text())
    del raw["nic_bandwidth"]
    with pytest.raises(ClusterError) as info:
        cluster_from_dict(raw, where="conf/cluster/b200.yaml")
    assert "missing field(s) cluster.nic_bandwidth" in str(info.value) and "\n" not in str(info.value)
    assert set(REQUIRED) <= set(yaml.safe_load((CONF_DIR / "cluster" / "h100_sxm.yaml").read_text()))


def test_search_ranks_by_step_time_and_reports_undividable_batch():
    c = _cluster()
    res = search(GPT3, c, world=512, global_batch_size=512)
    times = [e.time.total for e in res.fitting]
    assert all(a <= b + 1e-9 for a, b in zip(times, times[1:])) and res.fitting and all(e.fits for e in res.fitting)
    assert res.dropped.get("does not fit memory", 0) > 0  # e.g. pure DP of 175B
    assert res.closest_miss is not None and not res.closest_miss.fits
    with pytest.raises(PlanError, match=r"trainer.global_batch_size=7: no layout of 512 GPUs divides it"):
        search(GPT3, c, world=512, global_batch_size=7)


def test_estimate_memory_drops_with_tp_and_fits_flag():
    c = _cluster()
    mem = [
        estimate(
            GPT3, PlanLayout(dp=1, tp=t, pp=8, micro_batch_size=1, global_batch_size=64, recompute="full"), c
        ).memory_bytes
        for t in (1, 2, 4, 8)
    ]
    assert mem == sorted(mem, reverse=True)
    assert not estimate(GPT3, PlanLayout(dp=8, tp=1, pp=1, micro_batch_size=1, global_batch_size=8), c).fits


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        (
            ["model=gpt_1t", "plan.nodes=1", "trainer.global_batch_size=8"],
            "model=gpt_1t fits no layout of 8 x h100_sxm: the smallest needs",
        ),
        (
            [
                "plan.nodes=1",
                "plan.tp_degrees=[1]",
                "plan.pp_degrees=[1]",
                "trainer.global_batch_size=7",
                "model=gpt_tiny",
                "data.seq_len=128",
            ],
            "trainer.global_batch_size=7: no layout of 8 GPUs divides it",
        ),
        (["~cluster.nic_bandwidth"], "missing field(s) cluster.nic_bandwidth"),
        (["cluster=nope"], "cluster"),
        (["plan.zero_stages=[0,4]"], "plan.zero_stages: 4 is not allowed; allowed: 0, 1, 2, 3"),
        (["plan.zero_stages=[zero1]"], "plan.zero_stages: 'zero1' is not allowed; allowed: 0, 1, 2, 3"),
        (["plan.schedules=[2F2B]"], "plan.schedules: '2F2B' is not allowed; allowed: GPipe, 1F1B, Interleaved1F1B"),
        (
            ["plan.run_with.data_parallel=['parallelism=ddp']"],
            "plan.run_with.data_parallel must be a list of 4 overrides, entry i for ZeRO stage i (0, 1, 2, 3); got ['parallelism=ddp']",
        ),
    ],
)
def test_planner_bad_input_is_one_line(overrides, fragment, capsys):
    from framework.driver.plan.__main__ import main

    with pytest.raises(SystemExit) as info:
        main([*overrides, "tracking.enabled=false"])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert fragment in err and "\n" not in err


@pytest.mark.parametrize(
    "lay",
    [
        PlanLayout(
            dp=2,
            tp=2,
            pp=2,
            micro_batch_size=2,
            global_batch_size=16,
            schedule="Interleaved1F1B",
            virtual_stages=2,
            zero_stage=3,
            recompute="full",
            sequence_parallel=True,
            precision="fp32",
        ),
        PlanLayout(dp=2, tp=1, pp=1, micro_batch_size=4, global_batch_size=16, zero_stage=3, precision="fp32"),
        PlanLayout(dp=2, tp=1, pp=1, micro_batch_size=4, global_batch_size=16, zero_stage=1, precision="fp32"),
        PlanLayout(dp=2, tp=1, pp=1, micro_batch_size=4, global_batch_size=16, zero_stage=2, precision="fp32"),
        PlanLayout(dp=2, tp=1, pp=1, micro_batch_size=4, global_batch_size=16, zero_stage=0, precision="fp32"),
        PlanLayout(dp=2, tp=2, pp=1, micro_batch_size=4, global_batch_size=16, zero_stage=0, precision="fp32"),
    ],
)
def test_planner_overrides_run_in_trainlab(compose, lay):
    """The overrides the planner prints compose and validate as a trainlab run of the same layout."""
    from omegaconf import OmegaConf

    from framework.base.load import load_run_config
    from framework.driver.plan.runs import trainlab_overrides
    from framework.driver.validate import validate

    run_with = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "plan.yaml").plan.run_with)
    over, notes = trainlab_overrides(lay, model="gpt_tiny", seq_len=128, nodes=1, run_with=run_with)
    resolved = validate(load_run_config(compose(*over.split(), "checkpoint=none")))
    assert (resolved.layout.dp, resolved.layout.tp, resolved.layout.pp) == (lay.dp, lay.tp, lay.pp)
    assert (resolved.micro_batch_size, resolved.global_batch_size) == (lay.micro_batch_size, lay.global_batch_size)
    assert resolved.run.model.activation_checkpointing == (lay.recompute == "full")
    assert notes == (
        ["sequence parallelism with pp > 1: trainlab cannot run it yet (plan.run_with.sequence_parallel_with_pp)"]
        if lay.sequence_parallel and lay.pp > 1
        else []
    )


def test_activation_bytes_without_dropout_and_in_fp32():
    """Derived from Korthikanti §4.1's accounting: e-byte activations, no dropout masks."""
    sh = _gpt_table2_shape()
    s, b, h, a = sh.seq_len, 1, sh.d_model, sh.n_head
    got = A.activation_bytes_per_layer(sh, micro_batch_size=b, act_bytes=4, dropout=False)
    assert got == pytest.approx(s * b * (4 * h * 4 + (2 * h + 2 * h + 8 * h) * 4) + a * s * s * b * 4)


def test_breakdown_from_trainlab_metrics():
    from framework.base.cost.steptime import breakdown_from_metrics

    m = {
        "perf/data_wait_s": 0.002,
        "perf/compute_s": 0.030,
        "perf/comm_s": 0.001,
        "perf/comm_inflight_s": 0.008,
        "perf/optimizer_s": 0.004,
        "perf/other_s": 0.003,
    }
    b = breakdown_from_metrics(m)
    # the all-reduce's 7 ms before its exposed tail hide behind the 20 ms backward: the step is the spans' sum
    assert b.step_time() == pytest.approx(0.002 + 0.030 + 0.001 + 0.004 + 0.003)
    g = whatif(b)
    assert (
        g["dp_grad_reduction"] == pytest.approx(0)
        and g["backward"] == pytest.approx(1e-3)
        and g["other"] == pytest.approx(1e-3)
    )


def test_the_cost_package_measures_nothing():
    """framework/base/cost is pure formulas: no module imports torch or a clock (measurement lives in framework/metrics)."""
    import ast
    from pathlib import Path

    import framework.base.cost

    for path in sorted(Path(framework.base.cost.__file__).parent.glob("*.py")):
        tree = ast.parse(path.read_text())
        names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert not names & {"torch", "time"}, f"{path.name} imports {sorted(names & {'torch', 'time'})}"
