"""The end_to_end benchmark CLI and the profiling family's entry (`python -m cs336_systems.studies.profiling`), on the CPU with the debug model:
rows and schema, per-step sample accounting, failure rows that do not stop a sweep, skipped rows."""

import json

import pandas as pd
import pytest
import torch

from cs336_systems.measure.budget import TimeBudget
from cs336_systems.measure.results import COLUMNS, load_results
from cs336_systems.studies.profiling import end_to_end as E
from cs336_systems.studies.profiling import timing_run as S


def test_cli_writes_schema_rows_with_every_step(tmp_path):
    E.main(
        [
            "--size",
            "debug",
            "--context-length",
            "16",
            "--mode",
            "forward",
            "train",
            "--warmup",
            "1",
            "--steps",
            "3",
            "--device",
            "cpu",
            "--results-dir",
            str(tmp_path),
        ]
    )
    df = load_results("benchmarking_script", tmp_path)
    assert list(df.columns) == COLUMNS
    by_mode = df.groupby("mode").metric.apply(set).to_dict()
    assert by_mode["forward"] == {"forward_time", "step_time"}
    assert by_mode["train"] == {"forward_time", "backward_time", "optimizer_time", "step_time"}
    assert (df.n == 3).all() and (df.x_name == "context_length").all() and (df.x_value == 16).all()
    assert all(len(json.loads(s)) == 3 for s in df.samples)
    assert (df.note == "").all() and (df["mean"] > 0).all()
    step = df[(df["mode"] == "train") & (df.metric == "step_time")].iloc[0]
    parts = df[(df["mode"] == "train") & (df.metric != "step_time")]
    per_step = [sum(x) for x in zip(*(json.loads(s) for s in parts.samples))]
    assert json.loads(step.samples) == pytest.approx(
        per_step, abs=1e-5
    )  # step = forward + backward + optimizer
    assert json.loads(step.config_json)["model"]["d_model"] == 64


def test_warmup_and_steps_accounting(monkeypatch):
    calls = []
    real_step = E.Workload.step

    def counting_step(self, timer):
        calls.append(timer.enabled)
        return real_step(self, timer)

    monkeypatch.setattr(E.Workload, "step", counting_step)
    cfg = E.EndToEndConfig(
        size="debug",
        context_length=8,
        batch_size=1,
        mode="forward_backward",
        warmup=2,
        steps=4,
        device="cpu",
        x_axis="warmup",
    )
    rows = E.run_one(cfg)
    assert calls == [False, False, True, True, True, True]  # warm-up untimed, then the timed steps
    fwd = next(r for r in rows if r["metric"] == "forward_time")
    assert fwd["n"] == 4 and len(json.loads(fwd["samples"])) == 4
    assert (fwd["x_name"], fwd["x_value"]) == ("warmup", 2)
    E.run_one(
        E.EndToEndConfig(
            size="debug", context_length=8, batch_size=1, mode="forward", warmup=0, steps=2, device="cpu"
        )
    )
    assert calls[6:] == [True, True]


