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
# # parallelism_calcs (2026 §8)
# alternate_ring_all_reduce, data_parallel_calcs, fsdp_calcs, tp_calcs and fsdp_tp_calcs: five written problems of the 2026 handout's section 8 about one FFN layer spread over $N$ devices: how
# long a naive ring all-reduce takes, and for data parallelism (DP), fully sharded data parallelism
# (FSDP), tensor parallelism (TP) and a 2D FSDP $\times$ TP grid, the FLOPs and communication time of the
# forward and backward passes and the largest device count before communication dominates.
#
# **Setting (handout).** $N$ fully connected devices, each with egress bandwidth $W$ bytes/s and $C$ FLOP/s; a
# ring all-gather or reduce-scatter of $S$ bytes takes $\frac{N-1}{N}\frac{S}{W}$, a ring all-reduce twice that.
# The layer is $x_1 = x W_1$, $x_2 = x W_2$, $z = f(x_1) * x_2$, $y = z W_3$ with $x \in \mathbb{R}^{B \times D}$
# ($B$ tokens), $W_1, W_2 \in \mathbb{R}^{D \times D_{FF}}$, $W_3 \in \mathbb{R}^{D_{FF} \times D}$; everything is
# FP16 (2 bytes), only matmuls cost FLOPs ($2abc$), and a pass is communication-bound when its communication
# (which may overlap compute) takes longer than its compute. The derivations are in the notebook
# (`notebooks/32_parallelism_calcs.py`, not printed here); every formula is implemented and tested in `cs336_systems.accounting` (`tests/test_accounting.py` checks each
# bound at its threshold and one device past it, and simulates both ring algorithms step by step).

# %% [markdown] tags=["remove-cell"]
# **Setting: the backward pass.**
# $$dz = dy\, W_3^\top,\quad dx_2 = dz * f(x_1),\quad dx_1 = dz * f'(x_1) * x_2,\quad
#   dx = dx_1 W_1^\top + dx_2 W_2^\top,$$
# $$dW_3 = z^\top dy,\quad dW_2 = x^\top dx_2,\quad dW_1 = x^\top dx_1 .$$

# %% tags=["parameters"]
measure = "auto"  # unused: this problem is pure computation (kept for a uniform notebook interface)
quick = False  # unused for the same reason; the notebook runs in about a second either way
model_size = "8B_leaderboard"  # D and D_FF of the numeric illustration (the 2026 leaderboard model)
batch_tokens = 16384  # B of the numeric illustration (e.g. 32 sequences of 512 tokens)
device = "H100 SXM"  # a key of accounting.ACCELERATORS: gives C and W
allreduce_bytes = 1e9  # S of the ring-algorithm illustration (1 GB)
n_max = 64  # right edge of the plots over N

# %% tags=["remove-input"]
import matplotlib.pyplot as plt

from cs336_systems.report import latex_number, nb, save_figure, show_table
from cs336_systems.studies.written import parallelism_calcs

results_dir = nb.setup(quick)
SOURCE = parallelism_calcs.provenance()
setting = parallelism_calcs.Setting(model_size=model_size, batch_tokens=batch_tokens, device=device)
facts = parallelism_calcs.facts(setting, allreduce_bytes=allreduce_bytes)

