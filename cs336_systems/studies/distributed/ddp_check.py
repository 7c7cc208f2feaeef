"""naive_ddp (handout 2.2): check that data-parallel training equals single-process training.

Every rank builds the same toy model from a *different* seed, wraps it (the wrapper must broadcast
rank 0's parameters), and trains on its shard of a fixed random batch; a single-process reference
(started from rank 0's weights) trains on the whole batch. The loss is a mean over examples, so
averaging the ranks' gradients must reproduce the full-batch gradient, and after every SGD step each
rank's parameters must equal the reference's (up to float rounding of the different summation order).

The toy model has the features that break careless implementations: a frozen bias
(requires_grad=False: no gradient, no communication), a fixed non-trainable parameter, and a weight
used twice (fc4.weight is fc2.weight: one gradient, reduced once).

    torchrun --nproc_per_node 2 -m cs336_systems.studies.distributed.ddp_check --out check.json   # worker
    check_against_single_process(["naive", "flat"], world_size=2)                          # driver
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pandas as pd
import torch
import torch.distributed as dist
from torch import nn

from cs336_systems.distributed.ddp import DDP_VARIANTS, DDPBucketed
from cs336_systems.distributed.launch import run_torchrun
from cs336_systems.distributed.process_group import cleanup_process_group, setup_process_group
from cs336_systems.measure import cli

MODULE = "cs336_systems.studies.distributed.ddp_check"


class TiedToyModel(nn.Module):
    """10 -> 10 -> 50 -> 10 -> 50 -> 5 MLP with fc4.weight = fc2.weight, a frozen fc2 bias, a fixed param."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(10, 10, bias=False)
        self.fc2 = nn.Linear(10, 50, bias=True)
        self.fc2.bias.requires_grad = False
        self.fc3 = nn.Linear(50, 10, bias=False)
        self.fc4 = nn.Linear(10, 50, bias=False)
        self.fc4.weight = self.fc2.weight
        self.fc5 = nn.Linear(50, 5, bias=False)
        self.fixed = nn.Parameter(torch.tensor([2.0, 2.0]), requires_grad=False)

    def forward(self, x):
        for layer in (self.fc1, self.fc2, self.fc3, self.fc4):
            x = torch.relu(layer(x))
        return self.fc5(x)


def _wrap(variant: str, module: nn.Module) -> nn.Module:
    if variant.startswith("bucketed"):
        size = variant.partition(":")[2]
        return DDPBucketed(module, float(size) if size else None)
    return DDP_VARIANTS[variant](module)


def _variant(text: str) -> str:
    """argparse type of --variants: a DDP_VARIANTS name, or bucketed:MB with MB > 0."""
    name, _, size = text.partition(":")
    try:
        ok = name in DDP_VARIANTS and (not size or (name == "bucketed" and float(size) > 0))
    except ValueError:
        ok = False
    if not ok:
        raise argparse.ArgumentTypeError(
            f"expected one of {', '.join(DDP_VARIANTS)} or bucketed:MB, got {text!r}"
        )
    return text


