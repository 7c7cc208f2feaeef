"""One training step of `BasicsTransformerLM`, from the handout's plain step to the project's fast one.

`TrainStepConfig` switches each optimisation on separately, so a benchmark can add them one at a time
(the training-step waterfall): bf16 autocast, the attention implementation, torch.compile of every
block, the fused multi-tensor AdamW, bf16 compute weights with float32 masters (optionally stored as
the weight plus 16 bits, no float32 copy beside it), the optimizer update overlapped with backward, and
the fused LM-head + cross-entropy. Every variant computes the same
function: the reference AdamW's update (staff semantics) of the mean cross-entropy; with autocast the
variants agree to bf16 rounding (see [Note: bf16 compute weights] in `fused_adamw`).

`build_train_step(model, cfg)` returns a `TrainStep`: `step(tokens, targets) -> loss` (a detached
scalar tensor; no host sync), with `.optimizer` and `.model`.

[Note: the step as one CUDA graph]
With `cuda_graph=True` the step's first `GRAPH_WARMUP` calls per input shape run eagerly (compilation,
kernel plans, optimizer state), the next captures the whole step (forward, backward, the overlapped
updates on their side stream, the optimizer's flush) in one CUDA graph on the step's stream, and every
later call copies the batch into the graph's input tensors and replays it: one launch per step, no
host work left in it. The optimizer then reads its step size from the device (`FusedAdamW.capturing`
/ `replay_step`), so learning-rate changes and the step count stay right. A graph holds the addresses
it captured: when a parameter or optimizer buffer moves (`Offloader`, `FusedAdamW.rehome_`) the graphs
are dropped and the next call captures again (`drop_graphs`, which `Offloader.park` calls to free the
graphs' memory). The graph's memory pool stays reserved between steps: `torch.cuda.max_memory_reserved`,
not the allocated peak, is what such a step holds.
It is off by default: an 8-block 2.7B step at 512 tokens spends as long on the host as on the GPU in
its backward when timed from an idle GPU, but the 32-block step in a loop waits on the GPU (its
overlapped AdamW shares the SMs with backward): on an H200 the graph took 0.987x the eager step's time
in one process (`figures/data/training_step__ab_cuda_graph_ctx512_h200.txt`). It can only pay where the
host, not the GPU, sets the pace of the loop, which it does not at these sizes.

[Note: compile per block]
The fast step compiles each transformer block on its own (`block.compile()`), not the whole model:
the blocks share one compiled graph (parameters are graph inputs), compile time does not grow with
depth, and each block's backward is a separate autograd node, so the gradients of block i are final
(and its optimizer bucket can run) while block i-1's backward still computes. A whole-model graph
would deliver every gradient at the very end of backward.

[Note: bf16 weights in memory]
bf16 compute weights written by the optimizer save autocast's two casts per weight per step, but
beside float32 masters they cost 2 bytes per parameter that the stock step (autocast over float32
weights) does not keep: 14 persistent bytes per parameter (4 master + 2 weight + 4 m + 4 v) against
stock's 12 (4 weight + 4 m + 4 v), 6.3 GiB more for the 2.7B model's 3.41e9 parameters. Stock's
transient extra is its float32 gradients (4 bytes per parameter, all alive when its optimizer
runs) where ours are bf16 (2 bytes) and freed block by block by the overlapped update. Splitting
the masters (`split_master`: the bf16 weight is the master's high half, the optimizer keeps the
low 16 bits) removes the duplicate: 12 persistent bytes per parameter, as stock, the same weights
bit for bit, and 2 bytes per parameter less optimizer traffic.

[Note: stream priorities]
An overlapped optimizer launch on a side stream fills every SM it can get; a Hopper GEMM CTA needs a
whole SM's registers, so an update that starts first delays the backward GEMMs queued behind it
instead of running beside them. The overlapped step therefore runs forward and backward on a stream
of the highest priority (the side stream keeps the default, lowest one): the block scheduler then
gives free SMs to backward first and the update takes what backward leaves idle.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from cs336_systems.kernels.linear_cross_entropy import linear_cross_entropy
from cs336_systems.model import AdamW, BasicsTransformerLM, cross_entropy
from cs336_systems.training.fused_adamw import FusedAdamW, mixed_precision_groups

OPTIMIZERS = ("reference", "fused")


@dataclass(frozen=True, kw_only=True)
class TrainStepConfig:
    """Which optimisations a step uses (defaults: the handout's plain fp32 step)."""

    autocast: bool = False  # bf16 autocast for forward and loss
    attention: str = "naive"
    compile: bool = False  # torch.compile each block ([Note: compile per block])
    compile_mode: str = "default"  # torch.compile mode, e.g. "max-autotune-no-cudagraphs"
    optimizer: str = "reference"  # "reference" (per-parameter loop) or "fused" (multi-tensor Triton)
    bf16_weights: bool = False  # fused optimizer keeps fp32 masters, the model computes in bf16
    split_master: bool = False  # the bf16 weight is the master's high half (see `FusedAdamW`)
    overlap: bool = False  # fused optimizer updates each block from inside backward
    overlap_programs: int | None = None  # grid cap of the overlapped updates (None: uncapped)
    fused_loss: bool = False  # chunked LM-head + cross-entropy
    cuda_graph: bool = False  # replay the whole step as one CUDA graph ([Note: the step as one CUDA graph])
    lr: float = 1e-4
    weight_decay: float = 0.01

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        if (self.bf16_weights or self.overlap) and self.optimizer != "fused":
            raise ValueError("bf16_weights and overlap need optimizer='fused'")
        if self.bf16_weights and not self.autocast:
            raise ValueError("bf16_weights reproduces autocast numerics; it needs autocast=True")
        if self.split_master and not self.bf16_weights:
            raise ValueError("split_master stores the masters of bf16 compute weights; it needs bf16_weights")
        if self.cuda_graph and self.optimizer != "fused":
            raise ValueError(
                "cuda_graph needs optimizer='fused' (its updates read their step size on the device)"
            )

    @classmethod
    def fastest(cls, **overrides) -> TrainStepConfig:
        """The fastest step measured on an H200 (2.7B, contexts 512 and 2048; see training_step).

        SDPA attention: the model's head dimension 80 is padded to 128 by our Triton kernels, which
        made the step 9-10 % slower than with SDPA. The update overlaps backward on a low-priority
        side stream ([Note: stream priorities]); the waterfall in training_step measures what it saves.
        The masters are split ([Note: bf16 weights in memory]).
        """
        base = dict(
            autocast=True,
            attention="sdpa",
            compile=True,
            optimizer="fused",
            bf16_weights=True,
            split_master=True,
            overlap=True,
            fused_loss=True,
        )
        return cls(**{**base, **overrides})


def block_bucket_key(model: BasicsTransformerLM) -> Callable[[nn.Parameter], object]:
    """Bucket key for `FusedAdamW`: the index of the transformer block that owns a parameter (-1 else)."""
    owner = {id(p): i for i, block in enumerate(model.layers) for p in block.parameters()}
    return lambda p: owner.get(id(p), -1)


@contextlib.contextmanager
def stream_scope(stream: torch.cuda.Stream | None):
    """Run the enclosed work on `stream` (None: the current one), ordered after the caller's stream's
    earlier work and before its later work."""
    if stream is None:
        yield
        return
    caller = torch.cuda.current_stream()
    stream.wait_stream(caller)
    with torch.cuda.stream(stream):
        yield
    caller.wait_stream(stream)


GRAPH_WARMUP = 2  # eager steps per input shape before a cuda_graph step captures one


@dataclass
class _CapturedStep:
    """One captured step: its graph, the input and loss tensors it reads and writes, the addresses it
    was captured with, and the host buffers its replays read."""

    graph: torch.cuda.CUDAGraph
    tokens: Tensor
    targets: Tensor
    loss: Tensor
    addresses: tuple[int, ...]
    keepalive: list


@dataclass
class TrainStep:
    model: BasicsTransformerLM
    optimizer: torch.optim.Optimizer
    cfg: TrainStepConfig
    stream: torch.cuda.Stream | None = None  # [Note: stream priorities]
    _graphs: dict = field(default_factory=dict, repr=False)  # input signature -> _CapturedStep
    _eager_steps: dict = field(default_factory=dict, repr=False)  # input signature -> steps run eagerly

    def on_stream(self):
        """Run the enclosed work on the step's stream (ordered after, and before, the caller's)."""
        return stream_scope(self.stream)

    def loss(self, tokens: Tensor, targets: Tensor) -> Tensor:
        ctx = (
            torch.autocast(tokens.device.type, dtype=torch.bfloat16)
            if self.cfg.autocast
            else contextlib.nullcontext()
        )
        with ctx:
            if self.cfg.fused_loss:
                return linear_cross_entropy(
                    self.model.hidden_states(tokens), self.model.lm_head.weight, targets
                )
            return cross_entropy(self.model(tokens), targets)

    def _run(self, tokens: Tensor, targets: Tensor) -> Tensor:
        loss = self.loss(tokens, targets)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    def __call__(self, tokens: Tensor, targets: Tensor) -> Tensor:
        if self.cfg.cuda_graph:
            return self._graph_step(tokens, targets)
        with self.on_stream():
            return self._run(tokens, targets)

    # ---- [Note: the step as one CUDA graph] ---------------------------------------------------
    @property
    def captured(self) -> int:
        """How many input signatures have a captured graph now."""
        return len(self._graphs)

    def drop_graphs(self) -> None:
        """Forget every captured graph (their memory pools go back to the caching allocator)."""
        self._graphs.clear()

    def _addresses(self) -> tuple[int, ...]:
        tensors = [*self.model.parameters(), *self.model.buffers(), *self.optimizer.storage_tensors()]
        return tuple(t.data_ptr() for t in tensors)

    def _graph_step(self, tokens: Tensor, targets: Tensor) -> Tensor:
        key = (tuple(tokens.shape), tuple(targets.shape), tokens.dtype, targets.dtype, tokens.device)
        addresses = self._addresses()
        captured = self._graphs.get(key)
        if captured is not None and captured.addresses != addresses:
            self.drop_graphs()  # something moved: every graph holds stale addresses
            captured = None
        if captured is None:
            if self._eager_steps.get(key, 0) < GRAPH_WARMUP:
                self._eager_steps[key] = self._eager_steps.get(key, 0) + 1
                with self.on_stream():
                    return self._run(tokens, targets)
            captured = self._capture(tokens, targets, addresses)
            self._graphs[key] = captured
        captured.tokens.copy_(tokens)
        captured.targets.copy_(targets)
        self.optimizer.replay_step(captured.graph.replay)
        return captured.loss.clone()

    def _capture(self, tokens: Tensor, targets: Tensor, addresses: tuple[int, ...]) -> _CapturedStep:
        static_tokens, static_targets = tokens.clone(), targets.clone()
        keepalive: list = []
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize(tokens.device)
        with self.optimizer.capturing(keepalive), torch.cuda.graph(graph, stream=self.stream):
            loss = self._run(static_tokens, static_targets)
        return _CapturedStep(graph, static_tokens, static_targets, loss, addresses, keepalive)


def build_train_step(model: BasicsTransformerLM, cfg: TrainStepConfig) -> TrainStep:
    """Configure `model` in place (attention, compilation) and build its optimizer for `cfg`."""
    model.set_attention(cfg.attention)
    hp = dict(lr=cfg.lr, weight_decay=cfg.weight_decay)
    if cfg.optimizer == "reference":
        optimizer: torch.optim.Optimizer = AdamW(model.parameters(), **hp)
    else:
        params = (
            mixed_precision_groups(model, split_master=cfg.split_master)
            if cfg.bf16_weights
            else model.parameters()
        )
        optimizer = FusedAdamW(params, bucket_key=block_bucket_key(model) if cfg.overlap else None, **hp)
        if cfg.overlap:
            optimizer.overlap_with_backward(cfg.overlap_programs)
    cuda = next(model.parameters()).is_cuda
    if cfg.cuda_graph and not cuda:
        raise ValueError("cuda_graph captures the step in a CUDA graph: the model must be on a CUDA device")
    if cfg.compile:
        for block in model.layers:
            block.compile(mode=cfg.compile_mode)
    stream = None
    if (cfg.overlap or cfg.cuda_graph) and cuda:
        stream = torch.cuda.Stream(priority=torch.cuda.Stream.priority_range()[1])
    return TrainStep(model=model, optimizer=optimizer, cfg=cfg, stream=stream)
