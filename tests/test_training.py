"""The fused training pieces: multi-tensor AdamW, chunked LM-head + loss, the configurable step.

CPU: Triton kernels under the interpreter, small sizes. GPU (`gpu` marker): the same checks at
sizes that span many chunks, bf16, and the overlapped optimizer on a side stream.
"""

import json
import math

import pytest
import torch

from cs336_systems.kernels.adamw import (
    BLOCK,
    INTERPRETER_BLOCK,
    ChunkPlan,
    adamw_step_,
    address_table,
    chunk_block,
    join_master,
    split_master,
)
from cs336_systems.kernels.linear_cross_entropy import linear_cross_entropy
from cs336_systems.measure.traces import load_trace
from cs336_systems.model import MODEL_SIZES, AdamW, BasicsTransformerLM, cross_entropy
from cs336_systems.model.loss import random_batch
from cs336_systems.studies.training import train_step as study
from cs336_systems.studies.training import train_step_facts, train_step_trace
from cs336_systems.training import FusedAdamW, TrainStepConfig, build_train_step, mixed_precision_groups

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CHUNK = chunk_block(DEVICE)  # the elements of a chunk of the optimizers' plans on DEVICE
# Ragged sizes: smaller than a chunk, exactly one, and several chunks plus a remainder.
SHAPES = [(37, 5), (CHUNK,), (3, CHUNK + 301), (1,)]


def _params(shapes, device, dtype=torch.float32):
    return [torch.randn(s, device=device, dtype=dtype) for s in shapes]


