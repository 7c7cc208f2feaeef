"""DDP wrappers (naive, flat, overlapped per-parameter, bucketed) on CPU with gloo, several processes.

Each distributed test spawns one process group (`process_group.spawn`, a free port per test) and runs
several cases inside it to stay within the CI budget. The reference is always single-process training
of the same model on the union of the ranks' batches; the official 2025 flow (different init per
rank, broadcast check, allclose after every step, reshuffle) is reproduced through tests/adapters.py.
"""

from __future__ import annotations

import copy
import datetime
import math

import adapters
import pytest
import torch
import torch.distributed as dist
from ddp_helpers import (
    MODELS,
    BranchyModel,
    ToyModel,
    ToyModelWithTiedWeights,
    assert_same_across_ranks,
    fixture_data,
    shard,
    spawn_workers,
)
from torch import nn

from cs336_systems.distributed import DDPBucketed, DDPIndividualParameters, FlatDDP, NaiveDDP
from cs336_systems.distributed.ddp import plan_buckets
from cs336_systems.distributed.process_group import free_port

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(120)]

VARIANTS = {
    "naive": NaiveDDP,
    "flat": FlatDDP,
    "overlap": DDPIndividualParameters,
    "bucketed-None": lambda m, **kw: DDPBucketed(m, None, **kw),
    "bucketed-0.0016": lambda m, **kw: DDPBucketed(m, 0.0016, **kw),
    "bucketed-0.003": lambda m, **kw: DDPBucketed(m, 0.003, **kw),
}
# Buckets per model for each size (MB = 2**20 B; fc tensors of 400/1000/2000 B): one bucket, several
# with two tensors each, one tensor per bucket.
EXPECTED_BUCKETS = {
    "bucketed-None": {"ToyModel": 1, "ToyModelWithTiedWeights": 1},
    "bucketed-0.0016": {"ToyModel": 3, "ToyModelWithTiedWeights": 4},
    "bucketed-0.003": {"ToyModel": 2, "ToyModelWithTiedWeights": 2},
}


# ----------------------------------------------------------------------------------------------------
# Workers (module level: spawned processes import them)
# ----------------------------------------------------------------------------------------------------


def _official_flow(rank, world_size, device, kind, bucket_size_mb):
    """The official test_ddp_individual_parameters.py / test_ddp.py flow, through tests/adapters.py."""
    torch.set_num_threads(1)
    for model_class in (ToyModel, ToyModelWithTiedWeights):
        torch.manual_seed(rank)  # different initial weights on every rank
        non_parallel = model_class().to(device)
        if kind == "individual":
            ddp_model = adapters.get_ddp_individual_parameters(copy.deepcopy(non_parallel))
            on_after_backward = adapters.ddp_individual_parameters_on_after_backward
            on_batch_start = None
        else:
            ddp_model = adapters.get_ddp_bucketed(copy.deepcopy(non_parallel), bucket_size_mb)
            on_after_backward = adapters.ddp_bucketed_on_after_backward
            on_batch_start = adapters.ddp_bucketed_on_train_batch_start
        pairs = list(zip(non_parallel.named_parameters(), ddp_model.named_parameters(), strict=True))
        for (name, p_ref), (_, p_ddp) in pairs:
            if rank == 0 or "no_grad_fixed_param" in name:
                assert torch.allclose(p_ref, p_ddp), name
            else:  # rank 1 started from other weights: the constructor must have broadcast rank 0's
                assert not torch.allclose(p_ref, p_ddp), name
        assert_same_across_ranks(ddp_model.module)

        data, labels = fixture_data()
        data, labels = data.to(device), labels.to(device)
        loss_fn = nn.MSELoss()
        ref_opt = torch.optim.SGD(non_parallel.parameters(), lr=0.1)
        ddp_opt = torch.optim.SGD(ddp_model.parameters(), lr=0.1)
        for i in range(5):
            if on_batch_start is not None:
                on_batch_start(ddp_model=ddp_model, optimizer=ddp_opt)
            ref_opt.zero_grad()
            ddp_opt.zero_grad()
            loss_fn(non_parallel(data), labels).backward()
            ref_opt.step()
            loss_fn(ddp_model(shard(data, rank, world_size)), shard(labels, rank, world_size)).backward()
            on_after_backward(ddp_model=ddp_model, optimizer=ddp_opt)
            ddp_opt.step()
            if rank == 0:  # only rank 0 started from the reference's weights
                for (name, p_ref), (_, p_ddp) in zip(
                    non_parallel.named_parameters(), ddp_model.named_parameters()
                ):
                    if p_ref.requires_grad:
                        assert torch.allclose(p_ref, p_ddp), f"{model_class.__name__}.{name} step {i}"
                    else:
                        assert torch.equal(p_ref, p_ddp), f"frozen {name} changed"
            assert_same_across_ranks(ddp_model.module)
            torch.manual_seed(42 + i)
            perm = torch.randperm(data.shape[0])
            data, labels = data[perm.to(device)], labels[perm.to(device)]


