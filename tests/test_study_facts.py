"""Each notebook's `facts()` on the committed results under figures/data/: the numbers the answers state.

The expectations are recomputed here from the raw rows (or checked against physical facts), so a
change in how a study summarises its rows cannot silently change what the write-up says.
"""

import pandas as pd
import pytest

from cs336_systems.measure.results import REPO_ROOT, load_results

DATA = REPO_ROOT / "figures" / "data"


def committed(problem: str) -> pd.DataFrame:
    if not (DATA / f"{problem}.csv").exists():
        pytest.skip(f"no committed {problem}.csv")
    return load_results(problem, DATA)


def test_autocast_facts_on_the_committed_run():
    from cs336_systems.studies.profiling import mixed_precision

    df = committed("benchmarking_mixed_precision")
    facts = mixed_precision.facts(df, context_length=512)
    # (a) CUDA autocast: matmul outputs in the low precision, LayerNorm, loss and gradients in fp32
    dtype_of = facts["dtype_of"]
    low = facts["autocast_dtype"]
    assert dtype_of["fc1 output"] == dtype_of["logits (fc2 output)"] == low != "float32"
    assert dtype_of["LayerNorm output"] == dtype_of["loss"] == dtype_of["parameter gradients"] == "float32"
    # (b) fp16 overflows past sqrt(65504) ~ 256; bf16 does not overflow but is less precise than fp16
    assert facts["fp16_largest_finite"] == 65504
    assert facts["fp16_overflow_deviation"] == pytest.approx(255.94, abs=0.01)
    assert facts["bf16_over_fp16_error_narrow"] > 1 and facts["fp32_output_error_narrow"] < 1e-5
    # (c) the speed-ups are fp32 / bf16 mean step times of the rows at context 512
    step = df[(df.metric == "step_time") & (df["mode"] == "train") & (df.x_value.astype(str) == "512")]
    mean = step.groupby(["name", "dtype"])["mean"].last()
    speedup = facts["speedup"]
    assert speedup["sizes"] == ["small", "medium", "large", "xl", "2.7B"]
    assert speedup["step_first"] == pytest.approx(mean["small", "fp32"] / mean["small", "bf16-autocast"])
    assert speedup["step_last"] == pytest.approx(mean["2.7B", "fp32"] / mean["2.7B", "bf16-autocast"])
    assert speedup["grows_with_size"] and speedup["step_last"] > 3
    assert speedup["forward_min"] <= speedup["forward_max"]


def test_benchmarking_script_facts_on_the_committed_run():
    import json

    from cs336_systems.studies.profiling import timing_facts

    df = committed("benchmarking_script")
    facts = timing_facts.facts(df, context_length=512, warmup=5)
    timing = facts["timing"]
    rows = df[
        (df.x_name == "context_length")
        & (df.x_value.astype(str) == "512")
        & (df["mode"] == "forward_backward")
    ]
    mean = rows.groupby(["name", "metric"])["mean"].last()
    assert timing["sizes"] == ["small", "medium", "large", "xl", "2.7B"]
    assert timing["forward_first_ms"] == pytest.approx(mean["small", "forward_time"])
    assert timing["backward_last_ms"] == pytest.approx(mean["2.7B", "backward_time"])
    ratios = [mean[s, "backward_time"] / mean[s, "forward_time"] for s in timing["sizes"]]
    assert timing["backward_over_forward_min"] == pytest.approx(min(ratios))
    assert 1.5 < min(ratios) <= max(ratios) < 3  # about two matmuls per forward matmul
    assert timing["cv_median"] <= timing["cv_max"] and timing["failed"] == []
    # (c): the cold first step is the first sample of the warm-up-0 row of the first ablation size
    ablation = facts["ablation"]
    cold = df[(df.x_name == "warmup") & (df.x_value.astype(str) == "0") & (df.metric == "step_time")]
    cold = cold[cold.name == ablation["cold_size"]]
    samples = json.loads(cold["samples"].iloc[-1])
    assert ablation["cold"]["first_ms"] == pytest.approx(samples[0])
    assert ablation["first_over_rest"][0] == pytest.approx(samples[0] / pd.Series(samples[1:]).median())
    assert ablation["first_over_rest"][0] > 2 > ablation["first_over_rest"][1]  # one warm-up step is enough


