"""DDP training benchmark: variant labels, a real 2-rank gloo sweep through torchrun (one variant made
to crash on one rank, so the driver must record it and relaunch), traces, summary, figures, bucket model."""

from __future__ import annotations

import json
import math

import matplotlib
import pytest

matplotlib.use("Agg")

from cs336_systems.measure.results import append_rows, load_results, make_row
from cs336_systems.studies.distributed import comm_bench, ddp_facts, train_bench
from cs336_systems.studies.distributed.plots import render_figures
from cs336_systems.studies.distributed.train_bench import TrainBenchConfig, Variant

# The sweep launches torchrun for every variant: one module-wide limit covers the shared fixture.
pytestmark = [pytest.mark.distributed, pytest.mark.timeout(420)]


def test_variant_labels():
    assert Variant.parse("bucketed:10") == Variant("bucketed", 10.0)
    assert Variant.parse("bucketed").x_value == math.inf  # one bucket
    assert Variant.parse("torch").x_value == train_bench.TORCH_DEFAULT_BUCKET_MB
    assert math.isnan(Variant.parse("naive").x_value)
    assert (
        Variant.parse("torch:100").label == "torch:100"
        and Variant.parse("overlap").impl == "ddp_overlap_individual"
    )
    for bad in ("sharded", "naive:10", "bucketed:0", "bucketed:-1"):
        with pytest.raises(ValueError):
            Variant.parse(bad)
    with pytest.raises(ValueError, match="unknown variant"):
        TrainBenchConfig(trace=("nope",))


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp_training")
    cfg = TrainBenchConfig(
        size="debug",
        context_length=16,
        global_batch=4,
        warmup=1,
        steps=2,
        backend="gloo",
        trace=("naive", "overlap"),
    )
    variants = ["single", "naive", "flat", "overlap", "bucketed:0.01", "torch"]
    failed = train_bench.run_sweep(cfg, variants, nproc=2, results_dir=str(out), inject_failure="flat")
    return out, failed


def test_sweep_survives_a_crashing_variant(sweep):
    out, failed = sweep
    assert failed == ["flat"]
    df = load_results(train_bench.PROBLEM, out)
    step = df[df.metric == "step_time"]
    assert set(step.impl) == {
        "single_gpu",
        "ddp_naive",
        "ddp_flat",
        "ddp_overlap_individual",
        "ddp_bucketed",
        "ddp_torch",
    }
    flat = step[step.impl == "ddp_flat"].iloc[0]
    assert "injected failure" in flat.note and math.isnan(flat.p50)
    ok = df[df.impl != "ddp_flat"]
    assert (ok.note == "").all()
    comm = ok[ok.metric == "comm_time"]
    assert set(comm.impl) == {"ddp_naive", "ddp_overlap_individual", "ddp_bucketed"}  # not torch, not single
    for impl, g in ok[ok.metric.str.endswith("_time")].groupby("impl"):
        by = {m: json.loads(s) for m, s in zip(g.metric, g.samples)}
        phases = [by[m] for m in ("forward_time", "backward_time", "comm_time", "optimizer_time") if m in by]
        for i, total in enumerate(by["step_time"]):  # the phases of the slowest rank fit inside its step
            assert 0 < sum(p[i] for p in phases) <= total * 1.05, impl
    cfg = json.loads(step[step.impl == "ddp_bucketed"].iloc[0].config_json)
    assert cfg["world_size"] == 2 and cfg["per_rank_batch"] == 2 and cfg["num_buckets"] >= 2


def test_traces_summary_and_figures(sweep, tmp_path):
    out, _ = sweep
    for label in ("naive", "overlap"):
        assert train_bench.trace_path(out, label).exists()
    summ = ddp_facts.summary(load_results(train_bench.PROBLEM, out))
    assert list(summ.kind) == ["single", "naive", "flat", "overlap", "bucketed", "torch"]
    assert summ.loc[summ.kind == "single", "overhead_ms"].iloc[0] == 0
    assert math.isnan(summ.loc[summ.kind == "flat", "step_ms"].iloc[0])
    # Synthetic all-reduce rows (t = 50 us + s / 2 GB/s) so the bucket model can be fitted.
    rows = []
    for mb in (0.01, 0.1, 1.0):
        nbytes = int(mb * 2**20)
        rec = {"world_size": 2, "size_bytes": nbytes}
        rows.append(
            make_row(
                problem=comm_bench.PROBLEM,
                name="all_reduce",
                impl="gloo/cpu",
                mode="world2",
                x_name="size_mb",
                x_value=mb,
                metric="all_reduce_time",
                unit="ms",
                value=(50e-6 + nbytes / 2e9) * 1e3,
                config=rec,
            )
        )
    append_rows(comm_bench.PROBLEM, rows, out)
    model = ddp_facts.bucket_model(
        load_results(train_bench.PROBLEM, out),
        load_results(comm_bench.PROBLEM, out),
        grid_mb=[0.001, 0.01, 1],
    )
    assert model["o_s"] == pytest.approx(50e-6, rel=1e-3) and model["w_Bps"] == pytest.approx(2e9, rel=1e-3)
    assert model["bucket_mb_opt"] == pytest.approx(math.sqrt(model["s_bytes"] * 2e9 * 50e-6) / 2**20)
    assert list(model["table"].bucket_mb) == [0.01] and (model["curve"].simulated_ms > 0).all()
    written = render_figures(out, tmp_path)
    assert {p.name for p in written} >= {
        "naive_ddp_benchmarking__step_breakdown.png",
        "ddp_overlap_individual_parameters_benchmarking__timeline.png",
        "ddp_bucketed_benchmarking__bucket_sweep.png",
        "ddp_bucketed_benchmarking__overhead_model.png",
        "distributed_communication_single_node__all_reduce.png",
    }
