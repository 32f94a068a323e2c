"""The checkpoint-kind table (dispatch of loads), resume selection, and DeepSpeed's use of the folder commit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import framework.base.checkpoint.kinds as kinds
from framework.base.checkpoint.dcp import load_into_sharded, save_sharded
from framework.base.checkpoint.format import (
    MANIFEST,
    CheckpointError,
    commit_folder,
    list_checkpoints,
    load_state,
    new_temp_folder,
    read_manifest,
    verify,
    write_checkpoint,
)
from framework.base.checkpoint.kinds import CheckpointKind, can_load, get_checkpoint_kind, register_checkpoint_kind
from framework.base.checkpoint.resume import ResumeChoice, check_resume_request, select_resume
from framework.base.config.schema import ConfigError

REPO = Path(__file__).resolve().parents[2]
# DCP without a process group (one process) says so on every save and load.
pytestmark = pytest.mark.filterwarnings("ignore:.*assuming the intent is to (save|load) in a single process")


@pytest.fixture()
def table(monkeypatch):
    """The kind table with the package's kinds only (as in a driver that loaded no plugin), restored after the test."""
    monkeypatch.setattr(kinds, "_KINDS", {k: v for k, v in kinds._KINDS.items() if k in ("full", "delta", "dcp")})
    return kinds._KINDS


def _full(dirpath: Path, step: int, value: float = 0.0) -> Path:
    return write_checkpoint(
        dirpath,
        step,
        {"global_step": step, "state_dict": {"w": torch.full((4,), value)}},
        {"kind": "full", "base": None, "tokens_seen": 0},
    )


def _own_kind_folder(dirpath: Path, step: int, kind: str) -> Path:
    """A committed folder of a plugin's own format (its own file, no state.pt)."""
    tmp = new_temp_folder(dirpath, step)
    (tmp / "own").mkdir()
    (tmp / "own" / "weights.bin").write_bytes(b"x" * 10)
    return commit_folder(tmp, step, {"kind": kind, "base": None, "tokens_seen": 0}, fsync_files=True)


def _trained_linear(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    return model, opt


def _dcp_checkpoint(dirpath: Path, step: int, model, opt) -> Path:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    checkpoint = {
        "global_step": step,
        "state_dict": get_model_state_dict(model),
        "optimizer_states": [get_optimizer_state_dict(model, opt)],
    }
    return save_sharded(dirpath, step, checkpoint, {"tokens_seen": 0})


# -- the table ---------------------------------------------------------------------------------
def test_the_package_registers_full_delta_and_dcp():
    assert {"full", "delta", "dcp"} <= set(kinds.known_kinds())
    assert all(get_checkpoint_kind(k).load_full_state is not None for k in ("full", "delta", "dcp"))
    assert get_checkpoint_kind("dcp").load_into_shards is not None
    assert get_checkpoint_kind("full").load_into_shards is None


@pytest.mark.slow  # starts Python processes (the fast tier leaves it out)
def test_the_table_imports_no_torch_or_lightning():
    """The driver consults it before any rank starts."""
    code = (
        "import sys, framework.base.checkpoint.kinds as k; k.get_checkpoint_kind('dcp');"
        " print(sorted(m for m in ('torch', 'pytorch_lightning', 'lightning_fabric') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONPATH": str(REPO), "PATH": ""},
    ).stdout
    assert out.strip() == "[]"


def test_a_different_duplicate_registration_is_refused(table):
    first = register_checkpoint_kind(CheckpointKind("mine", "my files"))
    assert register_checkpoint_kind(CheckpointKind("mine", "my files")) == first  # the same entry again: fine
    with pytest.raises(ValueError, match="'mine' is registered twice"):
        register_checkpoint_kind(CheckpointKind("mine", "other files"))
    with pytest.raises(ValueError, match="'full' is registered twice"):
        register_checkpoint_kind(CheckpointKind("full", "full checkpoints", load_full_state=lambda p: {}))
    assert get_checkpoint_kind("mine") == first


def test_an_unknown_kind_names_the_known_ones(table):
    with pytest.raises(CheckpointError, match=r"unknown checkpoint kind 'nope'; known: dcp, delta, full\b"):
        get_checkpoint_kind("nope")


@pytest.mark.parametrize(
    "kind, writes, loads_full_state, expected",
    [
        ("full", "full", True, True),
        ("delta", "full", True, True),
        ("dcp", "full", True, True),  # gathered into a full state
        ("full", "dcp", True, True),  # a sharded plugin distributes a full state
        ("dcp", "dcp", True, True),
        ("own", "own", False, True),  # a plugin loads its own format
        ("full", "own", False, False),  # ... and only that
        ("dcp", "own", False, False),
        ("own", "full", True, False),  # registered without a full-state loader
        ("unregistered", "full", True, False),  # not registered in this process: only its writer loads it
        ("unregistered", "unregistered", False, True),
    ],
)
def test_can_load(table, kind, writes, loads_full_state, expected):
    register_checkpoint_kind(CheckpointKind("own", "own files"))
    assert can_load(kind, writes=writes, loads_full_state=loads_full_state) is expected


