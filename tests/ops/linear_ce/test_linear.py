"""cce.linear_cross_entropy (impl="torch") against the fp64 oracle, properties and edge cases.

Tolerances (all derived, none tuned to the implementation). The oracle computes in fp64 from
the *same* input values (a bf16 tensor converts to fp64 exactly; its gradients are kept in fp64),
so every difference is the implementation's own rounding. The CPU implementation computes in fp32
(fp64 for fp64 inputs), unit roundoff u. check_against_oracle bounds it from the data, worst case:

* logit error: a logit is a length-D dot product plus a bias (then softcap):
  |dL| <= logit_err = D u max_iv sum_d |e_id c_vd| + u (max|z| + max|b| + softcap).
* accumulation: every sum has at most n = V + D + N terms; its relative error against the sum of
  its terms' magnitudes is <= gamma_n ~ n u (+ 16 u for exp / log / division): acc_rel. fp64
  inputs add u_fp32 (8 + 2 max|lse|): the Triton kernels compute them in fp32 (loss and lse
  fp32, the backward's softmax rebuilt from the fp32 lse); impl="torch" keeps fp64.
* loss: per token, the terms combined (w (lse - tgt), smoothing, z lse^2) have magnitude
  s_i = 1 + w_max (1 + |lse| + max|L|) + z lse^2; a logit error moves the loss by <= 3 s_i
  logit_err. Bound: (acc_rel + 4 logit_err) * s, s reduced like the loss (relative to what
  cancels, not to the possibly tiny result).
* gradients: each entry of dE = dZ C, dC = dZ^T E, dbias = colsum dZ is a sum whose terms'
  magnitudes add up to the entry of |dZ| |C| (etc.), |dZ| being the sum of the magnitudes of the
  three terms an implementation adds (alpha p, beta onehot, gamma w; cce/_math.py; they cancel
  exactly for V = 1). A logit error moves p relatively by <= 2 logit_err and softcap' by
  <= 2 logit_err / softcap. Bound: ||got - ref||_F <= (u_grad + acc_rel + (4 + 4/softcap)
  logit_err) * || |dZ||C| ||_F, u_grad the unit roundoff of the gradient's storage dtype (one final
  rounding: bf16 2^-8, fp16 2^-11; fp16 subnormals add 2^-25 per entry). With softcap, the
  derivative 1 - tanh^2 computed from a rounded tanh is off by <= 3 u absolutely: add 3 u times
  the same norm computed without the softcap' factor.
* filtering (filter_eps > 0) adds the proven bound of helpers.filter_error_bounds.

Property tests compare the implementation with itself (two runs, each within the budget of
the exact value): twice the budget.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import (
    UNIT_ROUNDOFF,
    abs_logit_grad_terms,
    examples,
    filter_error_bounds,
    grad_error_scales,
    make_linear_inputs,
    make_weight,
    problem_rows,
    reference_logit_grad,
    rel_err,
    row_terms,
    run_with_upstream,
    tuned,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cce
from cce.options import CCEOptions
from cce.reference import linear_cross_entropy_reference

IMPL = "torch"


SETTINGS = settings(
    max_examples=examples(80, 15),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def cce_fn(e, c, t, b=None, **kw):
    return cce.linear_cross_entropy(e, c, t, b, impl=IMPL, **kw)


def ref_fn(e, c, t, b=None, **kw):
    return linear_cross_entropy_reference(e, c, t, b, dtype=torch.float64, **kw)


def fp64_leaves(*xs):
    """fp64 leaf copies (same requires_grad): the oracle's gradients then stay unrounded in fp64
    instead of being rounded to the input dtype by autograd's cast."""
    return [None if x is None else x.detach().double().requires_grad_(x.requires_grad) for x in xs]


def run_reference(e, c, t, b, *, seed, **kw):
    e64, c64, b64 = fp64_leaves(e, c, b)
    return run_with_upstream(ref_fn, e64, c64, t, b64, seed=seed, **kw)


def loss_scale(e, c, t, b, weight, **opts):
    """Per-token magnitude of the terms the loss combines (fp64), reduced like the loss."""
    reduction = opts.get("reduction", "mean")
    shift, softcap = opts.get("shift", False), opts.get("softcap")
    _, L, _, tt = problem_rows(e, c, t, b, shift=shift, softcap=softcap)
    valid = tt != opts.get("ignore_index", -100)
    if L.shape[0] == 0:
        s = torch.zeros(0, dtype=torch.float64)
    else:
        lse = torch.logsumexp(L, -1)
        wmax = 1.0 if weight is None else float(weight.abs().max())
        s = 1 + wmax * (1 + lse.abs() + L.abs().amax(-1)) + opts.get("z_loss", 0.0) * lse * lse
        s = torch.where(valid, s, 0.0)
    out_shape = (t[..., 1:] if shift else t).shape
    if reduction == "none":
        return s.reshape(out_shape)
    if reduction == "sum":
        return s.sum()
    if weight is None:
        den = valid.sum().double()
    else:
        den = torch.where(valid, weight.double()[torch.where(valid, tt, 0)], 0.0).sum()
    return s.sum() / (den if den != 0 else 1.0)


