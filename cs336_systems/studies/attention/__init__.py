"""Attention: naive attention at scale, torch.compile, and the FlashAttention-2 benchmarks.

Problems pytorch_attention, torch_compile, flash_benchmarking, flash_leaderboard (notebooks 06, 07,
10, 11) and the Hopper kernels (42).

Every study (listed in `STUDIES`) has its config, `measure(config, *, results_dir=None) -> rows`, a
`main()` CLI and `facts(df) -> dict`; `flash_sweep` and `flash_leaderboard` share one CLI,
`flash_bench` (`CLI` names it), which imports them (their own `main` would be an import cycle). The
other modules are the family's helpers.

* `pytorch_attention` (study; + `pytorch_attention_facts`, its accounting, tables, figure and facts,
  re-exported): naive attention at scale, time and memory, with the memory accounting.
* `torch_compile` (study): compiled attention and the compiled whole model (times the model with
  `profiling.end_to_end`).
* `impls`: the attention implementations the FlashAttention benchmarks time, by name.
* `flash_bench`: the CLI of the FlashAttention benchmarks (sweep, leaderboard, tuning); what it runs:
  the studies `flash_sweep` (flash_benchmarking) and `flash_leaderboard` (+ `flash_leaderboard_facts`,
  its runs' history, tables, plot and facts), and the tuning helpers
  `flash_tuning` (tile tuning, ncu reports) and `flash_backward_tuning` (the one-pass backward),
  whose rows `flash_leaderboard` and `flash_hopper` read, and `flash_ab` (interleaved A/B of Hopper
  kernel configurations against cuDNN, printed only).
* `flash_hopper` (study): the Gluon kernels' tuning, protocol and model-shape runs (+ `flash_hopper_facts`,
  their tables, plot and facts).
* `flash_host`: the protocol step's host side for `flash_bench --host-profile` (host time per call in
  interleaved rounds, rows "host_times" and their table; the profile, printed only).
* `flash_overhead` (study): the host overhead of the flash_benchmarking calls (CUDA graph replays).
* `flash_model` (study): our kernel inside the model (equivalence and training steps).
* `flash_offline`: the Hopper (Gluon) kernels compiled for sm_90a without a GPU, their registers,
  spills and shared memory (a CPU test and the optimisation log's offline evidence).
* `python -m cs336_systems.studies.attention` (this folder's `__main__`): the naive-attention and
  compile measurements on the host it is on (a time budget only with `--budget-s`).
"""

STUDIES = (
    "pytorch_attention",
    "torch_compile",
    "flash_sweep",
    "flash_leaderboard",
    "flash_hopper",
    "flash_overhead",
    "flash_model",
)
CLI = {"flash_sweep": "flash_bench", "flash_leaderboard": "flash_bench"}
