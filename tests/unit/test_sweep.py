"""A sweep's identity (framework/driver/sweep.py) and the compare report's swept-key table (framework/driver/compare.py)."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest

from framework.driver.compare import (
    build_rows,
    natural_key,
    pick_x,
    render_table,
    short_names,
    swept_keys,
    swept_values,
    table_columns,
)
from framework.driver.sweep import display_name, job_name, parse_sweep

EXCLUDED = ["resume", "experiment", "trainer.max_steps", "checkpoint.every_n_steps", "data.num_workers", "tracking.uri"]


def test_a_swept_key_names_the_jobs_even_when_it_is_excluded_from_run_names():
    sweep = parse_sweep(
        ["checkpoint.every_n_steps=5,10", "trainer.max_steps=20", "parallelism=single", "tracking.uri=x"],
        None,
        EXCLUDED,
    )
    assert sweep.keys == ["checkpoint.every_n_steps"] and sweep.values == {"checkpoint.every_n_steps": "5,10"}
    # not swept and excluded (max_steps, tracking.uri): left out of the name, so running it again continues it
    assert sweep.name == "checkpoint.every_n_steps=5,10,parallelism=single"
    jobs = {
        job_name(["checkpoint.every_n_steps=5", "trainer.max_steps=20", "parallelism=single"], sweep.keys),
        job_name(["checkpoint.every_n_steps=10", "trainer.max_steps=20", "parallelism=single"], sweep.keys),
    }
    assert jobs == {"checkpoint.every_n_steps=5", "checkpoint.every_n_steps=10"}


def test_two_different_sweeps_have_different_names_and_a_preset_sweep_is_named_by_its_command_line():
    a = parse_sweep(["trainer.max_steps=2,3"], None, EXCLUDED)
    b = parse_sweep(["trainer.max_steps=2,4"], None, EXCLUDED)
    c = parse_sweep(["data.num_workers=0,2"], None, EXCLUDED)
    assert len({a.name, b.name, c.name}) == 3
    preset = parse_sweep(
        ["experiment=checkpoint_policy"],
        {"checkpoint": "interval,async", "checkpoint.every_n_steps": "10,25"},
        EXCLUDED,
    )
    assert (
        preset.keys == ["checkpoint", "checkpoint.every_n_steps"] and preset.name == "sweep"
    )  # under outputs/checkpoint_policy/
    # the command line wins over the preset's sweep of the same key; range/choice/interval are sweeps
    narrowed = parse_sweep(
        ["checkpoint=async", "optim.lr=interval(1e-4,1e-2)", "trainer.micro_batch_size=choice(2,4)"],
        {"checkpoint": "interval,async"},
        EXCLUDED,
    )
    assert narrowed.keys == ["optim.lr", "trainer.micro_batch_size"]
    job = ["+foo=1", "optim.lr=0.003", "trainer.micro_batch_size=2"]
    assert job_name(job, narrowed.keys) == "optim.lr=0.003,trainer.micro_batch_size=2"
    assert display_name(job, narrowed.keys) == "0.003, 2 (lr, micro_batch_size)"
    assert display_name(["a.x=1", "b.x=2"], ["a.x", "b.x"]) == "1, 2 (a.x, b.x)"  # the last part is not unique


def _run(tags: dict, params: dict, metrics: dict | None = None, run_id: str = "r" * 32, status: str = "FINISHED"):
    return SimpleNamespace(
        info=SimpleNamespace(run_id=run_id, run_name=tags.get("trainlab.swept", run_id), status=status),
        data=SimpleNamespace(tags=tags, params=params, metrics=metrics or {}),
    )


def test_swept_keys_come_from_the_childrens_tags_or_from_the_params_that_differ():
    assert swept_values("checkpoint.every_n_steps=5,parallelism=ddp") == {
        "checkpoint.every_n_steps": "5",
        "parallelism": "ddp",
    }
    tagged = [
        {"swept": {"parallelism": "ddp", "optim.lr": "1e-3"}, "params": {}},
        {"swept": {"parallelism": "single"}, "params": {}},
    ]
    assert swept_keys(tagged) == ["parallelism", "optim.lr"]
    plain = [
        {
            "swept": None,
            "params": {
                "data.num_workers": "0",
                "data.mode": "memmap",
                "checkpoint.dir": "/a",
                "derived.checkpoint_dir": "c/a",
                "tracking.uri": "x",
                "run_name": "a",
            },
        },
        {
            "swept": None,
            "params": {
                "data.num_workers": "2",
                "data.mode": "memmap",
                "checkpoint.dir": "/b",
                "derived.checkpoint_dir": "c/b",
                "tracking.uri": "y",
                "run_name": "b",
            },
        },
    ]
    assert swept_keys(plain) == [
        "data.num_workers"
    ]  # paths, tracking and names differ too, but are not what is compared


def test_rows_are_labelled_by_swept_values_and_sorted_numerically():
    runs = [
        _run(
            {"trainlab.swept": f"checkpoint.every_n_steps={n},checkpoint={c}", "plugin": "single"},
            {},
            {"perf/tokens_per_sec_mean": 1000.0 + n, "mem/peak_bytes": 2 * 1024**3},
            run_id=f"{n}{c}".ljust(32, "0"),
        )
        for n, c in [(10, "async"), (2, "interval"), (10, "interval"), (2, "async"), (100, "async")]
    ]
    rows, keys = build_rows(None, runs, ["tokens_per_sec", "peak_mem_GiB"])
    assert keys == ["checkpoint.every_n_steps", "checkpoint"]
    assert [(r["checkpoint.every_n_steps"], r["checkpoint"]) for r in rows] == [
        ("2", "async"),
        ("2", "interval"),
        ("10", "async"),
        ("10", "interval"),
        ("100", "async"),
    ]  # not "10" < "100" < "2"
    assert rows[0]["peak_mem_GiB"] == 2.0 and rows[0]["tokens_per_sec"] == 1002.0
    assert pick_x(rows, keys) == "checkpoint.every_n_steps"
    table = render_table(rows, table_columns(keys, ["tokens_per_sec", "peak_mem_GiB", "goodput"], rows)).splitlines()
    assert table[0].split() == [
        "every_n_steps",
        "checkpoint",
        "status",
        "plugin",
        "layout",
        "tokens_per_sec",
        "peak_mem_GiB",
    ]
    assert table[1].split()[:2] == ["2", "async"] and table[1].split()[-2:] == [
        "1,002",
        "2.000",
    ]  # no goodput: no column
    assert short_names(["a.x", "b.x", "c.y"]) == {"a.x": "a.x", "b.x": "b.x", "c.y": "y"}
    assert sorted(["b", "10", None, "2", "1e-3"], key=natural_key) == ["1e-3", "2", "10", "b", None]


@pytest.mark.parametrize(
    "sweep, message",
    [
        (
            "checkpoint.every_n_step=5,10",
            "swept key checkpoint.every_n_step is not a config key; did you mean checkpoint.every_n_steps",
        ),
        (
            "trainer.max_steps=2,abc",
            "swept value trainer.max_steps='abc' (str): trainer.max_steps: Value 'abc' of type 'str'",
        ),
        ("trainer.micro_batch_size=interval(1,4)", "swept value trainer.micro_batch_size=1.0 (float)"),
        (
            "parallelism=zero1,ddp parallelism.zero_stage=1,2",
            "swept key parallelism.zero_stage is not an option of plugin(s) ddp",
        ),
        (
            "parallelism=choice(ddp,tp) parallelism.zero_stage=choice(1,2)",
            "swept key parallelism.zero_stage is not a config key of plugin(s) ddp, tp",
        ),
        # a bad value in a key the sweep does not sweep refuses every job: refused before the first (issue 23, item 9)
        (
            "optim.lr=1e-3,3e-3 trainer.micro_batch_size=3",
            "every job of this sweep is refused: trainer.global_batch_size=16 is not divisible by micro_batch_size 3",
        ),
        ("trainer.micro_batch_size=3,5", "every job of this sweep is refused (the first, trainer.micro_batch_size=3:"),
        (
            "parallelism=tp,pp parallelism.world_size=1",
            "every job of this sweep is refused (the first, parallelism=tp:",
        ),
    ],
)
def test_bad_sweeps_are_refused_in_one_line(capsys, sweep, message):
    from hydra import compose, initialize_config_dir

    from framework.driver.cli import CONF_DIR
    from framework.driver.sweep import check_sweep

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["run_name=x"], return_hydra_config=True)
        with pytest.raises(SystemExit) as done:
            check_sweep(cfg, sweep.split())
    err = capsys.readouterr().err
    assert (
        done.value.code == 2 and err.startswith("trainlab: error: " + message) and len(err.strip().splitlines()) == 1
    ), err


@pytest.mark.slow  # starts Python processes (the fast tier leaves it out)
def test_a_bad_sweep_fails_before_any_job_starts(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "framework.train", "-m", "trainer.max_steps=2,abc", "tracking=none"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and proc.stderr.startswith("trainlab: error: swept value trainer.max_steps='abc'"), (
        proc.stderr
    )
    assert len(proc.stderr.strip().splitlines()) == 1 and "Launching" not in proc.stdout
    assert not (tmp_path / "outputs").exists()


def test_a_run_leads_with_rounded_summary_figures_and_a_one_line_description():
    from framework.driver.run_summary import run_description, summary_metrics

    summary = {
        "perf/tokens_per_sec_mean": 2226.923037830342,
        "perf/mfu_mean": 0.10768294699582898,
        "perf/step_time_s_mean": 0.4598272965004071,
    }
    records = [
        {"step": 4, "mem/peak_bytes": 1.5 * 1024**3, "perf/comm_frac_mean": 0.2},
        {"step": 8, "mem/peak_bytes": 1024**3},
        {"step": 8, "perf/comm_frac_mean": 0.1234},
    ]
    m = summary_metrics(summary, records)
    assert m == {
        "summary/tokens_per_sec": 2230.0,
        "summary/mfu": 0.108,
        "summary/peak_mem_GiB": 1.5,
        "summary/step_time_ms": 460.0,
        "summary/comm_share": 0.123,
    }  # no data wait logged: left out, not 0
    assert run_description("ddp", "dp2-tp1-pp1", m, 6.1417e10) == (
        "ddp dp2-tp1-pp1 | 2,230 tokens/s | MFU 0.108 of 6.14e+10 FLOP/s | peak 1.5 GiB | comm 12.3%"
    )


def test_the_report_says_when_mfu_denominators_differ():
    from framework.driver.compare import mfu_peak_note

    same = [_run({}, {"mfu.peak_flops_per_device": "2.348e11"}), _run({}, {"mfu.peak_flops_per_device": "2.35e11"})]
    assert mfu_peak_note(same) is None
    differ = [_run({}, {"mfu.peak_flops_per_device": "2.348e11"}), _run({}, {"mfu.peak_flops_per_device": "1.219e11"})]
    assert "MFU denominators differ" in mfu_peak_note(differ) and "1.22e+11 .. 2.35e+11" in mfu_peak_note(differ)
    # 1 rank x 2 threads against 2 ranks x 1 thread: the denominator is all the devices' peak
    split = [
        _run({}, {"mfu.peak_flops_per_device": "8e10", "derived.world_size": "1"}),
        _run({}, {"mfu.peak_flops_per_device": "4.1e10", "derived.world_size": "2"}),
    ]
    assert mfu_peak_note(split) is None
    split[1].data.params["mfu.peak_flops_per_device"] = "2e10"
    assert "4e+10 .. 8e+10" in mfu_peak_note(split)


@pytest.mark.slow  # starts Python processes (the fast tier leaves it out)
def test_more_than_one_task_per_node_is_refused_before_submitting(tmp_path):
    """submitit would start a second driver per node, which stops at the run lock (issue 23, item 6)."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "framework.train",
            "-m",
            "hydra/launcher=submitit_local",
            "hydra.launcher.tasks_per_node=2",
            "optim.lr=1e-3,3e-3",
            "tracking=none",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "trainlab: error: hydra.launcher.tasks_per_node=2: trainlab runs one driver task per node, which starts that"
        " node's ranks itself; allowed: 1 (set the ranks with parallelism.world_size, parallelism.nnodes and"
        " parallelism.nproc_per_node)"
    ], proc.stderr
    assert not list(tmp_path.rglob(".submitit")) and not list(tmp_path.rglob("*.pkl"))


