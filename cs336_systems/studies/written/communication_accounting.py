"""The 2025 communication_accounting problem (section 2.4): the XXL FFN stack's memory on H100s, its
FSDP sharding onto TPU v5p, and the Scaling Book's mixed FSDP + TP forward model.

Nothing is measured: every table, figure and `facts()` value is computed by `cs336_systems.accounting`.
Memory is in bytes (decimal GB / TB / MB where printed, as the device sizes are quoted); a token is one
row of the activations (the handout's "batch" B counts tokens).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from cs336_systems import accounting
from cs336_systems.measure.provenance import code_commit

XXL, TPU, H100 = accounting.XXL, accounting.TPU_V5P, accounting.H100_SXM
TOKEN_COUNTS = (1024, 2048, 4096, 8192)  # example batches (tokens) for the activation terms
MESH_X = (64, 32, 16, 8, 4, 2)  # FSDP degrees of the 64-chip layouts of (d)
PIPELINE_STAGES = 4
CODE = (accounting.__path__[0], __file__)  # the code behind every number here: the closed forms, this module


def provenance() -> str:
    """The footer of this study's tables: computed (not measured), and the last commit of the code that
    computes them (measure.provenance, [Note: the commit of a computed table])."""
    return f"computed analytically by cs336_systems.accounting at git {code_commit(CODE)}"


def tpu_setting(**overrides: Any) -> accounting.MixedFsdpTpSetting:
    """The handout's TPU v5p mesh: X = 16 (FSDP), Y = 4 (TP), M_X = 2, M_Y = 1."""
    return accounting.MixedFsdpTpSetting(
        **({"d_model": XXL.d_model, "d_ff": XXL.d_ff, "x": 16, "y": 4, "m_x": 2, "m_y": 1} | overrides)
    )


def memory_terms_table() -> pd.DataFrame:
    """(a) Bytes, GB and GiB of the fp32 state terms and of the bf16 activations saved per token."""
    state = accounting.ffn_stack_memory(XXL, tokens=0)
    rows = [
        ("master weights (fp32)", state.weights),
        ("accumulated gradients (fp32)", state.gradients),
        ("AdamW m and v (fp32)", state.optimizer_state),
        ("state total", state.state),
        ("saved activations per token (bf16)", XXL.saved_activation_bytes_per_token(activation_bytes=2)),
    ]
    return pd.DataFrame(
        {
            "term": [r[0] for r in rows],
            "bytes": [int(r[1]) for r in rows],
            "GB": [r[1] / accounting.GB for r in rows],
            "GiB": [r[1] / accounting.GiB for r in rows],
        }
    )


def activation_table(token_counts: Sequence[int] = TOKEN_COUNTS) -> pd.DataFrame:
    """(a) Saved activations, state + activations, and the H100 80GB count per example batch."""
    rows = []
    for t in token_counts:
        m = accounting.ffn_stack_memory(XXL, tokens=t)
        rows.append(
            {
                "tokens T": t,
                "activations A(T) [GB]": m.activations / accounting.GB,
                "state + A(T) [GB]": m.total / accounting.GB,
                "H100 80GB needed": accounting.devices_to_hold(m.total, H100.memory_bytes),
            }
        )
    return pd.DataFrame(rows)


def fsdp_fit_table(token_counts: Sequence[int] = TOKEN_COUNTS) -> pd.DataFrame:
    """(b) The smallest N_FSDP under 95 GB per device (NaN where none fits), for T = 0 and each batch."""
    rows = []
    for t in [0, *token_counts]:
        m = accounting.ffn_stack_memory(XXL, tokens=t)
        n_min = accounting.min_fsdp_devices(m, TPU.memory_bytes)
        rows.append(
            {
                "tokens T": t,
                "A(T) [GB]": m.activations / accounting.GB,
                "min N_FSDP (95 GB)": n_min if n_min is not None else float("nan"),
                "memory/device at that N [GB]": (
                    accounting.fsdp_memory_per_device(m, n_min).total / accounting.GB
                    if n_min is not None
                    else float("nan")
                ),
            }
        )
    return pd.DataFrame(rows)


