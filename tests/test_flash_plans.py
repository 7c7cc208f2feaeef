"""Launch plans (`attention/flash_triton/plans.py`): the first call of an input signature records
its kernel launches, later calls replay them. Under the interpreter a replay re-invokes the kernels
with the new tensors substituted by role, so these CPU tests check the recording, the substitution
and the signature rules; the GPU test replays through `CompiledKernel.run`."""

from __future__ import annotations

import sys

import pytest
import torch

from cs336_systems.attention import FlashAttentionTriton
from cs336_systems.attention.flash_triton import (
    BwdConfig,
    FwdConfig,
    kernel_calls,
    launch,
    plans,
    use_configs,
)

pytestmark = pytest.mark.filterwarnings("ignore:tl.make_block_ptr is deprecated")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def full_calls(monkeypatch):
    """Empty plan caches, and counts of the full (recording) launcher paths taken."""
    monkeypatch.setattr(launch, "_FWD_PLANS", plans.PlanCache())
    monkeypatch.setattr(launch, "_BWD_PLANS", plans.PlanCache())
    calls = {"fwd": 0, "bwd": 0}
    for kind, name in (("fwd", "_flash_fwd_full"), ("bwd", "_flash_bwd_full")):
        original = getattr(launch, name)

        def counted(*args, _kind=kind, _original=original, **kwargs):
            calls[_kind] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(launch, name, counted)
    return calls


def _inputs(shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g, dtype=dtype).to(DEVICE) for _ in range(4)]


def _fwd_bwd(q, k, v, do, causal):
    o, lse = launch.flash_fwd(q, k, v, causal)
    return (o, lse, *launch.flash_bwd(do, q, k, v, o, lse, causal))


