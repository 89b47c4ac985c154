"""The recomputing backward: every (token block, vocabulary tile) recomputes its logits, forms
dZ and adds its products to fp32 gradient buffers with atomics; with a filter threshold a tile
whose probabilities are all below it leaves its row and column sums for rank-1 corrections.

It serves the filtered steps that the sparse backward does not (a bias gradient, smoothing under
softcap, thresholds below the sparse one's range, the vocabulary-parallel path); the host-side
corrections are in cce/ops/linear_ce/triton_backward.py. The maths of dZ: dz.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ...launch import cached_launch
from .common import add_target_lo, check_inputs, config, device_context, logit_tile, precision
from .dz import dense_dz


@cached_launch
@triton.heuristics(
    {
        "HAS_BIAS": lambda a: a["Bias"] is not None,
        "HAS_WEIGHT": lambda a: a["W"] is not None,
        "FOLD_SMOOTH": lambda a: a["Gamma"] is not None,
        "SORTED": lambda a: a["Perm"] is not None,
        "NEED_DE": lambda a: a["dE"] is not None,
        "NEED_DC": lambda a: a["dC"] is not None,
        "NEED_DBIAS": lambda a: a["dBias"] is not None,
        "TARGET_LO": lambda a: a["TLo"] is not None,
    }
)
@triton.jit
def _bwd_kernel(
    E,  # [*, D] hidden states (rows through Erow)
    C,  # [V, D] classifier
    Bias,  # [V] or None
    W,  # [V] class weights or None (read only with FOLD_SMOOTH)
    Erow,  # [N] e2d row of each sorted position
    Tgt,  # [N] targets of the sorted rows
    Perm,  # [V] vocabulary ids in walking order, or None (id order)
    NValid,  # [1] int32
    Lse, Alpha, Beta,  # [N] fp32 per sorted row
    Gamma,  # [N] fp32: the smoothing term folded into dZ (softcap on), or None
    dE,  # [*, D] fp32 (e2d's rows), or None
    dC,  # [V, D] fp32, or None
    dBias,  # [V] fp32, or None
    R,  # [N, n_vtiles] fp32: skipped tiles' row sums (FILTER and dE), else None
    CSK,  # [n_blocks, V] fp32: skipped tiles' column sums (FILTER and dC), else None
    TLo,  # [N] fp32: target entries' rounding remainders (16-bit operands), or None
    V, D, stride_e, stride_c, stride_de, stride_dc, n_vtiles, softcap, inv_temp, eps,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_TEMP: tl.constexpr, FOLD_SMOOTH: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    SORTED: tl.constexpr, FILTER: tl.constexpr, SCALE_DZ: tl.constexpr, TARGET_LO: tl.constexpr,
    NEED_DE: tl.constexpr, NEED_DC: tl.constexpr, NEED_DBIAS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """One (token block, vocabulary tile): recompute the logits, form dZ (dz.dense_dz) and add
    dZ @ C to dE, dZ^T @ E to dC (fp32 atomics), colsum(dZ) to dbias.

    Without softcap the smoothing term -gamma w is rank-1 and added exactly outside. With FILTER,
    a tile whose probabilities are all < eps and that holds no row's target skips both gradient
    matmuls and writes rowsum(dZ) to R[row, tile] and colsum(dZ) to CSK[block, id] instead, for
    the rank-1 corrections (rowsum x mean C_tile, colsum x mean E_block) outside.
    """
    pid_n = tl.program_id(0)
    pid_v = tl.program_id(1)
    n_valid = tl.load(NValid)
    start = pid_n * BLOCK_N
    if start >= n_valid:
        return
    offs_n = start + tl.arange(0, BLOCK_N)
    row_mask = offs_n < n_valid
    erow = tl.load(Erow + offs_n, mask=row_mask, other=0).to(tl.int64)
    offs_p = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)  # positions in the (sorted) vocabulary
    col_mask = offs_p < V
    if SORTED:
        vid = tl.load(Perm + offs_p, mask=col_mask, other=0).to(tl.int64)
    else:
        vid = offs_p.to(tl.int64)
    L = logit_tile(
        E, C, erow, vid, row_mask, col_mask, D, stride_e, stride_c, BLOCK_N, BLOCK_V, BLOCK_D, PRECISION
    )  # [BLOCK_N, BLOCK_V]
    if HAS_BIAS:
        b = tl.load(Bias + vid, mask=col_mask, other=0.0).to(tl.float32)
        L += b[None, :]
    lse = tl.load(Lse + offs_n, mask=row_mask, other=0.0)
    alpha = tl.load(Alpha + offs_n, mask=row_mask, other=0.0)
    beta = tl.load(Beta + offs_n, mask=row_mask, other=0.0)
    tgt = tl.load(Tgt + offs_n, mask=row_mask, other=-1)
    is_t = (vid[None, :] == tgt[:, None]) & row_mask[:, None] & col_mask[None, :]
    dz, p = dense_dz(
        L, lse, alpha, beta, Gamma, W, None, offs_n, vid, is_t, row_mask, col_mask, softcap, inv_temp,
        HAS_SOFTCAP, FOLD_SMOOTH, HAS_WEIGHT, HAS_TEMP, False,
    )  # fmt: skip
    if NEED_DBIAS:
        tl.atomic_add(dBias + vid, tl.sum(dz, axis=0), mask=col_mask, sem="relaxed")
    if FILTER:
        has_t = tl.max(tl.max(is_t.to(tl.int32), axis=1), axis=0) > 0
        skip = (tl.max(tl.max(p, axis=1), axis=0) < eps) & (not has_t)
        if skip:
            if NEED_DE:
                tl.store(R + offs_n.to(tl.int64) * n_vtiles + pid_v, tl.sum(dz, axis=1), mask=row_mask)
            if NEED_DC:
                tl.store(CSK + pid_n.to(tl.int64) * V + vid, tl.sum(dz, axis=0), mask=col_mask)
            return
    if SCALE_DZ:
        # fp16 operands: the tile is scaled to max |dZ| = 1 before rounding, the products back.
        scale = tl.max(tl.max(tl.abs(dz), axis=1), axis=0)
        scale = tl.where(scale > 0, scale, 1.0)
        dzc = (dz / scale).to(E.dtype.element_ty)
    else:
        scale = 1.0
        dzc = dz.to(E.dtype.element_ty)
    if TARGET_LO:
        lo = tl.sum(tl.where(is_t, dz - dzc.to(tl.float32) * scale, 0.0), axis=1)
        row_t = tl.max(is_t.to(tl.int32), axis=1) > 0
        tl.store(TLo + offs_n, lo, mask=row_mask & row_t)
    offs_d = tl.arange(0, BLOCK_D)
    for d0 in range(0, D, BLOCK_D):
        dm = (d0 + offs_d) < D
        if NEED_DE:
            c = tl.load(
                C + vid[:, None] * stride_c + (d0 + offs_d)[None, :],
                mask=col_mask[:, None] & dm[None, :],
                other=0.0,
            )
            g = tl.dot(dzc, c, input_precision=PRECISION) * scale  # [BLOCK_N, BLOCK_D]
            tl.atomic_add(
                dE + erow[:, None] * stride_de + (d0 + offs_d)[None, :], g,
                mask=row_mask[:, None] & dm[None, :], sem="relaxed",
            )  # fmt: skip
        if NEED_DC:
            e = tl.load(
                E + erow[:, None] * stride_e + (d0 + offs_d)[None, :],
                mask=row_mask[:, None] & dm[None, :],
                other=0.0,
            )
            g = tl.dot(tl.trans(dzc), e, input_precision=PRECISION) * scale  # [BLOCK_V, BLOCK_D]
            tl.atomic_add(
                dC + vid[:, None] * stride_dc + (d0 + offs_d)[None, :], g,
                mask=col_mask[:, None] & dm[None, :], sem="relaxed",
            )  # fmt: skip


@dataclass
class RecomputeOut:
    """fp32 accumulators; R / CSK hold the skipped tiles' row / column sums (None unfiltered)."""

    dE: torch.Tensor | None
    dC: torch.Tensor | None
    dbias: torch.Tensor | None
    R: torch.Tensor | None  # [N, n_vtiles] per sorted row
    CSK: torch.Tensor | None  # [n_blocks, V] per vocabulary id
    BLOCK_N: int
    BLOCK_V: int


