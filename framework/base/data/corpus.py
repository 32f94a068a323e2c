"""Document sources and the deterministic train/val split.

A *corpus* is an ordered list of documents (Python ``str``), split into train and val.
Three sources, chosen by ``data.name``:

- ``stdlib_code``: every ``.py`` file of the running Python's standard library
  (``sysconfig.get_paths()["stdlib"]``), one document per file. ``site-packages``,
  ``dist-packages`` and ``__pycache__`` folders are skipped; the stdlib's own test folders
  (``test/``, ``*/tests/``) are **kept** - they are real code and more than half of the bytes
  (about 31 MB in all for CPython 3.11, 12.6 MB without tests). Files that are not valid
  UTF-8 (a few deliberately broken test inputs) are skipped and counted.
- ``text_files``: ``data.paths`` are globs (``**`` recursive, ``~`` expanded) of UTF-8 text
  files, one document per file. A non-UTF-8 file is an error, not a silent skip.
- ``jsonl``: ``data.paths`` are globs of JSONL files; each non-blank line is a JSON object and
  its ``data.text_field`` string is one document.

Listing (:func:`list_sources`) only stats files, so the token cache key can be computed
cheaply on every rank; reading (:func:`read_corpus`) happens only when a cache is built.

Order and caps: files are taken in sorted order (by path relative to the stdlib root for
``stdlib_code``, by absolute path otherwise). ``data.max_bytes`` caps the total, whole
documents only (never a cut one): file sources take files in order and skip any file that
would overflow the cap (stat sizes, so nothing beyond the cap is read); ``jsonl`` takes
documents in order until the first one whose UTF-8 text would overflow it.

Split: each document gets a stable hash of its identity (relative path, plus line number for
``jsonl``); the ``max(1, round(n * data.val_fraction))`` documents with the smallest hashes are
val, the rest train. Both splits keep corpus order. The split depends only on the document
set and ``val_fraction`` - not on ``data.seed`` - so seed sweeps share one token cache.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import sysconfig
from dataclasses import dataclass, field

from framework.base.config.schema import ConfigError, DataConfig

_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


@dataclass(frozen=True)
class SourceFile:
    """One input file as listed (stat only, not read)."""

    path: str  # absolute path
    rel: str  # path relative to the corpus root, '/'-separated (stable split identity)
    size: int  # bytes on disk
    mtime_ns: int  # modification time (ns); part of the cache key


@dataclass(frozen=True)
class SourceListing:
    """The files a :class:`DataConfig` selects, after the ``max_bytes`` cap (file sources)."""

    name: str  # data.name
    root: str  # common folder the ``rel`` paths are relative to
    files: tuple[SourceFile, ...]

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


@dataclass
class Corpus:
    """Documents split into train and val, in corpus order."""

    train: list[str]
    val: list[str]
    num_files: int  # source files read (after skips)
    skipped_files: list[str] = field(default_factory=list)  # stdlib files that are not UTF-8

    @property
    def train_bytes(self) -> int:
        return sum(len(d.encode("utf-8")) for d in self.train)

    @property
    def val_bytes(self) -> int:
        return sum(len(d.encode("utf-8")) for d in self.val)


# ---------------------------------------------------------------------------------- listing


def list_sources(cfg: DataConfig) -> SourceListing:
    """Stat the files ``cfg`` selects, in deterministic order. Reads no file contents.

    Raises:
        ConfigError: a glob matches no file, or ``max_bytes`` is smaller than every file.
    """
    if cfg.name == "stdlib_code":
        root = os.path.realpath(sysconfig.get_paths()["stdlib"])
        files = _walk_stdlib(root)
        if not files:
            raise ConfigError(f"data.name=stdlib_code: no .py files under the stdlib folder {root!r}")
    elif cfg.name in ("text_files", "jsonl"):
        paths = _expand_globs(cfg.paths)
        root = os.path.commonpath(paths) if len(paths) > 1 else os.path.dirname(paths[0])
        files = [_stat(p, os.path.relpath(p, root).replace(os.sep, "/")) for p in paths]
    else:  # DataConfig.__post_init__ already rejects this
        raise ConfigError(f"data.name={cfg.name!r} is not a data source")

    files = [f for f in files if f.size > 0]  # empty files hold no document
    if not files:
        where = f"data.paths={cfg.paths}" if cfg.paths else f"data.name={cfg.name}"
        raise ConfigError(f"{where}: every selected file is empty")
    if cfg.max_bytes is not None and cfg.name != "jsonl":
        files = _cap_files(files, cfg.max_bytes)
    return SourceListing(name=cfg.name, root=root, files=tuple(files))


def _walk_stdlib(root: str) -> list[SourceFile]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        for fn in filenames:
            if fn.endswith(".py"):
                p = os.path.join(dirpath, fn)
                if os.path.isfile(p):
                    out.append(_stat(p, os.path.relpath(p, root).replace(os.sep, "/")))
    out.sort(key=lambda f: f.rel)
    return out


def _expand_globs(patterns: list[str]) -> list[str]:
    """Absolute, de-duplicated, sorted file paths matched by ``patterns`` (data.paths)."""
    found: set[str] = set()
    for pat in patterns:
        expanded = os.path.expanduser(pat)
        hits = glob.glob(expanded, recursive=True)
        files = [os.path.abspath(h) for h in hits if os.path.isfile(h)]
        if not files:
            if hits:
                raise ConfigError(
                    f"data.paths: {pat!r} matches only folders; use a file glob such as '{pat.rstrip('/')}/**/*.txt'"
                )
            raise ConfigError(f"data.paths: no file matches {pat!r}")
        found.update(files)
    return sorted(found)


def _stat(path: str, rel: str) -> SourceFile:
    st = os.stat(path)
    return SourceFile(path=os.path.abspath(path), rel=rel, size=st.st_size, mtime_ns=st.st_mtime_ns)


def _cap_files(files: list[SourceFile], max_bytes: int) -> list[SourceFile]:
    """Files taken in order, skipping any that would push the total past ``max_bytes``."""
    out, total = [], 0
    for f in files:
        if total + f.size <= max_bytes:
            out.append(f)
            total += f.size
    if not out:
        smallest = min(files, key=lambda f: f.size)
        raise ConfigError(
            f"data.max_bytes={max_bytes} is smaller than every file (smallest: {smallest.rel!r}, {smallest.size} bytes)"
        )
    return out


# ---------------------------------------------------------------------------------- reading


def read_corpus(cfg: DataConfig, listing: SourceListing | None = None) -> Corpus:
    """Read and split the documents of ``listing`` (default: ``list_sources(cfg)``).

    Raises:
        ConfigError: a text file is not UTF-8; a JSONL line is not a JSON object or lacks a
            string ``data.text_field``; fewer than 2 documents (no train/val split possible).
    """
    listing = listing if listing is not None else list_sources(cfg)
    skipped: list[str] = []
    docs: list[tuple[str, str]] = []  # (split identity, text)
    if cfg.name == "jsonl":
        total, cap = 0, cfg.max_bytes
        all_docs = ((f"{f.rel}:{ln}", text) for f in listing.files for ln, text in _read_jsonl(f.path, cfg.text_field))
        for ident, text in all_docs:
            n = len(text.encode("utf-8"))
            if cap is not None and total + n > cap:
                if not docs:
                    raise ConfigError(f"data.max_bytes={cap} is smaller than the first document ({ident}, {n} bytes)")
                break  # the first document that does not fit ends the corpus
            total += n
            docs.append((ident, text))
        num_files = len({d[0].rsplit(":", 1)[0] for d in docs})
    else:
        for f in listing.files:
            with open(f.path, "rb") as fh:
                raw = fh.read()
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                if cfg.name == "stdlib_code":
                    skipped.append(f.rel)
                    continue
                raise ConfigError(f"data.paths: {f.path} is not UTF-8 text (bad byte at offset {e.start})") from None
            if text:
                docs.append((f.rel, text))
        num_files = len(docs)
    train, val = split_documents(docs, cfg.val_fraction, what=_describe(cfg))
    return Corpus(train=train, val=val, num_files=num_files, skipped_files=skipped)


def _read_jsonl(path: str, text_field: str):
    """Yield ``(line number, text)`` for each non-blank line of a JSONL file (empty texts skipped)."""
    with open(path, encoding="utf-8") as fh:
        try:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ConfigError(
                        f"{path}:{lineno}: not valid JSON ({e.msg}); data.name=jsonl expects one object per line"
                    ) from None
                if not isinstance(obj, dict) or text_field not in obj:
                    keys = ", ".join(map(str, obj)) if isinstance(obj, dict) else type(obj).__name__
                    raise ConfigError(f"{path}:{lineno}: no field data.text_field={text_field!r} (found: {keys})")
                text = obj[text_field]
                if not isinstance(text, str):
                    raise ConfigError(
                        f"{path}:{lineno}: data.text_field={text_field!r} is a {type(text).__name__}, not a string"
                    )
                if text:
                    yield lineno, text
        except UnicodeDecodeError as e:
            raise ConfigError(f"data.paths: {path} is not UTF-8 text (bad byte at offset {e.start})") from None


def _describe(cfg: DataConfig) -> str:
    return f"data.name={cfg.name}" + (f", data.paths={cfg.paths}" if cfg.paths else "")


def split_documents(
    docs: list[tuple[str, str]], val_fraction: float, *, what: str = "corpus"
) -> tuple[list[str], list[str]]:
    """Split ``(identity, text)`` pairs into (train texts, val texts), both in input order.

    The ``max(1, round(n * val_fraction))`` documents whose identity has the smallest SHA-1
    are val. Deterministic, independent of input order and of any seed.

    Raises:
        ConfigError: fewer than 2 documents (one split would be empty).
    """
    n = len(docs)
    if n < 2:
        raise ConfigError(
            f"{what}: {n} non-empty document(s) after data.max_bytes; a train/val split "
            "(data.val_fraction) needs at least 2 - add files or raise data.max_bytes"
        )
    n_val = min(n - 1, max(1, round(n * val_fraction)))
    ranked = sorted(range(n), key=lambda i: (hashlib.sha1(docs[i][0].encode("utf-8")).digest(), i))
    val_ids = set(ranked[:n_val])
    train = [t for i, (_, t) in enumerate(docs) if i not in val_ids]
    val = [t for i, (_, t) in enumerate(docs) if i in val_ids]
    return train, val