# %% [markdown]
# **Answers.**
#
# * **alternate_ring_all_reduce:** $T_\text{alt} = (N-1)\,S/W$: each of the $N-1$ steps ships a whole $S$-byte
#   tensor over every link at once, $N/2$ times the $2\frac{N-1}{N}\frac{S}{W}$ of the reduce-scatter + all-gather ring.
# * **data_parallel_calcs:** (a) $F_\text{bwd} = 12BDD_{FF}/N_{DP}$ FLOPs per device; (b) the all-reduce of the
#   $6DD_{FF}$ bytes of weight gradients takes $T_\text{comm,bwd} = 12(N_{DP}-1)DD_{FF}/(N_{DP}W)$; (c) compute-bound
#   iff $N_{DP} \le 1 + BW/C$ ($D$ and $D_{FF}$ cancel: only the tokens per step decide).
# * **fsdp_calcs:** (a) $F_\text{fwd} = 6BDD_{FF}/N_{FSDP}$, $F_\text{bwd} = 12BDD_{FF}/N_{FSDP}$; (b) with $N = N_{FSDP}$,
#   $T_\text{comm,fwd} = \frac{N-1}{N}\frac{6DD_{FF}}{W}$ (all-gather) and $T_\text{comm,bwd} = \frac{12(N-1)DD_{FF}}{NW}$
#   (all-gather + reduce-scatter); (c) $N_{FSDP} \le 1 + BW/C$ in both passes, the DP bound.
# * **tp_calcs:** (a) every device has the full $dy$ after the forward all-reduce, so
#   $dz^{(i)} = dy\,W_3^{(i)\top}$, $dW_3^{(i)} = z^{(i)\top} dy$, $dx_2^{(i)} = dz^{(i)} * f(x_1^{(i)})$,
#   $dx_1^{(i)} = dz^{(i)} * f'(x_1^{(i)}) * x_2^{(i)}$, $dW_1^{(i)} = x^\top dx_1^{(i)}$, $dW_2^{(i)} = x^\top dx_2^{(i)}$
#   (all local) and $dx = \text{AllReduce}_i\big(dx_1^{(i)} W_1^{(i)\top} + dx_2^{(i)} W_2^{(i)\top}\big)$; (b)
#   $F_\text{fwd} = 6BDD_{FF}/N_{TP}$, $F_\text{bwd} = 12BDD_{FF}/N_{TP}$; (c) one all-reduce of $2BD$ bytes per pass,
#   $T_\text{comm,fwd} = T_\text{comm,bwd} = 4(N_{TP}-1)BD/(N_{TP}W)$; (d) $N_{TP} \le 1 + \frac{3}{2}D_{FF}W/C$ (the
#   forward binds; backward $1 + 3D_{FF}W/C$).
# * **fsdp_tp_calcs** ($N = N_{TP}N_{FSDP}$, $\frac{N-1}{N} \approx 1$): (a) $F_\text{fwd} = 6BDD_{FF}/N$; (b)
#   $T_\text{comm,fwd} = \max\big(\frac{6DD_{FF}}{N_{TP}W}, \frac{4BD}{N_{FSDP}W}\big)$ with overlapping axes; (c)
#   $N_{FSDP} \le BW/C$ and $N_{TP} \le \frac{3}{2}D_{FF}W/C$, so $N \le \frac{3}{2}BD_{FF}W^2/C^2$; (d) without overlap
#   the sum must fit, and AM-GM gives $N \le \frac{3}{8}BD_{FF}W^2/C^2$ at $N_{FSDP} = \frac{BW}{2C}$,
#   $N_{TP} = \frac{3}{4}\frac{D_{FF}W}{C}$, a quarter of the overlapped maximum.

