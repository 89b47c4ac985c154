"""The dZ tile of the backward kernels: its formation and its rounding to the operand dtype
(nontarget_dz: the non-target entries alone, for the kernels that add the target entries
themselves, the sparse backward's kept tiles and the dense slabs).

dZ = (alpha p - beta [v == t] [- gamma w]) softcap' per tile (cce/_math.py gives alpha, beta,
gamma; the exact backward adds the entropy's term eta p z and a temperature). The target term
is formed in the tile, before dZ is rounded to the operand dtype: rounding alpha p_it and
subtracting beta exactly outside would turn the cancellation alpha p_it - beta (p_it near 1)
into a large relative error of dC (docs/design.md, "Where rounding goes").

TARGET_LO (bf16 / fp16 operands): the target entry dZ_it is the one entry whose rounding error is
not averaged away (it carries the -beta term; rounding it costs 2^-8 of ||c_t|| in dE_i and of
the row sums in dC_t, where dE_i itself is a small difference). Its rounding remainder
dZ_it - round(dZ_it) goes to TLo[row] and is added back in fp32 outside (common.add_target_lo),
so the target term is exact.

SCALE_DZ (fp16 operands): alpha p can sit below fp16's normal range (alpha ~ 1/N for "mean"), so
dZ is scaled before rounding and the products scaled back.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ... import jit_math as jm
from ...launch import cached_launch
from .common import device_context, finish_logits


@triton.jit
def nontarget_dz(
    L, Bias, vid, tgt, lse, alpha, eta, row_mask, col_mask, softcap, inv_temp,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_TEMP: tl.constexpr, HAS_ETA: tl.constexpr,
):  # fmt: skip
    """dZ at the non-target entries of a logit tile L [BLOCK_N, BLOCK_V] (classes vid, the rows'
    targets tgt; bias not yet added, softcap not yet applied), fp32, 0 at the targets and outside
    row_mask x col_mask: p (alpha [+ eta z]) softcap', p = exp(z - lse), z = softcap(L + b)
    [* inv_temp] (HAS_ETA: the entropy's term; HAS_TEMP: the coefficients carry the
    temperature's factor already; cce/_math.py). The kernels that add the target entries' exact
    terms in fp32 themselves (the sparse backward's kept tiles, the dense slabs) form it here."""
    L, th = finish_logits(L, Bias, vid, col_mask, softcap, inv_temp, HAS_BIAS, HAS_SOFTCAP, HAS_TEMP)
    nt = row_mask[:, None] & col_mask[None, :] & (vid[None, :] != tgt[:, None])
    if HAS_ETA:
        p = tl.exp(L - lse[:, None])
        # (L where p > 0: a class a -inf bias masks gets 0, not 0 * -inf)
        dz = tl.where(nt, p * (alpha[:, None] + eta[:, None] * tl.where(p > 0, L, 0.0)), 0.0)
    else:
        dz = tl.where(nt, alpha[:, None] * tl.exp(L - lse[:, None]), 0.0)  # [BLOCK_N, BLOCK_V]
    if HAS_SOFTCAP:
        dz *= 1.0 - th * th
    return dz


@triton.jit
def dense_dz(
    L, lse, alpha, beta, Gamma, W, Eta, offs_n, vid, is_t, row_mask, col_mask, softcap, inv_temp,
    HAS_SOFTCAP: tl.constexpr, FOLD_SMOOTH: tl.constexpr, HAS_WEIGHT: tl.constexpr,
    HAS_TEMP: tl.constexpr, HAS_ETA: tl.constexpr,
):  # fmt: skip
    """(dZ, p) of a logit tile L (bias added, softcap not yet), fp32, 0 outside the rows / columns:
    dZ = (alpha p [+ eta p z] - beta [v == t] [- gamma w]) softcap', z = softcap(L) [* inv_temp]
    (HAS_TEMP: the coefficients carry the temperature's factor already). HAS_ETA: the entropy's
    term (cce/_math.py). The target term is formed in the tile, before any rounding (see the
    module docstring)."""
    if HAS_SOFTCAP:
        L, th = jm.softcap(L, softcap)
    if HAS_TEMP:
        L = L * inv_temp
    mask2 = row_mask[:, None] & col_mask[None, :]
    p = tl.where(mask2, tl.exp(L - lse[:, None]), 0.0)
    if HAS_ETA:
        eta = tl.load(Eta + offs_n, mask=row_mask, other=0.0)
        # (L where p > 0: a -inf logit, a class a -inf bias masks, gets 0, not 0 * -inf)
        dz = p * (alpha[:, None] + eta[:, None] * tl.where(p > 0, L, 0.0)) - tl.where(
            is_t, beta[:, None], 0.0
        )
    else:
        dz = alpha[:, None] * p - tl.where(is_t, beta[:, None], 0.0)
    if FOLD_SMOOTH:
        gamma = tl.load(Gamma + offs_n, mask=row_mask, other=0.0)
        if HAS_WEIGHT:
            w = tl.load(W + vid, mask=col_mask, other=0.0).to(tl.float32)
        else:
            w = tl.where(col_mask, 1.0, 0.0)
        dz -= gamma[:, None] * w[None, :]
    if HAS_SOFTCAP:
        dz *= 1.0 - th * th
    return tl.where(mask2, dz, 0.0), p


@triton.jit
def round_dz(dz, DZ, InvScale, SCALE_DZ: tl.constexpr):
    """(dz rounded to DZ's dtype, that rounding back in fp32 and unscaled, inv): with SCALE_DZ
    (fp16) dz is stored times inv = 1 / max |alpha|, one global scale that keeps alpha p above
    fp16's normal range; inv is 1 otherwise."""
    if SCALE_DZ:
        inv = tl.load(InvScale)
        dzr = (dz * inv).to(DZ.dtype.element_ty)
        back = dzr.to(tl.float32) / inv
    else:
        inv = 1.0
        dzr = dz.to(DZ.dtype.element_ty)
        back = dzr.to(tl.float32)
    return dzr, back, inv


@triton.jit
def store_dz(
    dz, is_t, offs_n, row_mask, offs_p, col_mask, DZ, InvScale, TLo, N, stride_dz, col0,
    SCALE_DZ: tl.constexpr, TARGET_LO: tl.constexpr,
):  # fmt: skip
    """Round the dZ tile to DZ's dtype and store it at columns offs_p - col0 of the slab; returns
    (rounded tile, inv) with inv the fp16 scale's inverse (1 without SCALE_DZ). Rows past n_valid
    in a partly valid block are stored as zeros. TARGET_LO: the target entry's rounding remainder
    goes to TLo[row] (added back in fp32 outside)."""
    dzr, back, inv = round_dz(dz, DZ, InvScale, SCALE_DZ)
    if TARGET_LO:
        lo = tl.sum(tl.where(is_t, dz - back, 0.0), axis=1)
        row_t = tl.max(is_t.to(tl.int32), axis=1) > 0
        tl.store(TLo + offs_n, lo, mask=row_mask & row_t)
    dz_ptr = DZ + offs_n.to(tl.int64)[:, None] * stride_dz + (offs_p - col0)[None, :]
    tl.store(dz_ptr, dzr, mask=(offs_n < N)[:, None] & col_mask[None, :])
    return dzr, inv


# dZ of every row on a sample of classes (slab_choice.dc_norm_estimate's exact dC rows): for row i
# and sampled class k (class id cls_k, possibly drawn more than once),
#   L_ik = softcap(z_ik + bias_k),  dZ_ik = (p_ik (alpha_i [+ eta_i L_ik]) - beta_i [cls_k == t_i]) softcap'
# from the fp32 logits z of a cuBLAS product, rounded once to the operand dtype (as the backward's
# GEMMs read dZ). One pass over z in place of a chain of elementwise torch ops.
@cached_launch
@triton.heuristics({"HAS_BIAS": lambda a: a["Bias"] is not None, "HAS_ETA": lambda a: a["Eta"] is not None})
@triton.jit
def _class_dz_kernel(
    Z,  # [n_rows, n_cls] fp32 logits (bias not added)
    DZ,  # [n_rows, n_cls] operand dtype, output
    Bias,  # [n_cls] fp32 bias of the sampled classes, or None
    Cls,  # [n_cls] int64 class ids
    Tgt, Lse, Alpha, Beta,  # [n_rows] int64 / fp32 (alpha = beta = 0 at rows without a gradient)
    Eta,  # [n_rows] fp32 the entropy's coefficient (0 at rows without a gradient), or None
    n_rows, n_cls, stride_z, stride_dz, softcap,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ETA: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
):  # fmt: skip
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_v = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    row_mask = offs_n < n_rows
    col_mask = offs_v < n_cls
    rows64 = offs_n.to(tl.int64)[:, None]
    mask2 = row_mask[:, None] & col_mask[None, :]
    L = tl.load(Z + rows64 * stride_z + offs_v[None, :], mask=mask2, other=0.0)  # [BLOCK_N, BLOCK_V]
    if HAS_BIAS:
        L += tl.load(Bias + offs_v, mask=col_mask, other=0.0)[None, :]
    cls = tl.load(Cls + offs_v, mask=col_mask, other=-1)
    t = tl.load(Tgt + offs_n, mask=row_mask, other=-2)
    lse = tl.load(Lse + offs_n, mask=row_mask, other=0.0)
    alpha = tl.load(Alpha + offs_n, mask=row_mask, other=0.0)
    beta = tl.load(Beta + offs_n, mask=row_mask, other=0.0)
    is_t = t[:, None] == cls[None, :]
    dz, _p = dense_dz(
        L, lse, alpha, beta, None, None, Eta, offs_n, cls, is_t, row_mask, col_mask, softcap, 1.0,
        HAS_SOFTCAP=HAS_SOFTCAP, FOLD_SMOOTH=False, HAS_WEIGHT=False, HAS_TEMP=False, HAS_ETA=HAS_ETA,
    )  # fmt: skip
    tl.store(DZ + rows64 * stride_dz + offs_v[None, :], dz.to(DZ.dtype.element_ty), mask=mask2)


def class_sample_dz(
    z, cls, tgt, lse, alpha, beta, bias_cls, softcap: float, dtype, eta=None
) -> torch.Tensor:  # fmt: skip
    """dZ [n_rows, n_cls] in ``dtype`` of the rows (tgt, lse, alpha, beta, eta or None: [n_rows])
    on the classes ``cls`` from their fp32 logits z (bias_cls: fp32 [n_cls] or None); see above."""
    n_rows, n_cls = z.shape
    dz = torch.empty((n_rows, n_cls), dtype=dtype, device=z.device)
    if n_rows == 0 or n_cls == 0:
        return dz
    BLOCK_N, BLOCK_V = 16, 256
    grid = (triton.cdiv(n_rows, BLOCK_N), triton.cdiv(n_cls, BLOCK_V))
    with device_context(z.device):
        _class_dz_kernel[grid](
            Z=z, DZ=dz, Bias=bias_cls, Cls=cls, Tgt=tgt, Lse=lse, Alpha=alpha, Beta=beta, Eta=eta,
            n_rows=n_rows, n_cls=n_cls, stride_z=z.stride(0), stride_dz=dz.stride(0), softcap=softcap,
            HAS_SOFTCAP=softcap > 0, BLOCK_N=BLOCK_N, BLOCK_V=BLOCK_V,
        )  # fmt: skip
    return dz
