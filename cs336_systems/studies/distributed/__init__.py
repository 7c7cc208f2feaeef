"""Studies of the distributed problems, run as `torchrun` workers from a driver in the same module.

`runner` is the one runner: launch N ranks, measure the variants in order, record a failed variant and
relaunch the rest, write rows. It is configured by `train_bench` (DDP variants; `ddp_variants` holds
the labels and wrappers, `ddp_facts` the tables, bucket model and facts), `sharding_bench`
(optimizer-state sharding; `sharding_facts`) and `fsdp_bench` (FSDP; `fsdp_facts`,
`fsdp_trace` for the profiled step); `rank_memory` measures a rank's memory. Also `comm_bench`
(all-reduce), `ddp_check` (DDP against one process), figures in `plots` and `trace_plot`.

Studies in the common shape (listed in `STUDIES`: config, `measure(config, *, results_dir=None) ->
rows`, `main()`, `facts(df)`): `sharding_bench` and `fsdp_bench` (`facts` re-exported from their
`*_facts`). Not yet in it: `comm_bench` (`run_grid`), `train_bench` (`measure(variants, ...)`, facts in
`ddp_facts`, which imports it), `ddp_check` and `fsdp_parity` (`check_against_single_process`, `run`).

Shared helpers (other families may import them): `runner`, which also launches the training
leaderboard's ranks, and `trace_plot`, the ranks' Chrome-trace timelines.
"""

SHARED = ("runner", "trace_plot")
STUDIES = ("sharding_bench", "fsdp_bench")
