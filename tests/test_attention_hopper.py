"""The Hopper (Gluon) FlashAttention kernels: chosen automatically on sm_90, forcible either way,
and the same function as the float64 reference over today's correctness matrix.

Gluon kernels do not run under the Triton interpreter: the numerical tests are `gpu`-marked and run
on an H100/H200 (the committed log of that run is figures/data/flash_hopper__gpu_tests.log). The
selection rules are checked on the CPU.
"""

from __future__ import annotations

import dataclasses
import heapq

import pytest
import torch

from cs336_systems.attention import FlashAttentionTriton
from cs336_systems.attention.flash_triton import (
    KernelOptions,
    hopper,
    hopper_configs,
    launch,
    tiles,
    use_configs,
)
from cs336_systems.studies.attention.flash_tuning import HOPPER_ONE_PASS_CANDIDATES
from tests.attention_helpers import check_outputs, hopper_backward_configs, make_case, on_hopper, run_impl

HOPPER = KernelOptions(hopper=True)
PORTABLE = KernelOptions(hopper=False)


@pytest.mark.parametrize(
    ("d", "d0"), [(16, 16), (64, 64), (128, 128), (256, 256), (80, 64), (96, 64), (48, 32), (160, 128), (192, 128),
                  (8, None), (72, None), (100, None), (112, None), (512, None)],
)  # fmt: skip
def test_head_dims_split_into_two_power_of_two_blocks(d, d0):
    assert hopper_configs.split_head_dim(d) == d0


def test_cpu_tensors_fall_back_to_the_portable_kernels_and_forcing_is_an_error():
    q = torch.randn(1, 2, 16, 64)
    assert not hopper.use_hopper(None, q, q, q)
    assert not hopper.use_hopper(False, q, q, q)
    with pytest.raises(ValueError, match="Hopper kernels forced"):
        hopper.use_hopper(True, q, q, q)


@pytest.mark.parametrize(
    ("d", "default", "default_bwd"),
    [(64, False, True), (128, True, True), (80, True, True), (96, True, True), (48, True, True),
     (32, False, False), (72, False, False), (160, False, False), (256, False, False)],
)  # fmt: skip
def test_the_gluon_kernels_are_preferred_where_they_were_measured_faster(d, default, default_bwd):
    """Split head dims (the tl kernels would pad them) and d = 128 (the warp-specialised kernels); the
    backward also at d = 64, where the one-pass kernel beats the tl passes."""
    assert hopper.preferred(d) is default
    assert hopper.preferred(d, "bwd") is default_bwd


@pytest.mark.parametrize(("kind", "d", "kernels"), [
    ("fwd", 80, ["flash_fwd_ws_kernel"]),
    ("fwd", 96, ["flash_fwd_hopper_kernel"]),
    ("fwd", 128, ["flash_fwd_ws_kernel"]),
    ("bwd", 128, ["flash_bwd_preprocess_kernel", "zero_kernel", "flash_bwd_dkdv_ws_kernel", "cast_rows_kernel"]),
])  # fmt: skip
def test_the_launchers_launches_are_recorded_on_meta_tensors(kind, d, kernels):
    """offline.hopper_launches runs a Hopper launcher on "meta" tensors and records its launches (Delta,
    the zeroed float32 dQ, the one-pass kernel and dQ's cast in the backward) without making them; the
    Hopper kernels take host TMA descriptors of those tensors, boxes (1, 1, rows, W), first block 64
    columns wide where d splits (80 = 64 + 16, 128 in the backward's two halves)."""
    from cs336_systems.studies.attention import flash_offline as offline

    recorded = offline.hopper_launches(kind, d, True)
    assert [r.name for r in recorded] == kernels
    main = recorded[0] if kind == "fwd" else recorded[2]
    assert main.kwargs["IS_CAUSAL"] is True and main.kwargs["D"] == d
    descs = [a for a in main.args if hasattr(a, "block_shape")]
    assert descs and all(a.base.device.type == "meta" for a in descs)
    widths = {(a.block_shape[0], a.block_shape[1], a.block_shape[-1]) for a in descs[:2]}
    assert widths == ({(1, 1, 128)} if (kind, d) == ("fwd", 128) else {(1, 1, 64), (1, 1, d - 64)})


def test_warp_specialised_configs_must_fit_the_register_file():
    """setmaxnreg budgets are multiples of 8 in 24..256, and the launch (every warpgroup, the producer's
    too, at the launch cap) fits an SM's 65,536 registers: checked when the configuration is made."""
    hopper_configs.WarpSpecializedBwdConfig(consumer_regs=240, dq_in_consumers=True)  # 3 x 128 x 168 = 64,512
    hopper_configs.WarpSpecializedFwdConfig(consumers=3, consumer_regs=160)
    with pytest.raises(ValueError, match="3 warpgroups need 67584 registers"):  # the cap 176 at 248
        hopper_configs.WarpSpecializedBwdConfig(consumer_regs=248, dq_in_consumers=True)
    with pytest.raises(ValueError, match="4 warpgroups need 73728 registers"):
        hopper_configs.WarpSpecializedBwdConfig(consumer_regs=208, dq_regs=120)
    with pytest.raises(ValueError, match="multiples of 8"):
        hopper_configs.WarpSpecializedFwdConfig(consumer_regs=244)


def test_spills_are_counted_inside_the_loops_that_issue_products():
    """Only LDL/STL in the innermost predicated back-edge spans that contain an HGMMA count; a barrier
    retry's unpredicated jump back into the body is not a loop."""
    from cs336_systems.studies.attention import flash_offline as offline

    sass = """
        /*0000*/  LDL R1, [R1] ;
        /*0010*/  HGMMA.64x64x16.F32 R24, gdesc[UR4], RZ ;
        /*0020*/  LDL R2, [R1+0x4] ;
        /*0030*/  STL [R1+0x8], R2 ;
        /*0040*/  @P0 BRA 0x10 ;
        /*0050*/  FADD R3, R3, R4 ;
        /*0060*/  LDL R5, [R1+0xc] ;
        /*0070*/  @!P1 BRA 0x50 ;
        /*0080*/  STL [R1+0x10], R5 ;
        /*0090*/  BRA 0x0 ;
    """
    assert offline.loop_local_accesses(sass) == 2  # the LDL and STL of the product loop 0x10-0x40


