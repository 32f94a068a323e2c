"""The configuration is validated once per run (issue 26): the driver's precheck of a single run, or a
sweep's check of its jobs, validates it; the job that then starts reuses that validation, renamed."""

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
    pre = framework.driver.cli.precheck(argv)
    resolved, _, _ = train._resolve(_job_cfg(*argv))
    assert len(validations) <= 1, f"validated {len(validations)} times in one run: {validations}"
    assert validations == ["precheck"]
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