# %% tags=["remove-input"]
nb.md(
    rf"""**Numerically.** All-reducing {facts["allreduce_GB"]:g} GB over 8 GPUs at $W = {latex_number(facts["bandwidth_GBps"])}$ GB/s takes
{facts["alternate_8_ms"]:.1f} ms instead of {facts["ring_8_ms"]:.2f} ms.
For 8.2-8.5, with the {setting.accelerator.name} constants of the table below, $C/W = {latex_number(facts["flops_per_byte"], ",.1f")}$ FLOP per
byte, so a device must do about {facts["flops_per_byte"]:,.0f} FLOPs for every byte it sends. For the {model_size} FFN layer and
$B = {latex_number(batch_tokens)}$ tokens: DP and FSDP stay compute-bound up to $N \le 1 + BW/C = {facts["dp_max_devices"]:.2f}$ devices, so one 8-GPU node
is just enough, and 16 devices with the same $W$ would need $B \ge (16 - 1) \cdot C/W \approx {latex_number(facts["min_batch_16_devices"])}$ tokens
(more across nodes, where the per-GPU network bandwidth is well below NVLink's).
TP is independent of the batch: $N_{{TP}} \le 1 + \tfrac{{3}}{{2}} D_{{FF}} W/C = {facts["tp_max_devices_forward"]:.2f}$ for the forward and
${facts["tp_max_devices_backward"]:.2f}$ for the backward. The 2D grid multiplies the two limits: with overlapping axes
$N_{{FSDP}} \le {facts["overlapped_max_fsdp"]:.2f}$ and $N_{{TP}} \le {facts["overlapped_max_tp"]:.2f}$, i.e. $N \le {facts["overlapped_max_devices"]:.0f}$ devices; without overlap the
AM-GM optimum $N_{{FSDP}} = {facts["serialized_fsdp"]:.2f}$, $N_{{TP}} = {facts["serialized_tp"]:.2f}$ allows only $N \le {facts["serialized_max_devices"]:.0f}$. On a {facts["other_name"]}
($C/W = {latex_number(facts["other_flops_per_byte"], ",.0f")}$) the same bounds are
{facts["other_dp_max_devices"]:.2f} (DP), {facts["other_tp_max_devices_forward"]:.2f} (TP forward) and
{facts["other_overlapped_max_devices"]:.0f} (2D, overlapped): faster
compute without proportionally faster links makes every scheme communication-bound sooner. These use datasheet
link rates; a measured all-reduce bandwidth (problem distributed_communication_single_node) is lower and would
tighten every bound in proportion."""
)

# %% tags=["remove-input"]
show_table(
    parallelism_calcs.constants_table(setting),
    caption="Constants of the numeric illustrations",
    provenance_from=f"{setting.accelerator.source}; {SOURCE}",
)

# %% tags=["remove-input", "remove-cell"]
save_figure(
    parallelism_calcs.plot_all_reduce_times(setting, allreduce_bytes, n_max),
    "alternate_ring_all_reduce__time_vs_n",
)
plt.show()

# %% [markdown] tags=["remove-cell"]
# **alternate_ring_all_reduce.** *Device $i$ starts with $y = x^{(i)}$; for $t = 1, \dots, N-1$ it sends $x^{((i-t+1) \bmod N)}$ to device
# $i+1$, receives $x^{((i-t) \bmod N)}$ from device $i-1$ and adds it to $y$. How long does this take?*
#
# At every step each device forwards one **whole** input tensor ($S$ bytes) to its neighbour. All $N$
# links work in parallel, so a step takes $S/W$ (limited by each sender's egress), and after $N-1$ steps
# every device has added all $N$ inputs:
# $$T_\text{alt} = (N-1)\,\frac{S}{W}.$$
# The bandwidth-optimal ring sends chunks of $S/N$ bytes for $2(N-1)$ steps,
# $T_\text{ring} = 2\frac{N-1}{N}\frac{S}{W}$, so the alternate scheme is $N/2$ times slower: its traffic
# per device grows linearly with $N$ instead of staying below $2S$.

# %% tags=["remove-input", "remove-cell"]
show_table(
    parallelism_calcs.simulation_table(),
    caption="Step-by-step simulation of both all-reduce algorithms (both produce the exact sum)",
    provenance_from=SOURCE,
)

