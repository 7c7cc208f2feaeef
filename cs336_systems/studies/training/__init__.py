"""Training: the 2026 training_step problem, the 8B training leaderboard and the training entry point's
run (notebooks 40, 41, 43).

* `train_step` (+ `train_step_facts`, the waterfall and facts): our fastest step against the stock
  PyTorch step, in one process.
* `leaderboard`: the leaderboard's run (ours against stock FSDP2, torchrun ranks through
  `distributed.runner`), with its parts `leaderboard_bench` (the timed step, checkpoint choice,
  profiled step), `leaderboard_memory` (the memory plan) and `leaderboard_stock` (the stock
  baseline); `leaderboard_facts`: its tables, timeline and facts.
* `train_run`: the entry point's committed GPU run (`train.gpu_demo`): loss, tokens/s, MFU against the
  training-step rows; `train_scaling`: the 8B step over 1..64 GPUs (ZeRO-2, FSDP, hybrid) from
  `accounting` and the committed rows, checked against the one- and two-GPU measurements.
"""
