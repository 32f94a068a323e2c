"""Token cache: corpus -> tokenizer -> flat token files on disk, built once and reused.

Layout of one cache, ``<data.cache_dir>/<key>/``::

    tokenizer.json   the byte-level BPE (framework.base.data.tokenizer), trained on train only
    train.bin        np.uint16 (np.uint32 if vocab > 65536) token ids, flat, native order
    val.bin          same for val
    train.txt        the train documents' raw UTF-8 text, concatenated (for data.mode=on_the_fly)
    train.docs.npy   int64 [docs + 1, 2]: each document's start as (byte offset in train.txt,
                     token offset in train.bin); the last row holds the totals
    val.txt, val.docs.npy   same for val
    meta.json        vocab_size, token/doc/byte counts, dtype, eot_id, key, timings

Each split is its documents in corpus order, each followed by ``<|endoftext|>``:
``doc0 EOT doc1 EOT ...``. Training windows cross document boundaries (GPT-2 style).

The key (``<data.name>-v<vocab_size>-<16 hex>``) hashes everything that changes the result:
the source name, the selected files (absolute path, size, mtime) after the ``max_bytes`` cap,
``text_field`` (jsonl), ``vocab_size``, ``val_fraction``, ``max_bytes``, the ``tokenizers``
version and :data:`FORMAT_VERSION`. Not in the key: ``seq_len``, ``seed``, ``num_workers`` -
one cache serves every window length and shuffle. Computing the key only stats files, so
every rank can find the cache cheaply.

Atomicity: a cache is built in a sibling folder ``.tmp-<key>-<pid>-<rand>`` and renamed into
place as a whole (``os.rename`` of a folder is atomic on POSIX), so a folder named ``<key>``
is always complete; a crash leaves only a ``.tmp-*`` folder, which is never read (delete it at
leisure). If two processes build the same key at once, the first rename wins and the other
discards its copy.

:func:`prepare_data` is meant to run ONCE, in the driver, before any rank starts; ranks call
:func:`load_token_cache` and only open the memmaps.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import tokenizers
from tokenizers import Tokenizer

from framework.base.config.schema import DataConfig
from framework.base.data.corpus import SourceListing, list_sources, read_corpus
from framework.base.data.tokenizer import eot_id, load_tokenizer, train_tokenizer, vocab_size

log = logging.getLogger(__name__)

FORMAT_VERSION = 2  # bump when the on-disk layout or the tokenization recipe changes
_CHUNK_CHARS = 4 << 20  # characters of text per encode_batch call (bounds peak memory)


@dataclass
class TokenCache:
    """A built token cache. Cheap to create; the token files are opened on demand."""

    dir: Path  # the cache folder <data.cache_dir>/<key>
    vocab_size: int  # trained tokenizer size (may be < data.vocab_size on a small corpus)
    train_tokens: int  # length of train.bin in tokens
    val_tokens: int  # length of val.bin in tokens
    dtype: str = "uint16"  # numpy dtype of the .bin files
    eot_id: int = 0  # id of <|endoftext|>
    meta: dict[str, Any] = field(default_factory=dict, repr=False)  # all of meta.json
    built: bool = False  # True if the call that returned this object tokenized the corpus

    @classmethod
    def open(cls, directory: str | os.PathLike) -> TokenCache:
        """Open and sanity-check the cache in ``directory``.

        Raises:
            FileNotFoundError: no ``meta.json`` there.
            RuntimeError: the cache is from another format version or its files do not match
                ``meta.json`` (delete the folder to rebuild).
        """
        d = Path(directory)
        meta_path = d / "meta.json"
        if not meta_path.is_file():
            raise FileNotFoundError(f"no token cache at {d} (missing meta.json)")
        try:
            meta = json.loads(meta_path.read_text())
            n_train, n_val, dtype = int(meta["train_tokens"]), int(meta["val_tokens"]), np.dtype(meta["dtype"])
        except (ValueError, KeyError, TypeError) as e:
            raise RuntimeError(f"token cache {d} is damaged: bad meta.json ({e}); delete it to rebuild") from None
        if meta.get("format_version") != FORMAT_VERSION:
            raise RuntimeError(
                f"token cache {d} has format_version={meta.get('format_version')}, "
                f"expected {FORMAT_VERSION}; delete it to rebuild"
            )
        for split, n in (("train", n_train), ("val", n_val)):
            f = d / f"{split}.bin"
            want = n * dtype.itemsize
            have = f.stat().st_size if f.is_file() else -1
            if have != want:
                raise RuntimeError(
                    f"token cache {d} is damaged: {f.name} has {have} bytes, meta.json says {want}; delete it to rebuild"
                )
        if not (d / "tokenizer.json").is_file():
            raise RuntimeError(f"token cache {d} is damaged: tokenizer.json is missing; delete it to rebuild")
        return cls(
            dir=d,
            vocab_size=int(meta["vocab_size"]),
            train_tokens=n_train,
            val_tokens=n_val,
            dtype=dtype.name,
            eot_id=int(meta["eot_id"]),
            meta=meta,
        )

    def _open(self, split: str, n: int) -> np.memmap:
        return np.memmap(self.dir / f"{split}.bin", dtype=np.dtype(self.dtype), mode="r", shape=(n,))

    def open_train(self) -> np.memmap:
        """Read-only memmap of the train token ids, shape ``[train_tokens]``."""
        return self._open("train", self.train_tokens)

    def open_val(self) -> np.memmap:
        """Read-only memmap of the val token ids, shape ``[val_tokens]``."""
        return self._open("val", self.val_tokens)

    def tokenizer(self) -> Tokenizer:
        """The cache's tokenizer (``decode(ids)`` turns token ids back into text)."""
        return load_tokenizer(str(self.dir / "tokenizer.json"))


