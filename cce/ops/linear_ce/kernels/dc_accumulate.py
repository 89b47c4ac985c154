"""dC summed over row chunks in scaled fp16, inside dC's own storage: the fused path's dC product.

The fused exact path (fused_grads.py) forms dC = sum over its row chunks c of dZ_c^T E_c. Added to
a bf16 dC after each chunk, every chunk rounds the running sum once more (8 bits of mantissa),
and the error grows about as the square root of the chunks (measured 3.6e-3 with 8, 4.7e-3 with
16 against fp32 gradients: cce/_dispatch.py). An fp32 accumulator costs V D 4 bytes (2 GiB at
V = 128256, D = 4096). Here the running sum lives in dC's own storage, read as fp16 and scaled by
a power of two S; fp16 keeps 11 bits, so each chunk's rounding is 8x smaller than bf16's, and
the last chunk writes round(sum / S) in c's dtype over it, tile by tile. No buffer besides dC.

    per output tile [BLOCK_V, BLOCK_D]:  acc = sum_k dZ[k, v] E[k, d]   (fp32, k the chunk's rows)
                                          x = S acc + Acc[v, d]          (Acc: fp16; 0 for the first chunk)
                                          Acc[v, d] = fp16(x), or at the last chunk Out[v, d] = x / S

Range. Every partial sum obeys |sum_c dZ_c^T E_c|_vd <= max|E| sum_i sum_v |dZ_iv|, and with
dZ_iv = (alpha_i p_iv - beta_i [v == t_i] - gamma_i w_v) softcap'(z_iv), softcap' <= 1:
sum_v |dZ_iv| <= |alpha_i| + |beta_i| + |gamma_i| W (W = sum_v |w_v|, V without class weights). So
with B = max|E| sum_i (|alpha_i| + |beta_i| + |gamma_i| W), S = 2^(14 - ceil(log2 B)) keeps every
stored value within 2^14 (fp16's largest is 65504): nothing overflows. Since S B >= 2^13,
stored values below 2^-14, i.e. entries under B 2^-27, are fp16 subnormals and keep fewer bits
(absolute error at most B 2^-38 per chunk): far below the rounding of the entries that carry the
norm of dC, but relative to the bound, not to each entry, so the smallest rows of dC (rare
classes) keep fewer of fp16's bits than the largest.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ...._dispatch import interpreting
from ...launch import cached_launch
from .common import device_context, tensor_descriptor, tma_rows_ok, use_tma

# The bound's headroom: S B <= 2^14, a factor 4 below fp16's largest value.
DC16_LOG2_TOP = 14


# Out tile (v, d), pid = v_tile * n_d + d_tile: the programs of one vocabulary tile are
# consecutive, so its dZ columns [K, BLOCK_V] are read from HBM about once and reused from L2 by
# the D tiles; E's chunk rows ([K, D], K ~ 2048) stay in L2 for all.
@cached_launch
@triton.jit
def _dc_accumulate_kernel(
    DZ,  # [K, >= V] the chunk's dZ, row stride stride_dz
    E,  # [K, D] the chunk's rows of E, contiguous
    Acc,  # [V, D] fp16: S dC of the chunks so far (read unless FIRST; written unless LAST)
    Out,  # [V, D] c's dtype: dC, written by the LAST chunk (may alias Acc: each program reads
    #        its tile before it writes it, with elements of equal size)
    S,  # [1] fp32, a power of two
    K, V, D, stride_dz,
    FIRST: tl.constexpr, LAST: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pv, pd = _tile(D, BLOCK_D)
    offs_v = pv * BLOCK_V + tl.arange(0, BLOCK_V)
    offs_d = pd * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_k = tl.arange(0, BLOCK_K)
    vmask = offs_v < V
    dmask = offs_d < D
    acc = tl.zeros((BLOCK_V, BLOCK_D), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        kmask = kk < K
        rows = kk.to(tl.int64)[:, None]
        dz = tl.load(
            DZ + rows * stride_dz + offs_v[None, :], mask=kmask[:, None] & vmask[None, :], other=0.0
        )  # [BLOCK_K, BLOCK_V]
        e = tl.load(
            E + rows * D + offs_d[None, :], mask=kmask[:, None] & dmask[None, :], other=0.0
        )  # [BLOCK_K, BLOCK_D]
        acc = tl.dot(tl.trans(dz), e, acc, input_precision=PRECISION)  # [BLOCK_V, BLOCK_D]
    _epilogue(acc, Acc, Out, S, offs_v, offs_d, V, D, FIRST, LAST)


@triton.jit
def _tile(D, BLOCK_D: tl.constexpr):
    """(vocabulary tile, D tile) of this program: the D tiles of one vocabulary tile consecutive."""
    pid = tl.program_id(0)
    n_d = tl.cdiv(D, BLOCK_D)
    return pid // n_d, pid % n_d


@triton.jit
def _epilogue(acc, Acc, Out, S, offs_v, offs_d, V, D, FIRST: tl.constexpr, LAST: tl.constexpr):
    """scaled_fp16_sum of the output tile (offs_v, offs_d) of a contiguous [V, D] dC."""
    off = offs_v.to(tl.int64)[:, None] * D + offs_d[None, :]  # [BLOCK_V, BLOCK_D]
    mask = (offs_v < V)[:, None] & (offs_d < D)[None, :]
    scaled_fp16_sum(acc, Acc, Out, S, off, mask, FIRST, LAST)


@triton.jit
def scaled_fp16_sum(acc, Acc, Out, S, off, mask, FIRST: tl.constexpr, LAST: tl.constexpr):
    """x = S acc (+ the stored fp16 entries at ``off`` unless FIRST); stored as fp16 in Acc (the
    fp16 view of Out's storage), or at the LAST chunk x / S in Out's dtype."""
    s = tl.load(S)
    x = acc * s
    if not FIRST:
        x += tl.load(Acc + off, mask=mask, other=0.0).to(tl.float32)
    if LAST:
        tl.store(Out + off, (x / s).to(Out.dtype.element_ty), mask=mask)
    else:
        tl.store(Acc + off, x.to(tl.float16), mask=mask)


# The same by tensor descriptors (Hopper): the operand tiles by TMA, zero-filled past K, V and D.
@cached_launch
@triton.jit
def _dc_accumulate_tma_kernel(
    DZ,  # descriptor of the chunk's dZ [K, V] (row stride a multiple of 16 bytes)
    E,  # descriptor of the chunk's rows of E [K, D]
    Acc, Out, S,  # as _dc_accumulate_kernel
    K, V, D,
    FIRST: tl.constexpr, LAST: tl.constexpr,
    BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pv, pd = _tile(D, BLOCK_D)
    acc = tl.zeros((BLOCK_V, BLOCK_D), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        dz = DZ.load([k0, pv * BLOCK_V])  # [BLOCK_K, BLOCK_V]
        e = E.load([k0, pd * BLOCK_D])  # [BLOCK_K, BLOCK_D]
        acc = tl.dot(dz.T, e, acc)  # [BLOCK_V, BLOCK_D]
    offs_v = pv * BLOCK_V + tl.arange(0, BLOCK_V)
    offs_d = pd * BLOCK_D + tl.arange(0, BLOCK_D)
    _epilogue(acc, Acc, Out, S, offs_v, offs_d, V, D, FIRST, LAST)


# Hopper: 128 x 256 output tiles (fp32 accumulator in 8 warps' registers), 64 rows per step,
# 3 stages of 48 KB operand tiles.
DC16_BLOCKS = (128, 256, 64)
DC16_WARPS = 8
DC16_STAGES = 3


def _amax(x: torch.Tensor) -> torch.Tensor:
    """fp32 0-dim max |x| (0 for an empty x), without a temporary of x's size."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    lo, hi = torch.aminmax(x)
    return torch.maximum(lo.float().abs(), hi.float().abs())


def dc16_scale(
    e2d: torch.Tensor, coef_bound: torch.Tensor, extra: torch.Tensor | None = None
) -> torch.Tensor:
    """fp32 [1]: the power of two S of the module docstring, from the hidden states (every row of
    e2d: a bound for any subset) and ``coef_bound`` (fp32 [N]: |alpha_i| + |beta_i| + |gamma_i| W
    per row, 0 at ignored rows; any terms whose sum times max|E| bounds the sums): B = max|E|
    sum(coef_bound) (+ ``extra``, fp32 0-dim, a bound of terms not of that form). Device ops
    only. S = 1 where the bound is 0 (no valid row, or E all zero), at most 2^126 (fp32's range)
    for a tiny bound, NaN where the bound is not finite (non-finite inputs: dC comes out NaN, not
    silently wrong)."""
    bound = _amax(e2d) * coef_bound.float().sum()
    if extra is not None:
        bound = bound + extra
    bound = bound.reshape(1)
    # 2^(top - ceil(log2 B)) = 2^top / 2^ceil(log2 B); frexp gives B = m 2^x with m in [0.5, 1),
    # so 2^ceil(log2 B) <= 2^x (equal unless B is a power of two, where it is half of it).
    _, x = torch.frexp(bound)
    s = torch.ldexp(torch.ones_like(bound), torch.clamp(DC16_LOG2_TOP - x, max=126))
    s = torch.where(bound > 0, s, torch.ones_like(s))
    return torch.where(torch.isfinite(bound), s, torch.full_like(s, float("nan")))


def dz_row_bound(
    e2d, c, bias, weight, a0, a1, beta, gamma, softcap: float, temperature: float
) -> torch.Tensor:
    """fp32 [N]: per row a bound of sum_v |dZ_iv| (the module docstring's range): |alpha_i| + |beta_i|
    + |gamma_i| W, W = sum_v |w_v| (V without class weights); with z-loss alpha_i = a0_i + a1_i
    lse_i and |lse_i| <= max_v |z_iv| + log V over the classes of finite logit, where |z_iv| <=
    D max|E| max|C| + max|b| before the softcap (at most the softcap after it), over the
    temperature; max|b| over the finite biases (a class masked by a bias of -inf has p = 0 and
    leaves lse as it is). Device ops, no host read."""
    f32 = torch.float32
    bound = a0.abs() + beta.abs()
    if gamma is not None:
        W = weight.float().abs().sum() if weight is not None else float(c.shape[0])
        bound = bound + gamma.abs() * W
    if a1 is not None:
        z = logit_bound(e2d, c, bias, softcap)
        bound = bound + a1.abs() * (z / temperature + math.log(max(c.shape[0], 1)))
    return bound.to(f32)


def logit_bound(
    e2d: torch.Tensor, c: torch.Tensor, bias: torch.Tensor | None, softcap: float
) -> torch.Tensor:
    """fp32 0-dim: a bound of |softcap(e_i . c_v + b_v)| over the classes of finite logit: D max|E|
    max|C| + max|b| (the finite biases), at most the softcap. Device ops, no host read."""
    z = _amax(e2d) * _amax(c) * c.shape[1]
    if bias is not None:
        z = z + _amax(torch.where(torch.isfinite(bias), bias, 0))
    if softcap > 0:
        z = torch.clamp(z, max=softcap)
    return z


def dc_accumulate(dz: torch.Tensor, ec: torch.Tensor, dC: torch.Tensor, S: torch.Tensor, first: bool,
                  last: bool) -> None:  # fmt: skip
    """One chunk's dC product into ``dC`` (c's dtype, contiguous [V, D], its storage holding S dC
    in fp16 between the first and the last chunk): dz [K, >= V] (16-bit, any row stride, unit
    column stride) the chunk's dZ, ``ec`` [K, D] contiguous its rows of E (dz's dtype)."""
    V, D = dC.shape
    K = dz.shape[0]
    if dC.element_size() != 2 or not dC.is_contiguous() or not ec.is_contiguous() or dz.stride(1) != 1:
        raise ValueError("dc_accumulate: a contiguous 16-bit dC, contiguous E rows, unit column stride of dZ")
    acc = dC.view(torch.float16)
    if interpreting():
        (BV, BD, BK), warps, stages = (32, 32, 16), 4, 1
    else:
        (BV, BD, BK), warps, stages = DC16_BLOCKS, DC16_WARPS, DC16_STAGES
    grid = (triton.cdiv(V, BV) * triton.cdiv(D, BD),)
    common = dict(Acc=acc, Out=dC, S=S, K=K, V=V, D=D, FIRST=first, LAST=last, BLOCK_V=BV, BLOCK_D=BD,
                  BLOCK_K=BK, num_warps=warps, num_stages=stages)  # fmt: skip
    with device_context(dC.device):
        if use_tma(ec, ec) and tma_rows_ok(dz) and tma_rows_ok(ec):
            TD = tensor_descriptor()
            _dc_accumulate_tma_kernel[grid](
                DZ=TD.from_tensor(dz[:, :V], [BK, BV]), E=TD.from_tensor(ec, [BK, BD]), **common
            )  # fmt: skip
        else:
            _dc_accumulate_kernel[grid](DZ=dz, E=ec, stride_dz=dz.stride(0), PRECISION="ieee", **common)


def dense_dc16_scale(
    e2d: torch.Tensor, c: torch.Tensor, bias: torch.Tensor | None, alpha: torch.Tensor,
    eta: torch.Tensor | None, tcoef: torch.Tensor, weight: torch.Tensor | None, ge: torch.Tensor | None,
    softcap: float, temperature: float,
) -> torch.Tensor:  # fmt: skip
    """dc16_scale of the dense slabs' dC sums over row blocks (dense_slabs.py): an entry of any
    partial sum is at most max|E| sum_i (|alpha_i| + |eta_i| max|z| / T) (the non-target
    entries, alpha and eta per sorted row: p <= 1, softcap' <= 1) + max|E| sum_i |coef_i| (the
    target terms, ``tcoef``) + max|w| max|ge| (smoothing: ``ge`` = sum_i gamma_i e_i, ``weight``
    the class weights or None)."""
    row = alpha.float().abs()
    if eta is not None:
        row = row + eta.float().abs() * (logit_bound(e2d, c, bias, softcap) / temperature)
    extra = None
    if ge is not None:
        w = 1.0 if weight is None else weight.float().abs().amax()
        extra = w * ge.abs().amax()
    return dc16_scale(e2d, torch.cat([row, tcoef.float().abs()]), extra)
