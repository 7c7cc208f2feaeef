"""training_leaderboard: the 2026 leaderboard's training step (8B config), ours against stock FSDP2, in one run.

    python -m cs336_systems.studies.training.leaderboard --nproc 2 --cold            # the protocol, 2 GPUs
    python -m cs336_systems.studies.training.leaderboard --nproc 1 --layers 34 8     # one GPU, batch 1
    python -m cs336_systems.studies.training.leaderboard --quick                     # CPU, gloo, 2 ranks

The protocol (HANDOUT_SPEC 5.2) and the choices made here:
* inputs, targets = torch.randint(high=vocab, size=(2, ranks * batch_per_rank, T)) from one seeded
  generator on every rank; rank r takes rows [r * batch_per_rank, (r + 1) * batch_per_rank) (one
  sequence per GPU by default: batch 2 on 2 GPUs, batch 1 on one);
* the project's BasicsTransformerLM in the config (`--size`, `--layers` overrides the depth for the
  full-width model at fewer layers), causal, initialised from one seed (the same weights for every
  path); attention: ours `--attention` (default our FlashAttention, "flash_triton": the rules say
  "The implementation must be your own", so only it makes a valid entry; "sdpa_cudnn" and "sdpa"
  remain as labelled experiments), both stock steps plain SDPA (PyTorch picks the backend: cuDNN at
  the 8B shape on Hopper, recorded as a row);
* precision (`--param-modes`): "bf16" = parameters and AdamW state in bf16 (the config's torch_dtype
  read literally, the headline); "fp32_master" = float32 master parameters, bf16 compute;
  every path runs in the same mode (leaderboard_stock.py says how the stock steps do);
* AdamW with default hyperparameters (lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight decay 0.01): the
  project's AdamW semantics for ours, torch.optim.AdamW(fused=True) for stock;
* the step: zero_grad(set_to_none=True), forward with the loss (the mean cross-entropy, i.e. the
  protocol's cross_entropy(logits, targets).sum() of a mean; both paths compute it chunked without
  materialising the logits), backward, optimizer step; timed by `measure.timing.do_bench_all_ranks`,
  i.e. do_bench(step, rep=--rep-ms, warmup=--warmup-ms) with every rank making the same calls and
  each call counted at its slowest rank; the headline is do_bench's statistic, the mean (p50 too);
* `--cold`: TRITON_CACHE_DIR and TORCHINDUCTOR_CACHE_DIR point at fresh directories for the ranks;
  the wall time of the whole run (from the launch of this process) is a row. Ours runs first in
  every configuration, so its compile and autotuning start from the empty caches.

Paths (`--paths`): "stock", the first attempt (FSDP2, every block recomputed, compiled blocks), kept
unchanged so results stay comparable across commits; "stock_tuned", torchtitan's recipe (FSDP2,
selective activation checkpointing on as few blocks as memory needs, compiled blocks, fused AdamW,
chunked loss; leaderboard_stock.py); "ours":

Ours (cs336_systems.training.leaderboard): ZeRO-2 over flat per-unit buffers, the fused AdamW in the
mode's precision on the local shard, the chunked fused LM-head + cross-entropy, each block compiled,
and only the first k blocks checkpointed (`--keep-attention`: keeping their attention's outputs;
`--keep-matmuls`: the last m of them also their matmuls'), k and m from `--checkpoint-blocks` (m = 0)
or planned ("auto", [Note: choosing the checkpointed blocks] in leaderboard_bench). After an OOM
(one rank only) the step is retried with 2 more checkpointed blocks, up to 3 times.

Rows (problem training_leaderboard; name "<size>:<layers>L", impl ours/stock, dtype the mode,
x_name world_size): step_ms (per timed call, slowest rank), forward_ms / backward_ms / optimizer_ms
(CUDA events in the timed calls; ours applies most of its update inside backward), peak_memory_gib
per rank (x_name rank), tflops, mfu_datasheet, mfu_measured_peak, setup_s (build + compile + first
step), checkpoint_blocks, matmul_blocks and block_saved_gib (ours), comm_ms / comm_exposed_ms (from a profiled
step of every path on rank 0, saved as `training_leaderboard__trace_<variant>.json.gz`),
recompute_ms (estimated, [Note: the recompute estimate] in leaderboard_bench), stock_tuned's
blocks_<policy> (full, attention, selective, none) and recompute_block_<policy>_ms, matmul_peak, and wall_s
of the run. Skipped, OOM and failed variants are rows with a note.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import math
import os
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import torch
import torch.distributed as dist

from cs336_systems.attention.flash_triton import KernelOptions, hopper_configs, use_configs
from cs336_systems.distributed.zero import PARAM_MODES
from cs336_systems.measure import cli
from cs336_systems.measure.results import append_rows, capture_failure, device_name, make_row
from cs336_systems.measure.results import results_dir as default_results_dir
from cs336_systems.model import BasicsTransformerLM, get_config
from cs336_systems.studies.distributed import runner
from cs336_systems.studies.training import leaderboard_cli
from cs336_systems.studies.training import leaderboard_memory as memory
from cs336_systems.studies.training.leaderboard_bench import (
    ProtocolStep,
    bench,
    bench_ours_fitting,
    path_block_recompute_ms,
    plan_path,
    profile_step,
    recompute_ms,
)
from cs336_systems.studies.training.leaderboard_facts import (
    PROBLEM,
    facts,  # noqa: F401 (the study's facts, kept beside its tables)
)
from cs336_systems.studies.training.leaderboard_rows import (
    failure_rows,
    finish_rows,
    parse_variant,
    variant_rows,
)
from cs336_systems.studies.training.leaderboard_stock import (
    POLICIES,
    RESHARD,
    SAC_MATMULS,
    StockFsdp2Step,
    StockTunedStep,
)
from cs336_systems.training import LeaderboardConfig, build_leaderboard_step

MODULE = "cs336_systems.studies.training.leaderboard"
PATHS = ("ours", "stock", "stock_tuned")
STOCK_STEPS = {"stock": StockFsdp2Step, "stock_tuned": StockTunedStep}
GPU_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}  # never NVLink multicast
ALLOC_CONF = "expandable_segments:True"  # both paths: less fragmentation at 100+ GiB


@dataclass(frozen=True, kw_only=True)
class LeaderboardRunConfig:
    size: str = "8B_leaderboard"
    layers: tuple[int, ...] = ()  # () = the size's depth
    context_length: int = 0  # 0 = the size's
    batch_per_rank: int = 1
    param_modes: tuple[str, ...] = ("bf16",)
    paths: tuple[str, ...] = PATHS
    attention: str = "flash_triton"  # ours; "sdpa_cudnn" / "sdpa" are experiments, not valid entries
    flash_bwd: str = ""  # ours (flash_triton): FIELD=VALUE[+...] of its Hopper backward; a trial when set
    checkpoint_blocks: str = "auto"
    keep_attention: bool = True
    keep_matmuls: bool = True  # ours: plan blocks that keep every matmul's output too (LEADERBOARD_LOG)
    tuned_sac: str = "all"  # stock_tuned: which matmul outputs a selective block keeps
    tuned_reshard: str = "after_forward"  # stock_tuned: FSDP2 resharding after forward, or "never"
    loss_chunk: int = 4096
    compile: bool = True
    overlap: bool = True
    defer_gather: bool = True  # ours: a unit's all-gather issued at the next unit's hook
    rep_ms: float = 30_000.0
    warmup_ms: float = 10_000.0
    estimate_calls: int = 5
    trace: bool = True
    estimate_recompute: bool = True  # ours, stock_tuned: one block timed alone per policy
    margin_gib: float = 6.0  # ours, stock_tuned: the least margin tried ([Note: the planning margin])
    gc: str = "manual"  # ours, stock_tuned: no collection while timing (leaderboard_bench.bench)
    backend: str = "nccl"
    cold: bool = False
    variants: tuple[str, ...] = ()  # "<path>-<mode>-L<layers>", in run order
    run_id: str = ""

    def __post_init__(self) -> None:
        mcfg = get_config(self.size)
        if not self.layers:
            object.__setattr__(self, "layers", (mcfg.num_layers,))
        if not self.context_length:
            object.__setattr__(self, "context_length", mcfg.context_length)
        if min(self.layers) < 1 or self.batch_per_rank < 1 or self.context_length < 1 or self.loss_chunk < 1:
            raise ValueError("--layers, --batch-per-rank, --context-length and --loss-chunk must be positive")
        if unknown := set(self.param_modes) - set(PARAM_MODES) | set(self.paths) - set(PATHS):
            raise ValueError(f"unknown param modes or paths {sorted(unknown)}")
        if self.checkpoint_blocks != "auto" and not (self.checkpoint_blocks.isdigit()):
            raise ValueError(f"--checkpoint-blocks must be 'auto' or a count, got {self.checkpoint_blocks!r}")
        if self.keep_matmuls and not self.keep_attention:
            raise ValueError("--keep-matmuls true needs --keep-attention true")
        if self.tuned_sac not in SAC_MATMULS or self.tuned_reshard not in RESHARD:
            raise ValueError(
                f"--tuned-sac must be one of {tuple(SAC_MATMULS)}, --tuned-reshard one of {RESHARD}"
            )
        if self.flash_bwd:  # the spec against the model's head dim, before any work
            if self.attention != "flash_triton":
                raise ValueError(
                    "--flash-bwd changes our attention's backward: it needs --attention flash_triton"
                )
            changed = hopper_configs.changed_backward(mcfg.d_model // mcfg.num_heads, self.flash_bwd)
            hopper_configs.check_group(changed, self.batch_per_rank * mcfg.num_heads)
        if self.gc not in ("auto", "manual"):
            raise ValueError(f"--gc must be 'auto' or 'manual', got {self.gc!r}")
        if self.rep_ms <= 0 or self.warmup_ms < 0 or self.estimate_calls < 1:
            raise ValueError("--rep-ms must be > 0, --warmup-ms >= 0, --estimate-calls >= 1")
        if not self.variants:
            order = [p for p in PATHS if p in self.paths]
            labels = [f"{p}-{m}-L{n}" for n in self.layers for m in self.param_modes for p in order]
            object.__setattr__(self, "variants", tuple(labels))


def protocol_batch(cfg: LeaderboardRunConfig, vocab: int, device, rank: int, world_size: int):
    """This rank's rows of the protocol's torch.randint(high=vocab, size=(2, global batch, T))."""
    g = torch.Generator().manual_seed(2026)
    data = torch.randint(
        high=vocab, size=(2, world_size * cfg.batch_per_rank, cfg.context_length), generator=g
    )
    rows = slice(rank * cfg.batch_per_rank, (rank + 1) * cfg.batch_per_rank)
    return data[0, rows].to(device), data[1, rows].to(device)


def build_path(cfg: LeaderboardRunConfig, label: str, device: torch.device):
    """(step, model config) of a variant: the model built from seed 0, then ours or the stock step."""
    path, mode, layers = parse_variant(label)
    mcfg = get_config(cfg.size, num_layers=layers, context_length=cfg.context_length)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if mode == "bf16" else None
    attention = cfg.attention if path == "ours" else "sdpa"
    model = BasicsTransformerLM.from_config(mcfg, attention_impl=attention, device=device, dtype=dtype)
    if path in STOCK_STEPS:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        tuned = dict(sac_matmuls=cfg.tuned_sac, reshard=cfg.tuned_reshard) if path == "stock_tuned" else {}
        stock = STOCK_STEPS[path](
            model, param_mode=mode, mesh=mesh, compile=cfg.compile, loss_chunk=cfg.loss_chunk, **tuned
        )
        return stock, mcfg
    k = layers if cfg.checkpoint_blocks == "auto" else int(cfg.checkpoint_blocks)
    ours = LeaderboardConfig(
        param_mode=mode,
        attention=attention,
        compile=cfg.compile,
        checkpoint_blocks=k,
        keep_attention=cfg.keep_attention,
        loss_chunk=cfg.loss_chunk,
        overlap=cfg.overlap,
        defer_gather=cfg.defer_gather,
    )
    return build_leaderboard_step(model, ours), mcfg


def measure_variant(
    cfg: LeaderboardRunConfig, label: str, device: torch.device, results_dir
) -> tuple[list, None]:
    """One variant on every rank; its rows on rank 0. With one rank an OOM or error is a row; with
    several it ends the worker and the runner records it ([Note: why a failed variant ends the worker])."""
    rank, world = dist.get_rank(), dist.get_world_size()
    path, mode, layers = parse_variant(label)
    mcfg = get_config(cfg.size, num_layers=layers, context_length=cfg.context_length)
    if rank == 0:
        print(f"[{PROBLEM}] {label} on {world} x {device_name(device)} ...", flush=True)
    if device.type == "cuda":
        plan = memory.memory_plan(mcfg, batch=cfg.batch_per_rank, world_size=world, loss_chunk=cfg.loss_chunk)
        note = memory.skip_note(plan, mcfg, path=path, mode=mode, capacity=torch.cuda.mem_get_info(device)[1])
        if note:
            return (failure_rows(cfg, label, note, world) if rank == 0 else []), None
    outcome: dict = {}
    rows: list[dict] = []
    with capture_failure(outcome) if world == 1 else contextlib.nullcontext():
        rows = _measure(cfg, label, device, results_dir)
    _release(device)
    if outcome:
        return (failure_rows(cfg, label, outcome["note"], world) if rank == 0 else []), None
    return rows, None


def _release(device) -> None:
    torch._dynamo.reset()  # compiled code must not keep a variant's model alive
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _measure(cfg: LeaderboardRunConfig, label: str, device, results_dir) -> list[dict]:
    if parse_variant(label)[0] == "ours" and cfg.flash_bwd:  # the whole variant under the changed backward
        with use_configs(options=KernelOptions(hopper_bwd=cfg.flash_bwd)):
            return _measure_path(cfg, label, device, results_dir)
    return _measure_path(cfg, label, device, results_dir)


def _measure_path(cfg: LeaderboardRunConfig, label: str, device, results_dir) -> list[dict]:
    path, mode, _ = parse_variant(label)
    rank, world = dist.get_rank(), dist.get_world_size()
    start = time.perf_counter()
    step, mcfg = build_path(cfg, label, device)
    tokens, targets = protocol_batch(cfg, mcfg.vocab_size, device, rank, world)
    protocol = ProtocolStep(step, tokens, targets)
    plan = plan_path(path, step, protocol, cfg, device)  # the first steps compile; setup_s counts them
    setup_s = time.perf_counter() - start
    if (
        cfg.estimate_recompute
        and device.type == "cuda"
        and mode == "bf16"
        and path in ("ours", "stock_tuned")
    ):
        outcome: dict = {}
        with capture_failure(outcome):  # an estimate only: a failure (OOM) leaves it out, not the run
            plan["recompute_block_ms"] = path_block_recompute_ms(path, cfg, mcfg, device)
        if outcome and rank == 0:
            print(f"[{PROBLEM}] {label}: no recompute estimate ({outcome['note']})", flush=True)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    if path == "ours":
        result, note = bench_ours_fitting(step, protocol, cfg, device, plan)
    else:
        result, note = bench(protocol, cfg, device, path), ""
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else math.nan
    comm: dict[str, float] = {}
    if cfg.trace:
        trial = "_flash_bwd" if path == "ours" and cfg.flash_bwd else ""  # never over a headline's trace
        trace = default_results_dir(results_dir) / f"{PROBLEM}__trace_{label}{trial}_ws{world}.json.gz"
        comm = profile_step(protocol, device, trace)
    peaks = runner.gather_to_rank0(peak)
    layers = len(step.model.layers)
    counts = (step.checkpoint_blocks, step.matmul_blocks) if path == "ours" else None  # what was timed
    del step, protocol
    if rank != 0:
        return []
    extra = {"setup_s": ("s", setup_s)} | {m: ("ms", v) for m, v in comm.items()} | result.pop("extra")
    if counts is not None:
        extra["checkpoint_blocks"], extra["matmul_blocks"] = ("blocks", counts[0]), ("blocks", counts[1])
    if "margin_gib" in plan:  # the margin the plan left, and how many it tried
        extra["margin_gib"] = ("GiB", plan["margin_gib"])
        extra["margin_probes"] = ("count", plan["margin_probes"])
    if "outside_allocator" in plan:  # the device memory the recompute plan could not count on
        extra["memory_outside_allocator_gib"] = ("GiB", plan["outside_allocator"] / 2**30)
    if "block_saved" in plan:
        extra["block_saved_gib"] = ("GiB", plan["block_saved"] / 2**30)
    for policy in POLICIES:  # stock_tuned: blocks per recompute policy
        if "policies" in plan:
            extra[f"blocks_{policy}"] = ("blocks", plan["policies"].count(policy))
    for policy, ms in plan.get("recompute_block_ms", {}).items():
        extra[f"recompute_block_{policy}_ms"] = ("ms", ms)
    if result["phases"].get("backward"):  # NaN for stock: its estimate comes from stock_tuned's rows
        extra["recompute_ms"] = ("ms", recompute_ms(path, plan, layers))
    return variant_rows(cfg, label, world, mcfg, result, plan, peaks, extra, note, device)


STUDY = runner.Study(
    problem=PROBLEM, module=MODULE, measure=measure_variant, failure_rows=failure_rows, finish=finish_rows
)


# --------------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------------


def _process_age_s() -> float:
    """Seconds since this process started (Linux /proc), else since this module was imported."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return uptime - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.perf_counter() - _IMPORTED