# %% [markdown] tags=["remove-cell"]
# **data_parallel_calcs.** Each of the $N_{DP}$ devices holds all weights and a batch shard $x^{(i)} \in \mathbb{R}^{(B/N_{DP}) \times D}$;
# the forward needs no communication and the weight gradients are all-reduced in the backward.
#
# **(a) Backward FLOPs per device.** Each of the three forward matmuls has two backward matmuls of the same
# size (one for the input gradient: $dz = dy W_3^\top$ and the two products in $dx$; one for the weight
# gradient: $dW_3, dW_2, dW_1$), each $2 \frac{B}{N_{DP}} D D_{FF}$ FLOPs on the local shard:
# $$F_\text{bwd} = 6 \cdot 2\,\frac{B}{N_{DP}}\,D\,D_{FF} = \frac{12\,B\,D\,D_{FF}}{N_{DP}}.$$
# **(b) Backward communication.** All-reduce the gradients of $W_1, W_2, W_3$: $3 D D_{FF}$ FP16 values,
# $S = 6 D D_{FF}$ bytes:
# $$T_\text{comm,bwd} = 2\,\frac{N_{DP}-1}{N_{DP}}\,\frac{6 D D_{FF}}{W} = \frac{12\,(N_{DP}-1)\,D\,D_{FF}}{N_{DP}\,W}.$$
# **(c) Largest $N_{DP}$.** Compute-bound while $T_\text{comm,bwd} \le F_\text{bwd}/C$:
# $$\frac{12 (N_{DP}-1) D D_{FF}}{N_{DP} W} \le \frac{12 B D D_{FF}}{N_{DP} C}
#   \iff N_{DP} \le 1 + \frac{B\,W}{C}.$$
# $D$ and $D_{FF}$ cancel: both compute and gradient traffic scale with the weight size, so only the
# tokens per step decide. Adding devices does not reduce the bytes each device sends, but divides its
# compute.

# %% [markdown] tags=["remove-cell"]
# **fsdp_calcs.** Each device holds $1/N_{FSDP}$ of every weight ($D D_{FF} / N_{FSDP}$ values) and a batch shard. The forward
# all-gathers $W_1, W_2, W_3$; the backward all-gathers them again and reduce-scatters their gradients.
#
# **(a) FLOPs per device.** The matmuls are those of DP, on $B/N_{FSDP}$ rows:
# $$F_\text{fwd} = \frac{6\,B\,D\,D_{FF}}{N_{FSDP}}, \qquad F_\text{bwd} = \frac{12\,B\,D\,D_{FF}}{N_{FSDP}}.$$
# **(b) Communication.** The gathered weights are $S = 6 D D_{FF}$ bytes; writing $N = N_{FSDP}$,
# $$T_\text{comm,fwd} = \frac{N-1}{N}\,\frac{6 D D_{FF}}{W},$$
# $$T_\text{comm,bwd} = \underbrace{\frac{N-1}{N}\frac{6 D D_{FF}}{W}}_\text{all-gather}
#   + \underbrace{\frac{N-1}{N}\frac{6 D D_{FF}}{W}}_\text{reduce-scatter}
#   = \frac{12 (N-1) D D_{FF}}{N W}.$$
# **(c) Largest $N_{FSDP}$.** Forward: $\frac{6 (N-1) D D_{FF}}{N W} \le \frac{6 B D D_{FF}}{N C}$; backward:
# the same with 12 on both sides. Both give
# $$N_{FSDP} \le 1 + \frac{B\,W}{C},$$
# the DP bound: FSDP moves the same bytes per FLOP as DP (an all-reduce is a reduce-scatter plus an
# all-gather) and saves memory in exchange for the forward's extra all-gather, which its extra compute covers.

