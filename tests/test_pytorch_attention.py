"""pytorch_attention / torch_compile harness: rows, OOM paths, budgets, memory accounting; the driver."""

import json
import math

import pandas as pd
import pytest
import torch

from cs336_systems.measure.budget import TimeBudget
from cs336_systems.measure.results import load_results
from cs336_systems.model.checkpointing import saved_tensors
from cs336_systems.studies.attention import pytorch_attention as pa
from cs336_systems.studies.attention import pytorch_attention_facts
from cs336_systems.studies.attention.torch_compile import attention_compile_sweep, whole_model_compile_sweep


def test_accounting_against_hand_computation():
    # batch 8, T = 256, d = 16, fp32: three (8, 256, 256) float tensors saved (masked scores, exp, P)
    acc = pa.attention_memory_accounting(8, 256, 16)
    square = 8 * 256 * 256 * 4  # 2 MiB
    assert (
        acc["saved: masked scores S'"] == acc["saved: exp(S' - m)"] == acc["saved: probabilities P"] == square
    )
    assert acc["saved: causal mask (T x T bool)"] == 256 * 256
    assert acc["saved: row max m and row sum l"] == 2 * 8 * 256 * 4
    assert acc["saved_for_backward"] == 3 * square + 65536 + 16384 == 6_373_376
    assert acc["inputs Q, K, V"] == 3 * 8 * 256 * 16 * 4
    assert acc["before_backward"] == 6_373_376 + 5 * 8 * 256 * 16 * 4  # + Q, K, V, O, dO
    # the smallest grid config that exceeds 141 GB at the estimated backward peak: T = 32768
    big = pa.attention_memory_accounting(8, 32768, 16)
    assert big["saved_for_backward"] >= 3 * 32 * 2**30 and big["backward_peak_estimate"] > 141e9
    with pytest.raises(ValueError):
        pa.attention_memory_accounting(8, 0, 16)


@pytest.mark.parametrize(("b", "t", "d"), [(8, 64, 16), (2, 97, 48)])
def test_accounting_saved_part_matches_autograd(b, t, d):
    q, k, v = (torch.randn(b, t, d, device="meta", requires_grad=True) for _ in range(3))
    _, rec = saved_tensors(pa.naive_attention, q, k, v)
    assert rec.activation_bytes == pa.attention_memory_accounting(b, t, d)["saved_for_backward"]
    assert rec.bytes("input") == 3 * b * t * d * 4  # Q, K^T (a view of K) and V, by reference


def test_sweep_on_cpu_writes_rows(tmp_path):
    cfgs = pa.attention_grid((8,), (16, 32), extra_points=(), reps=3, warmup=1, device="cpu", batch_size=2)
    df = pd.DataFrame(pa.measure(cfgs, results_dir=tmp_path, progress=False))
    saved = load_results("pytorch_attention", tmp_path)
    assert len(saved) == len(df) == 2 * 4  # first fwd/bwd + fwd/bwd timings; no memory rows on a CPU
    timed = saved[saved.metric.isin(["forward_time", "backward_time"])]
    assert (timed.n == 3).all() and (timed["mean"] > 0).all() and set(timed.x_value) == {16, 32}
    assert set(saved.name) == {"d8"} and saved.gpu_name.notna().all()
    cfg = json.loads(saved.config_json.iloc[0])
    assert cfg["causal"] is True and cfg["accounting"]["saved_for_backward"] > 0


class _OOMInBackward(torch.autograd.Function):
    """Identity whose backward succeeds `ok_calls` times, then runs out of memory."""

    calls = 0
    ok_calls = 0

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        _OOMInBackward.calls += 1
        if _OOMInBackward.calls > _OOMInBackward.ok_calls:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 32.00 GiB")
        return g


@pytest.mark.parametrize("ok_calls", [0, 1])  # fails in the warm-up / in the first timed backward
def test_oom_paths_become_rows(ok_calls):
    cfg = pa.AttentionBenchConfig(d=4, seq_len=8, batch_size=2, reps=2, warmup=1, device="cpu")

    def oom_forward(q, k, v):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB")

    rows = pd.DataFrame(pa.run_attention(cfg, attention_fn=oom_forward))
    assert list(rows.metric) == ["forward_time", "backward_time"]
    assert rows.note.tolist() == ["OOM", "not run: forward failed (OOM)"] and rows["mean"].isna().all()
    _OOMInBackward.calls, _OOMInBackward.ok_calls = 0, ok_calls
    rows = pd.DataFrame(pa.run_attention(cfg, attention_fn=lambda q, k, v: _OOMInBackward.apply(q + k + v)))
    fwd, bwd = (rows[rows.metric == m].iloc[0] for m in ("forward_time", "backward_time"))
    assert fwd.note == "" and fwd.n == 2 and bwd.note == "OOM"
    assert ("first_backward_time" in set(rows.metric)) == bool(ok_calls)
    assert pytorch_attention_facts.smallest_oom(
        pd.DataFrame(
            [
                {"note": "OOM", "name": "d32", "x_value": 8192},
                {"note": "OOM", "name": "d16", "x_value": 16384},
                {"note": "", "name": "d16", "x_value": 256},
            ]
        )
    ) == (32, 8192)


