"""The Hopper (Gluon) FlashAttention kernels against the portable tl kernels and SDPA's backends.

Rows come from `flash_bench --tune-hopper` (`name == "hopper_tuning"`: each pass alone, tl heuristic
tiles against every Gluon candidate), `flash_bench --leaderboard` (`"protocol"`: the 2025 shape) and
`flash_bench --leaderboard --lb-shapes ...` (`"shapes"`: the models' shapes, batch 1 with B*H heads,
with the host floor `custom_op_floor` beside the kernels) and `flash_bench --tune-bwd` (`"bwd_tuning"`:
the one-pass backward against the two-pass one, `flash_backward_tuning`).
`measure(HopperConfig())` runs all three on an sm_90 GPU; the tables and `facts` read the committed rows.

    python -m cs336_systems.studies.attention.flash_hopper --protocol-runs 3
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd

from cs336_systems.accounting.hardware import peak_flops
from cs336_systems.measure import cli
from cs336_systems.measure.results import latest_run
from cs336_systems.studies.attention import flash_backward_tuning
from cs336_systems.studies.attention.flash_leaderboard import (
    LeaderboardConfig,
    protocol_runs,
    split_table,
)
from cs336_systems.studies.attention.flash_leaderboard import (
    measure as run_leaderboard,  # the leaderboard study's measure
)
from cs336_systems.studies.attention.flash_sweep import LEADERBOARD
from cs336_systems.studies.attention.flash_tuning import run_hopper_tuning

PROBLEM = LEADERBOARD  # the rows live with the leaderboard's
SHAPE_IMPLS = (
    "flash_triton",
    "flash_triton_portable",
    "flash_triton_gluon",
    "sdpa_flash",
    "sdpa_cudnn",
    "custom_op_floor",
    "flash_triton_graphed",
    "sdpa_flash_graphed",
    "sdpa_cudnn_graphed",
)
# (heads, N, d): the 8B leaderboard's attention (32 heads, 32768, d 128) and the 2.7B model's (batch 4 x
# 32 heads, d 80) at the contexts issue 18 names.
MODEL_SHAPES = ((32, 32768, 128), (128, 512, 80), (128, 1024, 80), (128, 2048, 80), (128, 4096, 80))
# FlashAttention-3's published H100 SXM5 16-bit throughput, the reference points issue 18 quotes from
# Shah et al. 2024 (arXiv:2407.08608): the forward at causal d = 64, the backward at d = 128, long N.
# Published figures at their own shapes, not measured here.
FA3_PUBLISHED = {"fwd": (475.0, "causal, d = 64"), "bwd": (550.0, "d = 128")}


@dataclass(frozen=True, kw_only=True)
class HopperConfig:
    protocol_runs_n: int = 3  # interleaved runs of the 2025 protocol
    device: str = "cuda"


def measure(config: HopperConfig | None = None, *, results_dir=None) -> list[dict[str, Any]]:
    """Tune both kernel families per pass (d = 64, 128, 80), then the protocol (interleaved runs) and
    the model shapes, all in this process; returns every row."""
    import torch

    cfg_all = config or HopperConfig()
    device, rows = cfg_all.device, []
    for d in (64, 128, 80):
        rows += run_hopper_tuning(16, 16384, d, torch.bfloat16, device=device, results_dir=results_dir)
    impls = ("flash_triton", "flash_triton_gluon", "sdpa_flash", "sdpa_cudnn")
    for _ in range(cfg_all.protocol_runs_n):
        lb = LeaderboardConfig(impls=impls, device=device)
        rows += run_leaderboard(lb, results_dir=results_dir, split=False)
    for heads, n, d in MODEL_SHAPES:
        cfg = LeaderboardConfig(
            heads=heads,
            seq_len=n,
            d=d,
            rep_ms=2000,
            warmup_ms=300,
            impls=SHAPE_IMPLS,
            device=device,
            name="shapes",
        )
        rows += run_leaderboard(cfg, results_dir=results_dir, split=False)
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    p = cli.make_parser(__doc__, "python -m cs336_systems.studies.attention.flash_hopper --protocol-runs 3")
    p.add_argument("--protocol-runs", type=int, default=HopperConfig().protocol_runs_n)
    cli.add_results_dir(p)
    args = p.parse_args(argv)
    cfg = HopperConfig(protocol_runs_n=args.protocol_runs)
    print(cfg)
    rows = measure(cfg, results_dir=cli.results_dir_for(args.results_dir))
    print(f"{len(rows)} rows written")


def _config(row: pd.Series) -> dict[str, Any]:
    return json.loads(row.config_json)


def _tiles(impl: str) -> str:
    """A Gluon candidate's label -> its tiles in words, e.g.
    'HopperBwdConfig(block_m=64, block_n=64, stages=2, num_warps=4, maxnreg=None)' -> '64x64, 4 warps, 2 stages';
    'WarpSpecializedFwdConfig(consumers=2, block_n=128, stages=2, pingpong=False, ...)' -> '2 x 64 rows, 128 keys, 2 stages'."""
    f = dict(re.findall(r"(\w+)=([\w.]+)", impl))
    if impl.startswith("WarpSpecializedFwdConfig"):
        pp = ", ping-pong" if f.get("pingpong") == "True" else ""
        return f"{f['consumers']} x 64 rows, {f['block_n']} keys, {f['stages']} stages{pp}"
    if impl.startswith("WarpSpecializedBwdConfig"):
        one_pass = ", one pass" if f.get("dq_regs", "0") != "0" or f.get("dq_in_consumers") == "True" else ""
        return f"{f['consumers']} x 64 keys, {f['block_m']} queries, {f['stages']} stages{one_pass}"
    if "block_m" in f and "stages" in f:
        cap = f", <= {f['maxnreg']} regs" if f.get("maxnreg", "None") != "None" else ""
        return f"{f['block_m']}x{f['block_n']}, {f['num_warps']} warps, {f['stages']} stages{cap}"
    return impl


def pass_table(df: pd.DataFrame) -> pd.DataFrame:
    """Per head dim and pass, from the latest tuning run of that head dim (one process): the tl kernels'
    time, the fastest one-warpgroup Gluon candidate and the fastest warp-specialised one, each against
    tl; failing candidates never count. Pass "bwd" is the whole backward: the tl passes against the
    one-pass warp-specialised kernel."""
    tun = df[(df.name == "hopper_tuning") & (df.metric == "latency")].copy()
    if tun.empty:
        return pd.DataFrame()
    tun["d"] = [_config(r)["d"] for _, r in tun.iterrows()]
    # one run per head dim: the latest (it times the tl forward first, then the rest)
    start = tun[tun.impl.str.startswith("tl ") & (tun["mode"] == "fwd")].groupby("d").timestamp.max()
    tun = tun[tun.d.map(start).le(tun.timestamp)]
    tun = latest_run(tun, keys=("name", "impl", "mode", "d", "metric"))
    tun = tun[tun.p50.notna()]
    rows = []
    for (d, mode), g in tun.groupby(["d", "mode"], sort=False):
        tl = g[g.impl.str.startswith("tl ")]
        ws = g[g.impl.str.startswith(("gluon WarpSpecialized", "gluon one pass WarpSpecialized"))]
        gluon = g[g.impl.str.startswith("gluon ") & ~g.index.isin(ws.index)]
        if tl.empty or (gluon.empty and ws.empty):
            continue
        tl_ms = float(tl.p50.iloc[-1])
        best_ms = float(gluon.p50.min()) if len(gluon) else math.nan
        row = {
            "head dim": int(d),
            "pass": mode,
            "tl ms": tl_ms,
            "Gluon ms": best_ms,
            "Gluon / tl": best_ms / tl_ms,
            "WS ms": math.nan,
            "WS / tl": math.nan,
            "WS tiles": "",
        }
        if len(ws):
            best_ws = ws.loc[ws.p50.idxmin()]
            row |= {
                "WS ms": float(best_ws.p50),
                "WS / tl": float(best_ws.p50 / tl_ms),
                "WS tiles": _tiles(best_ws.impl.removeprefix("gluon ").removeprefix("one pass ")),
            }
        rows.append(row)
    out = pd.DataFrame(rows)
    out.attrs["source"] = tun
    return out


def _latest_run_per_shape(rows: pd.DataFrame) -> pd.DataFrame:
    """The rows of each shape's latest run (one `flash_leaderboard.measure` call), with a "shape" column."""
    if rows.empty:
        return rows
    rows = rows.copy()
    cfg = [json.loads(c) for c in rows.config_json]
    rows["shape"] = [f"{c['heads']} x {c['seq_len']} x {c['d']}" for c in cfg]
    rows["run_id"] = [c.get("run_id", sha) for c, sha in zip(cfg, rows.git_sha)]
    last = rows.sort_values("timestamp").groupby("shape", sort=False).run_id.last()
    return rows[rows.run_id == rows["shape"].map(last)]


