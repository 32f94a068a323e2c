"""A Llama-style decoder: RMSNorm, rotary positions, SwiGLU MLP, grouped-query attention, an untied head, no biases.

The architecture of Llama 2/3 (Touvron et al. 2023; Llama 3 paper, Dubey et al. 2024, §3.1):
pre-norm blocks ``x + attn(rms_norm(x))`` and ``x + mlp(rms_norm(x))``; rotary position
embeddings on queries and keys (Su et al. 2021, RoFormer; no learned position table); the
MLP ``down(silu(gate(x)) * up(x))`` (Shazeer 2020, GLU variants); ``n_kv_head`` key/value
heads shared by groups of ``n_head / n_kv_head`` query heads (Ainslie et al. 2023, GQA);
an output head of its own (``lm_head``, not tied to the token embedding); no biases.

Shapes use b = micro-batch, s = sequence length, h = ``d_model``, V = vocabulary size,
H = query heads, K = key/value heads, g = H / K (query heads per group), d = head_dim = h / H,
f = ``d_ff``.

Module names follow :mod:`framework.base.model.gpt` so that the plans written against them serve
both models (tensor parallelism, sequence parallelism, pipeline stages, checkpoint keys):
``wte`` (token embedding), ``blocks.N.ln_1`` / ``ln_2`` / ``ln_f`` (the norms, RMSNorms here),
``blocks.N.attn.qkv`` / ``attn.proj``, ``blocks.N.mlp.fc`` / ``mlp.proj``, plus ``lm_head``.

Fused layouts, both tensor-parallel friendly (a contiguous column shard of the weight is a
self-contained piece of the layer, and the layout does not depend on the TP degree, so
checkpoints reshard freely):

- ``attn.qkv`` (``[h] -> [K * (g + 2) * d]``) is laid out per key/value group, ``[K, g + 2, d]``:
  the group's g query heads, then its key head, then its value head. A column shard over
  ``tp`` (``tp`` dividing K) holds ``K / tp`` whole groups; the local head counts are read at
  forward time from the output width. With ``K == H`` this is the GPT's ``[H, 3, d]``.
- ``mlp.fc`` (``[h] -> [2f]``) fuses the gate and up projections interleaved, ``[f, 2]``
  (row ``2i`` gate, ``2i + 1`` up): a column shard holds matching gate/up columns for any
  ``tp`` dividing f. It is column-parallel (gate and up), ``mlp.proj`` (down) row-parallel,
  Megatron-LM's ``linear_fc1`` / ``linear_fc2`` for SwiGLU.

Rotary embeddings are computed in the attention from the sequence its q and k hold (the
whole sequence also under sequence parallelism, whose column-parallel ``qkv`` gathers it), in
fp32, with the rotate-half pairing (dimension ``i`` with ``i + d/2``).

Like the GPT, the model holds no parallelism and takes its parameter counts at construction.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from framework.base.config.schema import ModelConfig
from framework.base.cost.flops import flops_per_token as _flops_per_token
from framework.base.cost.flops import recompute_flops_per_token
from framework.base.model.gpt import check_seq_len, lm_loss, output_logits


def rope_cos_sin(seq_len: int, head_dim: int, theta: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)``, each ``[s, d]`` fp32: angle ``t * theta^(-2i/d)`` for position t and
    frequency ``i < d/2``, repeated for the two halves (RoFormer eq. 34, rotate-half pairing)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))  # [d/2]
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)  # [s, d/2]
    angles = torch.cat((angles, angles), dim=-1)  # [s, d]
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[b, n, s, d]`` by the angles of ``cos``/``sin`` ``[s, d]`` (in fp32; result in ``x``'s dtype)."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (xf * cos + rotated * sin).type_as(x)


class GroupedQueryAttention(nn.Module):
    """Causal self-attention with K key/value heads shared by groups of g query heads: ``[b, s, h] -> [b, s, h]``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h = cfg.d_model
        self.head_dim = h // cfg.n_head  # fixed; sharding changes the head counts, never this
        self.group = cfg.n_head // (cfg.n_kv_head or cfg.n_head)  # g, query heads per key/value head
        self.rope_theta = cfg.rope_theta
        self.dropout = cfg.dropout
        kv = cfg.n_kv_head or cfg.n_head
        self.qkv = nn.Linear(h, kv * (self.group + 2) * self.head_dim, bias=False)  # out features [K, g + 2, d]
        self.proj = nn.Linear(h, h, bias=False)  # residual projection (wo)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``[b, s, h]`` -> ``[b, s, h]``."""
        b, s, _ = x.shape
        g, d = self.group, self.head_dim
        qkv = self.qkv(x)  # [b, s, K_local * (g + 2) * d]
        k_local = qkv.size(-1) // ((g + 2) * d)  # K_local (== K unless sharded)
        qkv = qkv.view(b, s, k_local, g + 2, d)
        q = qkv[:, :, :, :g].reshape(b, s, k_local * g, d).transpose(1, 2)  # [b, H_local, s, d]
        k = qkv[:, :, :, g].transpose(1, 2)  # [b, K_local, s, d]
        v = qkv[:, :, :, g + 1].transpose(1, 2)  # [b, K_local, s, d]
        cos, sin = rope_cos_sin(s, d, self.rope_theta, x.device)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # Query head j*g + i attends with key/value head j (SDPA's enable_gqa repeats K/V by interleaving).
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True, enable_gqa=g > 1
        )  # [b, H_local, s, d]
        y = y.transpose(1, 2).reshape(b, s, k_local * g * d)  # [b, s, H_local * d]
        return self.proj(y)


