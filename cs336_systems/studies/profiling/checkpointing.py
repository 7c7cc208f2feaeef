"""Activation checkpointing study (2026 handout, gradient_checkpointing (a) and (b)).

(a) Cost model: `cost_table` instantiates the [Note: cost model] of `cs336_systems.model.checkpointing`
with sizes computed from the real model: c = one block input (B*T*d_model*4 bytes) and r = the bytes
one TransformerBlock saves for backward, counted with saved-tensor hooks on the "meta" device (no
memory needed), for no checkpointing, one level with every group size, sub-block, and recursive
bisection.

(b) Measurement: `run_strategy` trains the 2026 "xl" model (d_model 2560, 32 layers, 32 heads;
batch 4, context 2048, fp32, AdamW; naive attention) with one strategy: `warmup` untimed steps (the
optimizer state exists afterwards), then `steps` timed steps (forward, backward, optimizer phases
synchronised, as the end-to-end benchmark does) with the peak allocated memory of those steps. No
checkpointing is expected to OOM; that is recorded as a failure row. Rows go to
`figures/data/gradient_checkpointing.csv` with impl = strategy and x = blocks per checkpoint
(0.5 for sub-block regions, 0 for none). `measure(CheckpointingConfig(...))` runs the strategies;

    python -m cs336_systems.studies.profiling.checkpointing --size xl_2026 --context-length 2048

Caveat: the handout's worked example compiles the block and uses 16 heads; this study runs the
eager model of Table 1 (32 heads), whose naive attention saves more per block (see `cost_table`).
"""

from __future__ import annotations

import dataclasses
import gc
import timeit
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd
import torch
from tqdm.auto import tqdm

from cs336_systems.measure import cli
from cs336_systems.measure.budget import TimeBudget, skipped_row
from cs336_systems.measure.results import append_rows, capture_failure, failure_row, make_row
from cs336_systems.measure.timing import PhaseTimer, synchronize
from cs336_systems.model import get_config
from cs336_systems.model.checkpointing import (
    _attention_half,
    _mlp_half,
    activation_peak_model,
    make_block_runner,
    optimal_group_size,
    saved_tensors,
)
from cs336_systems.studies.profiling.end_to_end import PHASES, EndToEndConfig, build_workload, row_fields
from cs336_systems.studies.profiling.memory_block import block_saved_memory, make_block, residual_stream_bytes

PROBLEM = "gradient_checkpointing"
SIZE = "xl_2026"
BATCH_SIZE = 4
CONTEXT_LENGTH = 2048
# Run order: the expected optimum and its neighbours first, the OOM baseline, then the rest.
STRATEGIES: tuple[tuple[str, int | None], ...] = (
    ("block", 1),
    ("block", 2),
    ("none", None),
    ("sub_block", None),
    ("block", 4),
    ("recursive", None),
    ("block", 8),
)
GIB = 2**30
STATE_BYTES_PER_PARAM = 16  # fp32 parameter + gradient + AdamW m and v


def strategy_x(strategy: str, group: int | None) -> float:
    """Blocks per checkpoint region: 0 none, 0.5 sub-block, k for one level, leaf size for recursive."""
    return {"none": 0.0, "sub_block": 0.5}.get(strategy, float(group or 1))


def sizes_for_model(
    size: str = SIZE, batch_size: int = BATCH_SIZE, context_length: int = CONTEXT_LENGTH
) -> dict[str, float]:
    """c, r, r_attn, r_mlp (bytes) of one block of `size`, counted on the meta device."""
    c = residual_stream_bytes(size, batch_size, context_length)
    r = block_saved_memory(size, batch_size, context_length, device="meta")["saved"]["activation"]
    block = make_block(size, context_length, "meta")
    x = torch.randn(batch_size, context_length, block.ln1.weight.shape[0], device="meta", requires_grad=True)
    _, attn = saved_tensors(_attention_half, block, x, module=block)
    _, mlp = saved_tensors(_mlp_half, block, x, module=block)
    return {"c": c, "r": r, "r_attn": attn.activation_bytes, "r_mlp": mlp.activation_bytes}


