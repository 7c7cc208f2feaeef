"""`python -m cs336_systems.train`: the contract commands, multi-node equivalence, exact resume after a
SIGKILL under torchrun's restarts, a save killed half-way, and every bad input (CPU, gloo).

Tolerance of the multi-node check: fp32 on CPU; four ranks sum their gradients in another order than
one process, and the per-rank losses are averaged, so losses agree to ~1e-6 relative; the test
allows rtol 1e-5 (an error in the batch split or the averaging moves the loss by >= 1e-3).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from cs336_systems.distributed.process_group import free_port
from cs336_systems.train import build_parser, checkpoint, data, main, write_tokens

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--size", "debug", "--batch-size", "4", "--context-length", "64", "--device", "cpu"]
TORCHRUN = Path(sys.executable).with_name("torchrun")


@pytest.fixture(scope="module")
def tokens(tmp_path_factory) -> Path:
    return write_tokens(tmp_path_factory.mktemp("tokens") / "tokens.bin", 20_000, 256)


def child_env(**extra: str) -> dict[str, str]:
    """The test's environment for subprocesses: this checkout first on the path, one thread per rank."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    return env


def run(cmd: list[str], cwd: Path, *, timeout: float, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start `cmd` in its own session (so a timeout can stop every process it started)."""
    return subprocess.Popen(
        cmd,
        cwd=cwd,
        env=env or child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def finish(proc: subprocess.Popen, timeout: float) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"timed out after {timeout} s:\n{out[-4000:]}")
    return proc.returncode, out


def torchrun(nnodes: int, nproc: int, port: int, args: list[str]) -> list[str]:
    """The issue's torchrun contract, as written."""
    launcher = [str(TORCHRUN)] if TORCHRUN.exists() else [sys.executable, "-m", "torch.distributed.run"]
    return [
        *launcher, "--nnodes", str(nnodes), "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"127.0.0.1:{port}", "--max-restarts", "3", "-m", "cs336_systems.train", *args,
    ]  # fmt: skip


def metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def final_state(ckpt_dir: Path) -> dict[str, torch.Tensor]:
    """Model and optimizer tensors of the newest checkpoint, read back as one torch.save file."""
    step, path, _ = checkpoint.latest_checkpoint(ckpt_dir)
    out = ckpt_dir / f"final_{step}.pt"
    dcp_to_torch_save(path, out)
    state = torch.load(out)
    return {k: v for k, v in state.items() if k.startswith(("model.", "optim."))}


# ---- the command line -------------------------------------------------------------------------------


def test_help_shows_choices_and_defaults():
    text = build_parser().format_help()
    for needle in (
        "{none,ddp,zero2,fsdp,hsdp}",
        "{uint16,uint32}",
        "default: 1.0",
        "--checkpoint-every",
        "torchrun",
    ):
        assert needle in text


def test_no_flag_is_a_prefix_of_a_torchrun_option():
    """[Note: flag names under torchrun]: torchrun's argparse would take an abbreviation of its own."""
    from torch.distributed.run import get_args_parser

    theirs = [s for a in get_args_parser()._actions for s in a.option_strings if s.startswith("--")]
    ours = [s for a in build_parser()._actions for s in a.option_strings if s.startswith("--")]
    clashes = [(o, t) for o in ours for t in theirs if t.startswith(o) and o != "--help"]
    assert not clashes


def test_children_import_this_checkout():
    out = subprocess.run(
        [sys.executable, "-c", "import cs336_systems; print(cs336_systems.__file__)"],
        env=child_env(), capture_output=True, text=True, check=True, timeout=60,
    ).stdout  # fmt: skip
    assert Path(out.strip()).resolve() == (ROOT / "cs336_systems" / "__init__.py").resolve()


@pytest.mark.timeout(120)
def test_one_process_contract_then_resume(tokens, tmp_path, capsys):
    """The issue's first command as written, then a longer run that resumes from its last checkpoint."""
    cmd = [sys.executable, "-m", "cs336_systems.train", "--size", "debug", "--data", str(tokens), "--steps", "30",
           "--batch-size", "4", "--context-length", "64", "--checkpoint-dir", "ckpt", "--checkpoint-every", "10",
           "--metrics", "metrics.jsonl", "--device", "cpu"]  # fmt: skip
    code, out = finish(run(cmd, tmp_path, timeout=100), 100)
    assert code == 0, out
    rows = metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 31))
    assert {"step", "loss", "lr", "tokens_per_s", "grad_norm"} <= rows[0].keys()
    assert rows[-1]["loss"] < rows[0]["loss"]
    assert [s for s, _ in checkpoint.complete_checkpoints(tmp_path / "ckpt")] == [10, 20, 30]

    args = ["--data", str(tokens), "--steps", "34", "--checkpoint-dir", str(tmp_path / "ckpt"),
            "--checkpoint-every", "2", "--keep-checkpoints", "2", "--metrics", str(tmp_path / "metrics.jsonl")]  # fmt: skip
    main([*TINY, *args])
    assert "(step 30)" in capsys.readouterr().out
    assert [r["step"] for r in metrics(tmp_path / "metrics.jsonl")] == list(range(1, 35))
    assert [s for s, _ in checkpoint.complete_checkpoints(tmp_path / "ckpt")] == [32, 34]


