"""Activation checkpointing: exact gradients for every strategy, saved-bytes accounting, cost model."""

import math
import re

import pandas as pd
import pytest
import torch

from cs336_systems.measure.budget import TimeBudget
from cs336_systems.model import (
    BasicsTransformerLM,
    RotaryEmbedding,
    TransformerBlock,
    cross_entropy,
    get_config,
)
from cs336_systems.model.checkpointing import (
    KEPT_ATTENTION_OPS,
    MATMUL_OPS,
    activation_peak_model,
    checkpoint_keeping_attention,
    checkpoint_sub_blocks,
    is_kept_attention,
    make_block_runner,
    optimal_group_size,
    run_blocks,
    saved_tensors,
    saved_tensors_by_op,
)
from cs336_systems.studies.profiling import checkpointing as study

CFG = get_config("debug").replace(num_layers=5, context_length=32)  # odd depth: uneven groups and halves
STRATEGIES = [
    ("block", 1),
    ("block", 2),
    ("block", 3),
    ("sub_block", None),
    ("recursive", None),
    ("recursive", 2),
]


def _loss_and_grads(runner=None, group=None):
    torch.manual_seed(0)
    model = BasicsTransformerLM.from_config(CFG)
    model.set_block_runner(runner)
    model.set_checkpointing(group)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, CFG.vocab_size, (2, CFG.context_length + 1), generator=gen)
    loss = cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def reference():
    torch.set_num_threads(1)
    return _loss_and_grads()


@pytest.mark.parametrize(("strategy", "group"), STRATEGIES)
def test_checkpointing_gives_identical_loss_and_gradients(reference, strategy, group):
    loss0, grads0 = reference
    loss, grads = _loss_and_grads(make_block_runner(strategy, group))
    assert torch.equal(loss, loss0)
    for name, g in grads0.items():  # recomputation replays the same kernels: bitwise equal on CPU
        assert torch.equal(grads[name], g), f"{strategy}/{group}: gradient of {name} differs"


def test_model_level_grouping_matches_runner(reference):
    loss0, grads0 = reference
    loss, grads = _loss_and_grads(group=2)
    assert torch.equal(loss, loss0) and all(torch.equal(grads[n], g) for n, g in grads0.items())


def _blocks(n: int, device: str = "cpu"):
    rope = RotaryEmbedding(CFG.context_length, CFG.d_head, device=device)
    return [TransformerBlock(CFG.d_model, CFG.num_heads, CFG.d_ff, rope, device=device) for _ in range(n)]


@pytest.mark.parametrize(
    ("strategy", "group", "checkpoints"),
    # activation bytes saved at the top level, in block inputs c (the stack's own input is the caller's)
    [("block", 1, 4), ("block", 2, 2), ("block", 5, 0), ("sub_block", None, 9), ("recursive", None, 1)],
)
def test_saved_bytes_shrink_to_checkpoint_inputs(strategy, group, checkpoints):
    n, device = 5, "meta"
    blocks = torch.nn.ModuleList(_blocks(n, device))
    x = torch.randn(2, CFG.context_length, CFG.d_model, device=device, requires_grad=True)
    c = x.numel() * x.element_size()
    _, plain = saved_tensors(run_blocks, blocks, x, module=blocks)
    _, ckpt = saved_tensors(make_block_runner(strategy, group), blocks, x, module=blocks)
    assert ckpt.activation_bytes == checkpoints * c
    # without checkpointing: n blocks' residuals r, and the inputs of blocks 1..n-1 among them
    _, one = saved_tensors(run_blocks, blocks[:1], x, module=blocks)
    assert plain.activation_bytes == n * one.activation_bytes + (n - 1) * c
    assert ckpt.activation_bytes < plain.activation_bytes


def test_saved_tensors_kinds_and_by_op_totals():
    block = _blocks(1, "meta")[0]
    x = torch.randn(2, CFG.context_length, CFG.d_model, device="meta", requires_grad=True)
    y, rec = saved_tensors(block, x, module=block)
    assert rec.bytes("input") == x.numel() * 4
    assert rec.bytes("parameter") > 0 and rec.count("activation") > 0
    rows = saved_tensors_by_op(y, exclude=[x, *block.parameters(), *block.buffers()])
    assert sum(r["bytes"] for r in rows) == rec.activation_bytes
    assert math.isclose(sum(r["share"] for r in rows), 1.0)
    assert rows == sorted(rows, key=lambda r: -r["bytes"])
    # the three (batch, heads, T, T) tensors of the naive softmax are saved by amax, exp and the PV bmm
    t, h = CFG.context_length, CFG.num_heads
    square = 2 * h * t * t * 4
    ops = {r["op"]: r["bytes"] for r in rows}
    assert ops["Exp"] == square and ops["Amax"] >= square and ops["Bmm"] >= square
    assert len(saved_tensors_by_op(y, exclude=[x], top=3)) == 3
    with pytest.raises(ValueError, match="grad_fn"):
        saved_tensors_by_op(torch.ones(2))


