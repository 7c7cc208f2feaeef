"""Interleaved A/B of Hopper kernel configurations (`flash_bench --ab-fwd` / `--ab-bwd`).

A kernel change is kept when it pays (OPTIMIZATION_LOG.md): each variant, the launcher's default
configuration with some fields replaced (`parse_variant`), is checked against the portable tl
kernels on outputs poisoned with NaN, then timed with cuDNN's pass through SDPA in interleaved rounds
(do_bench medians), all in one process. Printed only: the evidence for a claim stays the protocol's
and the shapes' rows (`flash_bench --leaderboard`).

Each call runs alone at the GPU's power cap, where a kernel that draws less power a cycle clocks
higher: at 32 x 32768 x 128 our backward matched cuDNN's time here while taking 1.065x its cycles,
the ratio the 8B step then showed (OPTIMIZATION_LOG.md, session 22). For what a kernel will do inside
a busy step, compare cycles at fixed clocks too (`ncu --clock-control base` on `flash_bench --once`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pandas as pd
import torch

from cs336_systems.attention.flash_triton import hopper, hopper_configs, launch, tiles
from cs336_systems.studies.attention.flash_leaderboard import bench_all
from cs336_systems.studies.attention.flash_tuning import portable_problem, rel_err

KINDS = ("fwd", "bwd")


# --ab-fwd variants may name the forward kernel: "wg" the one-warpgroup kernel, "ws" the
# warp-specialised one, starting from their classes' defaults, not from head dim d's configuration
# ("wg" has 128-key tiles; "wg+block_n=64" is the one-warpgroup configuration d = 80 had before session 19)
FWD_KERNELS = {"wg": hopper_configs.HopperFwdConfig, "ws": hopper_configs.WarpSpecializedFwdConfig}
# --ab-fwd "tl": the portable tl forward with the launcher's tiles for the problem (the default forward
# wherever `hopper.preferred` is false, such as the 2025 protocol's d = 64)
TL = "tl"


def parse_variant(spec: str, d: int, kind: str = "bwd") -> Any:
    """'default' (the launcher's `kind` pass for head dim d) or 'field=value[+field=value...]': the
    default with those fields replaced, e.g. 'shortest_first=True'. A forward variant may start with
    a kernel of `FWD_KERNELS` ('ws', 'ws+block_n=64'): that kernel's configuration defaults instead
    of the launcher's; 'tl' (forward only) is the portable tl forward. Raises a ValueError naming a bad
    field or value, before any GPU work."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if spec == TL:
        if kind != "fwd":
            raise ValueError(
                "--ab-variants: 'tl' is the portable forward; --ab-bwd takes FIELD=VALUE variants"
            )
        return TL
    base = hopper_configs.heuristic_fwd(d) if kind == "fwd" else hopper_configs.heuristic_bwd(d)
    head, _, rest = spec.partition("+")
    if head in FWD_KERNELS:
        if kind != "fwd":
            raise ValueError(
                f"--ab-variants: {head!r} names a forward kernel; the backward takes FIELD=VALUE"
            )
        base, spec = FWD_KERNELS[head](), rest
    if spec in ("default", ""):
        return base
    try:
        return hopper_configs.with_fields(base, spec)
    except ValueError as err:
        raise ValueError(f"--ab-variants: {err}") from None


def _checked(spec: str, cfg: Any, call: Callable[[], None], outs: Sequence[torch.Tensor], refs) -> None:
    """Run `call` once on poisoned `outs` and raise unless they match `refs` (relative error <= 2e-2)."""
    for t in outs:
        t.fill_(float("nan"))
    call()
    err = max(rel_err(t, r) for t, r in zip(outs, refs, strict=True))
    if not err <= 2e-2:
        raise AssertionError(f"{spec} ({cfg}): relative error {err:.3g} > 2e-2 against the tl kernels")


def _interleaved(
    calls: dict[str, Callable[[], object]], rounds: int, rep_ms: float, title: str, configs
) -> pd.DataFrame:
    """Time every call once per round, rounds interleaved; print the medians against the first."""
    rows = []
    for r in range(rounds):
        for spec, call in calls.items():
            rows.append({"variant": spec, "round": r, "ms": bench_all(call, 100, rep_ms)["p50"]})
    df = pd.DataFrame(rows)
    med = df.groupby("variant", sort=False).ms.median()
    first = med.iloc[0]
    print(f"\n{title}, {rounds} interleaved rounds (median ms)")
    for spec, ms in med.items():
        print(f"{ms:9.3f} ms  {ms / first:6.3f}x  {spec}  {configs.get(spec, 'SDPA cuDNN')}")
    return df


def ab_hopper_backward(
    heads: int, n: int, d: int, variants: Sequence[str], *, rounds: int = 3, rep_ms: float = 1500.0,
    layout: str = "bhnd",
) -> pd.DataFrame:  # fmt: skip
    """The whole Hopper backward (dQ, dK, dV; Delta excluded) of each variant and cuDNN's backward
    (through SDPA's autograd, its own Delta included) on one causal bf16 problem of batch 1 in
    `layout` (`flash_tuning.portable_problem`); one row per variant and round."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    configs = {spec: parse_variant(spec, d, "bwd") for spec in variants}
    q, k, v, _o, _lse, tensors, opts, tma = portable_problem(heads, n, d, torch.bfloat16, "cuda", layout)
    base = tiles.current_config("bwd", n, n, d, torch.bfloat16, True)
    with tiles.use_configs(options=opts):
        launch.launch_bwd(tensors, True, base, opts, tma)
    grads = tensors[4:7]
    refs = [g.clone() for g in grads]
    calls: dict[str, Callable[[], object]] = {}
    for spec, cfg in configs.items():

        def call(cfg=cfg) -> None:
            if not hopper.flash_bwd_hopper(tensors, True, cfg):
                with tiles.use_configs(options=opts):
                    launch.launch_bwd(tensors, True, base, opts, tma, ("dq",))

        _checked(spec, cfg, call, grads, refs)
        calls[spec] = call
    qc, kc, vc = (t.detach().clone().requires_grad_() for t in (q, k, v))
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        out = torch.nn.functional.scaled_dot_product_attention(qc, kc, vc, is_causal=True)
    do = tensors[3].reshape(out.shape)
    calls["cudnn"] = lambda: torch.autograd.grad(out, (qc, kc, vc), do, retain_graph=True)
    title = f"whole backward, {heads} x {n} x {d} bf16 causal, layout {layout}"
    return _interleaved(calls, rounds, rep_ms, title, configs)


def ab_hopper_forward(
    heads: int, n: int, d: int, variants: Sequence[str], *, rounds: int = 3, rep_ms: float = 1500.0,
    layout: str = "bhnd",
) -> pd.DataFrame:  # fmt: skip
    """The Hopper forward (O and the logsumexp) of each variant and cuDNN's forward (SDPA on inputs
    that need gradients, so it too keeps the logsumexp) on one causal bf16 problem of batch 1 in
    `layout`; one row per variant and round."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    configs = {spec: parse_variant(spec, d, "fwd") for spec in variants}
    q, k, v, o_ref, lse_ref, *_ = portable_problem(heads, n, d, torch.bfloat16, "cuda", layout)
    o, lse = torch.empty_like(o_ref), torch.empty_like(lse_ref)
    calls: dict[str, Callable[[], object]] = {}
    for spec, cfg in configs.items():

        def call(cfg=cfg) -> None:
            if cfg == TL:
                with tiles.use_configs(options=tiles.KernelOptions(hopper=False)):
                    launch._flash_fwd_full({"q": q, "k": k, "v": v, "o": o, "lse": lse}, True)
            else:
                hopper.flash_fwd_hopper(q, k, v, o, lse, True, cfg)

        _checked(spec, cfg, call, (o, lse), (o_ref, lse_ref))
        calls[spec] = call
    qc, kc, vc = (t.detach().clone().requires_grad_() for t in (q, k, v))  # so cuDNN keeps its logsumexp

    def cudnn() -> None:
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            torch.nn.functional.scaled_dot_product_attention(qc, kc, vc, is_causal=True)

    calls["cudnn"] = cudnn
    return _interleaved(
        calls, rounds, rep_ms, f"forward, {heads} x {n} x {d} bf16 causal, layout {layout}", configs
    )
