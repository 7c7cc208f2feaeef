"""Tests of the from-scratch Basics Transformer LM, AdamW and cross-entropy."""

import math

import pytest
import torch
import torch.nn.functional as F

from cs336_systems.model import (
    MODEL_SIZES,
    AdamW,
    BasicsTransformerLM,
    Embedding,
    Linear,
    RMSNorm,
    RotaryEmbedding,
    causal_mask,
    clip_gradient,
    cross_entropy,
    get_config,
    get_cosine_lr,
    random_batch,
    scaled_dot_product_attention,
)

STAFF_NAMES = {
    "token_embeddings.weight",
    "ln_final.weight",
    "lm_head.weight",
    *(
        f"layers.{{i}}.{n}"
        for n in [
            "ln1.weight",
            "ln2.weight",
            "attn.q_proj.weight",
            "attn.k_proj.weight",
            "attn.v_proj.weight",
            "attn.output_proj.weight",
            "ffn.w1.weight",
            "ffn.w2.weight",
            "ffn.w3.weight",
        ]
    ),
}


def tiny_model(**kw):
    return BasicsTransformerLM.from_config(get_config("debug"), **kw)


@pytest.mark.parametrize("size", sorted(MODEL_SIZES))
def test_param_count_matches_formula_without_allocating(size):
    cfg = MODEL_SIZES[size]
    model = BasicsTransformerLM.from_config(cfg, device="meta")
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params()
    assert model.get_num_params() == cfg.num_params(non_embedding=True)


def test_handout_parameter_counts():
    # The spec's derived counts (V = 10k): small 128.6M ... 2.7B 3406.8M.
    expected = {"small": 128.6, "medium": 423.2, "large": 969.4, "xl": 1998.2, "2.7B": 3406.8}
    for size, millions in expected.items():
        assert round(get_config(size).num_params() / 1e6, 1) == millions


def test_staff_parameter_names_and_shapes():
    cfg = get_config("debug")
    model = tiny_model()
    names = {n for n, _ in model.named_parameters()}
    expected = {n.format(i=i) for n in STAFF_NAMES for i in range(cfg.num_layers)}
    assert names == expected
    shapes = dict(model.named_parameters())
    assert shapes["layers.0.ffn.w1.weight"].shape == (cfg.d_ff, cfg.d_model)
    assert shapes["layers.0.ffn.w2.weight"].shape == (cfg.d_model, cfg.d_ff)
    assert shapes["lm_head.weight"].shape == (cfg.vocab_size, cfg.d_model)
    assert "positional_encoder._freq_cis_cache" not in model.state_dict()


def test_forward_shape_dtype_and_context_check():
    cfg = get_config("debug")
    model = tiny_model()
    x, _ = random_batch(3, 20, cfg.vocab_size)
    logits = model(x)
    assert logits.shape == (3, 20, cfg.vocab_size) and logits.dtype == torch.float32
    with pytest.raises(ValueError, match="context_length"):
        model(torch.zeros(1, cfg.context_length + 1, dtype=torch.long))


def test_causal_future_tokens_do_not_change_past_logits():
    cfg = get_config("debug")
    model = tiny_model()
    x, _ = random_batch(2, 24, cfg.vocab_size)
    y = x.clone()
    y[:, 12:] = torch.randint(0, cfg.vocab_size, (2, 12))
    with torch.no_grad():
        a, b = model(x), model(y)
    torch.testing.assert_close(a[:, :12], b[:, :12])
    assert not torch.allclose(a[:, 12:], b[:, 12:])


@pytest.mark.parametrize("impl", ["sdpa", "flash_pytorch"])
def test_attention_implementations_agree_with_naive(impl):
    cfg = get_config("debug")
    model = tiny_model()
    x, _ = random_batch(2, 32, cfg.vocab_size)
    with torch.no_grad():
        ref = model(x)
        model.set_attention(impl)
        out = model(x)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_naive_attention_matches_torch_sdpa():
    q, k, v = torch.randn(3, 2, 4, 9, 16).unbind(0)
    out = scaled_dot_product_attention(q, k, v, causal_mask(9, 9))
    torch.testing.assert_close(
        out, F.scaled_dot_product_attention(q, k, v, is_causal=True), atol=1e-5, rtol=1e-5
    )


