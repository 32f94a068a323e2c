"""framework.base.parallelize: the order in which a plan is applied, activation checkpointing, compile."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from framework.base.config.schema import ModelConfig
from framework.base.model import GPT
from framework.base.parallelize import CheckpointedForward, ParallelPlan, blocks_of, checkpoint_blocks, parallelize_gpt

CFG = ModelConfig(n_layer=2, n_head=2, d_model=32, max_seq_len=16)


def _gpt(**changes) -> GPT:
    torch.manual_seed(0)
    return GPT(dataclasses.replace(CFG, **changes), vocab_size=300)


def test_plan_is_applied_split_tp_checkpointing_compile_dp_assemble():
    model = _gpt()
    names = [n for n, _ in model.named_parameters()]
    seen: list[str] = []

    def split(gpt):
        seen.append("split")
        return [gpt]

    def tp(piece):
        assert not any(isinstance(b, CheckpointedForward) for b in blocks_of(piece))
        seen.append("tp")

    def dp(mod):
        if mod is model:
            seen.append("dp root")
        else:  # a block: already checkpointed and compiled (in place) when it is wrapped
            assert isinstance(mod, CheckpointedForward) and mod._compiled_call_impl is not None
            seen.append("dp block")

    def assemble(pieces):
        seen.append("assemble")
        return pieces[0]

    out = parallelize_gpt(
        model, ParallelPlan(split=split, tp=tp, dp=dp, assemble=assemble), activation_checkpointing=True, compile=True
    )
    assert out is model
    assert seen == ["split", "tp", "dp block", "dp block", "dp root", "assemble"]
    assert [n for n, _ in model.named_parameters()] == names  # checkpoint keys unchanged
    assert model._compiled_call_impl is None  # blocks compiled, not the root


def test_an_empty_plan_compiles_the_whole_model_in_place():
    model = _gpt()
    names = [n for n, _ in model.named_parameters()]
    assert parallelize_gpt(model, ParallelPlan(), activation_checkpointing=False, compile=True) is model
    assert model._compiled_call_impl is not None
    assert all(b._compiled_call_impl is None for b in model.blocks)
    assert [n for n, _ in model.named_parameters()] == names


def test_several_pieces_need_an_assemble_step():
    model = _gpt()
    with pytest.raises(ValueError, match="2 pieces"):
        parallelize_gpt(model, ParallelPlan(split=lambda m: [m, m]), activation_checkpointing=False, compile=False)


def test_checkpointed_blocks_recompute_in_training_only_and_give_the_same_loss_and_grads():
    ref, ckpt = _gpt(), _gpt(activation_checkpointing=True)
    parallelize_gpt(ckpt, ParallelPlan(), activation_checkpointing=True, compile=False)
    checkpoint_blocks(ckpt.blocks)  # idempotent
    assert type(ckpt.blocks[0]).__mro__[1] is CheckpointedForward
    calls = {"ref": 0, "ckpt": 0}
    ref.blocks[0].mlp.register_forward_pre_hook(lambda *a: calls.__setitem__("ref", calls["ref"] + 1))
    ckpt.blocks[0].mlp.register_forward_pre_hook(lambda *a: calls.__setitem__("ckpt", calls["ckpt"] + 1))
    x = torch.randint(0, 300, (2, 16))
    losses = [m(x, x) for m in (ref, ckpt)]
    for loss in losses:
        loss.backward()
    assert torch.equal(losses[0], losses[1])
    for (name, p), q in zip(ref.named_parameters(), ckpt.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-6, atol=1e-7), name
    assert calls == {"ref": 1, "ckpt": 2}  # the block's forward ran again in backward (pre-hook: recompute stops early)
    ckpt.eval()
    with torch.no_grad():
        ckpt(x, x)
    assert calls["ckpt"] == 3  # evaluation: no recompute machinery
    assert ckpt.state_dict().keys() == ref.state_dict().keys()
