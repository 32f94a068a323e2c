"""tp/pp plugins end to end on CPU ranks (gloo): loss parity with `single`, bytes == cost model, bubble, sweeps.

Every layout trains 15 steps at global batch 8 and must reproduce the per-step losses of
`single` (micro-batch 8; the session's reference run, tests/integration/conftest.py) to a relative
1e-5 (fp32: ~100x the observed rounding noise, 1e-7 to 8e-7). Measured communication (DTensor's
functional collectives, the pipeline's sends, the tied-embedding all-reduce) must equal the cost
model byte for byte at every logged step.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from mlflow.tracking import MlflowClient

from tests.integration.conftest import job_runs, losses, shared_run

pytestmark = pytest.mark.slow

PARITY_RTOL = 1e-5
COMMON = [
    "trainer.max_steps=15",
    "trainer.log_every_n_steps=5",
    "trainer.val_every_n_steps=1000",
    "trainer.val_sequences=16",
    "checkpoint=none",
    "tracking=none",
    "trainer.global_batch_size=8",
    "trainer.grad_accum_steps=null",
]
B, S, H, L, V = 8, 64, 128, 4, 1024  # global batch, seq_len (SMALL_DATA), gpt_tiny's d_model / n_layer, vocab


LAYOUTS = {
    "tp2": ["parallelism=tp", "trainer.micro_batch_size=4"],
    "tp2sp": ["parallelism=tp", "parallelism.sequence_parallel=true", "trainer.micro_batch_size=4"],
    **{
        f"pp2-{schedule}": [
            "parallelism=pp",
            f"parallelism.schedule={schedule}",
            f"parallelism.virtual_stages={v}",
            f"trainer.micro_batch_size={mbs}",
        ]
        for schedule, v, mbs in (("gpipe", 1, 4), ("1f1b", 1, 4), ("interleaved_1f1b", 2, 2))
    },
    "dp2pp2": ["parallelism=pp", "trainer.micro_batch_size=2", "parallelism.world_size=4"],
    "tp4": ["parallelism=tp", "parallelism.world_size=4", "parallelism.tp_degree=4", "trainer.micro_batch_size=4"],
}
"""The layouts this module trains with :data:`COMMON` (run name -> overrides)."""

# dp 2 x tp 2, every step logged and every other one with a validation pass
DP2TP2 = [
    "parallelism=tp",
    "parallelism.world_size=4",
    "trainer.micro_batch_size=2",
    *[o for o in COMMON if not o.startswith(("trainer.log_every", "trainer.val_every"))],
    "trainer.log_every_n_steps=1",
    "trainer.val_every_n_steps=2",
    "trainer.warmup_steps_excluded=1",
]


for _name, _overrides in {**{n: [*o, *COMMON] for n, o in LAYOUTS.items()}, "dp2tp2": DP2TP2}.items():
    shared_run(_name, *_overrides, used_by=__name__)  # the session's batch runs them (conftest.shared_run)


@pytest.fixture(scope="module")
def mrun(shared_runs, single_ref) -> SimpleNamespace:
    """The module's layouts (the session's shared runs: ``conftest.shared_run``, one driver and rank server per lane
    of the batch instead of per run): ``records``: run name -> metric records; ``ref``: the `single` reference
    run's records."""
    return SimpleNamespace(records={n: shared_runs.records(n) for n in [*LAYOUTS, "dp2tp2"]}, ref=single_ref)


def _assert_parity(r: SimpleNamespace, name: str, records: list[dict], steps: tuple[int, ...] = (5, 10, 15)) -> None:
    ref = losses(r.ref)
    got = losses(records)
    assert sorted(got) == list(steps)
    assert min(ref.values()) < ref[1] - 0.5, "the reference must learn for the comparison to mean anything"
    for step, loss in got.items():
        assert loss == pytest.approx(ref[step], rel=PARITY_RTOL), f"{name} step {step}"


def _comm(records: list[dict]) -> list[dict]:
    """Logged comm records; measured == model for the total and each kind (exactly)."""
    recs = [r for r in records if "perf/comm_bytes" in r]
    assert recs
    for r in recs:
        kinds = {
            k[len("perf/comm_bytes_") : -len("_model")]
            for k in r
            if k.startswith("perf/comm_bytes_") and k.endswith("_model")
        } - {""}
        assert kinds - {"wire"}, "at least one collective kind is modelled"
        for kind in kinds:  # each kind, and "wire" (ring bytes on the wire)
            assert r[f"perf/comm_bytes_{kind}"] == r[f"perf/comm_bytes_{kind}_model"], kind
        assert r["perf/comm_bytes"] == r["perf/comm_bytes_model"] > 0
        assert r["mem/model_states_bytes"] == r["mem/model_states_bytes_model"]
    return recs


def test_tp2_with_and_without_sequence_parallel(mrun):
    act = 4 * S * H * 4  # one micro-batch's b*s*h activations in fp32 bytes (micro-batch 4, 2 per step)
    recs = mrun.records["tp2"]
    _assert_parity(mrun, "tp2", recs)
    for r in _comm(recs):
        assert r["perf/comm_bytes_allreduce"] == 2 * 4 * L * act  # 2 micro-batches x 4 all-reduces per layer
        assert r["perf/comm_bytes_wire"] == r["perf/comm_bytes"]  # ring all-reduce on 2 ranks: 2(n-1)/n = 1
    recs = mrun.records["tp2sp"]
    _assert_parity(mrun, "tp2sp", recs)
    for r in _comm(recs):
        assert r["perf/comm_bytes_allgather"] == 2 * (4 * L + 2) * act
        assert r["perf/comm_bytes_reduce_scatter"] == 2 * 4 * L * act
        assert r["perf/comm_bytes_allreduce"] == L * 4 * H * 4  # LayerNorm weight+bias gradients, once per step


