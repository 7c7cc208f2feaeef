"""Tile tuning at the leaderboard shape (`flash_bench --tune`), its tables, and Nsight Compute reports.

Each backward pass is timed alone over its candidate tiles (the evidence behind the heuristic table
in `attention/flash_triton/tiles.py` and OPTIMIZATION_LOG.md); `ncu_summary` parses the committed
`ncu` text reports of the backward kernels.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from cs336_systems.attention.flash_triton import hopper, hopper_configs, launch, tiles
from cs336_systems.measure.results import append_rows, capture_failure, failure_row, latest_run, make_row
from cs336_systems.studies.attention.flash_leaderboard import bench_all
from cs336_systems.studies.attention.flash_sweep import LEADERBOARD

DKDV_CANDIDATES = [
    (64, 64, 4, 3, False),
    (64, 64, 4, 3, True),
    (32, 64, 4, 3, False),
    (64, 64, 4, 2, False),
    (64, 64, 4, 2, True),
    (128, 64, 4, 2, False),
    (128, 64, 4, 2, True),
    (128, 64, 4, 3, False),
    (128, 64, 4, 3, True),
    (128, 64, 8, 2, False),
    (128, 64, 8, 3, False),
    (64, 128, 8, 3, False),
    (128, 128, 8, 2, False),
    (128, 128, 8, 2, True),
    (32, 128, 8, 3, False),
]  # (block_m1, block_n1, warps, stages, early_dp)
# Later rounds on the H200 (--tune-small). Round 2 (git 0a93eb849e) timed register caps that keep
# three CTAs per SM: (64, 64, 4, 2|3, True, None|168|160), (64, 64, 4, 3|2, False, None|160); dQ
# (128, 64, 4|8, 3|4); forward (128, 64, 8, 3|2). Round 3: 32-query steps, whose smaller S/dP tiles
# fit four CTAs per SM under a 128-register cap, against round 2's winner.
DKDV_CANDIDATES_SMALL = [
    (64, 64, 4, 2, True, 168),
    (32, 64, 4, 3, True, 128),
    (32, 64, 4, 2, True, 128),
    (32, 64, 4, 4, True, 128),
    (32, 64, 4, 3, True, None),
    (64, 64, 4, 2, True, 128),
]  # (block_m1, block_n1, warps, stages, early_dp, maxnreg)
DQ_CANDIDATES_SMALL = [(128, 64, 8, 4)]
FWD_CANDIDATES_SMALL = [(128, 64, 8, 3)]
# (block_m2, block_n2, warps, stages)
DQ_CANDIDATES = [(128, 64, 4, 3), (128, 64, 4, 2), (128, 64, 4, 4), (128, 64, 8, 3)]
DQ_CANDIDATES += [(64, 64, 4, 3), (128, 128, 8, 2), (256, 64, 8, 2), (128, 32, 4, 3)]


def time_candidate(
    name: str,
    kind: str,
    label: str,
    call: Callable[[], object],
    dtype: torch.dtype,
    n: int,
    config: dict[str, Any],
    check: Callable[[], float] | None = None,
    max_rel_err: float = 2e-2,
) -> tuple[dict[str, Any], float, str]:
    """Run `call` once, check it (`check()` -> relative error against a reference, if given), then time
    it (do_bench median). Returns (the tidy row, median ms or inf, the failure note or ""): a failing or
    wrong candidate is a failure row, never a timing."""
    outcome: dict[str, str] = {}
    st, err = None, math.nan
    with capture_failure(outcome):
        call()
        if check is not None:
            err = check()
            if not err <= max_rel_err:
                raise AssertionError(f"relative error {err:.3g} > {max_rel_err:g} against the reference")
        st = bench_all(call, 25, 200)
    common = dict(
        problem=LEADERBOARD,
        name=name,
        impl=label,
        mode=kind,
        dtype=str(dtype).removeprefix("torch."),
        x_name="seq_len",
        x_value=n,
        config=config if check is None else config | {"rel_err": err},
    )
    if st is None:
        note = outcome.get("note", "failed")
        return failure_row(metric="latency", unit="ms", note=note, **common), math.inf, note
    return make_row(metric="latency", unit="ms", stats=st, **common), st["p50"], ""


def run_tuning(
    heads: int,
    n: int,
    d: int,
    dtype: torch.dtype,
    *,
    device: str = "cuda",
    results_dir=None,
    install: bool = True,
    block_pointers: bool = False,
    small: bool = False,
) -> list[dict[str, Any]]:
    """Time forward tile candidates, then each backward pass alone over its candidates with TMA
    descriptors (and block pointers too if block_pointers), then the winners together; print them
    fastest first. With install=True the winners become the launcher's configuration for this
    shape (as the autotuner would). (Older rounds also timed the dQ pass on a side stream; that
    switch has left the kernels.)"""
    memory_paths = (True, False) if block_pointers else (True,)
    block_d = tiles.block_d(d)
    if small:  # the second round: a few candidates around the first round's winners
        fwd_cands = [tiles.FwdConfig(*c) for c in FWD_CANDIDATES_SMALL]
        dkdv_cands, dq_cands = DKDV_CANDIDATES_SMALL, DQ_CANDIDATES_SMALL
    else:
        fwd_cands = tiles.fwd_candidates(block_d, dtype)
        dkdv_cands = [(*c, None) for c in DKDV_CANDIDATES]
        dq_cands = DQ_CANDIDATES
    rows = []
    torch.manual_seed(0)
    q, k, v, do = (torch.randn(1, heads, n, d, device=device, dtype=dtype) for _ in range(4))
    o, lse = launch.flash_fwd(q, k, v, True)
    tensors, _ = launch.prepare_backward(do, q, k, v, o, lse)

    def passes_runner(cfg: tiles.BwdConfig, passes: tuple[str, ...], tma: bool) -> Callable[[], None]:
        opts = tiles.KernelOptions(use_tma=tma)
        path = launch.use_tma(opts, q.device, *tensors[:7])
        return lambda: launch.launch_bwd(tensors, True, cfg, opts, path, passes)

    results: list[tuple[str, float, Any, str]] = []

    config = {"heads": heads, "seq_len": n, "d": d, "causal": True}

    def time_one(kind: str, cand: Any, call: Callable[[], object], tma: bool | None = None) -> None:
        label = repr(cand) + ("" if tma is None else f" [tma={tma}]")
        row, ms, note = time_candidate("tuning", kind, label, call, dtype, n, config)
        rows.append(row)
        results.append((kind, ms, (cand, tma), note))

    for cand in fwd_cands:
        with tiles.use_configs(fwd=cand):
            time_one("fwd", cand, lambda: launch.flash_fwd(q, k, v, True))
    for bm1, bn1, w, st, early, maxnreg in dkdv_cands:
        for tma in memory_paths:
            cand = tiles.BwdConfig(bm1, bn1, 64, 32, w, st, 4, 3, early_dp=early, maxnreg1=maxnreg)
            time_one("dkdv", cand, passes_runner(cand, ("dkdv",), tma), tma)
    for bm2, bn2, w, st in dq_cands:
        for tma in memory_paths:
            cand = tiles.BwdConfig(32, 64, bm2, bn2, 4, 3, w, st)
            time_one("dq", cand, passes_runner(cand, ("dq",), tma), tma)
    print(f"\ntile candidates at {heads} x {n} x {d}, {dtype}, causal")
    for kind, ms, (cand, tma), note in sorted(results, key=lambda r: (r[0], r[1])):
        print(f"{kind:<5}{ms:>9.3f} ms  {cand!r} tma={tma} {note}")
    best = {
        kind: min((r for r in results if r[0] == kind), key=lambda r: r[1])[2][0]
        for kind in ("fwd", "dkdv", "dq")
    }
    b1, b2 = best["dkdv"], best["dq"]
    bwd = tiles.BwdConfig(
        b1.block_m1,
        b1.block_n1,
        b2.block_m2,
        b2.block_n2,
        b1.num_warps1,
        b1.num_stages1,
        b2.num_warps2,
        b2.num_stages2,
        early_dp=b1.early_dp,
        maxnreg1=b1.maxnreg1,
    )
    time_one("bwd", bwd, passes_runner(bwd, ("dkdv", "dq"), True), True)
    print(f"best: {best['fwd']!r}\n      {bwd!r}")
    if install:
        key = tiles.tuning_key(n, n, d, dtype, True)
        tiles.remember("fwd", key, best["fwd"])
        tiles.remember("bwd", key, bwd)
    append_rows(LEADERBOARD, rows, results_dir)
    return rows


# The Gluon (Hopper) kernels' candidates, by head dim: forward (block_m, block_n, stages, warps) and
# dK/dV (block_m queries per step, block_n keys, stages, warps, register cap). Registers per thread
# were read offline first (sm_90 compiles with Triton 3.6, OPTIMIZATION_LOG.md "Gluon"): e.g. the
# dK/dV kernel needs 222 at 64x64 (two 4-warp CTAs per SM), 151 at 32x64 (three).
HOPPER_FWD_CANDIDATES = {
    64: [
        (128, 64, 3, 8),
        (128, 64, 4, 8),
        (128, 64, 2, 8),
        (128, 128, 2, 8),
        (64, 64, 4, 4),
        (64, 128, 3, 4),
    ],
    128: [(128, 64, 2, 8), (128, 128, 2, 8), (64, 64, 3, 4), (64, 128, 2, 4), (128, 64, 3, 8)],
    80: [(128, 64, 3, 8), (128, 64, 2, 8), (128, 128, 2, 8), (64, 64, 3, 4), (64, 128, 3, 4)],
}
# The warp-specialised forward: (consumers, block_n, stages, pingpong, consumer_regs).
HOPPER_WS_FWD_CANDIDATES = {
    64: [(2, 128, 2, True, 240), (2, 128, 2, False, 240), (3, 64, 3, True, 160), (3, 64, 3, False, 160)],
    128: [(2, 128, 2, True, 240), (2, 128, 2, False, 240), (2, 128, 3, False, 240), (2, 64, 3, True, 240)],
    80: [(2, 128, 2, False, 240), (2, 64, 3, True, 240)],
}
# The warp-specialised dK/dV pass: (block_m, stages, consumer_regs, consumers).
HOPPER_WS_DKDV_CANDIDATES = {
    64: [(64, 3, 240, 2), (64, 5, 240, 2), (32, 4, 160, 3), (64, 3, 160, 3)],
    128: [(64, 2, 240, 2), (64, 3, 240, 2)],
    80: [(64, 2, 240, 2), (64, 4, 240, 2), (32, 4, 160, 3)],
}
# One-pass backward: (block_m, stages, consumer_regs, consumers, dq_regs [, ds_slots, dq_buffers
# [, dq_in_consumers]]): dQ by a third warpgroup (register splits that compile without spills for
# sm_90, Triton 3.6), or at d = 128 by the two consumers.
HOPPER_ONE_PASS_CANDIDATES = {
    64: [(64, 2, 184, 2, 120), (64, 3, 184, 2, 120), (64, 2, 200, 2, 88), (64, 2, 184, 2, 120, 3, 3)],
    80: [(64, 2, 208, 2, 72), (64, 3, 208, 2, 72)],
    128: [(64, 2, 240, 2, 0, 2, 1, True), (64, 2, 240, 2, 0, 2, 2, True)],
}
HOPPER_DKDV_CANDIDATES = {
    64: [
        (64, 64, 2, 4, None),
        (64, 64, 2, 4, 168),
        (32, 64, 3, 4, None),
        (32, 64, 4, 4, None),
        (32, 64, 3, 4, 128),
        (16, 64, 4, 4, None),
        (32, 128, 3, 8, None),
        (32, 128, 3, 8, 128),
        (64, 128, 2, 8, None),
    ],
    128: [(64, 64, 2, 4, None), (32, 64, 2, 4, None), (16, 64, 3, 4, None), (32, 128, 2, 8, None)],
    80: [
        (64, 64, 2, 4, None),
        (32, 64, 2, 4, None),
        (32, 64, 3, 4, None),
        (16, 64, 3, 4, None),
    ],
}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64 (a tuning candidate's check against the reference result)."""
    return float((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))