def test_exponentials_count_as_overlapped_only_before_the_loops_wait_for_every_product():
    """In a product loop, MUFU.EX2 before the first `WARPGROUP.DEPBAR.LE gsb0, 0x0` runs beside a product
    in flight; one after it does not; loops without exponentials are not listed."""
    from cs336_systems.studies.attention import flash_offline as offline

    sass = """
        /*0000*/  HGMMA.64x64x16.F32 R24, gdesc[UR4], RZ ;
        /*0010*/  WARPGROUP.DEPBAR.LE gsb0, 0x1 ;
        /*0020*/  MUFU.EX2 R1, R1 ;
        /*0030*/  @P1 MUFU.EX2 R2, R2 ;
        /*0040*/  WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
        /*0050*/  MUFU.EX2 R3, R3 ;
        /*0060*/  @P0 BRA 0x0 ;
        /*0070*/  HGMMA.64x64x16.F32 R24, gdesc[UR4], RZ ;
        /*0080*/  @P0 BRA 0x70 ;
    """
    assert offline.exponentials_under_products(sass) == [(3, 2)]


def test_barriers_count_inside_the_product_loops_only():
    from cs336_systems.studies.attention import flash_offline as offline

    sass = """
        /*0000*/  BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0010*/  BAR.SYNC.DEFER_BLOCKING 0x2, 0x80 ;
        /*0020*/  HGMMA.64x64x16.F32 R24, gdesc[UR4], RZ ;
        /*0030*/  @P2 BAR.SYNC.DEFER_BLOCKING 0x2, 0x80 ;
        /*0040*/  @P0 BRA 0x10 ;
        /*0050*/  BAR.SYNC.DEFER_BLOCKING 0x0 ;
    """
    assert offline.loop_barriers(sass) == 2  # the two of the loop 0x10-0x40


@pytest.mark.timeout(900)
def test_every_default_hopper_path_compiles_for_sm90_without_a_gpu():
    """The Gluon kernels do not run under the interpreter; compiled offline for sm_90a with the installed
    Triton (3.6 on the GPU hosts, 3.7 here in CI; their Gluon APIs differ) every default path's kernel
    must compile and fit a block's shared memory, and below d = 128 none may spill (studies/attention/flash_offline.py)."""
    import json
    import os
    import subprocess
    import sys

    from cs336_systems.studies.attention import flash_offline as offline

    command = [sys.executable, "-m", "cs336_systems.studies.attention.flash_offline", "--json"]
    out = subprocess.run(command, env=os.environ | {"TRITON_INTERPRET": "0"}, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-4000:]
    rows = json.loads(out.stdout)["rows"]
    assert sorted((r["kind"], r["d"]) for r in rows) == sorted(
        (k, d) for k in ("fwd", "bwd") for d in (64, 80, 128)
    )
    assert all(0 < r["shared_bytes"] <= offline.SM90_SHARED_BYTES and r["registers"] > 0 for r in rows), rows
    small = [r for r in rows if r["d"] < 128 or r["kind"] == "fwd"]
    assert all(r["loop_local_accesses"] == 0 for r in small), rows
    # outside the loops at most one 8-byte slot: Triton 3.7 spills one in the d = 80 one-pass backward,
    # whose partitions take the host descriptors' addresses ([Note: descriptors made on the host])
    assert all(r["spill_stores"] <= 8 and r["spill_loads"] <= 8 for r in small), rows
    # d = 128 backward: two consumers at 240 registers hold 128-wide dK and dV accumulators; ptxas spills
    # a few loop-invariant scalars (OPTIMIZATION_LOG, "Session 12"), never an accumulator (kilobytes)
    assert all(r["spill_stores"] < 512 for r in rows), rows
    # the softmax's exponentials overlap the warpgroup's own products where the wait for them comes after
    # ([Note: the wait for P V after the softmax]): the backwards and d = 128's forward; ptxas moves d = 80's
    # wait (three consumers keep the wait where ptxas puts it: measured faster, OPTIMIZATION_LOG session 21)
    under = {(r["kind"], r["d"]): (r["exponentials_under_products"], r["loop_exponentials"]) for r in rows}
    assert all(0 < n == total for (kind, d), (n, total) in under.items() if kind == "bwd" or d == 128), under
    assert under[("fwd", 80)][0] == 0 < under[("fwd", 80)][1], under


@pytest.mark.timeout(600)
def test_interleaved_dq_rows_compile_for_whole_tiles_without_more_barriers_offline():
    """Compiled for sm_90a without a GPU ([Note: dQ's staging rows interleaved]): at d = 128 the
    interleaved staging (the default there, where N is a multiple of 64) keeps the plain staging's
    warpgroup barriers a step and spills less; at a ragged N the launcher keeps the plain staging."""
    import json
    import os
    import subprocess
    import sys

    snippet = (
        "import json, dataclasses\n"
        "from cs336_systems.studies.attention import flash_offline as o\n"
        "from cs336_systems.attention.flash_triton import hopper_configs as h\n"
        "inter = h.heuristic_bwd(128)\n"
        "base = dataclasses.replace(inter, dq_rows_interleaved=False)\n"
        "dkdv = lambda c, n: [r for r in o.hopper_launches('bwd', 128, True, c, n) if 'dkdv' in r.name][0]\n"
        "rows = [dataclasses.asdict(o.compile_sm90(dkdv(c, 1024))) for c in (base, inter)]\n"
        "rank5 = lambda r: any(len(getattr(a, 'block_shape', ())) == 5 for a in r.args)\n"
        "print(json.dumps(rows + [rank5(dkdv(inter, 1024)), rank5(dkdv(inter, 1000))]))\n"
    )
    out = subprocess.run([sys.executable, "-c", snippet], env=os.environ | {"TRITON_INTERPRET": "0"},
                         capture_output=True, text=True)  # fmt: skip
    assert out.returncode == 0, out.stderr[-4000:]
    base, inter, whole, ragged = json.loads(out.stdout.strip().splitlines()[-1])
    assert inter["loop_barriers"] == base["loop_barriers"]
    assert (
        inter["loop_local_accesses"] < base["loop_local_accesses"]
        and inter["spill_stores"] < base["spill_stores"]
    )
    assert whole is True and ragged is False  # the interleaved (rank-5) dQ descriptors


