"""The training stack: the fused AdamW optimizer and the configurable training step (library).

* `FusedAdamW`, `mixed_precision_groups`: the reference AdamW's update in multi-tensor Triton
  launches, with optional bf16 compute weights (float32 masters, optionally split into the weight
  and 16 bits) and overlap with backward.
* `TrainStepConfig`, `build_train_step`: one step of `BasicsTransformerLM` with any subset of the
  optimisations (autocast, attention implementation, per-block compile, fused optimizer, fused loss).
* `Offloader`, `step_tensors`: park a step's parameters, gradients, buffers and optimizer state in
  host memory between uses (in place; compiled code keeps working) and bring them back.
* `LeaderboardConfig`, `build_leaderboard_step`: the 2026 leaderboard's step on any number of ranks
  (ZeRO-2 over flat units, fused AdamW in bf16 or with float32 masters, chunked loss, partial
  activation checkpointing).
"""

from cs336_systems.training.fused_adamw import FusedAdamW, mixed_precision_groups
from cs336_systems.training.leaderboard import (
    LeaderboardConfig,
    LeaderboardStep,
    build_leaderboard_step,
    transformer_units,
)
from cs336_systems.training.offload import Offloader, step_tensors
from cs336_systems.training.step import TrainStep, TrainStepConfig, block_bucket_key, build_train_step

__all__ = [
    "FusedAdamW",
    "LeaderboardConfig",
    "LeaderboardStep",
    "Offloader",
    "TrainStep",
    "TrainStepConfig",
    "block_bucket_key",
    "build_leaderboard_step",
    "build_train_step",
    "mixed_precision_groups",
    "step_tensors",
    "transformer_units",
]
