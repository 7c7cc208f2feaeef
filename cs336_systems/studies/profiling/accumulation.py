"""Handout 1.1.5 (mixed_precision_accumulation): summing 0.01 a thousand times in fp32 and fp16.

The four loops of the handout, run as written (one scalar tensor add per step, so every partial sum
is rounded to the accumulator's dtype):

1. fp32 accumulator, fp32 increments;
2. fp16 accumulator, fp16 increments;
3. fp32 accumulator, fp16 increments (type promotion casts each increment up inside `+=`);
4. fp32 accumulator, fp16 increments cast to fp32 explicitly.

The result is deterministic (IEEE round-to-nearest-even on every add), identical on CPU and GPU, and
costs microseconds, so the notebook computes it live instead of persisting result rows.

    python -m cs336_systems.studies.profiling.accumulation --steps 1000 --increment 0.01
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd
import torch

from cs336_systems.measure import cli

CASES = [
    # (case, accumulator dtype, increment dtype, explicit cast of the increment to the accumulator dtype)
    ("fp32 += fp32", torch.float32, torch.float32, False),
    ("fp16 += fp16", torch.float16, torch.float16, False),
    ("fp32 += fp16", torch.float32, torch.float16, False),
    ("fp32 += fp16.to(fp32)", torch.float32, torch.float16, True),
]


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}.get(dtype, str(dtype))


def accumulate(
    acc_dtype: torch.dtype,
    inc_dtype: torch.dtype,
    *,
    cast: bool = False,
    steps: int = 1000,
    increment: float = 0.01,
    device: str | torch.device = "cpu",
) -> float:
    """Add `increment` (stored as `inc_dtype`) `steps` times into a scalar `acc_dtype` accumulator."""
    s = torch.tensor(0, dtype=acc_dtype, device=device)
    for _ in range(steps):
        x = torch.tensor(increment, dtype=inc_dtype, device=device)
        s += x.type(acc_dtype) if cast else x
    return float(s.item())


@dataclass(frozen=True, kw_only=True)
class AccumulationConfig:
    steps: int = 1000
    increment: float = 0.01
    device: str = "cpu"

    def __post_init__(self):
        if not isinstance(self.steps, int) or self.steps < 1:
            raise ValueError(f"steps must be a positive int, got {self.steps!r}")
        if not self.increment > 0:
            raise ValueError(f"increment must be positive, got {self.increment!r}")


def measure(config: AccumulationConfig | None = None, *, results_dir=None) -> list[dict[str, Any]]:
    """The four handout loops; one row per case (`results_dir` is accepted like every study's and
    unused: nothing is persisted).

    Columns: case, accumulator, increment_dtype, result (the sum, as float64), exact (steps *
    increment in float64), increment_stored (the increment after rounding to its dtype),
    representation_error (steps * (increment_stored - increment): what an exact accumulator of the
    stored increment would be off by), accumulation_error (result - steps * increment_stored: the
    error added by rounding the partial sums).
    """
    cfg = config or AccumulationConfig()
    steps, increment, device = cfg.steps, cfg.increment, cfg.device
    exact = steps * increment
    rows = []
    for case, acc, inc, cast in CASES:
        stored = float(torch.tensor(increment, dtype=inc).item())
        result = accumulate(acc, inc, cast=cast, steps=steps, increment=increment, device=device)
        rows.append(
            {
                "case": case,
                "accumulator": _dtype_name(acc),
                "increment_dtype": _dtype_name(inc),
                "result": result,
                "exact": exact,
                "increment_stored": stored,
                "representation_error": steps * (stored - increment),
                "accumulation_error": result - steps * stored,
            }
        )
    return rows


def facts(df: pd.DataFrame, steps: int = 1000, increment: float = 0.01) -> dict[str, float]:
    """The numbers the answer quotes, from `measure`'s rows for (steps, increment): each case's
    result and errors, and the fp16 / fp32 spacing near the end value that explains them."""
    r = df.set_index("case")
    near = steps * increment
    exponent = math.floor(math.log2(near))  # values in [2**e, 2**(e+1)) share one spacing
    spacing16 = torch.finfo(torch.float16).eps * 2**exponent
    below = torch.tensor(near - 0.5, dtype=torch.float16)  # a partial sum just below the end value
    return {
        "exact": near,
        "fp32_result": r.loc["fp32 += fp32", "result"],
        "fp16_result": r.loc["fp16 += fp16", "result"],
        "mixed_result": r.loc["fp32 += fp16", "result"],
        "mixed_accumulation_error": r.loc["fp32 += fp16", "accumulation_error"],
        "mixed_representation_error": r.loc["fp32 += fp16", "representation_error"],
        "fp16_increment_stored": r.loc["fp32 += fp16", "increment_stored"],
        "fp32_spacing": torch.finfo(torch.float32).eps * 2**exponent,
        "fp16_spacing": spacing16,
        "fp16_spacing_log2": int(math.log2(spacing16)),
        "fp16_partial_sum": float(below),
        # what one fp16 add of the increment adds to that partial sum
        "fp16_step_there": float(below + torch.tensor(increment, dtype=torch.float16)) - float(below),
    }


def main(argv: Sequence[str] | None = None) -> None:
    p = cli.make_parser(__doc__, "python -m cs336_systems.studies.profiling.accumulation --steps 1000")
    d = AccumulationConfig()
    p.add_argument("--steps", type=int, default=d.steps, help="number of adds")
    p.add_argument("--increment", type=float, default=d.increment, help="the value added each step")
    args = p.parse_args(argv)
    cfg = AccumulationConfig(steps=args.steps, increment=args.increment)
    print(cfg)
    df = pd.DataFrame(measure(cfg))
    print(df.to_string(index=False))
    print(facts(df, steps=cfg.steps, increment=cfg.increment))


if __name__ == "__main__":
    main()
