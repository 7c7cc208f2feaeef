"""Memory plan of the training leaderboard: what the 8B config needs per GPU, computed, never typed in.

`memory_plan(cfg, ...)` returns, in bytes (the CLI prints it in GiB before anything runs; notebook 41
shows it as a table):
* `params`: the parameter count (`ModelConfig.num_params`);
* `state_<path>_<mode>`: persistent training state per rank. Ours (ZeRO-2, `zero_state_bytes`): the
  full weights + 1/N of the optimizer state (gradients live one unit at a time). Stock (FSDP2):
  (weights + gradients + AdamW state) / N, per `accounting.memory.BytesPerParam` of the mode;
* `block_input`: one (batch, T, d_model) residual in the compute dtype, what a checkpointed block
  keeps (all L of them: `block_inputs`);
* `block_saved`: what one block keeps for backward when it is not checkpointed, counted by
  saved-tensor hooks on the "meta" device (no memory used) for the eager block with a FlashAttention
  that saves q, k, v, o and the logsumexp (`_FlashLikeAttention`); the compiled block may save less;
* `logits_bf16`: the logits of the rank's batch if they were materialised (the fused / chunked loss
  never does).

`predicted_min_bytes` is a lower bound of a configuration's peak (state + every block input + one
block's activations + one LM-head chunk's logits, plus for stock the bf16 copies that FSDP2 gathers
of the root and two blocks): the study skips a configuration, with the numbers in the row's note, only
when even this bound exceeds the device.
"""

from __future__ import annotations

import torch
from torch import Tensor

from cs336_systems.distributed.zero import PARAM_MODES, zero_state_bytes
from cs336_systems.model import ModelConfig, RotaryEmbedding, TransformerBlock
from cs336_systems.model.checkpointing import saved_tensors

GiB = 2**30


class _FlashLikeAttention(torch.autograd.Function):
    """An attention stand-in that saves what FlashAttention saves (q, k, v, o, logsumexp); meta only."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, is_causal: bool) -> Tensor:
        o = torch.empty_like(q)
        lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        ctx.save_for_backward(q, k, v, o, lse)
        return o

    @staticmethod
    def backward(ctx, grad_o: Tensor):  # never run: the plan counts what forward saves
        raise NotImplementedError


def block_saved_bytes(cfg: ModelConfig, batch: int, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes one eager block saves for backward at (batch, cfg.context_length), counted on "meta"."""
    rope = RotaryEmbedding(cfg.context_length, cfg.d_head, cfg.rope_theta, device="meta")
    attention = lambda q, k, v, causal: _FlashLikeAttention.apply(q, k, v, causal)
    block = TransformerBlock(
        cfg.d_model, cfg.num_heads, cfg.d_ff, rope, attention, device="meta", dtype=dtype
    )
    x = torch.empty(batch, cfg.context_length, cfg.d_model, device="meta", dtype=dtype, requires_grad=True)
    _, record = saved_tensors(block, x, module=block)
    return record.activation_bytes


def _stock_state_bytes(num_params: int, mode: str, world_size: int) -> float:
    per_param = {"bf16": 2 + 2 + 4, "fp32_master": 4 + 4 + 8, "fp32": 4 + 4 + 8}[mode]
    return num_params * per_param / world_size


def memory_plan(cfg: ModelConfig, *, batch: int, world_size: int, loss_chunk: int) -> dict[str, float]:
    """The numbers of the module docstring, in bytes, for one rank holding `batch` sequences."""
    n = cfg.num_params()
    compute = 2  # bf16 activations in every mode the leaderboard runs on a GPU
    plan: dict[str, float] = {"params": float(n), "world_size": float(world_size)}
    for mode in PARAM_MODES:
        plan[f"state_ours_{mode}"] = zero_state_bytes(n, mode, world_size)
        plan[f"state_stock_{mode}"] = _stock_state_bytes(n, mode, world_size)
    plan["block_input"] = float(batch * cfg.context_length * cfg.d_model * compute)
    plan["block_inputs"] = cfg.num_layers * plan["block_input"]
    plan["block_saved"] = float(block_saved_bytes(cfg, batch))
    plan["logits_bf16"] = float(batch * cfg.context_length * cfg.vocab_size * compute)
    plan["loss_chunk_logits"] = float(min(loss_chunk, batch * cfg.context_length) * cfg.vocab_size * (2 + 4))
    return plan


def predicted_min_bytes(plan: dict[str, float], cfg: ModelConfig, *, path: str, mode: str) -> float:
    """A lower bound of the peak of (path, mode) on one rank (module docstring)."""
    path = "stock" if path.startswith("stock") else path  # both stock steps keep FSDP2's state
    total = (
        plan[f"state_{path}_{mode}"] + plan["block_inputs"] + plan["block_saved"] + plan["loss_chunk_logits"]
    )
    if path == "stock" and mode != "bf16":  # FSDP2 computes on bf16 copies of the gathered parameters
        per_block = 4 * cfg.d_model**2 + 3 * cfg.d_model * cfg.d_ff
        total += 2 * (2 * cfg.vocab_size * cfg.d_model + 2 * per_block)
    return total


def skip_note(
    plan: dict[str, float], cfg: ModelConfig, *, path: str, mode: str, capacity: float
) -> str | None:
    """Why (path, mode) cannot fit a device of `capacity` bytes, or None when it may."""
    need = predicted_min_bytes(plan, cfg, path=path, mode=mode)
    path = "stock" if path.startswith("stock") else path
    if need <= capacity:
        return None
    return (
        f"skipped: needs at least {need / GiB:.1f} GiB per GPU (state {plan[f'state_{path}_{mode}'] / GiB:.1f}, "
        f"{cfg.num_layers} block inputs {plan['block_inputs'] / GiB:.1f}, one block's activations "
        f"{plan['block_saved'] / GiB:.1f}), the device has {capacity / GiB:.1f} GiB"
    )
