"""Fixed-length training windows over a flat token array.

Window ``i`` is ``tokens[i*L : i*L + L + 1]`` (``L = seq_len``): ``L + 1`` tokens, so that the
input ``x = w[:-1]`` and the next-token target ``y = w[1:]`` both have ``L`` tokens.
Consecutive windows share one boundary token and never overlap otherwise; the last
``(len(tokens) - 1) % L`` tokens are unused. Windows may span ``<|endoftext|>`` separators.

Document-boundary masking (``data.mask_document_boundaries``, :func:`mask_document_boundaries`):
documents are packed as ``doc0 EOT doc1 EOT ...``, so the target after an ``EOT`` input is the
first token of an unrelated document; masking sets those targets to ``IGNORE_INDEX`` (no loss),
as Megatron-LM's ``eod_mask_loss`` does. Predicting the ``EOT`` itself keeps its loss, and
attention still spans the boundary (only the loss is masked).
"""

from __future__ import annotations

import mmap
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from framework.base.config.schema import ConfigError
from framework.base.model.gpt import IGNORE_INDEX


def mask_document_boundaries(x: torch.Tensor, y: torch.Tensor, eot_id: int) -> torch.Tensor:
    """``y`` with ``IGNORE_INDEX`` where the input is the end-of-text token: the targets that cross
    a document boundary. ``x``, ``y``: int64 ``[..., s]``; returns a new tensor (``y`` untouched)."""
    return y.masked_fill(x == eot_id, IGNORE_INDEX)


