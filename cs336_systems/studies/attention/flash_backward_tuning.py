"""One-pass backward tuning (`flash_bench --tune-bwd`): dQ added from inside the dK/dV pass (float32
atomics or TMA bulk reductions, `BwdConfig.dq`) against today's two passes, the whole backward timed.

Each candidate runs the complete backward (`launch.launch_bwd` with both passes: for the one-pass
modes that is the zeroed float32 dQ buffer, the dK/dV kernel and the cast into dq) on outputs
poisoned with NaN, is checked against the two-pass result (relative error <= 2e-2 for dq, dk and
dv), and only then timed. The two-pass heuristic is timed first and last, so a drift of the GPU
between the two shows. Rows: `name == "bwd_tuning"` in flash_leaderboard.csv.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pandas as pd
import torch

from cs336_systems.attention.flash_triton import launch, tiles
from cs336_systems.measure.results import append_rows, latest_run
from cs336_systems.studies.attention.flash_sweep import LEADERBOARD
from cs336_systems.studies.attention.flash_tuning import portable_problem, rel_err, time_candidate

# (block_m1, block_n1, warps, stages, early_dp, maxnreg1, dq) per head dim. Registers were read
# offline first (sm_90 compiles with Triton 3.6, OPTIMIZATION_LOG.md "One-pass backward"): at d = 64
# the 64x64 "reduce" kernel needs 230 registers uncapped (two 4-warp CTAs per SM), 32x64 164 (three,
# no spills); at d = 128 only 16x64 compiles without spills.
ONE_PASS_CANDIDATES: dict[int, list[tuple]] = {
    64: [
        (64, 64, 4, 2, True, 168, "reduce"),
        (64, 64, 4, 2, True, None, "reduce"),
        (64, 64, 4, 2, False, None, "reduce"),
        (64, 64, 4, 2, False, 168, "reduce"),
        (32, 64, 4, 2, True, None, "reduce"),
        (32, 64, 4, 3, True, None, "reduce"),
        (32, 128, 8, 2, True, None, "reduce"),
        (32, 128, 8, 2, True, 128, "reduce"),
        (64, 128, 8, 2, True, None, "reduce"),
        (64, 64, 4, 2, True, 168, "atomic"),
        (32, 64, 4, 2, True, None, "atomic"),
    ],
    128: [
        (16, 64, 4, 2, False, None, "reduce"),
        (32, 64, 4, 2, False, None, "reduce"),
        (32, 64, 4, 3, False, None, "reduce"),
        (64, 64, 8, 2, False, None, "reduce"),
        (32, 128, 8, 2, False, None, "reduce"),
        (16, 64, 4, 2, False, None, "atomic"),
    ],
}


def one_pass_candidates(d: int, base: tiles.BwdConfig) -> list[tiles.BwdConfig]:
    """The one-pass configurations timed at head dim d (base supplies the unused dQ-pass fields)."""
    return [
        tiles.BwdConfig(
            bm1,
            bn1,
            base.block_m2,
            base.block_n2,
            w,
            st,
            base.num_warps2,
            base.num_stages2,
            early_dp=early,
            maxnreg1=cap,
            dq=dq,
        )
        for bm1, bn1, w, st, early, cap, dq in ONE_PASS_CANDIDATES.get(d, [])
    ]


def run_backward_tuning(
    heads: int, n: int, d: int, dtype: torch.dtype, *, device: str = "cuda", results_dir=None
) -> list[dict[str, Any]]:
    """Time the whole backward (causal, batch 1, the tl kernels) for the two-pass heuristic and the
    one-pass candidates; print them fastest first; append the rows. Returns the rows."""
    rows: list[dict[str, Any]] = []
    tensors, opts, tma = portable_problem(heads, n, d, dtype, device)[5:]
    base = tiles.heuristic_bwd(n, n, tiles.block_d(d), dtype, interpreter=False)
    grads = tensors[4:7]
    launch.launch_bwd(tensors, True, base, opts, tma)
    refs = [g.clone() for g in grads]
    config = {"heads": heads, "seq_len": n, "d": d, "causal": True, "batch": 1}
    results: list[tuple[float, str, str]] = []

    def record(cfg: tiles.BwdConfig, label: str) -> None:
        def call() -> None:
            launch.launch_bwd(tensors, True, cfg, opts, tma)

        def check() -> float:
            return max(rel_err(g, r) for g, r in zip(grads, refs))

        for g in grads:
            g.fill_(float("nan"))
        row, ms, note = time_candidate("bwd_tuning", "bwd", label, call, dtype, n, config, check)
        rows.append(row)
        results.append((ms, label, note))
        print(f"bwd {label:<70} " + (f"FAILED {note[:120]}" if note else f"{ms:8.3f} ms"), flush=True)

    record(base, f"two-pass {base!r}")
    for cand in one_pass_candidates(d, base):
        record(cand, f"one-pass {cand!r}")
    record(base, f"two-pass (again) {base!r}")
    print(f"\nwhole backward at {heads} x {n} x {d}, {dtype}, causal, fastest first")
    for ms, label, note in sorted(results):
        print(f"{ms:9.3f} ms  {label} {note[:80]}")
    append_rows(LEADERBOARD, rows, results_dir)
    return rows


def _tiles(label: str) -> tuple[str, str]:
    """'one-pass BwdConfig(block_m1=64, ..., dq='reduce')' -> ('64x64, 4 warps, 2 stages', 'reduce')."""
    f = dict(re.findall(r"(\w+)=([\w.']+)", label))
    tiles = f"{f['block_m1']}x{f['block_n1']}, {f['num_warps1']} warps, {f['num_stages1']} stages"
    return tiles, f.get("dq", "").strip("'")


def one_pass_table(df: pd.DataFrame) -> pd.DataFrame:
    """Per head dim (the latest `--tune-bwd` run of each): the two-pass backward (median of its
    timings before and after the candidates), the fastest one-pass candidate (its tiles and dQ mode;
    the rest of its configuration is in the source rows), and their ratio."""
    tun = df[(df.name == "bwd_tuning") & (df.metric == "latency")].copy()
    if tun.empty:
        return pd.DataFrame()
    tun["d"] = [json.loads(c)["d"] for c in tun.config_json]
    rows = []
    for d, g in tun.groupby("d", sort=True):
        run = g[g.git_sha == latest_run(g, keys=("name", "impl", "d", "metric")).git_sha.iloc[-1]]
        two = run[run.impl.str.startswith("two-pass") & run.p50.notna()]
        one = run[run.impl.str.startswith("one-pass") & run.p50.notna()]
        if two.empty or one.empty:
            continue
        best = one.loc[one.p50.idxmin()]
        base = float(two.p50.median())
        tiles, dq = _tiles(best.impl)
        rows.append(
            {
                "head dim": int(d),
                "two-pass ms": base,
                "one-pass ms": float(best.p50),
                "one-pass / two-pass": float(best.p50) / base,
                "one-pass tiles": tiles,
                "dQ": dq,
            }
        )
    out = pd.DataFrame(rows)
    out.attrs["source"] = tun
    return out
