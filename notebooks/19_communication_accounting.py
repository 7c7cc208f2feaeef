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
# # communication_accounting (2025 §2.4)
# A written problem about the "XXL" model: $L = 126$ blocks, each two linears
# $d_\text{model} \to d_\text{ff} \to d_\text{model}$ with $d_\text{model} = 16384$ and
# $d_\text{ff} = 53248$ (no attention, embeddings, output layer or activation function, no activation
# checkpointing). Activations and communicated gradients are BF16; accumulated gradients, master weights
# and optimizer state are FP32. (a) How much memory do the master weights, gradients and AdamW state take
# on one device, how much do the activations saved for backward take, and how many H100 80GB is that?
# (b) With the state and half of the activations sharded over $N_\text{FSDP}$ devices, what is the memory
# per device, and which $N_\text{FSDP}$ fits a TPU v5p (95 GB)? (c) With the Scaling Book's mixed
# FSDP + TP model of the forward pass on TPU v5p ($W_\text{ici} = 2 \cdot 9 \cdot 10^{10}$ B/s,
# $C = 4.6 \cdot 10^{14}$ FLOP/s, $M_X = 2$, $M_Y = 1$, $X = 16$, $Y = 4$), at what batch per device does
# the model become compute-bound, and what is the global batch? (d) Which tricks lower that batch?
#
# Every number is computed by `cs336_systems.accounting` (tested in `tests/test_accounting.py`); nothing
# is measured. The derivations behind the answers are in the notebook (`notebooks/19_communication_accounting.py`),
# not printed here. Memory is in decimal GB ($10^9$ B), as the handout's device sizes are; a token is one row of
# the activations (the handout's "batch" $B$ counts tokens).

# %% tags=["parameters"]
measure = "auto"  # unused: this problem is pure computation (kept for a uniform notebook interface)
quick = False  # unused for the same reason; the notebook runs in about a second either way
token_counts = [1024, 2048, 4096, 8192]  # example batch sizes (tokens) for the activation terms
n_fsdp_max = 256  # right edge of the per-device memory plot

# %% tags=["remove-input"]
import matplotlib.pyplot as plt

from cs336_systems.report import latex_number, nb, save_figure, show_table
from cs336_systems.studies.written import communication_accounting

results_dir = nb.setup(quick)
SOURCE = communication_accounting.provenance()
facts = communication_accounting.facts(token_counts)

# %% [markdown] tags=["remove-cell"]
# ## (a) Memory on one device

# %% tags=["remove-input"]
nb.md(
    f"""**Answer (a).** $P = 126 \\cdot 2 \\cdot 16384 \\cdot 53248 = {latex_number(facts["params"])} \\approx {facts["params"] / 1e9:.1f}$ billion
parameters, so the FP32 master weights, gradients and AdamW state take
$16P = {latex_number(facts["state_bytes"])}$ bytes $\\approx {facts["state_TB"]:.2f}$ TB (exactly ${facts["state_GiB"]:.0f}$ GiB),
split as {facts["weights_GB"]:,.0f} GB of weights, {facts["gradients_GB"]:,.0f} GB of gradients and
{facts["optimizer_state_GB"]:,.0f} GB of optimizer state. The activations saved for backward are
$126 \\cdot (16384 + 53248) \\cdot 2 = {latex_number(facts["activation_bytes_per_token"])}$ bytes $\\approx {facts["activation_MB_per_token"]:.1f}$ MB per token,
i.e. $A(T) \\approx {facts["activation_MB_per_token"]:.1f}\\,T$ MB (for example {facts["example_activations_GB"]:,.0f} GB at
$T = {facts["example_tokens"]}$ tokens). **The state alone fills the memory of {facts["h100_for_state"]} H100 80GB GPUs**
($16P / 80\\,\\text{{GB}} = {facts["state_over_h100"]:.2f}$; with 80 GiB per GPU it would be {facts["h100_for_state_80GiB"]}), before
any activation or the BF16 working copy of the weights is counted."""
)

