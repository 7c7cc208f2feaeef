"""benchmarking_mixed_precision: what torch.autocast does to dtypes, and what it buys in speed.

(a) `dtype_table` runs the handout's toy model (fc1 -> ReLU -> LayerNorm -> fc2, no biases, fp32
    parameters) one training step under `torch.autocast` and reads every dtype off the run: forward
    hooks give the modules' outputs, a TorchDispatchMode sees the operands autocast hands to the
    matmul kernels, the loss and the gradients are inspected directly. Nothing is typed in.
(b) `layernorm_precision` computes LayerNorm's statistics entirely in fp32, fp16 and bf16 on data
    with a large spread, to show which part of LayerNorm is precision-sensitive (squares overflowing
    fp16's range; bf16 keeping the range but only ~3 significant digits).
(c) `timing_configs` gives the end_to_end configurations (fp32 vs bf16 autocast, all sizes) whose
    rows go to the problem "benchmarking_mixed_precision".

`measure(configs)` runs (a) and (c) without a time budget (`timing_run.measure_mixed_precision`, which
notebook 04 calls, runs the same under an optional budget and reuses benchmarking_script's fp32 rows):

    python -m cs336_systems.studies.profiling.mixed_precision --sizes small --context-length 128

Caveat: autocast's op lists differ by device. On CUDA, layer_norm and the loss run in fp32; on CPU
(where quick runs use bf16 because that is the CPU's low-precision type) layer_norm keeps bf16. The
table records what the device at hand did, and says which device and dtype that was.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pandas as pd
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from cs336_systems.measure import cli
from cs336_systems.measure.results import append_rows, make_row
from cs336_systems.model import SIZES_2025
from cs336_systems.studies.profiling import end_to_end, timing_facts
from cs336_systems.studies.profiling.end_to_end import EndToEndConfig, grid

PROBLEM = "benchmarking_mixed_precision"
OPERANDS = "fc1 matmul operands (autocast's cast copies)"
_BITS = {torch.float32: 32, torch.float16: 16, torch.bfloat16: 16, torch.float64: 64}


class ToyModel(nn.Module):
    """The handout's toy model: fc1 (no bias) -> ReLU -> LayerNorm(10) -> fc2 (no bias)."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.fc1 = nn.Linear(in_features, 10, bias=False)
        self.ln = nn.LayerNorm(10)
        self.fc2 = nn.Linear(10, out_features, bias=False)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (batch, in_features) -> logits (batch, out_features)."""
        x = self.relu(self.fc1(x))
        x = self.ln(x)
        return self.fc2(x)


class _MatmulOperands(TorchDispatchMode):
    """Records the dtypes of the operands of every matmul that reaches the kernels (after autocast)."""

    MATMULS = ("aten.mm", "aten.addmm", "aten.bmm", "aten.matmul")

    def __init__(self):
        super().__init__()
        self.seen: list[tuple[str, tuple[torch.dtype, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        if any(name == m for m in self.MATMULS):
            self.seen.append((name, tuple(a.dtype for a in args if isinstance(a, torch.Tensor))))
        return func(*args, **(kwargs or {}))


def default_autocast_dtype(device: str) -> torch.dtype:
    """fp16 on CUDA (the handout's setting), bf16 on CPU (the CPU's supported low-precision type)."""
    return torch.float16 if torch.device(device).type == "cuda" else torch.bfloat16


def dtype_table(
    device: str | None = None, dtype: torch.dtype | None = None, *, seed: int = 0
) -> pd.DataFrame:
    """One forward/backward of ToyModel under autocast; returns rows (quantity, dtype) as observed.

    device: default "cuda" when available, else "cpu"; dtype: default `default_autocast_dtype`.
    """
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = dtype or default_autocast_dtype(device)
    torch.manual_seed(seed)
    model = ToyModel(in_features=32, out_features=8).to(device)
    x = torch.randn(16, 32, device=device)
    y = torch.randint(0, 8, (16,), device=device)
    outputs: dict[str, torch.dtype] = {}
    hooks = [
        getattr(model, name).register_forward_hook(
            lambda _m, _i, out, name=name: outputs.__setitem__(name, out.dtype)
        )
        for name in ("fc1", "relu", "ln", "fc2")
    ]
    operands = _MatmulOperands()
    try:
        with torch.autocast(device_type=torch.device(device).type, dtype=dtype):
            param_dtypes = sorted({str(p.dtype) for p in model.parameters()})
            with operands:
                logits = model(x)
            loss = F.cross_entropy(logits, y)
        loss.backward()
    finally:
        for h in hooks:
            h.remove()
    grad_dtypes = sorted({str(p.grad.dtype) for p in model.parameters()})
    fc1_operands = sorted({str(d) for d in operands.seen[0][1]}) if operands.seen else ["(no matmul seen)"]
    rows = [
        ("model parameters (inside autocast)", ", ".join(param_dtypes)),
        (OPERANDS, ", ".join(fc1_operands)),
        ("fc1 output", str(outputs["fc1"])),
        ("ReLU output", str(outputs["relu"])),
        ("LayerNorm output", str(outputs["ln"])),
        ("logits (fc2 output)", str(outputs["fc2"])),
        ("loss", str(loss.dtype)),
        ("parameter gradients", ", ".join(grad_dtypes)),
    ]
    table = pd.DataFrame(rows, columns=["quantity", "dtype"])
    table.attrs.update(device=device, autocast_dtype=str(dtype))
    return table


def dtype_rows(table: pd.DataFrame, problem: str = PROBLEM) -> list[dict[str, Any]]:
    """Tidy rows of a `dtype_table`: mode = quantity, dtype = observed dtype, value = its bit width."""
    device, ac = table.attrs.get("device", ""), table.attrs.get("autocast_dtype", "")
    label = {"torch.float16": "fp16-autocast", "torch.bfloat16": "bf16-autocast"}.get(ac, ac)
    rows = []
    for order, (quantity, observed) in enumerate(table.itertuples(index=False)):
        first = getattr(torch, observed.split(",")[0].strip().replace("torch.", ""), None)
        bits = _BITS.get(first) if isinstance(first, torch.dtype) else None
        rows.append(
            make_row(
                problem=problem,
                name="toy_model",
                impl=label,
                mode=quantity,
                dtype=observed,
                x_name="order",
                x_value=order,
                metric="observed_dtype_bits",
                unit="bits",
                value=float(bits) if bits else None,
                config={"device": device, "autocast_dtype": ac, "model": "ToyModel(32, 8)"},
            )
        )
    return rows


LAYERNORM_WIDTH = 1024  # the row width of the LayerNorm experiment


def fp16_mean_accumulates_wider(width: int = LAYERNORM_WIDTH) -> bool:
    """Does torch's fp16 `mean` accumulate in a wider type? Rows of `width` squares of 16 (256 each): their
    sum (262144) overflows fp16, their mean (256) does not. True iff the mean comes out finite."""
    sq = torch.full((width,), 16.0, dtype=torch.float16) ** 2
    return bool(torch.isfinite(sq.mean()))


def layernorm_precision(
    *,
    num_rows: int = 64,
    width: int = LAYERNORM_WIDTH,
    offset: float = 0.0,
    spread: float = 300.0,
    seed: int = 0,
) -> pd.DataFrame:
    """LayerNorm with mean, variance and normalisation all computed in fp32, fp16 or bf16.

    Inputs are offset + spread * N(0, 1) rounded to each dtype; the reference is the fp64 LayerNorm
    of the same rounded inputs, so the error is the arithmetic's, not the input rounding's. Returns
    one row per dtype: whether the squared deviations overflowed, the variance relative error, and
    the max abs error of the normalised output.
    """
    g = torch.Generator().manual_seed(seed)
    base = offset + spread * torch.randn(num_rows, width, generator=g, dtype=torch.float64)
    rows = []
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        x = base.to(dtype)
        ref_x = x.double()
        ref_var = ref_x.var(dim=-1, unbiased=False, keepdim=True)
        ref = (ref_x - ref_x.mean(dim=-1, keepdim=True)) / torch.sqrt(ref_var + 1e-5)
        mean = x.mean(dim=-1, keepdim=True)  # rounded to `dtype`
        sq = (x - mean) * (x - mean)  # squared deviations, in `dtype`
        var = sq.mean(dim=-1, keepdim=True)
        out = (x - mean) * torch.rsqrt(var + 1e-5)
        rows.append(
            {
                "dtype": str(dtype).replace("torch.", ""),
                "max |x - mean|": float((ref_x - ref_x.mean(dim=-1, keepdim=True)).abs().max()),
                "largest finite value": float(torch.finfo(dtype).max),
                "squares overflowed": bool(torch.isinf(sq).any()),
                "variance rel. error": float(((var.double() - ref_var).abs() / ref_var).max()),
                "output max abs error": float((out.double() - ref).abs().max()),
            }
        )
    return pd.DataFrame(rows)


def timing_configs(
    sizes: Sequence[str] = SIZES_2025,
    *,
    context_length: int = 512,
    modes: Sequence[str] = ("forward", "train"),
    autocast: Sequence[str] = ("none", "bf16"),
    warmup: int = 5,
    steps: int = 10,
    device: str | None = None,
) -> list[EndToEndConfig]:
    """fp32 vs bf16-autocast end_to_end configurations (forward-only, and a training step whose rows
    give forward, backward and optimizer times separately)."""
    kw = {"device": device} if device else {}
    return grid(
        size=list(sizes),
        context_length=context_length,
        mode=list(modes),
        autocast=list(autocast),
        warmup=warmup,
        steps=steps,
        **kw,
    )


def layernorm_frame(spreads: Sequence[float] = (300.0, 1.0)) -> pd.DataFrame:
    """`layernorm_precision` for a wide and a narrow input spread, one frame with a `spread` column."""
    return pd.concat([layernorm_precision(spread=s).assign(spread=s) for s in spreads], ignore_index=True)


def facts(df: pd.DataFrame, *, context_length: int) -> dict[str, Any]:
    """The numbers the benchmarking_mixed_precision answers state: (a) the toy model's dtypes, (b) the
    LayerNorm precision experiment (computed live), (c) the bf16 speed-ups at `context_length`.
    (a) and (c) are absent when `df` has no such rows."""
    out: dict[str, Any] = {}
    dtypes = timing_facts.dtype_frame(df)
    if len(dtypes):
        out["gpu_name"] = dtypes.attrs["gpu_name"]
        out["autocast_dtype"] = dtypes.attrs["autocast_dtype"].replace("torch.", "")
        out["dtype_of"] = dict(
            zip(dtypes.quantity, dtypes.dtype.str.replace("torch.", "", regex=False), strict=True)
        )
    ln = layernorm_frame()
    wide, narrow = ln[ln.spread == 300.0].set_index("dtype"), ln[ln.spread == 1.0].set_index("dtype")
    fp16_max = wide.loc["float16", "largest finite value"]
    out |= {
        "fp16_largest_finite": fp16_max,
        "fp16_overflow_deviation": fp16_max**0.5,
        # torch's fp16 mean accumulates in fp32 (checked live), so only the elementwise squares overflow;
        # a kernel summing the squares in fp16 would overflow once their RMS exceeded this:
        "fp16_mean_accumulates_wider": fp16_mean_accumulates_wider(),
        "fp16_sum_overflow_rms": (fp16_max / LAYERNORM_WIDTH) ** 0.5,
        "layernorm_width": LAYERNORM_WIDTH,
        "fp16_output_error_wide": wide.loc["float16", "output max abs error"],
        "bf16_variance_error_wide": wide.loc["bfloat16", "variance rel. error"],
        "bf16_output_error_narrow": narrow.loc["bfloat16", "output max abs error"],
        "bf16_over_fp16_error_narrow": narrow.loc["bfloat16", "output max abs error"]
        / narrow.loc["float16", "output max abs error"],
        "fp32_output_error_narrow": narrow.loc["float32", "output max abs error"],
    }
    stats = timing_facts.timing_stats(df)
    table = timing_facts.mixed_table(stats[stats.x == context_length])
    if len(table):
        speedup = table.xs("speed-up", axis=1, level=1)
        step = speedup["train step"]
        out["speedup"] = {
            "sizes": list(speedup.index),
            "step_first": step.iloc[0],
            "step_last": step.iloc[-1],
            "grows_with_size": bool(step.iloc[-1] > step.iloc[0]),
            **{
                f"{name}_{end}": getattr(speedup[phase], end)()
                for name, phase in (
                    ("forward", "forward"),
                    ("backward", "backward"),
                    ("optimizer", "optimizer step"),
                )
                for end in ("min", "max")
            },
        }
    return out


def measure(
    config: Sequence[EndToEndConfig] | None = None, *, results_dir=None, device: str | None = None
) -> list[dict[str, Any]]:
    """(a) the toy model's dtype rows on `device`, then (c) the timing configurations (default: every
    `timing_configs()`), all appended under this problem; returns every row."""
    rows = dtype_rows(dtype_table(device))
    append_rows(PROBLEM, rows, results_dir)
    configs = timing_configs(device=device) if config is None else config
    return rows + end_to_end.measure(configs, problem=PROBLEM, results_dir=results_dir)


def main(argv: Sequence[str] | None = None) -> None:
    p = cli.make_parser(
        __doc__,
        "python -m cs336_systems.studies.profiling.mixed_precision --sizes small --context-length 128",
    )
    cli.add_size(p, list(SIZES_2025), nargs="+", flag="--sizes")
    p.add_argument("--context-length", type=int, default=512)
    p.add_argument("--warmup", type=int, default=5, help="untimed warm-up steps")
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--device", default=None, help="default: cuda when visible, else cpu")
    cli.add_results_dir(p)
    args = p.parse_args(argv)
    configs = timing_configs(
        args.sizes,
        context_length=args.context_length,
        warmup=args.warmup,
        steps=args.steps,
        device=args.device,
    )
    print(f"{len(configs)} timing configurations, e.g. {configs[0]}")
    rows = measure(configs, results_dir=cli.results_dir_for(args.results_dir), device=args.device)
    print(f"{PROBLEM}: {len(rows)} rows written")


if __name__ == "__main__":
    main()
