"""The measurements of benchmarking_script, nsys_profile and benchmarking_mixed_precision, as stages.

Each stage appends rows to `<results dir>/<problem>.csv` as each configuration ends; notebooks 01, 02
and 04 call `measure_benchmarking_script`, `run_profiling` and `measure_mixed_precision`, and
`python -m cs336_systems.studies.profiling` runs them all (parts toy, bench, mixed, ablation, profile):
1. toy-model dtype table under fp16 autocast (benchmarking_mixed_precision (a));
2. benchmarking_script (b): every 2025 size at context 512, modes forward / forward_backward /
   train, 5 warm-up + 10 measured steps, every step's time kept;
3. benchmarking_mixed_precision (c): bf16 autocast, modes forward and train, same protocol. The fp32
   baseline rows are those of stage 2 (the same measurements, relabelled to this problem);
4. benchmarking_script (c), the warm-up ablation: 0, 1 and 2 warm-up steps, then 10 measured train
   steps, each warm-up setting in a fresh Python process (as the handout's script would be run), so
   the first measured step pays for CUDA/cuBLAS initialisation, kernel selection and allocator growth;
   the sizes run in order in that process (the first in a cold process, later ones with new shapes);
5. nsys_profile: every size x context 128/256/512/1024 (context-major, so what a tight budget skips
   is the long-context tail that mostly runs out of memory anyway) profiled with torch.profiler (1
   warm-up train step, then one inference forward and one train step traced), OOMs recorded, the
   slim trace of one configuration saved next to the results and its timeline rendered into `out_dir`.

Every stage takes an optional `TimeBudget` (default: unbounded): under a budget, a configuration whose
predicted duration no longer fits gets a 'skipped: <reason>' row instead of running, so nothing is
dropped silently.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from tqdm.auto import tqdm

from cs336_systems.measure.budget import TimeBudget
from cs336_systems.measure.results import REPO_ROOT, append_rows, failure_row
from cs336_systems.measure.results import results_dir as default_results_dir
from cs336_systems.measure.traces import load_trace
from cs336_systems.model import SIZES_2025, get_config
from cs336_systems.studies.profiling import kernel_profile, kernel_tables, mixed_precision
from cs336_systems.studies.profiling.end_to_end import (
    MODES,
    PHASES,
    EndToEndConfig,
    grid,
    row_fields,
    run_one,
)

BENCH = "benchmarking_script"
MIXED = mixed_precision.PROBLEM
PROFILE = kernel_profile.PROBLEM
# Assumed sustained rates for the predicted durations (conservative: naive attention and elementwise
# kernels run far below the matmul peak). Only used to skip what cannot fit the budget.
_ASSUMED_FLOPS = {
    "cuda": {"none": 30e12, "bf16": 150e12, "fp16": 150e12},
    "cpu": {"none": 20e9, "bf16": 5e9, "fp16": 5e9},
}


@dataclass(frozen=True, kw_only=True)
class Plan:
    """What the run measures (the GPU defaults, or tiny CPU ones with `quick`)."""

    sizes: tuple[str, ...] = SIZES_2025
    context_length: int = 512
    warmup: int = 5
    steps: int = 10
    ablation_sizes: tuple[str, ...] = ("small", "medium", "large")
    ablation_warmups: tuple[int, ...] = (0, 1, 2)
    ablation_fresh_process: bool = True  # False (quick runs): in this process, no cold start to show
    profile_contexts: tuple[int, ...] = (128, 256, 512, 1024)
    profile_warmup: int = 1
    profile_steps: int = 1
    trace_size: str = "small"
    trace_context: int = 512
    device: str = "cuda" if torch.cuda.is_available() else "cpu"

    @property
    def trace_name(self) -> str:
        return f"{PROFILE}__trace_{self.trace_size}_ctx{self.trace_context}.json.gz"


def make_plan(quick: bool = False, **overrides: Any) -> Plan:
    """The GPU plan, or with quick=True the debug model on the CPU with short protocols."""
    if quick:
        base = dict(
            sizes=("debug",),
            context_length=64,
            warmup=1,
            steps=3,
            ablation_sizes=("debug",),
            ablation_fresh_process=False,
            profile_contexts=(32, 64),
            trace_size="debug",
            trace_context=64,
            device="cpu",
        )
        overrides = {**base, **overrides}
    return Plan(**overrides)


def _device_kind(device: str) -> str:
    return torch.device(device).type


def predicted_seconds(
    size: str, context_length: int, mode: str, autocast: str, num_steps: float, device: str
) -> float:
    """Rough duration of `num_steps` steps: matmul FLOPs at an assumed sustained rate, plus 2 s setup."""
    mcfg = get_config(size, context_length=context_length)
    flops = mcfg.matmul_flops_per_token(context_length) * 4 * context_length  # batch 4
    flops *= 1 if mode == "forward" else 3
    rate = _ASSUMED_FLOPS[_device_kind(device)].get(autocast, _ASSUMED_FLOPS[_device_kind(device)]["none"])
    return 2.0 + num_steps * flops / rate


def _skipped_rows(cfg: EndToEndConfig, problem: str, note: str) -> list[dict[str, Any]]:
    common = row_fields(cfg, problem, config=dataclasses.asdict(cfg))
    return [failure_row(metric=f"{p}_time", unit="ms", note=note, **common) for p in PHASES[cfg.mode]]


def _budgeted_sweep(
    configs: Sequence[EndToEndConfig], problem: str, results_dir, budget: TimeBudget, progress: bool = True
) -> list[dict]:
    rows = []
    for cfg in tqdm(configs, desc=problem, disable=not progress):
        est = predicted_seconds(
            cfg.size, cfg.context_length, cfg.mode, cfg.autocast, cfg.warmup + cfg.steps, cfg.device
        )
        reason = budget.skip_reason(est)
        r = _skipped_rows(cfg, problem, reason) if reason else run_one(cfg, problem)
        append_rows(problem, r, results_dir)
        rows.extend(r)
    return rows


# ---------------------------------------------------------------------------------------------------
# Stages (each usable on its own, e.g. from a notebook)
# ---------------------------------------------------------------------------------------------------


def run_toy_dtypes(plan: Plan, results_dir=None) -> pd.DataFrame:
    """Stage 1: the toy model's dtype table under autocast (fp16 on CUDA, bf16 on CPU)."""
    table = mixed_precision.dtype_table(plan.device)
    append_rows(MIXED, mixed_precision.dtype_rows(table), results_dir)
    return table


