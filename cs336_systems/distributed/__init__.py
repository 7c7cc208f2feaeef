"""Distributed training: process groups, collectives benchmark, DDP variants, sharded optimizer, FSDP."""

from cs336_systems.distributed.ddp import DDPBucketed, DDPIndividualParameters, FlatDDP, NaiveDDP
from cs336_systems.distributed.fsdp import FSDP
from cs336_systems.distributed.sharded_optimizer import ShardedOptimizer

__all__ = ["FSDP", "DDPBucketed", "DDPIndividualParameters", "FlatDDP", "NaiveDDP", "ShardedOptimizer"]
