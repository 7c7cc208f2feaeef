"""The history of 2025 leaderboard protocol runs (`flash_leaderboard.measure`'s rows):
one row per run with ours against SDPA's backends of the same process and which backward ours ran.
Which runs are "final" (today's tl kernels and tiles): `flash_leaderboard.final_runs`.
"""

from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING, Any

import pandas as pd

if TYPE_CHECKING:
    pass


def gluon_one_pass(cfg: dict[str, Any]) -> bool:
    """Whether a protocol run's own backward was the Gluon one-pass kernel: recorded as
    `hopper_bwd_default` with its configuration in `hopper_dkdv` (the first such runs recorded only
    the configuration; every protocol run so far was on an sm_90 GPU, where it is the default)."""
    text = cfg.get("hopper_dkdv", "")
    one_pass_cfg = ("dq_regs=" in text and "dq_regs=0," not in text) or "dq_in_consumers=True" in text
    return bool(cfg.get("hopper_bwd_default", True)) and one_pass_cfg


def protocol_runs(df: pd.DataFrame, target: float | None = None) -> pd.DataFrame:
    """Every protocol run (ours and the SDPA baselines of the same process), oldest first: GPU, the
    commit measured, do_bench budget, our tiles, and our median against SDPA-flash's."""
    lb = df[(df.name == "protocol") & (df.metric == "latency")].copy()
    if lb.empty:
        return pd.DataFrame()
    run_id = [json.loads(c).get("run_id") for c in lb.config_json]
    # older rows have no run_id: they were appended in run order, ours first
    lb["run"] = [
        f"id{r}" if r is not None else f"n{k}" for r, k in zip(run_id, (lb.impl == "flash_triton").cumsum())
    ]
    runs = []
    for _, g in lb.groupby("run", sort=False):
        ms = g.set_index("impl").p50
        cfg = json.loads(g.config_json.iloc[0])
        bwd_text = cfg.get("tiles_bwd", "")
        one_pass = gluon_one_pass(cfg)
        runs.append(
            {
                "gpu": g.gpu_name.iloc[0].replace("NVIDIA ", ""),
                "git sha": g.git_sha.iloc[0],
                "time (UTC)": str(g.timestamp.iloc[0])[:16].replace("T", " "),
                "do_bench rep/warmup ms": f"{cfg.get('rep_ms', math.nan):g}/{cfg.get('warmup_ms', math.nan):g}",
                "our tiles": cfg.get("tiles_source", "heuristic (not recorded)")
                + (", <=168 regs" if "maxnreg1=168" in bwd_text else "")
                + (", dQ side stream" if "streams=True" in bwd_text else "")
                + (", Gluon one-pass backward" if one_pass else ""),
                "our backward": "Gluon one pass" if one_pass else "tl",
                "ours ms": ms.get("flash_triton", math.nan),
                "sdpa_flash ms": ms.get("sdpa_flash", math.nan),
                "sdpa_cudnn ms": ms.get("sdpa_cudnn", math.nan),
                "tiles_fwd": cfg.get("tiles_fwd", ""),
                "tiles_bwd": bwd_text,
            }
        )
    out = pd.DataFrame(runs)
    out["ours / sdpa_flash"] = out["ours ms"] / out["sdpa_flash ms"]
    if target is not None:
        out["<= target"] = out["ours / sdpa_flash"] <= target
    return out
