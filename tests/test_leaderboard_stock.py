"""The training leaderboard's baselines and the validity of our entry.

* `stock_tuned` (`StockTunedStep`): any mix of the three recompute policies computes exactly the
  stock step's losses and parameters (same weights, same torch AdamW, FSDP2 on two gloo ranks); the
  selective policy recomputes every second matmul and no attention; the recompute plan's arithmetic.
* Our entry uses only the project's kernels for attention: a step of the study's default `ours`
  runs our FlashAttention operators and no SDPA operator, eagerly and in the compiled graphs.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from cs336_systems.distributed.process_group import spawn
from cs336_systems.model import BasicsTransformerLM, get_config
from cs336_systems.studies.training.leaderboard_stock import (
    PolicyBlock,
    StockFsdp2Step,
    StockTunedStep,
    allocator_usable_bytes,
    recompute_plan,
)

SMALL = dict(vocab_size=1000, context_length=64, d_model=64, num_layers=3, num_heads=4, d_ff=128)
STEPS = 3


class _OpLog(TorchDispatchMode):
    """The name of every operator that runs ("aten::mm", "cs336::flash_attn_fwd", ...)."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func._schema.name)
        return func(*args, **(kwargs or {}))


def _batch(rank: int):
    g = torch.Generator().manual_seed(7)
    x = torch.randint(0, SMALL["vocab_size"], (2, 2, SMALL["context_length"]), generator=g)
    return x[0, rank : rank + 1], x[1, rank : rank + 1]


def _train(step, tokens, targets) -> list[float]:
    losses = []
    for _ in range(STEPS):
        step.optimizer.zero_grad(set_to_none=True)
        loss = step.loss(tokens, targets)
        loss.backward()
        step.optimizer.step()
        losses.append(loss.item())
    return losses


def _full_params(step) -> list[torch.Tensor]:
    return [p.full_tensor().clone() for p in step.module.parameters()]


def _tuned_equals_stock(rank, world_size, device, policies: list[str], options: dict) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    model = BasicsTransformerLM(**SMALL, attention_impl="sdpa")
    tuned_model = copy.deepcopy(model)
    kw = dict(param_mode="fp32", mesh=mesh, compile=False, loss_chunk=40)
    stock = StockFsdp2Step(model, **kw)
    tuned = StockTunedStep(tuned_model, **kw, **options)
    with pytest.raises(ValueError, match="one of"):
        tuned.set_policies(["full"])  # one policy per block
    tuned.set_policies(policies)
    assert tuned.policies == policies
    tokens, targets = _batch(rank)
    expected, got = _train(stock, tokens, targets), _train(tuned, tokens, targets)
    assert got == expected, (got, expected)
    for a, b in zip(_full_params(tuned), _full_params(stock), strict=True):
        assert torch.equal(a, b)
    dist.barrier()


@pytest.mark.distributed
@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "policies, options",
    [
        (["full", "selective", "none"], {}),
        (["attention", "full", "selective"], {}),
        (["selective", "selective", "none"], {"sac_matmuls": "all", "reshard": "never"}),
    ],
)
def test_tuned_stock_step_equals_the_stock_step_on_two_ranks(policies, options):
    spawn(_tuned_equals_stock, 2, policies, options, timeout_s=150)


def test_the_selective_policy_recomputes_every_second_matmul_and_no_attention():
    """Backward of a selective block reruns every second matmul (none with stride 1) and no attention;
    an "attention" block reruns the matmuls a "full" one does but not the attention."""
    cfg = get_config("debug").replace(context_length=32)
    torch.manual_seed(0)
    block = BasicsTransformerLM.from_config(cfg, attention_impl="sdpa").layers[0]
    x = torch.randn(2, cfg.context_length, cfg.d_model, requires_grad=True)
    counts = {}
    for policy, stride in (
        ("none", 2),
        ("selective", 2),
        ("full", 2),
        ("selective_all", 1),
        ("attention", 2),
    ):
        y = PolicyBlock(block, policy.removesuffix("_all"), stride)(x)
        with _OpLog() as log:
            y.sum().backward()
        counts[policy] = (log.names.count("aten::mm"), sum("scaled_dot_product" in n for n in log.names))
    # q, k, v, output projection, w1, w3, w2: "full" reruns all but w2 (non-reentrant recompute stops
    # once backward's inputs exist), "selective" the 2nd, 4th and 6th (k, the output projection, w3)
    assert counts["full"][0] == counts["none"][0] + 6
    assert counts["selective"][0] == counts["none"][0] + 3
    assert counts["selective_all"] == counts["none"]  # every matmul output kept: only elementwise work
    assert counts["selective"][1] == counts["none"][1]  # the attention's forward is not rerun
    assert counts["full"][1] > counts["none"][1]
    # "attention" (ours' recompute policy): every matmul "full" reruns, the attention's forward not
    assert counts["attention"] == (counts["full"][0], counts["none"][1])


