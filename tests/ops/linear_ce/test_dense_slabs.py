"""The dense slabs of the sparse backward (kernels/dense_slabs.py, triton_backward.dense_slab_flags),
under the Triton interpreter on CPU (or on a GPU).

The device marks a slab of the sorted vocabulary dense where the tile filter keeps at least
Tuning.dense_kept of its (block, tile) pairs, and the slabs whose rank-1 corrections err the
most on sampled rows until the rest err by at most Tuning.slab_error (slab_choice.py); a dense
slab's tiles leave the sparse plan and are done exactly. The tests: the sampled errors and the
flags against float64 recomputations; the error rule meets its target when every row is
sampled; all slabs dense gives the exact gradients for every option; a mix of dense and sparse
slabs is exact on the dense slabs' classes and no worse than the sparse backward elsewhere; on
near-uniform rows (the start of training) the error falls from the rank-1 corrections' to the
target.
"""

from __future__ import annotations

import pytest
import torch

from bench.data import zipf_inputs
from cce import CCEOptions, Tuning, linear_cross_entropy_with_options
from cce.reference import linear_cross_entropy_reference
from tests.helpers import rel_err, skipped_mean_logit64

triton = pytest.importorskip("triton")

from cce.ops.linear_ce.kernels.common import slab_tiles, stats_blocks  # noqa: E402
from cce.ops.linear_ce.kernels.tile_stats import decode_tile_mass  # noqa: E402
from cce.ops.linear_ce.rows import RowOrder  # noqa: E402
from cce.ops.linear_ce.slab_choice import (  # noqa: E402
    ERROR_ROWS,
    UNIFORM_SHARE,
    dc_norm_estimate,
    dense_slab_flags,
    sample_rows,
    slab_errors,
)
from cce.ops.linear_ce.triton_backward import loss_coefficients, sparse_backward  # noqa: E402
from cce.ops.linear_ce.triton_impl import linear_ce_triton_fwd  # noqa: E402

OFF = {"dense_slabs": False}


def _fwd(e, c, bias, t, eps, tuning: Tuning, **kw):
    """The training forward of the sparse backward (tile statistics, no stash)."""
    opts = {"reduction": "mean", "softcap": 0.0, "label_smoothing": 0.0, "z_loss": 0.0, **kw}
    return linear_ce_triton_fwd(
        e, c, bias, None, None, t, -100, opts["reduction"], opts["softcap"], opts["label_smoothing"],
        opts["z_loss"], eps, True, False, tuning.stats_chain_tiles, tuning.dz_slab_bytes,
        tuning.de_block_slots, tuning.dc_scratch_tiles, tuning.stash_move_bytes, tuning.dense_slabs,
        tuning.dense_kept, tuning.slab_error, tuning.slab_error_dc, tuning.dense_slab_bytes,
        tuning.first_order, tuning.host_gating, 1.0, False, False,
    )  # fmt: skip


def _grads(e, c, t, bias=None, weight=None, *, eps=2e-3, tuning=None, seed=5, **opts):
    """(loss, dE, dC) through the public API, impl="triton", a random upstream gradient."""
    ee, cc = e.clone().requires_grad_(), c.clone().requires_grad_()
    o = CCEOptions(impl="triton", filter_eps=eps, tuning=tuning, **opts)
    loss = linear_cross_entropy_with_options(ee, cc, t, bias, weight, o)
    up = torch.rand(loss.shape, generator=torch.Generator().manual_seed(seed))
    (loss * up).sum().backward()
    return loss.detach(), ee.grad, cc.grad


def _oracle(e, c, t, bias=None, weight=None, *, seed=5, **opts):
    ee, cc = e.double().requires_grad_(), c.double().requires_grad_()
    b = None if bias is None else bias.double()
    loss = linear_cross_entropy_reference(ee, cc, t, bias=b, weight=weight, **opts)
    up = torch.rand(loss.shape, generator=torch.Generator().manual_seed(seed)).double()
    (loss * up).sum().backward()
    return loss.detach(), ee.grad, cc.grad


def _logits64(e, c, bias, softcap):
    """float64 (softcapped) logits and softcap' of rows e."""
    z = e.double() @ c.double().T
    if bias is not None:
        z = z + bias.double()
    d = torch.ones_like(z)
    if softcap:
        th = torch.tanh(z / softcap)
        z, d = softcap * th, 1 - th * th
    return z, d