# ------------------------------------------------------------------------------------- key


def cache_key(cfg: DataConfig, listing: SourceListing | None = None) -> str:
    """``<name>-v<vocab_size>-<sha256[:16]>`` of everything that changes the cache's content.

    Raises:
        ConfigError: from :func:`framework.base.data.corpus.list_sources` (bad globs, caps).
    """
    listing = listing if listing is not None else list_sources(cfg)
    material = {
        "format_version": FORMAT_VERSION,
        "tokenizers": tokenizers.__version__,
        "source": cfg.name,
        "files": [[f.path, f.size, f.mtime_ns] for f in listing.files],
        "text_field": cfg.text_field if cfg.name == "jsonl" else None,
        "vocab_size": cfg.vocab_size,
        "val_fraction": cfg.val_fraction,
        "max_bytes": cfg.max_bytes,
    }
    digest = hashlib.sha256(json.dumps(material, sort_keys=True).encode("utf-8")).hexdigest()[:16]
    return f"{cfg.name}-v{cfg.vocab_size}-{digest}"


def cache_root(cfg: DataConfig) -> Path:
    """``data.cache_dir`` as an absolute path (relative paths are against the current dir)."""
    return Path(os.path.expanduser(cfg.cache_dir)).absolute()


def token_dtype(n_vocab: int) -> np.dtype:
    """Smallest unsigned dtype holding ids ``0 .. n_vocab - 1``."""
    return np.dtype(np.uint16) if n_vocab <= 1 << 16 else np.dtype(np.uint32)


# ----------------------------------------------------------------------------------- build


def load_token_cache(cfg: DataConfig) -> TokenCache:
    """Open the existing cache for ``cfg`` without building anything (what ranks call).

    Raises:
        FileNotFoundError: the cache was never built (run :func:`prepare_data` first) - or the
            input files changed since (their sizes/mtimes are part of the key).
        ConfigError: bad ``data.*`` values (see :func:`list_sources`).
    """
    key = cache_key(cfg)
    d = cache_root(cfg) / key
    if not (d / "meta.json").is_file():
        raise FileNotFoundError(
            f"no token cache for this data config at {d}; prepare_data(cfg) builds it "
            "(the driver runs it before starting ranks; a changed input file also changes the key)"
        )
    return TokenCache.open(d)


def prepare_data(cfg: DataConfig, *, progress: bool = True) -> TokenCache:
    """Return the token cache for ``cfg``, building it first if it does not exist.

    Building reads the corpus, trains the tokenizer on the train split, tokenizes both splits
    and writes the cache atomically. The full CPython 3.11 stdlib (31 MB) takes tens of seconds
    on two cores (see meta.json ``timings_s``).

    Args:
        cfg: the data config.
        progress: draw progress bars on stderr while building.

    Returns:
        The cache; ``.built`` is True if this call built it, False if it was reused.

    Raises:
        ConfigError: bad paths, JSONL lines, caps, or fewer than 2 documents.
    """
    listing = list_sources(cfg)
    key = cache_key(cfg, listing)
    root = cache_root(cfg)
    final = root / key
    if (final / "meta.json").is_file():
        cache = TokenCache.open(final)
        log.info("data: reusing token cache %s (%d train / %d val tokens)", final, cache.train_tokens, cache.val_tokens)
        return cache

    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-{key}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        _build(cfg, listing, key, tmp, progress=progress)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "meta.json").is_file():
                raise
            log.info("data: another process built %s first; using it", final)  # lost the race
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            _fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    cache = TokenCache.open(final)
    cache.built = True
    return cache


