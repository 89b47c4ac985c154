"""The dense slabs of the sparse backward: vocabulary slabs where recomputing tile by tile does
not pay, run as GEMMs whose launch the device decides.

The sparse backward (backward_sparse.py) is fast where few tiles are kept (an LM's softmax on
the head of a sorted vocabulary) and slow where many are: a kept tile past its scratch slot is
recomputed once per D chunk of each output. Its rank-1 corrections of skipped tiles are accurate
only where the skipped mass is small. The sorted vocabulary is therefore cut into slabs of
whole tiles, and the device marks a slab dense (triton_backward.dense_slab_flags: many kept
tiles, or too much skipped mass left behind it) from the forward's own statistics. A dense
slab's tiles leave the sparse plan (keep 0, code 255) and are done here, exactly, in two
launches per slab (three on Hopper, whose GEMMs read the slab's classes gathered by a third) that
return at once for a sparse slab (no host synchronisation, so a step stays capturable in a CUDA
graph):

    for each row block B of the sorted rows (DenseSlabRun.blocks), each dense slab [v0, v1):
    dZ_slab[i, k] = p_{i, v_k} (alpha_i [+ eta_i z_{i, v_k}]) softcap'(z_{i, v_k})
                                  i in B, non-target entries only, v_k = perm[v0 + k]  (eta: entropy)
    dE_acc[i, :] += dZ_slab[i, :] @ C[perm[v0:v1]]            fp32 accumulator of B's rows
    dC[perm[v0 + k], :] (+)= dZ_slab[:, k]^T @ E[erow[B]]      one block: written once in c's
                                                              dtype; several: summed in dC's
                                                              storage as fp16 x S

The row blocks keep the memory flat in N: the dZ buffer, the fp32 dE rows and (Hopper) the
gathered rows of E are one block's, and the dE writer adds a block's dE_acc to its rows before
the next block runs (backward_sparse.py). Past one block dC's running sum is that of
dc_accumulate.py (fp16 times a power of two S from a bound of every partial sum, 8x finer per
block than bf16's rounding, no buffer).

The target entries stay out of the slab: the sparse writers add every row's exact target term
(p_t (alpha [+ eta z_t]) - beta, in fp32). dZ is rounded once to the operand dtype, as in the exact path; fp16
stores it times inv = 1 / max |alpha| (alpha p can sit below fp16's normal range; with the
entropy's term, 1 / the max of a bound of |dZ| / softcap' per row) and the products are scaled
back. Rows past n_valid have alpha = 0 and are stored as zeros; columns
past V likewise (the slab buffer is reused, and a stale entry would meet a masked operand).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ...._dispatch import interpreting, num_sms
from ...launch import cached_launch
from .backward_exact import exact_block_rows
from .common import (
    KernelConfig,
    add_dc_targets,
    config,
    device_context,
    logit_tile,
    precision,
    split_dot,
    sub_dc_smoothing,
    tensor_descriptor,
    tile_cols,
    use_tma,
)
from .dc_accumulate import dense_dc16_scale, scaled_fp16_sum
from .dz import nontarget_dz


def dense_config(tma: bool = False) -> tuple[int, int, int, int, int]:
    """(BLOCK_M of dE's rows and of dC's classes, BLOCK_DO, BLOCK_K, num_warps, num_stages) of
    the two slab GEMMs (docs/benchmarks.md has the sweep on an H100)."""
    if interpreting():
        return 16, 32, 16, 4, 1
    if tma:
        return 128, 256, 64, 8, 4
    return 128, 128, 64, 4, 4


@triton.jit
def _store_slab_dz(
    L, Bias, Tgt, Lse, Alpha, Eta, Inv, DZ, offs_n, row_mask, vid, col_mask, col0, N, stride_dz, softcap,
    inv_temp,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_TEMP: tl.constexpr, HAS_ETA: tl.constexpr,
    SCALE_DZ: tl.constexpr,
    BLOCK_V: tl.constexpr,
):  # fmt: skip
    """The dZ tile of logits L [BLOCK_N, BLOCK_V] (classes vid) into slab columns col0 + lane:
    p (alpha [+ eta z]) softcap' at the non-target entries, 0 elsewhere (rows past n_valid, classes past V,
    the targets), times inv with SCALE_DZ; rows past N are not stored."""
    tgt = tl.load(Tgt + offs_n, mask=row_mask, other=-1).to(tl.int64)
    lse = tl.load(Lse + offs_n, mask=row_mask, other=0.0)
    alpha = tl.load(Alpha + offs_n, mask=row_mask, other=0.0)
    eta = alpha  # (read only with HAS_ETA)
    if HAS_ETA:
        eta = tl.load(Eta + offs_n, mask=row_mask, other=0.0)
    dz = nontarget_dz(
        L, Bias, vid, tgt, lse, alpha, eta, row_mask, col_mask, softcap, inv_temp, HAS_BIAS, HAS_SOFTCAP,
        HAS_TEMP, HAS_ETA,
    )  # fmt: skip
    if SCALE_DZ:
        dz *= tl.load(Inv)
    cols = col0 + tl.arange(0, BLOCK_V)
    ptr = DZ + offs_n.to(tl.int64)[:, None] * stride_dz + cols[None, :]
    tl.store(ptr, dz.to(DZ.dtype.element_ty), mask=(offs_n < N)[:, None])


@cached_launch
@triton.heuristics(
    {
        "HAS_BIAS": lambda a: a["Bias"] is not None,
        "SCALE_DZ": lambda a: a["Inv"] is not None,
        "HAS_ETA": lambda a: a["Eta"] is not None,
    }
)
@triton.jit
def _slab_dz_kernel(
    E, C, Bias,  # [*, D] hidden states, [V, D] classifier, [V] or None
    Erow, Tgt, Perm, NValid, Lse, Alpha,  # per sorted row / sorted position
    Eta,  # [N] fp32 the entropy's coefficient per sorted row, or None
    Dense,  # [n_slabs] int8: 1 where the slab is dense
    DZ,  # [N, slab] operand dtype
    Inv,  # [1] fp32 1 / max |alpha| (with eta: 1 / max of the rows' |dZ| bound) (fp16), or None
    N, V, D, stride_e, stride_c, stride_dz, slab, tile0, row0, softcap, inv_temp,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_TEMP: tl.constexpr, HAS_ETA: tl.constexpr,
    SCALE_DZ: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Program (b, s): tile tile0 + s of the sorted vocabulary for token block b of the row block
    (N sorted rows from row0; Erow, Tgt, Lse, Alpha, Eta and DZ start at its first), into columns
    [s BLOCK_V, (s + 1) BLOCK_V) of the slab, if slab ``slab`` is dense."""
    if tl.load(Dense + slab) == 0:
        return
    pid_n = tl.program_id(0)
    s = tl.program_id(1)
    start = pid_n * BLOCK_N
    n_valid = block_valid(NValid, row0, N)
    if start >= n_valid:
        return  # never written, never read (the pointer GEMMs mask rows past n_valid)
    offs_n = start + tl.arange(0, BLOCK_N)
    row_mask = offs_n < n_valid
    erow = tl.load(Erow + offs_n, mask=row_mask, other=0).to(tl.int64)
    _offs_p, col_mask, vid = tile_cols(Perm, tile0 + s, V, BLOCK_V)
    L = logit_tile(
        E, C, erow, vid, row_mask, col_mask, D, stride_e, stride_c, BLOCK_N, BLOCK_V, BLOCK_D, PRECISION
    )  # [BLOCK_N, BLOCK_V]
    _store_slab_dz(
        L, Bias, Tgt, Lse, Alpha, Eta, Inv, DZ, offs_n, row_mask, vid, col_mask, s * BLOCK_V, N, stride_dz,
        softcap, inv_temp, HAS_BIAS, HAS_SOFTCAP, HAS_TEMP, HAS_ETA, SCALE_DZ, BLOCK_V,
    )  # fmt: skip


