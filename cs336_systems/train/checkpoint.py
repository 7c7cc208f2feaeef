"""Sharded checkpoints with `torch.distributed.checkpoint` (DCP): atomic, the last K kept, checked on load.

Layout of a checkpoint directory:

    DIR/step_00000020/   complete: DCP files (.metadata, one __R_0.distcp per rank) + train_state.json
    DIR/.tmp-step_00000030/   a save in progress, or one killed half-way: never loaded, removed on start

[Note: atomic checkpoints]
Every rank writes its shard into the temporary directory (`dcp.save`: each rank plans its own tensors,
replicated ones are written once, rank 0 writes the global .metadata last). After a barrier rank 0
writes train_state.json (the step and the run's fingerprint), fsyncs it and renames the directory to
its final name; a rename within one file system is atomic, so a directory named step_* is complete by
construction. A process killed anywhere before the rename leaves only a .tmp-* directory, and the next
start loads the previous complete checkpoint. Several nodes need DIR on a file system they share.

DCP loads in place: the state dict passed to `load` holds the live tensors (parameters, optimizer
moments, possibly views into flat buffers), and DCP copies the saved values into them.

The state dict is not `torch.distributed.checkpoint.state_dict.get_state_dict`'s: that helper knows
torch optimizers and torch FSDP, while the project's optimizers keep their state in flat buffers
(FusedAdamW, ZeroAdamW) whose views must be filled in place; `train.parallel` builds the dict.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import tempfile
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from cs336_systems.train.data import TrainInputError

STATE_FILE = "train_state.json"
_FINAL = re.compile(r"^step_(\d{8})$")
TMP_PREFIX = ".tmp-"
# Test hook: the step whose save this process dies in (SIGKILL), after its shard is written and before
# the rename ([Note: atomic checkpoints]); only while TORCHELASTIC_RESTART_COUNT is 0 or unset.
DIE_IN_SAVE_ENV = "CS336_TRAIN_TEST_DIE_IN_SAVE"


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _barrier() -> None:
    if _distributed():
        dist.barrier()


def check_writable(directory: str | Path) -> Path:
    """Create `directory` if needed and prove a file can be written there, or raise TrainInputError."""
    path = Path(directory)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".probe-"):
            pass
    except OSError as exc:
        raise TrainInputError(f"--checkpoint-dir {path}: not a writable directory ({exc})") from None
    return path


def complete_checkpoints(directory: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint in `directory`, oldest first."""
    path = Path(directory)
    if not path.is_dir():
        return []
    found = []
    for child in path.iterdir():
        m = _FINAL.match(child.name)
        if m and (child / STATE_FILE).is_file():
            found.append((int(m.group(1)), child))
    return sorted(found)


def latest_checkpoint(directory: str | Path) -> tuple[int, Path, dict] | None:
    """The newest complete checkpoint: (step, path, its train_state.json), or None."""
    done = complete_checkpoints(directory)
    if not done:
        return None
    step, path = done[-1]
    return step, path, json.loads((path / STATE_FILE).read_text())


def check_compatible(saved: dict, expected: dict, path: Path) -> None:
    """Raise TrainInputError naming every fingerprint field where the checkpoint differs from this run."""
    diffs = [
        f"{k}: checkpoint {saved.get(k)!r}, this run {v!r}" for k, v in expected.items() if saved.get(k) != v
    ]
    if diffs:
        raise TrainInputError(
            f"checkpoint {path} is from another configuration ("
            + "; ".join(diffs)
            + "); use another --checkpoint-dir or the same settings"
        )


def remove_partial(directory: str | Path) -> list[Path]:
    """Delete the .tmp-* directories of interrupted saves (call on rank 0 before anything is saved)."""
    removed = []
    for child in Path(directory).glob(TMP_PREFIX + "*"):
        shutil.rmtree(child, ignore_errors=True)
        removed.append(child)
    return removed


def save(directory: str | Path, step: int, state: dict, train_state: dict, *, keep: int) -> Path:
    """Write the checkpoint of `step` atomically ([Note: atomic checkpoints]); keep the newest `keep`.

    Collective: every rank calls it with its own `state` (tensors by key); returns the final path.
    """
    root = Path(directory)
    name = f"step_{step:08d}"
    tmp, final = root / (TMP_PREFIX + name), root / name
    rank0 = not _distributed() or dist.get_rank() == 0
    if rank0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    with _single_process_quiet():
        dcp.save(state, checkpoint_id=tmp)
    _maybe_die_in_save(step)
    _barrier()
    if rank0:
        with (tmp / STATE_FILE).open("w") as f:
            json.dump({**train_state, "step": step}, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        if final.exists():  # the same step saved again (a rerun that ended there): replace it whole
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(root)
        for _, old in complete_checkpoints(root)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def load(path: Path, state: dict) -> None:
    """Fill the tensors of `state` in place from the checkpoint at `path` (collective)."""
    with _single_process_quiet():
        dcp.load(state, checkpoint_id=path)


@contextlib.contextmanager
def _single_process_quiet():
    """Without a process group DCP warns that it assumes one process, which is what we mean."""
    with warnings.catch_warnings():
        if not _distributed():
            warnings.filterwarnings("ignore", message=".*assuming the intent is to .* in a single process")
        yield


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _maybe_die_in_save(step: int) -> None:
    if (
        os.environ.get(DIE_IN_SAVE_ENV) == str(step)
        and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    ):
        os.kill(os.getpid(), signal.SIGKILL)


def rng_state() -> dict[str, torch.Tensor]:
    """This process's generator states (CPU, and the current CUDA device's)."""
    out = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state()
    return out


def set_rng_state(states: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(states["cpu"])
    if "cuda" in states:
        torch.cuda.set_rng_state(states["cuda"])
