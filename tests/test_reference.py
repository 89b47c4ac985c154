"""The oracle (cce/reference.py) against plain F.cross_entropy, so that its conventions are pinned,
and the shared loss formula (cce/_math.py) against the oracle.

Everything here runs in fp64 on identical inputs and evaluates the same mathematical expression
with a few differently ordered operations, so results agree to a few ulps of fp64: we use
rtol = atol = 1e-12 (about 5000 ulps, covering V <= 300-term sums and log/exp rounding), unless a
comparison is in fp32 (stated there).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import make_weight

from cce import _math
from cce.reference import cross_entropy_reference, linear_cross_entropy_reference

TOL = dict(rtol=1e-12, atol=1e-12)


def logits_and_targets(lead, V, *, ignore_index=-100, ignore_frac=0.3, seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    L = (torch.randn(*lead, V, generator=gen, dtype=torch.float64) * 3).to(dtype).requires_grad_()
    t = torch.randint(0, V, lead, generator=gen)
    t[torch.rand(lead, generator=gen) < ignore_frac] = ignore_index
    return L, t


def torch_ce(L, t, **kw):
    """Plain F.cross_entropy on flattened logits, reshaped like targets for reduction='none'."""
    out = F.cross_entropy(L.reshape(-1, L.shape[-1]), t.reshape(-1), **kw)
    return out.reshape(t.shape) if kw.get("reduction") == "none" else out


def grads_of(fn, L, seed=1):
    out = fn(L)
    up = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    (g,) = torch.autograd.grad((out * up).sum(), L)
    return out.detach(), g


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("ls", [0.0, 0.2, 1.0])
@pytest.mark.parametrize("ignore_index", [-100, 3])
@pytest.mark.parametrize("lead", [(7,), (2, 3, 4)])
def test_matches_f_cross_entropy(reduction, weighted, ls, ignore_index, lead):
    """Value and logits-gradient equal F.cross_entropy's whenever some target is valid (the only
    deliberate differences are for all-ignored batches, tested below). ignore_index=3 is a real
    class id: tokens targeting class 3 are ignored."""
    V = 37
    L, t = logits_and_targets(lead, V, ignore_index=ignore_index)
    assert bool((t != ignore_index).any())
    w = make_weight(V, torch.Generator().manual_seed(2)).double() if weighted else None
    kw = dict(weight=w, ignore_index=ignore_index, reduction=reduction, label_smoothing=ls)
    got, g_got = grads_of(lambda x: cross_entropy_reference(x, t, dtype=torch.float64, **kw), L)
    exp, g_exp = grads_of(lambda x: torch_ce(x, t, **kw), L)
    assert got.dtype == torch.float64 and got.shape == exp.shape
    torch.testing.assert_close(got, exp, **TOL)
    torch.testing.assert_close(g_got, g_exp, **TOL)
    if reduction == "none":
        assert bool((got[t == ignore_index] == 0).all())


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_fp32_matches_f_cross_entropy(reduction):
    """dtype=float32 (the default) on fp32 logits is F.cross_entropy in fp32 (same operations: we
    allow 4 fp32 ulps of rounding-order difference, rtol 2.4e-7 * 4 ~ 1e-6)."""
    L, t = logits_and_targets((4, 6), 50, dtype=torch.float32)
    w = make_weight(50)
    kw = dict(weight=w, reduction=reduction, label_smoothing=0.1)
    got = cross_entropy_reference(L, t, **kw)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, torch_ce(L, t, **kw), rtol=1e-6, atol=1e-6)


def test_dtype_argument_upcasts():
    """dtype=float64 on bf16 logits computes in fp64 from the exactly converted values."""
    L, t = logits_and_targets((3, 4), 20, dtype=torch.bfloat16)
    got = cross_entropy_reference(L, t, dtype=torch.float64, reduction="none")
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, torch_ce(L.double(), t, reduction="none"), **TOL)


@pytest.mark.parametrize("weighted", [False, True])
def test_all_ignored_is_zero_not_nan(weighted):
    """Deliberate difference: torch gives NaN for 'mean' over no valid token; the oracle gives 0
    with zero gradients. 'sum' and 'none' agree with torch (0)."""
    V = 9
    L, t = logits_and_targets((2, 3), V, ignore_frac=1.0)
    w = make_weight(V).double() if weighted else None
    assert torch.isnan(torch_ce(L, t, weight=w))
    loss, g = grads_of(lambda x: cross_entropy_reference(x, t, weight=w, dtype=torch.float64), L)
    assert float(loss) == 0.0 and bool((g == 0).all())
    for reduction in ("sum", "none"):
        got = cross_entropy_reference(L, t, weight=w, reduction=reduction, dtype=torch.float64)
        torch.testing.assert_close(got, torch_ce(L, t, weight=w, reduction=reduction), **TOL)
        assert bool((got == 0).all())


def test_zero_total_weight_is_zero_not_nan():
    """'mean' whose valid tokens all have class weight 0: the divisor is 0; 0.0, not NaN."""
    V = 6
    L, t = logits_and_targets((8,), V, ignore_frac=0.0)
    w = torch.ones(V, dtype=torch.float64)
    w[t.unique()] = 0.0
    loss = cross_entropy_reference(L, t, weight=w, dtype=torch.float64)
    assert float(loss.detach()) == 0.0


def test_empty_batch():
    L = torch.randn(0, 7, dtype=torch.float64, requires_grad=True)
    t = torch.zeros(0, dtype=torch.long)
    assert float(cross_entropy_reference(L, t, dtype=torch.float64).detach()) == 0.0
    assert float(cross_entropy_reference(L, t, reduction="sum", dtype=torch.float64).detach()) == 0.0
    assert cross_entropy_reference(L, t, reduction="none", dtype=torch.float64).shape == (0,)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_z_loss_and_lse(reduction):
    """z_loss adds z * logsumexp(L)^2 to each valid token's loss (before the reduction, so 'mean'
    divides it by n_valid too); the returned lse is logsumexp(L), 0 at ignored tokens."""
    V, z = 23, 0.3
    L, t = logits_and_targets((3, 5), V)
    w = make_weight(V).double()
    valid = t != -100
    lse = torch.logsumexp(L.detach(), -1)
    tok = torch_ce(L.detach(), t, weight=w, reduction="none") + torch.where(valid, z * lse * lse, 0.0)
    exp = {"none": tok, "sum": tok.sum(), "mean": tok.sum() / w[t[valid]].sum()}[reduction]
    got, got_lse = cross_entropy_reference(
        L, t, weight=w, z_loss=z, reduction=reduction, return_lse=True, dtype=torch.float64
    )
    torch.testing.assert_close(got, exp, **TOL)
    assert got_lse.shape == t.shape
    torch.testing.assert_close(got_lse, torch.where(valid, lse, 0.0), **TOL)


@pytest.mark.parametrize("softcap", [1.0, 15.0])
def test_softcap_is_tanh_cap(softcap):
    L, t = logits_and_targets((4, 5), 30)
    kw = dict(reduction="none", label_smoothing=0.1)
    got, g = grads_of(lambda x: cross_entropy_reference(x, t, softcap=softcap, dtype=torch.float64, **kw), L)
    exp, g_exp = grads_of(lambda x: torch_ce(softcap * torch.tanh(x / softcap), t, **kw), L)
    torch.testing.assert_close(got, exp, **TOL)
    torch.testing.assert_close(g, g_exp, **TOL)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_shift_is_slicing(reduction):
    """shift=True predicts targets[..., 1:] from logits[..., :-1, :]; 'none' is shaped like
    targets[..., 1:]."""
    L, t = logits_and_targets((3, 6), 17)
    got, g = grads_of(
        lambda x: cross_entropy_reference(x, t, shift=True, reduction=reduction, dtype=torch.float64), L
    )
    exp, g_exp = grads_of(lambda x: torch_ce(x[:, :-1, :], t[:, 1:], reduction=reduction), L)
    assert got.shape == ((3, 5) if reduction == "none" else ())
    torch.testing.assert_close(got, exp, **TOL)
    torch.testing.assert_close(g, g_exp, **TOL)
    assert bool((g[:, -1] == 0).all())


@pytest.mark.parametrize("shift", [False, True])
def test_linear_reference_is_materialized_logits(shift):
    """linear_cross_entropy_reference = cross_entropy_reference(e @ c.T + bias); filter_eps and impl
    are accepted and ignored."""
    gen = torch.Generator().manual_seed(4)
    e = torch.randn(2, 5, 9, generator=gen, dtype=torch.float64)
    c = torch.randn(13, 9, generator=gen, dtype=torch.float64)
    b = torch.randn(13, generator=gen, dtype=torch.float64)
    t = torch.randint(0, 13, (2, 5), generator=gen)
    w = make_weight(13, gen)
    kw = dict(weight=w, shift=shift, softcap=4.0, label_smoothing=0.2, z_loss=0.01, reduction="none")
    got = linear_cross_entropy_reference(e, c, t, b, dtype=torch.float64, filter_eps=0.5, impl="triton", **kw)
    exp = cross_entropy_reference(e @ c.T + b, t, dtype=torch.float64, **kw)
    torch.testing.assert_close(got, exp, **TOL)
    exp_torch = torch_ce(
        (4.0 * torch.tanh((e @ c.T + b) / 4.0))[:, :-1] if shift else 4.0 * torch.tanh((e @ c.T + b) / 4.0),
        t[:, 1:] if shift else t,
        weight=w.double(),
        label_smoothing=0.2,
        reduction="none",
    )
    lse = torch.logsumexp(4.0 * torch.tanh((e @ c.T + b) / 4.0), -1)
    lse = lse[:, :-1] if shift else lse
    torch.testing.assert_close(got, exp_torch + 0.01 * lse * lse, **TOL)


# --------------------------------------------------------------------------------------------
# cce/_math.py (the formula every implementation uses) against the oracle
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("ls,z", [(0.0, 0.0), (0.3, 0.0), (0.0, 0.05), (1.0, 0.05)])
@pytest.mark.parametrize("with_lse", [False, True])
def test_math_formula_matches_oracle(reduction, weighted, ls, z, with_lse):
    """token_loss / reduce_loss from (lse, tgt, ssum) equal the oracle's loss, and the logits
    gradient alpha p - beta onehot - gamma w equals the oracle's autograd gradient under random
    upstream gradients on the loss (and on the lse)."""
    V = 29
    L, t = logits_and_targets((12,), V, seed=7)
    w = make_weight(V, torch.Generator().manual_seed(8)).double() if weighted else None
    valid = t != -100
    Ld = L.detach()
    lse = torch.logsumexp(Ld, -1)
    tgt = Ld.gather(1, torch.where(valid, t, 0)[:, None]).squeeze(1)
    ssum = Ld.sum(1) if w is None else Ld @ w
    k = _math.LossConsts(ls, z, V)
    w_t = _math.target_weight(w, t, valid).double()
    W = _math.weight_total(w, V, L.device)
    loss = _math.reduce_loss(_math.token_loss(lse, tgt, ssum, w_t, W, valid, k), w_t, reduction)

    kw = dict(weight=w, reduction=reduction, label_smoothing=ls, z_loss=z, dtype=torch.float64)
    ref, ref_lse = cross_entropy_reference(L, t, return_lse=True, **kw)
    # _math keeps its per-row quantities in fp32, the dtype kernels use (target_weight,
    # weight_total = fp32 sum of the weights, row_upstream), so the loss and the coefficients
    # carry a few fp32 roundings: rtol 1e-6 ~ 8 u_fp32.
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-6, atol=1e-6)

    gen = torch.Generator().manual_seed(9)
    up = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
    h = torch.randn(t.shape, generator=gen, dtype=torch.float64) if with_lse else None
    total = (ref * up).sum() + ((ref_lse * h).sum() if with_lse else 0.0)
    (dL,) = torch.autograd.grad(total, L)
    g = _math.row_upstream(up, w_t, reduction, t.numel()).double()
    alpha, beta, gamma = _math.coefficients(g, h, lse, w_t, W, valid, k)
    p = torch.softmax(Ld, -1)
    wv = torch.ones(V, dtype=torch.float64) if w is None else w
    onehot = F.one_hot(torch.where(valid, t, 0), V).double()
    dz = alpha[:, None] * p - beta[:, None] * onehot - gamma[:, None] * wv[None, :]
    # Same fp32 coefficients (see above); absolute 1e-6 of the largest entry for entries that
    # cancel to ~0.
    torch.testing.assert_close(dz, dL, rtol=1e-6, atol=1e-6 * float(dL.abs().max()))
    assert bool((dz[~valid] == 0).all())
