"""The Basics Transformer LM (CS336 Assignment 1), written from scratch with staff-compatible names."""

from cs336_systems.model.attention import (
    ATTENTION_IMPLS,
    CausalMultiHeadSelfAttention,
    causal_mask,
    get_attention,
    register_attention,
    scaled_dot_product_attention,
)
from cs336_systems.model.config import MODEL_SIZES, SIZES_2025, ModelConfig, get_config
from cs336_systems.model.layers import (
    Embedding,
    Linear,
    RMSNorm,
    RotaryEmbedding,
    SwiGLU,
    log_softmax,
    silu,
    softmax,
)
from cs336_systems.model.loss import cross_entropy, random_batch
from cs336_systems.model.optim import AdamW, clip_gradient, get_cosine_lr
from cs336_systems.model.transformer import BasicsTransformerLM, TransformerBlock

__all__ = [
    "ATTENTION_IMPLS",
    "MODEL_SIZES",
    "SIZES_2025",
    "AdamW",
    "BasicsTransformerLM",
    "CausalMultiHeadSelfAttention",
    "Embedding",
    "Linear",
    "ModelConfig",
    "RMSNorm",
    "RotaryEmbedding",
    "SwiGLU",
    "TransformerBlock",
    "causal_mask",
    "clip_gradient",
    "cross_entropy",
    "get_attention",
    "get_config",
    "get_cosine_lr",
    "log_softmax",
    "random_batch",
    "register_attention",
    "scaled_dot_product_attention",
    "silu",
    "softmax",
]
