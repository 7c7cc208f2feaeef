"""The one runner of the distributed studies: launch N ranks, run variants in order, write rows.

A study (DDP in `train_bench`, optimizer-state sharding in `sharding_bench`, FSDP in `fsdp_bench`)
describes itself with a `Study`: its results problem, its module (what torchrun runs), how one variant
is measured on every rank, and the failure row of a variant that could not be measured. Then:

* driver (`run_study`, no torchrun): launches the study's module under torchrun through
  `distributed.launch.run_variants`; when a launch dies, the first unfinished variant gets a failure
  row ("OOM" or its rank's own error) and the rest are launched again. With the NCCL backend and
  fewer GPUs than ranks, every variant gets a "not run" row and nothing is launched.
* worker (`run_worker`, under torchrun): sets up the process group and measures the variants in
  order; rank 0 appends each variant's rows as soon as it is done, so a later crash loses nothing.

[Note: why a failed variant ends the worker] A rank that fails (out of memory, say) leaves its peers
blocked inside a collective of that variant; a barrier or a group teardown would pair with that
collective and hang until the timeout. So the failing rank writes "FAIL <variant> <rank> <reason>"
to the progress file and exits; torchrun stops the other ranks and the driver relaunches the rest.
"""

from __future__ import annotations

import argparse
import json
import re
import tempfile
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from cs336_systems.distributed.launch import run_variants
from cs336_systems.distributed.process_group import cleanup_process_group, rank0_print, setup_process_group
from cs336_systems.measure import cli
from cs336_systems.measure.annotations import annotate
from cs336_systems.measure.results import append_rows, child_env, failure_row, load_results, make_row
from cs336_systems.measure.timing import PhaseTimer, synchronize
from cs336_systems.model import BasicsTransformerLM, get_config, random_batch
from cs336_systems.studies.distributed.rank_memory import allocated, reset_peak

Rows = list[dict[str, Any]]


@dataclass(frozen=True)
class Study:
    """What the runner needs to know about one distributed study.

    `measure(cfg, label, device, results_dir)` runs one variant on every rank and returns (rows on
    rank 0, a per-variant value kept for `finish`); `failure_rows(cfg, label, note, world_size)` are
    the rows recorded for a variant that failed; `finish(cfg, kept, world_size)` (optional) returns
    rows computed from the kept values of the variants this worker measured.
    """

    problem: str
    module: str
    measure: Callable[[Any, str, torch.device, str | None], tuple[Rows, Any]]
    failure_rows: Callable[[Any, str, str, int], Rows]
    finish: Callable[[Any, dict[str, Any], int], Rows] | None = None

    @property
    def tag(self) -> str:
        return self.module.rsplit(".", 1)[-1]


# --------------------------------------------------------------------------------------------------
# Worker
# --------------------------------------------------------------------------------------------------


def run_worker(
    study: Study,
    cfg: Any,
    labels: Sequence[str],
    *,
    backend: str,
    pg_timeout_s: float | None = None,
    progress_file: str | None = None,
    results_dir: str | None = None,
) -> None:
    """Body of one torchrun process: measure `labels` in order ([Note: why a failed variant ends the worker])."""
    timeout = {} if pg_timeout_s is None else {"timeout_s": pg_timeout_s}
    device = setup_process_group(backend, **timeout)
    current = None
    kept: dict[str, Any] = {}
    try:
        rank0_print(
            f"[{study.tag}] {dist.get_world_size()} x {device.type} ({backend}); variants {list(labels)}"
        )
        for label in labels:
            current = label
            rows, kept[label] = study.measure(cfg, label, device, results_dir)
            if dist.get_rank() == 0:
                append_rows(study.problem, rows, results_dir)
                rank0_print(f"  {label:>14}: {_step_summary(rows)}")
                log_progress(progress_file, f"DONE {label}")
        current = None
        if study.finish is not None and dist.get_rank() == 0:
            append_rows(study.problem, study.finish(cfg, kept, dist.get_world_size()), results_dir)
    except BaseException as exc:
        reason = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
        log_progress(progress_file, f"FAIL {current} {dist.get_rank()} {reason}")
        raise
    cleanup_process_group()


