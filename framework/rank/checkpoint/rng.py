"""Capture and restore every random number generator of one rank, in a weights-only-loadable form.

Python's ``random`` state is a tuple of ints; numpy's legacy global state is kept as a tensor
of its 624 key words plus plain ints/floats; torch's CPU and CUDA generator states are byte
tensors. None of these need a pickled class to load, so they live in ``state.pt`` next to
Lightning's state and load with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def capture_rng_state() -> dict[str, Any]:
    """This process's RNG states: python ``random``, numpy (global), torch CPU and every CUDA device."""
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {
            "name": np_name,
            "keys": torch.from_numpy(np_keys.astype(np.int64)),
            "pos": int(np_pos),
            "has_gauss": int(np_has_gauss),
            "cached_gaussian": float(np_gauss),
        },
        "torch_cpu": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["torch_cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Set this process's RNGs to ``state`` (from :func:`capture_rng_state`).

    Raises:
        ValueError: the state holds CUDA generator states for another number of devices.
    """
    random.setstate(_as_tuple(state["python"]))
    n = state["numpy"]
    np.random.set_state(
        (n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"])
    )
    torch.set_rng_state(state["torch_cpu"])
    if "torch_cuda" in state and torch.cuda.is_available():
        cuda = state["torch_cuda"]
        if len(cuda) != torch.cuda.device_count():
            raise ValueError(
                f"checkpoint holds CUDA RNG states of {len(cuda)} devices, this process sees {torch.cuda.device_count()}"
            )
        torch.cuda.set_rng_state_all(cuda)


def _as_tuple(x: Any) -> Any:
    # random.setstate wants tuples all the way down; a round trip may have turned them into lists.
    return tuple(_as_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x
