"""nsys_profile tooling: kernel classification, range attribution (CPU trace of the debug model and a
synthetic CUDA trace in Kineto's format), per-range tables, tidy rows, and the timeline figure."""

import matplotlib

matplotlib.use("Agg")

import math

import pandas as pd
import pytest
import torch

from cs336_systems.measure.annotations import ATTENTION_RANGES, naive_annotated_attention
from cs336_systems.measure.results import COLUMNS, append_rows, load_results
from cs336_systems.measure.traces import load_trace, save_trace, short_kernel_name, slim_trace
from cs336_systems.model import get_attention, get_config
from cs336_systems.studies.profiling import kernel_profile as P

# --------------------------------------------------------------------------------------------------
# Classification and names
# --------------------------------------------------------------------------------------------------

EXP = (
    "void at::native::vectorized_elementwise_kernel<4, at::native::exp_kernel_cuda(at::TensorIteratorBase&)::"
    "{lambda()#1}::operator()() const::{lambda(float)#1}, at::detail::Array<char*, 2> >(int, at::detail::Array<char*, 2>)"
)
MAX = (
    "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MaxOps<float>, unsigned int, "
    "float, 4, 4> >(at::native::ReduceOp<float, at::native::MaxOps<float>, unsigned int, float, 4, 4>)"
)
GEMM = (
    "sm90_xmma_gemm_f32f32_f32f32_f32_tn_n_tilesize128x128x32_warpgroupsize1x1x1_execute_segment_k_off_kernel"
)
NVJET = "nvjet_tst_128x256_64x4_2x1_v_bz_coopA_TNT"


@pytest.mark.parametrize(
    ("name", "cat", "cls"),
    [
        (EXP, "kernel", "elementwise"),
        (MAX, "kernel", "reduction"),
        (GEMM, "kernel", "matmul"),
        (NVJET, "kernel", "matmul"),
        ("ampere_sgemm_128x64_tn", "kernel", "matmul"),
        ("void cublasLt::splitKreduce_kernel<32, 16, int, float>(float*)", "kernel", "matmul"),
        (
            "void (anonymous namespace)::softmax_warp_forward<float, float, float, 10>(float*)",
            "kernel",
            "softmax",
        ),
        ("void at::native::cunn_SoftMaxForward<4, float, float, float>(float*)", "kernel", "softmax"),
        (
            "void at::native::multi_tensor_apply_kernel<at::native::TensorListMetadata<4>, FusedAdamMathFunctor<float>>()",
            "kernel",
            "optimizer",
        ),
        ("flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128>>", "kernel", "attention"),
        ("Memcpy HtoD (Pageable -> Device)", "gpu_memcpy", "memcpy"),
        ("Memset (Device)", "gpu_memset", "memcpy"),
        (
            "void at::native::indexSelectLargeIndex<float, long, unsigned int, 2, 2, -2, true>(long)",
            "kernel",
            "other",
        ),
        ("triton_poi_fused_add_mul_0", "kernel", "elementwise"),
        ("triton_red_fused_sum_1", "kernel", "reduction"),
        ("triton_tem_fused_mm_2", "kernel", "matmul"),
        ("aten::mm", None, "matmul"),
        ("aten::bmm", None, "matmul"),
        ("aten::_softmax", None, "softmax"),
        ("aten::amax", None, "reduction"),
        ("aten::sum", None, "reduction"),
        ("aten::mul_", None, "elementwise"),
        ("aten::addcdiv_", None, "elementwise"),
        ("aten::_foreach_add_", None, "optimizer"),
        ("aten::view", None, "other"),
    ],
)
def test_classify_kernel(name, cat, cls):
    assert P.classify_kernel(name, cat) == cls


