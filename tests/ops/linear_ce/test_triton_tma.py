"""The forward kernel's tensor-descriptor (TMA) path against its plain-load path and float64 truth.

On Hopper the forward reads its tiles through tensor descriptors: the valid-first rows of e are
gathered into one buffer, and a sorted vocabulary is walked in slabs whose rows are gathered
first. The interpreter runs descriptor loads too, so these tests force ``tma=True`` on the CPU
and compare every output of ``linear_ce_forward`` with the plain-load path (``tma=False``) on
the same inputs, over the edges the slabs add: V not a multiple of the tile, D not a multiple of
the D chunk (the descriptor zero-fills past D and past the last row), slabs of one and of several
tiles, the head tile in the first slab, ignored rows, bias, softcap, smoothing weights.

Tolerances. Both paths accumulate each logit in fp32 over the same D chunks in the same order,
and the tile epilogue is one function, so lse, the target logit and the smoothing sum agree to
fp32 rounding of the sums over V (1e-6 relative). The fp16 statistic St may round differently by
one fp16 ulp (2^-10 relative) and the int8 bound Sq by one code where 8 u sits on an integer.
"""

from __future__ import annotations

import math

import pytest
import torch

triton = pytest.importorskip("triton")

from cce.ops.linear_ce.kernels.backward_exact import linear_ce_backward_exact  # noqa: E402
from cce.ops.linear_ce.kernels.common import use_tma  # noqa: E402
from cce.ops.linear_ce.kernels.forward import FWD_SLAB_BYTES, fwd_slab_tiles, linear_ce_forward  # noqa: E402
from cce.ops.linear_ce.rows import RowOrder  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _ids(case):
    return "-".join(f"{k}={v}" for k, v in case.items()) or "plain"


def _inputs(N, D, V, dtype, seed, ignore_every=5):
    g = torch.Generator().manual_seed(seed)
    e = (torch.randn(N, D, generator=g) / D**0.25).to(dtype)
    c = (torch.randn(V, D, generator=g) / D**0.25).to(dtype)
    t = torch.randint(0, V, (N,), generator=g)
    if ignore_every:
        t[::ignore_every] = -100
    return e.to(DEV), c.to(DEV), t.to(DEV)


def _run(e, c, t, tma, *, stats=False, bias=None, weight=None, softcap=0.0, slab_bytes=None, seed=0):
    r = RowOrder(t, None, -100)
    ts = r.safe_t.index_select(0, r.perm)
    perm = None
    if stats:
        perm = torch.randperm(c.shape[0], generator=torch.Generator().manual_seed(seed)).to(DEV)
    out = linear_ce_forward(
        e, c, bias, weight, r.erow_s, ts, r.n_valid, softcap, weight is not None,
        perm=perm, eps=1e-3 if stats else 0.0, tma=tma, slab_bytes=slab_bytes,
    )  # fmt: skip
    return out, r


