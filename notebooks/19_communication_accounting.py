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
# # 2.4 communication_accounting
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
# Everything below is computed by `cs336_systems.accounting` (tested in
# `tests/test_accounting.py`); nothing is measured. **Units:** memory is counted in bytes and printed in
# decimal GB ($10^9$ B), as the handout's "80GB" and "95 GB" device sizes are; GiB ($2^{30}$ B) are
# given where they differ in an interesting way. A token is one row of the activations (the handout's
# "batch" $B$ counts tokens).

# %% tags=["parameters"]
measure = "auto"  # unused: this problem is pure computation (kept for a uniform notebook interface)
quick = False  # unused for the same reason; the notebook runs in about a second either way
token_counts = [1024, 2048, 4096, 8192]  # example batch sizes (tokens) for the activation terms
n_fsdp_max = 256  # right edge of the per-device memory plot

# %% tags=["remove-input"]
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from cs336_systems import accounting as acc
from cs336_systems.measure.results import env_metadata
from cs336_systems.report import nb, save_figure, show_table

results_dir = nb.setup(quick)


def num(x, spec=",.0f"):
    """A number for LaTeX math: thousands separators as {,} so they do not get punctuation spacing."""
    return format(x, spec).replace(",", "{,}")


SOURCE = f"computed analytically by cs336_systems.accounting at git {env_metadata()['git_sha']}"
XXL, TPU, H100 = acc.XXL, acc.TPU_V5P, acc.H100_SXM
P = XXL.num_params
state = acc.ffn_stack_memory(XXL, tokens=0)
act_per_token = XXL.saved_activation_bytes_per_token(activation_bytes=2)

# %% [markdown]
# ## (a) Memory on one device
#
# Each block holds $W_\text{in} \in \mathbb{R}^{d_\text{model} \times d_\text{ff}}$ and
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

# %% tags=["remove-input"]
rows = [
    ("master weights (fp32)", state.weights),
    ("accumulated gradients (fp32)", state.gradients),
    ("AdamW m and v (fp32)", state.optimizer_state),
    ("state total", state.state),
    ("saved activations per token (bf16)", act_per_token),
]
show_table(
    pd.DataFrame(
        {
            "term": [r[0] for r in rows],
            "bytes": [int(r[1]) for r in rows],
            "GB": [r[1] / acc.GB for r in rows],
            "GiB": [r[1] / acc.GiB for r in rows],
        }
    ),
    caption=f"XXL model: P = {P:,} parameters",
    provenance_from=SOURCE,
)
act_rows = []
for t in token_counts:
    m = acc.ffn_stack_memory(XXL, tokens=t)
    act_rows.append(
        {
            "tokens T": t,
            "activations A(T) [GB]": m.activations / acc.GB,
            "state + A(T) [GB]": m.total / acc.GB,
            "H100 80GB needed": acc.devices_to_hold(m.total, H100.memory_bytes),
        }
    )
show_table(
    pd.DataFrame(act_rows),
    caption="Saved activations and the H100 count for example batches",
    provenance_from=SOURCE,
)

# %% tags=["remove-input"]
n_h100 = acc.devices_to_hold(state.state, H100.memory_bytes)
n_h100_gib = acc.devices_to_hold(state.state, 80 * acc.GiB)
nb.md(
    f"""**Answer (a).** $P = 126 \\cdot 2 \\cdot 16384 \\cdot 53248 = {num(P)} \\approx {P / 1e9:.1f}$ billion
parameters, so the FP32 master weights, gradients and AdamW state take
$16P = {num(state.state)}$ bytes $\\approx {state.state / acc.TB:.2f}$ TB (exactly ${state.state / acc.GiB:.0f}$ GiB),
split as {state.weights / acc.GB:,.0f} GB of weights, {state.gradients / acc.GB:,.0f} GB of gradients and
{state.optimizer_state / acc.GB:,.0f} GB of optimizer state. The activations saved for backward are
$126 \\cdot (16384 + 53248) \\cdot 2 = {num(act_per_token)}$ bytes $\\approx {act_per_token / acc.MB:.1f}$ MB per token,
i.e. $A(T) \\approx {act_per_token / acc.MB:.1f}\\,T$ MB (for example {act_rows[-1]["activations A(T) [GB]"]:,.0f} GB at
$T = {token_counts[-1]}$ tokens). **The state alone fills the memory of {n_h100} H100 80GB GPUs**
($16P / 80\\,\\text{{GB}} = {state.state / H100.memory_bytes:.2f}$; with 80 GiB per GPU it would be {n_h100_gib}), before
any activation or the BF16 working copy of the weights is counted."""
)

