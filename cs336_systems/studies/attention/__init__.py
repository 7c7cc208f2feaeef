"""Attention: naive attention at scale, torch.compile, and the FlashAttention-2 benchmarks.

Problems pytorch_attention, torch_compile, flash_benchmarking, flash_leaderboard (notebooks 06, 07,
10, 11) and the Hopper kernels (42).

* `pytorch_attention` (+ `pytorch_attention_facts`, its tables, figure and facts): naive attention
  at scale, time and memory, with the memory accounting.
* `torch_compile`: compiled attention and the compiled whole model (times the model with
  `profiling.end_to_end`).
* `impls`: the attention implementations the FlashAttention benchmarks time, by name.
* `flash_bench`: the CLI of the FlashAttention benchmarks (sweep, leaderboard, tuning); the studies
  it runs: `flash_sweep` (flash_benchmarking), `flash_leaderboard` (+ `flash_leaderboard_runs`, the
  protocol-run history), `flash_tuning` (tile tuning, ncu reports), `flash_backward_tuning` (the
  one-pass backward), `flash_hopper` (the Gluon kernels' tables and facts).
* `flash_overhead`: the host overhead of the flash_benchmarking calls (CUDA graph replays).
* `flash_model`: our kernel inside the model (equivalence and training steps).
* `python -m cs336_systems.studies.attention` (this folder's `__main__`): the naive-attention and
  compile measurements on the host it is on (a time budget only with `--budget-s`).
"""
