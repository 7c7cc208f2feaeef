"""The stock PyTorch baselines of the training leaderboard: what a PyTorch user builds from the library.

`StockFsdp2Step(model, param_mode=..., mesh=...)` ("stock"), the first attempt, kept unchanged so that
results stay comparable across commits:
* FSDP2 (`torch.distributed.fsdp.fully_shard`) on every transformer block and on the root;
* every block recomputed in backward (`torch.utils.checkpoint`, non-reentrant) and compiled on its own
  (`torch.compile` of the checkpointed block, then `fully_shard`, the order torchtitan uses);
* attention by `F.scaled_dot_product_attention`; `torch.optim.AdamW(fused=True)` on a GPU with its
  default hyperparameters (torch's AdamW: the eps enters at another place than the reference AdamW's,
  see [Note: staff AdamW vs torch.optim.AdamW] in model/optim.py);
* the LM head and the cross-entropy in chunks of `loss_chunk` tokens, each chunk's logits recomputed in
  backward (`checkpoint`), written plainly in torch: the full logits are never kept.

Precision, in the same mode as ours (`PARAM_MODES` of cs336_systems.distributed.zero):
  "bf16":        the model's parameters in bf16 (so are the gradients and AdamW's m and v);
  "fp32_master": float32 parameters (and AdamW state), `MixedPrecisionPolicy(param_dtype=bf16,
                 reduce_dtype=float32)` and bf16 autocast over forward and loss;
  "fp32":        everything float32.

`StockTunedStep` ("stock_tuned") is the recipe a skilled PyTorch user runs (torchtitan's choices):
* FSDP2 per block and on the root, blocks resharded after forward except the last (its backward comes
  first, so gathering it again would only wait), or with `reshard="never"` none (the gathered weights
  kept until backward: no second all-gather, ZeRO-2's memory);
* per block one of four activation-checkpointing policies ([Note: the tuned stock recompute plan]):
  "full" (the whole block recomputed), "attention" and "selective" (torch's selective checkpointing,
  `create_selective_checkpoint_contexts`: the attention's outputs saved, and for "selective" every
  second matmul's output too, or with `sac_matmuls="all"` every matmul's; everything else recomputed)
  or "none"; as few blocks recomputed, and as cheaply, as memory allows, planned from measured peaks;
* every block compiled with its checkpoint inside the compiled graph (so the partitioner honours the
  selective policy); SDPA with the backend PyTorch picks (cuDNN at the 8B shape on Hopper, recorded
  as a row); torch's fused AdamW; the chunked LM head + loss of the stock step.

[Note: the tuned stock recompute plan]
One step with every block "full" gives the peak P; one each with block 0 "attention", "selective" and
"none" give a_a, a_s and a_n, the bytes those policies keep beyond "full" (peaks minus P, the largest
over the ranks). With R = U - margin - P, U the bytes the allocator can reach (`allocator_usable_bytes`,
the least of the ranks; the margin: [Note: the planning margin] in leaderboard_bench), every block
moves up the policies in that order while all of them fit, and where not all fit the last ones that
do (`recompute_plan`): e.g. if L a_a <= R < L a_s, the last floor((R - L a_a) / (a_s - a_a)) blocks
run "selective" and the others "attention". The order is that of the recompute removed per byte
kept: the attention's outputs (about 260 MB a block at 32k tokens) spare the attention's forward,
the block's dearest part, the matmuls' outputs most of the rest, "none" only the cheap elementwise work. ("attention" is the policy
ours' recomputed blocks run; it joined stock_tuned in session 17, which had had only "full" below
"selective".)
"""

from __future__ import annotations

import contextlib
import functools
import itertools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from cs336_systems.model import BasicsTransformerLM
from cs336_systems.model.checkpointing import MATMUL_OPS, is_kept_attention


