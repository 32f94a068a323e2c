"""Token-weighted loss (issue 13 item 7): the step's loss is the mean over the global batch's valid
targets however the batch is split into micro-batches and data-parallel ranks."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from framework.base.config.schema import ModelConfig
from framework.base.model import GPT
from framework.base.model.gpt import IGNORE_INDEX, lm_loss
from framework.rank.data.step_tokens import StepTokenCounts, valid_targets
from framework.rank.module import LMModule

V, S = 64, 16
FP32_RTOL = 1e-6  # one fp32 sum in another order: ~1e-7 relative


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(ModelConfig(n_layer=2, n_head=2, d_model=32, max_seq_len=S), V)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Two sequences; the first has 3 valid targets, the second all 16 (uneven micro-batches)."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, V, (2, S), generator=g), torch.randint(0, V, (2, S), generator=g)
    y[0, 3:] = IGNORE_INDEX
    return x, y


def _module(model: GPT, grad_accum_steps: int, dp: int) -> LMModule:
    """An LMModule around ``model`` for a layout (only what ``training_step`` reads)."""
    resolved = SimpleNamespace(grad_accum_steps=grad_accum_steps, layout=SimpleNamespace(dp=dp))
    module = LMModule(resolved, vocab_size=V, plugin=None)
    module.model = model
    return module


def _split_step(token_weighted: bool, grad_accum_steps: int, dp: int) -> tuple[float, list[torch.Tensor]]:
    """One optimizer step over ``_batch()`` split into ``grad_accum_steps x dp`` micro-batches of one
    sequence, reduced as trainlab's plugins do: each micro-batch loss / grad_accum_steps (Lightning),
    gradients and logged losses averaged over the dp ranks. Returns (logged loss, gradients)."""
    model = _model()
    module = _module(model, grad_accum_steps, dp)
    x, y = _batch()
    n = valid_targets(y)  # the step's count over all micro-batches and ranks (StepTokenCounts)
    rank_grads, rank_losses = [], []
    for r in range(dp):
        model.zero_grad()
        micro = []
        for j in range(grad_accum_steps):
            i = r * grad_accum_steps + j
            if token_weighted:  # trainlab's training_step
                loss = module.training_step((x[i : i + 1], y[i : i + 1], n), i)
            else:
                loss = model(x[i : i + 1], y[i : i + 1])  # each micro-batch's own mean
            (loss / grad_accum_steps).backward()
            micro.append(loss.detach())
        rank_losses.append(torch.stack(micro).mean())
        rank_grads.append([p.grad.clone() for p in model.parameters()])
    grads = [torch.stack(gs).mean(0) for gs in zip(*rank_grads)]  # the data-parallel mean
    return float(torch.stack(rank_losses).mean()), grads


def _one_pass() -> tuple[float, list[torch.Tensor]]:
    model = _model()
    x, y = _batch()
    loss = model(x, y)
    loss.backward()
    return float(loss.detach()), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("grad_accum_steps, dp", [(2, 1), (1, 2)], ids=["1x2-accumulation", "dp2"])
def test_split_step_equals_one_pass_with_uneven_valid_targets(grad_accum_steps, dp):
    ref_loss, ref_grads = _one_pass()
    loss, grads = _split_step(True, grad_accum_steps, dp)
    old_loss, old_grads = _split_step(False, grad_accum_steps, dp)  # the mean of micro-batch means
    print(
        f"\ndp {dp} x grad_accum_steps {grad_accum_steps}: one pass {ref_loss:.7f}  token-weighted {loss:.7f}  mean of means {old_loss:.7f}"
    )
    assert loss == pytest.approx(ref_loss, rel=FP32_RTOL)
    for g, ref in zip(grads, ref_grads):
        torch.testing.assert_close(g, ref, rtol=1e-5, atol=1e-7)
    # The old method weighs the 3 targets of the first sequence like the 16 of the second.
    assert abs(old_loss - ref_loss) > 1e-3
    assert max(float((g - ref).abs().max()) for g, ref in zip(old_grads, ref_grads)) > 1e-4


def test_without_ignored_targets_the_loss_is_the_plain_mean_bit_for_bit():
    model = _model()
    g = torch.Generator().manual_seed(2)
    x, y = torch.randint(0, V, (4, S), generator=g), torch.randint(0, V, (4, S), generator=g)
    with torch.no_grad():
        logits = model(x)
    n = valid_targets(y) * 2  # a step of 8 such sequences, split 2 x 2 into micro-batches of 2
    plain = torch.nn.functional.cross_entropy(logits[:2].reshape(-1, V), y[:2].reshape(-1))
    assert torch.equal(lm_loss(logits[:2], y[:2], n, num_micro_batches=4), plain)
    assert torch.equal(lm_loss(logits[:2], y[:2]), plain)
    # The count stays an integer: a mixed-precision wrapper that casts floating inputs leaves it.
    assert not torch.is_floating_point(n)


def test_lm_loss_ignores_masked_targets_and_is_zero_when_all_are():
    model = _model()
    x, y = _batch()
    with torch.no_grad():
        logits = model(x)
    kept = y[0, :3]
    want = torch.nn.functional.cross_entropy(logits[0, :3].float(), kept)
    assert torch.allclose(lm_loss(logits[:1], y[:1]), want)
    none = torch.full_like(y[:1], IGNORE_INDEX)
    assert float(lm_loss(logits[:1], none)) == 0.0  # not NaN (0 / 0)


def test_step_token_counts_yield_the_step_count_once_reduced_per_step():
    g = torch.Generator().manual_seed(3)
    batches = []
    for valid in (5, 16, 0, 9, 16):  # 2 steps of 2 micro-batches, then a short tail
        x, y = torch.randint(0, V, (1, S), generator=g), torch.randint(0, V, (1, S), generator=g)
        y[0, valid:] = IGNORE_INDEX
        batches.append((x, y))
    calls = []

    def two_ranks(local: torch.Tensor) -> torch.Tensor:  # another rank with the same count
        calls.append(int(local))
        return local * 2

    loader = SimpleNamespace(batch_sampler="sampler")
    wrapped = StepTokenCounts(batches, micro_batches_per_step=2, sum_over_ranks=two_ranks)
    out = list(wrapped)
    assert calls == [21, 9, 16]
    assert [int(n) for _, _, n in out] == [42, 42, 18, 18, 32]
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(out, batches))
    assert len(wrapped) == 5
    assert StepTokenCounts(loader, micro_batches_per_step=1, sum_over_ranks=two_ranks).batch_sampler == "sampler"
