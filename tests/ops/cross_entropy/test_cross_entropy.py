"""CPU tests of cce.cross_entropy: impl="torch" (hypothesis properties over every option) and
impl="triton" in the Triton interpreter (fp32 / fp16 only: bf16 arithmetic is wrong there), both
against the fp64 oracle under random upstream gradients."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import examples, poisoned_allocations, rel_err, tuned_ce
from hypothesis import given, settings
from hypothesis import strategies as st

from cce import CausalLMLoss, CrossEntropyLoss, cross_entropy
from cce.ops.cross_entropy import kernels as K
from cce.reference import cross_entropy_reference

# Loss and lse are fp32 sums over V <= ~1000 terms: relative error ~1e-6. The gradient is
# computed in fp32 and stored in the logits' dtype: fp32 ~1e-6, fp16 rounding ~2^-12 (3e-4)
# relative L2. Bounds are a few times those figures.
LOSS_TOL = 1e-5
# A token's loss is a difference, lse - L_t (+ smoothing, z-loss terms), of numbers up to
# m = 2 max|L| + log V in size; each is computed in fp32, so a tiny loss (a confident row) carries
# an absolute error of a few fp32 ulps of m, not of the loss: 16 ulps (1e-6) of that scale.
TERM_TOL = 1e-6
# float64 logits (impl="torch") are computed in fp64 throughout (loss and gradients fp64).
GRAD_TOL = {torch.float32: 1e-5, torch.float16: 1.5e-3, torch.float64: 1e-5}


def make(lead, V, dtype=torch.float32, *, ignore_frac=0.15, scale=3.0, seed=0, ignore_index=-100):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(*lead, V, generator=g, dtype=torch.float64) * scale).to(dtype)
    t = torch.randint(0, V, lead, generator=g)
    if ignore_frac > 0 and t.numel():
        t[torch.rand(lead, generator=g) < ignore_frac] = ignore_index
    return x, t


def _term_scale(x, t, *, z_loss=0.0, shift=False, ignore_index=-100, reduction="mean", **_):
    """Size of the terms the loss is computed from: per valid row m = 2 max|L| + log V (times
    1 + z m with z-loss), reduced as the loss is (sum; the largest for a mean, a weighted mean
    of rows; the 2-norm for "none", matching the norm-wise comparison)."""
    L = x.detach().double()
    if shift:
        L, t = L[..., :-1, :], t[..., 1:]
    m = 2 * L.abs().amax(-1) + math.log(L.shape[-1])
    m = (m * (1 + z_loss * m))[t != ignore_index]
    if m.numel() == 0:
        return 0.0
    return float({"sum": m.sum(), "mean": m.max(), "none": m.norm()}[reduction])


def check(x, t, *, impl, inplace=False, seed=1, fn=cross_entropy, **kw):
    """cce vs the fp64 oracle: outputs, and the gradient under random upstream gradients."""
    g = torch.Generator().manual_seed(seed)
    leaf = x.detach().clone().requires_grad_()
    xin = leaf * 1 if inplace else leaf
    out = fn(xin, t, impl=impl, inplace_backward=inplace, **kw)
    outs = out if isinstance(out, tuple) else (out,)
    ups = [torch.randn(o.shape, generator=g, dtype=torch.float64) for o in outs]
    x64 = x.detach().double().requires_grad_()
    ref = cross_entropy_reference(x64, t, dtype=torch.float64, **kw)
    refs = ref if isinstance(ref, tuple) else (ref,)
    scale = _term_scale(x, t, **kw)
    for o, r in zip(outs, refs, strict=True):
        assert o.dtype == (torch.float64 if x.dtype == torch.float64 else torch.float32)
        assert o.shape == r.shape
        err = float((o.detach().double() - r.detach()).norm())
        allowed = LOSS_TOL * float(r.detach().norm()) + TERM_TOL * scale
        assert err <= allowed, (err, allowed, kw)
    total = sum((o * u.float()).sum() for o, u in zip(outs, ups, strict=True))
    if not total.requires_grad:  # e.g. nothing to differentiate
        return
    (gx,) = torch.autograd.grad(total, xin)
    (gr,) = torch.autograd.grad(sum((o * u).sum() for o, u in zip(refs, ups, strict=True)), x64)
    assert gx.dtype == x.dtype and gx.shape == x.shape
    assert torch.isfinite(gx).all()
    assert rel_err(gx, gr) < GRAD_TOL[x.dtype], (rel_err(gx, gr), kw)
    if inplace:
        assert gx.data_ptr() == xin.data_ptr()


options = st.fixed_dictionaries(
    {},
    optional={
        "reduction": st.sampled_from(["mean", "sum", "none"]),
        "softcap": st.sampled_from([None, 2.0, 30.0]),
        "label_smoothing": st.sampled_from([0.0, 0.1, 1.0]),
        "z_loss": st.sampled_from([0.0, 1e-3]),
        "return_lse": st.booleans(),
        "shift": st.booleans(),
        "weight": st.booleans(),
        "ignore_index": st.sampled_from([-100, 0]),
        "inplace": st.booleans(),
    },
)


@settings(max_examples=examples(60, 15))
@given(
    opts=options,
    B=st.integers(1, 3),
    T=st.integers(2, 9),
    V=st.integers(2, 70),  # V = 1: see test_single_class
    ignore_frac=st.sampled_from([0.0, 0.3, 1.0]),
    seed=st.integers(0, 2**16),
)
def test_torch_impl_matches_oracle(opts, B, T, V, ignore_frac, seed):
    opts = dict(opts)
    x, t = make((B, T), V, ignore_frac=ignore_frac, seed=seed, ignore_index=opts.get("ignore_index", -100))
    if opts.pop("weight", False):
        opts["weight"] = torch.rand(V, generator=torch.Generator().manual_seed(seed)) + 0.1
    inplace = opts.pop("inplace", False)
    check(x, t, impl="torch", inplace=inplace, seed=seed, **opts)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_single_class(impl):
    """V = 1: the cross entropy is 0 and its gradient alpha p - beta cancels exactly in exact math;
    only the z-loss term 2 z lse g is left. The fp32 cancellation error is relative to the terms
    (|g| ~ 1), not to the small result, so the check is absolute: 1e-6 is ~10 fp32 units."""
    x, t = make((3, 4), 1, ignore_frac=0.0)
    for kw in ({}, {"z_loss": 1e-3, "reduction": "sum"}):
        xl = x.clone().requires_grad_()
        loss = cross_entropy(xl, t, impl=impl, **kw)
        loss.backward()
        x64 = x.double().requires_grad_()
        cross_entropy_reference(x64, t, dtype=torch.float64, **kw).backward()
        torch.testing.assert_close(
            loss.double(), cross_entropy_reference(x.double(), t, dtype=torch.float64, **kw)
        )
        torch.testing.assert_close(xl.grad.double(), x64.grad, rtol=0, atol=1e-6)


def test_torch_impl_chunks():
    """Several chunks (the chunk size is set by a byte budget) give the same result as one."""
    fn = tuned_ce(chunk_bytes=3 * 4 * 50 * 7)  # 7 rows of V=50 per chunk
    x, t = make((4, 13), 50, seed=3)
    check(x, t, impl="torch", fn=fn, softcap=5.0, label_smoothing=0.2, z_loss=1e-3, return_lse=True)
    check(x, t, impl="torch", fn=fn, inplace=True, shift=True)


def test_torch_impl_float64_and_fp16():
    x, t = make((37,), 300, torch.float64)
    check(x, t, impl="torch", label_smoothing=0.1)  # fp64 logits -> fp64 accumulation
    x, t = make((37,), 300, torch.float16)
    check(x, t, impl="torch", softcap=10.0)


# ------------------------------------------------------------------------------------------------
# Triton kernels in the interpreter (small shapes: it is slow)

TRITON_CASES = [
    ("fp32 plain", torch.float32, (2, 45), 700, {}),
    ("fp16 plain", torch.float16, (2, 45), 700, {"reduction": "sum"}),
    (
        "fp32 all options",
        torch.float32,
        (3, 20),
        517,
        {
            "softcap": 4.0,
            "label_smoothing": 0.1,
            "weight": True,
            "z_loss": 1e-3,
            "return_lse": True,
            "reduction": "none",
        },
    ),  # fmt: skip
    (
        "fp16 shift inplace",
        torch.float16,
        (2, 30),
        600,
        {"shift": True, "inplace": True, "label_smoothing": 0.2},
    ),
    ("fp32 few rows (vocab split)", torch.float32, (3,), 1500, {"label_smoothing": 0.1, "return_lse": True}),
]


@pytest.mark.parametrize("name,dtype,lead,V,opts", TRITON_CASES, ids=[c[0] for c in TRITON_CASES])
def test_triton_interpreter_matches_oracle(name, dtype, lead, V, opts):
    opts = dict(opts)
    x, t = make(lead, V, dtype, seed=len(name))
    if opts.pop("weight", False):
        opts["weight"] = torch.rand(V) + 0.5
    inplace = opts.pop("inplace", False)
    check(x, t, impl="triton", inplace=inplace, **opts)


@settings(max_examples=examples(25, 6))
@given(
    opts=options,
    rows=st.integers(1, 6),
    V=st.integers(2, 600),  # up to 3 blocks of 256 and a tail; few rows -> vocabulary splits
    dtype=st.sampled_from([torch.float32, torch.float16]),
    seed=st.integers(0, 2**16),
)
def test_triton_interpreter_properties(opts, rows, V, dtype, seed):
    opts = dict(opts)
    if rows < 2:  # shift needs a sequence of >= 2 positions (a bad input, tested elsewhere)
        opts.pop("shift", None)
    x, t = make((2, rows), V, dtype, seed=seed, ignore_index=opts.get("ignore_index", -100))
    if opts.pop("weight", False):
        opts["weight"] = torch.rand(V, generator=torch.Generator().manual_seed(seed)) + 0.1
    inplace = opts.pop("inplace", False)
    check(x, t, impl="triton", inplace=inplace, seed=seed, **opts)


def test_triton_strided_layouts():
    x, t = make((6, 9), 300, seed=5)
    xt, tt = x.transpose(0, 1), t.transpose(0, 1)  # leading dims do not flatten: row-offset table
    check(xt, tt, impl="triton", reduction="none")
    check(xt, tt, impl="triton", inplace=True)
    check(x[..., :257], t.clamp(max=256), impl="triton", reduction="sum")  # row stride 300, V 257
    xc = x.transpose(-1, -2).contiguous().transpose(-1, -2)  # class dim not unit-stride: copied
    check(xc, t, impl="triton", inplace=True)


@pytest.mark.parametrize("splits", [1, 2, 5])
def test_triton_split_plans_agree(splits):
    """Forward statistics do not depend on how the vocabulary is split across programs."""
    x, t = make((7,), 1200, seed=9)
    lse, tgt, ssum, *_ = K.ce_forward(x, t, None, -100, 3.0, True, splits=splits)
    L = 3.0 * torch.tanh(x.double() / 3.0)
    valid = t != -100
    ref_lse = torch.where(valid, torch.logsumexp(L, 1), 0.0)
    ref_tgt = torch.where(valid, L.gather(1, t.clamp(min=0)[:, None]).squeeze(1), 0.0)
    ref_ssum = torch.where(valid, L.sum(1), 0.0)
    assert rel_err(torch.where(valid, lse, 0.0), ref_lse) < 1e-6
    assert rel_err(tgt, ref_tgt) < 1e-6
    assert rel_err(ssum, ref_ssum) < 1e-5
    a = torch.rand(7)
    g = K.ce_backward(x, t, None, lse, a, a, a * 0.01, -100, 3.0, True, splits=splits)
    g1 = K.ce_backward(x, t, None, lse, a, a, a * 0.01, -100, 3.0, True, splits=1)
    assert torch.equal(g, g1)
    assert (g[~valid] == 0).all()


def test_triton_poisoned_output_fully_written():
    """Every gradient element is written (ignored rows too) even when the buffer held NaN."""
    x, t = make((9,), 333, seed=4, ignore_frac=0.4)
    lse, *_ = K.ce_forward(x, t, None, -100, 0.0, False)
    a = torch.rand(9)
    buf = torch.full_like(x, float("nan"))
    buf.copy_(x)  # in place: the kernel reads the logits from buf and overwrites them
    out = K.ce_backward(buf, t, None, lse, a, a, a * 0, -100, 0.0, False, inplace=True)
    assert torch.isfinite(out).all()
    ref = K.ce_backward(x, t, None, lse, a, a, a * 0, -100, 0.0, False)
    assert torch.equal(out, ref)
    assert (ref[t == -100] == 0).all()


@pytest.mark.parametrize(
    "opts",
    [
        {},
        {"label_smoothing": 0.1, "z_loss": 1e-3},
        {"reduction": "none", "return_lse": True},
        {"return_entropy": True},
    ],
    ids=["plain", "smooth-zloss", "none-lse", "entropy"],
)
def test_triton_poisoned_allocations_change_nothing(opts):
    """Every buffer torch.empty / empty_like / new_empty makes during the step filled first
    (helpers.poisoned_allocations): the outputs and the logits' gradient are bit for bit those of
    an ordinary run, so nothing reads memory it has not written (an odd V, ignored rows)."""
    x, t = make((33,), 257, seed=6, ignore_frac=0.2)

    def run():
        xx = x.clone().requires_grad_()
        out = cross_entropy(xx, t, impl="triton", **opts)
        outs = out if isinstance(out, tuple) else (out,)
        w = torch.linspace(0.5, 1.5, outs[0].numel()).reshape(outs[0].shape)
        (outs[0] * w).sum().backward()
        return [o.detach() for o in outs if o is not None], xx.grad

    want = run()
    with poisoned_allocations():
        got = run()
    assert all(torch.equal(a, b) for a, b in zip(got[0], want[0], strict=True))
    assert torch.equal(got[1], want[1])


def test_triton_empty_and_all_ignored():
    x, t = make((0,), 50)
    xl = x.clone().requires_grad_()
    loss = cross_entropy(xl, t, impl="triton")
    loss.backward()
    assert loss.item() == 0.0 and xl.grad.shape == x.shape
    x, t = make((5,), 50, ignore_frac=1.0)
    check(x, t, impl="triton")
    check(x, t, impl="triton", reduction="none", return_lse=True)


# ------------------------------------------------------------------------------------------------
# API, modules, validation


def test_modules_match_function():
    x, t = make((2, 6), 40, seed=2)
    w = torch.rand(40) + 0.5
    m = CrossEntropyLoss(w, reduction="sum", label_smoothing=0.1, impl="torch")
    ref = cross_entropy(x, t, weight=w, reduction="sum", label_smoothing=0.1, impl="torch")
    assert torch.equal(m(x, t), ref)
    assert "reduction='sum'" in repr(m)
    causal = CausalLMLoss(impl="torch")
    assert torch.equal(causal(x, t), cross_entropy(x, t, shift=True, impl="torch"))
    # 2-D (N, V) logits: the same convention as torch.nn.CrossEntropyLoss.
    x2, t2 = make((30,), 25, ignore_frac=0.0)
    torch.testing.assert_close(CrossEntropyLoss(impl="torch")(x2, t2), torch.nn.CrossEntropyLoss()(x2, t2))


def test_shift_does_not_copy_logits():
    """shift=True reads the unshifted logits in place: the forward allocates no logits-sized tensor
    in impl='torch' beyond its bounded chunk temporaries, and the gradient keeps the full shape."""
    x, t = make((2, 5), 30)
    xl = x.clone().requires_grad_()
    loss = cross_entropy(xl, t, shift=True, reduction="none", impl="torch")
    assert loss.shape == (2, 4)
    loss.sum().backward()
    assert xl.grad.shape == x.shape
    assert (xl.grad[:, -1] == 0).all()  # the last position predicts nothing


def test_validation_errors():
    x, t = make((4, 5), 10)
    with pytest.raises(ValueError, match=r"targets must have shape logits.shape\[:-1\] = \(4, 5\)"):
        cross_entropy(x, t[:, :3])
    with pytest.raises(TypeError, match="targets must hold integer class ids"):
        cross_entropy(x, t.float())
    with pytest.raises(TypeError, match="logits must be float32"):
        cross_entropy(x.long(), t)
    with pytest.raises(ValueError, match=r"weight must have shape \(V,\) = \(10,\)"):
        cross_entropy(x, t, weight=torch.ones(9))
    with pytest.raises(ValueError, match="reduction must be one of"):
        cross_entropy(x, t, reduction="avg")
    with pytest.raises(ValueError, match="label_smoothing must be in"):
        cross_entropy(x, t, label_smoothing=1.5)
    with pytest.raises(ValueError, match="softcap must be a finite float > 0"):
        cross_entropy(x, t, softcap=0.0)
    with pytest.raises(ValueError, match="shift=True needs a sequence dimension"):
        cross_entropy(x[:, :1], t[:, :1], shift=True)
    with pytest.raises(IndexError, match=r"targets must be in \[0, V\) = \[0, 10\)"):
        cross_entropy(x, t.clamp(min=0) + 5)
    with pytest.raises(ValueError, match="at least one class"):
        cross_entropy(x[..., :0], t)
    with pytest.raises(TypeError, match="inplace_backward must be a bool"):
        cross_entropy(x, t, inplace_backward=1)
    leaf = x.clone().requires_grad_()
    with pytest.raises(ValueError, match="leaf tensor that requires grad"):
        cross_entropy(leaf, t, inplace_backward=True)
    with pytest.raises(ValueError, match="leaf tensor that requires grad"):
        cross_entropy(leaf[:2], t[:2], inplace_backward=True)
    with pytest.raises(TypeError, match="impl='triton' supports float32"):
        cross_entropy(x.double(), t, impl="triton")


def test_inplace_backward_detects_other_readers():
    """An op that saved the logits for its own backward makes autograd raise, not go wrong."""
    x, t = make((3, 4), 20)
    leaf = x.clone().requires_grad_()
    y = torch.exp(leaf)  # exp saves its output for backward
    loss = cross_entropy(y, t, inplace_backward=True, impl="torch")
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_compile_fullgraph_cpu():
    x, t = make((2, 8), 30, seed=6)
    f = torch.compile(lambda a, b: cross_entropy(a, b, shift=True, z_loss=1e-3, impl="torch"), fullgraph=True)
    xl = x.clone().requires_grad_()
    loss = f(xl, t)
    loss.backward()
    ref = cross_entropy_reference(x, t, shift=True, z_loss=1e-3)
    assert rel_err(loss.detach(), ref) < LOSS_TOL
    assert torch.isfinite(xl.grad).all()


def test_autocast_does_not_recast_logits():
    """Under autocast the loss is still computed from the logits as given (fp32 here): bit-equal
    to the same call without autocast, gradient in the logits' dtype."""
    x = torch.randn(6, 40, requires_grad=True)
    t = torch.randint(0, 40, (6,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = cross_entropy(x, t, impl="torch", label_smoothing=0.1)
    (g,) = torch.autograd.grad(loss, x)
    ref = cross_entropy(x, t, impl="torch", label_smoothing=0.1)
    (gref,) = torch.autograd.grad(ref, x)
    assert loss.dtype == torch.float32 and g.dtype == torch.float32
    assert torch.equal(loss, ref) and torch.equal(g, gref)