def plot_memory_vs_n_fsdp(token_counts: Sequence[int] = TOKEN_COUNTS, n_fsdp_max: int = 256):
    fig, ax = plt.subplots()
    ns = np.arange(1, n_fsdp_max + 1)
    for t in [0, *token_counts]:
        m = accounting.ffn_stack_memory(XXL, tokens=t)
        mem = [accounting.fsdp_memory_per_device(m, n).total / accounting.GB for n in ns]
        ax.plot(ns, mem, label=f"T = {t} tokens" if t else "state only (T = 0)")
    ax.axhline(TPU.memory_bytes / accounting.GB, color="k", ls="--", lw=1, label="TPU v5p: 95 GB")
    ax.set(xscale="log", yscale="log", xlabel="$N_{FSDP}$", ylabel="memory per device [GB]")
    ax.set_title("XXL per-device memory: $(16P + A/2)/N + A/2$")
    ax.legend(fontsize="small")
    return fig


def tpu_table(setting: accounting.MixedFsdpTpSetting) -> pd.DataFrame:
    """(c) alpha, the TP fraction and the smallest batches under both criteria (sum and max)."""
    b_sum, b_max = setting.min_batch(combine="sum"), setting.min_batch(combine="max")
    return pd.DataFrame(
        [
            {"quantity": "alpha = C / W_ici [FLOP/B]", "value": setting.alpha},
            {"quantity": "T_TP / T_math = alpha Y / (M_Y F)", "value": setting.tp_fraction()},
            {
                "quantity": "alpha Y / M_Y (TP hidden iff F >= this)",
                "value": setting.alpha * setting.y / setting.m_y,
            },
            {"quantity": "min B / N, book (sum) [tokens]", "value": b_sum / setting.n},
            {"quantity": "min global B, book (sum) [tokens]", "value": b_sum},
            {"quantity": "min B / N, collectives overlapped (max) [tokens]", "value": b_max / setting.n},
            {"quantity": "min global B, collectives overlapped (max) [tokens]", "value": b_max},
        ]
    )


def plot_tpu_times(setting: accounting.MixedFsdpTpSetting):
    """(c) T_math, T_FSDP, T_TP and their sum per block over the global batch, with the book's bound."""
    b_sum = setting.min_batch(combine="sum")
    fig, ax = plt.subplots()
    bs = np.logspace(3, 6, 200)
    ax.plot(bs, [setting.t_math(b) * 1e6 for b in bs], color="k", label="$T_{math}$")
    ax.plot(bs, [setting.t_fsdp() * 1e6] * len(bs), label="$T_{FSDP}$")
    ax.plot(bs, [setting.t_tp(b) * 1e6 for b in bs], label="$T_{TP}$")
    ax.plot(
        bs, [(setting.t_fsdp() + setting.t_tp(b)) * 1e6 for b in bs], ls="--", label="$T_{FSDP} + T_{TP}$"
    )
    ax.axvline(b_sum, color="grey", lw=1, ls=":")
    ax.annotate(
        f"B = {b_sum:,.0f}",
        (b_sum, setting.t_math(b_sum) * 1e6),
        xytext=(8, -20),
        textcoords="offset points",
        bbox={"fc": "white", "ec": "none"},
    )
    ax.set(
        xscale="log", yscale="log", xlabel="global batch B [tokens]", ylabel="time per block, forward [us]"
    )
    ax.set_title("TPU v5p, X=16 (FSDP) x Y=4 (TP): compute vs communication")
    ax.legend(fontsize="small")
    return fig


def layout_variants() -> dict[str, tuple[accounting.MixedFsdpTpSetting, int, int]]:
    """(d) The tricks beyond re-meshing: FP8 weight all-gathers, and a pipeline of PIPELINE_STAGES stages
    of 64 / P chips (every stage keeps Y = 4 and has X = 16 / P; a layer's math is shared by its stage's
    chips only, so the per-layer ratios are those of that smaller mesh). Values: (setting, X, Y)."""
    x_pp = 16 // PIPELINE_STAGES
    return {
        "fp8 weight all-gathers": (tpu_setting(weight_bytes=1), 16, 4),
        f"pipeline, {PIPELINE_STAGES} stages of 16 chips": (tpu_setting(x=x_pp), x_pp, 4),
    }


