"""Naive attention at scale (handout pytorch_attention, and torch_compile (a) with `impl="naive_compiled"`).

The function benchmarked is the model's own causal naive attention, `get_attention("naive")` of
`cs336_systems.model.attention` (softmax(Q K^T / sqrt(d)) V with the T x T scores materialised and
a causal mask applied with `torch.where`), in float32, on Q, K, V of shape (batch=8, T, d): no head
dimension. Grid: d in {16, 32, 64, 128} x T in {256, 1024, 4096, 8192, 16384}.

Protocol (handout 1.2.1): random inputs; `warmup` forward+backward passes; 100 forward passes, each
timed with `timeit.default_timer()` around the call and a `torch.cuda.synchronize()`; then one more
forward whose allocated memory is recorded right before backward ("memory before backward"); then
100 backward passes of that graph (`retain_graph=True`, input gradients reset to None before each
pass, so no accumulation kernel is timed), each synchronised. Peak allocated memory of the forward
and of the backward phase are recorded too. OOM (or any failure) in a phase becomes a failure row;
the phases after it are recorded as not run.

`attention_memory_accounting` (in `pytorch_attention_facts`, with the study's `facts`) gives the bytes of every component (inputs, output, the tensors
autograd saves, transient buffers) from the shapes alone; the test suite checks its "saved" part
against saved-tensor hooks.

Caveats: the compiled variant uses `torch.compile(..., dynamic=True)` (one compilation serves the
whole grid; static shapes would compile 20 times) and disables AOTAutograd's donated buffers so the
backward can be replayed with `retain_graph=True`. Time budgets (`budget=`) can lower the number of
passes of a configuration (the row's `n` and `note` say so) or skip it with a "skipped:" row.
"""

from __future__ import annotations

import contextlib
import gc
import math
import timeit
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from tqdm.auto import tqdm

from cs336_systems.measure import cli
from cs336_systems.measure.budget import TimeBudget, skipped_row
from cs336_systems.measure.results import append_rows, capture_failure, failure_row, make_row
from cs336_systems.measure.timing import synchronize
from cs336_systems.model import get_attention
from cs336_systems.studies.attention.pytorch_attention_facts import (
    BATCH_SIZE,
    MIB,
    attention_memory_accounting,
    facts,  # noqa: F401 (the study's facts, kept beside its tables)
)

PROBLEM = "pytorch_attention"
COMPILE_PROBLEM = "torch_compile"
HEAD_DIMS = (16, 32, 64, 128)
SEQ_LENS = (256, 1024, 4096, 8192, 16384)
# Beyond the handout grid: a 141 GB H200 fits the whole grid, so one longer sequence shows the OOM point.
EXTRA_POINTS = ((16, 32768),)
IMPLS = ("naive", "naive_compiled")
COMPILE_ESTIMATE_S = 60.0  # budget needed before the first compiled call (Dynamo + Inductor, fwd and bwd)
METRICS = (
    "forward_time",
    "backward_time",
    "memory_before_backward",
    "memory_forward_graph",
    "peak_memory_forward",
    "peak_memory_backward",
)


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The model's causal naive attention: q, k, v (batch, T, d) -> (batch, T, d)."""
    return get_attention("naive")(q, k, v, True)


_COMPILED: dict[str, Callable] = {}


def compiled_attention(
    backend: str = "inductor",
) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """`torch.compile(naive_attention, dynamic=True)` (one per backend and process)."""
    if backend not in _COMPILED:
        _COMPILED[backend] = torch.compile(naive_attention, dynamic=True, backend=backend)
    return _COMPILED[backend]


def _replayable_backward() -> contextlib.AbstractContextManager:
    """AOTAutograd's donated buffers forbid a second backward of one graph (retain_graph=True); the
    backward graph is compiled lazily at the first backward call, so this must cover the whole run."""
    if hasattr(torch._functorch.config, "donated_buffer"):
        return torch._functorch.config.patch(donated_buffer=False)
    return contextlib.nullcontext()


@dataclass(frozen=True, kw_only=True)
class AttentionBenchConfig:
    d: int
    seq_len: int
    batch_size: int = BATCH_SIZE
    impl: str = "naive"
    reps: int = 100
    warmup: int = 3
    min_reps: int = 5
    backend: str = "inductor"
    device: str = "cuda" if torch.cuda.is_available() else "cpu"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.impl not in IMPLS:
            raise ValueError(f"impl must be one of {IMPLS}, got {self.impl!r}")
        if min(self.d, self.seq_len, self.batch_size) < 1:
            raise ValueError(
                f"d, seq_len and batch_size must be positive, got {self.d}, {self.seq_len}, {self.batch_size}"
            )
        if self.reps < 1 or self.warmup < 1 or self.min_reps < 1:
            raise ValueError("need reps >= 1, warmup >= 1 and min_reps >= 1")

    @property
    def problem(self) -> str:
        return PROBLEM if self.impl == "naive" else COMPILE_PROBLEM

    @property
    def impl_label(self) -> str:
        return (
            self.impl
            if self.backend == "inductor" or self.impl == "naive"
            else f"{self.impl}[{self.backend}]"
        )