def _build(cfg: DataConfig, listing: SourceListing, key: str, out: Path, *, progress: bool) -> None:
    """Write tokenizer.json, train.bin, val.bin and meta.json (last) into ``out``."""
    t0 = time.perf_counter()
    log.info("data: reading %d %s files (%.1f MB) ...", len(listing.files), cfg.name, listing.total_bytes / 1e6)
    corpus = read_corpus(cfg, listing)
    t_read = time.perf_counter() - t0
    if corpus.skipped_files:
        log.info("data: skipped %d non-UTF-8 files: %s", len(corpus.skipped_files), ", ".join(corpus.skipped_files[:5]))

    t0 = time.perf_counter()
    tok = train_tokenizer(corpus.train, vocab_size=cfg.vocab_size, length=len(corpus.train), show_progress=progress)
    t_train = time.perf_counter() - t0
    n_vocab, eot = vocab_size(tok), eot_id(tok)
    tok.save(str(out / "tokenizer.json"))
    log.info("data: trained byte-level BPE, %d tokens (requested %d), in %.1f s", n_vocab, cfg.vocab_size, t_train)

    dtype = token_dtype(n_vocab)
    t0 = time.perf_counter()
    n_train = _write_tokens(tok, corpus.train, out, "train", dtype, eot, progress=progress)
    n_val = _write_tokens(tok, corpus.val, out, "val", dtype, eot, progress=progress)
    t_tok = time.perf_counter() - t0
    train_bytes, val_bytes = corpus.train_bytes, corpus.val_bytes
    log.info(
        "data: %d train + %d val tokens (%.2f bytes/token) in %.1f s",
        n_train,
        n_val,
        (train_bytes + val_bytes) / max(1, n_train + n_val),
        t_tok,
    )
    meta = {
        "format_version": FORMAT_VERSION,
        "key": key,
        "source": cfg.name,
        "root": listing.root,
        "vocab_size": n_vocab,
        "vocab_size_requested": cfg.vocab_size,
        "eot_id": eot,
        "dtype": dtype.name,
        "train_tokens": n_train,
        "val_tokens": n_val,
        "train_docs": len(corpus.train),
        "val_docs": len(corpus.val),
        "num_files": corpus.num_files,
        "skipped_files": corpus.skipped_files,
        "bytes": train_bytes + val_bytes,
        "train_bytes": train_bytes,
        "val_bytes": val_bytes,
        "timings_s": {"read": round(t_read, 3), "train_tokenizer": round(t_train, 3), "tokenize": round(t_tok, 3)},
        "tokenizers_version": tokenizers.__version__,
    }
    _write_durable(out / "meta.json", (json.dumps(meta, indent=2) + "\n").encode("utf-8"))
    _fsync_dir(out)


def _chunks(docs: list[str], chars: int) -> Iterator[list[str]]:
    """Consecutive groups of documents of about ``chars`` characters (at least one doc each)."""
    group: list[str] = []
    n = 0
    for d in docs:
        group.append(d)
        n += len(d)
        if n >= chars:
            yield group
            group, n = [], 0
    if group:
        yield group


def _write_tokens(
    tok: Tokenizer, docs: list[str], out: Path, split: str, dtype: np.dtype, eot: int, *, progress: bool
) -> int:
    """Encode ``docs`` as ``doc0 EOT doc1 EOT ...`` into ``<split>.bin``, with the raw text in
    ``<split>.txt`` and the document offsets in ``<split>.docs.npy``; return the token count."""
    from tqdm import tqdm  # a pytorch-lightning dependency

    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)  # fast: skips offsets (>= 0.20)
    eot_arr = np.array([eot], dtype=dtype)
    n = 0
    n_bytes = 0
    offsets = [(0, 0)]
    with (
        open(out / f"{split}.bin", "wb") as fh,
        open(out / f"{split}.txt", "wb") as fh_txt,
        tqdm(
            total=sum(len(d) for d in docs),
            unit="char",
            unit_scale=True,
            desc=f"tokenize {split}",
            disable=not progress,
            file=sys.stderr,
            mininterval=1.0,
            leave=False,
        ) as bar,
    ):
        for group in _chunks(docs, _CHUNK_CHARS):
            parts = []
            for doc, enc in zip(group, encode(group, add_special_tokens=False)):
                parts.append(np.asarray(enc.ids, dtype=dtype))
                parts.append(eot_arr)
                raw = doc.encode("utf-8")
                fh_txt.write(raw)
                n_bytes += len(raw)
                offsets.append((n_bytes, offsets[-1][1] + len(enc.ids) + 1))
            arr = np.concatenate(parts)
            arr.tofile(fh)
            n += arr.size
            bar.update(sum(len(d) for d in group))
        for f in (fh, fh_txt):
            f.flush()
            os.fsync(f.fileno())
    with open(out / f"{split}.docs.npy", "wb") as f:
        np.save(f, np.asarray(offsets, dtype=np.int64))
        f.flush()
        os.fsync(f.fileno())
    return n


def _write_durable(path: Path, data: bytes) -> None:
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def _fsync_dir(path: Path) -> None:
    """Persist a folder's entries (renames) where the OS allows it; best effort."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
