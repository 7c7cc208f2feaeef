"""Training: the 2026 training_step problem and the 8B training leaderboard (notebooks 40, 41).

* `train_step` (+ `train_step_facts`, the waterfall and facts): our fastest step against the stock
  PyTorch step, in one process.
* `leaderboard`: the leaderboard's run (ours against stock FSDP2, torchrun ranks through
  `distributed.runner`), with its parts `leaderboard_bench` (the timed step, checkpoint choice,
  profiled step), `leaderboard_memory` (the memory plan) and `leaderboard_stock` (the stock
  baseline); `leaderboard_facts`: its tables, timeline and facts.
"""
