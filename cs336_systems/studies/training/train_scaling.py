"""A scaling estimate of the 8B leaderboard step over 1..64 GPUs, on one node and several, from
`accounting/` and the committed measurements, checked against the measured step times at every GPU
count with committed rows (one, two and four GPUs).

Weak scaling: each GPU keeps the leaderboard's one 32768-token sequence, so N GPUs train a global
batch of N sequences (the leaderboard's fixed batch of 2 cannot be spread over more than 2 GPUs
without splitting sequences). Per GPU and step:

* compute: the step's model FLOPs (`train_step.step_flops`: 3 x forward matmuls, causal attention
  halved) plus the recomputed blocks (selective checkpointing recomputes a block's projections and MLP,
  not its attention: 2 x tokens x (4 d^2 + 3 d d_ff) each), at the rate the committed one-GPU run of
  ours achieved (its model + recompute FLOPs over its step time) or at the datasheet bf16 peak
  (`accounting.hardware.peak_flops`, the ideal). The number of recomputed blocks is the measured one at
  that N where a row exists, else that of the largest N measured (more GPUs free memory, so this errs
  toward more compute);
* communication of S = params x bytes per parameter (`ModelConfig.num_params`, bf16 by default) with
  the ring formulas of `accounting.communication` (alpha-beta, one call per unit per collective):
  - zero2 (ours, flat): reduce-scatter of the gradients + all-gather of the updated weights;
  - fsdp (flat): all-gather in forward, again in backward, reduce-scatter of the gradients;
  - hybrid (shard in the node, replicate across nodes): zero2 within each node over NVLink, then an
    all-reduce of each GPU's 1/g gradient shard across the nodes;
  a flat ring that leaves the node runs at the inter-node bandwidth (its slowest hop).
  Intra-node bandwidth: the committed NCCL all-reduce bus bandwidth at its largest size
  (`distributed_communication_single_node`), else the datasheet NVLink egress (`accounting.H100_SXM`);
  the inter-node bandwidth per GPU and the per-step latencies are stated assumptions;
* step: max(compute, communication) when the collectives overlap backward (ours does), their sum when
  they do not; tokens/s = N x T / step.

`check(...)`: estimate / measured at every N with committed rows of ours (mode bf16), at both rates: the
one-GPU calibration run (the latest, whatever its attention) and, at more GPUs, the latest run with our
own attention (config "attention" = flash_triton) on the same GPU kind (`measured`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import matplotlib.pyplot as plt
import pandas as pd

from cs336_systems.accounting.communication import (
    ring_all_gather_time,
    ring_all_reduce_time,
    ring_reduce_scatter_time,
)
from cs336_systems.accounting.hardware import H100_SXM, peak_flops
from cs336_systems.model import ModelConfig, get_config
from cs336_systems.studies.distributed import comm_facts
from cs336_systems.studies.training import leaderboard_facts
from cs336_systems.studies.training.train_step import step_flops

STRATEGIES = ("zero2", "fsdp", "hybrid")
CONFIG = "8B_leaderboard"


@dataclass(frozen=True, kw_only=True)
class Assumptions:
    """What the estimate assumes beyond the committed rows (each a notebook parameter)."""

    gpus_per_node: int = 8
    inter_node_gb_per_s: float = 50.0  # per GPU: one 400 Gb/s NIC per GPU (DGX H100 style)
    intra_step_latency_s: float = 5e-6  # per ring step within a node
    inter_step_latency_s: float = 15e-6  # per ring step that crosses nodes
    comm_bytes_per_param: float = 2.0  # bf16 weights and gradients (the leaderboard's headline mode)
    device: str = "NVIDIA H100 80GB HBM3"  # whose datasheet peak is the ideal rate

    def __post_init__(self) -> None:
        if self.gpus_per_node < 1 or self.inter_node_gb_per_s <= 0 or self.comm_bytes_per_param <= 0:
            raise ValueError(f"bad assumptions: {self}")


def recompute_flops(cfg: ModelConfig, blocks: float, tokens: int) -> float:
    """FLOPs of recomputing `blocks` blocks' projections and MLP (not attention) for `tokens` tokens."""
    d = cfg.d_model
    return blocks * 2.0 * tokens * (4 * d * d + 3 * d * cfg.d_ff)


OWN_ATTENTION = "flash_triton"  # our Triton FlashAttention-2 (the leaderboard rows' config "attention")


def _config(row) -> dict:
    c = getattr(row, "config_json", "")
    return json.loads(c) if isinstance(c, str) and c else {}


