"""FlashAttention-2 benchmarks: the flash_benchmarking sweep and the 2025 leaderboard protocol.

Sweep (handout 1.3.2 flash_benchmarking): batch 1, one head, causal, N = 128 ... 65536, d = 16 ... 128,
bf16 and fp32; forward, backward and forward+backward latency (`timing.kernel_time`, i.e.
`triton.testing.do_bench`: median and p20/p80), TFLOP/s (`flops.attention_flops`, causal = half
the matmul work) and the peak memory of one forward+backward. Implementations:

* flash_triton            our Triton kernels (forward + two-pass Triton backward)
* flash_triton_ptbwd      our Triton forward + the torch.compile'd PyTorch recomputation backward
* flash_pytorch           tiled PyTorch autograd.Function (eager tile loop, compiled backward)
* flash_pytorch_compiled  the same with every tile step compiled
* naive                   the model's naive attention (T x T scores materialised; OOM recorded)
* sdpa_flash / sdpa_cudnn PyTorch SDPA pinned to its FlashAttention-2 / cuDNN backend
                          (a backend that rejects a dtype or d gives an 'unsupported' row)

Configurations an implementation cannot reasonably run (the Python tile loop at long N, or beyond
a time cap set by an earlier N) become 'skipped: reason' rows, as does everything left when the
overall time budget runs out, so every planned cell has a row. fp32 matmuls run in TF32
(`torch.set_float32_matmul_precision("high")`) for every implementation alike; the row config says so.

Leaderboard (`--leaderboard`, handout section 5.1 of the spec): bf16, causal, one
`torch.randn(3, 16, 16384, 64, requires_grad=True)` unbound into q, k, v; `torch.compile(Cls.apply)`;
`o = flash(q, k, v, True); o.sum().backward()` timed by `do_bench(rep=10000, warmup=1000)`; ours vs
SDPA flash vs SDPA cuDNN (the SDPA calls see the same tensors as (1, 16, N, 64) views) with ratios,
plus forward-only/backward-only TFLOP/s and the measured bf16 matmul peak of the same GPU.
`--variants`, `--tune` (and `--tune-hopper`, `--tune-bwd`) time kernel variants and tile candidates at the leaderboard shape (the
evidence behind flash_triton/OPTIMIZATION_LOG.md); `--ab-bwd` / `--ab-fwd` time Hopper backward /
forward configurations and cuDNN's pass in interleaved rounds (`flash_ab`, printed only).

Rows: problem "flash_benchmarking" (sweep) and "flash_leaderboard" (everything else).
Run: `python -m cs336_systems.studies.attention.flash_bench [--quick] [--leaderboard] [--variants] [--tune]`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from cs336_systems.attention.flash_triton import hopper_configs
from cs336_systems.measure import cli
from cs336_systems.measure.timing import synchronize
from cs336_systems.studies.attention.flash_ab import ab_hopper_backward, ab_hopper_forward, parse_variant
from cs336_systems.studies.attention.flash_backward_tuning import run_backward_tuning
from cs336_systems.studies.attention.flash_host import host_profile, host_times
from cs336_systems.studies.attention.flash_leaderboard import LeaderboardConfig, run_variants
from cs336_systems.studies.attention.flash_leaderboard import measure as run_leaderboard
from cs336_systems.studies.attention.flash_sweep import IMPLS, SweepConfig, quick_config
from cs336_systems.studies.attention.flash_sweep import measure as run_sweep
from cs336_systems.studies.attention.flash_tuning import LAYOUTS, run_hopper_tuning, run_tuning
from cs336_systems.studies.attention.impls import LEADERBOARD_IMPLS, leaderboard_step


def _ints(s: str) -> tuple[int, ...]:
    return tuple(int(x) for x in s.split(",") if x)


def _strs(s: str) -> tuple[str, ...]:
    return tuple(x for x in s.split(",") if x)


def _tune_spec(spec: str) -> tuple[int, torch.dtype, int]:
    """'d:dtype:N' of --tune, e.g. 64:bfloat16:16384."""
    parts = spec.split(":")
    dtype = getattr(torch, parts[1], None) if len(parts) == 3 else None
    if not isinstance(dtype, torch.dtype) or not (parts[0].isdigit() and parts[2].isdigit()):
        raise ValueError(f"--tune: expected d:dtype:N such as 64:bfloat16:16384, got {spec!r}")
    return int(parts[0]), dtype, int(parts[2])


def _lb_shape(spec: str) -> tuple[int, int, int]:
    """'16x16384x64' -> (heads, N, d)."""
    parts = spec.lower().split("x")
    if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"--lb-shapes: {spec!r} is not HEADSxNxD with positive integers (e.g. 16x16384x64)")
    heads, n, d = map(int, parts)
    return heads, n, d


def main(argv: Sequence[str] | None = None) -> None:
    p = cli.make_parser(
        __doc__, "python -m cs336_systems.studies.attention.flash_bench --quick --results-dir /tmp/fa2"
    )
    d = SweepConfig()
    p.add_argument(
        "--sweep",
        action="store_true",
        help="run the flash_benchmarking sweep (default if nothing else is asked)",
    )
    p.add_argument("--seq-lens", type=_ints, default=d.seq_lens, help="comma-separated N values")
    p.add_argument("--head-dims", type=_ints, default=d.head_dims, help="comma-separated head dims")
    p.add_argument("--dtypes", type=_strs, default=d.dtypes, help="comma-separated torch dtype names")
    p.add_argument(
        "--impls", type=_strs, default=d.impls, help=f"comma-separated subset of {','.join(IMPLS)}"
    )
    p.add_argument(
        "--warmup-ms", type=float, default=d.warmup_ms, help="do_bench warm-up budget per measurement"
    )
    p.add_argument(
        "--rep-ms", type=float, default=d.rep_ms, help="do_bench repetition budget per measurement"
    )
    p.add_argument(
        "--pytorch-head-dims", type=_ints, default=d.pytorch_head_dims, help="head dims for the PyTorch impls"
    )
    p.add_argument(
        "--pytorch-max-n",
        type=int,
        default=d.max_n["flash_pytorch"],
        help="longest N for the PyTorch tile loop",
    )
    p.add_argument(
        "--call-cap-ms", type=float, default=d.call_cap_ms, help="stop an impl after a fwd+bwd this slow"
    )
    p.add_argument(
        "--budget-s", type=float, default=None, help="overall sweep time budget (the rest: skipped rows)"
    )
    p.add_argument("--quick", action="store_true", help="tiny CPU-sized sweep (for smoke tests)")
    p.add_argument("--leaderboard", action="store_true", help="run the 2025 leaderboard protocol")
    p.add_argument(
        "--lb-rep-ms", type=float, default=10000.0, help="leaderboard do_bench rep (protocol: 10000)"
    )
    p.add_argument(
        "--lb-warmup-ms", type=float, default=1000.0, help="leaderboard do_bench warmup (protocol: 1000)"
    )
    p.add_argument("--variants", action="store_true", help="time the kernel variants of the optimisation log")
    p.add_argument(
        "--tune", type=str, default="", help="time tile candidates: 'd:dtype:N,...' e.g. 64:bfloat16:16384"
    )
    p.add_argument("--tune-small", action="store_true", help="--tune over the short later-round lists")
    p.add_argument(
        "--tune-hopper",
        type=str,
        default="",
        help="time the Gluon (sm_90) kernels' tile candidates against the tl kernels, each pass alone: "
        "'d:dtype:N,...' e.g. 64:bfloat16:16384 (16 heads, causal)",
    )
    p.add_argument(
        "--tune-bwd",
        type=str,
        default="",
        help="time the one-pass backward candidates (dQ by atomics / TMA reductions inside the dK/dV pass) "
        "against the two-pass heuristic, whole backward: 'd:dtype:N,...' e.g. 64:bfloat16:16384 (16 heads, causal)",
    )
    p.add_argument(
        "--ab-bwd",
        type=str,
        default="",
        help="HEADSxNxD: time the Hopper backward's --ab-variants and cuDNN's backward in interleaved "
        "rounds (causal bf16, batch 1; printed only), e.g. 32x32768x128",
    )
    p.add_argument(
        "--ab-fwd",
        type=str,
        default="",
        help="HEADSxNxD: the same for the Hopper forward's --ab-variants and cuDNN's forward, e.g. 16x16384x128",
    )
    p.add_argument(
        "--ab-variants",
        type=_strs,
        default=("default",),
        help="comma-separated --ab-bwd / --ab-fwd variants: 'default' (the launcher's pass) or "
        "FIELD=VALUE[+FIELD=VALUE] replacing its configuration's fields, e.g. default,shortest_first=True; "
        "a forward variant may name the kernel first, ws (warp-specialised) or wg (one warpgroup), from that "
        "kernel's own defaults: ws+block_n=64; tl (forward only) is the portable tl forward",
    )
    p.add_argument(
        "--ab-rounds", type=int, default=3, help="interleaved rounds of --ab-bwd / --ab-fwd / --host-profile"
    )
    p.add_argument(
        "--ab-layout",
        choices=list(LAYOUTS),
        default="bhnd",
        help="--ab-bwd / --ab-fwd inputs: bhnd dense per head; bnhd heads interleaved in each row (as the "
        "projections give them); step, the compiled model's: q and k dense, v and dO interleaved",
    )
    p.add_argument("--lb-runs", type=int, default=1, help="how many times to run the leaderboard protocol")
    p.add_argument(
        "--lb-shapes",
        type=_strs,
        default=("16x16384x64",),
        help="comma-separated HEADSxNxD causal bf16 shapes for --leaderboard (batch 1; the 2025 protocol is "
        "16x16384x64, rows 'protocol'; other shapes are rows 'shapes'), e.g. 32x32768x128,128x2048x80",
    )
    p.add_argument(
        "--lb-impls",
        type=_strs,
        default=LeaderboardConfig().impls,
        help=f"comma-separated implementations for --leaderboard, from {', '.join(LEADERBOARD_IMPLS)}",
    )
    p.add_argument(
        "--once",
        action="store_true",
        help="the protocol's step (forward + backward) twice per --lb-impls at the first --lb-shapes shape, "
        "nothing timed or saved (the workload to wrap in `ncu`: skip the first call's kernels)",
    )
    p.add_argument(
        "--host-profile",
        action="store_true",
        help="the protocol step's wall time per step for --lb-shapes x --lb-impls in --ab-rounds interleaved "
        "rounds (the host time per call where the GPU's share is small, e.g. 2x128x80; rows "
        "'host_times'), then its profile (printed only)",
    )
    p.add_argument("--host-times-only", action="store_true", help="--host-profile without the profiles")
    p.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"]
    )
    cli.add_results_dir(p)
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is visible (use --device cpu or --quick)")
    with cli.usage_errors(p):
        tune = [_tune_spec(spec) for spec in args.tune.split(",") if spec]
        tune_hopper = [_tune_spec(spec) for spec in args.tune_hopper.split(",") if spec]
        tune_bwd = [_tune_spec(spec) for spec in args.tune_bwd.split(",") if spec]
        sweep_cfg = None
        if args.quick:
            sweep_cfg = quick_config(args.device)
        elif args.sweep or not (
            args.leaderboard
            or args.variants
            or args.tune
            or args.tune_hopper
            or args.tune_bwd
            or args.once
            or args.host_profile
            or args.ab_bwd
            or args.ab_fwd
        ):
            sweep_cfg = SweepConfig(
                seq_lens=args.seq_lens,
                head_dims=args.head_dims,
                dtypes=args.dtypes,
                impls=args.impls,
                warmup_ms=args.warmup_ms,
                rep_ms=args.rep_ms,
                call_cap_ms=args.call_cap_ms,
                budget_s=args.budget_s,
                pytorch_head_dims=args.pytorch_head_dims,
                max_n={
                    "flash_pytorch": args.pytorch_max_n,
                    "flash_pytorch_compiled": args.pytorch_max_n,
                    "flash_triton_ptbwd": 16384,
                },
                device=args.device,
            )
        if args.lb_runs < 1:
            raise ValueError(f"--lb-runs must be >= 1, got {args.lb_runs}")
        lb_shapes = [_lb_shape(spec) for spec in args.lb_shapes]
        if unknown := set(args.lb_impls) - set(LEADERBOARD_IMPLS):
            raise ValueError(f"--lb-impls: unknown {sorted(unknown)}; known: {', '.join(LEADERBOARD_IMPLS)}")
    if args.host_profile:
        if args.device != "cuda":
            p.error("--host-profile needs a CUDA device")
        results_dir = cli.results_dir_for(args.results_dir, quick=args.quick)
        host_times(args.lb_impls, lb_shapes, rounds=args.ab_rounds, results_dir=results_dir)
        if not args.host_times_only:
            host_profile(args.lb_impls, lb_shapes)
        return
    results_dir = None if args.once else cli.results_dir_for(args.results_dir, quick=args.quick)

    if args.ab_bwd or args.ab_fwd:
        flag, kind = ("--ab-bwd", "bwd") if args.ab_bwd else ("--ab-fwd", "fwd")
        with cli.usage_errors(p):
            if args.ab_bwd and args.ab_fwd:
                raise ValueError("--ab-bwd and --ab-fwd take different variants: give one of them")
            heads, n, d = _lb_shape(args.ab_bwd or args.ab_fwd)
            for spec in args.ab_variants:  # bad variants fail here, before any GPU work
                hopper_configs.check_group(parse_variant(spec, d, kind), heads)
            if args.ab_rounds < 1:
                raise ValueError(f"--ab-rounds must be >= 1, got {args.ab_rounds}")
        if args.device != "cuda":
            p.error(f"{flag} times the Hopper kernels: it needs --device cuda")
        ab = ab_hopper_backward if kind == "bwd" else ab_hopper_forward
        ab(heads, n, d, args.ab_variants, rounds=args.ab_rounds, layout=args.ab_layout)
        return
    if args.once and args.device != "cuda":
        p.error("--once is a GPU profiler's workload (bf16 on the GPU kernels): it needs --device cuda")
    if args.once:  # e.g. ncu -k regex:bwd -s 1 -c 1 python -m ... --once --lb-impls flash_triton
        heads, n, d = lb_shapes[0]
        for impl in args.lb_impls:
            torch.manual_seed(0)
            x = torch.randn(3, heads, n, d, device=args.device, dtype=torch.bfloat16, requires_grad=True)
            step = leaderboard_step(impl, x)
            for _ in range(2):  # the first compiles and picks tiles: skip its kernels in a profiler (-s)
                step()
            synchronize(args.device)
            del x, step
        return

    for d, dtype, n in tune:
        run_tuning(16, n, d, dtype, device=args.device, small=args.tune_small, results_dir=results_dir)
    for d, dtype, n in tune_hopper:
        run_hopper_tuning(16, n, d, dtype, device=args.device, results_dir=results_dir)
    for d, dtype, n in tune_bwd:
        run_backward_tuning(16, n, d, dtype, device=args.device, results_dir=results_dir)
    if args.variants:
        run_variants(LeaderboardConfig(device=args.device), results_dir=results_dir)
    if args.leaderboard:
        for heads, n, d in lb_shapes:
            lb = LeaderboardConfig(
                heads=heads,
                seq_len=n,
                d=d,
                rep_ms=args.lb_rep_ms,
                warmup_ms=args.lb_warmup_ms,
                impls=tuple(args.lb_impls),
                device=args.device,
            )
            lb = dataclasses.replace(lb, name="protocol" if lb.is_protocol_shape() else "shapes")
            for i in range(args.lb_runs):  # repeated runs show the run-to-run spread; the split once, last
                run_leaderboard(lb, split=i == args.lb_runs - 1, results_dir=results_dir)
    if sweep_cfg is not None:
        cfg = sweep_cfg
        print(cfg)
        rows = run_sweep(cfg, results_dir=results_dir)
        measured = sum(1 for r in rows if r["metric"] == "latency" and not r["note"])
        print(f"flash_benchmarking: {measured} latency rows measured, {len(rows)} rows written")


if __name__ == "__main__":
    main()