@pytest.mark.parametrize(("d", "in_consumers"), [(64, False), (80, False), (128, True)])
def test_the_one_pass_backward_is_the_default_where_it_was_measured_faster(d, in_consumers):
    """A dQ warpgroup at d = 64, 80; at d = 128 (no registers for a third warpgroup) the consumers,
    with dQ's staging rows interleaved (measured faster only there)."""
    cfg = hopper_configs.heuristic_bwd(d)
    assert isinstance(cfg, hopper_configs.WarpSpecializedBwdConfig) and cfg.one_pass
    assert cfg.dq_in_consumers is in_consumers and cfg.head_split(d) is not None
    assert cfg.dq_rows_interleaved is in_consumers


@pytest.mark.parametrize(
    "cfg",
    [hopper_configs.WarpSpecializedFwdConfig(), hopper_configs.WarpSpecializedFwdConfig(consumers=3, consumer_regs=160),
     hopper_configs.WarpSpecializedBwdConfig(), hopper_configs.WarpSpecializedBwdConfig(consumers=3, consumer_regs=160),
     *hopper_configs.ONE_PASS_CONFIGS.values(),
     *(hopper_configs.WarpSpecializedBwdConfig(*c) for cands in HOPPER_ONE_PASS_CANDIDATES.values() for c in cands)],
    ids=str,
)  # fmt: skip
def test_warp_specialized_register_budget_fits_one_program_per_sm(cfg):
    """The launch cap spread over the program's warpgroups (consumers, the producer, a one-pass
    backward's dQ warpgroup) covers their registers (else setmaxnreg.inc would wait forever) and fits
    the 64K-register file."""
    dq_regs = getattr(cfg, "dq_regs", 0)
    warpgroups = cfg.consumers + 1 + (dq_regs > 0)
    assert cfg.maxnreg % 8 == 0
    assert warpgroups * cfg.maxnreg >= cfg.consumers * cfg.consumer_regs + 24 + dq_regs
    assert warpgroups * 128 * cfg.maxnreg <= 65536


@pytest.mark.parametrize("bad", [dict(consumers=3, consumer_regs=160), dict(block_m=32)], ids=str)
def test_the_one_pass_backward_takes_two_consumers_and_64_query_steps(bad):
    with pytest.raises(ValueError, match="one-pass backward takes two consumers and 64-query steps"):
        hopper_configs.WarpSpecializedBwdConfig(dq_regs=136, **bad)


def test_the_warp_specialized_kernels_are_the_defaults_at_d128_and_the_d80_forward():
    assert isinstance(hopper_configs.heuristic_fwd(128), hopper_configs.WarpSpecializedFwdConfig)
    assert isinstance(hopper_configs.heuristic_bwd(128), hopper_configs.WarpSpecializedBwdConfig)
    assert isinstance(hopper_configs.heuristic_bwd(96), hopper_configs.HopperBwdConfig)
    assert isinstance(hopper_configs.heuristic_fwd(64), hopper_configs.HopperFwdConfig)
    assert isinstance(hopper_configs.heuristic_fwd(80), hopper_configs.WarpSpecializedFwdConfig)
    assert isinstance(hopper_configs.heuristic_fwd(96), hopper_configs.HopperFwdConfig)


@pytest.mark.gpu
def test_gpu_hopper_is_the_default_on_sm90_for_16_bit_inputs_at_padded_head_dims():
    q = torch.randn(1, 2, 128, 80, device="cuda", dtype=torch.bfloat16)
    assert hopper.use_hopper(None, q, q, q) == on_hopper()
    assert not hopper.use_hopper(None, q.float(), q.float(), q.float())  # fp32: the tl kernels
    assert not hopper.use_hopper(False, q, q, q)
    q64 = torch.randn(1, 2, 128, 64, device="cuda", dtype=torch.bfloat16)
    assert not hopper.use_hopper(None, q64, q64, q64)  # power of two: the (faster) tl forward
    assert hopper.use_hopper(None, q64, q64, q64, kind="bwd") == on_hopper()  # the one-pass backward
    assert hopper.use_hopper(True, q64, q64, q64) == on_hopper()
    q128 = torch.randn(1, 2, 128, 128, device="cuda", dtype=torch.bfloat16)
    assert hopper.use_hopper(None, q128, q128, q128) == on_hopper()  # the warp-specialised kernels