@pytest.mark.parametrize(
    ("name", "short"),
    [
        (EXP, "vectorized_elementwise_kernel[exp_kernel_cuda]"),
        (MAX, "reduce_kernel[MaxOps]"),
        (
            "void (anonymous namespace)::softmax_warp_forward<float, float, float, 10>(float*, int)",
            "softmax_warp_forward",
        ),
        (
            "void at::native::vectorized_elementwise_kernel<4, at::native::BinaryFunctor<float, float, float, "
            "at::native::binary_internal::MulFunctor<float> >, at::detail::Array<char*, 3> >(int)",
            "vectorized_elementwise_kernel[MulFunctor]",
        ),
        (NVJET, NVJET),
        (
            "void cutlass::Kernel2<cutlass_80_simt_sgemm_128x128_8x4_nn_align1>(cutlass_80_simt_sgemm_128x128_8x4_nn_align1::Params)",
            "Kernel2[cutlass_80_simt_sgemm_128x128_8x4_nn_align1]",
        ),
        ("aten::mm", "aten::mm"),
    ],
)
def test_short_kernel_name(name, short):
    assert short_kernel_name(name) == short


def test_short_kernel_name_is_bounded():
    assert len(short_kernel_name("k" * 300, max_len=40)) == 40


# --------------------------------------------------------------------------------------------------
# A synthetic CUDA trace in Kineto's Chrome-trace format
# --------------------------------------------------------------------------------------------------


class _Trace:
    """Builds user_annotation ranges, cpu_op + cudaLaunchKernel launches and kernels linked by ids."""

    def __init__(self):
        self.events = [{"ph": "M", "name": "process_name", "pid": 0, "tid": 0, "args": {"name": "GPU 0"}}]
        self.corr = 100

    def range(self, name, ts, dur, tid=1):
        self.events.append(
            {
                "ph": "X",
                "cat": "user_annotation",
                "name": name,
                "pid": 1,
                "tid": tid,
                "ts": ts,
                "dur": dur,
                "args": {},
            }
        )

    def launch(self, kernel, at, runs_at, dur, *, tid=1, stream=7, op="aten::mm", cat="kernel", launch=True):
        self.corr += 1
        ext = self.corr + 10_000
        self.events.append(
            {
                "ph": "X",
                "cat": "cpu_op",
                "name": op,
                "pid": 1,
                "tid": tid,
                "ts": at - 1.0,
                "dur": 3.0,
                "args": {"External id": ext},
            }
        )
        if launch:
            self.events.append(
                {
                    "ph": "X",
                    "cat": "cuda_runtime",
                    "name": "cudaLaunchKernel",
                    "pid": 1,
                    "tid": tid,
                    "ts": at,
                    "dur": 1.0,
                    "args": {"correlation": self.corr, "External id": ext},
                }
            )
        self.events.append(
            {
                "ph": "X",
                "cat": cat,
                "name": kernel,
                "pid": 0,
                "tid": stream,
                "ts": runs_at,
                "dur": dur,
                "args": {"correlation": self.corr, "External id": ext, "stream": stream, "device": 0},
            }
        )

    def trace(self):
        return {"schemaVersion": 1, "traceEvents": list(self.events)}


@pytest.fixture(scope="module")
def gpu_trace():
    t = _Trace()
    t.range("train_step", 0, 1000)
    t.range("forward", 0, 100)
    t.range(ATTENTION_RANGES[0], 10, 10)
    t.range(ATTENTION_RANGES[1], 20, 10)
    t.range(ATTENTION_RANGES[2], 30, 10)
    t.range("backward", 100, 800)
    t.range("optimizer_step", 900, 100)
    # Forward kernels start on the GPU after the CPU left "forward": attribution must follow the launch.
    t.launch(GEMM, at=12, runs_at=150, dur=50)
    t.launch(MAX, at=22, runs_at=200, dur=10, op="aten::amax")
    t.launch(EXP, at=24, runs_at=210, dur=10, op="aten::exp")
    t.launch(GEMM, at=32, runs_at=220, dur=40)
    t.launch(NVJET, at=50, runs_at=260, dur=100)
    # Backward kernels are launched by the autograd engine's thread (tid 2), not the range's thread.
    t.launch(GEMM, at=200, runs_at=400, dur=60, tid=2)
    t.launch(GEMM, at=210, runs_at=460, dur=60, tid=2)
    t.launch(EXP, at=220, runs_at=520, dur=20, tid=2, op="aten::mul")
    # Optimizer: a multi-tensor kernel and a memcpy; one kernel without its launch event (op fallback).
    t.launch(
        "void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor<float>>()",
        at=910,
        runs_at=950,
        dur=20,
    )
    t.launch("Memcpy DtoD (Device -> Device)", at=920, runs_at=975, dur=5, cat="gpu_memcpy", op="aten::copy_")
    t.launch(EXP, at=930, runs_at=985, dur=5, launch=False, op="aten::add_")
    return t.trace()