def rounding_budget(e, c, t, b, **opts):
    """(acc_rel, logit_err) of the module doc for these inputs."""
    fp64 = e.dtype == torch.float64
    u = 2.0**-53 if fp64 else 2.0**-24
    shift, softcap = opts.get("shift", False), opts.get("softcap")
    E, L, z, _ = problem_rows(e, c, t, b, shift=shift, softcap=softcap)
    V, D = c.shape
    acc_rel = (V + D + E.shape[0] + 16) * u
    if E.shape[0] == 0:
        return acc_rel, 0.0
    if fp64:
        # The Triton kernels keep the loss and the lse in fp32, and the backward rebuilds the
        # softmax as exp(L - lse) from the saved fp32 lse: relative error u_fp32 (1 + |lse|) in p
        # (impl="torch" computes fp64 inputs in fp64: the bound holds a fortiori).
        acc_rel += 2.0**-24 * (8 + 2 * float(torch.logsumexp(L, -1).abs().max()))
    prod = float((E.abs() @ c.detach().double().abs().T).max())
    bmax = 0.0 if b is None else float(b.detach().double().abs().max())
    logit_err = D * u * prod + u * (float(z.abs().max()) + bmax + (softcap or 0.0))
    return acc_rel, logit_err


def lse_tolerance(e, c, t, b, acc_rel, logit_err, **opts):
    """Bound on |lse_got - lse_exact| per problem row (module doc)."""
    _, L, _, _ = problem_rows(e, c, t, b, shift=opts.get("shift", False), softcap=opts.get("softcap"))
    if L.shape[0] == 0:
        return torch.zeros(0, dtype=torch.float64)
    return (acc_rel + logit_err) * (1 + torch.logsumexp(L, -1).abs() + L.abs().amax(-1))


def error_budget(e, c, t, b, up_loss, up_lse, *, weight=None, **opts):
    """Rounding bounds of the module doc: {"loss": per loss entry, "lse": per token (or None),
    "e" / "c" / "bias": Frobenius bound on the gradient, before the storage rounding (u_grad) and
    the filter bound}."""
    acc_rel, logit_err = rounding_budget(e, c, t, b, **opts)
    out = {"loss": (acc_rel + 4 * logit_err) * loss_scale(e, c, t, b, weight, **opts), "lse": None}
    if up_lse is not None:
        out["lse"] = lse_tolerance(e, c, t, b, acc_rel, logit_err, **opts).reshape(up_lse.shape)
    dz = reference_logit_grad(e, c, t, b, up_loss, up_lse, weight=weight, **opts).abs()
    dz = dz + abs_logit_grad_terms(e, c, t, b, up_loss, up_lse, weight=weight, **opts)
    scales = grad_error_scales(e, c, t, b, dz, shift=opts.get("shift", False))
    sc_factor = 4 + 4 / opts["softcap"] if opts.get("softcap") else 4
    out.update({k: (acc_rel + sc_factor * logit_err) * v for k, v in scales.items()})
    if opts.get("softcap"):
        # softcap' = 1 - tanh^2 from a rounded tanh errs by <= 3 u absolutely, not relative to
        # softcap' (which is tiny where |z| >> softcap): 3 u times the terms before softcap'.
        raw = abs_logit_grad_terms(
            e, c, t, b, up_loss, up_lse, weight=weight, times_softcap_grad=False, **opts
        )
        u = 2.0**-53 if e.dtype == torch.float64 else 2.0**-24
        raw_scales = grad_error_scales(e, c, t, b, raw, shift=opts.get("shift", False))
        out.update({k: out[k] + 3 * u * raw_scales[k] for k in scales})
    out.update({k + "_scale": v for k, v in scales.items()})
    return out


def check_against_oracle(e, c, t, b, *, weight=None, seed=0, fn=None, **opts):
    """Runs cce (``fn``, default cce_fn) and the oracle under the same random upstream gradients
    and asserts the bounds."""
    dtype = e.dtype
    got = run_with_upstream(fn or cce_fn, e, c, t, b, seed=seed, weight=weight, **opts)
    ref = run_reference(e, c, t, b, seed=seed, weight=weight, **opts)
    loss, lse, grads, up_loss, up_lse = got
    rloss, rlse, rgrads, _, _ = ref

    # Output contract: fp32 loss (and lse), fp64 for fp64 inputs where impl="torch" computes them
    # (the exact dtypes per impl: tests/test_autograd_uses.py::test_float64_dtypes); shapes like
    # the oracle's.
    out_dtypes = (torch.float32, torch.float64) if dtype == torch.float64 else (torch.float32,)
    assert loss.dtype in out_dtypes
    assert loss.shape == rloss.shape
    budget = error_budget(e, c, t, b, up_loss, up_lse, weight=weight, **opts)
    err = (loss.double() - rloss).abs()
    assert not torch.isnan(loss).any()
    assert bool((err <= budget["loss"]).all()), (
        f"loss error {err.max().item():.3g} > {budget['loss'].max().item():.3g}"
    )
    if lse is not None:
        assert lse.dtype == loss.dtype and lse.shape == rlse.shape
        lerr = (lse.double() - rlse).abs()
        assert bool((lerr <= budget["lse"]).all()), f"lse error {lerr.max().item():.3g}"

    # Gradients.
    eps = CCEOptions(filter_eps=opts.get("filter_eps", "auto")).resolved_filter_eps(
        dtype, opts.get("impl", IMPL)
    )
    fb = filter_error_bounds(e, c, t, b, up_loss, up_lse, eps, weight=weight, **opts)
    for name, x in (("e", e), ("c", c), ("bias", b)):
        if x is None:
            continue
        if not x.requires_grad:
            assert name not in grads
            continue
        g, rg = grads[name], rgrads[name]
        assert g is not None, f"no gradient for {name}"
        assert g.dtype == x.dtype and g.shape == x.shape, (name, g.dtype, g.shape)
        assert torch.isfinite(g).all(), f"non-finite gradient for {name}"
        tol = budget[name] + UNIT_ROUNDOFF[x.dtype] * budget[name + "_scale"] + fb[name]
        # fp16 gradients below 2^-14 are subnormal: absolute spacing 2^-24 per entry.
        tol += math.sqrt(g.numel()) * 2.0**-25 if x.dtype == torch.float16 else 0.0
        diff = float((g.double() - rg.double()).norm())
        assert diff <= tol + 1e-30, (
            f"d{name}: ||got - ref|| = {diff:.3g} > tol {tol:.3g} (rel err {rel_err(g, rg):.3g}, "
            f"filter bound {fb[name]:.3g})"
        )
    return got, ref


