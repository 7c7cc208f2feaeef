"""Activation checkpointing strategies for a stack of blocks, and tools that measure what autograd saves.

Strategies (2026 handout section 3, gradient_checkpointing), each a "block runner" `fn(blocks, x) -> y`
that `BasicsTransformerLM.set_block_runner` accepts:

* `checkpoint_groups(blocks, x, k)`: one level; each run of k consecutive blocks is a
  `torch.utils.checkpoint.checkpoint` region (what `set_checkpointing(k)` does inside the model).
* `checkpoint_sub_blocks(blocks, x)`: one level below the block: the attention half
  `x + attn(ln1 x)` and the MLP half `h + ffn(ln2 h)` of every block are separate regions.
* `checkpoint_keeping_attention(fn, x, matmuls=False)`: selective checkpointing of one region: backward
  recomputes everything in `fn` except the attention core, whose outputs are kept ([Note: keeping the
  attention]), and with `matmuls` except every matmul too ([Note: keeping the matmuls too]).
* `checkpoint_recursive(blocks, x)`: nested bisection (a binary tree of checkpoints), the O(log N)
  memory / O(N log N) compute scheme (Chen et al. 2016, "Training Deep Nets with Sublinear Memory
  Cost", https://arxiv.org/abs/1604.06174, section 4.1 and its recursive variant).

[Note: cost model] With N blocks, c bytes per block input (a checkpoint) and r bytes of residuals per
block (what one block saves for backward), peak activation memory is about
  none:        N r
  one level k: ceil(N/k) c + k r          minimised at k* = sqrt(N c / r); one extra forward
  sub-block:   2N c + max(r_attn, r_mlp)  one extra forward
  recursive:   ceil(log2 N) c + r         ceil(log2 N) extra forwards per block
(backward-pass gradient buffers and the persistent model/optimizer state come on top).
`activation_peak_model` evaluates these formulas; the GPU study measures them.

Measurement: `saved_tensors(fn, *args)` runs `fn` under `torch.autograd.graph.saved_tensors_hooks`
and counts the distinct storages autograd keeps for backward (views of one storage count once;
parameters, buffers and the given inputs are reported apart, since they exist anyway).
`saved_tensors_by_op(output)` walks the autograd graph from `output` and attributes every saved
storage to the first operation (in forward order) that saved it. Both work on the "meta" device, so
full-size accounting needs no GPU.

Caveats: the strategies use non-reentrant checkpointing (`use_reentrant=False`, the variant that
supports nesting and keyword-free inputs). Random ops inside regions would need RNG state handling;
the model has none (no dropout). Attribution relies on autograd nodes' `_saved_*` attributes and
`_sequence_nr()`, which are internal but stable PyTorch interfaces.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

BlockRunner = Callable[[Sequence[nn.Module], Tensor], Tensor]
STRATEGIES = ("none", "block", "sub_block", "recursive")


# ----------------------------------------------------------------------------------------------------
# Strategies
# ----------------------------------------------------------------------------------------------------


def run_blocks(blocks: Sequence[nn.Module], x: Tensor) -> Tensor:
    """Plain loop: x (batch, T, d_model) through every block in order."""
    for block in blocks:
        x = block(x)
    return x


def checkpoint_groups(blocks: Sequence[nn.Module], x: Tensor, group_size: int) -> Tensor:
    """One level: each run of `group_size` consecutive blocks is recomputed in backward."""
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    blocks = list(blocks)
    for start in range(0, len(blocks), group_size):
        x = checkpoint(run_blocks, blocks[start : start + group_size], x, use_reentrant=False)
    return x


def _attention_half(block: nn.Module, x: Tensor) -> Tensor:
    return x + block.attn(block.ln1(x))


def _mlp_half(block: nn.Module, h: Tensor) -> Tensor:
    return h + block.ffn(block.ln2(h))


def checkpoint_sub_blocks(blocks: Sequence[nn.Module], x: Tensor) -> Tensor:
    """One level at half-block granularity (the pre-norm residual branches of a TransformerBlock).

    Equivalent to `block(x)` = `h + ffn(ln2 h)` with `h = x + attn(ln1 x)`, split into two regions.
    """
    for block in blocks:
        if not all(hasattr(block, name) for name in ("ln1", "attn", "ln2", "ffn")):
            raise ValueError(
                f"sub-block checkpointing needs TransformerBlock-like blocks, got {type(block).__name__}"
            )
        x = checkpoint(_attention_half, block, x, use_reentrant=False)
        x = checkpoint(_mlp_half, block, x, use_reentrant=False)
    return x


# [Note: keeping the attention]
# Per byte it would keep, the attention core is the costliest op of a block to recompute: at context
# T its forward is quadratic in T while its output is one (batch, T, d_model) tensor and a
# (batch, heads, T) log-sum-exp. A selective checkpoint (torch.utils.checkpoint's `context_fn` with a
# policy) keeps the outputs of exactly these ops and recomputes the rest: the norms, the projections
# (whose outputs q, k, v the attention's backward reads again), RoPE and the MLP. At the 8B config
# (T = 32768) that drops the attention forward, about 40 % of a block's forward, from the recompute
# for 0.25 GiB kept per block. Under torch.compile the checkpoint must sit inside the compiled
# function (compile the function that calls `checkpoint_keeping_attention`): the partitioner then
# honours the policy; a checkpoint around an already compiled module recomputes its whole graph.
# Our Triton FlashAttention is an autograd.Function whose forward launch is the operator
# `cs336::flash_attn_fwd` (attention/flash_triton/function.py): the policy keeps its outputs (o and the
# log-sum-exp) by name, so the recompute re-runs the Function's Python but not its kernel. Attention
# that is neither (e.g. "naive", "flash_pytorch") is recomputed like everything else.
KEPT_OP_NAMES = frozenset({"cs336::flash_attn_fwd"})
KEPT_ATTENTION_OPS = tuple(
    op
    for name in (
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
    )
    if (op := getattr(getattr(torch.ops.aten, name, None), "default", None)) is not None
)
# [Note: keeping the matmuls too]
# With `matmuls=True` the checkpoint also keeps every matmul's output (the q, k, v, output and MLP
# projections), so backward recomputes only elementwise work: the norms, RoPE and SwiGLU's product,
# memory-bound passes of a few ms per block at the 8B shape instead of the projections' matmuls. It
# keeps more bytes per block (the projections' outputs), so fewer blocks fit unchecked; a planner that
# measures both trades them (torchtitan's "selective" checkpointing keeps every second matmul by default).
MATMUL_OPS = (torch.ops.aten.mm.default, torch.ops.aten.bmm.default, torch.ops.aten.addmm.default)


def is_kept_attention(op) -> bool:
    """Is `op` an attention core whose outputs a keeping-the-attention checkpoint saves?"""
    return op in KEPT_ATTENTION_OPS or (isinstance(op, torch._ops.OpOverload) and op.name() in KEPT_OP_NAMES)


def _keep_attention_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if is_kept_attention(op) else CheckpointPolicy.PREFER_RECOMPUTE


def _keep_attention_and_matmuls_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    kept = is_kept_attention(op) or op in MATMUL_OPS
    return CheckpointPolicy.MUST_SAVE if kept else CheckpointPolicy.PREFER_RECOMPUTE


def keep_attention_context(matmuls: bool = False):
    """`context_fn` of a checkpoint that keeps the attention core's outputs ([Note: keeping the
    attention]) and, with `matmuls`, every matmul's ([Note: keeping the matmuls too])."""
    policy = _keep_attention_and_matmuls_policy if matmuls else _keep_attention_policy
    return create_selective_checkpoint_contexts(policy)


