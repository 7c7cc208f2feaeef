"""Kernel-level profiling of BasicsTransformerLM (nsys_profile): torch.profiler/CUPTI with NVTX ranges.

One profiled configuration runs `warmup` untraced training steps (inside a "warmup" range), then,
under `torch.profiler` (CUPTI activity tracing on CUDA), one inference forward pass under
`torch.no_grad()` (range "inference_step" > "forward") and `steps` training steps (range
"train_step" > "forward" (incl. the loss), "backward", "optimizer_step"). The attention is the
"naive_annotated" implementation (measure/annotations.py), whose ranges "computing attention
scores", "computing softmax" and "final matmul" sit inside every forward. Every range is both a
`record_function` (seen by torch.profiler) and an NVTX range, so the same script runs under
`nsys profile` with `--profiler none`:

    python -m cs336_systems.studies.profiling.kernel_profile --size small medium --context-length 128 256 512 1024
    nsys profile -o small512 --trace=cuda,nvtx,osrt --pytorch=autograd-nvtx \\
        python -m cs336_systems.studies.profiling.kernel_profile --size small --context-length 512 --profiler none

The exported Chrome trace is reduced to per-range kernel tables (`kernel_tables.summarize`), tidy
rows for the problem "nsys_profile" (`profile_rows`) and a timeline figure of one training step
(`kernel_tables.plot_timeline`); `kernel_facts` turns the rows into the answers' tables and
facts. The names of those modules that callers use are re-exported here.

Kernels are attributed to ranges by their launch ([Note: attributing asynchronous kernels to ranges]
in measure/traces.py) and sorted into classes ([Note: kernel classes] in kernel_tables.py).

Caveats: profiling adds host overhead (the Python timer under the profiler is slower than the
unprofiled benchmark); CUPTI and Nsight Systems cannot trace the same process at once, hence
`--profiler none` under nsys; torch.compile'd models fuse kernels and blur the range attribution.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import os
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd
import torch
from tqdm.auto import tqdm

from cs336_systems.measure import cli
from cs336_systems.measure.annotations import annotate
from cs336_systems.measure.results import append_rows, capture_failure, failure_row, make_row
from cs336_systems.measure.timing import PhaseTimer, synchronize
from cs336_systems.measure.traces import (
    kineto_logs_filtered,
    load_trace,
    save_trace,
    slim_trace,
)
from cs336_systems.model import get_config
from cs336_systems.studies.profiling.end_to_end import AUTOCAST_DTYPES, EndToEndConfig, build_workload
from cs336_systems.studies.profiling.kernel_facts import (
    attention_ratio,
    by_size,
    class_shares,
    facts,
    failures,
    forward_table,
    gemm_family,
    kernel_ranking,
    profile_frame,
    range_summary,
    summary_table,
    top_kernels,
)
from cs336_systems.studies.profiling.kernel_tables import (
    CLASS_COLORS,
    KERNEL_CLASSES,
    SOFTMAX_FLOPS_PER_SCORE,
    attention_flops,
    classify_kernel,
    kernel_table,
    plot_timeline,
    range_table,
    summarize,
)

PROBLEM = "nsys_profile"
# Re-exported from kernel_tables/kernel_facts (and load_trace from measure.traces): notebook 02 and
# the study's `facts` is kernel_facts'.
__all__ = [
    "CLASS_COLORS",
    "KERNEL_CLASSES",
    "PROBLEM",
    "SOFTMAX_FLOPS_PER_SCORE",
    "ProfileConfig",
    "ProfileResult",
    "attention_flops",
    "attention_ratio",
    "by_size",
    "class_shares",
    "classify_kernel",
    "facts",
    "failure_rows",
    "failures",
    "forward_table",
    "gemm_family",
    "kernel_ranking",
    "kernel_table",
    "load_trace",
    "main",
    "measure",
    "plot_timeline",
    "profile_config",
    "profile_frame",
    "profile_rows",
    "range_summary",
    "range_table",
    "run_profile",
    "summarize",
    "summary_table",
    "top_kernels",
]

# ---------------------------------------------------------------------------------------------------
# Running a profile
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class ProfileConfig:
    size: str = "small"
    context_length: int = 512
    batch_size: int = 4
    warmup: int = 1  # untraced training steps before the profiled ones
    steps: int = 1  # profiled training steps
    inference: bool = True  # also profile one forward under torch.no_grad()
    autocast: str = "none"
    attention: str = "naive_annotated"
    profiler: str = "torch"  # "torch": torch.profiler (CUPTI on CUDA); "none": ranges only (for nsys)
    device: str = "cuda" if torch.cuda.is_available() else "cpu"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.profiler not in ("torch", "none"):
            raise ValueError(f"profiler must be 'torch' or 'none', got {self.profiler!r}")
        if self.warmup < 0 or self.steps < 1:
            raise ValueError(f"need warmup >= 0 and steps >= 1, got warmup={self.warmup}, steps={self.steps}")
        if self.autocast not in AUTOCAST_DTYPES:
            raise ValueError(f"autocast must be one of {tuple(AUTOCAST_DTYPES)}, got {self.autocast!r}")
        get_config(self.size)

    @property
    def dtype_label(self) -> str:
        return "fp32" if self.autocast == "none" else f"{self.autocast}-autocast"

    def end_to_end(self) -> EndToEndConfig:
        """The benchmarking script's configuration of this profile: a training step with NVTX ranges."""
        shared = (
            "size",
            "context_length",
            "batch_size",
            "warmup",
            "steps",
            "autocast",
            "attention",
            "device",
            "seed",
        )
        return EndToEndConfig(mode="train", nvtx=True, **{k: getattr(self, k) for k in shared})

    def record(self) -> dict[str, Any]:
        mcfg = get_config(self.size, context_length=self.context_length)
        return {**dataclasses.asdict(self), "model": mcfg.as_kwargs(), "num_params": mcfg.num_params()}


