"""Parking a training step off its device: a round trip changes nothing, and a parked step keeps
nothing where it was (checked on every tensor reachable from it, optimizer internals included).

CPU: park to a second host copy (new storages everywhere). GPU (`gpu` marker): compiled steps parked
in page-locked host memory (every reachable tensor on the host) and brought back, without a
recompilation.
"""

import dataclasses
from collections.abc import Iterator

import pytest
import torch
from torch import Tensor, nn

from cs336_systems.model import MODEL_SIZES, BasicsTransformerLM
from cs336_systems.model.loss import random_batch
from cs336_systems.studies.training.train_step import StockStep, timed_step
from cs336_systems.training import (
    FusedAdamW,
    Offloader,
    TrainStepConfig,
    build_train_step,
    offload,
    step_tensors,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PATHS = ["stock", "ours"]


def _build(path: str, device: str = "cpu", compile: bool = False):
    torch.manual_seed(0)
    model = BasicsTransformerLM.from_config(MODEL_SIZES["debug"], device=device)
    if path == "stock":
        return StockStep(model, compile=compile, lr=1e-2, weight_decay=0.1)
    attention = "flash_triton" if device == "cuda" else "sdpa"
    return build_train_step(model, TrainStepConfig.fastest(compile=compile, attention=attention, lr=1e-2))


def _run(step, num_steps: int, offloader: Offloader | None = None, device: str = "cpu") -> list[float]:
    """Loss of each step; with an offloader, the step is parked and brought back before every step."""
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(num_steps):
        x, y = random_batch(4, 32, MODEL_SIZES["debug"].vocab_size, device=device, generator=gen)
        if offloader is not None:
            offloader.park()
            offloader.unpark()
        losses.append(timed_step(step, x, y)[0].item())
    return losses


def _reachable(obj, seen: set[int] | None = None) -> Iterator[Tensor]:
    """Every tensor reachable from obj through modules, optimizers, containers and dataclasses."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, Tensor):
        yield obj
        if obj.grad is not None:
            yield from _reachable(obj.grad, seen)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _reachable(k, seen)
            yield from _reachable(v, seen)
    elif isinstance(obj, list | tuple | set):
        for v in obj:
            yield from _reachable(v, seen)
    elif (
        isinstance(obj, nn.Module | torch.optim.Optimizer)
        or dataclasses.is_dataclass(obj)
        or type(obj).__module__.startswith("cs336_systems")  # the step, its parts
    ):
        yield from _reachable(vars(obj), seen)


@pytest.mark.parametrize("path", PATHS)
def test_parking_between_steps_changes_nothing(path):
    plain, parked = _build(path), _build(path)
    off = Offloader(parked)
    assert _run(parked, 3, off) == _run(plain, 3)
    assert not off.parked
    for a, b in zip(step_tensors(parked), step_tensors(plain), strict=True):
        assert torch.equal(a, b)
    if path == "ours":  # the float32 parameters are views of the moved master buffer again
        opt = parked.optimizer
        assert isinstance(opt, FusedAdamW) and opt.master.numel() > 0
        norm = parked.model.ln_final.weight
        assert norm.untyped_storage().data_ptr() == opt.master.untyped_storage().data_ptr()
        assert opt.state[norm]["master"].data_ptr() == norm.data_ptr()


@pytest.mark.parametrize("path", PATHS)
def test_a_parked_step_keeps_nothing_where_it_was(path):
    step = _build(path)
    _run(step, 1)
    step.model.ln_final.weight.grad = torch.ones_like(step.model.ln_final.weight)  # gradients move too
    before = [t for t in _reachable(step) if t.numel()]
    kinds = {t.dtype for t in before}
    storages = [t.untyped_storage() for t in before]  # held: their addresses cannot be reused
    old = {s.data_ptr() for s in storages}
    off = Offloader(step)
    off.park()  # from the CPU to other host memory: every storage is new
    after = [t for t in _reachable(step) if t.numel()]
    assert len(after) >= len(step_tensors(step)) and {t.dtype for t in after} == kinds
    assert not [t.shape for t in after if t.untyped_storage().data_ptr() in old]
    off.unpark()
    assert not [t.shape for t in _reachable(step) if t.numel() and t.untyped_storage().data_ptr() in old]


def test_offloader_refuses_a_second_park_and_an_unpark_of_a_resident_step():
    off = Offloader(_build("stock"))
    with pytest.raises(RuntimeError, match="not parked"):
        off.unpark()
    with off.resident():
        assert not off.parked
    assert off.parked
    with pytest.raises(RuntimeError, match="already parked"):
        off.park()


def test_page_locked_buffers_are_reused_once_unviewed_and_unpinned_when_none_fits(monkeypatch):
    pinned: dict[int, int] = {}  # a stand-in for the CUDA runtime: address -> registered bytes

    class Runtime:
        def cudaHostRegister(self, ptr, size, flags):
            pinned[ptr] = size
            return 0

        def cudaHostUnregister(self, ptr):
            return 0 if pinned.pop(ptr, None) is not None else 1

    monkeypatch.setattr(torch.cuda, "cudart", Runtime)
    monkeypatch.setattr(offload, "_PINNED", [])
    monkeypatch.setattr(offload, "PINNED_GRANULE", 1024)
    a = offload._pinned_buffer(1000)  # rounded up to the granule, registered once
    assert a.numel() == 1000 and list(pinned.values()) == [1024]
    view = a[10:20]
    del a
    b = offload._pinned_buffer(900)  # the first is still viewed: a second one
    assert len(pinned) == 2 and b.data_ptr() != view.data_ptr() - 10
    del view
    c = offload._pinned_buffer(1010)  # the first is free and fits (sizes differ by a RoPE table)
    assert len(pinned) == 2 and c.data_ptr() in pinned
    del b
    d = offload._pinned_buffer(5000)  # nothing free fits: the free one is unpinned first
    assert sorted(pinned.values()) == [1024, 5120] and d.data_ptr() in pinned and c.data_ptr() in pinned


@pytest.mark.gpu
@pytest.mark.parametrize("path", PATHS)
def test_compiled_step_parked_in_pinned_host_memory_runs_on_without_recompiling_gpu(path):
    plain, parked = _build(path, "cuda", compile=True), _build(path, "cuda", compile=True)
    off = Offloader(parked)
    losses, ref = _run(parked, 2, device="cuda"), _run(plain, 2, device="cuda")
    resident = torch.cuda.memory_allocated()
    off.park()
    left = [tuple(t.shape) for t in _reachable(parked) if t.numel() and t.device.type != "cpu"]
    assert not left, f"tensors left on the GPU: {left}"
    # the moved storages are page-locked; small host tensors made afterwards (e.g. the fused AdamW's
    # launch tables, rebuilt on the new device) need not be
    assert all(t.is_pinned() for t in step_tensors(parked) if t.numel())
    assert torch.cuda.memory_allocated() < resident - sum(t.nbytes for t in step_tensors(parked)) // 2
    off.unpark()
    torch.compiler.set_stance("fail_on_recompile")  # guards on device, dtype, shape: all restored
    try:
        losses, ref = losses + _run(parked, 2, device="cuda"), ref + _run(plain, 2, device="cuda")
    finally:
        torch.compiler.set_stance("default")
    # the same steps; GPU attention backwards accumulate in a run-dependent order, hence not bit for bit
    torch.testing.assert_close(losses, ref, rtol=2e-3, atol=2e-3)
    torch.cuda.empty_cache()
