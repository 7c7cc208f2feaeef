"""Memory and time of optimizer-state sharding on 2 GPUs (2025 optimizer_state_sharding_accounting).

Every variant trains the Basics Transformer LM ("xl" = 2025 XL, 2.0B parameters, by default) in fp32
with the project's AdamW on random tokens, data parallel over the ranks: 4 sequences of 512 tokens
per rank (global batch 8), the setting of the project's DDP benchmarks. Gradients are averaged by
a bucketed flat all-reduce after backward (the same code for every variant, so only the optimizer
differs). Variants:

    unsharded   AdamW over all parameters on every rank (plain data parallelism)
    sharded     ShardedOptimizer(AdamW): state for ~1/N of the parameters, updated params broadcast
    torch_zero  torch.distributed.optim.ZeroRedundancyOptimizer(AdamW), PyTorch's own version

[Note: what is measured, and where]
Per rank, from torch.cuda's allocator (memory_allocated / max_memory_allocated, GiB):
  after_init          model built on the GPU and the optimizer constructed (AdamW state is lazy);
  <it>:before_step    after forward, backward and the gradient all-reduce, right before step();
  <it>:after_step     right after step() (before zero_grad);
for <it> = "first" (iteration 1: no optimizer state yet before its step) and "steady" (the last
iteration). At each point `allocated` is split into parameters, gradients and optimizer state (sums
of the tensors' storages) and `other` (the rest: inputs, communication buffers, allocator slack);
`peak` is the maximum allocated since the previous point (so before_step's peak holds the
activations, reported as `activations_peak` = peak - allocated at the start of the iteration).
Next to each measured component is the analytic expectation (`expected_*`): 4 bytes per parameter for
weights and for gradients, and AdamW's m and v (8 bytes per parameter) for the parameters this
rank's optimizer actually owns (its partition, which for whole-tensor partitions is not exactly 1/N).
Time per iteration: warmup iterations, then timed ones, each phase (forward+backward, gradient
all-reduce, optimizer step) bracketed by device synchronisation; an iteration counts at its slowest rank.

Entry points: under torchrun the module is a worker that runs the variants in order; without it, it
is the driver, which launches the workers with `run_torchrun`, records a failure row for a variant
that crashes (e.g. out of memory) and relaunches the rest, then renders the figures:

    python -m cs336_systems.studies.distributed.sharding_bench --figures-dir figures            # 2 GPUs
    python -m cs336_systems.studies.distributed.sharding_bench --quick                          # CPU, gloo, debug
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import pandas as pd
import torch
import torch.distributed as dist
from torch import Tensor
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from cs336_systems import accounting
from cs336_systems.distributed.launch import run_variants
from cs336_systems.distributed.process_group import cleanup_process_group, setup_process_group
from cs336_systems.distributed.sharded_optimizer import ShardedOptimizer
from cs336_systems.measure import cli
from cs336_systems.measure.annotations import annotate
from cs336_systems.measure.results import (
    append_rows,
    capture_failure,
    child_env,
    failure_row,
    load_results,
    make_row,
)
from cs336_systems.measure.timing import PhaseTimer, synchronize
from cs336_systems.model import AdamW, BasicsTransformerLM, cross_entropy, get_config, random_batch

PROBLEM = "optimizer_state_sharding_accounting"
MODULE = "cs336_systems.studies.distributed.sharding_bench"
VARIANTS = ("unsharded", "sharded", "torch_zero")
IMPL = {"unsharded": "unsharded", "sharded": "sharded_optimizer", "torch_zero": "zero_redundancy_optimizer"}
POINTS = ("after_init", "first:before_step", "first:after_step", "steady:before_step", "steady:after_step")
COMPONENTS = ("params", "grads", "optimizer_state", "other")
GiB = 2**30
ADAMW_KWARGS = dict(lr=1e-4, weight_decay=0.01)
ADAM_STATE_BYTES_PER_PARAM = 8  # m and v in fp32


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """One run of the benchmark (all variants share it)."""

    size: str = "xl"
    context_length: int = 512
    batch_per_rank: int = 4
    warmup: int = 2
    steps: int = 5
    attention: str = "naive"
    variants: tuple[str, ...] = VARIANTS
    bucket_mb: float = 128.0  # gradient all-reduce bucket (and ShardedOptimizer broadcast bucket)
    backend: str = "nccl"
    run_id: str = ""

    def __post_init__(self) -> None:
        get_config(self.size)
        unknown = set(self.variants) - set(VARIANTS)
        if unknown:
            raise ValueError(f"unknown variants {sorted(unknown)}; known: {VARIANTS}")
        if self.warmup < 0 or self.steps < 1 or self.batch_per_rank < 1:
            raise ValueError("need warmup >= 0, steps >= 1, batch_per_rank >= 1")


# --------------------------------------------------------------------------------------------------
# Measurement helpers (also used by fsdp_bench)
# --------------------------------------------------------------------------------------------------


def storage_bytes(tensors: Iterable[Tensor | None]) -> int:
    """Bytes of the distinct storages behind `tensors` (views and tied tensors count once)."""
    seen: set[tuple[str, int]] = set()
    total = 0
    for t in tensors:
        if t is None:
            continue
        storage = t.untyped_storage()
        key = (str(t.device), storage.data_ptr())
        if key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[Tensor]:
    """Every tensor in the optimizer's (local) state; ZeroRedundancyOptimizer keeps it in `.optim`."""
    opt = getattr(optimizer, "optim", optimizer)
    return [v for st in opt.state.values() for v in st.values() if isinstance(v, Tensor) and v.numel() > 1]