needs_sm90 = pytest.mark.skipif(not on_hopper(), reason="needs an sm_90 GPU")
HOPPER_DTYPES = [
    pytest.param(torch.bfloat16, 5e-2, 5e-2, 1e-2, id="bf16"),
    pytest.param(torch.float16, 1e-2, 1e-2, 2e-3, id="fp16"),
]


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize(("dtype", "atol", "rtol", "floor"), HOPPER_DTYPES)
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [16, 32, 48, 64, 80, 96, 128, 160, 256])
@pytest.mark.parametrize(
    ("batch", "n_q", "n_k"), [((2,), 1, 1), ((1, 3), 97, 250), ((1, 3), 300, 97), ((1, 2), 1025, 1025)]
)
def test_gpu_hopper_matches_float64(batch, n_q, n_k, d, is_causal, dtype, atol, rtol, floor):
    case = make_case(batch, n_q, n_k, d, dtype, device="cuda", is_causal=is_causal)
    with use_configs(options=HOPPER):  # the Gluon forward and dK/dV kernels, dQ by the tl kernel
        ours = run_impl(FlashAttentionTriton.apply, case)
    check_outputs(ours, case, atol, rtol, floor)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("cfg", [hopper_configs.HopperFwdConfig(128, 64, 2, 8), hopper_configs.HopperFwdConfig(128, 128, 2, 8),
                                 hopper_configs.HopperFwdConfig(64, 64, 3, 4), hopper_configs.HopperFwdConfig(128, 32, 4, 8),
                                 hopper_configs.HopperFwdConfig(128, 64, 3, 8, head_major=False)],
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


WS_CONFIGS = [
    hopper_configs.WarpSpecializedFwdConfig(pingpong=True),
    hopper_configs.WarpSpecializedFwdConfig(pingpong=False),
    hopper_configs.WarpSpecializedFwdConfig(head_major=False),
    hopper_configs.WarpSpecializedFwdConfig(stages=3),
    hopper_configs.WarpSpecializedFwdConfig(block_n=64, stages=3, pingpong=True),
    hopper_configs.WarpSpecializedFwdConfig(block_n=64, stages=3),  # d = 80's default in session 19
    hopper_configs.WarpSpecializedFwdConfig(consumers=3, consumer_regs=152, block_n=64, stages=3),
    hopper_configs.WarpSpecializedFwdConfig(  # d = 80's
        consumers=3, consumer_regs=152, block_n=64, stages=3, late_pv_wait=False
    ),
    hopper_configs.WarpSpecializedFwdConfig(
        consumers=3, block_n=64, stages=3, consumer_regs=160, pingpong=True
    ),
    # the wait for P V where ptxas puts it (before the softmax): kept for A/Bs
    hopper_configs.WarpSpecializedFwdConfig(stages=3, late_pv_wait=False),
]


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("cfg", WS_CONFIGS, ids=str)
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [16, 64, 80, 128])
@pytest.mark.parametrize(
    ("batch", "n_q", "n_k"), [((2, 3), 1, 1), ((1, 3), 97, 250), ((1, 3), 300, 97), ((2, 2), 1025, 1025)]
)
def test_gpu_warp_specialized_forward_matches_float64_and_writes_every_element(
    cfg, is_causal, d, batch, n_q, n_k
):
    """The producer/consumer forward: ragged N (a program's second warpgroup past the last row, key
    tiles past N_k), causal and not, split head dims (80 = 64 + 16), every output element written."""
    case = make_case(batch, n_q, n_k, d, torch.bfloat16, device="cuda", is_causal=is_causal)
    q4, k4, v4 = (t.detach() for t in (case.q, case.k, case.v))
    o = torch.full_like(q4, float("nan"))
    lse = torch.full(q4.shape[:-1], float("nan"), device="cuda")
    hopper.flash_fwd_hopper(q4, k4, v4, o, lse, is_causal, cfg)
    torch.cuda.synchronize()
    qd, kd, vd = q4.double(), k4.double(), v4.double()
    scores = qd @ kd.transpose(-1, -2) / d**0.5
    if is_causal:  # top-left aligned
        keep = torch.ones(n_q, n_k, device="cuda", dtype=torch.bool).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    want_lse = torch.logsumexp(scores, -1)
    want = torch.softmax(scores, -1) @ vd
    assert torch.isfinite(o).all() and torch.isfinite(lse).all()
    torch.testing.assert_close(o.double(), want, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-2, rtol=1e-3)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize(
    "cfg",
    [
        hopper_configs.WarpSpecializedBwdConfig(),
        hopper_configs.WarpSpecializedBwdConfig(stages=3),
        hopper_configs.WarpSpecializedBwdConfig(block_m=32, stages=4, consumer_regs=160, consumers=3),
    ],
    ids=str,
)
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [16, 64, 80])
@pytest.mark.parametrize(
    ("batch", "n_q", "n_k"), [((2, 3), 1, 1), ((1, 3), 97, 250), ((1, 3), 300, 97), ((2, 2), 1025, 1025)]
)
def test_gpu_warp_specialized_dkdv_matches_the_portable_pass(cfg, is_causal, d, batch, n_q, n_k):
    """The producer/consumer dK/dV pass against the tl pass on the same operands (itself checked
    against float64 elsewhere): ragged N (a program's second warpgroup past the last key), causal
    and not, split head dims, every element of dK and dV written."""
    tensors = _portable_backward(batch, n_q, n_k, d, is_causal, ("dkdv",))
    want_dk, want_dv = tensors[5].clone(), tensors[6].clone()
    tensors[5].fill_(float("nan"))
    tensors[6].fill_(float("nan"))
    assert not hopper.flash_bwd_hopper(tensors, is_causal, cfg)
    torch.cuda.synchronize()
    for got, want in ((tensors[5], want_dk), (tensors[6], want_dv)):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


def _portable_backward(batch, n_q, n_k, d, is_causal, passes):
    """The backward operands of a random bf16 case with the tl kernels' `passes` run on them (the
    reference the Gluon passes are checked against on the same operands)."""
    case = make_case(batch, n_q, n_k, d, torch.bfloat16, device="cuda", is_causal=is_causal)
    q, k, v, do = (t.detach() for t in (case.q, case.k, case.v, case.do))
    with use_configs(options=PORTABLE):
        o, lse = launch.flash_fwd(q, k, v, is_causal)
        tensors, _ = launch.prepare_backward(do, q, k, v, o, lse)
        launch.launch_bwd(tensors, is_causal, tiles.current_config("bwd", n_q, n_k, d, q.dtype, is_causal), PORTABLE,
                          launch.use_tma(PORTABLE, q.device, *tensors[:7]), passes)  # fmt: skip
    return tensors


