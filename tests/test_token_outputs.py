"""Per-token outputs (cce.LossOutputs) and the temperature, impl="torch", linear and logits level,
against the fp64 oracle.

The oracle (cce.reference) materializes ``softcap(e @ c.T + bias) / temperature`` in fp64 and
takes the log-probabilities, entropy and argmax from it with plain torch ops; the gradients come
from autograd through it under the same random upstream gradients on every differentiable output.

Tolerances, derived (not tuned). Inputs are fp64, so the implementation's logits and sums are fp64
too; its error is the fp32 rounding of what the contract keeps in fp32 (unit roundoff u = 2^-24):

* outputs: lse, the target logit and E_p[z] are fp64 sums rounded once to fp32; log-prob, entropy
  and the loss subtract or combine two or three of them (one rounding each). Each such value
  has magnitude at most M_i = |lse_i| + max_v |z_iv| (+ the z-loss term z lse^2 and smoothing's
  W lse / V for the loss), so |error| <= 8 u M_i: four roundings, and a factor 2 to spare.
* gradients: dZ_iv = alpha_i p_iv - beta_i [v = t_i] - gamma_i w_v + eta_i p_iv z_iv (cce/_math.py)
  with fp32 coefficients, each formed by at most 8 roundings (so relative error <= 8 u against
  the sum of the magnitudes of its terms, A_i) from fp32-rounded statistics. Per row,
  sum_v |dZ err_iv| <= 8 u A_i (sum_v p_iv (1 + |z_iv|) + 1 + ls) <= 8 u A_i (3 + max_v |z_iv|)
  (ls <= 1), and softcap' <= 1, so ||dE err|| <= 8 u ||A (3 + max|z|)|| max_v ||c_v|| and
  ||dC err|| <= 8 u sum_i A_i (3 + max|z_i|) ||e_i||; dbias like dC with ||e_i|| = 1.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cce
import cce.reference
from cce.outputs import LossOutputs
from cce.reference import linear_cross_entropy_reference
from tests.helpers import examples, tuned

U32 = 2.0**-24
OUTPUTS = ("lse", "logprobs", "entropy")  # the differentiable per-token outputs


def _all_outputs(**kw):
    return dict(return_lse=True, return_logprobs=True, return_entropy=True, return_argmax=True,
                return_accuracy=True, **kw)  # fmt: skip


def _run(fn, e, c, t, b, seed, **opts):
    """fn's outputs, and its gradients w.r.t. (e, c, b) under seeded N(0, 1) upstream gradients on
    the loss and on every differentiable per-token output it returns."""
    leaves = [x for x in (e, c, b) if x is not None]
    out = fn(e, c, t, b, **opts)
    gen = torch.Generator().manual_seed(seed)
    ups = {}
    total = 0.0
    for name in ("loss", *OUTPUTS):
        x = getattr(out, name)
        if x is None:
            continue
        ups[name] = torch.randn(x.shape, generator=gen, dtype=torch.float64)
        total = total + (x.double() * ups[name]).sum()
    grads = torch.autograd.grad(total, leaves)
    return out, grads, ups


def _cce(e, c, t, b, **opts):
    return cce.linear_cross_entropy(e, c, t, b, impl="torch", filter_eps=None, **opts)


def _oracle(e, c, t, b, **opts):
    return linear_cross_entropy_reference(e, c, t, b, dtype=torch.float64, **opts)


def _row_bounds(z, t, out, ups, *, softcap=None, temperature=1.0, shift=False, ignore_index=-100,
                reduction="mean", label_smoothing=0.0, z_loss=0.0, **_):  # fmt: skip
    """(per-token output bound, per-row bound on sum_v |dZ err_iv|) of the module docstring, from
    the raw logits z (..., V), the oracle's fp64 values ``out`` and the upstream gradients."""
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    z = z / temperature
    if shift:
        z, t = z[..., :-1, :], t[..., 1:]
    z, t = z.reshape(-1, z.shape[-1]), t.reshape(-1)
    valid = t != ignore_index
    zmax = z.abs().amax(1)
    lse = torch.logsumexp(z, 1).abs()
    M = lse + zmax + z_loss * lse * lse + label_smoothing * lse
    n = valid.sum().clamp(min=1)
    g_loss = ups["loss"].reshape(-1).abs() if reduction == "none" else ups["loss"].abs().expand(len(t))
    g_loss = g_loss / n if reduction == "mean" else g_loss

    def up(name):
        return torch.zeros_like(lse) if name not in ups else ups[name].reshape(-1).abs()

    ent = out.entropy.detach().reshape(-1).abs()
    A = g_loss * (1 + 2 * z_loss * lse) + up("lse") + up("logprobs") * 2 + up("entropy") * (lse + ent + zmax)
    A = torch.where(valid, A, 0.0) / temperature
    return 8 * U32 * M, 8 * U32 * A * (3 + zmax)


def _bounds(e, c, t, b, out, ups, **opts):
    """The linear level: (per-token output bound, gradient bounds {e, c, bias})."""
    z = e.detach() @ c.detach().T + (0.0 if b is None else b.detach())
    out_bound, row = _row_bounds(z, t, out, ups, **opts)
    # e's rows as the problem reads them (shifted); dE's rows are disjoint, dC and dbias sum them
    e_rows = e.detach()[..., :-1, :] if opts.get("shift") else e.detach()
    e_norm = e_rows.reshape(-1, e.shape[-1]).norm(dim=1)
    grads = {
        "e": float(row.norm() * c.detach().norm(dim=1).max()),
        "c": float((row * e_norm).sum()),
        "bias": float(row.sum()),
    }
    return out_bound, grads