def test_gpu_kernels_are_attributed_by_their_launch(gpu_trace):
    kt = P.kernel_table(gpu_trace)
    assert len(kt) == 11 and set(kt.scope) == {"train"}
    fwd = kt[kt["in:forward"]]
    assert list(fwd.start_us) == [150, 200, 210, 220, 260]  # all run after the CPU left "forward"
    assert not (fwd["in:backward"]).any()
    bwd = kt[kt["in:backward"]]
    assert list(bwd.start_us) == [400, 460, 520]  # launched from thread 2 during "backward"
    assert set(kt.loc[kt["in:computing softmax"], "name"]) == {MAX, EXP}
    assert set(kt.loc[kt["in:computing attention scores"], "start_us"]) == {150}
    opt = kt[kt["in:optimizer_step"]]
    assert list(opt.cls) == ["optimizer", "memcpy", "elementwise"]
    assert list(opt.attribution) == ["launch", "launch", "op"]
    assert kt.loc[kt.start_us == 260, "op"].item() == "aten::mm"


def test_gpu_summary_tables(gpu_trace):
    s = P.summarize(gpu_trace)
    r = s["ranges"].set_index("range")
    assert r.loc["forward", "kernel_ms"] == pytest.approx((50 + 10 + 10 + 40 + 100) / 1e3)
    assert r.loc["forward", "gpu_span_ms"] == pytest.approx((360 - 150) / 1e3)
    assert r.loc["forward", "cpu_ms"] == pytest.approx(0.1)
    assert r.loc["step", "kernel_ms"] == pytest.approx(
        r.loc[["forward", "backward", "optimizer_step"], "kernel_ms"].sum()
    )
    assert r.loc["backward", "num_kernels"] == 3
    c = s["classes"]
    for _, g in c.groupby(["scope", "range"]):
        assert g.share.sum() == pytest.approx(1.0)
    fwd = c[c.range == "forward"].set_index("cls")
    assert fwd.loc["matmul", "share"] == pytest.approx(190 / 210)
    top = s["top"][s["top"].range == "forward"]
    assert top.iloc[0]["name"] == NVJET and top.iloc[0]["calls"] == 1
    assert top.iloc[1]["name"] == GEMM and top.iloc[1]["calls"] == 2


def test_timeline_of_a_gpu_trace(gpu_trace, tmp_path):
    fig = P.plot_timeline(gpu_trace, title="synthetic")
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert labels == ["stream 7", "phases", "attention"]
    fig.savefig(tmp_path / "t.png")
    assert (tmp_path / "t.png").stat().st_size > 1000
    with pytest.raises(ValueError, match="inference_step"):
        P.plot_timeline(gpu_trace, scope="inference")


def test_slim_trace_roundtrip(gpu_trace, tmp_path):
    path = save_trace(slim_trace(gpu_trace), tmp_path / "t.json.gz")
    back = load_trace(path)
    assert not any(e.get("cat") == "cpu_op" for e in back["traceEvents"])
    kt = P.kernel_table(back)
    assert len(kt) == 11
    # Without the aten ops, the kernel that had no launch event falls back to its own device time.
    assert (kt.attribution == "device_time").sum() == 1


# --------------------------------------------------------------------------------------------------
# A real CPU trace of the debug model
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cpu_result():
    cfg = P.ProfileConfig(size="debug", context_length=16, batch_size=2, warmup=1, steps=1, device="cpu")
    return P.profile_config(cfg)


def test_annotated_attention_matches_naive():
    q, k, v = (torch.randn(2, 3, 17, 8) for _ in range(3))
    for causal in (True, False):
        assert torch.equal(
            naive_annotated_attention(q, k, v, causal), get_attention("naive")(q, k, v, causal)
        )


