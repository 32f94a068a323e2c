"""Fault injection, detection and recovery (config groups ``fault`` and ``resilience``).

- :mod:`.schedule`: the fault schedule (listed events + a seeded MTBF process) and the
  cross-field config checks that run before any rank starts.
- :mod:`.events`: the run's fault log (``<run_dir>/faults.jsonl``), written by the ranks and
  read by the driver; it outlives restarts, so a fired event never fires again.
- :mod:`.kinds`: the fault-kind registry, one module per kind (NaN gradients, Inf/spiked loss,
  garbage batches, crashed/hung/slow ranks, failed and corrupt checkpoints), discovered.
- :mod:`.inject`: the injector callback that fires the scheduled events through their kinds.
- :mod:`.detect`: per-step health (all-gathered, so every rank decides the same), running
  statistics for spikes, straggler skew, the hang watchdog.
- :mod:`.guard`: the policy callback (skip the step, roll back to the in-memory snapshot, abort).
- :mod:`.supervisor`: the driver's side (restart and shrink relaunches, resume of restarted ranks).
- :mod:`.accounting`: recovery figures from the fault log (``fault/*``, ``recovery/*``, ``goodput``).
- :mod:`.report`: the recovery table of the compare report.
"""