def allocated(device: torch.device) -> float:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else math.nan


def peak_allocated(device: torch.device) -> float:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else math.nan


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def release_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


@torch.no_grad()
def all_reduce_gradients(params: Sequence[Tensor], bucket_bytes: int) -> None:
    """Average gradients over the ranks: flat SUM all-reduces of <= bucket_bytes, then / world size.

    Reverse parameter order, as gradients become ready in backward. Only the bucket is extra memory.
    """
    world_size = dist.get_world_size()
    bucket: list[Tensor] = []
    size = 0

    def flush() -> None:
        with torch.profiler.record_function("bench::grad_all_reduce"):
            flat = _flatten_dense_tensors(bucket)
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            flat.div_(world_size)
            for g, new in zip(bucket, _unflatten_dense_tensors(flat, bucket), strict=True):
                g.copy_(new)

    for p in reversed(params):
        if p.grad is None:
            continue
        nbytes = p.grad.numel() * p.grad.element_size()
        if bucket and size + nbytes > bucket_bytes:
            flush()
            bucket, size = [], 0
        bucket.append(p.grad)
        size += nbytes
    if bucket:
        flush()


def gather_to_rank0(obj: Any) -> list[Any] | None:
    objs: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(objs, obj)
    return objs if dist.get_rank() == 0 else None


# --------------------------------------------------------------------------------------------------
# Worker
# --------------------------------------------------------------------------------------------------


def _make_optimizer(variant: str, params: list[Tensor], bucket_mb: float) -> torch.optim.Optimizer:
    if variant == "unsharded":
        return AdamW(params, **ADAMW_KWARGS)
    if variant == "sharded":
        return ShardedOptimizer(params, AdamW, bucket_size_mb=bucket_mb, **ADAMW_KWARGS)
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return ZeroRedundancyOptimizer(params, optimizer_class=AdamW, **ADAMW_KWARGS)


def _local_param_count(variant: str, optimizer: torch.optim.Optimizer, total: int) -> int:
    """Parameters whose optimizer state lives on this rank."""
    if variant == "unsharded":
        return total
    opt = getattr(optimizer, "optim", None) or optimizer.inner  # ZeRO's local optimizer / ours
    return sum(p.numel() for g in opt.param_groups for p in g["params"])