@pytest.mark.xdist_group("profile_cpu_trace")  # one profiled run per worker, shared
def test_cpu_trace_ranges_and_attribution(cpu_result):
    rt = P.range_table(cpu_result.trace)
    num_layers = get_config("debug").num_layers
    for scope, marker in [("inference", "inference_step"), ("train", "train_step")]:
        names = rt[rt.scope == scope].name.value_counts()
        assert names[marker] == 1 and names["forward"] == 1
        for rng in ATTENTION_RANGES:
            assert names[rng] == num_layers
    train = rt[rt.scope == "train"].name
    assert {"backward", "optimizer_step"} <= set(train)
    assert "warmup" not in set(rt.name)  # warm-up runs before the profiler starts
    kt = P.kernel_table(cpu_result.trace)
    soft = kt[kt["in:computing softmax"]]
    assert {"aten::amax", "aten::exp", "aten::sum", "aten::div"} <= set(soft.name)
    assert not (soft.cls == "matmul").any()
    assert (kt[kt["in:final matmul"]].cls == "matmul").any()
    assert (kt[kt["in:optimizer_step"]].cls == "elementwise").any()
    assert not kt.loc[kt["in:optimizer_step"], "in:forward"].any()


@pytest.mark.xdist_group("profile_cpu_trace")  # one profiled run per worker, shared
def test_cpu_summary_fractions_and_rows(cpu_result, tmp_path):
    s = P.summarize(cpu_result.trace)
    for _, g in s["classes"].groupby(["scope", "range"]):
        assert g.share.sum() == pytest.approx(1.0)
    r = s["ranges"].set_index(["scope", "range"])
    parts = r.loc[
        [("train", "forward"), ("train", "backward"), ("train", "optimizer_step")], "kernel_ms"
    ].sum()
    assert parts <= r.loc[("train", "step"), "kernel_ms"] + 1e-9  # zero_grad is in the step, outside phases
    assert parts > 0.9 * r.loc[("train", "step"), "kernel_ms"]
    rows = P.profile_rows(cpu_result)
    append_rows("nsys_profile", rows, tmp_path)
    df = load_results("nsys_profile", tmp_path)
    assert list(df.columns) == COLUMNS and (df.note == "").all()
    f = P.profile_frame(df)
    assert set(f.scope) == {"inference", "train"}
    assert {"python_timer", "range_gpu_span", "class_share", "top_kernel_time", "flops"} <= set(f.metric)
    shares = f[f.metric == "class_share"].groupby(["scope", "range"]).value.sum()
    assert all(math.isclose(v, 1.0, rel_tol=1e-9) for v in shares)
    flops = f[(f.metric == "flops") & (f.scope == "train")].set_index("range").value
    d_head = get_config("debug").d_head
    assert flops[ATTENTION_RANGES[0]] / flops[ATTENTION_RANGES[1]] == pytest.approx(
        2 * d_head / P.SOFTMAX_FLOPS_PER_SCORE
    )


@pytest.mark.xdist_group("profile_cpu_trace")  # one profiled run per worker, shared
def test_timeline_of_a_cpu_trace(cpu_result, tmp_path):
    fig = P.plot_timeline(cpu_result.trace)
    assert fig.axes[0].get_yticklabels()[0].get_text().startswith("thread ")
    fig.savefig(tmp_path / "cpu.png")


def test_failures_become_rows(monkeypatch, tmp_path):
    def oom(cfg):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(P, "profile_config", oom)
    cfgs = [P.ProfileConfig(size="debug", context_length=c, device="cpu") for c in (16, 32)]
    df = pd.DataFrame(P.measure(cfgs, results_dir=tmp_path, progress=False))
    assert list(df.note) == ["OOM", "OOM"] and list(df.x_value) == [16, 32]
    late = pd.DataFrame(P.measure(cfgs[:1], results_dir=tmp_path, deadline=0.0, progress=False))
    assert late.note.item().startswith("skipped: time budget")
    assert len(load_results("nsys_profile", tmp_path)) == 3


