"""The VLA decoder stack on mmfuse (mmfuse.nn.vla) against the PyTorch reference of `mmfuse-bench train`
with the same weights: the same outputs and gradients in fp32 on the CPU (and in bf16 on the GPU, to
bf16 tolerance); the benchmark's CPU agreement check."""

import pytest
import torch

from mmfuse.bench import train
from mmfuse.bench.vla_reference import VLAReference, init_weights, make_batch, preset, type_indices
from mmfuse.nn.vla import MoTExperts, VLADecoder

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("action", [0, 5, 13])
def test_matches_the_reference(device, action):
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    cfg = preset("tiny")
    batch = make_batch(cfg, 3, 40, action, device, dtype, seed=action)
    ref = VLAReference(cfg)
    init_weights(ref, seed=1)
    ref = ref.to(device, dtype)
    ours = VLADecoder(cfg, device=device, dtype=dtype)
    ours.load_reference(ref.state_dict())
    idx_vl, idx_act = type_indices(batch)
    want = ref(batch.embeds, batch.positions, idx_vl, idx_act)
    got = ours(batch.embeds, batch.positions, action)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=5e-2, atol=5e-2)
    torch.testing.assert_close(got, want, **tol)
    g = torch.randn(want.shape, generator=torch.Generator().manual_seed(2)).to(device, dtype)
    (want * g).float().sum().backward()
    (got * g).float().sum().backward()
    ref_grads = dict(ref.named_parameters())
    for name, grad in ours.reference_grads().items():
        r = ref_grads[name].grad
        err = float((grad.double() - r.double()).norm() / r.double().norm().clamp_min(1e-30))
        assert err <= (1e-5 if dtype == torch.float32 else 5e-2), (name, err)