# %% [markdown] tags=["remove-cell"]
# **(a)** Each block holds $W_\text{in} \in \mathbb{R}^{d_\text{model} \times d_\text{ff}}$ and
# $W_\text{out} \in \mathbb{R}^{d_\text{ff} \times d_\text{model}}$, so
# $$P = L \cdot 2\, d_\text{model}\, d_\text{ff}.$$
# FP32 master weights, FP32 accumulated gradients and AdamW's two FP32 moments $m, v$ cost
# $4 + 4 + 4 + 4 = 16$ bytes per parameter:
# $$M_\text{state} = \underbrace{4P}_\text{master} + \underbrace{4P}_\text{grad} + \underbrace{8P}_{m,\,v} = 16P .$$
# For backward, a linear $y = xW$ needs its input $x$ (for $\partial W = x^\top \partial y$; the input
# gradient $\partial x = \partial y\, W^\top$ needs only $W$, which is state). With no activation function
# the hidden $h = x W_\text{in}$ is itself the saved input of $W_\text{out}$, so each block keeps
# $d_\text{model} + d_\text{ff}$ BF16 values per token:
# $$A(T) = T \cdot L \cdot (d_\text{model} + d_\text{ff}) \cdot 2 \text{ bytes for a batch of } T \text{ tokens.}$$
# The handout gives no batch size, so $A$ is reported per token and for a few example batches.

# %% tags=["remove-input", "remove-cell"]
show_table(
    communication_accounting.memory_terms_table(),
    caption=f"communication_accounting (a): memory of the XXL model, P = {facts['params']:,} parameters",
    provenance_from=SOURCE,
)

# %% [markdown] tags=["remove-cell"]
# ## (b) Sharding over $N_\text{FSDP}$ devices

# %% tags=["remove-input"]
nb.md(
    f"""**Answer (b).** Per device, $M(N) = (16P + A/2)/N + A/2$ with $16P = {facts["state_TB"]:.3f}$ TB and
$A \\approx {facts["activation_MB_per_token"]:.1f}$ MB per token. Ignoring activations,
$16P / 95\\,\\text{{GB}} = {facts["state_over_tpu"]:.2f}$, so **$N_\\text{{FSDP}} = {facts["min_fsdp_state_only"]}$ devices** is the
smallest mesh whose per-device share fits in 95 GB ({facts["memory_per_device_at_min_GB"]:.1f} GB each);
the unsharded half of the activations then adds $A/2$ to every device, which for example raises the
requirement to {facts["min_fsdp_example_tokens"]:.0f} devices at $T = {facts["example_tokens"]}$ tokens, and no $N$ fits
once $A/2 \\ge 95$ GB, i.e. for batches beyond about {facts["max_tokens_any_fsdp"]:,.0f} tokens."""
)

# %% [markdown] tags=["remove-cell"]
# **(b)** Sharding the master weights, gradients and optimizer state, and half of the activations (every other
# layer's), over $N = N_\text{FSDP}$ devices while the other half stays whole on every device gives
# $$M_\text{device}(N) = \frac{16P + A/2}{N} + \frac{A}{2}.$$
# Fitting a TPU v5p needs $M_\text{device}(N) \le 95\,\text{GB}$, i.e.
# $$N \ge \frac{16P + A/2}{95\,\text{GB} - A/2}, \qquad \text{possible only while } A/2 < 95\,\text{GB}.$$
# Ignoring activations ($A \to 0$) this is $N \ge 16P / 95\,\text{GB}$.

# %% tags=["remove-input", "remove-cell"]
show_table(
    communication_accounting.fsdp_fit_table(token_counts),
    caption="Smallest N_FSDP under 95 GB per device",
    provenance_from=SOURCE,
)
save_figure(
    communication_accounting.plot_memory_vs_n_fsdp(token_counts, n_fsdp_max),
    "communication_accounting__memory_vs_n_fsdp",
)
plt.show()

# %% [markdown] tags=["remove-cell"]
# ## (c) When is the TPU v5p forward compute-bound?

