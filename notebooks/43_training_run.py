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
# # training_run (beyond the handouts)
# Training for real with `python -m cs336_systems.train` (the run: `python -m cs336_systems.train.gpu_demo`, the
# entry point's default GPU step; a small run killed and resumed from its checkpoint), and the 8B leaderboard step
# on 1 to 64 GPUs, estimated and checked against the committed one-, two- and four-GPU measurements.

# %% tags=["parameters"]
measure = "auto"  # "auto": run the GPU demo when a GPU is present, else render the committed run
quick = False  # the debug preset for 40 steps on the CPU; results go to a scratch dir
gpus_per_node = 8
inter_node_gb_per_s = 50.0  # per GPU across nodes: one 400 Gb/s NIC per GPU (DGX H100 style)
intra_step_latency_s = 5e-6  # per ring step inside a node
inter_step_latency_s = 15e-6  # per ring step across nodes
comm_bytes_per_param = 2.0  # bf16 weights and gradients, the leaderboard's headline mode
world_sizes = [1, 2, 4, 8, 16, 32, 64]

# %% tags=["remove-input"]
from cs336_systems.report import nb, save_figure, show_table
from cs336_systems.studies.training import train_run, train_scaling

results_dir = nb.setup(quick)
if quick:
    train_run.measure_quick(results_dir)
elif nb.should_measure(measure, gpus=1, quick=quick):
    train_run.measure(results_dir)
run = train_run.load_run(results_dir)
# the reference rows are read, never written: the committed ones in every mode
step_rows = train_run.committed_rows("training_step")
run_facts = train_run.facts(run, step_rows)
size = run_facts["throughput_size"]


def _and(items):
    items = list(items)
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


# %% tags=["remove-input"]
if size is None:
    nb.md("**Run.** No run folder with a throughput run: nothing to show.")
else:
    r = run_facts["runs"][size]
    bench = (
        f" The training-step comparison for the same configuration ({size}, batch {r['batch']}, context "
        f"{r['context']}; one run on {r['bench_ours_device']}, git {r['bench_git']}, ours with "
        f"{r['bench_attention']} attention) times the step alone at {r['bench_ours_ms']:.0f} ms (ours) and "
        f"{r['bench_stock_ms']:.0f} ms (stock PyTorch): the run's loop iteration is {r['ratio_to_ours']:.2f}x ours "
        f"and {r['ratio_to_stock']:.2f}x stock"
        + (
            f" (a different GPU: {run_facts['device']} here; the demo also times the batch fetch and one host "
            "sync per step)."
            if not r["same_device"]
            else " (the demo also times the batch fetch and one host sync per step)."
        )
        if "bench_ours_ms" in r
        else " No training-step rows exist for this configuration."
    )
    two = train_run.two_gpu_table()
    two_text = (
        f" On {two.attrs['device'] or 'two GPUs'} (torchrun, git {two.attrs['git']}, global batch 8; table in the "
        "notebook) a step took "
        + _and(
            [
                f"{t['step ms']:.0f} ms with --parallel {t.parallel} ({t['tokens/s']:,.0f} tokens/s)"
                for _, t in two.iterrows()
            ]
        )
        + "."
        if len(two)
        else ""
    )
    resume = run_facts["resume"]
    resume_text = (
        f" The checkpoint run was killed by SIGKILL at step 50 (exit {resume['killed_exit']}), restarted, "
        + ("resumed from its step-40 checkpoint" if resume["resumed_from_step_40"] else "did not resume")
        + f" and finished with exit {resume['resumed_exit']}."
        if resume
        else ""
    )
    nb.md(
        f"""**Run** ({run_facts["device"]}, torch {run_facts["torch"]}). {size}, {r["steps"]} steps, batch
{r["batch"]} x context {r["context"]}: the loss fell from {r["first_loss"]:.2f} to {r["last_loss"]:.2f} nats
(lowest {r["min_loss"]:.2f}); the first step, which compiles, took {r["first_step_s"]:.1f} s. After the first
{train_run.SKIP_STEPS} steps the median step took {r["step_ms"]:.0f} ms: {r["tokens_per_s"]:,.0f} tokens/s and
an MFU of {r["mfu_logged"]:.1%} as logged (full T x T attention counted), {r["mfu_causal"]:.1%} with causal
attention halved (the convention of the benchmark rows).{bench}{resume_text}{two_text}"""
    )

