"""Our Triton FlashAttention-2 inside the model: equivalence check and end-to-end training steps.

Two measurements (issue: use the kernel in the model), rows under problem "flash_end_to_end":

* `check_equivalence`: one model, one batch; forward + backward with the reference attention
  ("naive", T x T scores) and with each other implementation (`model.set_attention`), same weights.
  Rows: the loss difference, the largest logit difference relative to the logits' RMS, and the
  largest per-parameter relative gradient error ||g - g_ref|| / ||g_ref|| (metric names
  `loss_abs_err`, `logits_rel_err`, `max_grad_rel_err`), with the tolerance and whether it held in
  the row's config (`tolerance`, `passed`).
* `training_sweep`: full training steps (forward, backward, AdamW) of one model size for each
  attention implementation and context length, timed with the handout protocol by
  `end_to_end.measure` (OOM and failures become rows; nothing is lost if a later config fails).

    python -m cs336_systems.studies.attention.flash_model --size 2.7B --contexts 512 1024 2048 4096 \
        --check-contexts 512 1024

`measure(ModelRunConfig(...))` runs both; `--quick` runs the same code on a tiny model on the CPU
(Triton interpreter, float32).
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd
import torch

from cs336_systems.measure import cli
from cs336_systems.measure.results import append_rows, capture_failure, failure_row, make_row
from cs336_systems.model import BasicsTransformerLM, cross_entropy, get_config, random_batch
from cs336_systems.studies.profiling import end_to_end as e2e

PROBLEM = "flash_end_to_end"
IMPLS = ("naive", "sdpa", "flash_triton")
# Tolerances of the equivalence check (relative errors; see check_equivalence). float32 runs every
# matmul at full precision (our kernel: 3xTF32 dots), so only summation order differs; bf16 autocast
# rounds P and dS to bf16 in the flash kernel, which the naive path keeps in float32.
TOLERANCE = {"fp32": 1e-3, "bf16-autocast": 5e-2}
CHECK_METRICS = ("loss_abs_err", "logits_rel_err", "max_grad_rel_err")


def _autocast(dtype_label: str, device: str):
    if dtype_label == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16)


def _forward_backward(model, inputs, targets, dtype_label: str, device: str):
    model.zero_grad(set_to_none=True)
    with _autocast(dtype_label, device):
        logits = model(inputs)
        loss = cross_entropy(logits, targets)
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach().float(), float(loss.detach()), grads


def compare(ref: tuple, other: tuple) -> dict[str, float]:
    """Errors of (logits, loss, grads) `other` against `ref` (see the module docstring)."""
    (lr, loss_r, gr), (lo, loss_o, go) = ref, other
    if set(gr) != set(go):
        raise ValueError(f"gradient sets differ: {sorted(set(gr) ^ set(go))}")
    rms = lr.pow(2).mean().sqrt().clamp_min(1e-30)
    grad_err = max(
        float((go[n].float() - g.float()).norm() / g.float().norm().clamp_min(1e-30)) for n, g in gr.items()
    )
    return {
        "loss_abs_err": abs(loss_o - loss_r),
        "logits_rel_err": float((lo - lr).abs().max() / rms),
        "max_grad_rel_err": grad_err,
    }


def check_equivalence(
    size: str,
    context_lengths: Sequence[int],
    *,
    batch_size: int = 2,
    impls: Sequence[str] = ("sdpa", "flash_triton"),
    reference: str = "naive",
    dtypes: Sequence[str] = ("fp32", "bf16-autocast"),
    device: str = "cuda",
    results_dir=None,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """Outputs and gradients of each implementation against the reference, same weights and batch."""
    rows: list[dict[str, Any]] = []
    for n in context_lengths:
        torch.manual_seed(seed)
        mcfg = get_config(size, context_length=n)
        model = BasicsTransformerLM.from_config(mcfg, attention_impl=reference, device=device)
        gen = torch.Generator().manual_seed(seed)
        inputs, targets = random_batch(batch_size, n, mcfg.vocab_size, device=device, generator=gen)
        for dtype_label in dtypes:
            tol = TOLERANCE[dtype_label]
            common = dict(
                problem=PROBLEM,
                name=size,
                mode="check",
                dtype=dtype_label,
                x_name="context_length",
                x_value=n,
            )
            model.set_attention(reference)
            ref = _forward_backward(model, inputs, targets, dtype_label, device)
            ref = (ref[0], ref[1], {k: g.clone() for k, g in ref[2].items()})
            for impl in impls:
                outcome: dict[str, str] = {}
                errs = None
                with capture_failure(outcome):
                    model.set_attention(impl)
                    errs = compare(ref, _forward_backward(model, inputs, targets, dtype_label, device))
                config = {
                    "reference": reference,
                    "batch_size": batch_size,
                    "tolerance": tol,
                    "seed": seed,
                    "model": mcfg.as_kwargs(),
                }
                if errs is None:
                    rows += [
                        failure_row(
                            metric=m, unit="", note=outcome["note"], impl=impl, config=config, **common
                        )
                        for m in CHECK_METRICS
                    ]
                    continue
                passed = errs["logits_rel_err"] <= tol and errs["max_grad_rel_err"] <= tol
                config["passed"] = passed
                rows += [
                    make_row(metric=m, unit="", value=v, impl=impl, config=config, **common)
                    for m, v in errs.items()
                ]
                print(
                    f"{size} T={n} {dtype_label:>13} {impl:>12} vs {reference}: "
                    + ", ".join(f"{k}={v:.2e}" for k, v in errs.items())
                    + f"  (tol {tol:g}: {'ok' if passed else 'FAIL'})"
                )
            del ref
        del model, inputs, targets
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    append_rows(PROBLEM, rows, results_dir)
    return rows


def training_sweep(
    size: str,
    context_lengths: Sequence[int],
    *,
    impls: Sequence[str] = IMPLS,
    batch_size: int = 4,
    autocast: str = "bf16",
    warmup: int = 3,
    steps: int = 5,
    device: str = "cuda",
    results_dir=None,
) -> pd.DataFrame:
    """Training-step time and peak memory per (context length, implementation); OOMs are rows."""
    configs = e2e.grid(
        size=size,
        context_length=list(context_lengths),
        attention=list(impls),
        mode="train",
        batch_size=batch_size,
        autocast=autocast,
        warmup=warmup,
        steps=steps,
        device=device,
    )
    return pd.DataFrame(e2e.measure(configs, problem=PROBLEM, results_dir=results_dir, progress=True))


def speedup_table(df: pd.DataFrame, ours: str = "flash_triton") -> pd.DataFrame:
    """Step time (ms) and peak memory (GiB) per context length and implementation, with our
    implementation's speed-up and memory saving against each other one (from the same sweep)."""
    t = df[(df["mode"] == "train") & df["metric"].isin(["step_time", "peak_memory"])]
    if t.empty:
        return t
    val = t.assign(v=t["mean"].where(t["note"].fillna("") == "", float("nan")))
    wide = val.pivot_table(index="x_value", columns=["metric", "impl"], values="v", aggfunc="last")
    failed = df[(df["mode"] == "train") & (df["note"].fillna("") != "")]  # OOM rows name the phases
    notes = failed.groupby(["x_value", "impl"])["note"].first()
    out = pd.DataFrame(index=wide.index)
    out.index.name = "context"
    for impl in [i for i in IMPLS if ("step_time", i) in wide.columns]:
        ms = wide[("step_time", impl)]
        out[f"{impl} ms"] = [
            f"{x:.1f}" if not math.isnan(x) else _short(notes.get((c, impl), "n/a")) for c, x in ms.items()
        ]
        if ("peak_memory", impl) in wide.columns:
            out[f"{impl} GiB"] = wide[("peak_memory", impl)].map(
                lambda x: "" if math.isnan(x) else f"{x:.1f}"
            )
    for other in [i for i in IMPLS if i != ours and ("step_time", i) in wide.columns]:
        if ("step_time", ours) in wide.columns:
            r = wide[("step_time", other)] / wide[("step_time", ours)]
            out[f"speed-up vs {other}"] = r.map(lambda x: "" if math.isnan(x) else f"{x:.2f}x")
            if ("peak_memory", other) in wide.columns and ("peak_memory", ours) in wide.columns:
                m = wide[("peak_memory", other)] - wide[("peak_memory", ours)]
                out[f"GiB saved vs {other}"] = m.map(lambda x: "" if math.isnan(x) else f"{x:.1f}")
    return out