@pytest.mark.parametrize("fp8", [False, True])
def test_compiled_model_matches_eager(fp8):
    # the in-place pieces (mRoPE on the q/k/v output, the expert backward) and the fp8 expert (its
    # packed gate/up output) under torch.compile
    cfg = preset("tiny")
    dtype = torch.bfloat16 if fp8 else torch.float32
    batch = make_batch(cfg, 2, 40, 5, "cpu", dtype, seed=4)
    ours = VLADecoder(cfg, fp8=fp8, fp8_scaling="dynamic", device="cpu", dtype=dtype)
    for p in ours.parameters():
        torch.nn.init.normal_(p, std=0.2)
    grads = []
    for fn in (ours, torch.compile(ours)):
        for p in ours.parameters():
            p.grad = None
        out = fn(batch.embeds, batch.positions, 5)
        out.float().square().sum().backward()
        grads.append([out.detach()] + [p.grad.clone() for p in ours.parameters()])
    for want, got in zip(*grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fp8", [False, True])
def test_backward_graph_has_no_whole_tensor_copies(fp8):
    # mRoPE in place on a view would make autograd copy the q/k/v gradient three times (CopySlices) and
    # replay later views with as_strided (AsStridedBackward0): the rotation runs on the GEMM's own output
    # (with fp8, Fp8Linear's output must not be a view either); the experts' two row blocks come from one
    # split (slices would each have a zero-filled full-size gradient)
    cfg = preset("tiny", layers=2)
    dtype = torch.bfloat16 if fp8 else torch.float32
    batch = make_batch(cfg, 2, 24, 5, "cpu", dtype, seed=6)
    ours = VLADecoder(cfg, fp8=fp8, device="cpu", dtype=dtype)
    out = ours(batch.embeds, batch.positions, 5)
    names, todo, seen = set(), [out.grad_fn], set()
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        names.add(type(fn).__name__)
        todo.extend(f for f, _ in fn.next_functions)
    assert "_RotateQKFnBackward" in names, sorted(names)
    assert not names & {"CopySlices", "AsStridedBackward0", "SliceBackward0"}, sorted(names)


def test_compiled_backward_graph_has_no_whole_tensor_copies():
    # traced, the q/k gradient is rotated in place in the graph's own buffer: the out-of-place form put
    # a slice_scatter (a whole-tensor copy) a layer into the backward graph; the last norm's unused
    # residual output gets no zero-filled gradient
    from torch._dynamo.backends.common import aot_autograd

    backward = []

    def keep(gm, _):
        return gm.forward

    def keep_backward(gm, _):
        backward.append(gm)
        return gm.forward

    torch._dynamo.reset()  # no shapes marked dynamic by an earlier test's compile
    cfg = preset("tiny", layers=2)
    batch = make_batch(cfg, 2, 24, 5, "cpu", torch.float32, seed=6)
    ours = VLADecoder(cfg, device="cpu", dtype=torch.float32)
    fn = torch.compile(ours, backend=aot_autograd(fw_compiler=keep, bw_compiler=keep_backward))
    fn(batch.embeds, batch.positions, 5).square().sum().backward()
    assert backward
    targets = [str(n.target) for gm in backward for n in gm.graph.nodes if n.op == "call_function"]
    assert not [t for t in targets if "slice_scatter" in t or "zeros" in t or "full" in t], targets
    assert any("mrope_" in t or "auto_functionalized" in t for t in targets), targets


def test_experts_backward_in_place_refuses_a_second_backward():
    # the backward turns the saved gate/up output into its gradient: a retained graph cannot run twice
    torch.manual_seed(0)
    e = MoTExperts(8, (16, 4))
    for p in e.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(6, 8, requires_grad=True)
    y = e(x, 4)
    y.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_fp8_expert_refuses_a_second_backward():
    # the fp8 expert lets go of its largest saved tensors during the backward: a retained graph cannot
    # run twice, and says why
    torch.manual_seed(0)
    e = MoTExperts(32, (48, 16), fp8=True, dtype=torch.bfloat16)
    for p in e.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x = torch.randn(20, 32, dtype=torch.bfloat16, requires_grad=True)
    y = e(x, 20)
    y.float().sum().backward(retain_graph=True)
    if not hasattr(torch._C._autograd, "_top_saved_tensors_default_hooks"):
        # a torch that cannot tell whether saved-tensor hooks are active: everything is saved as usual
        first = x.grad.clone()
        x.grad = None
        y.float().sum().backward()
        assert torch.equal(x.grad, first)
        return
    with pytest.raises(RuntimeError, match="second backward through the same graph"):
        y.float().sum().backward()


def test_fp8_expert_under_checkpointing_matches_plain():
    # under activation checkpointing (saved-tensor hooks) the fp8 expert saves everything through
    # save_for_backward, so the checkpoint drops and recomputes it: the gradients of the plain run
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(1)
    e = MoTExperts(32, (48, 16), fp8=True, scaling="dynamic", dtype=torch.bfloat16)
    for p in e.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x = torch.randn(20, 32, dtype=torch.bfloat16)
    grads = []
    for ck in (False, True):
        xi = x.clone().requires_grad_()
        e.zero_grad()
        y = checkpoint(e, xi, 20, use_reentrant=False) if ck else e(xi, 20)
        node = next(f for f, _ in y.grad_fn.next_functions if type(f).__name__ == "_Fp8ExpertFnBackward")
        if hasattr(torch._C._autograd, "_top_saved_tensors_default_hooks"):  # else it always saves everything
            assert node.saved_all == ck
        y.float().square().sum().backward()
        grads.append([xi.grad] + [p.grad.clone() for p in e.parameters() if p.grad is not None])
    for a, b in zip(*grads):
        assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("split", [True, False])
def test_fp8_expert_equals_the_fp8_linear_composition(device, split, monkeypatch):
    """An fp8 expert (_Fp8ExpertFn: the activation quantized from the gate/up output, that output saved
    packed in fp8, the weights' transposed copies made again in the backward, the gate/up gradient's
    copies made one at a time (split) or together) gives the bits of fp8_linear -> swiglu (its backward
    from the packed input) -> fp8_linear with the same delayed states: outputs, input and weight
    gradients and every state, over three steps (the delayed scales then in use)."""
    from mmfuse import fp8
    from mmfuse.nn.fp8_experts import _Fp8ExpertFn

    monkeypatch.setattr(_Fp8ExpertFn, "split_grad_copies", split)
    from mmfuse.swiglu import swiglu, swiglu_backward_fp8, swiglu_pack_fp8

    class PackedSwiglu(torch.autograd.Function):
        @staticmethod
        def forward(ctx, gu_out):
            ctx.save_for_backward(*swiglu_pack_fp8(gu_out))
            return swiglu(gu_out)

        @staticmethod
        def backward(ctx, da):
            return swiglu_backward_fp8(da, *ctx.saved_tensors, recompute=False)[0]

    M, H, inter = (37, 48, 80) if device == "cpu" else (4099, 2048, 5504)  # GPU: where fp8 pays, odd rows
    g = torch.Generator().manual_seed(5)
    e = MoTExperts(H, (inter, 16), fp8=True, device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        for p in e.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * H ** -0.5)
    gu, dn = e.gate_up0.detach().clone().requires_grad_(), e.down0.detach().clone().requires_grad_()
    states = {k: fp8.new_state(v.numel() - 2, device) for k, v in e.named_buffers()
              if k.endswith("_state") and "0_" in k}  # expert 0's (every row goes there)
    for step in range(3):
        x = torch.randn(M, H, generator=g).to(device, torch.bfloat16).requires_grad_()
        x2 = x.detach().clone().requires_grad_()
        dy = torch.randn(M, H, generator=g).to(device, torch.bfloat16)
        e.zero_grad()
        y = e(x, M)  # every row expert 0's
        y.backward(dy)
        gu.grad = dn.grad = None
        kw = dict(scaling="delayed")
        a = PackedSwiglu.apply(fp8.fp8_linear(x2, gu, x_state=states["gate_up0_x_state"],
                                              w_state=states["gate_up0_w_state"], g_state=states["gate_up0_g_state"],
                                              **kw))
        want = fp8.fp8_linear(a, dn, x_state=states["down0_x_state"], w_state=states["down0_w_state"],
                              g_state=states["down0_g_state"], **kw)
        want.backward(dy)
        assert torch.equal(y, want), step
        assert torch.equal(x.grad, x2.grad), step
        assert torch.equal(e.gate_up0.grad, gu.grad) and torch.equal(e.down0.grad, dn.grad), step
        for k, v in states.items():
            assert torch.equal(getattr(e, k), v), (step, k)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("wants", [(True, False), (False, True), (True, True)])
def test_fp8_expert_split_copies_with_some_gradients_unwanted(device, wants, monkeypatch):
    # the split gate/up gradient (row-major cast, then its transpose) where only the input's or only the
    # gate/up weight's gradient is wanted: the same bits as the one-pass mode
    from mmfuse.nn.fp8_experts import _Fp8ExpertFn

    want_x, want_gu = wants
    M, H, inter = (29, 32, 48) if device == "cpu" else (3001, 2048, 5504)
    grads = []
    for split in (True, False):
        monkeypatch.setattr(_Fp8ExpertFn, "split_grad_copies", split)
        g = torch.Generator().manual_seed(9)
        e = MoTExperts(H, (inter, 16), fp8=True, device=device, dtype=torch.bfloat16)
        with torch.no_grad():
            for p in e.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * H ** -0.5)
        e.gate_up0.requires_grad_(want_gu)
        x = torch.randn(M, H, generator=g).to(device, torch.bfloat16).requires_grad_(want_x)
        e(x, M).backward(torch.randn(M, H, generator=g).to(device, torch.bfloat16))
        grads.append((x.grad, e.gate_up0.grad, e.down0.grad))
    for a, b in zip(*grads):
        assert (a is None and b is None) or torch.equal(a, b)
    assert (grads[0][0] is not None) == want_x and (grads[0][1] is not None) == want_gu


