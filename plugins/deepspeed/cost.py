"""What DeepSpeed ZeRO costs (figures from :mod:`framework.base.cost`): model-state bytes per rank, bytes per collective, and the meter.

Notation (ZeRO, Rajbhandari et al. 2020): Ψ parameters, N = dp_degree ranks, K optimizer
bytes per parameter, a = grad_accum_steps micro-batches per optimizer step.

**Model states per rank** (§5, Fig. 1; the table is fp32 training: 4-byte parameters). DeepSpeed keeps an fp32 master copy of
each rank's partition next to the model's own parameters even when those are fp32, so its
optimizer state is K = 12 bytes/param (master weights 4 + AdamW ``exp_avg`` 4 +
``exp_avg_sq`` 4), partitioned from stage 1 on; parameters and gradients are 4 bytes each:

======= ============================ ==============================================
stage   formula (bytes)              what a rank holds
======= ============================ ==============================================
0       4Ψ + 4Ψ + 8Ψ                 plain data parallelism: AdamW on the parameters
1       4Ψ + 4Ψ + 12Ψ/N   (a > 1)    full gradients between micro-batches; reduced
        4Ψ + 4Ψ/N + 12Ψ/N (a = 1)    into this rank's partition at the boundary (a = 1:
                                     full gradients exist only inside backward)
2       4Ψ + 4Ψ/N + 12Ψ/N            gradients reduced into the partition every micro-batch
3       4Ψ/N + 4Ψ/N + 12Ψ/N          parameters partitioned too (gathered only to run)
======= ============================ ==============================================

With ``trainer.precision=bf16-mixed`` DeepSpeed casts the model to bf16 (w = 2 bytes) and the
figures follow what it allocates (``accounting="master_copy"`` of
:func:`framework.base.cost.memory.model_states_per_rank`, the same function the planner prices with):
stage 1 ``2Ψ + 2Ψ + 12Ψ/N`` (a > 1; ``2Ψ + 14Ψ/N`` when a = 1), stage 2 ``2Ψ + 14Ψ/N``, stage 3
``16Ψ/N`` (the fp32 master is 4 bytes whatever the model's dtype: K = 12); stage 0
(``BF16_Optimizer``) ``2Ψ + (2 + 4)Ψ + 12Ψ/N``. Measured with ``bf16-mixed`` on 2 CPU ranks
(``tests/integration/test_deepspeed_bf16.py``): within 2% of these. The transient fp32 copy of the
gradient partition inside the optimizer step (``4Ψ/N``) is not a model state and not counted.
The paper's accounting is ``accounting="paper"`` (it differs in fp32, K = 8, and in stage 1 with
accumulation).

Measured (:func:`framework.base.metrics.memory.model_states_bytes`, the largest sample within a
logged step) as the distinct storages of the parameters, their gradients, and the ZeRO
optimizer's flat buffers and inner AdamW state. Left out of the model: AdamW's step counters
(4 bytes per parameter group) and the padding of partitions to equal sizes.

**Communication per optimizer step** (payload bytes handed to the collectives, per rank):

======= ==================================================================================
stage   collectives
======= ==================================================================================
0       all-reduce of the gradients, 4Ψ (once per step)
1       all-reduce 4Ψ at the boundary, then all-gather of the updated parameters 4Ψ
2       all-reduce 4Ψ on *every* micro-batch (a · 4Ψ), then all-gather 4Ψ
3       per micro-batch: all-gather 4Ψ for forward (and again 4Ψ for backward when the
        parameters were released in between), reduce-scatter of the gradients 4Ψ
======= ==================================================================================

DeepSpeed's stages 1 and 2 reduce gradients with bucketed *all-reduces* and keep only their
own partition (``use_multi_rank_bucket_allreduce``), not with the reduce-scatter of the
paper's §7.2, so on a ring they send 3Ψ·(N-1)/N·4 bytes per step instead of the paper's 2Ψ.
Stage 3 keeps gathered parameters live from forward to backward while fewer than
``max_live_parameters`` elements are live and a parameter is reused within
``max_reuse_distance`` elements; the model counts one gather per micro-batch when both are >= Ψ
and two (the paper's 3Ψ per micro-batch) otherwise. DeepSpeed's scalar all-reduces (global
gradient norm and overflow check: 4-16 bytes per step) are measured but not modelled. Every
collective runs on the dp group (one group size for every kind).
"""

