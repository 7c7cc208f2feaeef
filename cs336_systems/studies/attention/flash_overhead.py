"""Host overhead in the flash_benchmarking grid: each call timed from a CUDA graph replay, beside the eager call.

The flash_benchmarking sweep (flash_sweep) times eager calls with `triton.testing.do_bench`: CUDA events
around a Python call. At batch 1 and one head a short sequence is a few microseconds of GPU work, while
the call itself (Python, autograd, custom-op dispatch, the launcher, several launches) costs the host
about a millisecond; the GPU then idles between kernels and the events time the host, not the kernels.
This study times the same calls without that overhead and records both in one process:

* `eager_latency`: the eager call, timed exactly as the sweep times it (do_bench median, p20/p80);
* `graph_latency`: the same call captured `calls` times back to back in one CUDA graph, timed by
  do_bench over `graph.replay()` and divided by `calls`. A replay re-issues the recorded kernels with
  no Python, dispatch or launch cost, so this is the GPU's time for the call (`calls` > 1 amortises
  the replay's own launch; `calls` is 1 for calls long enough that it does not matter).

Modes: `fwd` (forward with autograd recording, as in the sweep) and `fwd_bwd` (forward, then
`.backward(dO)`). Rows: problem "flash_benchmarking", the sweep's schema, metrics `eager_latency` and
`graph_latency` in ms (the sweep's `latency` rows are untouched), config with `calls`, batch, heads.
A call that cannot be captured (or any failure) is a row with the reason; without CUDA the graph rows
say "needs CUDA" and the eager rows are CPU timings (the CPU test of this path).

    python -m cs336_systems.studies.attention.flash_overhead --results-dir DIR            # the default grid, ~2 min
    python -m cs336_systems.studies.attention.flash_overhead --quick --results-dir /tmp/o # CPU smoke run

`facts(df)` gives the notebook's numbers from whichever rows exist (graph rows if measured, else what
the eager rows alone can say about the host floor).
"""

from __future__ import annotations

import gc
import math
import timeit
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import pandas as pd
import torch

from cs336_systems.measure import cli
from cs336_systems.measure.budget import TimeBudget, skipped_row
from cs336_systems.measure.results import append_rows, capture_failure, failure_row, latest_run, make_row
from cs336_systems.measure.timing import kernel_time, synchronize
from cs336_systems.studies.attention.impls import attention_fn

PROBLEM = "flash_benchmarking"
IMPLS = ("flash_triton", "sdpa_flash", "sdpa_cudnn", "naive")
MODES = ("fwd", "fwd_bwd")
METRICS = {"eager": "eager_latency", "graph": "graph_latency"}


@dataclass(frozen=True, kw_only=True)
class OverheadConfig:
    """The grid (the handout's, at batch 1 and one head like the sweep) and the timing budgets."""

    seq_lens: tuple[int, ...] = tuple(2**i for i in range(7, 17))
    head_dims: tuple[int, ...] = (64, 128, 16, 32)  # measured in this order: d = 64 first (the answer's)
    dtypes: tuple[str, ...] = ("bfloat16",)
    impls: tuple[str, ...] = IMPLS
    modes: tuple[str, ...] = MODES
    batch: int = 1
    heads: int = 1
    causal: bool = True
    calls: int = 20  # calls per graph for short calls
    long_call_ms: float = 2.0  # an eager call at least this long is captured once per graph
    warmup_ms: float = 10.0
    rep_ms: float = 40.0
    budget_s: float | None = 100.0
    device: str = "cuda"

    def __post_init__(self) -> None:
        if unknown := set(self.impls) - set(IMPLS):
            raise ValueError(f"unknown impls {sorted(unknown)}; known: {IMPLS}")
        if unknown := set(self.modes) - set(MODES):
            raise ValueError(f"unknown modes {sorted(unknown)}; known: {MODES}")
        if bad := [d for d in self.dtypes if not isinstance(getattr(torch, d, None), torch.dtype)]:
            raise ValueError(f"unknown dtypes {bad}; use torch dtype names such as bfloat16,float32")
        if self.calls < 1 or min(self.seq_lens, default=0) < 1 or min(self.head_dims, default=0) < 1:
            raise ValueError("calls, sequence lengths and head dims must be positive")


QUICK = dict(
    seq_lens=(32, 64),
    head_dims=(16,),
    dtypes=("float32",),
    impls=("flash_triton", "naive"),
    calls=2,
    warmup_ms=1.0,
    rep_ms=5.0,
    budget_s=None,
    device="cpu",
)