@dataclass
class ProfileResult:
    cfg: ProfileConfig
    trace: dict[str, Any] | None  # None when profiler == "none"
    python_ms: dict[str, list[float]]  # synchronised host-timer samples of the profiled phases


@contextlib.contextmanager
def _profiler(cfg: ProfileConfig) -> Iterator[torch.profiler.profile | None]:
    if cfg.profiler == "none":
        yield None
        return
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.device(cfg.device).type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with kineto_logs_filtered(), torch.profiler.profile(activities=activities) as prof:
        yield prof


def _inference_forward(work, timer: PhaseTimer) -> None:
    with timer.phase("inference_forward"), annotate("forward"), torch.no_grad(), work.autocast():
        work.model(work.inputs)


def profile_config(cfg: ProfileConfig) -> ProfileResult:
    """Warm up, then profile one inference forward and `cfg.steps` training steps (see module doc)."""
    work = build_workload(cfg.end_to_end())
    timer = PhaseTimer(device=cfg.device, enabled=False)

    with annotate("warmup"):
        for _ in range(cfg.warmup):
            work.step(timer)
        if cfg.inference and cfg.warmup:
            _inference_forward(work, timer)
    synchronize(cfg.device)
    timer.enabled = True
    trace = None
    with _profiler(cfg) as prof:
        if cfg.inference:
            with annotate("inference_step"):
                _inference_forward(work, timer)
        for _ in range(cfg.steps):
            with annotate("train_step"):
                work.step(timer)
        synchronize(cfg.device)
    del work
    if prof is not None:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "trace.json")
            prof.export_chrome_trace(path)
            trace = load_trace(path)
    return ProfileResult(cfg, trace, {k: [x * 1e3 for x in v] for k, v in timer.samples.items()})


