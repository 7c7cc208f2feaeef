"""Launchers for the FlashAttention-2 Triton kernels: validate -> pick tiles (tiles.py) -> allocate -> launch.

`flash_fwd(q, k, v, is_causal) -> (o, lse)` and `flash_bwd(do, q, k, v, o, lse, is_causal) -> (dq, dk, dv)`
take 3-D (B, N, d) or 4-D (B, H, N, d) tensors with any strides; they are viewed as (B, H, N, d)
without copies (the model's (B, T, H*d) -> (B, H, T, d) rearrange is read in place). Only a last
dimension that is not contiguous forces a copy. `o` is allocated with q's memory layout, so the
model's inverse rearrange stays a view.

Tile configurations (the heuristic table, pinning with `use_configs`, autotuning, the cache and the
shrink-and-retry on out-of-resources errors) live in `tiles.py`; the names are re-exported here.

fp32 inputs: tl.dot uses TF32 when `torch.get_float32_matmul_precision()` is "high"/"medium" and
3xTF32 ("tf32x3", near-fp32 accuracy) when it is "highest" (PyTorch's default), so our fp32 error
tracks PyTorch's.
"""

from __future__ import annotations

import math

import torch
import triton
from torch import Tensor

from cs336_systems.attention.flash_triton import (
    backward_dq_kernels,
    backward_kernels,
    buffer_kernels,
    hopper,
    hopper_configs,
    kernels,
    plans,
    tiles,
)
from cs336_systems.attention.flash_triton.tiles import (
    BwdConfig,
    FwdConfig,
    KernelOptions,
    bwd_candidates,
    fwd_candidates,
    heuristic_bwd,
    heuristic_fwd,
    interpreting,
    set_autotune,
    tuning_key,
    use_configs,
)
from cs336_systems.attention.inputs import check_attention_inputs

__all__ = [
    "BwdConfig",
    "FwdConfig",
    "KernelOptions",
    "bwd_candidates",
    "check_inputs",
    "flash_bwd",
    "flash_fwd",
    "fwd_candidates",
    "heuristic_bwd",
    "heuristic_fwd",
    "interpreting",
    "launch_bwd",
    "output_like",
    "prepare_backward",
    "set_autotune",
    "tuning_key",
    "use_configs",
    "use_tma",
]

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256


# ----------------------------------------------------------------------------------------------
# Layout helpers
# ----------------------------------------------------------------------------------------------


def _last_dim_contiguous(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def _as_4d(t: Tensor) -> Tensor:
    return t.unsqueeze(1) if t.ndim == 3 else t


def strides3(t4: Tensor) -> tuple[int, int, int]:
    """The (batch, head, row) strides of a (B, H, N, d) view: one kernel argument."""
    return t4.stride(0), t4.stride(1), t4.stride(2)


def output_like(t: Tensor) -> Tensor:
    """An uninitialised tensor shaped like t with a contiguous last dimension (t's layout if dense)."""
    if t.stride(-1) == 1 or t.shape[-1] == 1:
        return torch.empty_like(t)
    return torch.empty_like(t, memory_format=torch.contiguous_format)


def _empty_f32(shape: tuple[int, ...], like: Tensor) -> Tensor:
    """An uninitialised float32 tensor of `shape` on like's device (the logsumexp, Delta)."""
    return like.new_empty(shape, dtype=torch.float32)


def _tma_possible(device: torch.device, *tensors4: Tensor) -> bool:
    """Descriptors work on Hopper or newer (and in the interpreter) for aligned layouts."""
    if not tiles.tma_layout_ok(*tensors4):
        return False
    return interpreting() or (device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0))


def use_tma(options: KernelOptions, device: torch.device, *tensors4: Tensor) -> bool:
    """The memory path: TMA descriptors when the options allow them and the GPU and layouts can."""
    if options.use_tma is not None:
        return options.use_tma and _tma_possible(device, *tensors4)
    return not interpreting() and _tma_possible(device, *tensors4)