ONE_PASS_CONFIGS = [
    hopper_configs.WarpSpecializedBwdConfig(consumer_regs=200, dq_regs=88),
    hopper_configs.WarpSpecializedBwdConfig(
        stages=3, consumer_regs=208, dq_regs=72, ds_slots=3, dq_buffers=3
    ),
]
DQ_IN_CONSUMERS_CONFIGS = [
    hopper_configs.WarpSpecializedBwdConfig(dq_in_consumers=True, ds_slots=2, dq_buffers=1),
    hopper_configs.WarpSpecializedBwdConfig(dq_in_consumers=True, ds_slots=1, dq_buffers=2),
]
# (config, head dim): the dQ warpgroup at any split head dim; dQ in the consumers at two equal halves
ONE_PASS_CASES = [(cfg, d) for cfg in ONE_PASS_CONFIGS for d in (16, 64, 80)] + [
    (cfg, d) for cfg in DQ_IN_CONSUMERS_CONFIGS for d in (32, 64, 128)
]
# dQ's staging rows interleaved ([Note: dQ's staging rows interleaved]): the launcher's one-pass
# configurations with it, and blocks too narrow for it (d = 16, 32: the plain staging); the launcher
# takes it where N is a multiple of 64 (here 4096), the plain staging at the ragged N
ONE_PASS_CASES += [
    (dataclasses.replace(hopper_configs.ONE_PASS_CONFIGS[d], dq_rows_interleaved=True), d)
    for d in (64, 80, 128)
] + [
    (dataclasses.replace(ONE_PASS_CONFIGS[0], dq_rows_interleaved=True), 16),
    (dataclasses.replace(DQ_IN_CONSUMERS_CONFIGS[0], dq_rows_interleaved=True), 32),
]


@pytest.mark.parametrize(
    ("d", "half"), [(32, 16), (64, 32), (128, 64), (256, 128), (16, None), (48, None), (80, None), (96, None)]
)
def test_dq_in_the_consumers_needs_two_equal_power_of_two_halves(d, half):
    cfg = hopper_configs.WarpSpecializedBwdConfig(dq_in_consumers=True)
    assert cfg.one_pass and cfg.head_split(d) == half


def test_a_head_dim_the_consumers_cannot_halve_is_refused_with_a_clear_error():
    cfg = hopper_configs.WarpSpecializedBwdConfig(dq_in_consumers=True)
    tensors = [torch.zeros(1, 1, 4, 80) for _ in range(7)] + [torch.zeros(1, 1, 4)] * 2
    with pytest.raises(ValueError, match="head dim 80 cannot be split into two equal"):
        hopper.flash_bwd_hopper(tensors, True, cfg)


def test_interleaved_dq_rows_are_an_option_of_the_one_pass_backward():
    assert hopper_configs.WarpSpecializedBwdConfig(dq_in_consumers=True, dq_rows_interleaved=True).one_pass
    with pytest.raises(ValueError, match="dq_rows_interleaved is an option of the one-pass backward"):
        hopper_configs.WarpSpecializedBwdConfig(dq_rows_interleaved=True)


def test_dq_either_in_a_warpgroup_of_its_own_or_in_the_consumers():
    with pytest.raises(ValueError, match="either in a warpgroup of its own"):
        hopper_configs.WarpSpecializedBwdConfig(dq_regs=88, dq_in_consumers=True)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize(("cfg", "d"), ONE_PASS_CASES, ids=str)
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(
    ("batch", "n_q", "n_k"),
    [((2, 3), 1, 1), ((1, 3), 97, 250), ((1, 3), 300, 97), ((2, 2), 1025, 1025), ((1, 2), 4096, 4096)],
)
def test_gpu_one_pass_backward_matches_the_portable_passes(cfg, d, is_causal, batch, n_q, n_k):
    """dQ (added by the dQ warpgroup, or by the consumers, with TMA reductions), dK and dV of the
    one-pass kernel against the tl passes on the same operands: ragged N (keys past the end zeroed
    out of dS before dQ reads them), causal and not, split head dims, poisoned outputs; repeated to
    catch a race between the consumers' dS ring and the dQ products."""
    tensors = _portable_backward(batch, n_q, n_k, d, is_causal, ("dkdv", "dq"))
    wants = [t.clone() for t in tensors[4:7]]
    for _ in range(3):
        for t in tensors[4:7]:
            t.fill_(float("nan"))
        assert hopper.flash_bwd_hopper(tensors, is_causal, cfg)
        torch.cuda.synchronize()
        for got, want in zip(tensors[4:7], wants, strict=True):
            assert torch.isfinite(got).all()
            torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize(
    "cfg",
    [
        hopper_configs.ONE_PASS_CONFIGS[128],
        dataclasses.replace(hopper_configs.ONE_PASS_CONFIGS[128], group_heads=1),
        dataclasses.replace(hopper_configs.ONE_PASS_CONFIGS[128], group_heads=2),
        dataclasses.replace(hopper_configs.ONE_PASS_CONFIGS[128], group_heads=6, shortest_first=True),
        dataclasses.replace(hopper_configs.ONE_PASS_CONFIGS[64], group_heads=3),
    ],
    ids=str,
)
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_gpu_backward_grid_orders_cover_every_key_tile_of_every_head(cfg, is_causal):
    """Heads in groups of 1, 2, 3, 6 of the six (b, h) ([Note: tile order]), the old shortest-first
    order: every key tile of every head is computed once (poisoned outputs, against the tl passes)."""
    d = 128 if cfg.dq_in_consumers else 64
    tensors = _portable_backward((2, 3), 1025, 1025, d, is_causal, ("dkdv", "dq"))
    wants = [t.clone() for t in tensors[4:7]]
    for t in tensors[4:7]:
        t.fill_(float("nan"))
    assert hopper.flash_bwd_hopper(tensors, is_causal, cfg)
    torch.cuda.synchronize()
    for got, want in zip(tensors[4:7], wants, strict=True):
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("group", [0, 1, 2, 3, 6])
@pytest.mark.parametrize(
    "cfg", [hopper_configs.WarpSpecializedFwdConfig(), hopper_configs.HopperFwdConfig()], ids=str
)
def test_gpu_forward_grid_orders_cover_every_query_tile_of_every_head(cfg, group):
    """The forwards' head-major grid in groups of 1, 2, 3, 6 of the six (b, h) and by the rule (0):
    every output element written once and right (9 query tiles a head: the grid is head-major)."""
    case = make_case((2, 3), 1025, 1025, 64, torch.bfloat16, device="cuda", is_causal=True)
    q4, k4, v4 = (t.detach() for t in (case.q, case.k, case.v))
    o = torch.full_like(q4, float("nan"))
    lse = torch.full(q4.shape[:-1], float("nan"), device="cuda")
    hopper.flash_fwd_hopper(q4, k4, v4, o, lse, True, dataclasses.replace(cfg, group_heads=group))
    with use_configs(options=PORTABLE):
        want, want_lse = launch.flash_fwd(q4, k4, v4, True)
    torch.testing.assert_close(o.float(), want.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, want_lse, atol=1e-2, rtol=1e-3)


