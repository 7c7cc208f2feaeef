"""The timed part of the training leaderboard (training_leaderboard.py): the protocol's step with its
phases marked, the "auto" choice of checkpointed blocks, do_bench with OOM retries, one profiled step.

[Note: the recompute estimate]
Recomputation runs inside backward, fused into its kernels, so it is estimated from backward times
of the same run. Ours with `keep_matmuls`: its plan steps have every block recomputed keeping its
attention (backward B_all), then the last block unchecked (B_n), then the last block keeping its
matmuls too (B_m); a block recomputed keeping only its attention costs B_all - B_n, one keeping its
matmuls B_m - B_n, and recompute = (k - m)(B_all - B_n) + m (B_m - B_n). Without it: the plan step
B_all and the timed steps with k blocks recomputed (B_k): each recomputed block costs
(B_all - B_k) / (L - k), so recompute = k (B_all - B_k) / (L - k). stock_tuned's plan steps differ
only in block 0's policy ("full", "selective", "none"): a policy's per-block cost is its step's
backward minus the "none" step's, and recompute sums it over the blocks. The stock step recomputes
every block in full: L times the "full" per-block cost of stock_tuned from the same run (the same
compiled, FSDP-sharded block under the same checkpoint), when that ran. One step per estimate:
expect a few ms of noise per block; an estimate below zero (recompute cheaper than that noise, e.g.
elementwise work only) is not reported.

[Note: choosing the checkpointed blocks]
Only as many blocks are recomputed, and as cheaply, as memory needs. One step with every block
checkpointed keeping its attention is run (it also compiles), then a second one whose allocator peak
P is read. The last block's forward on a random input, run plainly, as its recomputed region and as
its region keeping the matmuls, gives A_n and A_m: the bytes an unchecked block, and one keeping its
matmuls, keeps beyond the recomputed region (allocated after minus before minus the output). With M
the device memory and `margin_gib` left for fragmentation and the allocator's workspace,
R = M - margin - P (the least of all ranks; the largest A of all ranks). With `keep_matmuls` the
blocks are planned like stock_tuned's ([Note: the tuned stock recompute plan] in leaderboard_stock,
"selective" = keeping the matmuls, "full" = keeping only the attention): if every block fits keeping
its matmuls (L A_m <= R), floor((R - L A_m) / (A_n - A_m)) blocks run unchecked and the others keep
their matmuls; otherwise floor(R / A_m) keep their matmuls and the rest only their attention.
Without it floor(R / A_n) blocks keep their activations and the first k = L - that many are
recomputed. Which blocks get which policy does not change the peak (every block's activations are
alive at the end of forward); recomputed blocks come first.
"""

from __future__ import annotations

