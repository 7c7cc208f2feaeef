"""Launch a package module under `torchrun` as a subprocess (the way notebooks run multi-process work).

`mp.spawn` cannot run functions defined in a notebook, so notebooks call `run_torchrun(module, args,
nproc)`: a fresh free port per job, `--master_addr 127.0.0.1` (plain torchrun can hang resolving the
host name), a timeout on the whole job, extra environment for the ranks (a study passes
`cs336_systems.measure.results.child_env(results_dir)`: where to write results, the commit measured),
and a failed rank's traceback surfaced in the raised error. No rank outlives its job: a timeout,
Ctrl-C, SIGTERM or SIGHUP to the caller stops the agent and every rank before the caller goes on (or
exits), and on Linux the agent gets SIGTERM from the kernel if the caller dies by SIGKILL.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Sequence

from cs336_systems.distributed.process_group import free_port


class TorchrunError(RuntimeError):
    pass


def torchrun_command(module: str, args: Sequence[str], nproc: int, *, python: str | None = None) -> list[str]:
    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    return [
        python or sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        "--nnodes=1",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        "-m",
        module,
        *map(str, args),
    ]


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
    try:
        with _signals_raise(signal.SIGTERM, signal.SIGHUP):
            output, returncode = _run_job(cmd, full_env, timeout_s, module)
    except _Signalled as sig:
        # The job is stopped; now let the handler the caller had (by default: exit) see the signal.
        os.kill(os.getpid(), sig.signum)
        raise TorchrunError(f"torchrun {module} stopped: this process got signal {sig.signum}") from None
    if echo:
        print(output, end="")
    if returncode != 0:
        raise TorchrunError(
            f"torchrun {module} {' '.join(map(str, args))} failed (exit {returncode}):\n{_tail(output)}"
        )
    return output


class _Signalled(BaseException):
    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def _signals_raise(*signums: int) -> Iterator[None]:
    """While the job runs, turn `signums` into an exception, so the job is stopped before we exit.

    Only signals left at their default action are taken over (one the caller ignores, e.g. SIGHUP
    under nohup, or handles itself stays so). Signal handlers can only be set from the main thread;
    elsewhere this does nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise _Signalled(signum)

    previous = {s: signal.signal(s, handler) for s in signums if signal.getsignal(s) == signal.SIG_DFL}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


# Run in the child before torchrun: ask the kernel to SIGTERM it when this process dies, even by
# SIGKILL (torchrun then stops its ranks), and give up if this process is already gone.
_EXEC_WITH_PARENT_DEATH_SIGNAL = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # 1 = PR_SET_PDEATHSIG\n"
    "os.getppid() == int(sys.argv[1]) or sys.exit(1)\n"
    "os.execv(sys.argv[2], sys.argv[2:])"
)


def _run_job(cmd: list[str], env: dict[str, str], timeout_s: float, module: str) -> tuple[str, int]:
    """Run the job to its end; on a timeout or an interrupt stop it, every rank included."""
    if sys.platform == "linux":
        cmd = [sys.executable, "-c", _EXEC_WITH_PARENT_DEATH_SIGNAL, str(os.getpid()), *cmd]
    # torchrun starts each rank in a session of its own, so killing the agent alone would orphan
    # ranks that keep running (and keep their GPU memory) after the job was declared dead: see
    # _terminate. The agent's own session keeps a Ctrl-C in the terminal from reaching the ranks
    # directly; the interrupt reaches them through _terminate instead.
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _terminate(proc)
        stdout, stderr = proc.communicate()
        raise TorchrunError(
            f"torchrun {module} timed out after {timeout_s:.0f} s\n{_tail(stdout + stderr)}"
        ) from None
    except BaseException:  # KeyboardInterrupt (Ctrl-C, a notebook's interrupt), SIGTERM, SIGHUP
        _terminate(proc)
        raise
    return stdout + stderr, proc.returncode


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


def main(argv: Sequence[str] | None = None) -> None:
    """`python -m cs336_systems.distributed.launch [--nproc N] MODULE [ARGS...]`: run_torchrun from a shell."""
    p = argparse.ArgumentParser(
        prog="python -m cs336_systems.distributed.launch",
        description="Run a package module under torchrun on this host (a free port, a timeout, every rank "
        "stopped on Ctrl-C or SIGTERM, the failing rank's traceback in the error).",
        epilog="example:\n  python -m cs336_systems.distributed.launch --nproc 2 "
        "cs336_systems.studies.distributed.ddp_check --variants naive",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--nproc", type=int, default=2, help="processes (ranks) on this host (default: 2)")
    p.add_argument("--timeout-s", type=float, default=900.0, help="limit for the whole job (default: 900)")
    p.add_argument(
        "--results-dir",
        default=None,
        metavar="DIR",
        help="CS336_RESULTS_DIR of the ranks (default: $CS336_RESULTS_DIR, else figures/data/)",
    )
    p.add_argument(
        "module", help="the module to run on every rank, e.g. cs336_systems.studies.distributed.ddp_check"
    )
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the module")
    a = p.parse_args(argv)
    if a.nproc < 1 or a.timeout_s <= 0:
        p.error("--nproc must be >= 1 and --timeout-s > 0")
    if importlib.util.find_spec(a.module) is None:
        p.error(f"module {a.module!r} cannot be imported here")
    try:
        env = {"CS336_RESULTS_DIR": str(a.results_dir)} if a.results_dir is not None else None
        run_torchrun(a.module, a.args, a.nproc, timeout_s=a.timeout_s, env=env)
    except TorchrunError as exc:
        raise SystemExit(str(exc)) from None


if __name__ == "__main__":
    main()
