"""A Lightning ``CheckpointIO`` that writes and reads trainlab checkpoint folders.

Lightning keeps owning *what* is in a checkpoint (``trainer.save_checkpoint`` collects model,
optimizer, LR scheduler, loop progress, data-module and callback state, on every rank) and
*when* the strategy writes it (rank 0 for ``single`` and ``ddp``); this plugin owns *how*:
the folder format of :mod:`framework.base.checkpoint.format` (atomic, checksummed, weights-only
loadable), background writes, deltas and pruning. It is handed to the Trainer as
``plugins=[FolderCheckpointIO(...)]``, so ``trainer.fit(ckpt_path=<folder>)`` loads through
:func:`~framework.base.checkpoint.format.load_state` as well.

Policies:

- ``asynchronous``: ``save_checkpoint`` copies every tensor to CPU memory (the only part the
  training step waits for) and a background thread writes, fsyncs, renames and prunes. At most
  one save is in flight: a new save first waits for the previous one. A failed background save
  leaves no folder behind and is reported through :meth:`pop_results`.
- sharded state: the plugin declares a checkpoint kind that saves in shards
  (``PluginCapabilities.checkpoint_format``, e.g. ``dcp`` for FSDP2, TP and pipeline stages;
  :mod:`framework.base.checkpoint.kinds`): every rank calls ``save_checkpoint`` and writes its own
  shards (:mod:`framework.base.checkpoint.dcp`); synchronous, full saves only.
- ``full_every_n_saves = K > 1`` (incremental): the first save of a process and then every
  K-th is a full base; the ones between are XOR+zlib deltas against the newest base
  (:mod:`framework.base.checkpoint.delta`), which stays in CPU memory for that purpose.
"""

from __future__ import annotations

import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from lightning_fabric.plugins.io.checkpoint_io import CheckpointIO

from framework.base.checkpoint.delta import child_of, encode_delta
from framework.base.checkpoint.format import load_state, prune, write_checkpoint
from framework.base.checkpoint.kinds import get_checkpoint_kind


@dataclass
class SaveResult:
    """Outcome of one save: ``save_s`` is wall seconds from the call to the renamed folder."""

    step: int
    kind: str  # full | delta | a sharded kind (dcp)
    save_s: float
    bytes: int = 0  # bytes on disk of the checkpoint folder's files
    path: Path | None = None  # None when the save failed
    delta_ratio: float | None = None  # delta bytes / bytes of its full base
    error: str | None = None


