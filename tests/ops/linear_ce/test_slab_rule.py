"""The dense-slab rule's decision in two launches (kernels/slab_rule.py), under the Triton
interpreter on CPU (or on a GPU).

slab_choice.dense_slab_flags runs the rule as two kernels on the slabs' Gram matrices up to
RULE_KERNEL_SLABS slabs and as torch ops past it. The tests: both give the same flags on random
errors for every combination of the rule's parts (kept share, dE's greedy rule with and without
the first-order variant, dC's rule with and without its own first-order estimate, rules off),
and the kernel's flags equal the greedy rule recomputed in float64 from the vectors themselves
(not from their Gram matrix) including errors that cancel between slabs.
"""

from __future__ import annotations

import itertools

import pytest
import torch

triton = pytest.importorskip("triton")

from cce.ops.linear_ce.kernels.slab_rule import RULE_KERNEL_SLABS  # noqa: E402
from cce.ops.linear_ce.slab_choice import SlabErrors, dense_slab_flags  # noqa: E402

BN = 16
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter on CPU


def _case(n_slabs, tps, k, D, seed, cancel=False):
    """Random rule inputs: keep [n_blocks, nt] with a few mostly-kept slabs, err / fo fp32
    [n_slabs, k, D] of spread scales (fo close to err on some slabs), dC estimates (one
    negative, as the unbiased estimate can be), ||dE||^2 and ||dC||^2 estimates."""
    g = torch.Generator().manual_seed(seed)
    nt = n_slabs * tps - int(torch.randint(0, tps, (1,), generator=g))  # a partial last slab
    N = 70
    n_valid = torch.tensor([int(torch.randint(40, N + 1, (1,), generator=g))], dtype=torch.int32)
    nb = -(-N // BN)
    p = torch.rand(nt, generator=g) ** 3  # most tiles rarely kept, a few often
    keep = torch.rand(nb, nt, generator=g) < p[None, :]
    scale = torch.rand(n_slabs, 1, 1, generator=g) ** 2
    err = torch.randn(n_slabs, k, D, generator=g) * scale
    if cancel:  # pairs of slabs whose errors nearly cancel
        err[1::2] = -err[0:-1:2] * 0.9 + 0.01 * torch.randn(err[1::2].shape, generator=g)
    fo = err * torch.rand(n_slabs, 1, 1, generator=g) + 0.1 * torch.randn(n_slabs, k, D, generator=g) * scale
    dc = torch.rand(n_slabs, generator=g) ** 2
    dc[0] = -0.01
    dc_fo = dc * torch.rand(n_slabs, generator=g)
    ref_sq = (err.sum(0).square().sum() * (2 + 8 * torch.rand((), generator=g))).reshape(())
    dc_ref = (dc.clamp(min=0).sum() * (2 + 8 * torch.rand((), generator=g))).reshape(())
    ref = torch.randn(k, D, generator=g)
    errs = SlabErrors(*(x.to(DEV) for x in (err, ref, fo, dc, dc_fo, dc_ref, ref_sq)))
    return keep.to(DEV), n_valid.to(DEV), nt, errs


def _both(keep, n_valid, nt, tps, dense_kept, slab_error, errors, cost, **kw):
    code = torch.zeros((1, nt), dtype=torch.uint8, device=DEV)
    k = dense_slab_flags(code, keep, n_valid, BN, tps, dense_kept, slab_error, errors, cost, **kw)
    t = dense_slab_flags(
        code, keep, n_valid, BN, tps, dense_kept, slab_error, errors, cost, max_kernel_slabs=0, **kw
    )
    return k, t


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("n_slabs,tps", [(1, 3), (5, 2), (17, 1), (RULE_KERNEL_SLABS, 1)])
def test_kernel_equals_torch_rule(seed, n_slabs, tps):
    """The same dense flags and first-order flag from the kernels and the torch ops, for every
    combination of the rule's parts."""
    keep, n_valid, nt, errs = _case(n_slabs, tps, 3, 8, seed)
    # (dense_kept, slab_error, slab_error_dc, fo, cost, dC estimates, dC's own fo estimate)
    combos = itertools.product((0.3, 2.0), (0.05, 0.2, 1.0), (None, 0.1), (False, True), (False, True))
    for dense_kept, se, se_dc, with_fo, with_dc in combos:
        e = errs._replace(
            fo=errs.fo if with_fo else None,
            dc_err=errs.dc_err if with_dc else None,
            dc_err_fo=errs.dc_err_fo if with_dc and seed % 2 else None,
            dc_ref=errs.dc_ref if with_dc else None,
        )
        for cost in (None, 0.5, 2.0) if with_fo else (None,):
            (dk, fk), (dt, ft) = _both(keep, n_valid, nt, tps, dense_kept, se, e, cost, slab_error_dc=se_dc)
            assert dk.dtype == torch.int8 and fk.dtype == torch.int32 and fk.shape == (1,)
            assert dk.tolist() == dt.tolist(), (dense_kept, se, se_dc, with_fo, with_dc, cost)
            assert fk.tolist() == ft.tolist(), (dense_kept, se, se_dc, with_fo, with_dc, cost)
    (dk, fk), (dt, ft) = _both(keep, n_valid, nt, tps, 0.3, 0.05, None, None)  # no errors
    assert dk.tolist() == dt.tolist() and fk.tolist() == ft.tolist() == [0]


@pytest.mark.parametrize("with_fo", [False, True])
def test_gram_over_many_partials(with_fo):
    """Long error vectors (k x D = 8 x 512: the Gram kernel's chunk loop over several blocks in
    each of many programs, their partials summed by the decision): the same flags as the torch
    rule."""
    keep, n_valid, nt, errs = _case(9, 2, 8, 512, seed=7)
    e = errs._replace(fo=errs.fo if with_fo else None)
    for se in (0.05, 0.2, 0.5):
        (dk, fk), (dt, ft) = _both(keep, n_valid, nt, 2, 2.0, se, e, 0.5 if with_fo else None)
        assert dk.tolist() == dt.tolist() and fk.tolist() == ft.tolist(), se


@pytest.mark.parametrize("seed", range(3))
def test_kernel_against_float64_vectors(seed):
    """The kernel's greedy dE rule (from Gram matrices) against the rule on the vectors in
    float64, with errors that nearly cancel between slabs (their vector sum is small)."""
    n_slabs, tps = 12, 2
    keep, n_valid, nt, errs = _case(n_slabs, tps, 4, 16, seed, cancel=True)
    keep = torch.zeros_like(keep)  # no slab dense by the kept share
    err = errs.err.double().cpu()
    norms = err.flatten(1).norm(dim=1)
    total = float(err.sum(0).norm())
    e = errs._replace(
        fo=None, dc_err=None, dc_err_fo=None, dc_ref=None, ref_sq=torch.tensor(total**2, device=DEV)
    )
    for rel in (0.02, 0.1, 0.3, 0.6):
        bound = rel * total
        got, _ = dense_slab_flags(
            torch.zeros((1, nt), dtype=torch.uint8), keep, n_valid, BN, tps, 2.0, rel, e
        )
        left = sorted(range(n_slabs), key=lambda i: -float(norms[i]))
        want = [False] * n_slabs
        while left and float(err[left].sum(0).norm()) > bound:
            want[left.pop(0)] = True
        assert got.tolist() == [int(w) for w in want], rel


def _systematic_f64(mass, n_valid, k, rows, share=0.0, add=0.0):
    """(pi, u) of the systematic sample in float64: the probabilities and the k quantiles."""
    M = mass.numel()
    m = mass.double()
    nv = max(int(n_valid), 1)
    uni = (torch.arange(M) < int(n_valid)).double() / nv
    if rows:
        heavy = m / m.sum() if m.sum() > 0 else uni
        pi = share * uni + (1 - share) * heavy
    else:
        pi = (m + nv * add) / (m + nv * add).sum()
    return pi, (torch.arange(k, dtype=torch.float64) + 0.5) / k


@pytest.mark.parametrize("rows", [True, False])
@pytest.mark.parametrize(
    "M,k,nv", [(50, 32, 50), (1000, 32, 700), (3000, 17, 3000), (600, 64, 1), (5000, 512, 4000)]
)
def test_systematic_sample_against_float64(rows, M, k, nv):
    """slab_rule.systematic_sample (fp32 cumulative sums over chunks: chunk sums, per-chunk
    histograms of the quantile indices, the pick): each drawn item
    is the one whose float64 cumulative interval holds the quantile (j + 1/2) / k (up to fp32
    rounding: quantiles on an interval's end, as with uniform masses, may go either way), with
    weight 1 / sqrt(k pi) (rows) or 1 / (k pi); heavy items are drawn several times; zero
    masses (rows: uniform over the valid ones) included."""
    from cce.ops.linear_ce.kernels.slab_rule import systematic_sample

    g = torch.Generator().manual_seed(M + k)
    n_valid = torch.tensor([nv], dtype=torch.int32)
    for mass in (
        torch.rand(M, generator=g) ** 4,
        torch.where(torch.rand(M, generator=g) < 0.01, 50.0, 0.0),  # a few heavy items
        torch.zeros(M),
    ):
        if rows:
            mass = torch.where(torch.arange(M) < nv, mass, 0.0)  # no mass past the valid rows
        kw = {"share": 0.5} if rows else {"add": 1.0 / M}
        pos, wt = systematic_sample(mass.to(DEV), n_valid.to(DEV), k, rows=rows, **kw)
        pos, wt = pos.cpu(), wt.cpu()
        pi, u = _systematic_f64(mass, n_valid, k, rows, **kw)
        assert pos.dtype == torch.int64 and wt.dtype == torch.float32
        cdf = pi.cumsum(0)
        lo = torch.cat([torch.zeros(1, dtype=torch.float64), cdf])[pos]  # the interval of pos
        hi = cdf[pos]
        assert bool((lo <= u + 1e-6).all() and (hi >= u - 1e-6).all() and (pi[pos] > 0).all())
        want = (k * pi[pos]).rsqrt() if rows else 1.0 / (k * pi[pos])
        torch.testing.assert_close(wt.double(), want, rtol=1e-5, atol=0)
        if rows and nv < M:
            assert int(pos.max()) < nv


@pytest.mark.parametrize("softcap", [0.0, 30.0])
def test_row_masses_read_the_steps_slogs(softcap):
    """slab_rule.row_masses with the entropy's coefficient: reading the step's skipped_slogs
    (tile_stats) gives what solving them in the kernel gives (the same fp32 expression), and
    both equal sum_j |(alpha_i + eta_i (lse_i - log BV)) S_ij + eta_i slog_ij| in float64 from the
    decoded masses, rows of all-255 codes (no skipped mass) and partial row / tile blocks
    included."""
    import math

    from cce.ops.linear_ce.kernels.slab_rule import row_masses
    from cce.ops.linear_ce.kernels.tile_stats import STATS_STEPS, decode_tile_mass, skipped_slogs

    g = torch.Generator().manual_seed(7)
    N, nt, BV = 45, 150, 256
    code = torch.randint(0, 256, (N, nt), generator=g, dtype=torch.int32).to(torch.uint8)
    code[3] = 255
    alpha = torch.randn(N, generator=g)
    eta = torch.randn(N, generator=g)
    lse = 5 + 3 * torch.rand(N, generator=g)
    args = [x.to(DEV) for x in (code, alpha, eta, lse)]
    slog = skipped_slogs(args[0], args[3], softcap, BV)
    solved = row_masses(args[0], args[1], STATS_STEPS, args[2], args[3], BV, softcap)
    read = row_masses(args[0], args[1], STATS_STEPS, args[2], args[3], BV, softcap, slog)
    torch.testing.assert_close(read, solved, rtol=2e-6, atol=0)
    S = decode_tile_mass(code).double()
    a = (alpha.double() + eta.double() * (lse.double() - math.log(BV)))[:, None]
    want = (a * S + eta.double()[:, None] * slog.cpu().double()).abs().sum(1)
    torch.testing.assert_close(read.cpu().double(), want, rtol=1e-5, atol=1e-6)
    assert float(read[3]) == 0.0
