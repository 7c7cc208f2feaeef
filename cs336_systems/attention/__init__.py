"""FlashAttention-2: the naive reference, a tiled pure-PyTorch version and Triton kernels.

* `attention_reference(q, k, v, is_causal) -> (o, lse)`: naive attention, THE reference.
* `FlashAttentionPytorch` / `flash_attention_pytorch`: tiled autograd.Function (Algorithm 1) with
  the recomputation backward of `backward.flash_backward`.
* `FlashAttentionTriton` / `flash_attention_triton`: Triton forward and two-pass backward kernels.

Both Functions take (batch, N, d) or (batch, heads, N, d) tensors, `.apply(q, k, v, is_causal=False)`.
"""

from cs336_systems.attention.backward import flash_backward
from cs336_systems.attention.flash_pytorch import FlashAttentionPytorch, flash_attention_pytorch
from cs336_systems.attention.flash_triton import FlashAttentionTriton, flash_attention_triton
from cs336_systems.attention.reference import attention_reference

__all__ = [
    "FlashAttentionPytorch",
    "FlashAttentionTriton",
    "attention_reference",
    "flash_attention_pytorch",
    "flash_attention_triton",
    "flash_backward",
]
