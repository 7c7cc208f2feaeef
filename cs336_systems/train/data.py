"""Token files and the batches of a step, as a pure function of (seed, step, rank).

A token file is a flat array of token ids (uint16 or uint32), as the Basics assignment writes it with
`np.ndarray.tofile`, read through a NumPy memmap (nothing is loaded up front).

[Note: batches as a pure function]
The global batch of step s is `batch_size` windows of context_length + 1 tokens whose start offsets
come from a NumPy generator seeded with (seed, 0, s); rank r of N takes rows [r*B/N, (r+1)*B/N).
Nothing depends on what ran before, so a run resumed at step s reads exactly the batches an
uninterrupted run reads, on any number of ranks whose global batch is the same, and the union of the
ranks' batches is the one-process batch (the multi-node test relies on both). Validation batch i
uses (seed, 1, i): the same held-out windows at every evaluation.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import Tensor

SAMPLE_TOKENS = 1 << 20  # tokens of each file checked against the vocabulary before training


class TrainInputError(ValueError):
    """Bad input to a training run (file, token ids, checkpoint): reported before any work."""


class TokenFile:
    """A memmapped token file, checked: the size fits the dtype, it holds a batch, ids fit the vocabulary.

    path: the file; dtype: "uint16" or "uint32"; vocab_size: ids must be < this;
    min_tokens: fewer tokens than this is an error (one batch); flag: the CLI flag named in errors.
    """

    def __init__(self, path: str | Path, dtype: str, vocab_size: int, *, min_tokens: int, flag: str):
        self.path, self.flag, self.vocab_size = Path(path), flag, vocab_size
        if not self.path.is_file():
            raise TrainInputError(f"{flag} {self.path}: no such file")
        itemsize = np.dtype(dtype).itemsize
        nbytes = self.path.stat().st_size
        if nbytes % itemsize:
            raise TrainInputError(
                f"{flag} {self.path}: {nbytes} bytes is not a whole number of {dtype} tokens "
                "(is --data-dtype right?)"
            )
        num = nbytes // itemsize
        if num < min_tokens:
            raise TrainInputError(
                f"{flag} {self.path}: {num} tokens, fewer than one batch needs ({min_tokens} = "
                "batch size x context length + 1)"
            )
        self.tokens = np.memmap(self.path, dtype=dtype, mode="r")
        self._check_sample()

    def __len__(self) -> int:
        return len(self.tokens)

    def _check_sample(self) -> None:
        """Check the file's head, tail and a strided sample through it against the vocabulary."""
        n = len(self.tokens)
        stride = max(1, n // SAMPLE_TOKENS)
        for part in (self.tokens[:SAMPLE_TOKENS], self.tokens[-SAMPLE_TOKENS:], self.tokens[::stride]):
            self.check_ids(np.asarray(part), "in a sample of the file")

    def check_ids(self, ids: np.ndarray, where: str) -> None:
        top = int(ids.max())
        if top >= self.vocab_size:
            raise TrainInputError(
                f"{self.flag} {self.path}: token id {top} {where} is >= the model's vocab_size "
                f"{self.vocab_size} (wrong --data-dtype, --size or --config?)"
            )

    def windows(self, starts: np.ndarray, context_length: int) -> np.ndarray:
        """(len(starts), context_length + 1) token ids, checked against the vocabulary."""
        ids = np.asarray(self.tokens[starts[:, None] + np.arange(context_length + 1)])
        self.check_ids(ids, "in a batch")  # on the host, a few KB: no device sync
        return ids


def batch_starts(
    seed: int, key: int, index: int, num_tokens: int, context_length: int, batch: int
) -> np.ndarray:
    """Start offsets of the global batch `index` of stream `key` (0: training, 1: validation)."""
    rng = np.random.default_rng([seed, key, index])
    return rng.integers(0, num_tokens - context_length, size=batch)


def rank_batch(
    data: TokenFile,
    *,
    seed: int,
    key: int,
    index: int,
    batch_size: int,
    context_length: int,
    rank: int,
    world_size: int,
    device: torch.device,
) -> tuple[Tensor, Tensor]:
    """This rank's (inputs, targets), each (batch_size / world_size, context_length) int64 on `device`."""
    starts = batch_starts(seed, key, index, len(data), context_length, batch_size)
    local = batch_size // world_size
    ids = torch.from_numpy(
        data.windows(starts[rank * local : (rank + 1) * local], context_length).astype(np.int64)
    )
    if device.type == "cuda":
        ids = ids.pin_memory().to(device, non_blocking=True)
    return ids[:, :-1], ids[:, 1:]


def write_tokens(
    path: str | Path, num_tokens: int, vocab_size: int, *, seed: int = 0, dtype: str = "uint16"
) -> Path:
    """A token file with learnable structure: each id is the previous plus one of four steps (mod vocab).

    A model can learn it down to ln(4) = 1.386 nats per token from ln(vocab_size) at the start, so a
    loss curve on generated data shows training working. Writes in 16M-token pieces.
    """
    if num_tokens < 2 or vocab_size < 8:
        raise ValueError(f"need num_tokens >= 2 and vocab_size >= 8, got {num_tokens}, {vocab_size}")
    if vocab_size > np.iinfo(dtype).max + 1:
        raise ValueError(f"vocab_size {vocab_size} does not fit {dtype}")
    rng = np.random.default_rng(seed)
    steps = np.array([1, 2, 3, 5], dtype=np.int64)
    path = Path(path)
    current = int(rng.integers(vocab_size))
    with path.open("wb") as f:
        for start in range(0, num_tokens, 1 << 24):
            n = min(1 << 24, num_tokens - start)
            ids = (current + np.cumsum(steps[rng.integers(0, 4, size=n)])) % vocab_size
            ids.astype(dtype).tofile(f)
            current = int(ids[-1])
    return path
