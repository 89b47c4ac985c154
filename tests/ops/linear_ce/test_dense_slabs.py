"""The dense slabs of the sparse backward (kernels/dense_slabs.py, triton_backward.dense_slab_flags),
under the Triton interpreter on CPU (or on a GPU).

The device marks a slab of the sorted vocabulary dense where the tile filter keeps at least
Tuning.dense_kept of its (block, tile) pairs, or where the slabs from it to the end hold more
than Tuning.skip_mass of the rows' skipped non-target mass; a dense slab's tiles leave the sparse
plan and are done exactly. The tests: the flags against a float64 recomputation of the rule;
all slabs dense gives the exact gradients for every option; a mix of dense and sparse slabs is
exact on the dense slabs' classes and no worse than the sparse backward elsewhere; on
near-uniform rows (the start of training) the mass rule makes everything dense and the error
falls from the rank-1 corrections' to rounding.
"""

from __future__ import annotations

import pytest
import torch

from bench.data import zipf_inputs
from cce import CCEOptions, Tuning, linear_cross_entropy_with_options
from cce.reference import linear_cross_entropy_reference
from tests.helpers import rel_err

triton = pytest.importorskip("triton")

from cce.ops.linear_ce.kernels.common import slab_tiles, stats_blocks  # noqa: E402
from cce.ops.linear_ce.kernels.tile_stats import decode_tile_mass  # noqa: E402
from cce.ops.linear_ce.rows import RowOrder  # noqa: E402
from cce.ops.linear_ce.triton_backward import dense_slab_flags, loss_coefficients, sparse_backward  # noqa: E402
from cce.ops.linear_ce.triton_impl import linear_ce_triton_fwd  # noqa: E402

OFF = {"dense_slabs": False}


