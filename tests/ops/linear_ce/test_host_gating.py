"""Tuning.host_gating: the sparse backward leaves out the launches its device decisions turn off
once those decisions have reached the host (cce/ops/linear_ce/host_peek.py). Under the
interpreter the decisions are host tensors, so the gated-off launches are always left out here;
host_gating=False issues every one of them. The gradients must be the same bit for bit."""

from __future__ import annotations

import pytest
import torch

import cce.ops.linear_ce.kernels.backward_sparse as KS
import cce.ops.linear_ce.triton_backward as TB
from bench.data import zipf_inputs
from cce import CCEOptions, Tuning, linear_cross_entropy_with_options
from cce.ops.linear_ce.host_peek import HostPeek
from tests.helpers import near_uniform_inputs


def _run(e, c, t, tuning, eps: float, need: str = "both", bias=None, entropy: float = 0.0, **opts):
    """(loss, dE, dC) of impl="triton" under a random upstream gradient; ``need``: which
    gradients autograd asks for ("both", "de", "dc"; None for the other); ``entropy``: the
    objective is loss - entropy * mean(entropy output) where nonzero."""
    ee, cc = e.clone().requires_grad_(need != "dc"), c.clone().requires_grad_(need != "de")
    o = CCEOptions(impl="triton", filter_eps=eps, tuning=tuning, return_entropy=entropy != 0, **opts)
    out = linear_cross_entropy_with_options(ee, cc, t, bias, None, o)
    loss = out.loss - entropy * out.entropy.mean() if entropy else out
    up = torch.rand(loss.shape, generator=torch.Generator().manual_seed(1))
    (loss * up).sum().backward()
    return loss.detach(), ee.grad, cc.grad


@pytest.fixture
def slab_calls(monkeypatch):
    """The ``slabs`` argument of every DenseSlabRun made (None: all of them, gated), with the
    device's dense flags it was given, and the calls of add_dc_first_order / first_order_terms."""
    seen = {"calls": [], "dc_fo": 0, "fo_terms": 0}
    run, add, terms = KS.DenseSlabRun, KS.add_dc_first_order, TB.first_order_terms

    def spy_run(*a, **k):
        seen["calls"].append((k.get("slabs"), a[9].clone()))  # (slabs, the device's dense flags)
        return run(*a, **k)

    def spy_add(*a, **k):
        seen["dc_fo"] += 1
        return add(*a, **k)

    def spy_terms(*a, **k):
        seen["fo_terms"] += 1
        return terms(*a, **k)

    monkeypatch.setattr(KS, "DenseSlabRun", spy_run)
    monkeypatch.setattr(KS, "add_dc_first_order", spy_add)
    monkeypatch.setattr(TB, "first_order_terms", spy_terms)
    return seen


CASES = {
    # no slab dense (the rule's targets met) and the first-order flag 0 (their operands built
    # without host gating)
    "none": dict(kind="zipf", rule=dict(dense_kept=2.0, slab_error=0.5, slab_error_dc=0.5)),
    # the head of the sorted vocabulary dense by the kept share
    "front": dict(kind="zipf", rule=dict(dense_kept=0.5)),
    # near-uniform softmaxes: slabs here and there dense by the error rule
    "scattered": dict(kind="uniform", rule=dict(slab_error=0.03, slab_error_dc=0.03, first_order=False)),
    # the same with the first-order terms a choice of the rule
    "first-order": dict(kind="uniform", rule=dict(slab_error=0.03, slab_error_dc=0.03)),
    # every slab dense
    "all": dict(kind="zipf", rule=dict(dense_kept=0.0)),
}


def _inputs(kind):
    if kind == "zipf":
        return zipf_inputs(96, 32, 1500, dtype=torch.float32, seed=3), 2e-3
    # V = 200: 7 tiles in 4 slabs of 2 (the last tile and slab partial); the error rule makes the
    # first two dense (as the first two of 5 at V = 300), with N = 64 > ERROR_ROWS sampled rows
    return near_uniform_inputs(64, 32, 200, std=0.3, seed=2), 2e-2