def cost_table(
    size: str = SIZE,
    batch_size: int = BATCH_SIZE,
    context_length: int = CONTEXT_LENGTH,
    max_group: int | None = None,
) -> pd.DataFrame:
    """Predicted peak activation memory (GiB) and forward passes per block for every strategy.

    Columns: strategy, group_size (x as in `strategy_x`), peak_activation_GiB, forward_passes,
    predicted_total_GiB (activations + 16 bytes/parameter of fp32 AdamW training state).
    """
    cfg = get_config(size, context_length=context_length)
    s = sizes_for_model(size, batch_size, context_length)
    n = cfg.num_layers
    state = STATE_BYTES_PER_PARAM * cfg.num_params()
    rows = [("none", None), ("sub_block", None), ("recursive", None)]
    rows += [("block", k) for k in range(1, (max_group or n) + 1)]
    out = []
    for strategy, k in rows:
        pred = activation_peak_model(
            strategy, n, s["c"], s["r"], k, sub_block_residual_bytes=max(s["r_attn"], s["r_mlp"])
        )
        out.append(
            {
                "strategy": strategy,
                "group_size": strategy_x(strategy, k),
                "peak_activation_GiB": pred["peak_bytes"] / GIB,
                "forward_passes": pred["forward_passes"],
                "predicted_total_GiB": (pred["peak_bytes"] + state) / GIB,
            }
        )
    df = pd.DataFrame(out)
    df.attrs.update(s, num_blocks=n, state_bytes=state, optimal_group=optimal_group_size(n, s["c"], s["r"]))
    return df


def study_config(
    strategy: str,
    group: int | None,
    *,
    size: str = SIZE,
    batch_size: int = BATCH_SIZE,
    context_length: int = CONTEXT_LENGTH,
    warmup: int = 1,
    steps: int = 1,
    device: str | None = None,
) -> EndToEndConfig:
    make_block_runner(strategy, group)  # validates
    return EndToEndConfig(
        size=size,
        context_length=context_length,
        batch_size=batch_size,
        mode="train",
        warmup=warmup,
        steps=steps,
        checkpoint_group=group if strategy == "block" else None,
        device=device or EndToEndConfig().device,
    )


def strategy_row_fields(strategy: str, group: int | None, cfg: EndToEndConfig) -> dict[str, Any]:
    """Row keywords of one strategy: the strategy is the impl, its group size the x axis."""
    return row_fields(
        cfg, PROBLEM, impl=strategy, mode="train", x_name="group_size", x_value=strategy_x(strategy, group)
    )


def run_strategy(strategy: str, group: int | None, cfg: EndToEndConfig) -> list[dict[str, Any]]:
    """Train `cfg` with one checkpointing strategy; rows of phase times, step time, peak memory."""
    common = strategy_row_fields(strategy, group, cfg)
    common["config"] |= {"strategy": strategy, "group_size": group}
    cuda = torch.device(cfg.device).type == "cuda" and torch.cuda.is_available()
    outcome: dict[str, str] = {}
    timer = PhaseTimer(device=cfg.device, enabled=False)
    peak = resident = None
    work = None
    with capture_failure(outcome):
        work = build_workload(cfg)
        if strategy in ("sub_block", "recursive"):
            work.model.set_block_runner(make_block_runner(strategy, group))
        for _ in range(cfg.warmup):
            work.step(timer)
        synchronize(cfg.device)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
            resident = torch.cuda.memory_allocated() / GIB
        timer.enabled = True
        for _ in range(cfg.steps):
            work.step(timer)
        if cuda:
            peak = torch.cuda.max_memory_allocated() / GIB
    work = None  # also on failure: release the model (and optimizer state) before the next run
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    metrics = [*(f"{p}_time" for p in PHASES["train"]), "step_time"]
    if outcome:
        rows = [failure_row(metric=m, unit="ms", note=outcome["note"], **common) for m in metrics]
        return [*rows, failure_row(metric="peak_memory", unit="GiB", note=outcome["note"], **common)]
    ms = {k: [x * 1e3 for x in v] for k, v in timer.samples.items()}
    rows = [make_row(metric=f"{p}_time", unit="ms", samples=ms[p], **common) for p in PHASES["train"]]
    rows.append(
        make_row(metric="step_time", unit="ms", samples=[sum(s) for s in zip(*ms.values())], **common)
    )
    if peak is not None:
        rows.append(make_row(metric="peak_memory", unit="GiB", value=peak, **common))
        rows.append(make_row(metric="resident_memory", unit="GiB", value=resident, **common))
    return rows


@dataclass(frozen=True, kw_only=True)
class CheckpointingConfig:
    """The strategies to run, in order, and the keywords of `study_config` they share."""

    strategies: tuple[tuple[str, int | None], ...] = STRATEGIES
    size: str = SIZE
    batch_size: int = BATCH_SIZE
    context_length: int = CONTEXT_LENGTH
    warmup: int = 1
    steps: int = 1
    device: str | None = None