def _set_tma_allocator(device: torch.device) -> None:
    # The allocator is a ContextVar, so set it on the calling thread (autograd runs backward on its own).
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=device))


def check_inputs(q: Tensor, k: Tensor, v: Tensor) -> None:
    """Raise ValueError for inputs the kernels cannot take (shapes, dtypes, devices, interpreter limits)."""
    check_attention_inputs(
        q, k, v, dtypes=SUPPORTED_DTYPES, max_head_dim=MAX_HEAD_DIM, impl="FlashAttentionTriton"
    )
    if q.device.type != "cuda" and not interpreting():
        raise ValueError(
            f"FlashAttentionTriton: tensors are on {q.device}; the Triton kernels need CUDA tensors "
            "(or TRITON_INTERPRET=1 set before import to run them on the CPU)"
        )
    if q.dtype == torch.bfloat16 and interpreting():
        raise ValueError(
            "FlashAttentionTriton: bfloat16 is not supported under TRITON_INTERPRET=1 (the interpreter "
            "computes bf16 arithmetic wrongly); use float32/float16 on the CPU or run on a GPU"
        )


def _common(q4: Tensor, is_causal: bool, opts: KernelOptions) -> dict:
    """The constexpr arguments every forward/backward kernel takes."""
    d = q4.shape[-1]
    return dict(
        D=d,
        BLOCK_D=tiles.block_d(d),
        is_causal=bool(is_causal),
        SKIP_MASKED_TILES=opts.skip_masked_tiles,
        SPLIT_DIAGONAL=opts.split_diagonal,
        DOT_PRECISION=tiles.dot_precision(q4.dtype),
    )


def _can_tune(q: Tensor) -> bool:
    return q.is_cuda and not interpreting()


# ----------------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------------


def _fwd_launch(q4, k4, v4, o4, lse, is_causal, cfg: FwdConfig, opts: KernelOptions, tma: bool) -> None:
    batch, heads, n_q, d = q4.shape
    grid = (batch * heads, triton.cdiv(n_q, cfg.block_m))
    plans.launch(
        kernels.flash_fwd_kernel,
        grid,
        q4,
        k4,
        v4,
        o4,
        lse,
        strides3(q4),
        strides3(k4),
        strides3(v4),
        strides3(o4),
        (n_q, 1),
        heads,
        n_q,
        k4.shape[2],
        1.0 / math.sqrt(d),
        Q_TILE_SIZE=cfg.block_m,
        K_TILE_SIZE=cfg.block_n,
        USE_TMA=tma,
        **_common(q4, is_causal, opts),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )


_FWD_PLANS = plans.PlanCache()
_BWD_PLANS = plans.PlanCache()


def _fwd_operands(q: Tensor, k: Tensor, v: Tensor) -> dict[str, Tensor]:
    """The forward kernels' tensors by role: q, k, v (last dim made contiguous), o and lse (new)."""
    q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
    return {"q": q, "k": k, "v": v, "o": output_like(q), "lse": _empty_f32(q.shape[:-1], q)}


def _plan_key(kind: str, is_causal: bool, *tensors: Tensor) -> tuple:
    return (kind, bool(is_causal), tiles.dot_precision(tensors[0].dtype), tiles.plan_state(),
            *(plans.tensor_signature(t) for t in tensors))  # fmt: skip


def _run_planned(cache: plans.PlanCache, key: tuple, plan, full, operands: dict[str, Tensor], *args) -> None:
    """Replay `plan` (the cache's plan of `key`) on `operands`, or, if there is none, run
    full(operands, *args) while recording one."""
    if plan is not None:
        plan.run(operands)
        return
    state = tiles.plan_state()
    with plans.recording() as rec:
        full(operands, *args)
    if tiles.plan_state() == state:  # autotuning / a shrunk configuration changed the tile cache
        cache.keep(key, rec, operands["q"].device)


