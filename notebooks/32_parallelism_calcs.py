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
# # 8 Parallelism calculations (2026): alternate_ring_all_reduce, data_parallel_calcs, fsdp_calcs, tp_calcs, fsdp_tp_calcs
# Five written problems of the 2026 handout's section 8 about one FFN layer spread over $N$ devices: how
# long a naive ring all-reduce takes, and for data parallelism (DP), fully sharded data parallelism
# (FSDP), tensor parallelism (TP) and a 2D FSDP $\times$ TP grid, the FLOPs and communication time of the
# forward and backward passes and the largest device count before communication dominates.
#
# **Setting (handout).** $N$ fully connected devices, each with egress bandwidth $W$ bytes/s. A ring
# all-gather or reduce-scatter of a tensor of $S$ bytes takes $\frac{N-1}{N}\frac{S}{W}$ and a ring
# all-reduce (reduce-scatter then all-gather) $2\frac{N-1}{N}\frac{S}{W}$. The layer is
# $$x_1 = x W_1,\quad x_2 = x W_2,\quad z = f(x_1) * x_2,\quad y = z W_3,$$
# with $x \in \mathbb{R}^{B \times D}$, $W_1, W_2 \in \mathbb{R}^{D \times D_{FF}}$,
# $W_3 \in \mathbb{R}^{D_{FF} \times D}$ ($B$ counts tokens). Its backward is
# $$dz = dy\, W_3^\top,\quad dx_2 = dz * f(x_1),\quad dx_1 = dz * f'(x_1) * x_2,\quad
#   dx = dx_1 W_1^\top + dx_2 W_2^\top,$$
# $$dW_3 = z^\top dy,\quad dW_2 = x^\top dx_2,\quad dW_1 = x^\top dx_1 .$$
# Everything is FP16 (2 bytes); only matmuls cost FLOPs, $2abc$ for $(a,b)\times(b,c)$; $C$ is the
# device's FLOP/s. Communication may overlap compute, so a pass is communication-bound when its
# communication time exceeds its compute time.
#
# All formulas are implemented and tested in `cs336_systems.accounting`
# (`tests/test_accounting.py` checks every bound at its threshold and one device past it, and simulates
# both ring algorithms step by step). Nothing is measured here.

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
import numpy as np
import pandas as pd
from matplotlib.ticker import NullFormatter, ScalarFormatter

from cs336_systems import accounting as acc
from cs336_systems.measure.results import env_metadata
from cs336_systems.model.config import get_config
from cs336_systems.report import nb, save_figure, show_table

results_dir = nb.setup(quick)
SOURCE = f"computed analytically by cs336_systems.accounting at git {env_metadata()['git_sha']}"
cfg = get_config(model_size)
D, DFF, B = cfg.d_model, cfg.d_ff, batch_tokens
dev = acc.ACCELERATORS[device]
C, W = dev.flops_per_s, dev.link_bytes_per_s


def num(x, spec=",.0f"):
    """A number for LaTeX math: thousands separators as {,} so they do not get punctuation spacing."""
    return format(x, spec).replace(",", "{,}")


show_table(
    pd.DataFrame(
        [
            {"symbol": "D", "value": D, "meaning": f"d_model of the {model_size} config"},
            {"symbol": "D_FF", "value": DFF, "meaning": f"d_ff of the {model_size} config"},
            {"symbol": "B", "value": B, "meaning": "tokens in the global batch"},
            {"symbol": "C [TFLOP/s]", "value": C / 1e12, "meaning": f"{dev.name} dense fp16/bf16 peak"},
            {"symbol": "W [GB/s]", "value": W / acc.GB, "meaning": f"{dev.name} NVLink egress per GPU"},
            {"symbol": "C / W [FLOP/B]", "value": C / W, "meaning": "FLOPs needed per byte sent"},
        ]
    ),
    caption="Constants of the numeric illustrations",
    provenance_from=f"{dev.source}; {SOURCE}",
)

