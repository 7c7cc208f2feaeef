"""The leaderboard step (ZeRO-2 over flat units, fused AdamW, chunked loss, partial checkpointing)
against the plain single-process reference step: same losses and parameters within stated tolerances.

Small config: 2 layers, d_model 128, 4 heads, d_ff 256, vocabulary 1000, context 256; the global
batch is 2 sequences, one per rank; 3 steps at lr 1e-2. The reference is `cs336_systems.model.AdamW`
with plain `cross_entropy(model(x), y)` over the whole batch in one process, in the same precision.
Compared: the loss of every step, and per parameter tensor the relative L2 error of its update after
the 3 steps, |(p_ours - p_0) - (p_ref - p_0)| / |p_ref - p_0|:

  mode         reference                                   AdamW eps  loss rtol  update error: matrices, gains
  fp32         fp32 model                                  1.0 (*)    1e-5       3e-5, 3e-5 (measured <= 3.2e-6)
  bf16         model.to(bfloat16), AdamW on bf16 weights   1e-8       1e-2       0.2, 0.5 (**)
  fp32_master  fp32 model under bf16 autocast              1e-8       1e-2       0.2, 0.5 (**)

(*) With the default eps Adam's first updates are lr * sign(g): they would not see a gradient that is
    off by a constant factor (e.g. summed instead of averaged over the ranks), and a rounding
    difference flips the sign of a near-zero gradient's update. With eps = 1 (>> |g|) the update is
    proportional to the gradient, so the fp32 comparison checks the synchronised gradients
    themselves to rounding error.
(**) Measured on the CPU: at most 0.07 for matrices in bf16, 0.12 for the embedding in fp32_master,
    0.18 (bf16) and 0.25 (fp32_master) for the 128-element norm gains. With the default eps the
    update of an element whose gradient is near zero follows its sign, which bf16 rounding flips for
    some: the bf16 reference rounds every AdamW operation to bf16 (ours updates in float32 and rounds
    once), and the fp32_master reference keeps an fp32 residual stream under autocast (ours computes
    in bf16).
"""

from __future__ import annotations

import copy
import json
import math

import pandas as pd
import pytest
import torch
import torch.distributed as dist

from cs336_systems.distributed.process_group import spawn
from cs336_systems.model import AdamW, BasicsTransformerLM, cross_entropy
from cs336_systems.training import LeaderboardConfig, build_leaderboard_step, transformer_units

SMALL = dict(vocab_size=1000, context_length=256, d_model=128, num_layers=2, num_heads=4, d_ff=256)
LR, STEPS = 1e-2, 3
TOLERANCES = {  # mode: (loss rtol, (relative error of a weight matrix's update, of a norm gain's))
    "fp32": (1e-5, (3e-5, 3e-5)),
    "bf16": (1e-2, (0.2, 0.5)),
    "fp32_master": (1e-2, (0.2, 0.5)),
}
EPS = {"fp32": 1.0, "bf16": 1e-8, "fp32_master": 1e-8}  # AdamW's eps per mode (see the docstring)


def _batch(device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    x = torch.randint(0, SMALL["vocab_size"], (2, SMALL["context_length"]), generator=g)
    y = torch.randint(0, SMALL["vocab_size"], (2, SMALL["context_length"]), generator=g)
    return x.to(device), y.to(device)


def _reference(model: BasicsTransformerLM, mode: str, x, y) -> list[float]:
    """The plain step in one process over the whole batch; returns the losses."""
    if mode == "bf16":
        model.to(torch.bfloat16)
    opt = AdamW(model.parameters(), lr=LR, eps=EPS[mode])
    losses = []
    for _ in range(STEPS):
        opt.zero_grad(set_to_none=True)
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=mode == "fp32_master"):
            loss = cross_entropy(model(x), y).sum()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _compare(
    rank, world_size, device, mode: str, attention: str, compile_blocks: bool, keep_attention: bool = True
) -> None:
    torch.manual_seed(0)
    ref = BasicsTransformerLM(**SMALL, attention_impl="sdpa", device=device)
    ours = copy.deepcopy(ref)
    init = [p.detach().float().cpu().clone() for p in ref.parameters()]
    x, y = _batch(device)
    cfg = LeaderboardConfig(
        param_mode=mode,
        attention=attention,
        compile=compile_blocks,
        checkpoint_blocks=1,  # one block recomputed, one not
        keep_attention=keep_attention,
        loss_chunk=100,  # ragged chunks: 256 = 100 + 100 + 56
        lr=LR,
        eps=EPS[mode],
    )
    step = build_leaderboard_step(ours, cfg)
    mine = slice(rank, rank + 1) if world_size > 1 else slice(None)
    losses = []
    for _ in range(STEPS):
        loss = step(x[mine], y[mine])
        if world_size > 1:
            dist.all_reduce(loss)
            loss /= world_size
        losses.append(loss.item())
    ref_losses = _reference(ref, mode, x, y)
    loss_rtol, update_rtol = TOLERANCES[mode]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=loss_rtol, atol=0)
    params = zip(ref.named_parameters(), ours.parameters(), init, strict=True)
    for (name, p_ref), p_ours, before in params:
        ours_f, ref_f = p_ours.detach().float().cpu(), p_ref.detach().float().cpu()
        moved_ref, moved_ours = ref_f - before, ours_f - before
        error = ((moved_ours - moved_ref).norm() / moved_ref.norm()).item()
        bound = update_rtol[0] if p_ref.ndim >= 2 else update_rtol[1]
        assert error <= bound, f"{mode} {name}: update differs from the reference's by {error:.3f} (relative)"
    assert [n for n, _ in transformer_units(ours)][-1] == "head"


