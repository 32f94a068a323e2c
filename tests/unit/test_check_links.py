"""scripts/check_links.py: every relative markdown link in README, docs, experiments and plugins resolves in the repository."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("check_links", ROOT / "scripts" / "check_links.py")
check_links = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_links)


def test_broken_links_absolute_paths_and_missing_anchors_are_reported(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "b.md").write_text("# Title\n\n## The `cost_model` (x)\n")
    (tmp_path / "docs" / "a.md").write_text(
        "[ok](b.md) [ok anchor](b.md#the-cost_model-x) [self](#top) ![img](b.md)\n"
        "[missing](c.md)\n"
        "[abs](/work/shared/REFERENCES.md)\n"
        "[bad anchor](b.md#nope)\n"
        "[outside](../../x.md)\n"
        "[web](https://example.com/x.md) `[code](nothere.md)`\n"
        "```\n[fenced](nothere.md)\n```\n"
        "# Top\n"
    )
    errors = check_links.check_file(tmp_path / "docs" / "a.md", root=tmp_path)
    assert [e.split(": ", 1)[0] for e in errors] == ["docs/a.md:2", "docs/a.md:3", "docs/a.md:4", "docs/a.md:5"]
    assert "no such file" in errors[0] and "absolute path" in errors[1]
    assert "no heading #nope in docs/b.md" in errors[2] and "outside the repository" in errors[3]


def test_every_link_in_the_repository_resolves():
    files = check_links.markdown_files()
    assert ROOT / "README.md" in files and any(f.parts[-2] == "docs" for f in files)
    errors = [e for f in files for e in check_links.check_file(f)]
    assert errors == []
