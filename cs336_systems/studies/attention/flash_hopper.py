"""The Hopper (Gluon) FlashAttention kernels against the portable tl kernels and SDPA's backends.

Rows come from `flash_bench --tune-hopper` (`name == "hopper_tuning"`: each pass alone, tl heuristic
tiles against every Gluon candidate), `flash_bench --leaderboard` (`"protocol"`: the 2025 shape) and
`flash_bench --leaderboard --lb-shapes ...` (`"shapes"`: the models' shapes, batch 1 with B*H heads,
with the host floor `custom_op_floor` beside the kernels) and `flash_bench --tune-bwd` (`"bwd_tuning"`:
the one-pass backward against the two-pass one, `flash_backward_tuning`).
`measure(HopperConfig())` runs all three on an sm_90 GPU; the tables and `facts` (`flash_hopper_facts`)
read the committed rows.

    python -m cs336_systems.studies.attention.flash_hopper --protocol-runs 3
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cs336_systems.measure import cli
from cs336_systems.studies.attention.flash_hopper_facts import (  # the shapes, and the study's facts
    MODEL_SHAPES,
    PROBLEM,  # noqa: F401 (the rows' problem, read as flash_hopper.PROBLEM)
    SHAPE_IMPLS,
    facts,  # noqa: F401 (kept beside its tables)
)
from cs336_systems.studies.attention.flash_leaderboard import LeaderboardConfig
from cs336_systems.studies.attention.flash_leaderboard import (
    measure as run_leaderboard,  # the leaderboard study's measure
)
from cs336_systems.studies.attention.flash_tuning import run_hopper_tuning


@dataclass(frozen=True, kw_only=True)
class HopperConfig:
    protocol_runs_n: int = 3  # interleaved runs of the 2025 protocol
    device: str = "cuda"


def measure(config: HopperConfig | None = None, *, results_dir=None) -> list[dict[str, Any]]:
    """Tune both kernel families per pass (d = 64, 128, 80), then the protocol (interleaved runs) and
    the model shapes, all in this process; returns every row."""
    import torch

    cfg_all = config or HopperConfig()
    device, rows = cfg_all.device, []
    for d in (64, 128, 80):
        rows += run_hopper_tuning(16, 16384, d, torch.bfloat16, device=device, results_dir=results_dir)
    impls = ("flash_triton", "flash_triton_gluon", "sdpa_flash", "sdpa_cudnn")
    for _ in range(cfg_all.protocol_runs_n):
        lb = LeaderboardConfig(impls=impls, device=device)
        rows += run_leaderboard(lb, results_dir=results_dir, split=False)
    for heads, n, d in MODEL_SHAPES:
        cfg = LeaderboardConfig(
            heads=heads,
            seq_len=n,
            d=d,
            rep_ms=2000,
            warmup_ms=300,
            impls=SHAPE_IMPLS,
            device=device,
            name="shapes",
        )
        rows += run_leaderboard(cfg, results_dir=results_dir, split=False)
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    p = cli.make_parser(__doc__, "python -m cs336_systems.studies.attention.flash_hopper --protocol-runs 3")
    p.add_argument("--protocol-runs", type=int, default=HopperConfig().protocol_runs_n)
    cli.add_results_dir(p)
    args = p.parse_args(argv)
    cfg = HopperConfig(protocol_runs_n=args.protocol_runs)
    print(cfg)
    rows = measure(cfg, results_dir=cli.results_dir_for(args.results_dir))
    print(f"{len(rows)} rows written")


if __name__ == "__main__":
    main()
