"""Every command-line entry point: help with choices and an example, usage errors before any work,
typed flags, a results directory option, and quick runs that never touch the committed results."""

import hashlib
import importlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cs336_systems.model import ATTENTION_IMPLS, MODEL_SIZES

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "cs336_systems"
N_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


def _cli_modules() -> list[str]:
    """Every `python -m` name: a module with a main guard, or a package with one in its __main__.py."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if '__name__ == "__main__"' in path.read_text():
            parts = path.relative_to(ROOT).with_suffix("").parts
            found.append(".".join(parts[:-1] if parts[-1] == "__main__" else parts))
    return found


def _entry(module: str):
    """The module whose `main` `python -m <module>` runs (a package's __main__)."""
    is_package = (ROOT / module.replace(".", "/") / "__main__.py").exists()
    return importlib.import_module(f"{module}.__main__" if is_package else module)


CLIS = _cli_modules()
# CLIs that write result rows (the others build the report, launch a module, write a JSON check,
# render the README summary from the committed results, print a result computed live, or train: metrics
# JSONL and checkpoints).
NOT_MEASURING = {
    "cs336_systems.distributed.launch",
    "cs336_systems.train",
    "cs336_systems.train.gpu_demo",
    "cs336_systems.train.make_tokens",
    "cs336_systems.studies.distributed.ddp_check",
    "cs336_systems.studies.profiling.accumulation",
    "cs336_systems.studies.overview.readme_summary",
    "cs336_systems.studies.attention.flash_offline",
}
MEASURING = [m for m in CLIS if ".report." not in m and m not in NOT_MEASURING]


def _help(module: str, capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        _entry(module).main(["--help"])
    assert exit_info.value.code in (0, None)
    return capsys.readouterr().out


def test_the_cli_list_is_complete():
    assert len(CLIS) >= 15 and "cs336_systems.studies.attention.flash_bench" in CLIS


@pytest.mark.parametrize("module", CLIS)
def test_every_cli_help_shows_its_choices_and_an_example(module, capsys):
    """Item 12: `--help` prints the purpose, the choices (model sizes, attention, ...) and an example."""
    text = _help(module, capsys)
    command = module.removesuffix(".__main__")  # a package's __main__ runs as `python -m package`
    assert "example:" in text and f"python -m {command}" in text.split("example:", 1)[1], text
    flat = " ".join(text.split())
    if re.search(r"--size[\s{\]]", text):
        assert all(size in flat for size in MODEL_SIZES), f"{module}: --help does not list the sizes"
    if "--attention" in text:  # the implementations this CLI accepts (a subset for some)
        offered = re.search(r"--attention \{([^}]+)\}", text)
        assert offered and set(offered.group(1).split(",")) <= set(ATTENTION_IMPLS), f"{module}: {text}"
    if module in MEASURING:
        assert "--results-dir" in text, f"{module} takes no --results-dir"


def test_launch_help_is_printed_from_the_shell():
    out = subprocess.run([sys.executable, "-m", "cs336_systems.distributed.launch", "--help"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0 and "--nproc" in out.stdout and "example:" in out.stdout


def test_no_cli_parses_a_flag_with_a_silent_lambda():
    """Item 11: `type=lambda s: s in ("true", ...)` turned `--compile maybe` into False."""
    offenders = [str(p.relative_to(ROOT)) for p in PACKAGE.rglob("*.py") if "type=lambda" in p.read_text()]
    assert not offenders


def test_compile_maybe_is_an_error(tmp_path, capsys):
    from cs336_systems.studies.profiling import end_to_end

    with pytest.raises(SystemExit) as exit_info:
        end_to_end.main(["--size", "debug", "--compile", "maybe", "--results-dir", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "argument --compile: expected true or false, got 'maybe'" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


USAGE_ERRORS = [
    ("studies.profiling.end_to_end", ["--size", "huge"], "--size"),
    ("studies.profiling.end_to_end", ["--size", "debug", "--batch-size", "0"], "batch_size"),
    ("studies.profiling.end_to_end", ["--size", "debug", "--attention", "fast"], "--attention"),
    ("studies.profiling.kernel_profile", ["--size", "debug", "--context-length", "0"], "--context-length"),
    ("studies.attention.flash_bench", ["--impls", "flash_triton,warp"], "unknown impls ['warp']"),
    ("studies.attention.flash_bench", ["--dtypes", "float33"], "unknown dtypes ['float33']"),
    ("studies.attention.flash_bench", ["--tune", "64:bfloat:16384"], "--tune"),
    ("studies.attention.flash_bench", ["--once", "--device", "cpu"], "--once is a GPU profiler's workload"),
    ("studies.attention.flash_bench", ["--ab-bwd", "32x4096x128", "--ab-variants", "dq_by_producr=True"],
     "'dq_by_producr=True' is not FIELD=VALUE"),
    ("studies.attention.flash_bench", ["--ab-bwd", "32x4096x128", "--ab-variants", "stages=two"],
     "'two' is not a Python literal"),
    ("studies.attention.flash_bench", ["--ab-bwd", "32x4096", "--device", "cpu"], "is not HEADSxNxD"),
    ("studies.attention.flash_bench", ["--ab-bwd", "2x64x128", "--device", "cpu"], "--ab-bwd times the Hopper"),
    ("studies.attention.flash_bench", ["--ab-fwd", "2x64x128", "--device", "cpu"], "--ab-fwd times the Hopper"),
    ("studies.attention.flash_bench", ["--ab-fwd", "2x64x128", "--ab-bwd", "2x64x128"], "give one of them"),
    ("studies.attention.flash_bench", ["--ab-bwd", "2x64x128", "--ab-variants", "group_heads=3"],
     "group_heads must divide batch x heads = 2"),
    ("studies.attention.flash_bench", ["--ab-fwd", "2x64x128", "--ab-variants", "dq_in_consumers=True"],
     "FIELD of WarpSpecializedFwdConfig"),
    ("studies.attention.flash_model", ["--quick", "--impls", "naive", "fast"], "--impls"),
    ("studies.attention", ["--quick", "--compile-sizes", "huge"], "--compile-sizes"),
    ("studies.attention", ["--quick", "--attn-reps", "0"], "--attn-reps"),
    ("studies.profiling", ["--quick", "--parts", "memory", "timeline"], "--parts"),
    ("studies.profiling", ["--quick", "--budget-s", "0"], "--budget-s"),
    ("studies.distributed.comm_bench", ["--grid", "--nccl-procs", "two"], "--nccl-procs"),
    ("studies.distributed.comm_bench", ["--grid", "--sizes-mb", "0"], "sizes_mb"),
    ("studies.distributed.ddp_check", ["--variants", "bucketed:x"], "--variants"),
    ("studies.distributed.fsdp_bench", ["--quick", "--variants", "zero3"], "--variants"),
    ("studies.distributed.fsdp_bench", ["--quick", "--nproc", "0"], "--nproc"),
    ("studies.distributed.sharding_bench", ["--size", "huge"], "--size"),
    ("studies.distributed.train_bench", ["--size", "debug", "--backend", "gloo", "--variants", "bucketd"], "unknown variant"),
    ("studies.distributed.train_bench", ["--size", "debug", "--backend", "gloo", "--nproc", "2", "--global-batch", "3"],
     "--global-batch 3 is not divisible"),
    ("studies.distributed.fsdp_parity", ["--device", "tpu"], "--device"),
    ("studies.training.train_step", ["--size", "huge"], "--size"),
    ("studies.training.leaderboard", ["--size", "huge"], "--size"),
    ("studies.training.leaderboard", ["--quick", "--checkpoint-blocks", "some"], "--checkpoint-blocks"),
    ("studies.training.leaderboard", ["--rep-ms", "0"], "--rep-ms"),
    ("studies.training.leaderboard", ["--flash-bwd", "shortest_first=maybe"], "'maybe' is not a Python literal"),
    ("studies.training.leaderboard", ["--flash-bwd", "order=1"], "'order=1' is not FIELD=VALUE"),
    ("studies.training.leaderboard", ["--flash-bwd", "group_heads=3"], "group_heads must divide batch x heads = 32"),
    ("studies.training.leaderboard", ["--flash-bwd", "stages=3", "--attention", "sdpa"], "needs --attention flash_triton"),
]  # fmt: skip
if N_GPUS < 2:  # impossible on this machine: NCCL needs a GPU per process
    USAGE_ERRORS += [
        (
            "studies.distributed.fsdp_bench",
            ["--size", "debug", "--backend", "nccl"],
            "--backend nccl with --nproc 2",
        ),
        (
            "studies.distributed.train_bench",
            ["--size", "debug", "--backend", "nccl", "--nproc", "2"],
            "--backend nccl",
        ),
    ]
if N_GPUS == 0:
    USAGE_ERRORS += [("studies.attention.flash_model", ["--device", "cuda"], "--device cuda")]


@pytest.mark.parametrize(
    ("module", "argv", "named"), USAGE_ERRORS, ids=lambda x: " ".join(x) if isinstance(x, list) else None
)
def test_configuration_mistakes_are_usage_errors_before_any_work(
    module, argv, named, tmp_path, capsys, monkeypatch
):
    """Item 10: exit status 2 and a message naming the argument; no row, no file, nothing measured."""
    monkeypatch.setenv("CS336_RESULTS_DIR", str(tmp_path))
    mod = _entry(f"cs336_systems.{module}")
    with pytest.raises(SystemExit) as exit_info:
        mod.main(
            [*argv, "--results-dir", str(tmp_path)] if module != "studies.distributed.ddp_check" else argv
        )
    assert exit_info.value.code == 2
    assert named in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_an_unwritable_results_dir_stops_a_cli_before_measuring(tmp_path, capsys):
    """Item 4 at the CLI boundary: the error comes before the work, naming the directory."""
    from cs336_systems.studies.profiling import end_to_end

    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(SystemExit, match=r"--results-dir: results directory .*file/rows is not writable"):
        end_to_end.main(["--size", "debug", "--context-length", "8", "--results-dir", str(blocker / "rows")])
    assert "resolved configs" not in capsys.readouterr().out


def _digest(root: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        if p.is_file():
            h.update(str(p.relative_to(root)).encode() + p.read_bytes())
    return h.hexdigest()


# Each CLI's quick run from the shell, narrowed where the whole quick workload already runs elsewhere
# in the suite (notebooks 21, 31, 40 and 41, tests/test_training_leaderboard.py): what this checks is
# where a quick run's rows go.
QUICK_RUNS = [
    ["cs336_systems.studies.attention.flash_bench", "--quick"],
    ["cs336_systems.studies.attention.flash_model", "--quick"],
    ["cs336_systems.studies.profiling", "--quick", "--parts", "memory"],
    ["cs336_systems.studies.distributed.fsdp_bench", "--quick", "--variants", "fsdp"],
    ["cs336_systems.studies.distributed.sharding_bench", "--quick", "--variants", "sharded"],
    # the parts that notebook 40's quick run (compare, waterfall) leaves out
    ["cs336_systems.studies.training.train_step", "--quick", "--parts", "check", "bandwidth"],
    ["cs336_systems.studies.training.leaderboard", "--quick", "--param-modes", "bf16", "--paths", "ours"],
]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("cmd", QUICK_RUNS, ids=lambda c: c[0].rsplit(".", 1)[1])
def test_quick_runs_write_a_scratch_dir_never_the_committed_results(cmd):
    """Item 5: a quick run without --results-dir (and without CS336_RESULTS_DIR) leaves figures/data/
    byte-identical and says where its rows went."""
    committed = ROOT / "figures" / "data"
    before = _digest(committed)
    env = {k: v for k, v in os.environ.items() if k != "CS336_RESULTS_DIR"}
    out = subprocess.run([sys.executable, "-m", *cmd], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=280)  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert _digest(committed) == before, f"{cmd} changed the committed figures/data/"
    match = re.search(r"quick run: results go to (\S+)", out.stdout)
    if match:  # train_step --quick saves nothing unless given a directory
        scratch = Path(match.group(1))
        assert scratch.is_relative_to(ROOT / "build" / "quick") and any(scratch.rglob("*"))
        shutil.rmtree(scratch)
    else:
        assert cmd[0].endswith("train_step")
