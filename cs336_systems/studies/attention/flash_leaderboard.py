"""The 2025 FlashAttention-2 leaderboard protocol and the optimisation log's kernel versions (notebook
11's tables, plot and facts: `flash_leaderboard_facts`).

Protocol (handout section 5.1 of the spec): bf16, causal, one `torch.randn(3, 16, 16384, 64,
requires_grad=True)` unbound into q, k, v; `torch.compile(Cls.apply)`; `o = flash(q, k, v, True);
o.sum().backward()` timed by `do_bench(rep=10000, warmup=1000)`; ours vs SDPA flash vs SDPA cuDNN
(the SDPA calls see the same tensors as (1, 16, N, 64) views) with ratios, plus forward-only and
backward-only TFLOP/s and the measured bf16 matmul peak of the same GPU. Rows: "flash_leaderboard".
"""

from __future__ import annotations

import dataclasses
import gc
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from cs336_systems.attention import FlashAttentionTriton
from cs336_systems.attention.flash_triton import hopper, hopper_configs, tiles
from cs336_systems.measure.flops import attention_flops, tflops
from cs336_systems.measure.results import (
    append_rows,
    capture_failure,
    device_name,
    failure_row,
    make_row,
)
from cs336_systems.measure.timing import kernel_time
from cs336_systems.studies.attention.flash_leaderboard_facts import (  # the protocol, and the study's facts
    LeaderboardConfig,
    facts,  # noqa: F401 (kept beside its tables)
)
from cs336_systems.studies.attention.flash_sweep import (
    LEADERBOARD,
    MODES,
    failure_note,
    measure_config,
)
from cs336_systems.studies.attention.impls import STEP_ONLY, attention_fn, impl_options, leaderboard_step


def _row_keys(name: str, impl: str, mode: str, dtype: str, n: int, config: dict[str, Any]) -> dict[str, Any]:
    """The identifying fields of one leaderboard row at sequence length n."""
    return dict(
        problem=LEADERBOARD,
        name=name,
        impl=impl,
        mode=mode,
        dtype=dtype,
        x_name="seq_len",
        x_value=n,
        config=config,
    )


def bench_all(
    fn: Callable[[], object], warmup_ms: float, rep_ms: float, grad_to_none=None
) -> dict[str, float]:
    """do_bench statistics of every repetition on a GPU (a host-timer loop on a CPU)."""
    return kernel_time(fn, warmup_ms=warmup_ms, rep_ms=rep_ms, grad_to_none=grad_to_none)


def matmul_peak_tflops(device: str = "cuda", n: int = 8192, dtype: torch.dtype = torch.bfloat16) -> float:
    """Measured matmul rate of this device (random n x n operands, do_bench median)."""
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    ms = bench_all(lambda: a @ b, 25, 200)["p50"]
    return tflops(2.0 * n**3, ms)