# %% tags=["remove-input"]
nb.md(
    f"""**Answer (c).** $\\alpha = 4.6 \\cdot 10^{{14}} / (1.8 \\cdot 10^{{11}}) = {latex_number(facts["alpha"], ",.1f")}$ FLOP/B. On its own the TP
term is hidden, since $F = 53248 \\ge \\alpha Y / M_Y = {latex_number(facts["tp_hidden_min_d_ff"])}$, but it still uses
$\\alpha Y / (M_Y F) = {facts["tp_fraction"]:.3f}$ of the math time, leaving the rest for the weight all-gathers. With the
Scaling Book's criterion $T_\\text{{FSDP}} + T_\\text{{TP}} \\le T_\\text{{math}}$ **the forward is compute-bound at
$B/N \\ge {facts["min_batch_sum_per_device"]:.1f}$ tokens per device, i.e. a global batch of at least ${facts["chips"]:.0f} \\times {facts["min_batch_sum_per_device"]:.1f}
\\approx {latex_number(facts["min_batch_sum"])}$ tokens** (each TP group of $Y = 4$ chips, one FSDP shard, processes $B/X \\ge {latex_number(facts["min_batch_sum_per_fsdp_shard"])}$ tokens). If the
FSDP and TP collectives could also overlap each other, only $T_\\text{{FSDP}} \\le T_\\text{{math}}$ would bind, giving
$B/N \\ge \\alpha/(Y M_X) = {facts["min_batch_max_per_device"]:.1f}$ tokens per device and $B \\ge {latex_number(facts["min_batch_max"])}$ tokens."""
)

# %% tags=["remove-input"]
tpu = communication_accounting.tpu_setting()
save_figure(communication_accounting.plot_tpu_times(tpu), "communication_accounting__tpu_times_vs_batch")
plt.show()

# %% [markdown] tags=["remove-cell"]
# **(c)** The Scaling Book (Austin et al. 2025, Part 5, "Mixed FSDP and Tensor Parallelism") shards a block as
# $\text{In}[B_X, D_Y] \cdot_D W_\text{in}[D_X, F_Y] \cdot_F W_\text{out}[F_Y, D_X] \to \text{Out}[B_X, D_Y]$
# on an $X \times Y$ mesh, $N = XY$: the FSDP axis $X$ all-gathers the weights, the TP axis $Y$ all-gathers
# the input and reduce-scatters the output. Per block and forward pass, with $D = d_\text{model}$,
# $F = d_\text{ff}$, $B$ the global batch in tokens, BF16 (2 bytes) everywhere, and $M_X$, $M_Y$ the number
# of ICI axes each collective uses:
# $$T_\text{math} = \frac{2 \cdot 2BDF}{NC}, \qquad
#   T_\text{FSDP} = \frac{2 \cdot 2DF}{Y\, W_\text{ici}\, M_X}, \qquad
#   T_\text{TP} = \frac{2 \cdot 2BD}{X\, W_\text{ici}\, M_Y}.$$
# (Two matmuls of $2BDF$ FLOPs shared by $N$ chips; two $(D, F/Y)$ BF16 weights gathered along $X$;
# a $(B/X, D)$ BF16 activation gathered and one reduce-scattered along $Y$.) With
# $\alpha = C / W_\text{ici}$ (FLOPs per byte of ICI traffic) the ratios to the math are
# $$\frac{T_\text{FSDP}}{T_\text{math}} = \frac{\alpha X}{M_X B}, \qquad
#   \frac{T_\text{TP}}{T_\text{math}} = \frac{\alpha Y}{M_Y F}.$$
# The book declares the step communication-bound when $T_\text{FSDP} + T_\text{TP} > T_\text{math}$
# (communication overlaps the math, but the two collectives are added), so it is compute-bound when
# $$B \ \ge\ \frac{\alpha X}{M_X \left(1 - \frac{\alpha Y}{M_Y F}\right)}, \qquad
#   \frac{B}{N} \ \ge\ \frac{\alpha}{Y M_X \left(1 - \frac{\alpha Y}{M_Y F}\right)} .$$
# If the two collectives also overlapped each other (compare with the max instead of the sum), the
# conditions separate into $B/N \ge \alpha/(Y M_X)$ and $F \ge \alpha Y / M_Y$; this gives a lower bound.