@st.composite
def problems(draw):
    lead = tuple(draw(st.integers(1, 4)) for _ in range(draw(st.integers(1, 2))))
    D, V = draw(st.integers(1, 24)), draw(st.integers(1, 90))
    opts = dict(
        temperature=draw(st.sampled_from([0.3, 0.7, 1.0, 1.6, 4.0])),
        softcap=draw(st.sampled_from([None, 2.0, 30.0])),
        shift=draw(st.booleans()) and lead[-1] >= 2,
        reduction=draw(st.sampled_from(["mean", "sum", "none"])),
        label_smoothing=draw(st.sampled_from([0.0, 0.1])),
        z_loss=draw(st.sampled_from([0.0, 1e-3])),
    )
    with_bias = draw(st.booleans())
    ignore = draw(st.sampled_from([0.0, 0.3, 1.0]))
    seed = draw(st.integers(0, 2**16))
    return lead, D, V, opts, with_bias, ignore, seed


def _inputs(lead, D, V, with_bias, ignore, seed, scale=2.0):
    gen = torch.Generator().manual_seed(seed)
    e = (torch.randn(*lead, D, generator=gen, dtype=torch.float64) * scale / math.sqrt(D)).requires_grad_()
    c = torch.randn(V, D, generator=gen, dtype=torch.float64).requires_grad_()
    b = torch.randn(V, generator=gen, dtype=torch.float64).requires_grad_() if with_bias else None
    t = torch.randint(0, V, lead, generator=gen)
    t[torch.rand(lead, generator=gen) < ignore] = -100
    return e, c, t, b


@settings(max_examples=examples(60, 12))
@given(problems())
def test_outputs_and_gradients_against_oracle(problem):
    """Every output and the gradients through all of them equal the fp64 oracle within the
    module docstring's bounds, over temperature, softcap, shift, reduction, smoothing, z-loss,
    bias and ignored tokens; argmax and accuracy exactly."""
    lead, D, V, opts, with_bias, ignore, seed = problem
    e, c, t, b = _inputs(lead, D, V, with_bias, ignore, seed)
    kw = _all_outputs(**opts)
    got, ggot, ups = _run(_cce, e, c, t, b, seed, **kw)
    ref, gref, _ = _run(_oracle, e, c, t, b, seed, **kw)
    assert isinstance(got, LossOutputs)
    out_bound, grad_bound = _bounds(e, c, t, b, ref, ups, **opts)
    for name in ("lse", "logprobs", "entropy"):
        x, y = getattr(got, name), getattr(ref, name)
        assert x.dtype == torch.float64 and x.shape == y.shape, name  # (fp64 inputs, impl="torch")
        assert bool(((x.double() - y).abs().reshape(-1) <= out_bound).all()), name
    loss_err = (got.loss.double() - ref.loss).abs()
    loss_bound = out_bound if opts["reduction"] == "none" else out_bound.sum()
    assert bool((loss_err.reshape(-1) <= loss_bound).all())
    assert got.argmax.dtype == torch.int64 and torch.equal(got.argmax, ref.argmax)
    assert got.accuracy.shape == () and float(got.accuracy) == float(ref.accuracy)
    for name, g, r in zip(("e", "c", "bias"), ggot, gref, strict=False):
        assert float((g - r).norm()) <= grad_bound[name] + 1e-300, name


def test_argmax_ties_take_the_smallest_id():
    """Tied largest logits (duplicated classifier rows): the smallest id, as torch.argmax."""
    gen = torch.Generator().manual_seed(0)
    e = torch.randn(6, 8, generator=gen)
    c = torch.randn(10, 8, generator=gen)
    c[7] = c[2]  # classes 2 and 7 always tie
    c[2] *= 10.0
    c[7] = c[2]
    t = torch.arange(6)
    out = cce.linear_cross_entropy(e.abs(), c.abs(), t, impl="torch", return_argmax=True)
    want = (e.abs() @ c.abs().T).argmax(1)
    assert torch.equal(out.argmax, want) and bool((out.argmax == 2).all())


def test_ignored_tokens_and_all_ignored_batch():
    """Ignored tokens: log-prob, lse and entropy 0, argmax -1; an all-ignored batch has loss 0,
    accuracy 0 and zero gradients through every output."""
    e = torch.randn(2, 5, 8, dtype=torch.float64, requires_grad=True)
    c = torch.randn(30, 8, dtype=torch.float64, requires_grad=True)
    t = torch.full((2, 5), -100)
    t[0, 1] = 3
    out = cce.linear_cross_entropy(e, c, t, impl="torch", **_all_outputs())
    ign = t == -100
    for name in ("lse", "logprobs", "entropy"):
        assert bool((getattr(out, name)[ign] == 0).all()), name
    assert bool((out.argmax[ign] == -1).all()) and out.argmax[0, 1] >= 0
    t[0, 1] = -100
    out = cce.linear_cross_entropy(e, c, t, impl="torch", **_all_outputs())
    assert float(out.loss) == 0.0 and float(out.accuracy) == 0.0
    total = out.loss + out.logprobs.sum() + out.entropy.sum() + out.lse.sum()
    ge, gc = torch.autograd.grad(total, (e, c))
    assert not ge.any() and not gc.any()


def test_accuracy_with_ignore_index_minus_one():
    """ignore_index = -1 equals the argmax of ignored tokens (-1): they still do not count."""
    e = torch.randn(4, 6, dtype=torch.float64)
    c = torch.randn(5, 6, dtype=torch.float64)
    t = (e @ c.T).argmax(1)
    t[1] = -1
    out = cce.linear_cross_entropy(e, c, t, impl="torch", ignore_index=-1, return_accuracy=True)
    assert float(out.accuracy) == 1.0