# %% [markdown] tags=["remove-cell"]
# **tp_calcs.** $W_1, W_2$ are split by columns and $W_3$ by rows: device $i$ holds
# $W_1^{(i)}, W_2^{(i)} \in \mathbb{R}^{D \times D_{FF}/N_{TP}}$ and $W_3^{(i)} \in \mathbb{R}^{D_{FF}/N_{TP} \times D}$,
# sees the whole batch $x \in \mathbb{R}^{B \times D}$, and computes
# $x_1^{(i)} = x W_1^{(i)}$, $x_2^{(i)} = x W_2^{(i)}$, $z^{(i)} = f(x_1^{(i)}) * x_2^{(i)}$,
# $y^{(i)} = z^{(i)} W_3^{(i)}$, $y = \text{AllReduce}_i(y^{(i)})$.
#
# **(a) Backward.** $y$ is replicated after the all-reduce, so every device has the full $dy \in \mathbb{R}^{B \times D}$
# without communication. With the saved $x, x_1^{(i)}, x_2^{(i)}, z^{(i)}$ ($y^{(i)}$ is not needed):
# $$\begin{aligned}
# dz^{(i)} &= dy\, W_3^{(i)\top} && (B \times D_{FF}/N_{TP}) \\
# dW_3^{(i)} &= z^{(i)\top} dy && (D_{FF}/N_{TP} \times D) \\
# dx_2^{(i)} &= dz^{(i)} * f(x_1^{(i)}) && (B \times D_{FF}/N_{TP}) \\
# dx_1^{(i)} &= dz^{(i)} * f'(x_1^{(i)}) * x_2^{(i)} && (B \times D_{FF}/N_{TP}) \\
# dW_1^{(i)} &= x^\top dx_1^{(i)}, \quad dW_2^{(i)} = x^\top dx_2^{(i)} && (D \times D_{FF}/N_{TP}) \\
# dx^{(i)} &= dx_1^{(i)} W_1^{(i)\top} + dx_2^{(i)} W_2^{(i)\top} && (B \times D), \text{ a partial sum over the } D_{FF} \text{ slices} \\
# dx &= \text{AllReduce}_i\big(dx^{(i)}\big) && (B \times D)
# \end{aligned}$$
# The weight gradients are local (each device owns its slices); the only collective is the all-reduce of
# $dx$, the transpose of the forward's all-reduce of $y$.
#
# **(b) FLOPs per device.** Three forward and six backward matmuls, each over a $D_{FF}/N_{TP}$ slice:
# $$F_\text{fwd} = \frac{6\,B\,D\,D_{FF}}{N_{TP}}, \qquad F_\text{bwd} = \frac{12\,B\,D\,D_{FF}}{N_{TP}}.$$
# **(c) Communication.** One all-reduce of a $(B, D)$ FP16 tensor ($2BD$ bytes) in each pass:
# $$T_\text{comm,fwd} = T_\text{comm,bwd} = 2\,\frac{N_{TP}-1}{N_{TP}}\,\frac{2 B D}{W} = \frac{4 (N_{TP}-1) B D}{N_{TP} W}.$$
# **(d) Largest $N_{TP}$.** Here $B$ and $D$ cancel and the hidden width decides:
# $$\text{forward: } \frac{4 (N-1) B D}{N W} \le \frac{6 B D D_{FF}}{N C} \iff N_{TP} \le 1 + \frac{3}{2}\frac{D_{FF}\,W}{C},
# \qquad \text{backward: } N_{TP} \le 1 + 3\,\frac{D_{FF}\,W}{C}.$$
# The forward binds first (the same traffic as the backward for half the FLOPs).