_IMPORTED = time.perf_counter()


def _wall_s(started: float | None) -> float:
    """Wall seconds of the run: the process's age now, or the time since `started`."""
    return _process_age_s() if started is None else time.perf_counter() - started


def measure(
    config: LeaderboardRunConfig,
    *,
    results_dir=None,
    nproc: int,
    figures_dir=None,
    timeout_s: float = 3600.0,
    started: float | None = None,
):
    """Launch the ranks (torchrun), then record the wall time of the whole run (since `started`, a
    `time.perf_counter()` value; None: since this process started); returns this run's rows."""
    cfg = config
    env = {**GPU_ENV, "PYTORCH_CUDA_ALLOC_CONF": ALLOC_CONF}
    if cfg.backend == "gloo":  # gloo ranks compute on the CPU: Triton kernels run in its interpreter
        env["TRITON_INTERPRET"] = "1"
    env = {k: v for k, v in env.items() if k not in os.environ or k in GPU_ENV}  # else the caller's win
    caches = {}
    if cfg.cold:
        for var in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"):
            caches[var] = tempfile.mkdtemp(prefix=f"cold-{var.split('_')[0].lower()}-")
    env |= caches
    df = runner.run_config_study(
        STUDY, cfg, nproc=nproc, results_dir=results_dir, timeout_s=timeout_s, env=env
    )
    run_id = df.config_json.str.extract(r'"run_id": "(\w+)"')[0].dropna()
    config = asdict(cfg) | {"caches": caches, "nproc": nproc, "run_id": run_id.iloc[0] if len(run_id) else ""}
    wall = make_row(
        problem=PROBLEM, name="run", impl="all", dtype="", metric="wall_s", unit="s", value=_wall_s(started),
        x_name="world_size", x_value=nproc, config=config, note="cold caches" if cfg.cold else "",
    )  # fmt: skip
    append_rows(PROBLEM, [wall], results_dir)
    print(f"[{PROBLEM}] wall time of the run: {wall['p50']:.0f} s", flush=True)
    return pd.concat([df, pd.DataFrame([wall])], ignore_index=True)


