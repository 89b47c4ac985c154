"""Which slabs of the sorted vocabulary the sparse backward does densely, decided on the device.

The sparse backward replaces each skipped (token block, tile) pair by a rank-1 correction whose
error depends on the data: about 0.01 of the skipped mass on zipf-like logits, 0.02-0.04 on
near-uniform ones, 0.3 or more on hidden states of a model trained on real text
(docs/design.md, "Dense slabs"). No rule on the statistics alone (a threshold, a skipped mass)
holds one error on all of them, so the error is measured: for a few sampled rows the exact
non-target gradient of every skipped tile is formed and compared with its correction, per slab.
The slabs whose corrections err the most are made dense until the sampled rows' remaining error
is at most ``slab_error`` of their exact gradient (relative Frobenius norm, the error the issue
states its target in). Slabs where the filter keeps many tiles are dense as well: recomputing
kept tiles one by one costs more than a GEMM there.

Everything stays on the device (the flags are a tensor the dense-slab kernels read), so a step
is still capturable in a CUDA graph. Cost: two passes over C for a few rows and a [rows, V]
softmax, about one token block's share of one matmul pass.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .kernels.common import inverse_permutation, mm_f32, tile_sizes
from .kernels.dense_slabs import slab_products
from .kernels.tile_stats import decode_tile_mass

# Rows sampled by slab_errors. Their weighted error estimates the whole batch's; rows are drawn
# in proportion to their skipped mass (plus a uniform share), since on hidden states of a model
# trained on real text a few rows with much skipped mass carry most of the error: evenly spaced
# rows measured 2.3x less than the true dE error there (docs/benchmarks.md).
ERROR_ROWS = 32
# The uniform share of the sampling probability (keeps the estimate of ||dE|| itself, which
# every row carries about alike, from resting on the heavy rows only).
UNIFORM_SHARE = 0.5
# Rows per chunk when summing each row's decoded tile masses (bounds the fp32 temporary).
_MASS_ROWS = 8192


def sample_rows(
    code: torch.Tensor, alpha_s: torch.Tensor, n_valid: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(pos, scale): k sorted-row positions and per-position weights, on the device.

    With N <= k every row is taken once (scale 1). Otherwise systematic sampling with probability
    pi_i = UNIFORM_SHARE / n_valid + (1 - UNIFORM_SHARE) m_i / sum(m) over the valid rows, m_i =
    |alpha_i| times the row's decoded skipped mass (its corrections' size), deterministic (the
    k quantiles (j + 1/2) / k of the cumulative pi; no random state is drawn); scale_i =
    1 / sqrt(k pi_i), so that the sum over the sampled rows of scale^2 x (a row's squared norm) is
    an unbiased estimate of the sum over all rows: slab_errors scales each row's error and
    reference by it.
    """
    N = code.shape[0]
    dev = code.device
    if N <= k:
        return torch.arange(N, device=dev), torch.ones(N, dtype=torch.float32, device=dev)
    m = torch.empty(N, dtype=torch.float32, device=dev)
    for s in range(0, N, _MASS_ROWS):
        t = min(s + _MASS_ROWS, N)
        m[s:t] = decode_tile_mass(code[s:t]).sum(1)
    m.mul_(alpha_s.abs())
    nv = n_valid.double().clamp(min=1)
    uni = (torch.arange(N, device=dev) < n_valid.long()).double() / nv
    mass = m.double()
    total = mass.sum()
    heavy = torch.where(total > 0, mass / total.clamp(min=1e-300), uni)
    pi = UNIFORM_SHARE * uni + (1.0 - UNIFORM_SHARE) * heavy
    cdf = pi.cumsum(0)
    u = (torch.arange(k, device=dev, dtype=torch.float64) + 0.5) / k * cdf[-1]
    pos = torch.searchsorted(cdf, u, right=True).clamp(max=N - 1)
    p = pi.index_select(0, pos)
    scale = torch.where(p > 0, (k * p).clamp(min=1e-300).rsqrt(), 0.0).float()
    return pos, scale


