"""Notebook 42's tables, plot and facts of the Hopper (Gluon) kernels (`flash_hopper.measure`'s rows
and the other `flash_bench` runs it names): each pass alone against the tl kernels, the protocol runs,
ours against cuDNN at the models' shapes. Reads rows only; `flash_hopper` re-exports `facts` and the
shapes it measures are defined here (`MODEL_SHAPES`), beside the tables that order them.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import pandas as pd

from cs336_systems.accounting.hardware import peak_flops
from cs336_systems.measure.results import latest_run
from cs336_systems.studies.attention import flash_backward_tuning
from cs336_systems.studies.attention.flash_leaderboard_facts import protocol_runs, split_table
from cs336_systems.studies.attention.flash_sweep import LEADERBOARD
from cs336_systems.studies.attention.impls import COMPILED_SDPA, LEADERBOARD_IMPLS

PROBLEM = LEADERBOARD  # the rows live with the leaderboard's
# every leaderboard implementation but the PyTorch-backward variant (a comparison of the 2025 kernels)
# and compiled SDPA (the baseline of `flash_bench --host-profile`'s host times)
SHAPE_IMPLS = tuple(
    i for i in LEADERBOARD_IMPLS if i != "flash_pytorch_compiled_bwd" and i not in COMPILED_SDPA
)
PROTOCOL_SHAPE = (16, 16384, 64)  # the 2025 leaderboard's (heads, N, d): rows "protocol" and "split"
# (heads, N, d): the 8B leaderboard's attention (32 heads, 32768, d 128) and the 2.7B model's (batch 4 x
# 32 heads, d 80) at the contexts issue 18 names.
MODEL_SHAPES = ((32, 32768, 128), (128, 512, 80), (128, 1024, 80), (128, 2048, 80), (128, 4096, 80))
# FlashAttention-3's published H100 SXM5 16-bit throughput, the reference points issue 18 quotes from
# Shah et al. 2024 (arXiv:2407.08608): the forward at causal d = 64, the backward at d = 128, long N.
# Published figures at their own shapes, not measured here.
FA3_PUBLISHED = {"fwd": (475.0, "causal, d = 64"), "bwd": (550.0, "d = 128")}


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


def gpu_kind(name: object) -> str:
    """The GPU model of a row's `gpu_name` ('NVIDIA H100 80GB HBM3' -> 'H100', 'NVIDIA H200' -> 'H200');
    anything else (a CPU) is returned as it is."""
    m = re.search(r"\b([A-Z]{1,2}\d{2,4})\b", str(name))
    return m.group(1) if m else str(name)


def _shape_name(heads: int, n: int, d: int) -> str:
    return f"{heads} x {n} x {d}"


# the table's order: the 2025 protocol's shape, then the models' (8B first, then the 2.7B model's by N)
SHAPE_ORDER = {
    _shape_name(*s): i
    for i, s in enumerate(
        (PROTOCOL_SHAPE, *sorted(MODEL_SHAPES, key=lambda s: (-s[2], s[1])))  # d = 128 first, then by N
    )
}


def _with_runs(rows: pd.DataFrame) -> pd.DataFrame:
    """`rows` with "shape", "gpu" (the GPU model, `gpu_kind`) and "run_id" (one `flash_leaderboard.measure`
    call; rows older than run ids: their commit) columns."""
    rows = rows.copy()
    cfg = [json.loads(c) for c in rows.config_json]
    rows["shape"] = [_shape_name(c["heads"], c["seq_len"], c["d"]) for c in cfg]
    rows["gpu"] = rows.gpu_name.map(gpu_kind)
    rows["run_id"] = [str(c.get("run_id", sha)) for c, sha in zip(cfg, rows.git_sha)]
    return rows


def _latest_run_per_shape(rows: pd.DataFrame) -> pd.DataFrame:
    """The rows of the latest run (one `flash_leaderboard.measure` call, one process) of each shape on each
    GPU model, with "shape", "gpu" and "run_id" columns: a run on one GPU model never stands in for
    another model's."""
    if rows.empty:
        return rows
    rows = _with_runs(rows)
    last = rows.sort_values("timestamp").groupby(["gpu", "shape"], sort=False).run_id.last().to_dict()
    return rows[[last[(g, s)] == r for g, s, r in zip(rows.gpu, rows["shape"], rows.run_id)]]


