"""Distributed training library: process groups, the torchrun launcher, DDP variants, sharded optimizer, FSDP.

Benchmarks of these live in `cs336_systems.studies.distributed`; analytic models in `cs336_systems.accounting`.
"""

from cs336_systems.distributed.ddp import DDPBucketed, DDPIndividualParameters, FlatDDP, NaiveDDP
from cs336_systems.distributed.fsdp import FSDP
from cs336_systems.distributed.sharded_optimizer import ShardedOptimizer

__all__ = ["FSDP", "DDPBucketed", "DDPIndividualParameters", "FlatDDP", "NaiveDDP", "ShardedOptimizer"]