def _step_summary(rows: Rows) -> str:
    step = next((r for r in rows if r["metric"] == "step_time"), None)
    if step is None:
        return f"{len(rows)} rows"
    return f"step {step['mean']:.1f} +- {step['std']:.1f} ms ({len(rows)} rows)"


def log_progress(path: str | None, line: str) -> None:
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


# --------------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------------


_PEER_FAILURE = re.compile(r"connection closed|connection reset|broken pipe|timed? ?out|sigterm|nccl", re.I)


def failure_note(fail_lines: Sequence[str], launch_note: str) -> str:
    """OOM, else the root cause: a rank's own error rather than a peer noticing the crash."""
    text = " ".join(fail_lines) + " " + launch_note
    if "out of memory" in text.lower() or launch_note == "OOM":
        return "OOM"
    own = [ln for ln in fail_lines if not _PEER_FAILURE.search(ln)]
    if own or fail_lines:
        return f"error: {(own or fail_lines)[0]}"[:200]
    return launch_note


def run_study(
    study: Study,
    cfg: Any,
    labels: Sequence[str],
    launch_args: Callable[[list[str], str], Sequence[str]],
    *,
    backend: str,
    nproc: int = 2,
    results_dir: str | None = None,
    timeout_s: float | None = None,
    env: dict[str, str] | None = None,
) -> list[str]:
    """Run every variant under torchrun (relaunching after a crash); returns the labels that failed.

    `launch_args(remaining, progress_file)` are the module's arguments for a launch of the variants
    `remaining`; the worker must pass `progress_file` on to `run_worker`. The default time limit of
    a launch is 120 s plus 90 s per variant. `env`: extra environment of the ranks.
    """
    labels = list(labels)
    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend == "nccl" and n_gpus < nproc:
        note = f"not run: needs {nproc} GPUs, {n_gpus} visible"
        append_rows(
            study.problem, [r for v in labels for r in study.failure_rows(cfg, v, note, nproc)], results_dir
        )
        print(f"[{study.tag}] {note}")
        return labels
    with tempfile.NamedTemporaryFile("r", suffix=".progress") as progress:
        log = lambda: Path(progress.name).read_text().splitlines()

        def record_failure(label: str, launch_note: str) -> None:
            fails = [
                ln.split(" ", 3)[3] for ln in log() if ln.startswith(f"FAIL {label} ") and ln.count(" ") >= 3
            ]
            note = failure_note(fails, launch_note)
            append_rows(study.problem, study.failure_rows(cfg, label, note, nproc), results_dir)
            print(f"[{study.tag}] variant {label} failed ({note})")

        return run_variants(
            study.module,
            labels,
            lambda remaining: launch_args(remaining, progress.name),
            finished=lambda: {ln.split()[1] for ln in log() if ln.startswith("DONE ")},
            on_failure=record_failure,
            nproc=nproc,
            timeout_s=timeout_s if timeout_s is not None else 120.0 + 90.0 * len(labels),
            env=child_env(results_dir) | (env or {}),
        )


# --------------------------------------------------------------------------------------------------
# Studies configured by a frozen dataclass with `variants`, `backend` and `run_id` (sharding, FSDP)
# --------------------------------------------------------------------------------------------------


def check_training_config(cfg: Any, known: Sequence[str]) -> None:
    """Clear errors for a bad size, unknown variants (also in `cfg.trace`) or step counts."""
    get_config(cfg.size)
    unknown = (set(cfg.variants) | set(getattr(cfg, "trace", ()))) - set(known)
    if unknown:
        raise ValueError(f"unknown variants {sorted(unknown)}; known: {tuple(known)}")
    if cfg.warmup < 0 or cfg.steps < 1 or cfg.batch_per_rank < 1:
        raise ValueError("need warmup >= 0, steps >= 1, batch_per_rank >= 1")


def add_worker_arguments(parser: argparse.ArgumentParser) -> None:
    """The driver-to-worker flags (hidden): the JSON config and the progress file."""
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--progress-file", default=None, help=argparse.SUPPRESS)