def _short(note: str) -> str:
    return "OOM" if str(note).startswith("OOM") else str(note)[:20]


def check_table(df: pd.DataFrame) -> pd.DataFrame:
    t = df[df["mode"] == "check"]
    if t.empty:
        return t
    wide = t.pivot_table(index=["x_value", "dtype", "impl"], columns="metric", values="mean", aggfunc="last")
    cfg = t.groupby(["x_value", "dtype", "impl"])["config_json"].last()
    wide["tolerance"] = [json.loads(c).get("tolerance") for c in cfg.reindex(wide.index)]
    wide["passed"] = [json.loads(c).get("passed") for c in cfg.reindex(wide.index)]
    wide.index.names = ["context", "dtype", "impl"]
    return wide[[*CHECK_METRICS, "tolerance", "passed"]]


def plot_training(df: pd.DataFrame):
    """Training-step time and peak memory against context length, one line per implementation; a
    configuration that ran out of memory is marked on the axis floor."""
    import matplotlib.pyplot as plt

    t = df[(df["mode"] == "train") & df["metric"].isin(["step_time", "peak_memory"])]
    batch = {int(x): json.loads(c)["batch_size"] for x, c in zip(t.x_value, t.config_json)}
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.1))
    for ax, metric, label in zip(axes, ("step_time", "peak_memory"), ("step time (ms)", "peak memory (GiB)")):
        m = t[t.metric == metric]
        ran = t[(t.metric == "step_time") & (t.note.fillna("") == "")]
        for k, impl in enumerate(IMPLS):
            g = m[(m.impl == impl) & (m.note.fillna("") == "")].sort_values("x_value")
            style = {"linestyle": "--", "linewidth": 2.5} if impl == "sdpa" else {}  # visible under ours
            line = ax.plot(g.x_value, g["mean"], marker="o", label=impl, zorder=3 - k, **style)[0]
            # contexts where this implementation never ran (out of memory at every batch tried)
            tr = df[(df["mode"] == "train") & (df.impl == impl)]
            failed = set(tr[tr.note.fillna("").str.startswith("OOM")].x_value)
            xs = sorted(failed - set(ran[ran.impl == impl].x_value))
            if xs:
                ax.scatter(
                    xs, [0] * len(xs), marker="x", s=60, color=line.get_color(), clip_on=False, zorder=4
                )
        ax.set_xscale("log", base=2)
        xs = sorted(batch)
        ax.set_xticks(xs, [f"{x}\n(batch {batch[x]})" for x in xs])
        ax.set_xlabel("context length")
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
    axes[0].legend(frameon=False)
    axes[1].text(0.02, 0.05, "x on the axis: out of memory", transform=axes[1].transAxes, fontsize=8)
    fig.suptitle("2.7B training step (bf16 autocast)")
    fig.tight_layout()
    return fig


