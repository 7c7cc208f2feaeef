"""torch.compile studies (handout torch_compile): (a) compiled attention, (b) the compiled whole model.

(a) `attention_compile_sweep` runs the pytorch_attention protocol on `torch.compile`d naive attention
(rows "naive_compiled" in `torch_compile.csv`; the eager rows live in `pytorch_attention.csv`).

(b) `whole_model_compile_sweep` runs the end-to-end benchmark (`end_to_end.run_one`, the handout's
timing protocol) for every size, for forward-only inference and a full training step (forward,
backward, AdamW), eager and with `torch.compile(model)`. The compiled model is compiled during the
untimed warm-up, so the timed steps are steady state. The compilation cost is recorded too:
"wall_time" (s) is the whole configuration (model build, warm-up including compilation, timed steps),
and "compile_time" (s) is Dynamo's own account of the time spent compiling
(`torch._dynamo.utils.calculate_time_spent()["total_wall_time"]`, forward and backward graphs).

`measure(CompileConfig(...))` runs both (notebook 07):

    python -m cs336_systems.studies.attention.torch_compile --quick

Caveat: compiling a whole 32- or 48-layer model takes minutes; under a time budget the remaining
configurations are recorded as "skipped:" rows, estimated from the sizes measured before them.
"""

from __future__ import annotations

import timeit
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd
from tqdm.auto import tqdm

from cs336_systems.measure import cli
from cs336_systems.measure.budget import TimeBudget, skipped_row
from cs336_systems.measure.results import append_rows, make_row
from cs336_systems.model import SIZES_2025, get_config
from cs336_systems.studies.attention.pytorch_attention import (
    HEAD_DIMS,
    SEQ_LENS,
    attention_grid,
)
from cs336_systems.studies.attention.pytorch_attention import measure as measure_attention
from cs336_systems.studies.profiling.end_to_end import PHASES, EndToEndConfig, row_fields, run_one

PROBLEM = "torch_compile"
CONTEXT_LENGTH = 512


def attention_compile_sweep(
    head_dims: Sequence[int] = HEAD_DIMS,
    seq_lens: Sequence[int] = SEQ_LENS,
    *,
    extra_points: Sequence[tuple[int, int]] = ((16, 32768),),
    backend: str = "inductor",
    budget: TimeBudget | None = None,
    save: bool = True,
    results_dir: str | None = None,
    progress: bool = True,
    **kw: Any,
) -> pd.DataFrame:
    """torch_compile (a): the pytorch_attention sweep with the compiled attention."""
    configs = attention_grid(
        head_dims, seq_lens, impl="naive_compiled", extra_points=extra_points, backend=backend, **kw
    )
    rows = measure_attention(configs, budget=budget, save=save, results_dir=results_dir, progress=progress)
    return pd.DataFrame(rows)


def dynamo_compile_seconds() -> float:
    """Seconds Dynamo/AOTAutograd/Inductor have spent compiling in this process (NaN if unknown)."""
    try:
        from torch._dynamo.utils import calculate_time_spent

        spent = calculate_time_spent()
    except Exception:
        return float("nan")
    if "total_wall_time" in spent:
        return float(spent["total_wall_time"])
    return float(spent.get("entire_frame_compile", 0.0) + spent.get("entire_backward_compile", 0.0))


def _metrics(mode: str) -> list[tuple[str, str]]:
    return [(f"{p}_time", "ms") for p in PHASES[mode]] + [
        ("step_time", "ms"),
        ("peak_memory", "GiB"),
        ("wall_time", "s"),
    ]


