"""The sparse backward's dC rows of the vocabulary tiles without a kept token block.

Such a tile's rows of dC (sorted positions p, classes v = perm[p], tile j) are

    dC[v, :] = q_p G_j[:]                                the skipped blocks' rank-1 correction
             + sum over the valid rows i with t_i = v of coef_i e_i      the exact target entries
             [- w_v sum_i gamma_i e_i]                                   label smoothing

(backward_sparse.py has the terms). Two launches write them in dC's dtype, without a host
synchronisation:

- _dc_rank1_kernel streams q_p G_j [- w_v ge] into every row of those tiles: one program per
  (tile, D chunk), a few loads and one store of [BLOCK_V, BLOCK_DO], so it runs near HBM's
  write bandwidth;
- _dc_target_classes_kernel then writes again the rows of the classes that are targets, whole:
  the target sum plus the same rank-1 term in fp32, so each final value is rounded once. The valid rows
  are sorted by their target's sorted position (triton_backward._dc_inputs): a class's rows are
  consecutive. One program per (group of BLOCK_R sorted rows, D chunk) owns the classes whose
  first row lies in its group; it sums their rows in the group by one one-hot product (fp32
  operands, IEEE: exact products, fp32 sums) and, for the last of them, the rows past the group
  up to the class's end (TEnd).

The tiles with kept blocks (a few at the head of the sorted vocabulary on LM-like data) are the
sparse dC writer's (backward_sparse._sparse_dc_kernel), and the dense slabs' tiles
DenseSlabRun's: both kernels here leave them alone. Written as one kernel with the kept-tile
recompute, every program paid for the recompute's registers (255 per thread, spilled), and the
tiles that need only q G ran far below the write bandwidth (docs/benchmarks.md, "The sparse dC
writer's three kernels"). Before both, kept_target_sums launches the class kernel once more for
the first tiles with kept blocks: their target sums alone, in fp32, which the kept-tile kernel
then reads instead of looping over those classes' thousands of rows itself (docs/benchmarks.md,
"The kept tiles' target sums").
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...._dispatch import interpreting
from ...launch import cached_launch
from .common import sub_dc_smoothing, tile_cols


def dc_skipped_config() -> tuple[int, int, int, int, int]:
    """(BLOCK_DO of the rank-1 stream, BLOCK_R, BLOCK_X, BLOCK_DO of the target classes,
    num_warps of both)."""
    if interpreting():
        return 32, 16, 16, 16, 4
    return 128, 32, 64, 64, 4


@triton.jit
def rank1_rows(
    Q, G, GFlag, W, GE, pos, tile, vid, mask, offs_do, dmask, V, stride_g,
    HAS_FO: tl.constexpr, HAS_SMOOTH: tl.constexpr, HAS_WEIGHT: tl.constexpr, BLOCK_V: tl.constexpr,
    TILE_ROWS: tl.constexpr,
):  # fmt: skip
    """q_p G_j [- w_v ge], fp32 [rows, BLOCK_DO], for rows of sorted positions ``pos``, classes
    ``vid``, where ``mask`` (0 elsewhere), in tiles ``tile`` (int64): one per row with
    TILE_ROWS, else one tile (a scalar: G's row is read once). q is spread uniformly, 1 / |j|,
    where GFlag is nonzero (the first-order terms carry the rest)."""
    q = tl.load(Q + pos, mask=mask, other=0.0)
    if HAS_FO:
        if tl.load(GFlag) != 0:
            size = tl.minimum(V - tile * BLOCK_V, BLOCK_V).to(tl.float32)
            q = tl.where(mask, 1.0 / size, 0.0)
    if TILE_ROWS:
        gm = mask[:, None] & dmask[None, :]
        g = tl.load(G + tile[:, None] * stride_g + offs_do[None, :], mask=gm, other=0.0)
    else:
        g = tl.load(G + tile * stride_g + offs_do, mask=dmask, other=0.0)[None, :]
    acc = q[:, None] * g
    if HAS_SMOOTH:
        acc = sub_dc_smoothing(acc, W, GE, vid, mask, offs_do, dmask, HAS_WEIGHT)
    return acc


@triton.jit
def _own_tiles(CntC, Dense, tile, tiles_per_slab, HAS_DENSE: tl.constexpr):
    """Whether each tile (any shape, valid ids) is written here: no kept block, no dense slab."""
    own = tl.load(CntC + tile) == 0
    if HAS_DENSE:
        own = own & (tl.load(Dense + tile // tiles_per_slab) == 0)
    return own


_FLAGS = {
    "HAS_DENSE": lambda a: a["Dense"] is not None,
    "HAS_FO": lambda a: a["GFlag"] is not None,
    "HAS_SMOOTH": lambda a: a["GE"] is not None,
    "HAS_WEIGHT": lambda a: a["W"] is not None,
}


@cached_launch
@triton.heuristics(_FLAGS)
@triton.jit
def _dc_rank1_kernel(
    Perm, CntC, Dense, Q, G, GFlag, W, GE, dC, V, D, stride_dc, stride_g, tiles_per_slab,
    HAS_DENSE: tl.constexpr, HAS_FO: tl.constexpr, HAS_SMOOTH: tl.constexpr, HAS_WEIGHT: tl.constexpr,
    BLOCK_V: tl.constexpr, BLOCK_DO: tl.constexpr,
):  # fmt: skip
    """dC[classes of one tile, one D chunk] = q_p G_j [- w_v ge] where the tile has no kept block
    and is in no dense slab (module docstring); a tile's D chunks at consecutive program ids."""
    n_dchunks = tl.cdiv(D, BLOCK_DO)
    pid_v = tl.program_id(0) // n_dchunks
    pid_d = tl.program_id(0) % n_dchunks
    if _own_tiles(CntC, Dense, pid_v, tiles_per_slab, HAS_DENSE).to(tl.int32) == 0:
        return
    offs_p, col_mask, vid = tile_cols(Perm, pid_v, V, BLOCK_V)
    offs_do = pid_d * BLOCK_DO + tl.arange(0, BLOCK_DO)
    dmask = offs_do < D
    # [BLOCK_V, BLOCK_DO]
    acc = rank1_rows(
        Q, G, GFlag, W, GE, offs_p, pid_v.to(tl.int64), vid, col_mask, offs_do, dmask, V, stride_g,
        HAS_FO, HAS_SMOOTH, HAS_WEIGHT, BLOCK_V, False,
    )  # fmt: skip
    tl.store(
        dC + vid[:, None] * stride_dc + offs_do[None, :], acc.to(dC.dtype.element_ty),
        mask=col_mask[:, None] & dmask[None, :],
    )  # fmt: skip


@cached_launch
@triton.heuristics(_FLAGS)
@triton.jit
def _dc_target_classes_kernel(
    E, Perm, CntC, Dense, Seg, TRow, TPos, TCoef, TEnd, Q, G, GFlag, W, GE, dC, HRank, TSum,
    V, D, stride_e, stride_dc, stride_g, n_vtiles, tiles_per_slab, n_sums,
    HAS_DENSE: tl.constexpr, HAS_FO: tl.constexpr, HAS_SMOOTH: tl.constexpr, HAS_WEIGHT: tl.constexpr,
    SUMS: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_X: tl.constexpr,
    BLOCK_DO: tl.constexpr,
):  # fmt: skip
    """dC[v, one D chunk] = sum_{i: t_i = v} coef_i e_i + q_p G_j [- w_v ge] for the classes v whose
    first row (TPos: the valid rows' target positions, sorted) lies in this program's group of
    BLOCK_R rows, in tiles without a kept block and outside dense slabs (module docstring).
    With SUMS instead: the target sums alone, fp32, of the classes in the first n_sums tiles with
    kept blocks (HRank: each tile's rank among those), into TSum [n_sums, BLOCK_V, D] at (rank,
    lane in the tile)."""
    n_dchunks = tl.cdiv(D, BLOCK_DO)
    r0 = (tl.program_id(0) // n_dchunks) * BLOCK_R
    pid_d = tl.program_id(0) % n_dchunks
    n_t = tl.load(Seg + n_vtiles)  # the valid rows (the others follow them)
    ar = tl.arange(0, BLOCK_R)
    offs_r = r0 + ar
    rm = offs_r < n_t
    pos = tl.load(TPos + offs_r, mask=rm, other=-1)
    prev = tl.load(TPos + offs_r - 1, mask=rm & (offs_r > 0), other=-1)
    start = rm & (pos != prev)  # a class's first row: its lane (positions are >= 0)
    tile = (tl.where(start, pos, 0) // BLOCK_V).to(tl.int64)
    if SUMS:
        rank = tl.load(HRank + tile)
        ok = start & (tl.load(CntC + tile) != 0) & (rank < n_sums)
    else:
        ok = start & _own_tiles(CntC, Dense, tile, tiles_per_slab, HAS_DENSE)  # the lanes written here
    if tl.max(ok.to(tl.int32), 0) == 0:
        return  # (no class here to write: they began in an earlier group, or are the other writers')
    offs_do = pid_d * BLOCK_DO + tl.arange(0, BLOCK_DO)
    dmask = offs_do < D
    row = tl.load(TRow + offs_r, mask=rm, other=0).to(tl.int64)
    cf = tl.load(TCoef + offs_r, mask=rm, other=0.0)
    ev = tl.load(E + row[:, None] * stride_e + offs_do[None, :], mask=rm[:, None] & dmask[None, :], other=0.0)
    x = ev.to(tl.float32) * cf[:, None]  # [BLOCK_R, BLOCK_DO]
    # lane k (a class's first row) gathers the group's rows of its class; a row whose class began
    # in an earlier group matches no lane
    onehot = tl.where(start[:, None] & rm[None, :] & (pos[:, None] == pos[None, :]), 1.0, 0.0)
    acc = tl.dot(onehot, x, input_precision="ieee")  # [BLOCK_R, BLOCK_DO]
    # The last class written here may go on past the group: its rows up to TEnd (exclusive; within
    # the group where a later class starts in it).
    last = tl.max(tl.where(ok, ar, -1), 0)
    end = tl.load(TEnd + r0 + last)
    ext = tl.zeros([BLOCK_DO], dtype=tl.float32)
    ax = tl.arange(0, BLOCK_X)
    for s in range(r0 + BLOCK_R, end, BLOCK_X):
        xm = s + ax < end
        rx = tl.load(TRow + s + ax, mask=xm, other=0).to(tl.int64)
        cx = tl.load(TCoef + s + ax, mask=xm, other=0.0)
        ex = tl.load(
            E + rx[:, None] * stride_e + offs_do[None, :], mask=xm[:, None] & dmask[None, :], other=0.0
        )
        ext += tl.sum(ex.to(tl.float32) * cx[:, None], axis=0)
    acc += tl.where(ar[:, None] == last, ext[None, :], 0.0)
    if SUMS:
        # (no tl.where on ok here: triton 3.6's layout pass fails on that select; the store's mask
        # covers the lanes that are not written)
        slot = rank.to(tl.int64) * BLOCK_V + (tl.where(start, pos, 0) - tile * BLOCK_V)
        tl.store(TSum + slot[:, None] * D + offs_do[None, :], acc, mask=ok[:, None] & dmask[None, :])
    else:
        vid = tl.load(Perm + tl.where(ok, pos, 0), mask=ok, other=0).to(tl.int64)
        acc += rank1_rows(
            Q, G, GFlag, W, GE, tl.where(ok, pos, 0), tile, vid, ok, offs_do, dmask, V, stride_g,
            HAS_FO, HAS_SMOOTH, HAS_WEIGHT, BLOCK_V, True,
        )  # fmt: skip
        tl.store(
            dC + vid[:, None] * stride_dc + offs_do[None, :], acc.to(dC.dtype.element_ty),
            mask=ok[:, None] & dmask[None, :],
        )  # fmt: skip


# fp32 bytes of the target sums that the class kernel forms for the tiles with kept blocks
# (kept_target_sums): whole tiles of BLOCK_V x D, at least one.
KEPT_SUMS_BYTES = 8 << 20


def kept_sum_tiles(BLOCK_V: int, D: int, n_vtiles: int, max_bytes: int = KEPT_SUMS_BYTES) -> int:
    """Tiles with kept blocks whose target sums kept_target_sums forms: whole fp32 tiles within
    ``max_bytes``, at least one unless it is 0."""
    fit = max_bytes // max(1, BLOCK_V * D * 4)
    return min(n_vtiles, max(fit, 1 if max_bytes > 0 else 0))


def class_ends(tpos: torch.Tensor) -> torch.Tensor:
    """Each sorted target row's class end (exclusive), int32: a class's rows are consecutive."""
    return torch.searchsorted(tpos, tpos, right=True, out_int32=True)


def _class_launch(e2d, seg, trow, tpos, tcoef, tend, BLOCK_V: int, D: int, **kw) -> None:
    """One _dc_target_classes_kernel launch over every group of sorted target rows."""
    _, BR, BX, BDO2, warps = dc_skipped_config()
    _dc_target_classes_kernel[(triton.cdiv(tpos.numel(), BR) * triton.cdiv(D, BDO2),)](
        E=e2d, Seg=seg, TRow=trow, TPos=tpos, TCoef=tcoef, TEnd=tend, stride_e=e2d.stride(0),
        n_vtiles=triton.cdiv(kw["V"], BLOCK_V), D=D, BLOCK_V=BLOCK_V, BLOCK_R=BR, BLOCK_X=BX,
        BLOCK_DO=BDO2, num_warps=warps, **kw,
    )  # fmt: skip


def kept_target_sums(
    e2d: torch.Tensor, V: int, cnt_c: torch.Tensor, seg: torch.Tensor, trow: torch.Tensor,
    tpos: torch.Tensor, tcoef: torch.Tensor, tend: torch.Tensor, BLOCK_V: int,
    max_bytes: int = KEPT_SUMS_BYTES, space: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """fp32 [n, BLOCK_V, D]: the target sums sum_{i: t_i = v} coef_i e_i of the classes of the
    first n = kept_sum_tiles(..., max_bytes) tiles with kept blocks (fewer where ``space``, fp32
    memory free for them, holds fewer: the sums are then its head), by their tile's rank among
    those (its place in the kept-tile kernel's list) and lane; 0 where no row targets the class."""
    D = e2d.shape[1]
    n_vtiles = triton.cdiv(V, BLOCK_V)
    n = kept_sum_tiles(BLOCK_V, D, n_vtiles, max_bytes)
    if space is None:
        tsum = torch.zeros((n, BLOCK_V, D), dtype=torch.float32, device=e2d.device)
    else:
        n = min(n, space.numel() // max(1, BLOCK_V * D))
        tsum = space[: n * BLOCK_V * D].view(n, BLOCK_V, D).zero_()
    if n > 0 and tpos.numel() > 0 and D > 0:
        hrank = torch.cumsum(cnt_c > 0, 0, dtype=torch.int32) - 1  # each tile's rank among them
        _class_launch(
            e2d, seg, trow, tpos, tcoef, tend, BLOCK_V, D, Perm=None, CntC=cnt_c, Dense=None, Q=None,
            G=None, GFlag=None, W=None, GE=None, dC=None, HRank=hrank, TSum=tsum, V=V, stride_dc=0,
            stride_g=0, tiles_per_slab=1, n_sums=n, SUMS=True,
        )  # fmt: skip
    return tsum


def write_skipped_dc(
    dC: torch.Tensor, e2d: torch.Tensor, perm: torch.Tensor, cnt_c: torch.Tensor, dense: torch.Tensor | None,
    seg: torch.Tensor, trow: torch.Tensor, tpos: torch.Tensor, tcoef: torch.Tensor, tend: torch.Tensor,
    q: torch.Tensor, G: torch.Tensor, fo_flag: torch.Tensor | None, weight: torch.Tensor | None,
    ge: torch.Tensor | None, tiles_per_slab: int, BLOCK_V: int,
) -> None:  # fmt: skip
    """dC's rows of the tiles without a kept block (cnt_c, the kept blocks per tile) outside the
    dense slabs (``dense``, int8 per slab of ``tiles_per_slab`` tiles, or None), in two launches
    (module docstring). seg / trow / tpos / tcoef: the valid rows sorted by their target's sorted
    position (backward_sparse.SparsePlan), tend their class ends (class_ends); ``fo_flag``: the
    first-order terms' flag, or None; ``ge``: the smoothing sum (fp32 [D]) or None, ``weight``
    the class weights or None."""
    V, D = dC.shape
    n_vtiles = triton.cdiv(V, BLOCK_V)
    if n_vtiles == 0 or D == 0:
        return
    BDO1, _, _, _, warps = dc_skipped_config()
    common = dict(
        Perm=perm, CntC=cnt_c, Dense=dense, Q=q, G=G, GFlag=fo_flag, W=weight, GE=ge, dC=dC, V=V,
        stride_dc=dC.stride(0), stride_g=G.stride(0), tiles_per_slab=tiles_per_slab,
    )  # fmt: skip
    _dc_rank1_kernel[(n_vtiles * triton.cdiv(D, BDO1),)](
        D=D, BLOCK_V=BLOCK_V, BLOCK_DO=BDO1, num_warps=warps, **common
    )
    if tpos.numel() > 0:
        _class_launch(
            e2d, seg, trow, tpos, tcoef, tend, BLOCK_V, D, HRank=None, TSum=None, n_sums=0, SUMS=False,
            **common,
        )  # fmt: skip
