"""The exact backward (filter_eps 0): dZ formed slab by slab of the vocabulary, the gradient
products by cuBLAS.

The sorted rows are taken in blocks (exact_block_rows: the block's fp32 dE rows and gathered E
rows within the slab budget, so the memory is flat in N; one block up to N D 6 bytes of it). In
a block, for each slab of vocabulary tiles a kernel stores dZ[:, slab] in the operand dtype (the
target term included, smoothing folded in when gamma is given; dz.py has the maths and the
rounding); cuBLAS then writes dC[slab] = dZ_slab^T @ E_block (fp32 accumulation inside the GEMM,
one rounding to c's dtype: no fp32 dC buffer; later blocks add to it, one rounding each) and
accumulates dE_block += dZ_slab @ C_slab in fp32, rounded once into dE's rows after the block's
last slab. Four matmul-sized passes: the forward, the dZ recompute, the two products.

On Hopper (common.use_tma) the slab kernel reads its tiles by tensor descriptors with the
forward's 128 x 256 tiles and one flat (tile, D chunk) loop; its epilogue has no per-entry
target or row work, the target entries being overwritten exactly by _dz_target_kernel. Elsewhere
a pointer-load kernel forms each tile with the target term in place.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ...._dispatch import num_sms
from ... import jit_math as jm
from ...launch import cached_launch
from .common import (
    KernelConfig,
    add_target_lo,
    aligned_parts,
    check_inputs,
    config,
    device_context,
    finish_logits,
    logit_tile,
    precision,
    slab_products,
    slab_tiles,
    target_logits,
    tensor_descriptor,
    tma_rows_ok,
    use_tma,
)
from .dz import dense_dz, round_dz, store_dz
from .forward import FWD_PROGRAMS_PER_SM_TMA


@cached_launch
@triton.heuristics(
    {
        "HAS_BIAS": lambda a: a["Bias"] is not None,
        "HAS_WEIGHT": lambda a: a["W"] is not None,
        "FOLD_SMOOTH": lambda a: a["Gamma"] is not None,
        "SCALE_DZ": lambda a: a["InvScale"] is not None,
        "HAS_ETA": lambda a: a["Eta"] is not None,
    }
)
@triton.jit
def _dz_slab_tma_kernel(
    E,  # descriptor of the gathered rows [N, D] (row i = sorted row i)
    C,  # descriptor of c [V, D]
    Bias, W,  # [V] or None
    NValid,  # [1] int32
    Lse, Alpha,  # [N] fp32 per sorted row
    Gamma,  # [N] fp32 smoothing coefficient folded into dZ, or None
    Eta,  # [N] fp32 the entropy's coefficient (eta p z), or None
    DZ,  # [N, slab] operand dtype; column 0 is tile0's first class
    InvScale,  # [1] fp32 1 / max |alpha| (fp16), or None
    N, V, D, stride_dz, tile0, tile_hi, n_splits, softcap, inv_temp,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, FOLD_SMOOTH: tl.constexpr, HAS_WEIGHT: tl.constexpr,
    SCALE_DZ: tl.constexpr, HAS_TEMP: tl.constexpr, HAS_ETA: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """The dZ slab by tensor descriptors: each program walks its balanced share of the slab's
    tiles [tile0, tile_hi) for one token block in one flat (tile, D chunk) loop, as the forward
    kernel does. It stores (alpha p [- gamma w]) softcap'; _dz_target_kernel then overwrites the
    target entries. Rows past n_valid get p = 0 through lse = +inf (and alpha = 0); columns past
    V are stored as 0 (the slab buffer holds whole tiles; the products read the first V).
    """
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    n_valid = tl.load(NValid)
    start = pid_n * BLOCK_N
    if start >= n_valid:
        return  # rows past n_valid stay as zeroed by the launcher
    offs_n = start + tl.arange(0, BLOCK_N)
    row_mask = offs_n < n_valid
    lse = tl.load(Lse + offs_n, mask=row_mask, other=float("inf"))
    alpha = tl.load(Alpha + offs_n, mask=row_mask, other=0.0)
    if SCALE_DZ:
        # fp16: one global scale (1 / max |alpha|) keeps alpha p above fp16's normal range.
        alpha = alpha * tl.load(InvScale)
    if FOLD_SMOOTH:
        gamma = tl.load(Gamma + offs_n, mask=row_mask, other=0.0)
        if SCALE_DZ:
            gamma = gamma * tl.load(InvScale)
    if HAS_ETA:
        eta = tl.load(Eta + offs_n, mask=row_mask, other=0.0)
        if SCALE_DZ:
            eta = eta * tl.load(InvScale)
    t0 = tile0 + (pid_s * (tile_hi - tile0)) // n_splits
    t1 = tile0 + ((pid_s + 1) * (tile_hi - tile0)) // n_splits
    k_tiles = tl.cdiv(D, BLOCK_D)
    ki = -1
    tile = t0 - 1
    acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    row_ptr = DZ + offs_n.to(tl.int64)[:, None] * stride_dz  # [BLOCK_N, 1]
    for _ in range(0, (t1 - t0) * k_tiles):
        ki = tl.where(ki == k_tiles - 1, 0, ki + 1)
        if ki == 0:
            tile += 1
        a = E.load([start, ki * BLOCK_D])  # [BLOCK_N, BLOCK_D]
        b = C.load([tile * BLOCK_V, ki * BLOCK_D])  # [BLOCK_V, BLOCK_D]
        acc = tl.dot(a, b.T, acc, input_precision=PRECISION)
        if ki == k_tiles - 1:
            offs_p = tile * BLOCK_V + tl.arange(0, BLOCK_V)
            col_mask = offs_p < V
            L, th = finish_logits(
                acc, Bias, offs_p, col_mask, softcap, inv_temp, HAS_BIAS, HAS_SOFTCAP, HAS_TEMP
            )  # fmt: skip
            if HAS_ETA:
                p = jm.exp(L - lse[:, None])  # (L where p > 0: a -inf logit gets 0, not NaN)
                dz = p * (alpha[:, None] + eta[:, None] * tl.where(p > 0, L, 0.0))
            else:
                dz = alpha[:, None] * jm.exp(L - lse[:, None])  # [BLOCK_N, BLOCK_V]
            if FOLD_SMOOTH:
                if HAS_WEIGHT:
                    w = tl.load(W + offs_p, mask=col_mask, other=0.0).to(tl.float32)
                    dz -= gamma[:, None] * w[None, :]
                else:
                    dz -= gamma[:, None]
            if HAS_SOFTCAP:
                dz *= 1.0 - th * th
            dz_ptr = row_ptr + (offs_p - tile0 * BLOCK_V)[None, :]
            # The slab buffer holds whole tiles (stride_dz >= its tiles' columns): the columns
            # past V are written 0 rather than masked, which keeps the store vectorized at an odd V
            # (a mask at V made it one element per store); the products read the first V.
            dz = tl.where(col_mask[None, :], dz, 0.0)
            tl.store(dz_ptr, dz.to(DZ.dtype.element_ty), mask=(offs_n < N)[:, None])
            acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)


@cached_launch
@triton.heuristics(
    {
        "HAS_BIAS": lambda a: a["Bias"] is not None,
        "HAS_WEIGHT": lambda a: a["W"] is not None,
        "FOLD_SMOOTH": lambda a: a["Gamma"] is not None,
        "SCALE_DZ": lambda a: a["InvScale"] is not None,
        "TARGET_LO": lambda a: a["TLo"] is not None,
        "NEED_DBIAS": lambda a: a["dBias"] is not None,
        "HAS_ETA": lambda a: a["Eta"] is not None,
    }
)
@triton.jit
def _dz_slab_kernel(
    E, C,  # [*, D] hidden states (rows through Erow), [V, D] classifier
    Bias, W,  # [V] or None
    Erow, Tgt,  # [N] e2d row and target of each sorted position
    NValid,  # [1] int32
    Lse, Alpha, Beta,  # [N] fp32 per sorted row
    Gamma,  # [N] fp32 smoothing coefficient folded into dZ, or None
    Eta,  # [N] fp32 the entropy's coefficient (eta p z), or None
    DZ,  # [N, slab] operand dtype; column 0 is tile0's first class
    InvScale,  # [1] fp32 1 / max |alpha| (fp16), or None
    TLo,  # [N] fp32 target entries' rounding remainders, or None
    dBias,  # [V] fp32 (atomics), or None
    N, V, D, stride_e, stride_c, stride_dz, tile0, softcap, inv_temp,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, FOLD_SMOOTH: tl.constexpr, HAS_WEIGHT: tl.constexpr,
    SCALE_DZ: tl.constexpr, TARGET_LO: tl.constexpr, NEED_DBIAS: tl.constexpr, HAS_TEMP: tl.constexpr,
    HAS_ETA: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """The dZ slab by pointer loads, one (token block, tile) per program: the full dZ tile
    (dz.dense_dz, target term included) rounded and stored (dz.store_dz); colsum(dZ) to dbias.
    Rows past n_valid in a partly valid block are stored as zeros."""
    pid_n = tl.program_id(0)
    pid_v = tl.program_id(1) + tile0
    n_valid = tl.load(NValid)
    start = pid_n * BLOCK_N
    if start >= n_valid:
        return  # rows past n_valid stay as zeroed by the launcher
    offs_n = start + tl.arange(0, BLOCK_N)
    row_mask = offs_n < n_valid
    erow = tl.load(Erow + offs_n, mask=row_mask, other=0).to(tl.int64)
    offs_p = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    col_mask = offs_p < V
    vid = offs_p.to(tl.int64)
    L = logit_tile(
        E, C, erow, vid, row_mask, col_mask, D, stride_e, stride_c, BLOCK_N, BLOCK_V, BLOCK_D, PRECISION
    )  # [BLOCK_N, BLOCK_V]
    if HAS_BIAS:
        L += tl.load(Bias + vid, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    lse = tl.load(Lse + offs_n, mask=row_mask, other=0.0)
    alpha = tl.load(Alpha + offs_n, mask=row_mask, other=0.0)
    beta = tl.load(Beta + offs_n, mask=row_mask, other=0.0)
    tgt = tl.load(Tgt + offs_n, mask=row_mask, other=-1)
    is_t = (vid[None, :] == tgt[:, None]) & row_mask[:, None] & col_mask[None, :]
    dz, _p = dense_dz(
        L, lse, alpha, beta, Gamma, W, Eta, offs_n, vid, is_t, row_mask, col_mask, softcap, inv_temp,
        HAS_SOFTCAP, FOLD_SMOOTH, HAS_WEIGHT, HAS_TEMP, HAS_ETA,
    )  # fmt: skip
    if NEED_DBIAS:
        tl.atomic_add(dBias + vid, tl.sum(dz, axis=0), mask=col_mask, sem="relaxed")
    store_dz(
        dz, is_t, offs_n, row_mask, offs_p, col_mask, DZ, InvScale, TLo, N, stride_dz, tile0 * BLOCK_V,
        SCALE_DZ, TARGET_LO,
    )  # fmt: skip


@cached_launch
@triton.heuristics(
    {
        "HAS_WEIGHT": lambda a: a["W"] is not None,
        "FOLD_SMOOTH": lambda a: a["Gamma"] is not None,
        "SCALE_DZ": lambda a: a["InvScale"] is not None,
        "TARGET_LO": lambda a: a["TLo"] is not None,
        "HAS_ETA": lambda a: a["Eta"] is not None,
    }
)
@triton.jit
def _dz_target_kernel(
    Zt,  # [N] fp32 target logits (softcap and temperature applied) of the sorted rows
    Tgt, NValid, Lse, Alpha, Beta,  # per sorted row
    Gamma, W, Eta,  # smoothing coefficient and class weights, the entropy's coefficient, or None
    DZ, InvScale, TLo,  # as in _dz_slab_kernel
    v0, v1, stride_dz, softcap, inv_temp,
    HAS_SOFTCAP: tl.constexpr, FOLD_SMOOTH: tl.constexpr, HAS_WEIGHT: tl.constexpr,
    SCALE_DZ: tl.constexpr, TARGET_LO: tl.constexpr, HAS_ETA: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Overwrites the target entries of a dZ slab (classes [v0, v1)) with their exact value
    (alpha p_t - beta [- gamma w_t]) softcap'(z_t), p_t = exp(z_t - lse), from the target logits:
    the TMA slab kernel stored alpha p_t [- gamma w_t] there. TARGET_LO: that entry's rounding
    remainder to TLo."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    n_valid = tl.load(NValid)
    valid = offs < n_valid
    t = tl.load(Tgt + offs, mask=valid, other=-1).to(tl.int64)
    m = valid & (t >= v0) & (t < v1)
    zt = tl.load(Zt + offs, mask=m, other=0.0)
    lse = tl.load(Lse + offs, mask=m, other=0.0)
    alpha = tl.load(Alpha + offs, mask=m, other=0.0)
    beta = tl.load(Beta + offs, mask=m, other=0.0)
    if HAS_ETA:
        alpha += tl.load(Eta + offs, mask=m, other=0.0) * zt
    v = alpha * tl.exp(zt - lse) - beta
    if FOLD_SMOOTH:
        gamma = tl.load(Gamma + offs, mask=m, other=0.0)
        if HAS_WEIGHT:
            gamma *= tl.load(W + t, mask=m, other=0.0).to(tl.float32)
        v -= gamma
    if HAS_SOFTCAP:
        r = zt / (softcap * inv_temp)  # tanh of the capped logit (zt carries the temperature)
        v *= 1.0 - r * r
    vr, back, _inv = round_dz(v, DZ, InvScale, SCALE_DZ)
    tl.store(DZ + offs.to(tl.int64) * stride_dz + (t - v0), vr, mask=m)
    if TARGET_LO:
        tl.store(TLo + offs, v - back, mask=m)


def fp16_dz_bound(alpha, eta, lse, entropy) -> torch.Tensor:
    """Per row, a bound of max_v |dZ_v| / softcap' = max_v p_v |alpha + eta z_v|: fp16 operands
    store dZ times 1 / (its max over rows), so that alpha p (alpha ~ 1 / N for a "mean") stays
    above fp16's normal range while nothing overflows. With the entropy's term, writing
    E_p[z] = lse - H: p_v |alpha + eta z_v| <= |alpha + eta E_p[z]| + |eta| p_v |z_v - E_p[z]|
    and p_v |z_v - E_p[z]| = p_v |log p_v + H| <= 1 / e + H. (|alpha| alone, the bound without
    eta, can fall far below it: alpha = delta E_p[z] for a gradient on the entropy alone, near 0
    for symmetric logits.) Loose where eta dominates and the logits are tiny: dZ then sits in
    fp16's subnormal range (absolute error 2^-25 of the scale)."""
    if eta is None:
        return alpha.abs()
    return (alpha + eta * (lse - entropy)).abs() + eta.abs() * (entropy + 1 / math.e)


