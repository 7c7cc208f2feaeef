"""Headline results for the README, computed from the committed tidy CSVs (never typed in).

python -m cs336_systems.studies.overview.readme_summary            # rewrite the block between the README markers
python -m cs336_systems.studies.overview.readme_summary --print    # print it only
"""

from __future__ import annotations

import argparse
import re

import pandas as pd

from cs336_systems.measure.results import REPO_ROOT, latest_run, load_results

START, END = "<!-- results-summary:start -->", "<!-- results-summary:end -->"


def _device(df: pd.DataFrame) -> str:
    return ", ".join(sorted(df["gpu_name"].dropna().unique())) if not df.empty else "n/a"


def flash_section() -> str:
    from cs336_systems.studies.attention.flash_leaderboard import final_runs, protocol_runs

    df = load_results("flash_leaderboard")
    runs = protocol_runs(df)
    final = final_runs(runs)
    if final.empty:
        final = runs.tail(1)
    if final.empty:
        return ""
    rows = [
        {
            "GPU": gpu,
            "implementation": name,
            "runs": len(g),
            "fwd+bwd median (ms), median of runs": f"{g[col].median():.3f}",
            "range over runs (ms)": f"{g[col].min():.3f} - {g[col].max():.3f}",
            "vs SDPA flash (median of runs)": f"{(g[col] / g['sdpa_flash ms']).median():.3f}x",
        }
        for gpu, g in final.groupby("gpu", sort=False)
        for name, col in (
            ("flash_triton (ours)", "ours ms"),
            ("sdpa_flash", "sdpa_flash ms"),
            ("sdpa_cudnn", "sdpa_cudnn ms"),
        )
    ]
    return (
        "**FlashAttention-2 leaderboard protocol** (bf16, causal, 16 x 16384 x 64, `torch.compile(apply)`, "
        "fwd + bwd, do_bench(rep=10000) median; the runs of the final tl kernels, per GPU):\n\n"
        + pd.DataFrame(rows).to_markdown(index=False)
        + hopper_sentence(runs)
        + model_shape_sentence(df)
    )


def model_shape_sentence(df: pd.DataFrame) -> str:
    """The 8B model's attention shape: ours against cuDNN in the latest run of that shape, and each
    pass alone (flash_hopper's tables)."""
    from cs336_systems.studies.attention import flash_hopper

    shapes = flash_hopper.shapes_table(df)
    key = "32 x 32768 x 128"
    if shapes.empty or key not in set(shapes["shape"]) or "ours / sdpa_cudnn" not in shapes:
        return ""
    row = shapes.set_index("shape").loc[key]
    src = shapes.attrs["source"]
    src = src[src["shape"] == key]
    out = (
        f" At the 8B model's attention shape ({key}) ours takes **{row['ours / sdpa_cudnn']:.2f}x** cuDNN's "
        f"time ({row['flash_triton']:.1f} vs {row['sdpa_cudnn']:.1f} ms, {src.gpu_name.iloc[-1]}, "
        f"{src.git_sha.iloc[-1][:7]})"
    )
    passes = flash_hopper.shape_throughput_table(df)
    passes = passes[passes["shape"] == key].set_index("mode")
    if {"fwd", "bwd"} <= set(passes.index):
        out += (
            f"; alone, forward {passes.loc['fwd', 'ours TFLOP/s']:.0f} vs {passes.loc['fwd', 'cuDNN TFLOP/s']:.0f} "
            f"TFLOP/s, backward {passes.loc['bwd', 'ours TFLOP/s']:.0f} vs {passes.loc['bwd', 'cuDNN TFLOP/s']:.0f}"
        )
    return out + "."


def hopper_sentence(runs: pd.DataFrame) -> str:
    """The protocol with the default backward on Hopper (the Gluon one-pass kernel): the latest such
    runs, ours against SDPA's backends in the same runs."""
    one = runs[runs["our backward"] == "Gluon one pass"] if len(runs) else runs
    if one.empty:
        return ""
    one = one[one["git sha"] == one["git sha"].iloc[-1]]
    cudnn = one["sdpa_cudnn ms"] / one["sdpa_flash ms"]
    return (
        f"\n\nOn Hopper the default backward is now a warp-specialised Gluon kernel with a dQ warpgroup "
        f"(one pass, TMA reductions): on the {one.gpu.iloc[-1]}, {len(one)} runs at {one['git sha'].iloc[-1][:7]}, "
        f"ours {one['ours ms'].min():.3f}-{one['ours ms'].max():.3f} ms = "
        f"**{one['ours / sdpa_flash'].min():.3f}-{one['ours / sdpa_flash'].max():.3f}x** SDPA-flash, against "
        f"{cudnn.min():.3f}-{cudnn.max():.3f}x for SDPA's cuDNN backend in the same runs (notebook 42)."
    )