def allocator_usable_bytes(device: torch.device) -> int:
    """The most bytes PyTorch's caching allocator can hold on `device` now: the free memory plus what
    it holds already. The rest of the device (the CUDA context, NCCL's buffers, libraries' own
    allocations) is out of its reach, so the recompute plans start from this rather than from the
    device's total (on two H200s 1.6 GiB lay outside it; planning from it did not by itself end the
    allocator's retries: [Note: the planning margin] in leaderboard_bench)."""
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device)


def outside_allocator_bytes(device: torch.device) -> int:
    """The device memory out of the caching allocator's reach (`allocator_usable_bytes`), for the rows."""
    return torch.cuda.mem_get_info(device)[1] - allocator_usable_bytes(device)


def least_headroom(peak: float, device: torch.device) -> float:
    """The least over the ranks of what the allocator can reach (`allocator_usable_bytes`) beyond this
    rank's `peak`, bytes: what both recompute plans start from."""
    short = torch.tensor([peak - allocator_usable_bytes(device)], device=device, dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(short, op=dist.ReduceOp.MAX)
    return -float(short)


def _chunk_loss_sum(hidden: Tensor, weight: Tensor, targets: Tensor) -> Tensor:
    """Sum of the cross-entropies of one chunk: hidden (c, d), weight (V, d), targets (c,)."""
    return F.cross_entropy((hidden @ weight.t()).float(), targets, reduction="sum")


class CheckpointedBlock(nn.Module):
    """A block whose activations are recomputed in backward."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x: Tensor) -> Tensor:
        return checkpoint(self.block, x, use_reentrant=False)


class ChunkedLossModel(nn.Module):
    """forward(tokens, targets) -> mean cross-entropy, LM head and loss in chunks of `chunk` tokens."""

    def __init__(self, lm: BasicsTransformerLM, chunk: int):
        super().__init__()
        self.lm, self.chunk = lm, chunk

    def forward(self, tokens: Tensor, targets: Tensor) -> Tensor:
        hidden = self.lm.hidden_states(tokens).flatten(0, 1)
        flat_targets = targets.flatten()
        weight = self.lm.lm_head.weight
        total = hidden.new_zeros((), dtype=torch.float32)
        for s in range(0, hidden.shape[0], self.chunk):
            part = (hidden[s : s + self.chunk], weight, flat_targets[s : s + self.chunk])
            total = total + checkpoint(_chunk_loss_sum, *part, use_reentrant=False)
        return total / hidden.shape[0]


class StockFsdp2Step:
    """The stock step's pieces: `loss(tokens, targets)`, `optimizer`, `model`, `on_stream()` (module docstring)."""

    def __init__(
        self,
        model: BasicsTransformerLM,
        *,
        param_mode: str,
        mesh,
        compile: bool = True,
        loss_chunk: int = 4096,
        lr: float = 1e-3,
        weight_decay: float = 0.01,
    ):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        if param_mode not in ("bf16", "fp32_master", "fp32"):
            raise ValueError(f"unknown param_mode {param_mode!r}")
        model.set_attention("sdpa")
        self.autocast = param_mode == "fp32_master"
        policy = (
            MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if self.autocast
            else MixedPrecisionPolicy()
        )
        layers = len(model.layers)
        for i, block in enumerate(model.layers):
            wrapped = self._wrap_block(block, compile)
            fully_shard(wrapped, mesh=mesh, mp_policy=policy, reshard_after_forward=self._reshard(i, layers))
            model.layers[i] = wrapped
        self.model = model
        self.module = ChunkedLossModel(model, loss_chunk)
        fully_shard(self.module, mesh=mesh, mp_policy=policy)
        fused = next(model.parameters()).is_cuda
        self.optimizer = torch.optim.AdamW(
            self.module.parameters(), lr=lr, weight_decay=weight_decay, fused=fused
        )

    def _wrap_block(self, block: nn.Module, compile: bool) -> nn.Module:
        """The checkpointed (and compiled) module that replaces `block` and is sharded on its own."""
        wrapped: nn.Module = CheckpointedBlock(block)
        return torch.compile(wrapped) if compile else wrapped

    def _reshard(self, index: int, layers: int) -> bool:
        """Does block `index` free its gathered parameters after forward (FSDP2's default: yes)."""
        return True

    def on_stream(self):
        return contextlib.nullcontext()

    def loss(self, tokens: Tensor, targets: Tensor) -> Tensor:
        with torch.autocast(tokens.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            return self.module(tokens, targets)

    def state_tensors(self) -> list[Tensor]:
        """Parameters (local shards) and optimizer state, for memory accounting."""
        out = [p.to_local() if hasattr(p, "to_local") else p for p in self.module.parameters()]
        for st in self.optimizer.state.values():
            out += [
                v.to_local() if hasattr(v, "to_local") else v for v in st.values() if isinstance(v, Tensor)
            ]
        return out


# --------------------------------------------------------------------------------------------------
# The tuned stock step
# --------------------------------------------------------------------------------------------------

POLICIES = ("full", "attention", "selective", "none")  # from the least kept to the most
RESHARD = ("after_forward", "never")
SAC_MATMULS = {"every_second": 2, "all": 1}  # which matmul outputs a selective block keeps: every k-th


def selective_context(stride: int = 2):
    """`context_fn` of operator-level selective checkpointing: the attention's outputs and every
    `stride`-th matmul's output saved (the 1st, (1 + stride)-th, ... in each pass; torchtitan's default
    is 2, 1 keeps them all, 0 none), everything else recomputed."""
    seen = {False: 0, True: 0}  # matmuls met in the forward pass and in the recompute

    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        if is_kept_attention(op):  # the attention core's outputs, as in model.checkpointing
            return CheckpointPolicy.MUST_SAVE
        if op in MATMUL_OPS and stride:
            seen[ctx.is_recompute] += 1
            if seen[ctx.is_recompute] % stride == 1 % stride:
                return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


class PolicyBlock(nn.Module):
    """A block run under one of `POLICIES` (`policy`, changed between steps; compiled, it keeps one
    graph per policy): "full" recomputes the whole block, "attention" all but the attention's outputs
    (the policy ours' recomputed blocks run), "selective" keeps the matmuls' outputs too (every
    `stride`-th), "none" recomputes nothing."""

    def __init__(self, block: nn.Module, policy: str = "full", stride: int = 2):
        super().__init__()
        self.block, self.policy = block, policy
        self.context = functools.partial(selective_context, stride)
        self.attention_context = functools.partial(selective_context, 0)

    def forward(self, x: Tensor) -> Tensor:
        if self.policy == "none":
            return self.block(x)
        if self.policy == "selective":
            return checkpoint(self.block, x, use_reentrant=False, context_fn=self.context)
        if self.policy == "attention":
            return checkpoint(self.block, x, use_reentrant=False, context_fn=self.attention_context)
        return checkpoint(self.block, x, use_reentrant=False)


def recompute_plan(layers: int, room: float, kept: dict[str, float]) -> list[str]:
    """Per block its policy ([Note: the tuned stock recompute plan]): `kept` maps the policies, from
    the one that keeps least, to the bytes a block keeps beyond it (the first 0, then increasing);
    `room` = R, bytes. Every block takes the next policy while all fit; then the last ones that fit."""
    names, sizes = list(kept), [float(v) for v in kept.values()]
    if len(names) < 2 or sizes[0] != 0 or any(b <= a for a, b in itertools.pairwise(sizes)):
        raise ValueError(f"need policies' kept bytes from 0, increasing, got {kept}")
    for i in range(1, len(names)):
        step = sizes[i] - sizes[i - 1]
        if room < layers * step:
            upgraded = max(0, int(room // step))
            return [names[i - 1]] * (layers - upgraded) + [names[i]] * upgraded
        room -= layers * step
    return [names[-1]] * layers


class StockTunedStep(StockFsdp2Step):
    """The tuned stock step (module docstring): `policies` per block, `set_policies`, `plan(...)`."""

    def __init__(
        self, model: BasicsTransformerLM, *, sac_matmuls: str = "every_second", reshard: str = "after_forward",
        **kwargs,
    ):  # fmt: skip
        if sac_matmuls not in SAC_MATMULS or reshard not in RESHARD:
            raise ValueError(
                f"sac_matmuls must be one of {tuple(SAC_MATMULS)} and reshard one of {RESHARD}, "
                f"got {sac_matmuls!r}, {reshard!r}"
            )
        self.blocks: list[PolicyBlock] = []
        self.stride, self.reshard = SAC_MATMULS[sac_matmuls], reshard
        super().__init__(model, **kwargs)

    def _wrap_block(self, block: nn.Module, compile: bool) -> nn.Module:
        wrapped = PolicyBlock(block, stride=self.stride)
        self.blocks.append(wrapped)
        return torch.compile(wrapped) if compile else wrapped  # the checkpoint inside the compiled graph

    def _reshard(self, index: int, layers: int) -> bool:
        # "after_forward": every block but the last (its backward comes first); "never": gathered
        # weights kept from forward to backward (ZeRO-2-like memory, no second all-gather)
        return self.reshard == "after_forward" and index < layers - 1

    @property
    def policies(self) -> list[str]:
        return [b.policy for b in self.blocks]

    def set_policies(self, policies: list[str]) -> None:
        if len(policies) != len(self.blocks) or set(policies) - set(POLICIES):
            raise ValueError(f"need one of {POLICIES} per block ({len(self.blocks)}), got {policies}")
        for block, policy in zip(self.blocks, policies, strict=True):
            block.policy = policy

    def plan(self, protocol, device: torch.device, margin_gib: float) -> dict:
        """Measure P, a_a, a_s and a_n with `protocol()` (one protocol step, a `leaderboard_bench.ProtocolStep`)
        and set the plan; on a CPU every block runs "selective". Returns the plan's numbers for the rows."""
        layers = len(self.blocks)
        if device.type != "cuda":
            self.set_policies(["selective"] * layers)
            protocol()
            return {"policies": self.policies}

        def peak(policies: list[str]) -> float:
            self.set_policies(policies)
            protocol()  # compiles a new policy's graph
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            protocol()
            torch.cuda.synchronize(device)
            value = torch.tensor([float(torch.cuda.max_memory_allocated(device))], device=device)
            if dist.is_initialized() and dist.get_world_size() > 1:
                dist.all_reduce(value, op=dist.ReduceOp.MAX)
            return float(value)

        full = peak(["full"] * layers)
        kept_attention = max(peak(["attention"] + ["full"] * (layers - 1)) - full, 1.0)
        kept_selective = max(peak(["selective"] + ["full"] * (layers - 1)) - full, kept_attention + 1.0)
        kept_none = max(peak(["none"] + ["full"] * (layers - 1)) - full, kept_selective + 1.0)
        plan = {
            "peak_all_full": full,
            "kept_attention": kept_attention,
            "kept_selective": kept_selective,
            "kept_none": kept_none,
            "headroom": least_headroom(full, device),  # full: the ranks' greatest already
            "outside_allocator": outside_allocator_bytes(device),
        }
        plan["policies"] = self.apply_margin(plan, margin_gib)
        return plan

    def apply_margin(self, plan: dict, margin_gib: float) -> list[str]:
        """Set the policies that leave `margin_gib` of what the allocator can reach unplanned, from
        `plan`'s measurements (`plan(...)`); returns them."""
        room = plan["headroom"] - margin_gib * 2**30
        kept = {"full": 0.0} | {p: plan[f"kept_{p}"] for p in POLICIES[1:]}
        self.set_policies(recompute_plan(len(self.blocks), room, kept))
        return self.policies
