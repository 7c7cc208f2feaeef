"""The Hopper (Gluon) FlashAttention kernels: chosen automatically on sm_90, forcible either way,
and the same function as the float64 reference over today's correctness matrix.

Gluon kernels do not run under the Triton interpreter: the numerical tests are `gpu`-marked and run
on an H100/H200 (the committed log of that run is figures/data/flash_hopper__gpu_tests.log). The
selection rules are checked on the CPU.
"""

from __future__ import annotations

import pytest
import torch

from cs336_systems.attention import FlashAttentionTriton
from cs336_systems.attention.flash_triton import KernelOptions, hopper, use_configs
from tests.attention_helpers import check_outputs, make_case, run_impl

HOPPER = KernelOptions(hopper=True)
PORTABLE = KernelOptions(hopper=False)


def _on_hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.parametrize(
    ("d", "d0"), [(16, 16), (64, 64), (128, 128), (256, 256), (80, 64), (96, 64), (48, 32), (160, 128), (192, 128),
                  (8, None), (72, None), (100, None), (112, None), (512, None)],
)  # fmt: skip
def test_head_dims_split_into_two_power_of_two_blocks(d, d0):
    assert hopper.split_head_dim(d) == d0


def test_cpu_tensors_fall_back_to_the_portable_kernels_and_forcing_is_an_error():
    q = torch.randn(1, 2, 16, 64)
    assert not hopper.use_hopper(None, q, q, q)
    assert not hopper.use_hopper(False, q, q, q)
    with pytest.raises(ValueError, match="Hopper kernels forced"):
        hopper.use_hopper(True, q, q, q)


def test_the_gluon_dkdv_kernel_is_opt_in_and_needs_the_hopper_path():
    assert KernelOptions().hopper_dkdv is False
    with pytest.raises(ValueError, match="hopper_dkdv=True needs the Hopper kernels"):
        KernelOptions(hopper=False, hopper_dkdv=True)


@pytest.mark.gpu
def test_gpu_hopper_is_the_default_on_sm90_for_16_bit_inputs():
    q = torch.randn(1, 2, 128, 64, device="cuda", dtype=torch.bfloat16)
    assert hopper.use_hopper(None, q, q, q) == _on_hopper()
    assert not hopper.use_hopper(None, q.float(), q.float(), q.float())  # fp32: the tl kernels
    assert not hopper.use_hopper(False, q, q, q)


needs_sm90 = pytest.mark.skipif(not _on_hopper(), reason="needs an sm_90 GPU")
HOPPER_DTYPES = [
    pytest.param(torch.bfloat16, 5e-2, 5e-2, 1e-2, id="bf16"),
    pytest.param(torch.float16, 1e-2, 1e-2, 2e-3, id="fp16"),
]


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize(("dtype", "atol", "rtol", "floor"), HOPPER_DTYPES)
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [16, 32, 64, 80, 96, 128, 256])
@pytest.mark.parametrize(
    ("batch", "n_q", "n_k"), [((2,), 1, 1), ((1, 3), 97, 250), ((1, 3), 300, 97), ((1, 2), 1025, 1025)]
)
def test_gpu_hopper_matches_float64(batch, n_q, n_k, d, is_causal, dtype, atol, rtol, floor):
    case = make_case(batch, n_q, n_k, d, dtype, device="cuda", is_causal=is_causal)
    # the opt-in Gluon dK/dV kernel too, wherever it takes the head dim
    with use_configs(options=KernelOptions(hopper=True, hopper_dkdv=hopper.bwd_supported(d))):
        ours = run_impl(FlashAttentionTriton.apply, case)
    check_outputs(ours, case, atol, rtol, floor)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("cfg", [hopper.HopperFwdConfig(128, 64, 2, 8), hopper.HopperFwdConfig(128, 128, 2, 8),
                                 hopper.HopperFwdConfig(64, 64, 3, 4), hopper.HopperFwdConfig(128, 32, 4, 8)],
                         ids=str)  # fmt: skip
@pytest.mark.parametrize("n", [333, 4096])
def test_gpu_hopper_forward_tile_candidates_and_every_element_written(cfg, n):
    case = make_case((1, 4), n, n, 64, torch.bfloat16, device="cuda", is_causal=True)
    q4, k4, v4 = (t.detach() for t in (case.q, case.k, case.v))
    o = torch.full_like(q4, float("nan"))
    lse = torch.full(q4.shape[:-1], float("nan"), device="cuda")
    hopper.flash_fwd_hopper(q4, k4, v4, o, lse, True, cfg)
    want = torch.nn.functional.scaled_dot_product_attention(
        q4.double(), k4.double(), v4.double(), is_causal=True
    )
    assert torch.isfinite(o).all() and torch.isfinite(lse).all()
    torch.testing.assert_close(o.double(), want, atol=5e-2, rtol=5e-2)


@pytest.mark.gpu
@needs_sm90
def test_gpu_hopper_and_portable_paths_agree_under_torch_compile(request):
    x = torch.randn(3, 4, 2048, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    q, k, v = x.unbind(0)
    with use_configs(options=PORTABLE):
        FlashAttentionTriton.apply(q, k, v, True).sum().backward()
    want = x.grad.clone()
    x.grad = None
    flash = torch.compile(FlashAttentionTriton.apply, fullgraph=True)
    with use_configs(options=KernelOptions(hopper=True, hopper_dkdv=True)):
        flash(q, k, v, True).sum().backward()
    torch.testing.assert_close(x.grad, want, atol=2e-2, rtol=2e-2)