@pytest.mark.parametrize("shape", [(2, 3, 40, 16), (2, 37, 24)], ids=["4d", "3d-d24"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_replay_matches_the_full_path_on_new_tensors(full_calls, shape, causal):
    q, k, v, do = _inputs(shape)
    first = _fwd_bwd(q, k, v, do, causal)
    q2, k2, v2, do2 = _inputs(shape, seed=1)  # same signature, other values and storage
    replayed = _fwd_bwd(q2, k2, v2, do2, causal)
    assert full_calls == {"fwd": 1, "bwd": 1}  # the second call replayed both plans
    with use_configs(fwd=FwdConfig(16, 16), bwd=BwdConfig(16, 16, 16, 16)):  # another plan state
        full = _fwd_bwd(q2, k2, v2, do2, causal)
    assert full_calls == {"fwd": 2, "bwd": 2}
    for a, b in zip(replayed, full):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert not any(torch.equal(a, b) for a, b in zip(first, replayed))  # new inputs, new outputs


def test_every_part_of_the_signature_separates_plans(full_calls):
    q, k, v, _ = _inputs((1, 2, 32, 16))
    launch.flash_fwd(q, k, v, True)
    launch.flash_fwd(q, k, v, False)  # flag
    launch.flash_fwd(q.transpose(1, 2).contiguous().transpose(1, 2), k, v, True)  # strides
    base = torch.randn(q.numel() + 1, device=DEVICE)
    launch.flash_fwd(base[1:].view_as(q), k, v, True)  # 4-byte offset: not 16-byte aligned
    launch.flash_fwd(q.half(), k.half(), v.half(), True)  # dtype
    with use_configs(fwd=FwdConfig(16, 16)):  # pinned configuration
        launch.flash_fwd(q, k, v, True)
    assert full_calls["fwd"] == 6
    launch.flash_fwd(q.clone(), k.clone(), v.clone(), True)  # same signature as the first call
    assert full_calls["fwd"] == 6


def test_calls_that_cannot_be_replayed_always_take_the_full_path(full_calls):
    q, _, _, do = _inputs((1, 2, 33, 16))
    for _ in range(2):  # one tensor in three roles: a replay could not tell them apart
        o, lse = launch.flash_fwd(q, q, q, True)
    assert full_calls["fwd"] == 2
    for _ in range(2):  # the same in the backward
        grads = launch.flash_bwd(do, q, q, q, o, lse, True)
    assert full_calls["bwd"] == 2
    ref = _fwd_bwd(q, q.clone(), q.clone(), do, True)  # three tensors: the same values
    for a, b in zip(grads, ref[2:]):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_the_one_pass_backward_replays_with_its_float32_scratch(full_calls):
    """The tl one-pass dQ (`BwdConfig.dq`) adds into a zeroed float32 scratch that is cast into dq:
    both are planned launches, so its second call replays (scratch allocated again) and matches the
    two-pass result."""
    q, k, v, do = _inputs((1, 2, 33, 16))
    ref = _fwd_bwd(q, k, v, do, True)
    with use_configs(bwd=BwdConfig(16, 16, 16, 16, dq="atomic")):
        for _ in range(2):
            grads = launch.flash_bwd(do, q, k, v, ref[0], ref[1], True)
    assert full_calls["bwd"] == 2  # the two-pass reference, then the one-pass's recording; then a replay
    for a, b in zip(grads, ref[2:]):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_a_named_tensor_that_dies_while_recording_does_not_lend_its_id_to_another_role():
    """A recording names tensors by id: one that a launcher names and drops (a temporary view) must
    not give its id to a later tensor in another role, which would fail the recording as one tensor
    in two roles (and leave the call on the full path every time)."""
    with plans.recording() as rec:
        for i in range(50):
            plans.role(f"t{i}", torch.empty(1))  # each dropped at once: CPython would reuse its id
    assert not rec.failed, rec.failed
    with plans.recording() as rec:  # a tensor passed in two roles still fails it
        t = torch.empty(1)
        plans.role("q", t)
        plans.role("k", t)
    assert "both 'q' and 'k'" in rec.failed


def test_bad_inputs_are_refused_with_a_plan_in_place(full_calls):
    q, k, v, do = _inputs((1, 2, 32, 16))
    launch.flash_fwd(q, k, v, True)
    with pytest.raises(ValueError, match="same head dimension"):
        launch.flash_fwd(q, k[..., :8], v, True)
    with pytest.raises(ValueError, match=r"must be a torch\.Tensor"):
        launch.flash_fwd(q, k, None, True)
    o, _ = launch.flash_fwd(q, k, v, True)
    with pytest.raises(ValueError, match=r"must be a torch\.Tensor"):
        launch.flash_bwd(do, q, k, v, o, None, True)


def test_autograd_backward_replays_on_its_own_thread(full_calls):
    grads = []
    for seed in (0, 1, 1):
        q, k, v, do = (t.requires_grad_(i < 3) for i, t in enumerate(_inputs((2, 2, 40, 16), seed=seed)))
        FlashAttentionTriton.apply(q, k, v, True).backward(do)
        grads.append((q.grad, k.grad, v.grad))
    assert full_calls == {"fwd": 1, "bwd": 1}
    for a, b in zip(grads[1], grads[2]):
        assert torch.equal(a, b)  # the same inputs give the same gradients through a replay


def test_the_operators_pass_torch_opcheck():
    """Schema, fake (meta) implementations and AOT dispatch of cs336::flash_attn_fwd / _bwd."""
    from cs336_systems.attention.flash_triton import function

    q, k, v = _inputs((2, 3, 33, 16))[:3]
    for name, result in torch.library.opcheck(function._flash_attn_fwd, (q, k, v, True)).items():
        assert result == "SUCCESS", name
    o, lse = function._flash_attn_fwd(q, k, v, True)
    args = (torch.randn_like(o), q, k, v, o, lse, True)
    for name, result in torch.library.opcheck(function._flash_attn_bwd, args).items():
        assert result == "SUCCESS", name


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 80], ids=["tl-d64", "gluon-d80"])
def test_gpu_replay_through_the_compiled_kernels(full_calls, d):
    """On the GPU a replay calls each CompiledKernel's launcher directly (the one-pass backward's
    float32 dQ scratch allocated again, zeroed and cast by planned kernels). The kernels are
    deterministic except the one-pass dQ (TMA reductions in a varying order: equal to rounding),
    so the replay reproduces the full path bit for bit elsewhere."""
    q, k, v, do = (t.to("cuda", torch.bfloat16) for t in _inputs((2, 4, 1000, d)))
    first = _fwd_bwd(q, k, v, do, True)
    again = _fwd_bwd(*(t.clone() for t in (q, k, v, do)), True)
    assert full_calls == {"fwd": 1, "bwd": 1}
    for name, a, b in zip(("o", "lse", "dq", "dk", "dv"), first, again, strict=True):
        if name == "dq":
            torch.testing.assert_close(a, b, atol=1e-2, rtol=1e-2)
        else:
            assert torch.equal(a, b), name