# --------------------------------------------------------------------------------------------
# Hypothesis: random shapes x dtypes x every option
# --------------------------------------------------------------------------------------------


@st.composite
def problems(draw, dtypes=(torch.float32, torch.bfloat16, torch.float16, torch.float64)):
    nlead = draw(st.integers(1, 3))
    lead = tuple(draw(st.integers(1, 5)) for _ in range(nlead))
    # D and V not multiples of any block size; V also below every block (1..7) and above the CPU
    # filter's 128-wide vocabulary block (so several filter blocks, the last one partial).
    D = draw(st.integers(1, 100))
    V = draw(st.one_of(st.integers(1, 7), st.integers(8, 300)))
    opts = dict(
        reduction=draw(st.sampled_from(["mean", "sum", "none"])),
        shift=draw(st.booleans()) if lead[-1] >= 2 else False,
        softcap=draw(st.one_of(st.none(), st.floats(0.5, 30.0))),
        label_smoothing=draw(st.sampled_from([0.0, 0.0, 0.1, 0.37, 1.0])),
        z_loss=draw(st.sampled_from([0.0, 0.0, 1e-4, 0.1])),
        return_lse=draw(st.booleans()),
        filter_eps=draw(st.sampled_from(["auto", "auto", None, 2.0**-10, 0.05])),
        ignore_index=draw(st.sampled_from([-100, -100, -1, 0])),
    )
    return dict(
        lead=lead,
        D=D,
        V=V,
        dtype=draw(st.sampled_from(dtypes)),
        bias=draw(st.booleans()),
        weight=draw(st.booleans()),
        ignore_frac=draw(st.sampled_from([0.0, 0.2, 0.6])),
        scale=draw(st.sampled_from([1.0, 4.0, 16.0])),
        needs=draw(st.sampled_from(["all", "all", "no_e", "no_c"])),
        seed=draw(st.integers(0, 2**16)),
        opts=opts,
    )


def build(p):
    gen = torch.Generator().manual_seed(p["seed"])
    e, c, t, b = make_linear_inputs(
        p["lead"],
        p["D"],
        p["V"],
        p["dtype"],
        bias=p["bias"],
        ignore_frac=p["ignore_frac"],
        ignore_index=p["opts"]["ignore_index"],
        scale=p["scale"],
        generator=gen,
    )
    w = make_weight(p["V"], gen) if p["weight"] else None
    if p["needs"] == "no_e":
        e.requires_grad_(False)
    elif p["needs"] == "no_c":
        c.requires_grad_(False)
    return e, c, t, b, w


@SETTINGS
@given(p=problems())
def test_matches_oracle(p):
    e, c, t, b, w = build(p)
    check_against_oracle(e, c, t, b, weight=w, seed=p["seed"], **p["opts"])


@settings(SETTINGS, max_examples=examples(15, 5))
@given(p=problems(dtypes=(torch.float32,)), k=st.floats(-20.0, 20.0))
def test_constant_logit_shift_changes_nothing(p, k):
    """softmax(L + k) = softmax(L): a constant bias changes neither loss nor gradients.

    Not with softcap (it is not shift-invariant), z_loss or the lse output (both see lse + k)."""
    opts = dict(p["opts"], softcap=None, z_loss=0.0, return_lse=False, filter_eps=None)
    e, c, t, _, w = build(dict(p, bias=False))
    kb = torch.full((p["V"],), k)
    l0, _, g0, _, _ = run_with_upstream(cce_fn, e, c, t, None, seed=1, weight=w, **opts)
    l1, _, g1, up, _ = run_with_upstream(cce_fn, e, c, t, kb, seed=1, weight=w, **opts)
    # Each side is within the rounding budget of the exact value (the budget with the bias k
    # covers the larger logits), so they differ by at most twice that.
    budget = error_budget(e, c, t, kb, up, None, weight=w, **opts)
    assert bool(((l1 - l0).abs() <= 2 * budget["loss"]).all())
    for name in g0:
        assert float((g1[name] - g0[name]).double().norm()) <= 2 * budget[name] + 1e-30, name


