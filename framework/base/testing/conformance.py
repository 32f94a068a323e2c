"""The conformance suite every parallelism plugin passes, runnable from pytest in a few lines.

Each check runs the real driver (``python -m framework.train``: Hydra, elastic agent, one
Lightning ``Trainer`` per rank) on CPU ranks (gloo), with a small model and corpus, and
compares numbers:

``loss_parity``
    The plugin's per-step losses equal those of ``single`` at the same global batch
    (fp32; ``PluginCase.parity_rtol``, default relative 1e-5 — float32 rounding of sums taken
    in another order is ~1e-7), and so does its learning rate at every step (exactly: the
    schedule counts optimizer steps, not micro-batches or ranks).
``checkpoint_round_trip``
    Resumed from its own step-``SAVE_AT`` checkpoint at the same layout, the plugin logs the
    same losses as its uninterrupted run and ends with the same weights and optimizer state
    (``round_trip_rtol``, default 0: bitwise).
``resume_other_world_size``
    Its step-``SAVE_AT`` checkpoint resumed under each layout of ``PluginCase.resume_as``
    (``single`` by default: another world size), and ``single``'s checkpoint resumed by the
    plugin: the losses of the remaining steps equal ``single``'s uninterrupted run
    (``parity_rtol``).
``bytes``
    Measured collective payload bytes per step equal the plugin's cost model, by collective
    kind (exact), and so do the ring bytes on the wire (each kind on the group size the
    estimate gives it); steps with a validation pass (every ``VAL_EVERY`` steps) are among
    the checked ones, so a meter that counts validation traffic fails. Measured model-state
    bytes per rank equal the modelled ones (``model_states_rtol``, default exact).
``skipped_step``
    With step ``SKIP_AT``'s update dropped (``resilience.skip_steps``), every rank's model and
    optimizer state after that step equals the state before it (``resilience.audit_skips``:
    max |after - before| over every tensor the rank holds, exactly 0), the LR schedule does not
    advance in it (``train/lr`` of step ``SKIP_AT + 1`` equals that of ``SKIP_AT``;
    ``train/optimizer_updates`` one behind ``train/steps_attempted`` from then on), and the
    losses, the step after the skip included, equal ``single``'s with the same skip
    (``parity_rtol``): the update after a skip uses that step's gradients only.

The ``single`` reference run is made once per pytest session and shared by every plugin;
each plugin's main run is shared by its four checks. Use from a test module::

    from framework.base.testing.conformance import PluginCase, conformance, conformance_params  # noqa: F401

    CASES = [PluginCase("myplugin", select=("parallelism=myplugin",))]

    @pytest.mark.parametrize("case,check", conformance_params(CASES))
    def test_conformance(conformance, case, check):
        conformance.check(case, check)
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

CHECKS = ("loss_parity", "checkpoint_round_trip", "resume_other_world_size", "bytes", "skipped_step")
STEPS = 8  # optimizer steps of every full run
SAVE_AT = 4  # step whose checkpoint the resume checks start from
SKIP_AT = 3  # step whose update the skipped_step check drops (AdamW moments exist by then); its runs end at SKIP_AT + 2
SKIP = ("resilience=skip_step", f"resilience.skip_steps=[{SKIP_AT}]", "resilience.audit_skips=true")
VAL_EVERY = 3  # validation inside the run (steps 3 and 6), not only at its start and end
# A small slice of the stdlib corpus, a small vocabulary, short windows: a run costs seconds.
SMALL_DATA = ("data.max_bytes=1500000", "data.vocab_size=1024", "data.seq_len=64")
BATCH = ("trainer.global_batch_size=8", "trainer.micro_batch_size=2", "trainer.grad_accum_steps=null")
COMMON = (
    "tracking=none",
    "trainer.progress_bar=false",
    "trainer.log_every_n_steps=1",
    "trainer.warmup_steps_excluded=1",
    "trainer.val_sequences=16",
    f"trainer.val_every_n_steps={VAL_EVERY}",
)
MODEL = "gpt_tiny"  # the model every check trains unless its PluginCase names another (model=llama_tiny)


@dataclass(frozen=True)
class PluginCase:
    """One plugin configuration under test.

    Attributes:
        name: test id (and run-name prefix).
        select: overrides that select and configure the plugin, e.g. ``("parallelism=fsdp",)``.
        model: the ``model=`` preset of every run of the case, the ``single`` reference's included
            (one reference per model, shared by the cases of that model).
        resume_as: layouts (override tuples) at another world size that must resume this
            plugin's checkpoint to ``single``'s losses.
        checks: which of :data:`CHECKS` apply.
        env: extra environment for the driver and its ranks (e.g. ``PYTHONPATH`` of a plugin
            package installed outside the shared environment).
        parity_rtol: relative tolerance of loss comparisons against ``single``.
        round_trip_rtol: relative tolerance of the round trip (0 = bitwise).
        model_states_rtol: relative tolerance of measured vs modelled model-state bytes.
    """

    name: str
    select: tuple[str, ...]
    model: str = MODEL
    resume_as: tuple[tuple[str, ...], ...] = (("parallelism=single",),)
    checks: tuple[str, ...] = CHECKS
    env: dict[str, str] = field(default_factory=dict, hash=False, compare=False)
    parity_rtol: float = 1e-5
    round_trip_rtol: float = 0.0
    model_states_rtol: float = 0.0

    def __str__(self) -> str:
        return self.name


def conformance_params(cases: list[PluginCase]) -> list[Any]:
    """``pytest.param(case, check)`` for every case and each of its checks, with ids ``<case>-<check>``."""
    return [pytest.param(c, k, id=f"{c.name}-{k}") for c in cases for k in c.checks]


@dataclass
class RunResult:
    """One finished driver run: its losses by step and metric records.

    ``run_dir``: its output folder (``metrics.jsonl``, ``faults.jsonl``); ``stdout``: the driver's output (a run of a
    batch, :meth:`Conformance.prefetch`: its ``train.log``)."""

    run_name: str
    ckpt_dir: Path
    losses: dict[int, float]
    records: list[dict]
    stdout: str = ""
    run_dir: Path | None = None


class Conformance:
    """Runs the driver in ``workdir`` and implements the checks (see the module docstring).

    Args:
        workdir: scratch folder (outputs/, checkpoints/ land there).
        cache_dir: token cache shared by every run.
    """

    def __init__(self, workdir: Path, cache_dir: Path) -> None:
        self.workdir = Path(workdir)
        self.cache_dir = Path(cache_dir)
        self._runs: dict[str, RunResult] = {}
        self._collect: dict[str, list[str]] | None = None  # prefetch: the runs asked for (their overrides), not run

    # -- running the driver --------------------------------------------------------------------
    def run(
        self,
        run_name: str,
        overrides: tuple[str, ...],
        *,
        env: dict[str, str] | None = None,
        max_steps: int = STEPS,
        save_every: int = SAVE_AT,
        resume: Path | str | None = None,
        ckpt_dir: Path | None = None,
        model: str = MODEL,
    ) -> RunResult:
        """Run the driver once (cached by ``run_name``); raises AssertionError with its output when it fails.

        ``resume``: a checkpoint folder, ``"auto"``, or None (= ``never``); ``ckpt_dir``: the
        run's ``checkpoint.dir`` (default ``checkpoints/<run_name>``); ``model``: the ``model=`` preset.
        """
        if run_name in self._runs:
            return self._runs[run_name]
        ckpt = ckpt_dir or self.workdir / "checkpoints" / run_name
        varying = _run_overrides(model, overrides, max_steps, save_every, resume)
        if self._collect is not None:  # Conformance.prefetch: note the run, run it later in a batch
            if not env:  # (a run with its own environment is left to its check)
                self._collect[run_name] = [*varying, f"checkpoint.dir='{ckpt}'"]
            return None
        args = [
            sys.executable,
            "-m",
            "framework.train",
            *self._fixed(),
            *varying,
            f"checkpoint.dir='{ckpt}'",
            f"run_name={run_name}",
        ]
        proc = subprocess.run(
            args, cwd=self.workdir, capture_output=True, text=True, timeout=900, env={**os.environ, **(env or {})}
        )
        if proc.returncode != 0:
            raise AssertionError(
                f"driver exited {proc.returncode}: {' '.join(args[2:])}\n"
                f"STDOUT:\n{proc.stdout[-3000:]}\nSTDERR:\n{proc.stderr[-6000:]}"
            )
        result = _result(run_name, self.workdir / "outputs" / "default" / run_name, ckpt, proc.stdout)
        self._runs[run_name] = result
        return result

    def _fixed(self) -> list[str]:
        """The overrides every run shares (data, batch, logging, validation, checkpoints kept)."""
        return [*SMALL_DATA, f"data.cache_dir={self.cache_dir}", *COMMON, *BATCH, "checkpoint.keep_last_k=10"]

    def reference(self, model: str = MODEL) -> RunResult:
        """``single`` at the same global batch, checkpointed at ``SAVE_AT`` (shared by every plugin of ``model``)."""
        return self.run(_ref_name("ref-single", model), ("parallelism=single",), model=model)

    def skip_reference(self, model: str = MODEL) -> RunResult:
        """``single`` with step ``SKIP_AT``'s update dropped (shared by every plugin's ``skipped_step`` check)."""
        return self.run(
            _ref_name("ref-single-skip", model),
            ("parallelism=single", *SKIP),
            max_steps=SKIP_AT + 2,
            save_every=0,
            model=model,
        )

    def plugin_run(self, case: PluginCase) -> RunResult:
        """The plugin's uninterrupted run, checkpointed at ``SAVE_AT`` and at the end."""
        return self.run(f"{case.name}-full", case.select, env=case.env, model=case.model)

    def round_trip_run(self, case: PluginCase) -> RunResult:
        """The plugin resumed from its own step-``SAVE_AT`` checkpoint at the same layout."""
        start = self.plugin_run(case).ckpt_dir / f"step{SAVE_AT:08d}"
        return self.run(
            f"{case.name}-roundtrip", case.select, env=case.env, save_every=STEPS, resume=start, model=case.model
        )

    def resume_as_run(self, case: PluginCase, i: int) -> RunResult:
        """The plugin's step-``SAVE_AT`` checkpoint resumed under layout ``case.resume_as[i]``."""
        return self.run(
            f"{case.name}-as{i}",
            case.resume_as[i],
            env=case.env,
            save_every=0,
            resume=self.plugin_run(case).ckpt_dir / f"step{SAVE_AT:08d}",
            model=case.model,
        )

    def from_single_run(self, case: PluginCase) -> RunResult:
        """``single``'s step-``SAVE_AT`` checkpoint resumed by the plugin."""
        return self.run(
            f"{case.name}-from-single",
            case.select,
            env=case.env,
            save_every=0,
            resume=self.reference(case.model).ckpt_dir / f"step{SAVE_AT:08d}",
            model=case.model,
        )

    def skip_run(self, case: PluginCase) -> RunResult:
        """The plugin with step ``SKIP_AT``'s update dropped (``resilience.audit_skips`` on)."""
        return self.run(
            f"{case.name}-skip",
            (*case.select, *SKIP),
            env=case.env,
            max_steps=SKIP_AT + 2,
            save_every=0,
            model=case.model,
        )

    def prefetch(self, checks: list[tuple[PluginCase, str]], lanes: int = 2) -> None:
        """Run ahead the driver runs that ``checks`` (``(case, check)`` pairs) will ask for, in batches.

        Two waves: the references and the plugins' uninterrupted and skip runs, then the resumes from their
        checkpoints. A wave's runs go in ``lanes`` Hydra sweeps side by side (:meth:`_run_batch`): one driver and one
        rank server per sweep instead of one per run, which on the 2-core machine is about half the CPU of a run
        (the imports of torch, Lightning and Hydra are paid once per sweep). Every run keeps its own config, so its
        numbers are those it gives alone; the checks then read them. A run that fails here is not kept: its check
        runs it again alone and reports the failure itself. Runs with their own environment (an outside plugin's
        ``PYTHONPATH``) are left to their checks.
        """
        first: dict[tuple[str, str], Any] = {}
        then: dict[tuple[str, str], Any] = {}
        for case, check in checks:
            if check not in CHECKS:
                raise ValueError(f"check={check!r}; allowed: {', '.join(CHECKS)}")
            if case.env:
                continue
            if check in ("loss_parity", "resume_other_world_size"):
                first[("ref", case.model)] = lambda m=case.model: self.reference(m)
            if check in ("loss_parity", "checkpoint_round_trip", "resume_other_world_size", "bytes"):
                first[("full", case.name)] = lambda c=case: self.plugin_run(c)
            if check == "skipped_step":
                first[("skip-ref", case.model)] = lambda m=case.model: self.skip_reference(m)
                first[("skip", case.name)] = lambda c=case: self.skip_run(c)
            if check == "checkpoint_round_trip":
                then[("roundtrip", case.name)] = ((f"{case.name}-full",), lambda c=case: self.round_trip_run(c))
            if check == "resume_other_world_size":
                for i in range(len(case.resume_as)):
                    then[(f"as{i}", case.name)] = ((f"{case.name}-full",), lambda c=case, i=i: self.resume_as_run(c, i))
                then[("from-single", case.name)] = (
                    (_ref_name("ref-single", case.model),),
                    lambda c=case: self.from_single_run(c),
                )
        self._run_batch(self._collected(first.values()), lanes)
        ready = [task for needs, task in then.values() if all(n in self._runs for n in needs)]  # no re-runs of failures
        self._run_batch(self._collected(ready), lanes)

    def _collected(self, tasks) -> dict[str, list[str]]:
        """The runs that ``tasks`` (callables of this object's run methods) would start, by run name, not started."""
        self._collect = {}
        try:
            for task in tasks:
                try:
                    task()
                except Exception:  # a run it needs did not finish: the check runs both and reports it
                    continue
            return self._collect
        finally:
            self._collect = None

    def _run_batch(self, runs: dict[str, list[str]], lanes: int) -> None:
        """Run ``runs`` (run name -> the overrides :meth:`run` noted) as ``lanes`` Hydra sweeps at once
        (:func:`~framework.base.testing.variants.run_variants`) and keep the runs that finished, with the output
        and checkpoint folders their sweep gave them. A failed run is left to its check."""
        from framework.base.testing.variants import checkpoint_dir, run_variants

        for name, run_dir in run_variants(self.workdir, self._fixed(), runs, lanes=lanes).items():
            log = run_dir / "train.log"
            self._runs[name] = _result(
                name, run_dir, checkpoint_dir(run_dir, self.workdir), log.read_text() if log.is_file() else ""
            )

    # -- the checks ----------------------------------------------------------------------------
    def check(self, case: PluginCase, check: str) -> None:
        """Run one of :data:`CHECKS` for ``case``.

        Raises:
            AssertionError: the plugin does not conform (the message says where).
            ValueError: ``check`` is not one of :data:`CHECKS`.
        """
        if check not in CHECKS:
            raise ValueError(f"check={check!r}; allowed: {', '.join(CHECKS)}")
        getattr(self, f"check_{check}")(case)

    def check_loss_parity(self, case: PluginCase) -> None:
        ref, got = self.reference(case.model), self.plugin_run(case)
        assert sorted(ref.losses) == list(range(1, STEPS + 1)), ref.losses
        assert min(ref.losses.values()) < ref.losses[1] - 0.1, (
            "the reference must learn for the comparison to mean anything"
        )
        _assert_losses(got.losses, ref.losses, range(1, STEPS + 1), case.parity_rtol, f"{case.name} vs single")
        lrs = [{int(r["step"]): r["train/lr"] for r in run.records if "train/lr" in r} for run in (got, ref)]
        assert sorted(lrs[1]) == list(range(1, STEPS + 1)) and lrs[0] == lrs[1], f"{case.name}: train/lr per step {lrs}"

    def check_checkpoint_round_trip(self, case: PluginCase) -> None:
        full, again = self.plugin_run(case), self.round_trip_run(case)
        _assert_losses(
            again.losses,
            full.losses,
            range(SAVE_AT + 1, STEPS + 1),
            case.round_trip_rtol,
            f"{case.name} resumed from its step {SAVE_AT}",
        )
        _assert_same_state(
            again.ckpt_dir / f"step{STEPS:08d}", full.ckpt_dir / f"step{STEPS:08d}", case.round_trip_rtol
        )

    def check_resume_other_world_size(self, case: PluginCase) -> None:
        ref = self.reference(case.model)
        steps = range(SAVE_AT + 1, STEPS + 1)
        for i, layout in enumerate(case.resume_as):
            got = self.resume_as_run(case, i)
            _assert_losses(
                got.losses, ref.losses, steps, case.parity_rtol, f"{case.name} checkpoint resumed as {layout}"
            )
        got = self.from_single_run(case)
        _assert_losses(got.losses, ref.losses, steps, case.parity_rtol, f"single checkpoint resumed by {case.name}")

    def check_bytes(self, case: PluginCase) -> None:
        from framework.base.cost.comm import KINDS

        records = self.plugin_run(case).records
        comm = [r for r in records if "perf/comm_bytes" in r]
        assert comm, "no step logged measured communication (perf/comm_bytes)"
        for r in comm:
            kinds = {k for k in KINDS if f"perf/comm_bytes_{k}_model" in r}
            measured = {k for k in KINDS if f"perf/comm_bytes_{k}" in r}
            assert measured == kinds, f"step {r['step']}: measured kinds {sorted(measured)} != modelled {sorted(kinds)}"
            for k in kinds:
                assert r[f"perf/comm_bytes_{k}"] == r[f"perf/comm_bytes_{k}_model"], (
                    f"step {r['step']}: measured {k} bytes {r[f'perf/comm_bytes_{k}']:.0f}"
                    f" != modelled {r[f'perf/comm_bytes_{k}_model']:.0f}"
                )
            assert r["perf/comm_bytes"] == r["perf/comm_bytes_model"]
            assert r["perf/comm_bytes_wire"] == r["perf/comm_bytes_wire_model"], (
                f"step {r['step']}: measured wire bytes {r['perf/comm_bytes_wire']:.0f}"
                f" != modelled {r['perf/comm_bytes_wire_model']:.0f}"
            )
        validated = {int(r["step"]) for r in records if "val/loss" in r} & {int(r["step"]) for r in comm}
        assert validated, "no checked step ran a validation pass (trainer.val_every_n_steps)"
        mem = [r for r in records if "mem/model_states_bytes_model" in r]
        assert mem, "no step logged mem/model_states_bytes_model"
        for r in mem:
            assert r["mem/model_states_bytes"] == pytest.approx(
                r["mem/model_states_bytes_model"], rel=case.model_states_rtol, abs=0
            ), f"step {r['step']}: model-state bytes"

    def check_skipped_step(self, case: PluginCase) -> None:
        from framework.base.faults.events import FaultLog

        ref, got = self.skip_reference(case.model), self.skip_run(case)
        log = FaultLog(got.run_dir).read()
        (start,) = [r for r in log if r["ev"] == "start"]
        audits = {r["rank"]: r for r in log if r["ev"] == "skip_audit"}
        assert sorted(audits) == list(range(start["world_size"])), f"{case.name}: skip audits of ranks {sorted(audits)}"
        for rank, a in audits.items():
            assert a["step"] == SKIP_AT and a["tensors"] > 0, a
            assert a["max_abs_diff"] == 0.0, (
                f"{case.name}: rank {rank}'s model/optimizer state moved by up to"
                f" {a['max_abs_diff']!r} in the skipped step {SKIP_AT}"
            )
        steps = range(1, SKIP_AT + 3)
        rec = {int(r["step"]): r for r in got.records if "train/lr" in r}
        assert rec[SKIP_AT + 1]["train/lr"] == rec[SKIP_AT]["train/lr"], (
            f"{case.name}: the LR schedule advanced in the skipped step"
        )
        updates = [(rec[s]["train/steps_attempted"], rec[s]["train/optimizer_updates"]) for s in steps]
        assert updates == [(s, s - (s >= SKIP_AT)) for s in steps], (
            f"{case.name}: (attempted, applied) per step {updates}"
        )
        _assert_losses(
            got.losses, ref.losses, steps, case.parity_rtol, f"{case.name} vs single, step {SKIP_AT} skipped"
        )