@pytest.mark.distributed
@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["fp32", "bf16", "fp32_master"])
def test_leaderboard_step_on_two_ranks_matches_the_single_process_step(mode, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # gloo ranks compute on the CPU, also on a GPU host
    spawn(_compare, 2, mode, "sdpa", False, timeout_s=200)


@pytest.mark.parametrize("keep_attention", [True, False])
def test_leaderboard_step_without_a_process_group_matches_too(keep_attention):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    _compare(0, 1, device, "fp32", "sdpa", False, keep_attention)


def test_leaderboard_config_rejects_bad_values():
    with pytest.raises(ValueError, match="param_mode"):
        LeaderboardConfig(param_mode="fp16")
    with pytest.raises(ValueError, match="checkpoint_blocks"):
        LeaderboardConfig(checkpoint_blocks=-1)


@pytest.mark.gpu
@pytest.mark.timeout(600)
@pytest.mark.parametrize("attention", ["flash_triton", "sdpa", "sdpa_cudnn"])
def test_leaderboard_step_on_one_gpu_compiled_matches_the_reference_gpu(attention):
    """The real path on one GPU (NCCL, one rank): compiled blocks, our attention, side-stream updates."""
    spawn(_compare, 1, "bf16", attention, True, backend="nccl", timeout_s=500)


@pytest.mark.multigpu
@pytest.mark.timeout(600)
def test_leaderboard_step_on_two_gpus_matches_the_reference_gpu():
    spawn(_compare, 2, "bf16", "sdpa_cudnn", True, backend="nccl", timeout_s=500)


# --------------------------------------------------------------------------------------------------
# The study: timing protocol, memory plan, facts, the quick run
# --------------------------------------------------------------------------------------------------


def test_do_bench_all_ranks_makes_do_bench_calls():
    from cs336_systems.measure.timing import do_bench_all_ranks

    calls = []
    result = do_bench_all_ranks(
        lambda: calls.append(1), warmup_ms=1.0, rep_ms=2.0, estimate_calls=3, device="cpu"
    )
    # one first call, 3 to estimate, then max(1, warmup / estimate) and max(1, rep / estimate)
    assert result["n_warmup"] == max(1, int(1.0 / result["estimate_ms"]))
    assert result["n_repeat"] == max(1, int(2.0 / result["estimate_ms"]))
    assert len(calls) == result["calls"] == 1 + 3 + result["n_warmup"] + result["n_repeat"]
    assert len(result["times_ms"]) == result["n_repeat"] and min(result["times_ms"]) >= 0
    with pytest.raises(ValueError, match="rep_ms"):
        do_bench_all_ranks(lambda: None, warmup_ms=1, rep_ms=0)


def test_memory_plan_of_the_8b_config():
    from cs336_systems.model import get_config
    from cs336_systems.studies.training import leaderboard_memory as memory

    cfg = get_config("8B_leaderboard")
    plan = memory.memory_plan(cfg, batch=1, world_size=2, loss_chunk=4096)
    n = cfg.num_params()
    assert 8.1e9 < plan["params"] == n < 8.2e9
    assert plan["state_ours_bf16"] == n * (2 + 4 / 2)  # full bf16 weights + half of bf16 m, v
    assert plan["state_stock_fp32_master"] == n * 16 / 2
    assert plan["block_inputs"] == 34 * 32768 * 4096 * 2
    assert plan["logits_bf16"] == 32768 * 151936 * 2  # ~10 GB: never materialised
    assert 4 * memory.GiB < plan["block_saved"] < 10 * memory.GiB  # q, k, v, o, the SwiGLU hidden, ...
    one = memory.memory_plan(cfg, batch=1, world_size=1, loss_chunk=4096)
    h200 = 139.8 * memory.GiB
    assert memory.skip_note(one, cfg, path="ours", mode="bf16", capacity=h200) is None
    assert "skipped: needs at least" in memory.skip_note(
        one, cfg, path="stock", mode="fp32_master", capacity=h200
    )


def _row(
    impl, metric, value, dtype="bf16", name="8B_leaderboard:34L", x_name="world_size", x_value=2, note=""
):
    from cs336_systems.measure.results import make_row

    config = {
        "batch_per_rank": 1,
        "rep_ms": 30000.0,
        "warmup_ms": 10000.0,
        "bench": {"n_repeat": 5},
        "world_size": 2,
        "variant": f"{impl}-{dtype}-L34",
    }
    return make_row(problem="training_leaderboard", name=name, impl=impl, dtype=dtype, mode="train",
                    x_name=x_name, x_value=x_value, metric=metric, unit="", value=value, note=note,
                    config=config)  # fmt: skip


def test_facts_say_not_run_without_rows_and_quote_the_latest_run():
    import pandas as pd

    from cs336_systems.measure.results import COLUMNS
    from cs336_systems.studies.training import leaderboard_facts as results

    assert results.facts(pd.DataFrame(columns=COLUMNS)) == {"status": "not run"}
    rows = [
        _row("stock", "step_ms", 6000.0),
        _row("ours", "step_ms", 4800.0),
        _row("ours", "mfu_datasheet", 0.5),
    ]
    rows += [
        _row("ours", "peak_memory_gib", g, x_name="rank", x_value=r) for r, g in enumerate((100.0, 101.0))
    ]
    rows += [_row("ours", "step_ms", 4000.0, dtype="fp32_master"), _row("stock", "step_ms", math.nan,
             dtype="fp32_master", note="OOM")]  # fmt: skip
    rows += [_row("all", "wall_s", 540.0, name="run", note="cold caches")]
    facts = results.facts(pd.DataFrame(rows))
    head = facts["headline"]
    assert head["mode"] == "bf16" and head["ratio"] == pytest.approx(0.8) and facts["meets_goal"]
    assert head["ours_peak_gib"] == 101.0 and head["ours_mfu"] == 0.5 and head["batch"] == 2
    assert facts["wall_s"] == 540.0 and facts["wall_cold"] and facts["wall_within_limit"]
    assert facts["failures"] == [
        {"config": "8B_leaderboard:34L", "path": "stock", "mode": "fp32_master", "note": "OOM"}
    ]
    assert facts["protocol"]["n_repeat"] == 5
    assert facts["phases"] == {}  # no phase rows in this frame


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_quick_run_measures_every_variant_on_two_gloo_ranks(tmp_path):
    from cs336_systems.studies.training import leaderboard, leaderboard_facts

    df = leaderboard.main(["--quick", "--results-dir", str(tmp_path)])
    step = df[df.metric == "step_ms"]
    assert sorted(zip(step.impl, step.dtype)) == sorted(
        (p, m) for p in ("ours", "stock", "stock_tuned") for m in ("bf16", "fp32_master")
    )
    assert (step["mean"] > 0).all() and (step.note == "").all()
    for metric in (
        "forward_ms",
        "backward_ms",
        "optimizer_step_ms",
        "tflops",
        "comm_ms",
        "checkpoint_blocks",
    ):
        assert metric in set(df.metric), metric
    assert len(list(tmp_path.glob("training_leaderboard__trace_*-*_ws2.json.gz"))) == 6  # every variant
    tuned = df[(df.impl == "stock_tuned") & (df.metric == "blocks_selective")]
    assert (tuned["mean"] == 2).all() and len(tuned) == 2  # a CPU plan: every block selective
    backend = df[(df.name == "sdpa_backend") & (df.metric == "backend")].note
    assert len(backend) == 1 and backend.iloc[0] in torch.nn.attention.SDPBackend.__members__
    facts = leaderboard_facts.facts(df)
    assert facts["status"] == "quick CPU run" and facts["wall_s"] > 0 and not facts["failures"]
    assert facts["stock_sdpa_backend"] == backend.iloc[0]
    assert set(facts["phases"]) == {"forward", "backward", "optimizer_step"}
    assert all(set(v) == {"ours", "stock"} for v in facts["phases"].values())


@pytest.mark.gpu
@pytest.mark.timeout(900)
def test_small_gpu_run_measures_ours_and_stock_in_both_modes_gpu(tmp_path):
    """The CLI's GPU path on a small config: NCCL on one rank, compiled blocks, FSDP2, auto checkpointing."""
    from cs336_systems.studies.training import leaderboard

    argv = ["--size", "small", "--layers", "2", "--context-length", "256", "--nproc", "1", "--rep-ms", "50"]
    argv += ["--warmup-ms", "10", "--estimate-calls", "2", "--param-modes", "bf16", "fp32_master"]
    df = leaderboard.main([*argv, "--results-dir", str(tmp_path)])
    step = df[df.metric == "step_ms"]
    assert len(step) == 4 and (step.note == "").all() and (step["mean"] > 0).all(), step
    assert (df[df.metric == "peak_memory_gib"]["mean"] > 0).all()
    assert "checkpoint_blocks" in set(df.metric) and "wall_s" in set(df.metric)


def test_facts_on_the_committed_runs():
    """The committed H200 rows: the headline is the latest two-GPU bf16 run with stock from the same run;
    every run keeps its own stock step (per attention and per recompute choice); one-GPU rows keep their
    own memory and MFU; the cold-start wall time is the run marked cold."""
    from cs336_systems.report import load_results
    from cs336_systems.studies.training import leaderboard_facts as results

    df = load_results(results.PROBLEM)
    facts = results.facts(df)
    steps = df[
        (df.metric == "step_ms") & (pd.to_numeric(df.x_value, errors="coerce") == 2) & (df.dtype == "bf16")
    ]
    head = facts["headline"]
    last_ours = steps[steps.impl == "ours"]["mean"].iloc[-1]
    last_stock = steps[steps.impl == "stock"]["mean"].iloc[-1]
    assert head["GPUs"] == 2 and head["mode"] == "bf16"
    assert head["ours_ms"] == last_ours and head["stock_ms"] == last_stock
    assert head["ratio"] == pytest.approx(last_ours / last_stock)
    assert facts["meets_goal"] == (head["ratio"] <= results.GOAL_RATIO)
    runs = pd.DataFrame(facts["by_attention"])
    one = runs[runs.GPUs == 1].set_index("attention of ours")
    assert one.at["flash_triton", "ratio"] > 1 > one.at["sdpa", "ratio"]  # our kernel loses at d=128, N=32768
    two = runs[(runs.GPUs == 2) & (runs["mode"] == "bf16")]
    kept, whole = (two[two.recompute == kind].ratio for kind in ("all but attention", "whole block"))
    assert len(kept) >= 1 and len(whole) >= 1 and kept.max() < whole.min()  # ratios: each within one run
    configs = pd.DataFrame(facts["configs"]).set_index(["mode", "GPUs"])
    assert (
        configs.at[("bf16", 1), "stock_peak_gib"] > configs.at[("bf16", 2), "stock_peak_gib"]
    )  # FSDP2 shards
    cold = df[(df.metric == "wall_s") & (df.note == "cold caches")]["mean"]
    assert facts["cold_wall_s"] == cold.iloc[-1] <= results.TIME_LIMIT_S


def test_a_profile_without_gpu_events_is_not_measured_and_an_earlier_profile_stands_in(tmp_path):
    """A run whose profiler saw no GPU activity records its communication as not measured (never 0);
    the timeline and the quoted communication then come from the latest run that was profiled."""
    from cs336_systems.studies.training import leaderboard as study
    from cs336_systems.studies.training import leaderboard_facts as results

    assert study._missing_note("comm_ms", math.nan) == study.NO_GPU_PROFILE
    assert study._missing_note("comm_ms", 0.0) == "" and study._missing_note("tflops", math.nan) == ""
    earlier = [_row("ours", "comm_ms", 800.0), _row("ours", "comm_exposed_ms", 12.0)]
    for r in earlier:
        r["git_sha"], r["timestamp"] = "a" * 40, "2026-11-26T00:00:00"
    later = [_row("stock", "step_ms", 6000.0), _row("ours", "step_ms", 4800.0)]
    later += [_row("ours", m, math.nan, note=study.NO_GPU_PROFILE) for m in ("comm_ms", "comm_exposed_ms")]
    for r in later:
        r["git_sha"], r["timestamp"] = "b" * 40, "2026-11-26T01:00:00"
    df = pd.DataFrame(earlier + later)
    variant = json.loads(earlier[0]["config_json"])["variant"]
    (tmp_path / f"training_leaderboard__trace_{variant}_ws2.json.gz").write_bytes(b"")
    assert results.trace_path(df, tmp_path, "bf16", 2) is not None
    facts = results.facts(df)
    assert math.isnan(facts["ours_extra"]["comm_ms"])
    assert facts["profiled"] == {"comm_ms": 800.0, "comm_exposed_ms": 12.0, "git": "a" * 10}
