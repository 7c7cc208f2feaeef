"""Tests of the measurement harness: statistics, tidy rows with provenance, failure capture, timers, FLOPs."""

import json
import math

import pandas as pd
import pytest
import torch

from cs336_systems.measure import flops
from cs336_systems.measure.provenance import DIRTY_MARK, dirty_rows, is_dirty_sha, provenance
from cs336_systems.measure.results import (
    COLUMNS,
    append_rows,
    capture_failure,
    failure_row,
    latest_run,
    load_results,
    make_row,
    summarize,
)
from cs336_systems.measure.timing import PhaseTimer, kernel_time, time_steps


def test_summarize_statistics():
    s = summarize([1.0, 2.0, 3.0, 4.0, 10.0])
    assert s["p50"] == 3.0 and s["mean"] == 4.0 and s["n"] == 5
    assert s["std"] == pytest.approx(math.sqrt((9 + 4 + 1 + 0 + 36) / 5))
    assert s["p20"] <= s["p50"] <= s["p80"]
    assert math.isnan(summarize([])["mean"])


def test_rows_round_trip_with_provenance(tmp_path):
    rows = [
        make_row(
            problem="demo",
            name="small",
            metric="forward_time",
            unit="ms",
            samples=[1.0, 3.0],
            x_name="context_length",
            x_value=128,
            config={"a": 1},
        ),
        failure_row(
            problem="demo",
            name="2.7B",
            metric="forward_time",
            unit="ms",
            note="OOM",
            x_name="context_length",
            x_value=1024,
        ),
    ]
    path = append_rows("demo", rows, tmp_path)
    append_rows(
        "demo",
        [
            make_row(
                problem="demo",
                name="small",
                metric="forward_time",
                unit="ms",
                value=5.0,
                x_name="context_length",
                x_value=128,
            )
        ],
        tmp_path,
    )
    assert path == tmp_path / "demo.csv"
    header = path.read_text().splitlines()[0].split(",")
    assert header == COLUMNS  # written once, schema order
    df = load_results("demo", tmp_path)
    assert len(df) == 3
    ok = df.iloc[0]
    assert (
        ok["mean"] == 2.0
        and json.loads(ok["samples"]) == [1.0, 3.0]
        and json.loads(ok["config_json"]) == {"a": 1}
    )
    for col in ("gpu_name", "torch_version", "git_sha", "timestamp"):
        assert isinstance(ok[col], str) and ok[col]
    assert df.iloc[1]["note"] == "OOM" and math.isnan(df.iloc[1]["mean"])
    latest = latest_run(df)
    assert len(latest) == 2 and latest[latest.name == "small"]["mean"].item() == 5.0
    assert "torch" in provenance(df) and "device" in provenance(df)


def test_dirty_shas_are_marked_in_the_provenance_line_and_listed(tmp_path):
    clean = make_row(problem="demo", name="a", metric="m", unit="ms", value=1.0)
    rows = [dict(clean, git_sha="abc1234567"), dict(clean, git_sha="def7654321-dirty")]
    append_rows("demo", rows, tmp_path)
    df = load_results("demo", tmp_path)
    line = provenance(df)
    assert f"def7654321-dirty{DIRTY_MARK}" in line and f"abc1234567{DIRTY_MARK}" not in line
    assert "1 of 2 rows were measured from uncommitted code" in line
    assert DIRTY_MARK not in provenance(df[df.git_sha == "abc1234567"])
    listed = dirty_rows(tmp_path)
    assert listed.to_dict("records") == [
        {"file": "demo.csv", "git_sha": "def7654321-dirty", "device": clean["gpu_name"], "rows": 1}
    ]
    assert is_dirty_sha("x-dirty") and not is_dirty_sha("dirtyx")


def test_results_and_figures_written_by_earlier_runs_do_not_make_the_sha_dirty():
    from cs336_systems.measure import results

    specs = results._OUTPUT_PATHSPECS
    assert ":(exclude)figures" in specs and ":(exclude)writeup.pdf" in specs


def test_schema_is_enforced(tmp_path):
    row = make_row(problem="demo", metric="m", unit="ms", value=1.0)
    row["surprise"] = 1
    with pytest.raises(ValueError, match="unknown result columns"):
        append_rows("demo", [row], tmp_path)
    with pytest.raises(ValueError, match="note"):
        failure_row(problem="demo", metric="m", unit="ms", note="")
    assert load_results("missing", tmp_path).empty