def flash_fwd(q: Tensor, k: Tensor, v: Tensor, is_causal: bool = False) -> tuple[Tensor, Tensor]:
    """Forward. q: (..., N_q, d), k, v: (..., N_k, d) -> o shaped like q, lse (..., N_q) float32 (natural log).

    The first call of each input signature checks the inputs, chooses kernels and tiles and records
    the launches; later ones replay them (`plans.py`)."""
    if not all(isinstance(t, Tensor) for t in (q, k, v)):
        check_inputs(q, k, v)  # raises the ValueError naming the problem
    key = _plan_key("fwd", is_causal, q, k, v)
    plan = _FWD_PLANS.get(key)
    if plan is None:
        check_inputs(q, k, v)
    ops = _fwd_operands(q, k, v)
    _run_planned(_FWD_PLANS, key, plan, _flash_fwd_full, ops, is_causal)
    return ops["o"], ops["lse"]


def _flash_fwd_full(ops: dict[str, Tensor], is_causal: bool) -> None:
    q4, k4, v4, o4 = (plans.role(name, _as_4d(ops[name])) for name in ("q", "k", "v", "o"))
    lse = plans.role("lse", ops["lse"])
    n_q, d = q4.shape[2:]
    n_k = k4.shape[2]
    opts = tiles.pinned_options()
    if hopper.use_hopper(opts.hopper, q4, k4, v4, o4):
        hopper.flash_fwd_hopper(q4, k4, v4, o4, lse, is_causal)
        return
    tma = use_tma(opts, q4.device, q4, k4, v4, o4)
    if tma:
        _set_tma_allocator(q4.device)
    tiles.choose_and_run(
        "fwd",
        tuning_key(n_q, n_k, d, q4.dtype, is_causal),
        lambda c: _fwd_launch(q4, k4, v4, o4, lse, is_causal, c, opts, tma),
        heuristic=lambda: heuristic_fwd(n_q, n_k, tiles.block_d(d), q4.dtype),
        candidates=lambda: fwd_candidates(tiles.block_d(d), q4.dtype),
        shrink=tiles.shrink_fwd,
        can_tune=_can_tune(q4),
    )


# ----------------------------------------------------------------------------------------------
# Backward
# ----------------------------------------------------------------------------------------------


def launch_bwd(
    tensors,
    is_causal,
    cfg: BwdConfig,
    opts: KernelOptions,
    tma: bool,
    passes: tuple[str, ...] = ("dkdv", "dq"),
) -> None:
    """Launch the backward passes (both, or one of them alone for `flash_bench --tune`) on the
    operands `prepare_backward` returns; tma: the memory path (see `use_tma`). With cfg.dq
    "atomic"/"reduce", the "dkdv" pass also computes dQ (into a zeroed float32 buffer, then cast
    into dq) and the "dq" pass runs only if "dkdv" is not among the passes."""
    q4, k4, v4, do4, dq4, dk4, dv4, lse, delta = tensors
    batch, heads, n_q, d = q4.shape
    n_k = k4.shape[2]
    common = _common(q4, is_causal, opts)
    ins = (q4, k4, v4, do4)
    in_strides = tuple(strides3(t) for t in ins)
    sizes = (heads, n_q, n_k, 1.0 / math.sqrt(d))  # NUM_HEADS, N_QUERIES, N_KEYS, scale
    dq_mode = tiles.DQ_MODES[cfg.dq] if "dkdv" in passes else 0
    if dq_mode == 2 and (not tma or interpreting()):
        dq_mode = 1  # TMA reductions need the TMA path on a GPU (the interpreter has none)
    if "dkdv" in passes:
        grid = (batch * heads, triton.cdiv(n_k, cfg.block_n1))
        cap = {"maxnreg": cfg.maxnreg1} if cfg.maxnreg1 and not interpreting() else {}
        kw = _pass_kwargs(common, tma, cfg.block_m1, cfg.block_n1, cfg.num_warps1, cfg.num_stages1)
        kw |= {"EARLY_DP": cfg.early_dp, "DQ_MODE": dq_mode} | cap
        shape = (batch * heads, n_q, common["BLOCK_D"])
        dq_acc = buffer_kernels.zeroed_float32("dq_acc", shape, q4.device) if dq_mode else lse
        plans.launch(
            backward_kernels.flash_bwd_dkdv_kernel,
            grid,
            *ins, dk4, dv4, lse, delta, dq_acc, *in_strides, strides3(dk4), strides3(dv4), *sizes, **kw,
        )  # fmt: skip
        if dq_mode:
            buffer_kernels.cast_rows_into(dq4, dq_acc)
    if "dq" in passes and not dq_mode:
        grid = (batch * heads, triton.cdiv(n_q, cfg.block_m2))
        kw = _pass_kwargs(common, tma, cfg.block_m2, cfg.block_n2, cfg.num_warps2, cfg.num_stages2)
        plans.launch(
            backward_dq_kernels.flash_bwd_dq_kernel,
            grid,
            *ins,
            dq4,
            lse,
            delta,
            *in_strides,
            strides3(dq4),
            *sizes,
            **kw,
        )