def test_budget_skips_and_reduces_reps():
    cfg = pa.AttentionBenchConfig(d=4, seq_len=8, batch_size=2, reps=50, warmup=1, device="cpu")
    rows = pa.run_attention(cfg, budget=TimeBudget(0.0, label="t"))
    assert all(r["note"].startswith("skipped: time budget 't'") for r in rows)
    slow = lambda q, k, v: (__import__("time").sleep(0.02), pa.naive_attention(q, k, v))[1]
    rows = pd.DataFrame(pa.run_attention(cfg, budget=TimeBudget(0.5), attention_fn=slow))
    fwd = rows[rows.metric == "forward_time"].iloc[0]
    assert 5 <= fwd.n < 50 and "reduced from 50" in fwd.note


def test_compiled_sweep_replays_backward(tmp_path):
    # aot_eager goes through Dynamo and AOTAutograd (donated buffers) without Inductor's C++ compile
    df = attention_compile_sweep(
        (8,),
        (16,),
        extra_points=(),
        backend="aot_eager",
        reps=2,
        warmup=1,
        device="cpu",
        batch_size=2,
        results_dir=tmp_path,
        progress=False,
    )
    assert (df.note == "").all() and set(df.impl) == {"naive_compiled[aot_eager]"}
    assert len(load_results("torch_compile", tmp_path)) == len(df)


def test_scaling_exponent():
    assert pytorch_attention_facts.scaling_exponent(
        [256, 1024, 4096], [3 * t * t for t in (256, 1024, 4096)]
    ) == pytest.approx(2.0)
    assert math.isnan(pytorch_attention_facts.scaling_exponent([256], [1.0]))


def test_whole_model_sweep_eager_and_skipped(tmp_path):
    df = whole_model_compile_sweep(
        ("debug",),
        ("forward",),
        context_length=16,
        warmup=1,
        steps=2,
        device="cpu",
        include_compiled=False,
        skip_reason="test",
        results_dir=tmp_path,
        progress=False,
    )
    eager, compiled = df[df.impl == "naive"], df[df.impl == "naive+compile"]
    assert set(eager.metric) == {"forward_time", "step_time", "wall_time"} and (eager.note == "").all()
    assert set(compiled.note) == {"skipped: test"} and "wall_time" in set(compiled.metric)


def test_family_entries_write_a_manifest(tmp_path):
    from cs336_systems.studies.attention.__main__ import main as attention_main
    from cs336_systems.studies.profiling.__main__ import main as profiling_main

    results, out = tmp_path / "data", tmp_path / "out"
    manifest = profiling_main(
        ["--quick", "--parts", "block_saved", "--out", str(out), "--results-dir", str(results)]
    )
    assert manifest["quick"] and list(manifest["parts"]) == ["block_saved"]
    assert json.loads((out / "manifest.json").read_text())["parts"] == manifest["parts"]
    assert "debug_ctx64" in json.loads((results / "memory_profiling" / "block_saved_by_op.json").read_text())
    assert set(load_results("memory_profiling", results).metric) == {
        "block_saved_activation_hooks",
        "block_param_grad_expected",
    }
    manifest = attention_main(
        [
            "--quick",
            "--parts",
            "attention",
            "--budget-s",
            "1e-9",
            "--out",
            str(out),
            "--results-dir",
            str(results),
        ]
    )
    part = manifest["parts"]["attention"]
    assert part["rows"] > 0 and part["skipped"] == part["rows"]  # an exhausted budget skips, never drops


@pytest.mark.gpu
def test_memory_before_backward_matches_accounting_on_gpu():
    cfg = pa.AttentionBenchConfig(d=32, seq_len=1024, reps=3, warmup=1, device="cuda")
    rows = pd.DataFrame(pa.run_attention(cfg)).set_index("metric")
    acc = pa.attention_memory_accounting(8, 1024, 32)
    graph = rows.loc["memory_forward_graph", "mean"] * 2**20
    assert abs(graph - (acc["saved_for_backward"] + acc["output O"])) <= 0.02 * acc["saved_for_backward"]
    assert rows.loc["memory_before_backward", "mean"] * 2**20 >= acc["before_backward"]
    assert rows.loc["peak_memory_backward", "mean"] > rows.loc["memory_before_backward", "mean"]
