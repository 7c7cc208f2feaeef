"""One module per handout problem or family: each measures (a CLI and functions that append tidy rows
through `cs336_systems.measure.results`) and analyses its rows for the notebooks.

* `end_to_end`, `autocast_study`, `mixed_precision`, `profile`, `timing_analysis`: benchmarking_script,
  mixed precision and nsys_profile; `timing_gpu_run` is their budgeted one-GPU run.
* `memory` (+ `memory_analysis`, the facts of its answers), `pytorch_attention` (+ `attention_results`,
  its rows' tables and facts), `compile_study`, `checkpointing_study`: memory_profiling,
  pytorch_attention, torch_compile, gradient_checkpointing;
  `memory_attention_gpu_run` is their budgeted one-GPU run.
* `communication_accounting`, `parallelism_calcs`: the written accounting problems (2025 section 2.4,
  2026 section 8), computed from `cs336_systems.accounting`.
* `flash_bench`, `flash_model`: FlashAttention-2 benchmarks, the leaderboard, our kernel in the model;
  `flash_overhead`: the same calls timed from CUDA graph replays beside the eager call (host overhead).
* `distributed/`: all-reduce, DDP, optimizer-sharding and FSDP benchmarks (torchrun workers) and plots.
* `train_step` (+ `train_step_results`, its rows' waterfall and facts): the 2026 training_step problem.
* `readme_summary`: the README's headline results, computed from the committed rows.
* `problem_index`: every handout problem, where it is answered, its tests and status (the writeup's
  overview, notebook 00).

Layer: may import the library, `measure` and (for plotting only) `report`; notebooks import studies.
"""
