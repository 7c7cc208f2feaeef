"""Fused training kernels beside attention: multi-tensor AdamW and a chunked LM-head + cross-entropy.

Each follows kernel -> launcher -> autograd.Function / optimizer: `adamw` holds the Triton kernel and
its launcher (the optimizer class using it is `cs336_systems.training.FusedAdamW`),
`linear_cross_entropy` the LM head fused with the loss.
"""
