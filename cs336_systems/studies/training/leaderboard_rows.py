"""The training leaderboard's rows (training_leaderboard.py measures, this module writes): the keys of a
variant's rows, its step / phase / throughput / memory rows, failure rows and the run's final rows
(the measured matmul rate, the SDPA backend stock gets)."""

from __future__ import annotations

import functools
import math
from dataclasses import asdict
from typing import Any

import torch

from cs336_systems.accounting.hardware import peak_flops
from cs336_systems.measure.results import device_name, failure_row, make_row
from cs336_systems.model import get_config
from cs336_systems.studies.training.leaderboard_facts import PROBLEM
from cs336_systems.studies.training.train_step import matmul_peak, step_flops


def parse_variant(label: str) -> tuple[str, str, int]:
    path, mode, layers = label.split("-")
    return path, mode, int(layers.removeprefix("L"))


def _keys(cfg, label: str, world_size: int) -> dict[str, Any]:
    path, mode, layers = parse_variant(label)
    config = asdict(cfg) | {"variant": label, "world_size": world_size}
    return dict(
        problem=PROBLEM, name=f"{cfg.size}:{layers}L", impl=path, dtype=mode, mode="train", config=config
    )


NO_GPU_PROFILE = "the profiler recorded no GPU activity (CUPTI unavailable): not measured"


def missing_note(metric: str, value: float) -> str:
    if not math.isnan(value):
        return ""
    if metric.startswith("comm"):
        return NO_GPU_PROFILE
    if metric == "recompute_ms":
        return "not estimated here, or below the estimate's noise ([Note: the recompute estimate])"
    return ""


def variant_rows(cfg, label, world, mcfg, result, plan, peaks, extra, note, device) -> list[dict]:
    """step / phase rows (ms per timed call), throughput and MFU, peak memory per rank, `extra`."""
    keys = _keys(cfg, label, world)
    bench = {k: result[k] for k in ("estimate_ms", "n_warmup", "n_repeat", "calls")}
    keys["config"] |= {"bench": bench, "checkpoint_plan": plan}
    at = dict(x_name="world_size", x_value=world)
    rows = [make_row(metric="step_ms", unit="ms", samples=result["times_ms"], note=note, **at, **keys)]
    rows += [
        make_row(metric=f"{p}_ms", unit="ms", samples=v, **at, **keys) for p, v in result["phases"].items()
    ]
    mean_s = sum(result["times_ms"]) / len(result["times_ms"]) / 1e3
    flops = step_flops(mcfg, cfg.batch_per_rank, cfg.context_length)  # per rank, no recomputation
    extra = extra | {"tflops": ("TFLOP/s", flops / mean_s / 1e12)}
    extra["mfu_measured_peak"] = ("fraction", flops / mean_s / measured_matmul_peak(device))
    if (datasheet := peak_flops(device_name(device), "bf16")) is not None:
        extra["mfu_datasheet"] = ("fraction", flops / mean_s / datasheet)
    rows += [
        make_row(metric=m, unit=u, value=float(v), note=missing_note(m, v), **at, **keys)
        for m, (u, v) in extra.items()
    ]
    rows += [
        make_row(metric="peak_memory_gib", unit="GiB", value=p / 2**30, x_name="rank", x_value=r, **keys)
        for r, p in enumerate(peaks)
        if not math.isnan(p)
    ]
    return rows


@functools.cache
def measured_matmul_peak(device: torch.device) -> float:
    """The bf16 matmul FLOP/s of this device, measured once per process (train_step.matmul_peak)."""
    return matmul_peak(device)


def failure_rows(cfg, label: str, note: str, world_size: int) -> list[dict]:
    at = dict(x_name="world_size", x_value=world_size)
    return [failure_row(metric="step_ms", unit="ms", note=note, **at, **_keys(cfg, label, world_size))]


def finish_rows(cfg, kept: dict, world_size: int) -> list[dict]:
    """The matmul rate measured by rank 0 (the reference of mfu_measured_peak), and the backend that
    plain SDPA (the stock step's attention) picks for the config's attention on this device."""
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    keys = dict(problem=PROBLEM, name="matmul_peak", impl="torch.mm", dtype="bf16", config=asdict(cfg))
    rows = [make_row(metric="tflops", unit="TFLOP/s", value=measured_matmul_peak(device) / 1e12, **keys)]
    keys = dict(problem=PROBLEM, name="sdpa_backend", impl="stock", dtype="bf16", config=asdict(cfg))
    backend = sdpa_backend(get_config(cfg.size, context_length=cfg.context_length), device)
    return [*rows, make_row(metric="backend", unit="", value=math.nan, note=backend, **keys)]


def sdpa_backend(mcfg, device: torch.device) -> str:
    """The SDPBackend PyTorch chooses for one sequence of `mcfg`'s causal attention in bf16."""
    from torch.nn.attention import SDPBackend

    head = mcfg.d_model // mcfg.num_heads
    q = torch.empty(1, mcfg.num_heads, mcfg.context_length, head, device=device, dtype=torch.bfloat16)
    return SDPBackend(torch._fused_sdp_choice(q, q, q, is_causal=True)).name