def test_return_types():
    """Without per-token outputs: the loss, or (loss, lse) with return_lse, as before. With any:
    a LossOutputs, loss first (tuple unpacking), None for what was not asked for."""
    e, c, t = torch.randn(3, 4), torch.randn(7, 4), torch.tensor([1, 2, 3])
    assert isinstance(cce.linear_cross_entropy(e, c, t, impl="torch"), torch.Tensor)
    pair = cce.linear_cross_entropy(e, c, t, impl="torch", return_lse=True)
    assert type(pair) is tuple and len(pair) == 2
    out = cce.linear_cross_entropy(e, c, t, impl="torch", return_entropy=True)
    loss, *rest = out
    assert loss is out.loss and out.lse is None and out.logprobs is None and out.argmax is None
    assert out.entropy.shape == t.shape and len(rest) == 5
    mod = cce.LinearCrossEntropy(impl="torch", temperature=0.5, return_logprobs=True, reduction="none")
    got = mod(e, c, t)
    want = torch.log_softmax((e @ c.T) / 0.5, 1).gather(1, t[:, None]).squeeze(1)
    torch.testing.assert_close(got.logprobs, want)
    torch.testing.assert_close(got.loss, -want)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_bad_temperature_names_the_argument(bad):
    e, c, t = torch.randn(3, 4), torch.randn(7, 4), torch.tensor([1, 2, 3])
    with pytest.raises(ValueError, match="temperature"):
        cce.linear_cross_entropy(e, c, t, temperature=bad)


@pytest.mark.parametrize("name", ["temperature", "return_entropy", "return_argmax"])
def test_wrong_types_name_the_argument(name):
    e, c, t = torch.randn(3, 4), torch.randn(7, 4), torch.tensor([1, 2, 3])
    with pytest.raises(TypeError, match=name):
        cce.linear_cross_entropy(e, c, t, **{name: True if name == "temperature" else 1})


def test_compiles_fullgraph():
    """torch.compile(fullgraph=True) traces a call with every output (the ops are opaque)."""
    e = torch.randn(5, 8, requires_grad=True)
    c = torch.randn(11, 8, requires_grad=True)
    t = torch.tensor([1, 2, -100, 4, 5])

    def f(e, c, t):
        out = cce.linear_cross_entropy(e, c, t, impl="torch", temperature=0.8, **_all_outputs())
        return out.loss - 0.01 * out.entropy.mean() + out.logprobs.sum(), out.argmax, out.accuracy

    got = torch.compile(f, fullgraph=True)(e, c, t)
    want = f(e, c, t)
    for x, y in zip(got, want, strict=True):
        torch.testing.assert_close(x, y)
    g1 = torch.autograd.grad(got[0], (e, c))
    g2 = torch.autograd.grad(want[0], (e, c))
    for x, y in zip(g1, g2, strict=True):
        torch.testing.assert_close(x, y)


@settings(max_examples=examples(40, 10))
@given(problems(), st.booleans())
def test_logits_level_against_oracle(problem, inplace):
    """cce.cross_entropy (logits level, impl="torch"): every output and the gradient through all
    of them equal the fp64 oracle within the module docstring's bounds (dX's rows: the per-row
    bound on sum_v |dZ err|, which bounds the row's L2 error), the gradient also written in
    place."""
    _check_logits_level(problem, inplace, "torch")


@settings(max_examples=examples(25, 6))
@given(problems(), st.booleans(), st.sampled_from([1, 2]))
def test_triton_logits_level_against_oracle(problem, inplace, splits):
    """The same with impl="triton" (the interpreter): fp32 logits (multiples of 1/2, exact in
    fp32 and often tied at the max), walked in 16-class blocks, in one program per
    row or in two vocabulary splits merged on the host. The kernels' sums run in fp32 over V
    terms (not fp64 rounded once), so the bounds take (V + 8) u in place of 8 u, as in the linear
    level's Triton test, and the gradient's rounding to fp32 one u more."""
    pytest.importorskip("triton")
    with pytest.MonkeyPatch.context() as mp:
        _small_blocks(mp, splits)
        _check_logits_level(problem, inplace, "triton")


def _small_blocks(mp, splits: int) -> None:
    """The logits-level kernels on 16-class blocks (several per row) in ``splits`` programs per
    row (the interpreter's defaults: one 256-class block, splits chosen by the row count)."""
    import cce.ops.cross_entropy.kernels as K

    real = K.split_plan
    mp.setattr(K, "default_config", lambda dtype, backward: (16, 4, 1))
    mp.setattr(
        K, "split_plan", lambda N, V, block_v, device, **kw: real(N, V, block_v, device, splits=splits)
    )


@pytest.mark.parametrize("splits", [1, 3])
def test_triton_logits_argmax_ties_across_blocks(splits, monkeypatch):
    """Tied largest logits in different 16-class blocks and vocabulary splits: the smallest id."""
    pytest.importorskip("triton")
    _small_blocks(monkeypatch, splits)
    gen = torch.Generator().manual_seed(8)
    x = torch.rand(6, 100, generator=gen)
    ties = [[5, 40, 90], [40, 90], [17, 18], [90, 99], [0, 99], [33, 64, 65]]
    for i, cols in enumerate(ties):
        x[i, cols] = 2.0
    out = cce.cross_entropy(x, torch.zeros(6, dtype=torch.long), impl="triton", return_argmax=True)
    assert out.argmax.tolist() == [cols[0] for cols in ties]


