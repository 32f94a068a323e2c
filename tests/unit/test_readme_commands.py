"""The README's commands chain (issue 23, item 8): every sweep it shows lands in an experiment that a
`framework.compare --experiment` command after it reads, so a reader who runs them top to bottom gets
every command working (a plain sweep without experiment_name lands in `default`, beside MLflow's `Default`)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _experiment_of(command: str) -> str:
    """The MLflow experiment a `framework.train` command's runs land in."""
    named = re.search(r"\bexperiment_name=(\S+)", command)
    if named:
        return named.group(1)
    preset = re.search(r"\bexperiment=(\w+)", command)
    if preset:
        text = (ROOT / "conf" / "experiment" / f"{preset.group(1)}.yaml").read_text()
        return re.search(r"^experiment_name:\s*(\S+)", text, re.M).group(1)
    return "default"


def test_every_sweep_in_the_readme_is_compared_after_it():
    lines = [ln.split("#")[0].strip() for ln in (ROOT / "README.md").read_text().splitlines()]
    sweeps = [
        (i, _experiment_of(ln))
        for i, ln in enumerate(lines)
        if ln.startswith("python -m framework.train")
        and (" -m " in ln.split("framework.train", 1)[1] or "experiment=" in ln)
    ]
    compared = [
        (i, m.group(1))
        for i, ln in enumerate(lines)
        for m in [re.search(r"framework\.compare --experiment (\S+)", ln)]
        if m
    ]
    assert sweeps and compared
    for i, experiment in sweeps:
        assert any(j > i and name == experiment for j, name in compared), (
            f"README line {i + 1}: its sweep lands in experiment {experiment!r}, which no later compare command reads"
        )
