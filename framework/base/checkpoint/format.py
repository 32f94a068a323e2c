"""The on-disk checkpoint format: one folder per checkpoint, a JSON manifest, checksummed files.

Layout of ``<checkpoint.dir>/step<NNNNNNNN>/``::

    manifest.json   plain JSON: format, kind (full | delta | dcp), base, step, tokens_seen, layout,
                    config_hash, versions (torch, pytorch_lightning, trainlab commit), created_unix,
                    files {name: {sha256, bytes}}, bytes (sum), delta_ratio (delta only)
    state.pt        the training state (Lightning's checkpoint dict plus trainlab's per-rank RNG
                    states), written with ``torch.save`` and read back only with
                    ``torch.load(weights_only=True)``: tensors and plain containers, nothing
                    that can run code. A ``delta`` checkpoint holds each tensor as the
                    zlib-compressed byte-wise XOR against the same tensor of its ``base`` (a full
                    checkpoint in the same folder); see :mod:`framework.base.checkpoint.delta`.

Atomicity: everything is written into a hidden ``.step<N>.tmp-<random>/`` folder, each file is
fsync'd, the manifest is written last, the folder is fsync'd and renamed to its final name and
the parent folder is fsync'd. A folder without the final name (a save killed midway) is never
listed; :func:`remove_partial` deletes such leftovers. A complete folder whose bytes were
changed afterwards fails :func:`verify` and is skipped by :func:`find_latest_valid`.

Other kinds hold other files: a sharded plugin's checkpoint (``kind: dcp``,
:mod:`framework.base.checkpoint.dcp`) a torch DCP folder ``dcp/`` (one shard file per rank) next to
``state.pt``, a plugin's own format its own files; the manifest lists every file under the
folder. How each kind loads is looked up in :mod:`framework.base.checkpoint.kinds`:
:func:`load_state` gathers any kind that can be gathered into one full state.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from framework.base.checkpoint.errors import CheckpointError, UnsafeCheckpointError
from framework.base.checkpoint.kinds import CheckpointKind, get_checkpoint_kind

FORMAT = "trainlab.checkpoint/1"
MANIFEST = "manifest.json"
STATE_FILE = "state.pt"
_NAME = re.compile(r"^step(\d{8})$")
_TMP_PREFIX = ".step"
# Test hook: "STEP:SECONDS" makes the save of that step pause for SECONDS after its state file
# is written and before the manifest and the rename, so a test can kill a save midway.
TEST_PAUSE_ENV = "TRAINLAB_CKPT_TEST_PAUSE"


def checkpoint_name(step: int) -> str:
    """Folder name of the checkpoint taken after optimizer step ``step``: ``step%08d``."""
    return f"step{step:08d}"


def list_checkpoints(dirpath: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoint folders in ``dirpath`` as ``(step, path)``, oldest first.

    Complete means renamed to the final name and holding a manifest; checksums are not read
    (see :func:`verify`). Temporary folders of unfinished saves are never listed.
    """
    d = Path(dirpath)
    if not d.is_dir():
        return []
    found = []
    for p in d.iterdir():
        m = _NAME.match(p.name)
        if m and p.is_dir() and (p / MANIFEST).is_file():
            found.append((int(m.group(1)), p))
    return sorted(found)


