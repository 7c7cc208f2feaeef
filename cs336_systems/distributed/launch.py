"""Launch a package module under `torchrun` as a subprocess (the way notebooks run multi-process work).

`mp.spawn` cannot run functions defined in a notebook, so notebooks call `run_torchrun(module, args,
nproc)`: a fresh free port per job, `--master_addr 127.0.0.1` (plain torchrun can hang resolving the
host name), a timeout on the whole job, extra environment for the ranks (a study passes
`cs336_systems.measure.results.child_env(results_dir)`: where to write results, the commit measured),
and a failed rank's traceback surfaced in the raised error.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence

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
    echo: bool = True,
) -> str:
    """Run `python -m torch.distributed.run ... -m module args` and return its combined output.

    Raises TorchrunError (with the last 80 lines of output, which hold the failing rank's traceback)
    on a non-zero exit or a timeout.
    """
    cmd = torchrun_command(module, args, nproc)
    full_env = dict(os.environ)
    full_env.update(
        PYTHONUNBUFFERED="1",
        OMP_NUM_THREADS=full_env.get("OMP_NUM_THREADS", "1"),
    )
    full_env.update(env or {})
    # On a timeout (or an interrupt) the ranks must die with the job: torchrun starts each worker in a
    # session of its own, so killing the agent alone would orphan ranks that keep running (and keep
    # their GPU memory) after the job was declared dead. See _terminate.
    proc = subprocess.Popen(
        cmd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _terminate(proc)
        stdout, stderr = proc.communicate()
        raise TorchrunError(
            f"torchrun {module} timed out after {timeout_s:.0f} s\n{_tail(stdout + stderr)}"
        ) from None
    except BaseException:  # e.g. KeyboardInterrupt in a notebook
        _terminate(proc)
        raise
    output = stdout + stderr
    if echo:
        print(stdout, end="")
    if proc.returncode != 0:
        raise TorchrunError(
            f"torchrun {module} {' '.join(map(str, args))} failed (exit {proc.returncode}):\n{_tail(output)}"
        )
    return output


def _descendants(pid: int) -> list[int]:
    """All live descendant process ids of `pid` (Linux /proc), children before grandchildren."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, frontier = [], [pid]
    while frontier:
        kids = [c for p in frontier for c in children.get(p, [])]
        out += kids
        frontier = kids
    return out


def _terminate(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """Stop a torchrun job and every rank it started: SIGTERM to the agent (which stops its workers),
    then SIGKILL to whatever of the job is still alive after `grace_s`."""
    pids = _descendants(proc.pid) if os.path.isdir("/proc") else []
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace_s)
    for pid in [proc.pid, *pids]:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def _tail(text: str, lines: int = 80) -> str:
    return "\n".join(text.splitlines()[-lines:])


def failure_note(exc: BaseException) -> str:
    """The short note of a failure row: "OOM", or the first line of the error."""
    text = str(exc)
    return (
        "OOM"
        if "out of memory" in text.lower()
        else f"error: {text.splitlines()[0][:200] if text else type(exc).__name__}"
    )


def run_variants(
    module: str,
    variants: Sequence[str],
    launch_args: Callable[[list[str]], Sequence[str]],
    *,
    finished: Callable[[], set[str]],
    on_failure: Callable[[str, str], None],
    nproc: int = 2,
    timeout_s: float = 900.0,
    env: dict[str, str] | None = None,
) -> list[str]:
    """Run `variants` under torchrun, relaunching with the rest after a crash; returns the failed ones.

    `launch_args(remaining)` builds the module's arguments; `finished()` names the variants that have
    recorded results so far. A crash is charged to the first remaining variant that has not finished:
    `on_failure(variant, note)` records it at once (nothing lost if a later launch also dies), and the
    variants after it are launched again. A crash after every variant finished is reported and ignored.
    """
    failed: list[str] = []
    remaining = list(variants)
    while remaining:
        try:
            run_torchrun(module, launch_args(remaining), nproc, timeout_s=timeout_s, env=env)
            break
        except TorchrunError as exc:
            done = finished()
            remaining = [v for v in remaining if v not in done]
            if not remaining:
                print(f"[{module}] failure after the last variant finished (ignored):\n{exc}")
                break
            bad = remaining.pop(0)
            failed.append(bad)
            on_failure(bad, failure_note(exc))
    return failed
