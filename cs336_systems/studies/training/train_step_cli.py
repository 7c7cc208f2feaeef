"""The command line of the training_step study (`train_step.py`): its options, their checks and the
quick run's overrides."""

from __future__ import annotations

import argparse

import torch

from cs336_systems.measure import cli
from cs336_systems.model import MODEL_SIZES

PARTS = ("bandwidth", "check", "compare", "waterfall")
DEFAULT_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def default_attention(device) -> str:
    """Our step's attention unless `--attention` says otherwise: our Triton kernel where it runs bf16."""
    return "flash_triton" if torch.device(device).type == "cuda" else "sdpa"


def parser(doc: str) -> argparse.ArgumentParser:
    """The study's options (`doc`: the study's docstring, whose first paragraph describes it)."""
    p = argparse.ArgumentParser(
        prog="python -m cs336_systems.studies.training.train_step",
        description=doc.split("\n\n")[0],
        epilog="example: python -m cs336_systems.studies.training.train_step --size 2.7B --context-length 512 2048",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--size", choices=list(MODEL_SIZES), default="2.7B", help="model size preset")
    p.add_argument("--context-length", nargs="+", type=int, default=[512, 2048])
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--rounds", type=int, default=4, help="interleaved rounds of stock and ours")
    p.add_argument("--steps", type=int, default=8, help="timed steps per path per round")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps after the first (compile) step")
    p.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    p.add_argument(
        "--attention",
        choices=["flash_triton", "sdpa"],
        default=default_attention(DEFAULT_DEVICE),
        help="attention of our step: by default our Triton FlashAttention-2 where CUDA is available, else "
        "SDPA (the Triton interpreter cannot run bf16); another choice is named in the rows' impl "
        "(e.g. 'ours +sdpa')",
    )
    p.add_argument(
        "--no-overlap",
        dest="overlap",
        action="store_false",
        help="our step applies the update after backward instead of overlapping it",
    )
    p.add_argument(
        "--compile-mode",
        choices=["default", "max-autotune-no-cudagraphs"],
        default="default",
        help="torch.compile mode of our blocks (stock always uses the default)",
    )
    p.add_argument(
        "--overlap-programs",
        type=int,
        default=0,
        help="grid cap of our overlapped optimizer launches (0: uncapped)",
    )
    p.add_argument(
        "--cuda-graph",
        action="store_true",
        help="our step replays as one CUDA graph after two eager steps (timed whole, no phases)",
    )
    p.add_argument("--no-compile", dest="compile", action="store_false", help="eager stock and ours")
    p.add_argument(
        "--no-trace",
        dest="trace",
        action="store_false",
        help="compare: no profiled step of each path (by default its trace is saved beside the rows)",
    )
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--device", default=DEFAULT_DEVICE, choices=["cuda", "cpu"])
    cli.add_results_dir(p)
    p.add_argument("--no-save", action="store_true", help="print only")
    p.add_argument(
        "--quick",
        action="store_true",
        help="debug model, 2 rounds of 2 steps, 4 check steps, no compile, no save",
    )
    return p


def checked(args: argparse.Namespace) -> argparse.Namespace:
    """The parsed options with the quick run's overrides and the results directory, after the checks
    that name a bad option before any work (SystemExit)."""
    if args.quick:
        args.size, args.context_length, args.rounds, args.steps, args.warmup = "debug", [32], 2, 2, 1
        args.compile, args.no_save = False, args.results_dir is None
    if args.attention == "sdpa" and torch.device(args.device).type == "cpu":
        print("ours uses SDPA attention on the CPU: our flash_triton needs CUDA for bf16", flush=True)
    if args.rounds < 1 or args.steps < 1 or args.warmup < 0:
        raise SystemExit("--rounds and --steps must be >= 1 and --warmup >= 0")
    if args.attention == "flash_triton" and torch.device(args.device).type != "cuda":
        raise SystemExit(
            "--attention flash_triton needs a CUDA device for bf16 (use --attention sdpa on a CPU)"
        )
    if args.cuda_graph and torch.device(args.device).type != "cuda":
        raise SystemExit("--cuda-graph captures our step in a CUDA graph: it needs --device cuda")
    if any(c < 1 for c in args.context_length):
        raise SystemExit(f"--context-length must be positive, got {args.context_length}")
    if not args.no_save:
        args.results_dir = str(cli.results_dir_for(args.results_dir, quick=args.quick))
    args.size_name = args.size
    return args