def _train_and_compare(rank, world_size, device, variant, n_examples=20, steps=4):
    """One variant on both toy models: identical (broadcast) start, AdamW steps, allclose every step."""
    torch.set_num_threads(1)
    for model_name, model_class in MODELS.items():
        torch.manual_seed(rank)
        reference = model_class().to(device)
        ddp = VARIANTS[variant](copy.deepcopy(reference))
        with torch.no_grad():
            for p in reference.parameters():  # the single-process run starts from rank 0's weights too
                dist.broadcast(p, src=0)
        if variant in EXPECTED_BUCKETS:
            assert ddp.num_buckets == EXPECTED_BUCKETS[variant][model_name]
        x, y = (t.to(device) for t in fixture_data(n_examples))
        ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
        ddp_opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2, weight_decay=0.1)
        for step in range(steps):
            ref_opt.zero_grad(set_to_none=step % 2 == 0)  # both ways of zeroing (views stay valid)
            ddp_opt.zero_grad(set_to_none=step % 2 == 0)
            nn.functional.mse_loss(reference(x), y).backward()
            nn.functional.mse_loss(ddp(shard(x, rank, world_size)), shard(y, rank, world_size)).backward()
            ddp.finish_gradient_synchronization()
            for (name, p_ref), p_ddp in zip(reference.named_parameters(), ddp.module.parameters()):
                if p_ref.requires_grad:
                    torch.testing.assert_close(
                        p_ddp.grad, p_ref.grad, msg=f"{variant} {model_name}.{name} grad"
                    )
                else:
                    assert p_ddp.grad is None
            ref_opt.step()
            ddp_opt.step()
            for (name, p_ref), p_ddp in zip(reference.named_parameters(), ddp.module.parameters()):
                torch.testing.assert_close(p_ddp, p_ref, msg=f"{variant} {model_name}.{name} step {step}")
        assert_same_across_ranks(ddp.module)


class _CountCollectives:
    """Counts calls of dist.all_reduce (the variants resolve it at call time, so patching works)."""

    def __init__(self):
        self.calls = 0
        self._orig = dist.all_reduce

    def __enter__(self):
        def counting(*args, **kwargs):
            self.calls += 1
            return self._orig(*args, **kwargs)

        dist.all_reduce = counting
        return self

    def __exit__(self, *exc):
        dist.all_reduce = self._orig


