"""FlashAttention-2: the reference, the official test semantics (both classes), the pure-PyTorch
implementation's grid, and the input checks of both classes.

The Triton kernels' grid (interpreter on CPU, GPU-marked cases) lives in test_attention_triton.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from cs336_systems.attention import FlashAttentionPytorch, FlashAttentionTriton, attention_reference
from cs336_systems.attention.backward import flash_backward
from tests.attention_helpers import check_outputs, make_case, run_impl, saved_lse

# The Triton kernels use block pointers (the handout's API) besides TMA descriptors; Triton 3.7 warns.
pytestmark = pytest.mark.filterwarnings("ignore:tl.make_block_ptr is deprecated")

# ------------------------------------------------------------------------------------------------
# The reference
# ------------------------------------------------------------------------------------------------


def test_reference_is_the_official_definition():
    """S = qk^T/sqrt(d), -1e6 where i < j (top-left), O = softmax(S) v, L = logsumexp(S)."""
    q = torch.randn(2, 5, 8, dtype=torch.float64)
    k, v = torch.randn(2, 7, 8, dtype=torch.float64), torch.randn(2, 7, 8, dtype=torch.float64)
    o, lse = attention_reference(q, k, v, is_causal=True)
    s = q @ k.transpose(-1, -2) / math.sqrt(8)
    s = torch.where(torch.arange(5)[None, :, None] >= torch.arange(7)[None, None, :], s, -1e6)
    torch.testing.assert_close(lse, torch.logsumexp(s, -1))
    torch.testing.assert_close(o, torch.softmax(s, -1) @ v)
    torch.testing.assert_close(o[:, 0], v[:, 0])  # query 0 sees key 0 only
    o_full, _ = attention_reference(q, k, v, is_causal=False)
    assert not torch.allclose(o_full[:, 0], v[:, 0])


# ------------------------------------------------------------------------------------------------
# Official semantics: batch 4, N 128, D 64, float32, rtol = atol = 1e-2, one (4, 128) saved tensor
# ------------------------------------------------------------------------------------------------

IMPLS = [pytest.param(FlashAttentionPytorch, id="pytorch"), pytest.param(FlashAttentionTriton, id="triton")]


def _official_inputs():
    torch.manual_seed(0)
    q, k, v, do = (torch.randn(4, 128, 64) for _ in range(4))
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), do


def _official_reference(q, k, v, is_causal):
    s = q @ k.transpose(-1, -2) * (1 / math.sqrt(64))
    if is_causal:
        s = torch.where(torch.arange(128)[None, :, None] >= torch.arange(128)[None, None, :], s, -1e6)
    return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("impl", IMPLS)
def test_official_forward(impl, is_causal):
    q, k, v, _ = _official_inputs()
    o = impl.apply(q, k, v, is_causal)  # is_causal positional, as the official test passes it
    lse = saved_lse(o, q)
    assert lse.shape == (4, 128)
    o_ref, lse_ref = _official_reference(q, k, v, is_causal)
    torch.testing.assert_close(o, o_ref, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(lse, lse_ref, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("impl", IMPLS)
def test_official_backward(impl, is_causal):
    q, k, v, do = _official_inputs()
    impl.apply(q, k, v, is_causal).backward(do)
    ours = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    _official_reference(q, k, v, is_causal)[0].backward(do)
    for got, want in zip(ours, (q.grad, k.grad, v.grad)):
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)


# ------------------------------------------------------------------------------------------------
# The pure-PyTorch implementation: ragged N, N_q != N_k, d 16..128, causal, 3-D/4-D, dtypes
# ------------------------------------------------------------------------------------------------

# (dtype, atol, rtol, floor of the 2x rule) against the float64 reference
PT_DTYPES = [
    pytest.param(torch.float32, 1e-4, 1e-4, 2e-5, id="fp32"),
    pytest.param(torch.bfloat16, 5e-2, 5e-2, 1e-2, id="bf16"),
]


PT_SHAPES = [
    pytest.param(n_q, n_k, d, id=f"q{n_q}-k{n_k}-d{d}")
    for n_q, n_k in [(1, 1), (17, 17), (97, 97), (97, 33), (17, 130)]
    for d in (16, 32, 64, 128)
] + [pytest.param(1025, 1025, 64, id="q1025-k1025-d64")]


@pytest.mark.parametrize(("dtype", "atol", "rtol", "floor"), PT_DTYPES)
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(("n_q", "n_k", "d"), PT_SHAPES)
def test_pytorch_matches_float64(n_q, n_k, d, is_causal, dtype, atol, rtol, floor):
    batch = (1, 2) if n_q < 1000 else (1,)  # 4-D (batch, heads) and 3-D inputs
    case = make_case(batch, n_q, n_k, d, dtype, is_causal=is_causal)
    check_outputs(run_impl(FlashAttentionPytorch.apply, case), case, atol, rtol, floor)


@pytest.mark.parametrize(("tile_q", "tile_k"), [(16, 16), (16, 48), (80, 32)])
def test_pytorch_tile_sizes(tile_q, tile_k):
    case = make_case((2,), 97, 75, 32, torch.float32, is_causal=True)
    ours = run_impl(FlashAttentionPytorch.apply, case, None, tile_q, tile_k)
    check_outputs(ours, case, 1e-4, 1e-4, 2e-5)


@pytest.mark.slow
def test_pytorch_compiled_tile_steps_and_backward():
    """compiled=True: every tile step and the backward chunks through torch.compile (Inductor, ~20 s on a CPU)."""
    case = make_case((1, 2), 40, 40, 16, torch.float32, is_causal=True)
    ours = run_impl(FlashAttentionPytorch.apply, case, True, 16, 16)
    check_outputs(ours, case, 1e-4, 1e-4, 2e-5)


def test_pytorch_rejects_tiles_below_16():
    q = torch.randn(1, 32, 16)
    with pytest.raises(ValueError, match="at least 16"):
        FlashAttentionPytorch.apply(q, q, q, False, None, 8, 16)


def test_backward_key_chunks_agree():
    """The chunked recomputation backward gives the same gradients for any chunk size."""
    case = make_case((2,), 70, 90, 16, torch.float64, is_causal=True)
    o, lse = attention_reference(case.q, case.k, case.v, True)
    args = (case.q, case.k, case.v, o.detach(), lse.detach(), case.do, True)
    full = flash_backward(*args, key_chunk=1000, compiled=False)
    for chunk in (16, 37):
        for a, b in zip(flash_backward(*args, key_chunk=chunk, compiled=False), full):
            torch.testing.assert_close(a, b)


# ------------------------------------------------------------------------------------------------
# Bad inputs: a ValueError that names the problem (both classes)
# ------------------------------------------------------------------------------------------------


def _bad(name):
    q = torch.randn(2, 8, 16)
    cases = {
        "device": (q, torch.randn(2, 8, 16, device="meta"), q, "one device"),
        "dtype": (q, q.half(), q, "one dtype"),
        "integer": (q.long(), q.long(), q.long(), "not supported"),
        "head_dim_mismatch": (q, torch.randn(2, 8, 32), torch.randn(2, 8, 32), "same head dimension"),
        "batch_mismatch": (q, torch.randn(3, 8, 16), torch.randn(3, 8, 16), "leading"),
        "kv_length": (q, torch.randn(2, 8, 16), torch.randn(2, 9, 16), "same sequence length"),
        "two_dims": (q[0], q[0], q[0], "3-D"),
        "five_dims": (q[None, None], q[None, None], q[None, None], "3-D"),
        "ndim_mismatch": (q, q[None], q[None], "same number of dimensions"),
        "empty_sequence": (q[:, :0], q[:, :0], q[:, :0], ">= 1"),
    }
    return cases[name]


BAD = [
    "device",
    "dtype",
    "integer",
    "head_dim_mismatch",
    "batch_mismatch",
    "kv_length",
    "two_dims",
    "five_dims",
    "ndim_mismatch",
    "empty_sequence",
]


@pytest.mark.parametrize("name", BAD)
@pytest.mark.parametrize("impl", IMPLS)
def test_bad_inputs_raise_value_error(impl, name):
    q, k, v, match = _bad(name)
    with pytest.raises(ValueError, match=match):
        impl.apply(q, k, v, False)


def test_triton_rejects_head_dim_above_256():
    q = torch.randn(1, 4, 512)
    with pytest.raises(ValueError, match="head dimension 512"):
        FlashAttentionTriton.apply(q, q, q, False)
