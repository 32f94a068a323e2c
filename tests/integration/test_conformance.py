"""The conformance suite (framework/testing/conformance.py) for the built-in plugins.

Every check runs the real driver on CPU ranks; the ``single`` reference run is shared by all
plugins (session fixture). A new plugin is one more ``PluginCase`` line.
"""

from __future__ import annotations

import pytest

from framework.testing.conformance import PluginCase, conformance, conformance_params  # noqa: F401 (fixture)

pytestmark = pytest.mark.slow

CASES = [
    PluginCase("ddp", select=("parallelism=ddp",)),
    # fsdp at 2 ranks resumes at 1 rank as plain `single` and as fsdp world_size=1 (and from single).
    PluginCase("fsdp", select=("parallelism=fsdp",),
               resume_as=(("parallelism=single",), ("parallelism=fsdp", "parallelism.world_size=1"))),
    # ZeRO-2-like FSDP: one all-gather per micro-batch instead of two; the numbers must still add up.
    PluginCase("fsdp-noreshard", select=("parallelism=fsdp", "parallelism.reshard_after_forward=false"),
               checks=("loss_parity", "bytes")),
]


@pytest.mark.parametrize("case,check", conformance_params(CASES))
def test_conformance(conformance, case, check):  # noqa: F811 (the fixture)
    conformance.check(case, check)