# ------------------------------------------------------------------------------------------------
# Timing one call
# ------------------------------------------------------------------------------------------------


def _call(fn: Callable, q, k, v, do, causal: bool, mode: str) -> Callable[[], None]:
    if mode == "fwd":
        return lambda: fn(q, k, v, causal)
    return lambda: fn(q, k, v, causal).backward(do)


def graph_time(
    step: Callable[[], None], *, calls: int, warmup_ms: float, rep_ms: float, grads: Sequence[torch.Tensor]
) -> dict[str, float]:
    """ms per call of `step`, from do_bench over replays of a CUDA graph that holds `calls` calls.

    The step is warmed up on a side stream first (libraries set up workspaces and compile outside the
    capture); gradients are set to None before the capture, so the graph owns their buffers.
    """
    if not torch.cuda.is_available():
        raise RuntimeError("graph timing needs CUDA")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    for t in grads:
        t.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            step()
    synchronize("cuda")
    stats = kernel_time(graph.replay, warmup_ms=warmup_ms, rep_ms=rep_ms, device="cuda")
    del graph
    return {k: (v / calls if k in ("p50", "p20", "p80", "mean", "std") else v) for k, v in stats.items()}


def measure_config(cfg: OverheadConfig, impl: str, dtype: str, d: int, n: int) -> list[dict[str, Any]]:
    """Eager and graph rows of every mode of one (impl, dtype, d, N)."""
    fn = attention_fn(impl, cfg.device)
    common = dict(problem=PROBLEM, name=f"d{d}", impl=impl, dtype=dtype, x_name="seq_len", x_value=n)
    base = {k: v for k, v in asdict(cfg).items() if k in ("batch", "heads", "causal", "warmup_ms", "rep_ms")}
    rows = []
    for mode in cfg.modes:
        outcome: dict[str, str] = {}
        graph_outcome: dict[str, str] = {}
        eager = graph = None
        calls = cfg.calls
        with capture_failure(outcome):
            shape = (cfg.batch, cfg.heads, n, d)
            q, k, v = (
                torch.randn(shape, device=cfg.device, dtype=getattr(torch, dtype), requires_grad=True)
                for _ in range(3)
            )
            do = torch.randn_like(q)
            step = _call(fn, q, k, v, do, cfg.causal, mode)
            step()  # compiles, selects tiles
            grads = [q, k, v] if mode == "fwd_bwd" else None
            eager = kernel_time(
                step, warmup_ms=cfg.warmup_ms, rep_ms=cfg.rep_ms, grad_to_none=grads, device=cfg.device
            )
            calls = 1 if eager["p50"] >= cfg.long_call_ms else cfg.calls
            with capture_failure(graph_outcome):
                graph = graph_time(
                    step, calls=calls, warmup_ms=cfg.warmup_ms, rep_ms=cfg.rep_ms, grads=[q, k, v]
                )
        config = {**base, "seq_len": n, "d": d, "calls": calls, "statistic": "do_bench median (p20/p80)"}
        for kind, stats in (("eager", eager), ("graph", graph)):
            metric = METRICS[kind]
            if stats is not None:
                rows.append(
                    make_row(metric=metric, unit="ms", mode=mode, stats=stats, config=config, **common)
                )
            else:
                note = (
                    outcome.get("note") or (graph_outcome.get("note") if kind == "graph" else "") or "failed"
                )
                if "needs CUDA" in note:
                    note = "graph timing needs CUDA"
                rows.append(
                    failure_row(metric=metric, unit="ms", mode=mode, note=note, config=config, **common)
                )
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        if outcome.get("note", "").startswith("OOM"):
            break
    return rows


def measure(config: OverheadConfig, *, results_dir=None) -> list[dict[str, Any]]:
    """The grid, head dims in the given order (the first is complete before the budget can run out),
    shortest N first per (d, impl, dtype); an OOM ends that (d, impl, dtype) at longer N."""
    cfg = config
    budget = TimeBudget(cfg.budget_s, label="flash_overhead")
    prev = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")  # TF32 for fp32, as in the sweep
    out: list[dict[str, Any]] = []
    try:
        for d in cfg.head_dims:
            for impl in cfg.impls:
                for dtype in cfg.dtypes:
                    rows, stop = [], ""
                    for n in sorted(cfg.seq_lens):
                        if stop or budget.exhausted():
                            why = stop or budget.skip_note(f"{impl} {dtype} d={d} N={n}")
                            common = dict(problem=PROBLEM, name=f"d{d}", impl=impl, dtype=dtype)
                            rows += [
                                skipped_row(metric=m, unit="ms", mode=mode, reason=why, x_name="seq_len", x_value=n, **common)
                                for mode in cfg.modes
                                for m in METRICS.values()
                            ]  # fmt: skip
                            continue
                        got = measure_config(cfg, impl, dtype, d, n)
                        rows += got
                        if any(str(r["note"]).startswith("OOM") for r in got):
                            stop = f"skipped: OOM at N={n}"
                    append_rows(PROBLEM, rows, results_dir)
                    out += rows
    finally:
        torch.set_float32_matmul_precision(prev)
    return out


