"""Sharded, reshardable checkpoints with torch Distributed Checkpoint (DCP), in trainlab's folder format.

For any plugin whose parameters are DTensors (FSDP2, tensor parallel) or whose ranks hold
different plain tensors (pipeline stages: :mod:`plugins.megatron.checkpoint`, which keys them by
the unsplit model's names): every rank writes only the shards it holds, and a checkpoint written at one
world size loads at any other, into a sharded run (DCP reshards on load) or into a plain one
(``single``, ``ddp``: the shards are gathered into one full state).

Layout of a sharded checkpoint ``step%08d/`` (manifest ``kind: "dcp"``)::

    dcp/.metadata       DCP's index: global shape, dtype and chunks of every tensor
    dcp/__<r>_0.distcp  the tensor shards written by rank r
    state.pt            everything that is not a model or optimizer tensor (loops, LR scheduler,
                        data position, callbacks, per-rank RNG, optimizer hyperparameters),
                        written by rank 0; weights-only loadable like every trainlab state file
    manifest.json       sha256 and size of every file above (written last, then the rename)

DCP holds one flat ``{key: tensor}`` dict, tensors only: ``state_dict/<name>`` for the
LightningModule's state (``name`` as in ``LightningModule.state_dict()``), and
``optimizer_<i>/<param name>/<state name>`` for optimizer ``i`` (``exp_avg``, ``exp_avg_sq``,
``step`` for AdamW), keyed by parameter *name*, not by position, so that a different sharding
or wrapping of the same model still matches. No pickled object is ever read back: DCP's index
is read with an unpickler that admits only DCP's own metadata classes, and a checkpoint that
holds non-tensor DCP entries is refused.

Atomicity is the folder format's (:mod:`framework.base.checkpoint.format`): rank 0 makes the
temporary folder and broadcasts its name, every rank writes its shards into it (DCP fsyncs
each file), rank 0 adds ``state.pt``, hashes every file, writes the manifest and renames.
The folder must be on a file system every rank sees (one node here).

Loading:

- :func:`load_full_state` (no process group): a plain Lightning checkpoint dict (full tensors,
  optimizer state keyed by position as ``Optimizer.state_dict()`` has it), so ``single`` and
  ``ddp`` resume from a sharded checkpoint through the ordinary ``CheckpointIO`` path, and
  ``python -m framework.checkpoint convert`` writes weights or a full checkpoint from it.
- :func:`load_into_sharded` (every rank): a checkpoint whose kind loads into live shards
  (:func:`load_shards` for this one; see :mod:`framework.base.checkpoint.kinds`) is read by DCP
  directly into them (any world size); any other (``state.pt`` of ``single``/``ddp``, a delta)
  is gathered into its full state and distributed with ``set_state_dict(full_state_dict=True)``.

The ``dcp`` kind is registered by the package (:mod:`framework.base.checkpoint`);
:class:`framework.base.checkpoint.sharded_strategy.ShardedCheckpointing` plugs the loading and
saving into a Lightning strategy. This module holds the file I/O only and imports no Lightning.
"""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path
from typing import Any

import torch

from framework.base.checkpoint.format import (
    STATE_FILE,
    CheckpointError,
    UnsafeCheckpointError,
    commit_folder,
    kind_of,
    load_state,
    new_temp_folder,
    read_manifest,
    safe_torch_load,
    verify,
    write_state_file,
)

KIND = "dcp"  # manifest "kind" of a sharded checkpoint
DCP_DIR = "dcp"  # sub-folder holding DCP's files
MODEL_KEY = "state_dict"  # Lightning's key of the LightningModule state
OPTIM_KEY = "optimizer_states"  # Lightning's key of the list of optimizer states


# -- flat DCP dict <-> Lightning's checkpoint dict ---------------------------------------------
def _optim_prefix(i: int) -> str:
    return f"optimizer_{i}/"