def test_recompute_plan_fills_the_room_selective_first():
    gib = 2**30
    # every block fits "selective" (4 x 1 GiB), the 6 GiB left keep 2 blocks unchecked (3 GiB more each)
    three = {"full": 0, "selective": 1 * gib, "none": 4 * gib}
    assert recompute_plan(4, 10 * gib, three) == ["selective", "selective", "none", "none"]
    # not every block fits "selective": the first ones run "full"
    assert recompute_plan(4, 2.5 * gib, three) == ["full", "full", "selective", "selective"]
    assert recompute_plan(4, 0, three) == ["full"] * 4
    assert recompute_plan(4, 100 * gib, three) == ["none"] * 4
    # with "attention" (0.25 GiB) below "selective": every block keeps its attention first
    four = {"full": 0, "attention": 0.25 * gib, "selective": 1 * gib, "none": 4 * gib}
    assert recompute_plan(4, 2.5 * gib, four) == ["attention", "attention", "selective", "selective"]
    assert recompute_plan(4, 0.6 * gib, four) == ["full", "full", "attention", "attention"]
    assert recompute_plan(4, 10 * gib, four) == ["selective", "selective", "none", "none"]
    with pytest.raises(ValueError, match="increasing"):
        recompute_plan(4, gib, {"full": 0, "selective": 2 * gib, "none": 1 * gib})
    with pytest.raises(ValueError, match="from 0"):
        recompute_plan(4, gib, {"selective": 1 * gib, "none": 2 * gib})


@pytest.mark.gpu
def test_the_plans_count_only_memory_the_allocator_can_reach():
    """The recompute plans start from `allocator_usable_bytes`: the free memory plus the allocator's
    own, below the device's total by the CUDA context at least, and not changed by the allocator's
    caching (bytes it holds count as usable whether in use or cached)."""
    device = torch.device("cuda")
    torch.cuda.empty_cache()
    before = allocator_usable_bytes(device)
    total = torch.cuda.mem_get_info(device)[1]
    assert torch.cuda.memory_reserved(device) < before < total
    x = torch.empty(2**30, dtype=torch.uint8, device=device)  # 1 GiB held by the allocator
    held = allocator_usable_bytes(device)
    del x  # cached now, still the allocator's
    cached = allocator_usable_bytes(device)
    torch.cuda.empty_cache()
    tolerance = 64 * 2**20  # the driver's bookkeeping and other processes' small allocations
    assert abs(held - before) < tolerance and abs(cached - before) < tolerance


# --------------------------------------------------------------------------------------------------
# Our entry: our own attention only
# --------------------------------------------------------------------------------------------------


def _no_sdpa(*args, **kwargs):
    raise AssertionError("F.scaled_dot_product_attention was called inside our leaderboard step")


@pytest.mark.parametrize("compiled", [False, True])
def test_our_entry_runs_only_our_attention(compiled, monkeypatch):
    """The study's default `ours` (HANDOUT_SPEC 5.2: "The implementation must be your own"): one step
    runs our FlashAttention's operators, once per block forward (the recomputed block keeps them) and
    once per block backward, and no SDPA operator; compiled, the same holds for the graphs."""
    from torch._dynamo.backends.common import aot_autograd

    from cs336_systems.studies.training import leaderboard

    assert leaderboard.LeaderboardRunConfig().attention == "flash_triton"
    cfg = leaderboard.LeaderboardRunConfig(
        size="debug", layers=(2,), context_length=64, param_modes=("fp32",), checkpoint_blocks="1",
        loss_chunk=48, compile=compiled,
    )  # fmt: skip
    graphs: list[str] = []

    def record(gm, _inputs):
        graphs.append(gm.code)
        return gm.forward

    original = torch.nn.Module.compile
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self: original(self, backend=aot_autograd(
        fw_compiler=record, bw_compiler=record)))  # fmt: skip
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", _no_sdpa)
    torch._dynamo.reset()
    step, mcfg = leaderboard.build_path(cfg, "ours-fp32-L2", torch.device("cpu"))
    tokens, targets = leaderboard.protocol_batch(cfg, mcfg.vocab_size, "cpu", 0, 1)
    if not compiled:
        with _OpLog() as log:
            step(tokens, targets)
        assert not [n for n in log.names if "scaled_dot_product" in n]
        assert log.names.count("cs336::flash_attn_fwd") == 2 and log.names.count("cs336::flash_attn_bwd") == 2
        return
    step(tokens, targets)  # (a dispatch mode would turn compilation off: the graphs are checked)
    torch._dynamo.reset()
    code = "\n".join(graphs)
    assert graphs and "scaled_dot_product" not in code
    assert "torch.ops.cs336.flash_attn_fwd" in code and "torch.ops.cs336.flash_attn_bwd" in code


def test_bad_tuned_options_fail_before_any_work():
    from cs336_systems.studies.training.leaderboard import LeaderboardRunConfig

    with pytest.raises(ValueError, match="--tuned-sac"):
        LeaderboardRunConfig(size="debug", tuned_sac="some")
    with pytest.raises(ValueError, match="--tuned-reshard"):
        LeaderboardRunConfig(size="debug", tuned_reshard="always")
    with pytest.raises(ValueError, match="sac_matmuls"):
        StockTunedStep(BasicsTransformerLM(**SMALL), param_mode="fp32", mesh=None, sac_matmuls="half")