def checkpoint_keeping_attention(fn: Callable[..., Tensor], *args: Tensor, matmuls: bool = False) -> Tensor:
    """`fn(*args)`, recomputed in backward except its attention core (and with `matmuls` its matmuls)."""
    context = functools.partial(keep_attention_context, matmuls) if matmuls else keep_attention_context
    return checkpoint(fn, *args, use_reentrant=False, context_fn=context)


def checkpoint_recursive(blocks: Sequence[nn.Module], x: Tensor, min_blocks: int = 1) -> Tensor:
    """Nested bisection: both halves of every segment longer than `min_blocks` are checkpoints.

    Forward keeps two segment inputs per level; backward recomputes one half at a time, which
    recursively keeps two inputs per level again, so O(log N) inputs plus one leaf's residuals are
    alive at once. Each block's forward runs ceil(log2(N / min_blocks)) + 1 times in total.
    """
    if min_blocks < 1:
        raise ValueError(f"min_blocks must be >= 1, got {min_blocks}")
    blocks = list(blocks)
    if len(blocks) <= min_blocks:
        return run_blocks(blocks, x)
    mid = (len(blocks) + 1) // 2
    x = checkpoint(checkpoint_recursive, blocks[:mid], x, min_blocks, use_reentrant=False)
    return checkpoint(checkpoint_recursive, blocks[mid:], x, min_blocks, use_reentrant=False)


