"""Sharded (DCP) checkpoints of the ``tp`` and ``pp`` plugins, keyed by the unsplit GPT's names.

Every rank writes what it holds with torch Distributed Checkpoint, through trainlab's folder
format (:mod:`framework.base.checkpoint.dcp`): TP shards are DTensors (DCP records their global
shape and offsets), FSDP2 shards on the dp dimension too, and a pipeline stage's plain tensors
are written by the ranks that hold them (replicas of the same tensor on TP/DP peers once).

Names: a pipeline rank's parameters are ``model.chunks.<k>.blocks.<N>.…`` (stage ``k``); in the
checkpoint they are the :class:`framework.base.model.GPT` names ``model.blocks.<N>.…``
(:func:`plugins.megatron.pipeline.gpt_param_name`), unique across stages, so the checkpoint is
the one an unsplit model would write: ``single``/``ddp`` resume from it
(:func:`framework.base.checkpoint.dcp.load_full_state` gathers it), and any tp/pp/dp layout of the
same model loads it (DCP reshards). The last stage's tied-head copy (``chunks.<last>.head``) is
not written: it equals ``wte`` (see :mod:`plugins.megatron.pipeline`), and on load it and its
AdamW moments are read from ``wte``'s entries. AdamW state is keyed by the same names
(``optimizer_<i>/<GPT name>/<exp_avg|exp_avg_sq|step>``); the optimizer's ``param_groups``
list every GPT parameter in the GPT's order (gathered from all ranks), which is the order in
which ``single``'s optimizer numbers them.

Loading also works the other way: a full checkpoint of ``single``/``ddp`` (``state.pt``) is
distributed into the live TP/FSDP shards and pipeline stages by the same names.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from framework.base.checkpoint.dcp import MODEL_KEY, OPTIM_KEY, join_checkpoint, live_named_state, split_checkpoint
from framework.base.checkpoint.format import CheckpointError, kind_of, load_state, verify
from framework.base.checkpoint.sharded_strategy import ShardedCheckpointing, unwrap_optimizer
from plugins.megatron.pipeline import gpt_param_name

PREFIX = "model."  # LMModule's attribute holding the model (or the pipeline runner)
TIED = PREFIX + "wte.weight"  # where the last stage's head copy is read from


def saved_name(live: str) -> str | None:
    """Checkpoint name of LightningModule entry ``live``; None for the pipeline's head copy (not saved).

    ``model.chunks.1.blocks.2.mlp.fc.weight`` -> ``model.blocks.2.mlp.fc.weight``; names outside a
    pipeline are already GPT names and stay as they are.
    """
    if not live.startswith(PREFIX + "chunks."):
        return live
    gpt = gpt_param_name(live[len(PREFIX) :])
    return None if gpt is None else PREFIX + gpt


def load_name(live: str) -> str:
    """Checkpoint name that LightningModule entry ``live`` is loaded from (the head copy: ``wte``)."""
    name = saved_name(live)
    return TIED if name is None else name


def _rename_model(state: dict[str, Any], fn) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in state.items():
        name = fn(k)
        if name is None:
            continue
        if name in out:
            raise CheckpointError(f"two entries of this rank map to checkpoint name {name!r}")
        out[name] = v
    return out


def _rename_optim(osd: dict[str, Any], fn) -> dict[str, Any]:
    """Optimizer state keyed by parameter name (``get_optimizer_state_dict`` form), names mapped by ``fn``."""
    return {
        "state": _rename_model(osd["state"], fn),
        "param_groups": [
            {**g, "params": [fn(n) for n in g["params"] if fn(n) is not None]} for g in osd["param_groups"]
        ],
    }


def global_group_names(groups: list[list[str]], order: list[str]) -> list[list[str]]:
    """Every rank's checkpoint names of each param group, merged and sorted in the GPT's ``order``.

    Collective over the default group (every rank calls it). ``groups[g]``: this rank's names of
    group ``g``. Returns for each group the union over ranks (TP/DP replicas once).
    """
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, groups)
    index = {n: i for i, n in enumerate(order)}
    merged = []
    for g in range(len(groups)):
        names = {n for ranks in gathered for n in ranks[g]}
        missing = names - index.keys()
        if missing:
            raise CheckpointError(f"parameters {sorted(missing)[:3]} are not GPT parameters")
        merged.append(sorted(names, key=index.__getitem__))
    return merged


class MeshCheckpointing(ShardedCheckpointing):
    """:class:`ShardedCheckpointing` with the GPT's names (see the module docstring).

    ``param_order``: the GPT's parameter names (with the ``model.`` prefix) in
    ``named_parameters`` order; set by the plugin in ``parallel_plan`` before any save or load.
    """

    param_order: list[str] = []

    def lightning_module_state_dict(self) -> dict[str, Any]:
        return _rename_model(super().lightning_module_state_dict(), saved_name)

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """This rank's AdamW state under checkpoint names; ``param_groups`` list every rank's names (collective)."""
        osd = _rename_optim(super().optimizer_state(optimizer), saved_name)
        merged = global_group_names([g["params"] for g in osd["param_groups"]], self.param_order)
        osd["param_groups"] = [{**g, "params": names} for g, names in zip(osd["param_groups"], merged)]
        return osd

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(checkpoint_path))
        problems = self.broadcast(verify(path) if self.global_rank == 0 else None)  # one rank reads every byte
        if problems:
            raise CheckpointError("; ".join(problems))
        return load_by_gpt_names(
            path, self.lightning_module, [unwrap_optimizer(o) for o in self.optimizers], self.param_order
        )


def load_by_gpt_names(
    path: Path, module: torch.nn.Module, optimizers: list[torch.optim.Optimizer], order: list[str]
) -> dict[str, Any]:
    """Load checkpoint ``path`` (sharded at any layout, or a full one of ``single``/``ddp``) into a tp/pp ``module``.

    The checkpoint's kind decides (:mod:`framework.base.checkpoint.kinds`), as in
    :func:`framework.base.checkpoint.dcp.load_into_sharded`: a kind that loads into live shards is read
    straight into them, any other is gathered into its full state and distributed by name.
    Collective: every rank calls it. Returns the rest of the checkpoint (loops, LR schedulers,
    data position, callbacks, RNG) for Lightning to restore.

    Raises:
        CheckpointError: a name of this rank is missing from the checkpoint, the optimizer's
            parameter groups differ from the saved ones, or the kind is unknown or loads only
            into its own plugin.
        UnsafeCheckpointError: the checkpoint holds pickled objects other than DCP's index.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    live = live_named_state(module, optimizers)
    live_groups = [[n for g in o["param_groups"] for n in g["params"]] for o in live[OPTIM_KEY]]
    kind = kind_of(path)
    if kind.load_into_shards is not None:
        renamed = {
            MODEL_KEY: _rename_model(live[MODEL_KEY], load_name),
            OPTIM_KEY: [_rename_optim(o, load_name) for o in live[OPTIM_KEY]],
        }
        tensors, _ = split_checkpoint(renamed)
        rest = kind.load_into_shards(path, tensors)  # into the live shards, resharding as needed
        saved = join_checkpoint(tensors, rest)
        options = StateDictOptions()
        model_state, optim_states = saved[MODEL_KEY], saved[OPTIM_KEY]
    else:
        rest = load_state(path)  # e.g. single / ddp: full tensors, optimizer state by position
        options = StateDictOptions(full_state_dict=True)
        model_state = rest.pop(MODEL_KEY)
        optim_states = []
        for o, osd in zip(live[OPTIM_KEY], rest.pop(OPTIM_KEY, [])):
            names = global_group_names(
                [[load_name(n) for n in g["params"] if saved_name(n) is not None] for g in o["param_groups"]], order
            )
            if [len(g["params"]) for g in osd["param_groups"]] != [len(g) for g in names]:
                raise CheckpointError(
                    f"optimizer param groups of the checkpoint ({[len(g['params']) for g in osd['param_groups']]}"
                    f" parameters) do not match this model's ({[len(g) for g in names]})"
                )
            by_pos = {pos: n for sg, ng in zip(osd["param_groups"], names) for pos, n in zip(sg["params"], ng)}
            optim_states.append(
                {"state": {by_pos[p]: s for p, s in osd["state"].items()}, "param_groups": osd["param_groups"]}
            )
    missing = [load_name(k) for k in live[MODEL_KEY] if load_name(k) not in model_state]
    if missing:
        raise CheckpointError(f"{path}: no entry for {missing[:3]} (another model?)")
    set_model_state_dict(module, {k: model_state[load_name(k)] for k in live[MODEL_KEY]}, options=options)
    for opt, o, saved_o, names in zip(optimizers, live[OPTIM_KEY], optim_states, live_groups):
        state = {n: saved_o["state"][load_name(n)] for n in names if load_name(n) in saved_o["state"]}
        groups = [{**sg, "params": lg["params"]} for sg, lg in zip(saved_o["param_groups"], o["param_groups"])]
        set_optimizer_state_dict(module, opt, {"state": state, "param_groups": groups}, options=options)
    return rest
