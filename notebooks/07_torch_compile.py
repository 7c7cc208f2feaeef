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
# # torch_compile (2025 §1.3)
# (a) A `torch.compile`d attention in the pytorch_attention sweep: forward and backward against the
# uncompiled one. (b) The whole Transformer compiled in the end-to-end benchmark: forward pass and full
# training step against the eager model.

# %% tags=["parameters"]
measure = "auto"  # "auto": measure when a GPU is present, else render the committed results
quick = False  # tiny attention grid (aot_eager backend) and the debug model eager, on the CPU

# %% tags=["remove-input"]
from cs336_systems.report import load_results, nb, show_table
from cs336_systems.studies.attention import torch_compile

results_dir = nb.setup(quick)

# %% tags=["remove-input"]
if nb.should_measure(measure, gpus=1, quick=quick):
    torch_compile.measure(torch_compile.CompileConfig(quick=quick), results_dir=str(results_dir))
compiled = load_results("torch_compile", results_dir)
eager_attn = load_results("pytorch_attention", results_dir)
attn_c = compiled[compiled.x_name == "seq_len"]
model = compiled[compiled.x_name == "context_length"]
facts = torch_compile.facts(compiled, eager_attn[eager_attn.impl == "naive"])

# %% tags=["remove-input"]
answer = []
if "attention" in facts:
    attention = facts["attention"]
    speeds = (
        facts["attention_table"]
        .xs("speedup", axis=1, level=1)
        .map(lambda v: float(str(v).rstrip("x") or "nan"))
    )
    slower_up_to = max((t for (_d, t), r in speeds.iterrows() if (r < 1).any()), default=None)
    answer.append(
        f"**Answer.** **(a)** Compiled attention runs the forward pass {attention['forward_min']:.2f}x to "
        f"{attention['forward_max']:.2f}x and the backward {attention['backward_min']:.2f}x to "
        f"{attention['backward_max']:.2f}x as fast as eager ({attention['forward_at_longest']:.2f}x and "
        f"{attention['backward_at_longest']:.2f}x on average at T = {attention['longest_T']}"
        + (f"; slower than eager only at T <= {slower_up_to}" if slower_up_to else "")
        + "). Inductor generates fused kernels for the scale, mask and softmax steps and their backward, so the "
        "T x T intermediates make fewer round trips to memory; the two matmuls stay cuBLAS calls, so the gain "
        + ("shrinks" if attention["shrinks_with_d"] else "does not shrink")
        + f" as d grows (forward at T = {attention['longest_T']}: "
        + ", ".join(f"{v:.2f}x at d = {d}" for d, v in attention["forward_at_longest_by_d"])
        + ")."
        + "".join(
            f" At d = {d}, T = {t} only the compiled attention fits ({forward} ms forward, {backward} ms backward)."
            for d, t, _eager, forward, backward in attention["only_compiled_ran"]
        )
    )
if "model" in facts:
    whole = facts["model"]
    answer.append(
        ("**(b)** " if answer else "**Answer.** **(b)** ")
        + "(per size and mode: the appendix table) "
        + " ".join(
            f"{'Forward only' if m == 'forward' else 'A training step'}: {lo:.2f}x to {hi:.2f}x as fast as eager."
            for m, lo, hi in whole["speedup_by_mode"]
        )
        + (
            " The gain shrinks with model size ("
            + "; ".join(
                f"{m} {x_first:.2f}x for {first}, {x_last:.2f}x for {last}"
                for m, x_first, first, x_last, last in whole["smallest_and_largest"]
            )
            + "): compilation removes elementwise traffic and launch overhead, while the projection and MLP "
            "matmuls it leaves to cuBLAS grow with d_model squared."
            if whole["shrinks_with_size"]
            else ""
        )
        + (
            f" Not measured within the session's budget: {', '.join(whole['skipped'])}."
            if whole["skipped"]
            else ""
        )
    )
nb.md(" ".join(answer))

# %% tags=["remove-input"]
grid = torch_compile.speedup_grid(facts["attention_table"])
if nb.have_results(grid, "compiled attention (and its eager baseline)"):
    show_table(
        grid.reset_index(),
        caption="(a) torch.compile'd attention, batch 8, fp32: ms per pass (speedup over eager)",
        provenance_from=attn_c,
        note="eager times: the pytorch_attention table; T = 32768: eager ran out of memory, so no speedup",
    )

# %% tags=["remove-input", "appendix"]
wm = facts["model_table"]
if nb.have_results(wm, "the whole-model compile study"):
    show_table(
        wm,
        caption="torch_compile (b): whole model, eager vs torch.compile: ms per step (mean of the timed steps), batch 4, fp32, "
        "context 512",
        provenance_from=model,
        note=f"{facts['protocol']}; compile (s): Dynamo's own account of the compile time of the forward and "
        "backward graphs",
    )

# %% [markdown] tags=["appendix"]
# **Method.** (a) The pytorch_attention protocol on `torch.compile(naive_attention, dynamic=True)`: one
# compilation with symbolic shapes serves the whole grid. (b) `end_to_end.run_one(compile=True)` wraps the
# whole model in `torch.compile` (Inductor); compilation happens in the untimed warm-up, so the timed
# steps are steady state; naive attention, AdamW for the training step.
