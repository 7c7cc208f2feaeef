"""Report helpers of the FlashAttention leaderboard (notebook 11): runs, final kernels, ncu parsing."""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest
import torch

from cs336_systems.attention.flash_triton import launch
from cs336_systems.measure.results import REPO_ROOT
from cs336_systems.studies.attention import (
    flash_leaderboard,
    flash_leaderboard_facts,
    flash_model,
    flash_tuning,
)

FWD = repr(launch.heuristic_fwd(16384, 16384, 64, torch.bfloat16, interpreter=False))
BWD = launch.heuristic_bwd(16384, 16384, 64, torch.bfloat16, interpreter=False)


def _run(run_id, ours, flash, *, bwd=BWD, rep=10000.0, order=("sdpa_flash", "flash_triton", "sdpa_cudnn")):
    cfg = {
        "rep_ms": rep,
        "warmup_ms": 1000.0,
        "run_id": run_id,
        "tiles_fwd": FWD,
        "tiles_bwd": bwd if isinstance(bwd, str) else repr(bwd),
        "tiles_source": "heuristic",
    }
    ms = {"flash_triton": ours, "sdpa_flash": flash, "sdpa_cudnn": 4.5}
    return [
        {
            "name": "protocol",
            "metric": "latency",
            "impl": impl,
            "p50": ms[impl],
            "config_json": json.dumps(cfg),
            "gpu_name": "NVIDIA H200",
            "git_sha": f"sha{run_id}",
            "timestamp": f"2026-11-23T10:0{run_id}:00",
        }
        for impl in order
    ]


def test_runs_are_grouped_by_run_id_and_final_runs_follow_the_heuristic_table():
    other = BWD.__class__(**{**BWD.__dict__, "maxnreg1": None})  # other kernels: not final
    # an older row: same kernels, the dQ pass on a side stream (a switch that has left the kernels): final
    streams = repr(BWD)[:-1] + ", fused=False, tma1=None, tma2=None, streams=True)"
    df = pd.DataFrame(
        _run(1, 5.0, 7.0)
        + _run(2, 5.2, 7.0, bwd=other)
        + _run(3, 5.0, 7.0, rep=3000.0)
        + _run(4, 5.3, 7.1, bwd=streams, order=("flash_triton", "sdpa_cudnn", "sdpa_flash"))
    )
    runs = flash_leaderboard_facts.protocol_runs(df, target=0.72)
    assert list(runs["git sha"]) == ["sha1", "sha2", "sha3", "sha4"]
    assert runs["ours / sdpa_flash"].round(6).tolist() == [
        round(5.0 / 7.0, 6),
        round(5.2 / 7.0, 6),
        round(5.0 / 7.0, 6),
        round(5.3 / 7.1, 6),
    ]
    assert runs["<= target"].tolist() == [True, False, True, False]
    assert list(flash_leaderboard_facts.final_runs(runs)["git sha"]) == ["sha1", "sha4"]


@pytest.mark.parametrize(
    ("recorded", "one_pass"),
    [({}, False),
     ({"hopper_dkdv": "WarpSpecializedBwdConfig(block_m=64, stages=2, consumer_regs=240, consumers=2, dq_regs=0, "
                      "ds_slots=2, dq_buffers=2)"}, False),
     ({"hopper_dkdv": "WarpSpecializedBwdConfig(block_m=64, stages=2, consumer_regs=200, consumers=2, dq_regs=88, "
                      "ds_slots=2, dq_buffers=2)"}, True),
     ({"hopper_dkdv": "WarpSpecializedBwdConfig(block_m=64, consumer_regs=200, dq_regs=88)",
       "hopper_bwd_default": False}, False)],
)  # fmt: skip
def test_a_run_whose_backward_was_the_gluon_one_pass_kernel_is_not_a_tl_final_run(recorded, one_pass):
    df = pd.DataFrame(_run(1, 4.5, 7.0))
    df["config_json"] = [json.dumps(json.loads(c) | recorded) for c in df.config_json]
    runs = flash_leaderboard_facts.protocol_runs(df)
    assert runs["our backward"].tolist() == ["Gluon one pass" if one_pass else "tl"]
    assert len(flash_leaderboard_facts.final_runs(runs)) == (0 if one_pass else 1)


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
    from cs336_systems.studies.attention import flash_sweep

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


