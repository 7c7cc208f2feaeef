"""Fully sharded data parallelism (2026 fsdp), split by responsibility.

* `sharded_param.py`: the flat, padded shard of one weight and how the full weight is rebuilt.
* `collectives.py`: async all-gather / reduce-scatter / all-reduce with named profiler ranges and the
  gloo fallbacks.
* `wrapper.py`: `FSDP(module, compute_dtype=None)`, the module wrapper and its hooks.
"""

from cs336_systems.distributed.fsdp.sharded_param import ShardedParam
from cs336_systems.distributed.fsdp.wrapper import FSDP, SHARDED_MODULE_TYPES

__all__ = ["FSDP", "SHARDED_MODULE_TYPES", "ShardedParam"]
