"""The crash-tolerant variant runner shared by the sharding and FSDP benchmarks (torchrun stubbed)."""

import pytest

from cs336_systems.distributed import launch


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