def run_benchmarking_script(plan: Plan, results_dir=None, budget: TimeBudget | None = None) -> list[dict]:
    """Stage 2: every size x mode at plan.context_length, plan.warmup + plan.steps."""
    configs = grid(
        size=list(plan.sizes),
        context_length=plan.context_length,
        mode=list(MODES),
        warmup=plan.warmup,
        steps=plan.steps,
        device=plan.device,
    )
    return _budgeted_sweep(configs, BENCH, results_dir, budget or TimeBudget())


def run_mixed_precision(
    plan: Plan, results_dir=None, budget: TimeBudget | None = None, fp32_rows: Sequence[dict] | None = None
) -> list[dict]:
    """Stage 3: bf16-autocast forward and train steps; fp32 from `fp32_rows` (stage 2) or measured."""
    budget = budget or TimeBudget()
    rows = []
    if fp32_rows is not None:
        copied = [
            {**r, "problem": MIXED}
            for r in fp32_rows
            if r["mode"] in ("forward", "train") and r["dtype"] == "fp32"
        ]
        append_rows(MIXED, copied, results_dir)
        rows.extend(copied)
        autocasts = ["bf16"]
    else:
        autocasts = ["none", "bf16"]
    configs = mixed_precision.timing_configs(
        plan.sizes,
        context_length=plan.context_length,
        autocast=autocasts,
        warmup=plan.warmup,
        steps=plan.steps,
        device=plan.device,
    )
    rows.extend(_budgeted_sweep(configs, MIXED, results_dir, budget))
    return rows


