"""The host-overhead measurement of flash_benchmarking (studies/attention/flash_overhead): its rows, its facts.

On a CPU the path runs up to the CUDA graph (eager rows measured, graph rows say why not); the facts
are checked on the committed sweep rows and on synthetic graph rows; the graph timing itself runs on a
GPU (`gpu` marker).
"""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest
import torch

from cs336_systems.measure.results import REPO_ROOT, load_results, make_row
from cs336_systems.studies.attention import flash_overhead as fo

DATA = REPO_ROOT / "figures" / "data"


def test_cpu_run_records_eager_rows_and_says_why_there_are_no_graph_rows(tmp_path):
    rows = fo.measure(fo.OverheadConfig(**fo.QUICK), results_dir=tmp_path)
    df = load_results(fo.PROBLEM, tmp_path)
    assert len(df) == len(rows) == 2 * 2 * 2 * 2  # impls x N x modes x (eager, graph)
    eager = df[df.metric == "eager_latency"]
    assert (eager.note == "").all() and (eager.p50 > 0).all()
    graph = df[df.metric == "graph_latency"]
    assert (graph.note == "graph timing needs CUDA").all() and graph.p50.isna().all()
    cfg = json.loads(eager.config_json.iloc[0])
    assert {"calls", "batch", "heads", "seq_len", "d"} <= set(cfg)
    assert "latency" not in set(df.metric)  # the sweep's own rows are never written here


def test_config_is_checked():
    with pytest.raises(ValueError, match="unknown impls"):
        fo.OverheadConfig(impls=("flash_pytorch",))
    with pytest.raises(ValueError, match="unknown modes"):
        fo.OverheadConfig(modes=("bwd",))
    with pytest.raises(SystemExit):
        fo.main(["--impls", "nope"])


def test_facts_from_the_committed_sweep_alone_describe_the_host_floor():
    df = load_results("flash_benchmarking", DATA)
    df = df[~df.metric.isin(["eager_latency", "graph_latency"])]  # the sweep's rows alone
    f = fo.facts(df)
    assert f["timing"] == "eager"  # without graph rows the claim is the eager ratio
    sweep = df[(df.metric == "latency") & (df.impl == "flash_triton") & (df.name == "d64")]
    sweep = sweep[(sweep.dtype == "bfloat16") & (sweep["mode"] == "fwd_bwd")]
    short = sweep[sweep.x_value.astype(float) <= 2048].drop_duplicates("x_value", keep="last")
    assert f["floor_ms"] == pytest.approx(short.p50.median())
    assert f["flops_growth"] == (2048 / 128) ** 2
    assert f["floor_spread"] < f["flops_growth"] / 10  # the time does not follow the work there
    assert f["eager_speedup"] > 1


def _graph_rows(impl: str, eager: dict[int, float], graph: dict[int, float]) -> list[dict]:
    rows = []
    for n in eager:
        common = dict(problem=fo.PROBLEM, name="d64", impl=impl, dtype="bfloat16", mode="fwd_bwd")
        common |= dict(x_name="seq_len", x_value=n, config={"calls": 20})
        rows.append(make_row(metric="eager_latency", unit="ms", value=eager[n], **common))
        rows.append(make_row(metric="graph_latency", unit="ms", value=graph[n], **common))
    for r in rows:
        r["gpu_name"] = "NVIDIA H100 80GB HBM3"
    return rows


def test_facts_with_graph_rows_use_the_graph_times():
    ns = [128, 2048, 16384]
    rows = _graph_rows("flash_triton", dict(zip(ns, [1.0, 1.1, 1.5])), dict(zip(ns, [0.01, 0.05, 0.6])))
    rows += _graph_rows("naive", dict(zip(ns, [0.9, 1.2, 15.0])), dict(zip(ns, [0.02, 0.4, 14.8])))
    f = fo.facts(pd.DataFrame(rows))
    assert f["timing"] == "graph"
    assert f["graph_speedup"] == pytest.approx(14.8 / 0.6)
    assert f["graph_ms"]["flash_triton"] == 0.6 and f["eager_ms"]["naive"] == 15.0
    assert f["dominated_up_to"] == {"flash_triton": 16384, "naive": 2048}
    assert f["overhead_ms"]["flash_triton"] == pytest.approx((0.99 + 1.05) / 2)
    assert math.isnan(f.get("floor_ms", math.nan))  # no sweep rows in this frame
    table = fo.overhead_table(pd.DataFrame(rows))
    assert list(table.columns) == [
        "N",
        "flash_triton eager",
        "flash_triton graph",
        "naive eager",
        "naive graph",
    ]
    assert table.set_index("N").loc[16384, "naive graph"] == "14.8" and len(table.attrs["rows"]) == 12
    committed = load_results("flash_benchmarking", DATA)
    assert fo.overhead_table(committed[committed.metric == "latency"]).empty  # the sweep alone: no table


def test_plot_with_and_without_graph_rows(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    ns = [128, 16384]
    fig = fo.plot_overhead(
        pd.DataFrame(_graph_rows("flash_triton", dict(zip(ns, [1.0, 1.5])), dict(zip(ns, [0.01, 0.6]))))
    )
    labels = fig.axes[0].get_legend_handles_labels()[1]
    assert "flash_triton (graph replay)" in labels and "flash_triton (eager)" in labels
    committed = load_results("flash_benchmarking", DATA)
    fig = fo.plot_overhead(
        committed[committed.metric == "latency"]
    )  # the sweep alone: eager vs the N^2 slope
    assert any("N^2" in lab for lab in fig.axes[0].get_legend_handles_labels()[1])


@pytest.mark.gpu
def test_graph_replay_removes_the_host_overhead_of_a_short_call(tmp_path):
    cfg = fo.OverheadConfig(
        seq_lens=(128,), head_dims=(64,), impls=("flash_triton", "sdpa_flash"), budget_s=None
    )
    fo.measure(cfg, results_dir=tmp_path)
    df = load_results(fo.PROBLEM, tmp_path)
    assert (df.note == "").all(), df[df.note != ""][["impl", "mode", "metric", "note"]]
    for (impl, mode), g in df.groupby(["impl", "mode"]):
        t = g.set_index("metric").p50
        assert t["graph_latency"] < t["eager_latency"], (impl, mode)  # a 128-token call is host-bound
    torch.cuda.empty_cache()


def test_facts_on_the_committed_graph_rows():
    """The committed GPU run (eager and graph rows of one process): the claim uses the graph times."""
    df = load_results("flash_benchmarking", DATA)
    f = fo.facts(df)
    assert f["timing"] == "graph"
    rows = df[(df.metric == "graph_latency") & (df.impl == "flash_triton") & (df["mode"] == "fwd_bwd")]
    rows = rows[(rows.dtype == "bfloat16") & (rows.name == "d64")]
    assert f["graph_ms"]["flash_triton"] in set(rows.p50)  # a committed graph timing, not the eager one
    assert f["graph_speedup"] == pytest.approx(f["graph_ms"]["naive"] / f["graph_ms"]["flash_triton"])
    assert (
        f["overhead_ms"]["flash_triton"] > f["overhead_ms"]["sdpa_flash"] > 0
    )  # our call costs the host more
    assert not fo.overhead_table(df).empty
