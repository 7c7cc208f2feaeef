"""Analytic accounting: hand-computed cases, identities, and thresholds that hold at the bound and fail past it."""

import math

import numpy as np
import pytest
import torch

from cs336_systems import accounting as acc
from cs336_systems.model.config import get_config

# --------------------------------------------------------------------------------------------------
# Units, parameter counts, memory
# --------------------------------------------------------------------------------------------------


def test_units_and_dtype_bytes():
    assert (acc.GB, acc.GiB, acc.MB, acc.MiB) == (1e9, 2**30, 1e6, 2**20)
    assert acc.dtype_bytes("fp32") == acc.dtype_bytes(torch.float32) == 4
    assert acc.dtype_bytes("bf16") == acc.dtype_bytes(torch.bfloat16) == acc.dtype_bytes("float16") == 2
    with pytest.raises(ValueError, match="unknown dtype"):
        acc.dtype_bytes("fp13")


def test_xxl_counts_by_hand():
    # 126 blocks * 2 matrices * 16384 * 53248
    assert acc.XXL.num_params == 219_848_638_464 == 126 * 2 * 16384 * 53248
    # inputs of both linears in bf16: (16384 + 53248) * 2 bytes * 126 blocks
    assert acc.XXL.saved_activation_bytes_per_token() == 139_264 * 126 == 17_547_264
    assert acc.XXL.activation_tp_fraction == pytest.approx(53248 / (16384 + 53248))


def test_num_params_uses_model_config():
    cfg = get_config("small")
    assert acc.num_params(cfg) == cfg.num_params()
    assert acc.num_params(acc.XXL) == acc.XXL.num_params
    assert acc.num_params(7) == 7
    with pytest.raises(ValueError):
        acc.num_params(-3)


def test_xxl_state_memory_2025_a():
    mem = acc.ffn_stack_memory(acc.XXL, tokens=0)
    p = acc.XXL.num_params
    assert (mem.weights, mem.gradients, mem.optimizer_state) == (4 * p, 4 * p, 8 * p)
    assert mem.total == 16 * p == 3_517_578_215_424
    assert mem.total / acc.GiB == 3276.0  # exact: 16 * 126 * 2 * 2^14 * 13 * 2^12 = 3276 * 2^30
    assert acc.devices_to_hold(mem.total, 80 * acc.GB) == 44
    assert acc.devices_to_hold(mem.total, 80 * acc.GiB) == 41


def test_memory_terms_add_to_total():
    mem = acc.ffn_stack_memory(acc.XXL, tokens=1000)
    d = mem.as_dict(acc.GB)
    assert d["total"] == pytest.approx(
        d["weights"] + d["gradients"] + d["optimizer_state"] + d["activations"]
    )
    assert mem.activations == 1000 * 17_547_264
    assert mem.total == mem.state + mem.activations


def test_fsdp_memory_2025_b_threshold():
    mem = acc.ffn_stack_memory(acc.XXL, tokens=0)
    n = acc.min_fsdp_devices(mem, 95 * acc.GB)
    assert n == 38  # 3.5176e12 / 95e9 = 37.03
    assert acc.fsdp_memory_per_device(mem, 38).total <= 95e9 < acc.fsdp_memory_per_device(mem, 37).total
    assert acc.fsdp_memory_per_device(mem, 1).total == mem.total


def test_fsdp_memory_half_activations():
    mem = acc.MemoryBreakdown(weights=40.0, gradients=40.0, optimizer_state=80.0, activations=20.0)
    per = acc.fsdp_memory_per_device(mem, 4)  # (160 + 10) / 4 + 10
    assert per.total == pytest.approx(52.5)
    assert per.activations == pytest.approx(20 / 2 / 4 + 20 / 2)
    # capacity 52.5 fits at N = 4 exactly and not at N = 3; the unsharded half alone (10) never fits in 10
    assert acc.min_fsdp_devices(mem, 52.5) == 4
    assert acc.min_fsdp_devices(mem, 10.0) is None
    with pytest.raises(ValueError):
        acc.fsdp_memory_per_device(mem, 0)


def test_mesh_memory_per_device():
    mem = acc.MemoryBreakdown(weights=64.0, gradients=64.0, optimizer_state=128.0, activations=32.0)
    dp = acc.mesh_memory_per_device(mem, dp=4)
    assert dp.state == mem.state and dp.activations == 8.0
    fsdp = acc.mesh_memory_per_device(mem, fsdp=4)
    assert fsdp.total == pytest.approx(mem.total / 4)
    tp = acc.mesh_memory_per_device(mem, tp=4, activation_tp_fraction=0.75)
    assert tp.state == pytest.approx(mem.state / 4)
    assert tp.activations == pytest.approx(32 * (0.75 / 4 + 0.25))
    both = acc.mesh_memory_per_device(mem, fsdp=2, tp=4, activation_tp_fraction=1.0)
    assert both.total == pytest.approx(mem.total / 8)


