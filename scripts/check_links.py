"""Check that every relative markdown link in the repository's documentation resolves inside it.

    python scripts/check_links.py            # README.md, docs/, experiments/, plugins/; exit 1 on a bad link

A link ``[text](target)`` or an image ``![alt](target)`` is checked when its target is not a URL
(``http://``, ``https://``, ``mailto:``): the path (relative to the markdown file; ``#anchor``
alone refers to the file itself) must exist inside the repository, and an ``#anchor`` on a
markdown target must name one of its headings (GitHub's slug: lower case, punctuation dropped,
spaces to hyphens). Absolute paths (``/work/...``) are errors: they resolve only on one machine.
Links inside fenced code blocks and inline code are ignored.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("README.md", "docs", "experiments", "plugins")
_LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_FENCE = re.compile(r"^\s*(```|~~~)")
_INLINE_CODE = re.compile(r"`[^`]*`")
_EXTERNAL = ("http://", "https://", "mailto:", "ftp://")


def markdown_files(root: Path = ROOT, sources: tuple[str, ...] = SOURCES) -> list[Path]:
    """The markdown files under ``sources`` (files or folders relative to ``root``), sorted."""
    out: list[Path] = []
    for s in sources:
        p = root / s
        if p.is_file():
            out.append(p)
        elif p.is_dir():
            out.extend(sorted(q for q in p.rglob("*.md") if ".venv" not in q.parts))
    return out


def links(text: str) -> list[tuple[int, str]]:
    """``(line number, target)`` of every markdown link outside code."""
    found, fenced = [], False
    for n, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if fenced:
            continue
        for m in _LINK.finditer(_INLINE_CODE.sub("", line)):
            found.append((n, m.group(1)))
    return found


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, markup and punctuation dropped, spaces to hyphens."""
    h = re.sub(r"[`*]|<[^>]+>", "", heading.strip().lower())
    h = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", h)
    h = re.sub(r"[^\w\- ]", "", h, flags=re.UNICODE)
    return h.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a markdown file (duplicates numbered ``-1``, ``-2`` as GitHub does)."""
    seen: dict[str, int] = {}
    out, fenced = set(), False
    for line in path.read_text(encoding="utf-8").splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            continue
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m and not fenced:
            s = slug(m.group(1))
            n = seen.get(s, 0)
            out.add(s if n == 0 else f"{s}-{n}")
            seen[s] = n + 1
    return out


def check_file(path: Path, root: Path = ROOT) -> list[str]:
    """One line per broken link of ``path``: ``file:line: target: why``."""
    errors = []
    rel = path.relative_to(root)
    for n, target in links(path.read_text(encoding="utf-8")):
        if target.startswith(_EXTERNAL):
            continue
        where, _, anchor = target.partition("#")
        if where.startswith("/"):
            errors.append(
                f"{rel}:{n}: {target}: an absolute path (resolves on one machine only); link relative to the file"
            )
            continue
        dest = (path.parent / where).resolve() if where else path
        try:
            dest.relative_to(root)
        except ValueError:
            errors.append(f"{rel}:{n}: {target}: points outside the repository")
            continue
        if not dest.exists():
            errors.append(f"{rel}:{n}: {target}: no such file")
            continue
        if anchor and dest.is_file() and dest.suffix == ".md" and anchor not in anchors(dest):
            errors.append(f"{rel}:{n}: {target}: no heading #{anchor} in {dest.relative_to(root)}")
    return errors


def main(argv: list[str] | None = None) -> int:
    files = markdown_files()
    errors = [e for f in files for e in check_file(f)]
    for e in errors:
        print(e)
    total = sum(len(links(f.read_text(encoding="utf-8"))) for f in files)
    print(f"{len(files)} markdown files, {total} links, {len(errors)} broken")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
