"""A failed launch's reason is its root cause: the first rank to fail, its exit code or signal and the
last line of its exception (framework/driver/faults/supervisor.py), not the first line of torch elastic's banner."""

from __future__ import annotations

import json

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from framework.driver.faults.supervisor import failure_reason


def _raised(tmp_path, rank: int, t: int, text: str) -> ProcessFailure:
    path = tmp_path / f"error{rank}.json"
    path.write_text(
        json.dumps(
            {
                "message": {
                    "message": text.splitlines()[-1],
                    "extraInfo": {
                        "py_callstack": f'Traceback (most recent call last):\n  File "worker.py", line 1\n{text}\n',
                        "timestamp": str(t),
                    },
                }
            }
        )
    )
    return ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=1, error_file=str(path))


def _killed(rank: int, t: int) -> ProcessFailure:
    f = ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=-9, error_file="<N/A>")
    f.timestamp = t  # the agent's clock when it noticed (no error file)
    return f


def test_a_sigkilled_rank_is_the_root_cause_not_the_peer_that_raised_first(tmp_path):
    # the issue's case: rank 1 SIGKILLed; rank 0's gloo op raised (its record is a second earlier)
    peer = _raised(
        tmp_path,
        0,
        1_700_000_000,
        "RuntimeError: [gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1234",
    )
    err = ChildFailedError("worker", {0: peer, 1: _killed(1, 1_700_000_001)})
    assert str(err).strip().splitlines()[0].startswith("=====")  # what the reason used to be
    assert err.get_first_failure()[0] == 0  # and the rank torch's banner names
    assert (
        failure_reason(err) == "rank 1 (pid 1001) was killed by SIGKILL (exit code -9); 1 other rank(s) failed after it"
    )


def test_the_first_rank_to_raise_is_named_with_the_last_line_of_its_exception(tmp_path):
    first = _raised(tmp_path, 1, 1_700_000_000, "ValueError: bad\nRuntimeError: loss diverged at step 7")
    later = _raised(tmp_path, 0, 1_700_000_005, "RuntimeError: Connection reset by peer")
    assert failure_reason(ChildFailedError("worker", {0: later, 1: first})) == (
        "rank 1 (pid 1001) exited with code 1: RuntimeError: loss diverged at step 7; 1 other rank(s) failed after it"
    )
    # within the 1 s resolution, a rank whose exception is its own comes before one that lost its peer
    peer = _raised(tmp_path, 0, 1_700_000_000, "RuntimeError: Connection reset by peer")
    own = _raised(tmp_path, 1, 1_700_000_001, "torch.OutOfMemoryError: CUDA out of memory")
    assert failure_reason(ChildFailedError("worker", {0: peer, 1: own})).startswith(
        "rank 1 (pid 1001) exited with code 1: torch.OutOfMemoryError: CUDA out of memory"
    )


def test_the_exception_line_is_found_past_the_cpp_frames_torch_appends(tmp_path):
    gloo = (
        "RuntimeError: [gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:3995: Connection reset by peer.\n\n"
        "At:\n  /x/default_hooks.py(31): <lambda>\n\n\nAt:\n  /x/plugins/ddp.py(57): done"
    )
    f = _raised(tmp_path, 1, 1_700_000_000, gloo)
    assert failure_reason(ChildFailedError("worker", {1: f})) == (
        "rank 1 (pid 1001) exited with code 1: RuntimeError: [gloo/transport/tcp/pair.cc:537] Read error"
        " [127.0.0.1]:3995: Connection reset by peer."
    )


def test_a_silent_exit_and_other_errors():
    silent = ProcessFailure(local_rank=0, pid=7, exitcode=43, error_file="<N/A>")
    assert (
        failure_reason(ChildFailedError("worker", {2: silent}))
        == "rank 2 (pid 7) exited with code 43 (no exception recorded)"
    )
    assert failure_reason(RuntimeError("=====\nrendezvous timed out\n=====")) == "rendezvous timed out"
    assert failure_reason(RuntimeError()) == "RuntimeError"
