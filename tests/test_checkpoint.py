"""Checkpoints (fczero.checkpoint): resume across world sizes against a single-process
reference, export of a full state dict, errors for a checkpoint of another model, and a
failed save that leaves the previous checkpoint loadable."""

from __future__ import annotations

import logging
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from fczero import checkpoint
from fczero.testing.distributed import run_on_ranks
from fczero.testing.parity import make_optimizer, mse
from tests.models import UnevenTiedMLP, mlp_batches

LR = 0.05
BATCHES = mlp_batches(steps=6, batch=8)


def _reference() -> tuple[list[float], nn.Module]:
    """One process, whole batches, six AdamW steps: the losses and the trained model."""
    torch.manual_seed(0)
    model = UnevenTiedMLP()
    opt = make_optimizer("adamw", model.parameters(), LR)
    losses = []
    for x, y in BATCHES:
        loss = mse(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, model


def _train_segment(rank, world_size, steps, load_from, save_to):
    """One rank: build and shard, optionally load, train ``steps`` (a slice of BATCHES), save."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import fczero

    # A resumed run builds from another seed: everything it trains from must come from the load.
    torch.manual_seed(0 if load_from is None else 123)
    model = fczero.parallelize(UnevenTiedMLP(), init_device_mesh("cpu", (world_size,)))
    opt = make_optimizer("adamw", model.parameters(), LR)
    start = 0
    if load_from is not None:
        start = checkpoint.load(load_from, model, opt).step
    losses = []
    for x, y in BATCHES[start : start + steps]:
        n = x.shape[0] // world_size
        loss = mse(model(x[rank * n : (rank + 1) * n]), y[rank * n : (rank + 1) * n])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world_size)
    if save_to is not None:
        checkpoint.save(save_to, model, opt, step=start + steps, extra={"world": world_size})
    exported = checkpoint.full_state_dict(model)
    if load_from is not None and save_to is None:
        _failed_save_over(load_from, model, opt, rank, start)
    return losses, exported


def _failed_save_over(path, model, opt, rank, step):
    """Rank 1's writes fail while saving over ``path``: every rank raises, none hangs, and
    ``path`` still loads the checkpoint of ``step``."""
    import torch.distributed as dist

    def crash(*args, **kwargs):
        raise OSError("disk full (injected)")

    original = dcp.FileSystemWriter.write_data
    if rank == 1:
        dcp.FileSystemWriter.write_data = crash
    try:
        checkpoint.save(path, model, opt, step=99)
        raise AssertionError("the save should have failed")
    except CheckpointException as e:
        assert "disk full (injected)" in repr(e)
    finally:
        dcp.FileSystemWriter.write_data = original
    dist.barrier()
    assert checkpoint.load(path, model, opt).step == step


def test_resume_across_world_sizes_matches_one_uninterrupted_process(tmp_path):
    """2 ranks train 2 steps and save; 4 ranks resume for 2 and save; 2 ranks finish, export
    the full state dict, then fail to save over the 4 ranks' checkpoint (rank 1's writes
    raise), which still loads."""
    ref_losses, ref_model = _reference()
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    first = run_on_ranks(_train_segment, 2, 2, None, a)
    second = run_on_ranks(_train_segment, 4, 2, a, b)
    third = run_on_ranks(_train_segment, 2, 2, b, None)  # then fails to save over b
    losses = first[0][0] + second[0][0] + third[0][0]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    assert ref_losses[-1] < ref_losses[0]  # it trained

    exported, rest = third[0][1], [r[1] for r in third[1:]]
    assert rest == [{}]  # rank0_only: other ranks get nothing
    plain = UnevenTiedMLP()
    plain.load_state_dict(exported, strict=True)  # a plain, never-parallelized model
    for name, value in ref_model.state_dict().items():
        torch.testing.assert_close(exported[name], value, rtol=1e-5, atol=1e-6, msg=name)
        assert type(exported[name]) is torch.Tensor
    x = BATCHES[0][0]
    torch.testing.assert_close(plain(x), ref_model(x), rtol=1e-5, atol=1e-6)


# -- one process (plain modules: the checks are the same code) ---------------------------


class Small(nn.Module):
    def __init__(self, hidden: int = 3, head: str = "head") -> None:
        super().__init__()
        self.body = nn.Linear(4, hidden)
        setattr(self, head, nn.Linear(hidden, 2))
        self.head_name = head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return getattr(self, self.head_name)(torch.relu(self.body(x)))


def _trained(seed: int = 0, opt_cls=torch.optim.AdamW, steps: int = 1):
    torch.manual_seed(seed)
    model = Small()
    opt = opt_cls(model.parameters(), lr=0.1)
    for _ in range(steps):
        model(torch.randn(5, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_round_trip_restores_params_optimizer_step_and_extra(tmp_path):
    model, opt = _trained(steps=2)
    checkpoint.save(tmp_path / "c", model, opt, step=7, extra={"lr": [0.1], "note": "x"})
    fresh, fresh_opt = _trained(seed=1, steps=0)
    info = checkpoint.load(tmp_path / "c", fresh, fresh_opt)
    assert (info.step, info.world_size, info.extra) == (7, 1, {"lr": [0.1], "note": "x"})
    for k, v in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v), k
    for p, q in zip(model.parameters(), fresh.parameters()):
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.state[p][key], fresh_opt.state[q][key]), key
    # the next step is the same as the original's next step
    x = torch.randn(5, 4)
    for m, o in ((model, opt), (fresh, fresh_opt)):
        m(x).sum().backward()
        o.step()
    for p, q in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(p, q)


def test_load_of_another_model_names_the_keys_and_changes_nothing(tmp_path):
    model, opt = _trained()
    checkpoint.save(tmp_path / "c", model, opt)
    other = Small(hidden=5, head="proj")
    other_opt = torch.optim.AdamW(other.parameters(), lr=0.1)
    before = _snapshot(other)
    with pytest.raises(ValueError) as excinfo:
        checkpoint.load(tmp_path / "c", other, other_opt)
    msg = str(excinfo.value)
    assert "missing from the checkpoint: proj.bias, proj.weight" in msg
    assert "in the checkpoint but not in the model: head.bias, head.weight" in msg
    assert "body.bias (checkpoint (3,), model (5,))" in msg
    assert "body.weight (checkpoint (3, 4), model (5, 4))" in msg
    assert all(torch.equal(v, before[k]) for k, v in other.state_dict().items())
    assert not other_opt.state  # the optimizer was not touched either


def test_load_rejects_a_mismatched_optimizer(tmp_path):
    model, opt = _trained()
    checkpoint.save(tmp_path / "with", model, opt)
    checkpoint.save(tmp_path / "without", model)
    fresh = Small()
    with pytest.raises(ValueError, match="holds AdamW state, but the optimizer is SGD"):
        checkpoint.load(tmp_path / "with", fresh, torch.optim.SGD(fresh.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="saved without an optimizer"):
        checkpoint.load(tmp_path / "without", fresh, torch.optim.AdamW(fresh.parameters()))
    sgd_model, sgd = _trained(opt_cls=torch.optim.SGD)  # no momentum: no state tensors
    checkpoint.save(tmp_path / "sgd", sgd_model, sgd)
    momentum = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match=r"optim\.state\.body\.bias\.momentum_buffer"):
        checkpoint.load(tmp_path / "sgd", fresh, momentum)
    assert not momentum.state  # left without state, as it came
    checkpoint.load(tmp_path / "without", fresh)  # the model alone loads
    assert torch.equal(fresh.body.weight, model.body.weight)


def test_bad_arguments_raise_before_writing(tmp_path):
    model, opt = _trained()
    with pytest.raises(TypeError, match="JSON-serializable"):
        checkpoint.save(tmp_path / "c", model, opt, extra={"t": torch.ones(1)})
    with pytest.raises(ValueError, match="step must be an int >= 0"):
        checkpoint.save(tmp_path / "c", model, opt, step=-1)
    with pytest.raises(ValueError, match="pick another directory name"):
        checkpoint.save(tmp_path / "c.partial", model, opt)
    stranger = torch.optim.SGD([nn.Parameter(torch.ones(2))], lr=0.1)
    with pytest.raises(ValueError, match="not params of the model"):
        checkpoint.save(tmp_path / "c", model, stranger)
    assert not os.listdir(tmp_path)
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        checkpoint.load(tmp_path / "c", model, opt)


def test_failed_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch, caplog):
    path = tmp_path / "c"
    model, opt = _trained(steps=1)
    good = _snapshot(model)
    checkpoint.save(path, model, opt, step=1)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()

    def crash(*args, **kwargs):
        raise OSError("disk full (injected)")

    with monkeypatch.context() as m:  # the ranks' data writes fail midway through the save
        m.setattr(dcp.FileSystemWriter, "write_data", crash)
        with pytest.raises(CheckpointException) as excinfo:  # a BaseException
            checkpoint.save(path, model, opt, step=2)
    assert "disk full (injected)" in repr(excinfo.value)
    assert os.path.isdir(f"{path}.partial")  # the unfinished write stays beside the good one

    fresh, fresh_opt = _trained(seed=1, steps=0)
    with pytest.raises(FileNotFoundError, match="no checkpoint at") as excinfo:
        checkpoint.load(tmp_path / "nothing", fresh)
    assert "unfinished" not in str(excinfo.value)
    os.makedirs(tmp_path / "nothing.partial")
    with pytest.raises(FileNotFoundError, match="unfinished save left"):
        checkpoint.load(tmp_path / "nothing", fresh)
    assert checkpoint.load(path, fresh, fresh_opt).step == 1
    assert all(torch.equal(v, good[k]) for k, v in fresh.state_dict().items())

    # a crash between save's two renames leaves only <path>.old: load falls back to it
    os.rename(path, f"{path}.old")
    with caplog.at_level(logging.WARNING, logger="fczero"):
        info = checkpoint.load(path, fresh)
    assert info.step == 1 and info.path == f"{path}.old"
    assert "loading the previous one" in caplog.text

    real_rename = os.rename

    def failing_rename(src, dst):
        if str(src).endswith(".partial"):
            raise PermissionError("read-only (injected)")
        real_rename(src, dst)

    os.rename(f"{path}.old", path)
    with monkeypatch.context() as m:  # the final rename fails: a clear error, nothing lost
        m.setattr(os, "rename", failing_rename)
        with pytest.raises(OSError, match=r"could not be moved to .*read-only \(injected\)"):
            checkpoint.save(path, model, opt, step=2)
    assert not os.path.exists(path) and os.path.isdir(f"{path}.old")  # moved aside, intact
    assert checkpoint.load(path, fresh).step == 1  # through the fallback

    checkpoint.save(path, model, opt, step=2)  # the next save succeeds and cleans up
    assert sorted(os.listdir(tmp_path)) == ["c", "nothing.partial"]
    assert checkpoint.load(path, fresh).step == 2


def test_load_refreshes_the_whole_copies_of_stage_2(tmp_path):
    """Stages 1/2 compute with whole copies of the params: a load must bring them along."""
    from torch.distributed.device_mesh import init_device_mesh

    import fczero

    store = torch.distributed.FileStore(str(tmp_path / "store"), 1)
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        x = torch.randn(5, 4)
        torch.manual_seed(0)
        model = fczero.parallelize(Small(), init_device_mesh("cpu", (1,)), stage=2)
        expected = model(x).detach()
        checkpoint.save(tmp_path / "c", model)
        torch.manual_seed(1)
        other = fczero.parallelize(Small(), init_device_mesh("cpu", (1,)), stage=2)
        assert not torch.allclose(other(x), expected)
        checkpoint.load(tmp_path / "c", other)
        torch.testing.assert_close(other(x).detach(), expected, rtol=0, atol=0)
    finally:
        torch.distributed.destroy_process_group()