@cached_launch
@triton.heuristics(
    {
        "HAS_BIAS": lambda a: a["Bias"] is not None,
        "SCALE_DZ": lambda a: a["Inv"] is not None,
        "HAS_ETA": lambda a: a["Eta"] is not None,
    }
)
@triton.jit
def _slab_dz_tma_kernel(
    Ed, Cd,  # descriptors of the sorted rows E_s [N, D] and of the slab's classes C_slab [width, D]
    Bias, Tgt, Perm, NValid, Lse, Alpha, Eta, Dense, DZ, Inv,
    N, V, D, stride_dz, slab, v0, row0, softcap, inv_temp,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_TEMP: tl.constexpr, HAS_ETA: tl.constexpr,
    SCALE_DZ: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """_slab_dz_kernel with its operands read by tensor descriptors (Hopper): the row block's
    rows gathered into E_s and the slab's classes into C_slab beforehand (_gather_slab_kernel),
    the target entries masked by comparing ids; columns past V (the last slab) are stored as
    zeros."""
    if tl.load(Dense + slab) == 0:
        return
    pid_n = tl.program_id(0)
    s = tl.program_id(1)
    start = pid_n * BLOCK_N
    n_valid = block_valid(NValid, row0, N)
    if start >= n_valid:
        # Zeros: the TMA GEMMs' row blocks reach past n_valid, and the buffer is not zeroed at
        # allocation (a memset of the whole slab on every step, dense or not).
        offs_n = start + tl.arange(0, BLOCK_N)
        cols = s * BLOCK_V + tl.arange(0, BLOCK_V)
        ptr = DZ + offs_n.to(tl.int64)[:, None] * stride_dz + cols[None, :]
        tl.store(ptr, tl.zeros((BLOCK_N, BLOCK_V), dtype=DZ.dtype.element_ty), mask=(offs_n < N)[:, None])
        return
    acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        a = Ed.load([start, d0])  # [BLOCK_N, BLOCK_D]; zeros past N and D
        b = Cd.load([s * BLOCK_V, d0])  # [BLOCK_V, BLOCK_D]; zeros past V (the gather's)
        acc = tl.dot(a, b.T, acc, input_precision=PRECISION)
    offs_n = start + tl.arange(0, BLOCK_N)
    _offs_p, col_mask, vid = tile_cols(Perm + v0, s, V - v0, BLOCK_V)
    _store_slab_dz(
        acc, Bias, Tgt, Lse, Alpha, Eta, Inv, DZ, offs_n, offs_n < n_valid, vid, col_mask, s * BLOCK_V, N,
        stride_dz, softcap, inv_temp, HAS_BIAS, HAS_SOFTCAP, HAS_TEMP, HAS_ETA, SCALE_DZ, BLOCK_V,
    )  # fmt: skip


@triton.jit
def block_valid(NValid, row0, N):
    """The valid rows of the row block of N sorted rows from row0: n_valid - row0 within [0, N]."""
    return tl.minimum(tl.maximum(tl.load(NValid) - row0, 0), N)


@triton.jit
def _slab_de_tile(
    DZ, C, Perm, n_valid, DEAcc, Scale, DZd, Cd, pid_m, pid_d,
    D, stride_dz, stride_c, stride_de, v0, width,
    SCALE_DZ: tl.constexpr, USE_TMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_DO: tl.constexpr,
    BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """DEAcc[rows of block pid_m, D chunk pid_d] += DZ[rows, :width] @ C[perm[v0 : v0 + width],
    D chunk] over the row block's first n_valid rows; one program owns its output tile (no
    atomics). USE_TMA: the operands by descriptors, C's rows gathered into C_slab beforehand
    (zeros past width up to the tile's end, where dZ's columns are zeros too)."""
    start = pid_m * BLOCK_M
    if start < n_valid:  # (blocks past the valid rows: nothing to add)
        offs_m = start + tl.arange(0, BLOCK_M)
        row_mask = offs_m < n_valid
        offs_do = pid_d * BLOCK_DO + tl.arange(0, BLOCK_DO)
        dmask = offs_do < D
        offs_k = tl.arange(0, BLOCK_K)
        a_ptr = DZ + offs_m.to(tl.int64)[:, None] * stride_dz + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
        acc = tl.zeros((BLOCK_M, BLOCK_DO), dtype=tl.float32)
        for k0 in range(0, width, BLOCK_K):
            if USE_TMA:
                a = DZd.load([start, k0])  # [BLOCK_M, BLOCK_K]
                b = Cd.load([k0, pid_d * BLOCK_DO])  # [BLOCK_K, BLOCK_DO]
            else:
                km = (k0 + offs_k) < width
                vid = tl.load(Perm + v0 + k0 + offs_k, mask=km, other=0).to(tl.int64)
                a = tl.load(a_ptr, mask=row_mask[:, None] & km[None, :], other=0.0)
                b_ptr = C + vid[:, None] * stride_c + offs_do[None, :]
                b = tl.load(b_ptr, mask=km[:, None] & dmask[None, :], other=0.0)  # [BLOCK_K, BLOCK_DO]
                a_ptr += BLOCK_K
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
        if SCALE_DZ:
            acc *= tl.load(Scale)
        out = DEAcc + offs_m.to(tl.int64)[:, None] * stride_de + offs_do[None, :]
        m2 = row_mask[:, None] & dmask[None, :]
        tl.store(out, tl.load(out, mask=m2, other=0.0) + acc, mask=m2)


@triton.jit
def _slab_dc_tile(
    DZ, E, Erow, Perm, n_valid, dC, Acc16, S16, Scale, DZd, Ed, Seg, TRow, TPos, TCoef, W, GE, pid_m, pid_d,
    D, stride_dz, stride_e, stride_dc, v0, width,
    SCALE_DZ: tl.constexpr, HAS_SMOOTH: tl.constexpr, HAS_WEIGHT: tl.constexpr, USE_TMA: tl.constexpr,
    FIRST: tl.constexpr, LAST: tl.constexpr, ACC16: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_DO: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr, SPLIT_DOT: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """dC[perm[v0 + cols of block pid_m], D chunk pid_d] (+)= DZ[:n_valid, cols]^T @
    E[erow[:n_valid], D chunk] over the row block's rows; the first row block (FIRST) adds the
    sum over all rows i whose target is one of these classes of coef_i e_i (exact, fp32) [and
    - w_v sum_i gamma_i e_i, the smoothing term]. One row block (FIRST and LAST): written in dC's
    dtype. Several: the running sum stays in dC's storage, as fp16 times S16 (ACC16: a 16-bit dC,
    read and written through its fp16 view Acc16, dc_accumulate.py's scheme) or in fp32 (an
    fp32 dC), and the last block (LAST) writes it in dC's dtype. One program owns its output
    tile. BLOCK_M divides BLOCK_V and v0 is a multiple of BLOCK_V: a program's classes lie in
    one tile."""
    cols = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cmask = cols < width
    offs_do = pid_d * BLOCK_DO + tl.arange(0, BLOCK_DO)
    dmask = offs_do < D
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_DO), dtype=tl.float32)
    for k0 in range(0, n_valid, BLOCK_K):
        if USE_TMA:
            # rows past n_valid: zeros in DZ (written so by the TMA dZ launch)
            a = DZd.load([k0, pid_m * BLOCK_M])  # [BLOCK_K, BLOCK_M]
            b = Ed.load([k0, pid_d * BLOCK_DO])  # [BLOCK_K, BLOCK_DO]
        else:
            rows = k0 + offs_k
            rm = rows < n_valid
            erow = tl.load(Erow + rows, mask=rm, other=0).to(tl.int64)
            a = tl.load(
                DZ + rows.to(tl.int64)[:, None] * stride_dz + cols[None, :],
                mask=rm[:, None] & cmask[None, :], other=0.0,
            )  # fmt: skip  # [BLOCK_K, BLOCK_M]
            b = tl.load(
                E + erow[:, None] * stride_e + offs_do[None, :], mask=rm[:, None] & dmask[None, :], other=0.0
            )  # [BLOCK_K, BLOCK_DO]
        acc = tl.dot(tl.trans(a), b, acc, input_precision=PRECISION)
    if SCALE_DZ:
        acc *= tl.load(Scale)
    vid = tl.load(Perm + v0 + cols, mask=cmask, other=0).to(tl.int64)
    if FIRST:
        # The target entries (left out of the slab), as in backward_sparse._sparse_dc_kernel.
        p0 = v0 + pid_m * BLOCK_M
        acc = add_dc_targets(
            acc, Seg, TRow, TPos, TCoef, E, p0 // BLOCK_V, p0, offs_do, dmask, stride_e, BLOCK_M, BLOCK_R,
            SPLIT_DOT,
        )  # fmt: skip
        if HAS_SMOOTH:
            acc = sub_dc_smoothing(acc, W, GE, vid, cmask, offs_do, dmask, HAS_WEIGHT)
    off = vid[:, None] * stride_dc + offs_do[None, :]  # [BLOCK_M, BLOCK_DO]
    m2 = cmask[:, None] & dmask[None, :]
    if ACC16:
        scaled_fp16_sum(acc, Acc16, dC, S16, off, m2, FIRST, LAST)
    else:
        if not FIRST:
            acc += tl.load(dC + off, mask=m2, other=0.0).to(tl.float32)
        tl.store(dC + off, acc.to(dC.dtype.element_ty), mask=m2)


@cached_launch
@triton.heuristics(
    {
        "SCALE_DZ": lambda a: a["Scale"] is not None,
        "HAS_DE": lambda a: a["DEAcc"] is not None,
        "HAS_DC": lambda a: a["dC"] is not None,
        "HAS_SMOOTH": lambda a: a["GE"] is not None,
        "HAS_WEIGHT": lambda a: a["W"] is not None,
        "ACC16": lambda a: a["S16"] is not None,
    }
)
@triton.jit
def _slab_grads_kernel(
    DZ, C, E, Erow, Perm, NValid, Dense, Scale,
    DEAcc,  # [N, D] fp32 dE of the row block's sorted rows, added to (or None: no dE)
    dC,  # [V, D] written (added to) at the slab's classes (or None: no dC)
    Acc16, S16,  # dC's storage as fp16 and its scale [1] fp32 (_slab_dc_tile), or None
    DZd, Cd, DZtd, Ed,  # USE_TMA: descriptors of DZ [BLOCK_M, BLOCK_K], C_slab, DZ [BLOCK_K, BLOCK_M], E_s
    Seg, TRow, TPos, TCoef,  # the valid rows by their target's position, so by tile (sparse_plan.SparsePlan)
    W, GE,  # smoothing: class weights [V] or None, sum_i gamma_i e_i [D] fp32; or None
    N, D, stride_dz, stride_c, stride_e, stride_de, stride_dc, slab, v0, width, de_blocks, row0,
    SCALE_DZ: tl.constexpr, HAS_DE: tl.constexpr, HAS_DC: tl.constexpr, HAS_SMOOTH: tl.constexpr,
    HAS_WEIGHT: tl.constexpr, ACC16: tl.constexpr, FIRST: tl.constexpr, LAST: tl.constexpr,
    USE_TMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_DO: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr, SPLIT_DOT: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """Both GEMMs of a dense slab over one row block (N sorted rows from row0; Erow and DZ start
    at its first) in one launch (they read dZ and write disjoint outputs), if slab ``slab`` is
    dense: programs [0, de_blocks) along axis 0 take dE's row blocks (_slab_de_tile), the rest
    dC's class blocks (_slab_dc_tile, FIRST / LAST: the first / last row block); axis 1 is the
    D chunk. One launch instead of two per slab: the launches happen whether the slab is dense
    or not (the device decides), and each costs the host more than the device when it is not."""
    if tl.load(Dense + slab) == 0:
        return
    pid = tl.program_id(0)
    pid_d = tl.program_id(1)
    n_valid = block_valid(NValid, row0, N)
    if HAS_DE:
        if pid < de_blocks:
            _slab_de_tile(
                DZ, C, Perm, n_valid, DEAcc, Scale, DZd, Cd, pid, pid_d, D, stride_dz, stride_c, stride_de,
                v0, width, SCALE_DZ, USE_TMA, BLOCK_M, BLOCK_DO, BLOCK_K, PRECISION,
            )  # fmt: skip
    if HAS_DC:
        if pid >= de_blocks:
            _slab_dc_tile(
                DZ, E, Erow, Perm, n_valid, dC, Acc16, S16, Scale, DZtd, Ed, Seg, TRow, TPos, TCoef, W, GE,
                pid - de_blocks, pid_d, D, stride_dz, stride_e, stride_dc, v0, width, SCALE_DZ, HAS_SMOOTH,
                HAS_WEIGHT, USE_TMA, FIRST, LAST, ACC16, BLOCK_M, BLOCK_DO, BLOCK_K, BLOCK_V, BLOCK_R,
                SPLIT_DOT, PRECISION,
            )  # fmt: skip


@cached_launch
@triton.jit
def _gather_slab_kernel(
    C, Perm, Dense, Out, D, stride_c, stride_o, slab, width, rows,
    BLOCK_K: tl.constexpr, BLOCK_DO: tl.constexpr,
):  # fmt: skip
    """Out[k] = C[Perm[k]] for k < width (Perm: the slab's sorted positions) and 0 for width <= k
    < rows (the last slab's tile past V, which the TMA kernels read: the buffer is not zeroed at
    allocation), if slab ``slab`` is dense: the classes the TMA kernels read by descriptor."""
    if tl.load(Dense + slab) == 0:
        return
    offs_k = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    km = offs_k < width
    vid = tl.load(Perm + offs_k, mask=km, other=0).to(tl.int64)
    for d0 in range(0, D, BLOCK_DO):
        offs_d = d0 + tl.arange(0, BLOCK_DO)
        dm = (offs_d < D)[None, :]
        x = tl.load(C + vid[:, None] * stride_c + offs_d[None, :], mask=km[:, None] & dm, other=0.0)
        tl.store(
            Out + offs_k.to(tl.int64)[:, None] * stride_o + offs_d[None, :],
            x,
            mask=(offs_k < rows)[:, None] & dm,
        )


class DenseSlabRun:
    """The dense slabs' part of the gradients (module docstring), by row blocks of the sorted rows
    (``blocks``: [r0, r1) each, multiples of BLOCK_N; their fp32 dE rows and, on Hopper, gathered
    E rows within ``block_bytes``, so the memory is flat in N). ``run(b)`` issues block b's
    launches: its dE part into ``de_acc`` (fp32 [r1 - r0, D], zeroed first; the dE writer adds
    it to the block's rows), its dC part added to the dense slabs' classes of ``dC``, in fp16
    times S (dc_accumulate.dc16_scale) inside dC's storage from the first block to the last,
    which writes the sum in dC's dtype (one block: written once, no scaling). Blocks run in
    order, each once; dC is complete after the last.

    ``dense`` (int8 [n_slabs], on the device) says which slabs; every launch happens, a sparse
    slab's return at once. Tiles are the forward's (config "fwd"), in ``perm`` order. With
    ``dC``, ``targets_by_tile`` = (seg, trow, tpos, tcoef) of the sparse plan: the target terms
    of the dense slabs' classes are added in the first block, and with ``ge`` (smoothing: sum_i
    gamma_i e_i) the smoothing term -w_v ge (``weight``: class weights, None for 1). ``eta``: the
    entropy's coefficient per sorted row (or None), ``dz_bound``: per row a bound of max |dZ| /
    softcap' for fp16's dZ scale (None: |alpha|). ``slabs``: the dense slabs where the host knows
    them (their launches only; they still read ``dense``), None: every slab's launches.
    ``temperature``: the logits are softcap(x) / T (``alpha``, ``eta`` and the target coefficients
    carry its 1 / T)."""

    def __init__(
        self, e2d: torch.Tensor, c: torch.Tensor, bias: torch.Tensor | None, erow: torch.Tensor,
        tgt: torch.Tensor, perm: torch.Tensor, n_valid: torch.Tensor, lse: torch.Tensor, alpha: torch.Tensor,
        dense: torch.Tensor, tiles_per_slab: int, softcap: float, need_de: bool, dC: torch.Tensor | None,
        targets_by_tile: tuple | None = None, weight: torch.Tensor | None = None,
        ge: torch.Tensor | None = None, eta: torch.Tensor | None = None, dz_bound: torch.Tensor | None = None,
        slabs: list[int] | None = None, temperature: float = 1.0, block_bytes: int = 256 << 20,
    ) -> None:  # fmt: skip
        if dC is not None and targets_by_tile is None:
            raise ValueError("dC needs targets_by_tile")
        N = erow.numel()
        V, D = c.shape
        self.launch = launch = _slab_launch(e2d, c)
        BN, BV = launch.cfg.BLOCK_N, launch.cfg.BLOCK_V
        self.width_max = tiles_per_slab * BV
        # The fp32 dE rows and gathered E rows of a block within block_bytes; no cap on the blocks'
        # number (dC's running sum is fp16 in its storage: dc_accumulate.py).
        R = exact_block_rows(N, D, e2d.element_size(), need_de, launch.tma, False, block_bytes, BN)
        work = N > 0 and V > 0 and (dC is not None or need_de)
        self.blocks = [(r0, min(N, r0 + R)) for r0 in range(0, N, R)] if work else []
        R = min(R, N)
        self.operands = (e2d, c, bias, erow, tgt, perm, n_valid, lse, alpha, eta)
        self.dense, self.tps, self.slabs = dense, tiles_per_slab, slabs
        self.softcap, self.temperature = softcap, temperature
        self.dC, self.targets, self.weight, self.ge = dC, targets_by_tile, weight, ge
        self.DZ, self.scale, self.inv = _slab_dz_buffer(e2d, alpha, dz_bound, R, self.width_max)
        self.de_acc = torch.empty((R, D), dtype=torch.float32, device=e2d.device) if need_de else None
        self.E_s = torch.empty((R, D), dtype=e2d.dtype, device=e2d.device) if launch.tma else None
        self.C_slab = (
            torch.empty((self.width_max, D), dtype=c.dtype, device=e2d.device) if launch.tma else None
        )
        self.S16 = None
        if dC is not None and len(self.blocks) > 1 and dC.element_size() == 2:
            self.S16 = dense_dc16_scale(
                e2d, c, bias, alpha, eta, targets_by_tile[3], weight, ge, softcap, temperature
            )
        self.next = 0
        self.current: torch.Tensor | None = None  # the dE part of the block run last

    @property
    def n_blocks(self) -> int:
        return len(self.blocks)

    def run(self, b: int) -> torch.Tensor | None:
        """Block b's launches (the next block: blocks run in order); returns its dE part, fp32
        [r1 - r0, D] (valid until the next block runs), or None without dE."""
        if b != self.next:
            raise ValueError(f"dense-slab row block {b} run out of order (next: {self.next})")
        self.next += 1
        e2d, c, bias, erow, tgt, perm, n_valid, lse, alpha, eta = self.operands
        r0, r1 = self.blocks[b]
        n = r1 - r0
        launch, BV = self.launch, self.launch.cfg.BLOCK_V
        V = c.shape[0]
        rows = (erow[r0:r1], tgt[r0:r1], lse[r0:r1], alpha[r0:r1], None if eta is None else eta[r0:r1])
        DZ = self.DZ[:n]
        de_acc = None
        if self.de_acc is not None:
            de_acc = self.de_acc[:n]
            de_acc.zero_()
        acc = _DcAccumulation(self.dC, self.S16, b == 0, b == len(self.blocks) - 1)
        tma_ops = None
        if launch.tma:
            E_s = torch.index_select(e2d, 0, rows[0], out=self.E_s[:n])
            tma_ops = _tma_operands(E_s, self.C_slab, DZ, launch)
        n_vtiles = triton.cdiv(V, BV)
        with device_context(e2d.device):
            for s, t0 in enumerate(range(0, n_vtiles, self.tps)):
                if self.slabs is not None and s not in self.slabs:
                    continue
                nt = min(self.tps, n_vtiles - t0)
                v0 = t0 * BV
                width = min(V, (t0 + nt) * BV) - v0
                if tma_ops is not None:
                    _launch_slab_dz_tma(
                        c, bias, rows, perm, n_valid, self.dense, DZ, self.inv, self.softcap,
                        self.temperature, launch, tma_ops, s, v0, width, nt, r0,
                    )  # fmt: skip
                    de_d, dc_d = tma_ops.de_d, tma_ops.dc_d
                else:
                    _launch_slab_dz(
                        e2d, c, bias, rows, perm, n_valid, self.dense, DZ, self.inv, self.softcap,
                        self.temperature, launch, s, t0, nt, r0,
                    )  # fmt: skip
                    de_d = dc_d = (None, None)
                _launch_slab_grads(
                    e2d, c, rows[0], perm, n_valid, self.dense, DZ, self.scale, de_acc, acc, self.targets,
                    self.weight, self.ge, launch, de_d, dc_d, s, v0, width, r0,
                )  # fmt: skip
        self.current = de_acc
        if self.next == len(self.blocks):  # the buffers no later block reads: freed now
            self.DZ = self.E_s = self.C_slab = None
        return de_acc

    def parts(self, a: int, b: int):
        """The dE writer's round [a, b) of sorted rows cut at the row blocks: (a', b', de_acc, r0)
        per part, de_acc the dE part of the block from r0 that holds it (whose launches are
        issued here before its first part); without blocks (a, b, None, 0)."""
        if not self.blocks:
            yield a, b, None, 0
            return
        for k, (r0, r1) in enumerate(self.blocks):
            lo, hi = max(a, r0), min(b, r1)
            if lo >= hi:
                continue
            if k >= self.next:
                self.run(k)
            elif k != self.next - 1:
                raise ValueError(
                    f"the dE writer reached dense-slab row block {k} after block {self.next - 1}"
                )
            yield lo, hi, self.current, r0

    def run_all(self) -> None:
        """Every block left (dC alone: no dE part to read between them)."""
        while self.next < len(self.blocks):
            self.run(self.next)


class _DcAccumulation(NamedTuple):
    """dC's part of one row block's launches: dC (or None), the fp16 scale S16 (or None: one
    block, or an fp32 dC), and whether the block is the first / the last."""

    dC: torch.Tensor | None
    S16: torch.Tensor | None
    first: bool
    last: bool


class _SlabLaunch(NamedTuple):
    """The launch settings that the slabs of one DenseSlabRun share (_slab_launch)."""

    cfg: KernelConfig  # the forward's tiles (config "fwd")
    tma: bool  # operands read by tensor descriptors (use_tma)
    BM: int  # dense_config(tma): BLOCK_M, BLOCK_DO, BLOCK_K, num_warps, num_stages of the GEMMs
    BDO: int
    BK: int
    warps: int
    stages: int
    BR: int  # add_dc_targets' BLOCK_R
    split: bool  # add_dc_targets' SPLIT_DOT
    prec: str  # tl.dot's input precision of the operands


class _TmaOperands(NamedTuple):
    """Hopper: the buffer and tensor descriptors of one row block's launches (_tma_operands)."""

    C_slab: torch.Tensor  # [width_max, D] a dense slab's classes, gathered by its launches
    e_dz: object  # the block's sorted rows E_s in the dZ launch's tiles
    c_dz: object  # C_slab in the dZ launch's tiles
    de_d: tuple  # (DZ, C_slab) in the dE GEMM's tiles
    dc_d: tuple  # (DZ, E_s) in the dC GEMM's tiles


def _slab_launch(e2d: torch.Tensor, c: torch.Tensor) -> _SlabLaunch:
    """The _SlabLaunch of DenseSlabRun's operands; ValueError where dC's class blocks do not
    divide the vocabulary tiles."""
    cfg = config(e2d.dtype, "fwd")
    BV = cfg.BLOCK_V
    tma = use_tma(e2d, c)
    BM, BDO, BK, warps, stages = dense_config(tma)
    BR = 16 if interpreting() else 32
    split = split_dot(e2d.device)
    if BV % BM:
        raise ValueError(f"the dC tiles ({BM} classes) must divide the vocabulary tiles ({BV})")
    return _SlabLaunch(cfg, tma, BM, BDO, BK, warps, stages, BR, split, precision(e2d.dtype))


def _slab_dz_buffer(
    e2d: torch.Tensor, alpha: torch.Tensor, dz_bound: torch.Tensor | None, R: int, width_max: int
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(DZ, scale, inv): the slabs' dZ buffer [R, width_max] (a row block's) in the operand dtype,
    and with fp16 operands dZ's scale (fp32 [1]: max |alpha| over all rows, or of ``dz_bound``)
    and its inverse, else None."""
    # (Not zeroed: a dense slab's launches write every entry its GEMMs read, and a memset of
    # both buffers on every step costs ~0.1 ms at N = 8192 whether a slab is dense or not.)
    DZ = torch.empty((R, width_max), dtype=e2d.dtype, device=e2d.device)
    scale = inv = None
    if e2d.dtype == torch.float16:
        scale = (alpha.abs() if dz_bound is None else dz_bound).amax().clamp(min=1e-30).reshape(1)
        inv = (1.0 / scale).contiguous()
    return DZ, scale, inv


def _tma_operands(
    E_s: torch.Tensor, C_slab: torch.Tensor, DZ: torch.Tensor, launch: _SlabLaunch
) -> _TmaOperands:
    """The _TmaOperands of one row block on Hopper (``launch.tma``): E_s its sorted rows, DZ its
    rows of the dZ buffer."""
    cfg, BM, BDO, BK = launch.cfg, launch.BM, launch.BDO, launch.BK
    BN, BV = cfg.BLOCK_N, cfg.BLOCK_V
    # Hopper: every operand by tensor descriptors, the block's sorted rows gathered once and a
    # dense slab's classes into C_slab (a gated copy, zeros past V up to the tile's end). The
    # descriptors span the whole buffers (zeros past the block's rows); the GEMMs read the last
    # slab's buffers only up to its last tile's end (nt * BV rows of C_slab, columns of dZ),
    # which its launches write.
    TD = tensor_descriptor()
    e_dz = TD.from_tensor(E_s, [BN, cfg.BLOCK_D])
    e_dc = TD.from_tensor(E_s, [BK, BDO])
    dz_de = TD.from_tensor(DZ, [BM, BK])
    dz_dc = TD.from_tensor(DZ, [BK, BM])
    c_dz, c_de = TD.from_tensor(C_slab, [BV, cfg.BLOCK_D]), TD.from_tensor(C_slab, [BK, BDO])
    return _TmaOperands(C_slab, e_dz, c_dz, (dz_de, c_de), (dz_dc, e_dc))


def _launch_slab_dz(
    e2d: torch.Tensor, c: torch.Tensor, bias: torch.Tensor | None, rows: tuple, perm: torch.Tensor,
    n_valid: torch.Tensor, dense: torch.Tensor, DZ: torch.Tensor, inv: torch.Tensor | None, softcap: float,
    temperature: float, launch: _SlabLaunch, s: int, t0: int, nt: int, row0: int,
) -> None:  # fmt: skip
    """Launches _slab_dz_kernel: slab s's dZ (its ``nt`` tiles from tile ``t0`` of the sorted
    vocabulary) into DZ for the row block from sorted row ``row0`` (``rows``: its erow, tgt, lse,
    alpha, eta), the operands read by pointers; returns nothing."""
    erow, tgt, lse, alpha, eta = rows
    N = erow.numel()
    V, D = c.shape
    cfg, prec = launch.cfg, launch.prec
    BN, BV = cfg.BLOCK_N, cfg.BLOCK_V
    _slab_dz_kernel[(triton.cdiv(N, BN), nt)](
        E=e2d, C=c, Bias=bias, Erow=erow, Tgt=tgt, Perm=perm, NValid=n_valid, Lse=lse,
        Alpha=alpha, Eta=eta, Dense=dense, DZ=DZ, Inv=inv, N=N, V=V, D=D, stride_e=e2d.stride(0),
        stride_c=c.stride(0), stride_dz=DZ.stride(0), slab=s, tile0=t0, row0=row0, softcap=float(softcap),
        HAS_SOFTCAP=softcap > 0, inv_temp=1.0 / temperature, HAS_TEMP=temperature != 1.0,
        BLOCK_N=BN, BLOCK_V=BV, BLOCK_D=cfg.BLOCK_D, PRECISION=prec,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip


def _launch_slab_dz_tma(
    c: torch.Tensor, bias: torch.Tensor | None, rows: tuple, perm: torch.Tensor, n_valid: torch.Tensor,
    dense: torch.Tensor, DZ: torch.Tensor, inv: torch.Tensor | None, softcap: float, temperature: float,
    launch: _SlabLaunch, tma_ops: _TmaOperands, s: int, v0: int, width: int, nt: int, row0: int,
) -> None:  # fmt: skip
    """Launches _gather_slab_kernel and _slab_dz_tma_kernel (Hopper): slab s's classes (``width``
    sorted positions from ``v0``, ``nt`` tiles) into tma_ops.C_slab, then its dZ into DZ from the
    descriptors, for the row block from sorted row ``row0`` (``rows`` as _launch_slab_dz's);
    returns nothing."""
    _erow, tgt, lse, alpha, eta = rows
    N = DZ.shape[0]
    V, D = c.shape
    cfg, prec = launch.cfg, launch.prec
    BN, BV = cfg.BLOCK_N, cfg.BLOCK_V
    C_slab, e_dz, c_dz = tma_ops.C_slab, tma_ops.e_dz, tma_ops.c_dz
    GK = 64  # classes per program of the gather
    _gather_slab_kernel[(triton.cdiv(nt * BV, GK),)](
        C=c, Perm=perm[v0:], Dense=dense, Out=C_slab, D=D, stride_c=c.stride(0),
        stride_o=C_slab.stride(0), slab=s, width=width, rows=nt * BV, BLOCK_K=GK, BLOCK_DO=128,
        num_warps=4,
    )  # fmt: skip
    _slab_dz_tma_kernel[(triton.cdiv(N, BN), nt)](
        Ed=e_dz, Cd=c_dz, Bias=bias, Tgt=tgt, Perm=perm, NValid=n_valid, Lse=lse, Alpha=alpha,
        Eta=eta, Dense=dense, DZ=DZ, Inv=inv, N=N, V=V, D=D, stride_dz=DZ.stride(0), slab=s,
        v0=v0, row0=row0, softcap=float(softcap), HAS_SOFTCAP=softcap > 0, inv_temp=1.0 / temperature,
        HAS_TEMP=temperature != 1.0, BLOCK_N=BN, BLOCK_V=BV,
        BLOCK_D=cfg.BLOCK_D, PRECISION=prec, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip


def _launch_slab_grads(
    e2d: torch.Tensor, c: torch.Tensor, erow: torch.Tensor, perm: torch.Tensor, n_valid: torch.Tensor,
    dense: torch.Tensor, DZ: torch.Tensor, scale: torch.Tensor | None, de_acc: torch.Tensor | None,
    acc: _DcAccumulation, targets: tuple | None, weight: torch.Tensor | None, ge: torch.Tensor | None,
    launch: _SlabLaunch, de_d: tuple, dc_d: tuple, s: int, v0: int, width: int, row0: int,
) -> None:  # fmt: skip
    """Launches _slab_grads_kernel: slab s's dE (``width`` sorted positions from ``v0``) over the
    row block from sorted row ``row0`` (``erow``: its rows) added to de_acc and its classes' dC
    rows written or added to (``acc``), with the target (and smoothing) terms of ``targets`` =
    (seg, trow, tpos, tcoef) in the first block; ``de_d``, ``dc_d``: the GEMMs' descriptors
    (Hopper) or (None, None). Returns nothing."""
    N = erow.numel()
    D = c.shape[1]
    cfg, tma, BM, BDO, BK, warps, stages, BR, split, prec = launch
    BV = cfg.BLOCK_V
    dC = acc.dC
    seg, trow, tpos, tcoef = targets if targets is not None else (None,) * 4
    de_blocks = triton.cdiv(N, BM) if de_acc is not None else 0
    dc_blocks = triton.cdiv(width, BM) if dC is not None else 0
    _slab_grads_kernel[(de_blocks + dc_blocks, triton.cdiv(D, BDO))](
        DZ=DZ, C=c, E=e2d, Erow=erow, Perm=perm, NValid=n_valid, Dense=dense, Scale=scale,
        DEAcc=de_acc, dC=dC, Acc16=None if acc.S16 is None else dC.view(torch.float16), S16=acc.S16,
        DZd=de_d[0], Cd=de_d[1], DZtd=dc_d[0], Ed=dc_d[1], Seg=seg, TRow=trow,
        TPos=tpos, TCoef=tcoef, W=weight, GE=ge, N=N, D=D, stride_dz=DZ.stride(0), stride_c=c.stride(0),
        stride_e=e2d.stride(0), stride_de=0 if de_acc is None else de_acc.stride(0),
        stride_dc=0 if dC is None else dC.stride(0), slab=s, v0=v0, width=width,
        de_blocks=de_blocks, row0=row0, FIRST=acc.first, LAST=acc.last, USE_TMA=tma, BLOCK_M=BM,
        BLOCK_DO=BDO, BLOCK_K=BK, BLOCK_V=BV, BLOCK_R=BR, SPLIT_DOT=split, PRECISION=prec, num_warps=warps,
        num_stages=stages,
    )  # fmt: skip


@cached_launch
@triton.jit
def _slab_products_kernel(
    W,  # [R, >= V] per-class weights of R rows (fp32, or C's bf16), in the sorted order (position p)
    C, Perm,  # [V, D] classifier, [V] class at each sorted position
    Out,  # [n_parts, R, D] fp32
    R, V, D, stride_w, stride_c, width,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_DO: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Out[s, r, D chunk] = sum over the positions p of part s ([s width, (s + 1) width) of the
    sorted vocabulary; ``width`` is a part's, slab_products adds a slab's parts) of W[r, p]
    C[perm[p], D chunk], for the rows r of block program_id(2): a few rows' weighted class sums
    (slab_choice.slab_errors), C read once per row block. A part's D chunks run at consecutive
    program ids (program_id(0)): together they read its weights once from HBM (then from L2)
    and its classes' rows of C whole."""
    s = tl.program_id(1)
    offs_r = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = offs_r < R
    offs_do = tl.program_id(0) * BLOCK_DO + tl.arange(0, BLOCK_DO)
    dmask = offs_do < D
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_R, BLOCK_DO), dtype=tl.float32)
    p0 = s * width
    for k0 in range(0, width, BLOCK_K):
        p = p0 + k0 + offs_k
        pm = (p < V) & (k0 + offs_k < width)
        vid = tl.load(Perm + p, mask=pm, other=0).to(tl.int64)
        w = tl.load(W + offs_r[:, None] * stride_w + p[None, :], mask=rmask[:, None] & pm[None, :], other=0.0)
        cc = tl.load(
            C + vid[:, None] * stride_c + offs_do[None, :], mask=pm[:, None] & dmask[None, :], other=0.0
        ).to(W.dtype.element_ty)  # [BLOCK_K, BLOCK_DO]
        acc = tl.dot(w, cc, acc, input_precision=PRECISION)  # [BLOCK_R, BLOCK_DO]
    out = Out + (s * R + offs_r).to(tl.int64)[:, None] * D + offs_do[None, :]
    tl.store(out, acc, mask=rmask[:, None] & dmask[None, :])