def test_leaderboard_facts_on_the_committed_results():
    from cs336_systems.report import load_results

    df = load_results(flash_leaderboard.LEADERBOARD)
    ncu = flash_tuning.ncu_table(REPO_ROOT / "figures" / "data")
    facts = flash_leaderboard.facts(df, 0.72, ncu=ncu)
    # direct: the full-protocol runs whose tiles are today's heuristic ones, on the H100 (the default)
    runs = flash_leaderboard_facts.protocol_runs(df)
    final = flash_leaderboard_facts.final_runs(runs)
    ratio = final["ours ms"] / final["sdpa_flash ms"]
    h100_final = final.gpu.str.contains("H100")
    assert facts["final_runs"] == h100_final.sum() >= 2 and facts["final_gpu"] == "H100 80GB HBM3"
    assert (
        facts["ratio_median"] == ratio[h100_final].median() and facts["ratio_best"] == ratio[h100_final].min()
    )
    assert facts["runs_meeting_target"] == int((ratio[h100_final] <= 0.72).sum())
    assert facts["ratio_median_by_gpu"]["H200"] == ratio[final.gpu == "H200"].median() < 0.73
    on_h200 = flash_leaderboard.facts(df, 0.72, gpu="H200")
    assert on_h200["final_gpu"] == "H200" and on_h200["ratio_best"] == ratio[final.gpu == "H200"].min() < 0.72
    assert on_h200["runs_meeting_target"] == int((ratio[final.gpu == "H200"] <= 0.72).sum()) >= 1
    split = df[(df.name == "split") & (df.metric == "throughput")]
    # the tl kernels' passes: the portable impl of the latest split run that timed it (the latest split runs'
    # own default backward is Gluon's, and the H200 run at b04f68b timed no portable kernels)
    tl_sha = split[split.impl == "flash_triton_portable"].git_sha.iloc[-1]
    assert tl_sha != split.git_sha.iloc[-1]  # the committed rows have later split runs without them
    last = split[split.git_sha == tl_sha].set_index(["impl", "mode"]).p50
    peak = df[(df.name == "matmul_peak") & (df.git_sha == tl_sha)].p50.iloc[-1]  # that run's
    assert facts["bwd_peak_fraction"] == pytest.approx(last[("flash_triton_portable", "bwd")] / peak)
    assert facts["bwd_tflops_issued"] == pytest.approx(last[("flash_triton_portable", "bwd")] * 1.4)
    v0 = df[(df.name == "variant") & (df.impl == "v0_mask_all_tiles") & (df["mode"] == "fwd_bwd")]
    assert facts["version_ms"]["v0_mask_all_tiles"] == v0.p50.iloc[-1]
    h100 = runs[runs.gpu.str.contains("H100") & (runs["our backward"] == "tl")]
    assert facts["h100_last_ratio"] == h100["ours ms"].iloc[-1] / h100["sdpa_flash ms"].iloc[-1]
    # runs whose own backward was the Gluon one-pass kernel are not the tl kernels' final runs
    one_pass = runs[runs["our backward"] == "Gluon one pass"]
    assert len(one_pass) >= 3 and not set(one_pass.index) & set(final.index)
    on_h100 = one_pass[one_pass.gpu.str.contains("H100")]  # the facts' GPU (the H200 has its own runs)
    latest = on_h100[on_h100["git sha"] == on_h100["git sha"].iloc[-1]]
    assert facts["one_pass_runs"] == len(latest)
    assert facts["one_pass_ratio_median"] == pytest.approx(latest["ours / sdpa_flash"].median())
    assert facts["ncu"]["dkdv_spill_requests"] == ncu.loc["Local Memory Spilling Requests", "dkdv (final)"]
    assert "ncu" not in flash_leaderboard.facts(df)  # no profile table, no profile facts


