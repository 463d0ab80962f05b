"""Each `Parallelism` on its own, in this one process: `SingleProcess` as it is, `Replicated` (DDP) and `Sharded`
(FSDP2) over a gloo process group of one rank, their collectives running over it; what the other ranks would add
to a gather comes from a fake `Distributed` (exgrpo.learner.parallel)."""

from __future__ import annotations

import copy
import dataclasses
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from exgrpo.config import TrainConfig
from exgrpo.learner.parallel import Replicated, Sharded, SingleProcess, parallelism
from exgrpo.runtime.distributed import Distributed


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        return torch.tanh(self.linear(x))


class Net(torch.nn.Module):
    """Two decoder-like blocks and a head: what FSDP shards by (`_no_split_modules`)."""

    _no_split_modules = ["Block"]

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([Block(), Block()])
        self.head = torch.nn.Linear(4, 1)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


@dataclasses.dataclass(frozen=True)
class GroupOfOne(Distributed):
    """This process as the one rank of the process group: enabled, so every collective runs (over itself)."""

    @property
    def enabled(self) -> bool:
        return True


@dataclasses.dataclass(frozen=True)
class WithOtherRanks(GroupOfOne):
    """As GroupOfOne, but a gather also returns `others`: what the other ranks contributed."""

    others: tuple = ()

    def gather(self, items: list) -> list:
        return list(items) + list(self.others)