def test_linear_and_rmsnorm():
    lin = Linear(7, 5)
    x = torch.randn(2, 3, 7)
    torch.testing.assert_close(lin(x), x @ lin.weight.T)
    std = math.sqrt(2 / 12)
    assert lin.weight.abs().max() <= 3 * std + 1e-6
    norm = RMSNorm(8)
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    out = norm(x)
    assert out.dtype == torch.bfloat16
    ref = x.float() / torch.sqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5)
    torch.testing.assert_close(out.float(), ref, atol=1e-2, rtol=1e-2)


def test_rope_preserves_norm_and_is_relative():
    d = 16
    rope = RotaryEmbedding(64, d, theta=10_000.0)
    q, k = torch.randn(2, d, dtype=torch.float64).float().unbind(0)
    seq = torch.stack([q] * 64)[None]  # (1, 64, d): the same vector at every position
    rq = rope(seq)
    torch.testing.assert_close(rq.norm(dim=-1), seq.norm(dim=-1))
    rk = rope(torch.stack([k] * 64)[None])
    # <R_m q, R_n k> depends only on m - n.
    dots = torch.einsum("md,nd->mn", rq[0], rk[0])
    torch.testing.assert_close(dots[10, 3], dots[40, 33], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(dots[5, 5], q @ k, atol=1e-4, rtol=1e-4)
    # Position 0 is the identity; explicit positions equal the default arange.
    torch.testing.assert_close(rq[0, 0], q)
    torch.testing.assert_close(rope(seq, torch.arange(64)[None]), rq)


def _adam_reference(p, grads, lr, b1, b2, eps, wd, decay_first):
    m = torch.zeros_like(p)
    v = torch.zeros_like(p)
    for t, g in enumerate(grads, start=1):
        if decay_first:
            p = p - lr * wd * p
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        alpha = lr * math.sqrt(1 - b2**t) / (1 - b1**t)
        p = p - alpha * m / (torch.sqrt(v) + eps)
        if not decay_first:
            p = p - lr * wd * p
    return p


@pytest.mark.parametrize("decay_first", [False, True])
def test_adamw_matches_hand_computed_update(decay_first):
    p0 = torch.randn(5, 3, dtype=torch.float64)
    grads = [torch.randn(5, 3, dtype=torch.float64) for _ in range(4)]
    param = torch.nn.Parameter(p0.clone())
    opt = AdamW(
        [param], lr=0.05, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1, decay_before_update=decay_first
    )
    for g in grads:
        param.grad = g.clone()
        opt.step()
    expected = _adam_reference(p0, grads, 0.05, 0.8, 0.95, 1e-6, 0.1, decay_first)
    torch.testing.assert_close(param.detach(), expected, atol=1e-12, rtol=1e-12)
    assert opt.state[param]["t"] == 5


def test_adamw_skips_params_without_grad_and_close_to_torch():
    a, b = torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.randn(4))
    b0 = b.detach().clone()
    ref = torch.nn.Parameter(a.detach().clone())
    ours, theirs = AdamW([a, b], lr=1e-2, decay_before_update=True), torch.optim.AdamW([ref], lr=1e-2)
    for _ in range(3):
        g = torch.randn(4)
        a.grad, ref.grad = g.clone(), g.clone()
        ours.step()
        theirs.step()
    assert torch.equal(b.detach(), b0) and b not in ours.state
    # Same algorithm up to where eps enters: close but (by design) not bitwise.
    torch.testing.assert_close(a.detach(), ref.detach(), atol=1e-5, rtol=1e-4)


def test_adamw_rejects_bad_hyperparameters():
    with pytest.raises(ValueError):
        AdamW([torch.nn.Parameter(torch.zeros(1))], lr=-1.0)
    with pytest.raises(ValueError):
        AdamW([torch.nn.Parameter(torch.zeros(1))], betas=(1.0, 0.9))


