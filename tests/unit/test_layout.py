"""The layout object, the plugin contract's capability checks, and that framework/ never names or probes a plugin."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from framework.base.config.schema import ConfigError, ParallelConfig
from framework.base.layout import MESH_DIM_NAMES, ParallelLayout
from framework.base.load import resolved_from_dict
from framework.base.registry import available_plugins
from framework.driver.validate import load_run_config, validate

FRAMEWORK = Path(__file__).resolve().parents[2] / "framework"


def test_layout_derives_dp_and_names_every_factor():
    assert ParallelLayout.from_config(ParallelConfig(world_size=8, tp_degree=2, pp_degree=2)) == ParallelLayout(
        dp=2, tp=2, pp=2
    )
    with pytest.raises(
        ConfigError, match=r"parallelism.world_size=3 != dp_degree\(2\) x tp_degree\(2\) x pp_degree\(1\) = 4"
    ):
        ParallelLayout.from_config(ParallelConfig(world_size=3, dp_degree=2, tp_degree=2))
    with pytest.raises(ConfigError, match=r"world_size=6 is not divisible by tp_degree\(4\) x pp_degree\(1\)"):
        ParallelLayout.from_config(ParallelConfig(world_size=6, tp_degree=4))
    with pytest.raises(ConfigError, match="tp=0 must be >= 1"):
        ParallelLayout(dp=1, tp=0)
    with pytest.raises(ConfigError, match="world_size=6 is not divisible by parallelism.nnodes=4"):
        ParallelLayout(dp=6, nnodes=4)


def test_rank_coordinates_put_tp_innermost():
    lay = ParallelLayout(dp=2, tp=2, pp=2)
    assert lay.shape == (2, 2, 2) and MESH_DIM_NAMES == ("pp", "dp", "tp")
    coords = [lay.coordinates(r) for r in range(8)]
    assert [c["tp"] for c in coords] == [0, 1] * 4
    assert [lay.dp_rank(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert [c["pp"] for c in coords] == [0] * 4 + [1] * 4
    for r, c in enumerate(coords):  # the inverse: r = (pp_i * dp + dp_i) * tp + tp_i
        assert (c["pp"] * lay.dp + c["dp"]) * lay.tp + c["tp"] == r
    with pytest.raises(ValueError):
        lay.coordinates(8)
    assert lay.describe() == "dp2-tp2-pp2" and lay.degree("tp") == 2


def test_the_resolved_run_crosses_to_the_ranks_unchanged(compose):
    import json

    resolved = validate(load_run_config(compose("parallelism=pp", "checkpoint=none", "trainer.micro_batch_size=4")))
    back = resolved_from_dict(json.loads(json.dumps(resolved.to_dict())))
    assert back == resolved
    assert back.owns_microbatching and back.loader_batch_size == 16 and back.trainer_accumulate_grad_batches == 1


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        (
            ["parallelism=fsdp", "parallelism.tp_degree=2", "parallelism.world_size=2"],
            "plugin 'fsdp' is data parallel only",
        ),
        (["parallelism=zero1", "parallelism.pp_degree=2"], "plugin 'deepspeed' is data parallel only"),
        (
            ["parallelism=fsdp", "checkpoint=memory", "checkpoint.mode=async"],
            "plugin 'fsdp' saves sharded (DCP) checkpoints synchronously only",
        ),
        (
            ["parallelism=pp", "checkpoint=memory"],
            "plugin 'pp' does not keep in-memory snapshots (not tested with pipeline stages)",
        ),
    ],
)
def test_capabilities_are_checked_by_the_framework(compose, overrides, fragment):
    with pytest.raises(ConfigError) as info:
        validate(load_run_config(compose(*overrides)))
    assert fragment in str(info.value) and "\n" not in str(info.value)


def test_policies_a_plugin_declares_pass(compose):
    validate(load_run_config(compose("parallelism=fsdp", "checkpoint=memory")))  # DTensor snapshots: declared
    validate(load_run_config(compose("parallelism=ddp", "checkpoint=async")))


def _code_strings_and_probes(path: Path) -> tuple[list[str], list[int]]:
    """String constants outside docstrings, and lines of getattr/hasattr calls on something named *plugin*."""
    tree = ast.parse(path.read_text())
    docstrings = {
        id(n.body[0].value)
        for n in ast.walk(tree)
        if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and n.body
        and isinstance(n.body[0], ast.Expr)
        and isinstance(n.body[0].value, ast.Constant)
    }
    strings = [
        n.value
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings
    ]
    probes = [
        n.lineno
        for n in ast.walk(tree)
        if isinstance(n, ast.Call)
        and isinstance(n.func, ast.Name)
        and n.func.id in ("getattr", "hasattr")
        and n.args
        and "plugin" in ast.unparse(n.args[0])
    ]
    return strings, probes


def test_framework_code_never_names_or_probes_a_plugin():
    # "single" is also an English word in messages; "tp" and "pp" are also mesh axes (MESH_DIM_NAMES).
    names = set(available_plugins()) - {"single"} - set(MESH_DIM_NAMES)
    for path in FRAMEWORK.rglob("*.py"):
        strings, probes = _code_strings_and_probes(path)
        named = {s for s in strings for n in names if re.fullmatch(re.escape(n), s)}
        assert not named, f"{path} names plugin(s) {named}"
        assert not probes, f"{path} probes a plugin with getattr/hasattr at line(s) {probes}"


def test_the_layout_names_the_axes_whose_groups_cross_nodes():
    # TP innermost: ranks 0-3 on node 0, 4-7 on node 1
    assert ParallelLayout(dp=4, nnodes=2).cross_node_axes() == ("dp",)
    assert ParallelLayout(dp=4).cross_node_axes() == ()
    lay = ParallelLayout(
        dp=2, tp=2, pp=2, nnodes=2
    )  # a node is one pipeline stage: its dp and tp groups stay inside it
    assert [lay.nodes_per_group(a) for a in ("pp", "dp", "tp")] == [2, 1, 1] and lay.cross_node_axes() == ("pp",)
    lay = ParallelLayout(dp=4, tp=2, nnodes=4)  # 2 ranks a node: one TP group per node, DP across all 4 nodes
    assert [lay.nodes_per_group(a) for a in ("dp", "tp")] == [4, 1] and [lay.node_of(r) for r in (0, 1, 2, 7)] == [
        0,
        0,
        1,
        3,
    ]