# %% [markdown]
# ## (b) Sharding over $N_\text{FSDP}$ devices
#
# Sharding the master weights, gradients and optimizer state, and half of the activations (every other
# layer's), over $N = N_\text{FSDP}$ devices while the other half stays whole on every device gives
# $$M_\text{device}(N) = \frac{16P + A/2}{N} + \frac{A}{2}.$$
# Fitting a TPU v5p needs $M_\text{device}(N) \le 95\,\text{GB}$, i.e.
# $$N \ge \frac{16P + A/2}{95\,\text{GB} - A/2}, \qquad \text{possible only while } A/2 < 95\,\text{GB}.$$
# Ignoring activations ($A \to 0$) this is $N \ge 16P / 95\,\text{GB}$.

# %% tags=["remove-input"]
n_min0 = acc.min_fsdp_devices(state, TPU.memory_bytes)
fit_rows = []
for t in [0, *token_counts]:
    m = acc.ffn_stack_memory(XXL, tokens=t)
    n_min = acc.min_fsdp_devices(m, TPU.memory_bytes)
    fit_rows.append(
        {
            "tokens T": t,
            "A(T) [GB]": m.activations / acc.GB,
            "min N_FSDP (95 GB)": n_min if n_min is not None else float("nan"),
            "memory/device at that N [GB]": (
                acc.fsdp_memory_per_device(m, n_min).total / acc.GB if n_min is not None else float("nan")
            ),
        }
    )
show_table(pd.DataFrame(fit_rows), caption="Smallest N_FSDP under 95 GB per device", provenance_from=SOURCE)

fig, ax = plt.subplots()
ns = np.arange(1, n_fsdp_max + 1)
for t in [0, *token_counts]:
    m = acc.ffn_stack_memory(XXL, tokens=t)
    mem = [acc.fsdp_memory_per_device(m, n).total / acc.GB for n in ns]
    ax.plot(ns, mem, label=f"T = {t} tokens" if t else "state only (T = 0)")
ax.axhline(TPU.memory_bytes / acc.GB, color="k", ls="--", lw=1, label="TPU v5p: 95 GB")
ax.set(xscale="log", yscale="log", xlabel="$N_{FSDP}$", ylabel="memory per device [GB]")
ax.set_title("XXL per-device memory: $(16P + A/2)/N + A/2$")
ax.legend(fontsize="small")
save_figure(fig, "communication_accounting__memory_vs_n_fsdp")
plt.show()

# %% tags=["remove-input"]
t_cap = 2 * TPU.memory_bytes / act_per_token
nb.md(
    f"""**Answer (b).** Per device, $M(N) = (16P + A/2)/N + A/2$ with $16P = {state.state / acc.TB:.3f}$ TB and
$A \\approx {act_per_token / acc.MB:.1f}$ MB per token. Ignoring activations,
$16P / 95\\,\\text{{GB}} = {state.state / TPU.memory_bytes:.2f}$, so **$N_\\text{{FSDP}} = {n_min0}$ devices** is the
smallest mesh whose per-device share fits in 95 GB ({acc.fsdp_memory_per_device(state, n_min0).total / acc.GB:.1f} GB each);
the unsharded half of the activations then adds $A/2$ to every device, which for example raises the
requirement to {fit_rows[-1]["min N_FSDP (95 GB)"]:.0f} devices at $T = {token_counts[-1]}$ tokens, and no $N$ fits
once $A/2 \\ge 95$ GB, i.e. for batches beyond about {t_cap:,.0f} tokens."""
)

# %% [markdown]
# ## (c) When is the TPU v5p forward compute-bound?
#
# The Scaling Book (Austin et al. 2025, Part 5, "Mixed FSDP and Tensor Parallelism") shards a block as
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