# ---- several ranks ------------------------------------------------------------------------------


@pytest.mark.distributed
@pytest.mark.timeout(240)
@pytest.mark.xdist_group("train_torchrun")
def test_two_nodes_of_two_ranks_match_one_process(tokens, tmp_path):
    """Two torchrun agents (c10d rendezvous on loopback), 2 ranks each, ddp; the reference: one process."""
    common = [*TINY, "--data", str(tokens), "--steps", "6", "--grad-clip", "0.5"]
    main([*common, "--metrics", str(tmp_path / "one.jsonl")])
    port = free_port()
    cmd = torchrun(2, 2, port, [*common, "--parallel", "ddp", "--metrics", str(tmp_path / "four.jsonl")])
    agents = [run(cmd, tmp_path, timeout=200) for _ in range(2)]
    results = [finish(a, 200) for a in agents]
    for code, out in results:
        assert code == 0, out[-4000:]
    one, four = metrics(tmp_path / "one.jsonl"), metrics(tmp_path / "four.jsonl")
    assert [r["step"] for r in four] == list(range(1, 7))
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose([r[key] for r in four], [r[key] for r in one], rtol=1e-5, err_msg=key)


@pytest.mark.distributed
@pytest.mark.timeout(240)
@pytest.mark.xdist_group("train_torchrun")
def test_sigkill_of_a_rank_restarts_and_resumes_exactly(tokens, tmp_path):
    """Rank 1 dies by SIGKILL at step 7; torchrun restarts the job, which resumes from step 5's
    checkpoint and ends with the parameters and AdamW state of an uninterrupted run, bit for bit.

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: with the agent's store shared (torch's default) a restarted
    rank can read the previous attempt's gloo addresses and fail to connect (pytorch/pytorch#135712).
    """
    env = child_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    args = [*TINY, "--data", str(tokens), "--steps", "10", "--checkpoint-every", "5", "--parallel", "ddp"]
    plain = run(
        torchrun(1, 2, free_port(), [*args, "--checkpoint-dir", "plain"]), tmp_path, timeout=100, env=env
    )
    code, out = finish(plain, 100)
    assert code == 0, out[-4000:]
    env.update({"CS336_TRAIN_TEST_KILL_AT_STEP": "7", "CS336_TRAIN_TEST_KILL_RANK": "1"})
    cmd = torchrun(1, 2, free_port(), [*args, "--checkpoint-dir", "killed", "--metrics", "killed.jsonl"])
    code, out = finish(run(cmd, tmp_path, timeout=150, env=env), 150)
    assert code == 0, out[-4000:]
    assert "exitcode: -9" in out and "(step 5)" in out  # it was killed, and it resumed
    assert [r["step"] for r in metrics(tmp_path / "killed.jsonl")] == list(range(1, 11))
    want, got = final_state(tmp_path / "plain"), final_state(tmp_path / "killed")
    assert want.keys() == got.keys() and len(want) > 10
    assert [k for k in want if not torch.equal(want[k], got[k])] == []