# %% [markdown]
# ## 8.1 alternate_ring_all_reduce
# *Device $i$ starts with $y = x^{(i)}$; for $t = 1, \dots, N-1$ it sends $x^{((i-t+1) \bmod N)}$ to device
# $i+1$, receives $x^{((i-t) \bmod N)}$ from device $i-1$ and adds it to $y$. How long does this take?*
#
# At every step each device forwards one **whole** input tensor ($S$ bytes) to its neighbour. All $N$
# links work in parallel, so a step takes $S/W$ (limited by each sender's egress), and after $N-1$ steps
# every device has added all $N$ inputs:
# $$T_\text{alt} = (N-1)\,\frac{S}{W}.$$
# The bandwidth-optimal ring sends chunks of $S/N$ bytes for $2(N-1)$ steps,
# $T_\text{ring} = 2\frac{N-1}{N}\frac{S}{W}$, so the alternate scheme is $N/2$ times slower: its traffic
# per device grows linearly with $N$ instead of staying below $2S$.

# %% tags=["remove-input"]
sim_rows = []
rng = np.random.default_rng(0)
for n in range(2, 9):
    data = [rng.standard_normal(840) for _ in range(n)]  # 840 elements: divisible by 2..8
    s = 840 * 2  # fp16 bytes
    alt = acc.simulate_alternate_ring_all_reduce(data, itemsize=2)
    rs, ag = acc.simulate_ring_all_reduce(data, itemsize=2)
    assert all(np.allclose(o, np.sum(data, axis=0)) for o in alt.outputs + ag.outputs)
    sim_rows.append(
        {
            "N": n,
            "alternate: simulated [S/W]": alt.time(1.0) / s,
            "(N-1)": n - 1,
            "ring: simulated [S/W]": (rs.time(1.0) + ag.time(1.0)) / s,
            "2(N-1)/N": 2 * (n - 1) / n,
            "slowdown": alt.time(1.0) / (rs.time(1.0) + ag.time(1.0)),
        }
    )
show_table(
    pd.DataFrame(sim_rows),
    caption="Step-by-step simulation of both all-reduce algorithms (both produce the exact sum)",
    provenance_from=SOURCE,
)

fig, ax = plt.subplots()
ns = np.arange(2, n_max + 1)
ax.plot(
    ns,
    [acc.alternate_ring_all_reduce_time(allreduce_bytes, n, W) * 1e3 for n in ns],
    label="alternate: $(N-1)S/W$",
)
ax.plot(ns, [acc.ring_all_reduce_time(allreduce_bytes, n, W) * 1e3 for n in ns], label="ring: $2(N-1)S/(NW)$")
ax.set(yscale="log", xlabel="devices N", ylabel="all-reduce time [ms]")
ax.set_xscale("log", base=2)
ax.xaxis.set_major_formatter(ScalarFormatter())
ax.xaxis.set_minor_formatter(NullFormatter())
ax.set_title(f"All-reduce of S = {allreduce_bytes / acc.GB:g} GB at W = {W / acc.GB:g} GB/s")
ax.legend()
save_figure(fig, "alternate_ring_all_reduce__time_vs_n")
plt.show()

# %% tags=["remove-input"]
t_alt8 = acc.alternate_ring_all_reduce_time(allreduce_bytes, 8, W)
t_ring8 = acc.ring_all_reduce_time(allreduce_bytes, 8, W)
nb.md(
    rf"""**Answer.** $T_\text{{alt}} = (N-1)\,S/W$: each of the $N-1$ steps ships a full $S$-byte tensor over every
link at once, which is $N/2$ times the $2\frac{{N-1}}{{N}}\frac{{S}}{{W}}$ of the reduce-scatter + all-gather ring. For
example, all-reducing {allreduce_bytes / acc.GB:g} GB over 8 GPUs at $W = {num(W / acc.GB)}$ GB/s takes
{t_alt8 * 1e3:.1f} ms instead of {t_ring8 * 1e3:.2f} ms."""
)

# %% [markdown]
# ## 8.2 data_parallel_calcs
# Each of the $N_{DP}$ devices holds all weights and a batch shard $x^{(i)} \in \mathbb{R}^{(B/N_{DP}) \times D}$;
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

# %% [markdown]
# ## 8.3 fsdp_calcs
# Each device holds $1/N_{FSDP}$ of every weight ($D D_{FF} / N_{FSDP}$ values) and a batch shard. The forward
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

# %% [markdown]
# ## 8.4 tp_calcs
# $W_1, W_2$ are split by columns and $W_3$ by rows: device $i$ holds
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