@pytest.mark.parametrize("splits", [1, 3])
def test_triton_logits_masked_blocks(splits, monkeypatch):
    """Logits masked to -inf over whole 16-class blocks, at a row's start, in its middle and over
    a whole vocabulary split: the same loss, lse, entropy, argmax and gradient as the fp64 oracle
    (a program whose first block holds no finite logit used to give NaN)."""
    pytest.importorskip("triton")
    _small_blocks(monkeypatch, splits)
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(3, 48, generator=gen)
    x[0, :20] = float("-inf")
    x[1, 16:32] = float("-inf")
    x[2, 32:] = float("-inf")
    t = torch.tensor([30, 40, 5])
    kw = dict(return_lse=True, return_entropy=True, return_argmax=True, reduction="none")
    xg = x.clone().requires_grad_()
    got = cce.cross_entropy(xg, t, impl="triton", **kw)
    (g,) = torch.autograd.grad(got.loss.sum() + got.entropy.sum(), (xg,))
    ref = cce.reference.cross_entropy_reference(x.double(), t, dtype=torch.float64, **kw)
    for name in ("loss", "lse", "entropy"):
        torch.testing.assert_close(getattr(got, name).double(), getattr(ref, name), rtol=1e-5, atol=1e-5)
    assert torch.equal(got.argmax, ref.argmax)
    # d(loss + H)/dz = p - onehot(t) + p (E_p[z] - z), 0 at the masked classes (the oracle's
    # autograd gives NaN through -inf logits; fp64 with -inf read as -1e4, whose p is 0).
    z = x.double().clamp(min=-1e4)
    p = torch.softmax(z, 1)
    r = p - torch.nn.functional.one_hot(t, 48).double() + p * ((p * z).sum(1, keepdim=True) - z)
    torch.testing.assert_close(g.double(), r, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("V", [8, 45])
def test_logits_minus_inf_under_softcap(impl, V, monkeypatch):
    """Under a softcap a logit of -inf is the class of logit softcap(-inf) = -softcap, as
    F.cross_entropy of the capped logits has it (it does not mask the class; only columns past the
    row's end are masked): the loss with label smoothing, the entropy and the gradient of loss +
    entropy as the fp64 oracle's, with the row's tail in a partial block (V = 45, 16-class
    blocks). Inputs fp32, the oracle fp64 on the same values: 1e-5."""
    if impl == "triton":
        pytest.importorskip("triton")
        _small_blocks(monkeypatch, 1)
    gen = torch.Generator().manual_seed(10)
    x = torch.randn(3, V, generator=gen)
    x[:, 5] = float("-inf")
    t = torch.tensor([1, 2, 7])
    kw = dict(softcap=0.5, label_smoothing=0.1, reduction="none")
    xg = x.clone().requires_grad_()
    got = cce.cross_entropy(xg, t, impl=impl, return_entropy=True, **kw)
    (g,) = torch.autograd.grad(got.loss.sum() + got.entropy.sum(), (xg,))
    xr = x.double().requires_grad_()
    capped = 0.5 * torch.tanh(xr / 0.5)
    logp = capped.log_softmax(1)
    loss = torch.nn.functional.cross_entropy(capped, t, label_smoothing=0.1, reduction="none")
    ent = -(logp.exp() * logp).sum(1)
    (gr,) = torch.autograd.grad(loss.sum() + ent.sum(), (xr,))
    torch.testing.assert_close(got.loss.double(), loss.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.entropy.double(), ent.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(g.double(), gr, rtol=1e-5, atol=1e-6)


def _check_logits_level(problem, inplace, impl):
    lead, _, V, opts, _, ignore, seed = problem
    gen = torch.Generator().manual_seed(seed)
    x0 = torch.randn(*lead, V, generator=gen, dtype=torch.float64) * 3.0
    if impl == "triton":
        x0 = (x0 * 2).round() / 2  # exact in fp32, and ties of the largest logit are frequent
    t = torch.randint(0, V, lead, generator=gen)
    t[torch.rand(lead, generator=gen) < ignore] = -100
    kw = _all_outputs(**opts)

    def fn(x, impl_fn, **k):
        out = impl_fn(x, t, **kw, **k)
        gen_up = torch.Generator().manual_seed(seed)
        ups = {n: torch.randn(getattr(out, n).shape, generator=gen_up, dtype=torch.float64)
               for n in ("loss", *OUTPUTS)}  # fmt: skip
        total = sum((getattr(out, n).double() * u).sum() for n, u in ups.items())
        return out, torch.autograd.grad(total, x)[0], ups

    x = x0.clone().requires_grad_()
    ref, gref, ups = fn(
        x, lambda x, t, **k: cce.reference.cross_entropy_reference(x, t, dtype=torch.float64, **k)
    )
    x1 = x0.float() if impl == "triton" else x0
    xin = (x1.clone().requires_grad_() * 1.0) if inplace else x1.clone().requires_grad_()
    got, ggot, _ = fn(xin, cce.cross_entropy, impl=impl, inplace_backward=inplace)
    out_bound, row = _row_bounds(x0, t, ref, ups, **opts)
    if impl == "triton":  # fp32 sums over V terms, the fp32 gradient's own rounding
        out_bound, row = out_bound * (V + 8) / 8, row * (V + 9) / 8
    for name in ("lse", "logprobs", "entropy"):
        x_, y_ = getattr(got, name), getattr(ref, name)
        assert x_.shape == y_.shape and bool(((x_.double() - y_).abs().reshape(-1) <= out_bound).all()), name
    assert torch.equal(got.argmax, ref.argmax) and float(got.accuracy) == float(ref.accuracy)
    err = (ggot - gref).reshape(-1, V)
    if opts["shift"]:  # the last position of each sequence has no target: its gradient is 0
        err = (ggot - gref)[..., :-1, :].reshape(-1, V)
        assert not (ggot - gref)[..., -1, :].any()
    assert bool((err.norm(dim=1) <= row + 1e-300).all())


@pytest.mark.parametrize(
    "filter_eps,tuning",
    [
        (None, cce.Tuning()),  # the exact backward
        (2.0**-12, cce.Tuning(backward="sparse", dense_slabs=False)),
        pytest.param(
            2.0**-12,
            cce.Tuning(backward="sparse", sparse_min_flops=0, dense_slab_bytes=16 * 64 * 4),
            marks=pytest.mark.slow,  # dense slabs of 16 x 64 classes: many interpreter launches
        ),
    ],
)
def test_triton_logprobs_are_minus_the_loss(filter_eps, tuning):
    """impl="triton" (the interpreter on CPU) gives the log-probabilities at temperature 1: the
    target logit's gradient enters the coefficients (beta -= u). Without smoothing, weights or
    z-loss, logprob = -loss per token, so upstream gradients g (loss), h (lse) and u (logprobs)
    must give the gradients of upstream g - u on the loss and h on lse, through the same kernels
    and the same plan: the coefficients differ only in the order of one fp32 addition
    (g + (h - u) against (g - u) + h), so the gradients agree to a few fp32 units (1e-5
    relative; the gradient through the log-probabilities alone is of the same size). N = 40 (3
    token blocks, the last partial), V = 180 (6 tiles, the last partial) in the interpreter."""
    pytest.importorskip("triton")
    gen = torch.Generator().manual_seed(3)
    N, D, V = 40, 16, 180
    e = torch.randn(N, D, generator=gen) / 2
    c = torch.randn(V, D, generator=gen)
    t = torch.randint(0, V, (N,), generator=gen)
    t[::7] = -100
    g, h, u = (torch.randn(N, generator=gen) for _ in range(3))
    kw = dict(impl="triton", reduction="none", filter_eps=filter_eps, tuning=tuning)

    def grads(up_loss, with_logprobs):
        ee, cc = e.clone().requires_grad_(), c.clone().requires_grad_()
        opts = cce.CCEOptions(return_lse=True, return_logprobs=with_logprobs, **kw)
        out = cce.linear_cross_entropy_with_options(ee, cc, t, None, None, opts)
        loss, lse = out[0], out[1]
        total = (loss * up_loss).sum() + (lse * h).sum()
        if with_logprobs:
            total = total + (out.logprobs * u).sum()
            assert torch.equal(out.logprobs, torch.where(t != -100, -loss, 0.0))
        return torch.autograd.grad(total, (ee, cc))

    got = grads(g, True)
    want = grads(g - u, False)
    for x, y in zip(got, want, strict=True):
        assert rel_err_(x, y) < 1e-5
    # u matters: dropping it changes the gradients by far more than the tolerance
    assert rel_err_(grads(g, False)[0], want[0]) > 1e-2


def rel_err_(a, b):
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


@pytest.mark.parametrize("inplace", [False, True])
def test_triton_logits_logprobs_are_minus_the_loss(inplace):
    """The logits level's Triton row passes (the interpreter on CPU) give the log-probabilities at
    temperature 1; as above, upstream (g, h, u) on (loss, lse, logprobs) equals (g - u, h) on
    (loss, lse) up to the order of one fp32 addition in the coefficients."""
    pytest.importorskip("triton")
    gen = torch.Generator().manual_seed(4)
    N, V = 40, 130
    x0 = torch.randn(N, V, generator=gen) * 3
    t = torch.randint(0, V, (N,), generator=gen)
    t[::6] = -100
    g, h, u = (torch.randn(N, generator=gen) for _ in range(3))

    def grad(up_loss, with_logprobs):
        x = x0.clone().requires_grad_()
        xin = x * 1.0 if inplace else x  # in place only on non-leaf logits
        out = cce.cross_entropy(xin, t, impl="triton", reduction="none", return_lse=True,
                                return_logprobs=with_logprobs, inplace_backward=inplace)  # fmt: skip
        total = (out[0] * up_loss).sum() + (out[1] * h).sum()
        if with_logprobs:
            total = total + (out.logprobs * u).sum()
        return torch.autograd.grad(total, x)[0]

    want = grad(g - u, False)
    assert rel_err_(grad(g, True), want) < 1e-5
    assert rel_err_(grad(g, False), want) > 1e-2


# ---------------------------------------------------------------------------------------------
# impl="triton" at the linear level (the interpreter on CPU)


@st.composite
def exact_logit_problems(draw):
    """Problems whose fp32 logits are exact: e and c hold multiples of 1/2 in [-1.5, 1.5], the
    bias multiples of 1/8, D <= 16 (|z| <= 36 + 1, a multiple of 1/8: exact in fp32), and
    temperatures with an exact inverse. Ties of the largest logit are frequent."""
    N, D, V = draw(st.integers(1, 40)), draw(st.integers(1, 16)), draw(st.integers(1, 90))
    opts = dict(
        temperature=draw(st.sampled_from([0.5, 1.0, 2.0])),
        reduction=draw(st.sampled_from(["mean", "sum", "none"])),
        label_smoothing=draw(st.sampled_from([0.0, 0.1])),
        z_loss=draw(st.sampled_from([0.0, 1e-3])),
        return_lse=True,
        return_logprobs=draw(st.booleans()),
        return_entropy=draw(st.booleans()),
        return_argmax=True,
        return_accuracy=True,
    )
    opts["tuning"] = cce.Tuning(fused=draw(st.booleans()))  # the fused path or the unfused one
    with_bias, ignore = draw(st.booleans()), draw(st.sampled_from([0.0, 0.3, 1.0]))
    return N, D, V, opts, with_bias, ignore, draw(st.integers(0, 2**16))


@settings(max_examples=examples(25, 6))
@given(exact_logit_problems())
def test_triton_outputs_and_gradients_against_oracle(problem):
    """impl="triton" (the interpreter): the temperature, entropy, argmax and accuracy, and the
    gradients through every output, against the fp64 oracle, on inputs whose fp32 logits are
    exact (so the kernels' error is that of their fp32 arithmetic; argmax and accuracy exact).
    The fused path ("mean" / "sum") and the unfused forward with the exact backward.

    Bounds, derived as in the module docstring but for fp32 sums (not fp64 sums rounded once):
    each of s = sum_v e^(z - m), the entropy's sum_v e^(z - m) (z - m) and the gradient products'
    sums over V or D carries a relative error <= (V + 4) u against the sum of its terms'
    magnitudes (one exp2 rounding per term and the summation, u = 2^-24), so
    - outputs: |err| <= 4 (V + 8) u (1 + |lse| + 2 max|z|) (log s, the entropy's
      sum_v p |z - m| <= 2 max|z|, the loss's combinations);
    - gradients: the per-row dZ error bound of the module docstring with (V + 8) u for 8 u, plus
      the fp32 products dE = dZ @ C, dC = dZ^T @ E ((V + D) u of sum_v |dZ_iv| ||c_v||)."""
    pytest.importorskip("triton")
    N, D, V, opts, with_bias, ignore, seed = problem
    gen = torch.Generator().manual_seed(seed)
    # fp32 leaves (the fused path takes fp32 / bf16 operands); the oracle reads them in fp64
    e = (torch.randint(-3, 4, (N, D), generator=gen) / 2).requires_grad_()
    c = (torch.randint(-3, 4, (V, D), generator=gen) / 2).requires_grad_()
    b = (torch.randint(-8, 9, (V,), generator=gen) / 8).requires_grad_() if with_bias else None
    t = torch.randint(0, V, (N,), generator=gen)
    t[torch.rand(N, generator=gen) < ignore] = -100

    def tri(e, c, t, b, **kw):  # (exact: the bound has no filter term)
        opts = cce.CCEOptions(impl="triton", filter_eps=None, **kw)
        return cce.linear_cross_entropy_with_options(e, c, t, b, None, opts)

    got, ggot, ups = _run(tri, e, c, t, b, seed, **opts)
    ref, gref, _ = _run(_oracle, e, c, t, b, seed, **{k: v for k, v in opts.items() if k != "tuning"})
    z = (e.detach() @ c.detach().T + (0.0 if b is None else b.detach())) / opts["temperature"]
    zmax = z.abs().amax(1)
    lse = torch.logsumexp(z, 1).abs()
    u = U32 * (V + 8)
    out_bound = 4 * u * (1 + lse + 2 * zmax)
    for name in ("lse", "logprobs", "entropy"):
        x, y = getattr(got, name), getattr(ref, name)
        if not opts[f"return_{name}"]:
            assert x is None
            continue
        assert x.dtype == torch.float32 and x.shape == y.shape, name
        assert bool(((x.double() - y).abs() <= out_bound).all()), name
    loss_err = (got.loss.double() - ref.loss).abs()
    loss_bound = out_bound * (1 + opts["z_loss"] * lse)
    assert bool((loss_err <= (loss_bound if opts["reduction"] == "none" else loss_bound.sum())).all())
    assert got.argmax.dtype == torch.int64 and torch.equal(got.argmax, ref.argmax)
    assert float(got.accuracy) == float(ref.accuracy)
    bound_opts = {k: v for k, v in opts.items() if not k.startswith("return_") and k != "tuning"}
    ref_ent = ref if opts["return_entropy"] else ref._replace(entropy=torch.zeros(N, dtype=torch.float64))
    _, grad_bound = _bounds(e, c, t, b, ref_ent, ups, **bound_opts)
    widen = (V + 8) / 8 + (V + D) / 8
    for name, g, r in zip(("e", "c", "bias"), ggot, gref, strict=False):
        assert float((g - r).norm()) <= widen * grad_bound[name] + 1e-300, name


def test_triton_outputs_keep_the_sparse_backward(monkeypatch):
    """Asking for the entropy and argmax keeps the sparse backward of a training step whose
    gradient reaches only the loss (and lse): the forward gathers its tile statistics and forms
    the outputs in the same walk (the target, kept out of the walk's maxima, enters the entropy
    and the argmax from its own logit), and the gradients equal the same step's without the
    outputs bit for bit. A gradient reaching the entropy stays on the sparse backward too (its
    term eta p z in dZ, triton_backward.sparse_backward): at this size every tile is kept (or in
    a dense slab), so its dZ is formed exactly and the gradients are within fp32 arithmetic of
    the oracle (~1e-6 relative, as the oracle test's bound); the skipped tiles' term is tested in
    tests/ops/linear_ce/test_triton_sparse.py. Exact fp32 logits (as there), so argmax and
    accuracy are exact."""
    pytest.importorskip("triton")
    import cce.ops.linear_ce.triton_impl as ti

    gen = torch.Generator().manual_seed(7)
    N, D, V = 48, 12, 300
    e = (torch.randint(-3, 4, (N, D), generator=gen) / 2).requires_grad_()
    c = (torch.randint(-3, 4, (V, D), generator=gen) / 2).requires_grad_()
    t = torch.randint(0, V, (N,), generator=gen)
    t[::5] = -100
    t[1] = int((e[1] @ c.T).argmax())  # a row whose target is its argmax
    sparse = cce.Tuning(backward="sparse", sparse_min_flops=0, fused=False)
    calls = []
    for name in ("linear_ce_triton_bwd", "linear_ce_triton_bwd_sparse"):
        real = getattr(ti, name)
        monkeypatch.setattr(ti, name, lambda *a, _r=real, _n=name: calls.append(_n) or _r(*a))

    def run(up_entropy: float, **outputs):
        opts = cce.CCEOptions(impl="triton", filter_eps=2.0**-12, tuning=sparse, return_lse=True, **outputs)
        out = cce.linear_cross_entropy_with_options(e, c, t, None, None, opts)
        total = out[0] + 0.3 * out[1].sum()
        if up_entropy:
            total = total + up_entropy * out.entropy.sum()
        return out, torch.autograd.grad(total, (e, c))

    _, g_plain = run(0.0)
    assert calls == ["linear_ce_triton_bwd_sparse"]
    kw = dict(return_entropy=True, return_argmax=True, return_accuracy=True)
    got, g_got = run(0.0, **kw)
    assert calls[1:] == ["linear_ce_triton_bwd_sparse"]
    assert all(torch.equal(x, y) for x, y in zip(g_got, g_plain, strict=True))
    ref = linear_cross_entropy_reference(e.double(), c.double(), t, dtype=torch.float64, **kw)
    z = e.detach().double() @ c.detach().double().T
    bound = 4 * U32 * (V + 8) * (1 + z.logsumexp(1).abs() + 2 * z.abs().amax(1))
    valid = t != -100
    assert bool(((got.entropy.double() - ref.entropy).abs()[valid] <= bound[valid]).all())
    assert torch.equal(got.argmax, ref.argmax) and float(got.accuracy) == float(ref.accuracy) > 0
    _, g_ent = run(0.5, **kw)
    assert calls[2:] == ["linear_ce_triton_bwd_sparse"]
    e64, c64 = e.detach().double().requires_grad_(), c.detach().double().requires_grad_()
    r = linear_cross_entropy_reference(e64, c64, t, dtype=torch.float64, return_lse=True, **kw)
    g_ref = torch.autograd.grad(
        r.loss + 0.3 * r.lse.sum() + 0.5 * r.entropy.sum(), (e64, c64), retain_graph=True
    )
    g_no = torch.autograd.grad(r.loss + 0.3 * r.lse.sum(), (e64, c64))
    for x, y, y0 in zip(g_ent, g_ref, g_no, strict=True):
        assert rel_err_(x.double(), y) < 1e-5
        assert rel_err_(y0, y) > 0.1  # the entropy's term is a large part of the gradient here


@pytest.mark.slow
def test_triton_walks_several_tiles_per_split(monkeypatch):
    """A problem with several vocabulary tiles per program (the interpreter's 32-class tiles, 8
    "SMs": 13 token blocks of 16 share 64 programs, so about 4 of the 22 tiles each; the fused
    path's row kernel walks a row in 32-class blocks, spy-checked to run): the running
    entropy accumulator is rescaled inside a program and ties of the largest logit meet across
    tiles of one program (duplicated classifier rows at ids 40 and 70, tiles 1 and 2) as well as
    across programs (id 600). Exact fp32 logits (as above): argmax exact; the entropy within the
    bound above."""
    pytest.importorskip("triton")
    gen = torch.Generator().manual_seed(6)
    N, D, V = 200, 8, 700
    e = (torch.randint(0, 4, (N, D), generator=gen) / 2).float()
    c = (torch.randint(-3, 4, (V, D), generator=gen) / 2).float()
    c[40] = c[70] = c[600] = 1.5  # the largest logit of every row (e >= 0), three times
    c[:, 0] += (torch.arange(V) % 5 == 1).float() * 0.5  # other ties elsewhere
    t = torch.randint(0, V, (N,), generator=gen)
    e[: N // 2, :] += (torch.arange(D) == 0).float() * 2  # rows whose max is elsewhere
    z = e.double() @ c.double().T
    p = torch.softmax(z, 1)
    H = -(p * torch.log_softmax(z, 1)).sum(1)
    bound = 4 * U32 * (V + 8) * (1 + z.logsumexp(1).abs() + 2 * z.abs().amax(1))
    import cce.ops.linear_ce.triton_impl as ti

    fused = []
    real = ti.linear_ce_triton_fused
    monkeypatch.setattr(ti, "linear_ce_triton_fused", lambda *a: fused.append(1) or real(*a))
    # the forward alone, and a training step's fused path (its row kernel walks 32-class blocks)
    for grad in (False, True):
        ee = e.clone().requires_grad_(grad)
        opts = cce.CCEOptions(impl="triton", filter_eps=None, return_entropy=True, return_argmax=True)
        out = cce.linear_cross_entropy_with_options(ee, c, t, None, None, opts)
        assert torch.equal(out.argmax, z.argmax(1)) and int((out.argmax == 40).sum()) > N // 4
        assert bool(((out.entropy.double() - H).abs() <= bound).all())
        assert len(fused) == int(grad)


def test_triton_fp16_entropy_gradient_scale():
    """fp16 operands store dZ times 1 / max_i b_i, b_i a bound of row i's max |dZ|
    (backward_exact.fp16_dz_bound). With a gradient on the entropy alone alpha_i = delta_i E_p[z]
    can be far below |eta_i p z|: logits +-2^-20 (two classes) give E_p[z] ~ 2^-40, and a scale
    from alpha alone overflows fp16. The gradient equals the fp64 oracle's on the same fp16-valued
    inputs up to dZ's one rounding to fp16, relative 2^-11 or absolute 2^-25 of the scaled value
    (fp16's subnormal spacing is 2^-24): |dZ err| <= 2^-11 |dZ| + 2^-25 s, s the scale, so
    ||dE err|| <= || (2^-11 |dZ| + 2^-25 s) @ |C| ||, twice that for slack."""
    pytest.importorskip("triton")
    from cce.ops.linear_ce.kernels.backward_exact import fp16_dz_bound

    gen = torch.Generator().manual_seed(5)
    for tiny in (False, True):
        N, D, V = (24, 16, 70) if not tiny else (12, 4, 2)
        e = torch.randn(N, D, generator=gen) / 2
        c = torch.randn(V, D, generator=gen)
        if tiny:
            e = torch.full((N, D), 2.0**-22) * torch.randn(N, 1, generator=gen).sign()
            c = torch.tensor([[1.0] * D, [-1.0] * D])
        e, c = e.half().requires_grad_(), c.half()
        t = torch.randint(0, V, (N,), generator=gen)
        out = cce.linear_cross_entropy(e, c, t, impl="triton", return_entropy=True, reduction="none")
        (ge,) = torch.autograd.grad(out.entropy.sum(), (e,))
        e64, c64 = e.detach().double().requires_grad_(), c.double()
        ref = linear_cross_entropy_reference(e64, c64, t, return_entropy=True, dtype=torch.float64)
        (gref,) = torch.autograd.grad(ref.entropy.sum(), (e64,))
        z = (e64 @ c64.T).detach().requires_grad_()
        lp = torch.log_softmax(z, 1)
        (dz,) = torch.autograd.grad(-(lp.exp() * lp).sum(), (z,))
        lse, H = z.detach().logsumexp(1), ref.entropy.detach()
        ones = torch.ones_like(lse)
        scale = float(fp16_dz_bound(ones * (lse - H), -ones, lse, H).amax())
        per_entry = 2.0**-11 * dz.abs() + 2.0**-25 * scale
        bound = 2 * float((per_entry @ c64.abs()).norm())
        assert bool(torch.isfinite(ge).all()), tiny
        assert float((ge.double() - gref).norm()) <= bound, tiny


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("mask", ["scattered", "whole-tiles"])
def test_linear_minus_inf_bias_masks_classes(impl, fused, temperature, mask):
    """A bias of -inf masks classes (a padded vocabulary): the entropy counts 0 log 0 = 0 there
    and the gradient of loss - entropy is finite, equal to the fp64 oracle's, 0 at the masked
    classes; on the fused path (the entropy in its forward) and on the forward kernel with the
    exact backward (its dZ kernel's eta term). Every 7th class, or whole vocabulary tiles: the
    first two and the last ones (the interpreter's 32-class tiles), so that a tile walk starts
    on tiles with no finite logit (its running max -inf). V is a multiple of every tile width,
    so no column mask hides the masked classes. Inputs exact in fp32 (the oracle reads the same
    values in fp64): fp32 kernels err on a logit by at most D u max_i ||e_i|| max_v ||c_v|| < 2e-5
    here (u = 2^-24), the outputs by twice that times 1 + |z| at most (atol, rtol 1e-5; the torch
    impl runs fp64), and the gradients, sums of such dZ against ||c|| or ||e|| ~ 4, within rtol
    1e-4, atol 1e-5."""
    if impl == "triton":
        pytest.importorskip("triton")
    gen = torch.Generator().manual_seed(5)
    N, D, V = 12, 16, 512
    e = torch.randn(N, D, generator=gen).double()
    c = (torch.randn(V, D, generator=gen) / 2).double()
    b = torch.randn(V, generator=gen).double()
    if mask == "scattered":
        b[3::7] = float("-inf")
    else:
        b[:64] = b[-96:] = float("-inf")
    allowed = (b > float("-inf")).nonzero().squeeze(1)
    t = allowed[torch.randint(0, allowed.numel(), (N,), generator=gen)]  # no target masked (loss inf)
    t[5] = -100
    kw = dict(return_entropy=True, return_logprobs=True, return_argmax=True, temperature=temperature)
    fn = tuned(fused=fused)
    dtype = torch.float32 if impl == "triton" else torch.float64  # interpreter: fp32 kernels

    def run(f, **k):
        leaves = [x.to(dtype).clone().requires_grad_() for x in (e, c, b)]
        out = f(*leaves[:2], t, leaves[2], **kw, **k)
        r = torch.linspace(-1, 1, N, dtype=torch.float64)
        total = out.loss.double() - (out.entropy.double() * r).sum() + out.logprobs.double().sum()
        return out, torch.autograd.grad(total, leaves)

    got, g1 = run(fn, impl=impl, filter_eps=None)
    ref, g2 = run(lambda *a, **k: linear_cross_entropy_reference(*a, dtype=torch.float64, **k))
    for name in ("loss", "entropy", "logprobs"):
        x = getattr(got, name)
        assert torch.isfinite(x).all(), name
        torch.testing.assert_close(x.double(), getattr(ref, name), rtol=1e-5, atol=1e-5)
    assert torch.equal(got.argmax, ref.argmax)
    for a, r_ in zip(g1, g2, strict=True):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a.double(), r_.double(), rtol=1e-4, atol=1e-5)
    assert (g1[2][b == float("-inf")] == 0).all()  # no gradient reaches a masked class


def test_torch_logits_masked_classes():
    """impl="torch" at the logits level: -inf logits (masked classes) give the oracle's entropy
    and a finite gradient of loss + entropy, 0 at the masked classes (fp64 inputs; the per-row
    statistics are kept in fp32: 8 u relative, the module docstring's bound, within 1e-6)."""
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(3, 48, generator=gen, dtype=torch.float64)
    x[:, 5::6] = float("-inf")
    t = torch.tensor([30, 40, 4])
    kw = dict(return_entropy=True, reduction="none")
    xg = x.clone().requires_grad_()
    got = cce.cross_entropy(xg, t, impl="torch", **kw)
    (g,) = torch.autograd.grad(got.loss.sum() + got.entropy.sum(), (xg,))
    xr = x.clone().requires_grad_()
    ref = cce.reference.cross_entropy_reference(xr, t, dtype=torch.float64, **kw)
    (gr,) = torch.autograd.grad(ref.loss.sum() + ref.entropy.sum(), (xr,))
    torch.testing.assert_close(got.entropy.double(), ref.entropy, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(g, gr, rtol=1e-6, atol=1e-7)
    assert torch.isfinite(g).all() and (g[:, 5::6] == 0).all()