def linear_ce_backward_recompute(
    e2d: torch.Tensor,
    c: torch.Tensor,
    bias: torch.Tensor | None,
    weight: torch.Tensor | None,
    erow: torch.Tensor,
    tgt: torch.Tensor,
    n_valid: torch.Tensor,
    lse: torch.Tensor,
    alpha: torch.Tensor,
    beta: torch.Tensor,
    gamma: torch.Tensor | None,
    perm: torch.Tensor | None,
    softcap: float,
    eps: float,
    need_de: bool,
    need_dc: bool,
    need_dbias: bool,
    temperature: float = 1.0,
) -> RecomputeOut:
    """Gradients of the sorted rows ``e2d[erow]`` (tgt, lse, alpha, beta, gamma per sorted row).

    ``gamma`` given means the smoothing term is folded into the tiles (softcap on); ``perm``
    (vocabulary ids in walking order) given means the tiles are walked in that order.
    ``temperature``: the logits are softcap(x) / T, the coefficients carry its 1 / T; the filter
    compares the tempered probabilities with ``eps``.
    """
    check_inputs(e2d, c, bias, weight, erow, tgt, n_valid, lse, alpha, beta, gamma, perm)
    N = erow.numel()
    V, D = c.shape
    dev = e2d.device
    cfg = config(e2d.dtype, "bwd")
    n_blocks = triton.cdiv(N, cfg.BLOCK_N)
    n_vtiles = triton.cdiv(V, cfg.BLOCK_V)
    f32 = torch.float32
    filt = eps > 0
    dE = torch.zeros(e2d.shape, dtype=f32, device=dev) if need_de else None
    dC = torch.zeros(c.shape, dtype=f32, device=dev) if need_dc else None
    db = torch.zeros(V, dtype=f32, device=dev) if need_dbias else None
    R = torch.zeros((N, n_vtiles), dtype=f32, device=dev) if (filt and need_de) else None
    CSK = torch.zeros((n_blocks, V), dtype=f32, device=dev) if (filt and need_dc) else None
    lo = None
    if e2d.dtype != f32 and (need_de or need_dc):
        lo = torch.zeros(N, dtype=f32, device=dev)
    if N > 0 and (need_de or need_dc or need_dbias):
        with device_context(dev):
            _bwd_kernel[(n_blocks, n_vtiles)](
                E=e2d, C=c, Bias=bias, W=weight, Erow=erow, Tgt=tgt, Perm=perm, NValid=n_valid,
                Lse=lse, Alpha=alpha, Beta=beta, Gamma=gamma, dE=dE, dC=dC, dBias=db, R=R, CSK=CSK,
                TLo=lo, V=V, D=D, stride_e=e2d.stride(0), stride_c=c.stride(0), stride_de=D,
                stride_dc=D, n_vtiles=n_vtiles, softcap=float(softcap), eps=float(eps),
                inv_temp=1.0 / temperature, HAS_TEMP=temperature != 1.0, HAS_SOFTCAP=softcap > 0,
                FILTER=filt, SCALE_DZ=e2d.dtype == torch.float16,
                BLOCK_N=cfg.BLOCK_N, BLOCK_V=cfg.BLOCK_V, BLOCK_D=cfg.BLOCK_D,
                PRECISION=precision(e2d.dtype), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            )  # fmt: skip
    if lo is not None and N > 0:
        add_target_lo(e2d, c, erow, tgt, lo, dE, dC)
    return RecomputeOut(dE, dC, db, R, CSK, cfg.BLOCK_N, cfg.BLOCK_V)