# %% tags=["remove-input"]
tpu = acc.MixedFsdpTpSetting(d_model=XXL.d_model, d_ff=XXL.d_ff, x=16, y=4, m_x=2, m_y=1)
b_sum, b_max = tpu.min_batch(combine="sum"), tpu.min_batch(combine="max")
show_table(
    pd.DataFrame(
        [
            {"quantity": "alpha = C / W_ici [FLOP/B]", "value": tpu.alpha},
            {"quantity": "T_TP / T_math = alpha Y / (M_Y F)", "value": tpu.tp_fraction()},
            {"quantity": "alpha Y / M_Y (TP hidden iff F >= this)", "value": tpu.alpha * tpu.y / tpu.m_y},
            {"quantity": "min B / N, book (sum) [tokens]", "value": b_sum / tpu.n},
            {"quantity": "min global B, book (sum) [tokens]", "value": b_sum},
            {"quantity": "min B / N, collectives overlapped (max) [tokens]", "value": b_max / tpu.n},
            {"quantity": "min global B, collectives overlapped (max) [tokens]", "value": b_max},
        ]
    ),
    caption="TPU v5p, X = 16 (FSDP), Y = 4 (TP), M_X = 2, M_Y = 1, N = 64",
    provenance_from=SOURCE,
)

fig, ax = plt.subplots()
bs = np.logspace(3, 6, 200)
ax.plot(bs, [tpu.t_math(b) * 1e6 for b in bs], color="k", label="$T_{math}$")
ax.plot(bs, [tpu.t_fsdp() * 1e6] * len(bs), label="$T_{FSDP}$")
ax.plot(bs, [tpu.t_tp(b) * 1e6 for b in bs], label="$T_{TP}$")
ax.plot(bs, [(tpu.t_fsdp() + tpu.t_tp(b)) * 1e6 for b in bs], ls="--", label="$T_{FSDP} + T_{TP}$")
ax.axvline(b_sum, color="grey", lw=1, ls=":")
ax.annotate(
    f"B = {b_sum:,.0f}",
    (b_sum, tpu.t_math(b_sum) * 1e6),
    xytext=(8, -20),
    textcoords="offset points",
    bbox={"fc": "white", "ec": "none"},
)
ax.set(xscale="log", yscale="log", xlabel="global batch B [tokens]", ylabel="time per block, forward [us]")
ax.set_title("TPU v5p, X=16 (FSDP) x Y=4 (TP): compute vs communication")
ax.legend(fontsize="small")
save_figure(fig, "communication_accounting__tpu_times_vs_batch")
plt.show()

# %% tags=["remove-input"]
nb.md(
    f"""**Answer (c).** $\\alpha = 4.6 \\cdot 10^{{14}} / (1.8 \\cdot 10^{{11}}) = {num(tpu.alpha, ",.1f")}$ FLOP/B. On its own the TP
term is hidden, since $F = 53248 \\ge \\alpha Y / M_Y = {num(tpu.alpha * tpu.y / tpu.m_y)}$, but it still uses
$\\alpha Y / (M_Y F) = {tpu.tp_fraction():.3f}$ of the math time, leaving the rest for the weight all-gathers. With the
Scaling Book's criterion $T_\\text{{FSDP}} + T_\\text{{TP}} \\le T_\\text{{math}}$ **the forward is compute-bound at
$B/N \\ge {b_sum / tpu.n:.1f}$ tokens per device, i.e. a global batch of at least ${tpu.n:.0f} \\times {b_sum / tpu.n:.1f}
\\approx {num(b_sum)}$ tokens** (each TP group of $Y = 4$ chips, one FSDP shard, processes $B/X \\ge {num(b_sum / tpu.x)}$ tokens). If the
FSDP and TP collectives could also overlap each other, only $T_\\text{{FSDP}} \\le T_\\text{{math}}$ would bind, giving
$B/N \\ge \\alpha/(Y M_X) = {b_max / tpu.n:.1f}$ tokens per device and $B \\ge {num(b_max)}$ tokens."""
)

# %% [markdown]
# ## (d) Shrinking the batch while staying compute-bound

