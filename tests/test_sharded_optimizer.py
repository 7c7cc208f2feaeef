"""ShardedOptimizer on CPU with gloo: sharded training equals unsharded training (bitwise in practice).

Every rank builds the same model from the same seed (no data parallel wrapper: the gradients are
identical by construction, as in the official test), trains a reference copy with the plain optimizer
and a second copy with `ShardedOptimizer`, and compares the parameters with the official tolerance
(numpy rtol 1e-7, atol 0) and bitwise. Workers are module-level functions so `mp.spawn` can import them.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from ddp_helpers import ToyModel, ToyModelWithTiedWeights
from torch import nn

from cs336_systems.distributed import ShardedOptimizer
from cs336_systems.distributed.process_group import spawn
from cs336_systems.model import AdamW as BasicsAdamW

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(120)]


MODELS = {"ToyModel": ToyModel, "ToyModelWithTiedWeights": ToyModelWithTiedWeights}
OPTIMIZERS = {
    "torch_adamw": (torch.optim.AdamW, dict(lr=0.1, weight_decay=0.1, betas=(0.9, 0.999), eps=1e-8)),
    "sgd_momentum": (torch.optim.SGD, dict(lr=0.05, momentum=0.9, weight_decay=0.01)),
    "basics_adamw": (BasicsAdamW, dict(lr=0.01, weight_decay=0.1)),
}


def _train_step(model: nn.Module, optimizer: torch.optim.Optimizer, x, y) -> None:
    optimizer.zero_grad()
    loss = ((y - model(x)) ** 2).sum()
    loss.backward()
    optimizer.step()


def _assert_same_params(ref: nn.Module, sharded: nn.Module) -> None:
    for (name, p_ref), (name_s, p_s) in zip(ref.named_parameters(), sharded.named_parameters(), strict=True):
        assert name == name_s
        np.testing.assert_allclose(
            p_s.detach().cpu().numpy(), p_ref.detach().cpu().numpy(), err_msg=name
        )  # rtol 1e-7
        assert torch.equal(p_s, p_ref), f"{name} differs in the last bits"


# ------------------------------------------------------------------------------------------------
# Workers
# ------------------------------------------------------------------------------------------------


def _official_semantics_worker(rank, world_size, device, model_name):
    """The official test: identical seeds, torch AdamW, 10 steps, rand inputs, sum-of-squares loss."""
    torch.manual_seed(42)
    model = MODELS[model_name]().to(device)
    ref_model = copy.deepcopy(model)
    opt_cls, kwargs = OPTIMIZERS["torch_adamw"]
    ref_opt = opt_cls(ref_model.parameters(), **kwargs)
    sharded_opt = ShardedOptimizer(model.parameters(), opt_cls, **kwargs)
    rng_before = torch.get_rng_state()
    for _ in range(10):
        x, y = torch.rand(32, 10, device=device), torch.rand(32, 5, device=device)
        rng_before = torch.get_rng_state()
        _train_step(model, sharded_opt, x, y)
        mid = torch.get_rng_state()
        assert torch.equal(mid, rng_before), "ShardedOptimizer consumed the global RNG"
        _train_step(ref_model, ref_opt, x, y)
    _assert_same_params(ref_model, model)
    # State exists only for this rank's shard, and the shards partition the trainable parameters.
    owned = {id(p) for p in sharded_opt.local_params}
    assert {id(p) for p in sharded_opt.state} <= owned
    assert all(sharded_opt.owner_of(p) == rank for p in sharded_opt.state)
    counts = [None] * world_size
    torch.distributed.all_gather_object(counts, len(sharded_opt.state))
    n_trainable = sum(p.requires_grad for p in model.parameters())
    assert sum(counts) == n_trainable


def _groups_worker(rank, world_size, device, opt_name):
    """Param groups with their own lr, a frozen parameter, several steps; then state_dict round trip."""
    torch.manual_seed(0)
    model = ToyModel().to(device)
    ref_model = copy.deepcopy(model)
    opt_cls, kwargs = OPTIMIZERS[opt_name]

    def groups(m):
        params = [p for p in m.parameters()]
        return [{"params": params[:1], "lr": kwargs["lr"] * 0.5}, {"params": params[1:]}]

    ref_opt = opt_cls(groups(ref_model), **kwargs)
    sharded_opt = ShardedOptimizer(groups(model), opt_cls, **kwargs)
    assert len(sharded_opt.param_groups) == 2 and sharded_opt.param_groups[0]["lr"] == kwargs["lr"] * 0.5
    gen = torch.Generator().manual_seed(7)
    batches = [(torch.rand(16, 10, generator=gen), torch.rand(16, 5, generator=gen)) for _ in range(8)]
    for x, y in batches[:5]:
        _train_step(model, sharded_opt, x.to(device), y.to(device))
        _train_step(ref_model, ref_opt, x.to(device), y.to(device))
    _assert_same_params(ref_model, model)

    # The consolidated state_dict is the unsharded optimizer's state_dict.
    sd = sharded_opt.state_dict()
    ref_sd = ref_opt.state_dict()
    _assert_state_dicts_equal(sd, ref_sd)

    # Round trip: a fresh ShardedOptimizer loaded from it continues exactly like the reference.
    resumed_model = copy.deepcopy(model)
    resumed = ShardedOptimizer(groups(resumed_model), opt_cls, **kwargs)
    resumed.load_state_dict(sd)
    _assert_state_dicts_equal(resumed.state_dict(), ref_sd)
    # An LR change on the outer groups (what a scheduler does) reaches the local optimizer.
    for opt in (resumed, ref_opt):
        opt.param_groups[1]["lr"] = kwargs["lr"] * 0.25
    for x, y in batches[5:]:
        _train_step(resumed_model, resumed, x.to(device), y.to(device))
        _train_step(ref_model, ref_opt, x.to(device), y.to(device))
    _assert_same_params(ref_model, resumed_model)

    # And an unsharded optimizer can load the sharded one's checkpoint.
    plain_model = copy.deepcopy(resumed_model)
    plain = opt_cls(groups(plain_model), **kwargs)
    plain.load_state_dict(resumed.state_dict())
    _assert_state_dicts_equal(plain.state_dict(), ref_opt.state_dict())


def _assert_state_dicts_equal(a: dict, b: dict) -> None:
    assert sorted(a["state"]) == sorted(b["state"])
    for i in a["state"]:
        sa, sb = a["state"][i], b["state"][i]
        assert sorted(sa) == sorted(sb)
        for k in sa:
            if isinstance(sb[k], torch.Tensor):
                assert torch.equal(sa[k].cpu(), sb[k].cpu()), (i, k)
            else:
                assert sa[k] == sb[k], (i, k)
    assert len(a["param_groups"]) == len(b["param_groups"])
    for ga, gb in zip(a["param_groups"], b["param_groups"], strict=True):
        assert ga == gb


def _add_param_group_worker(rank, world_size, device):
    """Unfreezing layers mid-training: the new group is assigned and stepped like the reference's."""
    torch.manual_seed(3)
    model = ToyModelWithTiedWeights().to(device)
    ref_model = copy.deepcopy(model)
    kwargs = dict(lr=0.02, weight_decay=0.05)

    def head(m):
        return [m.fc1.weight, m.fc2.weight]

    def tail(m):
        return [m.fc3.weight, m.fc5.weight]

    for m in (model, ref_model):
        for p in tail(m):
            p.requires_grad_(False)
    ref_opt = torch.optim.AdamW(head(ref_model), **kwargs)
    sharded_opt = ShardedOptimizer(head(model), torch.optim.AdamW, **kwargs)
    gen = torch.Generator().manual_seed(11)
    for step in range(6):
        if step == 3:
            for m, opt in ((model, sharded_opt), (ref_model, ref_opt)):
                for p in tail(m):
                    p.requires_grad_(True)
                opt.add_param_group({"params": tail(m), "lr": 0.01})
        x, y = torch.rand(8, 10, generator=gen).to(device), torch.rand(8, 5, generator=gen).to(device)
        _train_step(model, sharded_opt, x, y)
        _train_step(ref_model, ref_opt, x, y)
        _assert_same_params(ref_model, model)
    assert len(sharded_opt.param_groups) == 2 == len(sharded_opt.inner.param_groups)
    # zero_grad reaches every parameter, including those another rank owns.
    sharded_opt.zero_grad(set_to_none=True)
    assert all(p.grad is None for p in model.parameters())