def test_pytorch_attention_facts_on_the_committed_run():
    from cs336_systems.measure.results import latest_run
    from cs336_systems.studies.attention import pytorch_attention_facts

    df = latest_run(committed("pytorch_attention"), keys=("name", "impl", "x_value", "metric"))
    facts = pytorch_attention_facts.facts(df[df.impl == "naive"])
    oom = facts["oom"]
    # the extra point d = 16, T = 32768 is the only one past the H200's 141 GB
    # its first forward pass completed (a first_forward_time row) and no first backward did: the backward
    # ran out of memory first, although the note of the row forward_time says OOM (a later forward)
    rows = df[(df.impl == "naive") & (df.name == "d16") & (df.x_value == 32768)].set_index("metric")
    assert rows.loc["first_forward_time", "note"] == "" and "first_backward_time" not in rows.index
    assert (oom["d"], oom["T"], oom["phase"]) == (16, 32768, "backward")
    assert oom["first_forward_ms"] == pytest.approx(rows.loc["first_forward_time", "mean"])
    assert oom["forward_peak_GiB"] * 2**30 < facts["device_bytes"]  # the accounting agrees: forward fits
    assert oom["probabilities_GiB"] == 8 * 32768**2 * 4 / 2**30  # one (8, T, T) fp32 tensor
    assert oom["inputs_MiB"] == 3 * 8 * 32768 * 16 * 4 / 2**20
    assert oom["saved_for_backward_GiB"] == pytest.approx(
        3 * oom["probabilities_GiB"] + 32768**2 / 2**30, abs=0.01
    )
    assert oom["backward_peak_GiB"] > facts["device_bytes"] / 2**30
    scaling = facts["scaling"]
    assert 1.95 < scaling["exponent_min"] <= scaling["exponent_max"] < 2.05  # quadratic in T
    assert scaling["saved_T2_MiB_max"] == 3 * 8 * scaling["T_max"] ** 2 * 4 / 2**20
    assert scaling["max_relative_error"] < 0.01


def test_memory_breakdown_adds_up_to_the_snapshot_peak_and_near_the_allocator_peak():
    from cs336_systems.studies.profiling import memory, memory_facts

    df = committed("memory_profiling")
    timelines = {
        "train": memory.parse_timeline(
            memory.load_snapshot(
                memory.COMMITTED_SNAPSHOT_DIR / "memory_profiling__2.7B_train_fp32_ctx512.pickle.gz"
            )
        )
    }
    table = memory_facts.breakdown_table(df, timelines)
    parts = memory_facts.peak_parts(timelines["train"])
    col = "train step fp32"
    part_rows = [r for r in table.index if r.startswith("T = 512 peak") and not r.endswith("snapshot total")]
    assert table.loc[part_rows, col].sum() == pytest.approx(table.loc["T = 512 peak: snapshot total", col])
    assert parts["total"] == pytest.approx(timelines["train"].total.max() / 2**30)
    allocator = table.loc["peak, T = 512 (allocator)", col]
    assert 0 <= allocator - parts["total"] < 0.2  # the snapshot sees all but a sliver of the allocator's peak
    # at the peak the parameters and AdamW moments (12 bytes per parameter) are live, not the gradients
    state = 12 * 3406.8e6 / 2**30
    assert parts["kept from before the step"] == pytest.approx(state, rel=0.01)
    assert parts["gradients so far"] < 1 and parts["phase"] == "backward"


def test_layernorm_overflow_is_in_the_squares_not_the_mean():
    from cs336_systems.studies.profiling import mixed_precision

    facts = mixed_precision.facts(committed("benchmarking_mixed_precision"), context_length=512)
    assert facts["fp16_mean_accumulates_wider"] is True  # torch's fp16 mean does not overflow on the sum
    assert facts["fp16_overflow_deviation"] == pytest.approx(255.9, abs=0.1)
    assert facts["fp16_sum_overflow_rms"] == pytest.approx((65504 / 1024) ** 0.5)