@pytest.fixture
def group():
    """A gloo process group of this one process (an in-memory store), left at the end of the test."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def net() -> Net:
    torch.manual_seed(0)
    return Net()


X = torch.linspace(-1, 1, 12).reshape(3, 4)


def params(model) -> list[torch.nn.Parameter]:
    return list(model.parameters())


def reference_grad_norm() -> float:
    """The gradient norm of one backward pass of `net()` on X, in one process."""
    model = net()
    model(X).sum().backward()
    return float(torch.nn.utils.clip_grad_norm_(params(model), float("inf")))


# ---------------------------------------------------------------------------------------------------- one process


def test_one_process_trains_the_model_as_it_is():
    model = net()
    p = parallelism(model, TrainConfig(), Distributed(), "global")
    assert isinstance(p, SingleProcess) and p.train_model is model
    assert (p.shards_weights, p.casts_parameters, p.prompt_sharing, p.loss_multiplier) == (False, False, "auto", 1)
    assert [p.backward_passes(n) for n in (0, 1, 3)] == [0, 1, 3]
    with p.gradient_sync(last=False), p.full_weights():
        model(X).sum().backward()
    assert all(q.grad is not None for q in params(model))
    values = torch.arange(6.0).reshape(3, 2)
    assert p.assemble_rows(values, torch.tensor([0, 2])) is values
    assert p.checkpoint_weights() is None


def test_one_process_clips_the_gradients_and_returns_their_norm_before():
    model = net()
    p = SingleProcess(model)
    model(X).sum().backward()
    norm = p.clip_gradients(params(model), max_norm=1e-3)
    assert norm == pytest.approx(reference_grad_norm())
    assert float(torch.nn.utils.clip_grad_norm_(params(model), float("inf"))) == pytest.approx(1e-3, rel=1e-3)


def test_one_process_checks_every_weight_is_finite():
    model = net()
    p = SingleProcess(model)
    assert p.all_finite(params(model))
    with torch.no_grad():
        model.head.bias.fill_(float("nan"))
    assert not p.all_finite(params(model))


def test_one_process_optimizer_state_is_keyed_by_name_and_loads_back():
    model = net()
    p, optimizer = SingleProcess(model), torch.optim.AdamW(model.parameters())
    model(X).sum().backward()
    optimizer.step()
    state = p.optimizer_state(optimizer)
    assert set(state["state"]) == {name for name, _ in model.named_parameters()}

    other = net()
    fresh = torch.optim.AdamW(other.parameters())
    SingleProcess(other).load_optimizer_state(fresh, state)
    assert torch.equal(fresh.state[other.head.weight]["exp_avg"], optimizer.state[model.head.weight]["exp_avg"])


# ---------------------------------------------------------------------------------------------------- ddp


def test_ddp_wraps_the_model_and_a_rank_without_rows_still_joins_the_reduction(group):
    model = net()
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # torch 2.13 deprecates broadcast_buffers
        p = parallelism(model, TrainConfig(sharding="ddp"), GroupOfOne(), "global")
    assert isinstance(p, Replicated) and isinstance(p.train_model, torch.nn.parallel.DistributedDataParallel)
    assert p.train_model.module is model and p.model is model
    assert (p.shards_weights, p.casts_parameters, p.prompt_sharing) == (False, False, "auto")
    assert [p.backward_passes(n) for n in (0, 1, 3)] == [1, 1, 3]
    assert p.checkpoint_weights() is None


def test_ddp_reduces_gradients_on_the_last_backward_pass_only(group):
    p = Replicated(net(), TrainConfig(), GroupOfOne(), "global")
    reductions = []

    def count(state, bucket):  # DDP's all-reduce of a gradient bucket, counted (one rank: the sum is the bucket)
        reductions.append(bucket.index())
        done = torch.futures.Future()
        done.set_result(bucket.buffer())
        return done

    p.train_model.register_comm_hook(None, count)
    with p.gradient_sync(last=False):
        p.train_model(X).sum().backward()
    assert reductions == []
    with p.gradient_sync(last=True):
        p.train_model(X).sum().backward()
    assert reductions == [0]
    assert p.clip_gradients(params(p.model), float("inf")) == pytest.approx(2 * reference_grad_norm())


@pytest.mark.parametrize("loss_scale, multiplier", [("global", 2), ("per_rank", 1)])
def test_the_loss_is_multiplied_by_the_world_size_under_the_global_scale(group, loss_scale, multiplier):
    # two ranks described (their gradients averaged), one process group underneath: only the multiplier is read
    p = Replicated(net(), TrainConfig(), GroupOfOne(world_size=2), loss_scale)
    assert p.loss_multiplier == multiplier


def test_ddp_checks_every_weight_is_finite_across_ranks(group):
    model = net()
    p = Replicated(model, TrainConfig(), GroupOfOne(), "global")
    assert p.all_finite(params(model))
    with torch.no_grad():
        model.head.weight[0, 0] = float("inf")
    assert not p.all_finite(params(model))


def test_rows_of_every_rank_are_assembled_on_every_rank(group):
    values = torch.tensor([[1.0, 1.0], [2.0, 2.0], [0.0, 0.0], [0.0, 0.0]])  # this rank computed rows 0 and 1
    other = ([2, 3], torch.tensor([[3.0, 3.0], [4.0, 4.0]]))  # another rank rows 2 and 3
    p = Replicated(net(), TrainConfig(), WithOtherRanks(others=(other,)), "global")
    out = p.assemble_rows(values, torch.tensor([0, 1]))
    assert out.tolist() == [[1.0, 1.0], [2.0, 2.0], [3.0, 3.0], [4.0, 4.0]]
    assert values[2:].eq(0).all()  # the rank's own tensor is left as it was


# ---------------------------------------------------------------------------------------------------- fsdp


def test_fsdp_shards_the_model_in_place(group):
    model = net()
    p = parallelism(model, TrainConfig(sharding="fsdp"), GroupOfOne(), "global")
    assert isinstance(p, Sharded) and p.train_model is model
    assert all(isinstance(q, DTensor) for q in params(model))
    assert (p.shards_weights, p.casts_parameters, p.prompt_sharing) == (True, True, "always")


def test_fsdp_runs_the_most_backward_passes_any_rank_has(group):
    p = Sharded(net(), TrainConfig(), WithOtherRanks(others=(5,)), "global")
    assert p.backward_passes(2) == 5 and p.backward_passes(7) == 7


def test_fsdp_reduces_gradients_on_the_last_backward_pass_only_and_clips_over_the_shards(group):
    model = net()
    p = Sharded(model, TrainConfig(), GroupOfOne(), "global")
    with p.gradient_sync(last=False):
        model(X).sum().backward()
    assert all(q.grad is None for q in params(model))  # kept unreduced
    with p.gradient_sync(last=True):
        model(X).sum().backward()
    assert all(isinstance(q.grad, DTensor) for q in params(model))
    assert p.clip_gradients(params(model), float("inf")) == pytest.approx(2 * reference_grad_norm())


def test_fsdp_gathers_full_weights_for_pushes_and_checkpoints(group):
    model = net()
    full = copy.deepcopy(model.state_dict())
    p = Sharded(model, TrainConfig(), GroupOfOne(), "global")
    with p.full_weights():
        assert not any(isinstance(q, DTensor) for q in params(model))
        assert torch.equal(model.head.weight, full["head.weight"])
    assert all(isinstance(q, DTensor) for q in params(model))  # sharded again
    weights = p.checkpoint_weights()
    assert set(weights) == set(full) and all(torch.equal(weights[k], full[k]) for k in full)


def test_fsdp_checks_every_shard_is_finite(group):
    model = net()
    p = Sharded(model, TrainConfig(), GroupOfOne(), "global")
    assert p.all_finite(params(model))
    with torch.no_grad():
        model.head.bias.to_local().fill_(float("nan"))
    assert not p.all_finite(params(model))


def test_fsdp_optimizer_state_loads_into_one_process(group):
    model = net()
    p = Sharded(model, TrainConfig(), GroupOfOne(), "global")
    optimizer = torch.optim.AdamW(model.parameters())
    model(X).sum().backward()
    optimizer.step()
    state = p.optimizer_state(optimizer)
    assert set(state["state"]) == {name for name, _ in net().named_parameters()}

    other = net()
    fresh = torch.optim.AdamW(other.parameters())
    SingleProcess(other).load_optimizer_state(fresh, state)
    assert torch.equal(fresh.state[other.head.weight]["exp_avg"],
                       optimizer.state[model.head.weight]["exp_avg"].full_tensor())
