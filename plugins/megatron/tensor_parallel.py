"""Megatron-LM tensor parallelism for :class:`framework.base.model.GPT` and :class:`framework.base.model.Llama` with DTensor ``parallelize_module``.

Per transformer block (Shoeybi et al. 2019, §3, Fig. 3):

- attention: ``attn.qkv`` column-parallel (each rank holds whole heads: the qkv output is laid
  out ``[H, 3, d]``, so a contiguous column shard is head-aligned), ``attn.proj`` row-parallel;
- MLP: ``mlp.fc`` column-parallel, ``mlp.proj`` row-parallel.

The Llama-style model keeps these names, so the same plan applies: its ``attn.qkv`` is laid out
per key/value group ``[K, g + 2, d]`` (grouped-query attention), so a column shard holds
``K / tp`` whole groups — its query heads and its key/value heads (``tp`` must divide
``n_kv_head``; :func:`plugins.megatron.config.validate_run` refuses it otherwise); its
``mlp.fc`` is SwiGLU's gate and up projections interleaved ``[f, 2]`` (column-parallel: each
rank holds matching gate/up columns), ``mlp.proj`` the down projection (row-parallel); its
RMSNorms take the LayerNorms' places (``ln_1``, ``ln_2``, ``ln_f``) under sequence parallelism.
The communication is the same per layer: the block's input and output are ``[b, s, h]`` either way.

Without sequence parallelism the block input is replicated; each row-parallel output is
all-reduced in forward (Megatron's *g*) and each column-parallel input gradient in backward
(*f*): 2 + 2 all-reduces of ``b·s·h`` per layer per micro-batch (Fig. 4).

With ``sequence_parallel`` (Korthikanti et al. 2022, §4.2.2) the residual stream and the
LayerNorms are sharded over the sequence (``SequenceParallel`` on ``ln_1``/``ln_2``); each
*g* becomes a reduce-scatter and each *f* an all-gather (and their backward the reverse): per
layer 2 all-gathers + 2 reduce-scatters forward and the same backward, each of ``b·s·h``.
The embeddings, ``ln_f`` and the tied head stay replicated: the embedding output is split over
the sequence into block 0 (backward: one all-gather of its gradient) and the last block's
output is all-gathered into ``ln_f`` (forward: one all-gather).

Embeddings, final norm and head are not sharded (no vocab-parallel embedding or loss yet):
every TP rank computes them in full and holds identical gradients for them.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from framework.base.parallelize import blocks_of


def apply_tp(model: torch.nn.Module, tp_mesh: DeviceMesh, *, sequence_parallel: bool) -> torch.nn.Module:
    """Shard ``model``'s blocks over ``tp_mesh`` in place (see the module docstring); returns ``model``.
    The megatron plugin's TP plan (:attr:`framework.base.parallelize.ParallelPlan.tp`).

    ``model`` is a :class:`framework.base.model.GPT` or a pipeline stage holding a ``blocks``
    container of its blocks (and, with sequence parallelism, ``ln_f`` on the last stage).
    """
    blocks = blocks_of(model)
    for block in blocks:
        if sequence_parallel:
            plan = {
                "ln_1": SequenceParallel(),
                "attn.qkv": ColwiseParallel(input_layouts=Shard(1)),
                "attn.proj": RowwiseParallel(output_layouts=Shard(1)),
                "ln_2": SequenceParallel(),
                "mlp.fc": ColwiseParallel(input_layouts=Shard(1)),
                "mlp.proj": RowwiseParallel(output_layouts=Shard(1)),
            }
        else:
            plan = {
                "attn.qkv": ColwiseParallel(),
                "attn.proj": RowwiseParallel(),
                "mlp.fc": ColwiseParallel(),
                "mlp.proj": RowwiseParallel(),
            }
        parallelize_module(block, tp_mesh, plan)
    if sequence_parallel:
        # Replicated embedding output -> this rank's slice of the sequence (no forward comm).
        parallelize_module(
            blocks[0],
            tp_mesh,
            PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=True),
        )
        # Sequence-sharded residual stream -> the whole sequence for ln_f and the replicated head.
        parallelize_module(
            model.ln_f,
            tp_mesh,
            PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True),
        )
    return model