class SwiGLU(nn.Module):
    """``[b, s, h] -> fc -> [b, s, f, 2] -> silu(gate) * up -> [b, s, f] -> proj -> [b, s, h]``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d_ff = cfg.d_ff or 4 * cfg.d_model
        self.fc = nn.Linear(cfg.d_model, 2 * d_ff, bias=False)  # gate and up, interleaved [f, 2]
        self.proj = nn.Linear(d_ff, cfg.d_model, bias=False)  # down (residual projection)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``[b, s, h]`` -> ``[b, s, h]``."""
        gate, up = self.fc(x).unflatten(-1, (-1, 2)).unbind(-1)  # each [b, s, f_local]
        return self.dropout(self.proj(F.silu(gate) * up))


class LlamaBlock(nn.Module):
    """Pre-norm block: ``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))`` (RMSNorms); ``[b, s, h]``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln_1 = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = GroupedQueryAttention(cfg)
        self.ln_2 = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``[b, s, h]`` -> ``[b, s, h]``."""
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Llama(nn.Module):
    """Llama-style decoder (module docstring). Same interface as :class:`framework.base.model.GPT`.

    Args:
        cfg: the model shape (``model.arch=llama``).
        vocab_size: the tokenizer's vocabulary size; ``cfg.vocab_size`` wins when set (>= it).

    Raises:
        ValueError: ``cfg.vocab_size`` below ``vocab_size``.
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
        meta = torch.empty(()).is_meta  # see GPT.__init__: no init on the meta device
        self.wte = nn.Embedding(
            self.vocab_size,
            cfg.d_model,  # [V, h]
            _weight=torch.empty(self.vocab_size, cfg.d_model) if meta else None,
        )
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, self.vocab_size, bias=False)  # [V, h], untied
        if not meta:
            self._init_weights()
        self._n_params = sum(p.numel() for p in self.parameters())
        self._n_wte = self.wte.weight.numel()
        self._n_block_params = sum(p.numel() for p in self.blocks.parameters())

    def _init_weights(self) -> None:
        """Every Linear and the embedding ~ N(0, init_std); the residual projections (``attn.proj``,
        ``mlp.proj``) ~ N(0, init_std / sqrt(2 * n_layer)) as in GPT-2; RMSNorm weights 1.
        Deterministic given ``torch.manual_seed``."""
        std = self.cfg.init_std
        resid_std = std / math.sqrt(2 * self.cfg.n_layer)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                is_resid = name.endswith("attn.proj") or name.endswith("mlp.proj")
                nn.init.normal_(module.weight, mean=0.0, std=resid_std if is_resid else std)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=std)
            elif isinstance(module, nn.RMSNorm):
                nn.init.ones_(module.weight)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """The output projection ``[V, h]`` (its own weight, untied)."""
        return self.lm_head.weight

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        num_tokens: torch.Tensor | None = None,
        num_micro_batches: int = 1,
    ) -> torch.Tensor:
        """As :meth:`framework.base.model.GPT.forward`: ids ``[b, s]`` -> logits ``[b, s, V]`` or the loss.

        Raises:
            ValueError: ``s > max_seq_len``.
        """
        check_seq_len(idx, self.max_seq_len)
        x = self.drop(self.wte(idx))  # [b, s, h]
        for block in self.blocks:
            x = block(x)
        logits = output_logits(x, self.ln_f, self.lm_head.weight)  # [b, s, V]
        return logits if targets is None else lm_loss(logits, targets, num_tokens, num_micro_batches)

    def num_params(self, *, exclude_position_embedding: bool = True) -> int:
        """All parameters (there is no position embedding: the flag changes nothing)."""
        return self._n_params

    def num_flops_params(self) -> int:
        """N in ``6N``: every parameter but the token embedding (a lookup); the untied head is a matmul and counts.
        Equals :meth:`framework.base.cost.shape.ModelShape.num_flops_params`."""
        return self._n_params - self._n_wte

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token, ``6N + 12 * L * h * seq_len`` (PaLM App. B; :func:`framework.base.cost.flops.flops_per_token`).

        Grouped-query attention changes N (smaller K/V projections), not the attention term: the
        scores and the weighted sum still run over all H query heads, ``H * d = h``. RoPE, the
        norms and the SwiGLU product are elementwise and not counted (the convention counts matmuls).
        """
        return _flops_per_token(
            n_params=self.num_flops_params(), n_layer=self.n_layer, d_model=self.d_model, seq_len=seq_len
        )

    def hardware_flops_per_token(self, seq_len: int) -> int:
        """:meth:`flops_per_token` plus, with ``activation_checkpointing``, the blocks' forward again (see the GPT's)."""
        model = self.flops_per_token(seq_len)
        if not self.cfg.activation_checkpointing:
            return model
        return model + recompute_flops_per_token(
            n_block_params=self._n_block_params, n_layer=self.n_layer, d_model=self.d_model, seq_len=seq_len
        )
