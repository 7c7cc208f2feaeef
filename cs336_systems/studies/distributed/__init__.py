"""Studies of the distributed problems, run as `torchrun` workers from a driver in the same module.

`runner` is the one runner: launch N ranks, measure the variants in order, record a failed variant and
relaunch the rest, write rows. It is configured by `train_bench` (DDP variants; `ddp_variants` holds
the labels and wrappers, `ddp_facts` the tables, bucket model and facts), `sharding_bench`
(optimizer-state sharding; `sharding_facts`) and `fsdp_bench` (FSDP; `fsdp_facts`,
`fsdp_trace` for the profiled step); `rank_memory` measures a rank's memory. Also `comm_bench`
(all-reduce), `ddp_check` (DDP against one process), figures in `plots` and `trace_plot`.

Studies in the common shape (listed in `STUDIES`: config, `measure(config, *, results_dir=None) ->
rows`, `main()`, `facts(df)`): `comm_bench` (`GridConfig`; the rows the grid appended), `train_bench`
(`TrainBenchConfig`, `notebook_config` for the notebooks' setting; `facts` re-exported from
`ddp_facts`, which holds `PROBLEM` and `trace_path` through `ddp_variants` so that it does not import
`train_bench`), `sharding_bench` and `fsdp_bench` (`facts` re-exported from their `*_facts`) and
`fsdp_parity` (`ParityConfig`; its comparison rows; `facts(df)["runs"]`: one dict per recorded run).
Not in it: `ddp_check`, a correctness check rather than a measurement: it writes no rows (the
comparison comes back from its torchrun workers as one JSON file per launch, read into
{variant: (per-step frame, metadata)}), so it has no results to take a `results_dir` or a
`facts(df)` over; its `facts(checks)` reads those frames.

Shared helpers (other families may import them): `runner`, which also launches the training
leaderboard's ranks, `trace_plot`, the ranks' Chrome-trace timelines, and `comm_facts`, the all-reduce
grid's analysis (`comm_bench` re-exports it) with the latency-bandwidth fit.
"""

SHARED = ("runner", "trace_plot", "comm_facts")
STUDIES = ("comm_bench", "train_bench", "sharding_bench", "fsdp_bench", "fsdp_parity")
