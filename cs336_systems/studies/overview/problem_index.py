"""Every handout problem, what answers it, the tests that cover it and its status (the writeup's overview).

`PROBLEMS` is the index, in the order of the writeup: the 2025 handout's problems in its order, then the
2026 additions. Each entry names the notebook that answers it (None for the code-only problems, whose
deliverable is a tested class), the package modules that implement or measure it, the test files
that cover it, and where its rows are (a CSV in figures/data, a run folder with a summary.json, or none
for the written problems).

`overview(results_dir)` turns the index into the overview table. Nothing in it is typed in by hand
except the index itself: the number of tests is counted in the test files, whether a notebook or a
result file exists is looked up, and the status is derived from the committed rows (the devices that
measured them, rows measured from uncommitted code, and what the handout asks for that no row covers,
such as NCCL at 4 and 6 processes).

A new section (e.g. the 8B leaderboard or Hopper FlashAttention) adds its entry here; `tests/
test_overview.py` checks that every notebook appears once and that every named file exists.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from cs336_systems.measure.provenance import is_dirty_sha
from cs336_systems.measure.results import REPO_ROOT, load_results
from cs336_systems.measure.results import results_dir as default_results_dir

NOTEBOOKS = REPO_ROOT / "notebooks"
TESTS = REPO_ROOT / "tests"


@dataclass(frozen=True, kw_only=True)
class Problem:
    """One handout problem (or a group answered together). `handout`: e.g. "2025 §1.1.3"."""

    problem: str
    handout: str
    part: str  # "2025" (the 2025 handout) or "2026" (the 2026 additions)
    kind: str  # "measured", "code" (a tested class), "written" (derivations), "computed" (live on CPU)
    notebook: str | None = None  # NN_<name>, without .py
    modules: tuple[str, ...] = ()
    tests: tuple[str, ...] = ()  # test files (tests/<name>.py)
    results: str | None = None  # the CSV (figures/data/<results>.csv) holding its rows
    world_sizes: dict[str, tuple[int, ...]] = field(default_factory=dict)  # backend -> sizes the handout asks


# fmt: off
PROBLEMS: tuple[Problem, ...] = (
    Problem(problem="benchmarking_script", handout="2025 §1.1.3", part="2025", kind="measured",
            notebook="01_benchmarking_script", modules=("studies.profiling.end_to_end",), tests=("test_end_to_end",),
            results="benchmarking_script"),
    Problem(problem="nsys_profile", handout="2025 §1.1.4", part="2025", kind="measured",
            notebook="02_nsys_profile", modules=("studies.profiling.kernel_profile",), tests=("test_kernel_profile",),
            results="nsys_profile"),
    Problem(problem="mixed_precision_accumulation", handout="2025 §1.1.5", part="2025", kind="computed",
            notebook="03_mixed_precision_accumulation", modules=("studies.profiling.accumulation",),
            tests=("test_accumulation",)),
    Problem(problem="benchmarking_mixed_precision", handout="2025 §1.1.5", part="2025", kind="measured",
            notebook="04_benchmarking_mixed_precision", modules=("studies.profiling.mixed_precision",),
            tests=("test_mixed_precision",), results="benchmarking_mixed_precision"),
    Problem(problem="memory_profiling", handout="2025 §1.1.6", part="2025", kind="measured",
            notebook="05_memory_profiling", modules=("studies.profiling.memory",), tests=("test_memory",),
            results="memory_profiling"),
    Problem(problem="pytorch_attention", handout="2025 §1.2.1", part="2025", kind="measured",
            notebook="06_pytorch_attention", modules=("studies.attention.pytorch_attention",),
            tests=("test_pytorch_attention",), results="pytorch_attention"),
    Problem(problem="torch_compile", handout="2025 §1.3", part="2025", kind="measured",
            notebook="07_torch_compile", modules=("studies.attention.torch_compile",),
            tests=("test_pytorch_attention", "test_end_to_end"), results="torch_compile"),
    Problem(problem="flash_forward", handout="2025 §1.3.2", part="2025", kind="code",
            modules=("attention.flash_pytorch", "attention.flash_triton"),
            tests=("test_attention", "test_attention_triton")),
    Problem(problem="flash_backward", handout="2025 §1.3.2", part="2025", kind="code",
            modules=("attention.backward", "attention.flash_triton"),
            tests=("test_attention", "test_attention_triton")),
    Problem(problem="flash_benchmarking", handout="2025 §1.3.2", part="2025", kind="measured",
            notebook="10_flash_benchmarking", modules=("studies.attention.flash_sweep", "studies.attention.flash_overhead"),
            tests=("test_flash_bench",), results="flash_benchmarking"),
    Problem(problem="FlashAttention-2 leaderboard", handout="2025 §1.3.3", part="2025", kind="measured",
            notebook="11_flash_leaderboard", modules=("studies.attention.flash_leaderboard", "studies.attention.flash_leaderboard_facts", "studies.attention.flash_model"),
            tests=("test_flash_bench", "test_attention_hopper"), results="flash_leaderboard"),
    Problem(problem="distributed_communication_single_node", handout="2025 §2.1", part="2025",
            kind="measured", notebook="12_distributed_communication_single_node",
            modules=("studies.distributed.comm_bench",), tests=("test_comm_bench",),
            results="distributed_communication_single_node",
            world_sizes={"gloo": (2, 4, 6), "nccl": (2, 4, 6)}),
    Problem(problem="naive_ddp", handout="2025 §2.2", part="2025", kind="computed",
            notebook="13_naive_ddp", modules=("distributed.ddp", "studies.distributed.ddp_check"),
            tests=("test_ddp",)),
    Problem(problem="naive_ddp_benchmarking", handout="2025 §2.2", part="2025", kind="measured",
            notebook="14_naive_ddp_benchmarking", modules=("studies.distributed.train_bench",),
            tests=("test_train_bench",), results="ddp_training"),
    Problem(problem="minimal_ddp_flat_benchmarking", handout="2025 §2.3.1", part="2025", kind="measured",
            notebook="15_minimal_ddp_flat_benchmarking", modules=("studies.distributed.train_bench",),
            tests=("test_train_bench",), results="ddp_training"),
    Problem(problem="ddp_overlap_individual_parameters", handout="2025 §2.3.2", part="2025", kind="code",
            modules=("distributed.ddp",), tests=("test_ddp",)),
    Problem(problem="ddp_overlap_individual_parameters_benchmarking", handout="2025 §2.3.2", part="2025",
            kind="measured", notebook="16_ddp_overlap_individual_parameters_benchmarking",
            modules=("studies.distributed.train_bench",), tests=("test_train_bench", "test_trace_plot"),
            results="ddp_training"),
    Problem(problem="ddp_overlap_bucketed", handout="2025 §2.3.3", part="2025", kind="code",
            modules=("distributed.ddp",), tests=("test_ddp",)),
    Problem(problem="ddp_bucketed_benchmarking", handout="2025 §2.3.3", part="2025", kind="measured",
            notebook="18_ddp_bucketed_benchmarking", modules=("studies.distributed.train_bench",),
            tests=("test_train_bench", "test_distributed_facts"), results="ddp_training"),
    Problem(problem="communication_accounting", handout="2025 §2.4", part="2025", kind="written",
            notebook="19_communication_accounting", modules=("accounting", "studies.written.communication_accounting"),
            tests=("test_communication_accounting", "test_accounting")),
    Problem(problem="optimizer_state_sharding", handout="2025 §3", part="2025", kind="code",
            modules=("distributed.sharded_optimizer",), tests=("test_sharded_optimizer",)),
    Problem(problem="optimizer_state_sharding_accounting", handout="2025 §3", part="2025", kind="measured",
            notebook="21_optimizer_state_sharding_accounting", modules=("studies.distributed.sharding_bench",),
            tests=("test_distributed_facts",), results="optimizer_state_sharding_accounting"),
    Problem(problem="gradient_checkpointing", handout="2026 §3", part="2026", kind="measured",
            notebook="30_gradient_checkpointing", modules=("studies.profiling.checkpointing",),
            tests=("test_checkpointing",), results="gradient_checkpointing"),
    Problem(problem="fsdp", handout="2026 §7", part="2026", kind="code", modules=("distributed.fsdp",),
            tests=("test_fsdp", "test_fsdp_parity")),
    Problem(problem="fsdp_accounting", handout="2026 §7", part="2026", kind="measured",
            notebook="31_fsdp_accounting", modules=("studies.distributed.fsdp_bench",),
            tests=("test_distributed_facts", "test_fsdp_parity"), results="fsdp_accounting"),
    Problem(problem="alternate_ring_all_reduce ... fsdp_tp_calcs", handout="2026 §8", part="2026",
            kind="written", notebook="32_parallelism_calcs", modules=("accounting", "studies.written.parallelism_calcs"),
            tests=("test_parallelism_calcs",)),
    Problem(problem="training step (2.7B)", handout="2026 leaderboard", part="2026", kind="measured",
            notebook="40_training_step", modules=("training", "kernels", "studies.training.train_step"),
            tests=("test_training",), results="training_step"),
    Problem(problem="training_leaderboard (8B)", handout="2026 leaderboard", part="2026", kind="measured",
            notebook="41_training_leaderboard",
            modules=("training.leaderboard", "distributed.zero", "studies.training.leaderboard"),
            tests=("test_training_leaderboard",), results="training_leaderboard"),
    Problem(problem="flash_hopper", handout="2026 (beyond the handouts)", part="2026", kind="measured",
            notebook="42_flash_hopper", modules=("attention.flash_triton", "studies.attention.flash_hopper", "studies.attention.flash_hopper_facts"),
            tests=("test_attention_hopper", "test_flash_bench"), results="flash_leaderboard"),
    Problem(problem="training_run (train entry point)", handout="2026 (beyond the handouts)", part="2026",
            kind="measured", notebook="43_training_run",
            modules=("train", "studies.training.train_run", "studies.training.train_scaling"),
            tests=("test_train", "test_train_run"), results="train_gpu_demo"),
)
# fmt: on


def count_tests(test_file: str, tests_dir: Path = TESTS) -> int:
    """The number of `test_*` functions in tests/<test_file>.py (0 if the file does not exist)."""
    path = tests_dir / f"{test_file}.py"
    if not path.exists():
        return 0
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return sum(
        isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith("test_")
        for node in ast.walk(tree)
    )


def _devices(rows: pd.DataFrame) -> str:
    gpus = sorted(
        {str(g).removeprefix("NVIDIA ").replace(" 80GB HBM3", "") for g in rows.get("gpu_name", [])}
    )
    return ", ".join(g for g in gpus if not g.startswith("cpu")) or "CPU"


def missing_world_sizes(rows: pd.DataFrame, asked: dict[str, Sequence[int]]) -> dict[str, list[int]]:
    """Per backend, the process counts the handout asks for that no row of `rows` measured."""
    out = {}
    for backend, sizes in asked.items():
        sel = rows[rows["impl"].astype(str).str.startswith(backend)] if "impl" in rows else rows.iloc[:0]
        sel = sel[sel["note"].astype(str) == ""] if "note" in sel else sel  # a failed row measured nothing
        done = {json.loads(c).get("world_size", -1) for c in sel.get("config_json", []) if c}
        missing = [n for n in sizes if n not in done]
        if missing:
            out[backend] = missing
    return out


def status(p: Problem, results_dir: Path, notebooks_dir: Path = NOTEBOOKS) -> str:
    """What the committed material says about `p`: tested, measured (where), or what is missing."""
    if p.notebook is not None and not (notebooks_dir / f"{p.notebook}.py").exists():
        return "not written yet"
    if p.kind == "code":
        return "CPU tests" + (
            " (+ GPU-marked tests)" if any("triton" in t or "hopper" in t for t in p.tests) else ""
        )
    if p.kind == "written":
        return "derived; numbers computed"
    if p.kind == "computed":
        return "computed live on CPU"
    run_summary = Path(results_dir) / str(p.results) / "summary.json"
    if run_summary.exists():  # a run folder (`train.gpu_demo`), not a CSV of rows
        device = json.loads(run_summary.read_text()).get("device", "?")
        return f"measured ({_devices(pd.DataFrame({'gpu_name': [device]}))})"
    rows = load_results(p.results, results_dir) if p.results else pd.DataFrame()
    if rows.empty:
        return "not measured yet"
    text = f"measured ({_devices(rows)})"
    dirty = int(rows["git_sha"].map(is_dirty_sha).sum()) if "git_sha" in rows else 0
    if dirty:
        text += f"; {dirty} rows from uncommitted code"
    gaps = missing_world_sizes(rows, p.world_sizes)
    if gaps:
        most = int(pd.to_numeric(rows.get("num_gpus"), errors="coerce").max())
        text += "; not run: " + ", ".join(f"{b} at {', '.join(map(str, n))}" for b, n in gaps.items())
        text += f" processes (at most {most} GPUs were lent)"
    return text


def overview(results_dir: str | Path | None = None, notebooks_dir: Path = NOTEBOOKS) -> pd.DataFrame:
    """The overview table: part, problem, handout section, where it is answered (the notebook, or "code:"
    for a problem answered by a tested class; then the modules), tests and status."""
    rdir = default_results_dir(results_dir)
    rows = []
    for p in PROBLEMS:
        tests = [f"{t} ({count_tests(t)})" for t in p.tests]
        where = f"{p.notebook}; " if p.notebook else "code: "
        rows.append(
            {
                "part": p.part,
                "problem": p.problem,
                "handout": p.handout,
                "answered in": where + ", ".join(p.modules),
                "tests (count)": ", ".join(tests),
                "status": status(p, rdir, notebooks_dir),
            }
        )
    return pd.DataFrame(rows)


def printed(table: pd.DataFrame) -> pd.DataFrame:
    """The overview as the writeup prints it: the notebook that answers a problem (its section has the
    same name), or "code:" and the modules of a code-only problem; test files without their `test_`."""
    where = table["answered in"].where(
        table["answered in"].str.startswith("code: "), table["answered in"].str.split(";").str[0]
    )
    return table.drop(columns=["part"]).assign(
        **{
            "answered in": where,
            "tests (count)": table["tests (count)"].str.replace("test_", "", regex=False),
        }
    )


def facts(table: pd.DataFrame) -> dict[str, object]:
    """Counts the overview's text quotes: problems per part, code-only problems, tests named."""
    return {
        "problems_2025": int((table.part == "2025").sum()),
        "problems_2026": int((table.part == "2026").sum()),
        "code_only": int(table["answered in"].str.startswith("code: ").sum()),
        "not_run": [r.problem for r in table.itertuples() if "not run" in r.status],
        "pending": [
            r.problem for r in table.itertuples() if r.status in ("not written yet", "not measured yet")
        ],
    }
