"""The training_step rows (measured by `cs336_systems.studies.training.train_step`): the waterfall table and
figure, and `facts()`, the numbers notebook 40's answer quotes, from rows; and the waterfall's `STAGES`, which
`train_step` (the study, which re-exports `facts`) runs."""

from __future__ import annotations

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

# per-path metrics of the comparison that facts() reports
PATH_METRICS = ("peak_memory_gib", "mfu_datasheet", "mfu_measured_peak", "first_step_s")
PATH_METRICS += tuple(f"{p}_ms" for p in PHASES)


def waterfall_table(df: pd.DataFrame) -> pd.DataFrame:
    """Median step and phase times (ms) of each waterfall stage, in the order they were added."""
    w = df[
        (df.name == "waterfall") & df.metric.isin(["step_ms", "forward_ms", "backward_ms", "optimizer_ms"])
    ]
    order = [label for label, _ in STAGES]
    t = w.pivot_table(index="impl", columns="metric", values="p50", aggfunc="last")
    t = t.reindex([o for o in order if o in t.index])
    notes = df[(df.name == "waterfall") & (df.note.fillna("") != "")].set_index("impl")["note"]
    t["note"] = [notes.get(i, "") for i in t.index]
    return t[["step_ms", "forward_ms", "backward_ms", "optimizer_ms", "note"]]


def plot_waterfall(df: pd.DataFrame, ax=None):
    """Horizontal bars: step time per waterfall stage, with the stock step as a vertical line."""
    import matplotlib.pyplot as plt

    t = waterfall_table(df)
    if ax is None:
        _, ax = plt.subplots(figsize=(8, 0.45 * len(t) + 1.2))
    ax.barh(t.index[::-1], t["step_ms"][::-1], color="#4c72b0")
    for y, v in enumerate(t["step_ms"][::-1]):
        ax.text(v, y, f" {v:.0f}", va="center", fontsize=8)
    stock = df[(df.name == "compare") & (df.impl == "stock") & (df.metric == "step_ms")]
    for ctx, g in stock.groupby("x_value"):
        if ctx in set(df[df.name == "waterfall"].x_value):
            ax.axvline(
                g.p50.iloc[-1],
                color="#c44e52",
                ls="--",
                label=f"stock PyTorch step ({g.p50.iloc[-1]:.0f} ms)",
            )
    ax.set_xscale("log")
    ax.set_xlabel("median step time (ms, log scale)")
    ax.legend(loc="lower right")
    return ax.figure


def facts(df: pd.DataFrame) -> dict:
    """The numbers the training-step answer quotes, from the latest run's rows."""
    out: dict = {}
    if not df.empty and "bandwidth" in set(df.name):
        bw = df[df.name == "bandwidth"].groupby("impl").p50.last()
        out["copy_gbs"], out["adamw_gbs"] = bw.get("copy"), bw.get("fused_adamw")
        out["adamw_fraction_of_copy"] = out["adamw_gbs"] / out["copy_gbs"]
    if not df.empty and "matmul_peak" in set(df.name):
        out["matmul_tflops"] = df[df.name == "matmul_peak"].p50.iloc[-1]
    if not df.empty and "waterfall" in set(df.name):
        out["waterfall"] = waterfall_table(df)["step_ms"].to_dict()
    if not df.empty and "check" in set(df.name):
        c = df[df.name == "check"].pivot_table(index="x_value", columns="impl", values="p50", aggfunc="last")
        out["check_max_loss_diff"] = float((c["ours"] - c["reference"]).abs().max())
        out["check_steps"] = len(c)
    cmp = df[(df.name == "compare")]
    for ctx, g in cmp.groupby("x_value"):
        get = {(r.impl, r.metric): r.p50 for r in g.itertuples()}
        if ("stock", "step_ms") in get and ("ours", "step_ms") in get:
            out[int(ctx)] = {
                "stock_ms": get["stock", "step_ms"],
                "ours_ms": get["ours", "step_ms"],
                "ratio": get["ours", "step_ms"] / get["stock", "step_ms"],
                **{f"{p}_{m}": get.get((p, m), math.nan) for p in ("stock", "ours") for m in PATH_METRICS},
            }
    return out
