"""The planner's command line: --help, one line per bad input (exit 2), a TP group across nodes warned about and priced on the NIC."""

import subprocess
import sys

import pytest

from framework.driver.plan.__main__ import main


def test_help_prints_usage_and_the_plan_keys(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m framework.plan")
    for key in ("micro_batch_sizes:", "tp_degrees:", "state_accounting:", "cluster=a100_40gb", "h100_96gb"):
        assert key in out


@pytest.mark.parametrize(
    "module",
    [
        "framework.plan",
        "framework.train",
        "framework.compare",
        "framework.checkpoint",
        "framework.base.cost.whatif",
        "framework.base.metrics.local_cpu",
    ],
)
@pytest.mark.slow  # starts Python processes (the fast tier leaves it out)
def test_every_entry_point_prints_help(module):
    r = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-500:]
    assert "usage" in r.stdout.lower() or "powered by hydra" in r.stdout.lower()


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        (["plan.micro_batch_sizes=[0,1]"], "plan.micro_batch_sizes: 0 is not allowed; every entry must be an int >= 1"),
        (["plan.micro_batch_sizes=[-2]"], "plan.micro_batch_sizes: -2 is not allowed"),
        (["plan.virtual_stages=[0]"], "plan.virtual_stages: 0 is not allowed"),
        (["plan.pp_degrees=[0]"], "plan.pp_degrees: 0 is not allowed"),
        (["plan.precision=bf61"], "plan.precision='bf61' is not allowed; allowed: fp32, bf16, bf16_main_grad"),
        (["plan.state_accounting=ds"], "plan.state_accounting='ds' is not allowed; allowed: paper, master_copy"),
        (
            ["plan.nodes=1", "plan.tp_degrees=[3]"],
            "plan.tp_degrees: 3 neither divides cluster.gpus_per_node=8 nor is a multiple of it",
        ),
        (["plan.nodes=1", "plan.pp_degrees=[5]"], "plan.pp_degrees: 5 does not divide the world size 8"),
        (["plan.nodes=0"], "plan.nodes=0 is not allowed; must be an int >= 1"),
        (["data.seq_len=0"], "data.seq_len=0 is not allowed"),
        (["trainer.global_batch_size=0"], "trainer.global_batch_size=0 is not allowed"),
        (["plan.top_k=0"], "plan.top_k=0 is not allowed"),
        (["plan.zero3_prefetch=2"], "plan.zero3_prefetch=2 is not allowed; must be a number in [0, 1]"),
        (["plan.allreduce_algorithm=star"], "plan.allreduce_algorithm='star' is not allowed; allowed: ring, tree"),
    ],
)
def test_bad_input_is_one_line_naming_the_key(overrides, fragment, capsys):
    with pytest.raises(SystemExit) as info:
        main([*overrides, "tracking.enabled=false"])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert fragment in err and "\n" not in err and "Traceback" not in err


def test_tp_across_nodes_is_warned_and_priced_on_the_nic(capsys):
    assert (
        main(
            [
                "model=gpt_50m",
                "model.n_head=16",
                "data.seq_len=256",
                "plan.nodes=2",
                "plan.tp_degrees=[16]",
                "plan.pp_degrees=[1]",
                "trainer.global_batch_size=8",
                "plan.top_k=1",
                "tracking.enabled=false",
            ]
        )
        == 0
    )
    cap = capsys.readouterr()
    assert "trainlab: warning: plan.tp_degrees: tp 16 spans 2 nodes of 8 GPUs" in cap.err
    from framework.base.cost.collectives import layout_collectives
    from framework.base.cost.layout import PlanLayout
    from framework.base.cost.shape import ModelShape

    shape = ModelShape(n_layer=8, d_model=512, n_head=16, vocab_size=4096, seq_len=256)
    colls = layout_collectives(shape, PlanLayout(dp=1, tp=16, pp=1, micro_batch_size=1, global_batch_size=8), 8)
    assert {c.link for c in colls if c.group == "tp"} == {"nic"}
