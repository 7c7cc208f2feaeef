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
# # 1.3 torch_compile
# (a) Add a `torch.compile`d version of the attention to the pytorch_attention sweep and compare its
# forward and backward timings with the uncompiled one. (b) Compile the whole Transformer in the
# end-to-end benchmark and compare it with the eager model for the forward pass and for a full
# training step (forward, backward, optimizer step).

# %% tags=["parameters"]
measure = "auto"  # "auto": measure when a GPU is present, else render the committed results
quick = False  # tiny attention grid (aot_eager backend) and the debug model eager, on the CPU

# %% tags=["remove-input"]
from cs336_systems.report import load_results, nb, show_table
from cs336_systems.studies import compile_study

results_dir = nb.setup(quick)

# %% tags=["remove-input"]
if nb.should_measure(measure, gpus=1, quick=quick):
    compile_study.torch_compile_study(quick=quick, results_dir=str(results_dir))
compiled = load_results("torch_compile", results_dir)
eager_attn = load_results("pytorch_attention", results_dir)
attn_c = compiled[compiled.x_name == "seq_len"]
model = compiled[compiled.x_name == "context_length"]
facts = compile_study.facts(compiled, eager_attn[eager_attn.impl == "naive"])

# %% [markdown]
# **(a) Method.** The same protocol as pytorch_attention (batch 8, fp32, causal, 3 warm-up passes,
# then 100 timed forward and 100 timed backward passes), on
# `torch.compile(naive_attention, dynamic=True)`: one compilation with symbolic shapes serves the
# whole grid (static shapes would compile twenty times). Inductor fuses the masking, the softmax and
# their backward into a few kernels, so the T x T intermediates are read and written fewer times.

# %% tags=["remove-input"]
tab = facts["attention_table"]
if nb.have_results(tab, "compiled attention (and its eager baseline)"):
    show_table(
        tab.reset_index(),
        caption="Attention, batch 8, fp32: ms per pass, eager vs torch.compile, and the speedup",
        provenance_from=attn_c,
    )

# %% tags=["remove-input"]
if "attention" in facts:
    attention = facts["attention"]
    nb.md(
        f"**(a)** The compiled attention's forward pass is {attention['forward_min']:.2f}x to "
        f"{attention['forward_max']:.2f}x as fast as the eager one and its backward pass {attention['backward_min']:.2f}x "
        f"to {attention['backward_max']:.2f}x across the configurations both ran ({attention['forward_at_longest']:.2f}x "
        f"and {attention['backward_at_longest']:.2f}x on average at T = {attention['longest_T']}). The gain comes from "
        "fusion: the naive implementation launches one kernel per elementwise step and round-trips every T x T "
        "intermediate through GPU memory, while the compiled graph fuses scale, mask, max, exp, sum and "
        "normalisation; the two matmuls stay cuBLAS calls either way, so the gain "
        + ("shrinks" if attention["shrinks_with_d"] else "should shrink")
        + " as d grows (more matmul work per "
        f"T x T element): at T = {attention['longest_T']} the forward speedup is "
        + ", ".join(f"{v:.2f}x for d = {d}" for d, v in attention["forward_at_longest_by_d"])
        + "."
        + "".join(
            f" At d = {d}, T = {t} the eager attention failed ({eager}) while the compiled one "
            f"ran ({forward} ms forward, {backward} ms backward): with fewer "
            "T x T intermediates alive it fits where the eager one does not."
            for d, t, eager, forward, backward in attention["only_compiled_ran"]
        )
        + (
            f" The one-off compilation took {attention['compile_s']:.1f} s (the first call)."
            if attention["compile_s"] is not None
            else ""
        )
    )

# %% tags=["remove-input"]
wm = facts["model_table"]
nb.md(
    "**(b) Method.** `end_to_end.run_one` with `compile=True` wraps the model in `torch.compile` (whole model, "
    "default Inductor backend); compilation happens in the untimed warm-up, so the timed steps are steady state. "
    f"Batch 4, fp32, naive attention, AdamW for the training step; {facts['protocol']}. "
    '"compile (s)" is Dynamo\'s own account of the time spent compiling (forward and backward graphs).'
    + (
        ' Cells that did not fit in the time budget of the GPU session are marked "skipped".'
        if facts["any_skipped"]
        else ""
    )
)

# %% tags=["remove-input"]
if nb.have_results(wm, "the whole-model compile study"):
    show_table(
        wm,
        caption="Whole model, eager vs torch.compile: ms per step (mean of the timed steps)",
        provenance_from=model,
    )

# %% tags=["remove-input"]
if "model" in facts:
    whole = facts["model"]
    near = whole["attention_forward_near_context"]
    nb.md(
        "**(b)** "
        + " ".join(
            f"For {'inference (forward only)' if m == 'forward' else 'a full training step'} the compiled model is "
            f"{lo:.2f}x to {hi:.2f}x as fast as the eager one."
            for m, lo, hi in whole["speedup_by_mode"]
        )
        + (
            " The gain shrinks as the model grows ("
            + "; ".join(
                f"{m}: {x_first:.2f}x for {first}, {x_last:.2f}x for {last}"
                for m, x_first, first, x_last, last in whole["smallest_and_largest"]
            )
            + "): the matmul work grows with d_model squared, the elementwise work only with d_model."
            if whole["shrinks_with_size"]
            else ""
        )
        + (
            f" Attention alone gains {near[0]:.2f}x to {near[1]:.2f}x in the forward pass at the "
            f"lengths of (a) around context {whole['context_length']} "
            f"(T = {' and '.join(map(str, whole['attention_T_near_context']))}), and up to "
            f"{whole['attention_forward_max']:.2f}x at long sequences, where the T x T traffic dominates: in"
            if near
            else " In"
        )
        + " a whole model most of the time is in the projection and MLP matmuls, "
        "which compilation leaves to cuBLAS; what it removes is the elementwise and normalisation traffic "
        "(RMSNorm, SwiGLU, RoPE, softmax) and kernel-launch overhead."
        + (
            f" Not measured within the GPU session's time budget: {', '.join(whole['skipped'])}."
            if whole["skipped"]
            else ""
        )
    )