def _setup(N, D, V, *, seed, eps, tuning, bias=None, softcap=0.0, ignore=6, delta=None):
    """Forward statistics and the sorted rows' quantities the slab choice reads; with ``delta``
    (an upstream gradient of the entropy) also the entropy's coefficient ``eta_s``."""
    e, c, t = zipf_inputs(N, D, V, dtype=torch.float32, seed=seed)
    if ignore:
        t[::ignore] = -100
    out = _fwd(e, c, bias, t, eps, tuning, softcap=softcap)
    r = RowOrder(t, None, -100)
    g = torch.rand(N, generator=torch.Generator().manual_seed(seed))
    ent = None
    if delta is not None:
        z, _ = _logits64(e, c, bias, softcap)
        ent = (torch.logsumexp(z, 1) - (torch.softmax(z, 1) * z).sum(1)).float()
    alpha, beta, _, eta, _ = loss_coefficients(None, t, out[1], g, None, -100, 0.0, 0.0, V, None, delta, ent)
    srt = lambda x: x.index_select(0, r.perm).contiguous()  # noqa: E731
    s = {
        "e": e, "c": c, "bias": bias, "t": t, "r": r, "code": out[2], "keep": out[3].bool(), "lse": out[1],
        "vperm": out[5], "alpha_s": srt(alpha.float()), "beta_s": srt(beta.float()), "t_s": srt(r.safe_t),
        "lse_s": srt(out[1]), "softcap": softcap, "g": g, "out": out,
        "eta_s": None if eta is None else srt(eta.float()),
    }  # fmt: skip
    return s


def _errors(s, width, rows=ERROR_ROWS):
    BN, BV = stats_blocks(torch.float32)
    return slab_errors(
        s["e"], s["c"], s["bias"], s["r"].erow_s, s["t_s"], s["lse_s"], s["alpha_s"], s["beta_s"], s["code"],
        s["keep"], s["vperm"], s["r"].n_valid, s["softcap"], BN, BV, width, rows, eta_s=s["eta_s"],
    )  # fmt: skip


@pytest.mark.parametrize("softcap,bias,entropy", [(0.0, False, False), (4.0, True, False), (0.0, False, True),
                                                  (4.0, True, True)])  # fmt: skip