def add_training_arguments(
    parser: argparse.ArgumentParser, defaults: Any, known: Sequence[str], *, timeout_s: float
) -> None:
    """The flags of a dataclass-configured study's CLI (`defaults` is its default config)."""
    add_worker_arguments(parser)
    cli.add_size(parser, defaults.size)
    parser.add_argument("--context-length", type=int, default=defaults.context_length)
    parser.add_argument("--batch-per-rank", type=int, default=defaults.batch_per_rank)
    parser.add_argument("--warmup", type=int, default=defaults.warmup)
    parser.add_argument("--steps", type=int, default=defaults.steps)
    cli.add_attention(parser, defaults.attention)
    parser.add_argument("--variants", nargs="+", default=list(known), choices=known)
    parser.add_argument(
        "--backend", default="nccl" if torch.cuda.is_available() else "gloo", choices=["nccl", "gloo"]
    )
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="CPU smoke run: gloo, debug model, 2 steps")
    cli.add_results_dir(parser)
    parser.add_argument("--figures-dir", default=None, help="render the figures here after measuring")
    parser.add_argument("--timeout", type=float, default=timeout_s, help="seconds per torchrun launch")


def training_fields(args: argparse.Namespace, quick: dict[str, Any]) -> dict[str, Any]:
    """The config fields given by `add_training_arguments`' flags (`quick` overrides them with --quick)."""
    fields = dict(
        size=args.size,
        context_length=args.context_length,
        batch_per_rank=args.batch_per_rank,
        warmup=args.warmup,
        steps=args.steps,
        attention=args.attention,
        variants=tuple(args.variants),
        backend=args.backend,
    )
    return {**fields, **(quick if args.quick else {})}


def checked_config(
    parser: argparse.ArgumentParser, args: argparse.Namespace, config_class: type, fields: dict[str, Any]
) -> tuple[Any, str]:
    """The run's config and results directory, or a usage error (exit 2) before anything runs:
    a bad field, a launch the hardware cannot run (NCCL without a GPU per rank), an unwritable
    results directory. Quick runs get a scratch directory unless told otherwise."""
    with cli.usage_errors(parser):
        cfg = config_class(**fields)
        cli.check_launch(cfg.backend, args.nproc, args.timeout)
    return cfg, str(cli.results_dir_for(args.results_dir, quick=args.quick))


def run_config_worker(study: Study, config_class: type, args: argparse.Namespace) -> None:
    """Worker entry of a dataclass-configured study: `--worker` holds the config as JSON."""
    raw = json.loads(args.worker)
    cfg = config_class(**{k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()})
    run_worker(study, cfg, cfg.variants, backend=cfg.backend, progress_file=args.progress_file)


def config_cli(parser, args, study: Study, config_class: type, fields: Callable[[], dict[str, Any]], run):
    """The CLI body of a dataclass-configured study: a worker runs its variants; the driver checks the
    config (usage errors before any work), prints it and calls `run(cfg, nproc=..., ...)`."""
    if args.worker is not None:
        run_config_worker(study, config_class, args)
        return None
    cfg, results_dir = checked_config(parser, args, config_class, fields())
    print("resolved config:", json.dumps(asdict(cfg)), flush=True)
    return run(
        cfg, nproc=args.nproc, results_dir=results_dir, figures_dir=args.figures_dir, timeout_s=args.timeout
    )


def step_failure_rows(problem: str, cfg: Any, impl: str, dtype: str, note: str, world_size: int) -> Rows:
    """The one failure row (metric step_time) of a variant of a dataclass-configured study."""
    keys = dict(problem=problem, name=cfg.size, impl=impl, mode="train", dtype=dtype, config=asdict(cfg))
    return [
        failure_row(x_name="world_size", x_value=world_size, metric="step_time", unit="ms", note=note, **keys)
    ]


