"""Data pipeline: corpus -> byte-level BPE -> token cache -> windows -> step-exact batches.

The driver calls :func:`prepare_data` once before any rank starts; each rank builds a
:class:`TextDataModule`, which only opens the cache's memmaps.
"""

from typing import Any

from framework.base.data.dataset import WindowDataset
from framework.base.data.tokens import TokenCache, load_token_cache, prepare_data
from framework.rank.data.sampler import StepBatchSampler


def __getattr__(name: str) -> Any:
    # TextDataModule needs Lightning (~2 s to import): only the ranks import it, not the driver.
    if name == "TextDataModule":
        from framework.rank.data.datamodule import TextDataModule

        return TextDataModule
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["prepare_data", "load_token_cache", "TokenCache", "TextDataModule", "WindowDataset", "StepBatchSampler"]
