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
# # 2.1 distributed_communication_single_node
# Benchmark the all-reduce of float32 tensors of 1 MB, 10 MB, 100 MB and 1 GB on one node, with Gloo on
# CPU and NCCL on GPUs, for 2, 4 and 6 processes; plot or tabulate the results and comment in 2-3
# sentences on how backend, tensor size and number of processes interact.
#
# **Setup.** `python -m cs336_systems.studies.distributed.comm_bench --grid` (module docstring): one `torchrun`
# job per backend and process count; 5 warm-up all-reduces, then a barrier, `torch.cuda.synchronize()`,
# the timed SUM all-reduce and another synchronize, repeated (at least 3, at most 20 times, within a
# 10 s budget per size). Per-rank times are gathered with `all_gather_object`; a call's time is the
# slowest rank's. MB = 2^20 bytes, so "1 GB" is 1024 MB; bandwidths in GB/s = 1e9 bytes/s. Bus
# bandwidth = size / time x 2(n-1)/n, the bytes each rank moves in a ring all-reduce, which makes
# different process counts comparable. Gloo runs on the CPU cores of the GPU host; NCCL uses one
# process per GPU, and only as many GPUs as were lent (2): the 4- and 6-GPU NCCL runs could not be made.

# %% tags=["parameters"]
measure = "auto"  # "auto": measure when 2 GPUs are present, else render the committed results
quick = False  # gloo only, 2 processes, tiny tensors; results go to a scratch dir
gloo_procs = [2, 4, 6]
sizes_mb = [1, 10, 100, 1024]
gloo_max_mb = 1024  # largest gloo tensor (CPU memory and time)

# %% tags=["remove-input"]
from cs336_systems.report import load_results, nb, save_figure, show_table
from cs336_systems.studies.distributed import comm_bench
from cs336_systems.studies.distributed.plots import plot_all_reduce

results_dir = nb.setup(quick)
if nb.should_measure(measure, gpus=2, quick=quick):
    if quick:
        comm_bench.run_grid(
            gloo_procs=[2],
            nccl_procs=[],
            sizes_mb=[0.01, 0.1],
            warmup=1,
            max_iters=3,
            budget_s=0.2,
            results_dir=results_dir,
        )
    else:
        comm_bench.run_grid(
            gloo_procs=gloo_procs, sizes_mb=sizes_mb, gloo_max_mb=gloo_max_mb, results_dir=results_dir
        )
df = load_results(comm_bench.PROBLEM, results_dir)
t = comm_bench.tidy(df)

# %% tags=["remove-input"]
if nb.have_results(df, comm_bench.PROBLEM):
    save_figure(plot_all_reduce(df), f"{comm_bench.PROBLEM}__all_reduce")
    show_table(
        comm_bench.summary_table(df).reset_index(),
        caption="all-reduce time (ms, median over calls)",
        provenance_from=df,
    )
    show_table(
        comm_bench.summary_table(df, "busbw").reset_index(),
        caption="bus bandwidth (GB/s, median)",
        provenance_from=df,
    )

# %% tags=["remove-input"]
if nb.have_results(df, comm_bench.PROBLEM):
    ok = t[(t.note == "") & (t.metric == "busbw")]
    time_ok = t[(t.note == "") & (t.metric == "all_reduce_time")]

    def p50(impl, world, size, frame=ok):
        sel = frame[(frame.impl == impl) & (frame.world_size == world) & (frame.x_value == size)]
        return float(sel.sort_values("timestamp").p50.iloc[-1]) if len(sel) else float("nan")

    big, small = max(ok.x_value, default=float("nan")), min(ok.x_value, default=float("nan"))
    gloo_worlds = sorted(ok[ok.impl == "gloo/cpu"].world_size.unique())
    nccl_worlds = sorted(ok[ok.impl == "nccl/cuda"].world_size.unique())
    missing = t[(t.note != "") & (t.metric == "all_reduce_time")]
    parts = [
        f"**Answer.** At {big:g} MB, Gloo on CPU reaches a bus bandwidth of "
        + ", ".join(f"{p50('gloo/cpu', w, big):.2f} GB/s with {w} processes" for w in gloo_worlds)
        + "."
    ]
    if nccl_worlds:
        w = nccl_worlds[0]
        parts.append(
            f"NCCL on {w} GPUs reaches {p50('nccl/cuda', w, big):.0f} GB/s at {big:g} MB, "
            f"{p50('nccl/cuda', w, big) / p50('gloo/cpu', w, big):.0f}x Gloo with the same number of processes, and "
            f"a {small:g} MB all-reduce takes {p50('nccl/cuda', w, small, time_ok):.3f} ms vs "
            f"{p50('gloo/cpu', w, small, time_ok):.3f} ms with Gloo."
        )
    sizes = sorted(time_ok.x_value.unique())
    ref = "nccl/cuda" if nccl_worlds else "gloo/cpu"
    w0 = (nccl_worlds or gloo_worlds)[0]
    if len(sizes) >= 2:
        a, b = sizes[0], sizes[1]
        ta, tb = p50(ref, w0, a, time_ok), p50(ref, w0, b, time_ok)
        parts.append(
            f"Small tensors are latency-bound: with {ref} x{w0}, going from {a:g} MB to {b:g} MB ({b / a:.0f}x the "
            f"data) changes the time from {ta:.3f} to {tb:.3f} ms ({tb / ta:.1f}x), so the achieved bandwidth is far "
            f"below the link's and grows with size until the transfer dominates."
        )
    if len(gloo_worlds) >= 2:
        lo, hi = gloo_worlds[0], gloo_worlds[-1]
        parts.append(
            f"More processes cost more: at {big:g} MB a Gloo all-reduce takes {p50('gloo/cpu', lo, big, time_ok):.1f} ms "
            f"with {lo} processes and {p50('gloo/cpu', hi, big, time_ok):.1f} ms with {hi}, although the bytes each rank "
            f"moves only grow from {2 * (lo - 1) / lo:.2f}x to {2 * (hi - 1) / hi:.2f}x the tensor: a ring all-reduce "
            f"has 2(n-1) latency-bound steps, and the CPU ranks share the host's memory bandwidth."
        )
    parts.append(
        "NCCL moves data over NVLink between GPU memories with dedicated kernels, while Gloo copies through host "
        "memory and the TCP loopback, so the backend matters most for large tensors."
    )
    not_run = [n for n in (4, 6) if n not in nccl_worlds]
    if not nccl_worlds:
        parts.append("There are no NCCL rows here (no GPU run).")
    elif not_run:
        parts.append(
            f"NCCL with {' and '.join(map(str, not_run))} GPUs was not measured: the lent machines had "
            f"{max(nccl_worlds, default=0)} GPUs."
        )
    if len(missing):
        cases = sorted({f"{r.impl} x{r.world_size}: {r.note}" for r in missing.itertuples()})
        parts.append("Not measured: " + "; ".join(cases) + ".")
    nb.md(" ".join(parts))