def test_a_head_group_that_does_not_divide_the_heads_is_refused_before_any_work():
    cfg = hopper_configs.WarpSpecializedBwdConfig(dq_in_consumers=True, group_heads=4)
    tensors = [torch.zeros(2, 3, 4, 128) for _ in range(7)] + [torch.zeros(2, 3, 4)] * 2
    with pytest.raises(ValueError, match="group_heads must divide batch x heads = 6"):
        hopper.flash_bwd_hopper(tensors, True, cfg)
    q = torch.zeros(2, 3, 1025, 64)  # 9 query tiles a head: a head-major grid
    with pytest.raises(ValueError, match="group_heads must divide batch x heads = 6"):
        hopper.flash_fwd_hopper(
            q, q, q, q, q[..., 0], True, hopper_configs.WarpSpecializedFwdConfig(group_heads=4)
        )


def test_a_backward_option_changes_the_warp_specialised_configuration_or_names_the_problem():
    cfg = hopper_configs.changed_backward(128, "shortest_first=True+group_heads=2")
    assert cfg == dataclasses.replace(
        hopper_configs.ONE_PASS_CONFIGS[128], shortest_first=True, group_heads=2
    )
    with pytest.raises(
        ValueError, match="'order=1' is not FIELD=VALUE with FIELD of WarpSpecializedBwdConfig"
    ):
        hopper_configs.changed_backward(128, "order=1")
    with pytest.raises(ValueError, match="'x' is not a Python literal"):
        hopper_configs.changed_backward(128, "stages=x")
    with pytest.raises(ValueError, match="head dim 96 uses HopperBwdConfig"):
        hopper_configs.changed_backward(96, "stages=3")
    with (
        pytest.raises(ValueError, match="is not FIELD=VALUE"),
        use_configs(options=KernelOptions(hopper_bwd="x")),
    ):
        pass  # refused when pinned, before any call
    for bad in ("group_heads=-2", "group_heads=2.0", "group_heads=True"):
        with pytest.raises(ValueError, match="group_heads must be an integer >= 0"):
            hopper_configs.changed_backward(128, bad)


def test_a_pinned_backward_option_that_cannot_apply_is_an_error_before_any_work():
    """Names and literals are checked when pinned; the configuration for the call's head dim and
    heads at the backward's first call, before its operands are prepared."""
    q, k, v, do = (torch.randn(1, 2, 64, 128) for _ in range(4))
    o, lse = torch.zeros_like(q), torch.zeros(1, 2, 64)
    for spec, message in (("dq_regs=80", "either in a warpgroup of its own"), ("group_heads=3", "= 2")):
        with use_configs(options=KernelOptions(hopper_bwd=spec)), pytest.raises(ValueError, match=message):
            launch.flash_bwd(do, q, k, v, o, lse, True)


def test_the_pinned_backward_option_reaches_the_hopper_launcher(monkeypatch):
    """launch.flash_bwd under KernelOptions(hopper_bwd=...) hands the changed configuration to the
    Hopper backward (recorded here instead of launched), and the option is part of the plan's key."""
    seen, backward = hopper_backward_configs(monkeypatch, 128)
    with use_configs(options=KernelOptions(hopper_bwd="shortest_first=True")):
        backward()
        key = tiles.plan_state()
    backward()
    assert seen == [hopper_configs.changed_backward(128, "shortest_first=True"), None]
    assert key != tiles.plan_state()


@pytest.mark.parametrize(
    ("heads", "n_tiles", "group"),
    [(16, 128, 2), (32, 256, 1), (16, 64, 4), (128, 16, 16), (4, 16, 4), (25, 64, 5)],
)
def test_heads_are_grouped_by_the_fewest_that_fill_the_sms(heads, n_tiles, group):
    assert hopper_configs.group_heads(heads, n_tiles, 132) == group