def test_capture_failure_records_oom_and_errors():
    outcome = {}
    with capture_failure(outcome):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    assert outcome == {"note": "OOM"}
    outcome = {}
    with capture_failure(outcome):
        raise RuntimeError("shape mismatch\nmore detail")
    assert outcome["note"] == "error: RuntimeError: shape mismatch"
    outcome = {}
    with capture_failure(outcome):
        pass
    assert outcome == {}
    with pytest.raises(KeyboardInterrupt), capture_failure({}):
        raise KeyboardInterrupt


def test_step_timers_count_and_order():
    calls = []
    times = time_steps(lambda: calls.append(1), warmup=3, steps=4)
    assert len(calls) == 7 and len(times) == 4 and all(t >= 0 for t in times)
    with pytest.raises(ValueError):
        time_steps(lambda: None, warmup=-1, steps=1)
    timer = PhaseTimer()
    for i in range(3):
        timer.enabled = i > 0  # first step untimed
        with timer.phase("forward"):
            pass
        with timer.phase("backward"):
            pass
    assert {k: len(v) for k, v in timer.samples.items()} == {"forward": 2, "backward": 2}
    assert set(timer.summary()["forward"]) >= {"mean", "std", "p50"}


def test_kernel_time_cpu_fallback():
    x = torch.randn(64, 64)
    stats = kernel_time(lambda: x @ x, warmup_ms=1, rep_ms=5, device="cpu")
    assert stats["n"] >= 3 and 0 < stats["p20"] <= stats["p50"] <= stats["p80"]


def test_flop_formulas_and_peaks():
    f = flops.attention_flops(1, 16, 1024, 1024, 64, causal=False, mode="fwd")
    assert f == 4 * 16 * 1024 * 1024 * 64
    assert flops.attention_flops(1, 16, 1024, 1024, 64, causal=True, mode="fwd_bwd") == 0.5 * 3.5 * f
    with pytest.raises(ValueError):
        flops.attention_flops(1, 1, 1, 1, 1, causal=False, mode="sideways")
    assert flops.peak_flops("NVIDIA H100 80GB HBM3", torch.bfloat16) == pytest.approx(989.4e12)
    assert flops.peak_flops("NVIDIA H200", "float32") == pytest.approx(66.9e12)
    assert flops.peak_flops("cpu (x86_64)", torch.float32) is None
    assert flops.mfu(1e12, 1000.0, "unknown", torch.float32) is None
    assert flops.tflops(2e12, 1000.0) == pytest.approx(2.0)


def test_model_flops_per_token():
    from cs336_systems.model import get_config

    cfg = get_config("small", context_length=128)
    d, f, L, V = 768, 3072, 12, 10_000
    expected = L * (2 * (4 * d * d + 3 * d * f) + 4 * 128 * d) + 2 * d * V
    assert cfg.matmul_flops_per_token() == expected
    assert isinstance(pd.DataFrame([make_row(problem="x", metric="m", unit="u", value=1)]), pd.DataFrame)


def test_git_sha_prefers_the_launchers_statement(monkeypatch):
    """On a device host the tree's copy may carry a stale .git: CS336_GIT_SHA (set by whoever sent
    the tree) must win over `git rev-parse` there."""
    from cs336_systems.measure import results

    results._git_sha.cache_clear()
    monkeypatch.setenv("CS336_GIT_SHA", "abc1234567")
    try:
        assert results._git_sha() == "abc1234567"
        monkeypatch.delenv("CS336_GIT_SHA")
        results._git_sha.cache_clear()
        assert results._git_sha() not in ("abc1234567", "")
    finally:
        results._git_sha.cache_clear()


def test_child_env_tells_subprocesses_where_to_write_and_the_commit(tmp_path, monkeypatch):
    from cs336_systems.measure import results

    env = results.child_env(tmp_path)
    # the workers record the commit this process records (a copied tree's own .git may be stale)
    assert env == {"CS336_RESULTS_DIR": str(tmp_path), "CS336_GIT_SHA": results.env_metadata()["git_sha"]}
    monkeypatch.setenv("CS336_RESULTS_DIR", str(tmp_path / "env"))
    assert results.child_env()["CS336_RESULTS_DIR"] == str(tmp_path / "env")