def _in_order(frame: pd.DataFrame) -> pd.DataFrame:
    """Rows sorted by GPU model, then shape (`SHAPE_ORDER`; other shapes last)."""
    key = lambda c: c.map(SHAPE_ORDER).fillna(len(SHAPE_ORDER)) if c.name == "shape" else c
    return frame.sort_values(["gpu", "shape"], key=key).reset_index(drop=True)


def shapes_table(df: pd.DataFrame) -> pd.DataFrame:
    """Forward + backward at each model shape, from the latest run (one `flash_leaderboard.measure` call,
    one process) of that shape on each GPU model: every implementation it timed (median ms) and ours
    against SDPA's two backends of the same run. Implementations that run did not time are blank, never
    filled from another run or another GPU model."""
    sh = _latest_run_per_shape(df[(df.name == "shapes") & (df.metric == "latency")])
    if sh.empty:
        return pd.DataFrame()
    sh = latest_run(sh, keys=("name", "impl", "gpu", "shape", "metric"))
    wide = sh.pivot_table(index=["gpu", "shape"], columns="impl", values="p50", aggfunc="first")
    wide = wide[[i for i in SHAPE_IMPLS if i in wide.columns]]
    for base in ("sdpa_flash", "sdpa_cudnn"):  # absent on a CPU (quick runs)
        if {"flash_triton", base} <= set(wide.columns):
            wide[f"ours / {base}"] = wide["flash_triton"] / wide[base]
    wide.columns.name = None
    out = _in_order(wide.reset_index())
    out.attrs["source"] = sh
    return out


def shape_throughput_table(df: pd.DataFrame) -> pd.DataFrame:
    """Ours against cuDNN at every shape (the 2025 protocol's, rows "protocol"/"split", and the models',
    rows "shapes"/"shapes_split"), one row per GPU model and shape. Forward + backward: ours / cuDNN's time
    in the latest run of that shape on that GPU model (one process), and the same for the steps captured
    in CUDA graphs where that run timed them ("graphed / cuDNN"), and ours called eagerly, without
    torch.compile, against cuDNN's (eager) call where that run timed it ("eager / cuDNN"); each pass
    alone ("fwd ours", "fwd cuDNN", "bwd ours", "bwd cuDNN"): TFLOP/s in the latest split run of that
    shape on that GPU model. No ratio mixes GPU models or runs.
    `attrs["runs"]`: per row the commit of each run, and the spread of the forward + backward ratio over
    every run of that commit on that GPU model (`runs`, `min`, `max`)."""
    fb_rows = df[df.name.isin(["protocol", "shapes"]) & (df.metric == "latency")]
    fb = _latest_run_per_shape(fb_rows)
    sp = _latest_run_per_shape(df[df.name.isin(["split", "shapes_split"]) & (df.metric == "throughput")])
    if fb.empty:
        return pd.DataFrame()
    ms = fb.pivot_table(index=["gpu", "shape"], columns="impl", values="p50", aggfunc="last")
    if not {"flash_triton", "sdpa_cudnn"} <= set(ms.columns):
        return pd.DataFrame()
    out = pd.DataFrame({"fwd+bwd / cuDNN": ms["flash_triton"] / ms["sdpa_cudnn"]})
    graphed = {"flash_triton_graphed", "sdpa_cudnn_graphed"} <= set(ms.columns)
    out["graphed / cuDNN"] = ms["flash_triton_graphed"] / ms["sdpa_cudnn_graphed"] if graphed else math.nan
    # ours called eagerly (no torch.compile) against cuDNN's eager SDPA call: the host paths side by side
    eager = "flash_triton_eager" in ms.columns
    out["eager / cuDNN"] = ms["flash_triton_eager"] / ms["sdpa_cudnn"] if eager else math.nan
    tf = (
        sp.pivot_table(index=["gpu", "shape"], columns=["mode", "impl"], values="p50", aggfunc="last")
        if len(sp)
        else pd.DataFrame()
    )
    for mode in ("fwd", "bwd"):
        for impl, who in (("flash_triton", "ours"), ("sdpa_cudnn", "cuDNN")):
            col = tf[(mode, impl)] if (mode, impl) in tf.columns else pd.Series(dtype=float)
            out[f"{mode} {who}"] = col.reindex(out.index)  # TFLOP/s
    out = _in_order(out.reset_index())
    # the commits behind each row, and the spread of the ratio over every run of that commit (that GPU model)
    every = _with_runs(fb_rows)
    info = []
    for g, s in zip(out.gpu, out["shape"]):
        latest = fb[(fb.gpu == g) & (fb["shape"] == s)]
        sha = str(latest.git_sha.iloc[-1])
        same = every[(every.gpu == g) & (every["shape"] == s) & (every.git_sha == sha)]
        per_run = same.pivot_table(index="run_id", columns="impl", values="p50", aggfunc="last")
        ratio = per_run["flash_triton"] / per_run["sdpa_cudnn"]
        split = sp[(sp.gpu == g) & (sp["shape"] == s)] if len(sp) else sp
        info.append(
            {
                "gpu": g,
                "shape": s,
                "sha": sha[:7],
                "split sha": str(split.git_sha.iloc[-1])[:7] if len(split) else "",
                "runs": int(ratio.notna().sum()),
                "min": float(ratio.min()),
                "max": float(ratio.max()),
            }
        )
    out.attrs["runs"] = pd.DataFrame(info)
    out.attrs["source"] = pd.concat([fb, sp]) if len(sp) else fb
    return out


