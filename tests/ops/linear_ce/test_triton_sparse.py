"""The sparse backward of impl="triton" (forward tile statistics, cce/triton_impl.sparse_backward),
under the Triton interpreter on CPU (or on a GPU).

Its filter: a tile (token block x vocabulary tile, vocabulary in the forward's sorted order) is
recomputed only if the forward's statistic Sq (each row's tile max, rounded up to 1/8 nat) says
some non-target probability may reach eps; a skipped tile adds alpha_i S'_ij mean(C_j) to dE_i
(S'_ij its non-target mass as decoded from the uint8 code the forward keeps, see
tile_stats.encode_tile_stats) and q_v G_j to dC_v; the target entries are exact. The tests check the raw
statistics and the codes against float64 truth, that skipping is sound (every skipped entry is
below eps), and that the gradient error obeys the stated bound (docs/design.md):

    |err dE_i| <= sum_{skipped j} ( sum_{v in j, v != t_i} |dZ_iv| |c_v - mean C_j|
                                   + alpha_i |S'_ij - S_ij| |mean C_j| )
    |err dC_v| <= sum_{i: (block(i), j(v)) skipped, t_i != v} |dZ_iv| |e_i| + q_v |G_j|

with dZ = alpha p softcap' (the non-target part of the logit gradient). fp32 inputs (the bound's
terms are then far above fp32 rounding, which gets a 1e-6 relative slack).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.data import zipf_inputs
from cce import _math, linear_cross_entropy
from tests.helpers import rel_err, skipped_mean_logit64

triton = pytest.importorskip("triton")

from cce.ops.linear_ce.kernels import stash as KST  # noqa: E402
from cce.ops.linear_ce.kernels import tile_stats as KT  # noqa: E402
from cce.ops.linear_ce.kernels.common import stats_blocks  # noqa: E402
from cce.ops.linear_ce.kernels.dc_skipped import kept_sum_tiles  # noqa: E402
from cce.ops.linear_ce.kernels.forward import linear_ce_forward  # noqa: E402
from cce.ops.linear_ce.kernels.sparse_plan import kept_scratch_tiles  # noqa: E402
from cce.ops.linear_ce.rows import RowOrder, vocab_scores  # noqa: E402
from cce.ops.linear_ce.triton_backward import sparse_backward  # noqa: E402
from cce.ops.linear_ce.triton_impl import linear_ce_triton_fwd  # noqa: E402
from cce.options import Tuning  # noqa: E402

_T = Tuning()


def _fwd(e, c, bias, rows, t, red, softcap, ls, zl, eps, stash=False, temperature=1.0):
    """linear_ce_triton_fwd of a training step of the sparse backward (default tuning)."""
    return linear_ce_triton_fwd(
        e, c, bias, None, rows, t, -100, red, softcap, ls, zl, eps, True, stash, _T.stats_chain_tiles,
        _T.dz_slab_bytes, _T.de_block_slots, _T.dc_scratch_tiles, _T.stash_move_bytes, _T.dense_slabs,
        _T.dense_kept, _T.slab_error, _T.slab_error_dc, _T.dense_slab_bytes, _T.first_order,
        _T.host_gating, temperature, False, False,
    )  # fmt: skip


F16_REL = 2.0**-11  # fp16 rounding, relative


def _raw_stats(e, c, t, eps, bias=None, softcap=0.0):
    """The forward kernel's raw tile statistics (forward.FwdStats: st, sq, m0 on sorted rows), the
    vocabulary order and the row order, as linear_ce_triton_fwd computes them."""
    r = RowOrder(t, None, -100)
    vperm, _ = vocab_scores(e, c, bias, r)
    t_s = r.safe_t.index_select(0, r.perm)
    out = linear_ce_forward(e, c, bias, None, r.erow_s, t_s, r.n_valid, softcap, False, perm=vperm, eps=eps)
    return out, vperm, r


def _truth(e, c, t, bias, softcap, temperature=1.0):
    """float64 logits (softcapped, then divided by the temperature), lse and softcap' of the whole
    problem."""
    z = e.double() @ c.double().T
    if bias is not None:
        z = z + bias.double()
    scp = torch.ones_like(z)
    if softcap > 0:
        th = torch.tanh(z / softcap)
        z, scp = softcap * th, 1 - th**2
    z = z / temperature
    return z, torch.logsumexp(z, 1), scp


@pytest.mark.parametrize("softcap", [0.0, 4.0])
def test_forward_tile_statistics(softcap):
    """St is the tile's non-target log-mass (x softcap') relative to m0 up to fp16 rounding; m0 is
    a lower bound of lse; Sq / 8 bounds the tile's non-target max (relative to m0 + log eps)."""

    e, c, t = zipf_inputs(70, 40, 300, dtype=torch.float32, seed=3)
    t[::9] = -100
    bias = 0.3 * torch.randn(300)
    eps = 1e-3
    out, vperm, r = _raw_stats(e, c, t, eps, bias, softcap)
    st, sq, m0, zt = out.st, out.sq, out.m0, out.tgt
    n = int(r.n_valid)
    rows = r.perm[:n]
    z, lse, scp = _truth(e, c, t, bias, softcap)
    z, lse, scp, ts = z[rows][:, vperm], lse[rows], scp[rows][:, vperm], t[rows]
    assert (m0[:n].double() <= lse + 1e-5).all()
    assert torch.allclose(zt[:n].double(), z.gather(1, (vperm.argsort()[ts])[:, None]).squeeze(1), atol=1e-5)
    BN, BV = stats_blocks(e.dtype)
    is_t = vperm[None, :] == ts[:, None]
    mass = torch.where(is_t, 0.0, torch.exp(z - lse[:, None]) * scp)
    assert (lse - m0[:n].double()).max() > 0.05  # the head tile's lse is not the whole lse
    for j in range(st.shape[1]):
        cols = slice(j * BV, (j + 1) * BV)
        got = torch.exp(st[:n, j].double() + m0[:n].double() - lse)
        want = mass[:, cols].sum(1)
        tol = (torch.exp(F16_REL * st[:n, j].double().abs()) - 1) * want + 1e-6 * want + 1e-30
        assert ((got - want).abs() <= tol).all(), j
        u = torch.where(is_t[:, cols], -math.inf, z[:, cols]).max(1).values - m0[:n].double() - math.log(eps)
        q = sq[:n, j].double()
        assert ((q / 8 >= u - 1e-5) | (q == 127)).all(), j
        assert ((q >= -1) & (q <= 127)).all()
        assert (q[u > -0.125] == torch.ceil(8 * u[u > -0.125]).clamp(max=127)).float().mean() > 0.95