def measure(
    config: CheckpointingConfig | None = None,
    *,
    results_dir: str | None = None,
    budget: TimeBudget | None = None,
    step_estimate_s: float = 8.0,
    save: bool = True,
    progress: bool = True,
) -> list[dict[str, Any]]:
    """Run the strategies in order under an optional time budget (skipped ones get "skipped:" rows).

    step_estimate_s: assumed seconds per training step until the first strategy has been measured.
    """
    cfg_all = config or CheckpointingConfig()
    strategies = cfg_all.strategies
    config = {f.name: getattr(cfg_all, f.name) for f in dataclasses.fields(cfg_all) if f.name != "strategies"}
    all_rows = []
    per_step = step_estimate_s
    for strategy, group in tqdm(strategies, desc=PROBLEM, disable=not progress):
        cfg = study_config(strategy, group, **config)
        # recomputation adds forwards: the recursive scheme runs about log2(N) + 1 of them
        factor = 1.0 + (0.6 if strategy == "recursive" else 0.0)
        estimate = (cfg.warmup + cfg.steps) * per_step * factor + 5.0
        if strategy == "none":  # expected to OOM within the first forward
            estimate = min(estimate, 10.0)
        if budget is not None and not budget.can_afford(estimate):
            common = strategy_row_fields(strategy, group, cfg)
            why = budget.skip_note(f"~{estimate:.0f} s needed")
            rows = [
                skipped_row(metric=m, unit=u, reason=why, **common)
                for m, u in (("step_time", "ms"), ("peak_memory", "GiB"))
            ]
        else:
            start = timeit.default_timer()
            rows = run_strategy(strategy, group, cfg)
            measured = any(r["metric"] == "step_time" and r["n"] for r in rows)
            if measured and strategy == "block":  # calibrate (model build included: conservative)
                per_step = (timeit.default_timer() - start) / (cfg.warmup + cfg.steps)
        if save:
            append_rows(PROBLEM, rows, results_dir)
        all_rows.extend(rows)
    return all_rows


STRATEGY_LABELS = {
    "none": "no checkpointing",
    "block": "one level, k blocks",
    "sub_block": "one level, half blocks",
    "recursive": "recursive bisection",
}


def measured_table(df: pd.DataFrame) -> pd.DataFrame:
    """Strategy x {peak memory GiB, step ms}: means, or the failure / skip note (latest rows)."""
    from cs336_systems.measure.results import latest_run

    t = latest_run(
        df[df.metric.isin(["peak_memory", "step_time"])], keys=("name", "impl", "x_value", "metric")
    )
    if t.empty:
        return pd.DataFrame()
    value = t.apply(
        lambda r: (
            r["note"]
            if r["note"] and not r["n"]
            else (f"{r['mean']:.1f}" if r["unit"] == "GiB" else f"{r['mean']:,.0f}")
        ),
        axis=1,
    )
    t = t.assign(
        value=value, metric=t["metric"].map({"peak_memory": "peak memory (GiB)", "step_time": "step (ms)"})
    )
    out = t.pivot_table(
        index=["impl", "x_value"], columns="metric", values="value", aggfunc="last"
    ).reset_index()
    out = out.rename(columns={"impl": "strategy", "x_value": "blocks per checkpoint"})
    return out.sort_values(["strategy", "blocks per checkpoint"]).reset_index(drop=True)