# (1, H, N, d) dense; views of (1, N, H, d) (heads interleaved in each row); "step": q and k dense, v and
# dO interleaved, as the compiled block gives them (q and k come out of RoPE, v and dO are views of a
# projection's output and of the output projection's gradient)
LAYOUTS = ("bhnd", "bnhd", "step")


def portable_problem(heads: int, n: int, d: int, dtype: torch.dtype, device: str, layout: str = "bhnd"):
    """Random causal inputs (batch 1, seed 0), the tl kernels' forward on them, and the backward's
    operands (`launch.prepare_backward`). Returns (q, k, v, o, lse, tensors, options, tma). With
    layout "bnhd" q, k, v and dO are (1, H, N, d) views of (1, N, H, d) tensors, as the model's
    attention gets them from its projections (each row holds every head's d values); with "step" only
    v and dO are such views, q and k dense, as in the compiled model's step."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    torch.manual_seed(0)
    interleaved = {"bhnd": (), "bnhd": (0, 1, 2, 3), "step": (2, 3)}[layout]  # which of q, k, v, dO
    q, k, v, do = (
        torch.randn(1, n, heads, d, device=device, dtype=dtype).transpose(1, 2)
        if i in interleaved
        else torch.randn(1, heads, n, d, device=device, dtype=dtype)
        for i in range(4)
    )
    portable = tiles.KernelOptions(hopper=False)
    with tiles.use_configs(options=portable):
        o, lse = launch.flash_fwd(q, k, v, True)
        tensors, _ = launch.prepare_backward(do, q, k, v, o, lse)
    return q, k, v, o, lse, tensors, portable, launch.use_tma(portable, q.device, *tensors[:7])


def run_hopper_tuning(
    heads: int, n: int, d: int, dtype: torch.dtype, *, device: str = "cuda", results_dir=None
) -> list[dict[str, Any]]:
    """Time the Gluon forward and dK/dV candidates against the tl kernels' heuristic tiles, each pass
    alone (causal, batch 1). Every candidate is first checked against the tl result (relative error
    <= 2e-2 on poisoned outputs); a wrong or failing one is a failure row, never a timing."""
    rows: list[dict[str, Any]] = []
    q, k, v, o_ref, lse_ref, tensors, portable, tma = portable_problem(heads, n, d, dtype, device)
    bwd_cfg = tiles.current_config("bwd", n, n, d, dtype, True)
    with tiles.use_configs(options=portable):
        launch.launch_bwd(tensors, True, bwd_cfg, portable, tma)
    dq_ref, dk_ref, dv_ref = (t.clone() for t in tensors[4:7])
    config = {"heads": heads, "seq_len": n, "d": d, "causal": True, "batch": 1}

    def record(kind: str, label: str, call: Callable[[], object], check: Callable[[], float] | None) -> None:
        row, ms, note = time_candidate("hopper_tuning", kind, label, call, dtype, n, config, check)
        rows.append(row)
        print(f"{kind:<5} {label:<55} " + (f"FAILED {note[:120]}" if note else f"{ms:8.3f} ms"))

    with tiles.use_configs(options=portable):
        record(
            "fwd",
            f"tl {tiles.current_config('fwd', n, n, d, dtype, True)!r}",
            lambda: launch.flash_fwd(q, k, v, True),
            None,
        )
        record(
            "dkdv",
            f"tl {bwd_cfg!r}",
            lambda: launch.launch_bwd(tensors, True, bwd_cfg, portable, tma, ("dkdv",)),
            None,
        )
        record(
            "dq",
            f"tl {bwd_cfg!r}",
            lambda: launch.launch_bwd(tensors, True, bwd_cfg, portable, tma, ("dq",)),
            None,
        )
    o = torch.empty_like(q)
    lse = torch.empty(q.shape[:-1], device=device)
    fwd_cands = [hopper_configs.HopperFwdConfig(*c) for c in HOPPER_FWD_CANDIDATES.get(d, [])]
    fwd_cands += [hopper_configs.WarpSpecializedFwdConfig(*c) for c in HOPPER_WS_FWD_CANDIDATES.get(d, [])]
    for cfg in fwd_cands:

        def fwd_check() -> float:
            return max(rel_err(o, o_ref), rel_err(lse, lse_ref))

        o.fill_(float("nan"))
        record(
            "fwd",
            f"gluon {cfg!r}",
            lambda cfg=cfg: hopper.flash_fwd_hopper(q, k, v, o, lse, True, cfg),
            fwd_check,
        )
    dk, dv = tensors[5], tensors[6]
    dkdv_cands = [hopper_configs.HopperBwdConfig(*c) for c in HOPPER_DKDV_CANDIDATES.get(d, [])]
    dkdv_cands += [hopper_configs.WarpSpecializedBwdConfig(*c) for c in HOPPER_WS_DKDV_CANDIDATES.get(d, [])]
    for cfg in dkdv_cands:
        dk.fill_(float("nan"))
        dv.fill_(float("nan"))
        record(
            "dkdv",
            f"gluon {cfg!r}",
            lambda cfg=cfg: hopper.flash_bwd_hopper(tensors, True, cfg),
            lambda: max(rel_err(dk, dk_ref), rel_err(dv, dv_ref)),
        )
    one_pass = [hopper_configs.WarpSpecializedBwdConfig(*c) for c in HOPPER_ONE_PASS_CANDIDATES.get(d, [])]
    if one_pass:  # the whole backward (Delta excluded), against the tl passes and the default
        with tiles.use_configs(options=portable):
            record(
                "bwd",
                f"tl {bwd_cfg!r}",
                lambda: launch.launch_bwd(tensors, True, bwd_cfg, portable, tma),
                None,
            )

        def default_bwd() -> None:
            if not hopper.flash_bwd_hopper(tensors, True):
                launch.launch_bwd(tensors, True, bwd_cfg, portable, tma, ("dq",))

        record(
            "bwd", f"default {hopper_configs.heuristic_bwd(d)!r} (+ tl dQ unless one pass)", default_bwd, None
        )
    dq = tensors[4]
    for cfg in one_pass:
        for t in (dq, dk, dv):
            t.fill_(float("nan"))
        record(
            "bwd",
            f"gluon one pass {cfg!r}",
            lambda cfg=cfg: hopper.flash_bwd_hopper(tensors, True, cfg),
            lambda: max(rel_err(dq, dq_ref), rel_err(dk, dk_ref), rel_err(dv, dv_ref)),
        )
    append_rows(LEADERBOARD, rows, results_dir)
    return rows


def _short_config(kernel: str, text: str) -> str:
    """'FwdConfig(block_m=128, ...)' / 'BwdConfig(...)' -> '128x64, 8 warps, 3 stages[, TMA|block ptr]'."""
    f = dict(re.findall(r"(\w+)=([\w.]+)", text))
    suffix = {"1": "1", "2": "2"}.get({"dkdv": "1", "dq": "2"}.get(kernel, ""), "")
    if kernel == "fwd":
        rows, w, st, tma = f"{f['block_m']}x{f['block_n']}", f["num_warps"], f["num_stages"], "None"
    else:
        rows = f"{f['block_m' + suffix]}x{f['block_n' + suffix]}"
        w, st = f["num_warps" + suffix], f["num_stages" + suffix]
        tma = f.get("tma" + suffix, f.get("tma", "None"))  # older rows: tma1/tma2 fields
    path = {"True": ", TMA", "False": ", block pointers"}.get(tma, "")
    extra = ""
    if kernel == "dkdv" and f.get("early_dp") == "True":
        extra += ", early dP"
    if kernel == "dkdv" and f.get("maxnreg1", "None") != "None":
        extra += f", <= {f['maxnreg1']} regs"
    return f"{rows}, {w} warps, {st} stages{path}{extra}"


def tuning_table(df: pd.DataFrame, top: int = 3) -> pd.DataFrame:
    """The fastest tile candidates per kernel (latest tuning run of each candidate)."""
    tun = latest_run(
        df[(df.name == "tuning") & (df.metric == "latency")], keys=("name", "impl", "mode", "metric")
    )
    tun = tun[tun.p50.notna() & tun["mode"].isin(["fwd", "dkdv", "dq"])]
    if tun.empty:
        return pd.DataFrame()
    tun = tun[tun.gpu_name == tun.gpu_name.iloc[-1]]  # timings of one GPU only (the latest tuned)
    best = tun.sort_values("p50").groupby("mode", sort=False).head(top)
    out = pd.DataFrame(
        {
            "kernel": best["mode"].values,
            "tiles (rows x rows), warps, stages, memory path": [
                _short_config(k, c) for k, c in zip(best["mode"], best.impl)
            ],
            "median ms": best.p50.values,
        }
    )
    out.attrs["source"] = best
    return out


NCU_METRICS = (
    "Duration",
    "SM Frequency",
    "Registers Per Thread",
    "Local Memory Spilling Requests",
    "Block Limit Registers",
    "Achieved Active Warps Per SM",
    "Eligible Warps Per Scheduler",
    "Issue Slots Busy",
    "Compute (SM) Throughput",
)


def ncu_summary(text: str) -> pd.DataFrame:
    """Selected metrics per kernel from an `ncu` text report (the committed *__ncu_*.txt files), plus
    the pipeline ncu names as the most utilised one and its utilisation."""
    kernels: dict[str, dict[str, str]] = {}
    current = None
    for line in text.splitlines():
        head = re.match(r"^\s{2}(\w+_kernel) \(", line)
        if head:
            current = kernels.setdefault(head.group(1), {})
            continue
        if current is None:
            continue
        m = re.match(r"^\s{4}(\S.*?\S)\s{2,}(?:(\S+)\s+)?([\d,.]+)\s*$", line)
        if m and m.group(1) in NCU_METRICS:
            name, unit, value = m.group(1), m.group(2), m.group(3)
            if name == "Duration" and unit in ("us", "ns"):  # one unit for every kernel
                value = f"{float(value.replace(',', '')) / (1e3 if unit == 'us' else 1e6):.3f}"
                unit = "ms"
            current[name + (f" ({unit})" if unit else "")] = value
        pipe = re.search(r"(\w+) is the highest-utilized pipeline \(([\d.]+)%\)", line)
        if pipe:
            current["busiest pipeline"] = f"{pipe.group(1)} {pipe.group(2)}%"
    return pd.DataFrame(kernels)


def tuning_rounds(df: pd.DataFrame, gpu: str = "H200") -> pd.DataFrame:
    """dK/dV candidates and whole-backward timings of every tuning round on one GPU (a round = a git sha)."""
    sel = df[(df.name == "tuning") & df.gpu_name.str.contains(gpu) & df["mode"].isin(["dkdv", "bwd"])]
    if sel.empty:
        return pd.DataFrame()
    side = lambda c: "dQ on a side stream" if "streams=True" in c else "dQ on the same stream"
    rounds = sel.assign(
        config=[_short_config("dkdv", c) if m == "dkdv" else side(c) for m, c in zip(sel["mode"], sel.impl)],
        round=sel.git_sha.map({sha: f"round {k + 1}" for k, sha in enumerate(sel.git_sha.unique())}),
    )
    out = rounds[["round", "mode", "config", "p50"]].rename(columns={"mode": "pass", "p50": "median ms"})
    out = out.sort_values(["round", "pass", "median ms"]).reset_index(drop=True)
    out.attrs["source"] = sel
    return out


def ncu_table(results_dir: Path, tags: tuple[str, ...] = ("round1", "final")) -> pd.DataFrame:
    """The backward kernels' ncu metrics of the committed reports `flash_leaderboard__ncu_bwd_<tag>.txt`,
    one column per (kernel, tag), e.g. 'dkdv (final)'; empty if no report exists."""
    tables = []
    for tag in tags:
        path = Path(results_dir) / f"flash_leaderboard__ncu_bwd_{tag}.txt"
        if path.exists():
            t = ncu_summary(path.read_text())
            short = lambda k, tag=tag: f"{k.replace('flash_bwd_', '').replace('_kernel', '')} ({tag})"
            tables.append(t.rename(columns=short))
    return pd.concat(tables, axis=1) if tables else pd.DataFrame()
