"""training_step: the project's fastest training step against the stock PyTorch step, in one process.

    python -m cs336_systems.studies.training.train_step --size 2.7B --context-length 512 2048 --batch-size 4
    python -m cs336_systems.studies.training.train_step --quick          # debug model on the CPU, scratch results

Per (size, context), rows under problem "training_step" (the rows of one invocation share the config's
`run_id`; every ratio is of one run, `train_step_facts.with_runs`):
* `compare`: the stock step and ours, built from the same initial weights and timed in interleaved
  rounds (`--rounds` x `--steps` steps each, after `--warmup`); per path the median step and its
  forward / backward / optimizer phases (CUDA events), peak memory, first-step (compile) time and MFU
  against the datasheet bf16 peak and against the bf16 matmul rate measured in this run. Then one
  profiled step of each path, its trace saved beside the rows (`train_step_trace`; `--no-trace`).
  Stock = the same architecture with `F.scaled_dot_product_attention`, `torch.compile(model)`,
  `torch.optim.AdamW(fused=True)` and `F.cross_entropy`, bf16 autocast over fp32 weights.
  Ours = `TrainStepConfig.fastest()` (see `cs336_systems.training.step`) with our attention
  (`--attention`: our Triton FlashAttention-2 on CUDA; SDPA on the CPU, where the Triton interpreter
  cannot run bf16; a non-default attention is named in the row's impl, e.g. "ours +sdpa").
  Only one path is on the device at a time: the other's parameters, gradients, buffers and optimizer
  state are parked in page-locked host memory (`cs336_systems.training.Offloader`) from before its
  first step on, and moved back before its next round, outside the timed region (synchronized before
  and after), so two 2.7B steps fit on one 80 GB GPU.
* `waterfall`: the step with one optimisation added at a time (`STAGES`), each built afresh.
* `bandwidth`: device copy GB/s and the fused AdamW's GB/s (28 bytes per parameter) on the shapes
  of the model's first blocks.
* `check` (`--parts check`): 20 steps (4 in a quick run) of ours and of the plain reference step (same
  weights and batches, reference AdamW, no fusions, bf16 autocast): the loss of every step.

Peak memory of a path (`peak_memory_gib`) = `torch.cuda.max_memory_allocated()` over its timed rounds
(reset before each), with the other path parked off the device: everything the path holds, its
persistent tensors included. A graphed step (`--cuda-graph`: ours replayed as one CUDA graph, timed
whole, without phases) allocates nothing while it replays and keeps its graph's memory pool reserved:
its peak is `torch.cuda.max_memory_reserved()`, after an untimed step that captures again once it is
back on the device. On the CPU, where it cannot be measured: the persistent tensors only.
`persistent_memory_gib`: the path's parameters, gradients between steps (none), buffers and optimizer
state (`cs336_systems.training.step_tensors`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import itertools
import time
from collections.abc import Sequence
from typing import Any

import pandas as pd
import torch
import torch.nn.functional as F
from torch import Tensor

from cs336_systems.accounting.hardware import peak_flops
from cs336_systems.measure.results import (
    append_rows,
    capture_failure,
    device_name,
    failure_row,
    make_row,
)
from cs336_systems.measure.timing import kernel_time, synchronize
from cs336_systems.model import MODEL_SIZES, BasicsTransformerLM, ModelConfig
from cs336_systems.model.loss import random_batch
from cs336_systems.studies.training import train_step_cli, train_step_trace
from cs336_systems.studies.training.train_step_cli import default_attention
from cs336_systems.studies.training.train_step_facts import (
    PHASES,
    STAGES,
    facts,  # noqa: F401 (the study's facts, kept beside its tables)
)
from cs336_systems.training import FusedAdamW, Offloader, TrainStepConfig, build_train_step, step_tensors
from cs336_systems.training.fused_adamw import mixed_precision_groups

PROBLEM = "training_step"
# the command-line options recorded as each context length's run config
RUN_CONFIG_KEYS = ("size", "batch_size", "rounds", "steps", "warmup", "compile", "attention", "cuda_graph")


class StockStep:
    """What a PyTorch user writes: SDPA, torch.compile(model), fused torch AdamW, bf16 autocast."""

    def __init__(self, model: BasicsTransformerLM, *, compile: bool, lr: float, weight_decay: float):
        model.set_attention("sdpa")
        self.model = model
        self.forward = torch.compile(model) if compile else model
        fused = next(model.parameters()).is_cuda
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, fused=fused)

    def on_stream(self):
        return contextlib.nullcontext()

    def loss(self, tokens: Tensor, targets: Tensor) -> Tensor:
        with torch.autocast(tokens.device.type, dtype=torch.bfloat16):
            logits = self.forward(tokens)
            return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def graphed(step) -> bool:
    """A step replayed as one CUDA graph (`TrainStepConfig.cuda_graph`): timed whole, no phases."""
    return bool(getattr(getattr(step, "cfg", None), "cuda_graph", False))


def timed_step(step, tokens: Tensor, targets: Tensor) -> tuple[Tensor, dict[str, float] | None]:
    """One step in three phases (a graphed step: as a whole); on CUDA returns events to read after a
    sync, else host seconds."""
    cuda = tokens.is_cuda
    marks = []

    def mark():
        if cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            marks.append(ev)
        else:
            marks.append(time.perf_counter())

    if graphed(step):
        mark()
        loss = step(tokens, targets)
        mark()
        return loss, marks
    with step.on_stream():
        mark()
        loss = step.loss(tokens, targets)
        mark()
        loss.backward()
        mark()
        step.optimizer.step()
        step.optimizer.zero_grad(set_to_none=True)
        mark()
    return loss.detach(), marks


def phase_ms(marks) -> dict[str, float]:
    if isinstance(marks[0], float):
        gaps = [(b - a) * 1e3 for a, b in itertools.pairwise(marks)]
    else:
        gaps = [a.elapsed_time(b) for a, b in itertools.pairwise(marks)]
    if len(gaps) != len(PHASES):  # a graphed step: one replay, no phases
        return {"step": sum(gaps)}
    return dict(zip(PHASES, gaps)) | {"step": sum(gaps)}


def persistent_bytes(step) -> int:
    """Bytes of a step's parameters, gradients, buffers and optimizer state (each tensor once)."""
    return sum(t.nbytes for t in step_tensors(step))


