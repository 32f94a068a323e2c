"""DeepSpeed plugin without ranks: config errors, the ZeRO cost model, the presets."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from framework.config.schema import ConfigError
from framework.config.validate import load_run_config, validate
from framework.cost.comm import ModelStats
from plugins.deepspeed import DeepSpeedConfig
from plugins.deepspeed.cost import zero_comm_volume, zero_model_states_bytes


@pytest.mark.parametrize(
    "override, message",
    [
        ("parallelism.zero_stage=4", "parallelism.zero_stage=4 is not a ZeRO stage; allowed: 0, 1, 2, 3"),
        ("parallelism.offload_param=cpu", "parallelism.offload_param='cpu' needs parallelism.zero_stage=3 (got 2)"),
        ("parallelism.offload_optimizer=nvme", "parallelism.offload_optimizer='nvme' is not allowed; allowed: none, cpu"),
        ("parallelism.reduce_bucket_size=0", "parallelism.reduce_bucket_size=0 must be > 0"),
        # Found by trying: async/incremental were silently saved as full sync checkpoints, and a
        # rollback to an in-memory snapshot crashed in DeepSpeed's optimizer load (KeyError).
        ("checkpoint=async", "checkpoint.mode='async': plugin 'deepspeed' saves DeepSpeed's own checkpoint files"
                             " synchronously only; allowed: sync"),
        ("checkpoint=incremental", "plugin 'deepspeed' saves DeepSpeed's own checkpoint files without deltas; allowed: 1"),
        ("checkpoint=memory", "plugin 'deepspeed' does not keep in-memory snapshots (so no resilience=rollback;"
                              " resilience=restart resumes from the last checkpoint); allowed: 0"),
    ],
)
def test_bad_options_are_one_line_config_errors(compose, override, message):
    with pytest.raises(ConfigError) as info:
        validate(load_run_config(compose("parallelism=zero2", override)))
    assert message in str(info.value) and "\n" not in str(info.value)


def test_offload_on_cpu_ranks_is_refused(compose):
    with pytest.raises(ConfigError, match=r"parallelism.offload_optimizer='cpu' needs CUDA ranks .*allowed here: none"):
        validate(load_run_config(compose("parallelism=zero3", "parallelism.offload_optimizer=cpu", "trainer.accelerator=cpu")))


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_presets_compose_and_pick_the_stage(compose, stage):
    resolved = validate(load_run_config(compose(f"parallelism=zero{stage}")))
    assert resolved.run.parallelism.name == "deepspeed"
    assert resolved.run.parallelism.zero_stage == stage
    assert resolved.layout.dp == resolved.world_size == 2


def _resolved(n: int, a: int) -> SimpleNamespace:
    return SimpleNamespace(layout=SimpleNamespace(dp=n), grad_accum_steps=a)


def test_model_states_follow_zero_section_5_with_a_master_copy():
    psi = 1_000_000
    stats = ModelStats(num_params=psi, num_param_tensors=10)
    got = {s: zero_model_states_bytes(stats, DeepSpeedConfig(zero_stage=s), _resolved(4, 2)) for s in range(4)}
    assert got[0] == 16 * psi  # 4 params + 4 grads + 8 AdamW
    assert got[1] == 4 * psi + 4 * psi + 12 * psi // 4  # K = 12: fp32 master + AdamW moments, partitioned
    assert got[2] == 4 * psi + (4 + 12) * psi // 4
    assert got[3] == 20 * psi // 4
    assert zero_model_states_bytes(stats, DeepSpeedConfig(zero_stage=1), _resolved(4, 1)) == got[2]


def test_comm_volume_by_stage():
    psi = 1000
    stats = ModelStats(num_params=psi, num_param_tensors=3)
    vol = lambda cfg, a=3: zero_comm_volume(stats, cfg, _resolved(2, a)).payload_bytes  # noqa: E731
    assert vol(DeepSpeedConfig(zero_stage=0)) == {"allreduce": 4 * psi}
    assert vol(DeepSpeedConfig(zero_stage=1)) == {"allreduce": 4 * psi, "allgather": 4 * psi}
    assert vol(DeepSpeedConfig(zero_stage=2)) == {"allreduce": 3 * 4 * psi, "allgather": 4 * psi}
    assert vol(DeepSpeedConfig(zero_stage=3)) == {"allgather": 3 * 4 * psi, "reduce_scatter": 3 * 4 * psi}
    released = DeepSpeedConfig(zero_stage=3, max_live_parameters=0, max_reuse_distance=0)
    assert vol(released) == {"allgather": 2 * 3 * 4 * psi, "reduce_scatter": 3 * 4 * psi}  # the paper's 3 Psi
