"""The training step as one CUDA graph (`TrainStepConfig.cuda_graph`) and what it rests on: AdamW
launches that read their step size from the device, host address tables kept alive for a graph.

CPU: the kernel's device hyperparameters under the Triton interpreter, and the refusals. GPU (`gpu`
marker): a graphed step against the same step run eagerly, through a learning-rate change and a
round trip through host memory (which moves every tensor, so the step captures again).
"""

import pytest
import torch

from cs336_systems.kernels.adamw import (
    ChunkPlan,
    adamw_scalars,
    adamw_step_,
    address_table,
    write_hyperparameters,
)
from cs336_systems.model import MODEL_SIZES, BasicsTransformerLM
from cs336_systems.model.loss import random_batch
from cs336_systems.training import FusedAdamW, Offloader, TrainStepConfig, build_train_step
from cs336_systems.training.step import GRAPH_WARMUP

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HP = dict(lr=3e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)


@pytest.mark.parametrize("decay_before_update", [False, True])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.float16])
def test_hyperparameters_read_on_the_device_give_the_same_update_bit_for_bit(decay_before_update, grad_dtype):
    n = 3000
    plan = ChunkPlan.build([0], [n], DEVICE)
    start = torch.randn(n, device=DEVICE)
    scalar, device = [
        (start.clone(), torch.zeros(n, device=DEVICE), torch.zeros(n, device=DEVICE)) for _ in (0, 1)
    ]
    hyper = torch.full((2,), float("nan"), device=DEVICE)  # never read before it is written
    for step in (1, 2, 3):
        g = torch.randn(n, device=DEVICE).to(grad_dtype)
        adamw_step_(plan, [g], *scalar, step=step, decay_before_update=decay_before_update, **HP)
        write_hyperparameters(hyper, step, HP["lr"], HP["betas"], HP["weight_decay"])
        # step, lr and weight decay given here are not the ones used: the device's values are
        adamw_step_(plan, [g], *device, step=99, lr=1.0, betas=HP["betas"], eps=HP["eps"], weight_decay=0.0,
                    decay_before_update=decay_before_update, hyper=hyper)  # fmt: skip
        for a, b in zip(scalar, device):
            assert torch.equal(a, b)
    assert hyper.tolist() == pytest.approx(list(adamw_scalars(3, HP["lr"], HP["betas"], HP["weight_decay"])))


def test_hyperparameters_must_be_two_float32_values_on_the_buffers_device():
    plan, buf = ChunkPlan.build([0], [16], DEVICE), torch.zeros(16, device=DEVICE)
    for bad in (torch.zeros(3, device=DEVICE), torch.zeros(2, device=DEVICE, dtype=torch.float64)):
        with pytest.raises(ValueError, match="hyper"):
            adamw_step_(plan, [buf], buf.clone(), buf.clone(), buf.clone(), step=1, hyper=bad, **HP)


def test_an_address_table_kept_alive_for_a_graph_bypasses_the_cache():
    tensors = [torch.zeros(16, device=DEVICE) for _ in range(3)]
    cache, keep = {}, []
    table = address_table(tensors, DEVICE, cache, keepalive=keep)
    assert table.tolist() == [t.data_ptr() for t in tensors]
    assert cache == {}  # a later step's table must not replace what the graph reads
    assert len(keep) == 1 and keep[0].tolist() == table.tolist()


def test_cuda_graph_needs_the_fused_optimizer_and_a_cuda_model():
    with pytest.raises(ValueError, match="cuda_graph needs optimizer='fused'"):
        TrainStepConfig(cuda_graph=True)
    model = BasicsTransformerLM.from_config(MODEL_SIZES["debug"], device="cpu")
    with pytest.raises(ValueError, match="CUDA device"):
        build_train_step(model, TrainStepConfig(optimizer="fused", cuda_graph=True))


def test_a_replay_needs_a_capture_and_a_capture_needs_cuda():
    model = BasicsTransformerLM.from_config(MODEL_SIZES["debug"], device="cpu")
    opt = FusedAdamW(model.parameters())
    with pytest.raises(RuntimeError, match="capturing"):
        opt.replay_step(lambda: None)
    with pytest.raises(RuntimeError, match="CUDA"), opt.capturing([]):
        pass


def _run(cfg: TrainStepConfig, steps: int, lr_change_at: int, park_at: int):
    torch.manual_seed(0)
    size = MODEL_SIZES["debug"]
    model = BasicsTransformerLM.from_config(size, device="cuda")
    step = build_train_step(model, cfg)
    gen = torch.Generator().manual_seed(1)
    losses, captured = [], []
    for i in range(steps):
        if i == lr_change_at:
            for g in step.optimizer.param_groups:
                g["lr"] = g["lr"] / 3
        if i == park_at:
            off = Offloader(step)
            off.park()
            assert step.captured == 0  # parking dropped the graphs
            off.unpark()
        x, y = random_batch(4, 32, size.vocab_size, device="cuda", generator=gen)
        losses.append(step(x, y))
        captured.append(step.captured)
    torch.cuda.synchronize()
    weights = [p.detach().float().clone() for p in model.parameters()]
    return [loss.item() for loss in losses], captured, weights, step


@pytest.mark.gpu
@pytest.mark.parametrize("overlap", [True, False])
def test_graphed_step_equals_the_eager_step_gpu(overlap):
    base = dict(attention="flash_triton", overlap=overlap, lr=1e-3)
    eager, _, w_eager, _ = _run(TrainStepConfig.fastest(**base), 10, lr_change_at=5, park_at=7)
    graphed, captured, w_graphed, step = _run(
        TrainStepConfig.fastest(**base, cuda_graph=True), 10, lr_change_at=5, park_at=7
    )
    # eager warm-up, then one graph; parked and back at step 7: captured again at once
    assert captured == [0] * GRAPH_WARMUP + [1] * (7 - GRAPH_WARMUP) + [1] * 3
    assert all(g["step"] == 10 for g in step.optimizer.param_groups)  # replays count their steps
    torch.testing.assert_close(torch.tensor(graphed), torch.tensor(eager), rtol=2e-3, atol=2e-3)
    for a, b in zip(w_graphed, w_eager):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-3)


@pytest.mark.gpu
def test_graphed_losses_are_their_own_tensors_gpu():
    """Each call returns a loss that later replays do not overwrite."""
    _, _, _, step = _run(TrainStepConfig.fastest(attention="flash_triton", cuda_graph=True), 3, -1, -1)
    size = MODEL_SIZES["debug"]
    x, y = random_batch(4, 32, size.vocab_size, device="cuda")
    first = step(x, y)
    kept = first.item()
    step(*random_batch(4, 32, size.vocab_size, device="cuda"))
    assert first.item() == kept
