"""Profiling: end-to-end timing, mixed precision, kernel profiles, memory and activation checkpointing.

Problems benchmarking_script, mixed_precision_accumulation, benchmarking_mixed_precision,
nsys_profile, memory_profiling (notebooks 01-05) and gradient_checkpointing (30).

* `end_to_end`: the end-to-end step benchmark (config, workload, `run_one`, sweep, CLI); the family's
  shared helper, which other families' model-level studies time with.
* `timing_facts`: tables, figures and facts of benchmarking_script and benchmarking_mixed_precision.
* `accumulation`: mixed_precision_accumulation (the four fp32/fp16 loops, computed live).
* `mixed_precision`: benchmarking_mixed_precision (autocast dtypes, LayerNorm precision, timings).
* `kernel_profile` (+ `kernel_tables`, the trace's kernel tables; `kernel_facts`, the answers'
  numbers): nsys_profile with torch.profiler and NVTX ranges.
* `memory` (+ `memory_block`, one block's saved bytes; `memory_timeline`, snapshot timelines;
  `memory_facts`, the answers' numbers): memory_profiling.
* `checkpointing`: gradient_checkpointing (cost model and measured strategies).
* `timing_run`, `memory_run`: the measurements as stages, called by the notebooks and by
  `python -m cs336_systems.studies.profiling` (this folder's `__main__`), which runs the family on
  the host it is on (a time budget only with `--budget-s`).
"""

SHARED = ("end_to_end",)
