"""The pytorch_attention rows (measured by `cs336_systems.studies.attention.pytorch_attention`): the results
table, the scaling figure, the memory accounting of the smallest OOM configuration, and `facts()`.

Reads rows, plus the accounting (`attention_memory_accounting`, from the shapes alone) that the
measurement records in each row's config; `pytorch_attention` (the study) re-exports both.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

import pandas as pd

BATCH_SIZE = 8
MIB = 2**20


def attention_memory_accounting(
    batch_size: int, seq_len: int, d: int, dtype_bytes: int = 4, *, causal: bool = True
) -> dict[str, int]:
    """Bytes of each component of the study's naive attention (derived from its autograd graph).

    Forward: S = Q K^T / sqrt(d); S' = where(mask, S, -inf); m = rowmax(S'); E = exp(S' - m);
    l = rowsum(E); P = E / l; O = P V. Autograd saves S' (for amax), E (for exp and the division),
    P (for P V), the mask, m and l; Q, K, V are saved by reference. `forward_peak_extra` is the
    largest transient on top of that (S' - m is alive while E and P are computed);
    `backward_transient_estimate` assumes three T x T gradient buffers alive at once (dP, dE and
    the amax/where gradient), an estimate to check against the measured backward peak.
    Keys: the components plus the totals "saved_for_backward", "before_backward", "forward_peak",
    "backward_peak_estimate".
    """
    if min(batch_size, seq_len, d, dtype_bytes) < 1:
        raise ValueError("batch_size, seq_len, d and dtype_bytes must be positive")
    b, t, s = batch_size, seq_len, dtype_bytes
    square = b * t * t * s  # one (batch, T, T) float tensor
    parts = {
        "inputs Q, K, V": 3 * b * t * d * s,
        "output O": b * t * d * s,
        "grad_output dO": b * t * d * s,
        "saved: masked scores S'": square,
        "saved: exp(S' - m)": square,
        "saved: probabilities P": square,
        "saved: causal mask (T x T bool)": t * t if causal else 0,
        "saved: row max m and row sum l": 2 * b * t * s,
        "forward_peak_extra": square,
        "backward_transient_estimate": 3 * square,
    }
    saved = sum(v for k, v in parts.items() if k.startswith("saved:"))
    parts["saved_for_backward"] = saved
    parts["before_backward"] = parts["inputs Q, K, V"] + parts["output O"] + parts["grad_output dO"] + saved
    parts["forward_peak"] = parts["inputs Q, K, V"] + saved + parts["forward_peak_extra"]
    parts["backward_peak_estimate"] = parts["before_backward"] + parts["backward_transient_estimate"]
    return parts


def smallest_oom(df: pd.DataFrame) -> tuple[int, int] | None:
    """(d, T) of the smallest configuration (by d*T, then T) with an OOM row, or None."""
    oom = df[df["note"].astype(str).str.contains("OOM")]
    if oom.empty:
        return None
    pts = {(int(str(n).lstrip("d")), int(t)) for n, t in zip(oom["name"], oom["x_value"])}
    return min(pts, key=lambda p: (p[0] * p[1], p[1], p[0]))


def oom_phase(df: pd.DataFrame, d: int, seq_len: int) -> dict[str, Any]:
    """Where configuration (d, seq_len) ran out of memory, as its rows say: {"phase", "first_forward_ms"}.

    The protocol's first warm-up pass records `first_forward_time` once the forward completes and
    `first_backward_time` once its backward does. A first forward with a time and no first backward
    means the backward ran out of memory first, even when the rows' notes name a later forward (after a
    failed backward the sweep stops in the next forward). Without a first forward the forward failed.
    """
    rows = df[(df.name == f"d{d}") & (df.x_value.astype(float) == seq_len)]
    done = rows[(rows.note.astype(str) == "") & rows["mean"].notna()].set_index("metric")["mean"]
    first_fwd = done.get("first_forward_time")
    if first_fwd is not None and "first_backward_time" not in done:
        return {"phase": "backward", "first_forward_ms": float(first_fwd)}
    notes = rows.set_index("metric")["note"].astype(str)
    phase = "forward" if notes.get("forward_time", "").startswith("OOM") else "backward"
    return {"phase": phase, "first_forward_ms": None if first_fwd is None else float(first_fwd)}


def accounting_table(
    batch_size: int, seq_len: int, d: int, device_bytes: float | None = None
) -> pd.DataFrame:
    """`attention_memory_accounting` as a table in MiB/GiB, optionally with the device's capacity."""
    acc = attention_memory_accounting(batch_size, seq_len, d)
    df = pd.DataFrame({"component": list(acc), "bytes": list(acc.values())})
    df["MiB"] = df["bytes"] / MIB
    df["GiB"] = df["bytes"] / 2**30
    if device_bytes is not None:
        df["fraction of device"] = df["bytes"] / device_bytes
    return df


def scaling_exponent(seq_lens: Sequence[float], values: Sequence[float]) -> float:
    """Least-squares slope of log(values) against log(seq_lens) (2.0 = quadratic in T)."""
    pts = [(math.log(t), math.log(v)) for t, v in zip(seq_lens, values) if v and v > 0 and t > 0]
    if len(pts) < 2:
        return math.nan
    mx = sum(p[0] for p in pts) / len(pts)
    my = sum(p[1] for p in pts) / len(pts)
    den = sum((p[0] - mx) ** 2 for p in pts)
    return sum((p[0] - mx) * (p[1] - my) for p in pts) / den if den else math.nan


def _parse_d(name: object) -> int:
    return int(str(name).lstrip("d"))


def results_table(df: pd.DataFrame, impl: str = "naive") -> pd.DataFrame:
    """(d, T) x {forward ms, backward ms, memory before backward MiB}: means, or the failure note."""
    from cs336_systems.measure.results import latest_run

    metrics = {
        "forward_time": "forward (ms)",
        "backward_time": "backward (ms)",
        "memory_before_backward": "memory before backward (MiB)",
    }
    t = latest_run(df[(df.impl == impl) & df.metric.isin(list(metrics))])
    if t.empty:
        return pd.DataFrame()
    value = t.apply(
        lambda r: (
            ("OOM" if "OOM" in r["note"] else r["note"])
            if r["note"] and r["n"] == 0
            else (f"{r['mean']:.3g}" if r["unit"] == "ms" else f"{r['mean']:,.0f}")
        ),
        axis=1,
    )
    t = t.assign(
        d=t["name"].map(_parse_d), T=t["x_value"].astype(int), value=value, metric=t["metric"].map(metrics)
    )
    out = t.pivot_table(index=["d", "T"], columns="metric", values="value", aggfunc="last")
    out = out[[m for m in metrics.values() if m in out.columns]]
    for d, seq in out.index:  # an OOM cell says which pass failed, from the rows (see oom_phase)
        if "OOM" in str(out.loc[(d, seq)].get("forward (ms)", "")):
            where = oom_phase(df[df.impl == impl], d, seq)
            if where["phase"] == "backward" and where["first_forward_ms"] is not None:
                out.loc[(d, seq), "forward (ms)"] = f"{where['first_forward_ms']:.3g} (1 pass)"
    return out


def grid_table(df: pd.DataFrame, impl: str = "naive") -> pd.DataFrame:
    """`results_table` pivoted: a row per (d, quantity), a column per T (no split row labels)."""
    t = results_table(df, impl)
    if t.empty:
        return t
    short = {"forward (ms)": "fwd ms", "backward (ms)": "bwd ms", "memory before backward (MiB)": "MiB"}
    long = t.rename(columns=short).stack().rename("value").reset_index()
    long.columns = ["d", "T", "quantity", "value"]
    out = long.pivot_table(index=["d", "quantity"], columns="T", values="value", aggfunc="last")
    order = {q: i for i, q in enumerate(short.values())}
    out = out.sort_index(key=lambda i: i.map(order) if i.name == "quantity" else i)
    out.columns = [f"T={c}" for c in out.columns]
    return out


def memory_vs_accounting(df: pd.DataFrame, impl: str = "naive") -> pd.DataFrame:
    """Memory of the forward graph (output O + what autograd saved; allocated after the forward minus
    allocated before it) next to `attention_memory_accounting`'s prediction, in MiB."""
    from cs336_systems.measure.results import latest_run

    t = latest_run(df[(df.impl == impl) & (df.metric == "memory_forward_graph") & (df.note == "")])
    rows = []
    for r in t.itertuples():
        cfg = json.loads(r.config_json) if isinstance(r.config_json, str) else {}
        b, d, n = cfg.get("batch_size", BATCH_SIZE), _parse_d(r.name), int(r.x_value)
        acc = attention_memory_accounting(b, n, d)
        rows.append(
            {
                "d": d,
                "T": n,
                "measured_MiB": r.mean,
                "predicted_MiB": (acc["saved_for_backward"] + acc["output O"]) / MIB,
                "saved_T2_MiB": 3 * b * n * n * 4 / MIB,
            }
        )
    return pd.DataFrame(rows).sort_values(["d", "T"]).reset_index(drop=True) if rows else pd.DataFrame()


def plot_scaling(df: pd.DataFrame, impl: str = "naive"):
    """Two panels against T (log-log): forward/backward time per d; memory of the forward graph (saved
    for backward + output), measured (markers) against `attention_memory_accounting` (lines)."""
    import matplotlib.pyplot as plt

    from cs336_systems.measure.results import latest_run

    t = latest_run(df[(df.impl == impl) & (df.note == "")])
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(9.0, 3.4))
    ds = sorted({_parse_d(n) for n in t["name"]})
    colors = plt.get_cmap("viridis")([i / max(len(ds) - 1, 1) * 0.85 for i in range(len(ds))])
    for d, c in zip(ds, colors):
        sel = t[t["name"] == f"d{d}"]
        for metric, style in (("forward_time", "-"), ("backward_time", "--")):
            s = sel[sel.metric == metric].sort_values("x_value")
            ax_t.plot(
                s.x_value,
                s["mean"],
                style,
                marker="o",
                color=c,
                label=f"d={d}" if metric == "forward_time" else None,
            )
        m = sel[sel.metric == "memory_forward_graph"].sort_values("x_value")
        if len(m):
            ax_m.plot(m.x_value, m["mean"], "o", color=c, label=f"d={d} measured")
            accs = [attention_memory_accounting(BATCH_SIZE, int(n), d) for n in m.x_value]
            pred = [(a["saved_for_backward"] + a["output O"]) / MIB for a in accs]
            ax_m.plot(m.x_value, pred, "-", color=c, alpha=0.6)
    for ax in (ax_t, ax_m):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length T")
    ax_t.set_ylabel("ms per pass (solid: forward, dashed: backward)")
    ax_m.set_ylabel("saved for backward + output (MiB)")
    ax_t.legend(fontsize=8)
    if ax_m.lines:
        ax_m.legend(fontsize=7, title="lines: accounting", title_fontsize=7)
    fig.tight_layout()
    return fig