CASES = [
    dict(),
    dict(stats=True),
    dict(stats=True, slab_bytes=1),  # one tile per slab
    dict(stats=True, slab_bytes=3 * 32 * 40 * 4),  # three tiles per slab (fp32 rows), last one short
    dict(bias=True),
    dict(stats=True, bias=True, softcap=3.0, slab_bytes=2 * 32 * 40 * 4),
    dict(weight=True, softcap=2.5),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_tma_path_matches_plain_loads(case, dtype):
    N, D, V = 37, 40, 203  # V: 6 full tiles of 32 and a short one; D: one full chunk and a partial
    e, c, t = _inputs(N, D, V, dtype, seed=11)
    g = torch.Generator().manual_seed(5)
    kw = dict(case)
    kw["bias"] = (0.5 * torch.randn(V, generator=g)).to(DEV) if case.get("bias") else None
    kw["weight"] = torch.rand(V, generator=g).to(DEV) if case.get("weight") else None
    got, r = _run(e, c, t, True, **kw)
    want, _ = _run(e, c, t, False, **kw)
    n = int(r.n_valid)
    assert n < N  # ignored rows present
    for name in ("lse", "tgt", "ssum", "m0"):
        a, b = getattr(got, name), getattr(want, name)
        if b is None:
            assert a is None
            continue
        assert torch.isfinite(a).all()
        assert torch.allclose(a[:n], b[:n], rtol=1e-6, atol=1e-5), (name, (a - b).abs().max())
        assert (a[n:] == 0).all()  # ignored rows: zeros, as the plain path
    if case.get("stats"):
        st_a, st_b = got.st[:n].float(), want.st[:n].float()
        fin = torch.isfinite(st_b)
        assert (torch.isfinite(st_a) == fin).all()
        assert ((st_a - st_b)[fin].abs() <= 2.0**-10 * st_b[fin].abs() + 1e-3).all()
        qa, qb = got.sq[:n].int(), want.sq[:n].int()
        assert (qa - qb).abs().max() <= 1
        assert (qa == qb).float().mean() > 0.99
        # The tiles' means of C: formed by the slab copies here, by a pass of their own there
        # (the same fp32 sums of the same rows).
        assert got.cm.shape == want.cm.shape == (-(-V // 32), D)
        assert torch.allclose(got.cm, want.cm, rtol=1e-6, atol=1e-6)
    else:
        assert got.cm is None and want.cm is None


def test_tma_lse_against_float64_truth():
    """The descriptor path on its own: lse and target logits against float64 on the same inputs,
    with several vocabulary slabs and the statistics on."""
    N, D, V = 45, 72, 170
    e, c, t = _inputs(N, D, V, torch.float16, seed=4, ignore_every=0)
    out, r = _run(e, c, t, True, stats=True, slab_bytes=2 * 32 * D * 2)
    z = e.cpu().double() @ c.cpu().double().T
    rows = r.perm.cpu()
    lse = torch.logsumexp(z, 1)[rows]
    zt = z.gather(1, t.cpu()[:, None]).squeeze(1)[rows]
    assert torch.allclose(out.lse.cpu().double(), lse, rtol=1e-6, atol=1e-5)
    assert torch.allclose(out.tgt.cpu().double(), zt, rtol=1e-6, atol=1e-5)
    assert (out.m0.cpu().double() <= lse + 1e-5).all()


def test_tma_rejects_unaligned_rows():
    e, c, t = _inputs(8, 5, 40, torch.float16, seed=1)  # 10-byte rows: no descriptor
    with pytest.raises(ValueError, match="16 bytes"):
        _run(e, c, t, True)
    assert not use_tma(e, c)  # and the automatic choice never picks it
    assert math.isfinite(float(_run(e, c, t, False)[0].lse.sum()))


EXACT_CASES = [
    dict(),
    dict(bias=True),
    dict(softcap=2.0, smoothing=True),  # smoothing folded into dZ (softcap)
    dict(softcap=2.0, smoothing=True, weight=True),
    dict(slab_bytes=1),  # one tile per slab
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", EXACT_CASES, ids=_ids)
def test_tma_exact_slabs_match_plain_kernel(case, dtype):
    """The exact backward's dZ slabs by the tensor-descriptor kernel (tma=True) against the
    pointer-load kernel (tma=False): the same dZ formula on logits accumulated over the same D chunks, so dE /
    dC agree to the rounding of dZ to the operand dtype (fp16: the scaled tile, 2^-11 relative,
    where both paths may round a tie differently) plus fp32 summation order."""
    N, D, V = 37, 40, 203
    e, c, t = _inputs(N, D, V, dtype, seed=21)
    g = torch.Generator().manual_seed(8)
    r = RowOrder(t, None, -100)
    srt = lambda x: x.index_select(0, r.perm).contiguous()  # noqa: E731
    fwd = linear_ce_forward(e, c, None, None, r.erow_s, srt(r.safe_t), r.n_valid, 0.0, False)
    bias = (0.5 * torch.randn(V, generator=g)).to(DEV) if case.get("bias") else None
    weight = torch.rand(V, generator=g).to(DEV) if case.get("weight") else None
    alpha = (torch.rand(N, generator=g) / N).to(DEV)
    beta = (torch.rand(N, generator=g) / N).to(DEV)
    gamma = (0.1 * torch.rand(N, generator=g) / N).to(DEV) if case.get("smoothing") else None
    args = (e, c, bias, weight, r.erow_s, srt(r.safe_t), r.n_valid, fwd.lse, alpha, beta, gamma)
    kw = dict(softcap=case.get("softcap", 0.0), need_de=True, need_dc=True, need_dbias=False)
    sb = case.get("slab_bytes", 256 << 20)
    a = linear_ce_backward_exact(*args, **kw, tma=True, slab_bytes=sb)
    b = linear_ce_backward_exact(*args, **kw, tma=False, slab_bytes=sb)
    tol = 2e-6 if dtype == torch.float32 else 2.0**-10
    for x, y in ((a.dE, b.dE), (a.dC, b.dC)):
        x, y = x.float(), y.float()
        assert torch.isfinite(x).all()
        assert (x - y).norm() <= tol * y.norm(), ((x - y).norm() / y.norm()).item()


def test_fwd_slab_tiles():
    """The sorted walk's slabs: the fewest of at most FWD_SLAB_BYTES of gathered rows, at least two
    (so that the training forward's buffer, about half of C, stays below the backward's peak,
    which holds dC), balanced (no slab of a tile left over); an explicit slab_bytes as given."""
    MiB = 1 << 20
    tile = 256 * 2048 * 2  # bytes of one tile's rows at D = 2048, bf16: 1 MiB
    assert FWD_SLAB_BYTES == 256 * MiB
    assert fwd_slab_tiles(248320, 2048, 2, 256) == 243  # 970 tiles: 4 slabs of <= 256 MiB
    assert fwd_slab_tiles(128256, 2048, 2, 256) == 251  # 501 tiles: 2 slabs (not 250 + 250 + 1)
    assert fwd_slab_tiles(65536, 2048, 2, 256) == 128  # C 256 MiB: two halves
    assert fwd_slab_tiles(128256, 8192, 2, 256) == 63  # 2004 MiB: 8 slabs of 252 MiB
    assert fwd_slab_tiles(65536, 2048, 2, 256, slab_bytes=3 * tile) == 3
    assert fwd_slab_tiles(100, 40, 4, 32) == 2  # 4 tiles: two slabs
    assert fwd_slab_tiles(20, 40, 4, 32) == 1 and fwd_slab_tiles(100, 40, 4, 32, slab_bytes=1) == 1