def test_mixed_experts_do_not_keep_the_whole_input_alive():
    # the fp8 expert saves fp8 copies of its rows; the bf16 one must not save a view of the whole input
    torch.manual_seed(0)
    e = MoTExperts(32, (48, 16), fp8=True)
    for p in e.parameters():
        torch.nn.init.normal_(p, std=0.2)
    e._uses_fp8 = lambda x, rows, i: i == 0  # expert 0 in fp8, expert 1 bf16, as on the GPU at VLA shapes
    x = torch.randn(40, 32, requires_grad=True)
    h = x * 1.0
    storages = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: storages.append(t.untyped_storage().data_ptr()) or t,
                                                  lambda t: t):
        y = e(h, 30)
    assert h.untyped_storage().data_ptr() not in storages
    y.square().sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_fp8_scaling_dynamic_and_bad_values():
    cfg = preset("tiny")
    batch = make_batch(cfg, 2, 24, 4, "cpu", torch.bfloat16, seed=2)
    ref = VLAReference(cfg)
    init_weights(ref, seed=1)
    m = VLADecoder(cfg, fp8=True, fp8_scaling="dynamic", dtype=torch.bfloat16)
    m.load_reference(ref.to(torch.bfloat16).state_dict())
    assert all(layer.experts.scaling == "dynamic" and layer.qkv.scaling == "dynamic" for layer in m.layers)
    assert not [s for mod in m.modules() if hasattr(mod, "fp8_delayed_states") for s in mod.fp8_delayed_states()]
    m(batch.embeds, batch.positions, batch.action).float().square().mean().backward()
    assert all(torch.isfinite(g).all() for g in m.reference_grads().values())
    with pytest.raises(ValueError, match="MoTExperts: scaling: expected 'dynamic' or 'delayed', got 'current'"):
        MoTExperts(8, (16, 4), fp8=True, scaling="current")


