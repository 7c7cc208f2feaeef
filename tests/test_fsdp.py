"""FSDP on CPU with gloo: sharded training equals single-process training of the same model.

Reproduces the official 2026 test semantics (ToyFSDPModel from the project's Embedding / RMSNorm /
Linear, SGD lr 0.01, 3 steps, fp32 bitwise and fp16 within 1e-4 of a reference that casts the
Linear/Embedding weights to fp16 for compute; gradient-sync shapes and dtypes), then goes further:
the project's AdamW, torch.nn Linear (with bias) and Embedding, tied and frozen weights, the bounded
working set of gathered weights, and world size 3 (padded shards). Workers are module-level.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from cs336_systems.distributed import FSDP
from cs336_systems.distributed.process_group import spawn
from cs336_systems.model import AdamW, Embedding, Linear, RMSNorm
from cs336_systems.studies.distributed.fsdp_parity import D_FF, D_MODEL, VOCAB, ToyFSDPModel

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(180)]


class TorchNNTiedModel(nn.Module):
    """torch.nn Embedding and Linear (with bias), lm_head tied to the embedding, one frozen linear."""

    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, D_MODEL)
        self.norm = RMSNorm(D_MODEL)
        self.up = nn.Linear(D_MODEL, D_FF)
        self.frozen = nn.Linear(D_FF, D_FF, bias=False)
        self.frozen.weight.requires_grad_(False)
        self.down = nn.Linear(D_FF, D_MODEL)
        self.lm_head = nn.Linear(D_MODEL, VOCAB, bias=False)
        self.lm_head.weight = self.embedding.weight

    def forward(self, token_ids):
        x = self.norm(self.embedding(token_ids))
        x = F.relu(self.frozen(F.relu(self.up(x))))
        return self.lm_head(self.down(x))


def _cast_weights_for_compute(model: nn.Module, dtype: torch.dtype) -> None:
    """The reference's mixed precision: Linear/Embedding weights (and biases) cast to `dtype` for compute.

    The cast is part of the autograd graph, so gradients reach the fp32 masters as fp32.
    """

    def pre(module, args):
        module._masters = {
            k: module._parameters[k] for k in ("weight", "bias") if module._parameters.get(k) is not None
        }
        for k, p in module._masters.items():
            module._parameters[k] = p.to(dtype)
        if isinstance(module, (Linear, nn.Linear)):
            return tuple(a.to(dtype) if a.is_floating_point() else a for a in args)
        return None

    def post(module, args, output):
        module._parameters.update(module._masters)
        del module._masters

    for m in model.modules():
        if isinstance(m, (Linear, nn.Linear, Embedding, nn.Embedding)):
            m.register_forward_pre_hook(pre)
            m.register_forward_hook(post)


def _data(num_rows: int):
    torch.manual_seed(123)
    return torch.randint(0, VOCAB, (num_rows, 8)), torch.randint(0, VOCAB, (num_rows,))


def _assert_params(fsdp: FSDP, ref: nn.Module, *, exact: bool, atol: float, rtol: float) -> None:
    full = fsdp.gather_full_params()
    for name, p in ref.named_parameters():
        assert name in full, f"{name} missing from gather_full_params()"
        got = full[name]
        assert got.shape == p.shape and got.dtype == torch.float32, name
        if exact:
            assert torch.equal(got, p.detach()), f"{name}: max diff {(got - p).abs().max().item():.3g}"
        else:
            torch.testing.assert_close(got, p.detach(), atol=atol, rtol=rtol, msg=name)


def _train_and_compare(
    rank, world_size, device, model_cls, compute_dtype, make_opt, *, reference, atol=0.0, rtol=0.0, steps=3
):
    """The official correctness flow; returns the FSDP wrapper for further checks.

    reference="full": the official reference, one process training on all rows at once. A weight
    gradient sums the batch rows; one process sums all of them in the kernel's order, data parallelism
    sums each rank's half and then the halves, so fp32 agreement is to round-off (a few hundred
    elements differ by about one fp32 epsilon after 3 steps). torch's own FSDP2 and DDP differ in
    exactly the same elements by exactly the same amounts: tests/test_fsdp_parity.py.
    reference="microbatch": one process accumulating the same per-rank mean-loss gradients in rank
    order and dividing by the world size, i.e. exactly FSDP's arithmetic; FSDP must then match it
    bitwise (exact communication, no extra rounding), in fp32 and with 16-bit compute.
    """
    torch.manual_seed(42)
    base = model_cls().to(device)
    ref = copy.deepcopy(base)
    if compute_dtype is not None:
        _cast_weights_for_compute(ref, compute_dtype)
    fsdp = FSDP(copy.deepcopy(base), compute_dtype)
    ref_opt, opt = make_opt(ref.parameters()), make_opt(fsdp.parameters())
    rows = 10 * world_size
    inputs, labels = _data(rows)
    inputs, labels = inputs.to(device), labels.to(device)
    loss_fn = nn.CrossEntropyLoss()
    per = rows // world_size
    for step in range(steps):
        ref_opt.zero_grad()
        if reference == "full":
            loss_fn(ref(inputs)[:, -1, :].float(), labels).backward()
        else:
            for r in range(world_size):
                loss_fn(
                    ref(inputs[r * per : (r + 1) * per])[:, -1, :].float(), labels[r * per : (r + 1) * per]
                ).backward()
            for p in ref.parameters():
                if p.grad is not None:
                    p.grad.div_(world_size)
        ref_opt.step()

        opt.zero_grad()
        lo, hi = rank * per, (rank + 1) * per
        loss_fn(fsdp(inputs[lo:hi])[:, -1, :].float(), labels[lo:hi]).backward()
        fsdp.finish_gradient_synchronization()
        opt.step()
        _assert_params(fsdp, ref, exact=reference == "microbatch", atol=atol, rtol=rtol)

        torch.manual_seed(42 + step)
        perm = torch.randperm(rows, device=device)
        inputs, labels = inputs[perm], labels[perm]
    return fsdp


def _gradient_sync_check(rank, world_size, device, model_cls, compute_dtype):
    """Official gradient_sync semantics: shard-shaped fp32 grads; replicated grads equal on every rank."""
    torch.manual_seed(42)
    fsdp = FSDP(model_cls().to(device), compute_dtype)
    torch.manual_seed(rank)
    fsdp(torch.randint(0, VOCAB, (4, 8), device=device)).sum().backward()
    fsdp.finish_gradient_synchronization()
    sharded_ids = {id(sp.shard) for sp in fsdp.sharded_params}
    for name, p in fsdp.module.named_parameters():
        if not p.requires_grad:
            assert p.grad is None, name
            continue
        assert p.grad is not None, name
        assert p.grad.shape == p.data.shape and p.grad.dtype == p.data.dtype == torch.float32, name
        if id(p) not in sharded_ids:
            gathered = [torch.empty_like(p.grad) for _ in range(world_size)]
            dist.all_gather(gathered, p.grad)
            assert all(torch.equal(g, gathered[0]) for g in gathered), f"{name} grads differ across ranks"
    owner = {
        type(m)
        for m in fsdp.module.modules()
        if any(id(q) in sharded_ids for q in m.parameters(recurse=False))
    }
    assert owner <= {Linear, Embedding, nn.Linear, nn.Embedding}


def _sgd(params):
    return torch.optim.SGD(params, lr=0.01)


def _adamw(params):
    return AdamW(params, lr=1e-3, weight_decay=0.01)


# The official tolerances (fp32: atol 1e-6, rtol 1e-4; fp16: 1e-4) and a tighter one for fp32.
FP32_TOL = dict(atol=1e-7, rtol=1e-5)
FP16_TOL = dict(atol=1e-4, rtol=1e-4)


def _ws2_worker(rank, world_size, device):
    torch.set_num_threads(1)  # two ranks on a 2-core CI box
    torch.use_deterministic_algorithms(True)
    # Official correctness semantics against full-batch training: fp32 and fp16 compute.
    fsdp = _train_and_compare(
        rank, world_size, device, ToyFSDPModel, None, _sgd, reference="full", **FP32_TOL
    )
    # Gathered weights are freed after use: at most two units (current + prefetched) are ever alive.
    assert fsdp.live_unsharded.peak["forward"] <= 2 and fsdp.live_unsharded.peak["backward"] <= 2
    assert fsdp.live_unsharded.now == 0
    # Shards are 1-D (S,) fp32 parameters, about 1/N of each weight.
    for sp in fsdp.sharded_params:
        assert sp.shard.shape == (-(-sp.numel // world_size),) and sp.shard.dtype == torch.float32
    _train_and_compare(
        rank, world_size, device, ToyFSDPModel, torch.float16, _sgd, reference="full", **FP16_TOL
    )
    # Bitwise against the same arithmetic done in one process: SGD and the project's AdamW, fp32 and fp16.
    for dtype in (None, torch.float16):
        for make_opt in (_sgd, _adamw):
            _train_and_compare(
                rank, world_size, device, ToyFSDPModel, dtype, make_opt, reference="microbatch"
            )
    # torch.nn classes, a bias, a tied embedding / lm_head, a frozen weight.
    _train_and_compare(rank, world_size, device, TorchNNTiedModel, None, _adamw, reference="microbatch")
    _train_and_compare(
        rank, world_size, device, TorchNNTiedModel, torch.float16, _sgd, reference="microbatch"
    )
    for dtype in (None, torch.float16):
        _gradient_sync_check(rank, world_size, device, ToyFSDPModel, dtype)
    _gradient_sync_check(rank, world_size, device, TorchNNTiedModel, torch.float16)
    _inference_check(rank, world_size, device)


def _inference_check(rank, world_size, device):
    """Forward under no_grad (no graph, no saved weights) is bitwise the unsharded model's, and frees everything."""
    torch.manual_seed(42)
    base = TorchNNTiedModel().to(device)
    fsdp = FSDP(copy.deepcopy(base))
    x = torch.randint(0, VOCAB, (3, 8), device=device)
    with torch.no_grad():
        assert torch.equal(fsdp(x), base(x))
        assert torch.equal(fsdp(x), base(x))  # the second call prefetches in the recorded order
    assert fsdp.live_unsharded.now == 0 and all(sp.shard.grad is None for sp in fsdp.sharded_params)


