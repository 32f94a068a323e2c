"""A GPT-style decoder: pre-norm blocks, causal attention, GELU MLP, tied embeddings.

Shapes use b = micro-batch, s = sequence length, h = ``d_model``, V = vocabulary size,
H = heads, d = head_dim = h / n_head, f = d_ff.

Module names are part of the API: tensor-parallel plans refer to ``blocks.N.attn.qkv``,
``blocks.N.attn.proj``, ``blocks.N.mlp.fc`` and ``blocks.N.mlp.proj``.

Tensor-parallel friendliness:
- the fused ``qkv`` output is laid out per head, ``[H, 3, d]`` (Megatron's layout), not
  GPT-2's ``[3, H, d]``; a contiguous column shard of ``qkv`` therefore holds whole heads,
  each with its own q, k and v;
- the number of heads is read at forward time from the local output width
  (``width // (3 * head_dim)``) with ``head_dim`` fixed, so a sharded ``qkv`` simply runs
  fewer heads.

Parameter counts are taken once, at construction, so they describe the whole model even
after a plugin shards or replaces its weights.

The model holds no parallelism: pipeline split, tensor parallelism, activation checkpointing
(``model.activation_checkpointing``), compilation and data-parallel wrapping are applied from
outside, in that order, by :func:`framework.base.parallelize.parallelize_gpt`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from framework.base.config.schema import ModelConfig
from framework.base.cost.flops import flops_per_token as _flops_per_token
from framework.base.cost.flops import recompute_flops_per_token

IGNORE_INDEX = -100
"""Target id that takes no loss (``F.cross_entropy``'s default ``ignore_index``): masked document
boundaries (``data.mask_document_boundaries``) or any dataset's ignored positions."""


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: ``[b, s, h] -> [b, s, h]``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h = cfg.d_model
        self.n_head = cfg.n_head  # heads of the whole model; the local count comes from qkv
        self.head_dim = h // cfg.n_head  # fixed; sharding changes the head count, never this
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(h, 3 * h, bias=cfg.bias)  # out features laid out [H, 3, d]
        self.proj = nn.Linear(h, h, bias=cfg.bias)  # residual projection
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``[b, s, h]`` -> ``[b, s, h]``."""
        b, s, _ = x.shape
        qkv = self.qkv(x)  # [b, s, 3 * H_local * d]
        n_local = qkv.size(-1) // (3 * self.head_dim)  # H_local (== n_head unless sharded)
        qkv = qkv.view(b, s, n_local, 3, self.head_dim).permute(3, 0, 2, 1, 4)  # [3, b, H, s, d]
        q, k, v = qkv.unbind(0)  # each [b, H, s, d]
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )  # [b, H, s, d]
        y = y.transpose(1, 2).reshape(b, s, n_local * self.head_dim)  # [b, s, H_local * d]
        return self.resid_dropout(self.proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward: ``[b, s, h] -> fc -> [b, s, f] -> GELU -> proj -> [b, s, h]``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d_ff = cfg.d_ff or 4 * cfg.d_model
        self.fc = nn.Linear(cfg.d_model, d_ff, bias=cfg.bias)
        self.act = nn.GELU()
        self.proj = nn.Linear(d_ff, cfg.d_model, bias=cfg.bias)  # residual projection
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``[b, s, h]`` -> ``[b, s, h]``."""
        return self.dropout(self.proj(self.act(self.fc(x))))


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``; ``[b, s, h]``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``[b, s, h]`` -> ``[b, s, h]``."""
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """GPT decoder with learned positions and an output head tied to the token embedding.

    Args:
        cfg: the model shape.
        vocab_size: the tokenizer's vocabulary size. The embedding has
            ``cfg.vocab_size`` rows when that is set (it may pad the tokenizer's size, never
            be smaller), else ``vocab_size`` rows.

    The output head has no weight of its own: logits are ``ln_f(x) @ wte.weight.T``, so
    the state dict holds the matrix once (as ``wte.weight``) and so do the counts.
    """

    def __init__(self, cfg: ModelConfig, vocab_size: int) -> None:
        super().__init__()
        if cfg.vocab_size is not None and cfg.vocab_size < vocab_size:
            raise ValueError(
                f"model.vocab_size={cfg.vocab_size} is smaller than the tokenizer's vocabulary "
                f"({vocab_size}); set model.vocab_size to null or >= {vocab_size}"
            )
        self.cfg = cfg
        self.vocab_size = cfg.vocab_size or vocab_size
        self.max_seq_len = cfg.max_seq_len
        self.n_layer = cfg.n_layer
        self.d_model = cfg.d_model

        # On the meta device (a shape only: the driver's counts, the FLOPs of a configured model) there are no
        # values to initialise, and torch's meta normal_ imports torch._dynamo (~1 s of CPU in the driver).
        meta = torch.empty(()).is_meta
        self.wte = nn.Embedding(
            self.vocab_size,
            cfg.d_model,  # [V, h]; also the output head
            _weight=torch.empty(self.vocab_size, cfg.d_model) if meta else None,
        )
        self.wpe = nn.Embedding(
            cfg.max_seq_len,
            cfg.d_model,  # [max_seq_len, h]
            _weight=torch.empty(cfg.max_seq_len, cfg.d_model) if meta else None,
        )
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        if not meta:
            self._init_weights()

        # Counted now, before any plugin shards the weights (see the module docstring).
        self._n_params = sum(p.numel() for p in self.parameters())  # tied head counted once
        self._n_wpe = self.wpe.weight.numel()
        self._n_block_params = sum(p.numel() for p in self.blocks.parameters())

    def _init_weights(self) -> None:
        """GPT-2 init: every weight ~ N(0, init_std); the residual projections (``attn.proj``,
        ``mlp.proj``) ~ N(0, init_std / sqrt(2 * n_layer)) so the residual stream's variance does
        not grow with depth; biases 0; LayerNorm weights 1. Deterministic given
        ``torch.manual_seed`` (modules are visited in a fixed order)."""
        std = self.cfg.init_std
        resid_std = std / math.sqrt(2 * self.cfg.n_layer)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                is_resid = name.endswith("attn.proj") or name.endswith("mlp.proj")
                nn.init.normal_(module.weight, mean=0.0, std=resid_std if is_resid else std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=std)
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """The output projection ``[V, h]``: the token embedding itself (tied)."""
        return self.wte.weight

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        num_tokens: torch.Tensor | None = None,
        num_micro_batches: int = 1,
    ) -> torch.Tensor:
        """Run the decoder: :func:`embed_tokens`, the blocks in order, :func:`output_logits`.

        Args:
            idx: token ids ``[b, s]`` (int64), ``s <= max_seq_len``.
            targets: next-token ids ``[b, s]`` (``IGNORE_INDEX`` where no loss is taken) or None.
            num_tokens, num_micro_batches: the loss's denominator is ``num_tokens /
                num_micro_batches`` (see :func:`lm_loss`); ``num_tokens`` None = the valid
                targets of ``targets`` (their mean cross-entropy).

        Returns:
            logits ``[b, s, V]`` when ``targets`` is None; otherwise :func:`lm_loss`, a 0-dim fp32
            tensor (also under autocast).

        Raises:
            ValueError: ``s > max_seq_len``.
        """
        x = embed_tokens(idx, self.wte, self.wpe, self.drop, self.max_seq_len)  # [b, s, h]
        for block in self.blocks:
            x = block(x)
        logits = output_logits(x, self.ln_f, self.wte.weight)  # [b, s, V], tied head
        return logits if targets is None else lm_loss(logits, targets, num_tokens, num_micro_batches)

    def num_params(self, *, exclude_position_embedding: bool = True) -> int:
        """Parameters of the whole model, the tied head counted once (it *is* ``wte``).

        With ``exclude_position_embedding`` (the default, nanoGPT's convention) ``wpe`` is left
        out; since the head is tied this equals :meth:`num_flops_params`. GPT-2 small
        (L=12, h=768, V=50257, max_seq_len=1024): 124,439,808 in all, 123,653,376 without wpe.
        """
        return self._n_params - (self._n_wpe if exclude_position_embedding else 0)

    def num_flops_params(self) -> int:
        """N in ``6N``: the non-embedding parameters plus the output projection (V * h).

        The position embedding is a lookup, not a matmul, so it is left out; the token
        embedding lookup is also free, but the output head multiplies by the same V * h
        matrix, so it counts once. With tied embeddings this is total params minus ``wpe``.
        Log this convention next to the metric (``framework.base.metrics.flops.FLOPS_CONVENTION``).
        """
        return self._n_params - self._n_wpe

    def hardware_flops_per_token(self, seq_len: int) -> int:
        """FLOPs per token the hardware runs: :meth:`flops_per_token` plus, with
        ``activation_checkpointing``, the blocks' forward again in backward.

        The recomputed forward of the blocks is ``2 * N_blocks + 4 * L * h * s`` per token
        (a third of the blocks' share of ``6N + 12 * L * h * s``); embeddings and the head are
        not recomputed. PaLM §4.1 defines HFU with these FLOPs; full recompute of everything
        would give ``8N + 16 * L * h * s``.
        """
        model = self.flops_per_token(seq_len)
        if not self.cfg.activation_checkpointing:
            return model
        return model + recompute_flops_per_token(
            n_block_params=self._n_block_params, n_layer=self.n_layer, d_model=self.d_model, seq_len=seq_len
        )

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token (forward + backward), ``6N + 12 * L * h * seq_len``.

        PaLM (Chowdhery et al., 2022), Appendix B; see :func:`framework.base.metrics.flops.flops_per_token`.
        """
        return _flops_per_token(
            n_params=self.num_flops_params(), n_layer=self.n_layer, d_model=self.d_model, seq_len=seq_len
        )


# The GPT's forward in pieces, shared with pipeline stages (plugins/megatron/pipeline.py), which
# hold some of these modules each and so cannot call GPT.forward.


def embed_tokens(
    idx: torch.Tensor, wte: nn.Embedding, wpe: nn.Embedding, drop: nn.Dropout, max_seq_len: int
) -> torch.Tensor:
    """Token + learned position embeddings, then dropout: ids ``[b, s]`` -> ``[b, s, h]``.

    Raises:
        ValueError: ``s > max_seq_len``.
    """
    s = check_seq_len(idx, max_seq_len)
    pos = torch.arange(s, device=idx.device)  # [s]
    return drop(wte(idx) + wpe(pos))


def check_seq_len(idx: torch.Tensor, max_seq_len: int) -> int:
    """The sequence length ``s`` of ids ``[b, s]``.

    Raises:
        ValueError: ``s > max_seq_len``.
    """
    s = idx.shape[1]
    if s > max_seq_len:
        raise ValueError(
            f"seq_len={s} is longer than model.max_seq_len={max_seq_len}; "
            "raise model.max_seq_len or shorten the sequences"
        )
    return s


def output_logits(x: torch.Tensor, ln_f: nn.Module, head_weight: torch.Tensor) -> torch.Tensor:
    """Final norm and the output projection: ``[b, s, h]`` -> logits ``[b, s, V]``
    (``head_weight`` ``[V, h]``: the token embedding, a pipeline stage's copy of it, or an untied head)."""
    return F.linear(ln_f(x), head_weight)


def lm_loss(
    logits: torch.Tensor, targets: torch.Tensor, num_tokens: torch.Tensor | None = None, num_micro_batches: int = 1
) -> torch.Tensor:
    """Cross-entropy of ``logits [b, s, V]`` against next-token ids ``targets [b, s]``, summed over
    the valid targets (``!= IGNORE_INDEX``) and divided by ``num_tokens / num_micro_batches``;
    computed in fp32 (a 0-dim tensor, also under autocast).

    A training step passes ``num_tokens`` = its valid targets over all micro-batches and
    data-parallel ranks (a 0-dim integer tensor) and ``num_micro_batches`` = ``grad_accum_steps
    * dp_degree``: after accumulation's ``1 / grad_accum_steps`` and the data-parallel mean, the
    step's loss and gradients are those of ``sum(CE) / num_tokens``, however the batch is split
    (torchtitan's ``global_valid_tokens``, Hugging Face's ``num_items_in_batch``). The count stays
    an integer tensor so that no mixed-precision wrapper casts it (FSDP2 casts floating inputs
    of the root's forward); the ratio is taken here in float64. ``num_tokens`` None: this call's
    own count of valid targets, i.e. their mean (0, not NaN, when there are none). With no
    ignored targets the value is bit-identical to ``F.cross_entropy``'s ``"mean"`` (also ``sum /
    count``).
    """
    b, s = targets.shape
    flat = targets.reshape(b * s)
    total = F.cross_entropy(logits.float().reshape(b * s, -1), flat, ignore_index=IGNORE_INDEX, reduction="sum")
    if num_tokens is None:
        num_tokens = (flat != IGNORE_INDEX).sum()
    denominator = (num_tokens.clamp(min=1).double() / num_micro_batches).float()
    return total / denominator
