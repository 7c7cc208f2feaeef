"""The leaderboard step (ZeRO-2 over flat units, fused AdamW, chunked loss, partial checkpointing)
against the plain single-process reference step: same losses and parameters within stated tolerances.

Small config: 2 layers, d_model 256, 4 heads, d_ff 512, vocabulary 1000, context 512; the global
batch is 2 sequences, one per rank; 3 steps at lr 1e-2 (so that every weight moves by far more
than the tolerances). The reference is `cs336_systems.model.AdamW` with plain
`cross_entropy(model(x), y)` over the whole batch in one process, in the same precision. Compared:
the loss of every step, and per parameter tensor the relative L2 error of its update,
|(p_ours - p_0) - (p_ref - p_0)| / |p_ref - p_0| after the 3 steps:

  mode         reference                                   loss rtol  update error: matrices, norm gains
  fp32         fp32 model                                  1e-5       1e-3, 1e-3; and elementwise: every
                                                                      |p_ours - p_ref| <= lr / 100, 99.9%
                                                                      of them <= 1e-6 (*)
  bf16         model.to(bfloat16), AdamW on bf16 weights   1e-2       0.1, 0.5 (**)
  fp32_master  fp32 model under bf16 autocast              1e-2       0.1, 0.5 (**)

(*) Adam divides by sqrt(v): where a gradient is near zero, a rounding difference of the gradient
    (the chunked loss sums in another order than one matmul; the mean of the ranks' means is another
    sum than the batch mean) changes that element's normalised update by a fraction of lr.
(**) Measured on the CPU: 0.02-0.10 for matrices, up to 0.18 (bf16) and 0.33 (fp32_master) for the
    256-element norm gains, whose gradients are sums over every token of bf16-rounded terms. The
    bf16 reference rounds every AdamW operation to bf16 (ours updates in float32 and rounds once);
    the fp32_master reference keeps an fp32 residual stream under autocast (ours computes in bf16).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from cs336_systems.distributed.process_group import spawn
from cs336_systems.model import AdamW, BasicsTransformerLM, cross_entropy
from cs336_systems.training import LeaderboardConfig, build_leaderboard_step, transformer_units

SMALL = dict(vocab_size=1000, context_length=512, d_model=256, num_layers=2, num_heads=4, d_ff=512)
LR, STEPS = 1e-2, 3
TOLERANCES = {  # mode: (loss rtol, (relative error of a weight matrix's update, of a norm gain's))
    "fp32": (1e-5, (1e-3, 1e-3)),
    "bf16": (1e-2, (0.1, 0.5)),
    "fp32_master": (1e-2, (0.1, 0.5)),
}


def _batch(device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    x = torch.randint(0, SMALL["vocab_size"], (2, SMALL["context_length"]), generator=g)
    y = torch.randint(0, SMALL["vocab_size"], (2, SMALL["context_length"]), generator=g)
    return x.to(device), y.to(device)


def _reference(model: BasicsTransformerLM, mode: str, x, y) -> list[float]:
    """The plain step in one process over the whole batch; returns the losses."""
    if mode == "bf16":
        model.to(torch.bfloat16)
    opt = AdamW(model.parameters(), lr=LR)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad(set_to_none=True)
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=mode == "fp32_master"):
            loss = cross_entropy(model(x), y).sum()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _compare(rank, world_size, device, mode: str, attention: str, compile_blocks: bool) -> None:
    torch.manual_seed(0)
    ref = BasicsTransformerLM(**SMALL, attention_impl="sdpa", device=device)
    ours = copy.deepcopy(ref)
    init = [p.detach().float().cpu().clone() for p in ref.parameters()]
    x, y = _batch(device)
    cfg = LeaderboardConfig(
        param_mode=mode,
        attention=attention,
        compile=compile_blocks,
        checkpoint_blocks=1,  # one block recomputed, one not
        loss_chunk=200,  # ragged chunks: 512 = 200 + 200 + 112
        lr=LR,
    )
    step = build_leaderboard_step(ours, cfg)
    mine = slice(rank, rank + 1) if world_size > 1 else slice(None)
    losses = []
    for _ in range(STEPS):
        loss = step(x[mine], y[mine])
        if world_size > 1:
            dist.all_reduce(loss)
            loss /= world_size
        losses.append(loss.item())
    ref_losses = _reference(ref, mode, x, y)
    loss_rtol, update_rtol = TOLERANCES[mode]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=loss_rtol, atol=0)
    off = total = 0
    params = zip(ref.named_parameters(), ours.parameters(), init, strict=True)
    for (name, p_ref), p_ours, before in params:
        ours_f, ref_f = p_ours.detach().float().cpu(), p_ref.detach().float().cpu()
        moved_ref, moved_ours = ref_f - before, ours_f - before
        error = ((moved_ours - moved_ref).norm() / moved_ref.norm()).item()
        bound = update_rtol[0] if p_ref.ndim >= 2 else update_rtol[1]
        assert error <= bound, f"{mode} {name}: update differs from the reference's by {error:.3f} (relative)"
        if mode == "fp32":
            diff = (ours_f - ref_f).abs()
            assert diff.max() <= LR / 100, f"{name}: max |ours - ref| = {diff.max():.3g}"
            off, total = off + int((diff > 1e-6).sum()), total + diff.numel()
    if mode == "fp32":
        assert off <= 1e-3 * total, f"{off} of {total} parameters differ by more than 1e-6"
    assert [n for n, _ in transformer_units(ours)][-1] == "head"


@pytest.mark.distributed
@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["fp32", "bf16", "fp32_master"])
def test_leaderboard_step_on_two_ranks_matches_the_single_process_step(mode):
    spawn(_compare, 2, mode, "sdpa", False, timeout_s=90)


def test_leaderboard_step_without_a_process_group_matches_too():
    _compare(0, 1, torch.device("cpu"), "fp32", "sdpa", False)


def test_leaderboard_config_rejects_bad_values():
    with pytest.raises(ValueError, match="param_mode"):
        LeaderboardConfig(param_mode="fp16")
    with pytest.raises(ValueError, match="checkpoint_blocks"):
        LeaderboardConfig(checkpoint_blocks=-1)


@pytest.mark.gpu
@pytest.mark.timeout(600)
@pytest.mark.parametrize("attention", ["flash_triton", "sdpa"])
def test_leaderboard_step_on_one_gpu_compiled_matches_the_reference_gpu(attention):
    """The real path on one GPU (NCCL, one rank): compiled blocks, our attention, side-stream updates."""
    spawn(_compare, 1, "bf16", attention, True, backend="nccl", timeout_s=500)


@pytest.mark.multigpu
@pytest.mark.timeout(600)
def test_leaderboard_step_on_two_gpus_matches_the_reference_gpu():
    spawn(_compare, 2, "bf16", "flash_triton", True, backend="nccl", timeout_s=500)