def cpu_copy(obj: Any, buffers: Any = None) -> Any:
    """A copy of a nested state in which every tensor is a CPU tensor that aliases no live state.

    Tensors are copied into ``buffers`` (a previous result of this function) where it holds a
    tensor of the same dtype and shape at the same position: writing into memory that is
    already mapped is several times faster than allocating (page faults) on every save. CUDA
    tensors go to pinned memory.
    """
    if isinstance(obj, torch.Tensor):
        if isinstance(buffers, torch.Tensor) and buffers.dtype == obj.dtype and buffers.shape == obj.shape:
            return buffers.copy_(obj.detach())
        if obj.is_cuda:
            return torch.empty_like(obj, device="cpu", pin_memory=True).copy_(obj.detach())
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return type(obj)((k, cpu_copy(v, child_of(buffers, k))) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(cpu_copy(v, child_of(buffers, i)) for i, v in enumerate(obj))
    return obj


class FolderCheckpointIO(CheckpointIO):
    """Writes ``trainer.save_checkpoint(<dir>/step%08d)`` as a checkpoint folder; loads folders safely.

    Args:
        keep_last_k: complete checkpoints kept after each successful save (bases of kept deltas too).
        asynchronous: write in a background thread after a synchronous copy to CPU.
        full_every_n_saves: 1 = every save is full; K > 1 = a full base every K saves, deltas between.
        manifest_fields: extra manifest entries (layout, config_hash, versions).
        tokens_per_step: tokens per optimizer step, for the manifest's ``tokens_seen``.
        kind: the checkpoint kind the run's plugin declares it writes
            (``PluginCapabilities.checkpoint_format``); a kind with a ``save_shards``
            (:class:`~framework.base.checkpoint.kinds.CheckpointKind`) is saved by every rank through it.

    Raises:
        CheckpointError: ``kind`` is not registered.
    """

    def __init__(
        self,
        *,
        keep_last_k: int,
        asynchronous: bool,
        full_every_n_saves: int,
        manifest_fields: dict[str, Any],
        tokens_per_step: int,
        kind: str = "full",
    ) -> None:
        self.kind = get_checkpoint_kind(kind)
        self.keep_last_k = keep_last_k
        self.asynchronous = asynchronous
        self.full_every = full_every_n_saves
        self.manifest_fields = manifest_fields
        self.tokens_per_step = tokens_per_step
        self._thread: threading.Thread | None = None
        self._results: list[SaveResult] = []
        self._lock = threading.Lock()
        self._base: tuple[str, Any, int] | None = None  # (folder name, CPU state, bytes) of the newest full save
        self._buffers: Any = None  # CPU copy of the previous save, reused for the next one
        self._saves_since_base = 0

    # -- saving ----------------------------------------------------------------------------
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Save ``checkpoint`` as folder ``path`` (``<dir>/step%08d``); returns once it is safe to train on.

        Raises:
            OSError: a synchronous write failed (no folder is left behind).
        """
        self.wait()
        t0 = time.perf_counter()
        path = Path(path)
        step = int(checkpoint["global_step"])
        if self.kind.save_shards is not None:  # the plugin saves in shards: every rank writes its part, synchronously
            self._save_sharded(path.parent, step, checkpoint, t0)
            return
        if self.asynchronous or self.full_every > 1:
            state = self._buffers = cpu_copy(checkpoint, self._buffers)
        else:
            state = checkpoint
        if self.asynchronous:
            self._thread = threading.Thread(
                target=self._write, args=(path.parent, step, state, t0), daemon=True, name=f"trainlab-ckpt-{step}"
            )
            self._thread.start()
            return
        result = self._write(path.parent, step, state, t0)
        if result.error is not None:
            raise OSError(f"checkpoint save of step {step} failed: {result.error}")

    def _write(self, dirpath: Path, step: int, state: Any, t0: float) -> SaveResult:
        is_full = self.full_every == 1 or self._base is None or self._saves_since_base >= self.full_every - 1
        result = SaveResult(step=step, kind="full" if is_full else "delta", save_s=0.0)
        manifest = {
            **self.manifest_fields,
            "kind": result.kind,
            "base": None,
            "tokens_seen": step * self.tokens_per_step,
        }
        try:
            if is_full:
                payload = state
            else:
                base_name, base_state, base_bytes = self._base
                payload = encode_delta(base_state, state)
                manifest["base"] = base_name
            final = write_checkpoint(dirpath, step, payload, manifest)
            result.path = final
            result.bytes = sum(f.stat().st_size for f in final.iterdir() if f.is_file())
            if is_full:
                self._saves_since_base = 0
                if self.full_every > 1:
                    self._base = (final.name, state, result.bytes)
                    self._buffers = None  # the base keeps these tensors; the next save copies into new ones
            else:
                self._saves_since_base += 1
                result.delta_ratio = result.bytes / base_bytes
            prune(dirpath, self.keep_last_k)
        except Exception as err:  # reported via pop_results (async) or raised by save_checkpoint (sync)
            result.error = f"{type(err).__name__}: {err}"
        result.save_s = time.perf_counter() - t0
        with self._lock:
            self._results.append(result)
        return result

    def _save_sharded(self, dirpath: Path, step: int, checkpoint: dict[str, Any], t0: float) -> None:
        """Collective save through the kind's ``save_shards`` (e.g. :func:`framework.base.checkpoint.dcp.save_sharded`);
        rank 0 prunes and reports."""
        result = SaveResult(step=step, kind=self.kind.name, save_s=0.0)
        try:
            final = self.kind.save_shards(
                dirpath, step, checkpoint, {**self.manifest_fields, "tokens_seen": step * self.tokens_per_step}
            )
        except Exception as err:
            raise OSError(f"checkpoint save of step {step} failed: {type(err).__name__}: {err}") from err
        if final is None:  # not rank 0: rank 0 commits the folder and reports
            return
        result.path = final
        result.bytes = sum(f.stat().st_size for f in final.rglob("*") if f.is_file())
        prune(dirpath, self.keep_last_k)
        result.save_s = time.perf_counter() - t0
        with self._lock:
            self._results.append(result)

    def record(self, result: SaveResult) -> None:
        """Report a save written by someone else (a strategy that writes its own folders) to :meth:`pop_results`."""
        with self._lock:
            self._results.append(result)

    def wait(self) -> None:
        """Block until the save in flight (if any) has finished, successfully or not."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def pop_results(self) -> list[SaveResult]:
        """Saves finished since the last call, oldest first (failed ones carry ``error``)."""
        with self._lock:
            done, self._results = self._results, []
        return done

    # -- loading and the rest of Lightning's CheckpointIO interface --------------------------
    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Verify and load checkpoint folder ``path`` (always weights-only; tensors on CPU).

        Raises:
            CheckpointError: bad manifest or checksum mismatch.
            UnsafeCheckpointError: a file holds objects other than tensors and plain containers.
        """
        return load_state(path)

    def remove_checkpoint(self, path: Any) -> None:
        """Delete checkpoint folder ``path``."""
        shutil.rmtree(path, ignore_errors=True)

    def teardown(self) -> None:
        """Wait for the save in flight, so that training never ends with a half-written checkpoint."""
        self.wait()