def _balance_worker(rank, world_size, device):
    """Greedy largest-first assignment: ranks differ by at most one (largest) tensor; sizes not divisible."""
    sizes = [7, 1000, 13, 999, 501, 500, 3, 250, 249, 1]
    params = [nn.Parameter(torch.full((n,), float(i), device=device)) for i, n in enumerate(sizes)]
    opt = ShardedOptimizer(params, torch.optim.SGD, lr=0.1)
    loads = opt.rank_bytes
    assert sum(loads) == 4 * sum(sizes)
    assert max(loads) - min(loads) <= 4 * max(sizes)
    assert sorted({opt.owner_of(p) for p in params}) == list(range(world_size))
    # Each rank perturbs only its own copy of every gradient: the owner's update must win everywhere.
    for i, p in enumerate(params):
        p.grad = torch.full_like(p, float(i + 1) * (1 + rank))
    opt.step()
    for i, p in enumerate(params):
        owner = opt.owner_of(p)
        expected = torch.full_like(p, float(i) - 0.1 * (i + 1) * (1 + owner))
        torch.testing.assert_close(p.detach(), expected, rtol=1e-6, atol=1e-6)  # the ranks differ by >= 0.1
    # A consolidated state dict and a reload on a different partition also work with SGD (stateless).
    sd = opt.state_dict()
    assert len(sd["param_groups"]) == 1 and sd["param_groups"][0]["params"] == list(range(len(sizes)))