def measure(config: LeaderboardConfig, *, results_dir=None, split: bool = True) -> list[dict[str, Any]]:
    """Time the protocol for every impl, print a side-by-side table, append rows."""
    cfg = config
    gpu = device_name(cfg.device)
    rows: list[dict[str, Any]] = []
    dt = getattr(torch, cfg.dtype)
    key = tiles.tuning_key(cfg.seq_len, cfg.seq_len, cfg.d, dt, True)
    config = dataclasses.asdict(cfg) | {
        "causal": True,
        "timed": "o = flash(q, k, v, True); o.sum().backward()",
        "run_id": time.time_ns(),  # the rows of one call (ours and the baselines) share it
        # our tiles: tuned in this process (--tune) or the launcher's heuristic table
        "tiles_fwd": repr(tiles.current_config("fwd", cfg.seq_len, cfg.seq_len, cfg.d, dt, True)),
        "tiles_bwd": repr(tiles.current_config("bwd", cfg.seq_len, cfg.seq_len, cfg.d, dt, True)),
        "tiles_source": "tuned" if tiles.cached("fwd", key) else "heuristic",
        # the Gluon (sm_90) kernels: chosen by default for this head dim?, and their tiles
        "hopper_default": hopper.preferred(cfg.d),
        "hopper_fwd": repr(hopper_configs.heuristic_fwd(cfg.d)),
        "hopper_dkdv": repr(hopper_configs.heuristic_bwd(cfg.d)),
        "hopper_bwd_default": hopper.preferred(cfg.d, "bwd"),
    }
    results: dict[str, dict[str, float]] = {}
    for impl in cfg.impls:
        torch.manual_seed(0)
        shape = (3, cfg.heads, cfg.seq_len, cfg.d)
        x = torch.randn(shape, device=cfg.device, dtype=getattr(torch, cfg.dtype), requires_grad=True)
        outcome: dict[str, str] = {}
        with capture_failure(outcome):
            step = leaderboard_step(impl, x)
            step()  # compile outside the timed region (do_bench's warm-up would also absorb it)
            results[impl] = bench_all(step, cfg.warmup_ms, cfg.rep_ms)
        common = _row_keys(cfg.name, impl, "fwd_bwd", cfg.dtype, cfg.seq_len, config)
        if impl in results:
            rows.append(make_row(metric="latency", unit="ms", stats=results[impl], **common))
        else:
            rows.append(
                failure_row(metric="latency", unit="ms", note=failure_note(outcome["note"]), **common)
            )
        del x
        gc.collect()
        torch.cuda.empty_cache()
    flops = attention_flops(1, cfg.heads, cfg.seq_len, cfg.seq_len, cfg.d, causal=True, mode="fwd_bwd")
    print(
        f"\nFA2 leaderboard protocol on {gpu}: bf16, causal, {cfg.heads} x {cfg.seq_len} x {cfg.d}, "
        f"do_bench(rep={cfg.rep_ms:g}, warmup={cfg.warmup_ms:g})"
    )
    base = results.get("sdpa_flash", {}).get("p50")
    print(f"{'impl':<16}{'median ms':>11}{'mean ms':>10}{'TFLOP/s':>9}{'vs sdpa_flash':>15}")
    for impl in cfg.impls:
        if impl not in results:
            print(f"{impl:<16}{'failed':>11}")
            continue
        st = results[impl]
        ratio = f"{st['p50'] / base:.3f}x" if base else "-"
        print(f"{impl:<16}{st['p50']:>11.3f}{st['mean']:>10.3f}{tflops(flops, st['p50']):>9.1f}{ratio:>15}")
    append_rows(LEADERBOARD, rows, results_dir)  # before the split: nothing measured is lost if it fails
    if split:
        split_rows = _leaderboard_split(cfg, config)
        append_rows(LEADERBOARD, split_rows, results_dir)
        rows += split_rows
    return rows


def _leaderboard_split(cfg: LeaderboardConfig, config: dict[str, Any]) -> list[dict[str, Any]]:
    """Forward-only and backward-only times at cfg's shape (rows "split" at the protocol shape,
    "shapes_split" at the others), and the bf16 matmul peak."""
    rows = []
    peak = matmul_peak_tflops(cfg.device, cfg.matmul_n, getattr(torch, cfg.dtype))
    rows.append(
        make_row(
            problem=LEADERBOARD,
            name="matmul_peak",
            impl="torch.matmul",
            mode="",
            dtype=cfg.dtype,
            metric="throughput",
            unit="TFLOP/s",
            value=peak,
            config={"shape": f"{cfg.matmul_n}^3"},
        )
    )
    print(f"\nmeasured {cfg.dtype} matmul peak: {peak:.1f} TFLOP/s")
    print(f"{'impl':<16}{'mode':<9}{'median ms':>11}{'TFLOP/s':>9}{'of peak':>9}")
    for impl in (i for i in cfg.impls if i not in STEP_ONLY):  # steps only, not attention callables
        fn = attention_fn(impl, cfg.device)
        with impl_options(impl):
            stats, _, note = measure_config(
                fn,
                **cfg.shape(),
                dtype=getattr(torch, cfg.dtype),
                warmup_ms=cfg.warmup_ms / 10,
                rep_ms=cfg.rep_ms / 10,
                modes=("fwd", "bwd"),
            )
        for mode in ("fwd", "bwd"):
            name = "split" if cfg.is_protocol_shape() else "shapes_split"
            common = _row_keys(name, impl, mode, cfg.dtype, cfg.seq_len, config)
            if mode not in stats:
                rows.append(failure_row(metric="latency", unit="ms", note=note or "not measured", **common))
                continue
            st = stats[mode]
            tf = tflops(
                attention_flops(1, cfg.heads, cfg.seq_len, cfg.seq_len, cfg.d, causal=True, mode=mode),
                st["p50"],
            )
            rows.append(make_row(metric="latency", unit="ms", stats=st, **common))
            rows.append(make_row(metric="throughput", unit="TFLOP/s", value=tf, **common))
            print(f"{impl:<16}{mode:<9}{st['p50']:>11.3f}{tf:>9.1f}{tf / peak:>9.1%}")
    return rows


