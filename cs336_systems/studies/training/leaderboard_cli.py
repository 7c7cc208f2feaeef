"""The command line of the training leaderboard study (`leaderboard.py`): its options, with the run
configuration's defaults, and the configuration fields they give."""

from __future__ import annotations

import argparse
from typing import Any

import torch

from cs336_systems.distributed.zero import PARAM_MODES
from cs336_systems.measure import cli
from cs336_systems.studies.distributed import runner
from cs336_systems.studies.training.leaderboard_stock import RESHARD, SAC_MATMULS


def parser(doc: str, d, paths: tuple[str, ...]) -> argparse.ArgumentParser:
    """The study's options; `d`: the default run configuration, `paths`: the paths it can time."""
    p = cli.make_parser(doc, "python -m cs336_systems.studies.training.leaderboard --nproc 2 --cold")
    runner.add_worker_arguments(p)
    cli.add_size(p, d.size)
    p.add_argument("--layers", nargs="+", type=int, default=[], help="depths to run (default: the size's)")
    p.add_argument("--context-length", type=int, default=0, help="0: the size's context length")
    p.add_argument("--batch-per-rank", type=int, default=d.batch_per_rank, help="sequences per GPU")
    p.add_argument("--param-modes", nargs="+", choices=list(PARAM_MODES), default=list(d.param_modes))
    p.add_argument(
        "--paths",
        nargs="+",
        choices=paths,
        default=list(d.paths),
        help="ours; stock, the first-attempt FSDP2 step; stock_tuned, torchtitan's recipe",
    )
    p.add_argument(
        "--attention",
        choices=["flash_triton", "sdpa", "sdpa_cudnn"],
        default=d.attention,
        help="attention of ours (only flash_triton, our own kernels, is a valid entry)",
    )
    p.add_argument(
        "--flash-bwd", default=d.flash_bwd, metavar="FIELD=VALUE[+...]",
        help="ours: fields of our Hopper backward's configuration replaced, e.g. shortest_first=True "
        "(an A/B of a kernel option inside the step; its runs are trials, never the headline)",
    )  # fmt: skip
    p.add_argument("--checkpoint-blocks", default=d.checkpoint_blocks, help="ours: 'auto' or how many blocks")
    p.add_argument(
        "--keep-attention",
        type=cli.boolean,
        default=d.keep_attention,
        help="ours: recomputed blocks keep the attention's outputs (selective checkpointing)",
    )
    p.add_argument(
        "--keep-matmuls", type=cli.boolean, default=None,
        help="ours: recomputed blocks may also keep every matmul's output, only elementwise work recomputed"
        " (planned per block; default: as --keep-attention)",
    )  # fmt: skip
    p.add_argument(
        "--tuned-sac", choices=list(SAC_MATMULS), default=d.tuned_sac,
        help="stock_tuned: matmul outputs a selectively checkpointed block keeps",
    )  # fmt: skip
    p.add_argument(
        "--tuned-reshard", choices=list(RESHARD), default=d.tuned_reshard,
        help="stock_tuned: FSDP2 frees gathered weights after forward (not the last block), or never",
    )  # fmt: skip
    p.add_argument("--loss-chunk", type=int, default=d.loss_chunk, help="tokens per LM-head + loss chunk")
    p.add_argument("--compile", type=cli.boolean, default=d.compile, help="compile each block (every path)")
    p.add_argument(
        "--overlap", type=cli.boolean, default=d.overlap, help="ours: update units inside backward"
    )
    p.add_argument(
        "--defer-gather",
        type=cli.boolean,
        default=d.defer_gather,
        help="ours, with --overlap: issue a unit's all-gather at the next unit's hook (zero.py's [Note: deferred gathers])",
    )
    p.add_argument("--rep-ms", type=float, default=d.rep_ms, help="do_bench rep (ms of timed calls)")
    p.add_argument("--warmup-ms", type=float, default=d.warmup_ms, help="do_bench warmup (ms)")
    p.add_argument(
        "--estimate-calls", type=int, default=d.estimate_calls, help="do_bench's estimate calls (5)"
    )
    p.add_argument(
        "--trace", type=cli.boolean, default=d.trace, help="profile one step of every path on rank 0"
    )
    p.add_argument(
        "--estimate-recompute", type=cli.boolean, default=d.estimate_recompute,
        help="time one block alone under each recompute policy (the recompute estimate; bf16, GPU)",
    )  # fmt: skip
    p.add_argument(
        "--margin-gib",
        type=float,
        default=d.margin_gib,
        help="ours and stock_tuned, planning: the least memory left free (GiB) tried; each path searches up "
        "from it for a plan without allocator retries",
    )
    p.add_argument(
        "--gc", choices=["auto", "manual"], default=d.gc, help="ours, stock_tuned: manual: no GC while timing"
    )
    p.add_argument("--cold", action="store_true", help="fresh Triton and Inductor cache directories")
    p.add_argument(
        "--backend", default="nccl" if torch.cuda.is_available() else "gloo", choices=["nccl", "gloo"]
    )
    p.add_argument(
        "--nproc", type=int, default=1 if torch.cuda.device_count() < 2 else 2, help="ranks (GPUs)"
    )
    p.add_argument(
        "--quick", action="store_true", help="CPU smoke run: gloo, 2 ranks, debug model, no compile"
    )
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per torchrun launch")
    cli.add_results_dir(p)
    p.add_argument("--figures-dir", default=None, help=argparse.SUPPRESS)
    return p


def config_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The run configuration's fields that the parsed options give (before the quick run's overrides)."""
    return dict(
        size=args.size, layers=tuple(args.layers), context_length=args.context_length,
        batch_per_rank=args.batch_per_rank, param_modes=tuple(args.param_modes), paths=tuple(args.paths),
        attention=args.attention, flash_bwd=args.flash_bwd, checkpoint_blocks=args.checkpoint_blocks,
        keep_attention=args.keep_attention, loss_chunk=args.loss_chunk,
        keep_matmuls=args.keep_attention if args.keep_matmuls is None else args.keep_matmuls,
        tuned_sac=args.tuned_sac, tuned_reshard=args.tuned_reshard,
        compile=args.compile, overlap=args.overlap, defer_gather=args.defer_gather, rep_ms=args.rep_ms, warmup_ms=args.warmup_ms,
        estimate_calls=args.estimate_calls, trace=args.trace, margin_gib=args.margin_gib, cold=args.cold,
        estimate_recompute=args.estimate_recompute, gc=args.gc,
        backend=args.backend,
    )  # fmt: skip