@settings(SETTINGS, max_examples=examples(15, 5))
@given(p=problems(dtypes=(torch.float32,)), perm_seed=st.integers(0, 1000))
def test_vocabulary_permutation_changes_nothing(p, perm_seed):
    """Relabelling the classes (c, bias, weight permuted, targets remapped) changes nothing, and
    the class gradients are permuted alike. Exact math (filter_eps=None): the filter's vocabulary
    tiles are deliberately not permutation invariant."""
    opts = dict(p["opts"], filter_eps=None)
    e, c, t, b, w = build(dict(p, needs="all"))
    V = p["V"]
    perm = torch.randperm(V, generator=torch.Generator().manual_seed(perm_seed))
    inv = torch.argsort(perm)  # new id of old class v
    valid = t != opts["ignore_index"]
    # The ignore_index may itself be a class id (0): keep ignored positions as they are and
    # check that no remapped real target collides with it.
    t2 = torch.where(valid, inv[torch.where(valid, t, 0)], t)
    if bool((t2[valid] == opts["ignore_index"]).any()):
        return
    c2 = c.detach()[perm].clone().requires_grad_()
    b2 = None if b is None else b.detach()[perm].clone().requires_grad_()
    w2 = None if w is None else w[perm]
    l0, s0, g0, up, uplse = run_with_upstream(cce_fn, e, c, t, b, seed=2, weight=w, **opts)
    l1, s1, g1, _, _ = run_with_upstream(cce_fn, e, c2, t2, b2, seed=2, weight=w2, **opts)
    # Same math, different summation order: each side within the rounding budget of the exact
    # value, so they differ by at most twice that.
    budget = error_budget(e, c, t, b, up, uplse, weight=w, **opts)
    assert bool(((l1 - l0).abs() <= 2 * budget["loss"]).all())
    if s0 is not None:
        assert bool(((s1 - s0).abs() <= 2 * budget["lse"]).all())
    back = {"e": g1["e"], "c": g1["c"][inv]}
    if b is not None:
        back["bias"] = g1["bias"][inv]
    for name, g in back.items():
        assert float((g - g0[name]).double().norm()) <= 2 * budget[name] + 1e-30, name


@settings(SETTINGS, max_examples=examples(20, 6))
@given(p=problems(dtypes=(torch.float32, torch.bfloat16)))
def test_reductions_agree(p):
    """sum == none.sum(); mean == sum / n_valid (sum of target weights with class weights)."""
    opts = dict(p["opts"], return_lse=False)
    e, c, t, b, w = build(p)
    with torch.no_grad():
        none = cce_fn(e, c, t, b, weight=w, **dict(opts, reduction="none"))
        total = cce_fn(e, c, t, b, weight=w, **dict(opts, reduction="sum"))
        mean = cce_fn(e, c, t, b, weight=w, **dict(opts, reduction="mean"))
    tt = t[..., 1:] if opts["shift"] else t
    valid = tt != opts["ignore_index"]
    if w is None:
        n_valid = float(valid.sum())
    else:
        n_valid = float(torch.where(valid, w[torch.where(valid, tt, 0)], 0.0).sum())
    # fp32 sums of n <= 125 terms: error <= n u * sum |terms|.
    tol = 125 * 2.0**-24 * float(none.abs().sum()) + 1e-30
    assert abs(float(total) - float(none.double().sum())) <= tol
    expect = float(total) / n_valid if n_valid != 0 else 0.0
    assert abs(float(mean) - expect) <= tol / max(n_valid, 1e-30) + 2.0**-23 * abs(expect)


@settings(SETTINGS, max_examples=examples(20, 6))
@given(p=problems(dtypes=(torch.float32, torch.float16)))
def test_ignored_tokens_contribute_nothing(p):
    """Ignored tokens: loss exactly 0, lse 0, and exactly zero dE rows (also, with shift, the last
    position of each sequence, which predicts nothing)."""
    opts = dict(p["opts"], reduction="none", return_lse=True)
    e, c, t, b, w = build(dict(p, needs="all", ignore_frac=0.5))
    loss, lse, grads, _, _ = run_with_upstream(cce_fn, e, c, t, b, seed=3, weight=w, **opts)
    tt = t[..., 1:] if opts["shift"] else t
    ign = tt == opts["ignore_index"]
    assert bool((loss[ign] == 0).all()) and bool((lse[ign] == 0).all())
    dE = grads["e"]
    unused = t == opts["ignore_index"] if not opts["shift"] else None
    if opts["shift"]:
        # e[..., j, :] predicts t[..., j + 1]; e[..., -1, :] predicts nothing.
        unused = torch.ones_like(t, dtype=torch.bool)
        unused[..., :-1] = ign
    assert bool((dE[unused] == 0).all())


@settings(SETTINGS, max_examples=examples(20, 6))
@given(p=problems(dtypes=(torch.float32, torch.bfloat16)))
def test_lse_bounds(p):
    """max_v L_iv <= lse_i <= max_v L_iv + log V for every valid token."""
    opts = dict(p["opts"], return_lse=True, reduction="none")
    e, c, t, b, w = build(p)
    with torch.no_grad():
        _, lse = cce_fn(e, c, t, b, weight=w, **opts)
    _, L, _, tt = problem_rows(e, c, t, b, shift=opts["shift"], softcap=opts["softcap"])
    valid = tt != opts["ignore_index"]
    if not bool(valid.any()):
        return
    m = L.amax(-1)[valid]
    got = lse.reshape(-1)[valid].double()
    slack = lse_tolerance(e, c, t, b, *rounding_budget(e, c, t, b, **opts), **opts)[valid]
    assert bool((got >= m - slack).all())
    assert bool((got <= m + math.log(p["V"]) + slack).all())


