"""Lossless deltas between two training states: byte-wise XOR against a base, then zlib.

Between two saves most bytes of a float tensor do not change (sign, exponent and the high
mantissa bits move slowly), so ``new XOR base`` is mostly zero bytes and compresses well;
``base XOR (new XOR base) == new`` restores every bit. A delta state has the same nested
structure as the state it encodes; each tensor whose base counterpart (same position in the
structure, same dtype and shape) exists is replaced by ``{"__xor_zlib__": uint8 tensor}``,
every other value is kept as is. Both forms load with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import zlib
from typing import Any

import torch

_KEY = "__xor_zlib__"
ZLIB_LEVEL = 1  # fastest level: the delta is written on the save path


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _child(base: Any, key: Any) -> Any:
    if not isinstance(base, (dict, list, tuple)):
        return None
    try:
        return base[key]
    except (KeyError, IndexError, TypeError):
        return None


def encode_delta(base: Any, state: Any) -> Any:
    """``state`` with every tensor that has a same-shaped counterpart in ``base`` replaced by its XOR delta.

    Both are nested dicts/lists/tuples of tensors and plain values, on CPU.
    """
    if isinstance(state, torch.Tensor):
        if isinstance(base, torch.Tensor) and base.dtype == state.dtype and base.shape == state.shape and state.numel() > 0:
            x = torch.bitwise_xor(_bytes_of(state), _bytes_of(base))
            packed = zlib.compress(x.numpy().tobytes(), ZLIB_LEVEL)
            return {_KEY: torch.frombuffer(bytearray(packed), dtype=torch.uint8)}
        return state
    if isinstance(state, dict):
        return type(state)((k, encode_delta(_child(base, k), v)) for k, v in state.items())
    if isinstance(state, (list, tuple)):
        return type(state)(encode_delta(_child(base, i), v) for i, v in enumerate(state))
    return state


def apply_delta(base: Any, delta: Any) -> Any:
    """Rebuild the state that :func:`encode_delta` encoded against ``base`` (bit for bit).

    Raises:
        ValueError: ``delta`` refers to a tensor that ``base`` does not have (a wrong base).
    """
    if isinstance(delta, dict) and set(delta) == {_KEY}:
        if not isinstance(base, torch.Tensor):
            raise ValueError("delta checkpoint refers to a tensor its base does not have (wrong base?)")
        raw = zlib.decompress(delta[_KEY].numpy().tobytes())
        x = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        if x.numel() != base.numel() * base.element_size():
            raise ValueError("delta checkpoint tensor size does not match its base (wrong base?)")
        return torch.bitwise_xor(x, _bytes_of(base)).view(base.dtype).reshape(base.shape)
    if isinstance(delta, dict):
        return type(delta)((k, apply_delta(_child(base, k), v)) for k, v in delta.items())
    if isinstance(delta, (list, tuple)):
        return type(delta)(apply_delta(_child(base, i), v) for i, v in enumerate(delta))
    return delta


def tensor_bytes(state: Any) -> int:
    """Total bytes of the tensors in a nested state (its size before any compression)."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(tensor_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(tensor_bytes(v) for v in state)
    return 0