@pytest.mark.parametrize("chain", [None, 3])
def test_encoded_tile_statistics(chain):
    """What the backward keeps of the statistics (tile_stats.encode_tile_stats): a tile is kept for a token
    block iff one of its rows' bounds Sq / 8 reaches lse - m0 (or is 127); the skipped tiles'
    masses are coded with their rounding carried along each row's chain of tiles, so that every
    running sum of decoded masses stays within the carry bound of the true running sum:

        |sum_{j <= k} S'_ij - S_ij| <= h / (1 - h) max_{j <= k} S_ij + fp16 error of St,
        h = exp(1 / (2 STEPS)) - 1 (half a code step)

    (and kept tiles, ignored rows code 255, mass 0). ``chain`` 3 splits the tiles into several
    carry chains (each starts at zero carry)."""
    chain = chain or _T.stats_chain_tiles
    e, c, t = zipf_inputs(70, 48, 800, dtype=torch.float32, seed=5)
    t[::9] = -100
    eps = 5e-3
    out, vperm, r = _raw_stats(e, c, t, eps)
    BN, BV = stats_blocks(e.dtype)
    code, keep = KT.encode_tile_stats(out.st, out.sq, out.m0, out.lse, r.n_valid, BN, chain)
    n, N = int(r.n_valid), len(t)
    nt = out.st.shape[1]
    assert code.dtype == torch.uint8 and code.shape == (N, nt) and keep.shape == (-(-N // BN), nt)
    # keep: the block OR of the rows' rule
    need = (out.lse - out.m0)[:n, None].double()
    q = out.sq[:n].double()
    kr = (q / 8 >= need) | (q == 127)
    want = torch.zeros(keep.shape, dtype=torch.bool)
    for b in range(keep.shape[0]):
        want[b] = kr[b * BN : (b + 1) * BN].any(0)
    assert torch.equal(keep.bool(), want)
    frac = want[: -(-n // BN)].float().mean()
    assert 0 < frac < 0.7, frac  # both kinds of tiles, mostly skipped ones
    # codes: the true masses, float64, in the walking order
    z, lse, _ = _truth(e, c, t, None, 0.0)
    rows = r.perm[:n]
    z, lse, ts = z[rows][:, vperm], lse[rows], t[rows]
    mass = torch.where(vperm[None, :] == ts[:, None], 0.0, torch.exp(z - lse[:, None]))
    S = torch.nn.functional.pad(mass, (0, nt * BV - mass.shape[1])).view(n, nt, BV).sum(2)
    skipped = ~keep.bool()[torch.arange(n) // BN]
    S = torch.where(skipped, S, 0.0)
    dec = KT.decode_tile_mass(code[:n]).double()
    assert (dec[~skipped] == 0).all() and (code[n:] == 255).all()
    h = math.exp(1 / (2 * KT.STATS_STEPS)) - 1
    f16 = S * (torch.exp(F16_REL * (out.st[:n].double().abs() + 1)) - 1)
    L = chain
    for j0 in range(0, nt, L):
        cols = slice(j0, min(nt, j0 + L))
        carry = (S[:, cols].cumsum(1) - dec[:, cols].cumsum(1)).abs()
        bound = (
            h / (1 - h) * S[:, cols].cummax(1).values + f16[:, cols].cumsum(1) + 1e-7 * S[:, cols].cumsum(1)
        )
        assert (carry <= bound + 1e-12).all(), (carry - bound).max()
    # ... and it can fail: codes one step off (6% on each mass) break it.
    off = KT.decode_tile_mass((code[:n].int() + 1).clamp(max=255).to(torch.uint8)).double()
    assert ((S.cumsum(1) - off.cumsum(1)).abs() > h / (1 - h) * S.cummax(1).values + f16.cumsum(1)).any()


def _bound(e, c, t, bias, softcap, alpha, plan, vperm, r, eta=None, temperature=1.0):
    """Per sorted row / per vocabulary id, the stated error bounds of dE and dC (float64).

    With ``eta`` (the entropy's coefficient per row) dZ = p (alpha + eta z) softcap' and a
    skipped tile's correction coefficient is a_ij S'_ij = (alpha_i + eta_i zbar_ij) S'_ij, zbar
    the tile's modelled mean logit (tests.helpers.skipped_mean_logit64); the dE bound's mass term
    |sum_v dZ_iv - a_ij S'_ij| |mean C_j| is alpha_i |S_ij - S'_ij| |mean C_j| without eta."""
    BN, BV = stats_blocks(e.dtype)
    n = int(r.n_valid)
    rows = r.perm[:n]
    z, lse, scp = _truth(e, c, t, bias, softcap, temperature)
    a = alpha.double()[rows]
    h = torch.zeros_like(a) if eta is None else eta.double()[rows]
    ts = t[rows]
    dzs = torch.exp(z[rows] - lse[rows][:, None]) * (a[:, None] + h[:, None] * z[rows]) * scp[rows]
    dzs = torch.where(torch.arange(c.shape[0])[None, :] == ts[:, None], 0.0, dzs)  # signed
    dz = dzs.abs()
    es, cs = e.double()[r.erow_s[:n]], c.double()
    keep = plan.keep.bool()
    dec = KT.decode_tile_mass(plan.code[:n]).double()
    be = torch.zeros(n, dtype=torch.float64)
    bc = torch.zeros(c.shape[0], dtype=torch.float64)
    for j in range(keep.shape[1]):
        ids = vperm[j * BV : (j + 1) * BV]
        cm = cs[ids].mean(0)
        spread = (cs[ids] - cm).norm(dim=1)
        for b in range(keep.shape[0]):
            blk = slice(b * BN, min((b + 1) * BN, n))
            if blk.start >= n or keep[b, j]:
                continue
            D = dz[blk][:, ids]
            Sd = dec[blk, j]
            # (the tempered logits' softcap is softcap / T: the codes' softcap' is of those)
            zbar = skipped_mean_logit64(Sd, lse[rows][blk], softcap / temperature, BV)
            coef = (a[blk] + h[blk] * zbar) * Sd
            be[blk] += D @ spread + (dzs[blk][:, ids].sum(1) - coef).abs() * cm.norm()
            bc[ids] += D.T @ es[blk].norm(dim=1)
        bc[ids] += plan.q[j * BV : (j + 1) * BV].double() * plan.g[j].double().norm()
    return be, bc


@pytest.mark.parametrize(
    "opts",
    [
        {}, {"softcap": 3.0}, {"z_loss": 1e-2}, {"label_smoothing": 0.1}, {"reduction": "sum"},
        {"bias": True}, {"temperature": 0.6}, {"temperature": 1.4, "softcap": 3.0, "bias": True},
    ],
    ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()) or "plain",
)  # fmt: skip
def test_sparse_filter_sound_and_within_stated_bound(opts):
    """With a coarse threshold most tiles are skipped: every skipped entry is below eps, and the
    corrected gradients obey the stated bound against the exact ones; at a temperature, of the
    tempered logits (softcap(x) / T: the same bound with dZ its gradient). N = 40 rows (3 token
    blocks, the last partial), V = 700 (22 tiles, the last partial)."""
    from cce.reference import linear_cross_entropy_reference

    opts = dict(opts)
    e, c, t = zipf_inputs(40, 48, 700, dtype=torch.float32, seed=9)
    t[::11] = -100
    bias = (
        0.2 * torch.randn(700, generator=torch.Generator().manual_seed(1))
        if opts.pop("bias", False)
        else None
    )
    softcap = opts.get("softcap", 0.0)
    ls = opts.get("label_smoothing", 0.0)
    zl = opts.get("z_loss", 0.0)
    red = opts.get("reduction", "mean")
    temp = opts.get("temperature", 1.0)
    eps = 2e-3
    out = _fwd(e, c, bias, None, t, red, softcap, ls, zl, eps, temperature=temp)
    lse, code, keep, zt, vperm, vscore = out[1:7]
    valid = t != -100
    w_t = _math.target_weight(None, t, valid)
    g = _math.row_upstream(torch.ones(()), w_t, red, len(t))
    dE, dC, plan = sparse_backward(
        e, c, bias, None, None, t, lse, g, None, -100, softcap, ls, zl, True, True,
        code, keep, zt, vperm, vscore, return_plan=True, temperature=temp,
    )  # fmt: skip
    # The exact gradients: the float64 oracle on the same inputs (the fp32 paths' own rounding,
    # ~1e-7 relative, then gets the 1e-6 relative slack below).
    ed, cd = e.double().requires_grad_(), c.double().requires_grad_()
    opts64 = dict(softcap=softcap or None, label_smoothing=ls, z_loss=zl, reduction=red, temperature=temp)
    linear_cross_entropy_reference(
        ed, cd, t, None if bias is None else bias.double(), dtype=torch.float64, **opts64
    ).backward()
    dE0, dC0 = ed.grad, cd.grad
    r = RowOrder(t, None, -100)
    n = int(r.n_valid)
    BN, BV = stats_blocks(e.dtype)
    frac = float(1 - plan.keep[: -(-n // BN)].float().mean())
    assert frac > 0.3, frac  # the test must exercise the skipped-tile terms
    # Sound: no skipped non-target entry reaches eps.
    z, lse_t, _ = _truth(e, c, t, bias, softcap, temp)
    rows = r.perm[:n]
    p = torch.exp(z[rows] - lse_t[rows][:, None])[:, vperm]
    p = torch.where(vperm[None, :] == t[rows][:, None], 0.0, p)
    skipped = ~plan.keep.bool()[torch.arange(n) // BN].repeat_interleave(BV, dim=1)[:, : c.shape[0]]
    assert (p[skipped] < eps).all()
    k = _math.LossConsts(ls, zl, c.shape[0])
    alpha, _, _ = _math.coefficients(
        g, None, lse, w_t, _math.weight_total(None, c.shape[0], e.device), valid, k
    )
    be, bc = _bound(e, c, t, bias, softcap, alpha / temp, plan, vperm, r, temperature=temp)
    err_e = (dE.double() - dE0.double())[r.erow_s[:n]].norm(dim=1)
    err_c = (dC.double() - dC0.double()).norm(dim=1)
    assert (err_e <= be + 1e-6 * dE0.norm()).all()
    assert (err_c <= bc + 1e-6 * dC0.norm()).all()
    assert (dE[~valid] == 0).all()
    # ... and the bound is small against the gradient itself here.
    assert rel_err(dE, dE0) < 2e-2 and rel_err(dC, dC0) < 2e-2


@pytest.mark.parametrize(
    "softcap,d,temp",
    [(0.0, 0.01, 1.0), (3.0, 0.01, 1.0), (0.0, 1.0, 1.0), (3.0, 1.0, 1.0), (3.0, 1.0, 0.7)],
    ids=["plain", "softcap", "entropy-large", "softcap-entropy-large", "softcap-entropy-large-T0.7"],
)
def test_sparse_entropy_term_within_stated_bound(softcap, d, temp):
    """A gradient on the entropy output (loss - d H per row, random row weights; d = 1: an
    entropy term as large as the loss's) in the sparse backward: kept tiles and the targets carry
    eta p z exactly, a skipped tile's correction the coefficient alpha + eta zbar (its mean logit
    to first order, tests.helpers.skipped_mean_logit64; with softcap the codes' mass carries
    softcap'). The gradients against the float64 oracle obey the stated bound of _bound (with
    eta), which is small against the gradient here; the entropy's own part of dE and dC is found
    to the filter's accuracy. N = 40 rows (3 token blocks, the last partial), V = 700 (22 tiles,
    the last partial)."""
    from cce.reference import linear_cross_entropy_reference

    N = 40
    e, c, t = zipf_inputs(N, 48, 700, dtype=torch.float32, seed=9)
    t[::11] = -100
    eps = 2e-3
    out = _fwd(e, c, None, None, t, "none", softcap, 0.0, 0.0, eps, temperature=temp)
    lse, code, keep, zt, vperm, vscore = out[1:7]
    valid = t != -100
    gen = torch.Generator().manual_seed(3)
    g = torch.rand(N, generator=gen) / N  # random upstream of the per-row loss
    delta = -d * torch.rand(N, generator=gen) / N  # ... and of the entropy
    z, lse_t, _ = _truth(e, c, t, None, softcap, temp)
    p = torch.softmax(z, 1)
    H = (lse_t - (p * z).sum(1)).float()
    dE, dC, plan = sparse_backward(
        e, c, None, None, None, t, lse, g, None, -100, softcap, 0.0, 0.0, True, True,
        code, keep, zt, vperm, vscore, return_plan=True, delta=delta, entropy=H, temperature=temp,
    )  # fmt: skip
    ed, cd = e.double().requires_grad_(), c.double().requires_grad_()
    o = linear_cross_entropy_reference(
        ed,
        cd,
        t,
        None,
        dtype=torch.float64,
        softcap=softcap or None,
        reduction="none",
        return_entropy=True,
        temperature=temp,
    )
    (o.entropy * delta.double()).sum().backward(retain_graph=True)
    dEH0, dCH0 = ed.grad.clone(), cd.grad.clone()  # the entropy term's part of dE and dC
    (o.loss * g.double()).sum().backward()
    dE0, dC0 = ed.grad, cd.grad
    r = RowOrder(t, None, -100)
    n = int(r.n_valid)
    BN, _ = stats_blocks(e.dtype)
    assert float(1 - plan.keep[: -(-n // BN)].float().mean()) > 0.3  # skipped tiles exercised
    w_t = _math.target_weight(None, t, valid)
    k = _math.LossConsts(0.0, 0.0, c.shape[0])
    alpha, beta, _ = _math.coefficients(
        g, None, lse, w_t, _math.weight_total(None, c.shape[0], e.device), valid, k
    )
    alpha, _, eta = _math.output_coefficients(alpha, beta, None, delta, lse, H, valid)
    be, bc = _bound(e, c, t, None, softcap, alpha / temp, plan, vperm, r, eta / temp, temp)
    err_e = (dE.double() - dE0)[r.erow_s[:n]].norm(dim=1)
    err_c = (dC.double() - dC0).norm(dim=1)
    assert (err_e <= be + 1e-6 * dE0.norm()).all()
    assert (err_c <= bc + 1e-6 * dC0.norm()).all()
    assert (dE[~valid] == 0).all()
    # The entropy's gradient -d p (log p + H) sits more in the tail than the loss's (p where
    # log p is far below -H), so the same coarse filter leaves more of it to the corrections:
    # a few % at d = 1 (where the dense-slab rule, off here, takes over), as for the loss alone
    # at d = 0.01.
    tol = 2e-2 if d <= 0.01 else 1e-1
    assert rel_err(dE, dE0) < tol and rel_err(dC, dC0) < tol
    # The entropy's part: what the backward adds for it (against the same call without delta)
    # is the exact float64 term up to the filter's error (checked where the term is not lost in
    # that error: at d = 1, where it is 25-72% of dE's norm; 0.2-2% at d = 0.01).
    dE1, dC1 = sparse_backward(
        e, c, None, None, None, t, lse, g, None, -100, softcap, 0.0, 0.0, True, True,
        code, keep, zt, vperm, vscore, temperature=temp,
    )  # fmt: skip
    if d >= 1:
        assert dEH0.norm() > 0.1 * dE0.norm()
        assert rel_err(dE - dE1, dEH0) < 0.2 and rel_err(dC - dC1, dCH0) < 0.2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("opts", [{}, {"shift": True, "label_smoothing": 0.1}, {"reduction": "none"}])
def test_sparse_public_api_vs_exact(dtype, opts):
    """Through the public API (which picks the sparse backward when e or c needs a gradient, the
    filter is on and bias needs none) against filter_eps=None, on zipf data with a coarse filter."""
    e, c, t = zipf_inputs(96, 40, 500, dtype=dtype, seed=4)
    t[::7] = -100
    lead = (2, 48) if opts.get("shift") else (96,)
    e, t = e.reshape(*lead, -1), t.reshape(lead)

    def run(eps):
        ee, cc = e.clone().requires_grad_(), c.clone().requires_grad_()
        loss = linear_cross_entropy(ee, cc, t, impl="triton", filter_eps=eps, **opts)
        up = torch.rand(loss.shape, generator=torch.Generator().manual_seed(5))  # random upstream
        (loss * up).sum().backward()
        return loss.detach(), ee.grad, cc.grad

    l1, e1, c1 = run(2e-3)
    l0, e0, c0 = run(None)
    assert rel_err(l1, l0) <= 1e-5  # the forward is not filtered
    # The stated bound on this data (test above) is a few 1e-3 of the gradient's norm; fp16 adds
    # 2^-11 rounding of the gradients.
    assert rel_err(e1, e0) < 2e-2 and rel_err(c1, c0) < 2e-2
    assert e1.dtype == dtype and c1.dtype == dtype


def test_scratch_and_recompute_agree():
    """A kept tile's dZ comes from a scratch slot (the dC writer's first kept_scratch_tiles kept
    tiles, the dE writer's first Tuning.de_block_slots per block) or is recomputed by the writers: both
    give the same gradients, whatever the number of slots."""
    e, c, t = zipf_inputs(64, 48, 800, dtype=torch.float32, seed=2)
    eps = 2e-3
    out = _fwd(e, c, None, None, t, "mean", 0.0, 0.0, 0.0, eps)
    g = torch.full((64,), 1 / 64)
    args = (e, c, None, None, None, t, out[1], g, None, -100, 0.0, 0.0, 0.0, True, True, *out[2:8])
    dE, dC, plan = sparse_backward(*args, return_plan=True)
    cap = kept_scratch_tiles(64, e.dtype)
    assert 0 < cap < int(plan.n_kept)  # both sources in use
    assert int(plan.cnt_e.max()) > _T.de_block_slots  # ... in the dE writer too
    for slots, de_slots in ((0, 0), (10**4, 1), (10**4, 10**3)):
        dE2, dC2 = sparse_backward(*args, de_block_slots=min(de_slots, 64), dc_scratch_tiles=slots)
        assert torch.allclose(dE2, dE, rtol=1e-6, atol=1e-9) and torch.allclose(dC2, dC, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_kept_tiles_target_sums_from_scratch_and_loop_agree(smoothing):
    """The target sums of the tiles with kept blocks come from the class kernel's fp32 scratch
    (the first tiles within kept_sums_bytes: a buffer of its own without dE, else the stash's
    free head, here two tiles' worth once the dC writer's dZ slots leave it) or from the
    kept-tile kernel's own loop over their rows: dC agrees with the scratch in full, in part
    and off. The sums differ only in their order of fp32 additions, at most about n 2^-24 of
    the sum of their n <= N terms' magnitudes: the test allows N 2^-24 of dC's largest entry
    (the zipf head's classes, whose rows dominate dC, are the ones with many terms; measured:
    3e-8 of it). dE does not read them."""
    e, c, t = zipf_inputs(64, 48, 800, dtype=torch.float32, seed=2)
    out = _fwd(e, c, None, None, t, "mean", 0.0, smoothing, 0.0, 2e-3)
    g = torch.rand(64, generator=torch.Generator().manual_seed(3)) / 64

    def run(need_de, **kw):
        loss = (-100, 0.0, smoothing, 0.0)  # ignore_index, softcap, label_smoothing, z_loss
        args = (e, c, None, None, None, t, out[1], g, None, *loss, need_de, True, *out[2:8])
        return sparse_backward(*args, return_plan=True, **kw)

    _, dC, plan = run(False)
    BV = stats_blocks(e.dtype)[1]
    n_kept = int((plan.cnt_c > 0).sum())
    assert n_kept >= 3  # tiles on both sides of a one- or two-tile scratch
    assert kept_sum_tiles(BV, 48, -(-800 // BV)) >= n_kept  # all in the scratch of its own
    dE, _, _ = run(True)
    for need_de, kw in (
        (False, {"kept_sums_bytes": BV * 48 * 4}),
        (False, {"kept_sums_bytes": 0}),
        (True, {}),
        (True, {"dc_scratch_tiles": 0}),
    ):
        dE2, dC2, _ = run(need_de, **kw)
        assert (dC2 - dC).abs().max() <= 64 * 2.0**-24 * dC.abs().max(), kw
        assert dE2 is None or torch.equal(dE2, dE)


@pytest.mark.parametrize(
    "dtype,D,shift",
    [
        (torch.float32, 48, False),
        (torch.float32, 48, True),
        (torch.float16, 40, True),
        (torch.float32, 6, False),
    ],
)
def test_stash_layout_gives_the_same_gradients(dtype, D, shift):
    """The training forward's stash (dE's buffer holding the codes in its tail, the dE pass in
    rounds around them, the rows moved to e2d's order at the end) gives bit for bit the
    gradients of separate buffers, with ignored rows and the shifted rows' gaps at zero. D = 128
    (fp32) also holds the dE writer's kept-tile slots in the stash; D = 6 not even the codes
    (they would take more than half of it)."""
    move = 7 * D * 4  # several row moves
    n, V, eps = 96, 400, 2e-3
    e, c, t = zipf_inputs(n, D, V, dtype=dtype, seed=3)
    t[5::9] = -100
    t[:20] = -100  # ignored rows ahead of valid ones: the sorted order moves rows
    rows = None
    if shift:
        rows = torch.arange(n).view(2, -1)[:, :-1].reshape(-1)
        t = t.view(2, -1)[:, 1:].reshape(-1)
    N = t.numel()
    nt = -(-V // stats_blocks(dtype)[1])
    fits = KST.code_fits_stash(N, nt, n, D, dtype)
    assert fits == (D != 6)
    BN, BV = stats_blocks(dtype)
    slot0, _, protect = KST.stash_layout(
        N, n, D, e.element_size(), nt if fits else 0, BN, BV, _T.de_block_slots
    )
    assert (slot0 is not None) == (D == 128)
    rounds = KST.de_rounds(N, D, BN, protect)
    if D >= 48:  # the dE pass takes several rounds in place, then a last one on copies
        assert len(rounds) >= 2 and not rounds[0][2] and (rounds[-1][2] or shift), rounds
    g = torch.rand(N, generator=torch.Generator().manual_seed(0))
    res = []
    for stash in (False, True):
        out = _fwd(e, c, None, rows, t, "mean", 0.0, 0.0, 0.0, eps, stash)
        assert (out[2].numel() == 0) == (stash and fits)
        assert out[7].shape == ((n, D) if stash else (0,))
        if stash:  # poison (0xff bytes: NaN) all but the codes: no unwritten byte may matter
            raw = out[7].view(-1).view(torch.uint8)
            raw[: raw.numel() - (N * nt if fits else 0)] = 255
        dE, dC = sparse_backward(
            e, c, None, None, rows, t, out[1], g, None, -100, 0.0, 0.0, 0.0, True, True, *out[2:8],
            move_bytes=move,
        )  # fmt: skip
        if stash:
            assert dE.data_ptr() == out[7].data_ptr()  # written in place
        res.append((dE, dC))
    (e0, c0), (e1, c1) = res
    assert torch.equal(e0, e1) and torch.equal(c0, c1)
    hit = torch.zeros(n, dtype=torch.bool)
    hit[rows if rows is not None else torch.arange(n)] = t != -100
    assert (e1[~hit] == 0).all() and (e1[hit].abs().sum(1) > 0).all()


@settings(max_examples=300, deadline=None)
@given(
    N=st.integers(1, 3000),
    extra=st.integers(0, 64),
    D=st.integers(1, 5000),
    es=st.sampled_from([2, 4]),
    nt=st.integers(0, 1200),
    BN=st.sampled_from([16, 128]),
    BV=st.sampled_from([32, 128, 256]),
    S=st.sampled_from([0, 1, 2]),
)
def test_stash_rounds_never_overwrite_what_is_still_read(N, extra, D, es, nt, BN, BV, S):
    """stash.stash_layout / stash.de_rounds: the slots (aligned) lie before the codes, which end the
    stash; the rounds cover the sorted rows in order, in whole blocks; a round in place writes
    no element that its rows or later ones still read (protect), the last one may (it reads
    copies) only when few blocks or rounds remain or no block would fit."""
    M = N + extra
    T = M * D * es
    code = nt if KST.code_fits_stash(N, nt, M, D, torch.float16 if es == 2 else torch.float32) else 0
    slot0, code_lo, protect = KST.stash_layout(N, M, D, es, code, BN, BV, S)
    assert code_lo * es <= T - N * code
    if slot0 is not None:
        assert slot0 >= 0 and slot0 % KST.STASH_ALIGN == 0
        assert slot0 + -(-N // BN) * S * BN * BV <= code_lo
    rounds = KST.de_rounds(N, D, BN, protect)
    assert rounds[0][0] == 0 and rounds[-1][1] == N
    assert all(not last for *_, last in rounds[:-1])
    for a, b, last in rounds:
        assert a % BN == 0 and a < b and (b == N or b % BN == 0)
        if not last:
            assert b * D <= protect(a)  # in place: the rows written end before what is still read
        else:
            few = N - a <= KST.de_final_blocks() * BN or len(rounds) == KST.DE_MAX_ROUNDS
            assert few or (a + BN) * D > protect(a)
    for (_, b, _), (a, _, _) in zip(rounds, rounds[1:], strict=False):
        assert a == b
    # Each round leaves at most ~2/3 of the rows to the next when the codes and the slots of a
    # row take at most a third of its dE (H100 bf16, BV = 256, S = 2: D >= 1536 + codes).
    if 3 * (code + S * BV * es) <= D * es:
        assert len(rounds) <= 3 + math.ceil(math.log(max(N / BN, 1), 1.5))


def test_stash_second_backward_raises():
    """The stash holds dE after the backward: a second backward through the same graph raises
    (autograd's saved-tensor version check) instead of reading a gradient as statistics."""
    e, c, t = zipf_inputs(16, 16, 160, dtype=torch.float32, seed=1)
    e.requires_grad_()
    loss = linear_cross_entropy(e, c, t, impl="triton", filter_eps=2e-3)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="inplace"):
        loss.backward()


def test_rows_move_to_e2d_order():
    """stash.to_e_rows: in place, row r <- row src[r] (0 where src[r] < 0) for src[r] <= r, through
    bounded temporaries (forced small here)."""
    gen = torch.Generator().manual_seed(0)
    for M, D in ((1, 3), (37, 5), (64, 8)):
        keep = torch.rand(M, generator=gen) < 0.6
        src = torch.where(keep, torch.cumsum(keep, 0) - 1, -1)  # valid-first order of kept rows
        x = torch.randn(M, D, generator=gen)
        x[0, 0] = float("nan")  # the rows of src < 0 read row 0: they are 0 all the same
        want = torch.where(keep[:, None], x[src.clamp(min=0)], 0.0)
        KST.to_e_rows(x, src, 4 * D * 5)
        torch.testing.assert_close(x, want, rtol=0, atol=0, equal_nan=True)
        assert (x[~keep] == 0).all()


@pytest.mark.parametrize("entropy", [False, True])
def test_minus_inf_bias_masking_whole_tiles(entropy):
    """A -inf bias masking the last 150 classes (whole vocabulary tiles at the end of the sorted
    order, whose forward scores are all -inf): the skipped tiles' dC spread q has nothing to
    spread there (0, not the NaN of a softmax over -inf), so every gradient is finite and, with
    the filter's corrections, close to the float64 oracle; the masked classes get dC = 0."""
    from cce.reference import linear_cross_entropy_reference

    N, D, V = 64, 32, 600
    e, c, t = zipf_inputs(N, D, V, dtype=torch.float32, seed=2)
    t[::5] = -100
    b = torch.zeros(V)
    b[-150:] = float("-inf")
    t = torch.where(t >= V - 150, t % (V - 150), t)  # no target among the masked classes
    eps = 2e-3
    out = _fwd(e, c, b, None, t, "none", 0.0, 0.0, 0.0, eps)
    g = torch.rand(N, generator=torch.Generator().manual_seed(2)) / N
    kw = {}
    z, lse_t, _ = _truth(e, c, t, b, 0.0)
    if entropy:
        p = torch.softmax(z, 1)
        H = (lse_t - torch.where(p > 0, p * z, 0.0).sum(1)).float()
        kw = dict(delta=-torch.rand(N, generator=torch.Generator().manual_seed(3)) / N, entropy=H)
    dE, dC, plan = sparse_backward(
        e, c, b, None, None, t, out[1], g, None, -100, 0.0, 0.0, 0.0, True, True, *out[2:8],
        return_plan=True, **kw,
    )  # fmt: skip
    assert torch.isinf(out[6]).sum() >= 150 and torch.isfinite(plan.q).all()
    assert torch.isfinite(dE).all() and torch.isfinite(dC).all()
    assert (dC[-150:] == 0).all()
    ed, cd = e.double().requires_grad_(), c.double().requires_grad_()
    o = linear_cross_entropy_reference(
        ed, cd, t, b.double(), dtype=torch.float64, reduction="none", return_entropy=True
    )
    total = (o.loss * g.double()).sum()
    if entropy:
        total = total + (o.entropy * kw["delta"].double()).sum()
    total.backward()
    # the filter's error on this data, as in the tests above (a few 1e-3; 4% with a large
    # entropy term)
    assert rel_err(dE, ed.grad) < 0.1 and rel_err(dC, cd.grad) < 0.1


@settings(max_examples=200, deadline=None)
@given(st.integers(-110, 110), st.integers(0, 2**31 - 1))
def test_target_product_split_is_exact(exp, seed):
    """The dC writers' target rows on the tensor cores (common.add_dc_targets with SPLIT_DOT, the
    GPU's path: the interpreter's bf16 products are wrong, so the kernel cannot run it here) split
    x = coef_i e_i into three bf16 parts whose sum is x exactly; the same roundings in torch (round
    to nearest even, as the kernel's casts), on random values, on ones with all 24 significant
    bits set and on bf16 rounding ties, at magnitudes 2^-110 .. 2^110. Exact where |x| >= 2^-110
    (below, the last part falls under bf16's smallest normal, 2^-126, and loses bits: an error
    below 2^-126)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4096, generator=g, dtype=torch.float64)
    # all 24 significant bits set (two signs), bf16 rounding ties (to even, both ways), the last bit
    x[:6] = torch.tensor(
        [1 - 2**-24, -(2 - 2**-23), 1 + 2**-8, 1 + 3 * 2**-8, -(1.5 - 2**-23), 1 + 2**-23],
        dtype=torch.float64,
    )
    x = (x * 2.0**exp).float()
    hi = x.to(torch.bfloat16)
    rest = x - hi.float()
    mid = rest.to(torch.bfloat16)
    lo = (rest - mid.float()).to(torch.bfloat16)
    err = (hi.double() + mid.double() + lo.double() - x.double()).abs()
    big = x.double().abs() >= 2.0**-110
    assert torch.all(err[big] == 0)
    assert torch.all(err <= 2.0**-126)


def test_split_dot_only_where_bf16_products_are_right(monkeypatch):
    """split_dot (add_dc_targets' SPLIT_DOT): never under the interpreter or off CUDA; on CUDA from
    Ampere on (bf16 tensor-core products), the fp32 product before."""
    from cce.ops.linear_ce.kernels import common

    assert common.split_dot(torch.device("cpu")) is False
    monkeypatch.setattr(common, "interpreting", lambda: False)
    for cap, want in (((7, 5), False), ((8, 0), True), ((9, 0), True)):
        monkeypatch.setattr(common, "capability", lambda device, cap=cap: cap)
        assert common.split_dot(torch.device("cuda", 0)) is want
    monkeypatch.setattr(common, "interpreting", lambda: True)
    assert common.split_dot(torch.device("cuda", 0)) is False


@pytest.mark.parametrize("shift", [False, True])
def test_backward_reads_the_forwards_orders(shift):
    """The sparse backward given the forward's orders (``order``, ``n_valid``) gives the gradients
    it gives when it makes them again, bit for bit; with ignored rows, and with ``rows`` (the
    causal shift's) so that the sorted rows' e2d rows come from both; dense slabs on."""
    N, D, V = 48, 40, 700
    e, c, t = zipf_inputs(N, D, V, dtype=torch.float32, seed=5)
    t[::7] = -100
    rows = None
    if shift:  # problem row i reads e2d row rows[i] (two sequences of 25 positions, last dropped)
        e = torch.cat([e, e[:2] * 0.5])
        rows = torch.arange(N + 2).view(2, 25)[:, :-1].reshape(-1)
    eps = 2e-3
    out = _fwd(e, c, None, rows, t, "mean", 0.0, 0.0, 0.0, eps)
    order, n_valid = out[11], out[12]
    assert order.shape == (3 * N + V,) and int(n_valid) == int((t != -100).sum())
    g = torch.rand(N)
    args = (e, c, None, None, rows, t, out[1], g, None, -100, 0.0, 0.0, 0.0, True, True, *out[2:8])
    kw = dict(dense_slabs=True, slab_error=0.05, dense_kept=0.5)
    dE, dC = sparse_backward(*args, **kw)
    dE2, dC2 = sparse_backward(*args, **kw, order=order, n_valid=n_valid)
    assert torch.equal(dE, dE2) and torch.equal(dC, dC2)


@pytest.mark.parametrize(
    "A,B,transposed", [(0, 5, False), (1, 1, False), (7, 33, False), (9, 130, True), (3, 16400, False)]
)
def test_compact_lists(A, B, transposed):
    """common.compact_lists against its definition: each row's set columns in order, zeros after
    (the dump slot included), and the counts; a transposed (strided) input; all-set and empty
    rows; past COMPACT_MAX_COLS columns (the torch form)."""
    from cce.ops.linear_ce.kernels.common import compact_lists

    keep = torch.rand(B, A).T if transposed else torch.rand(A, B)
    keep = keep < 0.3
    if A > 2:
        keep[1] = True
        keep[2] = False
    lst, cnt = compact_lists(keep)
    assert lst.shape == (A, B + 1) and lst.dtype == cnt.dtype == torch.int32
    for a in range(A):
        cols = keep[a].nonzero().flatten()
        assert int(cnt[a]) == cols.numel()
        assert torch.equal(lst[a, : cols.numel()].long(), cols)
        assert (lst[a, cols.numel() :] == 0).all()


@pytest.mark.parametrize("n_rows", [1, 15, 16, 17, 33, 50])
def test_dc_target_rows_over_many_groups(n_rows):
    """The dC writer takes a tile's target rows in groups of BLOCK_R (16 here), loading a group's
    indices two groups ahead and its rows of E one group ahead (common.add_dc_targets): with
    ``n_rows`` rows targeting one class (up to four groups, partial ones included) and the other
    rows spread, dC against float64 within the filter's bound (a few 1e-3 on this data, as in the
    tests above). A group left out or taken twice moves that class's row of dC by 16 rows' e_i / N,
    most of the gradient's norm here."""
    N = 64
    e, c, t = zipf_inputs(N, 32, 300, dtype=torch.float32, seed=6)
    gen = torch.Generator().manual_seed(7)
    t = torch.randint(1, 300, (N,), generator=gen)
    t[:n_rows] = 0
    t[n_rows::9] = -100
    eps = 2e-3
    out = _fwd(e, c, None, None, t, "mean", 0.0, 0.0, 0.0, eps)
    g = torch.rand(N, generator=gen) / N  # a random upstream gradient per row
    args = (e, c, None, None, None, t, out[1], g, None, -100, 0.0, 0.0, 0.0, True, True, *out[2:8])
    dE, dC = sparse_backward(*args)
    from cce.reference import linear_cross_entropy_reference

    ed, cd = e.double().requires_grad_(), c.double().requires_grad_()
    loss = linear_cross_entropy_reference(ed, cd, t, None, dtype=torch.float64, reduction="none")
    (loss * g.double()).sum().backward()
    assert rel_err(dC, cd.grad) < 2e-2 and rel_err(dE, ed.grad) < 2e-2
    # the target class's row alone, where a group's mistake would show
    assert rel_err(dC[0], cd.grad[0]) < 2e-2
