"""The GPT decoder trainlab trains (see :mod:`framework.model.gpt`)."""

from framework.model.gpt import GPT, MLP, Block, CausalSelfAttention

__all__ = ["GPT", "Block", "CausalSelfAttention", "MLP"]