def shapes_table(df: pd.DataFrame) -> pd.DataFrame:
    """Forward + backward at each model shape, from the latest run (one `flash_leaderboard.measure` call, one
    process) of that shape: every implementation it timed (median ms) and ours against SDPA's two
    backends. Implementations that run did not time are blank, never filled from another run."""
    sh = _latest_run_per_shape(df[(df.name == "shapes") & (df.metric == "latency")])
    if sh.empty:
        return pd.DataFrame()
    sh = latest_run(sh, keys=("name", "impl", "shape", "metric"))
    wide = sh.pivot_table(index="shape", columns="impl", values="p50", aggfunc="first", sort=False)
    wide = wide[[i for i in SHAPE_IMPLS if i in wide.columns]]
    for base in ("sdpa_flash", "sdpa_cudnn"):  # absent on a CPU (quick runs)
        if {"flash_triton", base} <= set(wide.columns):
            wide[f"ours / {base}"] = wide["flash_triton"] / wide[base]
    order = {f"{h} x {n} x {d}": i for i, (h, n, d) in enumerate(MODEL_SHAPES)}
    out = wide.reset_index().sort_values("shape", key=lambda c: c.map(order)).reset_index(drop=True)
    out.attrs["source"] = sh
    return out


def shape_throughput_table(df: pd.DataFrame) -> pd.DataFrame:
    """Forward and backward alone at each model shape (rows "shapes_split", the latest run of each
    shape): TFLOP/s of ours and cuDNN's, ours / cuDNN's time per pass."""
    sp = _latest_run_per_shape(df[(df.name == "shapes_split") & (df.metric == "throughput")])
    if sp.empty:
        return pd.DataFrame()
    tf = sp.pivot_table(index=["shape", "mode"], columns="impl", values="p50", aggfunc="first")
    if not {"flash_triton", "sdpa_cudnn"} <= set(tf.columns):
        return pd.DataFrame()
    out = pd.DataFrame(
        {"ours TFLOP/s": tf["flash_triton"], "cuDNN TFLOP/s": tf["sdpa_cudnn"],
         "ours / cuDNN time": tf["sdpa_cudnn"] / tf["flash_triton"]}
    ).reset_index()  # fmt: skip
    order = {f"{h} x {n} x {d}": i for i, (h, n, d) in enumerate(MODEL_SHAPES)}
    out = out.sort_values(["shape", "mode"], key=lambda c: c.map(order) if c.name == "shape" else c)
    out = out.reset_index(drop=True)
    out.attrs["source"] = sp
    return out