VARIANTS: dict[str, dict[str, Any]] = {
    # name: kernel options, backward tiles ("heuristic": the table; "tuned": the launcher's current
    # choice, e.g. set by run_tuning), backward implementation. The committed results also hold
    # v4_tma_fused_bwd and v6_tuned_dq_side_stream: neither helped (OPTIMIZATION_LOG.md), and their
    # switches (the fused backward kernel, the dQ pass on a side stream) have left the kernels.
    "v0_mask_all_tiles": {"options": tiles.KernelOptions(False, False, False, hopper=False)},
    "v1_skip_masked_tiles": {"options": tiles.KernelOptions(True, False, False, hopper=False)},
    "v2_split_diagonal": {"options": tiles.KernelOptions(True, True, False, hopper=False)},
    "v3_tma": {"options": tiles.KernelOptions(True, True, True, hopper=False)},
    "v5_tuned_tiles": {"options": tiles.KernelOptions(hopper=False), "bwd": "tuned"},
    "pytorch_compiled_bwd": {"options": tiles.KernelOptions(), "bwd_impl": "pytorch"},
}


def run_variants(
    cfg: LeaderboardConfig, names: Sequence[str] | None = None, *, results_dir=None
) -> list[dict[str, Any]]:
    """Forward and backward times of kernel variants at the leaderboard shape."""
    rows = []
    n, d = cfg.seq_len, cfg.d
    print(f"\nkernel variants at {cfg.heads} x {n} x {d}, bf16, causal (do_bench median)")
    print(f"{'variant':<26}{'fwd ms':>9}{'bwd ms':>9}{'fwd+bwd':>9}")
    for name in names or VARIANTS:
        spec = VARIANTS[name]
        if spec.get("bwd") == "tuned":
            bwd_cfg = tiles.current_config("bwd", n, n, d, torch.bfloat16, True)
        else:
            bwd_cfg = tiles.heuristic_bwd(n, n, d, torch.bfloat16)
        bwd_impl = spec.get("bwd_impl", "triton")
        fn = lambda q, k, v, c, b=bwd_impl: FlashAttentionTriton.apply(q, k, v, c, b)
        pin_fwd = None if spec.get("bwd") == "tuned" else tiles.heuristic_fwd(n, n, d, torch.bfloat16)
        with tiles.use_configs(fwd=pin_fwd, bwd=bwd_cfg, options=spec["options"]):
            stats, _, note = measure_config(fn, **cfg.shape(), dtype=torch.bfloat16, warmup_ms=50, rep_ms=400)
        config = {
            "heads": cfg.heads,
            "seq_len": n,
            "d": d,
            "options": repr(spec["options"]),
            "bwd": repr(bwd_cfg),
            "bwd_impl": bwd_impl,
            "fwd": repr(pin_fwd or tiles.cached("fwd", tiles.tuning_key(n, n, d, torch.bfloat16, True))),
        }
        for mode in MODES:
            common = _row_keys("variant", name, mode, "bfloat16", n, config)
            if mode in stats:
                rows.append(make_row(metric="latency", unit="ms", stats=stats[mode], **common))
            else:
                rows.append(failure_row(metric="latency", unit="ms", note=note or "not measured", **common))
        cells = "".join(f"{stats[m]['p50']:>9.3f}" if m in stats else f"{'fail':>9}" for m in MODES)
        print(f"{name:<26}{cells}  {note}")
    append_rows(LEADERBOARD, rows, results_dir)
    return rows
