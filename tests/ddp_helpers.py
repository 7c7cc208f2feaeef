"""Shared helpers of the DDP tests: the official toy models and the single-process reference.

`ToyModel` and `ToyModelWithTiedWeights` follow the official harness (HANDOUT_SPEC 3.1) exactly: a
frozen bias, a fixed no-grad parameter, and fc4.weight tied to fc2.weight. The spawned workers of
the tests live in test modules; everything they share lives here.
"""

from __future__ import annotations

import multiprocessing

import torch
import torch.distributed as dist
from torch import nn

from cs336_systems.distributed.process_group import spawn

# Workers are forked from a single-threaded server that imported these once (~0.1 s per launch instead
# of a fresh interpreter importing torch for every rank of every test).
multiprocessing.set_forkserver_preload(
    ["torch", "torch.distributed", "cs336_systems.distributed", "ddp_helpers"]
)


def spawn_workers(fn, world_size: int, *args, timeout_s: float = 60.0, **kwargs) -> None:
    """`process_group.spawn` (gloo on CPU unless kwargs say otherwise), through the forkserver."""
    spawn(fn, world_size, *args, timeout_s=timeout_s, start_method="forkserver", **kwargs)


class _FC2(nn.Module):
    """The wrapper around fc2 in the official ToyModel (its bias is frozen)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(10, 50, bias=True)
        self.fc.bias.requires_grad = False

    def forward(self, x):
        return self.fc(x)


class ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(10, 10, bias=False)
        self.fc2 = _FC2()
        self.fc3 = nn.Linear(50, 5, bias=False)
        self.relu = nn.ReLU()
        self.no_grad_fixed_param = nn.Parameter(torch.tensor([2.0, 2.0]), requires_grad=False)

    def forward(self, x):
        x = self.relu(self.fc1(x))
        x = self.relu(self.fc2(x))
        return self.fc3(x)


class ToyModelWithTiedWeights(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(10, 10, bias=False)
        self.fc2 = nn.Linear(10, 50, bias=False)
        self.fc3 = nn.Linear(50, 10, bias=False)
        self.fc4 = nn.Linear(10, 50, bias=False)
        self.fc5 = nn.Linear(50, 5, bias=False)
        self.fc4.weight = self.fc2.weight
        self.relu = nn.ReLU()

    def forward(self, x):
        x = self.relu(self.fc1(x))
        x = self.relu(self.fc2(x))
        x = self.relu(self.fc3(x))
        x = self.relu(self.fc4(x))
        return self.fc5(x)


class BranchyModel(nn.Module):
    """A model whose `extra` layer is used only when asked (a parameter without a gradient)."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(10, 10, bias=False)
        self.extra = nn.Linear(10, 10, bias=True)
        self.fc2 = nn.Linear(10, 5, bias=False)

    def forward(self, x, use_extra: bool = True):
        x = torch.relu(self.fc1(x))
        if use_extra:
            x = x + self.extra(x)
        return self.fc2(x)


MODELS = {"ToyModel": ToyModel, "ToyModelWithTiedWeights": ToyModelWithTiedWeights}


def fixture_data(n: int = 20, seed: int = 1234) -> tuple[torch.Tensor, torch.Tensor]:
    """Stand-in for the official fixtures: float32 inputs (n, 10) and targets (n, 5)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 10, generator=g), torch.randn(n, 5, generator=g)


def shard(t: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    per_rank = t.shape[0] // world_size
    return t[rank * per_rank : (rank + 1) * per_rank]


def assert_same_across_ranks(module: nn.Module) -> None:
    """Every state tensor of `module` is identical on all ranks (the official validate_ddp_net_equivalence)."""
    world = dist.get_world_size()
    for name, t in module.state_dict().items():
        gathered = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(gathered, t)
        for r, other in enumerate(gathered):
            assert torch.allclose(other, t), f"{name} differs between this rank and rank {r}"