def _ws3_worker(rank, world_size, device):
    torch.set_num_threads(1)
    # 6400 and 8192 are not multiples of 3: the last shard is padded. gloo's three-way sum need not add
    # in rank order, so even the microbatch reference agrees to round-off only.
    fsdp = _train_and_compare(
        rank, world_size, device, ToyFSDPModel, None, _adamw, reference="full", **FP32_TOL
    )
    assert any(sp.padded_numel > sp.numel for sp in fsdp.sharded_params)
    for sp in fsdp.sharded_params:  # the padding stays zero through training
        start = rank * sp.shard_numel
        pad_from = max(0, sp.numel - start)
        assert torch.count_nonzero(sp.shard.detach()[pad_from:]) == 0
    _gradient_sync_check(rank, world_size, device, ToyFSDPModel, torch.float16)


def test_fsdp_world_size_2():
    """Official correctness and gradient-sync semantics; bitwise vs microbatch reference; torch.nn, tied, frozen."""
    spawn(_ws2_worker, 2)


def test_fsdp_world_size_3_padded_shards():
    spawn(_ws3_worker, 3)


def test_fsdp_needs_a_process_group():
    with pytest.raises(RuntimeError, match="process group"):
        FSDP(ToyFSDPModel())


# ------------------------------------------------------------------------------------------------
# The all-gather timing analysis of fsdp_bench on a synthetic profiler trace
# ------------------------------------------------------------------------------------------------