# %% tags=["remove-input", "remove-cell"]
show_table(
    communication_accounting.tpu_table(tpu),
    caption="communication_accounting (c): TPU v5p, X = 16 (FSDP), Y = 4 (TP), M_X = 2, M_Y = 1, N = 64",
    provenance_from=SOURCE,
)

# %% [markdown] tags=["remove-cell"]
# ## (d) Shrinking the batch while staying compute-bound

# %% tags=["remove-input"]
nb.md(
    f"""**Answer (d).** Since the forward is compute-bound iff
$\\frac{{\\alpha X}}{{M_X B}} + \\frac{{\\alpha Y}}{{M_Y F}} \\le 1$, a smaller batch needs fewer bytes per FLOP on the
FSDP axis, more bandwidth per byte, or a different $X$ : $Y$ split. *Re-balancing FSDP against TP* (Megatron-style TP,
Shoeybi et al. 2019, moves activations instead of weights): at fixed $N$ the sum is minimised at
$X^* = \\sqrt{{B N M_X/(F M_Y)}}$, which gives the floor $B/N \\ge 4\\alpha^2/(F M_X M_Y)$ (Austin et al. 2025, Part 5),
i.e. $B \\ge {latex_number(facts["optimal_min_batch"])}$ tokens at $X^* \\approx {facts["optimal_x"]:.1f}$; the power-of-two mesh
$X = Y = {facts["best_mesh_x"]:.0f}$ already gets to {facts["best_mesh_min_batch"]:,.0f} tokens instead of {facts["min_batch_sum"]:,.0f}.
*Pipeline parallelism* (GPipe, Huang et al. 2019; 1F1B, Narayanan et al. 2019 and 2021; Tazi et al. 2025) splits the
$L$ layers over $P$ stages of $N/P$ chips, so each stage needs only $X/P$-way FSDP: with {facts["pipeline_stages"]} stages the bound
falls to {facts["pipeline_min_batch"]:,.0f} tokens, provided a stage keeps its gathered weights for all $m$ micro-batches instead of
re-gathering them, and $m \\gg P$ keeps the bubble fraction $(P-1)/(m+P-1)$ small. *Lower-precision communication*:
all-gathering FP8 weights halves $T_\\text{{FSDP}}$ and the bound ({facts["fp8_min_batch"]:,.0f} tokens), and FP8 TP collectives
halve $\\alpha Y/(M_Y F)$. *More links and overlap*: routing a collective over more ICI axes (larger $M_X$, $M_Y$) or
a faster interconnect lowers the effective $\\alpha$, and prefetching layer $\\ell + 1$'s all-gather during layer
$\\ell$ (as ZeRO-3 / FSDP do, Rajbhandari et al. 2020) while running both axes concurrently replaces the sum by a max
({facts["min_batch_max"]:,.0f} tokens). Sequence or context parallelism does not change the token count $B$ that the bound is about; it
only lets fewer, longer sequences make up the batch."""
)

# %% tags=["remove-input"]
show_table(
    communication_accounting.layout_table(),
    caption="Minimum global batch (book criterion, forward) for other layouts of the 64 chips",
    provenance_from=SOURCE,
)

# %% [markdown] tags=["appendix"]
# **References.** J. Austin et al., *How to Scale Your Model* (the TPU Scaling Book), Part 5 "How to Parallelize
# a Transformer for Training", 2025, https://jax-ml.github.io/scaling-book/training/ ;
# N. Tazi et al., *The Ultra-Scale Playbook: Training LLMs on GPU Clusters*, Hugging Face, 2025 ;
# S. Rajbhandari et al., *ZeRO: Memory Optimizations Toward Training Trillion Parameter Models*, SC 2020 ;
# M. Shoeybi et al., *Megatron-LM: Training Multi-Billion Parameter Language Models Using Model Parallelism*, 2019 ;
# Y. Huang et al., *GPipe: Efficient Training of Giant Neural Networks using Pipeline Parallelism*, NeurIPS 2019 ;
# D. Narayanan et al., *PipeDream: Generalized Pipeline Parallelism for DNN Training*, SOSP 2019, and
# *Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM*, SC 2021 (1F1B schedule).