def measured(
    lb_rows: pd.DataFrame, mode: str = "bf16", attention: str | None = OWN_ATTENTION
) -> pd.DataFrame:
    """One run of ours (8B, `mode`) per world size: step_ms, checkpoint_blocks, comm_exposed_ms, n (timed
    steps behind step_ms), rep_s (do_bench's time budget), attention, gpu, git, timestamp.

    Trial runs of ours ([Note: trials] in leaderboard_facts) are left out. One GPU is the calibration
    point: its latest run, whatever its attention (the one the leaderboard
    reports). At more GPUs: the latest run whose config attention is `attention` (our own Triton
    FlashAttention by default) on the one-GPU run's GPU kind, falling back to the latest run of that kind,
    then to the latest of any; the attention and gpu columns say what was taken. A run's metrics are the
    rows of its step_ms row's path with the same timestamp and commit.
    """
    cols = ["world_size", "step_ms", "checkpoint_blocks", "comm_exposed_ms", "n", "rep_s"]
    if lb_rows.empty:
        return pd.DataFrame(columns=[*cols, "attention", "gpu", "git", "timestamp"])
    d = leaderboard_facts.with_world_size(lb_rows)
    d = d[(d.impl == "ours") & (d.dtype == mode) & d.name.astype(str).str.startswith(CONFIG)]
    d = d[d.x_name == "world_size"].sort_values("timestamp", kind="stable")
    steps = d[(d.metric == "step_ms") & d["mean"].notna()]
    steps = steps[
        [not leaderboard_facts.is_trial(_config(r), r.git_sha) for r in steps.itertuples()]
    ]  # trials: no reference
    steps = steps.assign(attention=[_config(r).get("attention", "") for r in steps.itertuples()])
    calibration_gpu = None
    out = []
    for n in sorted(steps.world_size.unique()):
        cand = steps[steps.world_size == n]
        if n > 1:
            for keep in (
                (cand.gpu_name == calibration_gpu) & (cand.attention == attention),
                cand.gpu_name == calibration_gpu,
            ):
                if keep.any():
                    cand = cand[keep]
                    break
        step = cand.iloc[-1]
        if n == 1:
            calibration_gpu = step.gpu_name
        run = d[
            (d.world_size == n) & (d.timestamp == step.timestamp) & (d.git_sha == step.git_sha)
        ].drop_duplicates(subset=["metric"], keep="last")
        vals = run.set_index("metric")["mean"]
        out.append(
            {
                "world_size": int(n),
                "step_ms": float(step["mean"]),
                "checkpoint_blocks": float(vals.get("checkpoint_blocks", math.nan)),
                "comm_exposed_ms": float(vals.get("comm_exposed_ms", math.nan)),
                "n": int(step.n) if pd.notna(step.get("n")) else 0,
                "rep_s": float(_config(step).get("rep_ms", math.nan)) / 1e3,
                "attention": step.attention,
                "gpu": str(step.gpu_name),
                "git": str(step.git_sha)[:7],
                "timestamp": str(step.timestamp),
            }
        )
    return pd.DataFrame(out, columns=[*cols, "attention", "gpu", "git", "timestamp"])


def intra_node_bandwidth(comm_rows: pd.DataFrame) -> tuple[float, str]:
    """(bytes/s, source): the NCCL all-reduce bus bandwidth (mean over calls) at the largest size and rank
    count of the reported all-reduce run (`comm_facts.latest_rows`), else the datasheet NVLink egress."""
    if not comm_rows.empty:
        rows = comm_facts.latest_rows(comm_rows)
        sel = rows[
            (rows.metric == "busbw") & rows.impl.astype(str).str.startswith("nccl") & (rows.note == "")
        ]
        if len(sel):
            sel = sel[sel.world_size == sel.world_size.max()]
            biggest = sel[sel.x_value == sel.x_value.max()].iloc[-1]
            return float(biggest["mean"]) * 1e9, (
                f"measured NCCL all-reduce bus bandwidth, {biggest.x_value:.0f} MB over "
                f"{int(biggest.world_size)} ranks on {biggest.run}"
            )
    return H100_SXM.link_bytes_per_s, "datasheet NVLink 4 egress (H100 SXM)"


def comm_seconds(
    strategy: str, n: int, size_bytes: float, a: Assumptions, w_intra: float, units: int
) -> float:
    """Per-GPU communication time of one step (see the module docstring)."""
    if n == 1:
        return 0.0
    g = a.gpus_per_node
    w_inter = a.inter_node_gb_per_s * 1e9
    if strategy == "hybrid" and n > g:
        nodes = n // g
        within = 2 * ring_reduce_scatter_time(size_bytes, g, w_intra)
        across = ring_all_reduce_time(size_bytes / g, nodes, w_inter)
        latency = 2 * (g - 1) * a.intra_step_latency_s + 2 * (nodes - 1) * a.inter_step_latency_s
        return within + across + units * latency
    w, alpha = (w_intra, a.intra_step_latency_s) if n <= g else (w_inter, a.inter_step_latency_s)
    gathers = {"zero2": 1, "fsdp": 2, "hybrid": 1}[strategy]
    # `units` calls of 1/units of the tensor each: the bandwidth term is the whole tensor's,
    # the latency term is paid per call
    bw = ring_reduce_scatter_time(size_bytes, n, w) + gathers * ring_all_gather_time(size_bytes, n, w)
    return bw + units * (1 + gathers) * (n - 1) * alpha


