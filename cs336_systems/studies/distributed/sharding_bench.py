"""Memory and time of optimizer-state sharding on 2 GPUs (2025 optimizer_state_sharding_accounting).

Every variant trains the Basics Transformer LM ("xl" = 2025 XL, 2.0B parameters, by default) in fp32
with the project's AdamW on random tokens, data parallel over the ranks: 4 sequences of 512 tokens
per rank (global batch 8), the setting of the project's DDP benchmarks. Gradients are averaged by
a bucketed flat all-reduce after backward (the same code for every variant, so only the optimizer
differs). Variants:

    unsharded   AdamW over all parameters on every rank (plain data parallelism)
    sharded     ShardedOptimizer(AdamW): state for ~1/N of the parameters, updated params broadcast
    torch_zero  torch.distributed.optim.ZeroRedundancyOptimizer(AdamW), PyTorch's own version

[Note: what is measured, and where]
Per rank, from torch.cuda's allocator (memory_allocated / max_memory_allocated, GiB):
  after_init          model built on the GPU and the optimizer constructed (AdamW state is lazy);
  <it>:before_step    after forward, backward and the gradient all-reduce, right before step();
  <it>:after_step     right after step() (before zero_grad);
for <it> = "first" (iteration 1: no optimizer state yet before its step) and "steady" (the last
iteration). At each point `allocated` is split into parameters, gradients and optimizer state (sums
of the tensors' storages) and `other` (the rest: inputs, communication buffers, allocator slack);
`peak` is the maximum allocated since the previous point (so before_step's peak holds the
activations, reported as `activations_peak` = peak - allocated at the start of the iteration).
Next to each measured component is the analytic expectation (`expected_*`): 4 bytes per parameter for
weights and for gradients, and AdamW's m and v (8 bytes per parameter) for the parameters this
rank's optimizer actually owns (its partition, which for whole-tensor partitions is not exactly 1/N).
Time per iteration: warmup iterations, then timed ones, each phase (forward+backward, gradient
all-reduce, optimizer step) bracketed by device synchronisation; an iteration counts at its slowest rank.

Entry points (through `runner`): under torchrun the module is a worker that runs the variants in
order; without it, it is the driver, which launches the workers, records a failure row for a variant
that crashes (e.g. out of memory) and relaunches the rest, then renders the figures
(`sharding_facts` holds the tables, figures and the notebook's facts):

    python -m cs336_systems.studies.distributed.sharding_bench --figures-dir figures            # 2 GPUs
    python -m cs336_systems.studies.distributed.sharding_bench --quick                          # CPU, gloo, debug
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import pandas as pd
import torch
import torch.distributed as dist
from torch import Tensor

from cs336_systems.distributed.sharded_optimizer import ShardedOptimizer
from cs336_systems.measure import cli
from cs336_systems.measure.results import make_row
from cs336_systems.measure.timing import synchronize
from cs336_systems.model import AdamW, cross_entropy
from cs336_systems.studies.distributed import runner, sharding_facts
from cs336_systems.studies.distributed.rank_memory import (
    GiB,
    all_reduce_gradients,
    memory_snapshot,
    release_memory,
)
from cs336_systems.studies.distributed.sharding_facts import (
    IMPL,
    PROBLEM,
    VARIANTS,
    facts,  # noqa: F401 (the study's facts, kept beside its tables)
)

MODULE = "cs336_systems.studies.distributed.sharding_bench"
ADAMW_KWARGS = dict(lr=1e-4, weight_decay=0.01)
ADAM_STATE_BYTES_PER_PARAM = 8  # m and v in fp32


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """One run of the benchmark (all variants share it)."""

    size: str = "xl"
    context_length: int = 512
    batch_per_rank: int = 4
    warmup: int = 2
    steps: int = 5
    attention: str = "naive"
    variants: tuple[str, ...] = VARIANTS
    bucket_mb: float = 128.0  # gradient all-reduce bucket (and ShardedOptimizer broadcast bucket)
    backend: str = "nccl"
    run_id: str = ""

    def __post_init__(self) -> None:
        runner.check_training_config(self, VARIANTS)


def _make_optimizer(variant: str, params: list[Tensor], bucket_mb: float) -> torch.optim.Optimizer:
    if variant == "unsharded":
        return AdamW(params, **ADAMW_KWARGS)
    if variant == "sharded":
        return ShardedOptimizer(params, AdamW, bucket_size_mb=bucket_mb, **ADAMW_KWARGS)
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return ZeroRedundancyOptimizer(params, optimizer_class=AdamW, **ADAMW_KWARGS)


def _local_param_count(variant: str, optimizer: torch.optim.Optimizer, total: int) -> int:
    """Parameters whose optimizer state lives on this rank."""
    if variant == "unsharded":
        return total
    opt = getattr(optimizer, "optim", None) or optimizer.inner  # ZeRO's local optimizer / ours
    return sum(p.numel() for g in opt.param_groups for p in g["params"])


def _point_rows(
    cfg: BenchConfig, variant: str, point: str, rank: int, snap: dict[str, float], expected: dict[str, float]
) -> list[dict[str, Any]]:
    common = dict(
        problem=PROBLEM,
        name=cfg.size,
        impl=IMPL[variant],
        mode=point,
        dtype="fp32",
        x_name="rank",
        x_value=rank,
        config=asdict(cfg),
    )
    rows = [
        make_row(metric=k, unit="GiB", value=v / GiB, **common) for k, v in snap.items() if not math.isnan(v)
    ]
    rows += [
        make_row(metric=f"expected_{k}", unit="GiB", value=v / GiB, **common) for k, v in expected.items()
    ]
    return rows


def run_variant(
    cfg: BenchConfig, variant: str, device: torch.device, results_dir: str | None = None
) -> tuple[list[dict[str, Any]], None]:
    """Measure one variant on every rank; returns all ranks' rows on rank 0 (empty elsewhere)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    release_memory(device)
    mcfg, model = runner.build_model(cfg, device)
    params = list(model.parameters())
    optimizer = _make_optimizer(variant, params, cfg.bucket_mb)
    synchronize(device)
    num_params = sum(p.numel() for p in params)
    local = _local_param_count(variant, optimizer, num_params)
    inputs, targets = runner.rank_batch(cfg.batch_per_rank, cfg.context_length, mcfg.vocab_size, device, 1000)

    def expected(point: str) -> dict[str, float]:
        has_grads = point != "after_init"
        has_state = point in ("first:after_step", "steady:before_step", "steady:after_step")
        return {
            "params": 4.0 * num_params,
            "grads": 4.0 * num_params * has_grads,
            "optimizer_state": float(ADAM_STATE_BYTES_PER_PARAM * local * has_state),
        }

    snap = memory_snapshot(device, params, optimizer, with_peak=True)
    rows = _point_rows(cfg, variant, "after_init", rank, snap, expected("after_init"))
    iterations = cfg.warmup + cfg.steps

    def forward_backward() -> None:
        loss = cross_entropy(model(inputs), targets)
        loss.backward()

    def on_point(it: int, when: str, start_alloc: float) -> None:
        tag = "first" if it == 0 else "steady" if it == iterations - 1 else None
        if tag is None:
            return
        point = f"{tag}:{when}"
        since = start_alloc if when == "before_step" else None
        snap = memory_snapshot(device, params, optimizer, with_peak=True, peak_since=since)
        rows.extend(_point_rows(cfg, variant, point, rank, snap, expected(point)))

    timer = runner.train_phased(
        forward_backward=forward_backward,
        grad_sync=lambda: all_reduce_gradients(params, int(cfg.bucket_mb * 2**20)),
        optimizer=optimizer,
        device=device,
        warmup=cfg.warmup,
        steps=cfg.steps,
        on_point=on_point,
        reset_peak_before_step=True,
    )
    partition = dict(local_params=local, num_params=num_params, rank=rank)
    gathered = runner.gather_to_rank0((rows, dict(timer.samples), partition))
    model = optimizer = params = inputs = targets = None  # the closures above hold them too
    release_memory(device)
    if gathered is None:
        return [], None
    out = [row for rows_r, _, _ in gathered for row in rows_r]
    config = asdict(cfg) | {"partition": [p for _, _, p in gathered]}
    keys = dict(problem=PROBLEM, name=cfg.size, impl=IMPL[variant], mode="train", dtype="fp32")
    out += runner.phase_time_rows(
        [s for _, s, _ in gathered], cfg.steps, x_name="world_size", x_value=world_size, config=config, **keys
    )
    return out, None