def plot_cost_model(cost: pd.DataFrame, measured: pd.DataFrame | None = None):
    """Predicted peak (activations + training state) against k for one level, the other strategies as
    horizontal lines, and the measured peaks as markers. Returns the Figure."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.4))
    one = cost[cost.strategy == "block"]
    ax.plot(one.group_size, one.predicted_total_GiB, "-", color="#4e79a7", label="model: one level, k blocks")
    for strategy, color in (("sub_block", "#f28e2b"), ("recursive", "#59a14f")):
        row = cost[cost.strategy == strategy]
        if len(row):
            ax.axhline(
                row.predicted_total_GiB.iloc[0],
                color=color,
                ls="--",
                lw=1,
                label=f"model: {STRATEGY_LABELS[strategy]}",
            )
    if measured is not None and len(measured):
        ok = measured[(measured.metric == "peak_memory") & (measured.note == "")]
        for strategy, marker in (("block", "o"), ("sub_block", "s"), ("recursive", "^")):
            m = ok[ok.impl == strategy]
            if len(m):
                x = m.x_value if strategy == "block" else [1] * len(m)
                ax.plot(
                    x,
                    m["mean"],
                    marker,
                    color="black",
                    ms=6,
                    mfc="none" if strategy != "block" else "black",
                    label=f"measured: {STRATEGY_LABELS[strategy]}",
                )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("blocks per checkpoint k")
    ax.set_ylabel("peak memory (GiB)")
    ax.legend(fontsize=7, loc="upper left")
    return fig


def facts(df: pd.DataFrame, cost: pd.DataFrame) -> dict[str, Any]:
    """The numbers the gradient_checkpointing answers state. `cost` is `cost_table(...)` (the model:
    `"model"`); `df` the measured rows of one size (`"measured"`, absent without block rows)."""
    a = cost.attrs
    rec = cost[cost.strategy == "recursive"].iloc[0]
    one = cost[(cost.strategy == "block") & (cost.group_size == a["optimal_group"])].iloc[0]
    out: dict[str, Any] = {
        "model": {
            "num_blocks": a["num_blocks"],
            "c_MiB": a["c"] / 2**20,
            "r_MiB": a["r"] / 2**20,
            "r_GiB": a["r"] / 2**30,
            "optimal_group": a["optimal_group"],
            "k_star": (a["num_blocks"] * a["c"] / a["r"]) ** 0.5,
            "recursive_forward_passes": rec.forward_passes,
            "recursive_GiB": rec.peak_activation_GiB,
            "one_level_GiB": one.peak_activation_GiB,
            "sub_block_GiB": cost[cost.strategy == "sub_block"].peak_activation_GiB.iloc[0],
            "none_GiB": cost[cost.strategy == "none"].peak_activation_GiB.iloc[0],
        }
    }
    ok = df[(df.metric == "peak_memory") & (df.note == "")]
    block = ok[ok.impl == "block"].set_index("x_value")["mean"]
    if len(block):
        best = block.idxmin()
        bigger = block[block.index > best]
        sub = ok[ok.impl == "sub_block"]["mean"]
        rec_peak = ok[ok.impl == "recursive"]["mean"]
        none_note = df[(df.impl == "none") & (df.metric == "peak_memory")].note
        steps = df[(df.metric == "step_time") & (df.note == "")].set_index(["impl", "x_value"])["mean"]
        sub_peak = sub.iloc[0] if len(sub) else None
        out["measured"] = {
            "best_k": best,
            "best_GiB": block[best],
            "next_k": bigger.index[0] if len(bigger) else None,
            "next_GiB": bigger.iloc[0] if len(bigger) else None,
            "sub_block_GiB": sub_peak,
            "recursive_GiB": rec_peak.iloc[0] if len(rec_peak) else None,
            # the halves reach the same floor as the best block grouping (within 5%)
            "sub_block_at_floor": sub_peak is not None
            and abs(sub_peak - block[best]) < 0.05 * block[best]
            and len(rec_peak) > 0,
            "sub_block_minus_best_MiB": abs(sub_peak - block[best]) * 1024 if sub_peak is not None else None,
            "none_note": none_note.iloc[0] if len(none_note) and none_note.iloc[0] else None,
            "step_best_ms": steps.get(("block", best)),
            "step_recursive_ms": steps.get(("recursive", 1.0)),
        }
    return out


def main(argv: Sequence[str] | None = None) -> pd.DataFrame:
    p = cli.make_parser(
        __doc__, "python -m cs336_systems.studies.profiling.checkpointing --size debug --context-length 32"
    )
    d = CheckpointingConfig()
    cli.add_size(p, d.size)
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--context-length", type=int, default=d.context_length)
    p.add_argument("--warmup", type=int, default=d.warmup, help="untimed training steps per strategy")
    p.add_argument("--steps", type=int, default=d.steps, help="timed training steps per strategy")
    p.add_argument("--device", default=None, help="default: cuda when visible, else cpu")
    cli.add_results_dir(p)
    args = p.parse_args(argv)
    with cli.usage_errors(p):
        cfg = CheckpointingConfig(
            size=args.size,
            batch_size=args.batch_size,
            context_length=args.context_length,
            warmup=args.warmup,
            steps=args.steps,
            device=args.device,
        )
    print(cfg)
    df = pd.DataFrame(measure(cfg, results_dir=cli.results_dir_for(args.results_dir)))
    print(measured_table(df).to_string())
    return df


if __name__ == "__main__":
    main()