@pytest.mark.parametrize("schedule, v, mbs", [("gpipe", 1, 4), ("1f1b", 1, 4), ("interleaved_1f1b", 2, 2)])
def test_pp2_schedules(mrun, schedule, v, mbs):
    name = f"pp2-{schedule}"
    recs = mrun.records[name]
    _assert_parity(mrun, name, recs)
    m = B // mbs
    for r in _comm(recs):
        # rank 0 sends forward from each chunk but the last stage and backward from each but the first: 2v-1 per micro-batch
        assert r["perf/comm_bytes_p2p"] == (2 * v - 1) * m * mbs * S * H * 4
        assert r["perf/comm_bytes_allreduce"] == V * H * 4  # the tied embedding's gradient sync
    bubble = [r for r in recs if "perf/pp_bubble_frac" in r]
    assert bubble
    for r in bubble:
        assert r["perf/pp_bubble_frac_model"] == pytest.approx(1 / (v * m + 1))
        assert 0.0 < r["perf/pp_bubble_frac"] <= r["perf/pp_bubble_frac_max"] < 1.0


def test_four_rank_layouts(mrun):
    # (dp2 x tp2: the next test; tp2 x pp2: the conformance suite's tp2pp2 case, loss_parity and bytes)
    recs = mrun.records["dp2pp2"]
    _assert_parity(mrun, "dp2pp2", recs)
    logged = _comm(recs)
    # The run's record (written after the last validation, which leaves the first stage's FSDP2 root
    # unit gathered) keeps the largest logged step's model states, the modelled figure.
    (end,) = [r for r in recs if "mem/model_states_bytes" in r and "mem/model_states_bytes_model" not in r]
    assert end["mem/model_states_bytes"] == logged[-1]["mem/model_states_bytes_model"]
    # TP 4: the same payload per rank as TP 2, 1.5x the ring bytes on the wire (2(t-1)/t).
    recs = mrun.records["tp4"]
    _assert_parity(mrun, "tp4", recs)
    recs = _comm(recs)
    tp2 = [r for r in mrun.records["tp2"] if "perf/comm_bytes" in r]
    assert tp2
    for r, r2 in zip(recs, tp2):
        assert r["perf/comm_bytes"] == r2["perf/comm_bytes"]
        assert r["perf/comm_bytes_wire"] == 1.5 * r2["perf/comm_bytes_wire"]


def test_dp2tp2_parity_and_fsdp_bytes_on_steps_with_validation_equal_the_model(mrun):
    """dp 2 x tp 2 (4 ranks): `single`'s losses and the modelled bytes at every step, every other one with a
    validation pass. FSDP2 keeps its root unit (embeddings, ln_f) gathered after a forward; after a validation
    pass the next step skipped that all-gather (656,384 bytes under the model) until the root was resharded
    after evaluation forwards. Validation every 2 steps, so every step from 2 on follows or holds one."""
    recs = mrun.records["dp2tp2"]
    _assert_parity(mrun, "dp2tp2", recs, steps=tuple(range(1, 16)))
    assert set(range(2, 15, 2)) <= {int(r["step"]) for r in recs if "val/loss" in r}
    assert sorted(int(r["step"]) for r in _comm(recs)) == list(range(2, 16))


def test_multirun_tp_pp_records_two_finished_runs(runner):
    runner.run(
        "-m", "parallelism=tp,pp", "trainer.max_steps=6", "trainer.val_sequences=16"
    )  # the default checkpoint policy (interval)
    client = MlflowClient(tracking_uri=f"sqlite:///{runner.workdir}/mlruns.db")
    runs = job_runs(client, "default")  # the sweep's parent left out
    by_plugin = {r.data.tags["plugin"]: r for r in runs}
    assert set(by_plugin) == {"tp", "pp"} and len(runs) == 2
    assert by_plugin["tp"].data.tags["layout"] == "dp1-tp2-pp1" and by_plugin["pp"].data.tags["layout"] == "dp1-tp1-pp2"
    for r in runs:
        assert r.info.status == "FINISHED"
        assert r.data.params["derived.global_batch_size"] == "16"
        for key in ("train/loss", "val/loss", "perf/tokens_per_sec", "perf/comm_bytes", "perf/comm_bytes_model"):
            assert key in r.data.metrics, key
        assert r.data.metrics["perf/comm_bytes"] == r.data.metrics["perf/comm_bytes_model"]
    assert (
        "perf/pp_bubble_frac" in by_plugin["pp"].data.metrics
        and "perf/pp_bubble_frac_model" in by_plugin["pp"].data.metrics
    )
    # save_last wrote one sharded (DCP) checkpoint of step 6 per run
    manifests = [json.loads(p.read_text()) for p in runner.workdir.glob("checkpoints/**/step00000006/manifest.json")]
    assert sorted((m["layout"]["tp"], m["layout"]["pp"]) for m in manifests) == [(1, 2), (2, 1)], manifests
    assert all(m["kind"] == "dcp" for m in manifests)


def test_bad_layout_fails_before_any_rank_with_one_line(runner):
    proc = runner.run(
        "parallelism=tp", "parallelism.tp_degree=3", "parallelism.world_size=3", "checkpoint=none", check=False
    )
    assert proc.returncode == 2
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert lines == [
        "trainlab: error: parallelism.tp_degree=3 must divide model.n_head=4, model.d_model=128 and the MLP"
        " width 512 (allowed: a common divisor)"
    ]
    assert not list(runner.workdir.glob("outputs/**/launch.json"))
