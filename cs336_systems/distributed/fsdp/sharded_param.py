"""The sharded parameter of FSDP: a flat, padded 1/N slice of a weight, and how to rebuild the weight.

A weight W of shape `shape` (numel n) is flattened and zero-padded to `padded_numel` = N * ceil(n / N)
elements, so every rank holds the same number of elements S = padded_numel / N and all-gather /
reduce-scatter work on equal chunks:

    flat(W) ++ zeros(padded_numel - n)  =  [ shard_0 | shard_1 | ... | shard_{N-1} ],   shard_r: (S,)

Rank r keeps `shard_r` as an ordinary fp32 `nn.Parameter` of shape (S,) (the master weight that the
optimizer updates); the padding elements live in the last rank(s)' shards, start at zero, receive zero
gradients and therefore stay zero under SGD/AdamW (a zero gradient gives a zero update, and decay of
zero is zero). The full weight is `gathered[:n].view(shape)` of an all-gathered (padded_numel,) buffer.

Caveat: a shard is always 1-D; `FSDP.gather_full_params()` rebuilds full-shape tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn


@dataclass(eq=False)  # identity hashing: one object per distinct weight, shared by tied modules
class ShardedParam:
    """Metadata and shard of one sharded weight.

    name: the weight's first name in `module.named_parameters()`; aliases: every name (tied weights).
    shape: the full weight's shape; numel: its element count; shard: this rank's (S,) nn.Parameter.
    """

    name: str
    shape: torch.Size
    numel: int
    rank: int
    world_size: int
    shard: nn.Parameter
    aliases: list[str] = field(default_factory=list)

    @property
    def shard_numel(self) -> int:
        return self.shard.numel()

    @property
    def padded_numel(self) -> int:
        return self.shard_numel * self.world_size

    @classmethod
    def from_full(cls, name: str, full: Tensor, rank: int, world_size: int) -> ShardedParam:
        """Cut this rank's shard out of the full weight `full` (any shape); the result owns its memory."""
        numel = full.numel()
        shard_numel = -(-numel // world_size)  # ceil
        with torch.no_grad():
            flat = full.detach().reshape(-1)
            start = min(rank * shard_numel, numel)
            stop = min(start + shard_numel, numel)
            data = torch.zeros(shard_numel, dtype=full.dtype, device=full.device)
            data[: stop - start].copy_(flat[start:stop])
        shard = nn.Parameter(data, requires_grad=full.requires_grad)
        return cls(
            name=name,
            shape=full.shape,
            numel=numel,
            rank=rank,
            world_size=world_size,
            shard=shard,
            aliases=[name],
        )

    def unsharded_view(self, gathered: Tensor) -> Tensor:
        """The full weight as a view of an all-gathered (padded_numel,) buffer."""
        if gathered.numel() != self.padded_numel:
            raise ValueError(
                f"{self.name}: gathered buffer has {gathered.numel()} elements, expected {self.padded_numel}"
            )
        return gathered[: self.numel].view(self.shape)

    def padded_flat(self, full_grad: Tensor, dtype: torch.dtype) -> Tensor:
        """A (padded_numel,) contiguous `dtype` copy of a full-shape gradient, zero in the padding."""
        if full_grad.shape != self.shape:
            raise ValueError(
                f"{self.name}: gradient shape {tuple(full_grad.shape)} != weight shape {tuple(self.shape)}"
            )
        flat = full_grad.reshape(-1).to(dtype)
        if self.padded_numel == self.numel:
            return flat.contiguous()
        out = torch.zeros(self.padded_numel, dtype=dtype, device=full_grad.device)
        out[: self.numel].copy_(flat)
        return out