def test_zero_memory_matches_paper_figure_1():
    # ZeRO (Rajbhandari et al. 2020) Figure 1: Psi = 7.5B, N_d = 64, K = 12.
    psi, n = 7_500_000_000, 64
    gb = [
        acc.zero_memory_per_device(psi, n, stage=s, bytes_per_param=acc.ZERO_MIXED_ADAM).total / 1e9
        for s in range(4)
    ]
    assert gb[0] == pytest.approx(120.0)
    assert gb[1] == pytest.approx(31.4, abs=0.05)
    assert gb[2] == pytest.approx(16.6, abs=0.05)
    assert gb[3] == pytest.approx(1.9, abs=0.05)
    with pytest.raises(ValueError):
        acc.zero_memory_per_device(psi, n, stage=4)


# --------------------------------------------------------------------------------------------------
# Collectives
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_ring_all_reduce_is_reduce_scatter_plus_all_gather(n):
    s, w = 6e9, 3e11
    assert acc.ring_all_reduce_time(s, n, w) == pytest.approx(
        acc.ring_reduce_scatter_time(s, n, w) + acc.ring_all_gather_time(s, n, w)
    )
    assert acc.ring_all_reduce_bytes(s, n) == pytest.approx(2 * (n - 1) / n * s)
    assert acc.alternate_ring_all_reduce_time(s, n, w) == pytest.approx((n - 1) * s / w)
    if n > 1:
        assert acc.alternate_ring_all_reduce_time(s, n, w) / acc.ring_all_reduce_time(
            s, n, w
        ) == pytest.approx(n / 2)


def test_step_latency_adds_per_step():
    assert acc.ring_all_reduce_time(0.0, 5, 1.0, step_latency_s=1e-3) == pytest.approx(2 * 4 * 1e-3)
    assert acc.alternate_ring_all_reduce_time(0.0, 5, 1.0, step_latency_s=1e-3) == pytest.approx(4e-3)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 6])
def test_simulated_ring_all_reduce_matches_formula(n):
    rng = np.random.default_rng(n)
    elems = 12 * 5  # divisible by every n here, so every chunk has S / N elements
    data = [rng.standard_normal(elems) for _ in range(n)]
    expected = np.sum(data, axis=0)
    rs, ag = acc.simulate_ring_all_reduce(data, itemsize=2)
    s = elems * 2
    for out in ag.outputs:
        np.testing.assert_allclose(out, expected)
    chunks = np.array_split(expected, n)
    for i, out in enumerate(rs.outputs):
        np.testing.assert_allclose(out, chunks[(i + 1) % n])
    np.testing.assert_allclose(rs.bytes_sent, acc.ring_reduce_scatter_bytes(s, n))
    np.testing.assert_allclose(rs.bytes_sent + ag.bytes_sent, acc.ring_all_reduce_bytes(s, n))
    w = 1e3
    assert rs.time(w) + ag.time(w) == pytest.approx(acc.ring_all_reduce_time(s, n, w))


@pytest.mark.parametrize("n", [1, 2, 4, 7])
def test_simulated_alternate_ring_matches_formula(n):
    rng = np.random.default_rng(10 + n)
    data = [rng.standard_normal(9) for _ in range(n)]
    trace = acc.simulate_alternate_ring_all_reduce(data, itemsize=4)
    for out in trace.outputs:
        np.testing.assert_allclose(out, np.sum(data, axis=0))
    np.testing.assert_allclose(trace.bytes_sent, acc.alternate_ring_all_reduce_bytes(9 * 4, n))
    assert trace.time(2.0) == pytest.approx(acc.alternate_ring_all_reduce_time(36, n, 2.0))


def test_collective_input_errors():
    with pytest.raises(ValueError, match="device count"):
        acc.ring_all_reduce_time(1.0, 0, 1.0)
    with pytest.raises(ValueError, match="bandwidth"):
        acc.ring_all_reduce_time(1.0, 2, 0.0)
    with pytest.raises(ValueError, match="same number"):
        acc.simulate_ring_all_reduce([np.zeros(3), np.zeros(4)])


# --------------------------------------------------------------------------------------------------
# 2026 section 8: one FFN layer
# --------------------------------------------------------------------------------------------------