import math
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from cs336_systems.measure.annotations import annotate
from cs336_systems.measure.results import capture_failure
from cs336_systems.measure.timing import do_bench_all_ranks, synchronize
from cs336_systems.measure.traces import load_trace, save_trace
from cs336_systems.studies.distributed import trace_plot
from cs336_systems.studies.training.leaderboard_stock import recompute_plan

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
    """Plan k and m for "auto" and set them on `step` ([Note: choosing the checkpointed blocks]).
    Returns {"checkpoint_blocks", "matmul_blocks", "peak_all_checkpointed", "block_saved",
    "matmuls_saved", and the plan steps' backward times for [Note: the recompute estimate]}."""
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
    backward_all = protocol.phase_ms(1)["backward"][0]  # every block recomputed
    plan: dict[str, Any] = {"peak_all_checkpointed": peak, "backward_all_checkpointed_ms": backward_all}
    matmuls = cfg.keep_matmuls and bool(step.matmul_regions)
    if matmuls:  # the last block unchecked, then keeping its matmuls: per-block recompute costs
        for name, (k, m) in {
            "backward_last_none_ms": (layers - 1, 0),
            "backward_last_matmuls_ms": (layers, 1),
        }.items():
            step.set_checkpoint_blocks(k, m)
            protocol()  # compiles the policy's graph at its first use
            protocol()
            synchronize(device)
            plan[name] = protocol.phase_ms(1)["backward"][0]
    block = step.model.layers[-1]
    shape = (cfg.batch_per_rank, cfg.context_length, block.ln1.weight.shape[0])
    with step.on_stream():
        x = torch.randn(shape, device=device, dtype=step.optimizer.compute_dtype, requires_grad=True)
        region = _kept_bytes(step.regions[-1], x, device)
        saved = _kept_bytes(block, x, device) - region
        saved_mm = _kept_bytes(step.matmul_regions[-1], x, device) - region if matmuls else 0
        del x
    room = torch.cuda.mem_get_info(device)[1] - cfg.margin_gib * 2**30 - peak
    agreed = torch.tensor([-room, saved, saved_mm], device=device, dtype=torch.float64)
    if dist.get_world_size() > 1:  # the ranks plan from the least room and the most bytes
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    room, saved, saved_mm = -float(agreed[0]), float(agreed[1]), float(agreed[2])
    if matmuls:
        policies = recompute_plan(layers, room, max(saved_mm, 1.0), max(saved, saved_mm + 1.0))
        k, m = layers - policies.count("none"), policies.count("selective")
    else:
        k, m = layers - min(layers, max(0, int(room // max(saved, 1)))), 0
    step.set_checkpoint_blocks(k, m)
    return plan | {
        "checkpoint_blocks": k,
        "matmul_blocks": m,
        "block_saved": saved,
        "matmuls_saved": saved_mm,
    }


def recompute_ms(path: str, plan: dict, backward_ms: float, layers: int) -> float:
    """The estimated time backward spends recomputing forward work ([Note: the recompute estimate]);
    NaN where the run gives no estimate."""
    estimate = math.nan
    if path == "ours" and "backward_last_none_ms" in plan:  # per-block costs from the plan steps
        per_attention = plan["backward_all_checkpointed_ms"] - plan["backward_last_none_ms"]
        per_matmuls = plan["backward_last_matmuls_ms"] - plan["backward_last_none_ms"]
        k, m = plan["checkpoint_blocks"], plan["matmul_blocks"]
        estimate = (k - m) * per_attention + m * per_matmuls
    elif path == "ours" and "backward_all_checkpointed_ms" in plan:
        k = plan["checkpoint_blocks"]
        if k < layers:
            estimate = k * (plan["backward_all_checkpointed_ms"] - backward_ms) / (layers - k)
    elif "recompute_block_ms" in plan:  # stock_tuned's plan
        per_block = plan["recompute_block_ms"]
        estimate = sum(per_block.get(p, 0.0) for p in plan["policies"])
    return estimate if estimate >= 0 else math.nan


def _kept_bytes(fn, x, device) -> int:
    """Bytes that `fn(x)` leaves allocated for backward (its output not counted)."""
    synchronize(device)
    before = torch.cuda.memory_allocated(device)
    y = fn(x)
    synchronize(device)
    kept = torch.cuda.memory_allocated(device) - before - y.untyped_storage().nbytes()
    del y
    return kept


def bench(protocol: ProtocolStep, cfg, device) -> dict[str, Any]:
    result = do_bench_all_ranks(
        protocol, warmup_ms=cfg.warmup_ms, rep_ms=cfg.rep_ms, estimate_calls=cfg.estimate_calls, device=device
    )
    result["phases"] = protocol.phase_ms(result["n_repeat"])
    return result


def bench_ours_fitting(step, protocol, cfg, device, plan: dict) -> tuple[dict, str]:
    """Bench ours; on one rank, after an OOM retry with 2 more checkpointed blocks (up to 3 times)."""
    note = ""
    for attempt in range(4):
        outcome: dict = {}
        if dist.get_world_size() > 1:  # a rank cannot leave a collective alone: no retries
            return bench(protocol, cfg, device), note
        with capture_failure(outcome):
            return bench(protocol, cfg, device), note
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
    with tempfile.TemporaryDirectory() as tmp:
        prof.export_chrome_trace(str(Path(tmp) / "trace.json"))
        compact = trace_plot.compact_trace(load_trace(Path(tmp) / "trace.json"))
    frame = trace_plot.trace_frame(compact)
    if device.type == "cuda" and not frame.row.str.startswith("stream").any():
        # CUPTI failed to start (seen on one machine): a trace without kernels would read as "no
        # communication"; nothing is saved and the rows say not measured
        return {"comm_ms": math.nan, "comm_exposed_ms": math.nan}
    save_trace(compact, path)
    stats = trace_plot.overlap_stats(frame)
    return {"comm_ms": stats["comm_ms"], "comm_exposed_ms": stats["exposed_ms"]}