@pytest.mark.distributed
@pytest.mark.timeout(240)
@pytest.mark.xdist_group("train_torchrun")
@pytest.mark.parametrize("parallel", ["fsdp", "zero2"])
def test_sharded_runs_resume_and_match_one_process(tokens, tmp_path, parallel):
    """Two ranks with sharded optimizer state; rank 0 dies by SIGKILL at step 5, the restarted job resumes
    from step 3's sharded checkpoint; the 6 losses equal one process's (rtol 1e-5; a lr of 3e-3 makes a
    lost AdamW state visible), and so do the gradient norms, clipped at 0.5 (zero2: the fused AdamW kernel
    under the Triton interpreter, updated after the global norm of the reduce-scattered shards)."""
    common = [*TINY, "--data", str(tokens), "--steps", "6", "--lr", "3e-3", "--warmup-steps", "1"]
    common += ["--grad-clip", "0.5"]
    main([*common, "--metrics", str(tmp_path / "one.jsonl")])
    env = child_env(
        TRITON_INTERPRET="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", CS336_TRAIN_TEST_KILL_AT_STEP="5"
    )
    args = [*common, "--parallel", parallel, "--checkpoint-dir", "ckpt", "--checkpoint-every", "3"]
    cmd = torchrun(1, 2, free_port(), [*args, "--metrics", "two.jsonl"])
    code, out = finish(run(cmd, tmp_path, timeout=150, env=env), 150)
    assert code == 0, out[-4000:]
    assert "exitcode: -9" in out and "(step 3)" in out
    one, two = metrics(tmp_path / "one.jsonl"), metrics(tmp_path / "two.jsonl")
    assert [r["step"] for r in two] == list(range(1, 7))
    np.testing.assert_allclose([r["loss"] for r in two], [r["loss"] for r in one], rtol=1e-5)
    np.testing.assert_allclose([r["grad_norm"] for r in two], [r["grad_norm"] for r in one], rtol=1e-5)
    assert max(r["grad_norm"] for r in one) > 0.5  # the clip was active


@pytest.mark.distributed
@pytest.mark.timeout(240)
@pytest.mark.xdist_group("train_torchrun")
def test_hybrid_two_nodes_resume_and_match_one_process(tokens, tmp_path):
    """hsdp on two torchrun agents of two ranks each: FSDP within each agent's ranks, replicas across
    the agents. Rank 0 dies by SIGKILL at step 5; both agents restart, the job resumes from step 3's
    checkpoint, and the 6 losses and gradient norms equal one process's (rtol 1e-5, clipped at 0.5)."""
    common = [*TINY, "--data", str(tokens), "--steps", "6", "--lr", "3e-3", "--warmup-steps", "1"]
    common += ["--grad-clip", "0.5"]
    main([*common, "--metrics", str(tmp_path / "one.jsonl")])
    env = child_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", CS336_TRAIN_TEST_KILL_AT_STEP="5")
    args = [*common, "--parallel", "hsdp", "--checkpoint-dir", "ckpt", "--checkpoint-every", "3"]
    cmd = torchrun(2, 2, free_port(), [*args, "--metrics", "four.jsonl"])
    agents = [run(cmd, tmp_path, timeout=200, env=env) for _ in range(2)]
    results = [finish(a, 200) for a in agents]
    for code, out in results:
        assert code == 0, out[-4000:]
    out = "".join(o for _, o in results)
    assert "exitcode: -9" in out and "(step 3)" in out
    one, four = metrics(tmp_path / "one.jsonl"), metrics(tmp_path / "four.jsonl")
    assert [r["step"] for r in four] == list(range(1, 7))
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose([r[key] for r in four], [r[key] for r in one], rtol=1e-5, err_msg=key)