def estimate(
    lb_rows: pd.DataFrame,
    comm_rows: pd.DataFrame,
    a: Assumptions,
    world_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64),
) -> tuple[pd.DataFrame, dict]:
    """One row per (strategy, N): compute_s (measured rate), ideal_compute_s (datasheet), comm_s,
    step_overlap_s, step_serial_s, tokens_per_s, efficiency (compute / step, overlapped); and the
    inputs used (a dict the notebook quotes)."""
    cfg = get_config(CONFIG)
    tokens = cfg.context_length  # one sequence per GPU
    meas = measured(lb_rows)
    base_flops = step_flops(cfg, 1, tokens)
    w_intra, w_source = intra_node_bandwidth(comm_rows)
    peak = peak_flops(a.device, "bf16")
    inputs = {
        "params": cfg.num_params(),
        "size_bytes": cfg.num_params() * a.comm_bytes_per_param,
        "model_flops": base_flops,
        "w_intra": w_intra,
        "w_intra_source": w_source,
        "peak": peak,
        "units": cfg.num_layers + 2,  # blocks, embedding, LM head + final norm
    }
    one = meas[meas.world_size == 1]
    if len(one) and not math.isnan(one.step_ms.iloc[0]):
        k1 = one.checkpoint_blocks.iloc[0]
        inputs["rate"] = (base_flops + recompute_flops(cfg, k1, tokens)) / (one.step_ms.iloc[0] / 1e3)
        inputs["rate_source"] = (
            f"ours on 1 x {one.gpu.iloc[0]} (git {one.git.iloc[0]}, {one.attention.iloc[0]} attention)"
        )
    else:
        inputs["rate"], inputs["rate_source"] = 0.5 * peak, "half the datasheet peak (no committed 1-GPU row)"

    def blocks_at(n: int) -> float:
        if meas.empty or meas.checkpoint_blocks.isna().all():
            return 0.0
        known = meas.dropna(subset=["checkpoint_blocks"])
        exact = known[known.world_size == n]
        if len(exact):
            return float(exact.checkpoint_blocks.iloc[0])
        return float(known[known.world_size <= n].sort_values("world_size").checkpoint_blocks.iloc[-1])

    rows = []
    for strategy in STRATEGIES:
        for n in world_sizes:
            flops = base_flops + recompute_flops(cfg, blocks_at(n), tokens)
            compute, ideal = flops / inputs["rate"], flops / peak
            comm = comm_seconds(strategy, n, inputs["size_bytes"], a, w_intra, inputs["units"])
            overlap, serial = max(compute, comm), compute + comm
            rows.append(
                {
                    "strategy": strategy,
                    "GPUs": n,
                    "nodes": math.ceil(n / a.gpus_per_node),
                    "recomputed_blocks": blocks_at(n),
                    "compute_s": compute,
                    "ideal_compute_s": ideal,
                    "comm_s": comm,
                    "step_overlap_s": overlap,
                    "step_serial_s": serial,
                    "tokens_per_s": n * tokens / overlap,
                    "efficiency": compute / overlap,
                    "efficiency_serial": compute / serial,
                }
            )
    return pd.DataFrame(rows), inputs


def check(table: pd.DataFrame, lb_rows: pd.DataFrame) -> pd.DataFrame:
    """Estimate / measured for ours (zero2) at every N with a committed row (`measured`'s choice: the
    calibration run at one GPU, our own attention on the same GPU kind at more)."""
    meas = measured(lb_rows).dropna(subset=["step_ms"])
    est = table[table.strategy == "zero2"].set_index("GPUs")
    out = []
    for r in meas.itertuples():
        if r.world_size not in est.index:
            continue
        e = est.loc[r.world_size]
        out.append(
            {
                "GPUs": r.world_size,
                "measured_ms": r.step_ms,
                "estimate_ms": e.step_overlap_s * 1e3,
                "ratio": e.step_overlap_s * 1e3 / r.step_ms,
                "serial_ratio": e.step_serial_s * 1e3 / r.step_ms,
                "ideal_ratio": max(e.ideal_compute_s, e.comm_s) * 1e3 / r.step_ms,
                "comm_estimate_ms": e.comm_s * 1e3,
                "comm_exposed_measured_ms": r.comm_exposed_ms,
                "n": r.n,
                "rep_s": r.rep_s,
                "attention": r.attention,
                "gpu": r.gpu,
                "git": r.git,
            }
        )
    return pd.DataFrame(out)


