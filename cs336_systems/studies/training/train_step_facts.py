"""The training_step rows (measured by `cs336_systems.studies.training.train_step`): the comparison's runs,
the waterfall table and figure, and `facts()`, the numbers notebook 40's answer quotes, from rows; and the
waterfall's `STAGES`, which `train_step` (the study, which re-exports `facts`) runs.

Every ratio is of two paths of one run (one invocation of the study, `with_runs`) at one context on one
GPU: runs of different GPU kinds, commits or options are never mixed. The answer quotes the latest run of
the default comparison (ours = `TrainStepConfig.fastest()` with its default attention, impl "ours") per GPU
kind; older runs are listed by commit and attention (`compare_runs`), never folded into its ratios. The
waterfall, bandwidth and check parts come from the latest run that measured them, labelled by its commit,
GPU and attention.
"""

from __future__ import annotations

import json
import math

import pandas as pd

PHASES = ("forward", "backward", "optimizer")
# the waterfall's stages: each adds one change to the step before it
STAGES: list[tuple[str, dict]] = [
    ("handout fp32", {}),
    ("+ bf16 autocast", dict(autocast=True)),
    ("+ our FlashAttention", dict(attention="flash_triton")),
    ("+ compile per block", dict(compile=True)),
    ("+ fused AdamW", dict(optimizer="fused")),
    ("+ bf16 compute weights", dict(bf16_weights=True)),
    ("+ fused LM-head loss", dict(fused_loss=True)),
    ("SDPA instead of our attention", dict(attention="sdpa")),
    ("+ overlap with backward", dict(overlap=True)),
    ("+ split fp32 masters", dict(split_master=True)),  # = TrainStepConfig.fastest()
]

# per-path metrics of the comparison that compare_runs() reports
PATH_METRICS = ("peak_memory_gib", "persistent_memory_gib", "mfu_datasheet", "mfu_measured_peak")
PATH_METRICS += ("first_step_s", *(f"{p}_ms" for p in PHASES))
GOAL_RATIO = (
    0.85  # issue 29: ours at most 0.85x the stock step at contexts 512 and 2048, on an H100 and an H200
)
GOAL_CONTEXTS = (512, 2048)
GOAL_KINDS = ("H100", "H200")
DEFAULT_OURS = (
    "ours"  # the impl of TrainStepConfig.fastest() with the default attention (train_step.ours_label)
)


def gpu_kind(device: str) -> str:
    """ "H100" or "H200" for a device name of either kind, else the name itself."""
    return next((k for k in GOAL_KINDS if k in str(device)), str(device))


def _config(text) -> dict:
    return json.loads(text) if isinstance(text, str) and text else {}


def with_runs(df: pd.DataFrame) -> pd.DataFrame:
    """`df` with a `run` column: the rows of one invocation of the study share it. It is the config's
    `run_id` where recorded; rows written before the study recorded one are grouped by their place in
    the file (an invocation appends its rows as one block, its matmul_peak row first) and commit."""
    if df.empty:
        return df.assign(run=pd.Series(dtype=str))
    block = (df.name == "matmul_peak").cumsum()
    ids = [
        str(_config(c).get("run_id") or f"{str(sha)[:10]}#{b}")
        for c, sha, b in zip(df.config_json, df.git_sha, block)
    ]
    return df.assign(run=ids)


def runs_of(df: pd.DataFrame, runs) -> pd.DataFrame:
    """The rows of `df` that belong to the runs `runs` (`with_runs` ids), e.g. a table's provenance."""
    keep = with_runs(df).run.isin(list(runs))
    return df[keep.to_numpy()]