def _no_sync_accumulation(rank, world_size, device):
    """2 micro-batches per step inside/outside no_sync() == one full-batch step; no comm in micro-steps."""
    torch.set_num_threads(1)
    for variant in VARIANTS:
        torch.manual_seed(0)
        reference = ToyModelWithTiedWeights()
        ddp = VARIANTS[variant](copy.deepcopy(reference))
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
        ddp_opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
        x, y = fixture_data()
        xl, yl = shard(x, rank, world_size), shard(y, rank, world_size)
        half = xl.shape[0] // 2
        for step in range(3):
            ref_opt.zero_grad()
            ddp_opt.zero_grad()
            nn.functional.mse_loss(reference(x), y).backward()
            with _CountCollectives() as counter, ddp.no_sync():
                (nn.functional.mse_loss(ddp(xl[:half]), yl[:half]) / 2).backward()
                ddp.finish_gradient_synchronization()  # a no-op inside no_sync
            assert counter.calls == 0, f"{variant}: communication inside no_sync()"
            if step == 2:  # last micro-step also under no_sync; the sync happens at finish
                with ddp.no_sync():
                    (nn.functional.mse_loss(ddp(xl[half:]), yl[half:]) / 2).backward()
            else:
                (nn.functional.mse_loss(ddp(xl[half:]), yl[half:]) / 2).backward()
            ddp.finish_gradient_synchronization()
            ref_opt.step()
            ddp_opt.step()
            for (name, p_ref), p_ddp in zip(reference.named_parameters(), ddp.module.parameters()):
                torch.testing.assert_close(p_ddp, p_ref, msg=f"{variant} no_sync {name} step {step}")


def _unused_parameters(rank, world_size, device):
    """A parameter used on rank 0 only (step 0), then on no rank (step 1), then everywhere (step 2)."""
    torch.set_num_threads(1)
    plan = [[r == 0 for r in range(world_size)], [False] * world_size, [True] * world_size]
    for variant in VARIANTS:
        for find_unused in (False, True):
            torch.manual_seed(0)
            reference = BranchyModel()
            ddp = VARIANTS[variant](copy.deepcopy(reference), find_unused_parameters=find_unused)
            ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, weight_decay=0.5)
            ddp_opt = torch.optim.SGD(ddp.parameters(), lr=0.1, weight_decay=0.5)
            x, y = fixture_data()
            for step, use in enumerate(plan):
                ref_opt.zero_grad()
                ddp_opt.zero_grad()
                # Single-process reference of the mean loss over the ranks' shards, each with its branch.
                ref_loss = sum(
                    nn.functional.mse_loss(
                        reference(shard(x, r, world_size), use_extra=use[r]), shard(y, r, world_size)
                    )
                    for r in range(world_size)
                )
                (ref_loss / world_size).backward()
                out = ddp(shard(x, rank, world_size), use_extra=use[rank])
                nn.functional.mse_loss(out, shard(y, rank, world_size)).backward()
                ddp.finish_gradient_synchronization()
                extra = ddp.module.extra.weight
                if not any(use):  # globally unused this step
                    assert reference.extra.weight.grad is None
                    if find_unused:
                        assert extra.grad is None, variant
                    else:
                        torch.testing.assert_close(extra.grad, torch.zeros_like(extra))
                        extra.grad = None  # documented difference; keep the trajectories comparable
                        ddp.module.extra.bias.grad = None
                for (name, p_ref), p_ddp in zip(reference.named_parameters(), ddp.module.parameters()):
                    if p_ref.grad is not None:
                        torch.testing.assert_close(
                            p_ddp.grad, p_ref.grad, msg=f"{variant} {name} step {step}"
                        )
                ref_opt.step()
                ddp_opt.step()
                for (name, p_ref), p_ddp in zip(reference.named_parameters(), ddp.module.parameters()):
                    torch.testing.assert_close(p_ddp, p_ref, msg=f"{variant} unused {name} step {step}")


def _larger_world(rank, world_size, device):
    for variant in ("naive", "flat", "overlap", "bucketed-0.0016"):
        _train_and_compare(rank, world_size, device, variant, n_examples=8 * world_size, steps=2)


# ----------------------------------------------------------------------------------------------------
# Tests
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "bucket_size_mb"),
    [("individual", None), ("bucketed", 0.0016), ("bucketed", 0.0001), ("bucketed", 0.01)],
)
def test_official_flow(kind, bucket_size_mb):
    spawn_workers(_official_flow, 2, kind, bucket_size_mb)


@pytest.mark.parametrize("variant", ["naive", "flat", "bucketed-None", "bucketed-0.003"])
def test_matches_single_process_training(variant):
    spawn_workers(_train_and_compare, 2, variant)


def test_no_sync_gradient_accumulation():
    spawn_workers(_no_sync_accumulation, 2)