B, D, DFF = 1024, 1024, 4096
# C / W = 256 exactly, so B W / C = 4 and 1.5 D_FF W / C = 24
W = 1e11
C = 256 * W


def test_ffn_flops_by_hand():
    assert acc.ffn_forward_flops(B, D, DFF) == 6 * B * D * DFF
    assert acc.dp_backward_flops_per_device(B, D, DFF, 4) == 12 * B * D * DFF / 4
    assert acc.tp_forward_flops_per_device(B, D, DFF, 8) == 6 * B * D * DFF / 8
    assert acc.fsdp_tp_forward_flops_per_device(B, D, DFF, 2, 4) == 6 * B * D * DFF / 8


def test_comm_times_by_hand():
    n = 4
    assert acc.dp_backward_comm_time(D, DFF, n, W) == pytest.approx(12 * (n - 1) * D * DFF / (n * W))
    assert acc.fsdp_forward_comm_time(D, DFF, n, W) == pytest.approx(6 * (n - 1) * D * DFF / (n * W))
    assert acc.fsdp_backward_comm_time(D, DFF, n, W) == pytest.approx(12 * (n - 1) * D * DFF / (n * W))
    assert acc.tp_forward_comm_time(B, D, n, W) == pytest.approx(4 * (n - 1) * B * D / (n * W))
    assert acc.tp_backward_comm_time(B, D, n, W) == acc.tp_forward_comm_time(B, D, n, W)


def _check_threshold(n_max_closed_form, comm, compute):
    """The closed form is an integer here; it holds at n_max and fails at n_max + 1 (and brute force agrees)."""
    n_max = round(n_max_closed_form)
    assert n_max == pytest.approx(n_max_closed_form)
    assert comm(n_max) <= compute(n_max) * (1 + 1e-12)
    assert comm(n_max + 1) > compute(n_max + 1)
    assert acc.largest_compute_bound_n(comm, compute, n_max=10_000) == n_max


def test_dp_bound():
    n_max = acc.dp_max_devices(B, C, W)
    assert n_max == 1 + B * W / C == 5
    _check_threshold(
        n_max,
        lambda n: acc.dp_backward_comm_time(D, DFF, n, W),
        lambda n: acc.dp_backward_flops_per_device(B, D, DFF, n) / C,
    )


def test_fsdp_bound_forward_and_backward():
    n_max = acc.fsdp_max_devices(B, C, W)
    assert n_max == 5
    _check_threshold(
        n_max,
        lambda n: acc.fsdp_forward_comm_time(D, DFF, n, W),
        lambda n: acc.fsdp_forward_flops_per_device(B, D, DFF, n) / C,
    )
    _check_threshold(
        n_max,
        lambda n: acc.fsdp_backward_comm_time(D, DFF, n, W),
        lambda n: acc.fsdp_backward_flops_per_device(B, D, DFF, n) / C,
    )


def test_tp_bounds():
    fwd, bwd = acc.tp_max_devices_forward(DFF, C, W), acc.tp_max_devices_backward(DFF, C, W)
    assert fwd == 1 + 1.5 * DFF * W / C == 25
    assert bwd == 1 + 3 * DFF * W / C == 49
    _check_threshold(
        fwd,
        lambda n: acc.tp_forward_comm_time(B, D, n, W),
        lambda n: acc.tp_forward_flops_per_device(B, D, DFF, n) / C,
    )
    _check_threshold(
        bwd,
        lambda n: acc.tp_backward_comm_time(B, D, n, W),
        lambda n: acc.tp_backward_flops_per_device(B, D, DFF, n) / C,
    )


def test_fsdp_tp_overlapped_bound():
    n_f, n_t = acc.fsdp_tp_max_axes_overlapped(B, DFF, C, W)
    assert (n_f, n_t) == (4, 24)
    assert acc.fsdp_tp_max_devices_overlapped(B, DFF, C, W) == 1.5 * B * DFF * W**2 / C**2 == 96

    def bound(nf, nt):
        t = acc.fsdp_tp_forward_comm_times(B, D, DFF, nt, nf, W, exact=False)
        return t.overlapped <= acc.fsdp_tp_forward_flops_per_device(B, D, DFF, nt, nf) / C * (1 + 1e-12)

    assert bound(4, 24)
    assert not bound(5, 24) and not bound(4, 25)
    # the exact (N-1)/N form allows one more device on each axis
    nf_x, nt_x = acc.fsdp_tp_max_axes_overlapped(B, DFF, C, W, exact=True)
    assert (nf_x, nt_x) == (5, 25)
    t = acc.fsdp_tp_forward_comm_times(B, D, DFF, 25, 5, W, exact=True)
    assert t.overlapped == pytest.approx(acc.fsdp_tp_forward_flops_per_device(B, D, DFF, 25, 5) / C)