def test_experts_reject_a_bad_split():
    e = MoTExperts(8, (16, 4))
    with pytest.raises(ValueError, match=r"0 <= m0 <= T, got \(5, 8\) and m0 = 6"):
        e(torch.randn(5, 8), 6)


def test_train_benchmark_agrees_on_the_cpu():
    res = train.run("cpu")
    assert res["all_verified"]
    rows = {r["variant"]: r for r in res["rows"]}
    assert rows["mmfuse eager"]["grad_err"] < 1e-5
    assert rows["mmfuse eager"]["loss_rel"] < 1e-5
    assert rows["mmfuse eager"]["loss_last"] < rows["mmfuse eager"]["loss_first"]  # it trains


def test_fsdp2_two_gloo_ranks_match_one_process():
    """FSDP2 with activation checkpointing over two gloo ranks on the CPU: the sharded gradients equal
    the single-process gradients of the whole batch (mmfuse-bench train --nproc 2)."""
    import torch.distributed as dist

    from mmfuse.bench import train_dist

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    if not hasattr(torch.cpu.Stream, "record_event"):
        pytest.skip("this torch's FSDP2 does not run on the CPU (no CPU stream events)")
    res = train_dist.run("cpu", 2)
    assert res["all_verified"] and res["rows"][0]["grad_err"] < 1e-5


@pytest.mark.parametrize("grad_dtype", [torch.float8_e5m2, torch.float8_e4m3fn])
def test_fp8_model_tracks_the_reference_on_the_cpu(grad_dtype):
    """fp8 projections and experts (emulated on the CPU) against the bf16 reference: close, not equal;
    the gradient format reaches every fp8 GEMM."""
    cfg = preset("tiny")
    batch = make_batch(cfg, 2, 32, 8, "cpu", torch.bfloat16, seed=3)
    ref = VLAReference(cfg)
    init_weights(ref, seed=1)
    ref = ref.to(torch.bfloat16)
    ours = VLADecoder(cfg, fp8=True, fp8_grad_dtype=grad_dtype, dtype=torch.bfloat16)
    ours.load_reference(ref.state_dict())
    assert all(layer.experts.grad_dtype == grad_dtype and layer.qkv.grad_dtype == grad_dtype for layer in ours.layers)
    idx_vl, idx_act = type_indices(batch)
    want = ref(batch.embeds, batch.positions, idx_vl, idx_act).float()
    got = ours(batch.embeds, batch.positions, batch.action).float()
    rel = float((got - want).detach().norm() / want.norm())
    assert 1e-4 < rel < 0.1, rel  # fp8 rounding shows, and stays small
    got.square().mean().backward()
    assert all(g is not None and torch.isfinite(g).all() for g in ours.reference_grads().values())
    assert len([s for m in ours.modules() if hasattr(m, "fp8_delayed_states") for s in m.fp8_delayed_states()]) > 0


@pytest.mark.parametrize("fp8", [False, True])
def test_cast_keeps_the_fp32_buffers(fp8):
    # model.to(torch.bfloat16) (or .half(), .double()), as users cast a model: the rotary inv_freq and the
    # fp8 scaling states stay float32 (the ops read them in fp32 only); the cast model equals one built in bf16
    cfg = preset("tiny")
    data = make_batch(cfg, 2, 48, 12, "cpu", torch.bfloat16, seed=0)
    built = VLADecoder(cfg, fp8=fp8, dtype=torch.bfloat16)
    init_weights(built)
    cast = VLADecoder(cfg, fp8=fp8).to(torch.bfloat16)
    cast.load_state_dict(built.state_dict())
    for m in (cast, cast.half().bfloat16(), VLADecoder(cfg, fp8=fp8).double()):
        kept = {n: b.dtype for n, b in m.named_buffers() if n.endswith(("inv_freq", "_state"))}
        assert kept and set(kept.values()) == {torch.float32}, kept
    assert torch.equal(cast(data.embeds, data.positions, data.action),
                       built(data.embeds, data.positions, data.action))


def test_fp8_linear_cast_keeps_its_states():
    from mmfuse.nn import Fp8Linear

    lin = Fp8Linear(32, 48).to(torch.bfloat16)
    assert lin.weight.dtype == torch.bfloat16
    assert {b.dtype for b in lin.buffers()} == {torch.float32}
    assert lin(torch.randn(16, 32).bfloat16()).dtype == torch.bfloat16
