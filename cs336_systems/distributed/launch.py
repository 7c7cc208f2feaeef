"""Launch a package module under `torchrun` as a subprocess (the way notebooks run multi-process work).

`mp.spawn` cannot run functions defined in a notebook, so notebooks call `run_torchrun(module, args,
nproc)`: a fresh free port per job, `--master_addr 127.0.0.1` (plain torchrun can hang resolving the
host name), a timeout on the whole job, the results directory and git sha passed through the
environment, and a failed rank's traceback surfaced in the raised error.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence

from cs336_systems.benchmarking.results import env_metadata, results_dir
from cs336_systems.distributed.process_group import free_port


class TorchrunError(RuntimeError):
    pass


def torchrun_command(module: str, args: Sequence[str], nproc: int, *, python: str | None = None) -> list[str]:
    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    return [
        python or sys.executable, "-m", "torch.distributed.run",
        f"--nproc_per_node={nproc}", "--nnodes=1",
        "--master_addr=127.0.0.1", f"--master_port={free_port()}",
        "-m", module, *map(str, args),
    ]  # fmt: skip


def run_torchrun(
    module: str,
    args: Sequence[str] = (),
    nproc: int = 2,
    *,
    timeout_s: float = 900.0,
    env: dict[str, str] | None = None,
    results_dir_: str | os.PathLike | None = None,
    echo: bool = True,
) -> str:
    """Run `python -m torch.distributed.run ... -m module args` and return its combined output.

    Raises TorchrunError (with the last 80 lines of output, which hold the failing rank's traceback)
    on a non-zero exit or a timeout.
    """
    cmd = torchrun_command(module, args, nproc)
    full_env = dict(os.environ)
    full_env.update(
        CS336_RESULTS_DIR=str(results_dir(results_dir_)),
        CS336_GIT_SHA=env_metadata()["git_sha"],
        PYTHONUNBUFFERED="1",
        OMP_NUM_THREADS=full_env.get("OMP_NUM_THREADS", "1"),
    )
    full_env.update(env or {})
    try:
        proc = subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        raise TorchrunError(f"torchrun {module} timed out after {timeout_s:.0f} s\n{_tail(out)}") from None
    output = proc.stdout + proc.stderr
    if echo:
        print(proc.stdout, end="")
    if proc.returncode != 0:
        raise TorchrunError(f"torchrun {module} {' '.join(map(str, args))} failed (exit {proc.returncode}):\n{_tail(output)}")
    return output


def _tail(text: str, lines: int = 80) -> str:
    return "\n".join(text.splitlines()[-lines:])
