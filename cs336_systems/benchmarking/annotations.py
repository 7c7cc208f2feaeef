"""Named ranges visible to every profiler: NVTX (Nsight Systems) and torch.profiler record_function.

`annotate("forward")` pushes both, so the same scripts give filtered kernel tables under
`nsys profile` (where installed) and under torch.profiler/CUPTI (what the lent GPU hosts support).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def annotate(name: str, enabled: bool = True) -> Iterator[None]:
    if not enabled:
        yield
        return
    with torch.profiler.record_function(name):
        if torch.cuda.is_available():
            torch.cuda.nvtx.range_push(name)
            try:
                yield
            finally:
                torch.cuda.nvtx.range_pop()
        else:
            yield