def compare_runs(df: pd.DataFrame) -> pd.DataFrame:
    """One record per run and context of the `compare` part: device, commit, the impl (label) and
    attention of ours, whether the idle path was parked off the GPU (runs with `persistent_memory_gib`
    rows: the study parks it since it records them), each path's median step, phases, peak and
    persistent memory, MFU and failure note, and ours / stock. Oldest first."""
    df = with_runs(df)
    cmp = df[df.name == "compare"]
    out = []
    for (run, ctx), g in cmp.groupby(["run", "x_value"], sort=False):
        ours = sorted(i for i in g.impl.unique() if i.startswith("ours"))
        if "stock" not in set(g.impl) or not ours:
            continue
        label = ours[0]
        step = g[g.metric == "step_ms"]
        first = step.iloc[0] if len(step) else g.iloc[0]
        cfg = _config(first.config_json)
        rec: dict = {
            "run": run, "device": str(first.gpu_name), "git": str(first.git_sha)[:10], "ours": label,
            "attention": (cfg.get("ours") or {}).get("attention") or cfg.get("attention", ""),
            "parked": bool((g.metric == "persistent_memory_gib").any()),
            "size": cfg.get("size", ""), "batch": cfg.get("batch_size"), "ctx": int(float(ctx)),
            "timestamp": g.timestamp.max(),
        }  # fmt: skip
        for path, impl in (("stock", "stock"), ("ours", label)):
            rows = g[g.impl == impl].drop_duplicates("metric", keep="last").set_index("metric")
            rec[f"{path}_ms"] = float(rows.p50.get("step_ms", math.nan))
            for m in PATH_METRICS:
                rec[f"{path}_{m}"] = float(rows.p50.get(m, math.nan))
            note = rows.note.get("step_ms", "") if "step_ms" in rows.index else "not run"
            rec[f"{path}_note"] = note if isinstance(note, str) else ""
        rec["ratio"] = rec["ours_ms"] / rec["stock_ms"]
        rec["meets_goal"] = bool(rec["ratio"] <= GOAL_RATIO)
        rec["peak_le_stock"] = bool(rec["ours_peak_memory_gib"] <= rec["stock_peak_memory_gib"])
        matmul = df[(df.run == run) & (df.name == "matmul_peak")].p50
        rec["matmul_tflops"] = float(matmul.iloc[-1]) if len(matmul) else math.nan
        out.append(rec)
    if not out:
        return pd.DataFrame()
    return pd.DataFrame(out).sort_values("timestamp", kind="stable").reset_index(drop=True)


def latest_per_device(runs: pd.DataFrame, size: str | None = None) -> dict[str, dict]:
    """Per GPU kind, the latest run of the default comparison (ours with its default attention; of
    `size` if given) in which both paths ran at every context of GOAL_CONTEXTS, or where no run did,
    at some context (a later run of fewer contexts is listed by `compare_runs`, not quoted): {device:
    {run, git, attention, parked, timestamp, contexts: {ctx: record}}}, devices in name order."""
    if runs.empty:
        return {}
    sel = runs[(runs.ours == DEFAULT_OURS) & runs.ratio.notna()]
    if size is not None:
        sel = sel[sel["size"] == size]
    out = {}
    for device in sorted(sel.device.unique()):
        mine = sel[sel.device == device]
        complete = [
            r for r, g in mine.groupby("run", sort=False) if set(GOAL_CONTEXTS) <= set(g.ctx.astype(int))
        ]
        last = complete[-1] if complete else mine.iloc[-1].run
        recs = runs[runs.run == last]
        first = recs.iloc[0]
        out[device] = {
            "run": last,
            "git": first.git,
            "attention": first.attention,
            "parked": bool(recs.parked.all()),
            "size": first["size"],
            "batch": int(first.batch) if first.batch == first.batch else None,
            "timestamp": recs.timestamp.max(),
            "contexts": {int(r.ctx): r._asdict() for r in recs.sort_values("ctx").itertuples(index=False)},
        }
    return out


def _latest_part_run(df: pd.DataFrame, name: str) -> pd.DataFrame:
    """The rows of the latest run (by its newest row) that measured part `name`; all of that run's rows."""
    df = with_runs(df)
    part = df[df.name == name]
    if part.empty:
        return df.iloc[0:0]
    last = part.sort_values("timestamp", kind="stable").run.iloc[-1]
    return df[df.run == last]


def run_label(rows: pd.DataFrame) -> dict:
    """Device, commit and the attention of ours of one run's rows (its compare or check config)."""
    cfg = next((_config(c) for c in rows.config_json if "attention" in _config(c)), {})
    return {
        "device": str(rows.gpu_name.iloc[0]) if len(rows) else "",
        "git": str(rows.git_sha.iloc[0])[:10] if len(rows) else "",
        "attention": (cfg.get("ours") or {}).get("attention") or cfg.get("attention", ""),
    }


def waterfall_table(df: pd.DataFrame) -> pd.DataFrame:
    """Median step and phase times (ms) of each waterfall stage of the latest run with a waterfall,
    in the order the stages were added."""
    run = _latest_part_run(df, "waterfall")
    w = run[
        (run.name == "waterfall") & run.metric.isin(["step_ms", "forward_ms", "backward_ms", "optimizer_ms"])
    ]
    order = [label for label, _ in STAGES]
    t = w.pivot_table(index="impl", columns="metric", values="p50", aggfunc="last")
    t = t.reindex([o for o in order if o in t.index])
    notes = run[(run.name == "waterfall") & (run.note.fillna("") != "")].set_index("impl")["note"]
    t["note"] = [notes.get(i, "") for i in t.index]
    return t[["step_ms", "forward_ms", "backward_ms", "optimizer_ms", "note"]]


