"""Shared helpers of the attention tests: inputs, float64 references, and the error checks.

Two checks per output (o, lse, dq, dk, dv), in the style of the flash-attn tests:
* closeness to the float64 reference with the dtype's (atol, rtol);
* "our error <= 2x PyTorch's own error": max|ours - ref64| <= 2 * max|torch_same_dtype - ref64| + floor,
  where torch_same_dtype is the naive reference run in the input dtype on the same device. The floor
  keeps the rule meaningful where both errors sit at the rounding level (float32).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from cs336_systems.attention import attention_reference

NAMES = ("o", "lse", "dq", "dk", "dv")


@dataclass
class Case:
    q: Tensor
    k: Tensor
    v: Tensor
    do: Tensor
    is_causal: bool


def make_case(
    batch_shape: tuple[int, ...],
    n_q: int,
    n_k: int,
    d: int,
    dtype: torch.dtype,
    device="cpu",
    is_causal=False,
) -> Case:
    """Fresh standard-normal q, k, v (requires_grad) and upstream gradient do; never zeros."""
    q = torch.randn(*batch_shape, n_q, d, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(*batch_shape, n_k, d, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(*batch_shape, n_k, d, device=device, dtype=dtype, requires_grad=True)
    do = torch.randn(*batch_shape, n_q, d, device=device, dtype=dtype)
    return Case(q, k, v, do, is_causal)


def saved_lse(o: Tensor, q: Tensor) -> Tensor:
    """The official test's rule: exactly one saved tensor has shape q.shape[:-1], and it is L."""
    matches = [t for t in o.grad_fn.saved_tensors if t.shape == q.shape[:-1]]
    assert len(matches) == 1, (
        f"expected exactly one saved tensor of shape {tuple(q.shape[:-1])}, got {len(matches)}"
    )
    return matches[0]


def run_impl(fn: Callable, case: Case, *args) -> dict[str, Tensor]:
    """o, lse, dq, dk, dv of `fn(q, k, v, is_causal, *args)` (an autograd Function's apply)."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (case.q, case.k, case.v))
    o = fn(q, k, v, case.is_causal, *args)
    lse = saved_lse(o, q).detach().clone()
    o.backward(case.do)
    return {"o": o.detach(), "lse": lse, "dq": q.grad, "dk": k.grad, "dv": v.grad}


def run_reference(case: Case, dtype: torch.dtype | None = None) -> dict[str, Tensor]:
    """The naive reference in `dtype` (default: the inputs' dtype), through autograd."""
    dtype = dtype or case.q.dtype
    q, k, v = (t.detach().to(dtype).requires_grad_() for t in (case.q, case.k, case.v))
    o, lse = attention_reference(q, k, v, case.is_causal)
    o.backward(case.do.to(dtype))
    return {"o": o.detach(), "lse": lse.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def _max_err(a: Tensor, b: Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def check_outputs(
    ours: dict[str, Tensor], case: Case, atol: float, rtol: float, floor: float, names=NAMES
) -> None:
    """Assert closeness to float64 and the 2x-PyTorch-error rule; the message names the worst element."""
    ref64 = run_reference(case, torch.float64)
    same = run_reference(case)
    for name in names:
        got, want = ours[name], ref64[name]
        assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
        assert torch.isfinite(got).all(), f"{name}: non-finite values"
        err, err_torch = _max_err(got, want), _max_err(same[name], want)
        diff = (got.double() - want).abs()
        worst = tuple(int(i) for i in torch.unravel_index(diff.argmax(), diff.shape))
        where = f"worst at {worst}: ours {got[worst].item():.6g}, float64 {want[worst].item():.6g}"
        assert err <= 2 * err_torch + floor, (
            f"{name}: our max error {err:.3g} > 2 x PyTorch's {err_torch:.3g} + {floor:g} ({where})"
        )
        torch.testing.assert_close(
            got.double(), want, atol=atol, rtol=rtol, msg=lambda m, n=name, w=where: f"{n}: {m} ({w})"
        )


def on_hopper() -> bool:
    """Whether this host's GPU is an sm_90 (H100, H200), where the Gluon kernels run."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def hopper_backward_configs(monkeypatch, d: int) -> tuple[list, Callable[[], None]]:
    """`launch.flash_bwd` made to choose the Hopper backward and record the configuration it hands
    it, instead of launching (with no launch plan kept for other tests). Returns the list of those
    configurations and a call of flash_bwd on (1, 2, 64, d) causal operands."""
    from cs336_systems.attention.flash_triton import hopper, launch, plans

    seen: list = []

    def record(tensors, is_causal, cfg=None):
        seen.append(cfg)
        return True  # "dQ filled": no tl pass runs

    monkeypatch.setattr(hopper, "use_hopper", lambda *a, **k: True)
    monkeypatch.setattr(hopper, "flash_bwd_hopper", record)
    monkeypatch.setattr(launch, "_BWD_PLANS", plans.PlanCache())
    q, k, v, do = (torch.randn(1, 2, 64, d) for _ in range(4))
    o, lse = torch.zeros_like(q), torch.zeros(1, 2, 64)
    return seen, lambda: launch.flash_bwd(do, q, k, v, o, lse, True)