def _reset_grads(*ts: torch.Tensor) -> None:
    for t in ts:
        t.grad = None


def _timed(fn: Callable[[], Any], device: str) -> tuple[Any, float]:
    start = timeit.default_timer()
    out = fn()
    synchronize(device)
    return out, timeit.default_timer() - start


def _device_total_bytes(device: str) -> int | None:
    if not _cuda(device):
        return None
    return torch.cuda.get_device_properties(torch.device(device)).total_memory


def _cuda(device: str) -> bool:
    return torch.device(device).type == "cuda" and torch.cuda.is_available()


def _measure(cfg: AttentionBenchConfig, fn: Callable, budget: TimeBudget | None) -> dict[str, Any]:
    """Run the protocol; returns samples (s), memory (bytes), notes per phase. Never raises on OOM.

    A backward pass that fails during the warm-up (OOM) is recorded as the backward phase's failure;
    the forward phase is still warmed up and measured.
    """
    res: dict[str, Any] = {"notes": {}}
    cuda = _cuda(cfg.device)
    gen = torch.Generator(device=cfg.device).manual_seed(cfg.seed)
    shape = (cfg.batch_size, cfg.seq_len, cfg.d)
    outcome: dict[str, str] = {}
    bwd_outcome: dict[str, str] = {}
    with capture_failure(outcome):
        q, k, v = (torch.randn(shape, device=cfg.device, generator=gen, requires_grad=True) for _ in range(3))
        do = torch.randn(shape, device=cfg.device, generator=gen)
        o = None
        t_bwd = 0.0
        for i in range(cfg.warmup):
            o, t_fwd = _timed(lambda: fn(q, k, v), cfg.device)
            if not bwd_outcome:
                with capture_failure(bwd_outcome):
                    _, t_bwd = _timed(lambda: o.backward(do), cfg.device)  # noqa: B023 - this iteration's o
                if bwd_outcome:
                    t_bwd = 0.0
            o = None
            _reset_grads(q, k, v)
            if i == 0:
                res["first"] = (t_fwd, math.nan if bwd_outcome else t_bwd)
        per_rep = t_fwd + t_bwd
        reps = cfg.reps
        if budget is not None and not budget.can_afford(reps * per_rep):
            reps = max(0, min(reps, int(0.9 * budget.remaining() / per_rep)))
            if reps < min(cfg.min_reps, cfg.reps):
                res["skipped"] = budget.skip_note(f"{cfg.reps} passes of ~{per_rep * 1e3:.0f} ms")
                return res
            res["reps_note"] = f"passes reduced from {cfg.reps} to {reps} (time budget)"
        res["reps"] = reps
        fwd = []
        for _ in range(reps):
            o = None  # free the previous graph before building the next one
            o, dt = _timed(lambda: fn(q, k, v), cfg.device)
            fwd.append(dt)
        res["forward"] = fwd
        o = None
        if cuda:
            synchronize(cfg.device)
            base = torch.cuda.memory_allocated()  # inputs, dO, library workspaces
            torch.cuda.reset_peak_memory_stats()
        o = fn(q, k, v)
        synchronize(cfg.device)
        if cuda:
            res["memory_before_backward"] = torch.cuda.memory_allocated()
            res["memory_forward_graph"] = res["memory_before_backward"] - base
            res["peak_memory_forward"] = torch.cuda.max_memory_allocated()
    if outcome:
        res["notes"]["forward"] = outcome["note"]
        return res
    if bwd_outcome:
        res["notes"]["backward"] = bwd_outcome["note"]
        return res
    with capture_failure(outcome):
        bwd = []
        for _ in range(reps):
            _reset_grads(q, k, v)
            _, dt = _timed(lambda: o.backward(do, retain_graph=True), cfg.device)
            bwd.append(dt)
        res["backward"] = bwd
        if cuda:
            res["peak_memory_backward"] = torch.cuda.max_memory_allocated()
    if outcome:
        res["notes"]["backward"] = outcome["note"]
    return res