@pytest.mark.parametrize(
    ("exc", "note"),
    [
        (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB"), "OOM"),
        (RuntimeError("boom"), "error: RuntimeError: boom"),
    ],
)
def test_a_failing_config_becomes_rows_and_the_sweep_continues(monkeypatch, tmp_path, exc, note):
    real_step = E.Workload.step

    def step(self, timer):
        if self.cfg.context_length == 16:
            raise exc
        return real_step(self, timer)

    monkeypatch.setattr(E.Workload, "step", step)
    configs = E.grid(
        size="debug", context_length=[8, 16, 24], batch_size=1, mode="train", warmup=0, steps=1, device="cpu"
    )
    df = pd.DataFrame(E.measure(configs, results_dir=tmp_path, progress=False))
    bad = df[df.x_value == 16]
    assert set(bad.note) == {note} and bad["mean"].isna().all()
    assert set(bad.metric) == {"forward_time", "backward_time", "optimizer_time"}
    good = df[df.x_value != 16]
    assert (good.note == "").all() and set(good.x_value) == {8, 24}
    assert len(load_results("benchmarking_script", tmp_path)) == len(df)


def test_config_validation():
    with pytest.raises(ValueError, match="mode"):
        E.EndToEndConfig(mode="inference")
    with pytest.raises(ValueError, match="x_axis"):
        E.EndToEndConfig(x_axis="size")
    with pytest.raises(ValueError, match="autocast"):
        E.EndToEndConfig(autocast="fp8")


def test_budget_skips_are_recorded_not_dropped(tmp_path):
    plan = S.make_plan(quick=True)
    rows = S.run_benchmarking_script(plan, tmp_path, TimeBudget(0.0))
    df = pd.DataFrame(rows)
    assert len(df) == 1 + 2 + 3  # one row per phase of forward, forward_backward and train (one size)
    assert df.note.str.startswith("skipped: time budget").all()
    assert TimeBudget(60.0).skip_reason(predicted_s=120.0).startswith("skipped: predicted 120 s")
    assert TimeBudget().skip_reason(1e9) is None
    # Unbounded runs (the notebook path) must give child processes no timeout rather than inf,
    # which subprocess cannot wait for (seen failing on the GPU host).
    assert TimeBudget().subprocess_timeout() is None
    assert TimeBudget(5.0).subprocess_timeout(floor_s=30.0) == 30.0


def test_family_entry_runs_the_chosen_parts_unbounded(tmp_path):
    from cs336_systems.studies.profiling.__main__ import main

    manifest = main(
        [
            "--out",
            str(tmp_path / "out"),
            "--quick",
            "--results-dir",
            str(tmp_path / "res"),
            "--parts",
            "mixed",
            "bench",
        ]
    )
    assert list(manifest["parts"]) == ["bench", "mixed"]  # the family's order, not the command line's
    assert manifest["budget_s"] is None  # no budget unless one is asked for
    bench = load_results("benchmarking_script", tmp_path / "res")
    mixed = load_results("benchmarking_mixed_precision", tmp_path / "res")
    assert set(bench["mode"]) == set(E.MODES) and (bench.note == "").all()
    # fp32 rows are the stage-2 measurements relabelled; bf16 autocast is measured in stage 3
    assert set(mixed.dtype) == {"fp32", "bf16-autocast"} and set(mixed["mode"]) == {"forward", "train"}
    fp32 = mixed[mixed.dtype == "fp32"].sort_values(["mode", "metric"]).reset_index(drop=True)
    same = (
        bench[bench["mode"].isin(["forward", "train"])].sort_values(["mode", "metric"]).reset_index(drop=True)
    )
    assert list(fp32.samples) == list(same.samples)
    saved = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert saved["parts"]["bench"]["rows"] == 9 and saved["parts"]["bench"]["skipped"] == 0


def test_quick_refuses_committed_results_dir(tmp_path):
    from cs336_systems.measure.results import REPO_ROOT
    from cs336_systems.studies.profiling.__main__ import main

    with pytest.raises(SystemExit, match="committed"):
        main(["--out", str(tmp_path), "--quick", "--results-dir", str(REPO_ROOT / "figures" / "data")])


def test_flash_model_check_and_sweep_quick(tmp_path):
    """The model with our Triton attention matches the naive model (outputs and every gradient),
    and the training sweep gives a row per implementation (tiny model, CPU interpreter)."""
    import json

    from cs336_systems.studies.attention import flash_model as FM

    FM.main(["--quick", "--results-dir", str(tmp_path)])
    df = pd.read_csv(tmp_path / f"{FM.PROBLEM}.csv")
    check = df[df["mode"] == "check"]
    assert set(check["impl"]) == {"sdpa", "flash_triton"}
    assert check["note"].isna().all(), check["note"].tolist()
    assert all(json.loads(c)["passed"] for c in check["config_json"])
    assert (check[check.metric == "max_grad_rel_err"]["mean"] < 1e-3).all()
    steps = df[(df["mode"] == "train") & (df.metric == "step_time")]
    assert set(steps["impl"]) == set(FM.IMPLS) and steps["note"].isna().all()
    table = FM.speedup_table(df)
    assert "speed-up vs naive" in table.columns and len(table) == 1


def test_row_fields_carry_the_configuration_and_take_overrides():
    from cs336_systems.studies.profiling.end_to_end import EndToEndConfig, row_fields

    cfg = EndToEndConfig(size="small", context_length=128, mode="forward", device="cpu")
    fields = row_fields(cfg, "p")
    assert (fields["problem"], fields["name"], fields["x_name"], fields["x_value"]) == (
        "p",
        "small",
        "context_length",
        128,
    )
    assert fields["config"]["model"]["d_model"] == 768
    custom = row_fields(cfg, "p", impl="x", config={"a": 1})
    assert custom["impl"] == "x" and custom["config"] == {"a": 1}
