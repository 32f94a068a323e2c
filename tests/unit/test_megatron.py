"""tp/pp plugins without ranks: the cost model's arithmetic, the stage split and every bad input."""

from __future__ import annotations

import pytest

from framework.base.config.schema import ConfigError
from framework.base.cost.bubble import pp_bubble_fraction
from framework.base.cost.comm import (
    pp_p2p_bytes_per_step,
    ring_wire_bytes,
    sp_norm_grad_allreduce_bytes,
    tp_payload_bytes_per_microbatch,
)
from framework.driver.validate import load_run_config, validate
from plugins.megatron.pipeline import GPTStage, gpt_param_name, split_layers


def test_tp_payload_is_four_activation_allreduces_per_layer():
    # Shoeybi et al. 2019 Fig. 4: 2 forward + 2 backward all-reduces of b*s*h per layer.
    b, s, h, L = 4, 64, 128, 4
    act = b * s * h * 4
    for tp in (2, 4, 8):
        got = tp_payload_bytes_per_microbatch(
            micro_batch_size=b, seq_len=s, d_model=h, n_layer=L, tp=tp, sequence_parallel=False
        )
        assert got == {"allreduce": 4 * L * act}  # the payload per rank does not shrink with t ...
    # ... but the ring bytes on the wire grow as 2(t-1)/t: 1.0x at t=2, 1.5x at t=4, 1.75x at t=8.
    assert [ring_wire_bytes("allreduce", 100, t) for t in (2, 4, 8)] == [100.0, 150.0, 175.0]
    sp = tp_payload_bytes_per_microbatch(
        micro_batch_size=b, seq_len=s, d_model=h, n_layer=L, tp=2, sequence_parallel=True
    )
    assert sp == {"allgather": (4 * L + 2) * act, "reduce_scatter": 4 * L * act}
    assert (
        tp_payload_bytes_per_microbatch(
            micro_batch_size=b, seq_len=s, d_model=h, n_layer=L, tp=1, sequence_parallel=True
        )
        == {}
    )
    assert sp_norm_grad_allreduce_bytes(n_layer=4, d_model=128, bias=True) == 4 * 4 * 128 * 4


def test_pp_sends_and_bubble():
    kw = dict(n_microbatches=4, micro_batch_size=2, seq_len=64, d_model=128)
    act = 2 * 64 * 128 * 4
    assert pp_p2p_bytes_per_step(stage_ids=[0], num_stages=2, **kw) == 4 * act  # forward activations only
    assert pp_p2p_bytes_per_step(stage_ids=[1], num_stages=2, **kw) == 4 * act  # backward gradients only
    assert pp_p2p_bytes_per_step(stage_ids=[1], num_stages=3, **kw) == 8 * act  # a middle stage sends both ways
    assert (
        pp_p2p_bytes_per_step(stage_ids=[0, 2], num_stages=4, **kw) == 12 * act
    )  # interleaved: 2v-1 sends per micro-batch
    # Narayanan et al. 2021 §2.2: (p-1)/(m+p-1); interleaved (p-1)/(v*m+p-1).
    assert pp_bubble_fraction(pp=2, n_microbatches=2) == pytest.approx(1 / 3)
    assert pp_bubble_fraction(pp=4, n_microbatches=8) == pytest.approx(3 / 11)
    assert pp_bubble_fraction(pp=2, n_microbatches=4, virtual_stages=2) == pytest.approx(1 / 9)
    assert pp_bubble_fraction(pp=1, n_microbatches=4) == 0.0


def test_split_layers_is_contiguous_and_balanced():
    assert split_layers(4, 2) == [[0, 1], [2, 3]]
    assert split_layers(5, 3) == [[0, 1], [2, 3], [4]]
    assert split_layers(4, 4) == [[0], [1], [2], [3]]
    with pytest.raises(ValueError):
        split_layers(2, 3)