def _run_overrides(
    model: str, overrides: tuple[str, ...], max_steps: int, save_every: int, resume: Path | str | None
) -> list[str]:
    """The overrides of one run besides :meth:`Conformance._fixed`, its ``checkpoint.dir`` and its name."""
    return [
        f"model={model}",
        *overrides,
        f"trainer.max_steps={max_steps}",
        f"checkpoint.every_n_steps={save_every}",
        f"resume='{resume}'" if resume is not None else "resume=never",  # quoted: a batch's folders hold "=" and ","
    ]


def _result(run_name: str, run_dir: Path, ckpt: Path, stdout: str) -> RunResult:
    """A finished run's :class:`RunResult` from its output folder ``run_dir`` (``metrics.jsonl``)."""
    from framework.base.tracking import read_jsonl_metrics

    records = read_jsonl_metrics(run_dir / "metrics.jsonl")
    losses = {int(r["step"]): r["train/loss"] for r in records if "train/loss" in r}
    return RunResult(run_name, Path(ckpt), losses, records, stdout, Path(run_dir))


def _ref_name(prefix: str, model: str) -> str:
    """The reference run's name: ``prefix`` for :data:`MODEL` (the names other test modules share), else ``prefix-<model>``."""
    return prefix if model == MODEL else f"{prefix}-{model}"