def test_config_validation():
    with pytest.raises(ValueError, match="profiler"):
        P.ProfileConfig(profiler="nsys")
    with pytest.raises(ValueError, match="steps"):
        P.ProfileConfig(steps=0)
    with pytest.raises(ValueError, match="unknown model size"):
        P.ProfileConfig(size="huge")


def test_profiler_none_gives_timer_rows_only():
    cfg = P.ProfileConfig(
        size="debug", context_length=8, batch_size=1, warmup=0, steps=1, profiler="none", device="cpu"
    )
    rows = P.profile_rows(P.profile_config(cfg))
    assert {r["metric"] for r in rows} == {"python_timer"}
    assert pd.DataFrame(rows)["mode"].tolist() == [
        "inference/forward",
        "train/forward",
        "train/backward",
        "train/optimizer_step",
    ]


def test_facts_on_the_committed_results():
    from cs336_systems.measure.results import REPO_ROOT, latest_run
    from cs336_systems.studies.profiling import timing_facts

    data = REPO_ROOT / "figures" / "data"
    frame = P.profile_frame(latest_run(load_results("nsys_profile", data)))
    bench = timing_facts.timing_stats(load_results("benchmarking_script", data))
    facts = P.facts(frame, bench, 512)
    fwd = P.forward_table(frame, bench).xs(512, level="context_length")
    first, last = facts["sizes"][0], facts["sizes"][-1]
    assert (first, last) == ("small", "2.7B")
    assert facts["span_first_ms"] == fwd.gpu_span_ms[first] and facts["span_last_ms"] == fwd.gpu_span_ms[last]
    dev = (fwd.python_ms / fwd.gpu_span_ms - 1).abs()
    assert facts["timer_dev_min"] == pytest.approx(dev.min()) and facts["timer_dev_max"] == pytest.approx(
        dev.max()
    )
    assert [k["size"] for k in facts["top_forward"]] == facts["sizes"]
    assert all(0 < k["share"] <= 1 and k["calls"] >= 1 for k in facts["top_forward"])
    assert 0 <= facts["same_top_fraction"] <= 1 and facts["step_top_matmul_fraction"] == 1.0
    assert all(m["train"] < m["inference"] for m in facts["matmul_share"])  # backward + AdamW add non-matmul
    assert facts["non_matmul_min"] <= facts["non_matmul_max"]
    assert facts["optimizer_elementwise_min"] == pytest.approx(1.0)
    # 5 FLOPs per score against 4 d_head for QK^T and PV: d_head 64 (small) to 80 (2.7B)
    assert facts["softmax_flop_ratio_max"] == pytest.approx(5 / (4 * 64))
    assert facts["softmax_flop_ratio_min"] == pytest.approx(5 / (4 * 80))
    low = facts["softmax_time_ratio_min"] / facts["softmax_flop_ratio_max"]
    high = facts["softmax_time_ratio_max"] / facts["softmax_flop_ratio_min"]
    assert low <= facts["softmax_per_flop_min"] <= facts["softmax_per_flop_max"] <= high
    with pytest.raises(ValueError, match="no profiled configuration"):
        P.facts(frame, bench, 12345)
    summary = P.summary_table(frame, bench, 512)
    assert list(summary.index) == facts["sizes"]
    assert summary["span ms"].tolist() == fwd.gpu_span_ms.reindex(facts["sizes"]).tolist()
    assert summary["share"].tolist() == [k["share"] for k in facts["top_forward"]]
    assert (summary["mm train"] < summary["mm infer"]).all()


def test_gemm_family_names():
    assert P.gemm_family("sm80_xmma_gemm_f32f32_f32f32_f32_tn_n_tilesize128x128x8_stage3_warpsize2x2x1") == (
        "xmma_gemm tn 128x128x8"
    )
    assert P.gemm_family("Kernel2[cutlass_80_simt_sgemm_256x128_8x4_nn_align1]") == "simt_sgemm nn 256x128"
    assert P.gemm_family("reduce_kernel[MaxOps]") == "reduce_kernel[MaxOps]"
