"""A candidate layout the planner prices: degrees, schedule, micro-batch, sharding, recompute.

Rank order (Megatron-LM's default ``tp-dp-pp``, torchtitan's mesh ``pp x dp x tp``): TP ranks
are adjacent (inside one node when ``tp <= gpus_per_node``), DP neighbours are ``tp`` apart, PP
neighbours ``tp·dp`` apart. A group crosses nodes when its ranks span more than one node
(:meth:`PlanLayout.group_inter_node`).
"""

from __future__ import annotations

from dataclasses import dataclass

from framework.base.cost.activations import RECOMPUTE
from framework.base.cost.bubble import SCHEDULES
from framework.base.cost.memory import ACCOUNTINGS, PRECISIONS, ZERO_STAGES, is_zero_stage, zero_label


@dataclass(frozen=True)
class PlanLayout:
    """One layout of ``world_size = dp·tp·pp`` ranks.

    Attributes:
        dp, tp, pp: data-, tensor-, pipeline-parallel degrees.
        micro_batch_size: sequences per rank per forward/backward (b).
        global_batch_size: sequences per optimizer step (B).
        schedule: ``GPipe`` | ``1F1B`` | ``Interleaved1F1B`` (only read when ``pp > 1``).
        virtual_stages: model chunks per rank v (interleaved 1F1B only).
        zero_stage: ZeRO stage of the dp group, 0..3 (:data:`~framework.base.cost.memory.ZERO_STAGES`):
            0 plain DDP all-reduce, 1 shards optimizer state, 2 + gradients, 3 + weights (= FSDP full shard).
        recompute: activation recompute ``none`` | ``selective`` | ``full``.
        sequence_parallel: Megatron SP on the TP group (tp > 1).
        precision: ``bf16`` | ``bf16_main_grad`` | ``fp32`` (:data:`~framework.base.cost.memory.PRECISIONS`).
        state_accounting: how model states are counted, ``paper`` (ZeRO §3.1/§5) or ``master_copy``
            (what DeepSpeed allocates; :func:`~framework.base.cost.memory.model_states_per_rank`).
    """

    dp: int
    tp: int
    pp: int
    micro_batch_size: int
    global_batch_size: int
    schedule: str = "1F1B"
    virtual_stages: int = 1
    zero_stage: int = 0
    recompute: str = "none"
    sequence_parallel: bool = False
    precision: str = "bf16"
    state_accounting: str = "paper"

    def __post_init__(self) -> None:
        for k in ("dp", "tp", "pp", "micro_batch_size", "global_batch_size", "virtual_stages"):
            if getattr(self, k) < 1:
                raise ValueError(f"{k}={getattr(self, k)} must be >= 1")
        if not is_zero_stage(self.zero_stage):
            raise ValueError(
                f"zero_stage={self.zero_stage!r} is not allowed; allowed: {', '.join(map(str, ZERO_STAGES))}"
            )
        for k, allowed in (
            ("schedule", SCHEDULES),
            ("recompute", RECOMPUTE),
            ("precision", tuple(PRECISIONS)),
            ("state_accounting", ACCOUNTINGS),
        ):
            if getattr(self, k) not in allowed:
                raise ValueError(f"{k}={getattr(self, k)!r} is not allowed; allowed: {', '.join(allowed)}")
        if self.global_batch_size % (self.micro_batch_size * self.dp):
            raise ValueError(
                f"global_batch_size={self.global_batch_size} is not divisible by micro_batch_size "
                f"{self.micro_batch_size} x dp {self.dp}"
            )

    @property
    def world_size(self) -> int:
        """``dp·tp·pp``."""
        return self.dp * self.tp * self.pp

    @property
    def n_microbatches(self) -> int:
        """m = ``grad_accum_steps`` = ``B / (b·dp)``: micro-batches per rank (per pipeline) per step."""
        return self.global_batch_size // (self.micro_batch_size * self.dp)

    @property
    def v(self) -> int:
        """Chunks per rank the schedule runs (1 unless interleaved)."""
        return self.virtual_stages if (self.pp > 1 and self.schedule == "Interleaved1F1B") else 1

    def group_inter_node(self, axis: str, gpus_per_node: int) -> bool:
        """Whether the ``axis`` group (``tp``, ``dp``, ``pp``) spans more than one node."""
        stride = {"tp": 1, "dp": self.tp, "pp": self.tp * self.dp}[axis]
        size = {"tp": self.tp, "dp": self.dp, "pp": self.pp}[axis]
        return size > 1 and stride * size > gpus_per_node

    def group_ranks_per_node(self, axis: str, gpus_per_node: int) -> int:
        """Members of one ``axis`` group inside one node: ``min(size, gpus_per_node // stride)`` (1 when the stride is a node or more)."""
        stride = {"tp": 1, "dp": self.tp, "pp": self.tp * self.dp}[axis]
        size = {"tp": self.tp, "dp": self.dp, "pp": self.pp}[axis]
        return 1 if stride >= gpus_per_node else max(1, min(size, gpus_per_node // stride))

    def describe(self) -> str:
        """Short label, e.g. ``tp8 pp8(v2 Interleaved1F1B) dp16 zero1 b1 rc=selective sp`` (ZeRO stage 0 reads ``none``)."""
        pp = f"pp{self.pp}" + (
            f"(v{self.v} {self.schedule})"
            if self.pp > 1 and self.v > 1
            else (f"({self.schedule})" if self.pp > 1 else "")
        )
        return (
            f"tp{self.tp} {pp} dp{self.dp} {zero_label(self.zero_stage)} b{self.micro_batch_size} "
            f"rc={self.recompute}" + (" sp" if self.sequence_parallel else "")
        )