def failure_rows(cfg: BenchConfig, variant: str, note: str, world_size: int) -> list[dict[str, Any]]:
    return runner.step_failure_rows(PROBLEM, cfg, IMPL[variant], "fp32", note, world_size)


STUDY = runner.Study(problem=PROBLEM, module=MODULE, measure=run_variant, failure_rows=failure_rows)


def measure(
    config: BenchConfig,
    *,
    results_dir: str | os.PathLike | None = None,
    nproc: int = 2,
    figures_dir: str | os.PathLike | None = None,
    timeout_s: float = 240.0,
) -> list[dict[str, Any]]:
    """Launch the workers (relaunching after a crashed variant), then render figures; returns the rows."""
    df = runner.run_config_study(STUDY, config, nproc=nproc, results_dir=results_dir, timeout_s=timeout_s)
    if figures_dir is not None and not df.empty:
        sharding_facts.render_figures(df, figures_dir)
    return df.to_dict("records")


def _run(cfg: BenchConfig, **kw: Any) -> pd.DataFrame:
    return pd.DataFrame(measure(cfg, **kw))


QUICK = dict(size="debug", context_length=64, batch_per_rank=2, warmup=1, steps=2, backend="gloo")


def main(argv: Sequence[str] | None = None) -> pd.DataFrame | None:
    p = cli.make_parser(__doc__, "python -m cs336_systems.studies.distributed.sharding_bench --quick")
    defaults = BenchConfig()
    runner.add_training_arguments(p, defaults, VARIANTS, timeout_s=240.0)
    args = p.parse_args(argv)
    df = runner.config_cli(p, args, STUDY, BenchConfig, lambda: runner.training_fields(args, QUICK), _run)
    if df is None:
        return None
    with pd.option_context("display.width", 200, "display.max_columns", 20, "display.max_rows", 200):
        print(sharding_facts.memory_table(df).to_string())
        print(sharding_facts.time_table(df).to_string())
    return df


if __name__ == "__main__":
    main()