def make_block_runner(strategy: str, group_size: int | None = None) -> BlockRunner | None:
    """A runner for `BasicsTransformerLM.set_block_runner`: "none" (None), "block" (needs group_size),
    "sub_block", or "recursive" (group_size = blocks per leaf, default 1)."""
    if strategy == "none":
        return None
    if strategy == "block":
        if group_size is None or group_size < 1:
            raise ValueError(f"strategy 'block' needs group_size >= 1, got {group_size}")
        return lambda blocks, x: checkpoint_groups(blocks, x, group_size)
    if strategy == "sub_block":
        return checkpoint_sub_blocks
    if strategy == "recursive":
        leaf = group_size or 1
        return lambda blocks, x: checkpoint_recursive(blocks, x, leaf)
    raise ValueError(f"unknown checkpointing strategy {strategy!r}; known: {', '.join(STRATEGIES)}")


# ----------------------------------------------------------------------------------------------------
# Cost model (see [Note: cost model])
# ----------------------------------------------------------------------------------------------------


def activation_peak_model(
    strategy: str,
    num_blocks: int,
    checkpoint_bytes: float,
    residual_bytes: float,
    group_size: int | None = None,
    *,
    sub_block_residual_bytes: float | None = None,
) -> dict[str, float]:
    """Predicted peak activation bytes and forward passes per block for a strategy.

    checkpoint_bytes: c, one block input (B*T*d_model*bytes); residual_bytes: r, saved by one block;
    sub_block_residual_bytes: max(r_attn, r_mlp) for "sub_block" (default r/2).
    Returns {"peak_bytes", "forward_passes"} (forward passes per block: 1 = no recomputation).
    """
    n, c, r = num_blocks, checkpoint_bytes, residual_bytes
    if n < 1 or c < 0 or r < 0:
        raise ValueError(f"need num_blocks >= 1 and non-negative sizes, got {n}, {c}, {r}")
    if strategy == "none":
        return {"peak_bytes": n * r, "forward_passes": 1.0}
    if strategy == "block":
        if group_size is None or group_size < 1:
            raise ValueError(f"strategy 'block' needs group_size >= 1, got {group_size}")
        k = min(group_size, n)
        return {"peak_bytes": math.ceil(n / k) * c + k * r, "forward_passes": 2.0}
    if strategy == "sub_block":
        half = r / 2 if sub_block_residual_bytes is None else sub_block_residual_bytes
        return {"peak_bytes": 2 * n * c + half, "forward_passes": 2.0}
    if strategy == "recursive":
        leaf = group_size or 1
        depth = math.ceil(math.log2(n / leaf)) if n > leaf else 0
        return {"peak_bytes": depth * c + leaf * r, "forward_passes": depth + 1.0}
    raise ValueError(f"unknown checkpointing strategy {strategy!r}; known: {', '.join(STRATEGIES)}")


def optimal_group_size(num_blocks: int, checkpoint_bytes: float, residual_bytes: float) -> int:
    """Integer k in [1, N] minimising ceil(N/k) c + k r (the one-level model)."""
    best = min(
        range(1, num_blocks + 1),
        key=lambda k: activation_peak_model("block", num_blocks, checkpoint_bytes, residual_bytes, k)[
            "peak_bytes"
        ],
    )
    return best


# ----------------------------------------------------------------------------------------------------
# Saved-tensor measurement
# ----------------------------------------------------------------------------------------------------


def _storage_key(t: Tensor) -> int | None:
    """Identity of a tensor's storage (views share it); None for storage-less tensors."""
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        return None


def _storage_bytes(t: Tensor) -> int:
    try:
        return t.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):
        return t.numel() * t.element_size()


@dataclass
class SavedTensors:
    """What autograd saved while a function ran (distinct storages, bytes by kind).

    kinds: "activation" (new memory kept alive for backward), "parameter" (parameters/buffers,
    saved by reference), "input" (the caller's inputs, saved by reference).
    """

    storages: dict[int, dict[str, Any]] = field(default_factory=dict)

    def bytes(self, kind: str | None = "activation") -> int:
        return sum(s["bytes"] for s in self.storages.values() if kind is None or s["kind"] == kind)

    @property
    def activation_bytes(self) -> int:
        return self.bytes("activation")

    def count(self, kind: str | None = "activation") -> int:
        return sum(1 for s in self.storages.values() if kind is None or s["kind"] == kind)


