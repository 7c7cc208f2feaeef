"""All-reduce benchmark: formulas, the alpha-beta fit, and a real 2-rank gloo grid through torchrun."""

from __future__ import annotations

import json
import subprocess
import time

import numpy as np
import pytest
import torch

from cs336_systems.measure.results import load_results
from cs336_systems.studies.distributed import comm_bench


def test_bus_bandwidth_factor():
    assert comm_bench.bus_bandwidth_factor(1) == 0.0
    assert comm_bench.bus_bandwidth_factor(2) == 1.0
    assert comm_bench.bus_bandwidth_factor(4) == 1.5
    with pytest.raises(ValueError):
        comm_bench.bus_bandwidth_factor(0)


def test_fit_latency_bandwidth_recovers_the_model():
    sizes = np.array([1, 10, 100, 1024]) * 2**20
    o, w = 25e-6, 150e9
    times = o + sizes / w
    fo, fw = comm_bench.fit_latency_bandwidth(sizes, times * (1 + np.array([0.01, -0.01, 0.005, -0.005])))
    assert fo == pytest.approx(o, rel=0.2)
    assert fw == pytest.approx(w, rel=0.02)
    with pytest.raises(ValueError, match="distinct"):
        comm_bench.fit_latency_bandwidth([1, 1], [1.0, 2.0])
    with pytest.raises(ValueError, match="1/w"):
        comm_bench.fit_latency_bandwidth([1, 2, 3], [3.0, 2.0, 1.0])


def test_config_validation():
    with pytest.raises(ValueError, match="backend"):
        comm_bench.CommBenchConfig(backend="mpi")
    with pytest.raises(ValueError, match="sizes"):
        comm_bench.CommBenchConfig(sizes_mb=(0,))


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_gloo_grid_through_torchrun(tmp_path):
    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    config = comm_bench.GridConfig(
        gloo_procs=(2,), nccl_procs=(n_gpus + 1,), sizes_mb=(0.01, 0.1), warmup=1, max_iters=4, budget_s=0.2
    )
    rows = comm_bench.measure(config, results_dir=str(tmp_path), timeout_s=120)
    df = comm_bench.tidy(load_results(comm_bench.PROBLEM, tmp_path))
    assert len(rows) == len(df) and [r["metric"] for r in rows] == list(df.metric)
    gloo = df[df.backend == "gloo"]
    assert set(gloo.metric) == {"all_reduce_time", "algbw", "busbw"}
    assert (gloo.note == "").all() and (gloo.world_size == 2).all()
    assert sorted(gloo.x_value.unique()) == [0.01, 0.1]
    for _, g in gloo.groupby("x_value"):
        t = g[g.metric == "all_reduce_time"].iloc[0]
        bw = g[g.metric == "algbw"].iloc[0]
        nbytes = json.loads(t.config_json)["size_bytes"]
        samples_ms = json.loads(t.samples)
        assert 1 <= len(samples_ms) <= 4 and t.p50 > 0
        assert bw.p50 == pytest.approx(np.median([nbytes / (s / 1e3) / 1e9 for s in samples_ms]), rel=1e-3)
        assert len(json.loads(t.config_json)["per_rank_mean_ms"]) == 2
    nccl = df[df.backend == "nccl"]  # more GPUs than visible: failure rows, not a crash
    assert len(nccl) == 6 and nccl.note.str.contains("not run").all() and nccl.p50.isna().all()


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_timed_out_job_leaves_no_workers(tmp_path):
    """A job over its time limit becomes failure rows and its ranks are killed, not orphaned."""
    config = comm_bench.GridConfig(
        gloo_procs=(2,), nccl_procs=(), sizes_mb=(200,), warmup=1, max_iters=500, budget_s=123.25
    )
    comm_bench.measure(config, results_dir=str(tmp_path), timeout_s=8)
    df = load_results(comm_bench.PROBLEM, tmp_path)
    assert len(df) == 3 and df.note.str.contains("timed out").all()
    time.sleep(0.5)
    running = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert "--budget-s 123.25" not in running