def slab_errors(
    e2d: torch.Tensor,
    c: torch.Tensor,
    bias: torch.Tensor | None,
    erow_s: torch.Tensor,
    t_s: torch.Tensor,
    lse_s: torch.Tensor,
    alpha_s: torch.Tensor,
    beta_s: torch.Tensor,
    code: torch.Tensor,
    keep: torch.Tensor,
    vperm: torch.Tensor,
    n_valid: torch.Tensor,
    softcap: float,
    BLOCK_N: int,
    BLOCK_V: int,
    width: int,
    rows: int = ERROR_ROWS,
    cm: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(err, ref, fo) for ``rows`` sorted rows i drawn by sample_rows (all of them when N <= rows),
    each times its scale: err[s, i] (fp32 [n_slabs, rows, D]) is what the rank-1 corrections of
    the skipped tiles of slab s (``width`` sorted positions) get wrong in dE_i,

        err[s, i] = sum_{skipped j in s} ( sum_{v in j, v != t_i} dZ_iv c_v - alpha_i S'_ij mean(C_j) ),

    with dZ_iv = alpha_i p_iv softcap'(z_iv) and S'_ij the decoded mass the sparse backward uses;
    ref[i] (fp32 [rows, D]) is the exact sum_v dZ_iv c_v with the target term (alpha p_t -
    beta) softcap'. Sorted rows past n_valid count with alpha = beta = 0.

    With ``cm`` (fp32 [n_tiles, D], the tile means of the sorted vocabulary) also fo[s, i]
    (fp32 [n_slabs, rows, D]), the part of the first-order term (kernels/first_order.py) that
    slab s's skipped tiles give dE_i: (alpha_i S'_is / V) G e_i, S'_is the row's decoded mass
    in the slab and G e_i = sum_v (e_i . (c_v - mean(C_j(v)))) c_v computed exactly for the
    row (so err - fo is what the corrections with that term get wrong); else None.
    """
    N, nt = code.shape
    V, D = c.shape
    dev = c.device
    pos, scale = sample_rows(code, alpha_s, n_valid, rows)
    k = pos.numel()
    ok = (pos < n_valid.long()).float() * scale
    a = alpha_s.index_select(0, pos) * ok
    b = beta_s.index_select(0, pos) * ok
    t = t_s.index_select(0, pos).long()[:, None]
    vp = vperm.long()
    es = e2d.index_select(0, erow_s.index_select(0, pos))
    z = mm_f32(es, c.T, None)  # [k, V]
    gx = None
    if cm is not None:
        # G e_i = sum_v x_iv c_v with x_iv = e_i . (c_v - mean(C_j(v))) (class order; bf16
        # weights where c is bf16: an estimate's accuracy, one cuBLAS pass over C).
        tile_of = inverse_permutation(vp) // BLOCK_V
        x = z - mm_f32(es, cm.T.to(es.dtype), None).index_select(1, tile_of)
        gx = mm_f32(x.to(c.dtype), c, None)  # [k, D]
        del x
    if bias is not None:
        z += bias.float()[None, :]
    d = None
    if softcap > 0:
        th = torch.tanh(z / softcap)
        z = softcap * th
        d = 1.0 - th * th
    dz = torch.exp(z - lse_s.index_select(0, pos)[:, None]).mul_(a[:, None])  # alpha p
    if d is not None:
        dz.mul_(d)
    d_t = d.gather(1, t) if d is not None else 1.0
    full_t = dz.gather(1, t) - b[:, None] * d_t
    full = dz.scatter(1, t, full_t).index_select(1, vp)  # sorted positions
    dz.scatter_(1, t, 0.0)
    w = torch.zeros((k, nt * BLOCK_V), dtype=torch.float32, device=dev)
    w[:, :V] = dz.index_select(1, vp)
    del dz, z, d
    # The correction alpha_i S'_ij mean(C_j) as weights alpha_i S'_ij / |j| on the tile's classes.
    S = decode_tile_mass(code.index_select(0, pos)) * a[:, None]  # [k, nt]; 0 where kept
    skipped = ~keep.index_select(0, pos // BLOCK_N)
    size = tile_sizes(V, BLOCK_V, dev)  # classes per tile
    w3 = w.view(k, nt, BLOCK_V)
    w3.mul_(skipped[:, :, None]).sub_((S / size)[:, :, None])
    err = slab_products(w, c, vperm, width)
    ref = slab_products(full, c, vperm, width).sum(0)  # (one program per slab and D chunk)
    if gx is None:
        return err, ref, None
    n_slabs = err.shape[0]
    per_slab = F.pad(S, (0, n_slabs * (width // BLOCK_V) - nt)).view(k, n_slabs, -1).sum(2)  # [k, n_slabs]
    fo = (per_slab.T / V)[:, :, None] * gx[None]
    return err, ref, fo


def dense_slab_flags(
    code: torch.Tensor,
    keep: torch.Tensor,
    n_valid: torch.Tensor,
    BLOCK_N: int,
    tiles_per_slab: int,
    dense_kept: float,
    slab_error: float,
    errors: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None,
    first_order_cost: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dense, first_order) on the device, no host synchronisation: dense int8 [n_slabs], 1 for
    the slabs of ``tiles_per_slab`` vocabulary tiles (in the sorted order) that the sparse
    backward does densely; first_order int32 [1], 1 where it applies the first-order terms.

    A slab is dense where the tile filter keeps at least ``dense_kept`` of its (token block,
    tile) pairs. With ``errors`` (slab_errors' (err, ref, fo)), the other slabs are taken in
    order of decreasing ||err[s]|| and made dense until the sum of the remaining slabs' err is
    at most ``slab_error`` ||ref|| (the vector sum: errors of different slabs may cancel or add
    up). With fo and ``first_order_cost`` (the first-order terms' cost in dense slabs), the same
    rule on err - fo as well; the first-order terms are applied, with that rule's slabs, where
    they and its slabs cost less than the first rule's slabs.
    """
    nt = code.shape[1]
    dev = code.device
    n_slabs = -(-nt // tiles_per_slab)
    pad = n_slabs * tiles_per_slab - nt
    blocks = ((n_valid.float() + (BLOCK_N - 1)) // BLOCK_N).clamp(min=1)
    tiles = F.pad(torch.ones(nt, device=dev), (0, pad)).view(n_slabs, -1).sum(1)
    kept = F.pad(keep.sum(0, dtype=torch.float32), (0, pad)).view(n_slabs, -1).sum(1)
    dense = kept / (blocks * tiles) >= dense_kept
    off = torch.zeros(1, dtype=torch.int32, device=dev)
    if errors is None:
        return dense.to(torch.int8), off
    err, ref, fo = errors
    sparse = (~dense).float()[:, None, None]  # dense slabs are exact
    bound = slab_error * ref.norm()
    chosen = _worst_until(err * sparse, bound)
    if fo is None or first_order_cost is None:
        return (dense | chosen).to(torch.int8), off
    chosen_fo = _worst_until((err - fo) * sparse, bound)
    use = chosen_fo.sum() + first_order_cost < chosen.sum()
    return (dense | torch.where(use, chosen_fo, chosen)).to(torch.int8), use.int().reshape(1)


def _worst_until(err: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    """bool [n_slabs]: the slabs of largest ||err[s]|| (err [n_slabs, rows, D]), as few as leave
    the norm of the other slabs' summed err at most ``bound``."""
    n_slabs = err.shape[0]
    order = torch.argsort(err.flatten(1).norm(dim=1), descending=True)
    cum = err.index_select(0, order).cumsum(0)
    # rem[m]: the error left when the first m slabs of `order` are dense (rem[n_slabs] = 0).
    rem = torch.cat([cum[-1].norm().reshape(1), (cum[-1][None] - cum).flatten(1).norm(dim=1)])
    m = (rem <= bound).int().argmax()  # the first m that meets the target
    rank = torch.empty_like(order)
    rank[order] = torch.arange(n_slabs, device=err.device)
    return rank < m