# %% tags=["remove-input"]
if size is not None:
    save_figure(train_run.plot_run(run, size, run_facts["device"]), "training_run__loss_throughput")


# %% tags=["remove-input", "remove-cell"]
two = train_run.two_gpu_table()
if nb.have_results(two, "the two-GPU runs"):
    show_table(
        two,
        caption="The entry point on two GPUs (torchrun, NCCL; global batch 8, context 512): medians after "
        f"{train_run.SKIP_STEPS} steps",
        formats={"step ms": "{:.0f}", "tokens/s": "{:,.0f}", "MFU (logged)": "{:.1%}", "last loss": "{:.3f}"},
        provenance_from="; ".join(two.attrs["provenance"][2:]),
        note=two.attrs["provenance"][0],
    )

# %% [markdown]
# ## Scaling the 8B step
# Weak scaling, one 32768-token sequence per GPU (model and caveats: `studies/training/train_scaling.py`).
# Compute: the step's model FLOPs plus the recomputed blocks at our one-GPU rate. Communication: ring times of
# the bf16 model's sharded collectives at the measured NCCL bus bandwidth inside a node and the stated bandwidth
# across nodes, for ZeRO-2 (ours: reduce-scatter + all-gather), FSDP (all-gather twice + reduce-scatter) and
# the hybrid (ZeRO-2 inside a node, an all-reduce of each GPU's 1/8 shard across nodes).

# %% tags=["remove-input"]
assume = train_scaling.Assumptions(
    gpus_per_node=gpus_per_node,
    inter_node_gb_per_s=inter_node_gb_per_s,
    intra_step_latency_s=intra_step_latency_s,
    inter_step_latency_s=inter_step_latency_s,
    comm_bytes_per_param=comm_bytes_per_param,
)
lb_rows = train_run.committed_rows("training_leaderboard")
comm_rows = train_run.committed_rows("distributed_communication_single_node")
table, inputs = train_scaling.estimate(lb_rows, comm_rows, assume, tuple(world_sizes))
checked = train_scaling.check(table, lb_rows)
scale = train_scaling.facts(table, checked, inputs, assume)

# %% tags=["remove-input", "remove-cell"]
show_table(
    table[table.GPUs.isin([1, 2, 8, 16, 64])]
    .drop(columns=["ideal_compute_s", "efficiency_serial"])
    .reset_index(drop=True),
    caption="8B step per GPU count and strategy (estimate; s per step, one sequence per GPU)",
    formats={c: "{:.3f}" for c in ("compute_s", "comm_s", "step_overlap_s", "step_serial_s")}
    | {"tokens_per_s": "{:,.0f}", "efficiency": "{:.1%}", "recomputed_blocks": "{:.0f}"},
    provenance_from="computed: cs336_systems.studies.training.train_scaling from the committed rows",
    note=f"compute at {inputs['rate_source']}; intra-node bandwidth: {inputs['w_intra_source']}",
)

# %% tags=["remove-input"]
checks = {c["GPUs"]: c for c in scale["checks"]}
gpus = sorted({c["gpu"] for c in checks.values()})
multi = {n: c for n, c in checks.items() if n > 1}
check_text = (
    f" Checked against the committed runs on {', '.join(gpus)} (table below): the estimate is "
    + _and([f"{c['ratio']:.3f}x" for c in multi.values()])
    + " the measured "
    + "- and ".join(map(str, multi))
    + "-GPU steps ("
    + _and([f"{c['serial_ratio']:.3f}x" for c in multi.values()])
    + " with communication serialised)."
    if multi
    else ""
)
how = ""
if 1 in checks and multi:
    atts = {c["attention"] for c in multi.values()}
    other = any(
        (c["git"], c["attention"]) != (checks[1]["git"], checks[1]["attention"]) for c in multi.values()
    )
    how = (
        " Those are the latest runs of ours "
        + (
            "with our own FlashAttention (flash_triton)"
            if atts == {train_scaling.OWN_ATTENTION}
            else f"({', '.join(sorted(atts))} attention)"
        )
        + f"; the calibration point (ratio 1 by construction) is the latest one-GPU run of ours, with "
        f"{checks[1]['attention']} attention"
        + (
            (" (another commit and attention)" if other else "")
            + ": above 1, those steps compute faster than the one-GPU rate predicts."
            if all(c["ratio"] > 1 for c in multi.values())
            else "."
        )
    )