def _check_one(variant: str, steps: int, batch: int) -> tuple[list[dict], dict]:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)  # different initial weights on every rank
    local = TiedToyModel()
    reference = copy.deepcopy(local)
    before = {n: p.detach().clone() for n, p in local.named_parameters()}
    ddp = _wrap(variant, local)
    with torch.no_grad():
        for p in reference.parameters():
            dist.broadcast(p, src=0)
    changed = [n for n, p in ddp.module.named_parameters() if not torch.equal(p, before[n])]
    changed_per_rank: list = [None] * world
    dist.all_gather_object(changed_per_rank, changed)  # rank 0 keeps its weights; the others take them
    g = torch.Generator().manual_seed(1234)
    x, y = torch.randn(batch, 10, generator=g), torch.randn(batch, 5, generator=g)
    shard = slice(rank * batch // world, (rank + 1) * batch // world)
    opt_ref = torch.optim.SGD(reference.parameters(), lr=0.1)
    opt_ddp = torch.optim.SGD(ddp.parameters(), lr=0.1)
    records = []
    for step in range(1, steps + 1):
        opt_ref.zero_grad()
        opt_ddp.zero_grad()
        nn.functional.mse_loss(reference(x), y).backward()
        opt_ref.step()
        loss = nn.functional.mse_loss(ddp(x[shard]), y[shard])
        loss.backward()
        ddp.finish_gradient_synchronization()
        opt_ddp.step()
        for (name, p_ref), p in zip(reference.named_parameters(), ddp.module.parameters()):
            gathered = [torch.empty_like(p) for _ in range(world)]
            dist.all_gather(gathered, p.detach())
            records.append(
                {
                    "variant": variant,
                    "step": step,
                    "param": name,
                    "trainable": p.requires_grad,
                    "max_abs_diff_vs_single": float((p - p_ref).abs().max()),
                    "max_abs_diff_across_ranks": float(max((t - gathered[0]).abs().max() for t in gathered)),
                    "local_loss": float(loss),
                }
            )
    meta = {
        "variant": variant,
        "world_size": world,
        "batch": batch,
        "steps": steps,
        "overwritten_by_broadcast": dict(enumerate(changed_per_rank)),
    }
    return records, meta


def run_check(variants: Sequence[str], steps: int, batch: int, out: str | None) -> None:
    """Worker body (all ranks): every variant in turn; rank 0 writes the comparison as JSON."""
    setup_process_group("gloo")
    if batch % dist.get_world_size():
        raise ValueError(f"batch {batch} is not divisible by world size {dist.get_world_size()}")
    result = {}
    for variant in variants:
        records, meta = _check_one(variant, steps, batch)
        result[variant] = {"records": records, "meta": meta}
    if dist.get_rank() == 0 and out:
        Path(out).write_text(json.dumps(result))
    cleanup_process_group()


def check_against_single_process(
    variants: Sequence[str] = ("naive",),
    *,
    world_size: int = 2,
    steps: int = 5,
    batch: int = 16,
    timeout_s: float = 300.0,
) -> dict[str, tuple[pd.DataFrame, dict]]:
    """Launch the check through torchrun (gloo, CPU, one launch for all variants).

    Returns {variant: (per step x parameter differences, metadata)}.
    """
    for v in variants:
        if v.partition(":")[0] not in DDP_VARIANTS:
            raise ValueError(f"unknown variant {v!r}; known: {', '.join(DDP_VARIANTS)} (bucketed:<MB>)")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "check.json"
        args = ["--variants", *variants, "--steps", str(steps), "--batch", str(batch), "--out", str(out)]
        run_torchrun(
            MODULE, args, world_size, timeout_s=timeout_s, echo=False, env={"CUDA_VISIBLE_DEVICES": ""}
        )
        result = json.loads(out.read_text())
    return {v: (pd.DataFrame(r["records"]), r["meta"]) for v, r in result.items()}


def per_step(records: pd.DataFrame) -> pd.DataFrame:
    """Largest parameter difference after each step: vs single-process training and across ranks."""
    return records.groupby("step").agg(
        max_abs_diff_vs_single=("max_abs_diff_vs_single", "max"),
        max_abs_diff_across_ranks=("max_abs_diff_across_ranks", "max"),
    )


def variants_table(checks: dict[str, tuple[pd.DataFrame, dict]]) -> pd.DataFrame:
    """One row per checked variant: its largest difference vs single-process training and across ranks."""
    return pd.DataFrame(
        [
            {
                "variant": v,
                "max |DDP - single|": d.max_abs_diff_vs_single.max(),
                "max |rank r - rank 0|": d.max_abs_diff_across_ranks.max(),
            }
            for v, (d, _) in checks.items()
        ]
    )


def facts(checks: dict[str, tuple[pd.DataFrame, dict]], variant: str = "naive") -> dict[str, Any]:
    """The numbers the answer of notebook 13 states, from `check_against_single_process` results.

    rank0_changed: parameters rank 0's broadcast changed on rank 0 (0 when correct); replaced: the
    names the broadcast overwrote on the other ranks, sorted and comma-joined; max_across_ranks /
    max_vs_single: `variant`'s largest differences over all steps; worst_vs_single: over all variants.
    """
    if variant not in checks:
        raise ValueError(f"no check of {variant!r}; checked: {', '.join(checks)}")
    records, meta = checks[variant]
    overwritten = meta["overwritten_by_broadcast"]
    others = {r: names for r, names in overwritten.items() if int(r) != 0}
    steps = per_step(records)
    return {
        "world_size": meta["world_size"],
        "rank0_changed": len(overwritten["0"]),
        "replaced": ", ".join(sorted({n for names in others.values() for n in names})),
        "max_across_ranks": float(steps.max_abs_diff_across_ranks.max()),
        "max_vs_single": float(steps.max_abs_diff_vs_single.max()),
        "worst_vs_single": float(variants_table(checks)["max |DDP - single|"].max()),
    }


def main(argv: Sequence[str] | None = None) -> None:
    p = cli.make_parser(
        __doc__, "python -m cs336_systems.studies.distributed.ddp_check --variants naive bucketed:0.01"
    )
    p.add_argument(
        "--variants",
        nargs="+",
        default=["naive"],
        type=_variant,
        help=f"DDP wrappers to check: {', '.join(DDP_VARIANTS)} (bucketed:MB for a bucket size)",
    )
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch", type=int, default=16, help="global batch (split over the ranks)")
    p.add_argument("--out", default=None, help="rank 0 writes the comparison here (JSON)")
    p.add_argument("--world-size", type=int, default=2, help="driver: number of processes")
    args = p.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", args.world_size))  # under torchrun: the real world size
    if min(args.steps, args.batch, world) < 1 or args.batch % world:
        p.error("--steps, --batch and --world-size must be >= 1, and --batch a multiple of --world-size")
    if "WORLD_SIZE" in os.environ:
        run_check(args.variants, args.steps, args.batch, args.out)
        return
    results = check_against_single_process(
        args.variants, world_size=args.world_size, steps=args.steps, batch=args.batch
    )
    for df, meta in results.values():
        print(json.dumps(meta))
        print(df.groupby("step")[["max_abs_diff_vs_single", "max_abs_diff_across_ranks"]].max().to_string())


if __name__ == "__main__":
    main()