QUICK = dict(
    size="debug", layers=(2,), context_length=64, param_modes=("bf16", "fp32_master"), attention="sdpa",
    compile=False, rep_ms=40.0, warmup_ms=10.0, estimate_calls=2, loss_chunk=48, backend="gloo",
)  # fmt: skip


def main(argv: Sequence[str] | None = None, *, from_shell: bool = False) -> pd.DataFrame | None:
    """The CLI; `from_shell`: the wall-time row counts from this process's start (else from this call)."""
    started = None if from_shell else time.perf_counter()
    p = leaderboard_cli.parser(__doc__, LeaderboardRunConfig(), PATHS)
    args = p.parse_args(argv)
    if args.quick:
        args.nproc = 2

    def fields() -> dict[str, Any]:
        return leaderboard_cli.config_fields(args) | (QUICK if args.quick else {})

    if args.worker is None:
        with cli.usage_errors(p):
            cfg = LeaderboardRunConfig(**fields())
            mcfg = get_config(cfg.size, num_layers=max(cfg.layers), context_length=cfg.context_length)
            plan = memory.memory_plan(
                mcfg, batch=cfg.batch_per_rank, world_size=args.nproc, loss_chunk=cfg.loss_chunk
            )
        print(f"[{PROBLEM}] memory plan at {max(cfg.layers)} layers, {args.nproc} rank(s), GiB:", flush=True)
        print({k: round(v / memory.GiB, 2) for k, v in plan.items() if k not in ("params", "world_size")})
    df = runner.config_cli(
        p, args, STUDY, LeaderboardRunConfig, fields, functools.partial(measure, started=started)
    )
    if df is not None and not df.empty:
        with pd.option_context("display.width", 200, "display.max_columns", 20):
            print(summary(df).to_string())
    return df


def summary(df: pd.DataFrame) -> pd.DataFrame:
    """Mean step (ms) per variant and world size, with notes, for printing."""
    t = df[df.metric == "step_ms"]
    return t[["name", "impl", "dtype", "x_value", "mean", "p50", "n", "note"]].reset_index(drop=True)


if __name__ == "__main__":
    main(from_shell=True)