# ---- a save killed half-way --------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_a_save_killed_half_way_leaves_the_previous_checkpoint(tokens, tmp_path, capsys, monkeypatch):
    args = [
        *TINY,
        "--data",
        str(tokens),
        "--steps",
        "10",
        "--checkpoint-every",
        "5",
        "--checkpoint-dir",
        "ckpt",
    ]
    env = child_env(**{checkpoint.DIE_IN_SAVE_ENV: "10"})
    code, out = finish(
        run([sys.executable, "-m", "cs336_systems.train", *args], tmp_path, timeout=100, env=env), 100
    )
    assert code == -signal.SIGKILL, out
    partial = tmp_path / "ckpt" / ".tmp-step_00000010"
    assert any(partial.glob("*.distcp")), "the shard of step 10 was written before the kill"
    assert checkpoint.latest_checkpoint(tmp_path / "ckpt")[0] == 5
    monkeypatch.chdir(tmp_path)
    main(args)
    assert "(step 5)" in capsys.readouterr().out
    assert not partial.exists()
    assert [s for s, _ in checkpoint.complete_checkpoints(tmp_path / "ckpt")] == [5, 10]


# ---- bad input: a clear error before any work ------------------------------------------------------


def fails(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


def test_data_shorter_than_one_batch(tmp_path, capsys):
    short = write_tokens(tmp_path / "short.bin", 4 * 64, 256)
    err = fails([*TINY, "--data", str(short), "--steps", "1"], capsys)
    assert "256 tokens, fewer than one batch needs (257" in err


def test_missing_file_and_wrong_dtype(tmp_path, capsys):
    assert "no such file" in fails([*TINY, "--data", str(tmp_path / "nope.bin")], capsys)
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\0" * 40_001)
    assert "not a whole number of uint16 tokens" in fails([*TINY, "--data", str(odd)], capsys)
    assert "not a whole number of uint32" in fails(
        [*TINY, "--data", str(odd), "--data-dtype", "uint32"], capsys
    )


def test_token_id_beyond_the_vocabulary(tmp_path, capsys, monkeypatch):
    ids = np.zeros(20_000, dtype=np.uint16)
    ids[0] = 300  # the debug model's vocab_size is 256
    (tmp_path / "head.bin").write_bytes(ids.tobytes())
    err = fails([*TINY, "--data", str(tmp_path / "head.bin")], capsys)
    assert "token id 300 in a sample of the file is >= the model's vocab_size 256" in err
    # An id the sample misses is caught by the batch that reads it.
    monkeypatch.setattr(data, "SAMPLE_TOKENS", 2)
    ids[:] = 7
    ids[2000:18000] = 999  # the sample reads ids 0, 1, 10000, 19998 and 19999 only
    ids[10000] = 7
    (tmp_path / "middle.bin").write_bytes(ids.tobytes())
    err = fails([*TINY, "--data", str(tmp_path / "middle.bin"), "--steps", "2"], capsys)
    assert "token id 999 in a batch" in err


def test_checkpoint_from_another_configuration(tokens, tmp_path, capsys):
    ckpt = str(tmp_path / "ckpt")
    main([*TINY, "--data", str(tokens), "--steps", "1", "--checkpoint-dir", ckpt])
    capsys.readouterr()
    err = fails(
        [*TINY, "--data", str(tokens), "--steps", "2", "--checkpoint-dir", ckpt, "--seed", "1"], capsys
    )
    assert "is from another configuration (seed: checkpoint 0, this run 1)" in err
    err = fails([*TINY[:-4], "--context-length", "32", "--device", "cpu", "--data", str(tokens),
                 "--steps", "2", "--checkpoint-dir", ckpt], capsys)  # fmt: skip
    assert "'context_length': 64" in err and "'context_length': 32" in err


def test_unwritable_checkpoint_directory(tokens, tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    err = fails([*TINY, "--data", str(tokens), "--checkpoint-dir", str(blocker / "ckpt")], capsys)
    assert "--checkpoint-dir" in err and "not a writable directory" in err


def test_usage_errors_name_the_flag(tokens, capsys):
    assert "--steps must be positive, got 0" in fails([*TINY, "--data", str(tokens), "--steps", "0"], capsys)
    assert "--parallel ddp needs torchrun" in fails(
        [*TINY, "--data", str(tokens), "--parallel", "ddp"], capsys
    )
