"""Config schema, batch arithmetic and validation: bad input gives one clear line naming the key."""

from __future__ import annotations

import re

import pytest

from framework.base.config.schema import ConfigError
from framework.driver.validate import derive_batch, load_run_config, validate
from tests.conftest import CONF_DIR


@pytest.mark.parametrize(
    "given, expected",
    [
        (dict(micro_batch_size=8, global_batch_size=16, grad_accum_steps=None, dp_degree=2), (8, 1, 16)),
        (dict(micro_batch_size=2, global_batch_size=16, grad_accum_steps=None, dp_degree=2), (2, 4, 16)),
        (dict(micro_batch_size=None, global_batch_size=32, grad_accum_steps=4, dp_degree=2), (4, 4, 32)),
        (dict(micro_batch_size=3, global_batch_size=None, grad_accum_steps=5, dp_degree=4), (3, 5, 60)),
        (dict(micro_batch_size=2, global_batch_size=8, grad_accum_steps=2, dp_degree=2), (2, 2, 8)),
    ],
)
def test_derive_batch_fills_the_third(given, expected):
    mbs, acc, gbs = derive_batch(**given)
    assert (mbs, acc, gbs) == expected
    assert gbs == mbs * acc * given["dp_degree"]


@pytest.mark.parametrize(
    "given, fragment",
    [
        (dict(micro_batch_size=3, global_batch_size=16, grad_accum_steps=None, dp_degree=2), "not divisible"),
        (dict(micro_batch_size=None, global_batch_size=10, grad_accum_steps=4, dp_degree=2), "not divisible"),
        (dict(micro_batch_size=2, global_batch_size=16, grad_accum_steps=2, dp_degree=2), "!= micro_batch_size 2"),
        (dict(micro_batch_size=2, global_batch_size=None, grad_accum_steps=None, dp_degree=2), "at least two"),
    ],
)
def test_derive_batch_rejects_inconsistent(given, fragment):
    with pytest.raises(ConfigError, match=fragment) as info:
        derive_batch(**given)
    assert "\n" not in str(info.value)


def test_default_config_composes_and_validates(compose):
    resolved = validate(load_run_config(compose()))
    assert resolved.plugin_name == "ddp"
    assert (resolved.layout.dp, resolved.layout.tp, resolved.layout.pp) == (2, 1, 1)
    assert resolved.global_batch_size == 16 and resolved.micro_batch_size == 8 and resolved.grad_accum_steps == 1
    assert resolved.tokens_per_step == 16 * 128
    assert resolved.checkpoint_dir == "checkpoints/default/test"


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


