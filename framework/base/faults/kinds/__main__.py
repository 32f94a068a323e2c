"""``python -m framework.base.faults.kinds``: the registered fault kinds, one line each (name: summary)."""

from framework.base.faults.kinds import fault_kinds

for name, kind in sorted(fault_kinds().items()):
    print(f"{name}: {kind.summary}")
