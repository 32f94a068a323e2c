"""DeepSpeed ZeRO 1-3 with bf16-mixed on 2 CPU ranks: the measured model states equal the cost
model's DeepSpeed accounting (framework.base.cost.memory.model_states_per_rank, accounting="deepspeed")
in mixed precision (bf16 weights and gradients, fp32 master + AdamW moments: K = 12)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.conftest import Runner

pytestmark = pytest.mark.slow

COMMON = [
    "trainer.max_steps=4",
    "trainer.log_every_n_steps=1",
    "trainer.warmup_steps_excluded=1",
    "trainer.global_batch_size=8",
    "trainer.grad_accum_steps=null",
    "trainer.val_sequences=16",
    "trainer.micro_batch_size=2",
    "trainer.precision=bf16-mixed",
    "checkpoint.save_last=False",
]


@pytest.fixture(scope="module")
def bf16_runs(tmp_path_factory, data_cache) -> Runner:
    runner = Runner(tmp_path_factory.mktemp("zero_bf16"), data_cache)
    runner.run("-m", "parallelism=zero1,zero2,zero3", *COMMON, timeout=1500)
    return runner


@pytest.mark.parametrize("stage", (1, 2, 3))
def test_bf16_model_states_match_deepspeeds_accounting(bf16_runs, stage):
    (path,) = (bf16_runs.workdir / "outputs" / "default").glob(f"*/parallelism=zero{stage}")
    name = str(Path(path).relative_to(bf16_runs.workdir / "outputs" / "default"))
    recs = [r for r in bf16_runs.metrics(name) if r.get("mem/model_states_bytes_model")]
    assert len(recs) >= 3
    # measured 10.0, 9.1, 8.0 x Psi for stages 1 (2 micro-batches), 2, 3 against 10, 9, 8 x Psi modelled
    for r in recs[1:]:  # the first sample (step 1) reads 8.0 x Psi for ZeRO-1/2, lower than every later step: left out
        assert r["mem/model_states_bytes"] == pytest.approx(r["mem/model_states_bytes_model"], rel=0.02), (stage, r)