def test_model_facts_on_the_committed_results():
    from cs336_systems.report import load_results

    df = load_results(flash_model.PROBLEM)
    facts = flash_model.facts(df)
    checks = df[(df["mode"] == "check") & (df.metric == "max_grad_rel_err")]
    for (dtype, impl), g in checks.groupby(["dtype", "impl"]):
        assert facts["max_grad_rel_err"][(dtype, impl)] == g["mean"].max()
    step = df[(df["mode"] == "train") & (df.metric == "step_time")]
    ok = step[step.note.fillna("") == ""].set_index(["x_value", "impl"])["mean"]
    train = df[df["mode"] == "train"]
    oom = train[(train.impl == "naive") & train.note.fillna("").str.startswith("OOM")]
    assert facts["naive_oom_context"] == int(oom.x_value.min())
    assert facts["naive_oom_batch"] == json.loads(oom.config_json.iloc[0])["batch_size"]
    assert set(facts["speedup_vs_naive"]) == {c for c in (512, 1024, 2048, 4096) if (c, "naive") in ok.index}
    for c, r in facts["speedup_vs_naive"].items():
        assert r == pytest.approx(ok[(c, "naive")] / ok[(c, "flash_triton")])
    assert sorted(facts["vs_sdpa"]) == [512, 1024, 2048, 4096]
    assert facts["vs_sdpa"][4096] == pytest.approx(ok[(4096, "flash_triton")] / ok[(4096, "sdpa")])


def test_hopper_facts_on_the_committed_results():
    import json

    from cs336_systems.report import load_results
    from cs336_systems.studies.attention import flash_hopper, flash_hopper_facts

    df = load_results(flash_hopper.PROBLEM)
    f = flash_hopper.facts(df)
    cfg = [json.loads(c) for c in df.config_json]
    df = df.assign(
        d=[c.get("d") for c in cfg], heads=[c.get("heads") for c in cfg], n=[c.get("seq_len") for c in cfg]
    )
    tun = df[(df.name == "hopper_tuning") & (df.metric == "latency") & df.p50.notna()]
    dkdv = tun[(tun.d == 80) & (tun["mode"] == "dkdv") & (tun.git_sha == tun.git_sha.iloc[-1])]
    tl = dkdv[dkdv.impl.str.startswith("tl ")].p50.iloc[-1]
    ws = dkdv.impl.str.startswith("gluon WarpSpecialized")
    best = dkdv[dkdv.impl.str.startswith("gluon ") & ~ws].p50.min()
    best_ws = dkdv[ws].p50.min()
    assert (
        f["pass_ratio"][(80, "dkdv")] == pytest.approx(best / tl) and best < tl
    )  # no padding pays at d = 80
    assert f["ws_ratio"][(80, "dkdv")] == pytest.approx(best_ws / tl)
    assert f["pass_ratio"][(64, "dkdv")] > 1  # ... and does not at d = 64
    assert f["ws_ratio"][(128, "fwd")] < 1  # the warp-specialised forward pays at d = 128 (the text says so)
    # the one-pass backward against the tl passes (rows "bwd" of the latest tuning run), faster at d = 64, 80
    for d in (64, 80):
        bwd = tun[(tun.d == d) & (tun["mode"] == "bwd") & (tun.git_sha == tun.git_sha.iloc[-1])]
        one = bwd[bwd.impl.str.startswith("gluon one pass")].p50.min()
        assert f["ws_ratio"][(d, "bwd")] == pytest.approx(
            one / bwd[bwd.impl.str.startswith("tl ")].p50.iloc[-1]
        )
        assert f["ws_ratio"][(d, "bwd")] < 1
    # per GPU model: every shape (the protocol's and the models') has an H100 and an H200 entry, each the
    # latest run of that shape on that model, its ratio from that one run (never across models)
    fb = df[df.name.isin(["protocol", "shapes"]) & (df.metric == "latency")]
    fb = fb.assign(
        gpu=fb.gpu_name.map(flash_hopper_facts.gpu_kind),
        shape=[f"{int(h)} x {int(n)} x {int(d)}" for h, n, d in zip(fb.heads, fb.n, fb.d)],
        run=[str(json.loads(c).get("run_id", sha)) for c, sha in zip(fb.config_json, fb.git_sha)],
    )
    assert f["gpus"] == ["H100", "H200"]
    for gpu in ("H100", "H200"):
        assert set(f["vs_cudnn"][gpu]) == set(flash_hopper_facts.SHAPE_ORDER)
        for shape, ratio in f["vs_cudnn"][gpu].items():
            rows = fb[(fb.gpu == gpu) & (fb["shape"] == shape)].sort_values("timestamp")
            run = rows[rows.run == rows.run.iloc[-1]].set_index("impl").p50
            assert ratio == pytest.approx(run["flash_triton"] / run["sdpa_cudnn"])
            assert (ratio <= 1) == (shape in f["at_or_below_cudnn"][gpu]) != (shape in f["above_cudnn"][gpu])
        for mode in ("fwd", "bwd"):
            assert (gpu, "32 x 32768 x 128", mode) in f["shape_passes"]
        ratios = dict(
            sorted((int(k.split(" x ")[1]), v) for k, v in f["vs_flash"][gpu].items() if k.endswith("x 80"))
        )
        start = f["d80"][gpu]["d80_no_slower_from"]
        assert start in ratios and all(v <= 1 for n, v in ratios.items() if n >= start)
        assert any(v > 1 for n, v in ratios.items() if n < start)  # host overhead below it (the text says so)
    # the protocol shape: the latest commit with at least three runs on each GPU model (H200: 51d1c8d's,
    # the full protocol budget, beside older H200 rows of other commits, b04f68b's at rep 1500; H100: a
    # later commit's single run, 8c1c700, stays out), none mixed into its figures
    runs = flash_leaderboard_facts.protocol_runs(df)
    for gpu in ("H100", "H200"):
        mine = runs[runs.gpu.map(flash_hopper_facts.gpu_kind) == gpu]
        counts = mine.groupby("git sha", sort=False).size()
        latest = mine[mine["git sha"] == counts[counts >= 3].index[-1]]
        p = f["protocol"][gpu]
        assert p["sha"] == latest["git sha"].iloc[-1][:7] and p["runs"] == len(latest) >= 3
        assert p["ratio_min"] == pytest.approx(latest["ours / sdpa_flash"].min())
        assert p["beats_cudnn"] == bool((latest["ours ms"] < latest["sdpa_cudnn ms"]).all())
    assert f["protocol"]["H200"]["budget"] == "10000/1000" and f["protocol"]["H100"]["budget"] == "10000/1000"
    assert runs[runs.gpu == "H200"]["git sha"].nunique() > 1  # older H200 protocol commits exist
    assert f["protocol"]["H100"]["ratio_max"] <= 0.70 and f["protocol"]["H200"]["ratio_max"] <= 0.70


