"""No host-device synchronisation in a training step except where the run logs or validates
(``trainer.count_host_syncs``: framework/rank/callbacks/host_syncs.py, framework/rank/metrics/syncs.py).

The counter records every ``.item()``, ``.tolist()``, ``.cpu()``, ``bool()``/``float()``/``int()`` of a
tensor between one optimizer step's first batch and the next's, on CPU ranks: the same calls on a
GPU make the host wait for the device. A step with neither logging nor validation has none
(4 micro-batches of gradient accumulation each, fused AdamW, norm clipping); the logging steps
have some (the loss, the gradient norm, memory), which shows the counter sees them. ``single``
runs in bf16 autocast on the CPU (the GPU path: fused AdamW and norm clipping under AMP).
"""

from __future__ import annotations

import json

import pytest

from tests.integration.conftest import shared_run

pytestmark = pytest.mark.slow

LOG_EVERY, VAL_EVERY, STEPS = 4, 3, 8


PLUGINS = ("single", "fsdp")
for _plugin in PLUGINS:
    shared_run(
        f"syncs-{_plugin}",
        f"parallelism={_plugin}",
        "model=llama_tiny",
        "tracking=none",
        "checkpoint=none",
        "trainer.global_batch_size=8",
        "trainer.micro_batch_size=2" if _plugin == "single" else "trainer.micro_batch_size=1",
        "trainer.grad_accum_steps=null",
        f"trainer.max_steps={STEPS}",
        f"trainer.log_every_n_steps={LOG_EVERY}",
        f"trainer.val_every_n_steps={VAL_EVERY}",
        "trainer.val_sequences=16",
        "trainer.count_host_syncs=true",
        "trainer.precision=bf16-mixed" if _plugin == "single" else "trainer.precision=32-true",
        used_by=__name__,
    )


@pytest.mark.parametrize("plugin", PLUGINS)
def test_steps_without_logging_read_nothing_back(shared_runs, plugin):
    name = f"syncs-{plugin}"
    doc = json.loads((shared_runs.run_dir(name) / "host_syncs.json").read_text())
    counts = {int(s): v["count"] for s, v in doc.items()}
    assert sorted(counts) == list(range(1, STEPS + 1))
    quiet = [s for s in counts if s % LOG_EVERY and s % VAL_EVERY]
    assert quiet == [1, 2, 5, 7]
    assert {s: doc[str(s)]["sites"] for s in quiet if counts[s]} == {}, (
        "host syncs on steps without logging or validation"
    )
    for s in (LOG_EVERY, 2 * LOG_EVERY):  # the logged loss and gradient norm are read back there
        sites = " ".join(doc[str(s)]["sites"])
        assert counts[s] >= 2 and "step_metrics.py" in sites, doc[str(s)]
    logged = [r for r in shared_runs.records(name) if "train/grad_norm" in r]
    assert [int(r["step"]) for r in logged] == [LOG_EVERY, 2 * LOG_EVERY]
    assert (
        all(0 < r["train/grad_norm"] < float("inf") for r in logged)
        and logged[-1]["train/loss"] < logged[0]["train/loss"]
    )
