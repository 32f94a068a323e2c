"""FLOPs per token and per step (the MFU convention of :mod:`framework.base.metrics.flops`).

``flops_per_token = 6N + 12·L·h·s`` (PaLM, Chowdhery et al. 2022, App. B; nanoGPT
``estimate_mfu``): model FLOPs, no rematerialization. Hardware FLOPs add the recomputed
forward: full recompute of every block adds ``2·N_blocks + 4·L·h·s`` per token; selective
recompute (Korthikanti et al. 2022 §5: only the attention core ``softmax(QK^T)V``) adds the
attention score/value forward ``4·L·h·s``. torchtitan's op-level selective checkpointing
(``selective_ac_option = "op"``) instead recomputes every second matmul of a block
(:func:`op_sac_recompute_flops_per_token`).
"""

from __future__ import annotations

RECOMPUTE = ("none", "selective", "full")


def flops_per_token(*, n_params: int, n_layer: int, d_model: int, seq_len: int) -> int:
    """Training (forward + backward) FLOPs per token: ``6 * n_params + 12 * n_layer * d_model * seq_len``.

    PaLM (Chowdhery et al., 2022), Appendix B. ``n_params`` is N as in
    :data:`framework.base.metrics.flops.FLOPS_CONVENTION` (e.g. ``GPT.num_flops_params()``). The
    attention term counts the full s x s score matrix (no discount for causal masking), as PaLM does.
    """
    return 6 * int(n_params) + 12 * int(n_layer) * int(d_model) * int(seq_len)


def recompute_flops_per_token(*, n_block_params: int, n_layer: int, d_model: int, seq_len: int) -> int:
    """Extra hardware FLOPs per token when every transformer block's forward is recomputed in
    backward (activation checkpointing per block): ``2 * n_block_params + 4 * n_layer * d_model * seq_len``,
    the forward third of the blocks' ``6N + 12 * L * h * s`` (PaLM App. B convention).
    """
    return 2 * int(n_block_params) + 4 * int(n_layer) * int(d_model) * int(seq_len)


def hardware_flops_per_token(shape, recompute: str) -> int:
    """FLOPs per token the hardware runs for ``shape`` (:class:`~framework.base.cost.shape.ModelShape`) under
    ``recompute`` (``none`` | ``selective`` | ``full``; module docstring).

    Raises:
        ValueError: unknown ``recompute``.
    """
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute={recompute!r} is not allowed; allowed: {', '.join(RECOMPUTE)}")
    L, h, s = shape.n_layer, shape.d_model, shape.seq_len
    model = flops_per_token(n_params=shape.num_flops_params(), n_layer=L, d_model=h, seq_len=s)
    if recompute == "full":
        sh, rep = shape.layer_params(1)
        return model + recompute_flops_per_token(n_block_params=L * (sh + rep), n_layer=L, d_model=h, seq_len=s)
    if recompute == "selective":
        return model + 4 * L * h * s
    return model


def op_sac_recompute_flops_per_token(shape) -> int:
    """Extra hardware FLOPs per token of torchtitan's op-level selective activation checkpointing: per
    block it saves the output of every ``aten.mm`` except every second one (counted in forward call
    order), which backward recomputes (torchtitan ``parallelize_llama.py`` ``_custom_policy``, "Saves
    output of all compute ops, except every second mm"; commits 0413364 and 9dec370 of its
    docs/performance.md runs). Call order: SwiGLU blocks (torchtitan's Llama) ``wq, wk, wv, wo, w1,
    w3, w2`` recompute ``wk`` (h x kv_dim), ``wo`` (h x h) and ``w3`` (h x f); GELU blocks with a fused
    QKV ``qkv, proj, fc1, fc2`` recompute ``proj`` and ``fc2``. Each recomputed mm costs
    ``2·rows·cols`` FLOPs per token: ``2·L·Σ``.
    """
    h, f = shape.d_model, shape.ff
    if shape.mlp == "swiglu":
        mms = [h * h, h * shape.kv_dim, h * shape.kv_dim, h * h, h * f, h * f, f * h]
    else:
        mms = [h * (h + 2 * shape.kv_dim), h * h, h * f, f * h]
    return 2 * shape.n_layer * sum(mms[1::2])


def flops_per_step(shape, *, global_batch_size: int) -> int:
    """Model FLOPs of one optimizer step: ``flops_per_token · global_batch_size · seq_len``."""
    return (
        flops_per_token(
            n_params=shape.num_flops_params(), n_layer=shape.n_layer, d_model=shape.d_model, seq_len=shape.seq_len
        )
        * global_batch_size
        * shape.seq_len
    )


def megatron_flops_per_step(
    *, batch: int, seq_len: int, n_layer: int, d_model: int, vocab: int, recompute: bool
) -> float:
    """Narayanan et al. 2021 eq. 3: ``96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h))`` with full recompute
    (4 passes: hardware FLOPs, what their Table 1 reports); without recompute the model FLOPs
    ``72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h))`` (Korthikanti et al. 2022 App. A)."""
    B, s, l, h, V = batch, seq_len, n_layer, d_model, vocab  # noqa: E741 (the paper's symbols)
    if recompute:
        return 96.0 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))
    return 72.0 * B * s * l * h * h * (1 + s / (6 * h) + V / (12 * l * h))