# ------------------------------------------------------------------------------------------------
# Reading the rows
# ------------------------------------------------------------------------------------------------


def overhead_frame(df: pd.DataFrame) -> pd.DataFrame:
    """Latest eager/graph/latency rows with integer d and N (the sweep's `latency` rows included)."""
    sel = df[df.metric.isin(["latency", *METRICS.values()]) & (df.unit == "ms")]
    if sel.empty:
        return sel.assign(d=pd.Series(dtype=int), N=pd.Series(dtype=int))
    sel = latest_run(sel, keys=("name", "impl", "mode", "dtype", "x_value", "metric"))
    return sel.assign(
        d=sel["name"].str.removeprefix("d").astype(int), N=sel["x_value"].astype(float).astype(int)
    )


def _ms(f: pd.DataFrame, metric: str, impl: str, seq: int, *, d: int, dtype: str, mode: str) -> float:
    r = f[
        (f.metric == metric)
        & (f.impl == impl)
        & (f["N"] == seq)
        & (f.d == d)
        & (f.dtype == dtype)
        & (f["mode"] == mode)
    ]
    return float(r.p50.iloc[-1]) if len(r) and pd.notna(r.p50.iloc[-1]) else math.nan


def facts(df: pd.DataFrame, *, n_long: int = 16384, d: int = 64, dtype: str = "bfloat16") -> dict[str, Any]:
    """The overhead numbers of notebook 10 (fwd+bwd, `dtype`, head dim `d`), from whichever rows exist.

    Always (from the sweep's eager `latency` rows): `floor_ms`, the median of our fwd+bwd over N <= 2048;
    `floor_spread`, max/min of those times while the causal FLOPs grow `flops_growth` times; `long_over_floor`,
    our time at `n_long` over the floor; `eager_speedup`, naive over ours at `n_long`.
    With graph rows (`timing` = "graph"): `graph_ms`/`eager_ms` per impl at `n_long`, `graph_speedup`
    (naive over ours, both from graph replays), `overhead_ms` per impl (eager - graph, median over
    N <= 2048), and `dominated_up_to` per impl: the longest N where eager is at least twice the graph time.
    """
    f = overhead_frame(df)
    f = f[~f.gpu_name.astype(str).str.startswith("cpu")] if "gpu_name" in f else f
    kw = dict(d=d, dtype=dtype, mode="fwd_bwd")
    sweep = f[
        (f.metric == "latency")
        & (f.impl == "flash_triton")
        & (f.d == d)
        & (f.dtype == dtype)
        & (f["mode"] == "fwd_bwd")
    ]
    short = sweep[(sweep.N <= 2048) & sweep.p50.notna()].sort_values("N")
    out: dict[str, Any] = {"n_long": n_long, "d": d, "dtype": dtype, "timing": "eager"}
    if len(short) >= 2:
        out["floor_ms"] = float(short.p50.median())
        out["floor_spread"] = float(short.p50.max() / short.p50.min())
        out["floor_min_ms"], out["floor_max_ms"] = float(short.p50.min()), float(short.p50.max())
        out["floor_n"] = (int(short.N.min()), int(short.N.max()))
        out["flops_growth"] = float(short.N.max() / short.N.min()) ** 2
        out["long_over_floor"] = _ms(f, "latency", "flash_triton", n_long, **kw) / out["floor_ms"]
    out["eager_speedup"] = _ms(f, "latency", "naive", n_long, **kw) / _ms(
        f, "latency", "flash_triton", n_long, **kw
    )
    graph = f[
        (f.metric == METRICS["graph"])
        & f.p50.notna()
        & (f.d == d)
        & (f.dtype == dtype)
        & (f["mode"] == "fwd_bwd")
    ]
    if graph.empty:
        return out
    out["timing"] = "graph"
    impls = sorted(set(graph.impl))
    out["graph_ms"] = {i: _ms(f, METRICS["graph"], i, n_long, **kw) for i in impls}
    out["eager_ms"] = {i: _ms(f, METRICS["eager"], i, n_long, **kw) for i in impls}
    out["graph_speedup"] = out["graph_ms"].get("naive", math.nan) / out["graph_ms"].get(
        "flash_triton", math.nan
    )
    out["overhead_ms"], out["dominated_up_to"] = {}, {}
    for impl in impls:
        e = f[
            (f.metric == METRICS["eager"])
            & (f.impl == impl)
            & (f.d == d)
            & (f.dtype == dtype)
            & (f["mode"] == "fwd_bwd")
        ]
        g = graph[graph.impl == impl]
        both = (
            e.set_index("N")
            .p50.to_frame("eager")
            .join(g.set_index("N").p50.rename("graph"), how="inner")
            .dropna()
        )
        if both.empty:
            continue
        small = both[both.index <= 2048]
        out["overhead_ms"][impl] = float((small.eager - small.graph).median()) if len(small) else math.nan
        dominated = both[both.eager >= 2 * both.graph].index
        out["dominated_up_to"][impl] = int(dominated.max()) if len(dominated) else None
    return out  # fmt: skip


