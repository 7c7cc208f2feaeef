"""The studies: one package per family of handout problems. A study measures (a CLI and functions that
append tidy rows through `cs336_systems.measure.results`) and derives the numbers its notebook quotes.

* `profiling/`: benchmarking_script, mixed precision, nsys_profile, memory_profiling,
  gradient_checkpointing; `python -m cs336_systems.studies.profiling` measures them on this host.
* `attention/`: pytorch_attention, torch_compile, the FlashAttention-2 benchmarks, tuning, host
  overhead, the Hopper kernels; `python -m cs336_systems.studies.attention` measures the naive and
  compiled attention on this host, `python -m cs336_systems.studies.attention.flash_bench` the kernels.
* `training/`: training_step and the 8B training leaderboard.
* `distributed/`: all-reduce, DDP, optimizer-state sharding and FSDP benchmarks (torchrun workers).
* `written/`: the written accounting problems (2025 section 2.4, 2026 section 8).
* `overview/`: the problem index (notebook 00) and the README's headline results.

A study imports studies of its own family only, or a module another family lists in its `SHARED`
(e.g. `profiling.end_to_end`, `distributed.runner`); `overview` reads every family.
`tests/test_architecture.py` checks it. Layer: a study may import the library, `measure` and (for
plotting only) `report`; notebooks import studies.
"""
