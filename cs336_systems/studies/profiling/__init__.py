"""Profiling: end-to-end timing, mixed precision, kernel profiles, memory and activation checkpointing.

Problems benchmarking_script, mixed_precision_accumulation, benchmarking_mixed_precision,
nsys_profile, memory_profiling (notebooks 01-05) and gradient_checkpointing (30).

Every study (listed in `STUDIES`) has its config, `measure(config, *, results_dir=None) -> rows`, a
`main()` CLI and `facts(df) -> dict`; the other modules are the family's helpers.

* `end_to_end`: benchmarking_script's study, the end-to-end step benchmark (config, workload,
  `run_one`, `measure`, CLI; `facts` from `timing_facts`); also the family's shared helper, which
  other families' model-level studies time with.
* `timing_facts`: tables, figures and facts of benchmarking_script and benchmarking_mixed_precision.
* `accumulation` (study): mixed_precision_accumulation (the four fp32/fp16 loops, computed live).
* `mixed_precision` (study): benchmarking_mixed_precision (autocast dtypes, LayerNorm precision, timings).
* `kernel_profile` (study; + `kernel_tables`, the trace's kernel tables; `kernel_facts`, the answers'
  numbers): nsys_profile with torch.profiler and NVTX ranges. `kernel_tables` is shared too: its
  `classify_kernel` names the kernel classes of other families' traces (the 8B step's).
* `memory_run` (study; `facts` from `memory_facts`): memory_profiling, whose helpers are `memory`
  (the capture harness), `memory_block` (one block's saved bytes), `memory_timeline` (snapshot
  timelines) and `memory_facts` (the answers' numbers).
* `checkpointing` (study): gradient_checkpointing (cost model and measured strategies).
* `timing_run`, `memory_run`: the measurements as stages (under an optional budget), called by the
  notebooks and by
  `python -m cs336_systems.studies.profiling` (this folder's `__main__`), which runs the family on
  the host it is on (a time budget only with `--budget-s`).
"""

SHARED = ("end_to_end", "kernel_tables")
STUDIES = ("end_to_end", "accumulation", "mixed_precision", "kernel_profile", "memory_run", "checkpointing")
