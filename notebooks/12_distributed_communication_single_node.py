# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # distributed_communication_single_node (2025 §2.1)
# All-reduce of float32 tensors of 1 MB, 10 MB, 100 MB and 1 GB on one node, Gloo on CPU and NCCL on
# GPUs, 2, 4 and 6 processes: how do backend, tensor size and number of processes interact?

# %% tags=["parameters"]
measure = "auto"  # "auto": measure when 2 GPUs are present, else render the committed results
quick = False  # gloo only, 2 processes, tiny tensors; results go to a scratch dir
gloo_procs = [2, 4, 6]
sizes_mb = [1, 10, 100, 1024]
gloo_max_mb = 1024  # largest gloo tensor (CPU memory and time)

# %% tags=["remove-input"]
import pandas as pd

from cs336_systems.report import load_results, nb, save_figure, show_table
from cs336_systems.studies.distributed import comm_bench
from cs336_systems.studies.distributed.plots import plot_all_reduce

results_dir = nb.setup(quick)
if nb.should_measure(measure, gpus=2, quick=quick):
    if quick:
        comm_bench.measure(
            comm_bench.GridConfig(
                gloo_procs=(2,), nccl_procs=(), sizes_mb=(0.01, 0.1), warmup=1, max_iters=3, budget_s=0.2
            ),
            results_dir=results_dir,
        )
    else:
        comm_bench.measure(
            comm_bench.GridConfig(
                gloo_procs=tuple(gloo_procs), sizes_mb=tuple(sizes_mb), gloo_max_mb=gloo_max_mb
            ),
            results_dir=results_dir,
        )
df = load_results(comm_bench.PROBLEM, results_dir)
facts = comm_bench.facts(df)

# %% tags=["remove-input"]
if nb.have_results(df, comm_bench.PROBLEM):
    big, nccl_worlds = facts["big_mb"], facts["nccl_worlds"]
    parts = [
        f"**Answer.** At {big:g} MB, Gloo on CPU reaches a bus bandwidth of "
        + ", ".join(f"{bw:.2f} GB/s with {w} processes" for w, bw in facts["gloo_busbw_big"].items())
        + "."
    ]
    if nccl_worlds:
        other = (
            ""
            if facts["same_machine"] or not facts["gloo_run"]
            else f" (Gloo ran on the CPUs of another machine: {facts['gloo_run']})"
        )
        parts.append(
            f"NCCL on {facts['nccl_world']} GPUs reaches {facts['nccl_busbw_big']:.0f} GB/s at {big:g} MB, "
            f"{facts['nccl_over_gloo_big']:.0f}x Gloo with the same number of processes, and "
            f"a {facts['small_mb']:g} MB all-reduce takes {facts['nccl_small_ms']:.3f} ms vs "
            f"{facts['gloo_small_ms']:.3f} ms with Gloo{other}."
        )
    if "latency" in facts:
        lat = facts["latency"]
        a, b, ta, tb = lat["small_mb"], lat["next_mb"], lat["small_ms"], lat["next_ms"]
        parts.append(
            f"Small tensors are latency-bound: with {lat['impl']} x{lat['world']}, going from {a:g} MB to {b:g} MB "
            f"({b / a:.0f}x the data) changes the time from {ta:.3f} to {tb:.3f} ms ({tb / ta:.1f}x), so the "
            f"achieved bandwidth is far below the link's and grows with size until the transfer dominates."
        )
    if "gloo_lo" in facts:
        lo, hi = facts["gloo_lo"], facts["gloo_hi"]
        parts.append(
            f"More processes cost more: at {big:g} MB a Gloo all-reduce takes {lo['big_ms']:.1f} ms "
            f"with {lo['world']} processes and {hi['big_ms']:.1f} ms with {hi['world']}, although the bytes each "
            f"rank moves only grow from {lo['ring_factor']:.2f}x to {hi['ring_factor']:.2f}x the tensor: a ring "
            f"all-reduce has 2(n-1) steps, each with its own latency."
        )
    if "nccl_lo" in facts:
        lo, hi = facts["nccl_lo"], facts["nccl_hi"]
        where = (
            f"On one machine ({facts['nccl_run']}; both counts from one run)"
            if facts["nccl_run"]
            else f"Across runs ({'; '.join(facts['runs']['nccl/cuda'])})"
        )
        parts.append(
            f"{where}, NCCL with {hi['world']} GPUs takes {hi['big_ms']:.2f} ms for {big:g} MB against "
            f"{lo['big_ms']:.2f} ms with {lo['world']} ({hi['big_ms'] / lo['big_ms']:.2f}x, while each rank's "
            f"bytes grow {hi['ring_factor'] / lo['ring_factor']:.2f}x), a bus bandwidth of "
            f"{hi['busbw_big']:.0f} vs {lo['busbw_big']:.0f} GB/s; at {facts['small_mb']:g} MB it takes "
            f"{hi['small_ms']:.3f} vs {lo['small_ms']:.3f} ms ({hi['small_ms'] / lo['small_ms']:.1f}x), "
            f"{2 * (hi['world'] - 1)} ring steps instead of {2 * (lo['world'] - 1)}."
        )
    parts.append(
        "NCCL reduces in GPU kernels over the GPUs' interconnect, while Gloo goes through host memory and TCP "
        "sockets: the backend matters most for large tensors."
    )
    if not nccl_worlds:
        parts.append("There are no NCCL rows here (no GPU run).")
    elif facts["nccl_not_run"]:
        parts.append(
            f"**NCCL with {' and '.join(map(str, facts['nccl_not_run']))} GPUs was not measured:** NCCL needs one "
            f"GPU per process, the largest machine it ran on had {facts['nccl_max_gpus']} GPUs (the rows' "
            "num_gpus), and machines with more (8 GPUs) were withheld from this project."
        )
    if facts["missing"]:
        parts.append("Not measured: " + "; ".join(facts["missing"]) + ".")
    nb.md(" ".join(parts))

# %% tags=["remove-input"]
if nb.have_results(df, comm_bench.PROBLEM):
    both = pd.concat(
        {
            "time (ms)": comm_bench.summary_table(df),
            "bus bandwidth (GB/s)": comm_bench.summary_table(df, "busbw"),
        },
        names=["quantity"],
    )
    show_table(
        both.reset_index(),
        caption="All-reduce of float32 tensors (MB = 2^20 bytes): median time and bus bandwidth",
        provenance_from=comm_bench.latest_rows(df),
        note="bus bandwidth = size / time x 2(n-1)/n, the bytes a rank moves in a ring all-reduce. "
        + comm_bench.runs_note(facts),
    )
    save_figure(plot_all_reduce(df), f"{comm_bench.PROBLEM}__all_reduce")

# %% [markdown] tags=["appendix"]
# **Setup.** `python -m cs336_systems.studies.distributed.comm_bench --grid`: one `torchrun` job per backend
# and process count; 5 warm-up all-reduces, then per call a barrier, `torch.cuda.synchronize()`, the timed
# SUM all-reduce and another synchronize (3 to 20 calls within 10 s per size); a call's time is the slowest
# rank's. Gloo runs on the CPU cores of the GPU host, NCCL with one process per GPU. The table and figure
# show one run per backend and process count (`comm_bench.latest_rows`): the latest run of the largest count
# supplies every count it measured, so the counts compare on one machine; older runs are named under the table.
