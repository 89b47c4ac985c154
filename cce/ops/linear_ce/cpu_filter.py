"""The CPU gradient filter of impl="torch": (FILTER_BLOCK_N x FILTER_BLOCK_V) tiles of the
softmax whose entries are all below the threshold skip the gradient products; each contributes
a rank-1 correction instead (rowsum x block mean; docs/design.md has the error bound). Its shapes
are data-dependent, which on an accelerator would need a host synchronisation: CPU only. ``pb``
is the chunked.ChunkedProblem being evaluated.
"""

from __future__ import annotations

import math

import torch

from .chunked_math import mm

# Tile of the CPU gradient filter: row block x vocabulary block (as the GPU kernels' tiles).
FILTER_BLOCK_N = 64
FILTER_BLOCK_V = 128
# Above this fraction of kept tiles the dense exact products are cheaper than gathering.
DENSE_FRACTION = 0.5
# The first row block votes dense-or-filter on this many evenly spaced vocabulary blocks (where
# there are at least twice as many whole ones): a vote only trades time, the dense product being
# exact, and the sample costs a fraction of the block's pass (2 AMD EPYC cores, 2048 x 256 x
# 32000, every chunk then dense: 1.0 ms of kept_tiles per step against 2.5 ms, of a 0.32-0.36 s
# step; docs/benchmarks.md, "CPU: impl="torch"").
VOTE_BLOCKS = 32
# Skipped-tile dC corrections queued before one GEMM applies them (bounds their memory).
CORR_BATCH = 32


def block_means(pb) -> torch.Tensor:
    """[n_blocks, D] mean of c's rows per filter block (for the skipped-tile correction)."""
    if pb.block_means_cache is None:
        B, V = FILTER_BLOCK_V, pb.V
        nb = math.ceil(V / B)
        sums = torch.zeros(nb, pb.D, dtype=pb.acc, device=pb.c.device)
        sums.index_add_(0, torch.arange(V, device=pb.c.device) // B, pb.c_op.to(pb.acc))
        counts = torch.full((nb,), float(B), dtype=pb.acc, device=pb.c.device)
        counts[-1] = V - (nb - 1) * B
        pb.block_means_cache = sums / counts[:, None]
    return pb.block_means_cache


def kept_tiles(pb, P: torch.Tensor, alpha: torch.Tensor, r: torch.Tensor | None) -> torch.Tensor | None:
    """[row blocks, vocab blocks] bool: tiles to compute exactly (None: the whole chunk).

    The dense part of dZ is diag(r) P (r None: P itself, already scaled). A (FILTER_BLOCK_N x
    FILTER_BLOCK_V) tile is filtered when every |alpha_i p_iv| in it is below
    eps * max_i |alpha_i| (for mean/sum without weights or z-loss alpha is the same for all
    rows, so this is exactly "every probability below eps"). With a pending row scale r
    (P >= 0) the test is colmax_tile(P) * max_tile |r_i| < thr, which implies it, and is the
    same test where r is constant over the tile's rows.

    When most tiles are kept, the dense exact product is cheaper than gathering: None. That
    choice only trades time (the dense product is exact), so the first row block decides it
    when that block alone keeps most of its tiles (first on a sample of VOTE_BLOCKS vocabulary
    blocks, then on all of them), sparing a pass over the chunk on data where nothing can be
    filtered.
    """
    if pb.eps <= 0:
        return None
    B, R = FILTER_BLOCK_V, FILTER_BLOCK_N
    n, nb = P.shape[0], math.ceil(pb.V / B)
    nonneg = r is not None or bool((alpha >= 0).all())  # CPU only (filtering is)
    thr = pb.eps * alpha.abs().max()
    row_scale = lambda rows: 1.0 if r is None else r[rows].abs().max()  # noqa: E731
    whole = pb.V // B
    if whole >= 2 * VOTE_BLOCKS:
        sample = P[:R, : whole * B].view(-1, whole, B)[:, :: whole // VOTE_BLOCKS]  # [rows, ~32, B]
        colmax = (sample if nonneg else sample.abs()).amax((0, 2)) * row_scale(slice(0, R))
        if _mostly(colmax >= thr):
            return None
    keep = torch.empty(math.ceil(n / R), nb, dtype=torch.bool)
    for i in range(keep.shape[0]):
        Pr = P[i * R : (i + 1) * R]
        colmax = (Pr.amax(0) if nonneg else Pr.abs().amax(0)) * row_scale(slice(i * R, (i + 1) * R))
        colmax = torch.nn.functional.pad(colmax, (0, nb * B - pb.V))
        keep[i] = colmax.view(nb, B).amax(1) >= thr
        if i == 0 and _mostly(keep[0]):
            return None
    return None if _mostly(keep) else keep


def _mostly(kept: torch.Tensor) -> bool:
    """Whether more than DENSE_FRACTION of the tiles ``kept`` flags are kept."""
    return float(kept.float().mean()) > DENSE_FRACTION


def filtered_products(pb, ec, P, keep, need_de, dC, corr):
    """dE of the chunk (or None) and dC accumulation for the dense part P (scaled) filtered
    per kept tile; a skipped tile contributes rowsum (outer) mean(C_tile) to dE and
    colsum (outer) mean(E_tile) to dC."""
    n = P.shape[0]
    B, R = FILTER_BLOCK_V, FILTER_BLOCK_N
    blk_of_col = torch.arange(pb.V, device=P.device) // B
    dE_c = torch.zeros(n, pb.D, dtype=pb.acc, device=P.device) if need_de else None
    blk = None
    if need_de:  # rowsum of P per vocab block [n, n_blocks], for the skipped tiles
        blk = torch.zeros(n, keep.shape[1], dtype=P.dtype, device=P.device)
        blk.index_add_(1, blk_of_col, P)
    for i in range(keep.shape[0]):
        rows = slice(i * R, min((i + 1) * R, n))
        Pr, er = P[rows], ec[rows]
        col_keep = keep[i][blk_of_col]
        kcols = col_keep.nonzero().squeeze(1)
        if kcols.numel():
            Pk = Pr.index_select(1, kcols)
            if need_de:
                dE_c[rows] += mm(Pk, pb.c_op.index_select(0, kcols), pb.acc)
            if dC is not None:
                dC.index_add_(0, kcols, mm(Pk.T, er, pb.acc))
        skip = ~keep[i]
        if need_de:
            dE_c[rows] += blk[rows][:, skip] @ block_means(pb)[skip]
        if dC is not None:
            corr.append((torch.where(col_keep, 0.0, Pr.sum(0)), er.to(pb.acc).mean(0)))
            if len(corr) >= CORR_BATCH:
                flush_corrections(dC, corr)
    return dE_c


def flush_corrections(dC: torch.Tensor, corr: list) -> None:
    """dC += sum_k colsum_k (outer) mean(E_k) over the queued skipped-tile corrections (one GEMM)."""
    U = torch.stack([u for u, _ in corr])  # [k, V]
    Eb = torch.stack([m for _, m in corr])  # [k, D]
    dC.addmm_(U.T, Eb)
    corr.clear()