def test_shape_table_on_the_committed_results_never_mixes_gpu_models_or_runs():
    """Notebook 42's table: a row per GPU model and shape, the protocol shape included; the forward +
    backward ratio from one run on one GPU model, each pass alone from one split run on the same model."""
    from cs336_systems.report import load_results
    from cs336_systems.studies.attention import flash_hopper, flash_hopper_facts

    df = load_results(flash_hopper.PROBLEM)
    t = flash_hopper_facts.shape_throughput_table(df)
    assert set(zip(t.gpu, t["shape"])) == {
        (g, s) for g in ("H100", "H200") for s in flash_hopper_facts.SHAPE_ORDER
    }
    assert t[["fwd ours", "fwd cuDNN", "bwd ours", "bwd cuDNN", "fwd+bwd / cuDNN"]].notna().all().all()
    src = t.attrs["source"]
    fb, split = src[src.metric == "latency"], src[src.metric == "throughput"]
    for rows in (fb, split):
        per_row = rows.groupby(["gpu", "shape"])
        assert (per_row.gpu_name.nunique() == 1).all() and (per_row.run_id.nunique() == 1).all()
    h200 = t[t.gpu == "H200"]
    # on the H200 the latest runs: fcdac70 at the protocol's shape (without CUDA-graph steps or the eager
    # call), 64152b4 at 32 x 32768 x 128 and 512, 1024 and 2048 tokens (both), b04f68b at 4096 tokens
    # (CUDA-graph steps, no eager call)
    h200_src = src[(src.gpu == "H200") & (src.metric == "latency")]
    sha = h200_src.groupby("shape").git_sha.agg(lambda x: set(x.str[:7]))
    assert set(sha.map(tuple)) == {("fcdac70",), ("64152b4",), ("b04f68b",)}
    timed = h200_src.groupby("shape").impl.agg(set)
    for col, impl in (("graphed / cuDNN", "flash_triton_graphed"), ("eager / cuDNN", "flash_triton_eager")):
        ratio = h200.set_index("shape")[col]
        assert any(impl in timed[s] for s in sha.index)
        assert all((ratio[s] == ratio[s]) == (impl in timed[s]) for s in sha.index)  # blank, never borrowed
    runs = t.attrs["runs"]
    assert (runs["min"] <= t["fwd+bwd / cuDNN"] + 1e-12).all() and (
        t["fwd+bwd / cuDNN"] <= runs["max"] + 1e-12
    ).all()


