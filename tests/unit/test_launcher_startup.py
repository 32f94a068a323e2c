"""The driver's start-up shortcuts in framework/driver/launcher.py: when the rank server may start before
the config is read, and torch's rendezvous event names from frames instead of ``inspect.stack()``."""

from __future__ import annotations

import pytest

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
