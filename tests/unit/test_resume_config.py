"""A resume compares the configuration stored in the checkpoint with the run's (framework/base/checkpoint/resume.py):
one line naming each differing key, unless ``resume_allow_changed`` names it; a sweep's explicit
checkpoint.dir is the root of the jobs' own folders (framework/driver/sweep.py)."""

from __future__ import annotations

import dataclasses

import pytest

from framework.base.checkpoint.format import write_checkpoint
from framework.base.checkpoint.resume import check_resume_config, resume_config
from framework.base.config.schema import ConfigError, RunConfig
from framework.driver import sweep


def _run(**changes) -> RunConfig:
    run = RunConfig()
    model = dataclasses.replace(run.model, **{k[6:]: v for k, v in changes.items() if k.startswith("model_")})
    optim = dataclasses.replace(run.optim, **{k[6:]: v for k, v in changes.items() if k.startswith("optim_")})
    return dataclasses.replace(run, model=model, optim=optim, resume_allow_changed=changes.get("allow", []))


def _checkpoint(tmp_path, run: RunConfig, step: int = 10):
    return write_checkpoint(tmp_path, step, {"w": 1}, {"kind": "full", "base": None, "config": resume_config(run)})


def test_the_stored_config_holds_what_decides_the_training_not_how():
    cfg = resume_config(RunConfig())
    assert {"model.n_layer", "optim.lr", "data.seq_len", "data.seed", "trainer.global_batch_size"} <= set(cfg)
    assert not {
        "data.num_workers",
        "data.cache_dir",
        "model.activation_checkpointing",
        "trainer.micro_batch_size",
    } & set(cfg)


def test_a_resume_with_another_model_shape_is_refused_in_one_line(tmp_path):
    path = _checkpoint(tmp_path, _run())
    assert check_resume_config("auto", tmp_path, _run()) == {}
    with pytest.raises(ConfigError) as err:
        check_resume_config("auto", tmp_path, _run(model_n_layer=6, optim_lr=1e-3))
    assert str(err.value) == (
        f"resume from {path}: this run's configuration differs from the checkpoint's: model.n_layer 4 -> 6,"
        " optim.lr 0.003 -> 0.001; resume it unchanged, start elsewhere (another checkpoint.dir, or resume=never in an"
        " empty one), or allow the change: resume_allow_changed=[model.n_layer,optim.lr]"
    )
    with pytest.raises(ConfigError, match="model.n_layer 4 -> 6"):  # the named folder is compared too
        check_resume_config(str(path), tmp_path / "elsewhere", _run(model_n_layer=6))


def test_allowed_changes_are_returned_for_the_record_and_unknown_keys_refused(tmp_path):
    _checkpoint(tmp_path, _run())
    assert check_resume_config("auto", tmp_path, _run(optim_lr=1e-3, allow=["optim.lr"])) == {
        "optim.lr": (0.003, 0.001)
    }
    with pytest.raises(
        ConfigError, match=r"resume_allow_changed names optim.learning_rate, not a key a resume compares"
    ):
        check_resume_config("auto", tmp_path, _run(allow=["optim.learning_rate"]))
    # a checkpoint written before manifests stored the config: nothing to compare
    write_checkpoint(tmp_path, 20, {"w": 1}, {"kind": "full", "base": None})
    assert check_resume_config("auto", tmp_path, _run(model_n_layer=6)) == {}


def test_an_explicit_checkpoint_dir_is_a_root_of_the_jobs_folders(monkeypatch):
    assert sweep.job_checkpoint_dir("/ck", "s/every_n_steps=5") == "/ck"  # not in a sweep: as given
    s = sweep.Sweep(name="s", keys=["checkpoint.every_n_steps"], values={"checkpoint.every_n_steps": "5,10"})
    monkeypatch.setenv(sweep.SWEEP_ENV, s.to_json())
    assert sweep.job_checkpoint_dir("/ck", "s/checkpoint.every_n_steps=5") == "/ck/s/checkpoint.every_n_steps=5"
    assert sweep.job_checkpoint_dir(None, "s/checkpoint.every_n_steps=5") is None  # checkpoints/<experiment>/<run_name>
    swept = sweep.Sweep(name="s", keys=["checkpoint.dir"], values={"checkpoint.dir": "/a,/b"})
    monkeypatch.setenv(sweep.SWEEP_ENV, swept.to_json())
    assert sweep.job_checkpoint_dir("/a", "s/checkpoint.dir=_a") == "/a"  # each job names its own
