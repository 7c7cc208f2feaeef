"""FSDP on 2 GPUs: peak-memory saving versus replication, and whether all-gathers arrive in time (2026 fsdp_accounting).

Every variant trains the Basics Transformer LM ("xl_2026" = the 2026 handout's xl, d_model 2560,
32 layers, 3.4B parameters, by default) with the project's AdamW on random tokens, 2 sequences of 512
tokens per rank (the handout's batch of 4 split over 2 GPUs). Variants:

    replicated  DDP-style: the whole model, its gradients and AdamW state on every rank; gradients
                averaged by a bucketed flat all-reduce after backward (sharding_bench.all_reduce_gradients)
    fsdp        FSDP(model): fp32 master shards, fp32 compute and communication
    fsdp_bf16   FSDP(model, compute_dtype=torch.bfloat16): weights cast to bf16 before the all-gather

[Note: memory accounting]
Per rank, from the allocator: after_init (model wrapped, full copy freed), steady:before_step and
steady:after_step of the last iteration (split into parameters, gradients, optimizer state, other, as
in sharding_bench), and `iteration_peak`, the maximum allocated over that whole iteration. The
expected saving of (a) ignores the gathered-weight buffers, as the handout says: replicated state is
16 bytes per parameter (fp32 weight, gradient, AdamW m and v); FSDP keeps 16 bytes per element of its
shards (each weight padded to a multiple of N and split) plus 16 bytes per replicated (norm) parameter.
`expected_saving` = difference of the two; `measured_saving` = iteration_peak(replicated) -
iteration_peak(fsdp). Activations are identical in the two fp32 variants, so the measured saving
differs from the expected one by FSDP's working set: two gathered weights, one full-weight
gradient and two gradients in flight in reduce-scatters at a time (`expected_working_set`).

[Note: do the all-gathers finish in time?] is in fsdp_trace, which analyses the profiled step.

Entry points as in sharding_bench (through `runner`: driver without torchrun, worker under it;
`fsdp_facts` holds the tables, figures and the notebook's facts):

    python -m cs336_systems.studies.distributed.fsdp_bench --figures-dir figures      # 2 GPUs
    python -m cs336_systems.studies.distributed.fsdp_bench --quick                    # CPU, gloo, debug model
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import torch
import torch.distributed as dist

from cs336_systems.distributed.fsdp import FSDP
from cs336_systems.measure import cli
from cs336_systems.measure.annotations import annotate
from cs336_systems.measure.results import make_row
from cs336_systems.measure.results import results_dir as default_results_dir
from cs336_systems.measure.timing import synchronize
from cs336_systems.measure.traces import load_trace, save_trace
from cs336_systems.model import AdamW, cross_entropy
from cs336_systems.studies.distributed import fsdp_facts, runner
from cs336_systems.studies.distributed.fsdp_facts import (
    PROBLEM,
    VARIANTS,
    expected_state_bytes,
    expected_working_set_bytes,  # the study's facts, beside its tables
    facts,  # noqa: F401 (the study's facts, kept beside its tables)
)
from cs336_systems.studies.distributed.fsdp_trace import allgather_timing, compact_trace
from cs336_systems.studies.distributed.rank_memory import (
    GiB,
    all_reduce_gradients,
    memory_snapshot,
    peak_allocated,
    release_memory,
)

MODULE = "cs336_systems.studies.distributed.fsdp_bench"
COMPUTE_DTYPE = {"replicated": None, "fsdp": None, "fsdp_bf16": torch.bfloat16}
DTYPE_LABEL = {"replicated": "fp32", "fsdp": "fp32", "fsdp_bf16": "bf16"}
ADAMW_KWARGS = dict(lr=1e-4, weight_decay=0.01)


@dataclass(frozen=True, kw_only=True)
class FsdpBenchConfig:
    size: str = "xl_2026"
    context_length: int = 512
    batch_per_rank: int = 2
    warmup: int = 2
    steps: int = 4
    attention: str = "naive"
    variants: tuple[str, ...] = VARIANTS
    trace: tuple[str, ...] = ("fsdp", "fsdp_bf16")
    bucket_mb: float = 128.0
    backend: str = "nccl"
    run_id: str = ""

    def __post_init__(self) -> None:
        runner.check_training_config(self, VARIANTS)


# --------------------------------------------------------------------------------------------------
# Worker
# --------------------------------------------------------------------------------------------------


class _Training:
    """One variant's model (FSDP-wrapped or not), AdamW and this rank's batch; `step` = fwd + bwd + sync."""

    def __init__(self, cfg: FsdpBenchConfig, variant: str, device: torch.device):
        self.cfg, self.variant, self.device = cfg, variant, device
        mcfg, model = runner.build_model(cfg, device)
        if variant != "replicated":
            model = FSDP(model, compute_dtype=COMPUTE_DTYPE[variant])
        release_memory(device)  # the full copy FSDP replaced by shards is gone; start counting from here
        self.model = model
        self.params = list(model.parameters())
        self.optimizer = AdamW(self.params, **ADAMW_KWARGS)
        self.inputs, self.targets = runner.rank_batch(
            cfg.batch_per_rank, cfg.context_length, mcfg.vocab_size, device, 1000
        )

    def forward_backward(self) -> None:
        with annotate("fsdp_bench::forward"):
            loss = cross_entropy(self.model(self.inputs), self.targets)
        with annotate("fsdp_bench::backward"):
            loss.backward()

    def grad_sync(self) -> None:
        if self.variant == "replicated":
            all_reduce_gradients(self.params, int(self.cfg.bucket_mb * 2**20))
        else:
            self.model.finish_gradient_synchronization()

    def snapshot(self) -> dict[str, float]:
        return memory_snapshot(self.device, self.params, self.optimizer)

    def step(self) -> None:
        self.forward_backward()
        with annotate("fsdp_bench::grad_sync"):
            self.grad_sync()
        with annotate("fsdp_bench::optimizer_step"):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def run_variant(
    cfg: FsdpBenchConfig, variant: str, device: torch.device, results_dir: str | None = None
) -> tuple[list[dict], dict[str, float] | None]:
    """Measure one variant; returns (rows on rank 0, {metric: bytes} of rank 0's key numbers)."""
    world_size = dist.get_world_size()
    training = _Training(cfg, variant, device)
    snaps: dict[str, dict[str, float]] = {"after_init": training.snapshot()}
    last = cfg.warmup + cfg.steps - 1
    iteration_peak = math.nan

    def on_point(it: int, when: str, _start: float) -> None:
        nonlocal iteration_peak
        if it == last:
            snaps[f"steady:{when}"] = training.snapshot()
            if when == "after_step":
                iteration_peak = peak_allocated(device)

    timer = runner.train_phased(
        forward_backward=training.forward_backward,
        grad_sync=training.grad_sync,
        optimizer=training.optimizer,
        device=device,
        warmup=cfg.warmup,
        steps=cfg.steps,
        range_prefix="fsdp_bench::",
        on_point=on_point,
    )
    compact = None
    if variant in cfg.trace and variant != "replicated":
        compact = _profile_one_step(training, variant, device, results_dir)
    gathered = runner.gather_to_rank0((snaps, iteration_peak, dict(timer.samples)))
    training = None
    release_memory(device)
    if gathered is None:
        return [], None

    common = dict(
        problem=PROBLEM, name=cfg.size, impl=variant, dtype=DTYPE_LABEL[variant], config=asdict(cfg)
    )
    rows = []
    for r, (snaps_r, peak_r, _) in enumerate(gathered):
        for point, snap in snaps_r.items():
            for metric, value in snap.items():
                if not math.isnan(value):
                    rows.append(
                        make_row(
                            metric=metric,
                            unit="GiB",
                            value=value / GiB,
                            mode=point,
                            x_name="rank",
                            x_value=r,
                            **common,
                        )
                    )
        if not math.isnan(peak_r):
            rows.append(
                make_row(
                    metric="iteration_peak",
                    unit="GiB",
                    value=peak_r / GiB,
                    mode="steady",
                    x_name="rank",
                    x_value=r,
                    **common,
                )
            )
    expected = expected_state_bytes(cfg.size, world_size, sharded=variant != "replicated")
    for k in ("params", "grads", "optimizer_state", "state"):
        rows.append(
            make_row(
                metric=f"expected_{k}",
                unit="GiB",
                value=expected[k] / GiB,
                mode="steady:before_step",
                x_name="rank",
                x_value=0,
                **common,
            )
        )
    per_rank = [samples for _, _, samples in gathered]
    rows += runner.phase_time_rows(
        per_rank, cfg.steps, mode="train", x_name="world_size", x_value=world_size, **common
    )
    if compact is not None:
        rows += gap_rows(compact, cfg, variant)
    return rows, {"iteration_peak": gathered[0][1], "expected_state": expected["state"]}


def _profile_one_step(training: _Training, variant: str, device, results_dir) -> dict[str, Any] | None:
    """Profile one more step on rank 0 (the others run it unprofiled); save the compact trace there."""
    if dist.get_rank() != 0:
        training.step()
        synchronize(device)
        return None
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities, record_shapes=False, with_stack=False) as prof:
        with annotate("fsdp_bench::step"):
            training.step()
        synchronize(device)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        compact = compact_trace(load_trace(path))
    save_trace(compact, default_results_dir(results_dir) / f"{PROBLEM}__trace_{variant}.json.gz")
    return compact