def overhead_table(df: pd.DataFrame, *, d: int = 64, dtype: str = "bfloat16", mode: str = "fwd_bwd"):
    """Median ms per call, eager and from a graph replay, per N (rows) and implementation (columns), with
    the rows they come from in `.attrs["rows"]` (for the provenance footer)."""
    f = overhead_frame(df)
    f = f[f.metric.isin(list(METRICS.values())) & (f.d == d) & (f.dtype == dtype) & (f["mode"] == mode)]
    if f.empty:
        return pd.DataFrame()
    cell = f.p50.map(lambda v: f"{v:.3g}").where(f.p50.notna(), f.note.astype(str).str.split(":").str[0])
    f = f.assign(col=f.impl + " " + f.metric.str.removesuffix("_latency"), cell=cell)
    out = f.pivot_table(index="N", columns="col", values="cell", aggfunc="last")
    order = [f"{i} {k}" for i in IMPLS for k in METRICS if f"{i} {k}" in out.columns]
    out = out[order].reset_index()
    out.attrs["rows"] = f
    return out


def sweep_grid(df: pd.DataFrame, impls: Sequence[str] = ("flash_triton", "naive"), mode: str = "fwd_bwd"):
    """The sweep's `latency` medians (ms) pivoted: a row per (dtype, d, impl), a column per N; a failed
    cell shows its reason's first word (OOM, unsupported, skipped)."""
    f = overhead_frame(df)
    f = f[(f.metric == "latency") & f.impl.isin(impls) & (f["mode"] == mode)]
    if f.empty:
        return pd.DataFrame()
    cell = f.p50.map(lambda v: f"{v:.3g}").where(f.p50.notna(), f.note.astype(str).str.split(":").str[0])
    out = f.assign(cell=cell).pivot_table(
        index=["dtype", "d", "impl"], columns="N", values="cell", aggfunc="last"
    )
    out.columns = [str(c) for c in out.columns]
    return out


def handout_grid(df: pd.DataFrame, impls: Sequence[str] = ("flash_triton", "naive")) -> pd.DataFrame:
    """The handout's flash_benchmarking table: forward, backward and forward+backward medians (ms, eager
    calls) of `impls` ("ours" = flash_triton) for every dtype and head dim (a row each, with the pass and
    implementation) and every N (a column each); a failed cell shows its reason's first word (OOM, ...)."""
    blocks = {mode: sweep_grid(df, impls, mode) for mode in ("fwd", "bwd", "fwd_bwd")}
    if any(b.empty for b in blocks.values()):
        return pd.DataFrame()
    out = pd.concat(blocks, names=["pass"]).reset_index()
    order = {m: k for k, m in enumerate(blocks)}
    rank = {i: k for k, i in enumerate(impls)}
    out = out.sort_values(
        ["dtype", "d", "pass", "impl"],
        key=lambda c: c.map(order) if c.name == "pass" else c.map(rank) if c.name == "impl" else c,
    )
    out["dtype"] = out["dtype"].map({"bfloat16": "bf16", "float32": "fp32"}).fillna(out["dtype"])
    out["pass"] = out["pass"].replace({"fwd_bwd": "fwd+bwd"})
    out["impl"] = out["impl"].replace({"flash_triton": "ours"})
    return out[["dtype", "d", "pass", "impl", *[c for c in out.columns if c.isdigit()]]].reset_index(
        drop=True
    )