def _synthetic_gpu_trace() -> dict:
    """Two forward all-gathers: w0 ends before the compute stream is free (slack +5 us), w1 after (-190 us)."""

    def rng(name, ts, dur):
        return {"name": name, "cat": "user_annotation", "ph": "X", "ts": ts, "dur": dur, "pid": 1, "tid": 1}

    def launch(ts, corr):
        return {
            "name": "cudaLaunchKernel",
            "cat": "cuda_runtime",
            "ph": "X",
            "ts": ts,
            "dur": 1,
            "pid": 1,
            "tid": 1,
            "args": {"correlation": corr},
        }

    def kernel(name, ts, dur, stream, corr):
        return {
            "name": name,
            "cat": "kernel",
            "ph": "X",
            "ts": ts,
            "dur": dur,
            "pid": 0,
            "tid": stream,
            "args": {"stream": stream, "correlation": corr},
        }

    return {
        "traceEvents": [
            rng("fsdp_bench::forward", 0, 1000),
            launch(5, 10),
            kernel("ampere_sgemm_128x64_nn", 0, 125, 3, 10),
            rng("fsdp::all_gather::w0", 10, 10),
            launch(15, 1),
            kernel("ncclDevKernel_AllGather_RING_LL(x)", 20, 100, 7, 1),
            rng("fsdp::all_gather::w1", 30, 10),
            launch(35, 2),
            kernel("ncclDevKernel_AllGather_RING_LL(x)", 120, 300, 7, 2),
            rng("fsdp::wait_all_gather::w0", 50, 2),
            rng("fsdp::forward::l0", 55, 20),
            launch(60, 3),
            kernel("ampere_sgemm_128x64_nn", 130, 100, 3, 3),
            rng("fsdp::wait_all_gather::w1", 80, 2),
            rng("fsdp::forward::l1", 85, 20),
            launch(90, 4),
            kernel("ampere_sgemm_128x64_nn", 420, 50, 3, 4),
            {"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "host"}},
        ]
    }


def test_allgather_timing_on_a_synthetic_gpu_trace():
    from cs336_systems.studies.distributed.fsdp_trace import allgather_timing, compact_trace, plot_timeline

    compact = compact_trace(_synthetic_gpu_trace())
    kernels = [e for e in compact["traceEvents"] if e.get("cat") == "kernel"]
    assert {k["args"]["range"] for k in kernels} == {
        "",
        "fsdp::all_gather::w0",
        "fsdp::all_gather::w1",
        "fsdp::forward::l0",
        "fsdp::forward::l1",
    }
    t = allgather_timing(compact).set_index("weight")
    assert list(t.phase) == ["forward", "forward"]
    assert t.loc["w0", "slack_us"] == 5 and t.loc["w0", "lead_us"] == 10 and t.loc["w0", "gather_us"] == 100
    assert t.loc["w1", "slack_us"] == -190 and t.loc["w1", "lead_us"] == 0
    plot_timeline(compact)  # renders without error
    plot_timeline(compact, zoom_waits=1)  # the zoom ends at the second wait's consumer


def test_fsdp_timeline_bars_rows_and_colours():
    from cs336_systems.studies.distributed.fsdp_trace import compact_trace, timeline_bars

    bars = timeline_bars(compact_trace(_synthetic_gpu_trace()))
    assert sorted(bars.row.unique()) == ["NCCL stream 7", "compute stream 3"]
    assert set(bars[bars.row == "NCCL stream 7"].category) == {"all_gather"}
    assert set(bars[bars.row == "compute stream 3"].category) == {"other"}
    cpu = {
        "traceEvents": [e for e in _synthetic_gpu_trace()["traceEvents"] if e.get("cat") == "user_annotation"]
    }
    cpu_bars = timeline_bars(cpu)  # the host ranges are the rows; fsdp_bench::forward is none of them
    assert sorted(cpu_bars.row) == ["compute (unit forward)"] * 2 + ["waiting for all-gather"] * 2
    assert list(cpu_bars[cpu_bars.row == "waiting for all-gather"].category) == ["all_gather"] * 2


def test_allgather_timing_on_a_cpu_trace_is_the_blocked_wait():
    from cs336_systems.studies.distributed.fsdp_trace import allgather_timing

    trace = {
        "traceEvents": [e for e in _synthetic_gpu_trace()["traceEvents"] if e.get("cat") == "user_annotation"]
    }
    t = allgather_timing(trace)
    assert list(t.slack_us) == [-2.0, -2.0] and t.gather_us.isna().all()


# ------------------------------------------------------------------------------------------------
# GPU host: the official tests' setting (gloo on CUDA tensors) and the benchmarks' (NCCL)
# ------------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_fsdp_gloo_on_cuda_tensors():
    """As the official suite runs on a GPU machine: gloo collectives on CUDA tensors (ranks may share a GPU)."""
    spawn(_ws2_worker, 2, gloo_on_cuda=True)


@pytest.mark.multigpu
def test_fsdp_nccl():
    """The NCCL path (single-tensor all-gather / reduce-scatter) used by the benchmarks."""
    spawn(_ws2_worker, 2, backend="nccl")