# --------------------------------------------------------------------------------------------
# Edge cases
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_all_ignored(dtype, reduction):
    e, c, t, b = make_linear_inputs((3, 4), 19, 11, dtype, bias=True, ignore_frac=1.0)
    assert bool((t == -100).all())
    out = cce_fn(e, c, t, b, reduction=reduction, return_lse=True)
    loss, lse = out
    assert loss.dtype == torch.float32
    assert bool((loss == 0).all()) and bool((lse == 0).all())
    (loss.sum() + lse.sum()).backward()
    for x in (e, c, b):
        assert x.grad is not None and x.grad.dtype == dtype
        assert bool((x.grad == 0).all()), "all-ignored batch must give zero (not NaN) gradients"


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("lead", [(0,), (3, 0)])
def test_empty_batch(reduction, lead):
    """No tokens: loss 0.0 (mean / sum) or an empty per-token loss, zero gradients of every input's
    shape (like F.cross_entropy on empty logits, except mean is 0 instead of NaN)."""
    e, c, t, b = make_linear_inputs(lead, 13, 9, bias=True)
    loss = cce_fn(e, c, t, b, reduction=reduction)
    assert loss.dtype == torch.float32
    assert loss.shape == (lead if reduction == "none" else ())
    if reduction != "none":
        assert float(loss.detach()) == 0.0
    loss.sum().backward()
    assert bool((c.grad == 0).all()) and bool((b.grad == 0).all())
    assert e.grad is not None and e.grad.shape == e.shape


@pytest.mark.parametrize("lead", [(1,), (1, 1), (1, 1, 1)])
def test_one_token(lead):
    e, c, t, b = make_linear_inputs(lead, 23, 5, bias=True, ignore_frac=0.0)
    check_against_oracle(e, c, t, b, reduction="mean")
    e, c, t, b = make_linear_inputs(lead, 23, 5, bias=True, ignore_frac=0.0)
    check_against_oracle(e, c, t, b, reduction="none", return_lse=True)


@pytest.mark.parametrize("V", [1, 2, 7])
def test_vocabulary_smaller_than_a_block(V):
    e, c, t, b = make_linear_inputs((4, 6), 37, V, bias=True)
    check_against_oracle(e, c, t, b, reduction="none", label_smoothing=0.2, z_loss=1e-3)