@pytest.mark.parametrize("decay_before_update", [False, True])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_fused_adamw_matches_reference_over_many_steps(decay_before_update, weight_decay):
    init = _params(SHAPES, DEVICE)
    ref = [torch.nn.Parameter(x.clone()) for x in init]
    ours = [torch.nn.Parameter(x.clone()) for x in init]
    hp = dict(lr=3e-2, weight_decay=weight_decay, decay_before_update=decay_before_update, betas=(0.8, 0.95))
    opt_ref, opt_ours = AdamW(ref, **hp), FusedAdamW(ours, **hp)
    for _ in range(15):
        for r, o in zip(ref, ours):
            g = torch.randn_like(r)
            r.grad, o.grad = g.clone(), g.clone()
        opt_ref.step()
        opt_ours.step()
    for r, o in zip(ref, ours):
        torch.testing.assert_close(o, r, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(
            opt_ours.state[o]["exp_avg_sq"], opt_ref.state[r]["v"], rtol=1e-5, atol=1e-9
        )
    # float32 parameters are updated in place: they are views of the optimizer's master buffer
    assert ours[0].untyped_storage().data_ptr() == opt_ours.master.untyped_storage().data_ptr()


def test_bf16_compute_weights_are_the_rounded_masters():
    init = _params(SHAPES, DEVICE)
    ref = [torch.nn.Parameter(x.clone()) for x in init]
    ours = [torch.nn.Parameter(x.clone()) for x in init]
    opt_ref = AdamW(ref, lr=1e-2)
    opt = FusedAdamW([{"params": ours, "compute_dtype": torch.bfloat16}], lr=1e-2)
    assert all(p.dtype == torch.bfloat16 for p in ours)
    for _ in range(5):
        for r, o in zip(ref, ours):
            g = torch.randn_like(r).to(torch.bfloat16)
            r.grad, o.grad = g.float(), g
        opt_ref.step()
        opt.step()
    for r, o in zip(ref, ours):
        master = opt.state[o]["master"]
        torch.testing.assert_close(master, r, rtol=1e-5, atol=1e-6)
        # round-to-nearest-even, bit for bit as torch casts (the interpreter's own cast truncates)
        assert torch.equal(o.detach(), master.to(torch.bfloat16))


def _bits(x):
    return x.view(torch.int32)


def test_split_master_keeps_every_float32_but_a_tie_rounded_down():
    x = torch.cat([torch.randn(4000), torch.tensor([0.0, -0.0, 1e-40, -1e-40, 3.0e38, -2.5e-3])])
    ties = torch.randn(64)  # low 16 bits exactly half a bf16 ulp: odd highs round up, even ones down
    _bits(ties).copy_((_bits(ties) & ~0xFFFF) | 0x8000)
    x = torch.cat([x, ties])
    hi, lo = split_master(x)
    assert torch.equal(hi, x.to(torch.bfloat16))  # the weight is autocast's cast of the master, bit for bit
    back = join_master(hi, lo)
    down = (_bits(x) & 0xFFFF == 0x8000) & (_bits(x) & 0x10000 == 0)
    assert down.sum() > 10 and (~down).sum() > 4000
    assert torch.equal(_bits(back)[~down], _bits(x)[~down])
    assert torch.equal(_bits(back)[down], _bits(x)[down] - 1)  # one ulp toward zero, the same weight
    assert torch.equal(back.to(torch.bfloat16), hi)


def test_split_master_step_stores_the_float32_update_split():
    n = 3 * CHUNK + 77
    hi, lo = split_master(torch.randn(n, device=DEVICE))
    m, v = torch.zeros(n, device=DEVICE), torch.zeros(n, device=DEVICE)
    ref_m, ref_v = m.clone(), v.clone()
    plan, hp = ChunkPlan.build([0], [n], DEVICE), dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    for step in (1, 2, 3):
        g = torch.randn(n, device=DEVICE).bfloat16()
        ref_p = join_master(hi, lo)
        adamw_step_(plan, [g], ref_p, ref_m, ref_v, step=step, **hp)  # the same update of a float32 master
        copies = address_table([hi], DEVICE)
        adamw_step_(plan, [g], lo, m, v, step=step, copies=copies, copy_dtype=torch.bfloat16, **hp)
        got = join_master(hi, lo)
        down = (_bits(ref_p) & 0xFFFF == 0x8000) & (_bits(ref_p) & 0x10000 == 0)  # ties rounded down
        assert torch.equal(_bits(got)[~down], _bits(ref_p)[~down])
        assert torch.equal(_bits(got)[down], _bits(ref_p)[down] - 1)
        assert torch.equal(hi, ref_p.to(torch.bfloat16)) and torch.equal(m, ref_m) and torch.equal(v, ref_v)
    with pytest.raises(ValueError, match="split master"):
        adamw_step_(plan, [g], lo, m, v, step=4, **hp)  # no weight to hold the high halves


def test_split_master_step_keeps_a_tie_rounded_down_one_ulp_lower():
    # betas 0, no decay, eps below an ulp of |g|: the update is exactly p - lr * sign(g), landing on ties
    p = torch.tensor([1 + 2**-7, 1 + 2**-6, -(1 + 2**-7)], device=DEVICE)
    hi, lo = split_master(p)
    assert torch.equal(lo, torch.zeros_like(lo))
    g = torch.tensor([1.0, 1.0, -1.0], device=DEVICE).bfloat16()
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    adamw_step_(ChunkPlan.build([0], [3], DEVICE), [g], lo, m, v, step=1, lr=2**-8, betas=(0.0, 0.0), eps=1e-30,
                weight_decay=0.0, copies=address_table([hi], DEVICE), copy_dtype=torch.bfloat16)  # fmt: skip
    exact = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8)], device=DEVICE)  # ties: even, odd, even
    assert torch.equal(hi, exact.to(torch.bfloat16))  # rounded to nearest even: 1, 1 + 2^-6, -1
    assert lo.tolist() == [32767, -32768, 32767]
    assert torch.equal(_bits(join_master(hi, lo)), _bits(exact) - torch.tensor([1, 0, 1], device=DEVICE))