def saving_rows(
    cfg: FsdpBenchConfig, keys: dict[str, dict[str, float] | None], world_size: int
) -> list[dict]:
    """expected vs measured peak saving of each FSDP variant relative to replication (rank 0)."""
    rows = []
    base = keys.get("replicated")
    for variant in ("fsdp", "fsdp_bf16"):
        if base is None or keys.get(variant) is None:
            continue
        common = dict(
            problem=PROBLEM,
            name=cfg.size,
            impl=variant,
            dtype=DTYPE_LABEL[variant],
            mode="steady",
            x_name="world_size",
            x_value=world_size,
            config=asdict(cfg),
        )
        compute_bytes = 2 if COMPUTE_DTYPE[variant] is not None else 4
        rows.append(
            make_row(
                metric="expected_saving",
                unit="GiB",
                value=(base["expected_state"] - keys[variant]["expected_state"]) / GiB,
                **common,
            )
        )
        rows.append(
            make_row(
                metric="expected_working_set",
                unit="GiB",
                value=expected_working_set_bytes(cfg.size, compute_bytes) / GiB,
                **common,
            )
        )
        measured = base["iteration_peak"] - keys[variant]["iteration_peak"]
        if not math.isnan(measured):
            rows.append(make_row(metric="measured_saving", unit="GiB", value=measured / GiB, **common))
    return rows


