"""Wall-clock budgets for GPU sessions: measure what fits, record what does not.

A `TimeBudget` is a deadline. Long sweeps ask `can_afford(estimate_s)` before each configuration and,
when the answer is no, write a `skipped_row` (NaN statistics, note "skipped: ...") instead of running,
so a table always shows every planned cell: measured, OOM, or skipped with the reason.
"""

from __future__ import annotations

import math
import timeit
from dataclasses import dataclass, field
from typing import Any

from cs336_systems.measure.results import failure_row


@dataclass
class TimeBudget:
    """`seconds=None` means unlimited. `child(s)` is a sub-budget capped by this one's deadline."""

    seconds: float | None = None
    start: float = field(default_factory=timeit.default_timer)
    label: str = "budget"

    def __post_init__(self) -> None:
        if self.seconds is not None and self.seconds < 0:
            raise ValueError(f"a time budget needs seconds >= 0 or None, got {self.seconds}")

    def elapsed(self) -> float:
        return timeit.default_timer() - self.start

    def remaining(self) -> float:
        return math.inf if self.seconds is None else self.seconds - self.elapsed()

    def exhausted(self) -> bool:
        return self.remaining() <= 0

    def can_afford(self, estimate_s: float) -> bool:
        return estimate_s <= self.remaining()

    def child(self, seconds: float | None, label: str | None = None) -> TimeBudget:
        """A budget of `seconds` from now, never beyond this budget's deadline."""
        rem = self.remaining()
        cap = rem if seconds is None else min(seconds, rem)
        return TimeBudget(None if math.isinf(cap) else max(cap, 0.0), label=label or self.label)

    def skip_reason(self, predicted_s: float = 0.0) -> str | None:
        """Why a configuration predicted to take `predicted_s` must be skipped, or None if it fits."""
        left = self.remaining()
        if left <= 0:
            return "skipped: time budget of the GPU run exhausted"
        if predicted_s > left:
            return f"skipped: predicted {predicted_s:.0f} s exceeds the {left:.0f} s left of the run's budget"
        return None

    def subprocess_timeout(self, floor_s: float = 30.0) -> float | None:
        """A timeout for a child process: None when unbounded (subprocess cannot wait for inf)."""
        return None if self.seconds is None else max(self.remaining(), floor_s)

    def skip_note(self, what: str = "") -> str:
        total = "unlimited" if self.seconds is None else f"{self.seconds:.0f} s"
        return f"skipped: time budget '{self.label}' ({total}) exhausted" + (
            f" before {what}" if what else ""
        )


def skipped_row(*, problem: str, metric: str, unit: str, reason: str, **kw: Any) -> dict[str, Any]:
    """A row for a planned measurement that was not run (time budget, quick mode, unsupported device)."""
    note = reason if reason.startswith("skipped") else f"skipped: {reason}"
    return failure_row(problem=problem, metric=metric, unit=unit, note=note, **kw)