# slab_products' programs per SM at least: a slab is split into parts of as few positions as
# that takes (not below SLAB_PRODUCTS_MIN_PART), their sums added after the kernel. At few
# tokens a slab holds up to 64k positions and there are few slabs: one program per slab and D
# chunk left most SMs idle, each streaming its slab's rows of C alone (H100, V = 256000, D =
# 2304, 32 rows: 1.13 ms whole, 0.53 ms in parts of 8192). Rows go in blocks of at most
# SLAB_PRODUCTS_ROWS, C read once per block: with 16-bit weights one block holds the error
# estimates' 64 to 96 rows (H200, V = 128256, D = 4096: 96 rows in two blocks of fp32 weights and
# tf32 products 0.99 ms, in one block of bf16 weights 0.54 ms; fp32 weights spilled registers
# at 64 rows per block).
SLAB_PRODUCTS_PROGRAMS_PER_SM = 8
SLAB_PRODUCTS_MIN_PART = 2048
SLAB_PRODUCTS_ROWS = 128
SLAB_PRODUCTS_ROWS_FP32 = 32


def slab_products(w: torch.Tensor, c: torch.Tensor, perm: torch.Tensor, width: int) -> torch.Tensor:
    """fp32 [n_slabs, R, D]: for each slab of ``width`` sorted positions, ``w`` (fp32 [R, >= V],
    sorted positions) restricted to the slab times the slab's classes ``c[perm[...]]`` (with a
    bf16 ``c`` on the GPU, ``w`` rounded to bf16: an estimate's accuracy)."""
    R = w.shape[0]
    V, D = c.shape
    n_slabs = triton.cdiv(V, width)
    if R == 0 or V == 0 or D == 0:
        return torch.zeros((n_slabs, R, D), dtype=torch.float32, device=c.device)
    small = interpreting()
    # bf16 classifier on the GPU: the weights (formed in fp32) rounded to bf16, an estimate's
    # accuracy (at most 2^-8 of each weight against tf32's 2^-11; the steps' gradient errors
    # measured the same to three digits, docs/benchmarks.md), products in bf16; else fp32
    # weights, tf32 products.
    half = c.dtype == torch.bfloat16 and c.is_cuda and not small
    if half:
        w = w.to(c.dtype)
    BR = min(max(16, triton.next_power_of_2(R)), SLAB_PRODUCTS_ROWS if half else SLAB_PRODUCTS_ROWS_FP32)
    BK, BDO = (16, 32) if small else (64, 128)
    d_chunks, r_blocks = triton.cdiv(D, BDO), triton.cdiv(R, BR)
    # Parts of a slab: halved while the programs are too few (a part stays a multiple of BK).
    part, parts = width, 1
    target = SLAB_PRODUCTS_PROGRAMS_PER_SM * num_sms(c.device)
    while (
        triton.cdiv(V, part) * d_chunks * r_blocks < target
        and part % (2 * BK) == 0
        and part // 2 >= SLAB_PRODUCTS_MIN_PART
    ):
        part, parts = part // 2, parts * 2
    n_parts = triton.cdiv(V, part)
    out = torch.empty((n_slabs * parts, R, D), dtype=torch.float32, device=c.device)
    if n_parts < n_slabs * parts:  # the last slab's parts past V: no positions
        out[n_parts:].zero_()
    # fp32 weights: tf32 products on a GPU, an estimate's accuracy (the weights are formed in fp32).
    prec = "ieee" if small or not c.is_cuda else "tf32"
    with device_context(c.device):
        _slab_products_kernel[(d_chunks, n_parts, r_blocks)](
            W=w, C=c, Perm=perm, Out=out, R=R, V=V, D=D, stride_w=w.stride(0), stride_c=c.stride(0),
            width=part, BLOCK_R=BR, BLOCK_K=BK, BLOCK_DO=BDO, PRECISION=prec, num_warps=8 if BR > 64 else 4,
        )  # fmt: skip
    if parts == 1:
        return out
    return out.view(n_slabs, parts, R, D).sum(1)