def test_scratch_tensors_are_allocated_zeroed_and_cast_again_on_replay():
    """A launcher's scratch (`plans.empty`) gets a new tensor in its role on every replay; the zero
    and cast kernels of the one-pass backwards' dQ buffer run as planned launches (the cast keeps
    the first d of the buffer's wider rows)."""
    from cs336_systems.attention.flash_triton import buffer_kernels

    dst = torch.full((2, 3, 5, 24), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    cache = plans.PlanCache()
    with plans.recording() as rec:
        plans.role("dst", dst)
        acc = buffer_kernels.zeroed_float32("acc", (2 * 3, 5, 32), dst.device)
        buffer_kernels.cast_rows_into(dst, acc)
    cache.keep("k", rec, dst.device)
    assert torch.equal(dst, torch.zeros_like(dst))
    plan = cache.get("k")
    assert plan is not None and [name for name, *_ in plan.scratch] == ["acc"]
    other = torch.full_like(dst, float("nan"))  # the same signature, new storage
    plan.run({"dst": other})
    assert torch.equal(other, torch.zeros_like(other))
    src = torch.randn(2 * 3, 5, 32, device=DEVICE)  # wider rows: the cast keeps their first 24
    buffer_kernels.cast_rows_into(other, src)
    # to bf16 within one unit in the last place (the interpreter's cast truncates, CUDA's rounds)
    torch.testing.assert_close(other.float(), src.view(2, 3, 5, 32)[..., :24], rtol=2**-7, atol=0)


def test_host_descriptors_are_made_again_from_the_tensor_in_their_role_on_replay():
    """A host TMA descriptor (`plans.tma_descriptor`) is recorded as its tensor's role and view; a
    replay makes it again at the new tensor's address, with the recorded shape and strides: the light
    stand-in Triton's launcher reads, or Gluon's checked TensorDescriptor on the JIT's path."""
    pytest.importorskip("triton.experimental.gluon.nvidia.hopper")
    from triton.experimental.gluon import language as gl

    seen = []
    kernel = type("Kernel", (), {"__name__": "kernel", "arg_names": ["k0", "k1", "dq"], "params": []})()
    t = torch.zeros(2, 16, 3, 80, dtype=torch.bfloat16).transpose(1, 2)  # (B, N, H, d) as (B, H, N, d)
    acc = torch.zeros(6, 64, 32)
    split = kernel_calls.TmaView(
        64, 16, (1, 1, 8, 16), gl.NVMMASharedLayout.get_default_for([1, 1, 8, 16], gl.bfloat16)
    )
    rows = kernel_calls.TmaView(
        0, 32, (1, 8, 4, 2, 32), gl.NVMMASharedLayout(128, 32, rank=5), rows_interleaved=True
    )
    with plans.recording() as rec:
        plans.role("k", t)
        plans.role("dq_acc", acc)
        descs = (plans.tma_descriptor(t, split), plans.tma_descriptor(acc, rows))
        rec.note(kernel, (1,), descs, {}, None)
    assert not rec.failed
    assert descs[0].base.data_ptr() == t.data_ptr() + 64 * 2 and list(descs[0].shape) == [2, 3, 16, 16]
    assert list(descs[0].strides) == list(t.stride())
    assert list(descs[1].shape) == [6, 8, 4, 2, 32] and list(descs[1].strides) == [
        64 * 32,
        8 * 32,
        32,
        4 * 32,
        1,
    ]
    described = rec.launches[0].args
    new_t, new_acc = torch.zeros_like(t), torch.zeros_like(acc)
    for checked in (False, True):
        light = [a.make({"k": new_t, "dq_acc": new_acc}, checked) for a in described]
        seen.append(light)
        assert light[0].base.data_ptr() == new_t.data_ptr() + 64 * 2
        assert light[1].base.data_ptr() == new_acc.data_ptr()
        assert [list(x.shape) for x in light] == [list(d.shape) for d in descs]
        assert [list(x.strides) for x in light] == [list(d.strides) for d in descs]
    assert type(seen[1][0]).__name__ == "TensorDescriptor" != type(seen[0][0]).__name__
    # a descriptor of a tensor with no role cannot be replayed: the recording fails
    with plans.recording() as rec:
        rec.note(kernel, (1,), (plans.tma_descriptor(t, split),), {}, None)
    assert "no role" in rec.failed


def test_replayed_descriptors_are_encoded_once_per_address_and_passed_flattened():
    """A `kernel_calls.Call` with an `Encoded` launcher calls Triton's launcher below its descriptor
    wrapper: each descriptor argument encoded (by the encoder it is given: Triton's
    `make_tensordesc_arg`) once per argument and address, and passed flattened in place, tensors by
    role as their addresses, other arguments as recorded."""
    calls, encoded = [], []

    def encode(desc, meta):
        encoded.append((desc.base.data_ptr(), meta))
        return [f"map@{desc.base.data_ptr()}", *desc.shape, *desc.strides]

    run = type("Run", (), {"launch_cooperative_grid": False, "launch_pdl": False})()
    kernel = type("Compiled", (), {"function": "fn", "packed_metadata": "pm"})()
    view = kernel_calls.TmaView(64, 16, (1, 1, 8, 16), None)
    described = kernel_calls.Described("k", view, 128, [2, 3, 16, 16], [3840, 80, 1280, 1])
    call = kernel_calls.Call(kernel, (3, 1, 1), (described, kernel_calls.Role("lse"), 7, described, None))
    call.encoded = kernel_calls.Encoded(lambda *args: calls.append(args), ["meta0", "meta1"], encode, run)
    a, b, lse = torch.zeros(4), torch.zeros(4), torch.zeros(2)
    for t in (a, a, b):
        tensors = {"k": t, "lse": lse}
        call("stream", call.arguments(tensors))
    assert encoded == [
        (a.data_ptr() + 128, "meta0"), (a.data_ptr() + 128, "meta1"),
        (b.data_ptr() + 128, "meta0"), (b.data_ptr() + 128, "meta1"),
    ]  # fmt: skip
    head = (3, 1, 1, "stream", "fn", False, False, None, None, "pm", None, None, None)
    flat = [f"map@{a.data_ptr() + 128}", 2, 3, 16, 16, 3840, 80, 1280, 1]
    assert calls[1] == (*head, *flat, lse.data_ptr(), 7, *flat, None)  # pointers as addresses


def test_a_replay_builds_its_arguments_once_per_set_of_addresses(monkeypatch):
    """Below Triton's JIT a replay keeps each launch's arguments by the addresses of the tensors in
    its roles ([Note: a replay's arguments by address]): the same addresses again are launched from
    the kept arguments, a new address builds them anew; pointers go to the launcher as addresses,
    parameters left to their defaults as recorded."""
    runs, builds = [], []

    class Compiled:
        function, packed_metadata = "fn", "pm"
        metadata = type("Metadata", (), {"global_scratch_size": 0})()

        def run(self, *args):
            runs.append(args)

    default = type("Param", (), {"default": True})()
    kernel = type(
        "Kernel", (), {"arg_names": ["a", "b", "n", "flag"], "params": [None, None, None, default]}
    )()
    plan = plans.Plan(
        [plans._Launch(kernel, (4, 2), (kernel_calls.Role("a"), kernel_calls.Role("b"), 7), {}, Compiled())]
    )
    monkeypatch.setattr(kernel_calls, "current_stream", lambda: "stream")
    original = kernel_calls.Call.arguments
    monkeypatch.setattr(kernel_calls.Call, "arguments", lambda self, t: builds.append(1) or original(self, t))
    a, b, c = torch.zeros(4), torch.zeros(4), torch.zeros(4)
    for x in (a, a, c, a):
        plan.run({"a": x, "b": b})
    head = (4, 2, 1, "stream", "fn", "pm", None, None, None)
    assert runs == [(*head, x.data_ptr(), b.data_ptr(), 7, True) for x in (a, a, c, a)]
    assert all(type(r[9]) is kernel_calls.Address for r in runs)  # an int: the launcher takes it as is
    assert len(builds) == 2  # a, then c; the third a is the first's
    monkeypatch.setattr(plans, "MAX_ARGUMENT_SETS", 2)  # full: the kept sets are cleared, then refilled
    plan.run({"a": b, "b": b})
    assert len(builds) == 3 and len(plan._arguments) == 1


def make_tensordesc_arg(desc, meta):
    """The encoder `kernel_calls.Encoded.of` finds beside a launcher's class (Triton's own there)."""
    return [f"map@{desc.base.data_ptr()}/{meta}", *desc.shape, *desc.strides]


class _FakeRun:
    """A compiled kernel's `run` shaped like Triton 3.6's CudaLauncher: `launch` is the descriptor
    wrapper, a closure over the raw `launcher` and the descriptors' `tensordesc_meta`."""

    global_scratch_size = profile_scratch_size = 0
    launch_cooperative_grid = launch_pdl = False

    def __init__(self, calls: list) -> None:
        tensordesc_meta = ["meta0"]

        def launcher(*args):
            calls.append(args)

        def launch(*args):  # never called by a replay: it would encode every descriptor again
            raise AssertionError((launcher, tensordesc_meta))

        self.launch = launch


def test_a_replay_with_descriptors_launches_below_the_wrapper_end_to_end(monkeypatch):
    """The GPU's replay path on the CPU, a compiled kernel faked like Triton's: `Plan.run` finds the
    raw launcher below the descriptor wrapper (`Encoded.of`), passes the descriptor encoded once per
    address and flattened, the other tensor as its address, and keeps the arguments per address set."""
    calls, encoded, original = [], [], make_tensordesc_arg

    def encode(desc, meta):
        encoded.append(desc.base.data_ptr())
        return original(desc, meta)

    monkeypatch.setattr(sys.modules[__name__], "make_tensordesc_arg", encode)
    compiled = type(
        "Compiled",
        (),
        {"function": "fn", "packed_metadata": "pm", "run": _FakeRun(calls),
         "metadata": type("Metadata", (), {"global_scratch_size": 0})()},
    )()  # fmt: skip
    kernel = type("Kernel", (), {"arg_names": ["q_desc", "lse", "n"], "params": []})()
    view = kernel_calls.TmaView(16, 16, (1, 1, 8, 16), None)
    described = kernel_calls.Described("q", view, 32, [2, 3, 16, 16], [3840, 80, 1280, 1])
    plan = plans.Plan([plans._Launch(kernel, (5,), (described, kernel_calls.Role("lse"), 9), {}, compiled)])
    monkeypatch.setattr(kernel_calls, "current_stream", lambda: "stream")
    q, q2, lse = torch.zeros(8), torch.zeros(8), torch.zeros(2)
    for t in (q, q, q2, q):
        plan.run({"q": t, "lse": lse})
    head = (5, 1, 1, "stream", "fn", False, False, None, None, "pm", None, None, None)
    flat = lambda t: [f"map@{t.data_ptr() + 32}/meta0", 2, 3, 16, 16, 3840, 80, 1280, 1]
    assert calls == [(*head, *flat(t), lse.data_ptr(), 9) for t in (q, q, q2, q)]
    assert encoded == [q.data_ptr() + 32, q2.data_ptr() + 32]  # once per address
    compiled.run.kernel_signature = "Triton 3.7's convention"  # not known here: the checked path
    assert kernel_calls.Encoded.of(compiled) is None


def test_replayed_descriptors_of_a_deep_models_step_stay_encoded_from_step_to_step():
    """A step passes each argument one address per layer and the same addresses the next step: with
    a few hundred layers' addresses the second step encodes nothing again."""
    encoded = []

    def encode(desc, meta):
        encoded.append(desc.base.data_ptr())
        return [desc.base.data_ptr()]

    run = type("Run", (), {"launch_cooperative_grid": False, "launch_pdl": False})()
    kernel = type("Compiled", (), {"function": "fn", "packed_metadata": "pm"})()
    described = kernel_calls.Described(
        "q", kernel_calls.TmaView(0, 16, (1, 1, 8, 16), None), 0, [1, 1, 8, 16], [128, 128, 16, 1]
    )
    call = kernel_calls.Call(kernel, (1, 1, 1), (described,))
    call.encoded = kernel_calls.Encoded(lambda *args: None, ["meta"], encode, run)
    layers = [torch.zeros(4) for _ in range(300)]
    for _ in range(2):
        for t in layers:
            call("stream", call.arguments({"q": t}))
    assert encoded == [t.data_ptr() for t in layers]


class _Attention(torch.nn.Module):
    def forward(self, q, k, v):
        return FlashAttentionTriton.apply(q, k, v, True)


def _reference_grads(q, k, v, do):
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    o = torch.nn.functional.scaled_dot_product_attention(q64, k64, v64, is_causal=True)
    o.backward(do.double())
    return o, q64.grad, k64.grad, v64.grad


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 80, 128], ids=["d64", "d80", "d128"])
def test_gpu_forward_and_backward_replay_inside_a_cuda_graph(d):
    """`torch.cuda.make_graphed_callables` captures our forward and backward (every launch, the
    one-pass backward's float32 dQ scratch from the graph's pool); replays on new values written into
    the static inputs match the float64 reference (each replay's outputs poisoned first)."""
    g = torch.Generator(device="cuda").manual_seed(d)
    shape = (2, 4, 512, d)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
               for _ in range(3))  # fmt: skip
    graphed = torch.cuda.make_graphed_callables(_Attention(), (q, k, v))
    for _ in range(2):  # new inputs: the graphed callable copies them into the captured ones
        qn, kn, vn = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
                      for _ in range(3))  # fmt: skip
        do = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g)
        o = graphed(qn, kn, vn)
        o.backward(do)
        torch.cuda.synchronize()
        want_o, want_dq, want_dk, want_dv = _reference_grads(qn, kn, vn, do)
        torch.testing.assert_close(o.double(), want_o, atol=2e-2, rtol=2e-2)
        for got, want in ((qn.grad, want_dq), (kn.grad, want_dk), (vn.grad, want_dv)):
            assert torch.isfinite(got).all()
            torch.testing.assert_close(got.double(), want, atol=5e-2, rtol=5e-2)


@pytest.mark.gpu
def test_gpu_the_compiled_step_runs_as_cuda_graphs_under_reduce_overhead():
    """`torch.compile(mode="reduce-overhead")` (Inductor's CUDA graph trees) captures the compiled
    forward and backward with our operators inside: no cudagraph skip is counted, and the replayed
    step's gradients match the float64 reference on new inputs."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    step = torch.compile(lambda q, k, v: FlashAttentionTriton.apply(q, k, v, True), mode="reduce-overhead")
    g = torch.Generator(device="cuda").manual_seed(0)
    shape = (1, 8, 512, 80)
    for _ in range(4):  # warm-up, record, then replays
        q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
                   for _ in range(3))  # fmt: skip
        do = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g)
        step(q, k, v).backward(do)
    torch.cuda.synchronize()
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])
    _, want_dq, want_dk, want_dv = _reference_grads(q, k, v, do)
    for got, want in ((q.grad, want_dq), (k.grad, want_dk), (v.grad, want_dv)):
        torch.testing.assert_close(got.double(), want, atol=5e-2, rtol=5e-2)