# -- dispatch ----------------------------------------------------------------------------------
def test_load_state_dispatches_on_the_manifest_kind(table, tmp_path):
    calls = []

    def load_mine(path):
        calls.append(path)
        return {"global_step": 5, "from": "mine"}

    register_checkpoint_kind(CheckpointKind("mine", "my files", load_full_state=load_mine))
    mine = _own_kind_folder(tmp_path, 5, "mine")
    assert load_state(mine) == {"global_step": 5, "from": "mine"} and calls == [mine]
    full = _full(tmp_path, 6, 2.0)
    assert torch.equal(load_state(full)["state_dict"]["w"], torch.full((4,), 2.0)) and calls == [mine]


def test_saves_dispatch_on_the_declared_kind_not_on_the_state(table, tmp_path):
    """The checkpoint IO saves the kind the plugin declares: a kind with ``save_shards`` goes to it on every rank
    (even when the state holds plain tensors, as pipeline stages do); ``full`` writes one state file; the
    on-disk result of a dcp save is the same folder as before (manifest kind ``dcp``, loadable as a full state)."""
    from framework.base.checkpoint.io import FolderCheckpointIO

    def io(kind):
        return FolderCheckpointIO(
            keep_last_k=3, asynchronous=False, full_every_n_saves=1, manifest_fields={}, tokens_per_step=10, kind=kind
        )

    calls = []
    register_checkpoint_kind(
        CheckpointKind("shards", "my shards", save_shards=lambda d, s, c, m: calls.append((s, m)) or None)
    )
    io("shards").save_checkpoint(
        {"global_step": 3, "state_dict": {"w": torch.ones(2)}}, tmp_path / "a" / "step00000003"
    )
    assert (
        calls == [(3, {"tokens_seen": 30})] and not (tmp_path / "a").exists()
    )  # not rank 0's folder here: nothing reported

    model, opt = _trained_linear()
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    state = {
        "global_step": 4,
        "state_dict": get_model_state_dict(model),
        "optimizer_states": [get_optimizer_state_dict(model, opt)],
    }
    dcp_io = io("dcp")
    dcp_io.save_checkpoint(state, tmp_path / "b" / "step00000004")
    (done,) = dcp_io.pop_results()
    assert done.kind == "dcp" and read_manifest(done.path)["kind"] == "dcp" and verify(done.path) == []
    assert torch.equal(load_state(done.path)["state_dict"]["weight"], model.weight.detach())

    full_io = io("full")
    full_io.save_checkpoint({"global_step": 5, "state_dict": {"w": torch.ones(2)}}, tmp_path / "c" / "step00000005")
    (done,) = full_io.pop_results()
    assert done.kind == "full" and read_manifest(done.path)["kind"] == "full"
    with pytest.raises(CheckpointError, match="unknown checkpoint kind 'nope'"):
        io("nope")


def test_a_kind_without_a_full_state_is_refused_by_load_state(table, tmp_path):
    register_checkpoint_kind(CheckpointKind("own", "my plugin's own files"))
    path = _own_kind_folder(tmp_path, 3, "own")
    with pytest.raises(
        CheckpointError,
        match=r"my plugin's own files \('own'\) do not gather into one full state;"
        r" only a plugin that writes 'own' checkpoints loads them",
    ):
        load_state(path)
    unknown = _own_kind_folder(tmp_path / "b", 3, "unregistered")
    with pytest.raises(CheckpointError, match="unknown checkpoint kind 'unregistered'"):
        load_state(unknown)


