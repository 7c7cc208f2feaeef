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
# # optimizer_state_sharding_accounting (2025 §3)
# XL model, 2 GPUs: (a) peak memory with and without optimizer-state sharding after initialisation,
# directly before and after the optimizer step, broken down into parameters, gradients, optimizer state
# and activations: does it match expectations? (b) How does sharding change the time per iteration?
# (c) How does our approach differ from ZeRO stage 1 (Rajbhandari et al. 2020) in memory and in
# communication volume?

# %% tags=["parameters"]
measure = "auto"  # "auto": measure when 2 GPUs are present, else render the committed results
quick = False  # debug model, gloo on CPU, 2 ranks, 2 steps; results go to a scratch dir

# %% tags=["remove-input"]
import math

from cs336_systems.report import load_results, nb, save_figure, show_table
from cs336_systems.studies.distributed import sharding_bench, sharding_facts

results_dir = nb.setup(quick)
if nb.should_measure(measure, gpus=2, quick=quick):
    config = sharding_bench.BenchConfig(**(sharding_bench.QUICK if quick else {}))
    sharding_bench.measure(config, nproc=2, results_dir=results_dir)
df = sharding_facts.latest(load_results(sharding_bench.PROBLEM, results_dir))


def gib(x):
    return "n/a" if math.isnan(x) else f"{x:.2f}"


# %% tags=["remove-input"]
if nb.have_results(df, sharding_bench.PROBLEM):
    facts = sharding_facts.facts(df)
    nb.md(
        f"**Answer.** **(a)** After initialisation every variant holds only the weights: "
        f"{gib(facts['unsharded_allocated_after_init'])} GiB allocated, of which {gib(facts['unsharded_params_after_init'])} GiB "
        f"parameters (4 bytes x {facts['num_params_b']:.2f}B = {gib(facts['unsharded_expected_params_after_init'])} GiB); "
        f"AdamW has no state yet. Right before a steady-state step the unsharded rank holds "
        f"{gib(facts['unsharded_params_steady:before_step'])} GiB parameters + {gib(facts['unsharded_grads_steady:before_step'])} GiB "
        f"gradients + {gib(facts['unsharded_state_r0'])} GiB AdamW m and v + {gib(facts['unsharded_other_steady:before_step'])} GiB other = "
        f"{gib(facts['unsharded_allocated_steady:before_step'])} GiB; forward and backward peaked at "
        f"{gib(facts['unsharded_peak_steady:before_step'])} GiB, "
        f"{gib(facts['unsharded_activations_peak_steady:before_step'])} GiB above the iteration's start (whose "
        "gradients were freed): the saved activations plus the gradients and temporaries alive at that peak, the "
        f"same in every variant. With our sharded optimizer the state is {gib(facts['sharded_state_r0'])} GiB on rank 0 and "
        f"{gib(facts['sharded_state_r1'])} GiB on rank 1 (expected from the whole-tensor partition: {gib(facts['sharded_expected_state_r0'])} / {gib(facts['sharded_expected_state_r1'])}; "
        f"an exact half would be {gib(facts['exact_half_state'])}), so rank 0 allocates "
        f"{gib(facts['sharded_allocated_steady:before_step'])} GiB before the step, "
        f"{gib(facts['sharded_saving_steady'])} GiB less; "
        f"PyTorch's ZeroRedundancyOptimizer lands at {gib(facts['torch_zero_state_r0'])} / {gib(facts['torch_zero_state_r1'])} GiB of state. Directly after "
        f"the step the totals equal those before it (the state persists; in the first iteration it appears during "
        f"the step: {gib(facts['unsharded_first_step_growth'])} GiB "
        f"unsharded vs {gib(facts['sharded_first_step_growth'])} GiB "
        f"sharded). Every measured component equals its expectation to within {gib(facts['worst_error_gib'])} GiB: parameters and "
        f"gradients are 4 bytes per parameter, AdamW's state 8 bytes per owned parameter, and only the "
        f"optimizer state shrinks, by the fraction of parameters the rank does not own."
    )

