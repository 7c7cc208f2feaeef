"""FlashAttention-2 Triton kernels against the float64 reference.

On a CPU the kernels run under the Triton interpreter (TRITON_INTERPRET=1, set by conftest.py):
float32/float16 at small sizes, with both memory paths (block pointers and TMA tensor descriptors),
pinned small tiles so that the masked/unmasked/ragged tile logic is exercised, and the
optimisation-log switches. bf16 (the interpreter computes it wrongly), long sequences, real
compilation and torch.compile with Inductor run on the GPU (`gpu` marker).
"""

from __future__ import annotations

import pytest
import torch
from einops import rearrange

from cs336_systems.attention import FlashAttentionTriton, attention_reference
from cs336_systems.attention.flash_triton import BwdConfig, FwdConfig, KernelOptions, launch, use_configs
from cs336_systems.studies.attention.flash_backward_tuning import one_pass_candidates
from tests.attention_helpers import check_outputs, make_case, run_impl

pytestmark = pytest.mark.filterwarnings("ignore:tl.make_block_ptr is deprecated")

CPU = "cpu"
FP32 = (torch.float32, 1e-4, 1e-4, 2e-5)  # (dtype, atol, rtol, floor of the 2x rule)

# ------------------------------------------------------------------------------------------------
# CPU (interpreter): the default (interpreter) tiles over ragged N, d 16..128, causal or not
# ------------------------------------------------------------------------------------------------

INTERP_DTYPES = [
    pytest.param(torch.float32, 1e-4, 1e-4, 2e-5, id="fp32"),
    pytest.param(torch.float16, 5e-3, 5e-3, 1e-3, id="fp16"),
]


@pytest.mark.parametrize(("dtype", "atol", "rtol", "floor"), INTERP_DTYPES)
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [16, 32, 64, 128])
@pytest.mark.parametrize(("n_q", "n_k"), [(1, 1), (17, 17), (97, 97), (33, 70)])
def test_interpreter_matches_float64(n_q, n_k, d, is_causal, dtype, atol, rtol, floor):
    case = make_case((1, 2), n_q, n_k, d, dtype, is_causal=is_causal)
    check_outputs(run_impl(FlashAttentionTriton.apply, case), case, atol, rtol, floor)


# Small pinned tiles: several query and key tiles, diagonal tiles, ragged tails on both sides.
SMALL_FWD = FwdConfig(32, 16)
SMALL_BWD = BwdConfig(16, 32, 32, 16)
TILE_CASES = [
    pytest.param((2,), 97, 97, 32, True, SMALL_BWD, KernelOptions(), id="3d-square-causal"),
    pytest.param((1, 2), 97, 50, 32, True, SMALL_BWD, KernelOptions(), id="nq>nk-causal"),
    pytest.param((1, 2), 40, 97, 32, True, SMALL_BWD, KernelOptions(), id="nq<nk-causal"),
    pytest.param((1, 2), 70, 45, 64, False, SMALL_BWD, KernelOptions(), id="ragged-full"),
    pytest.param((1, 2), 97, 97, 48, True, SMALL_BWD, KernelOptions(), id="d48-padded"),
    pytest.param((1, 2), 50, 50, 8, True, SMALL_BWD, KernelOptions(), id="d8-padded"),
    pytest.param((1, 2), 97, 97, 32, True, SMALL_BWD, KernelOptions(use_tma=True), id="tma-causal"),
    pytest.param((1, 2), 45, 70, 48, False, SMALL_BWD, KernelOptions(use_tma=True), id="tma-full-d48"),
    # dK/dV with more queries per step than keys per program: unaligned query tiles after the diagonal
    pytest.param((1, 2), 97, 97, 32, True, BwdConfig(32, 16, 32, 16), KernelOptions(), id="bm1>bn1-causal"),
    pytest.param((1, 2), 70, 45, 32, False, BwdConfig(32, 16, 32, 16), KernelOptions(), id="bm1>bn1-full"),
    pytest.param(
        (1, 2),
        40,
        97,
        32,
        True,
        BwdConfig(32, 16, 32, 16),
        KernelOptions(use_tma=True),
        id="bm1>bn1-tma-nq<nk",
    ),
    pytest.param(
        (1, 2), 97, 70, 32, True, BwdConfig(16, 32, 32, 16, early_dp=True), KernelOptions(), id="early-dp"
    ),
    pytest.param((1, 2), 97, 70, 32, True, SMALL_BWD, KernelOptions(False, False), id="no-skip-no-split"),
    # dQ accumulated by atomics inside the dK/dV pass ("reduce" falls back to them off the GPU)
    pytest.param(
        (2,), 97, 97, 32, True, BwdConfig(16, 32, 32, 16, dq="atomic"), KernelOptions(), id="dq-atomic-3d"
    ),
    pytest.param(
        (1, 2), 97, 50, 48, True, BwdConfig(16, 32, 32, 16, dq="atomic"), KernelOptions(), id="dq-atomic-d48"
    ),
    pytest.param(
        (1, 2),
        40,
        97,
        32,
        True,
        BwdConfig(32, 16, 32, 16, dq="atomic"),
        KernelOptions(),
        id="dq-atomic-bm1>bn1",
    ),
    pytest.param(
        (1, 2),
        70,
        45,
        32,
        False,
        BwdConfig(16, 32, 32, 16, early_dp=True, dq="reduce"),
        KernelOptions(use_tma=True),
        id="dq-reduce-fallback-full",
    ),
    pytest.param((1, 2), 97, 70, 32, True, SMALL_BWD, KernelOptions(True, False), id="skip-no-split"),
]