def step_flops(cfg: ModelConfig, batch: int, ctx: int) -> float:
    """Model FLOPs of one step: 3 x forward matmuls (weights incl. LM head, causal attention halved)."""
    d = cfg.d_model
    weights = cfg.num_layers * (4 * d * d + 3 * d * cfg.d_ff) + cfg.vocab_size * d
    attention = cfg.num_layers * 4 * batch * ctx * ctx * d * 0.5
    return 3.0 * (2.0 * batch * ctx * weights + attention)


def matmul_peak(device) -> float:
    """Measured bf16 matmul FLOP/s (8192^3 on CUDA; a small product on the CPU)."""
    n = 8192 if torch.device(device).type == "cuda" else 256
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    ms = kernel_time(lambda: a @ b, device=device)["p50"]
    return 2 * n**3 / (ms * 1e-3)


def bandwidth_rows(cfg: ModelConfig, device, run_cfg: dict) -> list[dict]:
    """Copy bandwidth and the fused AdamW's effective bandwidth on the first blocks' shapes."""
    cuda = torch.device(device).type == "cuda"
    n = 2**28 if cuda else 2**20
    buffers = [torch.empty(n, device=device), torch.empty(n, device=device)]
    copy_ms = kernel_time(lambda: buffers[1].copy_(buffers[0]), device=device)["p50"]
    buffers.clear()
    blocks = min(cfg.num_layers, 8)
    model = BasicsTransformerLM.from_config(cfg.replace(num_layers=blocks), device=device)
    opt = FusedAdamW(mixed_precision_groups(model))
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    numel = sum(p.numel() for p in model.parameters())
    adamw_ms = kernel_time(opt.step, device=device)["p50"]
    rows = []
    bandwidth = {"problem": PROBLEM, "name": "bandwidth", "metric": "bandwidth", "unit": "GB/s"}
    for impl, ms, nbytes in [("copy", copy_ms, 2 * 4 * n), ("fused_adamw", adamw_ms, 28 * numel)]:
        config = run_cfg | {"bytes": nbytes, "ms": ms, "blocks": blocks}
        rows.append(make_row(impl=impl, value=nbytes / (ms * 1e-3) / 1e9, config=config, **bandwidth))
    return rows