def run_config_study(
    study: Study,
    cfg: Any,
    *,
    nproc: int,
    results_dir: Any = None,
    timeout_s: float | None = None,
    env: dict[str, str] | None = None,
):
    """Driver of a dataclass-configured study; returns the rows of this run (`cfg.run_id`, made here
    when the config has none). `env`: extra environment of the ranks."""
    if not cfg.run_id:
        cfg = replace(cfg, run_id=uuid.uuid4().hex[:8])
    results = None if results_dir is None else str(results_dir)
    run_study(
        study,
        cfg,
        cfg.variants,
        lambda rest, progress: [
            "--worker",
            json.dumps(asdict(replace(cfg, variants=tuple(rest)))),
            "--progress-file",
            progress,
        ],
        backend=cfg.backend,
        nproc=nproc,
        results_dir=results,
        timeout_s=timeout_s,
        env=env,
    )
    df = load_results(study.problem, results_dir)
    return df[df.config_json.str.contains(cfg.run_id)] if not df.empty else df


# --------------------------------------------------------------------------------------------------
# What every study builds and writes
# --------------------------------------------------------------------------------------------------


def build_model(cfg: Any, device: torch.device, *, seed: int = 0):
    """(model config, the Basics LM of `cfg.size` / `cfg.context_length` / `cfg.attention`, seeded)."""
    mcfg = get_config(cfg.size, context_length=cfg.context_length)
    torch.manual_seed(seed)
    return mcfg, BasicsTransformerLM.from_config(mcfg, attention_impl=cfg.attention, device=device)


def rank_batch(batch: int, context_length: int, vocab_size: int, device: torch.device, seed: int):
    """Random (inputs, targets) of this rank: each rank its own shard of the global batch."""
    generator = torch.Generator().manual_seed(seed + dist.get_rank())
    return random_batch(batch, context_length, vocab_size, device=device, generator=generator)


def gather_to_rank0(obj: Any) -> list[Any] | None:
    """Every rank's `obj` on rank 0 (None on the others)."""
    objs: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(objs, obj)
    return objs if dist.get_rank() == 0 else None


def phase_time_rows(per_rank: Sequence[dict[str, list[float]]], steps: int, **keys: Any) -> Rows:
    """`<phase>_time` rows (ms) and their sum `step_time`: each timed step counts at its slowest rank.

    `per_rank[r][phase]` are rank r's per-step durations in seconds (a `PhaseTimer`'s samples).
    """
    phases = {k: [max(s[k][i] for s in per_rank) * 1e3 for i in range(steps)] for k in per_rank[0]}
    rows = [
        make_row(metric=f"{phase}_time", unit="ms", samples=samples, **keys)
        for phase, samples in phases.items()
    ]
    step = [sum(parts) for parts in zip(*phases.values(), strict=True)]
    return [*rows, make_row(metric="step_time", unit="ms", samples=step, **keys)]


def train_phased(
    *,
    forward_backward: Callable[[], None],
    grad_sync: Callable[[], None],
    optimizer: torch.optim.Optimizer,
    device: torch.device,
    warmup: int,
    steps: int,
    range_prefix: str = "",
    on_point: Callable[[int, str, float], None] | None = None,
    reset_peak_before_step: bool = False,
) -> PhaseTimer:
    """`warmup` + `steps` iterations, phases forward_backward, grad_sync, optimizer bracketed by device
    synchronisation (the handout's protocol); returns the timer of the timed iterations.

    `on_point(iteration, "before_step" | "after_step", allocated at the iteration's start)` is called
    after the gradient synchronisation and after the optimizer step. The allocator's peak is reset at
    the start of every iteration, and also before the optimizer step if `reset_peak_before_step`.
    """
    timer = PhaseTimer(device=device)
    for it in range(warmup + steps):
        timer.enabled = it >= warmup
        reset_peak(device)
        start = allocated(device)
        with timer.phase("forward_backward"), annotate(f"{range_prefix}forward_backward"):
            forward_backward()
        with timer.phase("grad_sync"), annotate(f"{range_prefix}grad_sync"):
            grad_sync()
        synchronize(device)
        if on_point is not None:
            on_point(it, "before_step", start)
        if reset_peak_before_step:
            reset_peak(device)
        with timer.phase("optimizer"), annotate(f"{range_prefix}optimizer_step"):
            optimizer.step()
        synchronize(device)
        if on_point is not None:
            on_point(it, "after_step", start)
        optimizer.zero_grad(set_to_none=True)
    return timer