# %% [markdown]
# ## 8.5 fsdp_tp_calcs
# On an $N_{TP} \times N_{FSDP}$ grid, device $(i, j)$ holds $W_1^{(i,j)}, W_2^{(i,j)} \in \mathbb{R}^{D/N_{FSDP} \times D_{FF}/N_{TP}}$,
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

# %% tags=["remove-input"]
n_dp = acc.dp_max_devices(B, C, W)
n_tp_f, n_tp_b = acc.tp_max_devices_forward(DFF, C, W), acc.tp_max_devices_backward(DFF, C, W)
nf_o, nt_o = acc.fsdp_tp_max_axes_overlapped(B, DFF, C, W)
nf_s, nt_s = acc.fsdp_tp_max_axes_serialized(B, DFF, C, W)
n8 = 8
fsdp_tp_8 = acc.fsdp_tp_forward_comm_times(B, D, DFF, 2, 4, W)
rows = [
    {
        "scheme, pass": "DP, backward",
        "compute/device [ms]": acc.dp_backward_flops_per_device(B, D, DFF, n8) / C * 1e3,
        "comm [ms]": acc.dp_backward_comm_time(D, DFF, n8, W) * 1e3,
        "max N": n_dp,
    },
    {
        "scheme, pass": "FSDP, forward",
        "compute/device [ms]": acc.fsdp_forward_flops_per_device(B, D, DFF, n8) / C * 1e3,
        "comm [ms]": acc.fsdp_forward_comm_time(D, DFF, n8, W) * 1e3,
        "max N": acc.fsdp_max_devices(B, C, W),
    },
    {
        "scheme, pass": "FSDP, backward",
        "compute/device [ms]": acc.fsdp_backward_flops_per_device(B, D, DFF, n8) / C * 1e3,
        "comm [ms]": acc.fsdp_backward_comm_time(D, DFF, n8, W) * 1e3,
        "max N": acc.fsdp_max_devices(B, C, W),
    },
    {
        "scheme, pass": "TP, forward",
        "compute/device [ms]": acc.tp_forward_flops_per_device(B, D, DFF, n8) / C * 1e3,
        "comm [ms]": acc.tp_forward_comm_time(B, D, n8, W) * 1e3,
        "max N": n_tp_f,
    },
    {
        "scheme, pass": "TP, backward",
        "compute/device [ms]": acc.tp_backward_flops_per_device(B, D, DFF, n8) / C * 1e3,
        "comm [ms]": acc.tp_backward_comm_time(B, D, n8, W) * 1e3,
        "max N": n_tp_b,
    },
    {
        "scheme, pass": "FSDP 4 x TP 2, forward, overlapped",
        "compute/device [ms]": acc.fsdp_tp_forward_flops_per_device(B, D, DFF, 2, 4) / C * 1e3,
        "comm [ms]": fsdp_tp_8.overlapped * 1e3,
        "max N": nf_o * nt_o,
    },
    {
        "scheme, pass": "FSDP 4 x TP 2, forward, serialized",
        "compute/device [ms]": acc.fsdp_tp_forward_flops_per_device(B, D, DFF, 2, 4) / C * 1e3,
        "comm [ms]": fsdp_tp_8.serialized * 1e3,
        "max N": nf_s * nt_s,
    },
]
summary = pd.DataFrame(rows)
summary["comm / compute"] = summary["comm [ms]"] / summary["compute/device [ms]"]
show_table(
    summary,
    caption=f"One FFN layer (D = {D}, D_FF = {DFF}, B = {B} tokens) on N = {n8} {dev.name}",
    provenance_from=SOURCE,
    note="max N: the closed-form bound (exact (N-1)/N factors for DP, FSDP, TP; (N-1)/N ~ 1 for the 2D grid)",
)

fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
ns = np.arange(2, n_max + 1)
ratio = {
    "DP / FSDP (bwd)": [
        acc.dp_backward_comm_time(D, DFF, n, W) / (acc.dp_backward_flops_per_device(B, D, DFF, n) / C)
        for n in ns
    ],
    "TP forward": [
        acc.tp_forward_comm_time(B, D, n, W) / (acc.tp_forward_flops_per_device(B, D, DFF, n) / C) for n in ns
    ],
    "TP backward": [
        acc.tp_backward_comm_time(B, D, n, W) / (acc.tp_backward_flops_per_device(B, D, DFF, n) / C)
        for n in ns
    ],
}
for (label, r), ls in zip(ratio.items(), ["-", "--", "-"]):
    axes[0].plot(ns, r, ls=ls, label=label)  # DP and TP forward coincide when B ~ 1.5 D_FF