def test_presets_compose(compose):
    tp = validate(load_run_config(compose("parallelism=tp", "checkpoint=none")))
    assert (tp.layout.dp, tp.layout.tp, tp.layout.pp) == (1, 2, 1)
    pp = validate(load_run_config(compose("parallelism=pp", "checkpoint=none", "trainer.micro_batch_size=4")))
    assert (pp.layout.dp, pp.layout.tp, pp.layout.pp) == (1, 1, 2) and pp.grad_accum_steps == 4
    both = validate(
        load_run_config(
            compose(
                "parallelism=pp",
                "checkpoint=none",
                "parallelism.world_size=4",
                "parallelism.tp_degree=2",
                "trainer.micro_batch_size=4",
            )
        )
    )
    assert (both.layout.dp, both.layout.tp, both.layout.pp) == (1, 2, 2)
    assert both.owns_microbatching and both.loader_batch_size == 4 * 4 and both.trainer_accumulate_grad_batches == 1
    assert not tp.owns_microbatching  # only a pipeline schedule owns micro-batching
    assert [both.layout.dp_rank(r) for r in range(4)] == [0, 0, 0, 0]
    dp2 = validate(load_run_config(compose("parallelism=tp", "checkpoint=none", "parallelism.world_size=4")))
    assert [dp2.layout.dp_rank(r) for r in range(4)] == [0, 0, 1, 1]  # tp innermost: TP peers read the same data


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        (
            ["parallelism=tp", "parallelism.tp_degree=3", "parallelism.world_size=3"],
            "parallelism.tp_degree=3 must divide model.n_head=4, model.d_model=128 and the MLP width 512",
        ),
        (
            ["parallelism=tp", "parallelism.world_size=8", "parallelism.tp_degree=8", "model.n_head=4"],
            "parallelism.tp_degree=8 must divide model.n_head=4",
        ),
        (
            ["parallelism=pp", "parallelism.pp_degree=8", "parallelism.world_size=8", "trainer.micro_batch_size=1"],
            "parallelism.pp_degree=8 x virtual_stages=1 = 8 pipeline stages > model.n_layer=4",
        ),
        (
            ["parallelism=pp", "parallelism.schedule=interleaved_1f1b", "parallelism.virtual_stages=4"],
            "= 8 pipeline stages > model.n_layer=4",
        ),
        (
            ["parallelism=pp", "parallelism.schedule=zigzag"],
            "parallelism.schedule='zigzag' is not a pipeline schedule; allowed: gpipe, 1f1b, interleaved_1f1b",
        ),
        (
            ["parallelism=pp", "parallelism.schedule=interleaved_1f1b"],
            "parallelism.virtual_stages=1: schedule interleaved_1f1b needs >= 2 model chunks per rank",
        ),
        (
            ["parallelism=pp", "parallelism.virtual_stages=2"],
            "only schedule interleaved_1f1b runs several chunks per rank",
        ),
        (
            ["parallelism=tp", "parallelism.world_size=4", "parallelism.dp_degree=1"],
            "parallelism.world_size=4 != dp_degree(1) x tp_degree(2) x pp_degree(1) = 2",
        ),
        (
            ["parallelism=tp", "parallelism.world_size=3"],
            "parallelism.world_size=3 is not divisible by tp_degree(2) x pp_degree(1)",
        ),
        (
            ["parallelism=pp", "trainer.micro_batch_size=16"],
            "schedule 1f1b needs grad_accum_steps (micro-batches) >= pp_degree=2; got 1",
        ),
        (
            ["parallelism=tp", "parallelism.data_parallel=zero"],
            "parallelism.data_parallel='zero' is not allowed; allowed: fsdp, ddp",
        ),
        (
            ["parallelism=tp", "parallelism.sequence_parallel=true", "data.seq_len=63", "model.max_seq_len=256"],
            "parallelism.sequence_parallel=true needs data.seq_len=63 divisible by tp_degree=2",
        ),
        (
            ["parallelism=pp", "checkpoint=async"],
            "checkpoint.mode='async': plugin 'pp' saves sharded (DCP) checkpoints",
        ),
        (
            ["parallelism=tp", "checkpoint=incremental"],
            "checkpoint.full_every_n_saves=4: plugin 'tp' saves sharded (DCP)",
        ),
        (
            ["parallelism=tp", "checkpoint=memory"],
            "checkpoint.memory_every_n_steps=10: plugin 'tp' does not keep in-memory snapshots",
        ),
    ],
)
def test_bad_layouts_are_one_line_errors(compose, overrides, fragment):
    if not any(o.startswith("checkpoint=") for o in overrides):
        overrides = [*overrides, "checkpoint=none"]
    with pytest.raises(ConfigError) as info:
        validate(load_run_config(compose(*overrides)))
    assert fragment in str(info.value)
    assert "\n" not in str(info.value)


def test_stage_parameter_names_map_back_to_the_gpt():
    import torch

    from framework.base.config.schema import ModelConfig
    from framework.base.model import GPT

    gpt = GPT(ModelConfig(), vocab_size=300)
    layers = split_layers(4, 4)
    chunks = torch.nn.ModuleDict({str(k): GPTStage(gpt, layers[k], first=k == 0, last=k == 3) for k in range(4)})
    names = {gpt_param_name(f"chunks.{n}") for n, _ in chunks.named_parameters()}
    assert names - {None} == {n for n, _ in gpt.named_parameters()}  # every GPT parameter exactly once ...
    assert None in names  # ... plus the last stage's head copy, which is wte
    assert torch.equal(chunks["3"].head, gpt.wte.weight)
