"""Distributed training: process groups, collectives benchmark, DDP variants, sharded optimizer, FSDP."""