@pytest.mark.parametrize(("batch", "n_q", "n_k", "d", "is_causal", "bwd", "options"), TILE_CASES)
def test_interpreter_small_tiles(batch, n_q, n_k, d, is_causal, bwd, options):
    case = make_case(batch, n_q, n_k, d, torch.float32, is_causal=is_causal)
    with use_configs(SMALL_FWD, bwd, options):
        ours = run_impl(FlashAttentionTriton.apply, case)
    check_outputs(ours, case, *FP32[1:])


def test_every_output_element_is_written(monkeypatch):
    """Outputs start as NaN: any element a kernel forgets to write fails the check."""
    monkeypatch.setattr(launch, "output_like", lambda t: torch.full_like(t, float("nan")))
    monkeypatch.setattr(
        launch, "_empty_f32", lambda shape, like: torch.full(shape, float("nan"), device=like.device)
    )
    case = make_case((1, 2), 61, 45, 24, torch.float32, is_causal=True)
    with use_configs(SMALL_FWD, SMALL_BWD):
        ours = run_impl(FlashAttentionTriton.apply, case)
    check_outputs(ours, case, *FP32[1:])


# ------------------------------------------------------------------------------------------------
# Layouts: the model's strided views, the leaderboard's unbind, a non-contiguous last dimension
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dq", ["pass", "atomic"])
def test_padded_keys_stay_out_of_dq_when_logsumexp_is_very_negative(dq):
    """Rows whose scores are all about -100 have L < -88, so a padded key (K = 0, score 0) would get
    P = exp(-L) = inf in float32; the ragged key tile must keep it out of dQ in both dQ modes."""
    case = make_case((1, 2), 40, 45, 32, torch.float32)
    with torch.no_grad():
        case.k.fill_(4.0)
        case.q[..., :8, :] = -4.5  # scores -101.8 with every key
    with use_configs(SMALL_FWD, BwdConfig(16, 32, 32, 16, dq=dq)):
        ours = run_impl(FlashAttentionTriton.apply, case)
    assert ours["lse"][..., :8].max() < -88
    check_outputs(ours, case, *FP32[1:])


