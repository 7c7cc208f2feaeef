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
# # 3 optimizer_state_sharding_accounting
# (2025 handout.) On one node with 2 GPUs and the XL model, (a) profile the peak memory with and without
# optimizer-state sharding after model initialization, directly before the optimizer step and directly
# after it; do the numbers match expectations, broken down into parameters, gradients, optimizer state
# and activations? (b) How does sharding change the time per training iteration? (c) How does our
# approach differ from ZeRO stage 1 (ZeRO-DP $P_{os}$, Rajbhandari et al. 2020), in memory and in
# communication volume?
#
# **Setup.** `python -m cs336_systems.studies.distributed.sharding_bench` (see its module docstring): the 2025
# XL model (d_model 1600, 48 layers, 2.0B parameters) in fp32 with the project's AdamW (lr 1e-4, weight
# decay 0.01), data parallel over 2 GPUs with 4 sequences of 512 tokens per GPU (global batch 8, the
# setting of our DDP benchmarks), naive attention. Gradients are averaged by the same bucketed flat
# all-reduce after backward in every variant, so only the optimizer differs: plain AdamW
# (`unsharded`), our `ShardedOptimizer(AdamW)`, and PyTorch's `ZeroRedundancyOptimizer(AdamW)`.
# Memory is `torch.cuda.memory_allocated` per rank at each point; the components are the summed
# storages of the parameters, their gradients and the optimizer's state tensors; "other" is the rest.
# "first" is the first iteration (AdamW creates its state lazily during that step), "steady" the last.

# %% tags=["parameters"]
measure = "auto"  # "auto": measure when 2 GPUs are present, else render the committed results
quick = False  # debug model, gloo on CPU, 2 ranks, 2 steps; results go to a scratch dir

# %% tags=["remove-input"]
import math

from cs336_systems.measure.results import load_results
from cs336_systems.model import get_config
from cs336_systems.report import nb, save_figure, show_table
from cs336_systems.studies.distributed import sharding_bench as B

results_dir = nb.setup(quick)
if nb.should_measure(measure, gpus=2, quick=quick):
    B.run(B.BenchConfig(**(B.QUICK if quick else {})), nproc=2, results_dir=results_dir)
df = B.latest(load_results(B.PROBLEM, results_dir))
v = lambda impl, metric, mode=None, rank=None: B.value(df, impl, metric, mode, rank)
g = lambda x: "n/a" if math.isnan(x) else f"{x:.2f}"
U, S, Z = B.IMPL["unsharded"], B.IMPL["sharded"], B.IMPL["torch_zero"]

# %% tags=["remove-input"]
if nb.have_results(df, B.PROBLEM):
    save_figure(B.plot_memory_breakdown(df), f"{B.PROBLEM}__memory")
    show_table(
        B.memory_table(df, rank=0).reset_index(),
        caption="GiB allocated on rank 0 at each point: measured components next to their expectation",
        provenance_from=df,
        note="peak = max allocated since the previous point; activations_peak = before_step peak minus "
        "allocated at the start of the iteration",
    )

# %% tags=["remove-input"]
if nb.have_results(df, B.PROBLEM):
    cfg = get_config(df.name.iloc[0])
    state = {
        impl: [v(impl, "optimizer_state", "steady:before_step", r) for r in (0, 1)] for impl in (U, S, Z)
    }
    exp = {
        impl: [v(impl, "expected_optimizer_state", "steady:before_step", r) for r in (0, 1)]
        for impl in (U, S, Z)
    }
    err = (df[df.metric.str.startswith("expected_")].assign(metric=lambda d: d.metric.str[9:])
           .merge(df, on=["impl", "mode", "x_value", "metric"], suffixes=("_e", "_m")))  # fmt: skip
    worst = (err.mean_m - err.mean_e).abs().max() if len(err) else math.nan
    nb.md(
        f"**(a)** After initialisation every variant holds only the weights: "
        f"{g(v(U, 'allocated', 'after_init', 0))} GiB allocated, of which {g(v(U, 'params', 'after_init', 0))} GiB "
        f"parameters (4 bytes x {cfg.num_params() / 1e9:.2f}B = {g(v(U, 'expected_params', 'after_init', 0))} GiB); "
        f"AdamW has no state yet. Right before a steady-state step the unsharded rank holds "
        f"{g(v(U, 'params', 'steady:before_step', 0))} GiB parameters + {g(v(U, 'grads', 'steady:before_step', 0))} GiB "
        f"gradients + {g(state[U][0])} GiB AdamW m and v + {g(v(U, 'other', 'steady:before_step', 0))} GiB other = "
        f"{g(v(U, 'allocated', 'steady:before_step', 0))} GiB; the forward and backward pass peaked at "
        f"{g(v(U, 'peak', 'steady:before_step', 0))} GiB, i.e. {g(v(U, 'activations_peak', 'steady:before_step', 0))} GiB "
        f"of activations on top. With our sharded optimizer the state is {g(state[S][0])} GiB on rank 0 and "
        f"{g(state[S][1])} GiB on rank 1 (expected from the whole-tensor partition: {g(exp[S][0])} / {g(exp[S][1])}; "
        f"an exact half would be {g(exp[U][0] / 2)}), so rank 0 allocates "
        f"{g(v(S, 'allocated', 'steady:before_step', 0))} GiB before the step, "
        f"{g(v(U, 'allocated', 'steady:before_step', 0) - v(S, 'allocated', 'steady:before_step', 0))} GiB less; "
        f"PyTorch's ZeroRedundancyOptimizer lands at {g(state[Z][0])} / {g(state[Z][1])} GiB of state. Directly after "
        f"the step the totals equal those before it (the state persists; in the first iteration it appears during "
        f"the step: {g(v(U, 'allocated', 'first:after_step', 0) - v(U, 'allocated', 'first:before_step', 0))} GiB "
        f"unsharded vs {g(v(S, 'allocated', 'first:after_step', 0) - v(S, 'allocated', 'first:before_step', 0))} GiB "
        f"sharded). Every measured component equals its expectation to within {g(worst)} GiB: parameters and "
        f"gradients are 4 bytes per parameter, AdamW's state 8 bytes per owned parameter, and only the "
        f"optimizer state shrinks, by the fraction of parameters the rank does not own."
    )

