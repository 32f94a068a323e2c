"""The fault x policy matrix end to end (framework/base/testing/fault_matrix.py): every fault kind under every
policy that claims to handle it, 20 cells in 6 single-rank runs of 11 steps that share two references,
two runs at a time (one thread each on 2 cores).

Prints the matrix as a markdown table (``pytest -s``); ``benchmarks/fault_matrix.py`` prints it too.
Measured on 2 CPU cores: 50 s (99.5 s one run at a time; runs: ref 13 s, ref_skip 13 s, skip_step 10 s, rollback 15 s,
restart 37 s, abort 11 s).
"""

from __future__ import annotations

import pytest

from framework.base.testing.fault_matrix import CELLS, evaluate, markdown, run_matrix

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def matrix(tmp_path_factory, data_cache):
    workdir = tmp_path_factory.mktemp("fault_matrix")
    runs = run_matrix(workdir, data_cache, lanes=2)
    outcomes = {(o.cell.fault, o.cell.policy): o for o in evaluate(runs)}
    print("\n" + markdown(list(outcomes.values()), runs))
    return outcomes


@pytest.mark.parametrize("cell", CELLS, ids=[f"{c.fault}-{c.policy}" for c in CELLS])
def test_fault_under_policy(matrix, cell):
    outcome = matrix[cell.fault, cell.policy]
    assert outcome.ok, f"{cell.fault} under {cell.policy} (run {cell.run}, step {cell.step}): {outcome.problems}"