def test_gradient_checkpointing_facts_on_the_committed_run():
    from cs336_systems.studies.profiling import checkpointing

    df = committed("gradient_checkpointing")
    df = df[df.name == "xl_2026"]
    facts = checkpointing.facts(df, checkpointing.cost_table("xl_2026", 4, 2048))
    model, measured = facts["model"], facts["measured"]
    assert model["num_blocks"] == 32 and model["recursive_forward_passes"] == 6  # ceil(log2 32) + 1
    assert model["recursive_GiB"] < model["one_level_GiB"] < model["none_GiB"]
    peaks = df[(df.metric == "peak_memory") & (df.impl == "block") & (df.note == "")]
    peaks = peaks.groupby("x_value")["mean"].last()
    assert measured["best_k"] == peaks.idxmin() and measured["best_GiB"] == pytest.approx(peaks.min())
    assert measured["next_k"] == sorted(k for k in peaks.index if k > peaks.idxmin())[0]
    assert measured["none_note"] == "OOM"
    assert (
        measured["sub_block_at_floor"]
        and measured["sub_block_minus_best_MiB"] < 0.05 * measured["best_GiB"] * 1024
    )
    assert measured["step_recursive_ms"] > measured["step_best_ms"]  # more recomputation


def test_torch_compile_facts_on_the_committed_runs():
    from cs336_systems.measure.results import latest_run
    from cs336_systems.studies.attention import torch_compile

    compiled, eager = committed("torch_compile"), committed("pytorch_attention")
    facts = torch_compile.facts(compiled, eager[eager.impl == "naive"])
    attention = facts["attention"]
    keys = ("name", "impl", "x_value", "metric")

    def forward_ms(df, d, t):
        rows = latest_run(df, keys=keys)
        rows = rows[
            (rows.name == f"d{d}") & (rows.x_value.astype(float) == t) & (rows.metric == "forward_time")
        ]
        return rows["mean"].iloc[-1]

    longest = attention["longest_T"]
    for d, speedup in attention["forward_at_longest_by_d"]:
        expected = forward_ms(eager[eager.impl == "naive"], d, longest) / forward_ms(
            compiled[compiled.x_name == "seq_len"], d, longest
        )
        assert speedup == pytest.approx(expected, abs=0.006)  # the table rounds to 2 decimals
    assert attention["forward_min"] <= attention["forward_at_longest"] <= attention["forward_max"]
    # the eager attention ran out of memory at the extra point, the compiled one did not
    assert [(d, t, eager_note) for d, t, eager_note, *_ in attention["only_compiled_ran"]] == [
        (16, 32768, "OOM")
    ]
    grid = torch_compile.speedup_grid(facts["attention_table"])
    assert grid.loc[(16, "fwd"), "T=32768"] == "70.3"  # compiled only: no speedup over a failed eager run
    assert grid.loc[(16, "fwd"), f"T={longest}"].endswith(
        f"({dict(attention['forward_at_longest_by_d'])[16]:.2f}x)"
    )
    model = facts["model"]
    assert model["context_length"] == 512 and model["attention_T_near_context"] == [256, 1024]
    assert {mode for mode, *_ in model["speedup_by_mode"]} == {"forward", "train"}
    assert all(1 < lo <= hi < 2 for _, lo, hi in model["speedup_by_mode"])


