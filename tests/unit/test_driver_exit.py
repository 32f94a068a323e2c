"""How the driver's command line ends (framework/driver/cli.py ``main``): its exit status and last line."""

from __future__ import annotations

import sys

import pytest

from framework.driver import cli


class _Exited(Exception):
    """Raised instead of ending the test process (:func:`framework.base.process_exit.exit_process`)."""


def test_ctrl_c_before_training_starts_exits_130_in_one_line(monkeypatch, capsys):
    """Ctrl-C while the driver composes, validates or imports (before any rank): status 130 and one line, as
    documented, not a traceback of the exit path itself (found by a new user's Ctrl-C 1.5 s after starting)."""

    def interrupted(argv):
        raise KeyboardInterrupt

    def exit_process(code):
        raise _Exited(code)

    monkeypatch.setattr(sys, "argv", ["framework.train", "trainer.preload_ranks=false"])  # no rank server
    monkeypatch.setattr(cli, "precheck", interrupted)
    monkeypatch.setattr("framework.base.process_exit.exit_process", exit_process)
    with pytest.raises(_Exited) as ended:
        cli.main(lambda: None)
    assert ended.value.args == (130,)
    assert capsys.readouterr().err.splitlines() == ["trainlab: interrupted before training started"]