def facts(df: pd.DataFrame) -> dict[str, Any]:
    """The numbers the pytorch_attention answers state, from the naive rows of the latest run:
    `"oom"` (the smallest configuration that ran out of memory and its accounting; None if none did),
    `"device_bytes"` (the GPU's capacity recorded in the rows, or None), `"scaling"` (how the saved
    memory grows with T, and the accounting's largest relative error)."""
    out: dict[str, Any] = {"oom": None, "device_bytes": None}
    if df.empty:
        return out
    gpu_rows = df[~df.gpu_name.astype(str).str.startswith("cpu")]
    out["device_bytes"] = next((json.loads(c).get("device_total_bytes") for c in gpu_rows.config_json), None)
    oom = smallest_oom(df)
    if oom is not None:
        d, t = oom
        a = attention_memory_accounting(BATCH_SIZE, t, d)
        out["oom"] = {
            "d": d,
            "T": t,
            **oom_phase(df, d, t),
            "probabilities_GiB": a["saved: probabilities P"] / 2**30,
            "saved_for_backward_GiB": a["saved_for_backward"] / 2**30,
            "inputs_MiB": a["inputs Q, K, V"] / 2**20,
            "forward_peak_GiB": a["forward_peak"] / 2**30,
            "backward_peak_GiB": a["backward_peak_estimate"] / 2**30,
        }
    mem = memory_vs_accounting(df)
    if len(mem):
        big = mem[mem["T"] >= 1024]
        exps = [scaling_exponent(g["T"], g["measured_MiB"]) for _, g in big.groupby("d")]
        out["scaling"] = {
            "exponent_min": min(exps),
            "exponent_max": max(exps),
            "saved_T2_MiB_max": mem["saved_T2_MiB"].max(),
            "T_max": mem["T"].max(),
            "max_relative_error": (mem["measured_MiB"] / mem["predicted_MiB"] - 1).abs().max(),
        }
    return out