def _pass_kwargs(
    common: dict, tma: bool, block_m: int, block_n: int, num_warps: int, num_stages: int
) -> dict:
    """The keyword arguments of one backward kernel's launch: its tiles, warps, stages and switches."""
    return dict(
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps, num_stages=num_stages, USE_TMA=tma, **common
    )


def _bwd_operands(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor) -> dict[str, Tensor]:
    """The backward kernels' tensors by role: the inputs (last dims made contiguous, do in q's dtype,
    lse float32 contiguous) and new dq, dk, dv and delta."""
    q, k, v, o, do = (_last_dim_contiguous(t) for t in (q, k, v, o, do))
    lse = lse.contiguous().float()  # (..., N_q) float32, as delta
    return {
        "q": q, "k": k, "v": v, "o": o, "do": do if do.dtype == q.dtype else do.to(q.dtype), "lse": lse,
        "dq": output_like(q), "dk": output_like(k), "dv": output_like(v), "delta": _empty_f32(lse.shape, lse),
    }  # fmt: skip


def _check_backward(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor) -> None:
    check_inputs(q, k, v)
    for name, t in (("do", do), ("o", o), ("lse", lse)):
        if not isinstance(t, Tensor):
            raise ValueError(
                f"FlashAttentionTriton backward: {name} must be a torch.Tensor, got {type(t).__name__}"
            )
    if do.shape != q.shape or o.shape != q.shape or lse.shape != q.shape[:-1]:
        raise ValueError(
            f"FlashAttentionTriton backward: do {tuple(do.shape)}, o {tuple(o.shape)} must match q "
            f"{tuple(q.shape)} and lse {tuple(lse.shape)} must be {tuple(q.shape[:-1])}"
        )


def _prepare(ops: dict[str, Tensor]) -> tuple[Tensor, ...]:
    """Run the Delta = rowsum(dO * O) kernel; return the 4-D kernel operands (q, k, v, do, dq, dk,
    dv, lse, delta) of `launch_bwd`, each named for the active plan recording."""
    t4 = {name: plans.role(name, _as_4d(t) if t.ndim == ops["q"].ndim else t) for name, t in ops.items()}
    q4, o4, do4 = t4["q"], t4["o"], t4["do"]
    batch, heads, n_q, d = q4.shape
    block_d = tiles.block_d(d)
    pre_m = 64 if block_d <= 128 else 32
    plans.launch(
        backward_kernels.flash_bwd_preprocess_kernel,
        (batch * heads, triton.cdiv(n_q, pre_m)),
        o4, do4, t4["delta"], strides3(o4), strides3(do4), heads, n_q, D=d, BLOCK_D=block_d, BLOCK_M=pre_m,
    )  # fmt: skip
    tensors = tuple(t4[name] for name in ("q", "k", "v", "do", "dq", "dk", "dv", "lse", "delta"))
    if _tma_possible(q4.device, *tensors[:7]):
        _set_tma_allocator(q4.device)  # for launch_bwd, here or in flash_bench's tuning
    return tensors