# FlashAttention-2 (and SDPA's flash backend, which vendors it) compiles kernels for these head dims and
# runs a head dim d in the smallest one >= d: HEADDIM_SWITCH in csrc/flash_attn/src/static_switch.h of
# Dao-AILab/flash-attention (aten/src/ATen/native/transformers/cuda/flash_attn/static_switch.h in torch).
FA2_KERNEL_HEAD_DIMS = (32, 64, 96, 128, 160, 192, 224, 256)


def model_head_dim(size: str) -> int:
    """d_model / num_heads of a MODEL_SIZES preset."""
    from cs336_systems.model import get_config

    cfg = get_config(size)
    return cfg.d_model // cfg.num_heads


def head_dim_padding(d: int) -> dict[str, float]:
    """The head dim our tl kernels compute in (`tiles.block_d`), the one FlashAttention-2's kernel runs
    in, and the ratio of their QK^T and P V work (both products are linear in the head dim)."""
    from cs336_systems.attention.flash_triton import tiles

    ours = tiles.block_d(d)
    fa2 = next(k for k in FA2_KERNEL_HEAD_DIMS if k >= d)
    return {"d": d, "ours": ours, "fa2": fa2, "work_vs_fa2": ours / fa2, "work_vs_unpadded": ours / d}


def facts(df: pd.DataFrame, ours: str = "flash_triton") -> dict[str, Any]:
    """The numbers notebook 11's model answer states: the largest relative gradient error against
    naive attention per (dtype, impl) over the checked contexts; per context, the naive / ours
    training-step ratio (contexts where both ran) and ours / SDPA (contexts where both ran); the
    first context where naive attention ran out of memory and the batch size it was run at."""
    checks = check_table(df)
    train = df[df["mode"] == "train"]
    steps = train[train.metric == "step_time"]
    ms = steps[steps.note.fillna("") == ""].pivot_table(
        index="x_value", columns="impl", values="mean", aggfunc="last"
    )
    ms.index = ms.index.astype(int)
    batch = {int(c): json.loads(cj)["batch_size"] for c, cj in zip(steps.x_value, steps.config_json)}
    fails = train[(train.impl == "naive") & train.note.fillna("").str.startswith("OOM")]
    batch |= {int(c): json.loads(cj)["batch_size"] for c, cj in zip(fails.x_value, fails.config_json)}
    ooms = sorted({int(c) for c in fails.x_value})
    both = ms.reindex(columns=["naive", ours, "sdpa"]).dropna(subset=["naive", ours])
    vs_sdpa = ms.reindex(columns=[ours, "sdpa"]).dropna()
    return {
        "max_grad_rel_err": checks.groupby(level=("dtype", "impl"))["max_grad_rel_err"].max().to_dict(),
        "speedup_vs_naive": (both["naive"] / both[ours]).to_dict(),
        "naive_oom_context": ooms[0] if ooms else None,
        "naive_oom_batch": batch.get(ooms[0]) if ooms else None,
        "vs_sdpa": (vs_sdpa[ours] / vs_sdpa["sdpa"]).to_dict(),
    }