def end_to_end_section() -> str:
    fp32 = latest_run(load_results("benchmarking_script"))
    fp32 = fp32[
        (fp32["metric"] == "step_time") & (fp32["x_name"] == "context_length") & (fp32["dtype"] == "fp32")
    ]
    if fp32.empty:
        return ""
    table = fp32.pivot_table(index="name", columns="mode", values="mean", aggfunc="last")
    bf16 = latest_run(load_results("benchmarking_mixed_precision"))
    bf16 = bf16[
        (bf16["metric"] == "step_time") & (bf16["dtype"] == "bf16-autocast") & (bf16["mode"] == "train")
    ]
    if not bf16.empty:
        table["train (bf16 autocast)"] = bf16.set_index("name")["mean"]
    order = [s for s in ("small", "medium", "large", "xl", "2.7B") if s in table.index]
    table = table.loc[order].map(lambda v: "OOM/n.a." if pd.isna(v) else f"{v:.1f}")
    ctx = int(fp32["x_value"].astype(float).iloc[0])
    return (
        f"**End-to-end step time, ms** (batch 4, context {ctx}, fp32 unless noted, mean of 10 steps after 5 "
        f"warm-up; {_device(fp32)}):\n\n" + table.reset_index().to_markdown(index=False)
    )


def ddp_section() -> str:
    df = latest_run(load_results("ddp_training"), keys=("impl", "x_value", "metric"))
    df = df[df["note"] == ""]
    if df.empty:
        return ""
    step = df[df["metric"] == "step_time"].copy()
    comm = df[df["metric"] == "comm_time"].set_index(["impl", "x_value"])["mean"]
    step["variant"] = step.apply(
        lambda r: r["impl"] + ("" if pd.isna(r["x_value"]) else f" ({r['x_value']:g} MB)"), axis=1
    )
    step["comm (ms)"] = [comm.get((i, x), float("nan")) for i, x in zip(step["impl"], step["x_value"])]
    out = step[["variant", "mean", "comm (ms)"]].rename(columns={"mean": "step (ms)"})
    out = out.map(
        lambda v: f"{v:.1f}" if isinstance(v, float) and not pd.isna(v) else ("" if pd.isna(v) else v)
    )
    return (
        f"**DDP training step, 2025 XL model, 2 GPUs** (global batch 8, context 512, fp32, NCCL; comm = "
        f"exposed gradient communication; {_device(df)}):\n\n" + out.to_markdown(index=False)
    )


def leaderboard_section() -> str:
    from cs336_systems.studies.training import leaderboard_facts as results

    facts = results.facts(load_results(results.PROBLEM))
    head = facts.get("headline")
    if not head:
        return ""
    missing = "; not measured on two H100s" if "NVIDIA H100 80GB HBM3" in facts["not_run_kinds"] else ""
    return (
        f"**2026 training-step leaderboard, 8B config, a valid entry** (our own kernels only: attention, loss, "
        f"optimizer; {head['config']}, {head['mode']}, {head['GPUs']} x {head['device']}, global batch "
        f"{head['batch']}): ours {head['ours_ms']:.0f} ms per step vs the tuned stock step (FSDP2, selective "
        f"checkpointing, compiled blocks, fused AdamW, chunked loss) {head['stock_tuned_ms']:.0f} ms "
        f"({head['ratio_tuned']:.3f}x) and the first-attempt stock step {head['stock_ms']:.0f} ms "
        f"({head['ratio']:.3f}x), in one invocation; MFU {head['ours_mfu']:.1%} of the datasheet bf16 peak"
        + (f"; from empty caches the run took {facts['cold_wall_s']:.0f} s" if "cold_wall_s" in facts else "")
        + f"{missing}."
    )


def build() -> str:
    parts = [s for s in (flash_section(), end_to_end_section(), ddp_section(), leaderboard_section()) if s]
    return (
        "\n\n".join(parts) + "\n\nEvery table in `writeup.pdf` carries its device, versions and git commit."
    )


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="example:\n  python -m cs336_systems.studies.overview.readme_summary --print",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--print", action="store_true", help="print the summary instead of rewriting README.md")
    args = p.parse_args(argv)
    text = build()
    if args.print:
        print(text)
        return
    readme = REPO_ROOT / "README.md"
    src = readme.read_text()
    new = re.sub(re.escape(START) + r".*?" + re.escape(END), f"{START}\n{text}\n{END}", src, flags=re.S)
    readme.write_text(new)


if __name__ == "__main__":
    main()