def layout_table() -> pd.DataFrame:
    """(d) The smallest global batch (book criterion) for every X x Y split of 64 chips and the variants."""
    rows = []
    cases = [("bf16, 64 chips", tpu_setting(x=x, y=64 // x), x, 64 // x) for x in MESH_X]
    cases += [(name, *v) for name, v in layout_variants().items()]
    for name, setting, x, y in cases:
        rows.append(
            {
                "variant": name,
                "X (FSDP)": x,
                "Y (TP)": y,
                "T_TP / T_math": setting.tp_fraction(),
                "min global B [tokens]": setting.min_batch(),
            }
        )
    return pd.DataFrame(rows)


def facts(token_counts: Sequence[int] = TOKEN_COUNTS) -> dict[str, Any]:
    """Every number the answers (a)-(d) state, from the accounting functions."""
    gb, mb = accounting.GB, accounting.MB
    state = accounting.ffn_stack_memory(XXL, tokens=0)
    act_per_token = XXL.saved_activation_bytes_per_token(activation_bytes=2)
    last = token_counts[-1]
    fit = fsdp_fit_table(token_counts)
    n_min0 = accounting.min_fsdp_devices(state, TPU.memory_bytes)
    tpu = tpu_setting()
    b_sum, b_max = tpu.min_batch(combine="sum"), tpu.min_batch(combine="max")
    mesh = layout_table()
    best = mesh.iloc[: len(MESH_X)].sort_values("min global B [tokens]").iloc[0]
    b_opt = accounting.mixed_fsdp_tp_optimal_min_batch_per_device(XXL.d_ff) * 64
    variants = layout_variants()
    return {
        # (a)
        "params": XXL.num_params,
        "state_bytes": state.state,
        "state_TB": state.state / accounting.TB,
        "state_GiB": state.state / accounting.GiB,
        "weights_GB": state.weights / gb,
        "gradients_GB": state.gradients / gb,
        "optimizer_state_GB": state.optimizer_state / gb,
        "activation_bytes_per_token": act_per_token,
        "activation_MB_per_token": act_per_token / mb,
        "example_tokens": last,
        "example_activations_GB": accounting.ffn_stack_memory(XXL, tokens=last).activations / gb,
        "h100_for_state": accounting.devices_to_hold(state.state, H100.memory_bytes),
        "h100_for_state_80GiB": accounting.devices_to_hold(state.state, 80 * accounting.GiB),
        "state_over_h100": state.state / H100.memory_bytes,
        # (b)
        "state_over_tpu": state.state / TPU.memory_bytes,
        "min_fsdp_state_only": n_min0,
        "memory_per_device_at_min_GB": accounting.fsdp_memory_per_device(state, n_min0).total / gb,
        "min_fsdp_example_tokens": fit["min N_FSDP (95 GB)"].iloc[-1],
        "max_tokens_any_fsdp": 2 * TPU.memory_bytes / act_per_token,
        # (c)
        "alpha": tpu.alpha,
        "tp_hidden_min_d_ff": tpu.alpha * tpu.y / tpu.m_y,
        "tp_fraction": tpu.tp_fraction(),
        "chips": tpu.n,
        "min_batch_sum": b_sum,
        "min_batch_sum_per_device": b_sum / tpu.n,
        "min_batch_sum_per_fsdp_shard": b_sum / tpu.x,
        "min_batch_max": b_max,
        "min_batch_max_per_device": b_max / tpu.n,
        # (d)
        "optimal_min_batch": b_opt,
        "optimal_x": accounting.mixed_fsdp_tp_optimal_x(b_opt, 64, XXL.d_ff),
        "best_mesh_x": best["X (FSDP)"],
        "best_mesh_min_batch": best["min global B [tokens]"],
        "pipeline_stages": PIPELINE_STAGES,
        "pipeline_min_batch": variants[f"pipeline, {PIPELINE_STAGES} stages of 16 chips"][0].min_batch(),
        "fp8_min_batch": variants["fp8 weight all-gathers"][0].min_batch(),
    }