def throughput_table(df: pd.DataFrame, gpu: str = "H100") -> pd.DataFrame:
    """Forward and backward alone at the protocol shape (the latest split run on `gpu`: FlashAttention-3
    publishes H100 figures), TFLOP/s: ours and cuDNN's, ours as a fraction of the matmul peak measured in
    that run and of the datasheet peak, beside FlashAttention-3's published figures (`FA3_PUBLISHED`, at
    their own head dims)."""
    split = split_table(df, gpu=gpu)
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
    out.attrs |= {
        "source": split.attrs["source"],
        "peak": split.attrs["peak"],
        "datasheet": datasheet,
        "gpu": split.attrs["gpu"],
    }
    return out


MIN_PROTOCOL_RUNS = 3  # runs of one commit on one GPU model before its protocol figures are quoted


def quoted_protocol_runs(runs: pd.DataFrame) -> pd.DataFrame:
    """Of `protocol_runs` rows (of one GPU model), those of the latest commit with at least
    MIN_PROTOCOL_RUNS runs: what notebook 42 and the README quote (a later commit's fewer runs stay
    in the runs table); empty without such a commit."""
    if runs.empty:
        return runs
    counts = runs.groupby("git sha", sort=False).size()
    enough = counts[counts >= MIN_PROTOCOL_RUNS]
    return runs[runs["git sha"] == enough.index[-1]] if len(enough) else runs.iloc[:0]


def _protocol_facts(df: pd.DataFrame, kind: str) -> dict[str, Any]:
    """The protocol runs of the latest commit measured at least MIN_PROTOCOL_RUNS times on GPU model
    `kind`: ours, cuDNN and (where timed) the portable tl kernels against SDPA-flash of the same runs;
    {} without such runs. (A later commit's fewer runs stay in the runs table, not in these figures.)"""
    runs = protocol_runs(df)
    latest = quoted_protocol_runs(runs[runs.gpu.map(gpu_kind) == kind] if len(runs) else runs)
    if latest.empty:
        return {}
    lb = df[(df.name == "protocol") & (df.metric == "latency") & df.git_sha.isin(latest["git sha"])]
    portable = lb[(lb.impl == "flash_triton_portable") & (lb.gpu_name.map(gpu_kind) == kind)].p50
    cudnn = latest["sdpa_cudnn ms"] / latest["sdpa_flash ms"]
    return {
        "runs": len(latest),
        "sha": str(latest["git sha"].iloc[-1])[:7],
        "budget": str(latest["do_bench rep/warmup ms"].iloc[-1]),
        "ours_ms_min": float(latest["ours ms"].min()),
        "ours_ms_max": float(latest["ours ms"].max()),
        "ratio_min": float(latest["ours / sdpa_flash"].min()),
        "ratio_max": float(latest["ours / sdpa_flash"].max()),
        "cudnn_ratio_min": float(cudnn.min()),
        "cudnn_ratio_max": float(cudnn.max()),
        # ours below cuDNN in every run (each run's steps timed in one process)
        "beats_cudnn": bool((latest["ours ms"] < latest["sdpa_cudnn ms"]).all()),
        "portable_ratio": float(portable.median() / latest["sdpa_flash ms"].median())
        if len(portable)
        else math.nan,
    }