# %% tags=["remove-input"]
if nb.have_results(df[df.unit == "ms"], "the step timings"):
    facts = sharding_facts.facts(df)
    nb.md(
        f"**(b)** An iteration takes {gib(facts['unsharded_step_ms'])} ms unsharded, {gib(facts['sharded_step_ms'])} ms with our sharded optimizer "
        f"({facts['sharded_step_change_pct']:+.1f} %) and {gib(facts['torch_zero_step_ms'])} ms with ZeroRedundancyOptimizer "
        f"({facts['torch_zero_step_change_pct']:+.1f} %). Forward, backward and the gradient all-reduce are the same code in "
        f"all three; the difference is the optimizer phase: {gib(facts['unsharded_optimizer_ms'])} ms for AdamW over all parameters, "
        f"{gib(facts['sharded_optimizer_ms'])} ms for AdamW over about half of them plus the broadcast of every updated parameter from its "
        f"owner ({gib(facts['torch_zero_optimizer_ms'])} ms for PyTorch's version). Sharding therefore "
        f"{'adds' if facts['sharded_step_diff_ms'] > 0 else 'saves'} {gib(abs(facts['sharded_step_diff_ms']))} ms per iteration: the local update is "
        f"shorter but the broadcast of the updated parameters is new, and it sits on the critical path after "
        f"the step; the point of sharding is the memory of (a), not speed."
    )

# %% tags=["remove-input"]
zero1 = sharding_facts.zero1_facts("xl", 2)
nb.md(
    f"**(c)** In memory the two are the same scheme: both keep full fp32 parameters and gradients on every rank "
    f"and divide only the optimizer state by $N$ ({zero1['ours_state_gib']:.1f} vs {zero1['dp_state_gib']:.1f} GiB of "
    f"model state for XL on 2 GPUs). The differences are granularity (ZeRO partitions one flat buffer at element "
    f"granularity, so every rank gets exactly $\\Psi/N$; we assign whole tensors, which leaves the imbalance seen in "
    f"(a)) and communication: ZeRO-1 sends {zero1['zero1_sent_gb']:.1f} GB per device per step (reduce-scatter "
    f"of gradients + all-gather of parameters, $2\\Psi$ like plain DP) while ours sends "
    f"{zero1['ours_sent_gb']:.1f} GB (all-reduce + broadcasts, $3\\Psi$), "
    f"{zero1['sent_ratio']:.1f}x as much. ZeRO also overlaps its collectives "
    f"with computation and lets stage 2 free the gradient memory its reduce-scatter makes redundant; our "
    f"broadcasts run after the step, on the critical path."
)

# %% tags=["remove-input"]
if nb.have_results(df, sharding_bench.PROBLEM):
    steady = sharding_facts.memory_table(df, rank=0).xs("steady:before_step", level="mode")
    cols = ["params", "grads", "optimizer_state", "allocated", "peak", "activations_peak"]
    times = sharding_facts.time_table(df)
    times = times[[c for c in ("step_time",) if c in times]]
    show_table(
        steady[[c for c in cols if c in steady]]
        .rename(columns={"activations_peak": "peak - start", "optimizer_state": "opt. state"})
        .join(times.rename(columns={"step_time": "step ms"}))
        .rename_axis("rank 0, steady state")
        .reset_index(),
        caption="(a), (b) GiB allocated on rank 0 right before a steady-state optimizer step, by component; the peak of "
        "that iteration and its rise above the iteration's start; ms per iteration (slowest rank)",
        provenance_from=df,
    )
    save_figure(
        sharding_facts.plot_memory_breakdown(
            df, points=("after_init", "steady:before_step", "steady:after_step")
        ),
        f"{sharding_bench.PROBLEM}__memory",
    )

# %% [markdown] tags=["appendix"]
# **(c), the volumes.** Per device for fp32 parameters and gradients and AdamW ($\Psi$ parameters, $N$
# devices, ring collectives): plain data parallelism all-reduces the gradients ($2\frac{N-1}{N}\Psi$ elements
# sent per device); ZeRO-1 reduce-scatters them and all-gathers the updated parameters, together the volume of
# one all-reduce; ours keeps the full gradient all-reduce and adds the parameter broadcasts, one more
# all-gather's worth.
#
# **Setup.** `python -m cs336_systems.studies.distributed.sharding_bench`: 2025 XL in fp32 with the
# project's AdamW (lr 1e-4, weight decay 0.01) on 2 GPUs, 4 sequences of 512 tokens per GPU, naive
# attention; gradients averaged by the same bucketed flat all-reduce in every variant, so only the
# optimizer differs: AdamW (`unsharded`), our `ShardedOptimizer(AdamW)`, PyTorch's
# `ZeroRedundancyOptimizer(AdamW)`. Memory is `torch.cuda.memory_allocated` per rank; the components are the
# summed storages of parameters, gradients and optimizer state; "other" is the rest.

# %% tags=["remove-input", "remove-cell"]
show_table(
    sharding_facts.zero1_comparison("xl", 2).reset_index(),
    caption="optimizer_state_sharding_accounting (c): model-state memory and data sent per device per step, XL on "
    "2 GPUs (computed)",
    provenance_from="computed by sharding_facts.zero1_comparison (cs336_systems.accounting)",
)
