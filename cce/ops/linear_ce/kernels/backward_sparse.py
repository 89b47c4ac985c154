"""The sparse backward: the forward's tile statistics decide which tiles are recomputed at all.

A tile (token block x vocabulary tile, vocabulary in the sorted order) is recomputed only when
the forward found a non-target probability of one of its rows that may reach the threshold
(tile_stats.py). Every other tile contributes through its rank-1 correction: alpha_i S_ij
mean(C_j) to dE (S_ij its non-target mass) and q_v G_j to dC; every target entry
alpha p_t - beta is added exactly. Each value of dE and dC is rounded once into its storage, one
program owning a (token block, D chunk) of dE or (dc_skipped.py for the tiles without kept
blocks) a (vocabulary tile, D chunk) of dC: no atomics and no fp32 gradient buffers. Kept
tiles' dZ are computed once into scratch slots (past them, once per D chunk of the output);
the slots and the codes live in dE's own buffer (stash.py).
docs/design.md states the error bound.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import triton
import triton.language as tl

from ...._dispatch import interpreting, num_sms
from ...launch import cached_launch
from .common import (
    KernelConfig,
    add_dc_targets,
    check_inputs,
    compact_lists,
    config,
    device_context,
    precision,
    skipped_coef0,
    split_dot,
    tile_cols,
)
from .dc_skipped import KEPT_SUMS_BYTES, class_ends, kept_target_sums, rank1_rows, write_skipped_dc
from .dense_slabs import DenseSlabRun
from .first_order import FirstOrder, add_dc_first_order
from .kept_tiles import block_rows, fill_block_slots, fill_kept_slots, kept_dz
from .sparse_plan import SparsePlan
from .stash import de_rounds, shares_memory, stash_layout, to_e_rows
from .tile_stats import STATS_STEPS, tile_means

if TYPE_CHECKING:
    from ..host_peek import HostPeek


@triton.jit
def _skipped_tiles(
    acc, Code, Cm, Slog, Dense, offs_n, row_mask, offs_do, dmask, alpha, eta, lse, code_row0, stride_code,
    stride_cm, n_vtiles, tiles_per_slab,
    HAS_ETA: tl.constexpr, HAS_DENSE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
    BLOCK_DO: tl.constexpr, BLOCK_J: tl.constexpr, STEPS: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """(acc plus the skipped tiles' rank-1 corrections of a token block's rows, one D chunk; fsum:
    each row's coefficient of the first-order term) for _sparse_de_kernel."""
    # Skipped tiles: S_ij = exp(-code / STEPS), the tile's non-target probability mass (times
    # softcap'; code 255, kept tiles included: 0), against the tile mean of C. Masses <= 1, so
    # the operand dtype holds them.
    corr = tl.zeros((BLOCK_N, BLOCK_DO), dtype=tl.float32)
    ssum = tl.zeros((BLOCK_N,), dtype=tl.float32)
    if HAS_ETA:
        # The entropy's term eta p z over a skipped tile, with the tile's p-weighted mean logit
        # zbar_ij = lse + log(S_ij / BLOCK_V) (to first order in the tile's logit spread, the
        # model of first_order.py; with softcap, S / softcap'(zbar): common.skipped_slog): the
        # tile's coefficient is a_ij = alpha_i + eta_i zbar_ij = a0_i + eta_i slog_ij / S_ij,
        # a0_i = alpha_i + eta_i (lse_i - log BLOCK_V). The product's operand is a_ij S_ij / r_i,
        # formed in fp32 and rounded once, r_i = |a0_i| + |eta_i| (then |a_ij S_ij / r_i| <=
        # S_ij + |slog_ij|: within fp16's range whatever the upstream gradient's scale).
        a0 = skipped_coef0(alpha, eta, lse, BLOCK_V)
        r = tl.abs(a0) + tl.abs(eta)
        inv_r = 1.0 / tl.maximum(r, 1e-30)  # (|a0_i| / max(r_i, 1e-30) <= 1: 0 on r_i = 0)
        a0r = a0 * inv_r
        etar = eta * inv_r
        wsum = tl.zeros((BLOCK_N,), dtype=tl.float32)  # sum_j a_ij S_ij / r_i
    for j0 in range(0, n_vtiles, BLOCK_J):
        offs_j = j0 + tl.arange(0, BLOCK_J)
        jm = offs_j < n_vtiles
        code = tl.load(
            Code + (offs_n - code_row0).to(tl.int64)[:, None] * stride_code + offs_j[None, :],
            mask=row_mask[:, None] & jm[None, :], other=255,
        ).to(tl.float32)  # fmt: skip  # [BLOCK_N, BLOCK_J]
        S = tl.where(code < 255.0, tl.exp(code * (-1.0 / STEPS)), 0.0)
        if HAS_DENSE:
            dn = tl.load(Dense + offs_j // tiles_per_slab, mask=jm, other=1)
            S = tl.where(dn[None, :] == 0, S, 0.0)
        cm = tl.load(
            Cm + offs_j.to(tl.int64)[:, None] * stride_cm + offs_do[None, :],
            mask=jm[:, None] & dmask[None, :], other=0.0,
        )  # fmt: skip  # [BLOCK_J, BLOCK_DO]
        if HAS_ETA:
            # slog_ij = S (zbar - lse + log BLOCK_V) (common.skipped_slog, formed once per step
            # in Slog: with softcap its Newton steps per D chunk cost more than the products).
            slog = tl.load(
                Slog + offs_n.to(tl.int64)[:, None] * n_vtiles + offs_j[None, :],
                mask=row_mask[:, None] & jm[None, :], other=0.0,
            )  # fmt: skip
            if HAS_DENSE:
                slog = tl.where(dn[None, :] == 0, slog, 0.0)
            w = a0r[:, None] * S + etar[:, None] * slog  # [BLOCK_N, BLOCK_J]: a_ij S_ij / r_i
            corr = tl.dot(w.to(Cm.dtype.element_ty), cm, corr, input_precision=PRECISION)
            wsum += tl.sum(w, axis=1)
        else:
            corr = tl.dot(S.to(Cm.dtype.element_ty), cm, corr, input_precision=PRECISION)
        ssum += tl.sum(S, axis=1)
    if HAS_ETA:
        acc += r[:, None] * corr
        # The first-order term's coefficient: sum_j (a_ij + eta_i) S_ij (first_order.py).
        fsum = r * wsum + eta * ssum
    else:
        acc += alpha[:, None] * corr
        fsum = alpha * ssum
    return acc, fsum


@triton.jit
def _first_order_rows(
    acc, E, Gram, GScale, GFlag, erow, row_mask, offs_do, dmask, fsum, D, stride_e,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DO: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """acc plus, where GFlag is nonzero, fsum_i (e_i @ Gbar) over one D chunk (Gram = Gbar / GScale,
    first_order.py) for _sparse_de_kernel."""
    if tl.load(GFlag) != 0:
        offs_k = tl.arange(0, BLOCK_D)
        fo = tl.zeros((BLOCK_N, BLOCK_DO), dtype=tl.float32)
        for k0 in range(0, D, BLOCK_D):
            km = (k0 + offs_k) < D
            e = tl.load(
                E + erow[:, None] * stride_e + (k0 + offs_k)[None, :],
                mask=row_mask[:, None] & km[None, :], other=0.0,
            )  # fmt: skip  # [BLOCK_N, BLOCK_D]
            g = tl.load(
                Gram + (k0 + offs_k).to(tl.int64)[:, None] * D + offs_do[None, :],
                mask=km[:, None] & dmask[None, :], other=0.0,
            )  # fmt: skip  # [BLOCK_D, BLOCK_DO]
            fo = tl.dot(e, g, fo, input_precision=PRECISION)
        acc += (fsum * tl.load(GScale))[:, None] * fo
    return acc


@cached_launch
@triton.heuristics(
    {
        "HAS_BIAS": lambda a: a["Bias"] is not None,
        "HAS_SMOOTH": lambda a: a["Gamma"] is not None,
        "HAS_DENSE": lambda a: a["Dense"] is not None,
        "HAS_GRAM": lambda a: a["Gram"] is not None,
        "HAS_ETA": lambda a: a["Eta"] is not None,
    }
)
@triton.jit
def _sparse_de_kernel(
    E, C, Bias, Erow, Tgt, Perm, NValid, Lse, Alpha, Eta, Slog, Gamma, Coef, Code, ListE, CntE, Cm, WC,
    Scratch, ScaleBuf, Dense, DEAcc, Gram, GScale, GFlag, dE,
    V, D, stride_e, stride_c, stride_de, stride_code, stride_cm, stride_acc, acc_row0, n_vtiles, softcap,
    inv_temp,
    blk0,
    code_row0, slot_blk0, cap, tiles_per_slab,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_TEMP: tl.constexpr, HAS_SMOOTH: tl.constexpr,
    HAS_DENSE: tl.constexpr,
    HAS_GRAM: tl.constexpr, HAS_ETA: tl.constexpr, SCALE_DZ: tl.constexpr,
    N_SLOTS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DO: tl.constexpr, BLOCK_J: tl.constexpr, STEPS: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """dE[sorted rows of one token block from blk0 on, one D chunk], written once in dE's dtype
    at the sorted rows (the caller moves them to e2d's rows):

    sum over the block's kept tiles of dZ_tile @ C_tile (the first N_SLOTS from the scratch
    slots of kept_tiles.fill_block_slots, block slot_blk0's first, the others recomputed)
    + alpha_i sum over its skipped tiles j of S_ij mean(C_j)   (S_ij from Code, encode_tile_stats)
    + coef_i c_{t_i} (the target entries, exact in fp32) [- gamma_i sum_v w_v c_v: Gamma and WC,
    or None without smoothing] [+ DEAcc[sorted row - acc_row0], the dense slabs' part (fp32, of
    the row block from acc_row0 that holds these rows), whose tiles' codes do not count: Dense
    per slab of tiles_per_slab tiles, both or neither None]
    [+ alpha_i S_i (e_i @ Gbar), S_i = sum_j S_ij, where GFlag is nonzero: the first-order term
    of first_order.py, Gram = Gbar / GScale in the operand dtype, or None].
    With Eta (the entropy's coefficient per sorted row, or None) the kept tiles' dZ carry
    eta p z, a skipped tile's mass S_ij the coefficient a_ij = alpha_i + eta_i zbar_ij instead of
    alpha_i (zbar_ij its mean logit, common.skipped_slog), and the first-order term
    sum_j (a_ij + eta_i) S_ij instead of alpha_i S_i (first_order.py).

    Code row 0 is sorted row code_row0. Rows from n_valid on are not written.

    One program per (token block, D chunk), a block's D chunks at consecutive program ids: the
    chunks of one block read the same codes, entropy terms, kept tiles and rows of E, which then
    come from L2 rather than HBM (with the D chunks outermost, the programs in flight cover
    different blocks and each chunk reads the [N, n_tiles] codes again).
    """
    n_dchunks = tl.cdiv(D, BLOCK_DO)
    pid_n = blk0 + tl.program_id(0) // n_dchunks
    pid_d = tl.program_id(0) % n_dchunks
    n_valid = tl.load(NValid)
    start = pid_n * BLOCK_N
    if start >= n_valid:
        return
    offs_n = start + tl.arange(0, BLOCK_N)
    row_mask = offs_n < n_valid
    erow, tgt, lse, alpha, eta = block_rows(Erow, Tgt, Lse, Alpha, Eta, offs_n, row_mask, HAS_ETA)
    offs_do = pid_d * BLOCK_DO + tl.arange(0, BLOCK_DO)
    dmask = offs_do < D
    acc = tl.zeros((BLOCK_N, BLOCK_DO), dtype=tl.float32)
    cnt = tl.load(CntE + pid_n)
    for k in range(0, cnt):
        j = tl.load(ListE + pid_n * (n_vtiles + 1) + k)
        offs_p, col_mask, vid = tile_cols(Perm, j, V, BLOCK_V)
        gk = tl.where(k < N_SLOTS, (pid_n - slot_blk0) * N_SLOTS + k, cap)
        dzc, scale = kept_dz(
            Scratch, ScaleBuf, gk, cap,
            E, C, Bias, erow, vid, tgt, lse, alpha, eta, row_mask, col_mask, D, stride_e, stride_c,
            softcap, inv_temp,
            HAS_BIAS, HAS_SOFTCAP, HAS_TEMP, HAS_ETA, SCALE_DZ, BLOCK_N, BLOCK_V, BLOCK_D, PRECISION,
        )  # fmt: skip
        c = tl.load(
            C + vid[:, None] * stride_c + offs_do[None, :], mask=col_mask[:, None] & dmask[None, :], other=0.0
        )  # [BLOCK_V, BLOCK_DO]
        acc += tl.dot(dzc, c, input_precision=PRECISION) * scale
    acc, fsum = _skipped_tiles(
        acc, Code, Cm, Slog, Dense, offs_n, row_mask, offs_do, dmask, alpha, eta, lse, code_row0, stride_code,
        stride_cm, n_vtiles, tiles_per_slab,
        HAS_ETA, HAS_DENSE, BLOCK_N, BLOCK_V, BLOCK_DO, BLOCK_J, STEPS, PRECISION,
    )  # fmt: skip
    if HAS_GRAM:
        acc = _first_order_rows(
            acc, E, Gram, GScale, GFlag, erow, row_mask, offs_do, dmask, fsum, D, stride_e,
            BLOCK_N, BLOCK_D, BLOCK_DO, PRECISION,
        )  # fmt: skip
    coef = tl.load(Coef + offs_n, mask=row_mask, other=0.0)
    ct = tl.load(
        C + tgt[:, None] * stride_c + offs_do[None, :], mask=row_mask[:, None] & dmask[None, :], other=0.0
    ).to(tl.float32)
    acc += coef[:, None] * ct
    if HAS_SMOOTH:
        gamma = tl.load(Gamma + offs_n, mask=row_mask, other=0.0)
        wc = tl.load(WC + offs_do, mask=dmask, other=0.0)
        acc -= gamma[:, None] * wc[None, :]
    if HAS_DENSE:
        acc += tl.load(
            DEAcc + (offs_n - acc_row0).to(tl.int64)[:, None] * stride_acc + offs_do[None, :],
            mask=row_mask[:, None] & dmask[None, :], other=0.0,
        )  # fmt: skip
    tl.store(
        dE + offs_n.to(tl.int64)[:, None] * stride_de + offs_do[None, :], acc.to(dE.dtype.element_ty),
        mask=row_mask[:, None] & dmask[None, :],
    )  # fmt: skip


@cached_launch
@triton.heuristics(
    {
        "HAS_BIAS": lambda a: a["Bias"] is not None,
        "HAS_WEIGHT": lambda a: a["W"] is not None,
        "HAS_SMOOTH": lambda a: a["GE"] is not None,
        "HAS_ETA": lambda a: a["Eta"] is not None,
        "HAS_FO": lambda a: a["GFlag"] is not None,
    }
)
@triton.jit
def _sparse_dc_kernel(
    E, C, Bias, W, Erow, Tgt, Perm, NValid, Lse, Alpha, Eta, ListC, CntC, TList, TCnt, Seg, TRow, TPos, TCoef,
    TSum, Q, G, GE, Gidx, Scratch, ScaleBuf, GFlag, dC,
    V, D, stride_e, stride_c, stride_dc, stride_g, n_blocks, n_vtiles, softcap, inv_temp, cap, n_sums,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_TEMP: tl.constexpr, HAS_SMOOTH: tl.constexpr,
    HAS_WEIGHT: tl.constexpr, HAS_ETA: tl.constexpr, HAS_FO: tl.constexpr, SCALE_DZ: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DO: tl.constexpr,
    BLOCK_R: tl.constexpr, SPLIT_DOT: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """dC[ids of one vocabulary tile with kept blocks, one D chunk], written once in dC's dtype:

    sum over the tile's kept token blocks of dZ_tile^T @ E_block (recomputed)
    + q_v G_j (the skipped blocks' mass sum_i alpha_i S_ij e_i, spread by q within the tile;
      uniformly, 1 / |j|, where GFlag is nonzero: the first-order terms carry the rest)
    + sum over the rows i with t_i in the tile of coef_i e_i (to fp32 accuracy: TSum's fp32 sums,
      dc_skipped.kept_target_sums, for the first n_sums of these tiles; common.add_dc_targets for
      the others) [- w_v sum_i gamma_i e_i].

    The tiles are TList's first TCnt (those with a kept block; none is in a dense slab, whose
    tiles keep no block); dc_skipped.py writes the others. Persistent programs take the
    (tile, D chunk) items in turn, a tile's D chunks at consecutive items (they recompute the
    same kept tiles from the same rows of E and C, then read from L2).
    """
    n_dchunks = tl.cdiv(D, BLOCK_DO)
    n_valid = tl.load(NValid)
    for w in range(tl.program_id(0), tl.load(TCnt) * n_dchunks, tl.num_programs(0)):
        pid_v = tl.load(TList + w // n_dchunks)
        offs_p, col_mask, vid = tile_cols(Perm, pid_v, V, BLOCK_V)
        offs_do = (w % n_dchunks) * BLOCK_DO + tl.arange(0, BLOCK_DO)
        dmask = offs_do < D
        acc = tl.zeros((BLOCK_V, BLOCK_DO), dtype=tl.float32)
        for k in range(0, tl.load(CntC + pid_v)):
            blk = tl.load(ListC + pid_v * (n_blocks + 1) + k)
            offs_n = blk * BLOCK_N + tl.arange(0, BLOCK_N)
            row_mask = offs_n < n_valid
            erow, tgt, lse, alpha, eta = block_rows(Erow, Tgt, Lse, Alpha, Eta, offs_n, row_mask, HAS_ETA)
            gk = tl.load(Gidx + blk * n_vtiles + pid_v)
            dzc, scale = kept_dz(
                Scratch, ScaleBuf, gk, cap,
                E, C, Bias, erow, vid, tgt, lse, alpha, eta, row_mask, col_mask, D, stride_e, stride_c,
                softcap, inv_temp,
                HAS_BIAS, HAS_SOFTCAP, HAS_TEMP, HAS_ETA, SCALE_DZ, BLOCK_N, BLOCK_V, BLOCK_D, PRECISION,
            )  # fmt: skip
            e = tl.load(
                E + erow[:, None] * stride_e + offs_do[None, :],
                mask=row_mask[:, None] & dmask[None, :],
                other=0.0,
            )  # [BLOCK_N, BLOCK_DO]
            acc += tl.dot(tl.trans(dzc), e, input_precision=PRECISION) * scale
        acc += rank1_rows(
            Q, G, GFlag, W, GE, offs_p, pid_v.to(tl.int64), vid, col_mask, offs_do, dmask, V, stride_g,
            HAS_FO, HAS_SMOOTH, HAS_WEIGHT, BLOCK_V, False,
        )  # fmt: skip
        rank = w // n_dchunks  # (the tile's rank in TList)
        if rank < n_sums:
            lanes = (rank * BLOCK_V + tl.arange(0, BLOCK_V)).to(tl.int64)
            tmask = col_mask[:, None] & dmask[None, :]
            acc += tl.load(TSum + lanes[:, None] * D + offs_do[None, :], mask=tmask, other=0.0)
        else:
            acc = add_dc_targets(
                acc, Seg, TRow, TPos, TCoef, E, pid_v, pid_v * BLOCK_V, offs_do, dmask, stride_e, BLOCK_V,
                BLOCK_R, SPLIT_DOT,
            )  # fmt: skip
        tl.store(
            dC + vid[:, None] * stride_dc + offs_do[None, :], acc.to(dC.dtype.element_ty),
            mask=col_mask[:, None] & dmask[None, :],
        )  # fmt: skip


def sparse_config() -> tuple[int, int, int, int, int, int]:
    """(BLOCK_D of the recompute, BLOCK_DO of dE and of dC, BLOCK_J, BLOCK_R, num_warps).

    A kept tile is recomputed once per D chunk of the output, so the chunks are as wide as the
    accumulator allows: [BLOCK_N, 128] for dE, [BLOCK_V = 256, 64] for dC (fp32 registers)."""
    if interpreting():
        return 32, 32, 32, 16, 16, 4
    return 64, 128, 64, 64, 32, 8


class _Geometry(NamedTuple):
    """What every launch of one sparse backward shares (linear_ce_backward_sparse makes it)."""

    common: dict[str, Any]  # the problem's operands, as every kernel here takes them
    ctx: AbstractContextManager[Any]  # the launches' device context
    cfg: KernelConfig  # the forward's tiles: n_blocks token blocks of the N sorted rows x n_vtiles
    N: int
    D: int
    n_blocks: int
    n_vtiles: int
    scale_dz: bool  # (fp16) the kept tiles' dZ are stored scaled, an fp32 scale per tile


class _DeSlots(NamedTuple):
    """The dE writer's kept-tile slots, S per token block (_de_slots)."""

    slots: torch.Tensor  # [n_blocks * S, BLOCK_N, BLOCK_V]
    scale: torch.Tensor | None  # their fp32 scales where scale_dz, else None
    S: int
    in_stash: bool  # whether the slots are in the stash's tail (else a buffer of their own)
    code_in_stash: bool  # whether plan.code is the stash's tail
    protect: Callable[[int], int]  # stash.stash_layout's
    free: int  # the stash's elements before the slots (or the codes), free for the dC writer's slots


def _de_slots(g: _Geometry, e2d: torch.Tensor, plan: SparsePlan, stash: torch.Tensor, S: int) -> _DeSlots:
    """The dE writer's kept-tile slots (_DeSlots), filled with their dZ by kept_tiles.fill_block_slots."""
    cfg, dev, n_blocks, BN, BV = g.cfg, e2d.device, g.n_blocks, g.cfg.BLOCK_N, g.cfg.BLOCK_V
    tile = BN * BV
    code_in_stash = shares_memory(plan.code, stash)
    # The stash's tail: [kept-tile slots of the dE writer, S per block][codes]. The slots go
    # there when they fit, else to a separate buffer (small D).
    code_bytes = g.n_vtiles if code_in_stash else 0
    A0, code_lo, protect = stash_layout(g.N, e2d.shape[0], g.D, e2d.element_size(), code_bytes, BN, BV, S)
    slots_in_stash = A0 is not None
    if slots_in_stash:
        slots = stash.view(-1)[A0 : A0 + n_blocks * S * tile].view(n_blocks * S, BN, BV)
        free = A0
    else:
        slots = torch.empty((n_blocks * S, BN, BV), dtype=e2d.dtype, device=dev)
        free = code_lo
    slot_scale = torch.empty(n_blocks * S, dtype=torch.float32, device=dev) if g.scale_dz else None
    if S > 0:
        with g.ctx:
            fill_block_slots(plan.list_e, plan.cnt_e, slots, slot_scale, S, cfg, g.common)
    return _DeSlots(slots, slot_scale, S, slots_in_stash, code_in_stash, protect, free)


def _fp32_words(stash: torch.Tensor, lo: int, hi: int) -> torch.Tensor | None:
    """The stash's elements [lo, hi) as fp32 words (whole words from lo; lo a multiple of the
    words' elements, as whole tiles are), or None for elements wider than 4 bytes."""
    per = 4 // stash.element_size()
    if per == 0:
        return None
    x = stash.view(-1)[lo:hi]
    return x[: x.numel() // per * per].view(torch.float32)


def _write_dc(
    g: _Geometry, e2d: torch.Tensor, c: torch.Tensor, weight: torch.Tensor | None, plan: SparsePlan,
    stash: torch.Tensor | None, de: _DeSlots | None, dense: torch.Tensor | None, tiles_per_slab: int,
    smooth: bool, sums_bytes: int,
) -> torch.Tensor:  # fmt: skip
    """dC, newly allocated: the tiles without kept blocks by dc_skipped.write_skipped_dc, then
    those with them by _sparse_dc_kernel, whose first kept tiles' dZ go first into a scratch:
    the stash's head with ``de`` (dE wanted), else a buffer of its own; the target sums of the
    first of those tiles within ``sums_bytes`` (dc_skipped.kept_target_sums) before them."""
    cfg, dev, BN, BV = g.cfg, e2d.device, g.cfg.BLOCK_N, g.cfg.BLOCK_V
    tile = BN * BV
    BD, _, BDO_C, _, BR, warps = sparse_config()
    free = e2d.numel() if de is None else de.free  # elements of the stash free for the dC writer's slots
    cap = min(plan.klist.numel() - 1, free // tile)
    if de is not None and cap > 0:
        scratch = stash.view(-1)[: cap * tile].view(cap, BN, BV)
    else:
        scratch = torch.empty((cap, BN, BV), dtype=e2d.dtype, device=dev)
    scalebuf = torch.empty(cap, dtype=torch.float32, device=dev) if g.scale_dz else None
    if g.N > 0 and cap > 0:
        with g.ctx:
            fill_kept_slots(plan.klist, plan.n_kept, scratch, scalebuf, cfg, g.common)
    dC = torch.empty(c.shape, dtype=c.dtype, device=dev)
    pending = plan.fo_pending
    fo_flag = plan.fo.flag if plan.fo is not None else None if pending is None else pending.flag
    if g.n_vtiles == 0:
        return dC
    tlist, tcnt = compact_lists((plan.cnt_c > 0)[None, :])  # the tiles with kept blocks
    tend = class_ends(plan.tpos)
    with g.ctx:
        # Their target sums first (the frequent classes' thousands of rows, a vector loop per
        # class): the recompute below then has only its kept blocks as its long path. With dE
        # wanted they take the stash's free head past the slots above (no memory beside the
        # gradients; fewer tiles where less is free), else a buffer of their own.
        space = None if de is None else _fp32_words(stash, cap * tile, de.free)
        tsum = kept_target_sums(
            e2d, g.common["V"], plan.cnt_c, plan.seg, plan.trow, plan.tpos, plan.tcoef, tend, BV, sums_bytes,
            space,
        )  # fmt: skip
    # Those tiles' programs are few and long (the kept tiles); on CUDA they run on a second
    # stream beside the other tiles' (dc_skipped.py), which write other rows of dC and read what
    # both read. Its higher priority lets their programs take SMs first; the others' many short
    # programs fill the rest.
    main = torch.cuda.current_stream(dev) if dev.type == "cuda" else None
    side = torch.cuda.Stream(dev, priority=-1) if main is not None else None
    if side is not None:
        side.wait_stream(main)
    try:
        with g.ctx, torch.cuda.stream(side) if side is not None else nullcontext():
            # (one stage: the recompute's second stage took shared memory from every program:
            # docs/benchmarks.md, "The sparse dC writer's programs")
            items = g.n_vtiles * triton.cdiv(g.D, BDO_C)
            _sparse_dc_kernel[(min(items, 2 * num_sms(dev)),)](
                W=weight, ListC=plan.list_c, CntC=plan.cnt_c, TList=tlist, TCnt=tcnt, Seg=plan.seg,
                TRow=plan.trow, TPos=plan.tpos, TCoef=plan.tcoef, TSum=tsum, Q=plan.q, G=plan.g,
                GE=plan.ge if smooth else None, Gidx=plan.gidx, Scratch=scratch, ScaleBuf=scalebuf,
                GFlag=fo_flag, dC=dC, stride_dc=dC.stride(0), stride_g=plan.g.stride(0),
                n_blocks=g.n_blocks, cap=cap, n_sums=tsum.shape[0], BLOCK_D=BD, BLOCK_DO=BDO_C, BLOCK_R=BR,
                SPLIT_DOT=split_dot(e2d.device), num_warps=warps, num_stages=1, **g.common,
            )  # fmt: skip
        with g.ctx:
            write_skipped_dc(
                dC, e2d, g.common["Perm"], plan.cnt_c, dense, plan.seg, plan.trow, plan.tpos, plan.tcoef,
                tend, plan.q, plan.g, fo_flag, weight, plan.ge if smooth else None, tiles_per_slab, BV,
            )  # fmt: skip
    finally:
        if side is not None:
            # (joined before any later work, an error's included: what either stream read or
            # wrote is reused, or freed to the allocator, only after both)
            main.wait_stream(side)
    return dC


def _decisions(
    plan: SparsePlan, dense: torch.Tensor | None, decided: HostPeek | None
) -> tuple[FirstOrder | None, torch.Tensor | None, list[int] | None]:
    """(fo, dense, slabs): the first-order terms to apply (built here where pending), ``dense``
    (None where no slab is dense) and the dense slabs for DenseSlabRun (None: all, gated)."""
    # The device's decisions, where they have reached the host (else None: every gated launch).
    seen = None if decided is None else decided.get()
    # Whether the first-order terms' flag has reached the host as 0: their gated launches would
    # be no-ops, and operands not built yet are left out (the flag has had the dC writer's issue
    # time longer to arrive than at the plan).
    fo_off = (
        seen is not None and (plan.fo is not None or plan.fo_pending is not None) and int(seen[1][0]) == 0
    )
    if plan.fo_pending is not None:
        if not fo_off:
            plan.fo = plan.fo_pending.build()
        plan.fo_pending = None
    fo = None if fo_off else plan.fo
    slabs = None if dense is None or seen is None else [s for s, d in enumerate(seen[0].tolist()) if d]
    if slabs == []:
        dense = None  # no slab is dense: the dE writer neither masks nor adds the slabs' part
    return fo, dense, slabs


def _write_de(
    g: _Geometry, e2d: torch.Tensor, c: torch.Tensor, perm: torch.Tensor, stash: torch.Tensor,
    plan: SparsePlan, de: _DeSlots, gamma: torch.Tensor | None, cm: torch.Tensor | None,
    fo: FirstOrder | None, dense: torch.Tensor | None, slab_run: DenseSlabRun | None, tiles_per_slab: int,
) -> None:  # fmt: skip
    """dE (N > 0), written once by _sparse_de_kernel into ``stash`` in sorted row order, in the
    rounds of stash.de_rounds, each cut at the dense slabs' row blocks (``slab_run``: a block's
    launches are issued before its first rows', and the writer adds its dE part); ``cm``: the
    tile means in fp32, or None (made here)."""
    N, D, BN, BV = g.N, g.D, g.cfg.BLOCK_N, g.cfg.BLOCK_V
    BD, BDO_E, _, BJ, _, warps = sparse_config()
    slots, slot_scale, S = de.slots, de.scale, de.S
    # The tile means of C, all of D: [n_tiles, D], O(V D / BLOCK_V), alive through the pass.
    if plan.fo is not None:
        cm = plan.fo.cm
    cm = tile_means(c, perm, BV, e2d.dtype) if cm is None else cm.to(e2d.dtype)
    for a, b, last in de_rounds(N, D, BN, de.protect):
        code, row0, sl, sl_scale, sl_blk0 = plan.code, 0, slots, slot_scale, 0
        if last:  # copies of what the rows [a, N) read in the region they write
            if de.code_in_stash:
                code, row0 = plan.code[a:].clone(), a
            sl_blk0 = a // BN
            sl = slots[sl_blk0 * S :]
            sl = sl.clone() if de.in_stash else sl
            sl_scale = slot_scale[sl_blk0 * S :] if g.scale_dz else slot_scale
        for a1, b1, de_acc, acc_row0 in slab_run.parts(a, b) if slab_run is not None else [(a, b, None, 0)]:
            with g.ctx:
                _sparse_de_kernel[(triton.cdiv(b1 - a1, BN) * triton.cdiv(D, BDO_E),)](
                    Slog=plan.slog, Gamma=gamma, Coef=plan.coef, Code=code, ListE=plan.list_e,
                    CntE=plan.cnt_e,
                    Cm=cm, WC=plan.wc if gamma is not None else None, Scratch=sl, ScaleBuf=sl_scale,
                    Dense=dense, DEAcc=de_acc, Gram=None if fo is None else fo.gram,
                    GScale=None if fo is None else fo.gscale, GFlag=None if fo is None else fo.flag,
                    dE=stash, tiles_per_slab=tiles_per_slab,
                    stride_de=stash.stride(0), stride_code=code.stride(0),
                    stride_cm=cm.stride(0), stride_acc=0 if de_acc is None else de_acc.stride(0),
                    acc_row0=acc_row0, blk0=a1 // BN, code_row0=row0, slot_blk0=sl_blk0, cap=sl.shape[0],
                    N_SLOTS=S, BLOCK_D=BD, BLOCK_DO=BDO_E, BLOCK_J=BJ, STEPS=STATS_STEPS, num_warps=warps,
                    num_stages=2, **g.common,
                )  # fmt: skip
        del code, sl, sl_scale


def linear_ce_backward_sparse(
    e2d: torch.Tensor, c: torch.Tensor, bias: torch.Tensor | None, weight: torch.Tensor | None,
    erow: torch.Tensor, tgt: torch.Tensor, perm: torch.Tensor, n_valid: torch.Tensor, lse: torch.Tensor,
    alpha: torch.Tensor, gamma: torch.Tensor | None, plan: SparsePlan, softcap: float, need_de: bool,
    need_dc: bool, stash: torch.Tensor | None = None, src: torch.Tensor | None = None, release: bool = True,
    de_block_slots: int = 2, move_bytes: int = 8 << 20, dense: torch.Tensor | None = None,
    tiles_per_slab: int = 1, eta: torch.Tensor | None = None, dz_bound: torch.Tensor | None = None,
    cm: torch.Tensor | None = None, temperature: float = 1.0, decided: HostPeek | None = None,
    block_bytes: int = 256 << 20, kept_sums_bytes: int = KEPT_SUMS_BYTES,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:  # fmt: skip
    """(dE, dC), each value rounded once into its storage: dE into ``stash`` (e2d's shape and
    dtype; the codes plan.code may be its tail, see stash_code), which is returned; dC newly
    allocated.

    No fp32 gradient accumulators and no atomics: one program owns a (token block, D chunk) of dE
    or a (vocabulary tile, D chunk) of dC. The skipped tiles enter through the forward's
    statistics; kept tiles' dZ are computed once into a scratch (past its slots, once per D chunk).
    dC is written first, its scratch in the stash (plan.klist numbers its slots). The dE pass
    then runs in rounds of sorted rows (stash.de_rounds) whose scratch sits in the stash past the
    round's rows and before the codes still to be read; at the end the rows are moved to e2d's
    order (src: sorted row of each e2d row, -1 for rows whose gradient is 0). So nothing of
    O(N) bytes per row is allocated besides the gradients. gamma (smoothing without softcap) is
    given with plan.wc / plan.ge. With ``release`` the plan's dC-only tensors are dropped once dC
    is written.

    ``eta`` (fp32 [N] per sorted row, or None): the entropy's coefficient, dZ = p (alpha + eta z)
    at the non-target entries (cce/_math.py); the skipped tiles' corrections then use each
    tile's coefficient alpha + eta zbar_ij, zbar_ij its mean logit to first order
    (common.skipped_slog; _sparse_de_kernel), the first-order terms that coefficient plus eta
    (first_order.py). ``dz_bound`` (fp32 [N] or None): a bound of
    each row's max |dZ| / softcap' (backward_exact.fp16_dz_bound), for the dense slabs' fp16
    scale where it is not max |alpha|.

    ``dense`` (int8 [n_slabs] on the device, or None): the slabs of ``tiles_per_slab`` tiles
    that the plan leaves out (keep 0, code 255), done by dense_slabs.DenseSlabRun after the
    sparse dC writer, by row blocks: their dC rows directly, their dE part through an fp32
    accumulator of one block's rows that the dE writer adds (its fp32 rows and gathered rows of
    E within ``block_bytes``: flat in N; allocated only with ``dense``). ``decided``
    (host_peek.HostPeek of ``dense`` and plan.fo's flag, or None): where those have reached the
    host, only the dense slabs' launches are issued (none, and no accumulator, where no slab is
    dense), and the first-order terms' only where their flag is set. ``cm``: the tile means in
    fp32 where the caller has them (else made here).

    ``temperature``: the logits are softcap(x) / T in the recomputed tiles; the coefficients
    (alpha, eta, plan.coef) carry the chain rule's 1 / T already, and the plan's statistics are
    those of the tempered logits (the forward's).

    ``kept_sums_bytes``: the fp32 scratch of the target sums of the first tiles with kept blocks
    (dc_skipped.kept_target_sums; the other such tiles sum their target rows themselves).
    """
    check_inputs(e2d, c, bias, weight, erow, tgt, perm, n_valid, lse, alpha, gamma, eta)
    N = erow.numel()
    smooth = gamma is not None
    g = _geometry(e2d, c, bias, erow, tgt, perm, n_valid, lse, alpha, eta, softcap, temperature)
    de = None
    if need_de:
        if stash is None or src is None or stash.shape != e2d.shape or stash.dtype != e2d.dtype:
            raise ValueError("need_de needs a stash of e2d's shape and dtype and its row map src")
        de = _de_slots(g, e2d, plan, stash, de_block_slots if N > 0 else 0)
    dC = None
    if need_dc:
        dC = _write_dc(g, e2d, c, weight, plan, stash, de, dense, tiles_per_slab, smooth, kept_sums_bytes)
    fo, dense, slabs = _decisions(plan, dense, decided)
    slab_run = None
    if dense is not None:
        # After the sparse dC writer (independent of it: it masks the dense slabs' tiles), so that
        # the slabs' gated launches are issued while the GPU runs it. The first row block adds
        # the target terms of the dense slabs' classes; the others run between the dE writer's
        # rounds (_write_de), or here without dE.
        slab_run = DenseSlabRun(
            e2d, c, bias, erow, tgt, perm, n_valid, lse, alpha, dense, tiles_per_slab, softcap, need_de, dC,
            (plan.seg, plan.trow, plan.tpos, plan.tcoef) if need_dc else None, weight,
            plan.ge if smooth else None, eta=eta, dz_bound=dz_bound, slabs=slabs, temperature=temperature,
            block_bytes=block_bytes,
        )  # fmt: skip
        if not need_de:
            slab_run.run_all()
        elif slab_run.n_blocks > 0:
            slab_run.run(0)
    # (dC's dense classes hold a scaled fp16 sum until the last row block: the first-order
    # terms, which add to every class, wait for it.)
    fo_dc = fo if need_dc else None
    if fo_dc is not None and (slab_run is None or slab_run.next == slab_run.n_blocks):
        _add_first_order(dC, c, fo_dc, release)
        fo_dc = None
    if release:
        plan.list_c = plan.cnt_c = plan.g = plan.q = plan.trow = plan.tpos = plan.tcoef = plan.seg = None
        plan.gidx = plan.klist = None
        if plan.fo is not None and fo_dc is None:
            plan.fo.H = plan.fo.rate = plan.fo.tile_of = None
    if not need_de:
        return None, dC
    if N > 0:
        _write_de(g, e2d, c, perm, stash, plan, de, gamma, cm, fo, dense, slab_run, tiles_per_slab)
    del de, slab_run
    if fo_dc is not None:
        _add_first_order(dC, c, fo_dc, release)
    to_e_rows(stash, src, move_bytes)
    return stash, dC


def _geometry(
    e2d: torch.Tensor, c: torch.Tensor, bias: torch.Tensor | None, erow: torch.Tensor, tgt: torch.Tensor,
    perm: torch.Tensor, n_valid: torch.Tensor, lse: torch.Tensor, alpha: torch.Tensor,
    eta: torch.Tensor | None, softcap: float, temperature: float,
) -> _Geometry:  # fmt: skip
    """The _Geometry of one linear_ce_backward_sparse call: the kernels' config and the problem's
    operands, as every kernel here takes them."""
    N = erow.numel()
    V, D = c.shape
    cfg = config(e2d.dtype, "fwd")
    BN, BV = cfg.BLOCK_N, cfg.BLOCK_V
    n_blocks, n_vtiles = triton.cdiv(N, BN), triton.cdiv(V, BV)
    scale_dz = e2d.dtype == torch.float16
    common = dict(
        E=e2d, C=c, Bias=bias, Erow=erow, Tgt=tgt, Perm=perm, NValid=n_valid, Lse=lse, Alpha=alpha,
        Eta=eta, V=V, D=D, stride_e=e2d.stride(0), stride_c=c.stride(0), n_vtiles=n_vtiles,
        softcap=float(softcap), HAS_SOFTCAP=softcap > 0, inv_temp=1.0 / temperature,
        HAS_TEMP=temperature != 1.0, SCALE_DZ=scale_dz, BLOCK_N=BN, BLOCK_V=BV,
        PRECISION=precision(e2d.dtype),
    )  # fmt: skip
    return _Geometry(common, device_context(e2d.device), cfg, N, D, n_blocks, n_vtiles, scale_dz)


def _add_first_order(dC: torch.Tensor, c: torch.Tensor, fo: FirstOrder, release: bool) -> None:
    """The first-order terms' part of dC (gated by their flag), then (``release``) their dC-only
    operands dropped."""
    add_dc_first_order(dC, c, fo.H, fo.cm, fo.tile_of, fo.rate, fo.flag)
    if release:
        fo.H = fo.rate = fo.tile_of = None
