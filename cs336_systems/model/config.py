"""Model hyperparameters and the named presets of the handouts (Table 1 of 2025 and 2026).

Sizes are keyed by the handout's names. "xl" is the 2025 XL (d_model 1600); the 2026 handout reuses
the name for the 2025 "2.7B" config, which is registered here as "xl_2026" to keep the names unique.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Hyperparameters of `BasicsTransformerLM` (staff-compatible names)."""

    vocab_size: int = 10_000
    context_length: int = 512
    d_model: int
    d_ff: int
    num_layers: int
    num_heads: int
    rope_theta: float = 10_000.0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "context_length", "d_model", "d_ff", "num_layers", "num_heads"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.d_model % self.num_heads:
            raise ValueError(f"d_model={self.d_model} is not divisible by num_heads={self.num_heads}")
        if self.d_head % 2:
            raise ValueError(f"RoPE needs an even head dimension, got d_head={self.d_head}")

    @property
    def d_head(self) -> int:
        return self.d_model // self.num_heads

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def as_kwargs(self) -> dict:
        """The constructor arguments of `BasicsTransformerLM`."""
        return dataclasses.asdict(self)

    def num_params(self, *, non_embedding: bool = False) -> int:
        """Analytic parameter count: 2*V*d (untied embedding and head) + L*(4d^2 + 3*d*d_ff + 2d) + d.

        With `non_embedding=True` the lm_head is left out (the 2025 staff `get_num_params` default).
        """
        d, v = self.d_model, self.vocab_size
        per_block = 4 * d * d + 3 * d * self.d_ff + 2 * d
        total = 2 * v * d + self.num_layers * per_block + d
        return total - v * d if non_embedding else total

    def matmul_flops_per_token(self, seq_len: int | None = None) -> int:
        """Forward FLOPs per token of every matmul (projections, FFN, LM head, attention QK^T and PV).

        Attention scores count the full (non-causal-skipped) T x T product, as a naive implementation
        computes it. Multiply by 3 for forward + backward.
        """
        t = self.context_length if seq_len is None else seq_len
        d = self.d_model
        per_block = 2 * (4 * d * d + 3 * d * self.d_ff) + 2 * 2 * t * d
        return self.num_layers * per_block + 2 * d * self.vocab_size


def _size(d_model: int, d_ff: int, num_layers: int, num_heads: int, **kw) -> ModelConfig:
    return ModelConfig(d_model=d_model, d_ff=d_ff, num_layers=num_layers, num_heads=num_heads, **kw)


MODEL_SIZES: dict[str, ModelConfig] = {
    # A tiny model for CPU tests and quick notebook runs.
    "debug": _size(64, 128, 2, 4, vocab_size=256, context_length=64),
    # 2025 handout, Table 1.
    "small": _size(768, 3072, 12, 12),
    "medium": _size(1024, 4096, 24, 16),
    "large": _size(1280, 5120, 36, 20),
    "xl": _size(1600, 6400, 48, 25),
    "2.7B": _size(2560, 10240, 32, 32),
    # 2026 handout, Table 1 ("xl" there is the 2025 "2.7B").
    "xl_2026": _size(2560, 10240, 32, 32),
    "10B": _size(4608, 12288, 50, 36),
    # 2026 training-step leaderboard config.
    "8B_leaderboard": _size(4096, 11008, 34, 32, vocab_size=151_936, context_length=32_768),
}

SIZES_2025 = ("small", "medium", "large", "xl", "2.7B")


def get_config(size: str, **overrides) -> ModelConfig:
    """A preset by name, with optional field overrides (e.g. `context_length=1024`)."""
    try:
        cfg = MODEL_SIZES[size]
    except KeyError:
        raise ValueError(f"unknown model size {size!r}; known: {', '.join(MODEL_SIZES)}") from None
    return cfg.replace(**overrides) if overrides else cfg
