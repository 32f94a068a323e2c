"""Activation memory: the saved-tensor meter against Korthikanti et al. 2022 (Table 2) on trainlab's GPT.

Exact byte counts for a fixed shape (gpt_tiny: L=4, h=128, a=4, f=512, V=4096; b=8, s=128; fp32,
no dropout, CPU fused attention), single process. The cost model's per-layer figure
(:func:`framework.base.cost.activations.activation_bytes_per_layer`, 16-bit, Table 2) is adapted term by
term in :func:`adapted_layer_bytes`; the rest of the model's saved tensors are stated in
:func:`benchmarks.cost_model_validation.gpt_activation_bytes`.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.cost_model_validation import gpt_activation_bytes
from framework.base.config.schema import ModelConfig
from framework.base.cost.activations import activation_bytes_per_layer
from framework.base.cost.shape import ModelShape
from framework.base.metrics.memory import SavedTensorMeter
from framework.base.model import GPT

L, H, A, V, S, B = 4, 128, 4, 4096, 128, 8


def gpt_tiny() -> GPT:
    torch.manual_seed(0)
    return GPT(ModelConfig(n_layer=L, n_head=A, d_model=H, max_seq_len=256, dropout=0.0), V)


def batch(b: int = B) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, V, (b, S), generator=g), torch.randint(0, V, (b, S), generator=g)


def adapted_layer_bytes(b: int = B) -> float:
    """One layer's saved bytes: the cost model's Table 2 figure for our GPT plus what Table 2 leaves out.

    The cost model with fp32 activations (``act_bytes=4``), no dropout masks (``dropout=0``) and
    ``recompute="selective"`` (no ``5·a·s²·b`` score terms: fused attention keeps no ``s x s``
    matrix either) is ``64·sbh`` bytes: 16 elements per token and hidden unit (LayerNorm inputs 2,
    attention and MLP inputs 2, Q/K/V 3, attention output = projection input 1, GELU input and
    output 8). Added: the attention's log-sum-exp ``4·b·a·s`` and the two LayerNorms' mean and
    rstd ``2·2·4·s·b`` (fp32).
    """
    shape = ModelShape(n_layer=L, d_model=H, n_head=A, vocab_size=V, seq_len=S)
    ours = activation_bytes_per_layer(shape, micro_batch_size=b, recompute="selective", act_bytes=4, dropout=False)
    table2 = activation_bytes_per_layer(shape, micro_batch_size=b, recompute="selective")  # 2 bytes, dropout: 34·sbh
    assert table2 == 34 * S * b * H and ours == (table2 - 2 * S * b * H) * 2  # Table 2 less the 2 masks, at 4 bytes
    return ours + 4 * b * A * S + 2 * 2 * 4 * S * b


def test_one_microbatch_of_gpt_tiny_saves_the_adapted_korthikanti_bytes():
    x, y = batch()
    parts = gpt_activation_bytes(n_layer=L, d_model=H, n_head=A, d_ff=4 * H, vocab=V, seq_len=S, micro_batch_size=B)
    assert parts["layer"] == adapted_layer_bytes()  # the benchmark's adapter agrees with the cost model's Table 2
    meter = SavedTensorMeter()
    with meter:
        loss = gpt_tiny()(x, y)
    assert (
        meter.peak_bytes == L * parts["layer"] + parts["ids"] + parts["pos"] + parts["head"] + parts["targets"]
    )  # 51,536,904
    loss.backward()
    assert meter.live_bytes == 0  # backward freed every saved storage


def test_two_microbatches_in_flight_hold_twice_the_activations():
    """Two forwards before a backward (GPipe's warm-up): twice one micro-batch, the shared token ids and targets once."""
    model = gpt_tiny()
    x, y = batch()
    meter = SavedTensorMeter()
    with meter:
        model(x, y)
    one = meter.peak_bytes
    meter = SavedTensorMeter()
    with meter:
        l1, l2 = model(x, y), model(x, y)
    assert meter.peak_bytes == 2 * one - 2 * (8 * S * B)  # ids and targets: the same storages in both graphs
    (l1 + l2).backward()
    assert meter.live_bytes == 0


def test_microbatch_views_of_one_batch_keep_the_whole_batch_alive():
    """A pipeline schedule splits the step's batch into views: one micro-batch's saved ids and targets hold all of it."""
    model = gpt_tiny()
    x, y = batch(4 * 2)
    meter = SavedTensorMeter()
    with meter:
        model(x[:2], y[:2])  # the first of 4 micro-batches of 2
    parts = gpt_activation_bytes(n_layer=L, d_model=H, n_head=A, d_ff=4 * H, vocab=V, seq_len=S, micro_batch_size=2)
    assert meter.peak_bytes == L * parts["layer"] + parts["pos"] + parts["head"] + 4 * (parts["ids"] + parts["targets"])


def test_a_last_pipeline_stage_counts_its_received_activation_not_its_parameters():
    """A stage's input is a leaf that requires grad (the received activation): counted; the head copy (a parameter) is not."""
    from framework.base.model.gpt import lm_loss
    from plugins.megatron.pipeline import GPTStage

    stage = GPTStage(gpt_tiny(), [2, 3], first=False, last=True)
    hidden = torch.randn(B, S, H, requires_grad=True)
    _, y = batch()
    parts = gpt_activation_bytes(n_layer=L, d_model=H, n_head=A, d_ff=4 * H, vocab=V, seq_len=S, micro_batch_size=B)
    meter = SavedTensorMeter()
    with meter:
        loss = lm_loss(stage(hidden), y)  # the schedule's loss (plugins/megatron/pipeline.py)
    assert meter.peak_bytes == 2 * parts["layer"] + parts["head"] + parts["targets"]
    assert meter.peak_bytes > 0 and hidden.untyped_storage().nbytes() == 4 * B * S * H
    loss.backward()
    assert meter.live_bytes == 0


@pytest.mark.parametrize("b", [1, 2])
def test_activation_bytes_scale_with_the_microbatch(b):
    x, y = batch(b)
    meter = SavedTensorMeter()
    with meter:
        gpt_tiny()(x, y)
    parts = gpt_activation_bytes(n_layer=L, d_model=H, n_head=A, d_ff=4 * H, vocab=V, seq_len=S, micro_batch_size=b)
    assert meter.peak_bytes == L * parts["layer"] + parts["ids"] + parts["pos"] + parts["head"] + parts["targets"]