def _at_context(run_cfg: dict) -> dict[str, Any]:
    """Row keywords of this run: the problem, its context length as the x axis, and `run_cfg` as config."""
    at = {"x_name": "context_length", "x_value": run_cfg["context_length"]}
    return {"problem": PROBLEM, "config": run_cfg, **at}


def _step_failure(name: str, impl: str, note: str, run_cfg: dict) -> dict[str, Any]:
    """The row of a path whose step could not run (an OOM or an error); the other paths go on."""
    return failure_row(name=name, impl=impl, metric="step_ms", unit="ms", note=note, **_at_context(run_cfg))


def _rows_for_path(path: str, name: str, times: list[dict], extra: dict, run_cfg: dict) -> list[dict]:
    train = {"name": name, "impl": path, "mode": "train", "dtype": "bf16"}
    timed = [(f"{m}_ms", [t[m] for t in times]) for m in ("step", *PHASES) if all(m in t for t in times)]
    rows = [
        make_row(metric=metric, unit="ms", samples=samples, **train, **_at_context(run_cfg | extra))
        for metric, samples in timed
    ]
    rows += [
        make_row(metric=metric, unit=unit, value=value, **train, **_at_context(run_cfg))
        for metric, (unit, value) in extra.items()
        if isinstance(value, float | int)
    ]
    return rows


def ours_config(args) -> TrainStepConfig:
    """`TrainStepConfig.fastest()` with the CLI's choices for our step."""
    return TrainStepConfig.fastest(
        attention=args.attention,
        compile=args.compile,
        compile_mode=args.compile_mode,
        overlap=args.overlap,
        overlap_programs=args.overlap_programs or None,
        cuda_graph=args.cuda_graph,
        lr=args.lr,
        weight_decay=args.weight_decay,
    )


def ours_label(args) -> str:
    """'ours' for `TrainStepConfig.fastest()` with the default attention; other choices are named."""
    label = "ours"
    if args.attention != default_attention(args.device):
        label += f" +{args.attention}"
    if not args.overlap:
        label += " -overlap"
    elif args.overlap_programs:
        label += f" +overlap grid {args.overlap_programs}"
    if args.compile_mode != "default":
        label += f" +{args.compile_mode}"
    if args.cuda_graph:
        label += " +cuda_graph"
    return label


def _build(path: str, cfg: ModelConfig, state: dict, args, stage: dict | None = None):
    model = BasicsTransformerLM.from_config(cfg, device=args.device)
    model.load_state_dict(state)
    hp = dict(lr=args.lr, weight_decay=args.weight_decay)
    if path == "stock":
        return StockStep(model, compile=args.compile, **hp)
    if path.startswith("ours"):
        return build_train_step(model, ours_config(args))
    return build_train_step(model, TrainStepConfig(**stage, **hp))


def _first_step_s(step, batch) -> float:
    start = time.perf_counter()
    timed_step(step, *batch)
    synchronize()
    return time.perf_counter() - start