if "multi" in scale:
    m = scale["multi"]
    zero2 = table[table.strategy == "zero2"].set_index("GPUs")
    lo, hi = zero2.loc[m["lo"]], zero2.loc[m["hi"]]
    why = (
        f", all of it from recomputing {hi.recomputed_blocks:.0f} instead of {lo.recomputed_blocks:.0f} blocks"
        if lo.comm_s < lo.compute_s
        and hi.comm_s < hi.compute_s
        and lo.recomputed_blocks != hi.recomputed_blocks
        else ""
    )
    how += (
        f" From {m['lo']} to {m['hi']} GPUs (one commit, {m['attention']} attention) the measured step changes by "
        f"{m['measured_change']:+.1%} and the estimate by {m['estimate_change']:+.1%}{why}; the measured {m['hi']}- and "
        f"{m['lo']}-GPU steps are means of only {checks[m['hi']]['n']} and {checks[m['lo']]['n']} timed steps ({checks[m['hi']]['rep_s']:.0f} "
        f"and {checks[m['lo']]['rep_s']:.0f} s budgets)."
    )
ideal = [c["ideal_ratio"] for c in checks.values()]
ideal_text = (
    f" At the datasheet peak the compute would take {min(ideal):.2f} to {max(ideal):.2f} of the measured steps "
    "(ideal)."
    if ideal
    else ""
)
n_most = max(checks, default=1)
nb.md(
    f"""**Answer.** The 8B model has {scale["params_b"]:.2f} B parameters, {scale["size_gb"]:.1f} GB in bf16; one
GPU's step needs {scale["compute_s"]:.2f} s of compute at the {scale["rate_tflops"]:.0f} TFLOP/s ours achieved on one
GPU. Against that, the sharded collectives are small: at {scale["n_max"]} GPUs on {scale["nodes_max"]} nodes, with
{inter_node_gb_per_s:.0f} GB/s per GPU between nodes and {scale["w_intra_gb_s"]:.0f} GB/s inside a node, one step's
communication is {scale["zero2_comm_s"]:.2f} s for ZeRO-2, {scale["fsdp_comm_s"]:.2f} s for FSDP and
{scale["hybrid_comm_s"]:.2f} s for the hybrid. Overlapped with backward (as ours does), every strategy stays
compute-bound up to {scale["n_max"]} GPUs (efficiency {scale["zero2_eff"]:.0%}: {scale["zero2_tokens_per_s"]:,.0f}
tokens/s in all); serialised, the efficiency at {scale["n_max"]} GPUs would be {scale["zero2_eff_serial"]:.0%} (ZeRO-2),
{scale["fsdp_eff_serial"]:.0%} (FSDP) and {scale["hybrid_eff_serial"]:.0%} (hybrid), which is where the hybrid pays: it
sends only 1/{gpus_per_node} of the gradients across nodes. Flat FSDP at {scale["n_max"]} GPUs becomes
communication-bound only below {scale["fsdp_breakeven_gb_s"]:.1f} GB/s per GPU between nodes.{check_text}{how}{ideal_text}
Not measured: more than {n_most} GPUs or more than one node (8-GPU machines and several nodes were not lent)."""
)

# %% tags=["remove-input"]
save_figure(train_scaling.plot_scaling(table, checked, assume), "training_run__scaling_8b")

# %% tags=["remove-input"]
CHECK_COLUMNS = {
    "measured_ms": "measured",
    "estimate_ms": "estimate",
    "serial_ratio": "serial",
    "ideal_ratio": "ideal",
    "comm_estimate_ms": "comm est.",
    "comm_exposed_measured_ms": "exposed",
}
if len(checked):
    show_table(
        checked.drop(columns=["gpu", "rep_s"]).rename(columns=CHECK_COLUMNS),
        caption="Estimate against the committed 8B measurements of ours (ms; mode bf16, do_bench mean)",
        formats={c: "{:.0f}" for c in ("measured", "estimate", "comm est.", "exposed")}
        | {c: "{:.3f}" for c in ("ratio", "serial", "ideal")},
        provenance_from=lb_rows[lb_rows.timestamp.isin(train_scaling.measured(lb_rows).timestamp)],
        note="ratio: estimate (overlapped) / measured; serial: communication not overlapped; ideal: compute at "
        "the datasheet bf16 peak; comm est.: estimated communication; exposed: measured communication not under "
        "compute; n: timed steps (do_bench); attention: the run's attention kernels",
    )
