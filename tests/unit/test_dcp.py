"""Sharded (DCP) checkpoint helpers: state conversions, the safe index reader, resharding rules."""

from __future__ import annotations

import pickle

import pytest
import torch

from framework.base.checkpoint.dcp import (
    _MetadataUnpickler,
    join_checkpoint,
    optim_state_by_name,
    optim_state_by_position,
    split_checkpoint,
)
from framework.base.checkpoint.format import UnsafeCheckpointError
from framework.rank.checkpoint.reshard import rescale_batch_progress, rng_state_for_rank


def _trained():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.AdamW(
        [
            {"params": [model[0].weight, model[1].weight]},
            {"params": [model[0].bias, model[1].bias], "weight_decay": 0.0},
        ],
        lr=0.1,
    )
    model(torch.randn(5, 3)).sum().backward()
    opt.step()
    return model, opt


def test_optimizer_state_by_name_and_back_is_the_identity():
    model, opt = _trained()
    positional = opt.state_dict()
    named = optim_state_by_name(positional, model, opt)
    assert named["param_groups"][0]["params"] == ["0.weight", "1.weight"]
    assert named["param_groups"][1]["params"] == ["0.bias", "1.bias"]
    assert torch.equal(named["state"]["1.bias"]["exp_avg"], opt.state[model[1].bias]["exp_avg"])
    back = optim_state_by_position(named)
    assert back["param_groups"] == positional["param_groups"]
    torch.testing.assert_close(back["state"], positional["state"], rtol=0, atol=0)
    fresh = torch.optim.AdamW(
        [
            {"params": [model[0].weight, model[1].weight]},
            {"params": [model[0].bias, model[1].bias], "weight_decay": 0.0},
        ],
        lr=0.1,
    )
    fresh.load_state_dict(back)  # loads into an optimizer with the same groups
    assert torch.equal(fresh.state[model[0].weight]["exp_avg_sq"], opt.state[model[0].weight]["exp_avg_sq"])


def test_optimizer_state_of_another_model_is_refused():
    model, opt = _trained()
    other = torch.nn.Linear(3, 4)
    other_opt = torch.optim.AdamW(other.parameters())
    with pytest.raises(Exception, match="do not match"):
        optim_state_by_name(opt.state_dict(), other, other_opt)


def test_split_and_join_keep_every_entry():
    model, opt = _trained()
    named = optim_state_by_name(opt.state_dict(), model, opt)
    ckpt = {"state_dict": model.state_dict(), "optimizer_states": [named], "global_step": 3, "loops": {"a": 1}}
    tensors, rest = split_checkpoint(ckpt)
    assert all(isinstance(v, torch.Tensor) for v in tensors.values())
    assert "optimizer_0/0.weight/exp_avg" in tensors and "state_dict/1.bias" in tensors
    assert rest["global_step"] == 3 and rest["optimizer_states"][0]["param_groups"] == named["param_groups"]
    back = join_checkpoint(tensors, rest)
    torch.testing.assert_close(back["state_dict"], ckpt["state_dict"], rtol=0, atol=0)
    torch.testing.assert_close(back["optimizer_states"][0]["state"], named["state"], rtol=0, atol=0)


class _RunsCode:
    def __reduce__(self):
        return (print, ("pwned",))


def test_dcp_index_reader_admits_only_metadata_classes(tmp_path):
    import io

    from torch.distributed.checkpoint.metadata import Metadata, TensorProperties, TensorStorageMetadata

    good = Metadata(
        state_dict_metadata={"w": TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([2]), [])}
    )
    assert _MetadataUnpickler(io.BytesIO(pickle.dumps(good))).load().state_dict_metadata["w"].size == torch.Size([2])
    with pytest.raises(pickle.UnpicklingError, match="builtins.print is not allowed"):
        _MetadataUnpickler(io.BytesIO(pickle.dumps(_RunsCode()))).load()


def test_a_planted_dcp_index_is_refused_without_running_it(tmp_path, capsys):
    from framework.base.checkpoint.dcp import safe_reader

    (tmp_path / ".metadata").write_bytes(pickle.dumps(_RunsCode()))
    with pytest.raises(UnsafeCheckpointError, match="refused to load"):
        safe_reader(tmp_path).read_metadata()
    assert "pwned" not in capsys.readouterr().out


def test_rng_states_at_another_world_size():
    a, b = {"torch_cpu": torch.tensor([1, 2])}, {"torch_cpu": torch.tensor([3, 4])}
    assert rng_state_for_rank([a, b], 1, 2) == (b, None)  # same world size: own state
    assert rng_state_for_rank([a, dict(a)], 0, 1) == (a, None)  # identical states: shared, exact
    assert rng_state_for_rank([a], 1, 2) == (a, None)  # 1 -> 2 ranks
    state, warning = rng_state_for_rank([a, b], 2, 3)  # different states: rank r % n, with a warning
    assert state is a and "differ from an uninterrupted run" in warning


def _progress(ready: int, completed: int) -> dict:
    counters = {"ready": ready, "started": ready, "processed": ready, "completed": completed}
    return {
        "global_step": 3,
        "loops": {"fit_loop": {"epoch_loop.batch_progress": {"total": dict(counters), "current": dict(counters)}}},
    }


def test_batch_counter_follows_the_micro_batches_per_step():
    ckpt = _progress(12, 11)  # 3 steps x 4 micro-batches, saved inside the last batch's end hook
    assert rescale_batch_progress(ckpt, 2, 4)
    total = ckpt["loops"]["fit_loop"]["epoch_loop.batch_progress"]["total"]
    assert (total["ready"], total["completed"]) == (6, 5)
    ckpt = _progress(6, 5)
    assert rescale_batch_progress(ckpt, 4, None)  # saved value inferred from the counter: 6 // 3 = 2
    assert ckpt["loops"]["fit_loop"]["epoch_loop.batch_progress"]["current"]["ready"] == 12
    assert not rescale_batch_progress(_progress(6, 5), 2, 2)
