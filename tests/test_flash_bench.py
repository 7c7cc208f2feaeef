"""Report helpers of the FlashAttention leaderboard (notebook 11): runs, final kernels, ncu parsing."""

from __future__ import annotations

import json

import pandas as pd
import torch

from cs336_systems.attention.flash_triton import launch
from cs336_systems.studies import flash_leaderboard, flash_tuning

FWD = repr(launch.heuristic_fwd(16384, 16384, 64, torch.bfloat16, interpreter=False))
BWD = launch.heuristic_bwd(16384, 16384, 64, torch.bfloat16, interpreter=False)


def _run(run_id, ours, flash, *, bwd=BWD, rep=10000.0, order=("sdpa_flash", "flash_triton", "sdpa_cudnn")):
    cfg = {"rep_ms": rep, "warmup_ms": 1000.0, "run_id": run_id, "tiles_fwd": FWD, "tiles_bwd": bwd if isinstance(bwd, str) else repr(bwd),
           "tiles_source": "heuristic"}  # fmt: skip
    ms = {"flash_triton": ours, "sdpa_flash": flash, "sdpa_cudnn": 4.5}
    return [
        {"name": "protocol", "metric": "latency", "impl": impl, "p50": ms[impl], "config_json": json.dumps(cfg),
         "gpu_name": "NVIDIA H200", "git_sha": f"sha{run_id}", "timestamp": f"2026-11-23T10:0{run_id}:00"}
        for impl in order
    ]  # fmt: skip


def test_runs_are_grouped_by_run_id_and_final_runs_follow_the_heuristic_table():
    other = BWD.__class__(**{**BWD.__dict__, "maxnreg1": None})  # other kernels: not final
    # an older row: same kernels, the dQ pass on a side stream (a switch that has left the kernels): final
    streams = repr(BWD)[:-1] + ", fused=False, tma1=None, tma2=None, streams=True)"
    df = pd.DataFrame(
        _run(1, 5.0, 7.0) + _run(2, 5.2, 7.0, bwd=other) + _run(3, 5.0, 7.0, rep=3000.0)
        + _run(4, 5.3, 7.1, bwd=streams, order=("flash_triton", "sdpa_cudnn", "sdpa_flash"))
    )  # fmt: skip
    runs = flash_leaderboard.protocol_runs(df, target=0.72)
    assert list(runs["git sha"]) == ["sha1", "sha2", "sha3", "sha4"]
    assert runs["ours / sdpa_flash"].round(6).tolist() == [round(5.0 / 7.0, 6), round(5.2 / 7.0, 6),
                                                           round(5.0 / 7.0, 6), round(5.3 / 7.1, 6)]  # fmt: skip
    assert runs["<= target"].tolist() == [True, False, True, False]
    assert list(flash_leaderboard.final_runs(runs)["git sha"]) == ["sha1", "sha4"]


NCU_TEXT = """\
  flash_bwd_dkdv_kernel (16, 256, 1)x(128, 1, 1), Context 1, Stream 7, Device 0, CC 9.0
    Section: GPU Speed Of Light Throughput
    Duration                         ms         2.86
    INF   Shared is the highest-utilized pipeline (52.2%) based on elapsed cycles in the workload
    Registers Per Thread             register/thread               168
    Local Memory Spilling Requests                       10,756,032
  flash_bwd_preprocess_kernel (16, 256, 1)x(128, 1, 1), Context 1, Stream 7, Device 0, CC 9.0
    Duration                         us        19.17
"""


def test_ncu_summary_parses_metrics_units_and_the_busiest_pipeline():
    t = flash_tuning.ncu_summary(NCU_TEXT)
    assert list(t.columns) == ["flash_bwd_dkdv_kernel", "flash_bwd_preprocess_kernel"]
    assert t.loc["Duration (ms)", "flash_bwd_dkdv_kernel"] == "2.86"
    assert t.loc["Duration (ms)", "flash_bwd_preprocess_kernel"] == "0.019"  # us -> ms
    assert t.loc["Registers Per Thread (register/thread)", "flash_bwd_dkdv_kernel"] == "168"
    assert t.loc["Local Memory Spilling Requests", "flash_bwd_dkdv_kernel"] == "10,756,032"
    assert t.loc["busiest pipeline", "flash_bwd_dkdv_kernel"] == "Shared 52.2%"


def test_sweep_facts_on_the_committed_results():
    from cs336_systems.report import load_results
    from cs336_systems.studies import flash_sweep

    df = flash_sweep.sweep_frame(load_results(flash_sweep.PROBLEM))
    facts = flash_sweep.facts(df)
    lat = df[(df.metric == "latency") & (df["mode"] == "fwd_bwd") & (df.dtype == "bfloat16") & (df.d == 64)]
    ms = lat.set_index(["impl", "N"]).p50
    assert facts["triton_ms_long"] == ms[("flash_triton", 16384)]
    assert facts["speedup_long"] == ms[("naive", 16384)] / ms[("flash_triton", 16384)] > 5
    assert facts["naive_oom_n"] == int(lat[(lat.impl == "naive") & (lat.note == "OOM")].N.min())
    assert facts["memory_exponent_triton"] < 1.2 < 1.8 < facts["memory_exponent_naive"]
    assert 0 < facts["sdpa_floor_ms"] < facts["floor_ms"]
    gpu = ~df.gpu_name.astype(str).str.startswith("cpu")
    tf = df[gpu & (df.metric == "throughput") & (df.impl == "flash_triton") & (df["mode"] == "fwd_bwd")]
    assert facts["best_tflops"]["tflops"] == tf[tf["dtype"] == "bfloat16"].p50.max()