def test_a_dcp_checkpoint_gathers_into_a_full_state_and_loads_into_live_tensors(table, tmp_path):
    model, opt = _trained_linear()
    path = _dcp_checkpoint(tmp_path, 4, model, opt)
    assert read_manifest(path)["kind"] == "dcp" and verify(path) == []
    full = load_state(path)  # through the table's full-state loader
    assert torch.equal(full["state_dict"]["weight"], model.weight.detach())
    assert torch.equal(full["optimizer_states"][0]["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])

    # load_into_sharded reads a kind with load_into_shards straight into the live tensors, through the table
    used = []
    dcp_kind = table["dcp"]
    table["dcp"] = CheckpointKind(
        "dcp",
        dcp_kind.description,
        load_full_state=dcp_kind.load_full_state,
        load_into_shards=lambda p, t: used.append(p) or dcp_kind.load_into_shards(p, t),
    )
    fresh, fresh_opt = _trained_linear(seed=1)
    rest = load_into_sharded(path, fresh, [fresh_opt])
    assert used == [path] and rest["global_step"] == 4
    assert torch.equal(fresh.weight, model.weight) and torch.equal(fresh.bias, model.bias)
    assert torch.equal(fresh_opt.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])


def test_load_into_sharded_distributes_a_full_state(table, tmp_path):
    model, opt = _trained_linear()
    full = load_state(_dcp_checkpoint(tmp_path / "dcp", 2, model, opt))
    path = write_checkpoint(tmp_path / "full", 2, full, {"kind": "full", "base": None, "tokens_seen": 0})
    fresh, fresh_opt = _trained_linear(seed=1)
    rest = load_into_sharded(path, fresh, [fresh_opt])
    assert rest["global_step"] == 2 and torch.equal(fresh.weight, model.weight)
    assert torch.equal(fresh_opt.state_dict()["state"][1]["exp_avg_sq"], opt.state_dict()["state"][1]["exp_avg_sq"])


def test_load_into_sharded_refuses_a_kind_only_its_plugin_loads(table, tmp_path):
    register_checkpoint_kind(CheckpointKind("own", "my plugin's own files"))
    fresh, fresh_opt = _trained_linear()
    with pytest.raises(CheckpointError, match="do not gather into one full state"):
        load_into_sharded(_own_kind_folder(tmp_path, 1, "own"), fresh, [fresh_opt])


# -- the folder commit -------------------------------------------------------------------------
def test_commit_folder_lists_nested_files_and_replaces_a_step_only_when_complete(tmp_path):
    first = _own_kind_folder(tmp_path, 7, "own")
    files = read_manifest(first)["files"]
    assert files == {"own/weights.bin": {"sha256": files["own/weights.bin"]["sha256"], "bytes": 10}}
    tmp = new_temp_folder(tmp_path, 7)
    (tmp / "own").mkdir()
    (tmp / "own" / "weights.bin").write_bytes(b"y" * 12)
    again = commit_folder(tmp, 7, {"kind": "own", "base": None}, fsync_files=True)
    assert again == first and verify(again) == [] and read_manifest(again)["bytes"] == 12
    assert [p.name for p in tmp_path.iterdir()] == ["step00000007"]  # no temporary or set-aside folder left


def test_deepspeed_saves_commit_through_the_folder_format(tmp_path, monkeypatch):
    """``plugins.deepspeed.checkpoint`` registers its kind and writes through ``format.commit_folder``."""
    import plugins.deepspeed.checkpoint as ds

    assert get_checkpoint_kind("deepspeed").load_full_state is None
    assert not can_load("deepspeed", writes="full", loads_full_state=True)
    committed = []
    real_commit = ds.commit_folder
    monkeypatch.setattr(ds, "commit_folder", lambda *a, **kw: committed.append(kw) or real_commit(*a, **kw))

    class Engine:
        def save_checkpoint(self, save_dir, client_state, tag):
            (Path(save_dir) / tag).mkdir()
            (Path(save_dir) / tag / "mp_rank_00_model_states.pt").write_bytes(json.dumps(client_state).encode())
            (Path(save_dir) / "latest").write_text(tag)

    results = []
    io = SimpleNamespace(
        manifest_fields={"layout": {"world_size": 1}}, tokens_per_step=10, keep_last_k=2, record=results.append
    )
    strategy = SimpleNamespace(
        checkpoint_io=io, broadcast=lambda x: x, is_global_zero=True, barrier=lambda: None, deepspeed_engine=Engine()
    )
    for step in (3, 3, 6, 9):  # step 3 saved twice: replaced
        ds.save_folder(
            strategy,
            {"global_step": step, "state_dict": {}, "optimizer_states": [], "loops": step},
            tmp_path / f"step{step:08d}",
        )
    assert [s for s, _ in list_checkpoints(tmp_path)] == [6, 9]  # pruned to keep_last_k
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step00000006", "step00000009"]
    m = read_manifest(tmp_path / "step00000009")
    assert (
        m["kind"] == "deepspeed" and m["base"] is None and m["tokens_seen"] == 90 and m["layout"] == {"world_size": 1}
    )
    assert set(m["files"]) == {"latest", "deepspeed/mp_rank_00_model_states.pt"}
    assert verify(tmp_path / "step00000009") == [] and (tmp_path / "step00000009" / MANIFEST).is_file()
    assert committed == [{"fsync_files": True}] * 4
    assert [r.step for r in results] == [3, 3, 6, 9] and results[-1].bytes == m["bytes"]
    assert results[-1].path == tmp_path / "step00000009"


# -- resume selection --------------------------------------------------------------------------
def _check(resume, ckdir, plugin="single", writes="full", loads_full_state=True, writers=None):
    check_resume_request(
        str(resume), str(ckdir), plugin, writes=writes, loads_full_state=loads_full_state, writers=writers
    )


def test_resume_never_with_checkpoints_names_checkpoint_dir(tmp_path):
    _check("never", tmp_path)  # empty: fine
    _full(tmp_path, 4)
    _full(tmp_path, 8)
    with pytest.raises(ConfigError) as info:
        _check("never", tmp_path)
    assert str(info.value) == (
        f"resume=never but checkpoint.dir={tmp_path} already holds checkpoints (up to step 8);"
        " remove it or choose another checkpoint.dir"
    )
    _check("auto", tmp_path)


def test_resume_folder_that_is_not_intact_is_refused(tmp_path):
    path = _full(tmp_path, 2)
    (path / "state.pt").write_bytes(b"changed")
    with pytest.raises(
        ConfigError,
        match=r"resume='.*step00000002': not a usable checkpoint folder \(.*\); allowed: auto,"
        r" never, or an intact checkpoint folder$",
    ):
        _check(path, tmp_path / "other")
    with pytest.raises(ConfigError, match="not a usable checkpoint folder"):
        _check(tmp_path / "missing", tmp_path / "other")


def test_resume_a_kind_only_its_plugin_loads(table, tmp_path):
    own = _own_kind_folder(tmp_path / "a", 15, "own")  # not registered here, as in the driver of another plugin
    writers = {"own": ["own1", "own2"], "full": ["single", "ddp"]}.get
    with pytest.raises(ConfigError) as info:
        _check(own, tmp_path / "b", writers=writers)
    assert str(info.value) == (
        f"resume={str(own)!r}: a 'own' checkpoint cannot be loaded by plugin 'single'; allowed: parallelism=own1|own2"
    )
    with pytest.raises(ConfigError, match="allowed: a plugin that writes 'own' checkpoints$"):
        _check(own, tmp_path / "b")
    register_checkpoint_kind(CheckpointKind("own", "own files"))  # registered (the plugin was imported): the same
    with pytest.raises(ConfigError, match=r"allowed: parallelism=own1\|own2$"):
        _check(own, tmp_path / "b", writers=writers)
    _check(own, tmp_path / "b", plugin="own1", writes="own", loads_full_state=False)  # its own plugin: fine

    full = _full(tmp_path / "c", 3)  # the other way: a plugin that loads only its own kind
    with pytest.raises(ConfigError) as info:
        _check(full, tmp_path / "b", plugin="own1", writes="own", loads_full_state=False, writers=writers)
    assert str(info.value) == (
        f"resume={str(full)!r}: a 'full' checkpoint cannot be loaded by plugin 'own1';"
        " allowed: a checkpoint written by own1|own2"
    )
    with pytest.raises(ConfigError, match="allowed: a 'own' checkpoint$"):
        _check(full, tmp_path / "b", plugin="own1", writes="own", loads_full_state=False)


def test_resume_a_sharded_checkpoint_into_a_full_state_plugin_and_back(tmp_path):
    model, opt = _trained_linear()
    dcp = _dcp_checkpoint(tmp_path / "a", 2, model, opt)
    full = _full(tmp_path / "b", 2)
    _check(dcp, tmp_path / "c", plugin="single", writes="full")
    _check(full, tmp_path / "c", plugin="fsdp", writes="dcp")


def test_select_resume_skips_a_corrupt_newest_checkpoint(tmp_path):
    _full(tmp_path, 5)
    newest = _full(tmp_path, 10)
    data = bytearray((newest / "state.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (newest / "state.pt").write_bytes(bytes(data))
    warnings: list[str] = []
    choice = select_resume("auto", tmp_path, warnings.append)
    assert choice == ResumeChoice(path=str(tmp_path / "step00000005"), step=5)
    assert len(warnings) == 1 and "skipping corrupt checkpoint" in warnings[0] and str(newest) in warnings[0]


def test_select_resume_never_folder_and_empty(tmp_path):
    assert select_resume("auto", tmp_path / "empty", pytest.fail) == ResumeChoice(path=None, step=0)
    path = _full(tmp_path, 7)
    assert select_resume("never", tmp_path, pytest.fail) == ResumeChoice(path=None, step=0)
    assert select_resume(str(path), tmp_path / "elsewhere", pytest.fail) == ResumeChoice(path=str(path), step=7)
