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
cross-entropy: Megatron's fused vocab-parallel cross-entropy keeps one fp32 copy and computes its
gradient in place; PyTorch's ``F.cross_entropy`` on fp32 logits, torchtitan's ``loss_fn``, holds three
at the start of backward: log-softmax's saved output, the gradient ``nll_loss`` passes back and
log-softmax's gradient input, ``fp32_logit_copies = 3``); the first stage the embedding output
``e·s·b·h`` (+ dropout mask ``s·b·h``) per micro-batch in flight (§4.3).

torchtitan's op-level selective checkpointing (``op_sac``; ``selective_ac_option = "op"``, its
``parallelize_llama.py`` ``_custom_policy`` at the commits of its docs/performance.md runs, 0413364
and 9dec370) keeps a different set: a checkpointed block keeps its input and the outputs of the
ops its policy saves, ``aten.mm`` except every second one (forward call order) and the fused
attention (output and log-sum-exp); every other op (norms, rotary, SwiGLU/GELU, residual adds, the
unsaved mm's) is recomputed in backward (``torch.utils.checkpoint`` selective checkpointing caches the
saved ops' outputs and nothing else of the region). Per token: the input ``h·e``, the saved
mm's outputs (SwiGLU ``wq, wk, wv, wo, w1, w3, w2`` keeps ``wq`` h, ``wv`` kv_dim, ``w1`` f and
``w2`` h; a GELU block ``qkv, proj, fc1, fc2`` keeps ``qkv`` h + 2·kv_dim and ``fc1`` f) times ``e``,
the attention output ``h·e`` and its log-sum-exp ``4·a`` (fp32 per head); column-parallel outputs
(Q/K/V, fc1/w1/w3) are split by ``t``, the input and row-parallel outputs by ``t`` only with SP.
Backward rematerialises one block at a time: one layer's selective set as working memory, as
under full recompute.
"""

from __future__ import annotations

from framework.base.cost.bubble import microbatches_in_flight

RECOMPUTE = ("none", "selective", "full")


def activation_bytes_per_layer(
    shape,
    *,
    micro_batch_size: int,
    tp: int = 1,
    sequence_parallel: bool = False,
    recompute: str = "none",
    act_bytes: int = 2,
    dropout: bool = True,
    op_sac: bool = False,
) -> float:
    """Bytes one transformer layer keeps for backward, per micro-batch, on one TP rank (module table;
    with ``op_sac`` and ``recompute = "selective"``, torchtitan's op-level saved set, module docstring).

    Args:
        shape: a :class:`~framework.base.cost.shape.ModelShape` (h, a, f, kv heads, s).
        micro_batch_size: b sequences.
        tp: tensor-parallel degree t.
        sequence_parallel: SP splits the non-TP part (norms, dropouts, layer inputs) by ``t``.
        recompute: ``none`` | ``selective`` | ``full``.
        act_bytes: bytes per activation element (2: bf16/fp16, Table 2; 4: fp32).
        dropout: dropout layers keep 1-byte masks (Table 2); False = no dropout (p = 0).
        op_sac: ``selective`` is torchtitan's op-level selective checkpointing (its saved set, not Table 2's).

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
    if recompute == "selective" and op_sac:
        f, kv = shape.ff, shape.kv_dim
        # column-parallel saved outputs (/t) and the input + row-parallel saved outputs (/t only with SP)
        split, unsplit = ((h + kv + f), 2 * h) if shape.mlp == "swiglu" else ((h + 2 * kv + f), h)
        per_token = (split / tp + unsplit / sp_div + h / tp) * e + 4 * a / tp  # + attention output and its lse
        return float(s * b * per_token)
    mlp = (3 if shape.mlp == "swiglu" else 2) * shape.ff
    split = (2 * h + 2 * shape.kv_dim + mlp) * e  # bytes per token, divided by t
    unsplit = 4 * h * e + (2 * h if dropout else 0)
    per_token = unsplit / sp_div + split / tp
    scores = a * s * s * b * (2 * e + 1 if dropout else e) / tp if recompute == "none" else 0.0
    return s * b * per_token + scores


def activation_bytes_per_rank(
    shape,
    *,
    micro_batch_size: int,
    tp: int,
    pp: int,
    n_microbatches: int,
    sequence_parallel: bool,
    recompute: str,
    schedule: str = "1F1B",
    virtual_stages: int = 1,
    act_bytes: int = 2,
    dropout: bool = True,
    op_sac: bool = False,
    fp32_logit_copies: int = 1,
) -> dict[str, float]:
    """Peak activation bytes of the busiest rank, by part (module docstring).

    The first stage holds ``L/p`` layers' activations for :func:`~framework.base.cost.bubble.microbatches_in_flight`
    micro-batches (1F1B: ``min(p, m)``; GPipe: ``m``; interleaved: ``p·(1 + (p-1)/(p·v))``); with
    ``pp == 1`` one micro-batch is in flight (gradient accumulation frees each micro-batch's
    activations in its backward). Returns ``{"layers", "recompute_working", "embedding", "logits",
    "total"}`` for the larger of the first and the last stage. ``op_sac``: ``selective`` is torchtitan's
    op-level checkpointing (:func:`activation_bytes_per_layer`), with one layer rematerialised in backward;
    ``fp32_logit_copies``: fp32 copies of one micro-batch's logits the loss holds at once (module docstring).
    """
    s, b, h = shape.seq_len, micro_batch_size, shape.d_model
    kw = dict(act_bytes=act_bytes, dropout=dropout)
    per_layer = activation_bytes_per_layer(
        shape, micro_batch_size=b, tp=tp, sequence_parallel=sequence_parallel, recompute=recompute, op_sac=op_sac, **kw
    )
    inflight = microbatches_in_flight(
        schedule=schedule, pp=pp, n_microbatches=n_microbatches, virtual_stages=virtual_stages
    )
    layers_per_stage = -(-shape.n_layer // pp)  # the busiest stage: ceil(L/p)
    rematerialised = recompute == "full" or (recompute == "selective" and op_sac)
    working = (
        activation_bytes_per_layer(
            shape, micro_batch_size=b, tp=tp, sequence_parallel=sequence_parallel, recompute="selective", **kw
        )
        if rematerialised
        else 0.0
    )  # the recomputed layer, its attention core fused (no s x s scores)
    sp_div = tp if sequence_parallel else 1
    embedding = (act_bytes + (1 if dropout else 0)) * s * b * h / sp_div
    logits = 4.0 * s * b * shape.vocab_size / tp * fp32_logit_copies
    first = {
        "layers": per_layer * layers_per_stage * inflight,
        "recompute_working": working,
        "embedding": embedding * inflight,
        "logits": logits if pp == 1 else 0.0,
    }
    last = {
        "layers": per_layer * layers_per_stage * 1.0,
        "recompute_working": working,
        "embedding": 0.0,
        "logits": logits,
    }
    worst = max((first, last), key=lambda d: sum(d.values())) if pp > 1 else first
    return {**worst, "total": sum(worst.values())}