def whole_model_compile_sweep(
    sizes: Sequence[str] = SIZES_2025,
    modes: Sequence[str] = ("forward", "train"),
    *,
    context_length: int = CONTEXT_LENGTH,
    warmup: int = 5,
    steps: int = 10,
    device: str | None = None,
    include_compiled: bool = True,
    skip_reason: str = "",
    budget: TimeBudget | None = None,
    compile_estimate_s: float = 60.0,
    save: bool = True,
    results_dir: str | None = None,
    progress: bool = True,
) -> pd.DataFrame:
    """torch_compile (b): eager vs compiled whole model, per size and mode, under an optional budget.

    include_compiled=False records the compiled cells as skipped with `skip_reason` (e.g. quick runs
    on a CPU, where Inductor's C++ compilation of a whole model takes minutes).
    compile_estimate_s: assumed compile seconds of the first (smallest) model; later sizes are
    estimated from the last measured one, scaled by the number of layers.
    """
    all_rows: list[dict[str, Any]] = []
    dev = device or EndToEndConfig().device
    step_s: dict[tuple[str, str], float] = {}  # (size, mode) -> measured eager seconds per step
    compile_per_layer: dict[str, float] = {}  # mode -> measured compile seconds per layer
    last_eager_per_param: dict[str, float] = {}
    cells = [(s, m, c) for s in sizes for m in modes for c in (False, True)]
    run_settings = {"context_length": context_length, "warmup": warmup, "steps": steps, "device": dev}
    for size, mode, compiled in tqdm(cells, desc=PROBLEM, disable=not progress):
        cfg = EndToEndConfig(size=size, mode=mode, compile=compiled, **run_settings)
        common = row_fields(cfg, PROBLEM, x_name="context_length", x_value=context_length)
        mcfg = get_config(size)
        n_steps = warmup + steps
        per_step = step_s.get((size, mode)) or last_eager_per_param.get(mode, 1e-9) * mcfg.num_params()
        estimate = n_steps * per_step + 5.0
        if compiled:
            per_layer = compile_per_layer.get(mode, compile_estimate_s * (2 if mode == "train" else 1) / 12)
            estimate += per_layer * mcfg.num_layers
        if compiled and not include_compiled:
            reason = skip_reason or "compiled configurations not requested"
        elif budget is not None and not budget.can_afford(estimate):
            reason = budget.skip_note(f"~{estimate:.0f} s needed")
        else:
            reason = ""
        if reason:
            rows = [skipped_row(metric=m, unit=u, reason=reason, **common) for m, u in _metrics(mode)]
        else:
            before = dynamo_compile_seconds()
            start = timeit.default_timer()
            rows = run_one(cfg, problem=PROBLEM)
            wall = timeit.default_timer() - start
            rows.append(make_row(metric="wall_time", unit="s", value=wall, **common))
            step = next((r for r in rows if r["metric"] == "step_time"), None)
            if step is not None and not compiled:
                step_s[(size, mode)] = step["mean"] / 1e3
                last_eager_per_param[mode] = step["mean"] / 1e3 / mcfg.num_params()
            if compiled:
                spent = dynamo_compile_seconds() - before
                rows.append(make_row(metric="compile_time", unit="s", value=spent, **common))
                if step is not None and spent == spent:  # not NaN
                    compile_per_layer[mode] = spent / mcfg.num_layers
                elif step is not None:
                    compile_per_layer[mode] = max(wall - n_steps * per_step, 0.0) / mcfg.num_layers
        if save:
            append_rows(PROBLEM, rows, results_dir)
        all_rows.extend(rows)
    return pd.DataFrame(all_rows)


@dataclass(frozen=True, kw_only=True)
class CompileConfig:
    quick: bool = False  # CPU-sized grids, the compiled whole model recorded as skipped
    device: str | None = None


def measure(
    config: CompileConfig | None = None, *, results_dir: str | None = None, budget: TimeBudget | None = None
) -> list[dict[str, Any]]:
    """Both parts; returns every row. Quick (CPU): a tiny attention grid, eager and compiled with the
    aot_eager backend (Dynamo + AOTAutograd without Inductor's minutes of C++ compilation), and the
    debug model eager with its compiled cells recorded as skipped. Otherwise the full grids."""
    cfg = config or CompileConfig()
    device = cfg.device
    if cfg.quick:
        kw: dict[str, Any] = dict(reps=3, warmup=1, device=device or "cpu")
        grid: dict[str, Any] = dict(head_dims=(16,), seq_lens=(64, 128), extra_points=())
        rows = measure_attention(attention_grid(**grid, **kw), results_dir=results_dir, progress=False)
        parts = [
            attention_compile_sweep(
                **grid, backend="aot_eager", results_dir=results_dir, progress=False, **kw
            ),
            whole_model_compile_sweep(
                ("debug",),
                context_length=32,
                warmup=1,
                steps=2,
                device=device or "cpu",
                include_compiled=False,
                results_dir=results_dir,
                progress=False,
                skip_reason="quick mode on a CPU: Inductor's C++ compile of a whole model takes minutes",
            ),
        ]
        return rows + [r for part in parts for r in part.to_dict("records")]
    dev = {"device": device} if device else {}
    parts = [
        attention_compile_sweep(budget=budget, results_dir=results_dir, **dev),
        whole_model_compile_sweep(budget=budget, results_dir=results_dir, **dev),
    ]
    return [r for part in parts for r in part.to_dict("records")]


def main(argv: Sequence[str] | None = None) -> None:
    p = cli.make_parser(__doc__, "python -m cs336_systems.studies.attention.torch_compile --quick")
    p.add_argument("--quick", action="store_true", help="CPU-sized grids (aot_eager backend)")
    p.add_argument("--device", default=None, help="default: cuda when visible, else cpu")
    cli.add_results_dir(p)
    args = p.parse_args(argv)
    cfg = CompileConfig(quick=args.quick, device=args.device)
    print(cfg)
    rows = measure(cfg, results_dir=str(cli.results_dir_for(args.results_dir, quick=args.quick)))
    print(f"{PROBLEM}: {len(rows)} rows written")