def _shape_rows(gpu, run_id, ms, *, name="shapes", heads=128, n=1024, d=80, t=0):
    cfg = json.dumps({"heads": heads, "seq_len": n, "d": d, "run_id": run_id})
    return [
        {"name": name, "metric": "latency", "impl": impl, "mode": "fwd_bwd", "p50": v, "config_json": cfg,
         "gpu_name": gpu, "git_sha": f"sha{run_id}", "timestamp": f"2026-11-2{t}T10:00:00"}
        for impl, v in ms.items()
    ]  # fmt: skip


def test_the_shape_table_keeps_each_gpu_models_latest_run():
    """A later run on one GPU model never replaces, or mixes into, another model's latest run; a split
    run of one model never lends its passes to another."""
    from cs336_systems.studies.attention import flash_hopper_facts

    rows = (
        _shape_rows("NVIDIA H100 80GB HBM3", 1, {"flash_triton": 3.0, "sdpa_cudnn": 1.0}, t=1)
        + _shape_rows("NVIDIA H100 80GB HBM3", 2, {"flash_triton": 2.0, "sdpa_cudnn": 1.0}, t=2)
        + _shape_rows("NVIDIA H200", 3, {"flash_triton": 1.0, "sdpa_cudnn": 2.0, "flash_triton_eager": 3.0}, t=3)
        + [r | {"name": "shapes_split", "metric": "throughput", "mode": "fwd", "p50": 100.0}
           for r in _shape_rows("NVIDIA H200", 4, {"flash_triton": 0, "sdpa_cudnn": 0}, t=4)]
    )  # fmt: skip
    t = flash_hopper_facts.shape_throughput_table(pd.DataFrame(rows)).set_index("gpu")
    assert t.loc["H100", "fwd+bwd / cuDNN"] == 2.0 and t.loc["H200", "fwd+bwd / cuDNN"] == 0.5
    assert t.loc["H200", "fwd ours"] == 100.0 and math.isnan(t.loc["H100", "fwd ours"])
    # the eager call against cuDNN's, only where that run timed it
    assert t.loc["H200", "eager / cuDNN"] == 1.5 and math.isnan(t.loc["H100", "eager / cuDNN"])
    runs = t.attrs["runs"].set_index("gpu")
    assert runs.loc["H100", "runs"] == 1 and runs.loc["H100", "sha"] == "sha2"
    assert (
        flash_hopper_facts.gpu_kind("NVIDIA H100 80GB HBM3") == "H100"
        and flash_hopper_facts.gpu_kind("cpu") == "cpu"
    )


def test_a_tuning_candidate_is_timed_only_when_it_runs_and_matches_the_reference():
    import json

    import torch

    from cs336_systems.studies.attention.flash_tuning import time_candidate

    args = ("hopper_tuning", "dkdv", "cand", lambda: None, torch.bfloat16, 128, {"d": 64})
    row, ms, note = time_candidate(*args, check=lambda: 1e-3)
    assert note == "" and row["p50"] == ms > 0 and json.loads(row["config_json"])["rel_err"] == 1e-3
    row, ms, note = time_candidate(*args, check=lambda: 0.5)  # wrong result: a failure row, not a time
    assert ms == math.inf and "relative error 0.5" in note and math.isnan(row["p50"])

    def broken():
        raise RuntimeError("out of resources: shared memory")

    row, ms, note = time_candidate("tuning", "fwd", "cand", broken, torch.float32, 128, {})
    assert ms == math.inf and "shared memory" in row["note"] and "rel_err" not in row["config_json"]