def throughput_table(df: pd.DataFrame) -> pd.DataFrame:
    """Forward and backward alone at the protocol shape (the latest split run), TFLOP/s: ours and
    cuDNN's, ours as a fraction of the matmul peak measured in that run and of the datasheet peak,
    beside FlashAttention-3's published figures (`FA3_PUBLISHED`, at their own head dims)."""
    split = split_table(df)
    if split.empty:
        return pd.DataFrame()
    tf = split.set_index(["impl", "mode"])["TFLOP/s"]
    datasheet = (peak_flops(split.attrs["gpu"], "bf16") or math.nan) / 1e12
    rows = [
        {
            "pass": mode,
            "ours": tf[("flash_triton", mode)],
            "cuDNN": tf.get(("sdpa_cudnn", mode), math.nan),
            "ours / measured peak": tf[("flash_triton", mode)] / split.attrs["peak"],
            "ours / datasheet": tf[("flash_triton", mode)] / datasheet,
            "FA3 (published)": FA3_PUBLISHED[mode][0],
        }
        for mode in ("fwd", "bwd")
    ]
    out = pd.DataFrame(rows)
    out.attrs |= {"source": split.attrs["source"], "peak": split.attrs["peak"], "datasheet": datasheet}
    return out


def facts(df: pd.DataFrame) -> dict[str, Any]:
    """The numbers the Hopper section states: per-pass Gluon/tl ratios by head dim, the protocol runs
    of the latest commit measured on an H100 (ours, the portable tl kernels and cuDNN against
    SDPA-flash in the same runs), and the model shapes against SDPA-flash and cuDNN."""
    passes = pass_table(df)
    runs = protocol_runs(df)
    runs = runs[runs.gpu.str.contains("H100")]
    latest = runs[runs["git sha"] == runs["git sha"].iloc[-1]] if len(runs) else runs
    lb = df[(df.name == "protocol") & (df.metric == "latency") & df.git_sha.isin(latest["git sha"])]
    portable = lb[lb.impl == "flash_triton_portable"].p50
    shapes = shapes_table(df).set_index("shape")
    cudnn = latest["sdpa_cudnn ms"] / latest["sdpa_flash ms"]
    out: dict[str, Any] = {
        "pass_ratio": {
            (int(r["head dim"]), r["pass"]): r["Gluon / tl"]
            for _, r in passes.iterrows()
            if r["Gluon / tl"] == r["Gluon / tl"]
        },
        "ws_ratio": {
            (int(r["head dim"]), r["pass"]): r["WS / tl"]
            for _, r in passes.iterrows()
            if r["WS / tl"] == r["WS / tl"]
        },
        "protocol_runs": len(latest),
        "protocol_sha": str(latest["git sha"].iloc[-1])[:7] if len(latest) else "",
        "protocol_ratio_min": latest["ours / sdpa_flash"].min(),
        "protocol_ratio_max": latest["ours / sdpa_flash"].max(),
        "protocol_cudnn_ratio_min": cudnn.min(),
        "protocol_cudnn_ratio_max": cudnn.max(),
        # ours below cuDNN in every run (each run's two steps timed in one process)
        "protocol_beats_cudnn": bool(len(latest))
        and bool((latest["ours ms"] < latest["sdpa_cudnn ms"]).all()),
        "protocol_portable_ratio": float(portable.median() / latest["sdpa_flash ms"].median())
        if len(portable)
        else math.nan,
        "shape_vs_flash": shapes["ours / sdpa_flash"].to_dict(),
        "shape_vs_cudnn": shapes["ours / sdpa_cudnn"].to_dict(),
        "gpu": str(latest.gpu.iloc[-1]) if len(latest) else "",
    }
    # the shortest context from which ours is no slower than SDPA-flash at every longer one (d = 80)
    d80 = sorted((int(k.split(" x ")[1]), v) for k, v in out["shape_vs_flash"].items() if k.endswith(" x 80"))
    out["d80_no_slower_from"] = next(
        (n for k, (n, _) in enumerate(d80) if all(v <= 1 for _, v in d80[k:])), None
    )
    start = out["d80_no_slower_from"] or 0
    below = [k for k in shapes.index if k.endswith(" x 80") and int(k.split(" x ")[1]) < start]
    if below:  # our times where SDPA-flash is faster: nearly flat in N (host overhead)
        ours = shapes.loc[below, "flash_triton"]
        out["d80_short_ms"] = (float(ours.min()), float(ours.max()))
    short = "128 x 512 x 80"
    if short in shapes.index and "custom_op_floor" in shapes.columns:  # the host floor of our design
        out["floor_512"] = {
            c: float(shapes.loc[short, c]) for c in ("custom_op_floor", "flash_triton", "sdpa_flash")
        }
    graphed = [c for c in shapes.columns if c.endswith("_graphed")]
    if "flash_triton_graphed" in graphed:  # every step captured in CUDA graphs: no host work per call
        rows = shapes["flash_triton_graphed"].notna()
        out["graphed"] = {k: {c: float(shapes.loc[k, c]) for c in graphed} for k in shapes.index[rows]}
    tp = throughput_table(df)
    if len(tp):
        out["throughput"] = tp.set_index("pass").to_dict("index")
    per_shape = shape_throughput_table(df)  # forward and backward alone at each model shape
    out["shape_passes"] = {(r["shape"], r["mode"]): r.to_dict() for _, r in per_shape.iterrows()}
    one = flash_backward_tuning.one_pass_table(df)  # the tl one-pass attempt (session 9)
    out["tl_one_pass_ratio"] = {int(r["head dim"]): r["one-pass / two-pass"] for _, r in one.iterrows()}
    return out