def compare(cfg: ModelConfig, args, run_cfg: dict, state: dict, batches, peak: float) -> list[dict]:
    """Stock vs ours, interleaved rounds, one path on the device at a time; returns rows (a failure row
    per path that could not run)."""
    paths = ["stock", ours_label(args)]
    steps, parking, times, extra = {}, {}, {p: [] for p in paths}, {}
    flops = step_flops(cfg, args.batch_size, run_cfg["context_length"])
    datasheet = peak_flops(device_name(), "bf16")
    cuda = torch.device(args.device).type == "cuda"
    rows = []

    def failed(path: str, note: str) -> None:  # an OOM or error is a row, and the other paths go on
        rows.append(_step_failure("compare", path, note, run_cfg))
        steps.pop(path, None)
        parking.pop(path, None)
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()

    def only_on_device(path: str) -> None:
        """Park every other path, then bring `path` back if it is parked (outside any timing)."""
        for other, offloader in parking.items():
            if other != path and not offloader.parked:
                offloader.park()
        if cuda:
            torch.cuda.empty_cache()  # the parked path's cached blocks (cut to its tensors) go back
        if path in parking and parking[path].parked:
            parking[path].unpark()
            if graphed(steps[path]):  # parking dropped its graphs: capture again, untimed
                timed_step(steps[path], *batches[0])
                synchronize()
                torch.cuda.empty_cache()  # the eager pool's free blocks; the graph's pool stays

    for path in paths:
        outcome: dict = {}
        with capture_failure(outcome):
            only_on_device(path)
            steps[path] = _build(path, cfg, state, args)
            parking[path] = Offloader(steps[path])
            extra[path] = {"first_step_s": ("s", _first_step_s(steps[path], batches[0]))}
            for i in range(args.warmup):
                timed_step(steps[path], *batches[i % len(batches)])
            extra[path]["persistent_memory_gib"] = ("GiB", persistent_bytes(steps[path]) / 2**30)
        if outcome:
            failed(path, outcome["note"])
    peaks = {p: 0 for p in steps}
    for r in range(args.rounds):
        for path in list(steps)[:: 1 if r % 2 == 0 else -1]:
            outcome = {}
            with capture_failure(outcome):
                only_on_device(path)
                synchronize()
                if cuda:
                    torch.cuda.reset_peak_memory_stats()
                marks = [timed_step(steps[path], *batches[i % len(batches)])[1] for i in range(args.steps)]
                synchronize()
                times[path] += [phase_ms(m) for m in marks]
            if outcome:
                failed(path, outcome["note"] + f" (in round {r + 1})")
            elif cuda:  # a graph's pool stays reserved between replays, which allocate nothing
                held = (
                    torch.cuda.max_memory_reserved()
                    if graphed(steps[path])
                    else torch.cuda.max_memory_allocated()
                )
                peaks[path] = max(peaks[path], held)
    if args.trace and not args.no_save:  # one profiled step of each path: its kernels by phase
        for path in list(steps):
            outcome = {}
            with capture_failure(outcome):
                only_on_device(path)
                where = train_step_trace.trace_file(args.results_dir, path, run_cfg["context_length"])
                saved = train_step_trace.save_profile(steps[path], batches[0], where)
                print(
                    f"{path}: trace -> {saved}" if saved else f"{path}: the profiler saw no kernels",
                    flush=True,
                )
            if outcome:
                print(f"{path}: no trace ({outcome['note']})", flush=True)
    for path, step in steps.items():
        med = pd.Series([t["step"] for t in times[path]]).median()
        e = extra[path] | {
            "peak_memory_gib": ("GiB", (peaks[path] if cuda else persistent_bytes(step)) / 2**30),
            "tflops": ("TFLOP/s", flops / (med * 1e-3) / 1e12),
            "mfu_measured_peak": ("fraction", flops / (med * 1e-3) / peak),
        }
        if datasheet:
            e["mfu_datasheet"] = ("fraction", flops / (med * 1e-3) / datasheet)
        rows += _rows_for_path(path, "compare", times[path], e, run_cfg)
    steps.clear()
    parking.clear()
    return rows


def waterfall(cfg: ModelConfig, args, run_cfg: dict, state: dict, batches) -> list[dict]:
    rows, stage = [], {}
    for label, change in STAGES:
        stage = stage | change
        if not args.compile:
            stage.pop("compile", None)
        if stage.get("attention") == "flash_triton" and not torch.cuda.is_available():
            stage["attention"] = "sdpa"  # the interpreter cannot run bf16 attention
        outcome: dict = {}
        with capture_failure(outcome):
            step = _build("stage", cfg, state, args, stage)
            first = _first_step_s(step, batches[0])
            for i in range(args.warmup):
                timed_step(step, *batches[i % len(batches)])
            marks = [timed_step(step, *batches[i % len(batches)])[1] for i in range(args.steps)]
            synchronize()
            extra = {"first_step_s": ("s", first)}
            times = [phase_ms(m) for m in marks]
            rows += _rows_for_path(label, "waterfall", times, extra, run_cfg | {"stage": stage})
            del step
        if outcome:
            rows.append(_step_failure("waterfall", label, outcome["note"], run_cfg | {"stage": stage}))
        torch._dynamo.reset()  # compiled code must not keep the stage's model alive
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return rows


