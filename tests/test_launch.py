"""The torchrun launcher and `spawn`: crash-tolerant variant runs (torchrun stubbed), no orphaned
process after a signal to the driver, and a failing rank reported at once."""

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from ddp_helpers import spawn_workers

from cs336_systems.distributed import launch
from cs336_systems.distributed.process_group import RankFailed


class FakeTorchrun:
    """Runs variants in order; `crash_on` variants kill the job (with `message`) before finishing."""

    def __init__(self, crash_on, message="CUDA out of memory. Tried to allocate 2 GiB", crash_at_end=False):
        self.crash_on, self.message, self.crash_at_end = set(crash_on), message, crash_at_end
        self.finished, self.launches = set(), []

    def __call__(self, module, args, nproc, *, timeout_s, env):
        self.launches.append(list(args))
        for v in args:
            if v in self.crash_on:
                raise launch.TorchrunError(f"torchrun {module} failed:\n{self.message}")
            self.finished.add(v)
        if self.crash_at_end:
            raise launch.TorchrunError("segfault at teardown")


@pytest.mark.parametrize(
    ("crash_on", "message", "expected_note"),
    [
        (["b"], "CUDA out of memory", "OOM"),
        (["a", "c"], "RuntimeError: boom\ntrace", "error: torchrun m failed:"),
    ],
)
def test_run_variants_records_each_crash_and_relaunches_the_rest(
    monkeypatch, crash_on, message, expected_note
):
    fake = FakeTorchrun(crash_on, message)
    monkeypatch.setattr(launch, "run_torchrun", fake)
    recorded = []
    failed = launch.run_variants(
        "m",
        ["a", "b", "c", "d"],
        lambda rest: rest,
        finished=lambda: set(fake.finished),
        on_failure=lambda v, note: recorded.append((v, note)),
    )
    assert failed == crash_on
    assert [v for v, _ in recorded] == crash_on and all(n == expected_note for _, n in recorded)
    assert fake.finished == {"a", "b", "c", "d"} - set(crash_on)
    assert len(fake.launches) == len(crash_on) + 1  # one relaunch per crash, never a finished variant again
    # Each relaunch carries exactly the variants after the one that crashed.
    variants = ["a", "b", "c", "d"]
    expected = [variants] + [variants[variants.index(v) + 1 :] for v in crash_on]
    assert fake.launches == expected


def test_crash_after_the_last_variant_is_not_charged_to_anyone(monkeypatch):
    fake = FakeTorchrun([], crash_at_end=True)
    monkeypatch.setattr(launch, "run_torchrun", fake)
    recorded = []
    failed = launch.run_variants(
        "m",
        ["a", "b"],
        lambda rest: rest,
        finished=lambda: set(fake.finished),
        on_failure=lambda v, n: recorded.append(v),
    )
    assert failed == [] and recorded == [] and len(fake.launches) == 1


def test_failure_note():
    assert launch.failure_note(RuntimeError("CUDA out of memory. Tried")) == "OOM"
    assert launch.failure_note(RuntimeError("bad shape\nmore")) == "error: bad shape"


# ----------------------------------------------------------------------------------------------------
# No process outlives its job; a failing rank is reported at once
# ----------------------------------------------------------------------------------------------------

DRIVER = """
import signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal, even if started in the background
from cs336_systems.distributed.launch import run_torchrun
run_torchrun("sleeping_rank", [sys.argv[1]], nproc=2, timeout_s=120)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.distributed
@pytest.mark.timeout(150)
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads the process tree from /proc")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL], ids=lambda s: s.name)
def test_a_signalled_driver_leaves_no_torchrun_process_behind(tmp_path, sig):
    """Item 6: SIGTERM / Ctrl-C (or even SIGKILL) to the driver stops the torchrun agent and its ranks."""
    tests_dir = Path(__file__).parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tests_dir.parent), str(tests_dir)]))
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, str(tmp_path)], env=env, start_new_session=True)
    tree = []
    try:
        deadline = time.monotonic() + 100
        while len(list(tmp_path.glob("rank*.pid"))) < 2:
            assert driver.poll() is None and time.monotonic() < deadline, "the ranks never started"
            time.sleep(0.2)
        tree = launch._descendants(driver.pid)
        ranks = {int(p.read_text()) for p in tmp_path.glob("rank*.pid")}
        assert ranks <= set(tree) and len(tree) >= 3  # the agent and both ranks
        driver.send_signal(sig)
        driver.wait(timeout=30)
        deadline = time.monotonic() + 15
        while any(map(_alive, tree)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [pid for pid in tree if _alive(pid)], "processes of the job outlived the driver"
    finally:
        for pid in [driver.pid, *tree]:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        driver.wait()


def _rank1_raises(rank, world_size, device):
    if rank == 1:
        raise ValueError("rank 1 fails on purpose")
    dist.all_reduce(torch.ones(1))  # rank 0 waits here for a peer that never comes


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_a_failing_rank_reaches_the_caller_within_seconds():
    """Item 7: the first rank's exception, with its rank and traceback, not a process-group timeout later."""
    start = time.monotonic()
    with pytest.raises(
        RankFailed, match=r"(?s)rank 1 of 2 failed:.*Traceback.*ValueError: rank 1 fails"
    ) as info:
        spawn_workers(_rank1_raises, 2, timeout_s=45)
    assert info.value.rank == 1
    assert time.monotonic() - start < 10
