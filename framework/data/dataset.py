"""Fixed-length training windows over a flat token array.

Window ``i`` is ``tokens[i*L : i*L + L + 1]`` (``L = seq_len``): ``L + 1`` tokens, so that the
input ``x = w[:-1]`` and the next-token target ``y = w[1:]`` both have ``L`` tokens.
Consecutive windows share one boundary token and never overlap otherwise; the last
``(len(tokens) - 1) % L`` tokens are unused. Windows may span ``<|endoftext|>`` separators.
"""

from __future__ import annotations

import mmap
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset


class WindowDataset(Dataset):
    """Map-style dataset of ``(x, y)`` pairs, each an int64 tensor of shape ``[seq_len]``.

    ``len = (len(tokens) - 1) // seq_len`` (0 if the array is too short for one window).

    Pickling (DataLoader workers under ``spawn``/``forkserver``) sends the memmap's file name,
    not its contents: each worker re-opens the file read-only.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int) -> None:
        """
        Args:
            tokens: 1-D array of token ids (usually a read-only ``np.memmap``), shape ``[T]``.
            seq_len: tokens per input sequence ``L`` (> 0).

        Raises:
            ValueError: ``seq_len`` <= 0 or ``tokens`` is not 1-D.
        """
        if seq_len <= 0:
            raise ValueError(f"seq_len={seq_len} must be > 0")
        if tokens.ndim != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tokens.shape}")
        self.tokens = tokens
        self.seq_len = seq_len

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
        return w[:-1], w[1:]

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