def _assert_losses(got: dict[int, float], want: dict[int, float], steps: range, rtol: float, what: str) -> None:
    missing = [s for s in steps if s not in got]
    assert not missing, f"{what}: no loss logged for steps {missing}"
    for s in steps:
        assert got[s] == pytest.approx(want[s], rel=rtol, abs=0), (
            f"{what}: step {s} loss {got[s]!r} != {want[s]!r} (rtol {rtol})"
        )


def _assert_same_state(a: Path, b: Path, rtol: float) -> None:
    """Every model and optimizer tensor of checkpoints ``a`` and ``b`` (any format) equal within ``rtol``."""
    import torch

    from framework.base.checkpoint.format import load_state

    sa, sb = load_state(a), load_state(b)
    torch.testing.assert_close(sa["state_dict"], sb["state_dict"], rtol=rtol, atol=0)
    torch.testing.assert_close(
        [o["state"] for o in sa["optimizer_states"]], [o["state"] for o in sb["optimizer_states"]], rtol=rtol, atol=0
    )


@pytest.fixture(scope="session")
def conformance(tmp_path_factory) -> Conformance:
    """A session-wide :class:`Conformance` (its ``single`` reference run is shared by every plugin)."""
    root = tmp_path_factory.mktemp("conformance")
    return Conformance(root, root / "token_cache")