@pytest.mark.parametrize(
    "name,need",
    [(n, "both") for n in sorted(CASES)] + [("scattered", "de"), ("scattered", "dc"), ("first-order", "dc")],
)
def test_same_gradients_bit_for_bit(name, need, slab_calls):
    """host_gating on and off: the same loss, dE and dC to the bit (ignored rows, a partial last
    token block and slab), whether the device made no slab dense, some or all; with host_gating
    the launches issued are the dense slabs' alone, as the device chose them."""
    case = CASES[name]
    (e, c, t), eps = _inputs(case["kind"])
    outs = {}
    for gate in (False, True):
        tu = Tuning(
            backward="sparse", dense_slabs=True, dense_slab_bytes=e.shape[0] * 4 * 64, host_gating=gate,
            **case["rule"],
        )  # fmt: skip
        outs[gate] = _run(e, c, t, tu, eps, need)
    for a, b in zip(outs[False], outs[True], strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            assert torch.equal(a, b)
    calls = slab_calls["calls"]
    assert calls[0][0] is None  # host_gating=False: every slab's launches, gated
    for slabs, dense in calls[1:]:
        assert slabs == [s for s, d in enumerate(dense.tolist()) if d] and slabs
    if name == "none":
        assert len(calls) == 1


@pytest.mark.parametrize(
    "opts",
    [
        dict(bias=True, label_smoothing=0.1, z_loss=1e-3),
        dict(softcap=5.0),
        dict(entropy=0.5),
    ],
    ids=["bias-smoothing-zloss", "softcap", "entropy"],
)
def test_same_gradients_bit_for_bit_with_options(opts, slab_calls):
    """The same with the options whose terms the dense slabs and the dE writer carry: a (frozen)
    bias, label smoothing and z-loss; softcap; a gradient through the entropy output."""
    e, c, t = near_uniform_inputs(64, 32, 1200, std=0.3, seed=4)
    kw = dict(opts)
    if kw.pop("bias", False):
        kw["bias"] = torch.randn(1200, generator=torch.Generator().manual_seed(2)) * 0.3
    outs = []
    for gate in (False, True):
        tu = Tuning(
            backward="sparse", dense_slabs=True, dense_slab_bytes=64 * 4 * 64, slab_error=0.03,
            slab_error_dc=0.03, host_gating=gate,
        )  # fmt: skip
        outs.append(_run(e, c, t, tu, 2e-2, **kw))
    for a, b in zip(*outs, strict=True):
        assert torch.equal(a, b)
    (off, flags), *on = slab_calls["calls"]
    want = [s for s, d in enumerate(flags.tolist()) if d]  # the device's choice (the same in both runs)
    assert off is None and [slabs for slabs, _ in on] == ([want] if want else [])


def test_gating_leaves_out_what_the_device_turned_off(slab_calls):
    """Error targets the corrections already meet and no kept-share rule: the device makes no
    slab dense and leaves the first-order terms off (as on zipf-like data at scale). With
    host_gating nothing of either is launched; without it every gated launch is, and the
    first-order operands are built (they could pay at this size)."""
    e, c, t = zipf_inputs(96, 32, 1500, dtype=torch.float32, seed=3)
    tu = dict(
        backward="sparse", dense_slabs=True, dense_slab_bytes=96 * 4 * 64, dense_kept=2.0, slab_error=0.5,
        slab_error_dc=0.5,
    )  # fmt: skip
    a = _run(e, c, t, Tuning(**tu, host_gating=False), 2e-3)
    calls_off = dict(slab_calls, slabs=[slabs for slabs, _ in slab_calls["calls"]])
    slab_calls["calls"].clear()
    slab_calls["dc_fo"] = slab_calls["fo_terms"] = 0
    b = _run(e, c, t, Tuning(**tu, host_gating=True), 2e-3)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)
    assert calls_off["slabs"] == [None]
    assert calls_off["fo_terms"] == 1 and calls_off["dc_fo"] == 1
    assert slab_calls["calls"] == [] and slab_calls["dc_fo"] == 0 and slab_calls["fo_terms"] == 0


