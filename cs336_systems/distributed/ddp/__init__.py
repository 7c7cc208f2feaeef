"""Four data-parallel wrappers with one interface: `forward`, `finish_gradient_synchronization()`, `no_sync()`.

* `NaiveDDP`: one blocking all-reduce per gradient after backward (handout 2.2).
* `FlatDDP`: one blocking all-reduce of all gradients flattened into one buffer (2.3.1).
* `DDPIndividualParameters`: async per-parameter all-reduce from gradient hooks, overlapping backward (2.3.2).
* `DDPBucketed(module, bucket_size_mb)`: async all-reduce per bucket of gradients (2.3.3).
"""

from cs336_systems.distributed.ddp.bucketed import DDPBucketed, plan_buckets
from cs336_systems.distributed.ddp.flat import FlatDDP
from cs336_systems.distributed.ddp.naive import NaiveDDP
from cs336_systems.distributed.ddp.overlap import DDPIndividualParameters

DDP_VARIANTS = {
    "naive": NaiveDDP,
    "flat": FlatDDP,
    "overlap": DDPIndividualParameters,
    "bucketed": DDPBucketed,
}

__all__ = ["DDP_VARIANTS", "DDPBucketed", "DDPIndividualParameters", "FlatDDP", "NaiveDDP", "plan_buckets"]