def _d80_facts(shapes: pd.DataFrame) -> dict[str, Any]:
    """One GPU model's d = 80 rows of `shapes_table`: the shortest context from which ours is no slower
    than SDPA-flash at every longer one, our step times below it (host time, nearly flat in N), and at
    N = 512 the host floor of our design where that run timed it."""
    rows = shapes.set_index("shape")
    if "ours / sdpa_flash" not in rows:
        return {}
    d80 = sorted(
        (int(k.split(" x ")[1]), v) for k, v in rows["ours / sdpa_flash"].items() if k.endswith(" x 80")
    )
    start = next((n for k, (n, _) in enumerate(d80) if all(v <= 1 for _, v in d80[k:])), None)
    out: dict[str, Any] = {"d80_no_slower_from": start}
    below = [k for k in rows.index if k.endswith(" x 80") and int(k.split(" x ")[1]) < (start or 0)]
    if below:
        ours = rows.loc[below, "flash_triton"]
        out["d80_short_ms"] = (float(ours.min()), float(ours.max()))
    short = "128 x 512 x 80"
    if (
        short in rows.index
        and "custom_op_floor" in rows.columns
        and rows.loc[short, "custom_op_floor"] == rows.loc[short, "custom_op_floor"]
    ):
        out["floor_512"] = {
            c: float(rows.loc[short, c])
            for c in ("custom_op_floor", "flash_triton", "flash_triton_eager", "sdpa_flash", "sdpa_cudnn")
            if c in rows.columns and rows.loc[short, c] == rows.loc[short, c]  # timed in that run
        }
    return out


def facts(df: pd.DataFrame) -> dict[str, Any]:
    """The numbers the Hopper section states. Per-pass Gluon/tl ratios by head dim (the tuning runs); and
    per GPU model (`gpus`, e.g. "H100", "H200"), never mixing two models in one ratio: the protocol runs
    of the latest commit on that model (`protocol[gpu]`), ours / cuDNN forward + backward at every shape
    in the latest run of that shape on that model (`vs_cudnn[gpu][shape]`, with the shapes at or below
    cuDNN and above it, and whether every run of that commit agrees), each pass alone
    (`shape_passes[(gpu, shape, mode)]`), the steps captured in CUDA graphs (`graphed[gpu][shape]`) and
    the d = 80 contexts against SDPA-flash (`d80[gpu]`)."""
    passes = pass_table(df)
    table = shape_throughput_table(df)
    gpus = [g for g in dict.fromkeys(table.gpu) if not g.lower().startswith("cpu")] if len(table) else []
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
        "gpus": gpus,
        "protocol": {g: p for g in gpus if (p := _protocol_facts(df, g))},
    }
    runs = table.attrs["runs"].set_index(["gpu", "shape"]) if len(table) else pd.DataFrame()
    t = table.set_index(["gpu", "shape"]) if len(table) else table
    out["vs_cudnn"], out["at_or_below_cudnn"], out["above_cudnn"] = {}, {}, {}
    out["same_verdict_every_run"], out["runs_per_shape"], out["shas"], out["split_shas"] = {}, {}, {}, {}
    out["shape_passes"], out["graphed_vs_cudnn"], out["passes_faster"] = {}, {}, {}
    for g in gpus:
        ratio = t.loc[g, "fwd+bwd / cuDNN"]
        out["vs_cudnn"][g] = ratio.to_dict()
        out["at_or_below_cudnn"][g] = [s for s, v in ratio.items() if v <= 1]
        out["above_cudnn"][g] = [s for s, v in ratio.items() if v > 1]
        r = runs.loc[g]
        out["same_verdict_every_run"][g] = bool(((r["max"] <= 1) | (r["min"] > 1)).all())
        out["runs_per_shape"][g] = (int(r["runs"].min()), int(r["runs"].max()))
        out["shas"][g] = sorted(set(r["sha"]))
        out["split_shas"][g] = {s: v for s, v in r["split sha"].items() if v and v != r.loc[s, "sha"]}
        for s, row in t.loc[g].iterrows():
            for mode in ("fwd", "bwd"):
                ours, cudnn = row[f"{mode} ours"], row[f"{mode} cuDNN"]
                if ours == ours and cudnn == cudnn:
                    out["shape_passes"][(g, s, mode)] = {
                        "ours TFLOP/s": float(ours),
                        "cuDNN TFLOP/s": float(cudnn),
                        "ours / cuDNN time": float(cudnn / ours),
                    }
        out["graphed_vs_cudnn"][g] = t.loc[g, "graphed / cuDNN"].dropna().to_dict()
        out["passes_faster"][g] = {  # the shapes where that pass alone is no slower than cuDNN's
            mode: [
                s
                for (g2, s, m), v in out["shape_passes"].items()
                if (g2, m) == (g, mode) and v["ours / cuDNN time"] <= 1
            ]
            for mode in ("fwd", "bwd")
        }
    shapes = shapes_table(df)
    out["graphed"], out["d80"], out["vs_flash"] = {}, {}, {}
    for g in gpus:
        sh = shapes[shapes.gpu == g] if len(shapes) else shapes
        if sh.empty:
            continue
        out["d80"][g] = _d80_facts(sh)
        if "ours / sdpa_flash" in sh.columns:  # the models' shapes against SDPA-flash of the same run
            out["vs_flash"][g] = sh.set_index("shape")["ours / sdpa_flash"].to_dict()
        if "flash_triton_graphed" in sh.columns:  # every step captured in CUDA graphs: no host work per call
            cols = [c for c in sh.columns if c.endswith("_graphed")]
            sh = sh[sh["flash_triton_graphed"].notna()].set_index("shape")
            out["graphed"][g] = {k: {c: float(sh.loc[k, c]) for c in cols} for k in sh.index}
    tp = throughput_table(df)
    if len(tp):
        out["throughput"] = tp.set_index("pass").to_dict("index")
        out["throughput_gpu"] = tp.attrs["gpu"]
    one = flash_backward_tuning.one_pass_table(df)  # the tl one-pass attempt (session 9)
    out["tl_one_pass_ratio"] = {int(r["head dim"]): r["one-pass / two-pass"] for _, r in one.iterrows()}
    return out