def prepare_backward(
    do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor
) -> tuple[tuple[Tensor, ...], tuple[Tensor, Tensor, Tensor]]:
    """Check, allocate dq/dk/dv and run the Delta = rowsum(dO * O) kernel.

    Returns (the 4-D kernel operands q, k, v, do, dq, dk, dv, lse, delta) and (dq, dk, dv) shaped
    like q, k, v.
    """
    _check_backward(do, q, k, v, o, lse)
    ops = _bwd_operands(do, q, k, v, o, lse)
    return _prepare(ops), (ops["dq"], ops["dk"], ops["dv"])


def flash_bwd(
    do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, is_causal: bool = False
) -> tuple[Tensor, Tensor, Tensor]:
    """Backward. do, q, o: (..., N_q, d); k, v: (..., N_k, d); lse: (..., N_q) from flash_fwd.

    Returns dq, dk, dv shaped like q, k, v (same layouts when those are dense). Launches are
    planned per input signature like flash_fwd's.
    """
    if not all(isinstance(t, Tensor) for t in (do, q, k, v, o, lse)):
        _check_backward(do, q, k, v, o, lse)
    key = _plan_key("bwd", is_causal, q, k, v, o, do, lse)
    plan = _BWD_PLANS.get(key)
    if plan is None:
        _check_backward(do, q, k, v, o, lse)
        _changed_hopper_backward(q)  # a pinned option that cannot apply: an error before any work
    ops = _bwd_operands(do, q, k, v, o, lse)
    _run_planned(_BWD_PLANS, key, plan, _flash_bwd_full, ops, is_causal)
    return ops["dq"], ops["dk"], ops["dv"]


def _changed_hopper_backward(
    q: Tensor,
) -> hopper_configs.HopperBwdConfig | hopper_configs.WarpSpecializedBwdConfig | None:
    """The Hopper backward's configuration for q's head dim as the pinned options change it (None when
    they do not): `KernelOptions.deterministic` (the two-pass kernel) and `hopper_bwd` (fields
    replaced), checked against q's heads (a ValueError naming the problem)."""
    opts = tiles.pinned_options()
    if opts.deterministic:
        cfg = hopper_configs.deterministic_backward(q.shape[-1], opts.hopper_bwd)
    elif opts.hopper_bwd:
        cfg = hopper_configs.changed_backward(q.shape[-1], opts.hopper_bwd)
    else:
        return None
    hopper_configs.check_group(cfg, math.prod(q.shape[:-2]))
    return cfg


def _flash_bwd_full(ops: dict[str, Tensor], is_causal: bool) -> None:
    tensors = _prepare(ops)
    q4, k4 = tensors[0], tensors[1]
    _, _, n_q, d = q4.shape
    n_k = k4.shape[2]
    opts = tiles.pinned_options()
    tma = use_tma(opts, q4.device, *tensors[:7])
    if hopper.use_hopper(opts.hopper, *tensors[:7], kind="bwd"):
        # dK/dV by a Gluon kernel; dQ too with a one-pass configuration, else by the tl kernel.
        passes = () if hopper.flash_bwd_hopper(tensors, is_causal, _changed_hopper_backward(q4)) else ("dq",)
    else:
        passes = ("dkdv", "dq")
    if not passes:
        return
    tiles.choose_and_run(
        "bwd",
        tuning_key(n_q, n_k, d, q4.dtype, is_causal),
        lambda c: launch_bwd(tensors, is_causal, c, opts, tma, passes),
        heuristic=lambda: heuristic_bwd(n_q, n_k, tiles.block_d(d), q4.dtype),
        candidates=lambda: bwd_candidates(tiles.block_d(d), q4.dtype),
        shrink=tiles.shrink_bwd,
        can_tune=_can_tune(q4),
    )