def read_manifest(path: str | Path) -> dict[str, Any]:
    """The manifest of checkpoint folder ``path``.

    Raises:
        CheckpointError: no manifest, not JSON, or not this format.
    """
    f = Path(path) / MANIFEST
    try:
        manifest = json.loads(f.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: not a checkpoint folder (no {MANIFEST})") from None
    except (ValueError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{f}: unreadable manifest ({err})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{f}: format is not {FORMAT!r}")
    return manifest


def file_sha256(path: Path) -> str:
    """Hex sha256 of the file at ``path`` (read in 4 MiB blocks).

    Raises:
        OSError: the file cannot be read.
    """
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def verify(path: str | Path) -> list[str]:
    """Problems of checkpoint folder ``path`` (empty when it is intact).

    Checks the manifest, every listed file's size and sha256, and for a checkpoint that names a
    ``base`` (a delta) that the base exists next to it and is intact too. Reads every byte
    (sha256 runs at roughly 1 GB/s on one core).
    """
    path = Path(path)
    try:
        manifest = read_manifest(path)
    except CheckpointError as err:
        return [str(err)]
    problems = []
    for name, meta in manifest["files"].items():
        f = path / name
        if not f.is_file():
            problems.append(f"{f}: missing")
        elif f.stat().st_size != meta["bytes"]:
            problems.append(f"{f}: {f.stat().st_size} bytes, manifest says {meta['bytes']}")
        elif file_sha256(f) != meta["sha256"]:
            problems.append(f"{f}: sha256 mismatch (corrupt)")
    if manifest.get("base"):
        base = path.parent / manifest["base"]
        base_problems = verify(base)
        if base_problems:
            problems.append(f"{path}: its base {base.name} is not intact ({base_problems[0]})")
    return problems


def safe_torch_load(file: str | Path) -> Any:
    """``torch.load`` with the weights-only unpickler (tensors and plain containers only), on CPU.

    Raises:
        UnsafeCheckpointError: the file holds any other pickled object (which could run code
            when unpickled); nothing from it is executed.
    """
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UnsafeCheckpointError(
            f"{file}: refused to load: it holds pickled objects other than tensors and plain containers"
            f" (weights-only unpickler: {first})"
        ) from None


def kind_of(path: str | Path) -> CheckpointKind:
    """The :mod:`~framework.base.checkpoint.kinds` entry of checkpoint folder ``path``'s manifest ``kind``.

    Raises:
        CheckpointError: no or bad manifest, or a kind that is not registered in this process.
    """
    return get_checkpoint_kind(read_manifest(path)["kind"])


def load_state(path: str | Path) -> dict[str, Any]:
    """Verify checkpoint folder ``path`` and return its whole state as one Lightning checkpoint dict.

    The kind's loader (:mod:`framework.base.checkpoint.kinds`) reads it: ``full`` its state file, a
    ``delta`` rebuilt from its base, a sharded ``dcp`` checkpoint gathered into full tensors.
    Tensors come back on CPU; optimizer states keyed by position.

    Raises:
        CheckpointError: the manifest is missing or bad, a checksum does not match, or the kind
            is unknown or does not gather into a full state (only its own plugin loads it).
        UnsafeCheckpointError: a state file holds objects other than tensors and plain containers.
    """
    path = Path(path)
    problems = verify(path)
    if problems:
        raise CheckpointError("; ".join(problems))
    kind = kind_of(path)
    if kind.load_full_state is None:
        raise CheckpointError(
            f"{path}: {kind.description} ({kind.name!r}) do not gather into one full state;"
            f" only a plugin that writes {kind.name!r} checkpoints loads them"
        )
    return kind.load_full_state(path)


def find_latest_valid(dirpath: str | Path, warn: Callable[[str], None] | None = None) -> Path | None:
    """The newest checkpoint in ``dirpath`` that passes :func:`verify`, or None.

    Every newer checkpoint that fails is reported through ``warn`` (default: ``warnings.warn``)
    with its path and the first problem found, then skipped.
    """
    warn = warn or (lambda msg: warnings.warn(msg, stacklevel=2))
    for _, path in reversed(list_checkpoints(dirpath)):
        problems = verify(path)
        if not problems:
            return path
        warn(f"skipping corrupt checkpoint {path}: {problems[0]}")
    return None


def latest_valid_step(dirpath: str | Path, warn: Callable[[str], None] | None = None) -> tuple[Path | None, int]:
    """``(path, step)`` of the newest checkpoint in ``dirpath`` that passes :func:`verify`
    (:func:`find_latest_valid`, ``warn`` as there); ``(None, 0)`` when there is none."""
    latest = find_latest_valid(dirpath, warn=warn)
    return latest, (read_manifest(latest)["step"] if latest else 0)


def fsync_dir(path: Path) -> None:
    """fsync folder ``path`` itself, so that its entries (new files, renames) survive a crash.

    Raises:
        OSError: the folder cannot be opened or synced.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _HashingWriter:
    """A write-only file object that hashes and counts what passes through it."""

    def __init__(self, f) -> None:
        self.f = f
        self.sha = hashlib.sha256()
        self.bytes = 0

    def write(self, data) -> int:
        self.f.write(data)
        self.sha.update(data)
        self.bytes += len(data)
        return len(data)

    def flush(self) -> None:
        self.f.flush()


def _test_pause(step: int) -> None:
    spec = os.environ.get(TEST_PAUSE_ENV)
    if spec:
        at, seconds = spec.split(":")
        if int(at) == step:
            time.sleep(float(seconds))


def new_temp_folder(dirpath: str | Path, step: int) -> Path:
    """A fresh hidden ``.step%08d.tmp-*`` folder in ``dirpath`` to write a checkpoint into.

    Never listed as a checkpoint; :func:`commit_folder` turns it into one, :func:`remove_partial`
    deletes it when a save died before that.
    """
    dirpath = Path(dirpath)
    dirpath.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{step:08d}.tmp-", dir=dirpath))


def hash_files(folder: Path, known: dict[str, dict[str, Any]] | None = None) -> dict[str, dict[str, Any]]:
    """``{relative path: {sha256, bytes}}`` of every file under ``folder``; ``known`` entries are not re-read."""
    files = dict(known or {})
    for f in sorted(folder.rglob("*")):
        name = f.relative_to(folder).as_posix()
        if f.is_file() and name not in files and name != MANIFEST:
            files[name] = {"sha256": file_sha256(f), "bytes": f.stat().st_size}
    return files


def commit_folder(
    tmp: Path,
    step: int,
    manifest: dict[str, Any],
    known: dict[str, dict[str, Any]] | None = None,
    *,
    fsync_files: bool = False,
) -> Path:
    """Turn temporary folder ``tmp`` into checkpoint ``step%08d`` next to it; return the final path.

    Lists every file under ``tmp`` (sub-folders included) with its sha256 and size (``known``:
    entries already hashed while writing), writes the manifest last, fsyncs every folder,
    renames. The files must already be fsync'd, or ``fsync_files``: fsync each here (for files
    written by a library that does not). An existing folder of the same step is moved aside
    and deleted only after the new one is complete.

    Raises:
        OSError: the commit failed; ``tmp`` has been removed.
    """
    dirpath = tmp.parent
    final = dirpath / checkpoint_name(step)
    try:
        if fsync_files:
            for f in sorted(p for p in tmp.rglob("*") if p.is_file()):
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
        files = hash_files(tmp, known)
        _test_pause(step)
        full = {
            **manifest,
            "format": FORMAT,
            "step": step,
            "created_unix": time.time(),
            "files": files,
            "bytes": sum(m["bytes"] for m in files.values()),
        }
        with open(tmp / MANIFEST, "w") as f:
            json.dump(full, f, indent=2, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        for sub in [p for p in tmp.rglob("*") if p.is_dir()]:
            fsync_dir(sub)
        fsync_dir(tmp)
        old = None
        if final.exists():  # re-saving a step: move the old one aside only once the new one is complete
            old = Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{step:08d}.tmp-old-", dir=dirpath))
            os.rename(final, old / final.name)
        os.rename(tmp, final)
        fsync_dir(dirpath)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def write_state_file(folder: Path, state: Any) -> dict[str, dict[str, Any]]:
    """``torch.save`` ``state`` as ``folder/state.pt`` (fsync'd); returns its manifest entry."""
    with open(folder / STATE_FILE, "wb") as f:
        w = _HashingWriter(f)
        torch.save(state, w)
        f.flush()
        os.fsync(f.fileno())
    return {STATE_FILE: {"sha256": w.sha.hexdigest(), "bytes": w.bytes}}


def write_checkpoint(dirpath: str | Path, step: int, state: Any, manifest: dict[str, Any]) -> Path:
    """Write ``state`` as checkpoint folder ``<dirpath>/step%08d`` atomically; return its path.

    ``manifest`` holds the descriptive fields (kind, base, tokens_seen, layout, ...); ``format``,
    ``step``, ``created_unix``, ``files`` and ``bytes`` are added here. An existing folder of
    the same step is replaced only after the new one is complete.

    Raises:
        OSError: the write failed; the temporary folder has been removed.
    """
    tmp = new_temp_folder(dirpath, step)
    try:
        known = write_state_file(tmp, state)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return commit_folder(tmp, step, manifest, known)


def remove_partial(dirpath: str | Path) -> list[Path]:
    """Delete temporary folders left by saves that never completed; return what was removed.

    Call only when no save is in flight (e.g. before training starts).
    """
    d = Path(dirpath)
    removed = []
    if d.is_dir():
        for p in d.iterdir():
            if p.name.startswith(_TMP_PREFIX) and ".tmp-" in p.name and p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
                removed.append(p)
    return removed


def prune(dirpath: str | Path, keep_last_k: int) -> list[Path]:
    """Delete all but the newest ``keep_last_k`` complete checkpoints; return what was deleted.

    A base that a kept delta checkpoint needs is kept too, so the newest checkpoint always
    stays loadable. Only complete checkpoints are counted: a save that failed never pushes
    a valid one out.
    """
    found = list_checkpoints(dirpath)
    keep = {p for _, p in found[-keep_last_k:]}
    for p in list(keep):
        try:
            m = read_manifest(p)
        except CheckpointError:
            continue
        if m.get("base"):
            keep.add(p.parent / m["base"])
    removed = []
    for _, p in found:
        if p not in keep:
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed
