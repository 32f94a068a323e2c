"""The model shape the cost model reads: parameter counts by part, per layer and per rank.

:class:`ModelShape` covers trainlab's GPT (learned positions, GELU MLP, multi-head attention,
tied head) and the published shapes the planner sizes (Llama-style: SwiGLU MLP, grouped-query
attention, untied head, rotary positions). Counts are exact for trainlab's GPT and Llama (checked
against ``GPT.num_params`` in ``tests/unit/test_cost_model.py`` and ``Llama.num_params`` in
``tests/unit/test_llama.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer's shape.

    Attributes:
        n_layer: transformer blocks L.
        d_model: hidden size h.
        n_head: attention heads a (query heads).
        vocab_size: vocabulary V.
        seq_len: training sequence length s (tokens).
        d_ff: MLP inner size f (None = 4h).
        n_kv_head: key/value heads (grouped-query attention; None = ``n_head``).
        mlp: ``gelu`` (2 matrices h x f) or ``swiglu`` (3 matrices h x f).
        bias: biases in the linear layers and norms.
        tied_embeddings: the output head is the token embedding (counted once).
        learned_positions: a learned ``max_seq_len x h`` position embedding (GPT-2); False = rotary.
        max_seq_len: rows of the learned position embedding (None = ``seq_len``).
        dropout: the model applies dropout (its masks are activation memory; Korthikanti Table 2 assumes it).
    """

    n_layer: int
    d_model: int
    n_head: int
    vocab_size: int
    seq_len: int
    d_ff: int | None = None
    n_kv_head: int | None = None
    mlp: str = "gelu"
    bias: bool = True
    tied_embeddings: bool = True
    learned_positions: bool = True
    max_seq_len: int | None = None
    dropout: bool = True

    def __post_init__(self) -> None:
        if self.mlp not in ("gelu", "swiglu"):
            raise ValueError(f"mlp={self.mlp!r} is not allowed; allowed: gelu, swiglu")
        for k in ("n_layer", "d_model", "n_head", "vocab_size", "seq_len"):
            if getattr(self, k) < 1:
                raise ValueError(f"{k}={getattr(self, k)} must be >= 1")

    @property
    def ff(self) -> int:
        """MLP inner size f."""
        return self.d_ff or 4 * self.d_model

    @property
    def kv_heads(self) -> int:
        """Key/value heads."""
        return self.n_kv_head or self.n_head

    @property
    def kv_dim(self) -> int:
        """Width of K (and of V): ``kv_heads * h / a``."""
        return self.kv_heads * self.d_model // self.n_head

    def layer_params(self, tp: int = 1) -> tuple[int, int]:
        """Parameters of one block on one TP rank: ``(sharded over tp, replicated)``.

        Sharded (Megatron column/row parallel, Shoeybi et al. 2019 §3): QKV ``h·(h + 2·kv_dim)``
        (+ bias), output projection ``h·h``, MLP ``2·h·f`` (GELU; ``3·h·f`` SwiGLU) (+ fc bias),
        each divided by ``tp``. Replicated: the two norms' ``2h`` (+ ``2h`` bias), and the row
        parallel layers' biases (``h`` each).
        """
        h, f = self.d_model, self.ff
        b = 1 if self.bias else 0
        qkv = h * (h + 2 * self.kv_dim) + b * (h + 2 * self.kv_dim)
        proj = h * h
        mlp = (3 if self.mlp == "swiglu" else 2) * h * f + b * f
        sharded = qkv + proj + mlp
        replicated = 2 * h * (1 + b) + 2 * b * h
        return sharded // tp, replicated

    def embedding_params(self) -> int:
        """Token embedding ``V·h`` (+ learned positions ``max_seq_len·h``)."""
        pos = (self.max_seq_len or self.seq_len) * self.d_model if self.learned_positions else 0
        return self.vocab_size * self.d_model + pos

    def head_params(self) -> int:
        """Final norm (+ an untied output head ``V·h``)."""
        norm = self.d_model * (2 if self.bias else 1)
        return norm + (0 if self.tied_embeddings else self.vocab_size * self.d_model)

    def num_params(self) -> int:
        """All parameters Ψ (a tied head once)."""
        s, r = self.layer_params(1)
        return self.n_layer * (s + r) + self.embedding_params() + self.head_params()

    def num_flops_params(self) -> int:
        """N of ``6N`` (:data:`framework.base.metrics.flops.FLOPS_CONVENTION`): Ψ minus the position
        embedding; the output projection ``V·h`` counts once whether tied or not, the input
        embedding lookup of an untied model does not count."""
        pos = (self.max_seq_len or self.seq_len) * self.d_model if self.learned_positions else 0
        untied_input = 0 if self.tied_embeddings else self.vocab_size * self.d_model
        return self.num_params() - pos - untied_input

    @classmethod
    def from_model_config(cls, cfg: Any, *, seq_len: int, vocab_size: int | None = None) -> ModelShape:
        """From a :class:`~framework.base.config.schema.ModelConfig` (``vocab_size``: the tokenizer's, when the model's is null)."""
        vocab = cfg.vocab_size or vocab_size
        if vocab is None:
            raise ValueError("model.vocab_size is null and no tokenizer vocabulary size was given")
        return cls(
            n_layer=cfg.n_layer,
            d_model=cfg.d_model,
            n_head=cfg.n_head,
            vocab_size=vocab,
            seq_len=seq_len,
            d_ff=cfg.d_ff,
            n_kv_head=getattr(cfg, "n_kv_head", None),
            mlp=getattr(cfg, "mlp", "gelu"),
            bias=cfg.bias,
            tied_embeddings=getattr(cfg, "tied_embeddings", True),
            learned_positions=getattr(cfg, "learned_positions", True),
            max_seq_len=cfg.max_seq_len,
            dropout=cfg.dropout > 0,
        )