def test_cross_entropy_matches_torch():
    logits = torch.randn(3, 7, 11) * 5
    targets = torch.randint(0, 11, (3, 7))
    torch.testing.assert_close(
        cross_entropy(logits, targets), F.cross_entropy(logits.reshape(-1, 11), targets.reshape(-1))
    )
    big = torch.tensor([[1000.0, 0.0, -1000.0]])
    assert torch.isfinite(cross_entropy(big, torch.tensor([2])))
    with pytest.raises(ValueError, match="do not match"):
        cross_entropy(logits, targets[:, :3])


@pytest.mark.parametrize("bad", [-1, 11])
def test_token_ids_outside_the_vocabulary_are_errors_not_wraparound(bad):
    """Item 9: a negative id would silently read the table's last row; ids >= vocab are errors too."""
    ids = torch.tensor([[1, 2, bad, 3]])
    with pytest.raises(
        ValueError, match=rf"token ids must lie in \[0, 11\): found {bad} at position \(0, 2\)"
    ):
        Embedding(11, 4)(ids)
    with pytest.raises(ValueError, match=rf"targets must lie in \[0, 11\): found {bad}"):
        cross_entropy(torch.randn(1, 4, 11), ids)
    model = BasicsTransformerLM(
        vocab_size=11, context_length=8, d_model=16, num_layers=1, num_heads=2, d_ff=32
    )
    with pytest.raises(ValueError, match="token ids"):
        model(ids)
    with pytest.raises(TypeError, match="integer"):
        Embedding(11, 4)(ids.float())


def test_the_device_path_of_the_id_check_is_an_async_assert(monkeypatch):
    """Under torch.compile (and on a GPU) the check is torch._assert_async, which raises on CPU."""
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with pytest.raises(RuntimeError, match=r"token ids outside \[0, 11\)"):
        Embedding(11, 4)(torch.tensor([0, -1]))
    Embedding(11, 4)(torch.tensor([0, 10]))


@pytest.mark.gpu
def test_the_id_check_does_not_synchronise_the_gpu():
    emb = Embedding(11, 4, device="cuda")
    ids = torch.randint(0, 11, (4, 16), device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        emb(ids)
        cross_entropy(torch.randn(4, 16, 11, device="cuda"), ids)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_cosine_schedule_and_clipping():
    assert get_cosine_lr(0, 1.0, 0.1, 10, 100) == 0.0
    assert get_cosine_lr(10, 1.0, 0.1, 10, 100) == pytest.approx(1.0)
    assert get_cosine_lr(55, 1.0, 0.1, 10, 100) == pytest.approx(0.55)
    assert get_cosine_lr(200, 1.0, 0.1, 10, 100) == 0.1
    ps = [torch.nn.Parameter(torch.zeros(3)) for _ in range(2)]
    ps[0].grad, ps[1].grad = torch.tensor([3.0, 0, 0]), torch.tensor([0, 4.0, 0])
    norm = clip_gradient(ps, 1.0)
    assert norm.item() == pytest.approx(5.0)
    total = torch.sqrt(sum(p.grad.pow(2).sum() for p in ps))
    assert total.item() == pytest.approx(1.0, rel=1e-4)


def test_tiny_model_overfits_a_fixed_batch():
    torch.manual_seed(0)
    cfg = get_config("debug")
    model = tiny_model()
    x, y = random_batch(4, 16, cfg.vocab_size)
    opt = AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    losses = []
    for _ in range(60):
        loss = cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] > 5.0  # ~ln(256) at random init
    assert losses[-1] < 0.3 * losses[0]


def test_one_level_checkpointing_gives_identical_gradients():
    cfg = get_config("debug")
    torch.manual_seed(1)
    a = tiny_model()
    b = tiny_model()
    b.load_state_dict(a.state_dict())
    b.set_checkpointing(1)
    x, y = random_batch(2, 16, cfg.vocab_size)
    cross_entropy(a(x), y).backward()
    cross_entropy(b(x), y).backward()
    for (n, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        torch.testing.assert_close(pa.grad, pb.grad, msg=n, atol=0, rtol=0)
    with pytest.raises(ValueError):
        b.set_checkpointing(-1)


def test_config_validation():
    with pytest.raises(ValueError, match="divisible"):
        get_config("debug", num_heads=3)
    with pytest.raises(ValueError, match="unknown model size"):
        get_config("huge")
