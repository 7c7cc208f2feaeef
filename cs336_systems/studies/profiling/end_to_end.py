"""End-to-end benchmark of BasicsTransformerLM: forward, forward+backward, or a full training step.

Protocol of the handout (benchmarking_script): random weights and tokens, `warmup` untimed steps,
then `steps` timed steps with `torch.cuda.synchronize()` after every phase and
`timeit.default_timer()`; every step's time is kept. Options: bf16/fp16 autocast, torch.compile,
attention implementation, activation checkpointing, NVTX/record_function ranges, and a CUDA memory
snapshot of the timed steps. Each configuration of a sweep is OOM-guarded: failures become rows.

    python -m cs336_systems.studies.profiling.end_to_end --size small medium --context-length 512 \
        --mode forward forward_backward --warmup 5 --steps 10

Forward-only mode runs under `torch.no_grad()` (inference); in the other modes the forward phase is
timed with autograd recording, as training does. Rows are keyed by context length unless `--x-axis`
names another config field (the warm-up ablation uses `--x-axis warmup`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import itertools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd
import torch
from tqdm.auto import tqdm

from cs336_systems.measure import cli
from cs336_systems.measure.annotations import annotate
from cs336_systems.measure.results import append_rows, capture_failure, failure_row, make_row
from cs336_systems.measure.timing import PhaseTimer, synchronize
from cs336_systems.model import (
    AdamW,
    BasicsTransformerLM,
    cross_entropy,
    get_attention,
    get_config,
    random_batch,
)
from cs336_systems.studies.profiling.timing_facts import facts  # noqa: F401 (the study's facts, kept beside its tables)

MODES = ("forward", "forward_backward", "train")
AUTOCAST_DTYPES = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}
PHASES = {
    "forward": ("forward",),
    "forward_backward": ("forward", "backward"),
    "train": ("forward", "backward", "optimizer"),
}
X_AXES = ("context_length", "warmup", "batch_size", "steps", "checkpoint_group")


@dataclass(frozen=True, kw_only=True)
class EndToEndConfig:
    size: str = "small"
    context_length: int = 512
    batch_size: int = 4
    mode: str = "forward_backward"
    warmup: int = 5
    steps: int = 10
    autocast: str = "none"
    compile: bool = False
    attention: str = "naive"
    checkpoint_group: int | None = None
    nvtx: bool = False
    memory_snapshot: str | None = None
    device: str = "cuda" if torch.cuda.is_available() else "cpu"
    seed: int = 0
    x_axis: str = "context_length"  # the field reported as the rows' x_name/x_value (e.g. "warmup")

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.autocast not in AUTOCAST_DTYPES:
            raise ValueError(f"autocast must be one of {tuple(AUTOCAST_DTYPES)}, got {self.autocast!r}")
        if self.warmup < 0 or self.steps < 1 or self.batch_size < 1:
            raise ValueError("need warmup >= 0, steps >= 1, batch_size >= 1")
        get_config(self.size)  # validates the name
        get_attention(self.attention)  # validates the name
        if self.context_length < 1 or (self.checkpoint_group is not None and self.checkpoint_group < 1):
            raise ValueError("need context_length >= 1 and checkpoint_group None or >= 1")
        if self.x_axis not in X_AXES:
            raise ValueError(f"x_axis must be one of {X_AXES}, got {self.x_axis!r}")

    @property
    def dtype_label(self) -> str:
        return "fp32" if self.autocast == "none" else f"{self.autocast}-autocast"

    @property
    def impl_label(self) -> str:
        return self.attention + ("+compile" if self.compile else "")


@dataclass
class Workload:
    """Everything one configuration needs: model, optimizer, batch, and the step function."""

    cfg: EndToEndConfig
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer | None
    inputs: torch.Tensor
    targets: torch.Tensor

    def autocast(self):
        dtype = AUTOCAST_DTYPES[self.cfg.autocast]
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=torch.device(self.cfg.device).type, dtype=dtype)

    def step(self, timer: PhaseTimer) -> None:
        cfg, nvtx = self.cfg, self.cfg.nvtx
        grad_ctx = torch.no_grad() if cfg.mode == "forward" else contextlib.nullcontext()
        with timer.phase("forward"), annotate("forward", nvtx), grad_ctx, self.autocast():
            logits = self.model(self.inputs)
            loss = cross_entropy(logits, self.targets) if cfg.mode != "forward" else None
        if loss is not None:
            with timer.phase("backward"), annotate("backward", nvtx):
                loss.backward()
        if self.optimizer is not None:
            with timer.phase("optimizer"), annotate("optimizer_step", nvtx):
                self.optimizer.step()
        if cfg.mode != "forward":  # untimed: gradients must not accumulate across steps
            (self.optimizer or self.model).zero_grad(set_to_none=True)


def build_workload(cfg: EndToEndConfig) -> Workload:
    torch.manual_seed(cfg.seed)
    mcfg = get_config(cfg.size, context_length=cfg.context_length)
    model = BasicsTransformerLM.from_config(mcfg, attention_impl=cfg.attention, device=cfg.device)
    model.set_checkpointing(cfg.checkpoint_group)
    optimizer = AdamW(model.parameters()) if cfg.mode == "train" else None
    if cfg.compile:
        model = torch.compile(model)
    inputs, targets = random_batch(cfg.batch_size, cfg.context_length, mcfg.vocab_size, device=cfg.device)
    return Workload(cfg, model, optimizer, inputs, targets)


def _config_record(cfg: EndToEndConfig) -> dict[str, Any]:
    mcfg = get_config(cfg.size, context_length=cfg.context_length)
    return {**dataclasses.asdict(cfg), "model": mcfg.as_kwargs(), "num_params": mcfg.num_params()}


def row_fields(cfg: EndToEndConfig, problem: str, **overrides: Any) -> dict[str, Any]:
    """The keywords every results row of one configuration carries (for make_row, failure_row and
    skipped_row): problem, size as name, impl, mode, dtype, the x axis and the config record.
    `overrides` replace any of them (e.g. a study's own impl or x axis)."""
    fields = {
        "problem": problem,
        "name": cfg.size,
        "impl": cfg.impl_label,
        "mode": cfg.mode,
        "dtype": cfg.dtype_label,
        "x_name": cfg.x_axis,
        "x_value": getattr(cfg, cfg.x_axis),
    }
    return fields | {"config": overrides.pop("config", None) or _config_record(cfg)} | overrides


def run_one(cfg: EndToEndConfig, problem: str = "benchmarking_script") -> list[dict[str, Any]]:
    """Measure one configuration; returns tidy rows (failure rows on OOM or error)."""
    common = row_fields(cfg, problem)
    outcome: dict[str, str] = {}
    timer = PhaseTimer(device=cfg.device)
    peak_gib = None
    with capture_failure(outcome):
        work = build_workload(cfg)
        timer.enabled = False
        with annotate("warmup", cfg.nvtx):
            for _ in range(cfg.warmup):
                work.step(timer)
        synchronize(cfg.device)
        if torch.cuda.is_available() and cfg.device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
        if cfg.memory_snapshot:
            torch.cuda.memory._record_memory_history(max_entries=1_000_000)
        timer.enabled = True
        with annotate("measure", cfg.nvtx):
            for i in range(cfg.steps):
                with annotate(f"step_{i}", cfg.nvtx):
                    work.step(timer)
        if cfg.memory_snapshot:
            torch.cuda.memory._dump_snapshot(cfg.memory_snapshot)
            torch.cuda.memory._record_memory_history(enabled=None)
        if torch.cuda.is_available() and cfg.device.startswith("cuda"):
            peak_gib = torch.cuda.max_memory_allocated() / 2**30
        del work
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    if outcome:
        return [
            failure_row(metric=f"{p}_time", unit="ms", note=outcome["note"], **common)
            for p in PHASES[cfg.mode]
        ]
    ms = {k: [x * 1e3 for x in v] for k, v in timer.samples.items()}
    rows = [make_row(metric=f"{p}_time", unit="ms", samples=ms[p], **common) for p in PHASES[cfg.mode]]
    step_ms = [sum(parts) for parts in zip(*(ms[p] for p in PHASES[cfg.mode]))]
    rows.append(make_row(metric="step_time", unit="ms", samples=step_ms, **common))
    if peak_gib is not None:
        rows.append(make_row(metric="peak_memory", unit="GiB", value=peak_gib, **common))
    return rows


def measure(
    config: EndToEndConfig | Sequence[EndToEndConfig],
    *,
    results_dir: str | None = None,
    problem: str = "benchmarking_script",
    save: bool = True,
    progress: bool = True,
) -> list[dict[str, Any]]:
    """Run one configuration or several in order, appending each one's rows as soon as it finishes
    (nothing lost); returns every row. `run_one` measures one configuration without saving."""
    configs = [config] if isinstance(config, EndToEndConfig) else list(config)
    all_rows = []
    for cfg in tqdm(configs, desc=problem, disable=not progress):
        rows = run_one(cfg, problem)
        if save:
            append_rows(problem, rows, results_dir)
        all_rows.extend(rows)
    return all_rows


def grid(**axes: Sequence[Any] | Any) -> list[EndToEndConfig]:
    """Cartesian product of EndToEndConfig fields given as lists (scalars are fixed values)."""
    keys = list(axes)
    values = [v if isinstance(v, list | tuple) else [v] for v in axes.values()]
    return [EndToEndConfig(**dict(zip(keys, combo))) for combo in itertools.product(*values)]


def summary_table(df: pd.DataFrame) -> pd.DataFrame:
    if df.empty:
        return df
    t = df[df.metric.str.endswith("_time") | (df.metric == "peak_memory")].copy()
    t["value"] = t.apply(lambda r: r["note"] if r["note"] else f"{r['mean']:.2f} +- {r['std']:.2f}", axis=1)
    return t.pivot_table(
        index=["name", "impl", "dtype", "mode", "x_value"], columns="metric", values="value", aggfunc="last"
    )


def main(argv: Sequence[str] | None = None) -> pd.DataFrame:
    p = cli.make_parser(
        __doc__,
        "python -m cs336_systems.studies.profiling.end_to_end --size small medium --context-length 256 512 "
        "--mode forward train --compile false true --results-dir /tmp/e2e",
    )
    cli.add_size(p, ["small"], nargs="+")
    p.add_argument("--context-length", nargs="+", type=int, default=[512], help="sequence length(s)")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument(
        "--mode", nargs="+", default=["forward_backward"], choices=MODES, help="what one step does"
    )
    p.add_argument("--warmup", nargs="+", type=int, default=[5], help="untimed warm-up steps")
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument(
        "--autocast", nargs="+", default=["none"], choices=list(AUTOCAST_DTYPES), help="mixed precision"
    )
    p.add_argument(
        "--compile",
        nargs="+",
        type=cli.boolean,
        default=[False],
        help="torch.compile the model (true/false; both to compare)",
    )
    cli.add_attention(p, ["naive"], nargs="+")
    p.add_argument("--checkpoint-group", type=int, default=None, help="blocks per activation checkpoint")
    p.add_argument("--nvtx", action="store_true", help="emit NVTX / record_function ranges")
    p.add_argument(
        "--memory-snapshot", default=None, help="write a CUDA memory snapshot pickle of the timed steps"
    )
    p.add_argument("--device", default=EndToEndConfig().device, choices=["cuda", "cpu"])
    p.add_argument(
        "--x-axis",
        default="context_length",
        choices=X_AXES,
        help="config field reported as the rows' x_name/x_value (e.g. warmup for the warm-up ablation)",
    )
    p.add_argument(
        "--problem", default="benchmarking_script", help="results file name (figures/data/<problem>.csv)"
    )
    cli.add_results_dir(p)
    p.add_argument("--no-save", action="store_true", help="print only; append no rows")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is visible (use --device cpu)")
    with cli.usage_errors(p):
        configs = grid(
            size=args.size,
            context_length=args.context_length,
            batch_size=args.batch_size,
            mode=args.mode,
            warmup=args.warmup,
            steps=args.steps,
            autocast=args.autocast,
            compile=args.compile,
            attention=args.attention,
            checkpoint_group=args.checkpoint_group,
            nvtx=args.nvtx,
            memory_snapshot=args.memory_snapshot,
            device=args.device,
            x_axis=args.x_axis,
        )
    results_dir = None if args.no_save else cli.results_dir_for(args.results_dir)
    print(
        "resolved configs:",
        json.dumps([dataclasses.asdict(c) for c in configs][:3], default=str),
        f"... ({len(configs)} total)" if len(configs) > 3 else "",
    )
    df = pd.DataFrame(measure(configs, problem=args.problem, save=not args.no_save, results_dir=results_dir))
    with pd.option_context("display.width", 200, "display.max_columns", 20):
        print(summary_table(df).to_string())
    return df


if __name__ == "__main__":
    main()