def test_fsdp_tp_serialized_bound_is_am_gm_optimum():
    n_f, n_t = acc.fsdp_tp_max_axes_serialized(B, DFF, C, W)
    assert (n_f, n_t) == (2, 12)
    n_max = acc.fsdp_tp_max_devices_serialized(B, DFF, C, W)
    assert n_max == pytest.approx(3 / 8 * B * DFF * W**2 / C**2) == 24
    assert n_max == pytest.approx(acc.fsdp_tp_max_devices_overlapped(B, DFF, C, W) / 4)

    def slack(nf, nt):
        t = acc.fsdp_tp_forward_comm_times(B, D, DFF, nt, nf, W, exact=False)
        return acc.fsdp_tp_forward_flops_per_device(B, D, DFF, nt, nf) / C - t.serialized

    assert slack(n_f, n_t) == pytest.approx(0.0, abs=1e-15)  # equality at the optimum
    # any other split of the same N is communication-bound; more devices are too
    for ratio in (0.5, 0.9, 1.1, 2.0, 4.0, 12.0):
        assert slack(n_f * ratio, n_t / ratio) < 0
    assert slack(n_f * 1.01, n_t) < 0 and slack(n_f, n_t * 1.01) < 0


# --------------------------------------------------------------------------------------------------
# 2025 communication_accounting (c): Scaling Book mixed FSDP + TP on TPU v5p
# --------------------------------------------------------------------------------------------------


def test_tpu_v5p_mixed_fsdp_tp_batch():
    s = acc.MixedFsdpTpSetting(d_model=16384, d_ff=53248, x=16, y=4, m_x=2, m_y=1)
    assert s.n == 64
    assert s.alpha == pytest.approx(4.6e14 / 1.8e11)
    # max criterion: B >= alpha X / m_x = 2555.6 * 8; TP side needs F >= alpha Y / m_y = 10,222 (holds)
    assert s.min_batch(combine="max") == pytest.approx(2555.5556 * 8, rel=1e-6)
    assert s.min_batch_per_device(combine="max") == pytest.approx(2555.5556 * 8 / 64, rel=1e-6)
    assert s.tp_fraction() == pytest.approx(2555.5556 * 4 / 53248, rel=1e-6)
    # the book's sum criterion: B >= alpha X / (m_x (1 - alpha Y / (m_y F)))
    b = s.min_batch(combine="sum")
    assert b == pytest.approx(20_444.44 / (1 - 0.191974), rel=1e-5)
    assert b / 64 == pytest.approx(395.34, rel=1e-4)
    for combine in ("sum", "max"):
        b = s.min_batch(combine=combine)
        assert s.is_compute_bound(b, combine=combine)
        assert not s.is_compute_bound(0.99 * b, combine=combine)
    with pytest.raises(ValueError, match="combine"):
        s.min_batch(combine="mean")


def test_tpu_optimal_mix_matches_quadratic_discriminant():
    f, n = 53248, 64
    per_device = acc.mixed_fsdp_tp_optimal_min_batch_per_device(f)
    b = per_device * n
    x_star = acc.mixed_fsdp_tp_optimal_x(b, n, f)
    alpha = 4.6e14 / 1.8e11
    assert x_star == pytest.approx(b * 2 / (2 * alpha))  # the double root B m_x / (2 alpha)
    s = acc.MixedFsdpTpSetting(d_model=16384, d_ff=f, x=x_star, y=n / x_star)
    assert s.t_fsdp() + s.t_tp(b) == pytest.approx(s.t_math(b))
    # the book's rule of thumb with m_x = 2, m_y = 1: 2 alpha^2 / F
    assert per_device == pytest.approx(2 * alpha**2 / f)


def test_tp_only_mesh_is_never_compute_bound_when_tp_term_dominates():
    s = acc.MixedFsdpTpSetting(d_model=1024, d_ff=4096, x=1, y=64)
    assert math.isinf(s.min_batch())


# --------------------------------------------------------------------------------------------------
# 2025 ddp_bucketed_benchmarking (b)
# --------------------------------------------------------------------------------------------------


def _simulate_serial_stream(n_b, comm, compute):
    end = 0.0
    for k in range(1, n_b + 1):
        end = max(end, k * compute) + comm
    return end - n_b * compute


