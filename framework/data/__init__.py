"""Data pipeline: corpus -> byte-level BPE -> token cache -> windows -> step-exact batches.

The driver calls :func:`prepare_data` once before any rank starts; each rank builds a
:class:`TextDataModule`, which only opens the cache's memmaps.
"""

from framework.data.datamodule import TextDataModule
from framework.data.dataset import WindowDataset
from framework.data.sampler import StepBatchSampler
from framework.data.tokens import TokenCache, load_token_cache, prepare_data

__all__ = ["prepare_data", "load_token_cache", "TokenCache", "TextDataModule", "WindowDataset", "StepBatchSampler"]
