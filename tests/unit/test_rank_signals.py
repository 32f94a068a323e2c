"""A rank's signal dispositions do not depend on what it inherited (framework.callbacks.preemption)."""

from __future__ import annotations

import signal
import subprocess
import sys

CHILD = """
import signal
from framework.callbacks.preemption import install_handlers
assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN, "the test starts the child with SIGINT ignored"
install_handlers()
print(signal.getsignal(signal.SIGINT) is signal.default_int_handler,
      signal.getsignal(signal.SIGTERM).__name__, signal.getsignal(signal.SIGUSR1).__name__)
"""


def test_a_rank_started_with_sigint_ignored_still_stops_on_ctrl_c():
    """A shell's background job (and a rank forked from the preload server) starts with SIGINT ignored; the
    rank's handlers give it KeyboardInterrupt back (Lightning's graceful stop), and the preemption flag for
    SIGTERM/SIGUSR1. Without it, a Ctrl-C'd run's ranks trained on until the agent killed them."""
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120, check=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)).stdout.split()
    assert out == ["True", "_on_signal", "_on_signal"]