def test_bucket_overhead_model():
    s, w, o = 400e6, 50e9, 1e-4
    assert acc.ddp_bucket_overhead(s, w, o, 4) == pytest.approx(4 * 1e-4 + 400e6 / (4 * 50e9))
    # the closed form is the serial-stream pipeline with compute per bucket s / (n_b w)
    for n_b in (1, 2, 7, 40):
        c = s / (n_b * w)
        assert acc.bucket_pipeline_overhead(n_b, o + c, c) == pytest.approx(
            acc.ddp_bucket_overhead(s, w, o, n_b)
        )
        assert acc.bucket_pipeline_overhead(n_b, o + c, c) == pytest.approx(
            _simulate_serial_stream(n_b, o + c, c)
        )
    # if compute per bucket exceeds comm per bucket only the last bucket's all-reduce is exposed
    assert (
        acc.bucket_pipeline_overhead(5, 1.0, 2.0)
        == pytest.approx(_simulate_serial_stream(5, 1.0, 2.0))
        == 1.0
    )


def test_bucket_optimum():
    s, w, o = 400e6, 50e9, 1e-4
    n_star = acc.ddp_optimal_num_buckets(s, w, o)
    assert n_star == pytest.approx(math.sqrt(s / (w * o)))
    assert acc.ddp_optimal_bucket_bytes(s, w, o) * n_star == pytest.approx(s)
    best = acc.ddp_bucket_overhead(s, w, o, n_star)
    assert best == pytest.approx(acc.ddp_min_overhead(s, w, o)) == pytest.approx(2 * math.sqrt(s * o / w))
    grid = np.linspace(0.1 * n_star, 10 * n_star, 999)
    assert np.all(acc.ddp_bucket_overhead(s, w, o, grid) >= best * (1 - 1e-12))
    assert acc.num_buckets_for_size(s, 100e6) == 4 and acc.num_buckets_for_size(s, 1e12) == 1


def test_fit_recovers_overhead_parameters():
    s, w, o = 2e9, 80e9, 3e-4
    n_b = np.array([1, 2, 4, 20, 200, 2000])
    y = acc.ddp_bucket_overhead(s, w, o, n_b)
    o_fit, w_fit = acc.fit_ddp_overhead_model(n_b, y, s)
    assert o_fit == pytest.approx(o) and w_fit == pytest.approx(w)
    with pytest.raises(ValueError):
        acc.fit_ddp_overhead_model([4, 4], [1.0, 1.0], s)


# --------------------------------------------------------------------------------------------------
# 2025 optimizer_state_sharding_accounting (c)
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 4, 8])
def test_zero1_vs_ours_comm_volume(n):
    psi = get_config("xl").num_params()
    dp = acc.dp_comm_volume(psi, n)
    zero1 = acc.zero1_comm_volume(psi, n)
    ours = acc.broadcast_sharded_optimizer_comm_volume(psi, n)
    assert zero1.total == pytest.approx(dp.total) == pytest.approx(2 * (n - 1) / n * 4 * psi)
    assert ours.total == pytest.approx(1.5 * zero1.total)
    # mixed precision (fp16 grads and params): ZeRO's 2 Psi elements of 2 bytes, times (N-1)/N
    assert acc.zero1_comm_volume(psi, n, grad_bytes=2, param_bytes=2).total == pytest.approx(
        (n - 1) / n * 4 * psi
    )


def test_tpu_fp8_weight_gathers_halve_the_fsdp_term():
    bf16 = acc.MixedFsdpTpSetting(d_model=16384, d_ff=53248, x=16, y=4)
    fp8 = acc.MixedFsdpTpSetting(d_model=16384, d_ff=53248, x=16, y=4, weight_bytes=1)
    assert fp8.t_fsdp() == pytest.approx(bf16.t_fsdp() / 2)
    assert fp8.min_batch(combine="max") == pytest.approx(bf16.min_batch(combine="max") / 2)
    assert fp8.min_batch() == pytest.approx(bf16.min_batch() / 2)
    assert fp8.is_compute_bound(fp8.min_batch()) and not fp8.is_compute_bound(0.99 * fp8.min_batch())


def test_gpu_takes_its_compute_rate_from_the_datasheet_table_and_rejects_unknown_names():
    from cs336_systems.accounting.hardware import H200_SXM, gpu, peak_flops

    assert H200_SXM.flops_per_s == peak_flops("H200 SXM", "bf16")
    assert H200_SXM.memory_bytes == 141e9
    with pytest.raises(ValueError, match="no bf16 peak"):
        gpu("Mystery GPU", link_bytes_per_s=1e9, memory_gb=1, source="none")
