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
# # fsdp_accounting (2026 §7)
# (a) Building on the optimizer-state sharding analysis, how much peak memory should FSDP save
# (ignoring the pre-allocated all-gather buffers)? (b) Profile the xl model on two GPUs: do the weight
# all-gathers finish before the forward pass needs them?

# %% tags=["parameters"]
measure = "auto"  # "auto": measure when 2 GPUs are present, else render the committed results
quick = False  # debug model, gloo on CPU, 2 ranks, 2 steps; results go to a scratch dir

# %% tags=["remove-input"]
import math

from cs336_systems.report import load_results, nb, save_figure, show_table
from cs336_systems.studies.distributed import fsdp_bench, fsdp_facts, fsdp_parity, sharding_facts

results_dir = nb.setup(quick)
if nb.should_measure(measure, gpus=2, quick=quick):
    config = fsdp_bench.FsdpBenchConfig(**(fsdp_bench.QUICK if quick else {}))
    fsdp_bench.measure(config, nproc=2, results_dir=results_dir)
df = sharding_facts.latest(load_results(fsdp_bench.PROBLEM, results_dir))
size = df.name.iloc[0] if len(df) else "xl_2026"


def gib(x):
    return "n/a" if math.isnan(x) else f"{x:.2f}"


# %% tags=["remove-input"]
facts = fsdp_facts.facts(df, size, 2)
if not math.isnan(facts["measured_saving"]):
    nb.md(
        f"**Answer.** **(a)** Data parallelism keeps 16 bytes of training state per parameter on every rank (fp32 "
        "weight, gradient, AdamW m and v); FSDP shards all of it for the Linear and Embedding weights, so the state "
        f"of {size} ({facts['num_params_b']:.2f}B parameters) on 2 GPUs shrinks from {gib(facts['replicated_state'])} "
        f"to {gib(facts['fsdp_state'])} GiB, {gib(facts['expected_saving'])} GiB saved (optimizer-state sharding "
        f"alone: {gib(facts['optimizer_sharding_saving'])} GiB). **The peak saves less:** the peak of a steady fp32 "
        f"iteration is {gib(facts['replicated_peak'])} GiB replicated and {gib(facts['fsdp_peak'])} GiB with FSDP, "
        f"{gib(facts['measured_saving'])} GiB saved. The missing {gib(facts['shortfall'])} GiB is the gradient "
        f"saving the expectation counted ({gib(facts['expected_grads_saving'])} GiB): every step ends with `zero_grad(set_to_none=True)`, so no "
        "variant holds a full set of gradients at its peak, and what FSDP saves there is its parameters and "
        f"optimizer state, {gib(facts['expected_saving_at_peak'])} GiB expected. Measured at the start of an "
        f"iteration that saving is {gib(facts['measured_start_saving'])} GiB; what forward and backward then add up "
        f"to the peak is {gib(facts['replicated_rise_to_the_peak'])} GiB replicated and "
        f"{gib(facts['fsdp_rise_to_the_peak'])} GiB with FSDP (activations, the gradients and buffers alive at "
        f"the peak): FSDP's rise is {gib(facts['rise_difference'])} GiB larger, within the "
        f"{gib(facts['working_set_fp32'])} GiB its working set (gathered weights, gradients in flight) can reach. With bf16 compute the rise is "
        f"{gib(facts['fsdp_bf16_rise_to_the_peak'])} GiB, but that variant holds {gib(facts['fsdp_bf16_other'])} GiB "
        "outside its parameters, gradients and optimizer state from initialisation on (fp32 FSDP: "
        f"{gib(facts['fsdp_other'])} GiB), which the rows do not explain, so its peak is "
        f"{gib(facts['fsdp_bf16_peak'])} GiB."
    )
else:
    nb.md(
        f"**Answer.** **(a)** FSDP should save {gib(facts['expected_saving'])} GiB of training state per rank "
        "(not measured in this run: the allocator statistics need GPUs)."
    )

# %% tags=["remove-input"]
slack = fsdp_facts.slack_table(df)
if len(slack):
    nb.md(fsdp_facts.allgather_answer(df))

# %% tags=["remove-input"]
parts = fsdp_facts.peak_breakdown(df)
if nb.have_results(parts, fsdp_bench.PROBLEM):
    show_table(
        parts.reset_index(),
        caption=f"(a) The peak of a steady iteration on rank 0 (GiB), {size} on 2 GPUs: what was allocated at the "
        "iteration's start, and what forward and backward added up to the peak",
        provenance_from=df,
        note="start = allocated after the optimizer step minus the gradients, which zero_grad(set_to_none=True) frees",
        formats={c: "{:.2f}" for c in parts.columns},
    )
_ = fsdp_facts.render_figures(df, results_dir, show=("__timeline_fsdp",))

# %% [markdown] tags=["appendix"]
# **Setup.** `python -m cs336_systems.studies.distributed.fsdp_bench`: the 2026 xl model (the 2025 2.7B
# shape) on 2 GPUs, 2 sequences of 512 tokens per GPU, naive attention, the project's AdamW. Variants:
# `replicated` (whole model, gradients and AdamW state on every rank; gradients averaged by a bucketed
# all-reduce), `fsdp` (our `FSDP(model)`, fp32) and `fsdp_bf16` (`compute_dtype=torch.bfloat16`: weights
# cast to bf16 before the all-gather, fp32 masters, gradients and optimizer). Our FSDP shards every Linear
# and Embedding weight and replicates the RMSNorm gains; it gathers a layer's weight just before its forward,
# prefetching one layer ahead (a gather starts only after the layer two positions earlier has finished),
# frees it after use, gathers it again for backward and reduce-scatters its gradient. For (b), every wait on
# an all-gather in one profiled step (torch.profiler CUPTI trace on rank 0, drawn above; Nsight Systems is
# not installed) is compared with the moment the compute stream could have used the weight: *slack* =
# (compute stream free) - (all-gather done); negative slack is time the compute stream waited. Whether our
# FSDP is bit-exact in fp32 (against torch's FSDP2, DDP and one process): the end of this notebook, from
# `figures/data/fsdp_parity.csv`.

# %% [markdown] tags=["remove-cell"]
# **Is FSDP bit-exact in fp32?** `python -m cs336_systems.studies.distributed.fsdp_parity` trains the official
# toy model with SGD for 3 steps on 20 sequences split 10/10 over 2 ranks, with our FSDP, torch's FSDP2 and
# `DistributedDataParallel`, and compares every parameter with one process training on the whole batch, in
# fp32 ulps.

# %% tags=["remove-input", "remove-cell"]
if quick:
    fsdp_parity.measure(fsdp_parity.ParityConfig(device="cpu"), results_dir=results_dir)
elif nb.should_measure(measure, gpus=1):
    fsdp_parity.measure(fsdp_parity.ParityConfig(device="cuda"), results_dir=results_dir)
parity = load_results(fsdp_parity.PROBLEM, results_dir)
if nb.have_results(parity, "the fp32 parity runs"):
    nb.md(fsdp_parity.answer(parity))

# %% tags=["remove-input", "remove-cell"]
if len(parity):
    for table, caption, rows in fsdp_parity.tables(parity)[:1]:  # the first device's; the answer quotes all
        show_table(
            table,
            caption=f"fsdp_accounting: {caption}",
            provenance_from=rows,
            formats={"max |difference|": "{:.1e}"},
        )
