"""`python -m cs336_systems.train.gpu_demo --out DIR`: the training entry point on one GPU, in one command.

1. Writes a generated token file (`data.write_tokens`: learnable, so the loss falls from ln V to ~ln 4).
2. Throughput: the largest preset that fits (2.7B, else xl, else large) for `--steps` steps at batch 4,
   context 512, no checkpoints: DIR/<size>.jsonl holds loss, tokens/s and MFU per step.
3. Checkpoints on GPU: the small preset for 60 steps, checkpointed every 20, a SIGKILL at step 50
   (the test hook), then a second run that resumes from step 40 and finishes: DIR/small.jsonl.
4. Writes DIR/summary.json: per run the median tokens/s and MFU after the first 10 steps (compile and
   warmup), the first and last loss, and what was run where.

Every run is a subprocess of `python -m cs336_systems.train`, as a user would start it. Meant for one
H100 or H200 (about 5 minutes); on a CPU it refuses to start.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from cs336_systems.train.data import write_tokens

SIZES = ("2.7B", "xl", "large")  # tried in this order until one fits


def run_train(args: list[str], env: dict | None = None) -> tuple[int, str]:
    cmd = [sys.executable, "-m", "cs336_systems.train", *args]
    print("$", " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, env={**os.environ, **(env or {})}, capture_output=True, text=True)
    out = proc.stdout + proc.stderr
    print("\n".join(out.splitlines()[-3:]), flush=True)
    return proc.returncode, out


def summarise(path: Path, skip: int = 10) -> dict:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    steady = rows[skip:] or rows
    return {
        "steps": len(rows),
        "first_loss": rows[0]["loss"],
        "last_loss": rows[-1]["loss"],
        "median_tokens_per_s": statistics.median(r["tokens_per_s"] for r in steady),
        "median_mfu": statistics.median(r.get("mfu") or 0.0 for r in steady),
        "median_step_time_s": statistics.median(r["step_time_s"] for r in steady),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m cs336_systems.train.gpu_demo",
        description=__doc__,
        epilog="example:\n  python -m cs336_systems.train.gpu_demo --out runs/gpu_demo",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", required=True, help="directory of the token file, metrics and summary")
    p.add_argument("--steps", type=int, default=300, help="steps of the throughput run (default: 300)")
    p.add_argument("--sizes", nargs="+", default=list(SIZES), help="presets to try, largest first")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tokens = write_tokens(out / "tokens.bin", 50_000_000, 10_000)
    common = ["--data", str(tokens), "--batch-size", "4", "--context-length", "512", "--lr", "3e-4"]
    summary = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "runs": {}}

    for size in a.sizes:
        metrics = out / f"{size}.jsonl"
        t0 = time.perf_counter()
        code, text = run_train(["--size", size, *common, "--steps", str(a.steps), "--metrics", str(metrics)])
        if code == 0:
            summary["runs"][size] = summarise(metrics) | {"wall_s": time.perf_counter() - t0}
            break
        summary["runs"][size] = {"failed": "OOM" if "out of memory" in text.lower() else text[-2000:]}

    ckpt = ["--size", "small", *common, "--steps", "60", "--checkpoint-dir", str(out / "ckpt_small")]
    ckpt += ["--checkpoint-every", "20", "--keep-checkpoints", "2", "--metrics", str(out / "small.jsonl")]
    killed, _ = run_train(ckpt, env={"CS336_TRAIN_TEST_KILL_AT_STEP": "50"})
    resumed, text = run_train(ckpt)
    summary["runs"]["small"] = summarise(out / "small.jsonl") | {
        "killed_exit": killed,
        "resumed_exit": resumed,
        "resumed_from_step_40": "(step 40)" in text,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