def profile_rows(result: ProfileResult, problem: str = PROBLEM, *, top_k: int = 6) -> list[dict[str, Any]]:
    """Tidy rows of one profile. Columns: name = model size, x = context length, mode = "<scope>/<range>".

    impl says what a row aggregates: "all" (every kernel of the range), a kernel class, or a kernel's
    short name. Metrics (per step; ms unless said):
      all:    range_cpu_time, range_gpu_span, range_kernel_time, range_num_kernels (count),
              python_timer (synchronised host timer of the phase, profiler attached), flops (GFLOP,
              attention ranges only);
      class:  class_time, class_share (fraction of the range's kernel time);
      kernel: top_kernel_time, top_kernel_calls (config_json has the rank and class, and on the time
              row the full kernel name).
    config_json is the compact ProfileConfig (the size names the model's hyperparameters).
    """
    cfg = result.cfg
    config = dataclasses.asdict(cfg)
    common = dict(
        problem=problem,
        name=cfg.size,
        dtype=cfg.dtype_label,
        x_name="context_length",
        x_value=cfg.context_length,
    )
    rows = []
    timer_phases = {
        "inference/forward": "inference_forward",
        "train/forward": "forward",
        "train/backward": "backward",
        "train/optimizer_step": "optimizer",
    }
    for mode, phase in timer_phases.items():
        if phase in result.python_ms:
            rows.append(
                make_row(
                    metric="python_timer",
                    unit="ms",
                    impl="all",
                    mode=mode,
                    samples=result.python_ms[phase],
                    config=config,
                    **common,
                )
            )
    if result.trace is None:
        return rows
    tables = summarize(result.trace, top_k=top_k)

    def add(metric: str, unit: str, value: float, impl: str, mode: str, row_config: dict = config) -> None:
        rows.append(
            make_row(metric=metric, unit=unit, impl=impl, mode=mode, value=value, config=row_config, **common)
        )

    for r in tables["ranges"].itertuples(index=False):
        for metric, unit, value in [
            ("range_cpu_time", "ms", r.cpu_ms),
            ("range_gpu_span", "ms", r.gpu_span_ms),
            ("range_kernel_time", "ms", r.kernel_ms),
            ("range_num_kernels", "count", r.num_kernels),
        ]:
            add(metric, unit, value, "all", f"{r.scope}/{r.range}")
    flops = attention_flops(cfg.size, cfg.context_length, cfg.batch_size)
    for scope in tables["ranges"].scope.unique():
        for rng, f in flops.items():
            add("flops", "GFLOP", f / 1e9, "all", f"{scope}/{rng}")
    for r in tables["classes"].itertuples(index=False):
        for metric, unit, value in [("class_time", "ms", r.time_ms), ("class_share", "fraction", r.share)]:
            add(metric, unit, value, r.cls, f"{r.scope}/{r.range}")
    for r in tables["top"].itertuples(index=False):
        cfg_k = {**config, "rank": r.rank, "class": r.cls}
        add("top_kernel_time", "ms", r.time_ms, r.short, f"{r.scope}/{r.range}", {**cfg_k, "kernel": r.name})
        add("top_kernel_calls", "count", r.calls, r.short, f"{r.scope}/{r.range}", cfg_k)
    return rows


def failure_rows(cfg: ProfileConfig, note: str, problem: str = PROBLEM) -> list[dict[str, Any]]:
    """The rows saying a configuration was not profiled (OOM, error, or 'skipped: <reason>')."""
    return [
        failure_row(
            problem=problem,
            metric="range_kernel_time",
            unit="ms",
            note=note,
            name=cfg.size,
            impl="all",
            mode="train/step",
            dtype=cfg.dtype_label,
            x_name="context_length",
            x_value=cfg.context_length,
            config=cfg.record(),
        )
    ]


def run_profile(
    cfg: ProfileConfig, problem: str = PROBLEM, *, trace_path: str | os.PathLike | None = None
) -> list[dict[str, Any]]:
    """Profile one configuration; tidy rows (failure rows on OOM/error). Optionally save the slim trace."""
    outcome: dict[str, str] = {}
    result = None
    with capture_failure(outcome):
        result = profile_config(cfg)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    if outcome or result is None:
        return failure_rows(cfg, outcome.get("note", "error: no result"), problem)
    if trace_path is not None and result.trace is not None:
        save_trace(slim_trace(result.trace), trace_path)
    return profile_rows(result, problem)


