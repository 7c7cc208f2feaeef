"""The timed part of the training leaderboard (training_leaderboard.py): the protocol's step with its
phases marked, the "auto" choice of checkpointed blocks, do_bench with OOM retries, one profiled step.

[Note: the recompute estimate]
Recomputation runs inside backward, fused into its kernels, so it cannot be read off a trace; and
differences of whole protocol steps (a 3-4 s backward) that differ in one block are as noisy as the
few ms a block's recompute may cost (session 15: a block keeping its matmuls measured faster than an
unchecked one). So one block is timed alone (`block_recompute_ms`): a fresh block of the model's
shape and precision, under each recompute policy of the path, compiled as in the step, its backward
(gradients of the input and of every parameter, returned rather than accumulated, so no optimizer
hook runs) timed over several calls; a policy's per-block cost is its median backward minus the
unchecked block's. Ours: "attention" (recomputed keeping the attention's outputs) and "matmuls"
(keeping the matmuls' too); recompute = (k - m) attention + m matmuls. stock_tuned: "full" and
"selective" (its recipe's matmuls); recompute sums its blocks' policies. The stock step recomputes
every block in full: L times stock_tuned's "full" from the same run (the same compiled block under
the same checkpoint), when that ran. Collectives are not part of it (FSDP2's gathers run whether or
not a block is recomputed). An estimate below zero is not reported.

[Note: choosing the checkpointed blocks]
Only as many blocks are recomputed, and as cheaply, as memory needs. One step with every block
checkpointed keeping its attention is run (it also compiles), then a second one whose allocator peak
P is read. The last block's forward on a random input, run plainly, as its recomputed region and as
its region keeping the matmuls, gives A_n and A_m: the bytes an unchecked block, and one keeping its
matmuls, keeps beyond the recomputed region (allocated after minus before minus the output). With M
the bytes the allocator can reach (`allocator_usable_bytes`: the device less the CUDA context, NCCL's
buffers and other allocations outside it) and `margin_gib` left for fragmentation,
R = M - margin - P (the least of all ranks; the largest A of all ranks). With `keep_matmuls` the
blocks are planned like stock_tuned's ([Note: the tuned stock recompute plan] in leaderboard_stock,
"selective" = keeping the matmuls, "full" = keeping only the attention): if every block fits keeping
its matmuls (L A_m <= R), floor((R - L A_m) / (A_n - A_m)) blocks run unchecked and the others keep
their matmuls; otherwise floor(R / A_m) keep their matmuls and the rest only their attention.
Without it floor(R / A_n) blocks keep their activations and the first k = L - that many are
recomputed. Which blocks get which policy does not change the peak (every block's activations are
alive at the end of forward); recomputed blocks come first.

[Note: the planning margin]
The plans leave a margin of the memory the allocator can reach unplanned. With a fixed 6 GiB (to
session 16) the timed steps of both paths peaked about 7 GiB below the device's 139.8 GiB on two H200s
and still hit the caching allocator's free-and-retry path (cached blocks released, a device
synchronisation, the allocation tried again): stock_tuned 28 times and ours 10 times per timed window,
stock_tuned's compute stream idling 400-440 ms of a profiled step while the host waited. With 12 GiB
neither retried and both were faster (ours 4558 -> 4528 ms, stock_tuned 4918 -> 4566 ms, with 3 of its
34 blocks recomputed in full); with 20 GiB neither retried and both were slower again (more recompute):
figures/data/training_leaderboard__margin_trial.csv (git 4a0bad8). A likely reason, not verified:
the allocator pools memory per stream (FSDP2's and our all-gathers run on their own streams), so bytes
cached by one stream were not free for another. How much is needed depends on the path, the GPU and
the plan, so each path searches for it (`fit_margin`): from `margin_gib` (6 GiB) up in steps of
MARGIN_STEP_GIB, the first plan under which two protocol steps see no retry on any rank (plans are
arithmetic on the measured peaks: each probe costs its two steps and the compilation of the regions
whose policy changed). The rows record each path's margin and probes, and the timed calls' retries.
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from cs336_systems.measure.annotations import annotate
from cs336_systems.measure.results import capture_failure
from cs336_systems.measure.timing import do_bench_all_ranks, synchronize
from cs336_systems.measure.traces import save_trace
from cs336_systems.model import BasicsTransformerLM
from cs336_systems.studies.distributed import trace_plot
from cs336_systems.studies.training.leaderboard_stock import (
    SAC_MATMULS,
    PolicyBlock,
    least_headroom,
    outside_allocator_bytes,
    recompute_plan,
)
from cs336_systems.training.leaderboard import LeaderboardConfig, checkpointed_regions

MARGIN_STEP_GIB = 2.0  # the planning margin's search ([Note: the planning margin])
MARGIN_SPAN_GIB = 12.0  # at most this much above the configured start
PHASES = ("forward", "backward", "optimizer_step")  # the range names trace_plot.compact_trace keeps


class ProtocolStep:
    """The timed step: zero_grad(set_to_none=True), loss, backward, optimizer step; phase marks kept."""

    def __init__(self, step, tokens, targets):
        self.step, self.tokens, self.targets = step, tokens, targets
        self.marks: list[list] = []

    def _mark(self, marks: list) -> None:
        if self.tokens.is_cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            marks.append(event)
        else:
            marks.append(time.perf_counter())

    def __call__(self) -> None:
        marks: list = []
        with self.step.on_stream():
            self._mark(marks)
            with annotate("forward"):
                self.step.optimizer.zero_grad(set_to_none=True)
                loss = self.step.loss(self.tokens, self.targets)
            self._mark(marks)
            with annotate("backward"):
                loss.backward()
            self._mark(marks)
            with annotate("optimizer_step"):
                self.step.optimizer.step()
            self._mark(marks)
        self.marks.append(marks)

    def phase_ms(self, last: int) -> dict[str, list[float]]:
        """Per phase, the durations (ms) of the last `last` calls."""
        out: dict[str, list[float]] = {p: [] for p in PHASES}
        for marks in self.marks[-last:]:
            for phase, a, b in zip(PHASES, marks, marks[1:]):
                out[phase].append((b - a) * 1e3 if isinstance(a, float) else a.elapsed_time(b))
        return out


def plan_checkpointing(step, protocol: ProtocolStep, cfg, device) -> dict[str, Any]:
    """Plan k and m for "auto" with `cfg.margin_gib` and set them on `step` ([Note: choosing the
    checkpointed blocks]). Returns the measurements (for `apply_ours_margin`) and the counts."""
    layers = len(step.model.layers)
    step.set_checkpoint_blocks(layers)
    protocol()
    synchronize(device)
    if device.type != "cuda":  # no memory to plan from: every block stays recomputed
        return {"checkpoint_blocks": step.checkpoint_blocks, "matmul_blocks": step.matmul_blocks}
    torch.cuda.reset_peak_memory_stats(device)
    protocol()
    synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    matmuls = cfg.keep_matmuls and bool(step.matmul_regions)
    block = step.model.layers[-1]
    shape = (cfg.batch_per_rank, cfg.context_length, block.ln1.weight.shape[0])
    with step.on_stream():
        x = torch.randn(shape, device=device, dtype=step.optimizer.compute_dtype, requires_grad=True)
        region = _kept_bytes(step.regions[-1], x, device)
        saved = _kept_bytes(block, x, device) - region
        saved_mm = _kept_bytes(step.matmul_regions[-1], x, device) - region if matmuls else 0
        del x
    agreed = torch.tensor([saved, saved_mm], device=device, dtype=torch.float64)
    if dist.get_world_size() > 1:  # the ranks plan from the least headroom and the most bytes
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    plan = {
        "peak_all_checkpointed": peak,
        "headroom": least_headroom(peak, device),
        "block_saved": float(agreed[0]),
        "matmuls_saved": float(agreed[1]),
        "keep_matmuls": matmuls,
        "outside_allocator": outside_allocator_bytes(device),
    }
    return plan | apply_ours_margin(step, plan, cfg.margin_gib)


def apply_ours_margin(step, plan: dict, margin_gib: float) -> dict[str, int]:
    """Set ours' checkpointed blocks k and matmul-keeping blocks m that leave `margin_gib` of what the
    allocator can reach unplanned, from `plan_checkpointing`'s measurements; returns both."""
    layers = len(step.model.layers)
    room, saved, saved_mm = plan["headroom"] - margin_gib * 2**30, plan["block_saved"], plan["matmuls_saved"]
    if plan["keep_matmuls"]:
        kept = {"full": 0.0, "selective": max(saved_mm, 1.0), "none": max(saved, saved_mm + 1.0)}
        policies = recompute_plan(layers, room, kept)  # "full" here: ours' attention-only region
        k, m = layers - policies.count("none"), policies.count("selective")
    else:
        k, m = layers - min(layers, max(0, int(room // max(saved, 1)))), 0
    step.set_checkpoint_blocks(k, m)
    return {"checkpoint_blocks": k, "matmul_blocks": m}


def fit_margin(
    apply: Callable[[float], Any],
    probe: Callable[[], int],
    start_gib: float,
    step_gib: float,
    most_gib: float,
) -> tuple[float, int]:
    """[Note: the planning margin]: the least margin from `start_gib` up, in `step_gib` steps up to
    `most_gib`, whose plan (`apply(margin)`) makes `probe()` (the allocator's retries in a few protocol
    steps, agreed by every rank) return 0, or `most_gib`'s. Returns (margin, probes run)."""
    margin, probes = start_gib, 0
    while True:
        apply(margin)
        probes += 1
        if probe() == 0 or margin + step_gib > most_gib + 1e-9:
            return margin, probes
        margin += step_gib


def retry_probe(protocol: ProtocolStep, device, steps: int = 2) -> Callable[[], int]:
    """The allocator's retries during `steps` protocol steps (the most of any rank), as a `fit_margin`
    probe; the first step after a new plan also compiles the regions it changed."""

    def probe() -> int:
        before = _alloc_retries(device)
        for _ in range(steps):
            protocol()
        synchronize(device)
        count = torch.tensor([_alloc_retries(device) - before], device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(count, op=dist.ReduceOp.MAX)
        return int(count)

    return probe


def plan_path(path: str, step, protocol: ProtocolStep, cfg, device) -> dict[str, Any]:
    """Run `path`'s first steps (they compile) and, with `cfg.checkpoint_blocks == "auto"`, its plan:
    ours by `plan_checkpointing`, stock_tuned by its own `plan`; a fixed count checkpoints that many
    blocks (stock_tuned's selectively). Returns the plan's numbers ({} for stock)."""
    plan: dict[str, Any] = {}
    if path in ("ours", "stock_tuned") and cfg.checkpoint_blocks == "auto":
        if path == "ours":
            plan = plan_checkpointing(step, protocol, cfg, device)
            apply = lambda m: plan.update(apply_ours_margin(step, plan, m))
        else:
            plan = step.plan(protocol, device, cfg.margin_gib)
            apply = lambda m: plan.update(policies=step.apply_margin(plan, m))
        if device.type == "cuda":  # the plans' margin: [Note: the planning margin]
            margin, probes = fit_margin(
                apply, retry_probe(protocol, device), cfg.margin_gib, MARGIN_STEP_GIB,
                cfg.margin_gib + MARGIN_SPAN_GIB,
            )  # fmt: skip
            plan |= {"margin_gib": margin, "margin_probes": probes}
        return plan
    if path == "stock_tuned":
        k = min(int(cfg.checkpoint_blocks), len(step.blocks))
        step.set_policies(["selective"] * k + ["none"] * (len(step.blocks) - k))
        plan = {"policies": step.policies}
    protocol()  # the first step: compilation
    synchronize(device)
    return plan


def recompute_ms(path: str, plan: dict, layers: int) -> float:
    """The estimated time backward spends recomputing forward work ([Note: the recompute estimate]);
    NaN where the run gives no estimate."""
    per_block = plan.get("recompute_block_ms", {})
    if path == "ours" and per_block:
        k, m = plan["checkpoint_blocks"], plan["matmul_blocks"]
        estimate = (k - m) * per_block["attention"] + m * per_block.get("matmuls", 0.0)
    elif path == "stock_tuned" and per_block:
        estimate = sum(per_block.get(p, 0.0) for p in plan["policies"])
    else:
        estimate = math.nan
    return estimate if estimate >= 0 else math.nan


def backward_ms(fn: Callable[[Tensor], Tensor], x: Tensor, params: list[Tensor], reps: int, device) -> float:
    """Median time (ms) of the backward of fn(x) for x and `params` (returned, not accumulated) over
    `reps` calls after two untimed ones."""
    grad = torch.randn_like(x)
    times = []
    for i in range(reps + 2):
        y = fn(x)
        synchronize(device)
        start = time.perf_counter()
        torch.autograd.grad(y, [x, *params], grad)
        synchronize(device)
        if i >= 2:
            times.append((time.perf_counter() - start) * 1e3)
        del y
    return sorted(times)[len(times) // 2]


def block_recompute_ms(
    runners: dict[str, Callable[[Tensor], Tensor]], block: nn.Module, shape: tuple, device, reps: int = 8
) -> dict[str, float]:
    """Per recompute policy, what it adds to one block's backward (ms): runners[policy](x) runs `block`
    under it, runners["none"] unchecked ([Note: the recompute estimate])."""
    dtype = next(block.parameters()).dtype
    x = torch.randn(shape, device=device, dtype=dtype, requires_grad=True)
    params = [p for p in block.parameters() if p.requires_grad]
    base = backward_ms(runners["none"], x, params, reps, device)
    return {
        name: backward_ms(fn, x, params, reps, device) - base
        for name, fn in runners.items()
        if name != "none"
    }


def path_block_recompute_ms(path: str, cfg, mcfg, device) -> dict[str, float]:
    """`block_recompute_ms` of a fresh bf16 block of `mcfg` under `path`'s policies ("ours":
    "attention", "matmuls"; "stock_tuned": "full", "attention", "selective" with `cfg.tuned_sac`'s
    matmuls), compiled
    as `cfg.compile` says."""
    small = mcfg.replace(num_layers=1, vocab_size=256)  # the block does not depend on the vocabulary
    attention = cfg.attention if path == "ours" else "sdpa"
    lm = BasicsTransformerLM.from_config(small, attention_impl=attention, device=device, dtype=torch.bfloat16)
    block = lm.layers[0]
    if path == "ours":
        ours = LeaderboardConfig(attention=attention, compile=cfg.compile)
        one = nn.ModuleList([block])
        runners = {
            "attention": checkpointed_regions(one, ours)[0],
            "matmuls": checkpointed_regions(one, ours, matmuls=True)[0],
        }
        if cfg.compile:
            block.compile()
        runners["none"] = block
    else:
        stride = SAC_MATMULS[cfg.tuned_sac]
        wrap = torch.compile if cfg.compile else (lambda m: m)
        runners = {p: wrap(PolicyBlock(block, p, stride)) for p in ("none", "full", "attention", "selective")}
    return block_recompute_ms(runners, block, (cfg.batch_per_rank, cfg.context_length, small.d_model), device)


def _kept_bytes(fn, x, device) -> int:
    """Bytes that `fn(x)` leaves allocated for backward (its output not counted)."""
    synchronize(device)
    before = torch.cuda.memory_allocated(device)
    y = fn(x)
    synchronize(device)
    kept = torch.cuda.memory_allocated(device) - before - y.untyped_storage().nbytes()
    del y
    return kept


def gc_policy(path: str, cfg) -> str:
    """The garbage-collection policy of `path`'s timed steps: cfg.gc for ours and stock_tuned; the
    first-attempt stock step keeps Python's default ([Note: garbage collection during the timed steps])."""
    return "auto" if path == "stock" else cfg.gc


def _alloc_retries(device) -> int:
    """The caching allocator's retries so far (a cudaFree of its cache, then the allocation again)."""
    return torch.cuda.memory_stats(device).get("num_alloc_retries", 0) if device.type == "cuda" else 0


def bench(protocol: ProtocolStep, cfg, device, path: str) -> dict[str, Any]:
    """do_bench of `path`'s protocol step, with the phases of the timed calls and, in "extra", the
    garbage collections and the allocator's retries they saw.

    [Note: garbage collection during the timed steps]
    Python's collector runs when allocations pass its thresholds; a full collection of a process
    holding compiled graphs and autograd state can hold the host long enough for the GPU's queue to
    drain (the step's trace then shows the compute stream idle). cfg.gc "manual" does what torchtitan
    does (automatic collection off, a collection between steps every so many steps; every timed window
    here is shorter than its default period of 50 steps): one collection before the warm-up, none
    during the timed calls. "auto" leaves Python's default. The study's default is "manual" for ours
    and stock_tuned (what a skilled user runs); stock, the first attempt, keeps "auto" (`gc_policy`).
    What it changed on two H200s: LEADERBOARD_LOG.md, session 16."""
    manual = gc_policy(path, cfg) == "manual"
    if manual:
        gc.collect()
        gc.disable()
    collections = sum(s["collections"] for s in gc.get_stats())
    retries = _alloc_retries(device)
    try:
        result = do_bench_all_ranks(
            protocol,
            warmup_ms=cfg.warmup_ms,
            rep_ms=cfg.rep_ms,
            estimate_calls=cfg.estimate_calls,
            device=device,
        )
        collections = sum(s["collections"] for s in gc.get_stats()) - collections  # before gc.enable()
    finally:
        if manual:
            gc.enable()
    result["phases"] = protocol.phase_ms(result["n_repeat"])
    result["extra"] = {
        "gc_collections": ("count", collections),
        "alloc_retries": ("count", _alloc_retries(device) - retries),
    }
    return result


def bench_ours_fitting(step, protocol, cfg, device, plan: dict) -> tuple[dict, str]:
    """Bench ours; on one rank, after an OOM retry with 2 more checkpointed blocks (up to 3 times)."""
    note = ""
    for attempt in range(4):
        outcome: dict = {}
        if dist.get_world_size() > 1:  # a rank cannot leave a collective alone: no retries
            return bench(protocol, cfg, device, "ours"), note
        with capture_failure(outcome):
            return bench(protocol, cfg, device, "ours"), note
        if outcome["note"] != "OOM" or attempt == 3 or step.checkpoint_blocks >= len(step.model.layers):
            raise RuntimeError(outcome["note"])
        note += f"OOM with {step.checkpoint_blocks} checkpointed blocks; "
        step.optimizer.abandon_step()
        step.set_checkpoint_blocks(step.checkpoint_blocks + 2, step.matmul_blocks)
        plan["checkpoint_blocks"] = step.checkpoint_blocks
        protocol.marks.clear()
    raise AssertionError("unreachable")


def profile_step(protocol: ProtocolStep, device, path: Path) -> dict[str, float]:
    """One profiled step on rank 0 (the others run it unprofiled); compact trace saved; comm stats."""
    if dist.get_rank() != 0:
        protocol()
        synchronize(device)
        return {}
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        protocol()
        synchronize(device)
    compact = trace_plot.compact_profile(prof)
    frame = trace_plot.trace_frame(compact)
    if device.type == "cuda" and not frame.row.str.startswith("stream").any():
        # CUPTI failed to start (seen on one machine): a trace without kernels would read as "no
        # communication"; nothing is saved and the rows say not measured
        return {"comm_ms": math.nan, "comm_exposed_ms": math.nan}
    save_trace(compact, path)
    stats = trace_plot.overlap_stats(frame)
    return {"comm_ms": stats["comm_ms"], "comm_exposed_ms": stats["exposed_ms"]}
