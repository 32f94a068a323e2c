"""GPT decoder: shapes, loss at init, causality, tying, determinism, counts, learning."""

from __future__ import annotations

import math

import pytest
import torch

from framework.base.config.schema import ModelConfig
from framework.base.model import GPT

V = 64


def tiny(**kw) -> ModelConfig:
    args = dict(n_layer=2, n_head=2, d_model=32, max_seq_len=16)
    args.update(kw)
    return ModelConfig(**args)


def build(seed: int = 0, **kw) -> GPT:
    torch.manual_seed(seed)
    return GPT(tiny(**kw), V)


def test_logits_shape_and_scalar_loss():
    model = build()
    idx = torch.randint(0, V, (3, 10))
    assert model(idx).shape == (3, 10, V)
    loss = model(idx, idx)
    assert loss.shape == () and loss.dtype == torch.float32


def test_loss_at_init_is_about_ln_vocab():
    model = build()
    idx = torch.randint(0, V, (4, 16), generator=torch.Generator().manual_seed(1))
    tgt = torch.randint(0, V, (4, 16), generator=torch.Generator().manual_seed(2))
    assert abs(model(idx, tgt).item() - math.log(V)) < 0.3


def test_loss_is_fp32_under_bf16_autocast():
    model = build()
    idx = torch.randint(0, V, (2, 8))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(idx, idx)
    assert loss.dtype == torch.float32


def test_causal_change_at_t_leaves_earlier_logits():
    model = build().eval()
    idx = torch.randint(0, V, (2, 12))
    t = 7
    idx2 = idx.clone()
    idx2[:, t] = (idx[:, t] + 1) % V
    a, b = model(idx), model(idx2)
    torch.testing.assert_close(a[:, :t], b[:, :t], rtol=0, atol=1e-6)
    assert not torch.allclose(a[:, t], b[:, t])


def test_head_is_tied_to_token_embedding():
    model = build()
    assert model.lm_head_weight.data_ptr() == model.wte.weight.data_ptr()
    assert not any(k.startswith("lm_head") for k in model.state_dict())
    # logits are exactly ln_f(hidden) @ wte.T: scaling wte row r moves only its logit's scale
    idx = torch.randint(0, V, (1, 5))
    with torch.no_grad():
        before = model(idx)
        model.wte.weight[3].zero_()
        after = model(idx)
    assert torch.all(after[..., 3] == 0)
    assert not torch.allclose(before[..., 3], after[..., 3])


def test_same_seed_same_weights_other_seed_differs():
    a, b, c = build(seed=5), build(seed=5), build(seed=6)
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.wte.weight, c.wte.weight)


def test_init_scales_residual_projections():
    torch.manual_seed(0)
    model = GPT(ModelConfig(n_layer=8, n_head=4, d_model=256, max_seq_len=8), 512)
    blk = model.blocks[0]
    assert blk.attn.qkv.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert blk.mlp.proj.weight.std().item() == pytest.approx(0.02 / 4, rel=0.05)  # 1/sqrt(2*8)
    assert blk.attn.proj.weight.std().item() == pytest.approx(0.02 / 4, rel=0.05)
    assert torch.all(blk.attn.qkv.bias == 0) and torch.all(blk.ln_1.weight == 1)


def test_sequence_longer_than_max_seq_len_is_an_error():
    model = build()
    with pytest.raises(ValueError, match=r"seq_len=17.*model\.max_seq_len=16"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_no_bias_flag_and_vocab_padding():
    model = build(bias=False, vocab_size=80)
    assert model.vocab_size == 80 and model.wte.weight.shape == (80, 32)
    assert all(not n.endswith("bias") for n, _ in model.named_parameters())
    with pytest.raises(ValueError, match="model.vocab_size=32"):
        GPT(tiny(vocab_size=32), V)


def test_heads_follow_qkv_width():
    """A column shard of qkv (whole heads, layout [H, 3, d]) runs fewer heads, same head_dim."""
    model = build().eval()
    attn = model.blocks[0].attn
    x = torch.randn(2, 6, 32)
    full = attn(x)
    # Split heads across two "ranks" by hand: rows of qkv, columns of proj; sum the partials.
    h, half = 32, 3 * 32 // 2
    part = torch.zeros_like(full)
    for r in range(2):
        shard = type(attn)(tiny()).eval()
        shard.qkv = torch.nn.Linear(h, half)
        shard.proj = torch.nn.Linear(h // 2, h, bias=False)
        with torch.no_grad():
            shard.qkv.weight.copy_(attn.qkv.weight[r * half : (r + 1) * half])
            shard.qkv.bias.copy_(attn.qkv.bias[r * half : (r + 1) * half])
            shard.proj.weight.copy_(attn.proj.weight[:, r * h // 2 : (r + 1) * h // 2])
        part += shard(x)
    torch.testing.assert_close(part + attn.proj.bias, full, rtol=1e-5, atol=1e-6)


def test_gpt2_small_parameter_count():
    cfg = ModelConfig(name="gpt2_124m", n_layer=12, n_head=12, d_model=768, max_seq_len=1024, vocab_size=50257)
    with torch.device("meta"):  # counts only; no memory, no init cost
        model = GPT(cfg, 50257)
    assert model.num_params(exclude_position_embedding=False) == 124_439_808
    assert model.num_params() == 124_439_808 - 1024 * 768 == 123_653_376
    assert model.num_flops_params() == model.num_params()


def test_adam_overfits_one_batch():
    model = build(seed=0)
    gen = torch.Generator().manual_seed(3)
    idx = torch.randint(0, V, (4, 16), generator=gen)
    tgt = torch.randint(0, V, (4, 16), generator=gen)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    first = None
    for _ in range(30):
        loss = model(idx, tgt)
        first = loss.item() if first is None else first
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    assert model(idx, tgt).item() < 0.5 * first
