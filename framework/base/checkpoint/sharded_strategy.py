"""Lightning glue of sharded (DCP) checkpoints: a strategy mixin over :mod:`framework.base.checkpoint.dcp`.

Lightning's strategies save one full state on rank 0 and load it before the optimizers exist;
a strategy whose parameters are DTensors (FSDP2, tensor parallel) or whose ranks hold different
plain tensors (pipeline stages) needs every rank to write its own shards and to load after
setup, straight into the live shards. :class:`ShardedCheckpointing` overrides those strategy
hooks; the file I/O is :mod:`framework.base.checkpoint.dcp`'s.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from framework.base.checkpoint.dcp import load_into_sharded
from framework.base.checkpoint.format import CheckpointError, verify


def unwrap_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside a Lightning ``LightningOptimizer`` (any other object as it is)."""
    return getattr(optimizer, "_optimizer", optimizer)


class ShardedCheckpointing:
    """Mix into a Lightning strategy whose parameters are DTensors (before the strategy class).

    ``class MyStrategy(ShardedCheckpointing, ModelParallelStrategy): ...``. Saves go to the
    Trainer's :class:`~framework.base.checkpoint.io.FolderCheckpointIO` on *every* rank (each writes
    its shards); loads read a sharded checkpoint of any world size, or a full one, straight into
    the live shards after the optimizers exist (``restore_checkpoint_after_setup``).
    """

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # load_checkpoint has restored them

    def lightning_module_state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(self.lightning_module)  # this rank's shards (DTensors)

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(self.lightning_module, unwrap_optimizer(optimizer))  # keyed by parameter name

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        # every rank writes its part (DTensors or not): the IO saves the plugin's declared sharded kind
        self.checkpoint_io.save_checkpoint(checkpoint, self.broadcast(filepath))

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(checkpoint_path))
        problems = self.broadcast(verify(path) if self.global_rank == 0 else None)  # one rank reads every byte
        if problems:
            raise CheckpointError("; ".join(problems))
        return load_into_sharded(
            path, self.lightning_module, [unwrap_optimizer(o) for o in self.optimizers], verified=True
        )

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        """Done by :meth:`load_checkpoint`."""

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        """Done by :meth:`load_checkpoint`."""
