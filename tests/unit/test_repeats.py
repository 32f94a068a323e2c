"""Repeats of a sweep (framework/driver/repeats.py), their aggregation in the compare report, and the load monitor."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from framework.base.load_monitor import (
    LoadMonitor,
    contention_verdict,
    other_cpu_share,
    read_cpu_jiffies,
    summarize_samples,
    warning,
)
from framework.driver.compare import aggregate_rows, contention_note, render_table, table_columns
from framework.driver.repeats import REPEAT_KEY, child_tags, config_label, install, summary_table
from framework.driver.sweep import JobOutcome


def _compose(*overrides: str):
    from hydra import compose, initialize_config_dir

    from framework.driver.cli import CONF_DIR

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=["run_name=x", *overrides], return_hydra_config=True)


def test_repeats_are_the_outer_loop_so_configurations_interleave():
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    cfg = _compose("experiment=single_vs_ddp", "sweep.repeats=3")
    assert install(cfg) == 3
    params = OmegaConf.to_container(cfg.hydra.sweeper.params)
    assert list(params) == [REPEAT_KEY, "parallelism"] and params[REPEAT_KEY] == "0,1,2"
    lines = [f"{k}={v}" for k, v in params.items()]
    (jobs,) = BasicSweeper.split_arguments(OverridesParser.create().parse_overrides(lines), None)  # what Hydra will run
    assert [(j[0].split("=")[1], j[1].split("=")[1]) for j in jobs] == [
        ("0", "single"),
        ("0", "ddp"),
        ("1", "single"),
        ("1", "ddp"),
        ("2", "single"),
        ("2", "ddp"),
    ]  # A B A B A B
    assert install(_compose("experiment=single_vs_ddp")) == 1  # no repeats: the sweep is untouched


def test_repeats_are_refused_with_an_optuna_search_and_a_repeat_on_the_command_line():
    from framework.base.config.schema import ConfigError

    cfg = _compose("sweep.repeats=2")
    from omegaconf import open_dict, read_write

    with read_write(cfg.hydra), open_dict(cfg.hydra.sweeper):
        cfg.hydra.sweeper._target_ = "hydra_plugins.hydra_optuna_sweeper.optuna_sweeper.OptunaSweeper"
    with pytest.raises(ConfigError, match="sweep.repeats=2 needs Hydra's basic sweeper"):
        install(cfg)
    with pytest.raises(ConfigError, match="sweep.repeats must be|sweep.repeats=0"):
        from framework.driver.validate import load_run_config

        load_run_config(_compose("sweep.repeats=0"))


def test_children_are_tagged_with_configuration_repeat_and_order():
    tags = child_tags({"parallelism": "ddp", REPEAT_KEY: "2"}, 5)
    assert tags == {"trainlab.config": "parallelism=ddp", "trainlab.repeat": "2", "trainlab.sweep_order": "5"}
    assert child_tags({"parallelism": "ddp"}, None) == {"trainlab.config": "parallelism=ddp", "trainlab.repeat": "0"}
    assert config_label(["parallelism=ddp", f"{REPEAT_KEY}=3"]) == "parallelism=ddp"


def _outcomes(values: dict[str, list[float | None]]) -> list[JobOutcome]:
    out = []
    for i in range(max(len(v) for v in values.values())):
        for label, vals in values.items():
            if i < len(vals):
                out.append(
                    JobOutcome(
                        f"{label},repeat={i}",
                        [label, f"{REPEAT_KEY}={i}"],
                        "FINISHED" if vals[i] is not None else "FAILED",
                        objective=vals[i],
                    )
                )
    return out


def test_the_sweep_summary_ranks_configurations_by_verdicts():
    obj = "perf/tokens_per_sec_mean"
    table, line, note = summary_table(
        _outcomes(
            {"parallelism=single": [2000, 2050, 1980, 2020, 2010], "parallelism=ddp": [3000, 3100, 2950, 3050, 3020]}
        ),
        obj,
    )
    assert "best configuration parallelism=ddp" in line and "faster by" in line and "than parallelism=single" in line
    assert note.startswith("Best (perf/tokens_per_sec_mean, median of 5): parallelism=ddp") and "Slower than it" in note
    single = next(ln for ln in table.splitlines() if ln.startswith("parallelism=single"))
    assert "slower by 33%" in single and "2,010.0" in single
    # an A/A pair: no established best
    _, line, note = summary_table(
        _outcomes({"sweep.label=a": [1000, 1040, 980, 1010, 995], "sweep.label=b": [1005, 990, 1030, 985, 1002]}), obj
    )
    assert line.startswith("trainlab: no established best") and "indistinguishable from" in line
    assert note.startswith("No established best")
    # one run each: not ranked; a failed repeat is counted, not scored
    table, line, _ = summary_table(
        _outcomes({"parallelism=single": [2000], "parallelism=ddp": [2500], "parallelism=tp": [None]}), obj
    )
    assert "not ranked: n=1: repeats needed to rank" in line and "no objective" in table


def _row(plugin: str, repeat: int, tps: float, contended: str | None = None) -> dict:
    return {
        "parallelism": plugin,
        "repeat": str(repeat),
        "status": "FINISHED",
        "plugin": plugin,
        "layout": "dp1",
        "tokens_per_sec": tps,
        "mfu": tps / 1e5,
        "step_time_s": 1000 / tps,
        "run_id": f"{plugin}{repeat}".ljust(32, "0"),
        "run": f"{plugin}{repeat}",
        "run_name": plugin,
        "contended": contended,
    }


def test_the_compare_report_aggregates_repeats_with_intervals_and_verdicts():
    rows = [
        _row(p, i, base + d)
        for i, d in enumerate([0, 40, -30, 20, -10])
        for p, base in (("single", 2000), ("ddp", 3000))
    ]
    rows[0]["contended"] = "true"
    agg = aggregate_rows(None, rows, ["parallelism"], ["tokens_per_sec", "mfu"])
    by = {r["parallelism"]: r for r in agg}
    assert by["single"]["n"] == 5 and by["single"]["tokens_per_sec"] == 2000 and by["single"]["contended"] == "1/5"
    assert by["single"]["tokens_per_sec_lo"] <= 2000 <= by["single"]["tokens_per_sec_hi"]
    assert by["ddp"]["verdict"].startswith("best (faster by") and by["single"]["verdict"].startswith("slower by 33%")
    assert by["ddp"]["step_time_s"] == pytest.approx(1 / 3) and 0 < by["ddp"]["cv"] < 0.02
    table = render_table(agg, table_columns(["parallelism"], ["tokens_per_sec", "mfu"], agg))
    header = table.splitlines()[0].split()
    assert header[:5] == ["parallelism", "status", "plugin", "layout", "verdict"] and "cv" in header
    note = contention_note(agg, ["parallelism"])
    assert note.startswith("warning: measured under contention") and "parallelism=single (1/5 runs)" in note
    by_step = {
        r["parallelism"]: r
        for r in aggregate_rows(None, rows, ["parallelism"], ["step_time_s"], rank_by="step_time_s", maximize=False)
    }
    assert by_step["ddp"]["verdict"].startswith("best (faster by")  # lower step time is faster
    one = aggregate_rows(None, [_row("single", 0, 2000)], ["parallelism"], ["tokens_per_sec"])
    assert "repeats needed" not in (one[0]["verdict"] or "") and one[0]["n"] == 1  # a single config is just best


# --- the load monitor -----------------------------------------------------------------------------


def test_other_cpu_share_and_the_contention_verdict():
    assert other_cpu_share(d_busy_s=3.0, d_tree_s=1.0, d_wall_s=1.0, cores=4) == 0.5
    assert other_cpu_share(1.0, 2.0, 1.0, 4) == 0.0 and other_cpu_share(9.0, 0.0, 1.0, 2) == 1.0
    assert contention_verdict({"load/other_cpu_share_mean": 0.05, "load/steal_frac_mean": 0.0}, 0.1) == ""
    reason = contention_verdict(
        {"load/other_cpu_share_mean": 0.45, "load/steal_frac_mean": 0.08, "load/gpu_other_procs_max": 1.0}, 0.1
    )
    assert "45% of the CPUs (threshold 10%)" in reason and "steal 8%" in reason and "1 other process" in reason
    rec = summarize_samples([{"t": 5, "load/other_cpu_share": 0.4}, {"t": 10, "load/other_cpu_share": 0.2}], 5, 0.1)
    assert rec.means["load/other_cpu_share_mean"] == pytest.approx(0.3) and rec.contended
    assert "measured under contention" in warning(rec) and warning(summarize_samples([], 5, 0.1)) is None


def test_read_cpu_jiffies(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text("cpu  100 10 50 800 20 5 5 10 0 0\ncpu0 1 2 3\n")
    assert read_cpu_jiffies(str(stat)) == (170.0, 1000.0, 10.0)
    assert read_cpu_jiffies(str(tmp_path / "missing")) is None


@pytest.mark.slow  # starts Python processes (the fast tier leaves it out)
def test_the_monitor_counts_a_process_outside_the_run_and_not_the_runs_own_work(tmp_path):
    """A busy loop in this process is the run's own work; a detached busy process (not a descendant) is another's."""
    spin = "import time\nt=time.time()\nwhile time.time()-t<30: pass\n"
    out = subprocess.run(
        ["sh", "-c", f"{sys.executable} -c '{spin}' >/dev/null 2>&1 & echo $!"],
        capture_output=True,
        text=True,
        check=True,
    )
    pid = int(out.stdout.strip())  # its parent (sh) has exited: it is not in this process's tree
    try:
        import psutil

        deadline = time.time() + 20  # the spinner is busy (past its interpreter start) before the monitor starts
        while sum(psutil.Process(pid).cpu_times()[:2]) < 0.3 and time.time() < deadline:
            time.sleep(0.05)
        mon = LoadMonitor(0.5, cpu_threshold=0.02, run_dir=tmp_path)
        with mon:
            t = time.process_time()
            while time.process_time() - t < 1.5:  # our own CPU time
                pass
    finally:
        os.kill(pid, signal.SIGKILL)
    rec = mon.record
    assert rec is not None and len(rec.samples) >= 2 and (tmp_path / "load.json").exists()
    assert rec.contended and rec.means["load/other_cpu_share_mean"] >= 0.02
    assert all(0.0 <= s["load/other_cpu_share"] <= 1.0 for s in rec.samples)
    off = LoadMonitor(0)
    with off:
        pass
    assert off.record is None


def _burn(seconds: float) -> None:
    t = time.process_time()
    while time.process_time() - t < seconds:
        pass


def test_the_runs_tree_keeps_the_cpu_time_of_children_that_have_exited():
    """Loader workers and ranks exit before the run ends; their CPU time is the run's own, not another's.

    CPU time, not wall time: the assertion holds on a loaded machine as well.
    """
    import multiprocessing as mp

    mon = LoadMonitor(1.0)
    before, _ = mon._tree()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_burn, args=(0.6,)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()  # reaped: their times move to this process's children_user/children_system
    after, _ = mon._tree()
    assert after - before >= 2 * 0.6 * 0.9


def test_a_sweeping_preset_takes_repeats_without_dash_m_and_a_plain_run_is_refused():
    """The study READMEs' commands (`experiment=data_pipeline sweep.repeats=5`: the preset sets hydra.mode
    MULTIRUN) pass the driver's precheck; a single run with repeats is refused in one line (exit 2)."""
    from framework.driver.cli import precheck

    assert precheck(["experiment=data_pipeline", "sweep.repeats=5"]) is None  # the sweep's own checks follow
    with pytest.raises(SystemExit) as exc:
        precheck(["parallelism=single", "sweep.repeats=5"])
    assert exc.value.code == 2
