"""The typed launch object: what the driver hands the ranks crosses the launch file unchanged, and a
rank reads it without validating the config again; a shrink re-resolves in the driver."""

from __future__ import annotations

from pathlib import Path

import pytest

from framework.base.config.schema import ConfigError
from framework.base.faults.schedule import build_schedule
from framework.base.launch import LaunchSpec
from framework.driver.faults.supervisor import resolve_shrunk
from framework.driver.validate import load_run_config, validate


def _resolved(compose, *overrides):
    return validate(load_run_config(compose("checkpoint=none", "tracking=none", *overrides)))


def test_the_launch_object_crosses_the_launch_file_unchanged(compose, tmp_path):
    resolved = _resolved(
        compose, "parallelism=ddp", "parallelism.world_size=2", "fault=rank_crash", "resilience=shrink"
    )
    launch = LaunchSpec(
        resolved=resolved,
        run_dir=tmp_path / "run",
        mlflow_run_id="abc",
        resume_from=None,
        token_cache_dir=str(tmp_path / "cache"),
        fault_schedule=build_schedule(resolved.run, 2),
        launch_index=1,
        shrunk_at_step=10,
    )
    back = LaunchSpec.read(launch.write(tmp_path / "run" / "launch.json"))
    assert back == launch
    assert back.fault_schedule and isinstance(back.run_dir, Path)


def test_a_rank_reads_the_launch_object_without_validating(compose, tmp_path, monkeypatch):
    import framework.driver.validate as validate_module

    launch = LaunchSpec(
        resolved=_resolved(compose, "parallelism=pp", "trainer.micro_batch_size=4"),
        run_dir=tmp_path,
        mlflow_run_id=None,
        resume_from=None,
        token_cache_dir=str(tmp_path),
    )
    text = launch.to_json()

    def refuse(run):
        raise AssertionError("a rank validated the config again")

    monkeypatch.setattr(validate_module, "validate", refuse)
    assert LaunchSpec.from_json(text) == launch


def test_a_shrink_re_resolves_the_run_at_a_smaller_world_size(compose):
    resolved = _resolved(
        compose,
        "parallelism=ddp",
        "parallelism.world_size=4",
        "trainer.micro_batch_size=2",
        "trainer.global_batch_size=16",
        "trainer.grad_accum_steps=null",
        "resilience=shrink",
        "resilience.min_world_size=1",
    )
    shrunk = resolve_shrunk(resolved.run, resolved.world_size)
    # 3 ranks do not divide 16 sequences in micro-batches of 2: the next size that does is 2
    assert shrunk.world_size == 2 and shrunk.global_batch_size == 16 and shrunk.grad_accum_steps == 4
    assert shrunk.micro_batch_size == 2 and shrunk.run.fault.events == []
    with pytest.raises(ConfigError, match="dp degrees tried: none"):
        resolve_shrunk(shrunk.run, 1)


@pytest.mark.slow  # starts Python processes (the fast tier leaves it out)
def test_a_process_exits_although_a_daemonic_child_ignores_sigterm(tmp_path):
    """Loader workers ignore the preemption signals; multiprocessing's exit handler terminates (SIGTERM) and
    joins daemonic children, which then waited forever: exit_process kills them first."""
    import subprocess
    import sys
    import textwrap

    script = tmp_path / "exits.py"
    script.write_text(
        textwrap.dedent("""
        import multiprocessing, signal, time
        from framework.base.process_exit import exit_process

        def idle():
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            time.sleep(600)

        if __name__ == "__main__":
            child = multiprocessing.get_context("fork").Process(target=idle, daemon=True)
            child.start()
            time.sleep(0.5)
            exit_process(0)
    """)
    )
    done = subprocess.run([sys.executable, str(script)], timeout=60, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