axes[0].axhline(1.0, color="k", ls="--", lw=1)
axes[0].set(yscale="log", xlabel="devices N", ylabel="comm time / compute time")
axes[0].set_xscale("log", base=2)
axes[0].xaxis.set_major_formatter(ScalarFormatter())
axes[0].xaxis.set_minor_formatter(NullFormatter())
axes[0].set_title(f"B = {B} tokens, {dev.name}")
axes[0].legend(fontsize="small")
bs = np.logspace(2, 6, 100)
axes[1].plot(bs, acc.dp_max_devices(bs, C, W), label="DP / FSDP: $1 + BW/C$")
axes[1].plot(bs, np.full_like(bs, n_tp_f), label=r"TP fwd: $1 + \frac{3}{2} D_{FF} W/C$")
axes[1].plot(
    bs,
    acc.fsdp_tp_max_devices_overlapped(bs, DFF, C, W),
    label=r"FSDP x TP, overlapped: $\frac{3}{2} B D_{FF} W^2/C^2$",
)
axes[1].plot(
    bs,
    acc.fsdp_tp_max_devices_serialized(bs, DFF, C, W),
    ls="--",
    label=r"FSDP x TP, serialized: $\frac{3}{8} B D_{FF} W^2/C^2$",
)
axes[1].set(xscale="log", yscale="log", xlabel="batch B [tokens]", ylabel="largest compute-bound N")
axes[1].set_ylim(bottom=1)
axes[1].set_title(f"D_FF = {DFF}, {dev.name}")
axes[1].legend(fontsize="small")
fig.tight_layout()
save_figure(fig, "parallelism_calcs__bounds")
plt.show()

# %% tags=["remove-input"]
other = acc.B200
nb.md(
    rf"""**Answers (8.2-8.5, numerically).** With the {dev.name} constants above, $C/W = {num(C / W, ",.1f")}$ FLOP per
byte, so a device must do about {C / W:,.0f} FLOPs for every byte it sends. For the {model_size} FFN layer and
$B = {num(B)}$ tokens: DP and FSDP stay compute-bound up to $N \le 1 + BW/C = {n_dp:.2f}$ devices, so one 8-GPU node
is just enough, and 16 devices with the same $W$ would need $B \ge (16 - 1) \cdot C/W \approx {num(15 * C / W)}$ tokens
(more across nodes, where the per-GPU network bandwidth is well below NVLink's).
TP is independent of the batch: $N_{{TP}} \le 1 + \tfrac{{3}}{{2}} D_{{FF}} W/C = {n_tp_f:.2f}$ for the forward and
${n_tp_b:.2f}$ for the backward. The 2D grid multiplies the two limits: with overlapping axes
$N_{{FSDP}} \le {nf_o:.2f}$ and $N_{{TP}} \le {nt_o:.2f}$, i.e. $N \le {nf_o * nt_o:.0f}$ devices; without overlap the
AM-GM optimum $N_{{FSDP}} = {nf_s:.2f}$, $N_{{TP}} = {nt_s:.2f}$ allows only $N \le {nf_s * nt_s:.0f}$. On a {other.name}
($C/W = {num(other.flops_per_byte, ",.0f")}$) the same bounds are
{acc.dp_max_devices(B, other.flops_per_s, other.link_bytes_per_s):.2f} (DP), {acc.tp_max_devices_forward(DFF, other.flops_per_s, other.link_bytes_per_s):.2f} (TP forward) and
{acc.fsdp_tp_max_devices_overlapped(B, DFF, other.flops_per_s, other.link_bytes_per_s):.0f} (2D, overlapped): faster
compute without proportionally faster links makes every scheme communication-bound sooner. These use datasheet
link rates; a measured all-reduce bandwidth (problem distributed_communication_single_node) is lower and would
tighten every bound in proportion."""
)
