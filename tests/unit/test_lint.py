"""The formatter and linter (ruff, configured in pyproject.toml) are part of the suite: a file that
ruff would reformat, or a lint finding, fails here with ruff's own report. Skips, saying so, only
where ruff is not installed (it is in the ``dev`` extra)."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _ruff() -> list[str]:
    exe = Path(sys.executable).with_name("ruff")
    if exe.exists():
        return [str(exe)]
    found = shutil.which("ruff")
    if found is None:
        pytest.skip("ruff is not installed (pip install -e '.[dev]' installs it)")
    return [found]


def test_ruff_format_leaves_every_file_unchanged():
    proc = subprocess.run([*_ruff(), "format", "--check", "--diff", "."], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, (
        f"ruff format would change files (run `ruff format .`):\n{proc.stdout[-4000:]}{proc.stderr[-2000:]}"
    )


def test_ruff_check_finds_nothing():
    proc = subprocess.run(
        [*_ruff(), "check", "--output-format", "concise", "."], cwd=ROOT, capture_output=True, text=True
    )
    assert proc.returncode == 0, (
        f"ruff check findings (run `ruff check --fix .`):\n{proc.stdout[-4000:]}{proc.stderr[-2000:]}"
    )