def plot_vs_cudnn(table: pd.DataFrame):
    """Ours / cuDNN's forward + backward time per shape (`shape_throughput_table`), a bar per GPU model
    for the eager steps and a marker on it for the steps captured in CUDA graphs (no host work)."""
    import matplotlib.pyplot as plt

    gpus = list(dict.fromkeys(table.gpu))
    shapes = sorted(dict.fromkeys(table["shape"]), key=lambda s: SHAPE_ORDER.get(s, len(SHAPE_ORDER)))
    t = table.set_index(["gpu", "shape"])
    fig, ax = plt.subplots(figsize=(8.5, 2.6))
    width = 0.8 / max(len(gpus), 1)
    colors = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728")
    for k, g in enumerate(gpus):
        xs = [x + (k - (len(gpus) - 1) / 2) * width for x in range(len(shapes))]
        eager = [t["fwd+bwd / cuDNN"].get((g, s), math.nan) for s in shapes]
        graphed = [t["graphed / cuDNN"].get((g, s), math.nan) for s in shapes]
        ax.bar(xs, eager, width, color=colors[k % len(colors)], label=f"{g}: eager steps")
        ax.plot(xs, graphed, ls="none", marker="D", ms=5, mec="k", mfc="white", label=None)
    ax.plot([], [], ls="none", marker="D", ms=5, mec="k", mfc="white", label="steps in CUDA graphs")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(range(len(shapes)), shapes, fontsize=8)
    ax.set_yscale("log")
    top = max(table[["fwd+bwd / cuDNN", "graphed / cuDNN"]].max(skipna=True).max(), 1.0)
    ax.set_ylim(0.8, 1.45 * top)
    ax.set_yticks([t for t in (0.8, 1, 1.5, 2, 3, 4, 6) if t <= 1.45 * top])
    ax.yaxis.set_major_formatter(plt.FuncFormatter(lambda y, _: f"{y:g}"))
    ax.yaxis.set_minor_formatter(plt.NullFormatter())
    ax.set_ylabel("ours / cuDNN time")
    ax.set_title("fwd+bwd against cuDNN (heads x N x d, causal, bf16; below 1: ours faster)", fontsize=10)
    ax.legend(frameon=False, fontsize=8, ncol=3)
    fig.tight_layout()
    return fig