def _busy_fraction(order: list[tuple[int, int]], n: int, sms: int = 132) -> float:
    """[Note: tile order]'s model: programs (head, causal key tile of 128) of their query steps
    (64 each) plus three, taken in grid order by whichever SM frees first; work over SMs x makespan."""
    free = [0] * sms
    for _, tile in order:
        at = heapq.heappop(free)
        heapq.heappush(free, at + (n - 128 * tile) // 64 + 3)
    return sum((n - 128 * t) // 64 + 3 for _, t in order) / (sms * max(free))


@pytest.mark.parametrize(("heads", "n"), [(16, 16384), (16, 8192), (32, 32768), (32, 4096)])
def test_grouped_heads_keep_the_sms_busy_to_the_end_in_a_model_of_the_schedule(heads, n):
    """The grid order of `program_tile` (head-major, heads in groups of `group_heads`, tile by tile
    within a group, longest first) against one head after the other, shortest first (the backward's
    order before session 18)."""
    n_tiles = n // 128
    g = hopper_configs.group_heads(heads, n_tiles, 132)
    grouped = [(h0 + r % g, r // g) for h0 in range(0, heads, g) for r in range(g * n_tiles)]
    shortest_first = [(h, n_tiles - 1 - t) for h in range(heads) for t in range(n_tiles)]
    assert sorted(grouped) == sorted(shortest_first)  # the same programs
    assert _busy_fraction(grouped, n) >= 0.99
    assert _busy_fraction(grouped, n) > _busy_fraction(shortest_first, n)


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
    with use_configs(options=HOPPER):
        flash(q, k, v, True).sum().backward()
    torch.testing.assert_close(x.grad, want, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@needs_sm90
def test_gpu_a_pinned_backward_option_runs_under_torch_compile_and_agrees():
    """KernelOptions(hopper_bwd=...) inside a compiled call (as in the 8B step): the changed backward
    (the old grid order, heads in groups of two) gives the default's gradients."""
    seen = []
    launcher = hopper.flash_bwd_hopper

    def recorded(tensors, is_causal, cfg=None):
        seen.append(cfg)
        return launcher(tensors, is_causal, cfg)

    x = torch.randn(3, 2, 4, 1025, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    q, k, v = x.unbind(0)
    flash = torch.compile(FlashAttentionTriton.apply, fullgraph=True)
    flash(q, k, v, True).sum().backward()
    want = x.grad.clone()
    x.grad = None
    spec = "shortest_first=True+group_heads=2"
    with pytest.MonkeyPatch.context() as mp, use_configs(options=KernelOptions(hopper_bwd=spec)):
        mp.setattr(hopper, "flash_bwd_hopper", recorded)
        flash(q, k, v, True).sum().backward()
    assert seen == [hopper_configs.changed_backward(128, spec)]  # the changed backward ran
    torch.testing.assert_close(x.grad, want, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize(
    "cfg",
    [
        hopper_configs.HopperBwdConfig(64, 64, 2, 4),
        hopper_configs.HopperBwdConfig(32, 64, 3, 4),
        hopper_configs.HopperBwdConfig(16, 64, 3, 4),
        hopper_configs.HopperBwdConfig(32, 128, 3, 8, maxnreg=128),
    ],
    ids=str,
)
@pytest.mark.parametrize("d", [64, 80])
@pytest.mark.parametrize("n", [333, 2048])
def test_gpu_hopper_dkdv_tile_candidates_and_every_element_written(cfg, d, n):
    """dK, dV of the Gluon pass alone (poisoned outputs) against the float64 reference's gradients."""
    from cs336_systems.attention.flash_triton import launch

    case = make_case((1, 4), n, n, d, torch.bfloat16, device="cuda", is_causal=True)
    q, k, v, do = (t.detach() for t in (case.q, case.k, case.v, case.do))
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    torch.nn.functional.scaled_dot_product_attention(q64, k64, v64, is_causal=True).backward(do.double())
    with use_configs(options=PORTABLE):
        o, lse = launch.flash_fwd(q, k, v, True)
    tensors, (_dq, dk, dv) = launch.prepare_backward(do, q, k, v, o, lse)
    dk.fill_(float("nan"))
    dv.fill_(float("nan"))
    hopper.flash_bwd_hopper(tensors, True, cfg)
    assert torch.isfinite(dk).all() and torch.isfinite(dv).all()
    torch.testing.assert_close(dk.double(), k64.grad, atol=5e-2, rtol=5e-2)
    torch.testing.assert_close(dv.double(), v64.grad, atol=5e-2, rtol=5e-2)


def _ptxas_serialization(kernel) -> list[str]:
    """ptxas's notes that it serialised the wgmma instructions of any compiled variant of `kernel`
    (the JIT's cache on the current device), from re-assembling each variant's PTX for sm_90a."""
    import os
    import subprocess
    import tempfile

    import triton

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    kernel_cache = kernel.device_caches[torch.cuda.current_device()][0]
    assert kernel_cache, "the kernel was not compiled on this device"
    notes = []
    for compiled in kernel_cache.values():
        with tempfile.TemporaryDirectory() as tmp:
            src = os.path.join(tmp, "k.ptx")
            with open(src, "w") as f:
                f.write(compiled.asm["ptx"])
            out = subprocess.run([ptxas, "-arch=sm_90a", "-v", src, "-o", os.path.join(tmp, "k.cubin")],
                                 capture_output=True, text=True, check=True)  # fmt: skip
        notes += [line for line in out.stderr.splitlines() if "serialized" in line]
    return notes


@pytest.mark.gpu
@needs_sm90
def test_gpu_warp_specialized_backward_keeps_its_products_asynchronous():
    """ptxas serialises every wgmma of a warp-specialised kernel whose partitions leave a product in
    flight across a loop's back edge ("insufficient register resources") or touch an in-flight
    accumulator; the consumers and the dQ warpgroup therefore complete each step's products within
    the step. Checked on the compiled two-pass and one-pass kernels (dQ in a warpgroup or in the
    consumers) at d = 64, 80 and 128."""
    from cs336_systems.attention.flash_triton import hopper_ws_backward_kernels

    for d, cfg in ((64, hopper_configs.WarpSpecializedBwdConfig()), (128, hopper_configs.WarpSpecializedBwdConfig(stages=2)),
                   (64, hopper_configs.ONE_PASS_CONFIGS[64]), (80, hopper_configs.ONE_PASS_CONFIGS[80]),
                   (128, DQ_IN_CONSUMERS_CONFIGS[0]), (64, DQ_IN_CONSUMERS_CONFIGS[1])):  # fmt: skip
        case = make_case((1, 2), 256, 256, d, torch.bfloat16, device="cuda", is_causal=True)
        q, k, v, do = (t.detach() for t in (case.q, case.k, case.v, case.do))
        with use_configs(options=PORTABLE):
            o, lse = launch.flash_fwd(q, k, v, True)
        tensors, _ = launch.prepare_backward(do, q, k, v, o, lse)
        hopper.flash_bwd_hopper(tensors, True, cfg)
    assert _ptxas_serialization(hopper_ws_backward_kernels.flash_bwd_dkdv_ws_kernel) == []


def test_ab_variants_replace_fields_of_the_launchers_passes():
    from cs336_systems.studies.attention.flash_ab import parse_variant

    assert parse_variant("default", 128) == hopper_configs.heuristic_bwd(128)
    cfg = parse_variant("shortest_first=True+stages=3", 128)
    assert cfg.shortest_first and cfg.stages == 3 and cfg.dq_in_consumers
    with pytest.raises(ValueError, match="dQ either in a warpgroup of its own"):
        parse_variant("dq_regs=88", 128)  # the config's own check
    assert parse_variant("default", 80, "fwd") == hopper_configs.heuristic_fwd(80)
    assert parse_variant("group_heads=0", 128, "fwd").group_heads == 0
    with pytest.raises(ValueError, match="is not FIELD=VALUE with FIELD of WarpSpecializedFwdConfig"):
        parse_variant("dq_in_consumers=True", 128, "fwd")
    ws = parse_variant("ws", 80, "fwd")  # a kernel's prefix starts from that class's defaults, not d's
    assert parse_variant("wg+block_n=64", 80, "fwd") == hopper_configs.HopperFwdConfig(128, 64, 3, 8)
    assert (
        ws == hopper_configs.WarpSpecializedFwdConfig()
        and parse_variant("wg", 80, "fwd") == hopper_configs.HopperFwdConfig()
    )
    assert parse_variant("ws+block_n=64+stages=3", 80, "fwd") == hopper_configs.WarpSpecializedFwdConfig(
        block_n=64, stages=3
    )
    with pytest.raises(ValueError, match="names a forward kernel"):
        parse_variant("ws", 128, "bwd")
    assert parse_variant("tl", 64, "fwd") == "tl"  # the portable forward, the protocol's default at d = 64
    with pytest.raises(ValueError, match="'tl' is the portable forward"):
        parse_variant("tl", 64, "bwd")


def test_the_ab_problem_in_the_models_layout_holds_every_head_in_each_row():
    """`--ab-layout bnhd`: (1, H, N, d) views of (1, N, H, d), as the model's projections give them;
    the backward's operands keep that layout; the default is dense per head; a bad layout is refused."""
    from cs336_systems.studies.attention.flash_tuning import portable_problem

    q, k, _, o, lse, tensors, _, _ = portable_problem(2, 32, 16, torch.float32, "cpu", "bnhd")
    assert q.shape == (1, 2, 32, 16) and q.stride() == k.stride() == (32 * 2 * 16, 16, 2 * 16, 1)
    assert tensors[3].stride() == q.stride() and o.shape == q.shape and lse.shape == (1, 2, 32)
    dense = portable_problem(2, 32, 16, torch.float32, "cpu")[0]
    assert dense.is_contiguous()
    with pytest.raises(ValueError, match="layout must be one of"):
        portable_problem(2, 32, 16, torch.float32, "cpu", "nhd")


def test_the_ab_problem_in_the_steps_layout_matches_the_compiled_attention(monkeypatch):
    """`--ab-layout step` gives our backward the strides the compiled model's attention gives it: q and
    k dense per head (RoPE's outputs), v and dO views with the heads interleaved in each row (compiled
    for the CPU here; Inductor's layout choices for these ops do not depend on the device)."""
    from cs336_systems.attention.flash_triton import launch
    from cs336_systems.model.attention import CausalMultiHeadSelfAttention
    from cs336_systems.model.layers import RotaryEmbedding
    from cs336_systems.studies.attention.flash_tuning import portable_problem

    heads, n, d = 2, 32, 16
    seen = []
    real = launch._bwd_operands

    def spy(do, q, k, v, o, lse):
        seen.append(tuple(t.stride() for t in (q, k, v, do)))
        return real(do, q, k, v, o, lse)

    monkeypatch.setattr(launch, "_bwd_operands", spy)
    torch.manual_seed(0)
    attn = CausalMultiHeadSelfAttention(heads * d, heads, RotaryEmbedding(n, d), "flash_triton")
    x = torch.randn(1, n, heads * d, requires_grad=True)
    torch.compile(attn)(x).sum().backward()
    assert seen
    model = seen[-1]  # what the compiled model's backward received
    monkeypatch.undo()  # the problem's own backward operands are not recorded
    dense, interleaved = (n * d * heads, n * d, d, 1), (n * heads * d, d, heads * d, 1)
    assert model == (dense, dense, interleaved, interleaved)
    q, k, v, _o, _lse, tensors, _, _ = portable_problem(heads, n, d, torch.float32, "cpu", "step")
    assert (q.stride(), k.stride(), v.stride(), tensors[3].stride()) == model
    for other in ("bhnd", "bnhd"):  # the other layouts are not the step's
        q, k, v, _o, _lse, tensors, _, _ = portable_problem(heads, n, d, torch.float32, "cpu", other)
        assert (q.stride(), k.stride(), v.stride(), tensors[3].stride()) != model


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize(
    ("kind", "shape", "option"),
    [("bwd", (2, 512, 128), "shortest_first=True"), ("fwd", (4, 2048, 128), "group_heads=0")],
)
def test_gpu_ab_times_every_variant_and_cudnn_in_each_round(kind, shape, option):
    from cs336_systems.studies.attention import flash_ab

    ab = flash_ab.ab_hopper_backward if kind == "bwd" else flash_ab.ab_hopper_forward
    df = ab(*shape, ["default", option], rounds=2, rep_ms=20.0, layout="bnhd")  # the model's layout
    assert sorted(df.variant.unique()) == sorted(["cudnn", "default", option])
    assert (df.groupby("variant").size() == 2).all() and (df.ms > 0).all()