def test_parameters_without_gradient():
    spawn_workers(_unused_parameters, 2)


def test_world_size_3():
    spawn_workers(_larger_world, 3)


@pytest.mark.multigpu
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_nccl_on_two_gpus(variant):
    spawn_workers(_train_and_compare, 2, variant, backend="nccl")


@pytest.mark.gpu
@pytest.mark.parametrize(("kind", "bucket_size_mb"), [("individual", None), ("bucketed", 0.0016)])
def test_official_flow_gloo_on_cuda_tensors(kind, bucket_size_mb):
    """What the official suite does on a GPU machine: gloo collectives on CUDA tensors."""
    spawn_workers(_official_flow, 2, kind, bucket_size_mb, gloo_on_cuda=True)


# ----------------------------------------------------------------------------------------------------
# Single-process tests (no spawn)
# ----------------------------------------------------------------------------------------------------


@pytest.fixture
def world_of_one():
    """An in-process gloo group of size 1 (DDP of one rank must equal plain training)."""
    dist.init_process_group(
        "gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{free_port()}",
        timeout=datetime.timedelta(seconds=30),
    )  # fmt: skip
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("cls", [NaiveDDP, FlatDDP, DDPIndividualParameters, DDPBucketed])
def test_needs_a_process_group(cls):
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="process group"):
        cls(ToyModel())


@pytest.mark.parametrize("bad", [0, -1.0, math.nan])
def test_bucket_size_must_be_positive(bad):
    with pytest.raises(ValueError, match="bucket_size_mb"):
        DDPBucketed(ToyModel(), bad)
    with pytest.raises(TypeError, match="bucket_size_mb"):
        DDPBucketed(ToyModel(), "10")


def test_bucket_plan_reverse_order_and_limits():
    tied = ToyModelWithTiedWeights()
    params = [p for p in tied.parameters() if p.requires_grad]  # fc1, fc2(=fc4), fc3, fc5
    assert len(params) == 4
    assert plan_buckets(params, None) == [[3, 2, 1, 0]]
    assert plan_buckets(params, 0.0016) == [[3], [2], [1], [0]]  # 1000, 2000, 2000, 400 B vs 1678 B
    assert plan_buckets(params, 0.003) == [[3, 2], [1, 0]]
    assert plan_buckets(params, 1e-9) == [[3], [2], [1], [0]]  # each tensor larger than the limit
    mixed = [torch.zeros(10), torch.zeros(10, dtype=torch.float64), torch.zeros(10)]
    assert plan_buckets(mixed, None) == [[2], [1], [0]]  # dtypes never share a bucket
    meta = [torch.empty(1000, device="meta"), torch.empty(1000, device="meta")]
    assert plan_buckets(meta, 4000 / 2**20) == [[1], [0]]


@pytest.mark.usefixtures("world_of_one")
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_world_of_one_is_plain_training(variant):
    torch.manual_seed(0)
    reference = ToyModelWithTiedWeights()
    ddp = VARIANTS[variant](copy.deepcopy(reference))
    x, y = fixture_data()
    nn.functional.mse_loss(reference(x), y).backward()
    nn.functional.mse_loss(ddp(x), y).backward()
    ddp.finish_gradient_synchronization()
    for p_ref, p_ddp in zip(reference.parameters(), ddp.module.parameters()):
        torch.testing.assert_close(p_ddp.grad, p_ref.grad)
    assert [n for n, _ in ddp.named_parameters()] == [f"module.{n}" for n, _ in reference.named_parameters()]
    assert ddp.state_dict().keys() == {f"module.{k}" for k in reference.state_dict()}  # nothing extra


@pytest.mark.usefixtures("world_of_one")
@pytest.mark.parametrize("variant", ["overlap", "bucketed-0.0016"])
def test_two_backwards_without_sync_is_an_error(variant):
    ddp = VARIANTS[variant](ToyModel())
    x, y = fixture_data()
    nn.functional.mse_loss(ddp(x), y).backward()
    with pytest.raises(RuntimeError, match="no_sync"):
        nn.functional.mse_loss(ddp(x), y).backward()
