"""The two timers of the project, each for its job.

* `time_steps` / `PhaseTimer`: end-to-end steps by the handout's protocol -- `warmup` untimed steps,
  then `steps` timed ones, `torch.cuda.synchronize()` after each timed phase and
  `timeit.default_timer()` on the host. Every step's duration is kept, so the warm-up ablation can
  show per-step outliers and not only means.
* `kernel_time`: kernels and single ops through `triton.testing.do_bench` (CUDA events, L2 flush,
  median and p20/p80 of many repetitions). On a CPU it falls back to a host-timer loop with the same
  return shape, so notebooks' quick mode runs everywhere.
"""

from __future__ import annotations

import contextlib
import timeit
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from cs336_systems.measure.results import summarize


def synchronize(device: torch.device | str | None = None) -> None:
    dev = torch.device(device) if device is not None else None
    if (dev is None or dev.type == "cuda") and torch.cuda.is_available():
        torch.cuda.synchronize(dev)


@dataclass
class PhaseTimer:
    """Per-step durations (seconds) of named phases: `with timer.phase("forward"): ...`.

    Each phase is bracketed by device synchronisation, so its time is the device time of the work it
    queued plus host overhead. Disabled (`enabled=False`, e.g. during warm-up) it only runs the body.
    """

    device: torch.device | str | None = None
    enabled: bool = True
    samples: dict[str, list[float]] = field(default_factory=dict)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        synchronize(self.device)
        start = timeit.default_timer()
        yield
        synchronize(self.device)
        self.samples.setdefault(name, []).append(timeit.default_timer() - start)

    def summary(self, scale: float = 1e3) -> dict[str, dict[str, float]]:
        """Statistics per phase, by default in milliseconds."""
        return {k: summarize([x * scale for x in v]) for k, v in self.samples.items()}


def time_steps(
    step: Callable[[], object], *, warmup: int, steps: int, device: torch.device | str | None = None
) -> list[float]:
    """Durations in seconds of `steps` calls of `step` after `warmup` untimed calls (synchronised)."""
    if warmup < 0 or steps < 1:
        raise ValueError(f"need warmup >= 0 and steps >= 1, got warmup={warmup}, steps={steps}")
    for _ in range(warmup):
        step()
    synchronize(device)
    out = []
    for _ in range(steps):
        start = timeit.default_timer()
        step()
        synchronize(device)
        out.append(timeit.default_timer() - start)
    return out


def kernel_time(
    fn: Callable[[], object],
    *,
    warmup_ms: float = 25,
    rep_ms: float = 100,
    grad_to_none=None,
    device: torch.device | str | None = None,
) -> dict[str, float]:
    """Milliseconds per call of `fn`: {"p50", "p20", "p80", "mean", "std", "n"}.

    CUDA: `triton.testing.do_bench` (its own warm-up and repetition budget in ms, L2 flush between
    calls, gradients of `grad_to_none` reset). CPU: repeated host timing with the same budget.
    """
    on_cuda = (device is None or torch.device(device).type == "cuda") and torch.cuda.is_available()
    if on_cuda:
        import triton.testing

        times = triton.testing.do_bench(
            fn, warmup=warmup_ms, rep=rep_ms, grad_to_none=grad_to_none, return_mode="all"
        )
        return summarize(list(times))
    fn()  # warm-up call
    est = max(timeit.timeit(fn, number=1), 1e-6)
    n_warm = max(1, int(warmup_ms / 1e3 / est))
    n_rep = max(3, min(1000, int(rep_ms / 1e3 / est)))
    for _ in range(n_warm):
        fn()
    samples = []
    for _ in range(n_rep):
        if grad_to_none is not None:
            for t in grad_to_none:
                t.grad = None
        start = timeit.default_timer()
        fn()
        samples.append((timeit.default_timer() - start) * 1e3)
    return summarize(samples)
