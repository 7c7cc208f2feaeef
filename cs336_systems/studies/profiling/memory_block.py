"""One TransformerBlock's memory (memory_profiling (d) and the 2026 (f)).

`residual_stream_bytes`: the (d) derivation. `block_saved_memory`: one TransformerBlock's
saved-for-backward bytes and the top operations (saved-tensor hooks), plus on a GPU the allocator's
view of the same quantities and of the block's gradient memory; `block_saved_rows` and
`by_op_frame` turn a result into rows and a table.
"""

from __future__ import annotations

import gc
from typing import Any

import pandas as pd
import torch

from cs336_systems.measure.results import make_row
from cs336_systems.measure.timing import synchronize
from cs336_systems.model import RotaryEmbedding, TransformerBlock, get_config
from cs336_systems.model.checkpointing import saved_tensors, saved_tensors_by_op

PROBLEM = "memory_profiling"
MIB = 2**20


def residual_stream_bytes(size: str, batch_size: int, context_length: int, dtype_bytes: int = 4) -> int:
    """Bytes of one residual-stream activation (batch, T, d_model): B * T * d_model * dtype_bytes."""
    if batch_size < 1 or context_length < 1 or dtype_bytes < 1:
        raise ValueError("batch_size, context_length and dtype_bytes must be positive")
    return batch_size * context_length * get_config(size).d_model * dtype_bytes


def make_block(size: str, context_length: int, device: str) -> TransformerBlock:
    cfg = get_config(size, context_length=context_length)
    rope = RotaryEmbedding(context_length, cfg.d_head, cfg.rope_theta, device=device)
    return TransformerBlock(cfg.d_model, cfg.num_heads, cfg.d_ff, rope, device=device)


def block_saved_memory(
    size: str = "xl_2026", batch_size: int = 4, context_length: int = 2048, device: str = "meta", top: int = 5
) -> dict[str, Any]:
    """Memory one TransformerBlock saves for backward, by operation (2026 memory_profiling (f)).

    On any device: saved-tensor hooks count the distinct storages saved (activation, parameter and
    input bytes) and the autograd graph attributes them to the forward ops that saved them ("meta"
    needs no memory at all). On CUDA the allocator checks it: allocated bytes grow by the saved
    activations plus the block output over the forward, and over the backward they change by
    +parameter gradients + input gradient - saved activations, from which the gradient bytes of
    one block are recovered and compared with the parameter bytes.
    Returns {"saved": {...bytes}, "by_op": [rows], "expected_grad_bytes", and on CUDA "measured": {...}}.
    """
    block = make_block(size, context_length, device)
    d_model = block.ln1.weight.shape[0]
    x = torch.randn(batch_size, context_length, d_model, device=device, requires_grad=True)
    cuda = torch.device(device).type == "cuda" and torch.cuda.is_available()
    if cuda:
        synchronize(device)
        m0 = torch.cuda.memory_allocated()
    y, rec = saved_tensors(block, x, module=block)
    out: dict[str, Any] = {
        "size": size,
        "batch_size": batch_size,
        "context_length": context_length,
        "saved": {k: rec.bytes(k) for k in ("activation", "parameter", "input")},
        "by_op": saved_tensors_by_op(y, exclude=[x, *block.parameters(), *block.buffers()], top=top),
        "expected_grad_bytes": sum(p.numel() * p.element_size() for p in block.parameters()),
        "output_bytes": y.numel() * y.element_size(),
    }
    if cuda:
        synchronize(device)
        m1 = torch.cuda.memory_allocated()
        dy = torch.randn_like(y)
        del rec  # metadata only: the saved tensors are held by the autograd graph of y
        synchronize(device)
        m2 = torch.cuda.memory_allocated()
        y.backward(dy)
        synchronize(device)
        m3 = torch.cuda.memory_allocated()
        fwd_delta = m1 - m0
        saved_measured = fwd_delta - out["output_bytes"]
        x_grad = x.grad.numel() * x.grad.element_size()
        out["measured"] = {
            "forward_delta": fwd_delta,
            "saved_activation": saved_measured,
            "backward_delta": m3 - m2,
            "grad_bytes": (m3 - m2) + saved_measured - x_grad,
        }
    del block, x, y
    gc.collect()
    return out


def block_saved_rows(result: dict[str, Any], problem: str = PROBLEM) -> list[dict[str, Any]]:
    """Rows of a CUDA `block_saved_memory` result (MiB): hook-counted vs allocator-measured."""
    common = dict(
        problem=problem,
        name=result["size"],
        impl="naive",
        mode="block",
        dtype="fp32",
        x_name="context_length",
        x_value=result["context_length"],
        config={k: result[k] for k in ("size", "batch_size", "context_length")},
    )
    rows = [
        make_row(
            metric="block_saved_activation_hooks",
            unit="MiB",
            value=result["saved"]["activation"] / MIB,
            **common,
        ),
        make_row(
            metric="block_param_grad_expected",
            unit="MiB",
            value=result["expected_grad_bytes"] / MIB,
            **common,
        ),
    ]
    if "measured" in result:
        m = result["measured"]
        rows += [
            make_row(
                metric="block_saved_activation_allocator",
                unit="MiB",
                value=m["saved_activation"] / MIB,
                **common,
            ),
            make_row(
                metric="block_backward_memory_delta", unit="MiB", value=m["backward_delta"] / MIB, **common
            ),
            make_row(metric="block_param_grad_measured", unit="MiB", value=m["grad_bytes"] / MIB, **common),
        ]
    return rows


def by_op_frame(result: dict[str, Any]) -> pd.DataFrame:
    """The top-op table of a `block_saved_memory` result (MiB and % of saved activation bytes)."""
    df = pd.DataFrame(result["by_op"])
    if df.empty:
        return df
    df["MiB"] = df["bytes"] / MIB
    df["percent"] = 100 * df["share"]
    return df[["op", "MiB", "percent", "num_tensors", "shapes"]]
