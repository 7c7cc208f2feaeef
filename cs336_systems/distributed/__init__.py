"""Distributed training: process groups, collectives benchmark, DDP variants, sharded optimizer, FSDP."""

from cs336_systems.distributed.fsdp import FSDP
from cs336_systems.distributed.sharded_optimizer import ShardedOptimizer

__all__ = ["FSDP", "ShardedOptimizer"]
