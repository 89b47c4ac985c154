"""torch.compile(fullgraph=True) over cce's entry points (CPU: impl="torch", and impl="triton" in the
Triton interpreter).

``fullgraph=True`` turns any graph break into an error, so tracing at all is the first check; the
second is that the compiled function gives the eager results. The compiled graph calls the same
custom ops as eager and only reshapes around them, so the two agree to a few fp32 ulps: TOL = 1e-6
relative (a wrong option or a lost gradient is off by far more).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch._dynamo

import cce
from tests.helpers import loss_and_grads, make_linear_inputs, rel_err

TOL = 1e-6

# (lead shape, options, bias, class weights)
LINEAR_CASES = [
    ((3, 40), dict(), False, False),
    ((3, 40), dict(reduction="sum", softcap=3.0), True, False),
    ((2, 33), dict(reduction="none", shift=True, label_smoothing=0.1), False, False),
    ((70,), dict(z_loss=1e-3, return_lse=True, filter_eps=None), True, False),
    ((2, 25), dict(shift=True, label_smoothing=0.2, softcap=5.0), False, True),
]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _compare(got, ref):
    (l1, s1, g1), (l2, s2, g2) = got, ref
    assert l1.shape == l2.shape and l1.dtype == l2.dtype
    assert rel_err(l1, l2) <= TOL
    if s2 is not None:
        assert rel_err(s1, s2) <= TOL
    assert len(g1) == len(g2)
    for a, b in zip(g1, g2, strict=True):
        assert (a is None) == (b is None)
        if b is not None:
            assert rel_err(a, b) <= TOL


@pytest.mark.parametrize("case", range(len(LINEAR_CASES)))
def test_linear_cross_entropy_compiles_fullgraph(case):
    lead, opts, has_bias, has_weight = LINEAR_CASES[case]
    V, D = 301, 48
    e, c, t, b = make_linear_inputs(lead, D, V, bias=has_bias, scale=4.0)
    w = torch.rand(V) + 0.5 if has_weight else None

    def fn(e, c, t, b, **kw):
        return cce.linear_cross_entropy(e, c, t, b, weight=w, impl="torch", **kw)

    # aot_eager: Dynamo + AOTAutograd (fake tensors, the autograd formula) without codegen.
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    ref = loss_and_grads(fn, e, c, t, b, generator=torch.Generator().manual_seed(1), **opts)
    got = loss_and_grads(compiled, e, c, t, b, generator=torch.Generator().manual_seed(1), **opts)
    _compare(got, ref)


@pytest.mark.parametrize("opts", [dict(filter_eps=None), dict(filter_eps=None, shift=True, reduction="sum")])
def test_triton_fused_path_compiles_fullgraph(opts):
    """impl="triton" (the Triton interpreter) on its fused exact path under torch.compile: the
    custom ops trace (their fakes) and give eager's results at a V off a multiple of 8, where dC
    is returned as the first V rows of storage padded to 8 classes (kernels/fused_grads.py), and
    with the rows read by index (shift)."""
    V, D = 37, 16
    e, c, t, b = make_linear_inputs((2, 12), D, V, scale=3.0)

    def fn(e, c, t, b, **kw):
        return cce.linear_cross_entropy(e, c, t, b, impl="triton", **kw)

    plan = cce.explain(e, c, t, impl="triton", **opts)
    assert plan.backward == "fused", plan
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    ref = loss_and_grads(fn, e, c, t, b, generator=torch.Generator().manual_seed(2), **opts)
    got = loss_and_grads(compiled, e, c, t, b, generator=torch.Generator().manual_seed(2), **opts)
    _compare(got, ref)


def test_example_gpt_inductor_matches_eager_and_torch_loss():
    """examples/gpt.py under the default backend (inductor): its forward ends in LinearCrossEntropy."""
    from examples.gpt import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=257, seq_len=24, d_model=32, n_layer=1, n_head=2)
    torch.manual_seed(0)
    model = GPT(cfg, loss="cce", impl="torch")
    torch.manual_seed(0)
    plain = GPT(cfg, loss="torch")  # same weights, lm_head + F.cross_entropy
    ids = torch.randint(0, 257, (2, 24))
    params = list(model.parameters())
    loss_e = model(ids, labels=ids)
    grads_e = torch.autograd.grad(loss_e, params)
    loss_t = plain(ids, labels=ids)
    grads_t = torch.autograd.grad(loss_t, list(plain.parameters()))
    compiled = torch.compile(model, fullgraph=True)
    loss_c = compiled(ids, labels=ids)
    grads_c = torch.autograd.grad(loss_c, params)
    # cce vs materialized logits: fp32 reductions in another order, ~1e-7 measured.
    assert rel_err(loss_e.detach(), loss_t.detach()) <= 1e-5
    # Inductor may fuse / reorder the small model around the op: ~1e-7 relative measured; 1e-5 bound.
    assert rel_err(loss_c.detach(), loss_e.detach()) <= 1e-5
    for a, b, t in zip(grads_c, grads_e, grads_t, strict=True):
        assert rel_err(b, t) <= 1e-5
        assert rel_err(a, b) <= 1e-5


def test_no_grad_and_frozen_head_compile():
    """A frozen classifier (LoRA-style) and inference under no_grad trace too."""
    e, c, t, _ = make_linear_inputs((2, 30), 40, 211)
    c = c.detach()
    fn = lambda e, c, t: cce.linear_cross_entropy(e, c, t, shift=True, impl="torch")
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    (ge,) = torch.autograd.grad(compiled(e, c, t), [e])
    (ge_ref,) = torch.autograd.grad(fn(e, c, t), [e])
    assert rel_err(ge, ge_ref) <= TOL
    with torch.no_grad():
        assert rel_err(compiled(e, c, t), fn(e, c, t)) <= TOL


CE_CASES = [
    dict(),
    dict(reduction="sum", softcap=3.0, shift=True),
    dict(reduction="none", label_smoothing=0.1, z_loss=1e-3),
    dict(return_lse=True),
]


@pytest.mark.skipif(
    importlib.util.find_spec("cce.ops.cross_entropy") is None, reason="cce.ops.cross_entropy not built yet"
)
@pytest.mark.parametrize("case", range(len(CE_CASES)))
def test_cross_entropy_compiles_fullgraph(case):
    from cce import cross_entropy

    opts = CE_CASES[case]
    V = 301
    logits = (torch.randn(2, 37, V) * 3).requires_grad_()
    t = torch.randint(0, V, (2, 37))
    t[0, :5] = -100

    def fn(z, t):
        return cross_entropy(z, t, impl="torch", **opts)

    def run(f):
        out = f(logits, t)
        loss, lse = out if isinstance(out, tuple) else (out, None)
        g = torch.Generator().manual_seed(2)
        total = (loss * torch.randn(loss.shape, generator=g)).sum()
        if lse is not None:
            total = total + (lse * torch.randn(lse.shape, generator=g)).sum()
        (gz,) = torch.autograd.grad(total, [logits])
        return loss.detach(), None if lse is None else lse.detach(), [gz]

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    _compare(run(compiled), run(fn))


def test_patched_hf_model_compiles_fullgraph():
    """torch.compile(fullgraph=True) of a cce-patched Hugging Face model, loss and gradients."""
    pytest.importorskip("transformers")
    import copy

    import cce.transformers
    from tests.test_transformers import batch, build

    model = cce.transformers.patch(build("llama"), impl="torch")
    twin = copy.deepcopy(model)
    ids, labels = batch()
    loss_e = model(input_ids=ids, labels=labels).loss
    loss_e.backward()
    compiled = torch.compile(twin, fullgraph=True, backend="aot_eager")
    out = compiled(input_ids=ids, labels=labels)
    assert out.logits is None
    out.loss.backward()
    assert rel_err(out.loss.detach(), loss_e.detach()) <= TOL
    for (name, p), q in zip(twin.named_parameters(), model.parameters(), strict=True):
        assert rel_err(p.grad, q.grad) <= 1e-5, name  # the decoder's ops may be reordered: 1e-5