def test_model_layout_is_read_in_place_and_output_keeps_it():
    """q from the model is a (B, H, T, d) view of a (B, T, H*d) projection: no copy, and o has the
    same layout so the model's inverse rearrange is a view."""
    x = torch.randn(2, 40, 3 * 16)
    q = rearrange(x, "b t (h d) -> b h t d", h=3)
    k = rearrange(torch.randn(2, 40, 48), "b t (h d) -> b h t d", h=3)
    v = rearrange(torch.randn(2, 40, 48), "b t (h d) -> b h t d", h=3)
    assert not q.is_contiguous()
    o = FlashAttentionTriton.apply(q, k, v, True)
    assert o.stride() == q.stride()
    assert rearrange(o, "b h t d -> b t (h d)").is_contiguous()
    torch.testing.assert_close(o, attention_reference(q, k, v, True)[0], atol=1e-4, rtol=1e-4)


def test_unbound_views_and_non_contiguous_last_dim():
    """The leaderboard's `q, k, v = x.unbind(0)` views, and a k whose last dimension is strided."""
    x = torch.randn(3, 2, 33, 16, requires_grad=True)
    q, k, v = x.unbind(0)
    k_t = k.detach().transpose(-1, -2).contiguous().transpose(-1, -2).requires_grad_()  # stride(-1) != 1
    assert k_t.stride(-1) != 1
    o = FlashAttentionTriton.apply(q, k_t, v, True)
    o.sum().backward()  # an expanded (stride-0) upstream gradient
    ref_o, _ = attention_reference(q.detach(), k_t.detach(), v.detach(), True)
    torch.testing.assert_close(o, ref_o, atol=1e-4, rtol=1e-4)
    assert x.grad is not None and k_t.grad is not None
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k_t, v))
    attention_reference(qd, kd, vd, True)[0].sum().backward()
    torch.testing.assert_close(x.grad[0].double(), qd.grad, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(k_t.grad.double(), kd.grad, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(x.grad[2].double(), vd.grad, atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------------------------------------------
# torch.compile: the leaderboard's torch.compile(Cls.apply) traces without graph breaks
# ------------------------------------------------------------------------------------------------


def test_torch_compile_traces_whole_function():
    x = torch.randn(3, 2, 45, 32, requires_grad=True)
    q, k, v = x.unbind(0)
    FlashAttentionTriton.apply(q, k, v, True).sum().backward()
    want = x.grad.clone()
    x.grad = None
    flash = torch.compile(FlashAttentionTriton.apply, backend="aot_eager", fullgraph=True)
    flash(q, k, v, True).sum().backward()
    torch.testing.assert_close(x.grad, want)


def test_pytorch_backward_option_matches_triton_backward():
    case = make_case((1, 2), 45, 45, 32, torch.float32, is_causal=True)
    ours = run_impl(FlashAttentionTriton.apply, case, "pytorch")
    check_outputs(ours, case, *FP32[1:])
    with pytest.raises(ValueError, match="backward_impl"):
        FlashAttentionTriton.apply(case.q, case.k, case.v, True, "cuda")


def test_bf16_is_refused_under_the_interpreter():
    if not launch.interpreting():
        pytest.skip("only meaningful under TRITON_INTERPRET=1")  # on the GPU host bf16 runs (tests below)
    q = torch.randn(1, 16, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="bfloat16"):
        FlashAttentionTriton.apply(q, q, q, False)


def test_model_with_flash_triton_matches_naive():
    from cs336_systems.model import BasicsTransformerLM, get_config

    cfg = get_config("debug")
    model = BasicsTransformerLM(**cfg.as_kwargs())
    x = torch.randint(0, cfg.vocab_size, (2, 40))
    ref = model(x)
    ref.square().mean().backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model.set_attention("flash_triton")
    out = model(x)
    out.square().mean().backward()
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[n], atol=1e-4, rtol=1e-3, msg=lambda m, n=n: f"{n}: {m}")


# ------------------------------------------------------------------------------------------------
# GPU: bf16, long and ragged sequences, compiled kernels, TMA vs block pointers, Inductor
# ------------------------------------------------------------------------------------------------

# GPU fp32 runs 3xTF32 dots (PyTorch's default "highest" matmul precision maps to tf32x3)
GPU_DTYPES = [
    pytest.param(torch.bfloat16, 5e-2, 5e-2, 1e-2, id="bf16"),
    pytest.param(torch.float16, 1e-2, 1e-2, 2e-3, id="fp16"),
    pytest.param(torch.float32, 1e-3, 1e-3, 1e-4, id="fp32"),
]


@pytest.mark.gpu
@pytest.mark.parametrize(("dtype", "atol", "rtol", "floor"), GPU_DTYPES)
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [16, 32, 64, 128])
def test_gpu_matches_float64(d, is_causal, dtype, atol, rtol, floor):
    case = make_case((1, 2), 1025, 1025, d, dtype, device="cuda", is_causal=is_causal)
    check_outputs(run_impl(FlashAttentionTriton.apply, case), case, atol, rtol, floor)


@pytest.mark.gpu
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_fp32_tf32_matches_float64(d, is_causal):
    """fp32 at matmul precision "high" (TF32 dots, as in the benchmark sweep) against PyTorch in TF32."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        case = make_case((1, 2), 1025, 1025, d, torch.float32, device="cuda", is_causal=is_causal)
        check_outputs(run_impl(FlashAttentionTriton.apply, case), case, 2e-2, 2e-2, 2e-3)
    finally:
        torch.set_float32_matmul_precision(previous)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("batch", "n_q", "n_k", "d"),
    [((2,), 1, 1, 64), ((1, 3), 17, 17, 64), ((1, 3), 97, 250, 64), ((1, 3), 300, 97, 64), ((2, 2), 4096, 4096, 64),
     ((1, 2), 333, 333, 48), ((1, 2), 257, 257, 80), ((1, 2), 200, 200, 256)],
)  # fmt: skip
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_gpu_ragged_and_odd_head_dims_bf16(batch, n_q, n_k, d, is_causal):
    case = make_case(batch, n_q, n_k, d, torch.bfloat16, device="cuda", is_causal=is_causal)
    check_outputs(run_impl(FlashAttentionTriton.apply, case), case, 5e-2, 5e-2, 1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "options",
    [
        KernelOptions(use_tma=False, hopper=False),
        KernelOptions(use_tma=True, hopper=False),
        KernelOptions(False, False, hopper=False),
    ],  # the tl kernels' memory paths, also on Hopper
    ids=["blockptr", "tma", "baseline"],
)
def test_gpu_memory_paths_and_variants(options):
    case = make_case((1, 4), 1000, 1000, 64, torch.bfloat16, device="cuda", is_causal=True)
    with use_configs(bwd=launch.heuristic_bwd(1000, 1000, 64, torch.bfloat16), options=options):
        ours = run_impl(FlashAttentionTriton.apply, case)
    check_outputs(ours, case, 5e-2, 5e-2, 1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "bwd",
    [BwdConfig(128, 64, 128, 64, 4, 2, 4, 3), BwdConfig(128, 64, 128, 64, 4, 2, 4, 3, early_dp=True),
     BwdConfig(64, 64, 128, 64, 4, 3, 4, 3, early_dp=True), BwdConfig(128, 128, 128, 64, 8, 2, 4, 3),
     BwdConfig(64, 64, 128, 64, 4, 2, 8, 4, early_dp=True, maxnreg1=168),
     BwdConfig(32, 64, 128, 64, 4, 3, 8, 4, early_dp=True, maxnreg1=128),
     BwdConfig(32, 64, 128, 64, 4, 2, 8, 4, early_dp=True, maxnreg1=128)],
    ids=["bm1-128", "bm1-128-early-dp", "bm1-64-early-dp", "bn1-128", "maxnreg-168", "bm1-32-maxnreg-128",
         "bm1-32-maxnreg-128-stages-2"],
)  # fmt: skip
@pytest.mark.parametrize(("n", "is_causal"), [(1000, True), (1000, False), (4096, True), (333, True)])
def test_gpu_backward_tile_candidates(bwd, n, is_causal):
    """The dK/dV tile shapes and orders the tuner may pick, at ragged and aligned N."""
    case = make_case((1, 4), n, n, 64, torch.bfloat16, device="cuda", is_causal=is_causal)
    with use_configs(bwd=bwd):
        ours = run_impl(FlashAttentionTriton.apply, case)
    check_outputs(ours, case, 5e-2, 5e-2, 1e-2)


def _one_pass_cases() -> list:
    cases = []
    for d in (64, 128):  # the first "reduce" and "atomic" candidates of each head dim's tuning list
        base = launch.heuristic_bwd(4096, 4096, d, torch.bfloat16, interpreter=False)
        cands = one_pass_candidates(d, base)
        picked = [next(c for c in cands if c.dq == mode) for mode in ("reduce", "atomic")]
        cases += [pytest.param(d, torch.bfloat16, c, id=f"d{d}-{c.dq}") for c in picked]
    cases += [
        pytest.param(
            80, torch.bfloat16, BwdConfig(16, 64, 64, 16, 4, 2, 4, 2, dq="reduce"), id="d80-padded-reduce"
        ),
        pytest.param(
            48, torch.float16, BwdConfig(32, 64, 64, 32, 4, 2, 4, 2, dq="atomic"), id="d48-fp16-atomic"
        ),
        pytest.param(
            64, torch.float32, BwdConfig(32, 64, 64, 32, 4, 2, 4, 2, dq="reduce"), id="d64-fp32-reduce"
        ),
    ]
    return cases


@pytest.mark.gpu
@pytest.mark.parametrize(("d", "dtype", "bwd"), _one_pass_cases())
@pytest.mark.parametrize(("n", "is_causal"), [(1000, True), (1000, False), (4096, True), (333, True)])
def test_gpu_one_pass_backward_candidates(d, dtype, bwd, n, is_causal):
    """dQ added from inside the dK/dV pass (TMA reductions or atomics), every tuned candidate."""
    case = make_case((1, 4), n, n, d, dtype, device="cuda", is_causal=is_causal)
    with use_configs(bwd=bwd, options=KernelOptions(hopper=False)):
        ours = run_impl(FlashAttentionTriton.apply, case)
    tol = {p.values[0]: p.values[1:] for p in GPU_DTYPES}[dtype]
    check_outputs(ours, case, *tol)


@pytest.mark.gpu
def test_gpu_inductor_compile_leaderboard_style():
    x = torch.randn(3, 4, 2048, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    q, k, v = x.unbind(0)
    FlashAttentionTriton.apply(q, k, v, True).sum().backward()
    want = x.grad.clone()
    x.grad = None
    flash = torch.compile(FlashAttentionTriton.apply, fullgraph=True)
    flash(q, k, v, True).sum().backward()
    torch.testing.assert_close(x.grad, want)


@pytest.mark.gpu
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_gpu_official_semantics(is_causal):
    """The official shapes (batch 4, N 128, D 64, float32) on the GPU, at the official tolerance."""
    case = make_case((4,), 128, 128, 64, torch.float32, device="cuda", is_causal=is_causal)
    check_outputs(run_impl(FlashAttentionTriton.apply, case), case, 1e-2, 1e-2, 1e-2)


def test_interpreter_still_chosen_after_pytorch_imports_triton(tmp_path):
    """Regression: on a CPU-only machine, a model step with SDPA (whose CPU backward makes PyTorch
    import Triton) before the first FlashAttentionTriton call used to leave Triton in compiled mode
    ("Cannot call @triton.jit'd outside of the scope of a kernel"). The package sets the interpreter
    on import now. Runs in a fresh process without TRITON_INTERPRET."""
    import os
    import subprocess
    import sys

    if torch.cuda.is_available():
        pytest.skip("the interpreter is chosen only without CUDA")
    code = (
        "import torch\n"
        "from cs336_systems.model import BasicsTransformerLM, get_config, random_batch, cross_entropy\n"
        "c = get_config('debug', context_length=16)\n"
        "m = BasicsTransformerLM.from_config(c, attention_impl='sdpa')\n"
        "x, y = random_batch(2, 16, c.vocab_size)\n"
        "cross_entropy(m(x), y).backward()\n"
        "m.set_attention('flash_triton')\n"
        "cross_entropy(m(x), y).backward()\n"
        "print('ok')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


# ------------------------------------------------------------------------------------------------
# tiles.py: validation of pinned configurations, the one chooser and its cache
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cfg", "rule"),
    [
        (FwdConfig(32, 64), "block_m must be a multiple of block_n"),
        (FwdConfig(48, 16), "block_m must be a power of two"),
        (FwdConfig(32, 8), "block_n must be a power of two >= 16"),
        (BwdConfig(16, 32, 16, 32), "block_m2 must be a multiple of block_n2"),
        (BwdConfig(16, 32, 32, 16, num_warps1=3), "warps must be powers of two"),
        (BwdConfig(16, 32, 32, 16, maxnreg1=0), "maxnreg1 must be positive"),
        (BwdConfig(16, 32, 32, 16, dq="atomics"), "dq must be one of"),
    ],
)
def test_use_configs_rejects_configurations_the_kernels_cannot_run(cfg, rule):
    kind = "fwd" if isinstance(cfg, FwdConfig) else "bwd"
    with pytest.raises(ValueError, match=rule), use_configs(**{kind: cfg}):
        pass
    with pytest.raises(ValueError, match="KernelOptions"), use_configs(options="tma"):
        pass


def test_shipped_gpu_tables_are_unchanged():
    """The GPU configurations the measured results were taken with (OPTIMIZATION_LOG.md)."""
    bf16, fp32 = torch.bfloat16, torch.float32
    assert launch.heuristic_fwd(16384, 16384, 64, bf16, interpreter=False) == FwdConfig(128, 64, 8, 3)
    assert launch.heuristic_bwd(16384, 16384, 64, bf16, interpreter=False) == BwdConfig(
        64, 64, 128, 64, 4, 2, 8, 4, early_dp=True, maxnreg1=168
    )
    assert launch.heuristic_fwd(4096, 4096, 128, fp32, interpreter=False) == FwdConfig(64, 32, 4, 2)
    assert launch.heuristic_bwd(4096, 4096, 128, bf16, interpreter=False) == BwdConfig(
        32, 64, 64, 64, 4, 3, 4, 2
    )
    assert launch.heuristic_bwd(4096, 4096, 256, bf16, interpreter=False) == BwdConfig(
        16, 64, 64, 16, 8, 2, 8, 1
    )
    assert launch.heuristic_fwd(40, 40, 64, bf16, interpreter=False) == FwdConfig(
        64, 64, 8, 3
    )  # clamped to N


def test_choose_and_run_caches_only_shrunk_or_tuned_configurations(monkeypatch):
    from cs336_systems.attention.flash_triton import tiles

    monkeypatch.setattr(tiles, "_tuned", {})
    key = ("test-shape",)
    ran = []

    def run(cfg):
        ran.append(cfg)
        if cfg.num_stages > 1:  # the "GPU" rejects pipelined configurations
            raise tiles.triton.runtime.errors.OutOfResources(1, 0, "shared memory")

    def choose():
        return tiles.choose_and_run(
            "fwd", key, run, heuristic=lambda: FwdConfig(64, 32, 4, 3), candidates=list,
            shrink=tiles.shrink_fwd, can_tune=False,
        )  # fmt: skip

    assert choose() == FwdConfig(64, 32, 4, 1)
    assert ran == [FwdConfig(64, 32, 4, 3), FwdConfig(64, 32, 4, 2), FwdConfig(64, 32, 4, 1)]
    assert tiles.cached("fwd", key) == FwdConfig(64, 32, 4, 1)  # the next call starts from what ran
    ran.clear()
    assert choose() == FwdConfig(64, 32, 4, 1) and ran == [FwdConfig(64, 32, 4, 1)]
    tiles._tuned.clear()
    with use_configs(fwd=FwdConfig(32, 16, 4, 2)):  # a pinned configuration is shrunk but not cached
        assert choose() == FwdConfig(32, 16, 4, 1)
    assert tiles.cached("fwd", key) is None
