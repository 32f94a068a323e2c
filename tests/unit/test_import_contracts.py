"""The import contracts of ``.importlinter`` hold (driver above rank above base; the driver reaches the
ranks only through the launcher; plugins on base only), checked with import-linter in this process."""

from __future__ import annotations

import configparser
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_import_contracts_hold(capsys, monkeypatch):
    try:
        from importlinter.cli import lint_imports
    except ImportError:
        print("import-linter is not installed (pip install -e '.[dev]'): the import contracts are not checked")
        pytest.skip("import-linter is not installed (the dev extra): the import contracts are not checked")
    import framework

    assert Path(framework.__file__).resolve().parents[1] == REPO, (
        f"framework is imported from {framework.__file__}, not from this checkout: run with PYTHONPATH={REPO}"
    )
    monkeypatch.chdir(REPO)
    code = lint_imports(config_filename=str(REPO / ".importlinter"), no_cache=True, no_logo=True)
    out = capsys.readouterr().out
    assert code == 0, "import contracts broken (.importlinter):\n" + out
    ini = configparser.ConfigParser()
    ini.read_string((REPO / ".importlinter").read_text())
    contracts = sum(s.startswith("importlinter:contract:") for s in ini.sections())
    assert f"{contracts} kept, 0 broken" in out, out  # every contract of the file was found and checked