def _fwd(e, c, bias, t, eps, tuning: Tuning, **kw):
    """The training forward of the sparse backward (tile statistics, no stash)."""
    opts = {"reduction": "mean", "softcap": 0.0, "label_smoothing": 0.0, "z_loss": 0.0, **kw}
    return linear_ce_triton_fwd(
        e, c, bias, None, None, t, -100, opts["reduction"], opts["softcap"], opts["label_smoothing"],
        opts["z_loss"], eps, True, False, tuning.stats_chain_tiles, tuning.dz_slab_bytes,
        tuning.de_block_slots, tuning.dc_scratch_tiles, tuning.stash_move_bytes, tuning.dense_slabs,
        tuning.dense_kept,
        tuning.skip_mass, tuning.dense_slab_bytes,
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


@pytest.mark.parametrize(
    "dense_kept,skip_mass,slab_bytes", [(0.3, 0.05, 2048), (2.0, 0.01, 4096), (0.1, 2.0, 1)]
)
def test_flags_follow_the_rule(dense_kept, skip_mass, slab_bytes):
    """dense_slab_flags against the rule recomputed in float64 from the forward's codes and keep
    flags (with ignored rows, a partial last token block and a partial last slab)."""
    e, c, t = zipf_inputs(90, 32, 700, dtype=torch.float32, seed=1)
    t[::6] = -100
    tu = Tuning(
        backward="sparse",
        dense_slabs=True,
        dense_kept=dense_kept,
        skip_mass=skip_mass,
        dense_slab_bytes=slab_bytes,
    )
    eps = 2e-3
    out = _fwd(e, c, None, t, eps, tu)
    code, keep = out[2], out[3]
    r = RowOrder(t, None, -100)
    g = torch.rand(90, generator=torch.Generator().manual_seed(0))
    alpha = loss_coefficients(None, t, out[1], g, None, -100, 0.0, 0.0, 700)[0]
    alpha_s = alpha.index_select(0, r.perm).float()
    BN, BV = stats_blocks(e.dtype)
    nt = code.shape[1]
    tps = slab_tiles(90, nt, BV, 4, slab_bytes)
    got = dense_slab_flags(code, keep.bool(), alpha_s, r.n_valid, BN, tps, dense_kept, skip_mass)
    mass = (alpha_s.double().abs()[:, None] * decode_tile_mass(code).double()).sum(0)
    nvb = -(-int(r.n_valid) // BN)
    want = []
    for s0 in range(0, nt, tps):
        s1 = min(nt, s0 + tps)
        behind = float(mass[s0:].sum() / alpha_s.double().abs().sum())
        frac = float(keep[:, s0:s1].double().sum()) / (nvb * (s1 - s0))
        want.append(int(frac >= dense_kept or behind > skip_mass))
    assert got.tolist() == want
    assert got.dtype == torch.int8


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
    sparse backward takes (fp32: 1e-5, the fp32 GEMMs' rounding over D = 40; fp16: dZ is rounded
    to fp16, 2^-11 relative, as in the exact path: 2e-3)."""
    e, c, t = zipf_inputs(96, 40, 500, dtype=torch.float32, seed=4)
    t[::7] = -100
    g = torch.Generator().manual_seed(9)
    b = (0.5 * torch.randn(500, generator=g)) if bias else None
    w = (0.5 + torch.rand(500, generator=g)) if weight else None
    if opts.get("shift"):
        e, t = e.reshape(2, 48, -1), t.reshape(2, 48)
    tu = Tuning(
        backward="sparse", dense_slabs=True, dense_kept=0.0, dense_slab_bytes=96 * 2 * 64
    )  # several slabs
    l1, e1, c1 = _grads(e.to(dtype), c.to(dtype), t, None if b is None else b.to(dtype), w, tuning=tu, **opts)
    l0, e0, c0 = _oracle(e.to(dtype), c.to(dtype), t, None if b is None else b.to(dtype), w, **opts)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    assert rel_err(l1, l0) < tol
    assert rel_err(e1, e0) < tol and rel_err(c1, c0) < tol
    assert e1.dtype == dtype and c1.dtype == dtype


def test_mixed_slabs_exact_where_dense():
    """Zipf data, small slabs, the kept-share rule only: the head slabs are dense and the tail
    sparse (both occur); the dC rows of the dense slabs' classes are exact, and the whole error is
    the sparse backward's (the same skipped tiles minus the dense ones)."""
    N, D, V = 128, 48, 2000
    e, c, t = zipf_inputs(N, D, V, dtype=torch.float32, seed=7)
    t[::5] = -100
    eps = 2e-3
    tu = Tuning(
        backward="sparse", dense_slabs=True, dense_kept=0.2, skip_mass=2.0, dense_slab_bytes=N * 4 * 64
    )
    out = _fwd(e, c, None, t, eps, tu)
    g = torch.rand(N, generator=torch.Generator().manual_seed(2))
    args = (e, c, None, None, None, t, out[1], g, None, -100, 0.0, 0.0, 0.0, eps, True, True, *out[2:])
    kw = {"dense_slabs": True, "dense_kept": 0.2, "skip_mass": 2.0, "dense_slab_bytes": N * 4 * 64}
    r = RowOrder(t, None, -100)
    alpha = loss_coefficients(None, t, out[1], g, None, -100, 0.0, 0.0, V)[0]
    BN, BV = stats_blocks(e.dtype)
    tps = slab_tiles(N, out[2].shape[1], BV, 4, kw["dense_slab_bytes"])
    flags = dense_slab_flags(
        out[2], out[3].bool(), alpha.index_select(0, r.perm).float(), r.n_valid, BN, tps, 0.2, 2.0
    )
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


def test_mass_rule_on_near_uniform_rows():
    """Near-uniform rows (random logits of std 0.5, the start of training): every tile is
    skipped by the filter (no probability reaches eps = 2^-8, bf16's default) and the rank-1
    corrections' error is large (their first-order term, of relative size about std / sqrt(D),
    is missing); the default rules make the slabs dense and the gradients exact."""
    g = torch.Generator().manual_seed(3)
    N, D, V = 64, 32, 3000
    e = torch.randn(N, D, generator=g) * 0.5**0.5 / D**0.25
    c = torch.randn(V, D, generator=g) * 0.5**0.5 / D**0.25
    t = torch.randint(0, V, (N,), generator=g)
    _, e0, c0 = _oracle(e, c, t)
    _, e_off, c_off = _grads(e, c, t, eps=2.0**-8, tuning=Tuning(backward="sparse", **OFF))
    _, e_on, c_on = _grads(e, c, t, eps=2.0**-8, tuning=Tuning(backward="sparse", dense_slabs=True))
    assert rel_err(e_off, e0) > 1e-2  # the corrections alone
    assert rel_err(e_on, e0) < 1e-5 and rel_err(c_on, c0) < 1e-5