def _point_rows(
    cfg: BenchConfig, variant: str, point: str, rank: int, snap: dict[str, float], expected: dict[str, float]
) -> list[dict[str, Any]]:
    common = dict(problem=PROBLEM, name=cfg.size, impl=IMPL[variant], mode=point, dtype="fp32",
                  x_name="rank", x_value=rank, config=asdict(cfg))  # fmt: skip
    rows = [
        make_row(metric=k, unit="GiB", value=v / GiB, **common) for k, v in snap.items() if not math.isnan(v)
    ]
    rows += [
        make_row(metric=f"expected_{k}", unit="GiB", value=v / GiB, **common) for k, v in expected.items()
    ]
    return rows


def _snapshot(device, params, optimizer, *, peak_since: float | None = None) -> dict[str, float]:
    snap = {
        "params": float(storage_bytes(params)),
        "grads": float(storage_bytes(p.grad for p in params)),
        "optimizer_state": float(storage_bytes(optimizer_state_tensors(optimizer))),
        "allocated": allocated(device),
        "peak": peak_allocated(device),
    }
    snap["other"] = snap["allocated"] - snap["params"] - snap["grads"] - snap["optimizer_state"]
    if peak_since is not None:
        snap["activations_peak"] = snap["peak"] - peak_since
    return snap