def test_a_sweep_of_a_config_group_on_the_search_path_is_checked_by_its_options(tmp_path, capsys):
    """``hydra.searchpath=[file://<folder>] +variant=a,b``: each option of the folder's own group ``variant`` (a
    ``_global_`` file choosing groups and setting keys) is a job. The sweep's check composes each option; a value in
    one that the validation refuses is that job's refusal, and a sweep whose every option is refused stops before any
    job (the conformance suite's batches run this way: framework/base/testing/conformance.py)."""
    from hydra import compose, initialize_config_dir

    from framework.driver.cli import CONF_DIR
    from framework.driver.sweep import check_sweep, is_config_group

    group = tmp_path / "variant"
    group.mkdir()
    (group / "a.yaml").write_text("# @package _global_\ndefaults:\n  - override /parallelism: fsdp\n  - _self_\n")
    (group / "b.yaml").write_text("# @package _global_\ntrainer:\n  micro_batch_size: 3\n")  # 16 % 3 != 0
    searchpath = f"hydra.searchpath=[file://{tmp_path}]"
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["run_name=x", searchpath], return_hydra_config=True)
        assert is_config_group("+variant", [searchpath]) and not is_config_group("+variant")
        assert not is_config_group("trainer.max_steps", [searchpath])
        check_sweep(cfg, ["+variant=a,b"])  # a holds: the sweep runs (b is its FAILED job)
        with pytest.raises(SystemExit) as done:
            check_sweep(cfg, ["+variant=b,b"])
    err = capsys.readouterr().err
    assert done.value.code == 2 and err.startswith(
        "trainlab: error: every job of this sweep is refused: trainer.global_batch_size=16 is not divisible"
    ), err
