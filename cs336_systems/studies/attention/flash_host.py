"""The host side of the 2025 protocol's step (`flash_bench --host-profile`): its wall time per step in
interleaved rounds, which at a tiny shape (the GPU's share a few tens of us) is the host time per call
(rows "host_times"), then where that time goes (torch.profiler, printed only).

The like-for-like baseline of our compiled step is SDPA compiled the same way (`sdpa_*_compiled`);
`custom_op_floor` is a compiled step built like ours that launches nothing (`impls.py`).
`host_time_table(df)` is the latest run's table per GPU model, which notebook 42 quotes.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import pandas as pd
import torch

from cs336_systems.measure.results import append_rows, make_row
from cs336_systems.measure.timing import synchronize
from cs336_systems.studies.attention.flash_hopper_facts import gpu_kind
from cs336_systems.studies.attention.flash_sweep import LEADERBOARD
from cs336_systems.studies.attention.impls import leaderboard_step

HOST_TIMES = "host_times"  # the rows' name (problem flash_leaderboard)
TIMED = "o = flash(q, k, v, True); o.sum().backward()"
# the ratios the table gives: (column, numerator impl, denominator impl)
RATIOS = (
    ("ours / compiled cuDNN", "flash_triton", "sdpa_cudnn_compiled"),
    ("ours / eager cuDNN", "flash_triton", "sdpa_cudnn"),
    ("floor / eager cuDNN", "custom_op_floor", "sdpa_cudnn"),
)


def _inputs(heads: int, n: int, d: int, device: str) -> torch.Tensor:
    """The protocol's stacked (q, k, v): bf16 on a GPU, float32 on the CPU (the interpreter)."""
    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    return torch.randn(3, heads, n, d, device=device, dtype=dtype, requires_grad=True)


def host_times(
    impls: Sequence[str],
    shapes: Sequence[tuple[int, int, int]],
    *,
    rounds: int = 5,
    steps: int = 200,
    device: str = "cuda",
    results_dir: str | Path | None = None,
) -> dict[tuple[int, int, int], dict[str, list[float]]]:
    """The wall time per protocol step of each impl (us): a loop of `steps` steps with one synchronize
    at the end, in `rounds` interleaved rounds. Where the GPU's share of a step is small (a tiny
    shape) this is the host time per call. Prints each round, the medians and their ratio to the
    first impl's (and the graph breaks a compiled impl's warm-up steps counted); returns {shape: {impl:
    per round}}."""
    from torch._dynamo.utils import counters

    if rounds < 1 or steps < 1:
        raise ValueError(f"host_times: rounds and steps must be >= 1, got {rounds} and {steps}")
    run_id = time.time_ns()  # the rows of one call (every shape and impl) share it
    out = {}
    for heads, n, d in shapes:
        x = _inputs(heads, n, d, device)
        step_of = {impl: leaderboard_step(impl, x) for impl in impls}
        breaks = {}
        for impl, step in step_of.items():
            before = sum(counters["graph_break"].values())
            for _ in range(5):
                step()
            breaks[impl] = sum(counters["graph_break"].values()) - before
        times: dict[str, list[float]] = {impl: [] for impl in impls}
        for _ in range(rounds):
            for impl, step in step_of.items():
                synchronize(device)
                t0 = time.perf_counter()
                for _ in range(steps):
                    step()
                synchronize(device)
                times[impl].append((time.perf_counter() - t0) / steps * 1e6)
        medians = {impl: statistics.median(v) for impl, v in times.items()}  # the rows' p50
        first = medians[impls[0]]
        print(
            f"\nwall time per step at {heads} x {n} x {d}, {rounds} interleaved rounds of {steps} steps (us)"
        )
        for impl, v in times.items():
            rounds_us = " ".join(f"{t:7.1f}" for t in v)
            note = f"  ({breaks[impl]} graph breaks)" if breaks[impl] else ""
            print(f"  {medians[impl]:8.1f}  {medians[impl] / first:6.3f}x  {impl:22s} [{rounds_us}]{note}")
        out[(heads, n, d)] = times
        if results_dir is not None:
            run = {"heads": heads, "d": d, "seq_len": n, "rounds": rounds, "steps": steps, "causal": True,
                   "device": device, "run_id": run_id, "timed": TIMED}  # fmt: skip
            rows = [
                make_row(
                    problem=LEADERBOARD,
                    metric="host_time",
                    unit="us",
                    name=HOST_TIMES,
                    impl=impl,
                    mode="fwd_bwd",
                    dtype=str(x.dtype).removeprefix("torch."),
                    x_name="seq_len",
                    x_value=n,
                    samples=v,
                    config=run | {"graph_breaks": breaks[impl]},
                )
                for impl, v in times.items()
            ]
            append_rows(LEADERBOARD, rows, results_dir)
    return out


def host_time_table(df: pd.DataFrame) -> pd.DataFrame:
    """The latest `host_times` run of each GPU model: a row per shape, each impl's median host time per
    step (us) and the `RATIOS` whose two impls were timed; attrs["shas"]: the run's commit per GPU,
    attrs["source"]: its rows."""
    rows = df[(df.name == HOST_TIMES) & (df.metric == "host_time")] if "name" in df.columns else df.iloc[:0]
    if rows.empty:
        return pd.DataFrame(columns=["gpu", "shape"])
    cfg = rows.config_json.map(json.loads)
    rows = rows.assign(
        gpu=rows.gpu_name.map(gpu_kind),
        run_id=cfg.map(lambda c: c["run_id"]),
        shape=cfg.map(lambda c: f"{c['heads']} x {c['seq_len']} x {c['d']}"),
    )
    latest = rows[rows.run_id == rows.groupby("gpu").run_id.transform("max")]
    table = latest.pivot_table(index=["gpu", "shape"], columns="impl", values="p50", sort=False)
    for column, num, den in RATIOS:
        if num in table.columns and den in table.columns:
            table[column] = table[num] / table[den]
    table.columns.name = None
    out = table.reset_index()
    out.attrs["shas"] = latest.groupby("gpu").git_sha.first().str[:7].to_dict()
    out.attrs["source"] = latest
    return out


def host_profile(impls: Sequence[str], shapes: Sequence[tuple[int, int, int]], steps: int = 20) -> None:
    """Where the time of one protocol step goes when the GPU waits for the host: per shape and impl,
    the GPU kernel time per step, the host operations with the most self CPU time and the kernels with
    the most GPU time (torch.profiler). Prints only."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    for heads, n, d in shapes:
        x = _inputs(heads, n, d, "cuda")
        for impl in impls:
            step = leaderboard_step(impl, x)
            for _ in range(3):
                step()
            synchronize("cuda")
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(steps):
                    step()
                synchronize("cuda")
            events = prof.key_averages()
            gpu_ms = sum(e.self_device_time_total for e in events) / steps / 1e3
            print(f"\n{impl} at {heads} x {n} x {d}: GPU kernels {gpu_ms:.3f} ms/step")
            top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:12]
            for e in top:
                print(f"  {e.self_cpu_time_total / steps / 1e3:8.3f} ms  x{e.count // steps:<3} {e.key[:90]}")
            print("  GPU time per step by kernel (self device time):")
            kernels = sorted(events, key=lambda e: e.self_device_time_total, reverse=True)
            for e in [e for e in kernels if e.device_type == DeviceType.CUDA][:10]:
                print(
                    f"  {e.self_device_time_total / steps / 1e3:8.3f} ms  x{e.count // steps:<3} {e.key[:90]}"
                )