# %% tags=["remove-input"]
mesh_rows = []
for x in [64, 32, 16, 8, 4, 2]:
    s = acc.MixedFsdpTpSetting(d_model=XXL.d_model, d_ff=XXL.d_ff, x=x, y=64 // x)
    mesh_rows.append(
        {
            "X (FSDP)": x,
            "Y (TP)": 64 // x,
            "T_TP / T_math": s.tp_fraction(),
            "min global B [tokens]": s.min_batch(),
        }
    )
fp8 = acc.MixedFsdpTpSetting(d_model=XXL.d_model, d_ff=XXL.d_ff, x=16, y=4, weight_bytes=1)
# Pipeline with P stages of 64 / P chips: every stage keeps Y = 4 and has X = 16 / P; the per-layer ratios
# are those of an X x Y mesh (T_math of a layer is shared by the stage's chips only).
pp_stages = 4
pp = acc.MixedFsdpTpSetting(d_model=XXL.d_model, d_ff=XXL.d_ff, x=16 // pp_stages, y=4)
variants = [
    ("fp8 weight all-gathers", fp8, 16, 4),
    (f"pipeline, {pp_stages} stages of 16 chips", pp, 16 // pp_stages, 4),
]
for _name, setting, x, y in variants:
    mesh_rows.append(
        {
            "X (FSDP)": x,
            "Y (TP)": y,
            "T_TP / T_math": setting.tp_fraction(),
            "min global B [tokens]": setting.min_batch(),
        }
    )
mesh_df = pd.DataFrame(mesh_rows)
mesh_df.insert(0, "variant", ["bf16, 64 chips"] * 6 + [v[0] for v in variants])
show_table(
    mesh_df,
    caption="Minimum global batch (book criterion, forward) for other layouts of the 64 chips",
    provenance_from=SOURCE,
)
best = mesh_df.iloc[:6].sort_values("min global B [tokens]").iloc[0]
b_opt = acc.mixed_fsdp_tp_optimal_min_batch_per_device(XXL.d_ff) * 64
x_opt = acc.mixed_fsdp_tp_optimal_x(b_opt, 64, XXL.d_ff)

# %% tags=["remove-input"]
nb.md(
    f"""**Answer (d).** Since the forward is compute-bound iff
$\\frac{{\\alpha X}}{{M_X B}} + \\frac{{\\alpha Y}}{{M_Y F}} \\le 1$, a smaller batch needs fewer bytes per FLOP on the
FSDP axis, more bandwidth per byte, or a different $X$ : $Y$ split. *Re-balancing FSDP against TP* (Megatron-style TP,
Shoeybi et al. 2019, moves activations instead of weights): at fixed $N$ the sum is minimised at
$X^* = \\sqrt{{B N M_X/(F M_Y)}}$, which gives the floor $B/N \\ge 4\\alpha^2/(F M_X M_Y)$ (Austin et al. 2025, Part 5),
i.e. $B \\ge {num(b_opt)}$ tokens at $X^* \\approx {x_opt:.1f}$; the power-of-two mesh
$X = Y = {best["X (FSDP)"]:.0f}$ already gets to {best["min global B [tokens]"]:,.0f} tokens instead of {b_sum:,.0f}.
*Pipeline parallelism* (GPipe, Huang et al. 2019; 1F1B, Narayanan et al. 2019 and 2021; Tazi et al. 2025) splits the
$L$ layers over $P$ stages of $N/P$ chips, so each stage needs only $X/P$-way FSDP: with {pp_stages} stages the bound
falls to {pp.min_batch():,.0f} tokens, provided a stage keeps its gathered weights for all $m$ micro-batches instead of
re-gathering them, and $m \\gg P$ keeps the bubble fraction $(P-1)/(m+P-1)$ small. *Lower-precision communication*:
all-gathering FP8 weights halves $T_\\text{{FSDP}}$ and the bound ({fp8.min_batch():,.0f} tokens), and FP8 TP collectives
halve $\\alpha Y/(M_Y F)$. *More links and overlap*: routing a collective over more ICI axes (larger $M_X$, $M_Y$) or
a faster interconnect lowers the effective $\\alpha$, and prefetching layer $\\ell + 1$'s all-gather during layer
$\\ell$ (as ZeRO-3 / FSDP do, Rajbhandari et al. 2020) while running both axes concurrently replaces the sum by a max
({b_max:,.0f} tokens). Sequence or context parallelism does not change the token count $B$ that the bound is about; it
only lets fewer, longer sequences make up the batch."""
)

# %% [markdown]
# **References.** J. Austin et al., *How to Scale Your Model* (the TPU Scaling Book), Part 5 "How to Parallelize
# a Transformer for Training", 2025, https://jax-ml.github.io/scaling-book/training/ ;
# N. Tazi et al., *The Ultra-Scale Playbook: Training LLMs on GPU Clusters*, Hugging Face, 2025 ;
# S. Rajbhandari et al., *ZeRO: Memory Optimizations Toward Training Trillion Parameter Models*, SC 2020 ;
# M. Shoeybi et al., *Megatron-LM: Training Multi-Billion Parameter Language Models Using Model Parallelism*, 2019 ;
# Y. Huang et al., *GPipe: Efficient Training of Giant Neural Networks using Pipeline Parallelism*, NeurIPS 2019 ;
# D. Narayanan et al., *PipeDream: Generalized Pipeline Parallelism for DNN Training*, SOSP 2019, and
# *Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM*, SC 2021 (1F1B schedule).