from __future__ import annotations

from typing import Any

from framework.base.cost import comm as _comm
from framework.base.cost import memory as _memory
from framework.base.cost.comm import CommEstimate, ModelStats


def zero_model_states_bytes(stats: ModelStats, cfg: Any, resolved: Any) -> int:
    """Modelled model-state bytes of one rank for ``cfg.zero_stage`` (table in the module docstring;
    :func:`framework.base.cost.memory.zero_model_states_bytes`)."""
    return _memory.zero_model_states_bytes(
        stats, zero_stage=cfg.zero_stage, dp_degree=resolved.layout.dp, grad_accum_steps=resolved.grad_accum_steps
    )


def zero_comm_volume(stats: ModelStats, cfg: Any, resolved: Any) -> CommEstimate:
    """Modelled payload bytes per rank per optimizer step, by collective (module docstring table;
    :func:`framework.base.cost.comm.zero_comm_volume`). Stage 3 keeps gathered parameters from forward
    to backward when ``min(max_live_parameters, max_reuse_distance) >= Ψ``."""
    kept = cfg.zero_stage == 3 and min(cfg.max_live_parameters, cfg.max_reuse_distance) >= stats.num_params
    return _comm.zero_comm_volume(
        stats,
        zero_stage=cfg.zero_stage,
        dp_degree=resolved.layout.dp,
        grad_accum_steps=resolved.grad_accum_steps,
        stage3_keeps_gathered=kept,
    )


# DeepSpeed's communication backend (``deepspeed.comm.comm.cdb``, a TorchBackend) methods
# that move tensors, with the kind they are counted as and how to find the payload:
# (positional index, keyword) of the tensor (or list of tensors) whose size is the payload
# (all-gather: the gathered output; reduce-scatter: the input being reduced).
_METERED = {
    "all_reduce": ("allreduce", 0, "tensor"),
    "all_reduce_coalesced": ("allreduce", 0, "tensors"),
    "inference_all_reduce": ("allreduce", 0, "tensor"),
    "reduce": ("reduce", 0, "tensor"),
    "broadcast": ("broadcast", 0, "tensor"),
    "all_gather": ("allgather", 0, "tensor_list"),
    "all_gather_into_tensor": ("allgather", 0, "output_tensor"),
    "all_gather_coalesced": ("allgather", 0, "output_tensors"),
    "reduce_scatter": ("reduce_scatter", 1, "input_list"),
    "reduce_scatter_tensor": ("reduce_scatter", 1, "input_tensor"),
}


def _nbytes(obj: Any) -> int:
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(t) for t in obj)
    return obj.numel() * obj.element_size()


def meter_deepspeed_comm(meter: Any) -> None:
    """Make every tensor collective of DeepSpeed's backend report to ``meter``.

    Every ``deepspeed.comm`` function (which ZeRO calls) goes through one backend object,
    ``deepspeed.comm.comm.cdb``; its methods are wrapped on that instance (idempotent: a second
    call replaces the meter). Payload as in :data:`_METERED`; completion is marked when the call
    returns (asynchronous calls: when they were issued). Every call is reported; the framework's
    window counts those of a training step (forward, backward, the engine's optimizer step: ZeRO-1/2's
    parameter all-gather runs there), not validation (ZeRO-3's gathers) or checkpoint saves.
    """
    from deepspeed.comm import comm as ds_comm

    from framework.base.metrics.timing import call_group

    cdb = ds_comm.cdb
    for method, (kind, index, keyword) in _METERED.items():
        inner = getattr(type(cdb), method, None)
        if inner is None:
            continue

        def metered(*args: Any, _inner=inner, _kind=kind, _index=index, _keyword=keyword, **kwargs: Any) -> Any:
            payload = args[_index] if len(args) > _index else kwargs[_keyword]
            rec = meter.launch(_kind, _nbytes(payload), call_group(_inner, (cdb, *args), kwargs))
            out = _inner(cdb, *args, **kwargs)
            meter.complete(rec)
            return out

        setattr(cdb, method, metered)