# %% tags=["remove-input"]
if nb.have_results(df[df.unit == "ms"], "the step timings"):
    save_figure(B.plot_step_time(df), f"{B.PROBLEM}__step_time")
    show_table(
        B.time_table(df).reset_index(),
        caption="ms per iteration (slowest rank), mean +- std",
        provenance_from=df,
    )
    t, o = {i: v(i, "step_time") for i in (U, S, Z)}, {i: v(i, "optimizer_time") for i in (U, S, Z)}
    nb.md(
        f"**(b)** An iteration takes {g(t[U])} ms unsharded, {g(t[S])} ms with our sharded optimizer "
        f"({(t[S] / t[U] - 1) * 100:+.1f} %) and {g(t[Z])} ms with ZeroRedundancyOptimizer "
        f"({(t[Z] / t[U] - 1) * 100:+.1f} %). Forward, backward and the gradient all-reduce are the same code in "
        f"all three; the difference is the optimizer phase: {g(o[U])} ms for AdamW over all parameters, "
        f"{g(o[S])} ms for AdamW over about half of them plus the broadcast of every updated parameter from its "
        f"owner ({g(o[Z])} ms for PyTorch's version). Sharding therefore "
        f"{'adds' if t[S] > t[U] else 'saves'} {g(abs(t[S] - t[U]))} ms per iteration: the local update is "
        f"shorter but the broadcast of the updated parameters is new, and it sits on the critical path after "
        f"the step; the point of sharding is the memory of (a), not speed."
    )

# %% [markdown]
# **(c) Our approach versus ZeRO stage 1.** Computed per device for fp32 parameters and gradients and
# AdamW ($\Psi$ parameters, $N$ devices, ring collectives): plain data parallelism all-reduces the
# gradients ($2\frac{N-1}{N}\Psi$ elements sent per device); ZeRO-1 reduce-scatters them (each rank only
# needs its partition's averaged gradients) and all-gathers the updated parameters, together the
# volume of one all-reduce; ours keeps the full gradient all-reduce and adds the parameter broadcasts,
# one more all-gather's worth.

# %% tags=["remove-input"]
cmp = B.zero1_comparison("xl", 2)
show_table(cmp.reset_index(), caption="Model-state memory and data sent per device per step, XL on 2 GPUs (computed)",
           provenance_from="computed by sharding_bench.zero1_comparison (cs336_systems.accounting)")  # fmt: skip
ours, zero = cmp.loc["ours (ShardedOptimizer)"], cmp.loc["ZeRO stage 1 (P_os)"]
nb.md(
    f"**(c)** In memory the two are the same scheme: both keep full fp32 parameters and gradients on every rank "
    f"and divide only the optimizer state by $N$ ({ours['state GiB']:.1f} vs {cmp.iloc[0]['state GiB']:.1f} GiB of "
    f"model state for XL on 2 GPUs). The differences are granularity (ZeRO partitions one flat buffer at element "
    f"granularity, so every rank gets exactly $\\Psi/N$; we assign whole tensors, which leaves the imbalance seen in "
    f"(a)) and communication: ZeRO-1 sends {zero['sent per device GB']:.1f} GB per device per step (reduce-scatter "
    f"of gradients + all-gather of parameters, $2\\Psi$ like plain DP) while ours sends "
    f"{ours['sent per device GB']:.1f} GB (all-reduce + broadcasts, $3\\Psi$), "
    f"{ours['sent per device GB'] / zero['sent per device GB']:.1f}x as much. ZeRO also overlaps its collectives "
    f"with computation and lets stage 2 free the gradient memory its reduce-scatter makes redundant; our "
    f"broadcasts run after the step, on the critical path."
)