def run_attention(
    cfg: AttentionBenchConfig, *, budget: TimeBudget | None = None, attention_fn: Callable | None = None
) -> list[dict[str, Any]]:
    """Measure one (d, T) configuration; returns tidy rows (failure / skipped rows included).

    attention_fn: override the function under test (tests inject failures this way).
    """
    first_compile = attention_fn is None and cfg.impl == "naive_compiled" and cfg.backend not in _COMPILED
    fn = attention_fn or (naive_attention if cfg.impl == "naive" else compiled_attention(cfg.backend))
    config = {
        **asdict(cfg),
        "causal": True,
        "dtype": "float32",
        "accounting": attention_memory_accounting(cfg.batch_size, cfg.seq_len, cfg.d),
        "device_total_bytes": _device_total_bytes(cfg.device),
    }
    common = dict(
        problem=cfg.problem,
        name=f"d{cfg.d}",
        impl=cfg.impl_label,
        mode="fwd_bwd",
        dtype="fp32",
        x_name="seq_len",
        x_value=cfg.seq_len,
        config=config,
    )
    cuda = _cuda(cfg.device)
    metrics = [("forward_time", "ms"), ("backward_time", "ms")]
    if cuda:
        metrics += [
            ("memory_before_backward", "MiB"),
            ("memory_forward_graph", "MiB"),
            ("peak_memory_forward", "MiB"),
            ("peak_memory_backward", "MiB"),
        ]
    if budget is not None and (
        budget.exhausted() or (first_compile and not budget.can_afford(COMPILE_ESTIMATE_S))
    ):
        if first_compile:
            _COMPILED.pop(cfg.backend, None)  # nothing was compiled: let a later, affordable call try
        why = budget.skip_note(f"compiling (~{COMPILE_ESTIMATE_S:.0f} s)" if first_compile else "")
        return [skipped_row(metric=m, unit=u, reason=why, **common) for m, u in metrics]
    with _replayable_backward() if cfg.impl == "naive_compiled" else contextlib.nullcontext():
        res = _measure(cfg, fn, budget)
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    if "skipped" in res:
        return [skipped_row(metric=m, unit=u, reason=res["skipped"], **common) for m, u in metrics]
    fwd_note, bwd_note = res["notes"].get("forward"), res["notes"].get("backward")
    note = res.get("reps_note", "")
    rows = []
    if "first" in res:
        for name, t in zip(("first_forward_time", "first_backward_time"), res["first"]):
            if not math.isnan(t):
                rows.append(make_row(metric=name, unit="ms", value=t * 1e3, **common))
    for metric, unit in metrics:
        phase = (
            "forward"
            if metric
            in ("forward_time", "memory_before_backward", "memory_forward_graph", "peak_memory_forward")
            else "backward"
        )
        if fwd_note:
            why = fwd_note if phase == "forward" else f"not run: forward failed ({fwd_note})"
            rows.append(failure_row(metric=metric, unit=unit, note=why, **common))
        elif phase == "backward" and bwd_note:
            rows.append(failure_row(metric=metric, unit=unit, note=bwd_note, **common))
        elif unit == "ms":
            samples = [x * 1e3 for x in res[phase]]
            rows.append(make_row(metric=metric, unit=unit, samples=samples, note=note, **common))
        else:
            rows.append(make_row(metric=metric, unit=unit, value=res[metric] / MIB, **common))
    return rows


def attention_grid(
    head_dims: Sequence[int] = HEAD_DIMS,
    seq_lens: Sequence[int] = SEQ_LENS,
    impl: str = "naive",
    extra_points: Sequence[tuple[int, int]] = EXTRA_POINTS,
    **kw: Any,
) -> list[AttentionBenchConfig]:
    """Configurations in run order: the grid (d outer, T inner), then the extra (d, T) points."""
    pts = [(d, t) for d in head_dims for t in seq_lens] + [p for p in extra_points]
    return [AttentionBenchConfig(d=d, seq_len=t, impl=impl, **kw) for d, t in pts]


def measure(
    config: AttentionBenchConfig | Sequence[AttentionBenchConfig],
    *,
    results_dir: str | None = None,
    budget: TimeBudget | None = None,
    save: bool = True,
    progress: bool = True,
) -> list[dict[str, Any]]:
    """Run one configuration or several in order, appending each one's rows as soon as it finishes."""
    configs = [config] if isinstance(config, AttentionBenchConfig) else list(config)
    all_rows = []
    for cfg in tqdm(configs, desc="attention", disable=not progress):
        rows = run_attention(cfg, budget=budget)
        if save:
            append_rows(cfg.problem, rows, results_dir)
        all_rows.extend(rows)
    return all_rows


def main(argv: Sequence[str] | None = None) -> None:
    p = cli.make_parser(
        __doc__,
        "python -m cs336_systems.studies.attention.pytorch_attention --head-dims 16 --seq-lens 256 1024",
    )
    p.add_argument("--head-dims", type=int, nargs="+", default=list(HEAD_DIMS))
    p.add_argument("--seq-lens", type=int, nargs="+", default=list(SEQ_LENS))
    p.add_argument("--impl", choices=IMPLS, default="naive")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    cli.add_results_dir(p)
    args = p.parse_args(argv)
    with cli.usage_errors(p):
        configs = attention_grid(
            args.head_dims, args.seq_lens, impl=args.impl, extra_points=(), device=args.device
        )
    print(f"{len(configs)} configurations, e.g. {configs[0]}")
    rows = measure(configs, results_dir=cli.results_dir_for(args.results_dir))
    print(f"{len(rows)} rows written")


if __name__ == "__main__":
    main()