def plot_shapes(shapes: pd.DataFrame):
    """Forward + backward time of each implementation relative to SDPA-flash, per model shape; the
    host floor (`custom_op_floor`) as a black bar across each group where it is in range."""
    import matplotlib.pyplot as plt

    from cs336_systems.report import impl_color

    impls = [i for i in SHAPE_IMPLS if i in shapes.columns and i != "custom_op_floor"]
    fig, ax = plt.subplots(figsize=(8.5, 3.2))
    width = 0.8 / len(impls)
    rels = []
    for k, impl in enumerate(impls):
        rel = shapes[impl] / shapes["sdpa_flash"]
        rels.append(rel)
        ax.bar([x + k * width for x in range(len(shapes))], rel, width, label=impl, color=impl_color(impl))
    low = 0.8 * min(float(r.min()) for r in rels)
    if "custom_op_floor" in shapes.columns:
        floor = shapes["custom_op_floor"] / shapes["sdpa_flash"]
        for x, f in enumerate(floor):
            if f >= low:  # only where the host floor is within sight of the kernels' times
                ax.hlines(f, x - width / 2, x + width * (len(impls) - 0.5), color="k", lw=1.6, ls="--")
        ax.plot([], [], color="k", lw=1.6, ls="--", label="host floor (custom_op_floor)")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks([x + width * (len(impls) - 1) / 2 for x in range(len(shapes))], shapes["shape"], fontsize=8)
    ax.set_ylabel("time / SDPA-flash time")
    ax.set_yscale("log")
    ax.set_ylim(bottom=low)
    ax.yaxis.set_major_formatter(plt.FuncFormatter(lambda y, _: f"{y:g}"))
    ax.yaxis.set_minor_formatter(plt.NullFormatter())
    ax.set_yticks([0.5, 1, 2, 4])
    ax.set_title("fwd+bwd at the models' shapes (heads x N x d, causal, bf16)")
    ax.legend(frameon=False, fontsize=7, ncol=3)
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    main()
