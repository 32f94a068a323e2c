"""The configuration is composed and validated once per run (issue 26): the driver's precheck of a single run
composes it as Hydra's job and validates it, and the job runs with that composition; a sweep's check of its
jobs validates them; the job that then starts reuses that validation, renamed."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser

import framework.driver.cli  # noqa: F401  (registers the run-name resolver)
import framework.driver.validate as validate_module
from framework.base.config import CONF_DIR
from framework.base.config.schema import ConfigError
from framework.driver import runs


@pytest.fixture()
def validations(monkeypatch):
    """Count calls of :func:`framework.driver.validate.validate` (the whole cross-field validation);
    forget the runs this process validated before the test."""
    calls: list[str] = []
    real = validate_module.validate

    def counting(run, **kwargs):
        calls.append(run.run_name)
        return real(run, **kwargs)

    monkeypatch.setattr(validate_module, "validate", counting)
    monkeypatch.setattr(runs, "_VALIDATED", [])
    return calls


def _job_cfg(*overrides: str):
    """The config Hydra composes for a job (its own run name, as ``tl_run_name`` gives it)."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=[*overrides, "run_name=the_job"])


def test_a_single_run_is_validated_once(validations, monkeypatch):
    """Precheck, then the job's own resolution in the driver (:func:`framework.driver.train._resolve`): one validation."""
    from framework.driver import train

    monkeypatch.setattr(
        "framework.driver.launcher.start_rank_server", lambda resolved: None
    )  # no rank server in a unit test
    argv = ["parallelism=single", "trainer.max_steps=2"]
    pre = framework.driver.cli.precheck(argv).resolved
    resolved, _, _ = train._resolve(_job_cfg(*argv))
    assert len(validations) == 1, f"validated {len(validations)} times in one run: {validations}"
    assert validations == [pre.run.run_name] == ["parallelism=single"]  # Hydra's name for it (max_steps: excluded)
    # the job's own name and folder, the precheck's validation
    assert resolved.run.run_name == "the_job" and resolved.checkpoint_dir.endswith("/the_job")
    assert (resolved.layout, resolved.global_batch_size, resolved.threads_per_rank) == (
        pre.layout,
        pre.global_batch_size,
        pre.threads_per_rank,
    )


def test_another_configuration_is_validated_again(validations):
    """Only the same run (up to its name and checkpoint folder) reuses a validation."""
    runs.resolve_run(_job_cfg("parallelism=single", "trainer.max_steps=2"))
    runs.resolve_run(_job_cfg("parallelism=single", "trainer.max_steps=3"))
    assert len(validations) == 2
    with pytest.raises(ConfigError):  # a refused run is not remembered as valid
        runs.resolve_run(_job_cfg("parallelism=single", "trainer.micro_batch_size=3", "trainer.global_batch_size=4"))
    with pytest.raises(ConfigError):
        runs.resolve_run(_job_cfg("parallelism=single", "trainer.micro_batch_size=3", "trainer.global_batch_size=4"))
    assert len(validations) == 4


def test_a_sweep_job_checked_before_the_sweep_is_validated_once(validations):
    """:func:`framework.driver.sweep.check_jobs` validates the first job that holds; that job then resolves without validating."""
    from framework.driver.sweep import check_jobs

    fixed = ["parallelism=single", "trainer.max_steps=2"]
    swept = {o.key_or_group: o for o in OverridesParser.create().parse_overrides(["optim.lr=0.001,0.002"])}
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        assert check_jobs(fixed, swept) == ""
    assert len(validations) == 1
    resolved = runs.resolve_run(_job_cfg(*fixed, "optim.lr=0.001"))
    assert len(validations) == 1, f"the first job was validated {len(validations)} times: {validations}"
    assert resolved.run.optim.lr == 0.001 and resolved.run.run_name == "the_job"


def test_a_single_run_is_composed_once_and_its_job_gets_that_composition(validations, monkeypatch, tmp_path):
    """Precheck, then the job (:meth:`framework.driver.cli.SingleRun.run`): one Hydra composition, one validation;
    the job sees the composed config (less its ``hydra`` node), Hydra's output folder and ``.hydra/`` files."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    composed: list[list[str]] = []
    real = ConfigLoaderImpl.load_configuration

    def counting(self, config_name, overrides, run_mode, from_shell=True, validate_sweep_overrides=True):
        composed.append(list(overrides))
        return real(self, config_name, overrides, run_mode, from_shell, validate_sweep_overrides)

    monkeypatch.setattr(ConfigLoaderImpl, "load_configuration", counting)
    monkeypatch.chdir(tmp_path)
    argv = ["parallelism=single", "trainer.max_steps=2", "tracking=none"]
    single = framework.driver.cli.precheck(argv)
    seen = {}

    def task(cfg):  # what @hydra.main's function gets
        seen["job"], seen["out"] = OmegaConf.to_container(cfg, resolve=True), HydraConfig.get().runtime.output_dir
        seen["global_hydra"] = GlobalHydra.instance().is_initialized()
        return 1.0

    def app():
        raise AssertionError("the decorated app is not called for a single run")

    app.__wrapped__ = task
    single.run(app)
    assert composed == [argv], composed  # once, with the command line's overrides
    assert len(validations) == 1
    job = seen["job"]
    assert "hydra" not in job and job["trainer"]["max_steps"] == 2 and job["run_name"] == single.resolved.run.run_name
    out = tmp_path / "outputs" / "default" / single.resolved.run.run_name
    assert seen["out"] == str(out) and seen["global_hydra"]
    hydra_yaml = OmegaConf.load(out / ".hydra" / "hydra.yaml").hydra
    assert hydra_yaml.mode == "RUN" and list(hydra_yaml.overrides.hydra) == ["hydra.mode=RUN"]
    assert list(hydra_yaml.overrides.task) == argv and hydra_yaml.job.name == "train"
    assert not GlobalHydra.instance().is_initialized()  # cleared after the job, as @hydra.main leaves it


def test_a_sweeping_preset_is_left_to_hydra_after_one_composition(monkeypatch):
    """An experiment preset with ``hydra.mode: MULTIRUN`` is not a single run: precheck returns None (its jobs are
    checked when the sweep starts), having composed once."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl

    calls = []
    real = ConfigLoaderImpl.load_configuration
    monkeypatch.setattr(
        ConfigLoaderImpl, "load_configuration", lambda self, *a, **k: calls.append(a) or real(self, *a, **k)
    )
    assert framework.driver.cli.precheck(["experiment=data_pipeline"]) is None
    assert len(calls) == 1
