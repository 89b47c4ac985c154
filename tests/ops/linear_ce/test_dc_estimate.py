"""dC's error estimate of the dense-slab rule (slab_choice.dc_error_terms, dc_norm_estimate),
under the Triton interpreter on CPU (or on a GPU).

dC's error is a sum over all rows, so the rule estimates each slab's from the sampled rows'
pairs and compares it with ||dC||^2 from exact dC rows of sampled classes. The tests: with every
row sampled the estimates are the sparse backward's true per-slab dC errors (with and without
the first-order terms), against float64; ||dC||^2 exact where the classes cover the vocabulary
and near it from a sample; the flags follow the greedy rule on dE and dC; the rule meets its
target on dC when every row is sampled; from 32 of 512 rows the estimates are near the truth.
"""

from __future__ import annotations

import pytest
import torch

from bench.data import zipf_inputs
from cce import CCEOptions, Tuning, linear_cross_entropy_with_options
from cce.reference import linear_cross_entropy_reference
from tests.helpers import greedy_dense, near_uniform_inputs, rel_err, triton_training_forward

triton = pytest.importorskip("triton")

import cce.ops.linear_ce.triton_backward as TB  # noqa: E402
from cce.ops.linear_ce.kernels.common import stats_blocks  # noqa: E402
from cce.ops.linear_ce.kernels.dz import class_sample_dz  # noqa: E402
from cce.ops.linear_ce.kernels.tile_stats import tile_means  # noqa: E402
from cce.ops.linear_ce.rows import RowOrder, vocab_scores  # noqa: E402
from cce.ops.linear_ce.slab_choice import SlabErrors, dc_norm_estimate, dense_slab_flags, slab_errors  # noqa: E402
from cce.ops.linear_ce.triton_backward import loss_coefficients, sparse_backward  # noqa: E402

EPS = 2.0**-8
ON = torch.ones(1, dtype=torch.int32)


def _inputs(kind, N, D, V):
    if kind == "zipf":
        e, c, t = zipf_inputs(N, D, V, dtype=torch.float32, seed=5)
        t[::7] = -100
        return e, c, t
    return near_uniform_inputs(N, D, V, std=0.2)


def _estimates(e, c, t, g, out, width, rows, cm=None):
    """slab_errors with dC's estimates, for per-row upstream gradients g."""
    V = c.shape[0]
    r = RowOrder(t, None, -100)
    alpha, beta, *_ = loss_coefficients(None, t, out[1], g, None, -100, 0.0, 0.0, V)
    srt = lambda x: x.index_select(0, r.perm).contiguous()  # noqa: E731
    alpha_s, beta_s, lse_s = srt(alpha.float()), srt(beta.float()), srt(out[1])
    BN, BV = stats_blocks(torch.float32)
    return slab_errors(
        e, c, None, r.erow_s, srt(r.safe_t), lse_s, alpha_s, beta_s, out[2], out[3].bool(), out[5], r.n_valid,
        0.0, BN, BV, width, rows, cm=cm, vscore=out[6],
    )  # fmt: skip


def _oracle_dc(e, c, t, g):
    cc = c.double().requires_grad_()
    loss = linear_cross_entropy_reference(e.double(), cc, t, reduction="none")
    (loss * g.double()).sum().backward()
    return cc.grad


