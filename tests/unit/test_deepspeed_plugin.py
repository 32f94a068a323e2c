"""DeepSpeed plugin without ranks: config errors, the ZeRO cost model, the presets."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from framework.base.config.schema import ConfigError
from framework.base.cost.comm import ModelStats
from framework.driver.validate import load_run_config, validate
from plugins.deepspeed import DeepSpeedConfig
from plugins.deepspeed.cost import zero_comm_volume, zero_model_states_bytes


@pytest.mark.parametrize(
    "override, message",
    [
        ("parallelism.zero_stage=4", "parallelism.zero_stage=4 is not a ZeRO stage; allowed: 0, 1, 2, 3"),
        ("parallelism.offload_param=cpu", "parallelism.offload_param='cpu' needs parallelism.zero_stage=3 (got 2)"),
        (
            "parallelism.offload_optimizer=nvme",
            "parallelism.offload_optimizer='nvme' is not allowed; allowed: none, cpu",
        ),
        ("parallelism.reduce_bucket_size=0", "parallelism.reduce_bucket_size=0 must be > 0"),
        # Found by trying: async/incremental were silently saved as full sync checkpoints, and a
        # rollback to an in-memory snapshot crashed in DeepSpeed's optimizer load (KeyError).
        (
            "checkpoint=async",
            "checkpoint.mode='async': plugin 'deepspeed' saves DeepSpeed's own checkpoint files"
            " synchronously only; allowed: sync",
        ),
        (
            "checkpoint=incremental",
            "plugin 'deepspeed' saves DeepSpeed's own checkpoint files without deltas; allowed: 1",
        ),
        (
            "checkpoint=memory",
            "plugin 'deepspeed' does not keep in-memory snapshots (so no resilience=rollback;"
            " resilience=restart resumes from the last checkpoint); allowed: 0",
        ),
    ],
)
def test_bad_options_are_one_line_config_errors(compose, override, message):
    with pytest.raises(ConfigError) as info:
        validate(load_run_config(compose("parallelism=zero2", override)))
    assert message in str(info.value) and "\n" not in str(info.value)


def test_offload_on_cpu_ranks_is_refused(compose):
    with pytest.raises(ConfigError, match=r"parallelism.offload_optimizer='cpu' needs CUDA ranks .*allowed here: none"):
        validate(
            load_run_config(
                compose("parallelism=zero3", "parallelism.offload_optimizer=cpu", "trainer.accelerator=cpu")
            )
        )


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


def test_a_users_deepspeed_config_is_merged_over_trainlabs(compose, tmp_path):
    """Issue 13 item 9: the JSON file, then ``ds_config`` over it, then both over trainlab's keys; a
    ``zero_optimization`` key trainlab also has as a typed option replaces it (cost model, params)."""
    import json

    from plugins.deepspeed.strategy import deepspeed_config

    path = tmp_path / "ds.json"
    path.write_text(
        json.dumps(
            {
                "steps_per_print": 5,
                "wall_clock_breakdown": True,
                "zero_optimization": {"allgather_bucket_size": 2000, "sub_group_size": 123},
            }
        )
    )
    resolved = validate(
        load_run_config(
            compose(
                "parallelism=zero2",
                f"parallelism.ds_config_path={path}",
                "trainer.global_batch_size=16",
                "trainer.micro_batch_size=4",
                "trainer.grad_accum_steps=null",
                "++parallelism.ds_config={steps_per_print:10,train_batch_size:16,gradient_accumulation_steps:2,"
                "zero_optimization:{reduce_bucket_size:1000,round_robin_gradients:true}}",
            )
        )
    )
    par = resolved.run.parallelism
    assert (par.reduce_bucket_size, par.allgather_bucket_size) == (1000, 2000)  # the typed options follow
    ds = deepspeed_config(par, resolved)
    assert ds["steps_per_print"] == 10 and ds["wall_clock_breakdown"] is True  # the dict wins over the file
    assert ds["train_micro_batch_size_per_gpu"] == 4 and ds["train_batch_size"] == 16
    assert "gradient_accumulation_steps" not in ds  # Lightning writes it (and refuses it in a config)
    zero = ds["zero_optimization"]
    assert zero["stage"] == 2 and zero["reduce_bucket_size"] == 1000 and zero["allgather_bucket_size"] == 2000
    assert zero["round_robin_gradients"] is True and zero["sub_group_size"] == 123
    assert zero["contiguous_gradients"] is True  # trainlab's keys the user left alone stay


@pytest.mark.parametrize(
    "ds_config, message",
    [
        (
            "{train_micro_batch_size_per_gpu:8}",
            "parallelism.ds_config.train_micro_batch_size_per_gpu=8 contradicts trainlab's batch arithmetic:"
            " trainer.micro_batch_size=4 (global_batch_size 16 = micro_batch_size 4 x grad_accum_steps 2 x dp_degree 2);"
            " remove the key or set trainer.micro_batch_size",
        ),
        (
            "{gradient_accumulation_steps:4}",
            "parallelism.ds_config.gradient_accumulation_steps=4 contradicts trainlab's batch arithmetic:"
            " trainer.grad_accum_steps=2 (global_batch_size 16 = micro_batch_size 4 x grad_accum_steps 2 x dp_degree 2);"
            " remove the key or set trainer.grad_accum_steps",
        ),
        (
            "{train_batch_size:32}",
            "parallelism.ds_config.train_batch_size=32 contradicts trainlab's batch arithmetic: trainer.global_batch_size=16",
        ),
        (
            "{zero_optimization:{stage:3}}",
            "parallelism.ds_config.zero_optimization.stage=3 contradicts parallelism.zero_stage=2",
        ),
        (
            "{zero_optimization:{reduce_bucket_size:1.5}}",
            "parallelism.ds_config.zero_optimization.reduce_bucket_size=1.5 must be a whole number (it sets parallelism.reduce_bucket_size)",
        ),
        ("{gradient_clipping:0.5}", "parallelism.ds_config.gradient_clipping=0.5 contradicts optim.grad_clip=1.0"),
        ("{bf16:{enabled:true}}", "parallelism.ds_config.bf16.enabled=true contradicts trainer.precision='32-true'"),
        (
            "{optimizer:{type:Adam}}",
            "parallelism.ds_config.optimizer is not allowed: the run's AdamW and LR schedule are optim.*",
        ),
    ],
)
def test_a_deepspeed_key_that_contradicts_the_run_is_a_one_line_error(compose, ds_config, message):
    with pytest.raises(ConfigError) as info:
        validate(
            load_run_config(
                compose(
                    "parallelism=zero2",
                    "trainer.global_batch_size=16",
                    "trainer.micro_batch_size=4",
                    "trainer.grad_accum_steps=null",
                    "optim.grad_clip=1.0",
                    f"++parallelism.ds_config={ds_config}",
                )
            )
        )
    assert message in str(info.value) and "\n" not in str(info.value)


def test_an_unreadable_deepspeed_json_is_a_one_line_error(compose, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    for path, message in (
        (tmp_path / "missing.json", "cannot read a JSON DeepSpeed config (No such file or directory)"),
        (bad, "holds a JSON list, not an object"),
    ):
        with pytest.raises(ConfigError) as info:
            validate(load_run_config(compose("parallelism=zero2", f"parallelism.ds_config_path={path}")))
        assert message in str(info.value) and "\n" not in str(info.value)


def test_held_state_hooks_count_what_zero_keeps_outside_the_parameters():
    """The framework measures model state through the plugin's hooks (no ``ds_*`` probing in framework/): the
    DeepSpeed plugin adds a ZeRO-3 partition (``ds_tensor``), a wrapper's flat buffers and the full ``ds_shape``."""
    import torch

    from framework.base.metrics.memory import model_states_bytes, model_stats
    from framework.base.plugin import ParallelPlugin
    from plugins.deepspeed import DeepSpeedPlugin

    module = torch.nn.Linear(4, 2, bias=False)
    w = module.weight
    w.ds_tensor, w.ds_shape = torch.zeros(3), (2, 4)  # a partition of 3 fp32 elements; the full shape
    adamw = torch.optim.AdamW(module.parameters())

    class Wrapper:  # like a ZeRO optimizer: an inner torch AdamW and flat fp32 buffers of its own
        def __init__(self) -> None:
            self.optimizer, self.flat = adamw, [torch.zeros(5)]

    wrapper = Wrapper()
    ds, base = DeepSpeedPlugin(DeepSpeedConfig(zero_stage=3)), ParallelPlugin(None)
    assert (
        ds.inner_optimizer(wrapper) is adamw
        and ds.inner_optimizer(adamw) is adamw
        and base.inner_optimizer(adamw) is adamw
    )
    plain = model_states_bytes(base.held_state(module, adamw))
    assert plain == {"params": 32, "grads": 0, "optimizer": 0, "total": 32}  # AdamW's params are the module's
    zero = model_states_bytes(ds.held_state(module, wrapper))
    assert zero == {"params": 32 + 12, "grads": 0, "optimizer": 20, "total": 64}
    assert model_stats(module, ds.full_param_shape).param_shapes == ((2, 4),)
    w.data = torch.empty(0)  # ZeRO-3 between uses: the full size comes from ds_shape only
    assert model_stats(module, ds.full_param_shape).num_params == 8 and model_stats(module).num_params == 0
