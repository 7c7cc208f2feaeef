"""Training: the 2026 training_step problem, the 8B training leaderboard and the training entry point's
run (notebooks 40, 41, 43).

Every study (listed in `STUDIES`) has its config, `measure(config, *, results_dir=None) -> rows`, a
`main()` CLI and `facts(df) -> dict`; the other modules are the family's helpers.

* `train_step` (study; + `train_step_facts`, the waterfall's stages, table and `facts`, re-exported):
  our fastest step against the stock PyTorch step, in one process.
* `leaderboard` (study; `facts` re-exported from `leaderboard_facts`): the leaderboard's run (ours against stock FSDP2, torchrun ranks through
  `distributed.runner`), with its parts `leaderboard_bench` (the timed step, checkpoint choice,
  profiled step), `leaderboard_memory` (the memory plan) and `leaderboard_stock` (the stock
  baseline); `leaderboard_facts`: its tables, timeline and facts. Merged, the leaderboard and its
  parts would pass 500 lines, so they stay its helpers.
* `train_run`: the entry point's committed GPU run (`train.gpu_demo`): loss, tokens/s, MFU against the
  training-step rows; `train_scaling`: the 8B step over 1..64 GPUs (ZeRO-2, FSDP, hybrid) from
  `accounting` and the committed rows, checked against the one- and two-GPU measurements.
"""

STUDIES = ("train_step", "leaderboard")