@pytest.mark.parametrize("case", ["on", "off"])
def test_first_order_flag_arriving_after_the_plan(case, slab_calls, monkeypatch):
    """The first-order flag reaches the host only after the plan is made (the decisions' first
    read finds nothing, the next one finds them, as on a GPU whose host is ahead): the terms'
    operands are built after the dC writer's launch where the flag is set (near-uniform rows,
    test_first_order.py's case of the terms on), left out where it is 0 (zipf rows), and the
    gradients are those of the flag arriving in time, to the bit."""
    if case == "on":
        (e, c, t), eps, rule = near_uniform_inputs(64, 32, 3000, std=0.2), 2.0**-8, {}
    else:
        (e, c, t), eps = _inputs("zipf")
        rule = CASES["none"]["rule"]
    built = int(case == "on")
    tu = Tuning(backward="sparse", dense_slabs=True, host_gating=True, **rule)
    in_time = _run(e, c, t, tu, eps)
    assert slab_calls["fo_terms"] == built  # (the flag each case's rule sets)
    slab_calls["fo_terms"] = slab_calls["dc_fo"] = 0
    get, reads = HostPeek.get, []

    def late(self):
        reads.append(self)
        return None if reads.count(self) == 1 else get(self)

    monkeypatch.setattr(HostPeek, "get", late)
    got = _run(e, c, t, tu, eps)
    assert len(reads) >= 2  # (read at the plan, and again after the dC writer's launch)
    for a, b in zip(in_time, got, strict=True):
        assert torch.equal(a, b)
    assert slab_calls["fo_terms"] == built and slab_calls["dc_fo"] == built


def test_peek_off_cuda_and_disabled():
    x, y = torch.tensor([0, 1, 0], dtype=torch.int8), torch.tensor([3], dtype=torch.int32)
    got = HostPeek(x, y).get()
    assert got is not None and torch.equal(got[0], x) and torch.equal(got[1], y)
    assert HostPeek(x, y, enabled=False).get() is None
    assert HostPeek().get() is None


@pytest.mark.gpu
def test_peek_on_cuda_never_waits_and_not_under_capture():
    """The copy is read only once its event has completed (after a synchronisation it must have);
    it is never made under CUDA-graph capture."""
    dev = torch.device("cuda")
    x = torch.randint(0, 2, (16,), dtype=torch.int8, device=dev)
    torch.cuda._sleep(int(50e6))  # the device busy: the copy cannot have arrived yet
    p = HostPeek(x)
    assert p.get() is None
    torch.cuda.synchronize()
    got = p.get()
    assert got is not None and torch.equal(got[0], x.cpu())
    s = torch.cuda.Stream()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
        q = HostPeek(x)
        y = x + 1
    assert q.get() is None
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, x + 1)


@pytest.mark.gpu
@pytest.mark.parametrize("regime", ["zipf", "random"])
def test_same_gradients_bit_for_bit_bf16(regime):
    """On the GPU, bf16, a size where the rule's decisions differ by regime: host_gating on and
    off give the same gradients to the bit, whichever path each call took."""
    from bench.data import make_inputs

    dev = torch.device("cuda")
    e, c, t = make_inputs(4096, 1024, 32768, regime, dtype=torch.bfloat16, device=dev, seed=0)
    outs = []
    for gate in (False, True, True):
        tu = Tuning(backward="sparse", host_gating=gate)
        outs.append(_run(e, c, t, tu, 2.0**-8))
        torch.cuda.synchronize()
    for o in outs[1:]:
        for x, y in zip(outs[0], o, strict=True):
            assert torch.equal(x, y)