def test_slab_errors_against_float64(softcap, bias, entropy):
    """slab_errors: each sampled row's corrections error per slab and its exact dZ @ C, against a
    float64 recomputation from the forward's codes and keep flags (ignored rows, a partial last
    tile and slab, bias and softcap). With ``entropy`` an upstream gradient on the entropy too:
    dZ = p (alpha + eta z) softcap', a skipped tile's coefficient alpha + eta zbar
    (tests.helpers.skipped_mean_logit64), the rows sampled by sum_j |a_ij S'_ij|. fp32 products
    over at most 700 classes: 1e-5 of |ref|."""
    N, D, V = 90, 32, 700
    b = 0.3 * torch.randn(V, generator=torch.Generator().manual_seed(4)) if bias else None
    delta = -0.5 * torch.rand(N, generator=torch.Generator().manual_seed(2)) if entropy else None
    s = _setup(
        N, D, V, seed=1, eps=2e-3, tuning=Tuning(backward="sparse"), bias=b, softcap=softcap, delta=delta
    )
    BN, BV = stats_blocks(torch.float32)
    width = 2 * BV
    err, ref = _errors(s, width, rows=20)[:2]
    r = s["r"]
    pos, scale = sample_rows(s["code"], s["alpha_s"], r.n_valid, 20, s["eta_s"], s["lse_s"], BV, softcap)
    z, d = _logits64(s["e"][r.erow_s[pos]], s["c"], b, softcap)
    ok = (pos < r.n_valid).double()[:, None] * scale.double()[:, None]
    a, be = s["alpha_s"].double()[pos, None] * ok, s["beta_s"].double()[pos, None] * ok
    h = torch.zeros_like(a) if delta is None else s["eta_s"].double()[pos, None] * ok
    ls = s["lse_s"].double()[pos, None]
    dz = torch.exp(z - ls) * (a + h * z) * d
    t = s["t_s"][pos]
    full = dz.clone()
    full[torch.arange(20), t] -= be[:, 0] * d[torch.arange(20), t]
    dz[torch.arange(20), t] = 0
    C = s["c"].double()
    perm = s["vperm"].long()
    M = decode_tile_mass(s["code"][pos]).double()
    S = M * (a + h * skipped_mean_logit64(M, ls, softcap, BV))
    if entropy:
        # The rows' sampling weights sum_j |a_ij S'_ij| (sample_rows: pi = share / n + (1 - share)
        # m / sum(m), scale = 1 / sqrt(k pi)); and ||dC||^2 from every class's exact column.
        Ma = decode_tile_mass(s["code"]).double()
        zbar = skipped_mean_logit64(Ma, s["lse_s"].double()[:, None], softcap, BV)
        m = (Ma * (s["alpha_s"].double()[:, None] + s["eta_s"].double()[:, None] * zbar)).abs().sum(1)
        m = m * (torch.arange(N) < r.n_valid)
        pi = UNIFORM_SHARE / int(r.n_valid) + (1 - UNIFORM_SHARE) * m / m.sum()
        assert torch.allclose(scale.double(), 1 / (20 * pi[pos]).sqrt(), rtol=1e-4)
        est = dc_norm_estimate(
            s["e"], s["c"], b, r.erow_s, s["t_s"], s["lse_s"], s["alpha_s"], s["beta_s"], r.n_valid,
            s["vperm"].long(), softcap, head=V, tail=0, eta_s=s["eta_s"],
        )  # fmt: skip
        ee, cc = s["e"].double(), s["c"].double().requires_grad_()
        b64 = None if b is None else b.double()
        o = linear_cross_entropy_reference(
            ee,
            cc,
            s["t"],
            b64,
            dtype=torch.float64,
            softcap=softcap or None,
            reduction="none",
            return_entropy=True,
        )
        ((o.loss * s["g"].double()).sum() + (o.entropy * delta.double()).sum()).backward()
        # (dZ rounded to fp32 operands, fp32 products over N = 90 rows)
        assert abs(float(est) / float(cc.grad.square().sum()) - 1) < 1e-4
    nt = s["code"].shape[1]
    want = torch.zeros(err.shape, dtype=torch.float64)
    for j in range(nt):
        ids = perm[j * BV : (j + 1) * BV]
        skip = ~s["keep"][pos // BN, j]
        contrib = dz[:, ids] @ C[ids] - S[:, j, None] * C[ids].mean(0)[None, :]
        want[j * BV // width] += contrib * skip[:, None].double()
    assert (err.double() - want).abs().max() <= 1e-5 * ref.double().norm(dim=1).max()
    assert rel_err(ref, full @ C) < 1e-5
    assert want.abs().sum() > 0  # some corrections exist


@pytest.mark.parametrize(
    "dense_kept,slab_error,slab_bytes", [(0.3, 0.05, 2048), (2.0, 0.01, 4096), (0.1, 2.0, 1)]
)
def test_flags_follow_the_rule(dense_kept, slab_error, slab_bytes):
    """dense_slab_flags against the rule recomputed in float64: the kept-share slabs, then the
    slabs of largest corrections error until the vector sum of the rest is within slab_error of
    the exact gradient (with ignored rows, a partial last token block and a partial last slab)."""
    N, V = 90, 700
    tu = Tuning(backward="sparse", dense_slabs=True, dense_kept=dense_kept, slab_error=slab_error)
    s = _setup(N, 32, V, seed=1, eps=2e-3, tuning=tu)
    BN, BV = stats_blocks(torch.float32)
    nt = s["code"].shape[1]
    tps = slab_tiles(N, nt, BV, 4, slab_bytes)
    errors = _errors(s, tps * BV) if slab_error < 1 else None
    got, _ = dense_slab_flags(s["code"], s["keep"], s["r"].n_valid, BN, tps, dense_kept, slab_error, errors)
    nvb = -(-int(s["r"].n_valid) // BN)
    want = []
    for s0 in range(0, nt, tps):
        s1 = min(nt, s0 + tps)
        frac = float(s["keep"][:, s0:s1].double().sum()) / (nvb * (s1 - s0))
        want.append(frac >= dense_kept)
    if errors is not None:
        err, ref = (x.double() for x in errors[:2])
        left = [i for i, w in enumerate(want) if not w]
        left.sort(key=lambda i: -float(err[i].norm()))
        while left and float(sum(err[i] for i in left).norm()) > slab_error * float(ref.norm()):
            want[left.pop(0)] = True
    assert got.tolist() == [int(w) for w in want]
    assert got.dtype == torch.int8


def test_error_rule_meets_its_target_when_every_row_is_sampled():
    """32 valid rows, all of them sampled: the dense slabs chosen by the error rule leave a dE
    error (against float64) of at most slab_error plus fp32 rounding (1e-5), on data where the
    sparse backward alone errs more than three times that."""
    N, D, V = 32, 32, 2000
    eps = 2e-2  # coarse: the corrections carry much of the mass
    e, c, t = zipf_inputs(N, D, V, dtype=torch.float32, seed=11, ignore_every=0)
    _, e0, _ = _oracle(e, c, t)
    _, e_off, _ = _grads(e, c, t, eps=eps, tuning=Tuning(backward="sparse", **OFF))
    off = float(rel_err(e_off, e0))
    target = off / 3
    tu = Tuning(
        backward="sparse", dense_slabs=True, dense_kept=2.0, slab_error=target, dense_slab_bytes=N * 4 * 64
    )
    _, e_on, _ = _grads(e, c, t, eps=eps, tuning=tu)
    assert off > 1e-3
    assert rel_err(e_on, e0) <= target + 1e-5


@pytest.mark.parametrize(
    "dtype,opts,bias,weight",
    [
        (torch.float32, {}, False, False),
        (torch.float32, {"reduction": "sum", "softcap": 3.0}, True, False),
        (torch.float32, {"label_smoothing": 0.1, "z_loss": 1e-3}, False, True),
        (torch.float32, {"reduction": "none", "shift": True}, False, False),
        (torch.float16, {"label_smoothing": 0.05}, True, False),
    ],
)
def test_all_dense_is_exact(dtype, opts, bias, weight):
    """Every slab dense (dense_kept = 0): the gradients of the exact path, for every option the
    sparse backward takes (fp32: 1e-5, the fp32 GEMMs' rounding over D = 33; fp16: dZ is rounded
    to fp16, 2^-11 relative, as in the exact path: 2e-3). N = 40 (more than ERROR_ROWS: the
    rows are sampled; a partial last token block), V = 200 (a partial last tile), D = 33 (a
    partial D chunk): 7 slabs of one fp32 tile (4 of two fp16 tiles) in the interpreter, and the
    first-order terms a candidate of the rule (their cost, 6.5 slabs in fp32, below the slab
    count), so that their estimates run too."""
    N, D, V = 40, 33, 200
    e, c, t = zipf_inputs(N, D, V, dtype=torch.float32, seed=4)
    t[::7] = -100
    g = torch.Generator().manual_seed(9)
    b = (0.5 * torch.randn(V, generator=g)) if bias else None
    w = (0.5 + torch.rand(V, generator=g)) if weight else None
    if opts.get("shift"):
        e, t = e.reshape(2, N // 2, -1), t.reshape(2, N // 2)
    tu = Tuning(
        backward="sparse", dense_slabs=True, dense_kept=0.0, dense_slab_bytes=N * 2 * 64
    )  # several slabs
    l1, e1, c1 = _grads(e.to(dtype), c.to(dtype), t, None if b is None else b.to(dtype), w, tuning=tu, **opts)
    l0, e0, c0 = _oracle(e.to(dtype), c.to(dtype), t, None if b is None else b.to(dtype), w, **opts)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    assert rel_err(l1, l0) < tol
    assert rel_err(e1, e0) < tol and rel_err(c1, c0) < tol
    assert e1.dtype == dtype and c1.dtype == dtype


@pytest.mark.parametrize(
    "dtype,need,opts",
    [
        (torch.float32, "both", {}),
        (torch.float16, "both", {"label_smoothing": 0.05}),
        (torch.float16, "dc", {"softcap": 3.0}),
        (torch.float32, "de", {"z_loss": 1e-3}),
        (torch.float16, "both", {"return_entropy": True}),
    ],
)
def test_all_dense_by_row_blocks(dtype, need, opts, monkeypatch):
    """Every slab dense, the rows in six blocks of 16 (Tuning.dense_slab_bytes bounds a block's
    fp32 dE rows: 16 rows of D = 33), 40% of them ignored, so that the last blocks have a few
    valid rows or none: the gradients of the exact path, as in one block (fp32: 1e-5; fp16: 2e-3,
    dZ's rounding; dC's sum over the blocks in fp16 times S, 2^-11 per block). dC alone has no
    per-row buffer without tensor descriptors (one block), dE alone no dC sum; with the
    entropy's gradient the scale's bound has its eta |z| term."""
    import cce.ops.linear_ce.kernels.backward_sparse as KS

    blocks = []
    run = KS.DenseSlabRun

    def spy(*a, **k):
        r = run(*a, **k)
        blocks.append(r.n_blocks)
        return r

    monkeypatch.setattr(KS, "DenseSlabRun", spy)
    N, D, V = 96, 33, 200
    e, c, t = zipf_inputs(N, D, V, dtype=torch.float32, seed=6)
    t[torch.rand(N, generator=torch.Generator().manual_seed(1)) < 0.4] = -100
    e, c = e.to(dtype), c.to(dtype)
    entropy = opts.pop("return_entropy", False)
    tu = Tuning(backward="sparse", dense_slabs=True, dense_kept=0.0, dense_slab_bytes=16 * 4 * D)
    ee, cc = e.clone().requires_grad_(need != "dc"), c.clone().requires_grad_(need != "de")
    o = CCEOptions(impl="triton", filter_eps=2e-3, tuning=tu, return_entropy=entropy, **opts)
    out = linear_cross_entropy_with_options(ee, cc, t, None, None, o)
    up = float(torch.rand((), generator=torch.Generator().manual_seed(2))) + 0.5
    loss = lambda o: o.loss * up - 0.3 * o.entropy.mean() if entropy else o * up  # noqa: E731
    loss(out).backward()
    assert blocks == [1 if need == "dc" else 6]  # (dC alone holds no per-row buffer off Hopper)
    e64, c64 = e.double().requires_grad_(), c.double().requires_grad_()
    ref = linear_cross_entropy_reference(e64, c64, t, dtype=torch.float64, return_entropy=entropy, **opts)
    loss(ref).backward()
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    if need != "dc":
        assert rel_err(ee.grad, e64.grad) < tol
    if need != "de":
        assert rel_err(cc.grad, c64.grad) < tol


def test_mixed_slabs_exact_where_dense():
    """Zipf data, small slabs, the kept-share rule only: the head slabs are dense and the tail
    sparse (both occur); the dC rows of the dense slabs' classes are exact, and the whole error is
    the sparse backward's (the same skipped tiles minus the dense ones)."""
    N, D, V = 128, 48, 2000
    e, c, t = zipf_inputs(N, D, V, dtype=torch.float32, seed=7)
    t[::5] = -100
    eps = 2e-3
    tu = Tuning(
        backward="sparse", dense_slabs=True, dense_kept=0.2, slab_error=2.0, dense_slab_bytes=N * 4 * 64
    )
    out = _fwd(e, c, None, t, eps, tu)
    g = torch.rand(N, generator=torch.Generator().manual_seed(2))
    args = (e, c, None, None, None, t, out[1], g, None, -100, 0.0, 0.0, 0.0, True, True, *out[2:8])
    kw = {"dense_slabs": True, "dense_kept": 0.2, "slab_error": 2.0, "dense_slab_bytes": N * 4 * 64}
    r = RowOrder(t, None, -100)
    BN, BV = stats_blocks(e.dtype)
    tps = slab_tiles(N, out[2].shape[1], BV, 4, kw["dense_slab_bytes"])
    flags, _ = dense_slab_flags(out[2], out[3].bool(), r.n_valid, BN, tps, 0.2, 2.0)
    assert 0 < int(flags.sum()) < flags.numel()  # both kinds
    dE, dC = sparse_backward(*args, **kw)
    dE_s, dC_s = sparse_backward(*args, **OFF)
    ee, cc = e.double().requires_grad_(), c.double().requires_grad_()
    (linear_cross_entropy_reference(ee, cc, t, reduction="none") * g.double()).sum().backward()
    dense_pos = flags.bool().repeat_interleave(tps)[: out[2].shape[1]].repeat_interleave(BV)[:V]
    dense_ids = out[5].long()[dense_pos]
    assert dense_ids.numel() > 0
    assert rel_err(dC[dense_ids], cc.grad[dense_ids]) < 1e-5
    assert rel_err(dE, ee.grad) <= rel_err(dE_s, ee.grad) + 1e-6
    assert rel_err(dC, cc.grad) <= rel_err(dC_s, cc.grad) + 1e-6


def test_error_rule_on_near_uniform_rows():
    """Near-uniform rows (random logits of std 0.5, the start of training): every tile is
    skipped by the filter (no probability reaches eps = 2^-8, bf16's default) and the rank-1
    corrections' error is large (their first-order term, of relative size about std / sqrt(D),
    is missing); the default rules make enough slabs dense that dE and dC meet the 5e-3 target
    (the rule's target is 2.5e-3 on the sampled rows; twice that allows for the sampling)."""
    g = torch.Generator().manual_seed(3)
    N, D, V = 64, 32, 3000
    e = torch.randn(N, D, generator=g) * 0.5**0.5 / D**0.25
    c = torch.randn(V, D, generator=g) * 0.5**0.5 / D**0.25
    t = torch.randint(0, V, (N,), generator=g)
    _, e0, c0 = _oracle(e, c, t)
    _, e_off, c_off = _grads(e, c, t, eps=2.0**-8, tuning=Tuning(backward="sparse", **OFF))
    _, e_on, c_on = _grads(e, c, t, eps=2.0**-8, tuning=Tuning(backward="sparse", dense_slabs=True))
    assert rel_err(e_off, e0) > 1e-2  # the corrections alone
    assert rel_err(e_on, e0) < 5e-3 and rel_err(c_on, c0) < 5e-3


def test_sample_rows():
    """sample_rows: every row once when N <= k; otherwise valid rows only, a uniform share
    evenly spread, and a row carrying the skipped mass drawn about (1 - UNIFORM_SHARE) k times,
    each with scale 1 / sqrt(k pi)."""
    N, nt, k = 200, 4, 32
    code = torch.full((N, nt), 255, dtype=torch.uint8)
    alpha = torch.ones(N)
    n_valid = torch.tensor([150], dtype=torch.int32)
    pos, scale = sample_rows(code[:20], alpha[:20], n_valid, k)
    assert pos.tolist() == list(range(20)) and scale.tolist() == [1.0] * 20
    pos, scale = sample_rows(code, alpha, n_valid, k)  # no skipped mass: uniform
    assert pos.numel() == k and int(pos.max()) < 150 and len(set(pos.tolist())) == k
    assert torch.allclose(scale, torch.full((k,), (150 / k) ** 0.5))
    code[10] = 0  # mass 1 per tile on row 10 only
    pos, scale = sample_rows(code, alpha, n_valid, k)
    heavy = pos == 10
    pi = UNIFORM_SHARE / 150 + (1 - UNIFORM_SHARE)
    assert abs(int(heavy.sum()) - k * pi) <= 1 and int(pos.max()) < 150
    assert torch.allclose(scale[heavy], torch.full((int(heavy.sum()),), (k * pi) ** -0.5))
    assert torch.allclose(
        scale[~heavy], torch.full((int((~heavy).sum()),), (k * UNIFORM_SHARE / 150) ** -0.5)
    )


@pytest.mark.parametrize("V, width, R", [(12000, 8192, 5), (4100, 4096, 40), (300, 64, 33)])
def test_slab_products_against_float64(V, width, R):
    """slab_products: per slab of ``width`` sorted positions, the rows' weighted sum of the slab's
    classes, also where a slab is split into parts over more programs (V = 12000: slabs of 8192
    positions in parts of 2048, the last slab's fourth part past V), where the last slab is
    short, and with rows in two blocks (R > SLAB_PRODUCTS_ROWS_FP32, fp32 weights)."""
    from cce.ops.linear_ce.kernels.dense_slabs import slab_products

    g = torch.Generator().manual_seed(V)
    D = 48
    c = torch.randn(V, D, generator=g)
    w = torch.randn(R, V + 11, generator=g)  # positions past V are no classes
    perm = torch.randperm(V, generator=g)
    got = slab_products(w, c, perm, width)
    n_slabs = -(-V // width)
    assert got.shape == (n_slabs, R, D)
    cs = c.double()[perm]
    want = torch.stack([w.double()[:, s * width : min((s + 1) * width, V)] @ cs[s * width : (s + 1) * width]
                        for s in range(n_slabs)])  # fmt: skip
    # fp32 products and sums over up to 8192 terms of size ~1 (randn): relative error ~1e-6.
    assert rel_err(got, want) < 1e-5