def facts(table: pd.DataFrame, checked: pd.DataFrame, inputs: dict, a: Assumptions) -> dict:
    """The numbers the notebook quotes: efficiencies at the largest N, break-even inter-node bandwidth."""
    n_max = int(table.GPUs.max())
    at = table[table.GPUs == n_max].set_index("strategy")
    out = {
        "n_max": n_max,
        "nodes_max": int(at.nodes.iloc[0]),
        "size_gb": inputs["size_bytes"] / 1e9,
        "params_b": inputs["params"] / 1e9,
        "rate_tflops": inputs["rate"] / 1e12,
        "w_intra_gb_s": inputs["w_intra"] / 1e9,
        "compute_s": float(at.loc["zero2", "compute_s"]),
    }
    for s in STRATEGIES:
        out[f"{s}_comm_s"] = float(at.loc[s, "comm_s"])
        out[f"{s}_eff"] = float(at.loc[s, "efficiency"])
        out[f"{s}_eff_serial"] = float(at.loc[s, "efficiency_serial"])
        out[f"{s}_tokens_per_s"] = float(at.loc[s, "tokens_per_s"])
    # the inter-node bandwidth at which flat fsdp at n_max would take as long as compute (bandwidth term)
    fsdp_bytes = 3 * (n_max - 1) / n_max * inputs["size_bytes"]
    out["fsdp_breakeven_gb_s"] = fsdp_bytes / out["compute_s"] / 1e9
    one_node = table[(table.strategy == "zero2") & (table.GPUs == a.gpus_per_node)]
    out["zero2_eff_one_node"] = float(one_node.efficiency.iloc[0]) if len(one_node) else math.nan
    out["checks"] = checked.to_dict("records")
    # two multi-GPU checks of one commit, attention and GPU kind: how the step changes between them,
    # measured and estimated (free of the one-GPU calibration's commit and attention)
    multi = checked[checked.GPUs > 1] if len(checked) else checked
    if len(multi) >= 2:
        lo, hi = multi.iloc[0], multi.iloc[-1]
        if (lo.git, lo.attention, lo.gpu) == (hi.git, hi.attention, hi.gpu):
            out["multi"] = {
                "lo": int(lo.GPUs),
                "hi": int(hi.GPUs),
                "git": lo.git,
                "attention": lo.attention,
                "measured_change": hi.measured_ms / lo.measured_ms - 1,
                "estimate_change": hi.estimate_ms / lo.estimate_ms - 1,
            }
    return out


def plot_scaling(table: pd.DataFrame, checked: pd.DataFrame, a: Assumptions):
    """Step time (left) and communication time against compute (right) per strategy over N GPUs."""
    fig, (ax_step, ax_comm) = plt.subplots(1, 2, figsize=(10, 3.1))
    colors = dict(zip(STRATEGIES, ("tab:blue", "tab:orange", "tab:green"), strict=True))
    for s in STRATEGIES:
        t = table[table.strategy == s]
        ax_step.plot(t.GPUs, t.step_overlap_s, marker="o", color=colors[s], label=f"{s}, overlapped")
        ax_step.plot(t.GPUs, t.step_serial_s, ls="--", color=colors[s], label=f"{s}, serialised")
        t = t[t.comm_s > 0]  # one GPU does not communicate (off the log scale)
        ax_comm.plot(t.GPUs, t.comm_s * 1e3, marker="o", color=colors[s], label=s)
    t = table[table.strategy == "zero2"]
    ax_comm.plot(t.GPUs, t.compute_s * 1e3, color="black", lw=1.5, label="compute (measured rate)")
    if len(checked):
        ax_step.scatter(
            checked.GPUs, checked.measured_ms / 1e3, color="black", zorder=5, label="measured (ours)"
        )
    for ax in (ax_step, ax_comm):
        ax.set_xscale("log", base=2)
        ax.axvline(a.gpus_per_node, color="grey", lw=0.8, ls=":")
        ax.set_xlabel("GPUs (one 32768-token sequence each)")
    ax_step.set(ylabel="step time (s)", title="8B step: estimate per GPU count")
    ax_comm.set(ylabel="ms per step", yscale="log", title="communication vs compute per GPU")
    ax_step.set_ylim(bottom=0)
    ax_step.legend(fontsize=7, ncol=2)
    ax_comm.legend(fontsize=7)
    fig.tight_layout()
    return fig
