"""One parallelize function for the GPT, in torchtitan's order.

:func:`parallelize_gpt` applies, to the freshly built :class:`~framework.base.model.GPT`:

1. **pipeline split** (``plan.split``): this rank's stages, each holding some of the GPT's
   blocks (``blocks``) and, on the first/last stage, its embeddings / final norm and head;
   without a split the GPT itself is the one piece;
2. **tensor parallelism** (``plan.tp``, sequence parallelism included), on each piece;
3. **activation checkpointing** (``model.activation_checkpointing``): each block keeps only its
   input and runs its forward again in backward (:func:`checkpoint_blocks`);
4. **compile** (``trainer.compile``): each block in place (``nn.Module.compile``), so
   parameter names, and with them checkpoint keys, stay those of the GPT; when the plan has
   nothing to apply (``single``, and ``ddp``, whose strategy wraps the model afterwards), the
   whole model in place instead (one graph, embeddings, head and loss included);
5. **data-parallel wrapping** (``plan.dp``: FSDP2 ``fully_shard`` or ``replicate``), each block
   first and then each piece's root, so each block is its own communication unit; its hooks
   run outside the checkpointed region, and eagerly under compile (FSDP2 disables dynamo in
   its hooks, ``torch/distributed/fsdp/_fully_shard/_fsdp_state.py``);

and then ``plan.assemble`` builds the module the LightningModule runs from the pieces (a
pipeline runner); without one the single piece is it. Plugins supply the plan
(:meth:`framework.base.plugin.ParallelPlugin.parallel_plan`), never their own copy of the forward.
torchtitan's ``parallelize_llama`` / ``pipeline_llama`` apply the same order (TP -> AC ->
compile -> FSDP), which is the order in which each step's wrappers compose.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn


@dataclass
class ParallelPlan:
    """What a plugin applies to the GPT; :func:`parallelize_gpt` applies it in order.

    Attributes:
        split: pipeline split: ``split(gpt)`` returns this rank's pieces (modules with a
            ``blocks`` container of the GPT's blocks, their names kept); None = the GPT is the
            one piece.
        tp: shards one piece in place over the tensor-parallel mesh (TP plan, + SP); None = no TP.
        dp: wraps one module in place over the data-parallel mesh (``fully_shard`` with its
            options, ``replicate``); applied to every block, then to each piece. None = no
            wrapping here (e.g. the strategy's DDP wraps the whole model).
        assemble: builds the module ``LMModule.model`` becomes from the parallelized pieces
            (e.g. a pipeline runner); None = the one piece.
    """

    split: Callable[[nn.Module], list[nn.Module]] | None = None
    tp: Callable[[nn.Module], Any] | None = None
    dp: Callable[[nn.Module], Any] | None = None
    assemble: Callable[[list[nn.Module]], nn.Module] | None = None


def blocks_of(piece: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a GPT (``blocks``: ``ModuleList``) or a pipeline stage (``ModuleDict``), in order."""
    blocks = piece.blocks
    return list(blocks.values() if isinstance(blocks, nn.ModuleDict) else blocks)


class CheckpointedForward:
    """Mixin put in front of a block's class by :func:`checkpoint_blocks` (as FSDP2 does with its
    own): in training with autograd on, the block's forward runs under ``torch.utils.checkpoint``
    (non-reentrant): it keeps only its input and runs again in backward."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.training and torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(super().forward, *args, use_reentrant=False, **kwargs)
        return super().forward(*args, **kwargs)


_CHECKPOINTED: dict[type, type] = {}


def checkpoint_blocks(blocks: Iterable[nn.Module]) -> None:
    """Activation checkpointing of each block, in place: a block's forward (``[b, s, h]`` ->
    ``[b, s, h]``) keeps only its input and runs again in backward; in evaluation or under
    ``no_grad`` it runs as is. Idempotent.

    The block's class becomes a subclass with :class:`CheckpointedForward` in front (no wrapper
    module), so parameter names stay the GPT's; hooks registered on the block (TP input
    layouts, FSDP's all-gather) run outside the checkpointed region, once per forward.
    """
    for block in blocks:
        cls = type(block)
        if issubclass(cls, CheckpointedForward):
            continue
        if cls not in _CHECKPOINTED:
            _CHECKPOINTED[cls] = type(f"Checkpointed{cls.__name__}", (CheckpointedForward, cls), {})
        block.__class__ = _CHECKPOINTED[cls]


def parallelize_gpt(
    model: nn.Module, plan: ParallelPlan, *, activation_checkpointing: bool, compile: bool
) -> nn.Module:
    """Apply ``plan`` to ``model`` in the order of the module docstring; returns what the
    LightningModule runs (``model`` itself unless the plan splits or assembles).

    Args:
        model: a freshly built :class:`~framework.base.model.GPT` (on any device).
        plan: the plugin's :class:`ParallelPlan`.
        activation_checkpointing: recompute each block's forward in backward (``model.activation_checkpointing``).
        compile: ``torch.compile`` in place (``trainer.compile``).

    Raises:
        ValueError: the plan splits into several pieces but has no ``assemble``.
    """
    pieces = plan.split(model) if plan.split is not None else [model]
    if len(pieces) != 1 and plan.assemble is None:
        raise ValueError(f"the parallel plan splits the model into {len(pieces)} pieces but has no assemble step")
    if plan.tp is not None:
        for piece in pieces:
            plan.tp(piece)
    if activation_checkpointing:
        for piece in pieces:
            checkpoint_blocks(blocks_of(piece))
    if compile:
        if plan.split is None and plan.tp is None and plan.dp is None:
            model.compile()  # in place: names (and checkpoint keys) stay; one graph with the head and loss
        else:
            for piece in pieces:
                for block in blocks_of(piece):
                    block.compile()  # in place (names kept), per block as torchtitan, before wrapping
    if plan.dp is not None:
        for piece in pieces:
            for block in blocks_of(piece):
                plan.dp(block)
            plan.dp(piece)
    return plan.assemble(pieces) if plan.assemble is not None else pieces[0]