@dataclass
class ExactOut:
    """dE (e2d's dtype and rows, every problem row written: 0 where ignored), dC (c.dtype),
    dbias (fp32); None where not needed."""

    dE: torch.Tensor | None
    dC: torch.Tensor | None
    dbias: torch.Tensor | None


# Row blocks of the exact backward: at most this many where dC is 16-bit, since each block past
# the first adds its fp32 product to the stored dC with one rounding (a bf16 dC summed that way
# over eight row chunks measured up to 3.6e-3 against fp32 gradients, sixteen 4.7e-3:
# cce/_dispatch.py, FUSED_DIRECT_CHUNKS). Past that the blocks grow with N instead.
EXACT_MAX_ROW_BLOCKS = 8


def exact_block_rows(N: int, D: int, e_bytes: int, need_de: bool, e_rows: bool, dc_16bit: bool,
                     budget: int, BLOCK_N: int) -> int:  # fmt: skip
    """Sorted rows per block of linear_ce_backward_exact: a multiple of BLOCK_N whose fp32 dE rows
    and gathered E rows (``e_rows``) fit ``budget`` bytes, at least BLOCK_N; balanced over the
    blocks; at most EXACT_MAX_ROW_BLOCKS blocks with a 16-bit dC."""
    per_row = D * (4 * need_de + e_bytes * e_rows)
    fit = max(BLOCK_N, budget // max(per_row, 1) // BLOCK_N * BLOCK_N)
    k = -(-max(N, 1) // fit)
    if dc_16bit:
        k = min(k, EXACT_MAX_ROW_BLOCKS)
    per_block = -(-max(N, 1) // k)
    return -(-per_block // BLOCK_N) * BLOCK_N


def linear_ce_backward_exact(
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
    softcap: float,
    need_de: bool,
    need_dc: bool,
    need_dbias: bool,
    slab_bytes: int,
    tma: bool | None = None,
    eta: torch.Tensor | None = None,
    temperature: float = 1.0,
    entropy: torch.Tensor | None = None,
    erow_is_permutation: bool = False,
) -> ExactOut:
    """Exact gradients of the sorted rows ``e2d[erow]`` (tgt, lse, alpha, beta, gamma per sorted
    row; ``gamma`` given folds the smoothing term into dZ) through dZ slabs of at most
    ``slab_bytes``, row block by row block (exact_block_rows: each block's fp32 dE rows and
    gathered E rows within ``slab_bytes`` too). dE comes in e2d's rows and dtype, rounded once
    per row; e2d rows no sorted row reads are 0 unless ``erow_is_permutation`` (then none is
    left out). Extra memory: the slab and one block's buffers, flat in N up to
    EXACT_MAX_ROW_BLOCKS blocks.

    ``tma`` (default: common.use_tma, without a bias gradient) forms the slabs by the
    tensor-descriptor kernel. ``eta`` (per sorted row, with the rows' ``entropy``) adds the
    entropy's term eta p z to dZ; ``temperature`` divides the logits after the softcap (the
    coefficients carry its factor 1 / T already, cce/_math.py).
    """
    check_inputs(e2d, c, bias, weight, erow, tgt, n_valid, lse, alpha, beta, gamma, eta, entropy)
    if (eta is None) != (entropy is None):
        raise ValueError("eta and entropy go together")
    N = erow.numel()
    V, D = c.shape
    dev = e2d.device
    grads = (need_de, need_dc, need_dbias)
    tma, cfg, R, n_slab, max_splits = _exact_geometry(e2d, c, N, grads, slab_bytes, tma)
    make = torch.empty if erow_is_permutation and N == e2d.shape[0] else torch.zeros
    dE = make(e2d.shape, dtype=e2d.dtype, device=dev) if need_de else None
    # Every slab writes all of its rows of dC (no memset of V x D) unless there are no rows at all.
    dC = (torch.empty if N > 0 else torch.zeros)((V, D), dtype=c.dtype, device=dev) if need_dc else None
    db = torch.zeros(V, dtype=torch.float32, device=dev) if need_dbias else None
    out = ExactOut(dE, dC, db)
    if N == 0 or not (need_de or need_dc or need_dbias):
        return out
    scale = inv = None
    if e2d.dtype == torch.float16:
        scale = fp16_dz_bound(alpha, eta, lse, entropy).amax().clamp(min=1e-30).reshape(1)
        inv = (1.0 / scale).contiguous()
    rows = dict(erow=erow, tgt=tgt, lse=lse, alpha=alpha, beta=beta, gamma=gamma, eta=eta)
    # Block buffers, reused: dZ (rows past a block's valid ones read as 0: zeroed per block, since
    # the previous block may have written them) and the fp32 dE rows.
    DZ = torch.zeros((min(R, N), n_slab * cfg.BLOCK_V), dtype=e2d.dtype, device=dev)
    dE_b = torch.empty((min(R, N), D), dtype=torch.float32, device=dev) if need_de else None
    for r0 in range(0, N, R):
        r1 = min(N, r0 + R)
        blk = {k: None if v is None else v[r0:r1] for k, v in rows.items()}
        nv = (n_valid - r0).clamp(min=0, max=r1 - r0)
        if r0 > 0:
            DZ.zero_()
        de = None if dE_b is None else dE_b[: r1 - r0].zero_()
        _exact_block(e2d, c, bias, weight, blk, nv, DZ[: r1 - r0], de, dC, db, r0 > 0, softcap, tma, cfg,
                     n_slab, max_splits, scale, inv, temperature)  # fmt: skip
        if de is not None:
            dE.index_copy_(0, blk["erow"], de.to(e2d.dtype))
    return out


def _exact_block(e2d, c, bias, weight, blk: dict, nv, DZ, dE, dC, db, accumulate_dc: bool, softcap: float,
                 tma: bool, cfg: KernelConfig, n_slab: int, max_splits: int, scale, inv,
                 temperature: float) -> None:  # fmt: skip
    """One row block of linear_ce_backward_exact: ``blk`` the block's sorted-row slices (erow, tgt,
    lse, alpha, beta, gamma, eta), ``nv`` its valid rows (device); dE its fp32 rows (zeroed), dC
    written (``accumulate_dc``: added to) slab by slab, db added to."""
    N, (V, D), dev, f32 = blk["erow"].numel(), c.shape, e2d.device, torch.float32
    n_blocks, n_vtiles, slab = triton.cdiv(N, cfg.BLOCK_N), triton.cdiv(V, cfg.BLOCK_V), DZ.shape[1]
    E_s = e2d.index_select(0, blk["erow"]) if (dC is not None or tma) else None
    # The target entry's rounding remainder goes back into the fp32 dE (dC is rounded once).
    lo = torch.zeros(N, dtype=f32, device=dev) if (e2d.dtype != f32 and dE is not None) else None
    ctx = device_context(dev)
    if tma:
        TD = tensor_descriptor()
        e_desc = TD.from_tensor(E_s, [cfg.BLOCK_N, cfg.BLOCK_D])
        c_desc = TD.from_tensor(c, [cfg.BLOCK_V, cfg.BLOCK_D])
        zt = torch.empty(N, dtype=f32, device=dev)
        with ctx:
            target_logits(e2d, c, bias, blk["erow"], blk["tgt"], nv, softcap, zt, temperature)
    common = dict(
        Bias=bias, W=weight, NValid=nv, Lse=blk["lse"], Alpha=blk["alpha"], Gamma=blk["gamma"],
        Eta=blk["eta"], DZ=DZ, InvScale=inv, softcap=float(softcap), HAS_SOFTCAP=softcap > 0,
        HAS_TEMP=temperature != 1.0, inv_temp=1.0 / temperature, BLOCK_N=cfg.BLOCK_N,
        BLOCK_V=cfg.BLOCK_V, BLOCK_D=cfg.BLOCK_D, PRECISION=precision(e2d.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    for t0 in range(0, n_vtiles, n_slab):
        nt = min(n_slab, n_vtiles - t0)
        v0, v1 = t0 * cfg.BLOCK_V, min(V, (t0 + nt) * cfg.BLOCK_V)
        with ctx:
            if tma:
                splits = min(nt, max_splits)
                _dz_slab_tma_kernel[(n_blocks, splits)](
                    E=e_desc, C=c_desc, N=N, V=V, D=D, stride_dz=slab, tile0=t0, tile_hi=t0 + nt,
                    n_splits=splits, **common,
                )  # fmt: skip
                TB = 256
                _dz_target_kernel[(triton.cdiv(N, TB),)](
                    Zt=zt, Tgt=blk["tgt"], NValid=nv, Lse=blk["lse"], Alpha=blk["alpha"], Beta=blk["beta"],
                    Gamma=blk["gamma"], W=weight, Eta=blk["eta"], DZ=DZ, InvScale=inv, TLo=lo, v0=v0, v1=v1,
                    stride_dz=slab, softcap=float(softcap), HAS_SOFTCAP=softcap > 0, BLOCK=TB,
                    inv_temp=1.0 / temperature,
                )  # fmt: skip
            else:
                _dz_slab_kernel[(n_blocks, nt)](
                    E=e2d, C=c, Erow=blk["erow"], Tgt=blk["tgt"], Beta=blk["beta"], TLo=lo, dBias=db, N=N,
                    V=V, D=D, stride_e=e2d.stride(0), stride_c=c.stride(0), stride_dz=slab, tile0=t0,
                    **common,
                )  # fmt: skip
        for k0, k1 in aligned_parts(v1 - v0):
            slab_products(DZ[:, k0:k1], c[v0 + k0 : v0 + k1], E_s, dE, dC, v0 + k0, scale, accumulate_dc)
    if lo is not None:
        add_target_lo(e2d, c, torch.arange(N, device=dev), blk["tgt"], lo, dE, None)


def _exact_geometry(
    e2d: torch.Tensor,
    c: torch.Tensor,
    N: int,
    grads: tuple[bool, bool, bool],
    slab_bytes: int,
    tma: bool | None,
) -> tuple[bool, KernelConfig, int, int, int]:
    """(tma, the kernels' config, sorted rows per block, tiles per dZ slab, vocabulary splits per
    TMA launch) of linear_ce_backward_exact for ``grads`` = (dE, dC, dbias) asked for: ``tma``
    resolved (None: common.use_tma, without a bias gradient) and checked; blocks by
    exact_block_rows, slabs of at most ``slab_bytes``."""
    need_de, need_dc, need_dbias = grads
    simple = not need_dbias and tma_rows_ok(c)
    tma = (simple and use_tma(e2d, c)) if tma is None else tma
    if tma and not simple:
        raise ValueError("tma=True: no bias gradient, 16-byte aligned classifier rows")
    cfg = config(e2d.dtype, "fwd" if tma else "bwd")
    dc_16bit = need_dc and c.dtype != torch.float32
    R = exact_block_rows(N, c.shape[1], e2d.element_size(), need_de, need_dc or tma, dc_16bit, slab_bytes,
                         cfg.BLOCK_N)  # fmt: skip
    rows = min(R, max(N, 1))
    n_blocks = triton.cdiv(rows, cfg.BLOCK_N)
    n_vtiles = triton.cdiv(c.shape[0], cfg.BLOCK_V)
    n_slab = slab_tiles(rows, n_vtiles, cfg.BLOCK_V, e2d.element_size(), slab_bytes)
    max_splits = 1
    if tma:
        max_splits = max(1, triton.cdiv(FWD_PROGRAMS_PER_SM_TMA * num_sms(e2d.device), n_blocks))
        if max_splits <= n_slab < n_vtiles:
            # A whole number of tiles per split (the splits are the grid's waves of equal programs).
            n_slab = min(n_vtiles, round(n_slab / max_splits) * max_splits)
    return tma, cfg, R, n_slab, max_splits