@pytest.mark.parametrize(
    "group, option",
    [
        (g, o)
        for g in ("model", "data", "parallelism", "checkpoint", "trainer", "tracking", "experiment")
        for o in _options(g)
    ],
)
def test_every_conf_option_composes_and_validates(compose, group, option, tmp_path):
    overrides = [f"{group}={option}"]
    if group == "data" and option in ("text_files", "jsonl"):
        overrides.append(f"data.paths=[{tmp_path}/*.txt]")
    if group == "parallelism" and option == "single":
        overrides.append("trainer.global_batch_size=8")
    if group == "parallelism" and option in ("fsdp", "tp", "pp"):
        overrides.append("checkpoint=none")
    run = load_run_config(compose(*overrides))
    validate(run)


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        (
            ["model=gpt_tiny", "+model.mlp=swiglu"],
            "model.mlp='swiglu' does not go with model.arch='gpt' (it trains only model.mlp='gelu'",
        ),
        (
            ["model=llama_tiny", "model.tied_embeddings=true"],
            "model.tied_embeddings=True does not go with model.arch='llama'",
        ),
        (["model=llama_tiny", "model.bias=true"], "model.bias=True does not go with model.arch='llama'"),
        (["model=llama_tiny", "model.arch=mamba"], "model.arch='mamba' is not allowed; allowed: gpt, llama"),
        (
            [
                "model=llama_tiny",
                "parallelism=tp",
                "parallelism.tp_degree=4",
                "parallelism.world_size=4",
                "checkpoint=none",
            ],
            "parallelism.tp_degree=4 must divide model.n_kv_head=2 (grouped-query attention splits key/value heads over tp",
        ),
    ],
)
def test_a_shape_that_does_not_fit_the_architecture_is_one_line(compose, overrides, fragment):
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        validate(load_run_config(compose(*overrides)))


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        (
            ["parallelism.name=nope"],
            "parallelism.name='nope' is not a known plugin; available: ddp, deepspeed, fsdp, pp, single, tp",
        ),
        (["trainer.global_batch_size=15"], "trainer.global_batch_size=15 is not divisible"),
        (["data.seq_len=512"], "data.seq_len=512 is longer than model.max_seq_len=256"),
        (["optim.lr=0"], "optim.lr=0.0 must be > 0"),
        (["optim.lr=-1e-3"], "optim.lr=-0.001 must be > 0"),
        (
            ["parallelism.world_size=3", "parallelism.dp_degree=2"],
            "parallelism.world_size=3 != dp_degree(2) x tp_degree(1) x pp_degree(1) = 2",
        ),
        (["parallelism.tp_degree=2"], "plugin 'ddp' is data parallel only"),
        (["parallelism=single", "parallelism.world_size=2"], "must be 1 for plugin 'single'"),
        (["trainer.precision=fp8"], "trainer.precision='fp8' is not allowed; allowed: 32-true, bf16-mixed, 16-mixed"),
        (["trainer.max_steps=abc"], "trainer.max_steps"),
        (["+parallelism.bogus=1"], "parallelism.bogus is not an option of plugin 'ddp'"),
        (["data=text_files"], "data.paths"),
        (["model.n_head=5"], "model.n_head=5 must divide model.d_model=128"),
        (["parallelism.nnodes=2"], "rendezvous.endpoint is required with parallelism.nnodes=2"),
        (
            ["parallelism.nnodes=2", "parallelism.nproc_per_node=2"],
            "parallelism.nnodes=2 x parallelism.nproc_per_node=2 = 4 != parallelism.world_size=2",
        ),
        (["data.name=web"], "data.name='web' is not a data source; allowed: stdlib_code, text_files, jsonl"),
        (["checkpoint.mode=later"], "checkpoint.mode='later' is not allowed; allowed: sync, async"),
        (["checkpoint.full_every_n_saves=0"], "checkpoint.full_every_n_saves=0 must be > 0"),
        (["checkpoint.memory_every_n_steps=-1"], "checkpoint.memory_every_n_steps=-1 must be >= 0"),
        (
            ["trainer.profile_steps=[3]"],
            "trainer.profile_steps=[3] must be [a, b] with 1 <= a <= b <= trainer.max_steps=800, or null",
        ),
        (["trainer.profile_steps=[5,2]"], "trainer.profile_steps=[5, 2] must be [a, b]"),
        (["trainer.profile_steps=[0,2]"], "trainer.profile_steps=[0, 2] must be [a, b]"),
        (
            ["trainer.max_steps=10", "trainer.profile_steps=[5,11]"],
            "trainer.profile_steps=[5, 11] must be [a, b] with 1 <= a <= b <= trainer.max_steps=10",
        ),
        (["tracking.system_metrics_interval_s=-1"], "tracking.system_metrics_interval_s=-1.0 must be >= 0 (0 = off)"),
    ],
)
def test_bad_input_is_one_clear_line(compose, overrides, fragment):
    with pytest.raises(ConfigError) as info:
        validate(load_run_config(compose(*overrides)))
    msg = str(info.value)
    assert fragment in msg
    assert "\n" not in msg