def _world3_worker(rank, world_size, device):
    """World size 3 (more ranks than convenient, uneven shards) still equals the unsharded optimizer."""
    torch.set_num_threads(1)
    torch.manual_seed(5)
    model = ToyModel().to(device)
    ref_model = copy.deepcopy(model)
    kwargs = dict(lr=0.05, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), **kwargs)
    sharded_opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, bucket_size_mb=1e-3, **kwargs)
    for _ in range(5):
        x, y = torch.rand(8, 10, device=device), torch.rand(8, 5, device=device)
        _train_step(model, sharded_opt, x, y)
        _train_step(ref_model, ref_opt, x, y)
    _assert_same_params(ref_model, model)
    _assert_state_dicts_equal(sharded_opt.state_dict(), ref_opt.state_dict())


# ------------------------------------------------------------------------------------------------
# Tests
# ------------------------------------------------------------------------------------------------


def _all_ws2_worker(rank, world_size, device):
    # One process group for every world-size-2 scenario: spawning costs more than the checks.
    torch.set_num_threads(1)  # two ranks on a 2-core CI box: more threads only oversubscribe
    for model_name in sorted(MODELS):
        _official_semantics_worker(rank, world_size, device, model_name)
    for opt_name in ("sgd_momentum", "basics_adamw"):
        _groups_worker(rank, world_size, device, opt_name)
    _add_param_group_worker(rank, world_size, device)
    _balance_worker(rank, world_size, device)


def test_world_size_2_official_semantics_groups_state_dict_add_group_balance():
    """Official semantics (both toy models, torch AdamW, rtol 1e-7 and bitwise), param groups with SGD
    momentum and the basics AdamW, state_dict round trips, add_param_group mid-training, balance."""
    spawn(_all_ws2_worker, 2)


def test_world_size_3():
    spawn(_world3_worker, 3)


def test_needs_a_process_group():
    with pytest.raises(RuntimeError, match="process group"):
        ShardedOptimizer([nn.Parameter(torch.zeros(3))], torch.optim.SGD, lr=0.1)


@pytest.mark.gpu
def test_gloo_on_cuda_tensors():
    """The official suite's setting on a GPU machine: gloo on CUDA tensors."""
    spawn(_all_ws2_worker, 2, gloo_on_cuda=True)


@pytest.mark.multigpu
def test_nccl():
    spawn(_all_ws2_worker, 2, backend="nccl")
