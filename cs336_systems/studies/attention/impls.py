"""The attention implementations the FlashAttention benchmarks time, by name.

`attention_fn(impl)` -> f(q, k, v, is_causal) for the sweep, to be called (forward and backward) inside
`impl_options(impl)`; `leaderboard_step(impl, x)` -> the 2025 leaderboard protocol's step (compiled
apply, forward + o.sum().backward()).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.nn.functional as F

from cs336_systems.attention import FlashAttentionPytorch, FlashAttentionTriton
from cs336_systems.attention.flash_triton import tiles
from cs336_systems.attention.flash_triton.function import define_op
from cs336_systems.model import get_attention

# Implementations the protocol can time: ours (the default choice of kernels), ours with the portable
# tl kernels only, ours with the Gluon (Hopper) forward and dK/dV kernels wherever they take the
# inputs, ours with the PyTorch backward, SDPA's two fastest backends, and `custom_op_floor`: an
# attention that launches nothing, built like ours (an autograd.Function around two operators,
# compiled), whose step time is the host floor of that design (outputs uninitialised: time only).
# "flash_triton_eager": ours called without torch.compile (its host path is the autograd.Function and
# our launchers only, no Dynamo guards or AOTAutograd wrappers: what a single attention call costs eagerly).
# "<impl>_graphed": that attention's forward and backward captured in CUDA graphs
# (`torch.cuda.make_graphed_callables`) and replayed, so no host work per call is left (GPU only).
# "sdpa_<backend>_compiled": SDPA compiled the way the protocol compiles ours (`torch.compile` of the
# call alone), so that its host time per call is the like-for-like baseline of our compiled path's.
LEADERBOARD_IMPLS = (
    "flash_triton",
    "flash_triton_portable",
    "flash_triton_gluon",
    "flash_pytorch_compiled_bwd",
    "sdpa_flash",
    "sdpa_cudnn",
    "custom_op_floor",
    "flash_triton_eager",
    "flash_triton_graphed",
    "sdpa_flash_graphed",
    "sdpa_cudnn_graphed",
    "sdpa_flash_compiled",
    "sdpa_cudnn_compiled",
)
# Implementations timed only as the protocol's step (no attention callable of their own).
STEP_ONLY = (
    "custom_op_floor",
    "flash_triton_eager",
    "flash_triton_graphed",
    "sdpa_flash_graphed",
    "sdpa_cudnn_graphed",
    "sdpa_flash_compiled",
    "sdpa_cudnn_compiled",
)
COMPILED_SDPA = {"sdpa_flash_compiled": "flash", "sdpa_cudnn_compiled": "cudnn"}  # impl -> backend
# Our implementations that pin the kernel choice (tiles.KernelOptions.hopper).
_PINNED_HOPPER = {"flash_triton_portable": False, "flash_triton_gluon": True}


def _empty_fwd(q, k, v, is_causal):
    return torch.empty_like(q), q.new_empty(q.shape[:-1], dtype=torch.float32)


def _empty_bwd(do, q, k, v, o, lse, is_causal):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


_FLOOR_LIB = torch.library.Library("cs336_floor", "FRAGMENT")
_floor_fwd = define_op(
    _FLOOR_LIB,
    "attn_fwd(Tensor q, Tensor k, Tensor v, bool is_causal) -> (Tensor, Tensor)",
    _empty_fwd,
    _empty_fwd,
)
_floor_bwd = define_op(
    _FLOOR_LIB,
    "attn_bwd(Tensor do, Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse, bool is_causal) -> (Tensor, Tensor, Tensor)",
    _empty_bwd,
    _empty_bwd,
)


class CustomOpFloor(torch.autograd.Function):
    """FlashAttentionTriton's structure (saved tensors, one operator each way, defined the same way)
    with no kernels: the host time of a step built this way, which no launcher can go below."""

    @staticmethod
    def forward(ctx, q, k, v, is_causal=False):
        o, lse = _floor_fwd(q, k, v, bool(is_causal))
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.is_causal = bool(is_causal)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        return (*_floor_bwd(do, q, k, v, o, lse, ctx.is_causal), None)


def sdpa_fn(backend_name: str) -> Callable:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend_name]

    def fn(q, k, v, is_causal):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)

    return fn


def impl_options(impl: str) -> contextlib.AbstractContextManager:
    """The kernel choice `impl` pins (Hopper kernels forced on or off), for the whole timed region:
    forward and backward (autograd runs the backward outside any call of the forward)."""
    if impl in _PINNED_HOPPER:
        return tiles.use_configs(options=tiles.KernelOptions(hopper=_PINNED_HOPPER[impl]))
    return contextlib.nullcontext()


def attention_fn(impl: str, device: str = "cuda") -> Callable:
    """The callable of `impl`; the PyTorch tile loop uses 128-row tiles on a GPU (64 on a CPU)."""
    tile = 128 if torch.device(device).type == "cuda" else 64
    return {
        "flash_triton": lambda q, k, v, c: FlashAttentionTriton.apply(q, k, v, c),
        "flash_triton_ptbwd": lambda q, k, v, c: FlashAttentionTriton.apply(q, k, v, c, "pytorch"),
        "flash_triton_portable": lambda q, k, v, c: FlashAttentionTriton.apply(q, k, v, c),  # impl_options
        "flash_triton_gluon": lambda q, k, v, c: FlashAttentionTriton.apply(q, k, v, c),  # pin the kernels
        "flash_pytorch": lambda q, k, v, c: FlashAttentionPytorch.apply(q, k, v, c, None, tile, tile),
        "flash_pytorch_compiled": lambda q, k, v, c: FlashAttentionPytorch.apply(
            q, k, v, c, True, tile, tile
        ),
        "naive": get_attention("naive"),
        "sdpa_flash": sdpa_fn("flash"),
        "sdpa_cudnn": sdpa_fn("cudnn"),
    }[impl]


class _Causal(torch.nn.Module):
    def __init__(self, fn: Callable):
        super().__init__()
        self.fn = fn

    def forward(self, q, k, v):
        return self.fn(q, k, v, True)


def _graphed(fn: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Callable:
    """fn(q, k, v, True) and its backward captured in CUDA graphs (on copies of q, k, v's shapes);
    called as flash(q, k, v, True) like the other steps (always causal, as the protocol)."""
    if q.device.type != "cuda":
        raise ValueError("the *_graphed implementations capture CUDA graphs: they need a CUDA device")
    samples = tuple(t.detach().clone().requires_grad_() for t in (q, k, v))
    graphed = torch.cuda.make_graphed_callables(_Causal(fn), samples)
    return lambda a, b, c, _is_causal: graphed(a, b, c)


def leaderboard_step(impl: str, x: torch.Tensor) -> Callable[[], None]:
    """The protocol's timed step for `impl` on x = stacked (q, k, v): o = flash(q, k, v, True); o.sum().backward()."""
    q, k, v = x  # the protocol's unpacking along dim 0: (heads, N, d) views of x
    if impl.endswith("_graphed"):
        base = impl.removesuffix("_graphed")
        if base.startswith("sdpa_"):
            q, k, v = q[None], k[None], v[None]  # 4-D for SDPA's kernels
        flash = _graphed(attention_fn(base, x.device.type), q, k, v)
    elif impl == "flash_triton" or impl in _PINNED_HOPPER:
        flash = torch.compile(FlashAttentionTriton.apply)
    elif impl == "flash_triton_eager":
        flash = FlashAttentionTriton.apply
    elif impl == "custom_op_floor":
        flash = torch.compile(CustomOpFloor.apply)
    elif impl == "flash_pytorch_compiled_bwd":
        flash = torch.compile(lambda a, b, c, causal: FlashAttentionTriton.apply(a, b, c, causal, "pytorch"))
    else:
        q, k, v = q[None], k[None], v[None]  # (1, heads, N, d) views: SDPA's flash/cuDNN kernels want 4-D
        if impl in COMPILED_SDPA:
            flash = torch.compile(sdpa_fn(COMPILED_SDPA[impl]))
        else:
            flash = sdpa_fn(impl.removeprefix("sdpa_"))

    def step():
        with impl_options(impl):
            o = flash(q, k, v, True)
            o.sum().backward()

    return step