def test_all_errors_are_reported_together(compose):
    with pytest.raises(ConfigError) as info:
        validate(load_run_config(compose("data.seq_len=512", "trainer.global_batch_size=15")))
    assert "data.seq_len=512" in str(info.value) and "trainer.global_batch_size=15" in str(info.value)


def test_warmup_cosine_schedule():
    from framework.rank.module import warmup_cosine

    f = lambda k: warmup_cosine(k, warmup_steps=10, max_steps=110, min_lr_ratio=0.1)  # noqa: E731
    assert [f(k) for k in (0, 4, 9)] == pytest.approx([0.1, 0.5, 1.0])  # linear warm-up to the peak
    assert f(10) == pytest.approx(1.0)
    assert f(60) == pytest.approx(0.1 + 0.9 * 0.5)  # half-way through the cosine
    assert f(110) == pytest.approx(0.1) and f(500) == pytest.approx(0.1)  # floor at min_lr_ratio


def _grid_points(params: dict) -> list[list[str]]:
    """The overrides of every point of a basic-sweeper grid (``key: a,b,c``, or ``glob(..)`` over a config
    group's presets; no range()/choice())."""
    import itertools

    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import Glob

    axes = []
    for k, vals in params.items():
        value = OverridesParser.create().parse_overrides([f"{k}={vals}"])[0].value()
        values = value.filter(_options(k)) if isinstance(value, Glob) else [v.strip() for v in str(vals).split(",")]
        axes.append([f"{k}={v}" for v in values])
    return [list(p) for p in itertools.product(*axes)]


@pytest.mark.parametrize("preset", _options("experiment"))
def test_every_point_of_a_study_preset_validates(compose, preset):
    """A study is only as good as its grid: each job of a preset's sweep composes and validates
    (a refused point would be a FAILED child in the study). Optuna searches, whose points are
    drawn at run time and may be refused on purpose, are checked for composing only."""
    from omegaconf import OmegaConf

    raw = OmegaConf.load(CONF_DIR / "experiment" / f"{preset}.yaml")
    params = OmegaConf.select(raw, "hydra.sweeper.params") or {}
    if "optuna" in str(raw.get("defaults", [])):  # override /hydra/sweeper: optuna
        validate(load_run_config(compose(f"experiment={preset}")))
        return
    points = _grid_points(dict(params)) or [[]]
    for point in points:
        validate(load_run_config(compose(f"experiment={preset}", *point)))


def test_threads_per_rank_is_refused_only_above_the_cores(compose, monkeypatch):
    """ranks x threads_per_rank > cores thrashes and is refused with the largest allowed value; 1 thread
    per rank is always allowed (4 ranks on 2 cores oversubscribe whatever the threads, as null does)."""
    import os

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)  # a 2-core machine
    common = (
        "parallelism=ddp",
        "trainer.global_batch_size=8",
        "trainer.micro_batch_size=1",
        "trainer.grad_accum_steps=null",
    )
    validate(load_run_config(compose(*common, "parallelism.world_size=4", "trainer.threads_per_rank=1")))
    validate(load_run_config(compose(*common, "parallelism.world_size=2", "trainer.threads_per_rank=1")))
    with pytest.raises(ConfigError) as err:
        validate(load_run_config(compose(*common, "parallelism.world_size=2", "trainer.threads_per_rank=2")))
    assert "trainer.threads_per_rank=2 x 2 ranks > 2 cores" in str(err.value) and "allowed: <= 1" in str(err.value)


def test_key_suggestions_are_the_close_ones_not_the_same_prefix():
    from framework.base.config import near_keys

    keys = [
        "parallelism.reshard_after_forward",
        "parallelism.nproc_per_node",
        "parallelism.world_size",
        "trainer.max_steps",
    ]
    assert near_keys("parallelism.reshard_after_forwad", keys) == ["parallelism.reshard_after_forward"]
    assert near_keys("parallelism.nproc_per_nod", keys) == ["parallelism.nproc_per_node"]
    assert near_keys("nothing.like.it", keys) == []