def check(cfg: ModelConfig, args, state: dict, batches, num_steps: int = 20, run_id: str = "") -> list[dict]:
    """Loss of each of `num_steps` steps: ours vs the plain reference step (reference AdamW, no fusions)."""
    attention = "sdpa" if not torch.cuda.is_available() else args.attention
    optimizer = {"lr": args.lr, "weight_decay": args.weight_decay}
    configs = {
        "reference": TrainStepConfig(autocast=True, attention="sdpa", **optimizer),
        "ours": dataclasses.replace(ours_config(args), attention=attention),
    }
    loss = {"problem": PROBLEM, "name": "check", "mode": "train", "dtype": "bf16", "metric": "loss"}
    check_config = {"size": args.size_name, "context_length": cfg.context_length, "run_id": run_id}
    loss |= {"x_name": "step", "unit": "nats", "config": check_config}
    rows = []
    for name, tc in configs.items():
        model = BasicsTransformerLM.from_config(cfg, device=args.device)
        model.load_state_dict(state)
        step = build_train_step(model, tc)
        losses = [step(*batches[i % len(batches)]).item() for i in range(num_steps)]
        rows += [make_row(impl=name, x_value=i + 1, value=v, **loss) for i, v in enumerate(losses)]
        del step, model
        gc.collect()
    return rows


def measure(config: argparse.Namespace, *, results_dir=None) -> list[dict]:
    """The parts (`config.parts`) at each context length; `config` holds the CLI's fields (`train_step_cli.parser`),
    `results_dir` (or `config.results_dir`) receives the rows unless `config.no_save`."""
    args = config
    rows: list[dict] = []
    device = torch.device(args.device)
    run_id = f"{time.time_ns():x}"  # the rows of one invocation share it (train_step_facts.with_runs)
    peak = matmul_peak(device)
    matmul = {"problem": PROBLEM, "name": "matmul_peak", "impl": "torch.mm", "dtype": "bf16"}
    rows.append(
        make_row(metric="tflops", unit="TFLOP/s", value=peak / 1e12, config={"run_id": run_id}, **matmul)
    )
    for ctx in args.context_length:
        cfg = MODEL_SIZES[args.size].replace(context_length=ctx)
        run_cfg = {key: getattr(args, key) for key in RUN_CONFIG_KEYS} | {
            "context_length": ctx,
            "run_id": run_id,
        }
        run_cfg["ours"] = dataclasses.asdict(ours_config(args))
        torch.manual_seed(0)
        state = {
            k: v.detach().cpu()
            for k, v in BasicsTransformerLM.from_config(cfg, device=device).state_dict().items()
        }
        gen = torch.Generator().manual_seed(1)
        batches = [
            random_batch(args.batch_size, ctx, cfg.vocab_size, device=device, generator=gen) for _ in range(4)
        ]
        if "bandwidth" in args.parts and ctx == args.context_length[0]:
            rows += bandwidth_rows(cfg, device, run_cfg)
        if "check" in args.parts and ctx == args.context_length[0]:
            rows += check(cfg, args, state, batches, num_steps=4 if args.quick else 20, run_id=run_id)
        if "compare" in args.parts:
            rows += compare(cfg, args, run_cfg, state, batches, peak)
        if "waterfall" in args.parts:
            rows += waterfall(cfg, args, run_cfg, state, batches)
        state = batches = None  # the host copy of the weights goes before the next context's is made
        print(summary(pd.DataFrame(rows)).to_string(), flush=True)
    if not args.no_save:
        print("rows ->", append_rows(PROBLEM, rows, results_dir or args.results_dir))
    return rows


def summary(df: pd.DataFrame) -> pd.DataFrame:
    """Median step time per (name, impl, context) with the ours/stock ratio, for printing."""
    t = df[df.metric == "step_ms"]
    if t.empty:
        return t
    return t.pivot_table(index=["name", "impl"], columns="x_value", values="p50", sort=False)


def main(argv: Sequence[str] | None = None) -> pd.DataFrame:
    args = train_step_cli.checked(train_step_cli.parser(__doc__).parse_args(argv))
    return pd.DataFrame(measure(args))


if __name__ == "__main__":
    main()