def run_variant(cfg: BenchConfig, variant: str, device: torch.device) -> list[dict[str, Any]]:
    """Measure one variant on every rank; returns all ranks' rows on rank 0 (empty elsewhere)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    mcfg = get_config(cfg.size, context_length=cfg.context_length)
    release_memory(device)
    torch.manual_seed(0)
    model = BasicsTransformerLM.from_config(mcfg, attention_impl=cfg.attention, device=device)
    params = list(model.parameters())
    optimizer = _make_optimizer(variant, params, cfg.bucket_mb)
    synchronize(device)
    num_params = sum(p.numel() for p in params)
    local = _local_param_count(variant, optimizer, num_params)
    gen = torch.Generator().manual_seed(1000 + rank)
    inputs, targets = random_batch(cfg.batch_per_rank, cfg.context_length, mcfg.vocab_size, device, gen)

    def expected(point: str) -> dict[str, float]:
        has_grads = point != "after_init"
        has_state = point in ("first:after_step", "steady:before_step", "steady:after_step")
        return {
            "params": 4.0 * num_params,
            "grads": 4.0 * num_params * has_grads,
            "optimizer_state": float(ADAM_STATE_BYTES_PER_PARAM * local * has_state),
        }

    rows = _point_rows(
        cfg, variant, "after_init", rank, _snapshot(device, params, optimizer), expected("after_init")
    )
    timer = PhaseTimer(device=device)
    iterations = cfg.warmup + cfg.steps
    for it in range(iterations):
        tag = "first" if it == 0 else "steady" if it == iterations - 1 else None
        timer.enabled = it >= cfg.warmup
        reset_peak(device)
        start_alloc = allocated(device)
        with timer.phase("forward_backward"), annotate("forward_backward"):
            loss = cross_entropy(model(inputs), targets)
            loss.backward()
            del loss
        with timer.phase("grad_sync"), annotate("grad_sync"):
            all_reduce_gradients(params, int(cfg.bucket_mb * 2**20))
        synchronize(device)
        if tag:
            snap = _snapshot(device, params, optimizer, peak_since=start_alloc)
            rows += _point_rows(
                cfg, variant, f"{tag}:before_step", rank, snap, expected(f"{tag}:before_step")
            )
        reset_peak(device)
        with timer.phase("optimizer"), annotate("optimizer_step"):
            optimizer.step()
        synchronize(device)
        if tag:
            snap = _snapshot(device, params, optimizer)
            rows += _point_rows(cfg, variant, f"{tag}:after_step", rank, snap, expected(f"{tag}:after_step"))
        optimizer.zero_grad(set_to_none=True)

    partition = dict(local_params=local, num_params=num_params, rank=rank)
    gathered = gather_to_rank0((rows, {k: v for k, v in timer.samples.items()}, partition))
    del model, optimizer, params, inputs, targets
    release_memory(device)
    if gathered is None:
        return []
    out = [row for rows_r, _, _ in gathered for row in rows_r]
    common = dict(problem=PROBLEM, name=cfg.size, impl=IMPL[variant], mode="train", dtype="fp32",
                  x_name="world_size", x_value=world_size)  # fmt: skip
    config = asdict(cfg) | {"partition": [p for _, _, p in gathered]}
    phases = {
        k: [max(s[k][i] for _, s, _ in gathered) * 1e3 for i in range(cfg.steps)] for k in gathered[0][1]
    }
    for phase, samples in phases.items():
        out.append(make_row(metric=f"{phase}_time", unit="ms", samples=samples, config=config, **common))
    step = [sum(parts) for parts in zip(*phases.values(), strict=True)]
    out.append(make_row(metric="step_time", unit="ms", samples=step, config=config, **common))
    return out


def worker(cfg: BenchConfig) -> None:
    device = setup_process_group(cfg.backend)
    try:
        for variant in cfg.variants:
            outcome: dict[str, str] = {}
            rows: list[dict[str, Any]] = []
            with capture_failure(outcome):
                rows = run_variant(cfg, variant, device)
            if outcome:
                rows = [failure_row(problem=PROBLEM, name=cfg.size, impl=IMPL[variant], mode="train", dtype="fp32",
                                    x_name="world_size", x_value=dist.get_world_size(), metric="step_time",
                                    unit="ms", note=outcome["note"], config=asdict(cfg))]  # fmt: skip
            if dist.get_rank() == 0:
                append_rows(PROBLEM, rows)
                print(f"[sharding_bench] {variant}: {len(rows)} rows {outcome.get('note', '')}", flush=True)
    finally:
        cleanup_process_group()


# --------------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------------


def run(
    cfg: BenchConfig,
    *,
    nproc: int = 2,
    results_dir: str | os.PathLike | None = None,
    figures_dir: str | os.PathLike | None = None,
    timeout_s: float = 240.0,
) -> pd.DataFrame:
    """Launch the workers (relaunching after a crashed variant), then render figures; returns the rows."""
    cfg = BenchConfig(**{**asdict(cfg), "run_id": cfg.run_id or uuid.uuid4().hex[:8]})

    def record_failure(variant: str, note: str) -> None:
        append_rows(PROBLEM, [failure_row(problem=PROBLEM, name=cfg.size, impl=IMPL[variant], mode="train",
                                          dtype="fp32", x_name="world_size", x_value=nproc, metric="step_time",
                                          unit="ms", note=note, config=asdict(cfg))], results_dir)  # fmt: skip

    run_variants(
        MODULE, cfg.variants,
        lambda rest: ["--worker", json.dumps(asdict(BenchConfig(**{**asdict(cfg), "variants": tuple(rest)})))],
        finished=lambda: _done_variants(cfg.run_id, results_dir), on_failure=record_failure,
        nproc=nproc, timeout_s=timeout_s, env=child_env(results_dir),
    )  # fmt: skip
    df = load_results(PROBLEM, results_dir)
    df = df[df.config_json.str.contains(cfg.run_id)] if not df.empty else df
    if figures_dir is not None and not df.empty:
        from cs336_systems.report.figures import save_figure
        from cs336_systems.report.style import apply_style

        apply_style()
        save_figure(plot_memory_breakdown(df), f"{PROBLEM}__memory", directory=figures_dir)
        save_figure(plot_step_time(df), f"{PROBLEM}__step_time", directory=figures_dir)
    return df


def _done_variants(run_id: str, results_dir) -> set[str]:
    df = load_results(PROBLEM, results_dir)
    if df.empty:
        return set()
    df = df[df.config_json.str.contains(run_id) & (df.metric == "step_time")]
    back = {v: k for k, v in IMPL.items()}
    return {back[i] for i in df.impl.unique() if i in back}


QUICK = dict(size="debug", context_length=64, batch_per_rank=2, warmup=1, steps=2, backend="gloo")


def main(argv: Sequence[str] | None = None) -> pd.DataFrame | None:
    p = cli.make_parser(__doc__, "python -m cs336_systems.studies.distributed.sharding_bench --quick")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # JSON config, set by the driver
    cli.add_size(p, "xl")
    p.add_argument("--context-length", type=int, default=512)
    p.add_argument("--batch-per-rank", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    cli.add_attention(p, "naive")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument(
        "--backend", default="nccl" if torch.cuda.is_available() else "gloo", choices=["nccl", "gloo"]
    )
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="CPU smoke run: gloo, debug model, 2 steps")
    cli.add_results_dir(p)
    p.add_argument("--figures-dir", default=None, help="render the figures here after measuring")
    p.add_argument("--timeout", type=float, default=240.0, help="seconds per torchrun launch")
    args = p.parse_args(argv)
    if args.worker is not None:
        worker(
            BenchConfig(**{**json.loads(args.worker), "variants": tuple(json.loads(args.worker)["variants"])})
        )
        return None
    fields = dict(size=args.size, context_length=args.context_length, batch_per_rank=args.batch_per_rank,
                  warmup=args.warmup, steps=args.steps, attention=args.attention, variants=tuple(args.variants),
                  backend=args.backend)  # fmt: skip
    if args.quick:
        fields.update(QUICK)
    with cli.usage_errors(p):
        cfg = BenchConfig(**fields)
        cli.check_launch(cfg.backend, args.nproc, args.timeout)
    results_dir = str(cli.results_dir_for(args.results_dir, quick=args.quick))
    print("resolved config:", json.dumps(asdict(cfg)), flush=True)
    df = run(
        cfg,
        nproc=args.nproc,
        results_dir=results_dir,
        figures_dir=args.figures_dir,
        timeout_s=args.timeout,
    )
    with pd.option_context("display.width", 200, "display.max_columns", 20, "display.max_rows", 200):
        print(memory_table(df).to_string())
        print(time_table(df).to_string())
    return df


# --------------------------------------------------------------------------------------------------
# Tables, figures and the analytic ZeRO-1 comparison (notebook helpers)
# --------------------------------------------------------------------------------------------------


def latest(df: pd.DataFrame) -> pd.DataFrame:
    """Rows of the most recent run (by run_id in the config)."""
    if df.empty:
        return df
    ok = df.copy()
    ok["run_id"] = ok.config_json.map(lambda s: json.loads(s).get("run_id", ""))
    last = ok.sort_values("timestamp").run_id.iloc[-1]
    return ok[ok.run_id == last].drop(columns="run_id")


def value(
    df: pd.DataFrame, impl: str, metric: str, mode: str | None = None, x_value: float | None = None
) -> float:
    """The mean of the (latest) matching successful row, NaN when there is none (notebook answers)."""
    m = df[(df.impl == impl) & (df.metric == metric) & (df.note == "")]
    if mode is not None:
        m = m[m["mode"] == mode]
    if x_value is not None:
        m = m[m.x_value.astype(float) == float(x_value)]
    return float(m.sort_values("timestamp")["mean"].iloc[-1]) if len(m) else math.nan


def memory_table(df: pd.DataFrame, rank: int | None = 0, digits: int | None = 3) -> pd.DataFrame:
    """GiB per (variant, point): measured allocated / peak and each component next to its expectation."""
    m = df[(df.unit == "GiB") & (df.note == "")]
    if rank is not None:
        m = m[m.x_value.astype(float) == rank]
    if m.empty:
        return pd.DataFrame()
    t = m.pivot_table(index=["impl", "mode"], columns="metric", values="mean", aggfunc="last")
    order = [c for c in ("allocated", "peak", "activations_peak", "params", "expected_params", "grads",
                         "expected_grads", "optimizer_state", "expected_optimizer_state", "other") if c in t]  # fmt: skip
    t = t[order]
    t = t.reindex(sorted(t.index, key=lambda ix: (list(IMPL.values()).index(ix[0]), POINTS.index(ix[1]))))
    return t.round(digits) if digits is not None else t


def time_table(df: pd.DataFrame) -> pd.DataFrame:
    t = df[(df.unit == "ms")]
    if t.empty:
        return pd.DataFrame()
    t = t.assign(value=t.apply(lambda r: r.note or f"{r['mean']:.1f} +- {r['std']:.1f}", axis=1))
    return t.pivot_table(index="impl", columns="metric", values="value", aggfunc="last")


def plot_memory_breakdown(df: pd.DataFrame, rank: int = 0):
    """Stacked bars of params / grads / optimizer state / other per variant and point, with the peak."""
    import matplotlib.pyplot as plt

    from cs336_systems.report.style import impl_color

    t = memory_table(df, rank, digits=None)
    fig, ax = plt.subplots(figsize=(10, 4.2))
    if t.empty:
        ax.text(0.5, 0.5, "no memory rows (CPU run?)", ha="center", va="center", transform=ax.transAxes)
        return fig
    colors = {"params": "#4c72b0", "grads": "#dd8452", "optimizer_state": "#55a868", "other": "#c7c7c7"}
    labels = [f"{impl}\n{mode.replace(':', ' ')}" for impl, mode in t.index]
    x = range(len(t))
    bottom = pd.Series(0.0, index=t.index)
    for comp in COMPONENTS:
        if comp in t:
            vals = t[comp].fillna(0).clip(lower=0)
            ax.bar(x, vals, bottom=bottom, color=colors[comp], label=comp.replace("_", " "), width=0.75)
            bottom += vals
    if "peak" in t:
        ax.scatter(
            x, t["peak"], marker="_", s=300, color="black", label="peak since previous point", zorder=3
        )
    for i, (impl, _) in enumerate(t.index):
        ax.axvspan(i - 0.45, i + 0.45, ymin=0, ymax=0.015, color=impl_color(impl))
    ax.set_xticks(list(x), labels, rotation=90, fontsize=7)
    ax.set_ylabel(f"GiB allocated (rank {rank})")
    fig.suptitle("Memory with and without optimizer-state sharding", fontsize=11)
    # legend between the title and the axes
    ax.legend(fontsize=8, ncols=5, loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False)
    fig.tight_layout()
    return fig


def plot_step_time(df: pd.DataFrame):
    """Stacked mean phase times per variant (slowest rank per iteration)."""
    import matplotlib.pyplot as plt

    t = df[(df.unit == "ms") & (df.note == "") & (df.metric != "step_time")]
    fig, ax = plt.subplots(figsize=(6, 3.2))
    if t.empty:
        ax.text(0.5, 0.5, "no timing rows", ha="center", va="center", transform=ax.transAxes)
        return fig
    p = t.pivot_table(index="impl", columns="metric", values="mean", aggfunc="last")
    p = p.reindex([i for i in IMPL.values() if i in p.index])
    p.plot.barh(stacked=True, ax=ax, color=["#4c72b0", "#dd8452", "#55a868"][: p.shape[1]])
    ax.set_xlabel("ms per iteration")
    ax.set_ylabel("")
    ax.set_title("Time per training iteration")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def zero1_comparison(size: str = "xl", world_size: int = 2) -> pd.DataFrame:
    """Per-device model-state memory and communication per step: plain DP, ours, ZeRO-1 (fp32 AdamW).

    ZeRO-1 (P_os) reduce-scatters gradients and all-gathers updated parameters (one all-reduce's
    volume); ours all-reduces gradients and then broadcasts parameters (an extra all-gather's worth).
    Memory: both shard only the optimizer state; ZeRO-1 balances elements exactly, ours whole tensors.
    """
    p = get_config(size).num_params()
    rows = []
    for name, stage, comm in (
        ("DP (unsharded AdamW)", 0, accounting.dp_comm_volume(p, world_size)),
        ("ours (ShardedOptimizer)", 1, accounting.broadcast_sharded_optimizer_comm_volume(p, world_size)),
        ("ZeRO stage 1 (P_os)", 1, accounting.zero1_comm_volume(p, world_size)),
    ):
        mem = accounting.zero_memory_per_device(p, world_size, stage=stage)
        rows.append({"scheme": name, "weights GiB": mem.weights / GiB, "grads GiB": mem.gradients / GiB,
                     "optimizer GiB": mem.optimizer_state / GiB, "state GiB": mem.state / GiB,
                     "sent per device GB": comm.total / 1e9,
                     "collectives": " + ".join(comm.parts)})  # fmt: skip
    return pd.DataFrame(rows).set_index("scheme")


if __name__ == "__main__":
    main()