def test_cost_model_hand_computations():
    # N = 32 blocks, c = 80 MiB, r = 3651.31 MiB (the handout's numbers): one level is best at k = 1
    assert optimal_group_size(32, 80, 3651.31) == 1
    assert activation_peak_model("block", 32, 80, 3651.31, 1)["peak_bytes"] == pytest.approx(
        32 * 80 + 3651.31
    )
    # N = 64, c = r: the classic sqrt(N) rule, k* = 8 with peak 64/8 + 8 = 16
    assert optimal_group_size(64, 1, 1) == 8
    assert activation_peak_model("block", 64, 1, 1, 8) == {"peak_bytes": 16, "forward_passes": 2.0}
    assert activation_peak_model("block", 64, 1, 1, 7)["peak_bytes"] == 17  # ceil(64/7) = 10
    rec = activation_peak_model("recursive", 32, 80, 3651.31)
    assert rec == {"peak_bytes": pytest.approx(5 * 80 + 3651.31), "forward_passes": 6.0}
    assert activation_peak_model("none", 32, 80, 100)["peak_bytes"] == 3200
    assert activation_peak_model("sub_block", 4, 1, 10, sub_block_residual_bytes=6)["peak_bytes"] == 14
    for bad in [("block", 4, 1, 1, None), ("nope", 4, 1, 1, 1), ("none", 0, 1, 1, None)]:
        with pytest.raises(ValueError):
            activation_peak_model(*bad)


def test_runner_validation():
    with pytest.raises(ValueError, match="group_size"):
        make_block_runner("block")
    with pytest.raises(ValueError, match="unknown"):
        make_block_runner("everything")
    assert make_block_runner("none") is None
    with pytest.raises(ValueError, match="TransformerBlock"):
        checkpoint_sub_blocks([torch.nn.Linear(4, 4)], torch.randn(2, 4, requires_grad=True))
    with pytest.raises(ValueError, match="callable"):
        BasicsTransformerLM.from_config(CFG).set_block_runner(3)


def test_cost_table_uses_meta_accounting():
    df = study.cost_table("debug", batch_size=2, context_length=32, max_group=4)
    attrs = df.attrs
    assert attrs["c"] == 2 * 32 * CFG.d_model * 4
    assert attrs["r"] > attrs["c"] and attrs["r_attn"] + attrs["r_mlp"] >= attrs["r"] - attrs["c"]
    one = df[(df.strategy == "block") & (df.group_size == 1)].iloc[0]
    assert one["peak_activation_GiB"] * 2**30 == pytest.approx(2 * attrs["c"] + attrs["r"])  # debug: 2 layers


def test_checkpointing_measure_runs_and_records_skips(tmp_path):
    cfg = study.CheckpointingConfig(
        strategies=(("block", 1), ("recursive", None)),
        size="debug",
        batch_size=2,
        context_length=16,
        device="cpu",
    )
    df = pd.DataFrame(study.measure(cfg, results_dir=tmp_path, progress=False))
    steps = df[df.metric == "step_time"]
    assert set(steps.impl) == {"block", "recursive"} and (steps.n == 1).all()
    cfg = study.CheckpointingConfig(strategies=(("block", 2),), size="debug", context_length=16, device="cpu")
    skipped = pd.DataFrame(study.measure(cfg, budget=TimeBudget(0.0), save=False, progress=False))
    assert skipped.note.str.startswith("skipped").all() and len(skipped) == 2