def test_one_pass_table_on_the_committed_results():
    """The one-pass rows as notebook 42 states them: the best candidate against the two-pass median
    of the same run, slower at both head dims (the prose says so)."""
    from cs336_systems.report import load_results
    from cs336_systems.studies.attention import flash_backward_tuning

    df = load_results(flash_tuning.LEADERBOARD)
    table = flash_backward_tuning.one_pass_table(df).set_index("head dim")
    tun = df[(df.name == "bwd_tuning") & (df.metric == "latency")]
    for d in (64, 128):
        run = tun[[json.loads(c)["d"] == d for c in tun.config_json]]
        run = run[run.git_sha == run.git_sha.iloc[-1]]
        two = run[run.impl.str.startswith("two-pass")].p50.median()
        one = run[run.impl.str.startswith("one-pass")].p50.min()
        assert table.loc[d, "one-pass / two-pass"] == pytest.approx(one / two) and one > two


def test_custom_op_floor_has_our_step_structure():
    from cs336_systems.studies.attention.impls import CustomOpFloor, leaderboard_step

    x = torch.randn(3, 2, 40, 16, requires_grad=True)
    q, k, v = x.unbind(0)
    o = CustomOpFloor.apply(q, k, v, True)
    assert o.shape == q.shape and len(o.grad_fn.saved_tensors) == 5
    o.sum().backward()
    assert x.grad.shape == x.shape
    leaderboard_step("custom_op_floor", x.detach().requires_grad_())  # a known impl (compiled lazily)


def test_host_times_interleave_rounds_of_every_impl_and_count_graph_breaks(capsys, tmp_path):
    """`flash_bench --host-profile`'s table: each impl's wall time per step in every round (rounds
    interleaved), with the medians' ratio to the first impl's, and a row per shape and impl (the rounds
    as samples) that `host_time_table` reads back; bad counts are refused before any work."""
    from cs336_systems.report import load_results
    from cs336_systems.studies.attention.flash_host import host_time_table, host_times

    impls = ("custom_op_floor", "flash_triton_eager")
    shapes = [(2, 32, 16), (1, 40, 16)]
    out = host_times(impls, shapes, rounds=2, steps=2, device="cpu", results_dir=tmp_path)
    assert list(out) == shapes and list(out[(2, 32, 16)]) == list(impls)
    assert all(len(v) == 2 and all(t > 0 for t in v) for per in out.values() for v in per.values())
    text = capsys.readouterr().out
    assert "2 interleaved rounds of 2 steps" in text and " 1.000x  custom_op_floor" in text
    assert "graph breaks" not in text  # the compiled floor is one graph each way
    df = load_results(flash_tuning.LEADERBOARD, tmp_path)
    assert len(df) == 4 and set(df.name) == {"host_times"} and set(df.unit) == {"us"}
    table = host_time_table(df).set_index("shape")
    assert list(table.index) == ["2 x 32 x 16", "1 x 40 x 16"]  # both shapes: one run
    for (heads, n, d), per in out.items():
        for impl, v in per.items():
            assert table.loc[f"{heads} x {n} x {d}", impl] == pytest.approx(sum(v) / 2)  # two rounds' median
    assert "ours / compiled cuDNN" not in table.columns  # its impls were not timed
    assert host_time_table(df.iloc[:0]).empty
    with pytest.raises(ValueError, match="rounds and steps"):
        host_times(impls, [(2, 32, 16)], rounds=0, device="cpu")


