"""The sparse backward's kept tiles: a token block's per-row values, a kept tile's dZ
(recomputed from E and C, or read from a scratch slot), and the launches that fill the slots
once (backward_sparse.py: the dC writer's slots, in (block, tile) order, and the dE writer's, a
few per token block).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...launch import cached_launch
from .common import KernelConfig, logit_tile, tile_cols
from .dz import nontarget_dz


@triton.jit
def block_rows(Erow, Tgt, Lse, Alpha, Eta, offs_n, row_mask, HAS_ETA: tl.constexpr):
    """(e2d row int64, target int64 (-1 masked), lse, alpha, eta) of a token block's sorted rows
    (eta 0 without HAS_ETA)."""
    erow = tl.load(Erow + offs_n, mask=row_mask, other=0).to(tl.int64)
    tgt = tl.load(Tgt + offs_n, mask=row_mask, other=-1).to(tl.int64)
    lse = tl.load(Lse + offs_n, mask=row_mask, other=0.0)
    alpha = tl.load(Alpha + offs_n, mask=row_mask, other=0.0)
    if HAS_ETA:
        eta = tl.load(Eta + offs_n, mask=row_mask, other=0.0)
    else:
        eta = tl.zeros_like(alpha)
    return erow, tgt, lse, alpha, eta


@triton.jit
def _dz_tile(
    E, C, Bias, erow, vid, tgt, lse, alpha, eta, row_mask, col_mask, D, stride_e, stride_c, softcap, inv_temp,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_TEMP: tl.constexpr, HAS_ETA: tl.constexpr,
    SCALE_DZ: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """(dZ tile in the operand dtype, its scale): p (alpha [+ eta z]) softcap' at the non-target
    entries (HAS_ETA: the entropy's term, z the softcapped logit; cce/_math.py).

    The target entries are 0 here; their exact term is added in fp32 by the caller. SCALE_DZ
    (fp16): the tile is scaled to max |dZ| = 1 before rounding (alpha p can sit below fp16's
    normal range), the products are to be multiplied by the returned scale.
    """
    L = logit_tile(
        E, C, erow, vid, row_mask, col_mask, D, stride_e, stride_c, BLOCK_N, BLOCK_V, BLOCK_D, PRECISION
    )  # [BLOCK_N, BLOCK_V]
    dz = nontarget_dz(
        L, Bias, vid, tgt, lse, alpha, eta, row_mask, col_mask, softcap, inv_temp, HAS_BIAS, HAS_SOFTCAP,
        HAS_TEMP, HAS_ETA,
    )  # fmt: skip
    if SCALE_DZ:
        scale = tl.max(tl.max(tl.abs(dz), axis=1), axis=0)
        scale = tl.where(scale > 0, scale, 1.0)
        dzc = (dz / scale).to(E.dtype.element_ty)
    else:
        scale = 1.0
        dzc = dz.to(E.dtype.element_ty)
    return dzc, scale


@triton.jit
def kept_dz(
    Scratch, ScaleBuf, gk, cap,
    E, C, Bias, erow, vid, tgt, lse, alpha, eta, row_mask, col_mask, D, stride_e, stride_c, softcap, inv_temp,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_TEMP: tl.constexpr, HAS_ETA: tl.constexpr,
    SCALE_DZ: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """The dZ tile of the gk-th kept tile: from the scratch written by fill_kept_slots when it has a
    slot there (gk < cap), else recomputed."""
    if gk < cap:
        offs = tl.arange(0, BLOCK_N)[:, None] * BLOCK_V + tl.arange(0, BLOCK_V)[None, :]
        dzc = tl.load(Scratch + gk.to(tl.int64) * (BLOCK_N * BLOCK_V) + offs)
        if SCALE_DZ:
            scale = tl.load(ScaleBuf + gk)
        else:
            scale = 1.0
    else:
        dzc, scale = _dz_tile(
            E, C, Bias, erow, vid, tgt, lse, alpha, eta, row_mask, col_mask, D, stride_e, stride_c,
            softcap, inv_temp,
            HAS_BIAS, HAS_SOFTCAP, HAS_TEMP, HAS_ETA, SCALE_DZ, BLOCK_N, BLOCK_V, BLOCK_D, PRECISION,
        )  # fmt: skip
    return dzc, scale


@triton.jit
def _kept_dz_to_slot(
    E, C, Bias, Erow, Tgt, Perm, NValid, Lse, Alpha, Eta, Scratch, ScaleBuf, blk, j, slot,
    V, D, stride_e, stride_c, softcap, inv_temp,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_TEMP: tl.constexpr, HAS_ETA: tl.constexpr,
    SCALE_DZ: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """The dZ tile (token block blk, vocabulary tile j) into scratch slot ``slot``."""
    n_valid = tl.load(NValid)
    offs_n = blk * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = offs_n < n_valid
    erow, tgt, lse, alpha, eta = block_rows(Erow, Tgt, Lse, Alpha, Eta, offs_n, row_mask, HAS_ETA)
    offs_p, col_mask, vid = tile_cols(Perm, j, V, BLOCK_V)
    dzc, scale = _dz_tile(
        E, C, Bias, erow, vid, tgt, lse, alpha, eta, row_mask, col_mask, D, stride_e, stride_c, softcap,
        inv_temp,
        HAS_BIAS, HAS_SOFTCAP, HAS_TEMP, HAS_ETA, SCALE_DZ, BLOCK_N, BLOCK_V, BLOCK_D, PRECISION,
    )  # fmt: skip
    offs = tl.arange(0, BLOCK_N)[:, None] * BLOCK_V + tl.arange(0, BLOCK_V)[None, :]
    tl.store(Scratch + slot.to(tl.int64) * (BLOCK_N * BLOCK_V) + offs, dzc)
    if SCALE_DZ:
        one = tl.arange(0, 1)
        tl.store(ScaleBuf + slot + one, scale + tl.zeros((1,), tl.float32))


@cached_launch
@triton.heuristics({"HAS_BIAS": lambda a: a["Bias"] is not None, "HAS_ETA": lambda a: a["Eta"] is not None})
@triton.jit
def _kept_dz_kernel(
    E, C, Bias, Erow, Tgt, Perm, NValid, Lse, Alpha, Eta, KList, NKept, Scratch, ScaleBuf,
    V, D, stride_e, stride_c, n_vtiles, softcap, inv_temp,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_TEMP: tl.constexpr, HAS_ETA: tl.constexpr,
    SCALE_DZ: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Program k: the dZ tile of the k-th kept tile (in (block, tile) order), once, into scratch
    slot k (the dC writer reads it once per D chunk instead of recomputing it)."""
    k = tl.program_id(0)
    if k >= tl.load(NKept):
        return
    flat = tl.load(KList + k)
    _kept_dz_to_slot(
        E, C, Bias, Erow, Tgt, Perm, NValid, Lse, Alpha, Eta, Scratch, ScaleBuf,
        flat // n_vtiles, flat % n_vtiles, k, V, D, stride_e, stride_c, softcap, inv_temp,
        HAS_BIAS, HAS_SOFTCAP, HAS_TEMP, HAS_ETA, SCALE_DZ, BLOCK_N, BLOCK_V, BLOCK_D, PRECISION,
    )  # fmt: skip


@cached_launch
@triton.heuristics({"HAS_BIAS": lambda a: a["Bias"] is not None, "HAS_ETA": lambda a: a["Eta"] is not None})
@triton.jit
def _kept_dz_block_kernel(
    E, C, Bias, Erow, Tgt, Perm, NValid, Lse, Alpha, Eta, ListE, CntE, Scratch, ScaleBuf,
    V, D, stride_e, stride_c, n_vtiles, softcap, inv_temp,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_TEMP: tl.constexpr, HAS_ETA: tl.constexpr,
    SCALE_DZ: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Program (b, s): the s-th kept tile of token block b into slot b * n_slots + s (the dE
    writer's per-block slots; the block's later kept tiles are recomputed there)."""
    blk = tl.program_id(0)
    s = tl.program_id(1)
    if s >= tl.load(CntE + blk):
        return
    j = tl.load(ListE + blk * (n_vtiles + 1) + s)
    _kept_dz_to_slot(
        E, C, Bias, Erow, Tgt, Perm, NValid, Lse, Alpha, Eta, Scratch, ScaleBuf,
        blk, j, blk * tl.num_programs(1) + s, V, D, stride_e, stride_c, softcap, inv_temp,
        HAS_BIAS, HAS_SOFTCAP, HAS_TEMP, HAS_ETA, SCALE_DZ, BLOCK_N, BLOCK_V, BLOCK_D, PRECISION,
    )  # fmt: skip


def fill_kept_slots(
    klist: torch.Tensor, n_kept: torch.Tensor, scratch: torch.Tensor, scale: torch.Tensor | None,
    cfg: KernelConfig, common: dict,
) -> None:  # fmt: skip
    """The dZ of the first scratch.shape[0] kept tiles (klist, n_kept: backward_sparse.SparsePlan)
    into their slots; ``common``: the problem's operands as the sparse kernels take them."""
    _kept_dz_kernel[(scratch.shape[0],)](
        KList=klist, NKept=n_kept, Scratch=scratch, ScaleBuf=scale, BLOCK_D=cfg.BLOCK_D,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **common,
    )  # fmt: skip


def fill_block_slots(
    list_e: torch.Tensor, cnt_e: torch.Tensor, slots: torch.Tensor, scale: torch.Tensor | None, S: int,
    cfg: KernelConfig, common: dict,
) -> None:  # fmt: skip
    """The dZ of each token block's first S kept tiles (list_e, cnt_e) into its S slots."""
    _kept_dz_block_kernel[(cnt_e.numel(), S)](
        ListE=list_e, CntE=cnt_e, Scratch=slots, ScaleBuf=scale, BLOCK_D=cfg.BLOCK_D,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **common,
    )  # fmt: skip