def _fmt(r: pd.Series) -> str:
    """The failure note, or the mean to 3 significant digits (no exponent: 1100, not 1.1e+03)."""
    if r["note"] and not r["n"]:
        return r["note"]
    return f"{r['mean']:.3g}" if abs(r["mean"]) < 1000 else f"{r['mean']:.0f}"


def attention_speedup_table(eager: pd.DataFrame, compiled: pd.DataFrame) -> pd.DataFrame:
    """(d, T) x {forward, backward} eager ms, compiled ms and speedup (eager / compiled)."""
    from cs336_systems.measure.results import latest_run

    parts = []
    for label, df in (("eager", eager), ("compiled", compiled)):
        t = latest_run(df[df.metric.isin(["forward_time", "backward_time"])])
        if t.empty:
            return pd.DataFrame()
        t = t.assign(
            d=t["name"].str.lstrip("d").astype(int),
            T=t["x_value"].astype(int),
            variant=label,
            phase=t["metric"].str.replace("_time", ""),
        )
        parts.append(t)
    t = pd.concat(parts)
    cells = t.assign(value=t.apply(_fmt, axis=1)).pivot_table(
        index=["d", "T"], columns=["phase", "variant"], values="value", aggfunc="last"
    )
    means = t[t.note.eq("") | t.n.gt(0)].pivot_table(
        index=["d", "T"], columns=["phase", "variant"], values="mean"
    )
    for phase in ("forward", "backward"):
        if (phase, "eager") in means.columns and (phase, "compiled") in means.columns:
            sp = means[(phase, "eager")] / means[(phase, "compiled")]
            cells[(phase, "speedup")] = (
                sp.map(lambda v: "" if pd.isna(v) else f"{v:.2f}x").reindex(cells.index).fillna("")
            )
    order = [
        (p, v)
        for p in ("forward", "backward")
        for v in ("eager", "compiled", "speedup")
        if (p, v) in cells.columns
    ]
    return cells[order]


def whole_model_table(df: pd.DataFrame) -> pd.DataFrame:
    """size x {forward, train} step ms eager and compiled, speedup, and compile seconds."""
    from cs336_systems.measure.results import latest_run

    t = latest_run(df[(df.x_name == "context_length") & df.metric.isin(["step_time", "compile_time"])])
    if t.empty:
        return pd.DataFrame()
    t = t.assign(variant=t["impl"].map(lambda s: "compiled" if s.endswith("+compile") else "eager"))
    order = {s: i for i, s in enumerate(SIZES_2025)}
    rows = []
    for (size, mode), g in sorted(
        t.groupby(["name", "mode"]), key=lambda kv: (order.get(kv[0][0], 99), kv[0][1])
    ):
        step = g[g.metric == "step_time"].set_index("variant")
        comp = g[g.metric == "compile_time"]
        row = {"size": size, "mode": mode}
        for v in ("eager", "compiled"):
            row[f"{v} (ms)"] = _fmt(step.loc[v]) if v in step.index else ""
        ok = all(v in step.index and step.loc[v, "n"] for v in ("eager", "compiled"))
        row["speedup"] = f"{step.loc['eager', 'mean'] / step.loc['compiled', 'mean']:.2f}x" if ok else ""
        row["compile (s)"] = _fmt(comp.iloc[0]) if len(comp) else ""
        rows.append(row)
    return pd.DataFrame(rows)


def protocol(df: pd.DataFrame) -> str:
    """'W warm-up + N timed steps, context T' of the whole-model rows (several if runs differ)."""
    import json

    seen = set()
    for c in df["config_json"].dropna():
        cfg = json.loads(c)
        if "warmup" in cfg and "steps" in cfg:
            seen.add((cfg["warmup"], cfg["steps"], cfg.get("context_length")))
    return "; ".join(f"{w} warm-up + {n} timed steps, context {t}" for w, n, t in sorted(seen)) or "unknown"


def _speedups(tab: pd.DataFrame, phase: str) -> pd.Series:
    return tab[(phase, "speedup")].str.rstrip("x").replace("", float("nan")).astype(float)