def split_checkpoint(checkpoint: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Split a Lightning checkpoint whose optimizer states are keyed by parameter name.

    Returns:
        ``(tensors, rest)``: ``tensors`` the flat DCP dict (model state and every tensor of
        the optimizer states), ``rest`` everything else, with each optimizer state reduced to
        its ``param_groups`` and any non-tensor per-parameter entries.
    """
    tensors: dict[str, torch.Tensor] = {f"{MODEL_KEY}/{k}": v for k, v in checkpoint[MODEL_KEY].items()}
    rest = {k: v for k, v in checkpoint.items() if k not in (MODEL_KEY, OPTIM_KEY)}
    rest[OPTIM_KEY] = []
    for i, osd in enumerate(checkpoint.get(OPTIM_KEY, [])):
        plain: dict[str, dict[str, Any]] = {}
        for name, per_param in osd.get("state", {}).items():
            for key, value in per_param.items():
                if isinstance(value, torch.Tensor):
                    tensors[f"{_optim_prefix(i)}{name}/{key}"] = value
                else:
                    plain.setdefault(name, {})[key] = value
        rest[OPTIM_KEY].append({"param_groups": osd["param_groups"], "state": plain})
    return tensors, rest


def join_checkpoint(tensors: dict[str, torch.Tensor], rest: dict[str, Any]) -> dict[str, Any]:
    """Inverse of :func:`split_checkpoint` (optimizer states keyed by parameter name)."""
    out = dict(rest)
    out[MODEL_KEY] = {k[len(MODEL_KEY) + 1 :]: v for k, v in tensors.items() if k.startswith(MODEL_KEY + "/")}
    optims = []
    for i, saved in enumerate(rest.get(OPTIM_KEY, [])):
        state: dict[str, dict[str, Any]] = {name: dict(v) for name, v in saved.get("state", {}).items()}
        prefix = _optim_prefix(i)
        for k, v in tensors.items():
            if k.startswith(prefix):
                name, key = k[len(prefix) :].rsplit("/", 1)
                state.setdefault(name, {})[key] = v
        optims.append({"state": state, "param_groups": saved["param_groups"]})
    out[OPTIM_KEY] = optims
    return out


def optim_state_by_position(named: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state keyed by parameter name -> keyed by position, as ``Optimizer.state_dict()``.

    Positions count the parameters of ``param_groups`` in order (what torch's ``Optimizer``
    does), so the result loads into an optimizer built with the same groups.
    """
    index: dict[str, int] = {}
    groups = []
    for g in named["param_groups"]:
        ids = []
        for name in g["params"]:
            index[name] = len(index)
            ids.append(index[name])
        groups.append({**g, "params": ids})
    return {"state": {index[n]: s for n, s in named["state"].items()}, "param_groups": groups}


def optim_state_by_name(
    positional: dict[str, Any], module: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    """Inverse of :func:`optim_state_by_position` for the live ``optimizer`` of ``module``.

    Raises:
        CheckpointError: the saved param groups do not match the optimizer's (other model or optimizer).
    """
    names = {id(p): n for n, p in module.named_parameters()}
    saved_groups = positional["param_groups"]
    live = [[names[id(p)] for p in g["params"]] for g in optimizer.param_groups]
    if [len(g["params"]) for g in saved_groups] != [len(g) for g in live]:
        raise CheckpointError(
            f"optimizer param groups of the checkpoint ({[len(g['params']) for g in saved_groups]} parameters)"
            f" do not match this run's ({[len(g) for g in live]}); another model or optimizer?"
        )
    by_pos = {pos: name for sg, lg in zip(saved_groups, live) for pos, name in zip(sg["params"], lg)}
    return {
        "state": {by_pos[pos]: s for pos, s in positional["state"].items()},
        "param_groups": [{**sg, "params": lg} for sg, lg in zip(saved_groups, live)],
    }


# -- reading DCP's index without running pickled code ----------------------------------------
_SAFE_MODULES = {
    "torch.distributed.checkpoint.metadata",
    "torch.distributed.checkpoint.filesystem",
    "pathlib",
    "collections",
}
_SAFE_NAMES = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Admits only DCP's metadata dataclasses, paths, ``torch.Size`` and dtypes."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module in _SAFE_MODULES or (module, name) in _SAFE_NAMES:
            obj = super().find_class(module, name)
            if module == "torch.distributed.checkpoint.filesystem" and name != "_StorageInfo":
                raise pickle.UnpicklingError(f"{module}.{name} is not allowed in DCP metadata")
            return obj
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in DCP metadata")


def safe_reader(path: Path):
    """A DCP ``FileSystemReader`` of DCP folder ``path`` whose index is read without running pickled code.

    Its ``read_metadata`` admits only DCP's metadata classes (:class:`_MetadataUnpickler`) and
    tensor entries.

    Raises (from ``read_metadata``):
        UnsafeCheckpointError: the index holds any other pickled object, or non-tensor entries.
    """
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta, TensorStorageMetadata

    class SafeFileSystemReader(FileSystemReader):
        """``FileSystemReader`` whose index is read by :class:`_MetadataUnpickler` (tensor entries only)."""

        def read_metadata(self, *args: Any, **kwargs: Any):
            with open(Path(self.path) / ".metadata", "rb") as f:
                try:
                    metadata = _MetadataUnpickler(f).load()
                except (pickle.UnpicklingError, AttributeError, ImportError) as err:
                    raise UnsafeCheckpointError(f"{self.path}/.metadata: refused to load: {err}") from None
            bad = [k for k, m in metadata.state_dict_metadata.items() if not isinstance(m, TensorStorageMetadata)]
            if bad:
                raise UnsafeCheckpointError(
                    f"{self.path}: refused to load: non-tensor entries {bad[:3]} (pickled objects)"
                )
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeFileSystemReader(str(path))


# -- saving ------------------------------------------------------------------------------------
def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _broadcast(obj: Any) -> Any:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def save_sharded(dirpath: str | Path, step: int, checkpoint: dict[str, Any], manifest: dict[str, Any]) -> Path | None:
    """Write ``checkpoint`` (optimizer states keyed by parameter name) as sharded checkpoint ``step%08d``.

    Collective: every rank calls it with its own shards. Returns the final folder on rank 0,
    None elsewhere.

    Raises:
        OSError: the write failed on this rank (rank 0 removes the temporary folder).
    """
    import torch.distributed.checkpoint as dcp

    rank = _rank()
    tmp = _broadcast(str(new_temp_folder(dirpath, step)) if rank == 0 else None)
    tmp = Path(tmp)
    tensors, rest = split_checkpoint(checkpoint)
    try:
        dcp.save(tensors, storage_writer=dcp.FileSystemWriter(str(tmp / DCP_DIR)))  # fsyncs every file
        if rank != 0:
            return None
        known = write_state_file(tmp, rest)
    except BaseException:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return commit_folder(tmp, step, {**manifest, "kind": KIND, "base": None}, known)


# -- loading -----------------------------------------------------------------------------------
def _read_rest(path: Path) -> dict[str, Any]:
    return safe_torch_load(path / STATE_FILE)


def load_full_state(path: str | Path) -> dict[str, Any]:
    """The full (unsharded) Lightning checkpoint dict of sharded checkpoint ``path``, in one process.

    Optimizer states come back keyed by position (``Optimizer.state_dict()`` form). Needs no
    process group; holds the whole state in CPU memory.

    Raises:
        CheckpointError: not a sharded checkpoint.
        UnsafeCheckpointError: the checkpoint holds pickled objects other than DCP's index.
    """
    import warnings

    import torch.distributed.checkpoint as dcp

    path = Path(path)
    if read_manifest(path)["kind"] != KIND:
        raise CheckpointError(f"{path}: not a sharded ({KIND}) checkpoint")
    reader = safe_reader(path / DCP_DIR)
    meta = reader.read_metadata()
    tensors = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.state_dict_metadata.items()}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process.*")
        dcp.load(tensors, storage_reader=reader, no_dist=True)
    full = join_checkpoint(tensors, _read_rest(path))
    full[OPTIM_KEY] = [optim_state_by_position(o) for o in full[OPTIM_KEY]]
    return full


def load_shards(path: Path, tensors: dict[str, Any]) -> dict[str, Any]:
    """Fill ``tensors`` in place from sharded checkpoint ``path``; return the rest of its state (``state.pt``).

    ``tensors``: :func:`split_checkpoint`'s flat dict of the live state (DTensor shards or plain
    tensors); DCP reads into each exactly the part this rank holds, resharding as needed. The
    ``dcp`` kind's ``load_into_shards``. Collective: every rank calls it. Does not verify.

    Raises:
        UnsafeCheckpointError: the checkpoint holds pickled objects other than DCP's index.
    """
    import torch.distributed.checkpoint as dcp

    dcp.load(tensors, storage_reader=safe_reader(Path(path) / DCP_DIR))
    return _read_rest(Path(path))


def live_named_state(module: torch.nn.Module, optimizers: list[torch.optim.Optimizer]) -> dict[str, Any]:
    """This rank's live state of ``module`` and its ``optimizers`` as Lightning's dict, optimizer states keyed by name.

    Model and optimizer tensors are the live ones (DTensor shards where the module is sharded),
    from ``torch.distributed.checkpoint.state_dict``; an AdamW that has not stepped yet gets its
    (empty) state initialised, so that a load has tensors to fill.
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    return {
        MODEL_KEY: get_model_state_dict(module),
        OPTIM_KEY: [get_optimizer_state_dict(module, opt) for opt in optimizers],  # initialises empty AdamW state
    }


def load_into_sharded(
    path: str | Path, module: torch.nn.Module, optimizers: list[torch.optim.Optimizer], verified: bool = False
) -> dict[str, Any]:
    """Load checkpoint ``path`` (sharded at any world size, or any kind that gathers into a full state) into a sharded ``module``.

    The checkpoint's kind decides (:mod:`framework.base.checkpoint.kinds`): one that loads into live
    shards is read straight into them; any other is gathered into its full state
    (:func:`~framework.base.checkpoint.format.load_state`) and distributed. Collective: every rank
    calls it. Returns the rest of the checkpoint (loops, LR schedulers, data position,
    callbacks, RNG) for Lightning to restore.

    Raises:
        CheckpointError: the checkpoint is not intact (unless ``verified``), its kind is unknown
            or loads only into its own plugin, or it does not match the model.
        UnsafeCheckpointError: it holds pickled objects other than tensors and plain containers.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    path = Path(path)
    if not verified:
        problems = verify(path)
        if problems:
            raise CheckpointError("; ".join(problems))
    kind = kind_of(path)
    if kind.load_into_shards is not None:
        live = live_named_state(module, optimizers)
        tensors, _ = split_checkpoint(live)
        rest = kind.load_into_shards(path, tensors)  # into the live shards, resharding as needed
        state = join_checkpoint(tensors, rest)
        set_model_state_dict(module, state[MODEL_KEY])
        for opt, osd in zip(optimizers, state[OPTIM_KEY]):
            set_optimizer_state_dict(module, opt, osd)
        return rest
    full = load_state(path)  # e.g. single / ddp: one full state file (a delta rebuilt from its base)
    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(module, full.pop(MODEL_KEY), options=options)
    for opt, osd in zip(optimizers, full.pop(OPTIM_KEY, [])):
        set_optimizer_state_dict(module, opt, optim_state_by_name(osd, module, opt), options=options)
    return full