def test_multiple_chunks():
    """Force several token chunks (a tiny memory budget): chunk boundaries must not matter."""
    fn = tuned(chunk_bytes=7 * 301 * 4)  # 7 rows of 301 fp32 logits per chunk
    e, c, t, b = make_linear_inputs((5, 9), 41, 301, bias=True, ignore_frac=0.3)
    w = make_weight(301)
    for reduction in ("mean", "none"):
        e.grad = c.grad = b.grad = None
        check_against_oracle(
            e,
            c,
            t,
            b,
            weight=w,
            reduction=reduction,
            shift=True,
            softcap=5.0,
            label_smoothing=0.1,
            z_loss=1e-3,
            return_lse=reduction == "none",
            fn=lambda *a, **k: fn(*a, impl=IMPL, **k),
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moderate_size(dtype):
    """Not only toy shapes: 256 tokens, V = 1000 (8 filter blocks, the last partial), every option
    at once, default filter. D = 100, scale 4: inside the range the tolerances are derived for."""
    gen = torch.Generator().manual_seed(21)
    e, c, t, b = make_linear_inputs((2, 128), 100, 1000, dtype, bias=True, scale=4.0, generator=gen)
    check_against_oracle(
        e,
        c,
        t,
        b,
        weight=make_weight(1000, gen),
        shift=True,
        softcap=20.0,
        label_smoothing=0.05,
        z_loss=1e-4,
        reduction="none",
        return_lse=True,
    )


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_shift_equals_slicing(reduction):
    """shift=True is exactly e[..., :-1, :] with targets[..., 1:] (within fp32 reordering), and the
    oracle agrees."""
    e, c, t, b = make_linear_inputs((3, 8), 29, 50, bias=True)
    check_against_oracle(e, c, t, b, reduction=reduction, shift=True)
    e.grad = c.grad = b.grad = None
    l0, _, g0, up, _ = run_with_upstream(cce_fn, e, c, t, b, seed=5, reduction=reduction, shift=True)
    es = e.detach()[:, :-1, :].contiguous().requires_grad_()
    l1, _, g1, _, _ = run_with_upstream(cce_fn, es, c, t[:, 1:].contiguous(), b, seed=5, reduction=reduction)
    assert l0.shape == l1.shape == ((3, 7) if reduction == "none" else ())
    budget = error_budget(e, c, t, b, up, None, reduction=reduction, shift=True)
    assert bool(((l0 - l1).abs() <= 2 * budget["loss"]).all())
    assert bool((g0["e"][:, -1] == 0).all())
    assert float((g0["e"][:, :-1] - g1["e"]).norm()) <= 2 * budget["e"]
    assert float((g0["c"] - g1["c"]).norm()) <= 2 * budget["c"]


@pytest.mark.parametrize("softcap", [0.7, 5.0, 30.0])
def test_softcap(softcap):
    e, c, t, b = make_linear_inputs((4, 5), 33, 40, bias=True, scale=4.0)
    check_against_oracle(e, c, t, b, softcap=softcap, reduction="none", return_lse=True, label_smoothing=0.1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bias_gradient(dtype):
    e, c, t, b = make_linear_inputs((6, 7), 31, 150, dtype, bias=True)
    got, ref = check_against_oracle(e, c, t, b, weight=make_weight(150), label_smoothing=0.3, z_loss=0.01)
    assert got[2]["bias"].dtype == dtype


@pytest.mark.parametrize("which", ["e", "c", "bias", "c_and_bias"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_inputs_not_requiring_grad(which, reduction):
    """No gradient is computed for an input that does not require it: .grad stays None, the others
    are still right."""
    e, c, t, b = make_linear_inputs((4, 6), 27, 45, bias=True)
    frozen = {"e": [e], "c": [c], "bias": [b], "c_and_bias": [c, b]}[which]
    for x in frozen:
        x.requires_grad_(False)
    loss = cce_fn(e, c, t, b, reduction=reduction)
    loss.sum().backward()
    for x in frozen:
        assert x.grad is None
    e.grad = c.grad = b.grad = None
    check_against_oracle(e, c, t, b, reduction=reduction)


@pytest.fixture
def spy_fwd(monkeypatch):
    """Records the arguments cce passes to the PyTorch implementation's forward op."""
    import cce.ops.linear_ce.torch_impl as ti

    calls = []
    real = ti.linear_ce_torch_fwd

    def spy(*args):
        calls.append(ti.FwdArgs(*args))
        return real(*args)

    monkeypatch.setattr(ti, "linear_ce_torch_fwd", spy)
    return calls


@pytest.mark.parametrize("which", ["e", "c", "bias"])
def test_frozen_input_gradient_not_requested(spy_fwd, which):
    """The implementation is told not to compute (or allocate) the gradient of a frozen input:
    its need_* flag is False, the others True."""
    e, c, t, b = make_linear_inputs((3, 4), 19, 30, bias=True)
    {"e": e, "c": c, "bias": b}[which].requires_grad_(False)
    cce_fn(e, c, t, b).backward()
    (args,) = spy_fwd
    need = dict(zip(("e", "c", "bias"), (args.need_de, args.need_dc, args.need_dbias), strict=True))
    assert need == {k: k != which for k in need}


def test_shift_does_not_copy_e(spy_fwd):
    """shift=True hands the implementation e itself (same storage), not a copy of e[..., :-1, :]."""
    e, c, t, _ = make_linear_inputs((3, 9), 21, 40)
    cce_fn(e, c, t, shift=True).backward()
    (args,) = spy_fwd
    assert args.e2d.data_ptr() == e.data_ptr() and args.e2d.shape == (27, 21)


def test_no_grad_anywhere():
    e, c, t, b = make_linear_inputs((4, 6), 27, 45, bias=True)
    for x in (e, c, b):
        x.requires_grad_(False)
    loss = cce_fn(e, c, t, b)
    assert not loss.requires_grad
    with torch.no_grad():
        e.requires_grad_(True)
        assert not cce_fn(e, c, t, b).requires_grad


@pytest.mark.parametrize("shift", [False, True])
def test_non_contiguous_e(shift):
    """e as a transposed view (B, T, D) of a (T, B, D) buffer, and with a strided hidden dim."""
    gen = torch.Generator().manual_seed(7)
    x, c, _, b = make_linear_inputs((6, 3), 35, 60, bias=True, generator=gen)
    e = x.detach().transpose(0, 1).requires_grad_()  # leaf, non-contiguous (3, 6, 35)
    assert not e.is_contiguous()
    t = torch.randint(0, 60, (3, 6), generator=gen)
    check_against_oracle(e, c, t, b, shift=shift, reduction="none")
    big = torch.randn(3, 6, 70, generator=gen) / 35**0.5
    e2 = big[..., ::2]  # stride 2 in D
    e2.requires_grad_()
    c.grad = b.grad = None
    check_against_oracle(e2, c, t, b, shift=shift)
    # non-contiguous c and targets too
    c3 = torch.randn(35, 60, generator=gen).div(35**0.5).T.requires_grad_()  # (60, 35), stride (1, 60)
    t3 = torch.randint(0, 60, (6, 3), generator=gen).T
    e.grad = b.grad = None
    check_against_oracle(e, c3, t3, b, shift=shift, reduction="sum")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_inputs_never_modified(dtype):
    e, c, t, b = make_linear_inputs((4, 6), 27, 145, dtype, bias=True, scale=10.0)
    w = make_weight(145)
    before = [x.detach().clone() for x in (e, c, t, b, w)]
    for reduction, lse in (("mean", False), ("none", True)):
        out = cce_fn(
            e,
            c,
            t,
            b,
            weight=w,
            reduction=reduction,
            return_lse=lse,
            shift=True,
            softcap=3.0,
            label_smoothing=0.1,
            z_loss=0.01,
        )
        loss = out[0].sum() + out[1].sum() if lse else out
        loss.backward()
    for x, x0 in zip((e, c, t, b, w), before, strict=True):
        assert torch.equal(x.detach(), x0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_dtypes_of_outputs(dtype):
    e, c, t, b = make_linear_inputs((3, 5), 16, 20, dtype, bias=True)
    loss, lse = cce_fn(e, c, t, b, return_lse=True, reduction="none")
    if dtype != torch.float64:
        assert loss.dtype == torch.float32 and lse.dtype == torch.float32
    (loss.sum() + lse.sum()).backward()
    for x in (e, c, b):
        assert x.grad.dtype == dtype


@pytest.mark.parametrize("where", ["e", "c", "bias"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_inputs_propagate(where, bad):
    """NaN / inf in the inputs show up in the loss: never silently replaced. A token's loss is
    non-finite exactly where the oracle's is (a -inf logit that is not the target legitimately
    masks its class: the loss stays finite there, in torch as here)."""
    e, c, t, b = make_linear_inputs((2, 4), 9, 12, bias=True, ignore_frac=0.0)
    with torch.no_grad():
        if where == "e":
            e[1, 2, 3] = bad  # one token
        elif where == "c":
            c[5, 0] = bad  # one class: logit +-inf (or NaN) in every row
        else:
            b[5] = bad
        t[0, 1] = 5  # some token targets the poisoned class
    none = cce_fn(e, c, t, b, reduction="none")
    ref = ref_fn(e, c, t, b, reduction="none")
    assert not bool(torch.isfinite(ref).all())  # the poison reaches the loss
    assert torch.equal(torch.isfinite(none), torch.isfinite(ref))
    for reduction in ("mean", "sum"):
        assert not torch.isfinite(cce_fn(e, c, t, b, reduction=reduction))


def test_module_matches_function():
    w = make_weight(33)
    mod = cce.LinearCrossEntropy(
        reduction="none", shift=True, softcap=4.0, label_smoothing=0.1, weight=w, z_loss=1e-3, impl=IMPL
    )
    e, c, t, b = make_linear_inputs((2, 6), 17, 33, bias=True)
    got = mod(e, c, t, b)
    exp = cce_fn(
        e, c, t, b, reduction="none", shift=True, softcap=4.0, label_smoothing=0.1, weight=w, z_loss=1e-3
    )
    assert torch.equal(got, exp)


# --------------------------------------------------------------------------------------------
# Gradient filtering
# --------------------------------------------------------------------------------------------


def _peaked(scale, V=700, D=48, lead=(4, 16), seed=11, dtype=torch.float32):
    """Logits ~ N(0, scale^2): at scale 20 a row's softmax sits on a handful of classes."""
    gen = torch.Generator().manual_seed(seed)
    return make_linear_inputs(lead, D, V, dtype, bias=True, scale=scale, generator=gen, ignore_frac=0.1)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_default_filter_fp32_peaked(reduction):
    """Default filter (fp32: eps = 2^-20) on a peaked softmax: the oracle comparison with the
    proven filter bound added, and a stated bound vs the exact (filter_eps=None) run of the same
    implementation: relative L2 error of dE, dC <= 2^-20 * 128 * 2 = 2^-12, i.e. at most every entry
    of one 128-wide vocab block per row dropped at p < eps, each moving by <= 2 max||c|| while a row's
    gradient has norm ~ max||c|| (a peaked softmax has alpha (p - onehot) of order 1)."""
    e, c, t, b = _peaked(20.0)
    # Precondition: the filter really has tiles to skip here (whole-row max p < eps).
    _, L, _, _ = problem_rows(e, c, t, b)
    p = torch.softmax(L, -1)
    assert float((p.amax(0) < 2.0**-20).double().mean()) > 0.5
    got, ref = check_against_oracle(e, c, t, b, reduction=reduction)
    e.grad = c.grad = b.grad = None
    exact = run_with_upstream(cce_fn, e, c, t, b, seed=0, reduction=reduction, filter_eps=None)
    for name in ("e", "c", "bias"):
        assert rel_err(got[2][name], exact[2][name]) <= 2.0**-12, name
        assert rel_err(exact[2][name], ref[2][name]) <= 1e-5, name


@pytest.mark.parametrize("eps", [2.0**-12, 1e-3])
@pytest.mark.parametrize("scale", [4.0, 20.0])
def test_coarse_filter_within_proven_bound(eps, scale):
    """A large filter_eps skips many tiles; the rank-1 correction keeps dE, dC within the bound of
    helpers.filter_error_bounds (checked inside check_against_oracle)."""
    e, c, t, b = _peaked(scale, V=650, lead=(2, 20), seed=3)
    check_against_oracle(e, c, t, b, filter_eps=eps, label_smoothing=0.1, z_loss=1e-3)
    e.grad = c.grad = b.grad = None
    check_against_oracle(e, c, t, b, filter_eps=eps, reduction="none", return_lse=True, shift=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_default_filter_half_precision_peaked(dtype):
    """bf16 / fp16 defaults (2^-8 / 2^-10) on peaked data stay within rounding + proven bound."""
    e, c, t, b = _peaked(20.0, dtype=dtype)
    check_against_oracle(e, c, t, b)
    e.grad = c.grad = b.grad = None
    check_against_oracle(e, c, t, b, reduction="none", softcap=30.0)


def _constant_tail_problem(dtype, p_rare, *, n_freq=20, V=1300, D=8, lead=(3, 8), seed=5):
    """Inputs where the filter's rank-1 correction is exact: every token has the same hidden state
    e0, and the classes n_freq.. (the "rare" tail) all share one vector c_r whose softmax
    probability is p_rare in every row. Any skipped tile lies in the tail (a tile holding a
    frequent class has p > 2 eps, asserted), and there mean(C_tile) = c_r and mean(E_chunk) = e0 exactly, so a
    correct correction reproduces the exact gradient up to rounding, while plain dropping misses
    the tail mass (V - n_freq) * p_rare."""
    gen = torch.Generator().manual_seed(seed)
    u = torch.randn(D, generator=gen, dtype=torch.float64)
    u /= u.norm()
    n = torch.randn(D, generator=gen, dtype=torch.float64)
    n -= (n @ u) * u
    n /= n.norm()
    e0 = 2.0 * u + 0.5 * n
    g = torch.randn(n_freq, D, generator=gen, dtype=torch.float64) * (2.0 / D**0.5)
    lse_freq = torch.logsumexp(g @ e0, 0)
    # e0 . c_r = log(p_rare) + lse (ignoring the tail's own small mass), with c_r = -s u.
    s = -(math.log(p_rare) + float(lse_freq)) / 2.0
    c = torch.cat([g, (-s * u).expand(V - n_freq, D)]).to(dtype).requires_grad_()
    e = e0.expand(*lead, D).to(dtype).clone().requires_grad_()
    t = torch.randint(0, V, lead, generator=gen)
    t[..., :2] = torch.randint(0, n_freq, lead[:-1] + (2,), generator=gen)
    t[0, 3] = -100
    return e, c, t


@pytest.mark.parametrize(
    "dtype,eps",
    [(torch.float32, "auto"), (torch.float32, 1e-3), (torch.bfloat16, "auto"), (torch.float16, "auto")],
)
@pytest.mark.parametrize("variant", ["mean", "none_lse_softcap", "sum_shift_smooth", "mean_chunked"])
def test_rank1_correction_exact_on_constant_tail(dtype, eps, variant):
    """The skipped-tile correction, not just the generic bound: here it is exact by construction
    (see _constant_tail_problem), so the filtered result must match the oracle to rounding
    accuracy (tolerance of check_against_oracle with a zero filter bound), while dropping the
    skipped tiles would err by far more (asserted as a precondition)."""
    eps_v = CCEOptions(filter_eps=eps).resolved_filter_eps(dtype, IMPL)
    e, c, t = _constant_tail_problem(dtype, p_rare=eps_v / 2)
    opts = {
        "mean": dict(reduction="mean"),
        "none_lse_softcap": dict(reduction="none", return_lse=True, softcap=40.0),
        "sum_shift_smooth": dict(reduction="sum", shift=True, label_smoothing=0.1, z_loss=1e-3),
        "mean_chunked": dict(reduction="mean", return_lse=True),
    }[variant]
    fn = cce_fn
    if variant == "mean_chunked":  # several token chunks: per-chunk dC corrections are summed
        chunked = tuned(chunk_bytes=5 * 1300 * 4)
        fn = lambda *a, **k: chunked(*a, impl=IMPL, **k)  # noqa: E731
    _, L, _, tt = problem_rows(e, c, t, None, shift=opts.get("shift", False), softcap=opts.get("softcap"))
    p = torch.softmax(L, -1)
    assert bool((p[:, 20:] < eps_v).all()) and bool((p[:, :20].amax(1) > 2 * eps_v).all())
    got = run_with_upstream(fn, e, c, t, None, seed=9, filter_eps=eps, **opts)
    ref = run_reference(e, c, t, None, seed=9, **opts)
    up, uplse = got[3], got[4]
    budget = error_budget(e, c, t, None, up, uplse, **opts)
    # What dropping the tail without correction would miss, per row: |alpha_i| * tail mass * c_r.
    E, pp, _, alpha, *_ = row_terms(e, c, t, None, up, uplse, **opts)
    tail = alpha.abs() * pp[:, 20:].sum(1)
    dropped = {"e": float(tail.norm() * c[-1].detach().double().norm()), "c": float(tail.sum() * E[0].norm())}
    for name in ("e", "c"):
        tol = budget[name] + UNIT_ROUNDOFF[dtype] * budget[name + "_scale"]
        if eps == "auto" and variant == "mean" and dtype == torch.float32:
            # A missing correction errs by ~dropped (exactly alpha_i * tail mass * c_r per dE row):
            # dropped > 2 tol makes that error exceed tol.
            assert dropped[name] > 2 * tol, "construction too weak to detect a missing correction"
        diff = float((got[2][name].double() - ref[2][name].double()).norm())
        assert diff <= tol, f"d{name}: {diff:.3g} > {tol:.3g} (uncorrected drop ~{dropped[name]:.3g})"


def test_autocast_casts_operands_like_lm_head():
    """Under autocast the matmul runs on operands in the autocast dtype (as lm_head(e) would),
    the loss is fp32 and fp32 leaves get fp32 gradients: the result equals cce on inputs cast to
    bf16 by hand (same ops, so up to fp32 summation-order differences: 1e-6 relative)."""
    e, c, t, b = make_linear_inputs((3, 9), 24, 70, bias=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = cce_fn(e, c, t, b, label_smoothing=0.1)
    assert loss.dtype == torch.float32
    g = torch.autograd.grad(loss, (e, c, b))
    assert all(x.dtype == torch.float32 for x in g)
    leaves = [x.detach().to(torch.bfloat16).requires_grad_() for x in (e, c, b)]
    ref = cce_fn(*leaves[:2], t, leaves[2], label_smoothing=0.1)
    gref = torch.autograd.grad(ref, leaves)
    assert rel_err(loss, ref) <= 1e-6
    for got, want in zip(g, gref, strict=True):
        assert rel_err(got, want.float()) <= 1e-6