def run_warmup_ablation(plan: Plan, results_dir=None, budget: TimeBudget | None = None) -> list[dict]:
    """Stage 4: per warm-up setting, `plan.steps` timed train steps of every ablation size.

    With `plan.ablation_fresh_process`, each warm-up setting runs in a fresh `end_to_end` process that
    appends its own rows (x_name "warmup"); a child that fails or overruns leaves failure rows written
    here for the configurations it did not report. Otherwise (quick runs) it runs in this process.
    """
    budget = budget or TimeBudget()
    results = str(default_results_dir(results_dir))
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the child gets the memory this process cached
    written = []
    for w in tqdm(plan.ablation_warmups, desc="warm-up ablation"):
        cfgs = [
            EndToEndConfig(
                size=s,
                context_length=plan.context_length,
                mode="train",
                warmup=w,
                steps=plan.steps,
                device=plan.device,
                x_axis="warmup",
            )
            for s in plan.ablation_sizes
        ]
        if not plan.ablation_fresh_process:
            written.extend(_budgeted_sweep(cfgs, BENCH, results_dir, budget, progress=False))
            continue
        est = 10.0 + sum(
            predicted_seconds(c.size, c.context_length, "train", "none", w + c.steps, c.device) for c in cfgs
        )
        reason = budget.skip_reason(est)
        if reason is None:
            cmd = [
                sys.executable,
                "-m",
                "cs336_systems.studies.profiling.end_to_end",
                "--size",
                *plan.ablation_sizes,
                "--context-length",
                str(plan.context_length),
                "--mode",
                "train",
                "--warmup",
                str(w),
                "--steps",
                str(plan.steps),
                "--x-axis",
                "warmup",
                "--problem",
                BENCH,
                "--results-dir",
                results,
                "--device",
                plan.device,
            ]
            env = {**os.environ, "CS336_GIT_SHA": os.environ.get("CS336_GIT_SHA", _git_sha())}
            try:
                proc = subprocess.run(
                    cmd,
                    capture_output=True,
                    text=True,
                    env=env,
                    cwd=REPO_ROOT,
                    timeout=budget.subprocess_timeout(),
                )
                reason = (
                    None
                    if proc.returncode == 0
                    else f"error: child exited {proc.returncode}: {proc.stderr[-200:]}"
                )
            except subprocess.TimeoutExpired:
                reason = "skipped: child process overran the run's budget"
        if reason is not None:
            for c in cfgs:
                r = _skipped_rows(c, BENCH, reason)
                append_rows(BENCH, r, results_dir)
                written.extend(r)
    return written


def measure_benchmarking_script(plan: Plan, results_dir=None, budget: TimeBudget | None = None) -> None:
    """benchmarking_script (b) and (c): stage 2 then stage 4 (one call for the notebook)."""
    run_benchmarking_script(plan, results_dir, budget)
    run_warmup_ablation(plan, results_dir, budget)


def measure_mixed_precision(plan: Plan, results_dir=None, budget: TimeBudget | None = None) -> None:
    """benchmarking_mixed_precision (a) and (c): the dtype table, then fp32 and bf16 timings."""
    run_toy_dtypes(plan, results_dir)
    run_mixed_precision(plan, results_dir, budget)


def run_profiling(
    plan: Plan, results_dir=None, budget: TimeBudget | None = None, out_dir=None
) -> pd.DataFrame:
    """Stage 5: the nsys_profile grid (torch.profiler), one slim trace, and its timeline PNG in out_dir."""
    budget = budget or TimeBudget()
    results = default_results_dir(results_dir)
    trace_path = results / plan.trace_name
    rows = []
    configs = [
        kernel_profile.ProfileConfig(
            size=s, context_length=c, warmup=plan.profile_warmup, steps=plan.profile_steps, device=plan.device
        )
        for c in plan.profile_contexts
        for s in plan.sizes
    ]
    for cfg in tqdm(configs, desc=PROFILE):
        est = 3.0 + predicted_seconds(
            cfg.size, cfg.context_length, "train", "none", cfg.warmup + cfg.steps + 0.4, cfg.device
        )
        reason = budget.skip_reason(est)
        if reason:
            r = kernel_profile.failure_rows(cfg, reason)
        else:
            want = (cfg.size, cfg.context_length) == (plan.trace_size, plan.trace_context)
            r = kernel_profile.run_profile(cfg, trace_path=trace_path if want else None)
        append_rows(PROFILE, r, results_dir)
        rows.extend(r)
    if out_dir is not None and trace_path.exists():
        render_timeline(trace_path, Path(out_dir) / f"{PROFILE}__timeline.png")
    return pd.DataFrame(rows)


def render_timeline(trace_path, png_path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = kernel_tables.plot_timeline(load_trace(trace_path), title=Path(trace_path).name)
    png_path = Path(png_path)
    png_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png_path, dpi=150, bbox_inches="tight")
    plt.close(fig)
    return png_path


def _git_sha() -> str:
    from cs336_systems.measure.results import env_metadata

    return env_metadata()["git_sha"]
