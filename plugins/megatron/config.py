"""Config of the ``tp`` and ``pp`` plugins and the checks that run before any rank starts.

Both plugins share one dataclass (:class:`MegatronConfig`): the presets
``conf/parallelism/tp.yaml`` and ``pp.yaml`` differ only in their degrees, and any layout
``dp x tp x pp`` is reached by overrides (``parallelism.tp_degree=2 parallelism.pp_degree=2
parallelism.world_size=4``). Every bad value is one :class:`ConfigError` line naming the key
and what is allowed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from framework.base.config.schema import ConfigError, ParallelConfig

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
DATA_PARALLEL = ("fsdp", "ddp")


@dataclass
class MegatronConfig(ParallelConfig):
    """Tensor (Megatron-LM) and pipeline parallelism on a ``pp x dp x tp`` device mesh."""

    name: str = "tp"
    world_size: int = 2
    tp_degree: int = 2
    sequence_parallel: bool = False  # TP only: shard norms/residual stream over the sequence (Korthikanti et al. 2022)
    schedule: str = "1f1b"  # PP only: gpipe | 1f1b | interleaved_1f1b
    virtual_stages: int = 1  # PP only: model chunks per pipeline rank (v); interleaved_1f1b needs >= 2
    data_parallel: str = "fsdp"  # how the dp mesh dimension syncs gradients: fsdp (FSDP2 fully_shard) | ddp (replicate)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.schedule not in SCHEDULES:
            raise ConfigError(
                f"parallelism.schedule={self.schedule!r} is not a pipeline schedule; allowed: {', '.join(SCHEDULES)}"
            )
        if self.data_parallel not in DATA_PARALLEL:
            raise ConfigError(
                f"parallelism.data_parallel={self.data_parallel!r} is not allowed; allowed: {', '.join(DATA_PARALLEL)}"
            )
        if self.virtual_stages < 1:
            raise ConfigError(f"parallelism.virtual_stages={self.virtual_stages} must be >= 1")
        if self.schedule == "interleaved_1f1b" and self.virtual_stages < 2:
            raise ConfigError(
                f"parallelism.virtual_stages={self.virtual_stages}: schedule interleaved_1f1b needs >= 2 model chunks per rank"
            )
        if self.schedule != "interleaved_1f1b" and self.virtual_stages != 1:
            raise ConfigError(
                f"parallelism.virtual_stages={self.virtual_stages}: only schedule interleaved_1f1b runs several chunks"
                f" per rank (schedule={self.schedule}; allowed: 1)"
            )


def validate_run(cfg: MegatronConfig, run: Any, *, pp_degree: int, grad_accum_steps: int) -> None:
    """Cross-field rules of a tp/pp layout against the model and batch.

    Raises:
        ConfigError: TP degree not dividing heads / key-value heads / hidden / MLP width (or seq_len with sequence
            parallelism), more pipeline stages than layers, too few micro-batches for the
            schedule. (Checkpoint policies are checked against the plugin's capabilities.)
    """
    m = run.model
    t = cfg.tp_degree
    d_ff = m.d_ff or 4 * m.d_model
    if m.n_head % t or m.d_model % t or d_ff % t:
        raise ConfigError(
            f"parallelism.tp_degree={t} must divide model.n_head={m.n_head}, model.d_model={m.d_model} and the MLP width"
            f" {d_ff} (allowed: a common divisor)"
        )
    kv = getattr(m, "n_kv_head", None) or m.n_head
    if kv % t:
        # Each TP rank holds whole key/value groups (framework/base/model/llama.py); replicating K/V heads is not implemented.
        raise ConfigError(
            f"parallelism.tp_degree={t} must divide model.n_kv_head={kv} (grouped-query attention splits"
            f" key/value heads over tp; allowed: a divisor of {kv})"
        )
    if cfg.sequence_parallel and t > 1 and run.data.seq_len % t:
        raise ConfigError(
            f"parallelism.sequence_parallel=true needs data.seq_len={run.data.seq_len} divisible by tp_degree={t}"
        )
    stages = pp_degree * cfg.virtual_stages
    if stages > m.n_layer:
        raise ConfigError(
            f"parallelism.pp_degree={pp_degree} x virtual_stages={cfg.virtual_stages} = {stages} pipeline stages > model.n_layer="
            f"{m.n_layer} (each stage needs at least one block)"
        )
    if pp_degree > 1 and cfg.sequence_parallel:
        raise ConfigError("parallelism.sequence_parallel=true with pp_degree > 1 is not supported (allowed: false)")
    if pp_degree > 1:
        if cfg.schedule == "1f1b" and grad_accum_steps < pp_degree:
            raise ConfigError(
                f"schedule 1f1b needs grad_accum_steps (micro-batches) >= pp_degree={pp_degree}; got {grad_accum_steps}"
            )
        if cfg.schedule == "interleaved_1f1b" and grad_accum_steps % max(1, grad_accum_steps // pp_degree):
            raise ConfigError(
                f"schedule interleaved_1f1b needs grad_accum_steps={grad_accum_steps} to be a multiple of"
                f" max(1, grad_accum_steps // pp_degree)"
            )
