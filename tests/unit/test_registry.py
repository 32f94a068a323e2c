"""Plugin registry: entry-point discovery, duplicates, unknown names, the protocol."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from framework.base.config.schema import ConfigError, ParallelConfig
from framework.base.plugin import ParallelPlugin
from framework.base.registry import available_plugins, get_plugin_class, register_plugin
from framework.driver.cli import check_group_choices
from tests.conftest import CONF_DIR


@pytest.mark.parametrize("name", ["single", "ddp", "fsdp", "deepspeed"])
def test_builtin_plugins_come_from_entry_points_and_conf(name):
    assert name in available_plugins()
    cls = get_plugin_class(name)
    assert cls.name == name
    assert issubclass(cls.config_cls, ParallelConfig)
    assert isinstance(cls(cls.config_cls()), ParallelPlugin)
    presets = [p for p in (CONF_DIR / "parallelism").glob("*.yaml") if f"name: {name}\n" in p.read_text()]
    assert presets, "every plugin has a conf/parallelism/*.yaml preset (deepspeed: zero1, zero2, zero3)"


def test_unknown_plugin_lists_available_names():
    with pytest.raises(ConfigError, match=r"parallelism.name='zero9' is not a known plugin; available: .*ddp.*single"):
        get_plugin_class("zero9")


def test_registering_a_second_class_under_a_taken_name_fails():
    @dataclass
    class Cfg(ParallelConfig):
        name: str = "ddp"

    class Impostor(ParallelPlugin):
        name = "ddp"
        config_cls = Cfg

    get_plugin_class("ddp")  # the real one, registered first
    with pytest.raises(ValueError, match="registered twice"):
        register_plugin(Impostor)


def test_a_class_that_is_not_a_plugin_is_refused():
    class Loose:  # the old duck-typed shape: a name and a config class, no contract
        name = "loose"
        config_cls = ParallelConfig

    with pytest.raises(TypeError, match="is not a subclass of framework.base.plugin.ParallelPlugin"):
        register_plugin(Loose)


def test_unknown_group_option_is_one_line_before_hydra(capsys):
    with pytest.raises(SystemExit) as info:
        check_group_choices(["parallelism=single,zero9", "trainer.max_steps=3"])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert (
        err
        == "trainlab: error: parallelism='zero9' is not an option of config group 'parallelism'; available: ddp, fsdp, pp, single, tp, zero1, zero2, zero3"
    )
    check_group_choices(["parallelism=single,ddp", "model=gpt2_124m", "experiment=null", "data.paths=[a,b]"])  # fine


@pytest.mark.slow  # starts Python processes (the fast tier leaves it out)
def test_a_second_driver_on_the_same_run_is_refused(tmp_path):
    import os
    import subprocess
    import sys

    from framework.driver.runs import hold_lock

    held = hold_lock(tmp_path, "run")
    try:
        code = f"from pathlib import Path; from framework.driver.runs import hold_lock; hold_lock(Path({str(tmp_path)!r}), 'run')"
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2
        assert f"another trainlab process (pid {os.getpid()}) is running in {tmp_path} (the same run)" in proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1
    finally:
        held.close()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0  # free again once the holder lets go


@pytest.mark.slow  # starts Python processes (the fast tier leaves it out)
def test_the_driver_imports_plugins_without_lightning():
    """The driver loads the plugin of the run (pre-check, cost model) but never trains: importing a built-in
    plugin must leave Lightning (about 2.5 s of CPU per process) to the ranks."""
    import subprocess
    import sys

    code = (
        "import sys; from framework.base.registry import available_plugins, get_plugin_class;"
        "[get_plugin_class(n) for n in available_plugins()];"
        "print(sorted(m for m in ('pytorch_lightning', 'lightning_fabric', 'deepspeed') if m in sys.modules))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert proc.stdout.strip() == "[]", proc.stdout
