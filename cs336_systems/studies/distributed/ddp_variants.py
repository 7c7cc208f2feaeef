"""The DDP variants of the training benchmark: labels, what each wraps the model in, a step clock.

A label is a kind, optionally with a bucket size in MB: "single", "naive", "flat", "overlap",
"bucketed[:<MB>]", "torch[:<MB>]" (`train_bench` describes each). `wrap` builds the variant around a
model; `StepClock` times the phases of one step from marks on the compute stream.
"""

from __future__ import annotations

import math
import os
import timeit
from dataclasses import dataclass
from pathlib import Path

import torch

from cs336_systems.distributed.ddp import DDP_VARIANTS, DDPBucketed
from cs336_systems.measure.results import results_dir as default_results_dir
from cs336_systems.measure.timing import synchronize

PROBLEM = "ddp_training"  # train_bench's rows (ddp_training.csv) and profiler traces

KIND_IMPL = {
    "single": "single_gpu",
    "naive": "ddp_naive",
    "flat": "ddp_flat",
    "overlap": "ddp_overlap_individual",
    "bucketed": "ddp_bucketed",
    "torch": "ddp_torch",
}
TORCH_DEFAULT_BUCKET_MB = 25.0  # torch.nn.parallel.DistributedDataParallel's bucket_cap_mb default
BUCKET_SIZES_MB = (1, 10, 100, 1000)
DEFAULT_VARIANTS = (
    "single",
    "naive",
    "flat",
    "overlap",
    *(f"bucketed:{b}" for b in BUCKET_SIZES_MB),
    "torch",
    *(f"torch:{b}" for b in BUCKET_SIZES_MB),
)
COMM_MEANING = {
    "naive": "sync call (all communication, after backward)",
    "flat": "sync call (all communication incl. flatten/unflatten copies, after backward)",
    "overlap": "exposed: end of backward -> end of sync",
    "bucketed": "exposed: end of backward -> end of sync",
}


@dataclass(frozen=True)
class Variant:
    """One benchmarked configuration, parsed from a label such as "bucketed:10" or "torch"."""

    kind: str
    bucket_size_mb: float | None = None

    @classmethod
    def parse(cls, label: str) -> Variant:
        kind, _, size = label.partition(":")
        if kind not in KIND_IMPL:
            raise ValueError(
                f"unknown variant {label!r}; kinds: {', '.join(KIND_IMPL)} (bucketed:<MB>, torch:<MB>)"
            )
        if size and kind not in ("bucketed", "torch"):
            raise ValueError(f"variant {label!r}: only bucketed and torch take a bucket size")
        mb = float(size) if size else None
        if mb is not None and not mb > 0:
            raise ValueError(f"variant {label!r}: bucket size must be > 0 MB")
        return cls(kind, mb)

    @property
    def label(self) -> str:
        return self.kind if self.bucket_size_mb is None else f"{self.kind}:{self.bucket_size_mb:g}"

    @property
    def impl(self) -> str:
        return KIND_IMPL[self.kind]

    @property
    def x_value(self) -> float:
        """Bucket size in MB for the bucketed variants (inf = one bucket), NaN for the others."""
        if self.kind == "bucketed":
            return math.inf if self.bucket_size_mb is None else self.bucket_size_mb
        if self.kind == "torch":
            return TORCH_DEFAULT_BUCKET_MB if self.bucket_size_mb is None else self.bucket_size_mb
        return math.nan


class StepClock:
    """Phase durations (ms) of one step from marks on the compute stream (CUDA events) or the host."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device

    def _now(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return timeit.default_timer()

    def start(self) -> None:
        synchronize(self.device)
        self._wall0 = timeit.default_timer()
        self._marks = [("start", self._now())]

    def mark(self, name: str) -> None:
        self._marks.append((name, self._now()))

    def stop(self) -> dict[str, float]:
        synchronize(self.device)
        out = {"step": (timeit.default_timer() - self._wall0) * 1e3}
        for (_, a), (name, b) in zip(self._marks, self._marks[1:]):
            out[name] = a.elapsed_time(b) if self.cuda else (b - a) * 1e3
        return out


def wrap(variant: Variant, model: torch.nn.Module, device: torch.device):
    """(module to call, gradient-sync function, wrapper or None)."""
    if variant.kind == "single":
        return model, lambda: None, None
    if variant.kind == "torch":
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(
            model,
            device_ids=[device.index] if device.type == "cuda" else None,
            bucket_cap_mb=variant.bucket_size_mb,
        )
        return ddp, lambda: None, ddp
    if variant.kind == "bucketed":
        ddp = DDPBucketed(model, variant.bucket_size_mb)
    else:
        ddp = DDP_VARIANTS[variant.kind](model)
    return ddp, ddp.finish_gradient_synchronization, ddp


def trace_path(results_dir: str | os.PathLike | None, label: str) -> Path:
    """Where train_bench writes the profiler trace of variant `label`."""
    safe = label.replace(":", "_").replace(".", "p")
    return default_results_dir(results_dir) / f"{PROBLEM}__trace_{safe}.json.gz"
