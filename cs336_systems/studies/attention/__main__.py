"""Measure the attention family's naive-attention and compile problems on this host.

    python -m cs336_systems.studies.attention                                   # every part, this GPU
    python -m cs336_systems.studies.attention --parts compile_model --compile-sizes medium large
    python -m cs336_systems.studies.attention --quick                           # tiny grid, CPU

Parts, in this order (rows appended to `<results dir>/<problem>.csv` as each configuration ends):

  attention           pytorch_attention: the 4 x 5 grid (+ one longer sequence), 100+100 passes
  attention_compiled  torch_compile (a): the same with torch.compile'd attention
  compile_model       torch_compile (b): eager vs compiled whole model, forward and train

Nothing bounds the run unless `--budget-s` is given; with it, what no longer fits becomes
"skipped:" rows. Compiling whole 32/48-layer models takes minutes each. The FlashAttention
benchmarks have their own entry with its modes (`python -m cs336_systems.studies.attention.flash_bench`:
the sweep, `--leaderboard`, `--tune...`), as do `flash_overhead` and `flash_model`.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from cs336_systems.measure import cli, parts
from cs336_systems.measure.results import REPO_ROOT
from cs336_systems.model import MODEL_SIZES, SIZES_2025
from cs336_systems.studies.attention.pytorch_attention import attention_grid
from cs336_systems.studies.attention.pytorch_attention import measure as attention_measure
from cs336_systems.studies.attention.torch_compile import attention_compile_sweep, whole_model_compile_sweep

PARTS = ("attention", "attention_compiled", "compile_model")


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = parts.family_parser(
        __doc__, "python -m cs336_systems.studies.attention --quick --parts attention", PARTS
    )
    p.add_argument(
        "--attn-reps", type=int, default=100, help="forward and backward passes per attention config"
    )
    p.add_argument(
        "--compile-backend",
        default=None,
        help="attention compile backend (default: inductor; quick: aot_eager)",
    )
    p.add_argument(
        "--quick-compile-model",
        action="store_true",
        help="in --quick, also compile the whole model (slow on CPU)",
    )
    p.add_argument(
        "--compile-sizes",
        nargs="+",
        default=list(SIZES_2025),
        choices=list(MODEL_SIZES),
        help="model sizes of compile_model",
    )
    p.add_argument("--compile-modes", nargs="+", default=["forward", "train"], choices=["forward", "train"], help="end-to-end modes of compile_model")  # fmt: skip
    args = p.parse_args(argv)
    if not args.quick and not torch.cuda.is_available():
        p.error("no CUDA device: the full grids need a GPU (use --quick for a CPU run at tiny sizes)")
    if args.attn_reps < 1:
        p.error("--attn-reps must be >= 1")
    budget = parts.budget_from(p, args.budget_s, "attention")
    results = str(cli.results_dir_for(args.results_dir, quick=args.quick))
    out = Path(args.out) if args.out else REPO_ROOT / "build" / "studies" / "attention"
    q = args.quick
    dev = "cuda" if torch.cuda.is_available() and not q else "cpu"
    backend = args.compile_backend or ("aot_eager" if q else "inductor")
    attn_kw: dict[str, Any] = {"reps": min(args.attn_reps, 5) if q else args.attn_reps, "device": dev}
    grid_kw: dict[str, Any] = (
        {"head_dims": (16, 32), "seq_lens": (64, 128), "extra_points": ((16, 256),)} if q else {}
    )
    print(f"device: {dev} | results: {results} | out: {out} | budget: {args.budget_s or 'none'}")
    runners = {
        "attention": lambda b: attention_measure(
            attention_grid(**grid_kw, **attn_kw), budget=b, results_dir=results, progress=False
        ),
        "attention_compiled": lambda b: attention_compile_sweep(
            **grid_kw, backend=backend, budget=b, results_dir=results, progress=False, **attn_kw
        ),
        "compile_model": lambda b: whole_model_compile_sweep(
            ("debug",) if q else args.compile_sizes,
            args.compile_modes,
            context_length=64 if q else 512,
            warmup=3,
            steps=5,
            device=dev,
            include_compiled=not q or args.quick_compile_model,
            skip_reason="quick mode on a CPU: Inductor's C++ compile of a whole model takes minutes",
            budget=b,
            results_dir=results,
            progress=False,
        ),
    }
    header = {"device": dev, "quick": q, "results_dir": results}
    return parts.run_parts(runners, args.parts, budget, out, header=header)


if __name__ == "__main__":
    main()
    sys.exit(0)