def measure(
    config: ProfileConfig | Sequence[ProfileConfig],
    *,
    results_dir: str | os.PathLike | None = None,
    problem: str = PROBLEM,
    save: bool = True,
    deadline: float | None = None,
    trace_for: tuple[str, int] | None = None,
    trace_path: str | os.PathLike | None = None,
    progress: bool = True,
) -> list[dict[str, Any]]:
    """Profile one configuration or several in order, appending each one's rows at once.

    deadline: a `time.monotonic()` value; configurations not started by then get a
    'skipped: time budget' row instead of running. trace_for=(size, context_length) names the
    configuration whose slim trace is written to `trace_path`.
    """
    configs = [config] if isinstance(config, ProfileConfig) else list(config)
    all_rows = []
    for cfg in tqdm(configs, desc=problem, disable=not progress):
        if deadline is not None and time.monotonic() > deadline:
            rows = failure_rows(cfg, "skipped: time budget of the GPU run exhausted", problem)
        else:
            want_trace = trace_for is not None and (cfg.size, cfg.context_length) == tuple(trace_for)
            rows = run_profile(cfg, problem, trace_path=trace_path if want_trace else None)
        if save:
            append_rows(problem, rows, results_dir)
        all_rows.extend(rows)
    return all_rows


# ---------------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> pd.DataFrame:
    p = cli.make_parser(
        __doc__,
        "python -m cs336_systems.studies.profiling.kernel_profile --size small --context-length 128 256 --results-dir /tmp/prof",
    )
    cli.add_size(p, ["small"], nargs="+")
    p.add_argument("--context-length", nargs="+", type=int, default=[512], help="sequence length(s)")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--warmup", type=int, default=1, help="untraced warm-up training steps (range 'warmup')")
    p.add_argument("--steps", type=int, default=1, help="profiled training steps")
    p.add_argument("--no-inference", action="store_true", help="do not profile the no_grad forward")
    p.add_argument("--autocast", default="none", choices=list(AUTOCAST_DTYPES))
    cli.add_attention(p, "naive_annotated")
    p.add_argument(
        "--profiler",
        default="torch",
        choices=["torch", "none"],
        help="torch: torch.profiler/CUPTI tables; none: only the NVTX ranges (run under nsys)",
    )
    p.add_argument("--device", default=ProfileConfig().device, choices=["cuda", "cpu"])
    p.add_argument(
        "--trace", default=None, help="write the slim Chrome trace (.json or .json.gz) of the first config"
    )
    p.add_argument("--problem", default=PROBLEM)
    cli.add_results_dir(p)
    p.add_argument("--no-save", action="store_true")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is visible (use --device cpu)")
    if min([args.batch_size, *args.context_length]) < 1:
        p.error("--batch-size and --context-length must be >= 1")
    with cli.usage_errors(p):
        configs = [
            ProfileConfig(
                size=s,
                context_length=c,
                batch_size=args.batch_size,
                warmup=args.warmup,
                steps=args.steps,
                inference=not args.no_inference,
                autocast=args.autocast,
                attention=args.attention,
                profiler=args.profiler,
                device=args.device,
            )
            for s in args.size
            for c in args.context_length
        ]
    results_dir = None if args.no_save else cli.results_dir_for(args.results_dir)
    print(
        "resolved configs:",
        json.dumps([dataclasses.asdict(c) for c in configs][:2]),
        f"... ({len(configs)} total)" if len(configs) > 2 else "",
    )
    first = (configs[0].size, configs[0].context_length)
    rows = measure(
        configs,
        problem=args.problem,
        results_dir=results_dir,
        save=not args.no_save,
        trace_for=first if args.trace else None,
        trace_path=args.trace,
    )
    df = pd.DataFrame(rows)
    if not df.empty:
        f = profile_frame(df)
        shares = f[(f.metric == "class_share") & f.range.isin(["step", "forward"])]
        with pd.option_context("display.width", 200, "display.max_rows", 200):
            print(
                shares.pivot_table(
                    index=["size", "context_length", "scope", "range"], columns="what", values="value"
                )
                .round(3)
                .to_string()
            )
    return df


if __name__ == "__main__":
    main()