# %% [markdown] tags=["remove-cell"]
# **fsdp_tp_calcs.** On an $N_{TP} \times N_{FSDP}$ grid, device $(i, j)$ holds $W_1^{(i,j)}, W_2^{(i,j)} \in \mathbb{R}^{D/N_{FSDP} \times D_{FF}/N_{TP}}$,
# $W_3^{(i,j)} \in \mathbb{R}^{D_{FF}/N_{TP} \times D/N_{FSDP}}$ and $x^{(j)} \in \mathbb{R}^{B/N_{FSDP} \times D}$. The forward
# all-gathers every weight over the FSDP axis into $W^{(i)}$, computes $x^{(j)} W_1^{(i)}$, $x^{(j)} W_2^{(i)}$,
# $z = f(x_1) * x_2$, $y^{(i,j)} = z W_3^{(i)}$, and all-reduces $y^{(i,j)}$ over the TP axis into $y^{(j)}$.
# Below $\frac{N-1}{N} \approx 1$, as the handout suggests.
#
# **(a) Forward FLOPs per device.** Three matmuls of a $(B/N_{FSDP}) \times D$ block with a $D \times (D_{FF}/N_{TP})$ block:
# $$F_\text{fwd} = 3 \cdot 2\,\frac{B}{N_{FSDP}}\,D\,\frac{D_{FF}}{N_{TP}} = \frac{6\,B\,D\,D_{FF}}{N}, \qquad N = N_{TP} N_{FSDP}.$$
# **(b) Forward communication.** The FSDP all-gathers assemble $3 D D_{FF}/N_{TP}$ values ($6 D D_{FF}/N_{TP}$ bytes);
# the TP all-reduce moves a $(B/N_{FSDP}) \times D$ tensor ($2BD/N_{FSDP}$ bytes) twice. With both axes overlapping:
# $$T_\text{comm,fwd} = \max\!\left(\frac{6\,D\,D_{FF}}{N_{TP}\,W},\ \frac{4\,B\,D}{N_{FSDP}\,W}\right).$$
# **(c) Largest $N$ with overlapping axes.** Each term must stay below $F_\text{fwd}/C = 6BDD_{FF}/(N_{TP} N_{FSDP} C)$:
# $$\frac{6 D D_{FF}}{N_{TP} W} \le \frac{6 B D D_{FF}}{N_{TP} N_{FSDP} C} \iff N_{FSDP} \le \frac{B W}{C}, \qquad
#   \frac{4 B D}{N_{FSDP} W} \le \frac{6 B D D_{FF}}{N_{TP} N_{FSDP} C} \iff N_{TP} \le \frac{3}{2}\frac{D_{FF} W}{C}.$$
# The two conditions are independent, so the optimum takes both at their limits:
# $$N = N_{TP} N_{FSDP} \le \frac{3}{2}\,\frac{B\,D_{FF}\,W^2}{C^2}.$$
# (Keeping the $\frac{N-1}{N}$ factors gives $(1 + \frac{BW}{C})(1 + \frac{3}{2}\frac{D_{FF}W}{C})$.)
#
# **(d) Largest $N$ when the axes cannot overlap.** Now the sum must fit:
# $$\frac{6 D D_{FF}}{N_{TP} W} + \frac{4 B D}{N_{FSDP} W} \le \frac{6 B D D_{FF}}{N C}
#   \iff 6 D_{FF} N_{FSDP} + 4 B N_{TP} \le \frac{6 B D_{FF} W}{C}$$
# (multiplying by $N W / D$). For a fixed product $N_{FSDP} N_{TP} = N$, AM-GM bounds the left side from below:
# $$6 D_{FF} N_{FSDP} + 4 B N_{TP} \ \ge\ 2\sqrt{6 D_{FF} N_{FSDP} \cdot 4 B N_{TP}} = 2\sqrt{24\, B\, D_{FF}\, N},$$
# with equality iff $6 D_{FF} N_{FSDP} = 4 B N_{TP}$. So some split is compute-bound iff
# $2\sqrt{24 B D_{FF} N} \le 6 B D_{FF} W / C$, i.e.
# $$N \le \frac{36\, B^2 D_{FF}^2 W^2 / C^2}{96\, B\, D_{FF}} = \frac{3}{8}\,\frac{B\,D_{FF}\,W^2}{C^2},$$
# reached at $N_{FSDP} = \frac{BW}{2C}$, $N_{TP} = \frac{3}{4}\frac{D_{FF} W}{C}$: half of each limit of (c), and
# a quarter of the overlapped maximum.

# %% tags=["remove-input", "remove-cell"]
show_table(
    parallelism_calcs.summary_table(setting),
    caption=f"One FFN layer (D = {setting.d_model}, D_FF = {setting.d_ff}, B = {batch_tokens} tokens) "
    f"on N = {parallelism_calcs.EXAMPLE_DEVICES} {setting.accelerator.name}",
    provenance_from=SOURCE,
    note="max N: the closed-form bound (exact (N-1)/N factors for DP, FSDP, TP; (N-1)/N ~ 1 for the 2D grid)",
)
save_figure(parallelism_calcs.plot_bounds(setting, n_max), "parallelism_calcs__bounds")
plt.show()
