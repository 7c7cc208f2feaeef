"""Studies of the distributed problems, run as `torchrun` workers from a driver in the same module.

`runner` is the one runner: launch N ranks, measure the variants in order, record a failed variant and
relaunch the rest, write rows. It is configured by `train_bench` (DDP variants; `ddp_variants` holds
the labels and wrappers, `ddp_facts` the tables, bucket model and facts), `sharding_bench`
(optimizer-state sharding; `sharding_facts`) and `fsdp_bench` (FSDP; `fsdp_facts`,
`fsdp_trace` for the profiled step); `rank_memory` measures a rank's memory. Also `comm_bench`
(all-reduce), `ddp_check` (DDP against one process), figures in `plots` and `trace_plot`.

Shared helpers (other families may import them): `runner`, which also launches the training
leaderboard's ranks, and `trace_plot`, the ranks' Chrome-trace timelines.
"""

SHARED = ("runner", "trace_plot")
