"""Process-group setup and teardown, device policy, free-port rendezvous and a spawn helper.

One place decides backend -> device: NCCL uses cuda:<local_rank>; gloo uses CPU tensors unless
`gloo_on_cuda=True` (the official tests run gloo on CUDA tensors when a GPU is visible). Every
`init_process_group` gets a timeout so a dead peer fails the run instead of hanging it.
Works under torchrun (reads RANK / WORLD_SIZE / LOCAL_RANK / MASTER_*) and under `spawn` below.
"""

from __future__ import annotations

import datetime
import os
import socket
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

DEFAULT_TIMEOUT_S = 120.0


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago (one per job avoids rendezvous clashes)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def device_for(backend: str, local_rank: int, *, gloo_on_cuda: bool = False) -> torch.device:
    if backend == "nccl" or (gloo_on_cuda and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError(f"backend {backend!r} needs CUDA, but no GPU is visible")
        index = local_rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def setup_process_group(
    backend: str = "gloo",
    rank: int | None = None,
    world_size: int | None = None,
    *,
    master_port: int | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    gloo_on_cuda: bool = False,
) -> torch.device:
    """Initialise the default process group and return this rank's device.

    With `rank`/`world_size` None they come from the torchrun environment.
    """
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    rank = int(os.environ["RANK"]) if rank is None else rank
    world_size = int(os.environ["WORLD_SIZE"]) if world_size is None else world_size
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world size {world_size}")
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if master_port is not None:
        os.environ["MASTER_PORT"] = str(master_port)
    elif "MASTER_PORT" not in os.environ:
        raise ValueError("no MASTER_PORT: pass master_port= or launch through torchrun/spawn")
    if backend == "gloo" and os.environ["MASTER_ADDR"] in ("127.0.0.1", "localhost"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # single host: skip hostname resolution
    device = device_for(backend, local_rank, gloo_on_cuda=gloo_on_cuda)
    kwargs = {"device_id": device} if backend == "nccl" else {}
    dist.init_process_group(
        backend, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s), **kwargs
    )
    return device


def cleanup_process_group() -> None:
    if dist.is_available() and dist.is_initialized():
        try:
            dist.barrier()
        finally:
            dist.destroy_process_group()


def require_process_group(what: str = "this operation") -> tuple[int, int]:
    """(rank, world_size), or a clear error when no process group is initialised."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"{what} needs an initialised torch.distributed process group; call "
            "cs336_systems.distributed.setup_process_group (or dist.init_process_group) first"
        )
    return dist.get_rank(), dist.get_world_size()


def is_rank0() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def rank0_print(*args, **kwargs) -> None:
    if is_rank0():
        print(*args, **kwargs, flush=True)


class RankFailed(RuntimeError):
    """A rank of `spawn` raised: `.rank` is its rank, the message holds its traceback."""

    def __init__(self, rank: int, world_size: int, remote_traceback: str):
        super().__init__(f"rank {rank} of {world_size} failed:\n{remote_traceback.strip()}")
        self.rank = rank
        self.remote_traceback = remote_traceback


def _spawn_entry(
    rank: int,
    fn: Callable,
    world_size: int,
    backend: str,
    port: int,
    timeout_s: float,
    gloo_on_cuda: bool,
    args: tuple,
) -> None:
    torch.set_num_threads(1)  # several ranks share few cores: intra-op threads only oversubscribe them
    device = setup_process_group(
        backend, rank, world_size, master_port=port, timeout_s=timeout_s, gloo_on_cuda=gloo_on_cuda
    )
    # No try/finally teardown: after an exception the peers may be blocked in a collective that waits
    # for this rank, so a teardown barrier would hold the error back for the whole process-group
    # timeout. Exiting at once lets `spawn` report this traceback and stop the other ranks.
    fn(rank, world_size, device, *args)
    cleanup_process_group()


def spawn(
    fn: Callable,
    world_size: int,
    *args,
    backend: str = "gloo",
    timeout_s: float = 60.0,
    gloo_on_cuda: bool = False,
    start_method: str = "spawn",
    grace_s: float = 2.0,
) -> None:
    """Run `fn(rank, world_size, device, *args)` in `world_size` processes with a fresh process group.

    `fn` must be importable (defined at module level in a package or test module, not in a notebook).
    When a rank raises, RankFailed (rank number and that rank's traceback) reaches the caller as soon
    as the rank exits; the other ranks get `grace_s` seconds, then SIGTERM, then SIGKILL.
    `start_method="forkserver"` (with `multiprocessing.set_forkserver_preload(["torch", ...])`) forks
    the workers from a single-threaded server that has imported torch once: ~0.1 s per launch
    instead of seconds.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    context = mp.start_processes(
        _spawn_entry,
        args=(fn, world_size, backend, free_port(), timeout_s, gloo_on_cuda, args),
        nprocs=world_size,
        join=False,
        start_method=start_method,
    )
    try:
        while not context.join(grace_period=grace_s):
            pass
    except mp.ProcessRaisedException as exc:
        text = exc.msg.split("terminated with the following error:", 1)[-1]
        raise RankFailed(exc.error_index, world_size, text) from None
    except mp.ProcessExitedException as exc:
        raise RankFailed(exc.error_index, world_size, f"exited with code {exc.exit_code}") from None
    finally:  # also on an interrupt or a test timeout in the caller: no rank outlives the call
        for process in context.processes:
            if process.is_alive():
                process.kill()
            process.join(timeout=5)