def test_training_step_facts_on_the_committed_run():
    from cs336_systems.studies.training import train_step, train_step_facts

    df = committed(train_step.PROBLEM)
    facts = train_step_facts.facts(df, size="2.7B")
    latest = facts["latest"]
    # the latest comparison on an H100 and on an H200, each at both contexts, ours with our own attention
    assert {train_step_facts.gpu_kind(d) for d in latest} == {"H100", "H200"}
    for device, run in latest.items():
        assert set(run["contexts"]) == {512, 2048} and run["attention"] == "flash_triton" and run["parked"]
        # recomputed from the raw rows: the newest compare run of this GPU kind at both contexts (its rows
        # share commit, device and time window; a later run at one context only, the H100's at c121c7f, is
        # listed, not quoted); both paths' rows of one context were written together
        step = df[(df.name == "compare") & (df.metric == "step_ms") & (df.gpu_name == device)]
        step = step[step.git_sha.astype(str).str[:10] == run["git"]]
        newest = step[step.impl.isin(["ours", "stock"])].sort_values("timestamp").tail(4)
        assert newest.git_sha.nunique() == 1 and str(newest.git_sha.iloc[0])[:10] == run["git"]
        for ctx, rec in run["contexts"].items():
            p50 = newest[newest.x_value.astype(float) == ctx].set_index("impl")["p50"]
            assert newest[newest.x_value.astype(float) == ctx].timestamp.nunique() == 1  # one run
            assert rec["ratio"] == pytest.approx(p50["ours"] / p50["stock"])
            assert rec["meets_goal"] == (rec["ratio"] <= train_step_facts.GOAL_RATIO)
            assert 0.5 < rec["ratio"] < 1  # ours is faster than the stock compiled step
            peak = df[
                (df.metric == "peak_memory_gib") & (df.gpu_name == device) & (df.x_value.astype(float) == ctx)
                & (df.timestamp == newest.timestamp[newest.x_value.astype(float) == ctx].iloc[0])
            ].set_index("impl")["p50"]  # fmt: skip
            assert (
                rec["ours_peak_memory_gib"] == peak["ours"] and rec["stock_peak_memory_gib"] == peak["stock"]
            )
            assert (
                rec["ours_peak_memory_gib"] <= rec["stock_peak_memory_gib"]
            )  # issue 29: ours' peak <= stock's
            persistent = (rec["ours_persistent_memory_gib"], rec["stock_persistent_memory_gib"])
            assert persistent[0] == pytest.approx(persistent[1], rel=1e-3)  # split masters: stock's bytes
    assert facts["peaks_ok"]
    assert (
        facts["goal_met"] == all(ok for _, _, ok in facts["goal_points"]) and len(facts["goal_points"]) == 4
    )
    partial = [r for r in facts["runs"] if str(r["git"]).startswith("c121c7f")]
    assert partial and {r["ctx"] for r in partial} == {2048}  # listed, not quoted: one context only
    # older runs (among them SDPA in ours with both paths resident) are listed, never quoted
    older = [r for r in facts["runs"] if r["run"] not in {x["run"] for x in latest.values()}]
    assert older and any(r["attention"] == "sdpa" and not r["parked"] for r in older)
    for r in older:  # a GPU's quoted run is its newest complete default run: older ones are not newer
        quoted = latest.get(r["device"])
        if quoted is not None and r["ours"] == train_step_facts.DEFAULT_OURS and r["run"] != quoted["run"]:
            complete = {512, 2048} <= {x["ctx"] for x in facts["runs"] if x["run"] == r["run"]}
            assert not complete or r["timestamp"] < quoted["timestamp"]
    # the step replayed as one CUDA graph (a non-default ours) is listed, never quoted
    graphed = [r for r in facts["runs"] if "+cuda_graph" in r["ours"]]
    assert graphed and not {r["run"] for r in graphed} & {x["run"] for x in latest.values()}
    # the older parts, each from one run and labelled by it
    runs = train_step_facts.with_runs(df)
    bandwidth = runs[runs.run == runs[runs.name == "bandwidth"].run.iloc[-1]]
    bw = bandwidth[bandwidth.name == "bandwidth"].set_index("impl")["p50"]
    assert facts["bandwidth"]["adamw_fraction_of_copy"] == pytest.approx(bw["fused_adamw"] / bw["copy"])
    assert 0.5 < facts["bandwidth"]["adamw_fraction_of_copy"] <= 1
    waterfall = facts["waterfall"]
    assert waterfall["handout fp32"] > waterfall["+ bf16 autocast"] > waterfall["+ bf16 compute weights"]
    wr = facts["waterfall_run"]
    assert wr["git"] == "95a381e903" and wr["device"] == "NVIDIA H200" and wr["attention"] == "sdpa"
    assert facts["check"]["steps"] == 20 and facts["check"]["max_loss_diff"] < 0.01


def test_training_leaderboard_facts_on_the_committed_run():
    from cs336_systems.studies.training import leaderboard_facts as results

    df = committed("training_leaderboard")
    facts = results.facts(df)
    head = facts["headline"]
    runs = pd.DataFrame(facts["runs"])
    same = runs[(runs.git == head["git"]) & (runs.GPUs == head["GPUs"]) & (runs.device == head["device"])]
    assert head["ratio"] == pytest.approx(
        head["ours_ms"] / head["stock_ms"]
    )  # do_bench's statistic: the mean
    assert head["ratio_tuned"] == pytest.approx(head["ours_ms"] / head["stock_tuned_ms"])
    assert head["ours_ms"] in set(same.ours_ms) and head["valid"]
    assert head["meets_tuned"] == (head["ratio_tuned"] <= results.GOAL_TUNED)
    assert 0 < head["ours_mfu"] < 1 and head["ours_peak_gib"] > 0
    assert facts["status"] == "measured" and "wall_s" in facts
