"""The decoders trainlab trains: a GPT-2-style :class:`GPT` and a Llama-style :class:`Llama`,
chosen by ``model.arch`` (:func:`build_model`)."""

from __future__ import annotations

from torch import nn

from framework.base.config.schema import ModelConfig
from framework.base.model.gpt import GPT, MLP, Block, CausalSelfAttention
from framework.base.model.llama import GroupedQueryAttention, Llama, LlamaBlock, SwiGLU

ARCHS = {"gpt": GPT, "llama": Llama}


def build_model(cfg: ModelConfig, vocab_size: int) -> nn.Module:
    """The decoder of ``cfg.arch`` (``gpt`` | ``llama``) with ``vocab_size`` rows unless ``cfg.vocab_size`` is set.

    Raises:
        ValueError: unknown ``cfg.arch`` (the config schema refuses it first), or a vocabulary below the tokenizer's.
    """
    if cfg.arch not in ARCHS:
        raise ValueError(f"model.arch={cfg.arch!r} is not allowed; allowed: {', '.join(ARCHS)}")
    return ARCHS[cfg.arch](cfg, vocab_size)


__all__ = [
    "ARCHS",
    "GPT",
    "Block",
    "CausalSelfAttention",
    "MLP",
    "Llama",
    "LlamaBlock",
    "GroupedQueryAttention",
    "SwiGLU",
    "build_model",
]
