"""A rank's signal dispositions do not depend on what it inherited (framework.rank.callbacks.preemption)."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # every test starts Python processes (the fast tier leaves them out)

CHILD = """
import os, signal
from framework.rank.callbacks.preemption import install_handlers, raise_if_interrupted
assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN, "the test starts the child with SIGINT ignored"
install_handlers()
print(signal.getsignal(signal.SIGINT).__name__,
      signal.getsignal(signal.SIGTERM).__name__, signal.getsignal(signal.SIGUSR1).__name__)
class Saved:  # Ctrl-C while a __del__ runs (in backward: the activation meter's saved tensors)
    def __del__(self):
        os.kill(os.getpid(), signal.SIGINT)
        sum(range(1000))  # the handler runs here; its KeyboardInterrupt is printed and dropped
Saved()
print("went-on")
try:
    raise_if_interrupted()
except KeyboardInterrupt:
    print("raised-again")
"""


def test_a_rank_started_with_sigint_ignored_still_stops_on_ctrl_c():
    """A shell's background job (and a rank forked from the preload server) starts with SIGINT ignored; the
    rank's handlers give it KeyboardInterrupt back (Lightning's graceful stop), and the preemption flag for
    SIGTERM/SIGUSR1. Without it, a Ctrl-C'd run's ranks trained on until the agent killed them. A KeyboardInterrupt
    dropped inside a ``__del__`` is raised again at the next micro-batch's end (raise_if_interrupted)."""
    out = subprocess.run(
        [sys.executable, "-c", CHILD],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    ).stdout.split()
    assert out == ["_on_interrupt", "_on_signal", "_on_signal", "went-on", "raised-again"]


SERVER = """
import signal, types
from multiprocessing import forkserver
from framework.driver.launcher import start_rank_server, stop_rank_server
signal.signal(signal.SIGTERM, lambda *a: None)
before = signal.getsignal(signal.SIGTERM)
run = types.SimpleNamespace(trainer=types.SimpleNamespace(preload_ranks=True, threads_per_rank=1), tracking=types.SimpleNamespace(enabled=False))
start_rank_server(types.SimpleNamespace(run=run, nproc_per_node=1, threads_per_rank=1))
pid = forkserver._forkserver._forkserver_pid
ignored = int(open(f"/proc/{pid}/status").read().split("SigIgn:")[1].split()[0], 16)
print(*[bool(ignored >> (s - 1) & 1) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)],
      signal.getsignal(signal.SIGTERM) is before)
stop_rank_server()
"""


def test_the_rank_server_ignores_preemption_signals_sent_to_the_process_group():
    """The preload server shares the driver's process group and its ranks die with it: a scheduler's SIGTERM
    or Slurm's SIGUSR1/SIGUSR2 to every process must not end it before the ranks save. It starts with them
    ignored; the driver keeps its own handlers."""
    out = subprocess.run([sys.executable, "-c", SERVER], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.split() == ["True", "True", "True", "True"], out.stderr[-2000:]


AGREE = """
import os, signal, sys, json
import torch.distributed as dist
from framework.rank.callbacks.preemption import _Received, agree_on_signal
rank = int(sys.argv[1])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[2]}", rank=rank, world_size=2)
if rank == 1:  # the signal reached rank 1 only (e.g. scancel --signal to the job's tasks), in its 7th step
    _Received.signum, _Received.t, _Received.steps_done = int(signal.SIGUSR2), 1700000000.25, 6
print(json.dumps(agree_on_signal()))
dist.destroy_process_group()
"""


def test_rank_0_records_the_signal_time_and_step_when_only_another_rank_got_it():
    """Rank 0 writes the preemption record: it used its own receipt, so a signal that reached rank 1 only
    left ``t_signal`` and ``step_at_signal`` null (issue 23, item 10)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    procs = [
        subprocess.Popen([sys.executable, "-c", AGREE, str(r), port], stdout=subprocess.PIPE, text=True) for r in (0, 1)
    ]
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert outs == ["[12, 1700000000.25, 6]"] * 2