def test_fused_adamw_split_master_holds_no_float32_copy_of_the_weights():
    init = _params(SHAPES, DEVICE)
    split = [torch.nn.Parameter(x.clone()) for x in init]
    whole = [torch.nn.Parameter(x.clone()) for x in init]
    norm = torch.nn.Parameter(torch.randn(5, device=DEVICE))  # stays float32, updated in place
    group = {"compute_dtype": torch.bfloat16}
    opt = FusedAdamW([{"params": split, "split_master": True, **group}, {"params": [norm]}], lr=1e-2)
    opt_whole = FusedAdamW([{"params": whole, **group}], lr=1e-2)
    assert opt.master.numel() == 16 and opt.master_lo.dtype == torch.int16  # the norm's master only
    assert norm.untyped_storage().data_ptr() == opt.master.untyped_storage().data_ptr()
    for _ in range(4):
        norm.grad = torch.randn_like(norm)
        for a, b in zip(split, whole):
            g = torch.randn_like(a)
            a.grad, b.grad = g, g.clone()
        opt.step()
        opt_whole.step()
    for a, b in zip(split, whole):
        assert a.dtype == torch.bfloat16 and "master" not in opt.state[a]
        torch.testing.assert_close(opt.master_of(a), opt_whole.master_of(b), rtol=1e-6, atol=0)
        assert torch.equal(a.detach(), opt.master_of(a).to(torch.bfloat16))
    with pytest.raises(ValueError, match="bfloat16"):
        FusedAdamW(
            [{"params": [torch.nn.Parameter(init[0])], "compute_dtype": torch.float16, "split_master": True}]
        )


def test_capped_grid_loops_over_chunks_with_the_same_result():
    shapes = [(3, CHUNK + 301), (CHUNK * 2,), (5,)]
    init, grads, results = _params(shapes, DEVICE), _params(shapes, DEVICE), []
    for max_programs in (None, 2):
        ps = [torch.nn.Parameter(x.clone()) for x in init]
        opt = FusedAdamW(ps, lr=1e-2)
        opt.overlap_with_backward(max_programs)
        for p, g in zip(ps, grads):
            p.grad = g.clone()
            opt._on_grad_ready(p)  # what the post-accumulate-grad hook does
        opt.step()
        results.append([p.detach().clone() for p in ps])
    for a, b in zip(*results):
        assert torch.equal(a, b)
    assert not torch.equal(results[0][0], init[0])


def test_unused_parameters_are_skipped_like_the_reference():
    a, b = (
        torch.nn.Parameter(torch.randn(10, device=DEVICE)),
        torch.nn.Parameter(torch.randn(7, device=DEVICE)),
    )
    b0 = b.detach().clone()
    opt = FusedAdamW([a, b], lr=0.1)
    a.grad = torch.ones_like(a)
    opt.step()
    assert torch.equal(b.detach(), b0)
    assert torch.equal(opt.state[b]["exp_avg"], torch.zeros_like(b))
    assert opt.state[a]["exp_avg"].abs().sum() > 0