def plot_overhead(df: pd.DataFrame, *, d: int = 64, dtype: str = "bfloat16"):
    """fwd+bwd ms against N per implementation: eager (solid) and, where measured, graph replay (dashed);
    without graph rows, the sweep's eager times with a causal-FLOPs slope for reference."""
    import matplotlib.pyplot as plt

    from cs336_systems.report import impl_color

    f = overhead_frame(df)
    f = f[(f.d == d) & (f.dtype == dtype) & (f["mode"] == "fwd_bwd") & f.p50.notna()]
    has_graph = (f.metric == METRICS["graph"]).any()
    fig, ax = plt.subplots(figsize=(6.4, 2.6))
    eager_metric = METRICS["eager"] if has_graph else "latency"
    for impl in [i for i in IMPLS if i in set(f.impl)]:
        for metric, ls in ((eager_metric, "-"), (METRICS["graph"], "--")):
            g = f[(f.impl == impl) & (f.metric == metric)].sort_values("N")
            if len(g):
                label = f"{impl} ({'graph replay' if metric == METRICS['graph'] else 'eager'})"
                ax.plot(g.N, g.p50, ls=ls, marker="o", ms=3, color=impl_color(impl), label=label)
    if not has_graph and len(f):
        # the slope the work follows, through the longest naive (GPU-bound) point
        ref = f[(f.impl == "naive") & (f.metric == eager_metric)].sort_values("N").tail(1)
        ref = ref if len(ref) else f.sort_values("N").tail(1)
        n = np.array(sorted(set(f.N)))
        ax.plot(n, float(ref.p50.iloc[0]) * (n / int(ref.N.iloc[0])) ** 2, color="grey", lw=0.8, ls=":",
                label="causal FLOPs ~ N^2 (slope)")  # fmt: skip
        ax.set_ylim(bottom=float(f.p50.min()) / 3)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length N")
    ax.set_ylabel("fwd+bwd median ms")
    ax.set_title(
        f"fwd+bwd, {dtype}, d = {d}, batch 1, one head: "
        + ("eager vs CUDA graph replay" if has_graph else "eager calls")
    )
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, ncols=2)
    else:
        ax.text(0.5, 0.5, f"no {dtype} rows at d = {d}", ha="center", va="center", transform=ax.transAxes)
    fig.tight_layout()
    return fig  # fmt: skip


# ------------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------------


def _ints(s: str) -> tuple[int, ...]:
    return tuple(int(x) for x in s.split(",") if x)


def _strs(s: str) -> tuple[str, ...]:
    return tuple(x for x in s.split(",") if x)


def main(argv: Sequence[str] | None = None) -> None:
    p = cli.make_parser(
        __doc__,
        "python -m cs336_systems.studies.attention.flash_overhead --results-dir /tmp/overhead --budget-s 150",
    )
    d = OverheadConfig()
    p.add_argument("--seq-lens", type=_ints, default=d.seq_lens, help="comma-separated N values")
    p.add_argument("--head-dims", type=_ints, default=d.head_dims, help="comma-separated head dims")
    p.add_argument("--dtypes", type=_strs, default=d.dtypes, help="comma-separated torch dtype names")
    p.add_argument(
        "--impls", type=_strs, default=d.impls, help=f"comma-separated subset of {','.join(IMPLS)}"
    )
    p.add_argument(
        "--modes", type=_strs, default=d.modes, help=f"comma-separated subset of {','.join(MODES)}"
    )
    p.add_argument("--calls", type=int, default=d.calls, help="calls captured per graph for short calls")
    p.add_argument(
        "--budget-s", type=float, default=d.budget_s, help="time budget; the rest become skipped rows"
    )
    p.add_argument(
        "--quick", action="store_true", help="tiny CPU grid (eager rows; graph rows say 'needs CUDA')"
    )
    cli.add_results_dir(p)
    args = p.parse_args(argv)
    with cli.usage_errors(p):
        if args.quick:
            cfg = OverheadConfig(**QUICK)
        else:
            cfg = OverheadConfig(
                seq_lens=args.seq_lens,
                head_dims=args.head_dims,
                dtypes=args.dtypes,
                impls=args.impls,
                modes=args.modes,
                calls=args.calls,
                budget_s=args.budget_s,
            )
    results_dir = cli.results_dir_for(args.results_dir, quick=args.quick)
    print(cfg, flush=True)
    start = timeit.default_timer()
    rows = measure(cfg, results_dir=results_dir)
    done = sum(1 for r in rows if not r["note"])
    print(f"{done} of {len(rows)} rows measured in {timeit.default_timer() - start:.0f} s -> {results_dir}")


if __name__ == "__main__":
    main()
