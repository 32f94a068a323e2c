"""Lossless deltas between two training states: byte-wise XOR against a base, byte planes, zlib.

Between two saves the high bytes of a float (sign, exponent, top of the mantissa) rarely
change while the low mantissa bytes change almost always. So ``new XOR base`` is split into
byte planes (byte 0 of every element, then byte 1, ...; the "shuffle" of Blosc/HDF5): the
high planes are nearly all zeros and zlib shrinks them to almost nothing, the low planes are
noise and are stored raw (a 64 KiB sample decides, so no time is spent compressing noise).
``base XOR (new XOR base) == new`` restores every bit.

A delta state has the same nested structure as the state it encodes; each tensor whose base
counterpart (same position in the structure, same dtype and shape) exists is replaced by
``{"__xor_planes__": [uint8 tensor per byte plane], "zlib": [0|1 per plane]}``, every other
value is kept as is. Both forms load with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import zlib
from typing import Any

import torch

_KEY = "__xor_planes__"
ZLIB_LEVEL = 1  # fastest level: the delta is written on the save path
_SAMPLE = 1 << 16  # bytes of a plane test-compressed to decide whether to compress it
_WORTH = 0.9  # compress a plane only when its sample shrinks below this fraction


def _pack_plane(plane: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``(bytes, 1)`` zlib-compressed, or ``(bytes, 0)`` raw when a sample shows it is noise."""
    view = plane.numpy()  # zlib reads the buffer directly, no copy
    if len(zlib.compress(view[:_SAMPLE], ZLIB_LEVEL)) > _WORTH * min(view.size, _SAMPLE):
        return plane.clone(), 0  # clone: a view would save the whole [planes, elements] storage
    return torch.frombuffer(bytearray(zlib.compress(view, ZLIB_LEVEL)), dtype=torch.uint8), 1


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def child_of(base: Any, key: Any) -> Any:
    """``base[key]`` when ``base`` is a dict/list/tuple holding it, else None."""
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
        if (
            isinstance(base, torch.Tensor)
            and base.dtype == state.dtype
            and base.shape == state.shape
            and state.numel() > 0
        ):
            x = torch.bitwise_xor(_bytes_of(state), _bytes_of(base))
            planes = x.view(-1, state.element_size()).t().contiguous()  # [bytes per element, elements]
            packed = [_pack_plane(plane) for plane in planes]
            return {_KEY: [p for p, _ in packed], "zlib": [z for _, z in packed]}
        return state
    if isinstance(state, dict):
        return type(state)((k, encode_delta(child_of(base, k), v)) for k, v in state.items())
    if isinstance(state, (list, tuple)):
        return type(state)(encode_delta(child_of(base, i), v) for i, v in enumerate(state))
    return state


def apply_delta(base: Any, delta: Any) -> Any:
    """Rebuild the state that :func:`encode_delta` encoded against ``base`` (bit for bit).

    Raises:
        ValueError: ``delta`` refers to a tensor that ``base`` does not have (a wrong base).
    """
    if isinstance(delta, dict) and set(delta) == {_KEY, "zlib"}:
        if not isinstance(base, torch.Tensor) or len(delta[_KEY]) != base.element_size():
            raise ValueError("delta checkpoint refers to a tensor its base does not have (wrong base?)")
        planes = [
            torch.frombuffer(bytearray(zlib.decompress(p.numpy())), dtype=torch.uint8) if z else p
            for p, z in zip(delta[_KEY], delta["zlib"])
        ]
        if any(p.numel() != base.numel() for p in planes):
            raise ValueError("delta checkpoint tensor size does not match its base (wrong base?)")
        x = torch.stack(planes).t().contiguous().reshape(-1)
        return torch.bitwise_xor(x, _bytes_of(base)).view(base.dtype).reshape(base.shape)
    if isinstance(delta, dict):
        return type(delta)((k, apply_delta(child_of(base, k), v)) for k, v in delta.items())
    if isinstance(delta, (list, tuple)):
        return type(delta)(apply_delta(child_of(base, i), v) for i, v in enumerate(delta))
    return delta