def check_global_batch_fits(*, global_batch_size: int, train_tokens: int, seq_len: int) -> None:
    """Refuse a global batch larger than the train split (the driver calls it before any rank starts).

    The split holds ``(train_tokens - 1) // seq_len`` windows (:class:`WindowDataset`). With a
    larger global batch every optimizer step would hold some windows twice (the sampler draws a
    step's samples from consecutive epochs), so tokens/s, MFU and the loss would describe
    repeated data as if it were new; a warning would let such a figure into a study, so it is
    an error instead.

    Raises:
        ConfigError: one line naming the global batch, the window count and the sizes behind it.
    """
    windows = max(0, (train_tokens - 1) // seq_len)
    if global_batch_size > windows:
        raise ConfigError(
            f"trainer.global_batch_size={global_batch_size} sequences is larger than the train split: {windows} windows"
            f" of data.seq_len={seq_len} ({train_tokens:,} tokens); every step would repeat windows. Use"
            f" global_batch_size <= {windows}, a shorter data.seq_len or more data"
        )


class WindowDataset(Dataset):
    """Map-style dataset of ``(x, y)`` pairs, each an int64 tensor of shape ``[seq_len]``.

    ``len = (len(tokens) - 1) // seq_len`` (0 if the array is too short for one window).

    Pickling (DataLoader workers under ``spawn``/``forkserver``) sends the memmap's file name,
    not its contents: each worker re-opens the file read-only.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, mask_eot_id: int | None = None) -> None:
        """
        Args:
            tokens: 1-D array of token ids (usually a read-only ``np.memmap``), shape ``[T]``.
            seq_len: tokens per input sequence ``L`` (> 0).
            mask_eot_id: the end-of-text id whose next target is ignored
                (:func:`mask_document_boundaries`), or None for no masking.

        Raises:
            ValueError: ``seq_len`` <= 0 or ``tokens`` is not 1-D.
        """
        if seq_len <= 0:
            raise ValueError(f"seq_len={seq_len} must be > 0")
        if tokens.ndim != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tokens.shape}")
        self.tokens = tokens
        self.seq_len = seq_len
        self.mask_eot_id = mask_eot_id

    def __len__(self) -> int:
        return max(0, (len(self.tokens) - 1) // self.seq_len)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Window ``i`` as ``(x, y)``: int64 tensors ``[seq_len]``, ``y[t] == x[t + 1]`` for t < L-1.

        Raises:
            IndexError: ``i`` outside ``[0, len)`` (negative indices are not wrapped).
        """
        n = len(self)
        if not 0 <= i < n:
            raise IndexError(f"window {i} out of range [0, {n})")
        start = i * self.seq_len
        w = torch.from_numpy(np.asarray(self.tokens[start : start + self.seq_len + 1], dtype=np.int64))
        return _pair(w, self.mask_eot_id)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        t = self.tokens
        if isinstance(t, np.memmap) and t.filename is not None and isinstance(t.base, mmap.mmap):
            # a whole-file memmap (not a view, whose .offset would be stale): send the recipe
            state["tokens"] = None
            state["_memmap"] = (str(t.filename), t.dtype.str, int(t.offset), t.shape)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        spec = state.pop("_memmap", None)
        self.__dict__.update(state)
        if spec is not None:
            filename, dtype, offset, shape = spec
            self.tokens = np.memmap(filename, dtype=np.dtype(dtype), mode="r", offset=offset, shape=shape)


class OnTheFlyWindowDataset(Dataset):
    """The same windows as :class:`WindowDataset` over a split's token stream, but tokenized
    from the raw text in ``__getitem__`` (``data.mode=on_the_fly``): the loader pays for BPE.

    Window ``i`` covers tokens ``[i*L, i*L + L + 1)`` of ``doc0 EOT doc1 EOT ...``; the
    documents overlapping it are read from ``<split>.txt`` (byte offsets in
    ``<split>.docs.npy``) and encoded whole with the cache's tokenizer, each followed by EOT.
    BPE of a document does not depend on its neighbours, so the windows are identical,
    token for token, to the memmap's (tested), and the sampler's loss parity holds. The cost
    is realistic for random access: a whole document is encoded to serve one window of it.
    """

    def __init__(
        self, cache_dir: str | Path, split: str, seq_len: int, eot_id: int, mask_document_boundaries: bool = False
    ) -> None:
        """
        Args:
            cache_dir: a token cache folder (``TokenCache.dir``).
            split: ``train`` or ``val``.
            seq_len: tokens per input sequence ``L`` (> 0).
            eot_id: id of ``<|endoftext|>`` (``TokenCache.eot_id``).
            mask_document_boundaries: ignore the targets after ``eot_id`` (:func:`mask_document_boundaries`).

        Raises:
            ValueError: ``seq_len`` <= 0.
            FileNotFoundError: the cache has no raw text for ``split``.
        """
        if seq_len <= 0:
            raise ValueError(f"seq_len={seq_len} must be > 0")
        d = Path(cache_dir)
        self.text_path = str(d / f"{split}.txt")
        self.tokenizer_path = str(d / "tokenizer.json")
        self.docs = np.load(d / f"{split}.docs.npy")  # [docs + 1, 2]: (byte offset, token offset)
        self.seq_len = seq_len
        self.eot_id = eot_id
        self.mask_eot_id = eot_id if mask_document_boundaries else None
        self._text: np.memmap | None = None
        self._tok: Any = None

    def __len__(self) -> int:
        return max(0, (int(self.docs[-1, 1]) - 1) // self.seq_len)

    def _encode_doc(self, d: int) -> list[int]:
        if self._tok is None:  # opened lazily, once per (worker) process
            from tokenizers import Tokenizer

            self._tok = Tokenizer.from_file(self.tokenizer_path)
            self._text = (
                np.memmap(self.text_path, dtype=np.uint8, mode="r") if self.docs[-1, 0] > 0 else np.zeros(0, np.uint8)
            )
        b0, b1 = int(self.docs[d, 0]), int(self.docs[d + 1, 0])
        text = bytes(self._text[b0:b1]).decode("utf-8")
        return self._tok.encode(text, add_special_tokens=False).ids + [self.eot_id]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Window ``i`` as ``(x, y)``: int64 tensors ``[seq_len]`` (see the class docstring).

        Raises:
            IndexError: ``i`` outside ``[0, len)``.
        """
        n = len(self)
        if not 0 <= i < n:
            raise IndexError(f"window {i} out of range [0, {n})")
        start, end = i * self.seq_len, i * self.seq_len + self.seq_len + 1
        starts = self.docs[:, 1]
        d = int(np.searchsorted(starts, start, side="right")) - 1
        first = int(starts[d])
        ids: list[int] = []
        while first + len(ids) < end:
            ids.extend(self._encode_doc(d))
            d += 1
        w = torch.tensor(ids[start - first : end - first], dtype=torch.int64)
        return _pair(w, self.mask_eot_id)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_text"] = state["_tok"] = None  # each worker re-opens the files
        return state


def _pair(w: torch.Tensor, mask_eot_id: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, y)`` of a window ``w [L + 1]``; ``y`` masked after ``mask_eot_id`` when it is not None
    (a copy then: ``x`` and ``y`` are views of one buffer)."""
    x, y = w[:-1], w[1:]
    return (x, y) if mask_eot_id is None else (x, mask_document_boundaries(x, y, mask_eot_id))
