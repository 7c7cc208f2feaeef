"""Distributed training library: process groups, the torchrun launcher, DDP variants, sharded optimizer, FSDP,
ZeRO-2 AdamW over flat per-unit buffers.

Benchmarks of these live in `cs336_systems.studies.distributed`; analytic models in `cs336_systems.accounting`.
"""

from cs336_systems.distributed.ddp import DDPBucketed, DDPIndividualParameters, FlatDDP, NaiveDDP
from cs336_systems.distributed.fsdp import FSDP
from cs336_systems.distributed.sharded_optimizer import ShardedOptimizer
from cs336_systems.distributed.zero import ZeroAdamW

__all__ = [
    "FSDP",
    "DDPBucketed",
    "DDPIndividualParameters",
    "FlatDDP",
    "NaiveDDP",
    "ShardedOptimizer",
    "ZeroAdamW",
]