def test_host_time_table_keeps_each_gpus_latest_run_and_its_ratios():
    """A row per GPU model and shape from that model's latest `host_times` run only, with the ratios
    of the impls timed in it (ours compiled against compiled and eager cuDNN, the floor against eager)."""
    from cs336_systems.measure.results import make_row
    from cs336_systems.studies.attention.flash_host import HOST_TIMES, host_time_table

    def rows(gpu, run_id, times):
        cfg = {"heads": 2, "seq_len": 128, "d": 80, "run_id": run_id}
        out = [make_row(problem="flash_leaderboard", metric="host_time", unit="us", name=HOST_TIMES, impl=impl,
                        samples=[t], config=cfg) for impl, t in times.items()]  # fmt: skip
        return [r | {"gpu_name": gpu, "git_sha": f"{run_id:07d}"} for r in out]

    old = {"flash_triton": 2000.0, "sdpa_cudnn_compiled": 1000.0}
    new = {
        "flash_triton": 900.0,
        "sdpa_cudnn_compiled": 1000.0,
        "sdpa_cudnn": 450.0,
        "custom_op_floor": 600.0,
    }
    df = pd.DataFrame(
        rows("NVIDIA H200", 1, old) + rows("NVIDIA H200", 2, new) + rows("NVIDIA H100 80GB HBM3", 3, old)
    )
    t = host_time_table(df).set_index("gpu")
    assert list(t.index) == ["H200", "H100"] and set(t["shape"]) == {"2 x 128 x 80"}
    assert t.loc["H200", "ours / compiled cuDNN"] == pytest.approx(0.9)  # run 2, not run 1
    assert t.loc["H200", "ours / eager cuDNN"] == pytest.approx(2.0)
    assert t.loc["H200", "floor / eager cuDNN"] == pytest.approx(600 / 450)
    assert t.loc["H100", "ours / compiled cuDNN"] == pytest.approx(2.0)
    assert t.loc["H100"].isna()["ours / eager cuDNN"]  # not timed on that GPU: blank, never borrowed
    assert t.attrs["shas"] == {"H100": "0000003", "H200": "0000002"}


def test_throughput_table_on_the_committed_results():
    """Per-pass TFLOP/s from the latest split run, as fractions of that run's measured peak and of
    the datasheet, beside the published FlashAttention-3 figures."""
    from cs336_systems.accounting.hardware import peak_flops
    from cs336_systems.report import load_results
    from cs336_systems.studies.attention import flash_hopper_facts

    df = load_results(flash_tuning.LEADERBOARD)
    t = flash_hopper_facts.throughput_table(df).set_index("pass")
    split = flash_leaderboard_facts.split_table(df, gpu="H100").set_index(
        ["impl", "mode"]
    )  # FA3 publishes H100 figures
    for mode in ("fwd", "bwd"):
        ours = split.loc[("flash_triton", mode), "TFLOP/s"]
        assert t.loc[mode, "ours"] == ours
        assert t.loc[mode, "ours / measured peak"] == pytest.approx(ours / split.attrs["peak"])
        datasheet = peak_flops(split.attrs["gpu"], "bf16") / 1e12
        assert t.loc[mode, "ours / datasheet"] == pytest.approx(ours / datasheet)
        assert t.loc[mode, "FA3 (published)"] == flash_hopper_facts.FA3_PUBLISHED[mode][0]
    assert split.attrs["source"].git_sha.nunique() == 1  # one run's rows, peak included
    # the text: the backward above cuDNN's, the forward short of it
    assert t.loc["bwd", "ours"] > t.loc["bwd", "cuDNN"] and t.loc["fwd", "ours"] < t.loc["fwd", "cuDNN"]