def speedup_grid(table: pd.DataFrame) -> pd.DataFrame:
    """`facts(...)["attention_table"]` pivoted: a row per (d, pass), a column per T, each cell the compiled
    ms with its speedup over eager in brackets (or the eager failure: then the compiled ms alone)."""
    if table.empty:
        return table
    cells = {}
    for phase, short in (("forward", "fwd"), ("backward", "bwd")):
        sub = table[phase]
        for (d, t), r in sub.iterrows():
            speed = str(r["speedup"])
            cells[(d, short, f"T={t}")] = (
                f"{r['compiled']} ({speed})" if speed.endswith("x") else str(r["compiled"])
            )
    s = pd.Series(cells)
    s.index.names = ["d", "pass", "T"]
    out = s.unstack("T").sort_index(key=lambda i: i.map({"fwd": 0, "bwd": 1}) if i.name == "pass" else i)
    return out[sorted(out.columns, key=lambda c: int(c[2:]))].fillna("\u2013")


def facts(compiled: pd.DataFrame, eager_attention: pd.DataFrame) -> dict[str, Any]:
    """The numbers the torch_compile answers state. `compiled`: the torch_compile rows; `eager_attention`:
    the naive rows of pytorch_attention (the eager baseline). `"attention"` (a) and `"model"` (b) are
    absent without rows; `"attention_table"` and `"model_table"` are the two tables shown."""
    attn = compiled[compiled.x_name == "seq_len"]
    model = compiled[compiled.x_name == "context_length"]
    tab = attention_speedup_table(eager_attention, attn)
    wm = whole_model_table(model)
    out: dict[str, Any] = {"attention_table": tab, "model_table": wm}
    out["any_skipped"] = len(wm) > 0 and bool(wm["compiled (ms)"].str.startswith("skipped").any())
    out["protocol"] = protocol(model) if len(model) else "not run"
    sp: dict[str, pd.Series] = {}
    if len(tab) and ("forward", "speedup") in tab.columns:
        sp = {p: _speedups(tab, p) for p in ("forward", "backward")}
        t_level = tab.index.get_level_values("T")
        both = sp["forward"].notna()  # configurations measured eager and compiled (eager can OOM)
        big_t = t_level[both].max()
        at_big = {p: sp[p][both & (t_level == big_t)] for p in sp}
        only_compiled = tab[~both & (tab[("forward", "compiled")].str.len() > 0)]
        only_compiled = only_compiled[
            only_compiled[("forward", "compiled")].map(lambda v: v.replace(".", "", 1).isdigit())
        ]
        first = attn[attn.metric == "first_forward_time"]["mean"]
        out["attention"] = {
            **{f"{p}_{end}": getattr(sp[p], end)() for p in sp for end in ("min", "max")},
            "longest_T": big_t,
            "forward_at_longest": at_big["forward"].mean(),
            "backward_at_longest": at_big["backward"].mean(),
            "forward_at_longest_by_d": [(d, v) for (d, _), v in at_big["forward"].items()],
            "shrinks_with_d": bool(at_big["forward"].is_monotonic_decreasing),
            "only_compiled_ran": [
                (d, t, r[("forward", "eager")], r[("forward", "compiled")], r[("backward", "compiled")])
                for (d, t), r in only_compiled.iterrows()
            ],
            "compile_s": first.max() / 1e3 if len(first) else None,
        }
    if len(wm) and (wm.speedup != "").any():
        ok = wm[wm.speedup != ""].assign(x=lambda t: t.speedup.str.rstrip("x").astype(float))
        ctx = int(model.x_value.astype(float).max())
        t_lvl = tab.index.get_level_values("T") if len(tab) else []
        lengths = sorted(set(t_lvl))
        near = [t for t in lengths if t <= ctx][-1:] + [t for t in lengths if t >= ctx][:1]
        sp_near = sp["forward"][[t in near for t in t_lvl]].dropna() if len(tab) else []
        by_size = list(ok.groupby("mode"))  # rows in model-size order (whole_model_table sorts them)
        skipped = wm[wm["compiled (ms)"].str.startswith("skipped")]
        out["model"] = {
            "speedup_by_mode": [
                (m, r["min"], r["max"]) for m, r in ok.groupby("mode").x.agg(["min", "max"]).iterrows()
            ],
            "shrinks_with_size": all(len(g) > 1 and g.x.iloc[-1] < g.x.iloc[0] for _, g in by_size),
            "smallest_and_largest": [
                (m, g.x.iloc[0], g["size"].iloc[0], g.x.iloc[-1], g["size"].iloc[-1]) for m, g in by_size
            ],
            "context_length": ctx,
            "attention_T_near_context": near,
            "attention_forward_near_context": (min(sp_near), max(sp_near)) if len(sp_near) else None,
            "attention_forward_max": sp["forward"].max() if sp else None,
            "skipped": [f"{r.size} {r.mode}" for r in skipped.itertuples()],
        }
    return out


if __name__ == "__main__":
    main()