def plot_waterfall(df: pd.DataFrame, ax=None):
    """Horizontal bars: step time per waterfall stage of the latest waterfall run, with the stock step
    of the same run (its compare part at the same context) as a vertical line."""
    import matplotlib.pyplot as plt

    t = waterfall_table(df)
    run = _latest_part_run(df, "waterfall")
    label = run_label(run)
    if ax is None:
        _, ax = plt.subplots(figsize=(8, 0.42 * len(t) + 1.3))
    ax.barh(t.index[::-1], t["step_ms"][::-1], color="#4c72b0")
    for y, v in enumerate(t["step_ms"][::-1]):
        ax.text(v, y, f" {v:.0f}", va="center", fontsize=8)
    stock = run[(run.name == "compare") & (run.impl == "stock") & (run.metric == "step_ms")]
    for ctx, g in stock.groupby("x_value"):
        if ctx in set(run[run.name == "waterfall"].x_value):
            ax.axvline(
                g.p50.iloc[-1],
                color="#c44e52",
                ls="--",
                label=f"stock step, same run ({g.p50.iloc[-1]:.0f} ms)",
            )
    ctxs = sorted({int(float(x)) for x in run[run.name == "waterfall"].x_value.dropna()})
    ax.set_title(
        f"Waterfall, context {', '.join(map(str, ctxs))}: {label['device']}, git {label['git']}", fontsize=10
    )
    ax.set_xscale("log")
    ax.set_xlabel("median step time (ms, log scale)")
    ax.legend(loc="lower right")
    return ax.figure


def facts(df: pd.DataFrame, size: str | None = None) -> dict:
    """The numbers the training-step answer quotes (see the module docstring):
    * "runs": `compare_runs` records (every run and context); "latest": `latest_per_device` (of `size`);
      "goal_ratio", "goal_points" ((device, context, met) of the latest runs at the goal's contexts),
      "goal_met" (every such point at most the goal, both GPU kinds measured at both contexts), "peaks_ok"
      (ours' peak at most stock's at every point of the latest runs);
    * "waterfall" (stage -> ms), "bandwidth" (copy and fused AdamW GB/s), "check" (max loss difference
      over its steps): each with its run's label ("<part>_run": device, git, attention; for the waterfall
      also its run id and the comparison of the same run: context, stock and ours' step)."""
    out: dict = {"goal_ratio": GOAL_RATIO}
    if df.empty:
        return out
    runs = compare_runs(df)
    out["runs"] = runs.to_dict("records")
    out["latest"] = latest_per_device(runs, size)
    points = [(dev, ctx, rec) for dev, r in out["latest"].items() for ctx, rec in r["contexts"].items()]
    goal = [(d, c, r) for d, c, r in points if c in GOAL_CONTEXTS]
    out["goal_points"] = [(d, c, bool(r["meets_goal"])) for d, c, r in goal]
    covered = {(gpu_kind(d), c) for d, c, _ in goal}
    out["goal_met"] = all(r["meets_goal"] for _, _, r in goal) and covered >= {
        (k, c) for k in GOAL_KINDS for c in GOAL_CONTEXTS
    }
    out["peaks_ok"] = bool(points) and all(r["peak_le_stock"] for _, _, r in points)
    bw = _latest_part_run(df, "bandwidth")
    if len(bw):
        b = bw[bw.name == "bandwidth"].groupby("impl").p50.last()
        out["bandwidth"] = {"copy_gbs": b.get("copy"), "adamw_gbs": b.get("fused_adamw")}
        out["bandwidth"]["adamw_fraction_of_copy"] = b.get("fused_adamw") / b.get("copy")
        out["bandwidth_run"] = run_label(bw)
    wf = _latest_part_run(df, "waterfall")
    if len(wf):
        out["waterfall"] = waterfall_table(df)["step_ms"].to_dict()
        out["waterfall_run"] = run_label(wf) | {"run": wf.run.iloc[0]}
        same = compare_runs(wf)
        if len(same):
            out["waterfall_run"] |= {
                "ctx": int(same.ctx.iloc[0]),
                "stock_ms": float(same.stock_ms.iloc[0]),
                "ours_ms": float(same.ours_ms.iloc[0]),
                "ours_optimizer_ms": float(same.ours_optimizer_ms.iloc[0]),
            }
    ck = _latest_part_run(df, "check")
    if len(ck):
        c = ck[ck.name == "check"].pivot_table(index="x_value", columns="impl", values="p50", aggfunc="last")
        out["check"] = {"max_loss_diff": float((c["ours"] - c["reference"]).abs().max()), "steps": len(c)}
        out["check_run"] = run_label(ck)
    return out
