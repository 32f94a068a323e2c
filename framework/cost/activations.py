"""Activation memory per rank (Korthikanti et al. 2022, "Reducing Activation Recomputation in
Large Transformer Models", §4 and Table 2), 16-bit activations.

Per layer and micro-batch (b sequences of s tokens, hidden h, a heads, TP degree t):

=============================== =====================================
no recompute, no TP             ``s·b·h·(34 + 5·a·s/h)``
TP                              ``s·b·h·(10 + 24/t + 5·a·s/(h·t))``
TP + sequence parallel (SP)     ``s·b·h·(34/t + 5·a·s/(h·t))``
selective recompute (+ SP)      the ``5·a·s/h`` term dropped: ``s·b·h·(10 + 24/t)`` (``34/t`` with SP)
full recompute                  ``2·s·b·h`` (the layer input; ``/t`` with SP)
=============================== =====================================

The 34 splits (§4.1) into 10 not split by TP (layer-norm inputs 4, attention and MLP inputs 2
+ 2, two dropout masks 1 + 1) and 24 split by TP (Q, K 4, V 2, projection input 2, MLP
activations 8 + 8). Derived generalisation for other shapes (exact on the paper's GPT, tested):
Q 2h, K and V ``2·kv_dim`` each, projection input 2h, MLP ``4f`` (GELU: fc output + GELU
output) or ``6f`` (SwiGLU: gate, up and their product), so the TP-split part is
``4h + 4·kv_dim + 4f`` (or ``6f``) bytes per token.

Element size and dropout (derived from the same §4.1 accounting, parameters ``act_bytes`` and
``dropout``): with ``e``-byte activations and 1-byte dropout masks the non-TP part is
``(4h)·e + 2h`` (layer-norm inputs 2h, attention and MLP inputs h + h, two masks), the TP part
``(2h + 2·kv_dim + 2f (3f SwiGLU))·e`` and the scores ``a·s·(2e + 1)`` per token (softmax
output, its dropout mask and output); without dropout the masks and the dropout output go:
``4h·e`` and ``a·s·e``. ``e = 2`` with dropout is Table 2.

Not in Table 2 and added here: under full recompute, the backward of one layer rematerialises
that layer's activations (one layer, one micro-batch, the selective size: the recomputed attention
core runs fused, FlashAttention-style, and keeps no ``s x s`` scores; a run that kept them at b = 8,
s = 8192 would need tens of GB for that one layer, more than the published full-recompute runs had); the last stage holds
the fp32 logits ``4·s·b·V/t`` of one micro-batch (the output layer's input and the
cross-entropy); the first stage the embedding output ``e·s·b·h`` (+ dropout mask ``s·b·h``)
per micro-batch in flight (§4.3).
"""

from __future__ import annotations

from framework.cost.bubble import microbatches_in_flight

RECOMPUTE = ("none", "selective", "full")


def activation_bytes_per_layer(shape, *, micro_batch_size: int, tp: int = 1, sequence_parallel: bool = False,
                               recompute: str = "none", act_bytes: int = 2, dropout: bool = True) -> float:
    """Bytes one transformer layer keeps for backward, per micro-batch, on one TP rank (module table).

    Args:
        shape: a :class:`~framework.cost.shape.ModelShape` (h, a, f, kv heads, s).
        micro_batch_size: b sequences.
        tp: tensor-parallel degree t.
        sequence_parallel: SP splits the non-TP part (norms, dropouts, layer inputs) by ``t``.
        recompute: ``none`` | ``selective`` | ``full``.
        act_bytes: bytes per activation element (2: bf16/fp16, Table 2; 4: fp32).
        dropout: dropout layers keep 1-byte masks (Table 2); False = no dropout (p = 0).

    Raises:
        ValueError: unknown ``recompute``.
    """
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute={recompute!r} is not allowed; allowed: {', '.join(RECOMPUTE)}")
    s, b, h, a = shape.seq_len, micro_batch_size, shape.d_model, shape.n_head
    sp_div = tp if sequence_parallel else 1
    e = act_bytes
    if recompute == "full":
        return float(e) * s * b * h / sp_div
    mlp = (3 if shape.mlp == "swiglu" else 2) * shape.ff
    split = (2 * h + 2 * shape.kv_dim + mlp) * e  # bytes per token, divided by t
    unsplit = 4 * h * e + (2 * h if dropout else 0)
    per_token = unsplit / sp_div + split / tp
    scores = a * s * s * b * (2 * e + 1 if dropout else e) / tp if recompute == "none" else 0.0
    return s * b * per_token + scores


def activation_bytes_per_rank(shape, *, micro_batch_size: int, tp: int, pp: int, n_microbatches: int,
                              sequence_parallel: bool, recompute: str, schedule: str = "1F1B",
                              virtual_stages: int = 1, act_bytes: int = 2, dropout: bool = True) -> dict[str, float]:
    """Peak activation bytes of the busiest rank, by part (module docstring).

    The first stage holds ``L/p`` layers' activations for :func:`~framework.cost.bubble.microbatches_in_flight`
    micro-batches (1F1B: ``min(p, m)``; GPipe: ``m``; interleaved: ``p·(1 + (p-1)/(p·v))``); with
    ``pp == 1`` one micro-batch is in flight (gradient accumulation frees each micro-batch's
    activations in its backward). Returns ``{"layers", "recompute_working", "embedding", "logits",
    "total"}`` for the larger of the first and the last stage.
    """
    s, b, h = shape.seq_len, micro_batch_size, shape.d_model
    kw = dict(act_bytes=act_bytes, dropout=dropout)
    per_layer = activation_bytes_per_layer(shape, micro_batch_size=b, tp=tp, sequence_parallel=sequence_parallel,
                                           recompute=recompute, **kw)
    inflight = microbatches_in_flight(schedule=schedule, pp=pp, n_microbatches=n_microbatches, virtual_stages=virtual_stages)
    layers_per_stage = -(-shape.n_layer // pp)  # the busiest stage: ceil(L/p)
    working = (activation_bytes_per_layer(shape, micro_batch_size=b, tp=tp, sequence_parallel=sequence_parallel,
                                          recompute="selective", **kw)
               if recompute == "full" else 0.0)  # the recomputed layer, its attention core fused (no s x s scores)
    sp_div = tp if sequence_parallel else 1
    embedding = (act_bytes + (1 if dropout else 0)) * s * b * h / sp_div
    logits = 4.0 * s * b * shape.vocab_size / tp
    first = {"layers": per_layer * layers_per_stage * inflight, "recompute_working": working,
             "embedding": embedding * inflight, "logits": logits if pp == 1 else 0.0}
    last = {"layers": per_layer * layers_per_stage * 1.0, "recompute_working": working, "embedding": 0.0, "logits": logits}
    worst = max((first, last), key=lambda d: sum(d.values())) if pp > 1 else first
    return {**worst, "total": sum(worst.values())}