def _reference_keys(tensors: Iterable[Tensor]) -> set[int]:
    keys = set()
    for t in tensors:
        k = _storage_key(t) if isinstance(t, Tensor) else None
        if k is not None:
            keys.add(k)
    return keys


def saved_tensors(
    fn: Callable[..., Any], *args: Any, module: nn.Module | None = None, **kwargs: Any
) -> tuple[Any, SavedTensors]:
    """Run `fn(*args, **kwargs)` and record every tensor autograd packs for backward.

    Storages of `module`'s parameters/buffers are kind "parameter"; storages of tensor `args` are
    kind "input"; everything else is "activation". Returns (fn's output, SavedTensors). The record
    holds metadata only; the saved tensors live as long as the autograd graph of the output.
    """
    params = _reference_keys([*module.parameters(), *module.buffers()]) if module is not None else set()
    inputs = _reference_keys(a for a in args if isinstance(a, Tensor))
    record = SavedTensors()

    def pack(t: Tensor) -> Tensor:
        key = _storage_key(t)
        if key is not None and key not in record.storages:
            kind = "parameter" if key in params else "input" if key in inputs else "activation"
            record.storages[key] = {
                "bytes": _storage_bytes(t),
                "kind": kind,
                "shape": tuple(t.shape),
                "dtype": str(t.dtype),
            }
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args, **kwargs)
    return out, record


_BACKWARD_SUFFIX = re.compile(r"Backward\d*$")


def _graph_nodes(output: Tensor) -> list[Any]:
    """Every autograd node reachable from output.grad_fn (iterative DFS; graphs can be deep)."""
    if output.grad_fn is None:
        raise ValueError("output has no grad_fn: run the forward with autograd recording")
    seen, stack, nodes = set(), [output.grad_fn], []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        nodes.append(node)
        stack.extend(nf for nf, _ in node.next_functions)
    return nodes


def _node_saved_tensors(node: Any) -> list[Tensor]:
    out = []
    for attr in dir(node):
        if not attr.startswith("_saved_"):
            continue
        try:
            value = getattr(node, attr)
        except RuntimeError:  # already freed (backward ran) or not accessible
            continue
        values = value if isinstance(value, list | tuple) else [value]
        out.extend(v for v in values if isinstance(v, Tensor))
    return out


def saved_tensors_by_op(
    output: Tensor, *, exclude: Iterable[Tensor] = (), top: int | None = None
) -> list[dict[str, Any]]:
    """Bytes saved for backward, grouped by the forward op that first saved each storage.

    Walks the autograd graph of `output`; storages of `exclude` (parameters, inputs) are skipped.
    0-dim tensors (Python scalars autograd wraps, e.g. the 1/sqrt(d) divisor) are not counted.
    Returns rows {"op", "bytes", "num_tensors", "shapes", "share"} sorted by bytes, descending;
    `share` is the fraction of all counted bytes. `op` is the autograd node name without
    "Backward" (e.g. "Bmm", "Amax", "Exp").
    """
    skip = _reference_keys(exclude)
    first: dict[int, tuple[int, str, tuple[int, ...], int]] = {}
    for node in _graph_nodes(output):
        seq = node._sequence_nr()
        op = _BACKWARD_SUFFIX.sub("", node.name())
        for t in _node_saved_tensors(node):
            key = _storage_key(t)
            if key is None or key in skip or t.dim() == 0:  # 0-dim: wrapped Python scalars, no residual
                continue
            if key not in first or seq < first[key][0]:
                first[key] = (seq, op, tuple(t.shape), _storage_bytes(t))
    groups: dict[str, dict[str, Any]] = {}
    for _seq, op, shape, nbytes in first.values():
        g = groups.setdefault(op, {"op": op, "bytes": 0, "num_tensors": 0, "shapes": set()})
        g["bytes"] += nbytes
        g["num_tensors"] += 1
        g["shapes"].add("x".join(map(str, shape)) or "scalar")
    total = sum(g["bytes"] for g in groups.values()) or 1
    rows = sorted(groups.values(), key=lambda g: g["bytes"], reverse=True)
    for g in rows:
        g["shapes"] = ", ".join(sorted(g["shapes"]))
        g["share"] = g["bytes"] / total
    return rows[:top] if top is not None else rows
