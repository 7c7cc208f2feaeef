"""The training entry point's committed GPU run (`train.gpu_demo`): loss curve, throughput and MFU, set
against the training-step benchmark's step time for the same configuration.

A run folder (`<results>/train_gpu_demo/`, written by `python -m cs336_systems.train.gpu_demo`) holds
`<size>.jsonl` (one metrics line per step, from `python -m cs336_systems.train --metrics`) and
`summary.json` (device, torch, per run the medians after the first 10 steps). `measure(dir)` runs it
(a GPU); `measure_quick(dir)` writes the same files on a CPU with the debug preset in seconds (the
notebook's quick mode), through the same `python -m cs336_systems.train` a user runs.

`facts(run, step_rows)` returns what notebook 43 quotes: per run the first/last loss, median step time,
tokens/s and MFU as logged (matmul FLOPs of the full T x T attention, `train.loop`), the MFU recomputed
with causal attention halved (`train_step.step_flops`, the convention of the training-step and
leaderboard rows), and, where `training_step` rows exist for the same size, batch and context, ours and
stock from one comparison run there (`bench_run`: the latest on the demo's GPU kind, else the latest; their
medians, as notebook 40 quotes) with the ratio demo / benchmark and both devices (a different GPU model is
said, not hidden).

Caveat: the demo times a whole loop iteration (batch fetch, one host sync for the loss, the metrics
line) with `time.perf_counter`; the benchmark times the step alone (CUDA events, median of its rounds).
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd
import torch

from cs336_systems.accounting.hardware import peak_flops
from cs336_systems.measure.cli import COMMITTED_RESULTS_DIR
from cs336_systems.measure.results import REPO_ROOT, load_results
from cs336_systems.model import get_config
from cs336_systems.studies.training import train_step_facts
from cs336_systems.studies.training.train_step import step_flops

RUN_DIR = "train_gpu_demo"
SKIP_STEPS = 10  # compile and warmup steps left out of the medians (as `train.gpu_demo` does)
BATCH, CONTEXT = 4, 512  # the demo's throughput configuration (`train.gpu_demo`)


def load_run(results_dir: str | Path) -> dict:
    """{"summary": summary.json, "metrics": {size: DataFrame of its JSONL}}; empty when absent."""
    folder = Path(results_dir) / RUN_DIR
    summary_path = folder / "summary.json"
    if not summary_path.exists():
        return {"summary": {}, "metrics": {}}
    summary = json.loads(summary_path.read_text())
    metrics = {}
    for size in summary.get("runs", {}):
        path = folder / f"{size}.jsonl"
        if path.exists():
            metrics[size] = pd.read_json(path, lines=True)
    return {"summary": summary, "metrics": metrics}


def _run_module(module: str, *args: str) -> None:
    """`python -m <module> args` with this checkout first on the path (studies do not import `train`)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *filter(None, [env.get("PYTHONPATH")])])
    proc = subprocess.run([sys.executable, "-m", module, *args], env=env, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(
            f"python -m {module} failed ({proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}"
        )


def measure(results_dir: str | Path) -> Path:
    """The GPU run: `python -m cs336_systems.train.gpu_demo --out <results_dir>/train_gpu_demo`."""
    folder = Path(results_dir) / RUN_DIR
    _run_module("cs336_systems.train.gpu_demo", "--out", str(folder))
    return folder


def measure_quick(results_dir: str | Path, *, steps: int = 40) -> Path:
    """The quick-mode run: the debug preset on the CPU through `python -m cs336_systems.train`."""
    folder = Path(results_dir) / RUN_DIR
    folder.mkdir(parents=True, exist_ok=True)
    tokens, metrics = folder / "tokens.bin", folder / "debug.jsonl"
    vocab = get_config("debug").vocab_size
    _run_module(
        "cs336_systems.train.make_tokens", str(tokens), "--num-tokens", "200000", "--vocab-size", str(vocab)
    )
    argv = ["--size", "debug", "--data", str(tokens), "--steps", str(steps), "--batch-size", "4"]
    argv += ["--context-length", "64", "--lr", "3e-3", "--metrics", str(metrics), "--device", "cpu"]
    _run_module("cs336_systems.train", *argv, "--progress", "off")
    rows = pd.read_json(metrics, lines=True)
    steady = rows.iloc[SKIP_STEPS:]
    summary = {
        "device": "cpu",
        "torch": torch.__version__,
        "runs": {
            "debug": {
                "steps": len(rows),
                "first_loss": float(rows.loss.iloc[0]),
                "last_loss": float(rows.loss.iloc[-1]),
                "median_tokens_per_s": float(steady.tokens_per_s.median()),
                "median_mfu": 0.0,
                "median_step_time_s": float(steady.step_time_s.median()),
                "batch_size": 4,
                "context_length": 64,
            }
        },
    }
    (folder / "summary.json").write_text(json.dumps(summary, indent=1))
    return folder


def committed_rows(problem: str) -> pd.DataFrame:
    """The committed rows of `problem` (figures/data), read in every mode: references, never written."""
    return load_results(problem, COMMITTED_RESULTS_DIR)


def bench_run(step_rows: pd.DataFrame, size: str, batch: int, ctx: int, device: str) -> dict | None:
    """The training_step comparison of (size, batch, context) to set the demo against: ours (the default
    `TrainStepConfig.fastest()`) and stock from one run (`train_step_facts.compare_runs`), the latest run
    on `device` where there is one, else the latest on any GPU; None without one."""
    if step_rows.empty:
        return None
    runs = train_step_facts.compare_runs(step_rows)
    if runs.empty:
        return None
    sel = runs[
        (runs["size"] == size) & (runs.batch == batch) & (runs.ctx == ctx)
        & (runs.ours == train_step_facts.DEFAULT_OURS) & runs.ratio.notna()
    ]  # fmt: skip
    same = sel[sel.device == device]
    pick = same if len(same) else sel
    return pick.iloc[-1].to_dict() if len(pick) else None


def facts(run: dict, step_rows: pd.DataFrame) -> dict:
    """The numbers notebook 43 quotes about the run (see the module docstring)."""
    summary = run.get("summary", {})
    out: dict = {"device": summary.get("device", ""), "torch": summary.get("torch", ""), "runs": {}}
    for size, rows in run.get("metrics", {}).items():
        meta = summary["runs"].get(size, {})
        batch, ctx = meta.get("batch_size", BATCH), meta.get("context_length", CONTEXT)
        steady = rows.iloc[SKIP_STEPS:] if len(rows) > SKIP_STEPS else rows
        step_s = float(statistics.median(steady.step_time_s))
        rec = {
            "steps": len(rows),
            "batch": batch,
            "context": ctx,
            "first_loss": float(rows.loss.iloc[0]),
            "last_loss": float(rows.loss.iloc[-1]),
            "min_loss": float(rows.loss.min()),
            "first_step_s": float(rows.step_time_s.iloc[0]),
            "step_ms": step_s * 1e3,
            "tokens_per_s": float(statistics.median(steady.tokens_per_s)),
            "mfu_logged": float(statistics.median(steady.mfu)) if "mfu" in steady else math.nan,
        }
        peak = peak_flops(out["device"], "bf16")
        flops = step_flops(get_config(size), batch, ctx)
        rec["mfu_causal"] = flops / step_s / peak if peak else math.nan
        bench = bench_run(step_rows, size, batch, ctx, out["device"])
        if bench is not None:
            for impl in ("ours", "stock"):
                rec[f"bench_{impl}_ms"] = bench[f"{impl}_ms"]
                rec[f"bench_{impl}_device"] = bench["device"]
                rec[f"ratio_to_{impl}"] = rec["step_ms"] / bench[f"{impl}_ms"]
            rec["bench_git"], rec["bench_attention"] = bench["git"], bench["attention"]
        rec["same_device"] = rec.get("bench_ours_device", out["device"]) == out["device"]
        out["runs"][size] = rec
    out["throughput_size"] = next((s for s in out["runs"] if s != "small"), None)
    resumed = summary.get("runs", {}).get("small", {})
    out["resume"] = {
        k: resumed[k] for k in ("killed_exit", "resumed_exit", "resumed_from_step_40") if k in resumed
    }
    return out


def plot_run(run: dict, size: str, device: str):
    """Loss per step (left) and tokens/s with MFU per step (right) of one run."""
    rows = run["metrics"][size]
    fig, (ax_loss, ax_tps) = plt.subplots(1, 2, figsize=(10, 2.9))
    ax_loss.plot(rows.step, rows.loss, lw=1.2)
    ax_loss.set(xlabel="step", ylabel="training loss (nats)", title=f"{size}: loss")
    steady = rows.iloc[1:]  # the first step compiles: off the throughput scale
    ax_tps.plot(steady.step, steady.tokens_per_s / 1e3, lw=1.0, label="tokens/s")
    ax_tps.set(xlabel="step", ylabel="thousand tokens/s (blue)", title=f"{size}: throughput ({device})")
    ax_tps.set_ylim(bottom=0)
    if "mfu" in steady and steady.mfu.notna().any():
        ax_mfu = ax_tps.twinx()
        ax_mfu.plot(steady.step, steady.mfu, lw=0.8, color="tab:orange", label="MFU (logged)")
        ax_mfu.set_ylabel("MFU, datasheet bf16 peak (orange)")
        ax_mfu.set_ylim(0, max(0.6, float(steady.mfu.max()) * 1.1))
    fig.tight_layout()
    return fig


TWO_GPU_DIR = "train_two_gpu"  # torchrun runs of the entry point on two GPUs (`provenance.txt` says which)


def two_gpu_table(results_dir: str | Path = COMMITTED_RESULTS_DIR) -> pd.DataFrame:
    """Per `--parallel` mode of the committed two-GPU runs (`2gpu_<size>_<mode>.jsonl`): steps, median
    step time, tokens/s and logged MFU after the first `SKIP_STEPS` steps, and the last loss; the
    provenance file's lines in attrs["provenance"], its device and short commit in attrs["device"] and
    attrs["git"]. Empty when the folder is absent."""
    folder = Path(results_dir) / TWO_GPU_DIR
    rows = []
    for path in sorted(folder.glob("2gpu_*.jsonl")):
        _, size, mode = path.stem.split("_", 2)
        m = pd.read_json(path, lines=True)
        steady = m.iloc[SKIP_STEPS:] if len(m) > SKIP_STEPS else m
        rows.append(
            {
                "size": size,
                "parallel": mode,
                "steps": len(m),
                "step ms": 1e3 * steady.step_time_s.median(),
                "tokens/s": steady.tokens_per_s.median(),
                "MFU (logged)": steady.mfu.median(),
                "last loss": float(m.loss.iloc[-1]),
            }
        )
    out = pd.DataFrame(rows)
    prov = folder / "provenance.txt"
    lines = prov.read_text().strip().splitlines() if prov.exists() else []
    out.attrs["provenance"] = lines
    # the provenance file's "device <n> x <GPU>, ..." and "git <sha> ..." lines, for prose
    out.attrs["device"] = next((x[7:].split(",")[0] for x in lines if x.startswith("device ")), "")
    out.attrs["git"] = next((x.split()[1][:10] for x in lines if x.startswith("git ")), "")
    return out
