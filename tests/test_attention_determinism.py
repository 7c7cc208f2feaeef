"""`KernelOptions(deterministic=True)`: a FlashAttention backward whose dQ, dK and dV repeat bit for bit.

The one-pass backwards add dQ's float32 partial sums with atomics or TMA reductions in an order that
varies from run to run; the deterministic option gives dQ a pass of its own. Which configuration that
is, that the launcher hands it to the Hopper kernels and that a contradicting pin is refused before any
work are checked on the CPU; that repeated runs agree bit for bit, on a GPU (`gpu` marker: under the
interpreter every program runs in order, so the CPU cannot show a varying order).
"""

from __future__ import annotations

import pytest
import torch

from cs336_systems.attention import FlashAttentionTriton
from cs336_systems.attention.flash_triton import (
    BwdConfig,
    KernelOptions,
    hopper_configs,
    launch,
    plans,
    tiles,
    use_configs,
)
from tests.attention_helpers import check_outputs, hopper_backward_configs, make_case, on_hopper, run_impl

DETERMINISTIC = KernelOptions(deterministic=True)


@pytest.mark.parametrize("d", sorted(hopper_configs.ONE_PASS_HEAD_DIMS))
def test_where_the_default_backward_is_one_pass_the_deterministic_one_is_two(d):
    assert hopper_configs.heuristic_bwd(d).one_pass  # the default adds dQ in a varying order
    cfg = hopper_configs.deterministic_backward(d)
    assert cfg == hopper_configs.TWO_PASS_BWD and not cfg.one_pass
    assert cfg.head_split(d) is not None  # the two-pass kernel takes this head dim
    changed = hopper_configs.deterministic_backward(d, "stages=3+shortest_first=True")
    assert (changed.stages, changed.shortest_first, changed.one_pass) == (3, True, False)
    for one_pass in ("consumer_regs=200+dq_regs=88", "dq_in_consumers=True"):
        with pytest.raises(ValueError, match="varying order"):
            hopper_configs.deterministic_backward(d, one_pass)


@pytest.mark.parametrize("d", [16, 32, 48, 96, 160, 256])
def test_elsewhere_the_default_backward_is_already_two_passes(d):
    cfg = hopper_configs.deterministic_backward(d)
    assert cfg == hopper_configs.heuristic_bwd(d) and not getattr(cfg, "one_pass", False)
    with pytest.raises(ValueError, match=f"head dim {d} uses HopperBwdConfig"):
        hopper_configs.deterministic_backward(d, "stages=3")


def test_a_one_pass_tl_configuration_contradicts_the_option_before_any_work():
    one_pass = BwdConfig(32, 64, 64, 32, dq="atomic")
    before = tiles.plan_state()
    varying = "dq='atomic' adds dQ's partial sums in a varying order"
    with pytest.raises(ValueError, match=varying), use_configs(bwd=one_pass, options=DETERMINISTIC):
        pass
    # pinned one inside the other, either way round
    with (
        use_configs(bwd=one_pass),
        pytest.raises(ValueError, match=varying),
        use_configs(options=DETERMINISTIC),
    ):
        pass
    with (
        use_configs(options=DETERMINISTIC),
        pytest.raises(ValueError, match=varying),
        use_configs(bwd=one_pass),
    ):
        pass
    assert tiles.plan_state() == before  # nothing stays pinned
    with use_configs(bwd=BwdConfig(32, 64, 64, 32), options=DETERMINISTIC):
        pass


@pytest.mark.parametrize(("d", "spec"), [(128, ""), (80, "stages=3"), (96, "")])
def test_the_launcher_hands_the_deterministic_configuration_to_the_hopper_backward(monkeypatch, d, spec):
    """launch.flash_bwd under KernelOptions(deterministic=True) gives the Hopper backward
    `deterministic_backward`'s configuration (recorded here instead of launched), and the option
    is part of the plan's key."""
    seen, backward = hopper_backward_configs(monkeypatch, d)
    with use_configs(options=KernelOptions(deterministic=True, hopper_bwd=spec)):
        backward()
        key = tiles.plan_state()
    backward()
    assert seen == [hopper_configs.deterministic_backward(d, spec), None]
    assert key != tiles.plan_state()


def test_on_the_cpu_the_deterministic_backward_is_the_portable_one(monkeypatch):
    """dQ by the tl pass after the dK/dV pass (the kernels its launch plan recorded), the same values."""
    monkeypatch.setattr(launch, "_BWD_PLANS", plans.PlanCache())
    case = make_case((2,), 70, 70, 32, torch.float32, is_causal=True)
    want = run_impl(FlashAttentionTriton.apply, case)
    default_plans = set(launch._BWD_PLANS._plans)
    with use_configs(options=DETERMINISTIC):
        got = run_impl(FlashAttentionTriton.apply, case)
    for name in ("o", "dq", "dk", "dv"):
        assert torch.equal(got[name], want[name]), name
    (key,) = set(launch._BWD_PLANS._plans) - default_plans  # the option's own plan
    assert _kernel_names(launch._BWD_PLANS._plans[key]) == [
        "flash_bwd_preprocess_kernel", "flash_bwd_dkdv_kernel", "flash_bwd_dq_kernel"
    ]  # fmt: skip


def _kernel_names(plan: plans.Plan) -> list[str]:
    return [getattr(getattr(x.fn, "fn", x.fn), "__name__", "") for x in plan.launches]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("hopper_kernels", [None, False], ids=["default", "portable"])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 80, 128])
def test_gpu_the_deterministic_backward_repeats_bit_for_bit(monkeypatch, hopper_kernels, is_causal, d):
    """Five backwards of one bf16 problem with many key tiles per query row (where a one-pass dQ's
    additions can come in any order): every bit of dQ, dK and dV the same each time, each as close to
    the float64 reference as the correctness matrix asks, and dQ by the tl pass after the dK/dV
    kernel (on Hopper by default the warp-specialised one)."""
    monkeypatch.setattr(launch, "_BWD_PLANS", plans.PlanCache())  # this test's recording alone
    case = make_case((2, 4), 1024, 1024, d, torch.bfloat16, device="cuda", is_causal=is_causal)
    with use_configs(options=KernelOptions(deterministic=True, hopper=hopper_kernels)):
        runs = [run_impl(FlashAttentionTriton.apply, case) for _ in range(5)]
    for name in ("dq", "dk", "dv"):
        assert all(torch.equal(r[name], runs[0][name]) for r in runs[1:]), name
    check_outputs(runs[0], case, atol=5e-2, rtol=5e-2, floor=1e-2)
    (plan,) = launch._BWD_PLANS._plans.values()
    names = _kernel_names(plan)
    dkdv = "flash_bwd_dkdv_ws_kernel" if on_hopper() and hopper_kernels is None else "flash_bwd_dkdv_kernel"
    assert names == ["flash_bwd_preprocess_kernel", dkdv, "flash_bwd_dq_kernel"], names