def test_pass_table_keeps_the_two_gluon_families_apart():
    """The fastest one-warpgroup candidate and the fastest warp-specialised one, each against tl;
    a failed candidate (no p50) never counts, and a pass without warp-specialised rows says so (NaN)."""
    import json
    import math

    import pandas as pd

    from cs336_systems.studies.attention import flash_hopper_facts

    def row(impl, mode, p50, d=64, t=0):
        return {"name": "hopper_tuning", "metric": "latency", "impl": impl, "mode": mode, "p50": p50,
                "config_json": json.dumps({"d": d}), "timestamp": t}  # fmt: skip

    df = pd.DataFrame(
        [
            row("tl FwdConfig(block_m=128)", "fwd", 2.0),
            row("gluon HopperFwdConfig(block_m=128, block_n=64, stages=3, num_warps=8)", "fwd", 2.2),
            row("gluon HopperFwdConfig(block_m=64, block_n=64, stages=3, num_warps=4)", "fwd", 2.4),
            row("gluon WarpSpecializedFwdConfig(consumers=2, block_n=128, stages=2, pingpong=False, consumer_regs=240)", "fwd", 1.8),
            row("gluon WarpSpecializedFwdConfig(consumers=3, block_n=64, stages=3, pingpong=True, consumer_regs=160)", "fwd", None),
            row("tl BwdConfig(block_m1=64)", "dkdv", 3.0),
            row("gluon HopperBwdConfig(block_m=64, block_n=64, stages=2, num_warps=4, maxnreg=None)", "dkdv", 3.3),
            row("tl BwdConfig(block_m1=64)", "bwd", 4.0),
            row("default WarpSpecializedBwdConfig(block_m=64, dq_regs=88) (+ tl dQ unless one pass)", "bwd", 3.0),
            row("gluon one pass WarpSpecializedBwdConfig(block_m=64, stages=2, consumer_regs=200, consumers=2, "
                "dq_regs=88, ds_slots=2, dq_buffers=2)", "bwd", 3.2),
        ]
    )  # fmt: skip
    t = flash_hopper_facts.pass_table(df).set_index("pass")
    assert t.loc["fwd", "Gluon ms"] == 2.2 and math.isclose(t.loc["fwd", "Gluon / tl"], 1.1)
    assert t.loc["fwd", "WS ms"] == 1.8 and math.isclose(t.loc["fwd", "WS / tl"], 0.9)
    assert t.loc["fwd", "WS tiles"] == "2 x 64 rows, 128 keys, 2 stages"
    assert math.isnan(t.loc["dkdv", "WS ms"]) and t.loc["dkdv", "WS tiles"] == ""
    # the whole backward: the one-pass kernel is warp-specialised; the default row is not a candidate
    assert math.isnan(t.loc["bwd", "Gluon ms"]) and t.loc["bwd", "WS ms"] == 3.2
    assert t.loc["bwd", "WS tiles"] == "2 x 64 keys, 64 queries, 2 stages, one pass"
    f = flash_hopper_facts._tiles(
        "WarpSpecializedBwdConfig(block_m=64, stages=5, consumer_regs=240, consumers=2)"
    )
    assert f == "2 x 64 keys, 64 queries, 5 stages"


def test_a_model_shape_run_records_its_forward_and_backward_and_survives_the_floor(tmp_path):
    """`flash_bench --leaderboard` at a model shape (CPU, float32, tiny): the forward/backward split
    comes as rows "shapes_split" for the attention implementations (the host floor and the eager call are
    steps, not attentions of their own, and have none), and the timed rows are stored before the split runs."""
    from cs336_systems.studies.attention.flash_leaderboard import LeaderboardConfig, measure

    cfg = LeaderboardConfig(heads=1, seq_len=16, d=16, rep_ms=1, warmup_ms=1, dtype="float32", device="cpu", matmul_n=64,
                            impls=("flash_triton", "custom_op_floor", "flash_triton_eager"), name="shapes")  # fmt: skip
    rows = measure(cfg, results_dir=tmp_path, split=True)
    stored = pd.read_csv(tmp_path / "flash_leaderboard.csv")
    assert len(stored) == len(rows)
    split = stored[stored.name == "shapes_split"]
    assert set(split.impl) == {"flash_triton"} and set(split["mode"]) == {"fwd", "bwd"}
    assert split.p50.notna().all() and set(stored[stored.name == "shapes"].impl) == set(cfg.impls)


def test_the_graphed_steps_need_a_cuda_device():
    from cs336_systems.studies.attention.impls import LEADERBOARD_IMPLS, STEP_ONLY, leaderboard_step

    assert set(STEP_ONLY) <= set(LEADERBOARD_IMPLS)
    x = torch.randn(3, 2, 16, 16, requires_grad=True)
    with pytest.raises(ValueError, match="capture CUDA graphs: they need a CUDA device"):
        leaderboard_step("flash_triton_graphed", x)