@dataclass(frozen=True, kw_only=True)
class ModelRunConfig:
    size: str = "2.7B"
    contexts: tuple[int, ...] = (512, 1024, 2048, 4096)  # training-step contexts
    check_contexts: tuple[int, ...] = (512, 1024)  # equivalence-check contexts
    impls: tuple[str, ...] = IMPLS
    batch_size: int = 4
    warmup: int = 3
    steps: int = 5
    device: str = "cuda"


def measure(config: ModelRunConfig, *, results_dir=None) -> list[dict[str, Any]]:
    """The equivalence check (fp32, and bf16 autocast on a GPU), then the training steps; every row."""
    c = config
    rows = []
    if c.check_contexts:
        dtypes = ("fp32",) if c.device == "cpu" else ("fp32", "bf16-autocast")
        others = [i for i in c.impls if i != "naive"]
        rows += check_equivalence(
            c.size, c.check_contexts, impls=others, dtypes=dtypes, device=c.device, results_dir=results_dir
        )
    if c.contexts:
        rows += training_sweep(
            c.size,
            c.contexts,
            impls=c.impls,
            batch_size=c.batch_size,
            warmup=c.warmup,
            steps=c.steps,
            autocast="none" if c.device == "cpu" else "bf16",
            device=c.device,
            results_dir=results_dir,
        ).to_dict("records")
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    p = cli.make_parser(__doc__, "python -m cs336_systems.studies.attention.flash_model --quick")
    cli.add_size(p, "2.7B")
    p.add_argument(
        "--contexts", nargs="*", type=int, default=[512, 1024, 2048, 4096], help="training-step contexts"
    )
    p.add_argument(
        "--check-contexts", nargs="*", type=int, default=[512, 1024], help="equivalence-check contexts"
    )
    p.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS, help="attention implementations")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="tiny model on the CPU (Triton interpreter)")
    p.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"]
    )
    cli.add_results_dir(p)
    a = p.parse_args(argv)
    if a.quick:
        a.size, a.contexts, a.check_contexts, a.batch_size, a.warmup, a.steps = "debug", [32], [32], 2, 1, 2
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is visible (use --device cpu or --quick)")
    if min([a.batch_size, a.steps, *a.contexts, *a.check_contexts], default=1) < 1 or a.warmup < 0:
        p.error("--batch-size, --steps, --contexts and --check-contexts must be >= 1, --warmup >= 0")
    cfg = ModelRunConfig(
        size=a.size,
        contexts=tuple(a.contexts),
        check_contexts=tuple(a.check_contexts),
        impls=tuple(a.impls),
        batch_size=a.batch_size,
        warmup=a.warmup,
        steps=a.steps,
        device=a.device,
    )
    print(cfg)
    measure(cfg, results_dir=cli.results_dir_for(a.results_dir, quick=a.quick))


if __name__ == "__main__":
    main()