def _per_slab(dC, want, vperm, width):
    """float64 [n_slabs]: the squared error of dC's rows per slab of sorted positions."""
    err = (dC.double() - want).square().sum(1)[vperm.long()]
    n_slabs = -(-err.numel() // width)
    return torch.nn.functional.pad(err, (0, n_slabs * width - err.numel())).view(n_slabs, width).sum(1)


@pytest.mark.parametrize("kind", ["zipf", "near-uniform"])
def test_dc_estimates_are_exact_when_every_row_is_sampled(kind, monkeypatch):
    """Every row sampled (scale 1, all pairs): dc_err[s] is the sparse backward's squared dC error
    on slab s's classes without the first-order terms, dc_err_fo with them (the device's flag set,
    no slab dense), and dc_ref is ||dC||^2, all against float64 (fp32 GEMMs over 32 columns and
    3000 classes: 1e-5 of ||dC|| on the errors' norms, 1e-5 relative on ||dC||^2)."""
    N, D, V = 64, 32, 3000
    e, c, t = _inputs(kind, N, D, V)
    tu = Tuning(backward="sparse", dense_slabs=True)
    out = triton_training_forward(e, c, t, EPS, tu)
    g = torch.rand(N, generator=torch.Generator().manual_seed(4))
    BN, BV = stats_blocks(torch.float32)
    width = 3 * BV
    cm = tile_means(c, out[5], BV, torch.float32)
    est = _estimates(e, c, t, g, out, width, rows=N, cm=cm)
    want = _oracle_dc(e, c, t, g)
    args = (e, c, None, None, None, t, out[1], g, None, -100, 0.0, 0.0, 0.0, True, True, *out[2:8])
    _, dC0 = sparse_backward(*args, dense_slabs=False)

    def all_sparse_terms_on(code, keep, n_valid, BLOCK_N, tps, *rest, **kw):
        return torch.zeros(-(-code.shape[1] // tps), dtype=torch.int8), ON

    monkeypatch.setattr(TB, "dense_slab_flags", all_sparse_terms_on)
    _, dC1 = sparse_backward(*args, dense_slabs=True)
    norm = float(want.norm())
    for got, dC in ((est.dc_err, dC0), (est.dc_err_fo, dC1)):
        true = _per_slab(dC, want, out[5], width)
        assert got.shape == true.shape
        assert (got.double().clamp(min=0).sqrt() - true.sqrt()).abs().max() <= 1e-5 * norm
    assert rel_err(dC0, want) > 3e-3  # the rank-1 corrections do err
    assert rel_err(est.dc_err_fo, est.dc_err) > 1e-3  # the terms change the estimate


@pytest.mark.parametrize("kind", ["zipf", "near-uniform"])
def test_dc_norm_estimate(kind):
    """dc_norm_estimate: ||dC||^2 exactly where the head covers the vocabulary (fp32: 1e-5), and
    from a head of 256 and 128 of the other 2744 classes within 10% (zipf-like data puts most of
    ||dC|| at the front; on near-uniform rows the classes are alike), for several row chunks.
    Its inputs as the training forward makes them, in torch: the valid rows' lse (the same to an
    fp32 ulp) and the sorted vocabulary (rows.vocab_scores, the forward's own order); the
    forward's kernels over 94 tiles, which took most of this test's time in the interpreter, are
    tested elsewhere."""
    N, D, V = 64, 32, 3000
    e, c, t = _inputs(kind, N, D, V)
    r = RowOrder(t, None, -100)
    lse = torch.logsumexp(e @ c.T, 1)
    vp = vocab_scores(e, c, None, r)[0].long()
    g = torch.rand(N, generator=torch.Generator().manual_seed(4))
    want = float(_oracle_dc(e, c, t, g).square().sum())
    alpha, beta, *_ = loss_coefficients(None, t, lse, g, None, -100, 0.0, 0.0, V)
    srt = lambda x: x.index_select(0, r.perm).contiguous()  # noqa: E731
    args = (
        e,
        c,
        None,
        r.erow_s,
        srt(r.safe_t),
        srt(lse),
        srt(alpha.float()),
        srt(beta.float()),
        r.n_valid,
    )
    exact = dc_norm_estimate(*args, vp, 0.0, head=V, tail=0)
    assert abs(float(exact) - want) <= 1e-5 * want
    for rows_bytes in (1 << 20, 4 * 1500 * 7):
        est = dc_norm_estimate(*args, vp, 0.0, head=256, tail=128, chunk_bytes=rows_bytes)
        assert abs(float(est) / want - 1) < 0.1


@pytest.mark.parametrize("softcap,bias", [(0.0, False), (3.0, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_class_sample_dz_against_float64(softcap, bias, dtype):
    """class_sample_dz (dc_norm_estimate's dZ on sampled classes): every entry equals
    (alpha p - beta [v == t]) softcap' in float64, at an odd shape (not a multiple of the
    blocks), with a class drawn twice (both columns carry the target term), rows without a
    gradient (alpha = beta = 0), every entry checked (finite). fp32 within 1e-6 of the entry
    scale; fp16 within its rounding (2^-11 relative, plus 2^-24 absolute below its normal range)."""
    g = torch.Generator().manual_seed(3)
    n, V, k = 37, 300, 261
    z = torch.randn(n, k, generator=g) * 3
    cls = torch.randint(0, V, (k,), generator=g)
    cls[7] = cls[200]
    t = torch.randint(0, V, (n,), generator=g)
    t[:5] = cls[200]
    t[5] = cls[3]
    lse = torch.logsumexp(z, 1) + torch.rand(n, generator=g)
    alpha = torch.rand(n, generator=g)
    beta = torch.rand(n, generator=g)
    alpha[-3:] = beta[-3:] = 0.0
    b = torch.randn(k, generator=g) if bias else None
    got = class_sample_dz(z, cls, t, lse, alpha, beta, b, softcap, dtype)
    L = z.double() + (b.double()[None] if bias else 0.0)
    d = 1.0
    if softcap:
        th = torch.tanh(L / softcap)
        L, d = softcap * th, 1 - th * th
    want = (alpha.double()[:, None] * torch.exp(L - lse.double()[:, None])
            - beta.double()[:, None] * (t[:, None] == cls[None, :])) * d  # fmt: skip
    tol = 1e-6 if dtype == torch.float32 else 2.0**-11
    assert got.dtype == dtype and torch.isfinite(got).all()
    assert ((got.double() - want).abs() <= tol * want.abs() + 2.0**-24 + 1e-6 * want.abs().max()).all()
    assert (got[-3:] == 0).all()


def test_flags_with_dc_follow_the_rule():
    """dense_slab_flags with dC's estimates: the slabs of the greedy dE rule and those of largest
    dc_err until the rest's sum is within slab_error_dc^2 dc_ref (negative estimates count as 0;
    slab_error_dc defaults to dE's target when called directly, and may differ from it);
    with fo, the same on err - fo and dc_err_fo, chosen by cost (float64 greedy here)."""
    g = torch.Generator().manual_seed(0)
    n_slabs, k, D = 7, 5, 8
    # dE's error in slabs 0, 1 and 5; dC's in 0, 2, 4 and 6 (3: a negative estimate)
    err = (
        torch.randn(n_slabs, k, D, generator=g)
        * torch.tensor([1.0, 1, 0.01, 0.01, 0.01, 1, 0.01])[:, None, None]
    )
    fo = err * 0.9
    ref = torch.randn(k, D, generator=g) * 10
    dc = torch.tensor([4.0, 0.1, 2.0, -0.5, 1.0, 0.02, 3.0])
    dc_fo = dc * torch.rand(n_slabs, generator=g)
    dc_ref = torch.tensor(100.0)
    code = torch.full((k, n_slabs), 255, dtype=torch.uint8)
    keep = torch.zeros(1, n_slabs, dtype=torch.bool)
    n_valid = torch.tensor([k], dtype=torch.int32)

    adds = {}
    # (dE's target, dC's: None is dE's, as a direct caller of dense_slab_flags gets)
    for slab_error, tol_dc in ((0.05, None), (0.1, None), (0.2, None), (0.1, 0.05), (0.05, 0.2)):
        tol_c = slab_error if tol_dc is None else tol_dc
        b, b2 = slab_error * float(ref.double().norm()), tol_c**2 * float(dc_ref)
        c1 = greedy_dense(err, b) | greedy_dense(dc, b2, squared=True)
        c2 = greedy_dense(err - fo, b) | greedy_dense(dc_fo, b2, squared=True)
        adds[slab_error, tol_c] = len(c1 - greedy_dense(err, b))
        for cost in (0.5, 2.5, 10.0):
            errors = SlabErrors(err, ref, fo, dc, dc_fo, dc_ref)
            dense, flag = dense_slab_flags(
                code, keep, n_valid, 16, 1, 2.0, slab_error, errors, cost, slab_error_dc=tol_dc
            )
            use = len(c2) + cost < len(c1)
            assert flag.tolist() == [int(use)]
            assert dense.tolist() == [int(i in (c2 if use else c1)) for i in range(n_slabs)]
        dense, _ = dense_slab_flags(
            code, keep, n_valid, 16, 1, 2.0, slab_error, SlabErrors(err, ref, None, dc, None, dc_ref),
            slab_error_dc=tol_dc,
        )  # fmt: skip
        assert dense.tolist() == [int(i in c1) for i in range(n_slabs)]
    # dC's rule adds slabs, more at tighter dC targets whatever dE's
    assert max(adds.values()) > 0
    assert adds[0.05, 0.05] > adds[0.05, 0.2] and adds[0.1, 0.05] >= adds[0.1, 0.1] > adds[0.05, 0.2]


def test_flags_targets_of_one_or_more_turn_a_rule_off():
    """slab_error or slab_error_dc of 1 or more turn that rule off (Tuning's documented meaning),
    even where the estimated errors exceed the gradient itself, and leave the other rule as it is."""
    n_slabs, k, D = 5, 3, 4
    err = torch.ones(n_slabs, k, D) * torch.tensor([4.0, 0.0, 3.0, 0.0, 0.0])[:, None, None]
    ref = torch.ones(k, D)  # ||ref|| = sqrt(12), far below the summed err
    dc = torch.tensor([0.0, 9.0, 0.0, 0.0, 8.0])
    errors = SlabErrors(err, ref, None, dc, None, torch.tensor(1.0))
    code = torch.full((k, n_slabs), 255, dtype=torch.uint8)
    keep = torch.zeros(1, n_slabs, dtype=torch.bool)
    n_valid = torch.tensor([k], dtype=torch.int32)

    def flags(se, se_dc):
        return dense_slab_flags(code, keep, n_valid, 16, 1, 2.0, se, errors, slab_error_dc=se_dc)[0].tolist()

    assert flags(0.1, 0.1) == [1, 1, 1, 0, 1]
    assert flags(2.0, 0.1) == [0, 1, 0, 0, 1]  # dE's rule off
    assert flags(0.1, 2.0) == [1, 0, 1, 0, 0]  # dC's rule off
    assert flags(1.0, 1.0) == [0] * n_slabs


def _dc_error(e, c, t, tuning, eps):
    cc = c.clone().requires_grad_()
    o = CCEOptions(impl="triton", filter_eps=eps, tuning=tuning)
    linear_cross_entropy_with_options(e, cc, t, None, None, o).backward()
    c0 = c.double().requires_grad_()
    linear_cross_entropy_reference(e.double(), c0, t).backward()
    return rel_err(cc.grad, c0.grad)


def test_dc_rule_meets_its_target_when_every_row_is_sampled():
    """32 valid rows, all sampled: with slab_error_dc a third of the sparse backward's dC error
    (and dE's rule off), dC's rule alone leaves a dC error within it (plus fp32 rounding, 1e-5)."""
    N, D, V = 32, 32, 2000
    eps = 2e-2
    e, c, t = zipf_inputs(N, D, V, dtype=torch.float32, seed=11, ignore_every=0)
    off = _dc_error(e, c, t, Tuning(backward="sparse", dense_slabs=False), eps)
    target = off / 3
    tu = Tuning(
        backward="sparse", dense_kept=2.0, slab_error=2.0, slab_error_dc=target, dense_slab_bytes=N * 4 * 64
    )
    assert off > 1e-3
    assert _dc_error(e, c, t, tu, eps) <= target + 1e-5


@pytest.mark.parametrize("kind,eps", [("zipf", 2e-2), ("near-uniform", EPS)])
def test_dc_estimates_from_sampled_rows(kind, eps):
    """32 of 512 rows sampled (the rule's default): the sum of the slabs' estimated squared dC
    errors within 0.7-1.3x of the sparse backward's true one, each slab's error within 0.6-1.5x,
    ||dC||^2 within 10%. The U-statistic is unbiased but rests on 32 x 31 pairs: 0.84x and 0.99x
    were measured here (deterministic: the sampling is systematic); the bounds leave room for
    rounding across platforms, not for a biased estimate."""
    N, D, V = 512, 32, 3000
    e, c, t = _inputs(kind, N, D, V)
    out = triton_training_forward(e, c, t, eps, Tuning(backward="sparse"))
    g = torch.full((N,), 1.0 / N)
    BN, BV = stats_blocks(torch.float32)
    width = 4 * BV
    est = _estimates(e, c, t, g, out, width, rows=32)
    want = _oracle_dc(e, c, t, g)
    args = (e, c, None, None, None, t, out[1], g, None, -100, 0.0, 0.0, 0.0, True, True, *out[2:8])
    _, dC0 = sparse_backward(*args, dense_slabs=False)
    true = _per_slab(dC0, want, out[5], width)
    got = est.dc_err.double().clamp(min=0)
    assert 0.7**2 < float(got.sum() / true.sum()) < 1.3**2
    ratio = (got / true).sqrt()
    assert float(ratio.min()) > 0.6 and float(ratio.max()) < 1.5
    assert abs(float(est.dc_ref) / float(want.square().sum()) - 1) < 0.1
    assert rel_err(dC0, want) > 1e-2  # the corrections err by much more than the target
