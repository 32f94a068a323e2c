"""Start-up: the driver's shortcuts in framework/driver/launcher.py (when the rank server may start before
the config is read, torch's rendezvous event names from frames instead of ``inspect.stack()``), and a rank's
process start time on the wall clock (the goodput timeline's ``t_proc``)."""

from __future__ import annotations

import pytest

from framework.driver import launcher
from framework.driver.launcher import name_rendezvous_events_cheaply, preload_on_command_line


@pytest.mark.parametrize(
    "argv, early",
    [
        ([], True),
        (["parallelism=ddp", "trainer.max_steps=3"], True),
        (["-m", "parallelism=single,ddp"], True),
        (["--multirun", "hydra/launcher=basic", "optim.lr=1e-3,2e-3"], True),
        (["trainer.preload_ranks=false"], False),
        (["+trainer.preload_ranks=False"], False),
        (["trainer.preload_ranks=true"], True),
        (["-m", "hydra/launcher=submitit_slurm", "parallelism=single,ddp"], False),
        (["--help"], False),
        (["--cfg", "job"], False),
    ],
)
def test_the_rank_server_starts_before_the_config_only_where_ranks_run_here(argv, early):
    assert preload_on_command_line(argv) is early


@pytest.mark.parametrize("argv", [["parallelism=ddp"], ["parallelism=ddp", "tracking=none"]])
def test_the_early_rank_server_preloads_the_rank_modules_and_never_mlflow(monkeypatch, argv):
    """Rank 0 writes its metrics to an outbox the driver sends (framework/base/tracking.py), so no rank needs MLflow."""
    import multiprocessing
    from multiprocessing import forkserver

    preloaded = []
    monkeypatch.setattr(multiprocessing, "set_forkserver_preload", lambda mods: preloaded.append(list(mods)))
    monkeypatch.setattr(forkserver, "ensure_running", lambda: None)
    for key, value in launcher.DRIVER_ENV_DEFAULTS.items():  # restored after the test
        monkeypatch.setenv(key, value)
    launcher.start_rank_server_early(argv)
    assert preloaded == [launcher.PRELOAD_MODULES]
    assert not any(m.startswith("mlflow") for m in launcher.PRELOAD_MODULES)


def test_rendezvous_event_names_match_torchs_own():
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    original = dynamic_rendezvous.get_method_name
    if getattr(original, "_trainlab", False):
        pytest.skip("patched already in this process")

    def named(get_name):
        def outer_caller():
            return inner_method()

        def inner_method():
            return get_name(), get_name(depth=1), get_name(depth=10_000)

        return outer_caller()

    expected = named(original)
    assert expected[0] == "outer_caller"  # torch's meaning of depth 2: the caller of the method that records
    name_rendezvous_events_cheaply()
    try:
        assert dynamic_rendezvous.get_method_name is not original
        assert named(dynamic_rendezvous.get_method_name) == expected
        patched = dynamic_rendezvous.get_method_name
        name_rendezvous_events_cheaply()  # idempotent
        assert dynamic_rendezvous.get_method_name is patched
    finally:
        dynamic_rendezvous.get_method_name = original


@pytest.mark.slow  # starts a Python process
def test_a_process_start_time_lies_between_the_clock_readings_around_its_creation():
    """The timeline's ``t_proc`` (framework/rank/callbacks/goodput.py) on the same clock as ``time.time()``:
    psutil's create_time was 0.93 s early on this machine (the boot time in whole seconds)."""
    import subprocess
    import sys
    import time

    code = "from framework.rank.callbacks.goodput import process_start_time; print(repr(process_start_time()))"
    before = time.time()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    after = time.time()
    t_proc = float(out)
    tick = 0.011  # one clock tick (10 ms) of /proc's start time, and rounding
    assert before - tick <= t_proc <= after, (before, t_proc, after)
    assert t_proc - before < 0.5, "created within half a second of the spawn (the child's imports come after)"