def gap_rows(compact: dict[str, Any], cfg: FsdpBenchConfig, variant: str) -> list[dict[str, Any]]:
    t = allgather_timing(compact)
    common = dict(
        problem=PROBLEM, name=cfg.size, impl=variant, dtype=DTYPE_LABEL[variant], config=asdict(cfg)
    )
    rows = []
    for r in t.itertuples():
        wait = dict(mode=r.phase, x_name=f"order:{r.weight}", x_value=r.order, **common)
        rows.append(make_row(metric="allgather_slack", unit="us", value=r.slack_us, **wait))
        if not math.isnan(r.gather_us):
            rows.append(make_row(metric="allgather_time", unit="us", value=r.gather_us, **wait))
            # The brief's "gap": compute start - all-gather end (>= 0 on a GPU, where the compute stream
            # waits for the gather; ~0 when it waited, larger when the weight was early).
            rows.append(make_row(metric="allgather_gap", unit="us", value=r.lead_us, **wait))
    for phase, g in t.groupby("phase"):
        rows.append(
            make_row(
                metric="allgather_hidden_fraction",
                unit="fraction",
                value=float((g.slack_us >= 0).mean()),
                mode=phase,
                x_name="waits",
                x_value=len(g),
                **common,
            )
        )
        rows.append(
            make_row(
                metric="allgather_exposed_total",
                unit="ms",
                value=float(-g.slack_us.clip(upper=0).sum() / 1e3),
                mode=phase,
                x_name="waits",
                x_value=len(g),
                **common,
            )
        )
    return rows


def failure_rows(cfg: FsdpBenchConfig, variant: str, note: str, world_size: int) -> list[dict[str, Any]]:
    return runner.step_failure_rows(PROBLEM, cfg, variant, DTYPE_LABEL[variant], note, world_size)


STUDY = runner.Study(
    problem=PROBLEM, module=MODULE, measure=run_variant, failure_rows=failure_rows, finish=saving_rows
)


def measure(
    config: FsdpBenchConfig,
    *,
    results_dir: str | os.PathLike | None = None,
    nproc: int = 2,
    figures_dir: str | os.PathLike | None = None,
    timeout_s: float = 300.0,
) -> list[dict[str, Any]]:
    """Launch the workers (relaunching after a crashed variant), then render the figures; the rows."""
    df = runner.run_config_study(STUDY, config, nproc=nproc, results_dir=results_dir, timeout_s=timeout_s)
    if figures_dir is not None:
        fsdp_facts.render_figures(df, results_dir, figures_dir)
    return df.to_dict("records")


def _run(cfg: FsdpBenchConfig, **kw: Any) -> pd.DataFrame:
    return pd.DataFrame(measure(cfg, **kw))


QUICK = dict(size="debug", context_length=64, batch_per_rank=2, warmup=1, steps=2, backend="gloo")


def main(argv: Sequence[str] | None = None) -> pd.DataFrame | None:
    p = cli.make_parser(__doc__, "python -m cs336_systems.studies.distributed.fsdp_bench --quick")
    defaults = FsdpBenchConfig()
    runner.add_training_arguments(p, defaults, VARIANTS, timeout_s=300.0)
    p.add_argument("--trace", nargs="*", default=list(defaults.trace), choices=VARIANTS)
    args = p.parse_args(argv)
    df = runner.config_cli(
        p,
        args,
        STUDY,
        FsdpBenchConfig,
        lambda: {"trace": tuple(args.trace), **runner.training_fields(args, QUICK)},
        _run,
    )
    if df is None:
        return None
    with pd.option_context("display.width", 200, "display.max_columns", 20):
        print(fsdp_facts.memory_table(df).to_string())
        print(fsdp_facts.saving_table(df).to_string())
        t = df[df.metric.isin(["allgather_hidden_fraction", "allgather_exposed_total", "step_time"])]
        print(t[["impl", "mode", "metric", "mean", "note"]].to_string())
    return df


if __name__ == "__main__":
    main()
