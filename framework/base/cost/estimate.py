"""Everything the cost model says about one layout: memory by part, bytes by link and
collective, bubble, step time, tokens/s, MFU, time, money and energy to train N tokens."""

from __future__ import annotations

from dataclasses import dataclass

from framework.base.cost.activations import activation_bytes_per_rank
from framework.base.cost.bubble import pp_bubble_fraction
from framework.base.cost.collectives import Collective, bytes_by_collective, bytes_by_link, layout_collectives
from framework.base.cost.flops import flops_per_token
from framework.base.cost.memory import StateBytes, model_states_per_rank, stage_params
from framework.base.cost.steptime import StepTime, StepTimeParams, step_time


@dataclass(frozen=True)
class Estimate:
    """The cost model's figures for one layout (per GPU unless named otherwise).

    Attributes:
        layout: the :class:`~framework.base.cost.layout.PlanLayout`.
        states: model-state bytes of the busiest rank (weights, grads, optimizer).
        activations: activation bytes of the busiest rank by part (``total`` included).
        memory_bytes: states + activations.
        memory_limit: the cluster's usable bytes per GPU.
        collectives: the step's collectives (:func:`~framework.base.cost.collectives.layout_collectives`).
        bubble: pipeline idle fraction of the step, ``(p-1)/(v·m+p-1)``.
        time: :class:`~framework.base.cost.steptime.StepTime`.
        tokens_per_sec: ``B·s / step_time`` for the whole job.
        mfu: model FLOPs (``6N + 12·L·h·s`` per token) per second over the job's peak.
    """

    layout: object
    states: StateBytes
    activations: dict
    memory_bytes: float
    memory_limit: float
    collectives: list[Collective]
    bubble: float
    time: StepTime
    tokens_per_sec: float
    mfu: float

    @property
    def fits(self) -> bool:
        """Whether the busiest rank's memory fits the usable memory."""
        return self.memory_bytes <= self.memory_limit

    @property
    def bytes_by_link(self) -> dict[str, float]:
        """Ring wire bytes per GPU per step: ``{"nvlink", "nic"}``."""
        return bytes_by_link(self.collectives)

    @property
    def bytes_by_collective(self) -> dict[str, float]:
        """Ring wire bytes per GPU per step by collective name."""
        return bytes_by_collective(self.collectives)

    def train_cost(self, tokens: float, cluster) -> dict[str, float]:
        """Time and cost to train ``tokens`` tokens: ``{"days", "gpu_hours", "money", "energy_mwh"}``
        (GPU board power only; price and power from the cluster file)."""
        seconds = tokens / self.tokens_per_sec
        gpu_hours = seconds / 3600 * self.layout.world_size
        return {
            "days": seconds / 86400,
            "gpu_hours": gpu_hours,
            "money": gpu_hours * cluster.price_per_gpu_hour,
            "energy_mwh": gpu_hours * cluster.power_w / 1e6,
        }


def memory_per_rank(shape, lay, op_sac: bool = False, torch_cross_entropy: bool = False) -> tuple[StateBytes, dict]:
    """Model states and activations of the busiest rank (the first pipeline stage's states: the
    embedding; the larger of first/last stage's activations; ``op_sac``: ``selective`` is torchtitan's
    op-level checkpointing, :attr:`~framework.base.cost.steptime.StepTimeParams.op_sac`;
    ``torch_cross_entropy``: the loss holds three fp32 copies of the logits,
    :attr:`~framework.base.cost.steptime.StepTimeParams.torch_cross_entropy`)."""
    psi = max(
        stage_params(shape, tp=lay.tp, pp=lay.pp, stage=0), stage_params(shape, tp=lay.tp, pp=lay.pp, stage=lay.pp - 1)
    )
    states = model_states_per_rank(
        psi,
        dp=lay.dp,
        zero_stage=lay.zero_stage,
        precision=lay.precision,
        accounting=lay.state_accounting,
        grad_accum_steps=lay.n_microbatches,
    )
    acts = activation_bytes_per_rank(
        shape,
        micro_batch_size=lay.micro_batch_size,
        tp=lay.tp,
        pp=lay.pp,
        n_microbatches=lay.n_microbatches,
        sequence_parallel=lay.sequence_parallel,
        recompute=lay.recompute,
        schedule=lay.schedule,
        virtual_stages=lay.v,
        act_bytes=4 if lay.precision == "fp32" else 2,
        dropout=shape.dropout,
        op_sac=op_sac,
        fp32_logit_copies=3 if torch_cross_entropy else 1,
    )
    return states, acts


def estimate(shape, lay, cluster, params: StepTimeParams = StepTimeParams()) -> Estimate:
    """The :class:`Estimate` of ``lay`` for ``shape`` (:class:`~framework.base.cost.shape.ModelShape`) on ``cluster``."""
    states, acts = memory_per_rank(shape, lay, op_sac=params.op_sac, torch_cross_entropy=params.torch_cross_entropy)
    colls = layout_collectives(shape, lay, cluster.gpus_per_node)
    st = step_time(shape, lay, cluster, params, colls)
    tokens = lay.global_batch_size * shape.seq_len / st.total
    fpt = flops_per_token(
        n_params=shape.num_flops_params(), n_layer=shape.n_layer, d_model=shape.d_model, seq_len=shape.seq_len
    )
    mfu = tokens * fpt / (lay.world_size * cluster.peak_flops)
    return Estimate(
        layout=lay,
        states=states,
        activations=acts,
        memory_bytes=states.total + acts["total"],
        memory_limit=cluster.usable_memory_bytes,
        collectives=colls,
        bubble=pp_bubble_fraction(pp=lay.pp, n_microbatches=lay.n_microbatches, virtual_stages=lay.v),
        time=st,
        tokens_per_sec=tokens,
        mfu=mfu,
    )