def test_the_chunk_size_changes_no_bit_of_the_update():
    """The GPU's chunks (BLOCK) and the interpreter's (INTERPRETER_BLOCK): the same update, bit for bit."""
    n = INTERPRETER_BLOCK + 3 * BLOCK + 5  # ragged for both
    init = [torch.randn(n, device=DEVICE), torch.randn(n, device=DEVICE), torch.rand(n, device=DEVICE)]
    results = []
    for block in (BLOCK, INTERPRETER_BLOCK):
        plan = ChunkPlan.build([0], [n], DEVICE, block=block)
        assert plan.block == block and plan.chunk_tensor.numel() == math.ceil(n / block)
        p, m, v = (x.clone() for x in init)
        for step in (1, 2):
            g = torch.randn(n, device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(step))
            adamw_step_(plan, [g], p, m, v, step=step, lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
        results.append((p, m, v))
    assert all(torch.equal(a, b) for a, b in zip(*results))
    assert chunk_block("cpu") == INTERPRETER_BLOCK and chunk_block("cuda:0") == BLOCK
    with pytest.raises(ValueError, match="power of two"):
        ChunkPlan.build([0], [n], DEVICE, block=3000)


def test_adamw_launch_rejects_bad_input():
    plan = ChunkPlan.build([0], [4], DEVICE)
    buf = torch.zeros(4, device=DEVICE)
    with pytest.raises(ValueError, match="2 gradients"):
        adamw_step_(plan, [buf, buf], buf, buf, buf, step=1, lr=1, betas=(0.9, 0.9), eps=1e-8, weight_decay=0)
    with pytest.raises(ValueError, match="step counts from 1"):
        adamw_step_(plan, [buf], buf, buf, buf, step=0, lr=1, betas=(0.9, 0.9), eps=1e-8, weight_decay=0)
    with pytest.raises(ValueError, match="contiguous"):
        adamw_step_(
            plan,
            [torch.zeros(4, 2, device=DEVICE).t()],
            buf,
            buf,
            buf,
            step=1,
            lr=1,
            betas=(0.9, 0.9),
            eps=1e-8,
            weight_decay=0,
        )
    with pytest.raises(ValueError, match="one device"):
        FusedAdamW([torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2, device="meta"))])


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("chunk", [None, 7, 64])
def test_linear_cross_entropy_matches_unfused(dtype, tol, chunk):
    n, d, vocab = 45, 24, 97
    x = torch.randn(3, n // 3, d, device=DEVICE, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(vocab, d, device=DEVICE, dtype=dtype) * 0.2)
    t = torch.randint(0, vocab, (3, n // 3), device=DEVICE)
    loss = linear_cross_entropy(x, w, t, chunk=chunk)
    (2.0 * loss).backward()
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    ref = cross_entropy(x.to(dtype) @ w.t(), t)
    (2.0 * ref).backward()
    torch.testing.assert_close(loss, ref.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(gx, x.grad, rtol=tol, atol=tol)
    torch.testing.assert_close(gw.float(), w.grad.float(), rtol=tol, atol=tol)
    assert gw.dtype == dtype


def test_linear_cross_entropy_rejects_bad_targets():
    x, w = torch.randn(4, 8), torch.randn(10, 8)
    with pytest.raises(ValueError, match=r"\[0, 10\)"):
        linear_cross_entropy(x, w, torch.tensor([0, 1, 10, 2]))
    with pytest.raises(ValueError, match="do not match"):
        linear_cross_entropy(x, w, torch.tensor([0, 1]))


def test_mixed_precision_groups_keep_norms_and_embeddings_fp32():
    model = BasicsTransformerLM.from_config(MODEL_SIZES["debug"])
    low, full = mixed_precision_groups(model)
    names = {id(p): n for n, p in model.named_parameters()}
    assert {names[id(p)] for p in full["params"]} == {
        n for n, p in model.named_parameters() if p.ndim == 1 or n == "token_embeddings.weight"
    }
    assert "lm_head.weight" in {names[id(p)] for p in low["params"]}


def _losses(tc: TrainStepConfig, steps: int = 20) -> list[float]:
    cfg = MODEL_SIZES["debug"]
    torch.manual_seed(0)
    model = BasicsTransformerLM.from_config(cfg, device=DEVICE)
    step = build_train_step(model, tc)
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        x, y = random_batch(4, 32, cfg.vocab_size, device=DEVICE, generator=gen)
        out.append(step(x, y).item())
    return out


def test_fast_step_follows_the_reference_step_for_20_steps():
    ref = _losses(TrainStepConfig(autocast=True, lr=1e-3))
    # bf16 compute weights and the overlapped update change nothing but rounding: the fused update and
    # torch's separate ops round the fp32 arithmetic differently where either contracts a multiply-add
    # (on a GPU the kernel; on a CPU torch's vectorised kernels, which use FMA on AVX2 CPUs: with
    # ATEN_CPU_CAPABILITY=default the 20 losses here are bit-identical, on AVX2 they part from step 11
    # by at most ~5e-4). A wrong update (decay, bias correction, eps) moves the losses by far more.
    same = _losses(
        TrainStepConfig(autocast=True, optimizer="fused", bf16_weights=True, overlap=True, lr=1e-3)
    )
    assert max(abs(a - b) for a, b in zip(same, ref)) <= 1e-3
    # the fused loss rounds differently (dW summed over chunks in fp32): bf16-level agreement
    fast = _losses(
        TrainStepConfig.fastest(
            compile=False, attention="sdpa" if DEVICE == "cpu" else "flash_triton", lr=1e-3
        )
    )
    assert max(abs(a - b) for a, b in zip(fast, ref)) < 2e-2
    assert ref[-1] < ref[0]  # it trains


def test_train_step_config_rejects_impossible_combinations():
    with pytest.raises(ValueError, match="optimizer='fused'"):
        TrainStepConfig(overlap=True)
    with pytest.raises(ValueError, match="autocast"):
        TrainStepConfig(optimizer="fused", bf16_weights=True)
    with pytest.raises(ValueError, match="optimizer must be"):
        TrainStepConfig(optimizer="sgd")


def test_study_quick_run_writes_nothing_by_default(tmp_path, capsys):
    df = study.main(["--quick", "--parts", "compare", "--no-save"])
    assert set(df[df.name == "compare"].impl) == {"stock", "ours"}
    assert (df[df.metric == "step_ms"].p50 > 0).all()
    peaks = df[df.metric == "peak_memory_gib"].set_index("impl").p50
    assert set(peaks.index) == {"stock", "ours"} and (peaks > 0).all()
    # the same persistent bytes per parameter: ours splits its masters (12 each, + padding)
    persistent = df[df.metric == "persistent_memory_gib"].set_index("impl").p50
    assert persistent["ours"] == pytest.approx(persistent["stock"], rel=0.05)
    facts = train_step_facts.facts(df)
    (run,) = facts["latest"].values()  # one run of one device: its rows share the run id
    assert run["attention"] == "sdpa" and run["parked"]  # the CPU's attention, said so in the rows
    assert math.isfinite(run["contexts"][32]["ratio"])
    assert df.config_json.str.contains('"run_id"').all()
    study.main(["--quick", "--parts", "compare", "--results-dir", str(tmp_path)])
    assert (tmp_path / "training_step.csv").exists()
    # one profiled step of each path, its work by phase: kernels on a GPU; on the CPU the compact
    # trace keeps the autograd functions, so only backward's work
    phases = {"forward", "backward", "optimizer_step"} if DEVICE == "cuda" else {"backward"}
    for impl in ("stock", "ours"):
        table = train_step_trace.kernel_table(load_trace(train_step_trace.trace_file(tmp_path, impl, 32)))
        ms = table.groupby("phase").ms.sum()
        assert set(ms.index) == phases and (ms > 0).all(), table


def _compare_rows(
    device, git, when, step_ms, *, run_id="", ours="ours", attention="flash_triton", peaks=None
):
    """The matmul_peak row and the compare rows of one run: {ctx: (stock ms, ours ms)}; peaks: {ctx: (stock,
    ours)} GiB (a run of the parking code also writes persistent_memory_gib)."""
    import pandas as pd

    run = {"run_id": run_id} if run_id else {}
    rows = [dict(name="matmul_peak", impl="torch.mm", x_value=None, metric="tflops", p50=700.0, config=run)]
    for ctx, times in step_ms.items():
        cfg = run | {"size": "2.7B", "batch_size": 4, "context_length": ctx, "attention": attention}
        for impl, ms in zip(("stock", ours), times):
            rows.append(dict(name="compare", impl=impl, x_value=ctx, metric="step_ms", p50=ms, config=cfg))
            for i, metric in enumerate(("peak_memory_gib", "persistent_memory_gib") if peaks else ()):
                value = peaks[ctx][impl != "stock"] if i == 0 else 38.0
                rows.append(
                    dict(name="compare", impl=impl, x_value=ctx, metric=metric, p50=value, config=cfg)
                )
    df = pd.DataFrame(rows)
    df["config_json"] = [json.dumps(c) for c in df.pop("config")]
    return df.assign(note="", gpu_name=device, git_sha=git, timestamp=when)


def test_train_step_facts_keep_each_ratio_within_one_run():
    import pandas as pd

    h100, h200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"
    df = pd.concat(
        [
            # older H200 run, rows without a run id (grouped by their block in the file): SDPA in ours
            _compare_rows(h200, "aaaaaaaaaa", "2026-01-01T00:00:00", {512: (100.0, 80.0)}, attention="sdpa"),
            _compare_rows(
                h200,
                "bbbbbbbbbb",
                "2026-01-02T00:00:00",
                {512: (110.0, 99.0), 2048: (300.0, 290.0)},
                run_id="r2",
                peaks={512: (50.0, 45.0), 2048: (70.0, 66.0)},
            ),
            _compare_rows(
                h100,
                "bbbbbbbbbb",
                "2026-01-03T00:00:00",
                {512: (120.0, 100.0), 2048: (330.0, 280.0)},
                run_id="r3",
                peaks={512: (50.0, 45.0), 2048: (70.0, 71.0)},
            ),
            # a later exploratory H200 run of another ours: listed, never the headline
            _compare_rows(
                h200,
                "cccccccccc",
                "2026-01-04T00:00:00",
                {512: (110.0, 60.0)},
                run_id="r4",
                ours="ours +sdpa",
            ),
        ]
    ).reset_index(drop=True)
    facts = train_step_facts.facts(df, size="2.7B")
    latest = facts["latest"]
    assert list(latest) == [h100, h200]
    assert latest[h200]["run"] == "r2" and latest[h100]["run"] == "r3"
    assert latest[h200]["contexts"][512]["ratio"] == pytest.approx(99 / 110)  # not 80/100 nor 60/110
    assert latest[h100]["contexts"][2048]["ratio"] == pytest.approx(280 / 330)
    assert facts["goal_points"] == [
        (h100, 512, True),
        (h100, 2048, True),
        (h200, 512, False),
        (h200, 2048, False),
    ]
    assert not facts["goal_met"]
    assert not facts["peaks_ok"] and not latest[h100]["contexts"][2048]["peak_le_stock"]  # 71 > 70 GiB
    runs = pd.DataFrame(facts["runs"])
    assert list(runs.run) == ["aaaaaaaaaa#1", "r2", "r2", "r3", "r3", "r4"]
    assert runs.set_index("run").loc["aaaaaaaaaa#1", "attention"] == "sdpa"
    assert not runs.set_index("run").loc["aaaaaaaaaa#1", "parked"]  # no persistent rows: both paths resident
    # a failed path (an OOM row) leaves its ratio undefined, and that run is not a headline
    oom = _compare_rows(h100, "dddddddddd", "2026-01-05T00:00:00", {512: (125.0, float("nan"))}, run_id="r5")
    oom.loc[oom.impl == "ours", "note"] = "OOM"
    facts = train_step_facts.facts(pd.concat([df, oom]).reset_index(drop=True), size="2.7B")
    assert facts["latest"][h100]["run"] == "r3"
    assert pd.DataFrame(facts["runs"]).set_index("run").loc["r5", "ours_note"] == "OOM"
    # every context met on both kinds: the goal is met
    good = {512: (100.0, 80.0), 2048: (300.0, 250.0)}
    both = pd.concat([_compare_rows(d, "e", "2026-02-01", good, run_id=d) for d in (h100, h200)])
    assert train_step_facts.facts(both.reset_index(drop=True))["goal_met"]
    # one kind only: not met, whatever its ratios
    assert not train_step_facts.facts(_compare_rows(h100, "e", "2026-02-01", good, run_id="x"))["goal_met"]


def test_step_flops_counts_weights_and_causal_attention():
    cfg = MODEL_SIZES["2.7B"]
    flops = study.step_flops(cfg, 4, 512)
    weights = (
        6
        * 4
        * 512
        * (cfg.num_params() - cfg.vocab_size * cfg.d_model - cfg.d_model - cfg.num_layers * 2 * cfg.d_model)
    )
    attention = 3 * cfg.num_layers * 2 * 4 * 512 * 512 * cfg.d_model
    assert flops == pytest.approx(weights + attention)


@pytest.mark.gpu
def test_overlapped_update_on_a_side_stream_equals_the_plain_step_gpu():
    base = dict(autocast=True, optimizer="fused", bf16_weights=True, attention="flash_triton", lr=1e-3)
    plain = _losses(TrainStepConfig(**base))
    overlapped = _losses(TrainStepConfig(**base, overlap=True, compile=True))
    assert max(abs(a - b) for a, b in zip(plain, overlapped)) < 2e-2
    assert _losses(TrainStepConfig(**base, overlap=True)) == plain


@pytest.mark.parametrize("attention", ["sdpa", "flash_triton"])
def test_compiled_block_has_no_graph_breaks(attention):
    # Our Triton attention is a registered custom op, so dynamo traces a whole block in one graph.
    torch._dynamo.reset()
    model = BasicsTransformerLM.from_config(MODEL_SIZES["debug"], attention_impl=attention)
    x = torch.randn(2, 16, model.config.d_model, requires_grad=True)
    explanation = torch._dynamo.explain(model.layers[0])(x)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


def test_an_overlapped_optimizer_and_its_model_are_freed():
    import gc
    import weakref

    model = BasicsTransformerLM.from_config(MODEL_SIZES["debug"])
    step = build_train_step(model, TrainStepConfig(autocast=True, optimizer="fused", overlap=True))
    x, y = random_batch(2, 16, MODEL_SIZES["debug"].vocab_size)
    step(x, y)
    alive = [weakref.ref(model), weakref.ref(step.optimizer)]
    del model, step
    gc.collect()
    assert all(r() is None for r in alive)


@pytest.mark.parametrize("scale", [0.5, 1 / 3])
def test_grad_scale_multiplies_each_gradient_in_float32_as_it_is_read(scale):
    """`grad_scale` (ZeroAdamW's 1 / world size for summed gradients): the update equals the update of
    the float32 gradient times the scale; for a power of two, bit for bit the update of the bf16
    gradient divided first (what a separate division kernel gave)."""
    n, hp = 3000, dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    g = torch.randn(n, device=DEVICE).bfloat16()
    plan = ChunkPlan.build([0], [n], DEVICE)
    start = torch.randn(n, device=DEVICE)
    got, want = [
        (start.clone(), torch.zeros(n, device=DEVICE), torch.zeros(n, device=DEVICE)) for _ in (0, 1)
    ]
    for step in (1, 2):
        adamw_step_(plan, [g], *got, step=step, grad_scale=scale, **hp)
        adamw_step_(plan, [(g.float() * scale).contiguous()], *want, step=step, **hp)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    if scale == 0.5:
        divided = [(start.clone(), torch.zeros(n, device=DEVICE), torch.zeros(n, device=DEVICE))]
        for step in (1, 2):
            adamw_step_(plan, [g / 2], *divided[0], step=step, **hp)
        for a, b in zip(got, divided[0]):
            assert torch.equal(a, b)


@pytest.mark.parametrize("decay_before_update", [False, True])
def test_bf16_state_is_the_float32_update_rounded_once_per_step(decay_before_update):
    """bf16 parameters, m and v: each step computes in float32 and rounds every stored value once."""
    n, lr, wd, betas, eps = 5000, 1e-3, 0.01, (0.9, 0.999), 1e-8
    p, g = torch.randn(n, device=DEVICE).bfloat16(), torch.randn(n, device=DEVICE).bfloat16()
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    ref_p, ref_m, ref_v = p.float(), m.float(), v.float()
    plan = ChunkPlan.build([0], [n], DEVICE)
    for step in (1, 2, 3):
        adamw_step_(plan, [g], p, m, v, step=step, lr=lr, betas=betas, eps=eps, weight_decay=wd,
                    decay_before_update=decay_before_update)  # fmt: skip
        gf = g.float()
        if decay_before_update:
            ref_p = ref_p * (1 - lr * wd)
        ref_m = betas[0] * ref_m + (1 - betas[0]) * gf
        ref_v = betas[1] * ref_v + (1 - betas[1]) * gf * gf
        lr_t = lr * math.sqrt(1 - betas[1] ** step) / (1 - betas[0] ** step)
        ref_p = ref_p - lr_t * ref_m / (ref_v.sqrt() + eps)
        if not decay_before_update:
            ref_p = ref_p * (1 - lr * wd)
        ref_p, ref_m, ref_v = (t.bfloat16().float() for t in (ref_p, ref_m, ref_v))
    # bit for bit on the CPU; on a GPU the kernel's sqrt / division may differ from torch's by an fp32
    # ulp, which can move a rounding to the neighbouring bf16 value
    rtol = 0.0 if DEVICE == "cpu" else 2.0**-7
    for ours, ref in ((p, ref_p), (m, ref_m), (v, ref_v)):
        assert ours.dtype == torch.bfloat16
        torch.testing.assert_close(ours.float(), ref, rtol=rtol, atol=0)