@pytest.mark.gpu
def test_checkpointing_lowers_peak_memory_on_gpu():
    cfg = get_config("debug").replace(num_layers=4, context_length=256, d_model=256, d_ff=512)
    peaks = {}
    for strategy, group in [("none", None), ("block", 1), ("recursive", None)]:
        torch.cuda.empty_cache()
        model = BasicsTransformerLM.from_config(cfg, device="cuda")
        model.set_block_runner(make_block_runner(strategy, group))
        tokens = torch.randint(0, cfg.vocab_size, (4, cfg.context_length + 1), device="cuda")
        torch.cuda.reset_peak_memory_stats()
        cross_entropy(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        peaks[strategy] = torch.cuda.max_memory_allocated()
        del model
    assert peaks["block"] < peaks["none"]


# ----------------------------------------------------------------------------------------------------
# Selective checkpointing: the attention core's outputs kept, the rest recomputed
# ----------------------------------------------------------------------------------------------------


class _CountKeptOps(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = 0
        self.matmuls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += is_kept_attention(func)
        self.matmuls += func in MATMUL_OPS
        return func(*args, **(kwargs or {}))


def _block_and_input(attention: str = "sdpa"):
    torch.manual_seed(0)
    block = BasicsTransformerLM.from_config(CFG, attention_impl=attention).layers[0]
    x = torch.randn(2, CFG.context_length, CFG.d_model, requires_grad=True)
    return block, x


def _grads(block, y, x):
    return torch.autograd.grad(y.sum(), [x, *block.parameters()])


@pytest.mark.parametrize("attention", ["sdpa", "flash_triton"])
@pytest.mark.parametrize("keep", [True, False])
def test_keeping_the_attention_skips_only_its_recompute(keep, attention):
    """Exact gradients either way; backward reruns the attention forward only under a plain checkpoint
    (SDPA's aten operator, or our FlashAttention's forward operator inside its autograd.Function)."""
    from torch.utils.checkpoint import checkpoint

    block, x = _block_and_input(attention)
    expected = _grads(block, block(x), x)
    y = checkpoint_keeping_attention(block.forward, x) if keep else checkpoint(block, x, use_reentrant=False)
    counter = _CountKeptOps()
    with counter:
        grads = _grads(block, y, x)
    assert all(torch.equal(a, b) for a, b in zip(grads, expected, strict=True))
    assert counter.calls == (0 if keep else 1)


@pytest.mark.parametrize("attention", ["sdpa", "flash_triton"])
def test_keeping_the_matmuls_too_recomputes_no_matmul(attention):
    """With `matmuls=True` backward runs only the gradients' matmuls, two per forward matmul (input and
    weight gradient); keeping only the attention recomputes the projections too. Gradients exact."""
    block, x = _block_and_input(attention)
    forward = _CountKeptOps()
    with forward:
        y = block(x)
    expected = _grads(block, y, x)
    backward = {}
    for matmuls in (False, True):
        y = checkpoint_keeping_attention(block.forward, x, matmuls=matmuls)
        counter = _CountKeptOps()
        with counter:
            grads = _grads(block, y, x)
        assert all(torch.equal(a, b) for a, b in zip(grads, expected, strict=True))
        assert counter.calls == 0
        backward[matmuls] = counter.matmuls
    assert forward.matmuls >= 7  # q, k, v, output, and the MLP's three projections
    assert backward[True] == 2 * forward.matmuls
    assert backward[False] > backward[True]


@pytest.mark.parametrize("matmuls", [False, True])
@pytest.mark.parametrize("attention", ["sdpa", "flash_triton"])
def test_keeping_the_attention_holds_under_compile(attention, matmuls):
    """Compiled with the checkpoint inside (as the leaderboard step does), the partitioner keeps the
    attention's outputs: its backward graph has no attention forward, and the gradients match eager;
    with `matmuls` its backward has only the gradients' matmuls (two per forward matmul)."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    graphs: list[str] = []

    def record(gm, _example_inputs):
        graphs.append(gm.code)
        return gm.forward

    backend = aot_autograd(
        fw_compiler=record, bw_compiler=record, partition_fn=min_cut_rematerialization_partition
    )
    block, x = _block_and_input(attention)
    expected = _grads(block, block(x), x)
    torch._dynamo.reset()
    compiled = torch.compile(
        lambda t: checkpoint_keeping_attention(block.forward, t, matmuls=matmuls), backend=backend
    )
    grads = _grads(block, compiled(x), x)
    torch._dynamo.reset()
    assert len(graphs) == 2
    forward_graph, backward_graph = graphs
    kept = {str(op) for op in KEPT_ATTENTION_OPS} | {"cs336.flash_attn_fwd.default"}  # "<ns>.<name>.default"

    def ops(graph: str) -> list[str]:
        return re.findall(r"torch\.ops\.((?:aten|cs336)\.\w+\.\w+)", graph)

    assert sum(op in kept for op in ops(forward_graph)) == 1
    assert sum(op in kept for op in ops(backward_graph)) == 0
    backward_ops = {op.removesuffix(".default") + "_backward.default" for op in kept}
    backward_ops.add("cs336.flash_attn_bwd.default")
    assert any(op in backward_ops for op in ops(backward_graph))
    mms = [sum(op.startswith(("aten.mm.", "aten.bmm.", "aten.addmm.")) for op in ops(g)) for g in graphs]
    assert (mms[1] == 2 * mms[0]) == matmuls, mms
    for a, b in zip(grads, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
