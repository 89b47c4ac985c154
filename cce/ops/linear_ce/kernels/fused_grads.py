"""The fused exact path: loss statistics and gradients in one forward, three matmul passes.

Where the loss's upstream gradient is a scalar (reduction "mean" or "sum"), every row's
coefficients are known once its lse is: dZ = (alpha p - beta [v == t] - gamma w) softcap'(z)
with alpha = a0 + a1 lse (cce/_math.py, for an upstream gradient of 1). So the gradients can be
formed while a row chunk's logits are in memory, and the backward only scales them:

    per chunk of n rows:  Z = E_c @ C^T            cuBLAS, fp32 output  [n, V]   (pass 1)
                          lse, tgt, ssum; dZ        _fused_rows_kernel, in place
                          dE_c = dZ @ C             cuBLAS, fp32 output  [n, D]   (pass 2)
                          dC  (+)= dZ^T @ E_c       cuBLAS                [V, D]   (pass 3)

against four passes of the exact backward (forward, dZ recompute, two products). The price is
memory: one chunk of fp32 logits (``chunk_bytes``), the chunk's fp32 dE rows (finished into dE
after each chunk) and, past FUSED_DIRECT_CHUNKS chunks, an fp32 dC accumulator (up to that many,
dC accumulates in c's dtype: one rounding per chunk); the dispatcher (cce._dispatch.fused_fits)
takes this path only where those are bounded.

Layout of the chunk buffer: fp32 rows of Vp = V rounded up to 16 classes (cce._dispatch,
FUSED_PAD_CLASSES: 16-byte aligned rows for cuBLAS and whole vectors for the row kernel, also at
odd V). dZ is written in place over the logits in the operand dtype: row i's dZ
occupies the first half of row i's bytes (16-bit operands; the same entries for fp32). The row
kernel reads entry v before it writes entry v, and entry v of the 16-bit row lies within fp32
entries < v + 1 of the same row, so nothing is overwritten before it is read. The gradient
products read dZ with a leading dimension of 2 Vp (16-bit) or Vp.

Rounding (as in kernels/dz.py): the target term is formed inside dZ before rounding, and its
rounding remainder dZ_it - round(dZ_it) (16-bit operands) goes back into dE in fp32. Ignored rows
have zero coefficients, so their dZ rows are zero; they cost their share of the matmuls (no row
compaction, which would need the valid count on the host).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ...._dispatch import FUSED_DIRECT_CHUNKS, fused_chunk_rows, fused_padded_classes, interpreting
from ... import jit_math as jm
from ...launch import cached_launch
from .common import aligned_parts, check_inputs, device_context, mm_f32, slab_products


# The row kernel's maths, for row i of the chunk (z: fp32 logits from cuBLAS):
#   L_v = softcap(z_v + bias_v) [/ T]                             (pass A and pass B)
#   pass A: m, s online over the row: lse = m + log(sum_v exp(L_v - m)); tgt = L_t;
#           ssum = sum_v w_v L_v (smoothing); the entropy log s - hs / s from
#           hs = sum_v exp(L_v - m) (L_v - m), rescaled with m as in forward.py's _fwd_tile;
#           the argmax, the smallest id among the maxima
#   pass B: alpha = a0 + a1 lse; dZ_v = (alpha exp(L_v - lse) - beta [v == t] - gamma w_v)
#           (1 - tanh^2) rounded to the operand dtype in place; lo = dZ_t - round(dZ_t).
@cached_launch
@triton.heuristics(
    {
        "HAS_BIAS": lambda a: a["Bias"] is not None,
        "HAS_WEIGHT": lambda a: a["W"] is not None,
        "HAS_SMOOTH": lambda a: a["Gamma"] is not None,
        "HAS_ZLOSS": lambda a: a["A1"] is not None,
        "TARGET_LO": lambda a: a["Lo"] is not None,
        "ENTROPY": lambda a: a["Ent"] is not None,
        "ARGMAX": lambda a: a["Amx"] is not None,
    }
)
@triton.jit
def _fused_rows_kernel(
    Z,  # [n, Vp] fp32 logits of the chunk (without bias)
    DZ,  # the same storage as the operand dtype: row i at DZ + i * stride_dz
    Bias, W,  # [V] or None
    Tgt,  # [N] int64 target (0 at ignored rows)
    A0, A1, Beta, Gamma,  # [N] fp32 coefficients (A1: None without z-loss; Gamma: without smoothing)
    Lse, Tz, Ssum, Lo,  # [N] fp32 outputs (Ssum with smoothing, Lo with 16-bit operands)
    Ent, Amx,  # [N] fp32 entropy, int64 argmax outputs, or None
    row0, V, Vp, stride_z, stride_dz, softcap, inv_temp,
    HAS_BIAS: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_SMOOTH: tl.constexpr, HAS_ZLOSS: tl.constexpr,
    TARGET_LO: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_TEMP: tl.constexpr, ENTROPY: tl.constexpr,
    ARGMAX: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    """One chunk row per program: its statistics, then its dZ row in place of its logits."""
    r = tl.program_id(0).to(tl.int64)
    i = row0 + r  # problem row
    z_row = Z + r * stride_z
    dz_row = DZ + r * stride_dz
    t = tl.load(Tgt + i)
    offs = tl.arange(0, BLOCK_V)
    m = -float("inf")
    s = 0.0
    zt = 0.0
    ssum = 0.0
    hs = 0.0
    amax = 0
    # The loops walk the padded row (Vp, a multiple of 16: whole vectors for the loads and
    # stores); the pad classes [V, Vp) (zeros) are masked by value (`live`).
    for v0 in range(0, Vp, BLOCK_V):
        vid = v0 + offs
        live = vid < V
        L = tl.load(z_row + vid, mask=vid < Vp, other=0.0)  # [BLOCK_V]
        if HAS_BIAS:
            L += tl.load(Bias + vid, mask=live, other=0.0).to(tl.float32)
        if HAS_SOFTCAP:
            L, _th = jm.softcap(L, softcap)
        if HAS_TEMP:
            L = L * inv_temp
        Lm = tl.where(live, L, -float("inf"))
        mx = tl.max(Lm, axis=0)
        m_new = tl.maximum(m, mx)
        if ARGMAX:
            ti = tl.min(tl.where(Lm == mx, vid, 2147483647), axis=0)
            amax = tl.where(mx > m, ti, tl.where(mx == m, tl.minimum(amax, ti), amax))
        d = Lm - m_new
        pe = jm.exp(d)
        scale = jm.exp(m - m_new)
        if ENTROPY:
            # (s = 0 before the first block, where m - m_new is -inf)
            hs = tl.where(s > 0, scale * (hs + (m - m_new) * s), 0.0)
            # (0, not 0 * -inf, at the pad classes and at classes a -inf bias masks)
            hs += tl.sum(tl.where(d > -float("inf"), pe * d, 0.0), axis=0)
        s = s * scale + tl.sum(pe, axis=0)
        m = m_new
        zt += tl.sum(tl.where(vid == t, L, 0.0), axis=0)
        if HAS_SMOOTH:
            if HAS_WEIGHT:
                w = tl.load(W + vid, mask=live, other=0.0).to(tl.float32)
                ssum += tl.sum(tl.where(live, L * w, 0.0), axis=0)
            else:
                ssum += tl.sum(tl.where(live, L, 0.0), axis=0)
    lse = m + tl.log(s)
    alpha = tl.load(A0 + i)
    if HAS_ZLOSS:
        alpha += tl.load(A1 + i) * lse
    beta = tl.load(Beta + i)
    if HAS_SMOOTH:
        gamma = tl.load(Gamma + i)
    lo = 0.0
    for v0 in range(0, Vp, BLOCK_V):
        vid = v0 + offs
        live = vid < V
        L = tl.load(z_row + vid, mask=vid < Vp, other=0.0)
        if HAS_BIAS:
            L += tl.load(Bias + vid, mask=live, other=0.0).to(tl.float32)
        if HAS_SOFTCAP:
            L, th = jm.softcap(L, softcap)
        if HAS_TEMP:
            L = L * inv_temp
        is_t = vid == t
        dz = alpha * jm.exp(L - lse) - tl.where(is_t, beta, 0.0)  # [BLOCK_V]
        if HAS_SMOOTH:
            if HAS_WEIGHT:
                dz -= gamma * tl.load(W + vid, mask=live, other=0.0).to(tl.float32)
            else:
                dz -= gamma
        if HAS_SOFTCAP:
            dz *= 1.0 - th * th
        dz = tl.where(live, dz, 0.0)
        dzr = dz.to(DZ.dtype.element_ty)
        if TARGET_LO:
            lo += tl.sum(tl.where(is_t, dz - dzr.to(tl.float32), 0.0), axis=0)
        tl.store(dz_row + vid, dzr, mask=vid < Vp)
    tl.store(Lse + i, lse)
    tl.store(Tz + i, zt)
    if HAS_SMOOTH:
        tl.store(Ssum + i, ssum)
    if TARGET_LO:
        tl.store(Lo + i, lo)
    if ENTROPY:
        tl.store(Ent + i, tl.log(s) - hs / s)
    if ARGMAX:
        tl.store(Amx + i, amax.to(tl.int64))


class FusedOut(NamedTuple):
    """Per problem row (fp32 [N]): lse, target logit, weighted logit sum (None without
    smoothing); gradients for the given coefficients: dE [M, D] in e2d's dtype, dC in c's dtype,
    dbias fp32 (None where not asked for); the entropy (fp32) and argmax (int64) where asked for."""

    lse: torch.Tensor
    tgt: torch.Tensor
    ssum: torch.Tensor | None
    dE: torch.Tensor | None
    dC: torch.Tensor | None
    dbias: torch.Tensor | None
    entropy: torch.Tensor | None = None
    argmax: torch.Tensor | None = None


def _logits(ec: torch.Tensor, c: torch.Tensor, out: torch.Tensor) -> None:
    """out (fp32 view [n, V], 16-byte aligned rows) = ec @ c^T, fp32 accumulation; by aligned
    column parts (common.aligned_parts: at an odd V cuBLAS would take a kernel several times
    slower for the whole product)."""
    for k0, k1 in aligned_parts(c.shape[0]):
        o, cp = out[:, k0:k1], c[k0:k1].T
        if ec.dtype == torch.float32:
            torch.mm(ec, cp, out=o)
        elif ec.is_cuda:
            torch.mm(ec, cp, out_dtype=torch.float32, out=o)
        else:
            o.copy_(mm_f32(ec, cp, None))


def linear_ce_fused(
    e2d: torch.Tensor,
    c: torch.Tensor,
    bias: torch.Tensor | None,
    weight: torch.Tensor | None,
    rows: torch.Tensor | None,
    safe_t: torch.Tensor,
    a0: torch.Tensor,
    a1: torch.Tensor | None,
    beta: torch.Tensor,
    gamma: torch.Tensor | None,
    softcap: float,
    need_de: bool,
    need_dc: bool,
    need_dbias: bool,
    chunk_bytes: int,
    temperature: float = 1.0,
    entropy: bool = False,
    argmax: bool = False,
) -> FusedOut:
    """Statistics and exact gradients of problem rows ``e2d[rows]`` (``rows`` None: every row of
    e2d) for targets ``safe_t`` (any class at ignored rows, whose coefficients are 0), with the
    coefficients a0, a1, beta, gamma of cce/_math.affine_coefficients (gamma None: no smoothing).
    Operands fp32 or bf16 / fp16 of one dtype (the coefficients must keep dZ in its range).
    ``temperature`` divides the logits after the softcap (the coefficients carry its 1 / T);
    ``entropy`` and ``argmax`` add those outputs."""
    check_inputs(e2d, c, bias, weight, rows, safe_t, a0, a1, beta, gamma)
    N = safe_t.numel()
    V, D = c.shape
    M = e2d.shape[0]
    dev, f32 = e2d.device, torch.float32
    half = e2d.dtype != f32
    lse = torch.empty(N, dtype=f32, device=dev)
    tgt = torch.empty(N, dtype=f32, device=dev)
    ssum = torch.empty(N, dtype=f32, device=dev) if gamma is not None else None
    ent = torch.empty(N, dtype=f32, device=dev) if entropy else None
    amx = torch.empty(N, dtype=torch.long, device=dev) if argmax else None
    lo = torch.empty(N, dtype=f32, device=dev) if (half and (need_de or need_dbias)) else None
    dbias = torch.zeros(V, dtype=f32, device=dev) if need_dbias else None
    n = fused_chunk_rows(N, V, chunk_bytes)
    chunks = -(-N // n)
    # dC: written by the first chunk, accumulated by the next ones (cuBLAS, beta = 1: fp32
    # accumulation, one rounding to the stored dtype per chunk); past FUSED_DIRECT_CHUNKS chunks
    # in an fp32 buffer, rounded once at the end (cce._dispatch, FUSED_DIRECT_CHUNKS).
    f32_acc = chunks > FUSED_DIRECT_CHUNKS and c.dtype != f32
    dC = None
    if need_dc:
        dC = (torch.zeros if N == 0 else torch.empty)((V, D), dtype=f32 if f32_acc else c.dtype, device=dev)
    Vp = fused_padded_classes(V)
    # The pad classes [V, Vp) are never written by the logits GEMM: the row kernel masks them
    # by value and writes their dZ as 0, which the products never read.
    buf = torch.empty((min(n, N), Vp), dtype=f32, device=dev)
    # dE: each chunk's rows are complete after its product (the whole vocabulary is in the
    # chunk), so they are accumulated in a chunk-sized fp32 buffer and finished into dE right
    # away (the target remainders added, one rounding): no fp32 [N, D] buffer.
    dE = de_buf = None
    if need_de:
        direct = lo is None and rows is None  # fp32 operands: the product accumulates in dE itself
        dE = (torch.empty if rows is None else torch.zeros)((M, D), dtype=e2d.dtype, device=dev)
        de_buf = None if direct else torch.empty((min(n, N), D), dtype=f32, device=dev)
    BLOCK_V = 32 if interpreting() else 1024
    with device_context(dev):
        for s in range(0, N, n):
            t = min(N, s + n)
            ec = e2d[s:t] if rows is None else e2d.index_select(0, rows[s:t])
            z = buf[: t - s, :V]
            _logits(ec, c, z)
            dzb = buf[: t - s].view(e2d.dtype)  # [rows, Vp * 4 / itemsize], same storage
            _fused_rows_kernel[(t - s,)](
                Z=z, DZ=dzb, Bias=bias, W=weight, Tgt=safe_t, A0=a0, A1=a1, Beta=beta, Gamma=gamma,
                Lse=lse, Tz=tgt, Ssum=ssum, Lo=lo, Ent=ent, Amx=amx, row0=s, V=V, Vp=Vp,
                stride_z=buf.stride(0), stride_dz=dzb.stride(0), softcap=float(softcap),
                inv_temp=1.0 / temperature, HAS_SOFTCAP=softcap > 0, HAS_TEMP=temperature != 1.0,
                BLOCK_V=BLOCK_V, num_warps=4,
            )  # fmt: skip
            dz = dzb[:, :V]
            if dbias is not None:
                dbias += torch.sum(dz, 0, dtype=f32)
            dE_c = None
            if dE is not None:
                dE_c = (dE[s:t] if de_buf is None else de_buf[: t - s]).zero_()
            for k0, k1 in aligned_parts(V):
                slab_products(dz[:, k0:k1], c[k0:k1], ec, dE_c, dC, k0, None, accumulate_dc=s > 0)
            if de_buf is not None:
                r = None if rows is None else rows[s:t]
                if lo is not None:
                    _finish_de(dE_c, lo[s:t], c, safe_t[s:t], r, s, dE)
                else:
                    dE.index_copy_(0, r, dE_c)
    if dbias is not None and lo is not None:
        dbias.index_add_(0, safe_t, lo)
    if f32_acc and dC is not None:
        dC = dC.to(c.dtype)
    return FusedOut(lse, tgt, ssum, dE, dC, dbias, ent, amx)


# out[rows[i]] = round(dE_i + lo_i c[t_i]) (rows None: out[row0 + i]) for the rows i of one
# chunk: the target entries' rounding remainders added in fp32 and dE rounded to the operands'
# dtype, in one pass over the chunk's fp32 dE.
@cached_launch
@triton.heuristics({"HAS_ROWS": lambda a: a["Rows"] is not None})
@triton.jit
def _finish_de_kernel(
    DE,  # [n, D] fp32, contiguous: the chunk's rows
    Lo,  # [n] fp32
    C,  # [V, D]
    Tgt,  # [n] int64 (a valid class at every row)
    Rows,  # [n] int64 output row of each chunk row, or None (then row0 + i)
    Out,  # [M, D] operands' dtype, contiguous
    row0, D, stride_c,
    HAS_ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0).to(tl.int64)
    t = tl.load(Tgt + i).to(tl.int64)
    lo = tl.load(Lo + i)
    r = tl.load(Rows + i).to(tl.int64) if HAS_ROWS else row0 + i
    offs = tl.arange(0, BLOCK_D)
    for d0 in range(0, D, BLOCK_D):
        m = (d0 + offs) < D
        x = tl.load(DE + i * D + d0 + offs, mask=m, other=0.0)  # [BLOCK_D]
        x += lo * tl.load(C + t * stride_c + d0 + offs, mask=m, other=0.0).to(tl.float32)
        tl.store(Out + r * D + d0 + offs, x.to(Out.dtype.element_ty), mask=m)


def _finish_de(dE, lo, c, safe_t, rows, row0: int, out: torch.Tensor) -> None:
    """out[rows or row0 + i] = round(dE_i + lo_i c[t_i]) for the chunk rows i of dE (fp32)."""
    n, D = dE.shape
    if n:
        BLOCK_D = 32 if interpreting() else min(1024, triton.next_power_of_2(D))
        _finish_de_kernel[(n,)](
            DE=dE, Lo=lo, C=c, Tgt=safe_t, Rows=rows, Out=out, row0=row0, D=D,
            stride_c=c.stride(0), BLOCK_D=BLOCK_D, num_warps=4,
        )  # fmt: skip


@cached_launch
@triton.jit
def _scale_kernel(X, S, n, BLOCK: tl.constexpr):
    """X *= S[0] in place, in fp32 (one rounding to X's dtype). S[0] == 1 (loss.backward() of the
    loss itself) leaves X as it is: the programs return without reading it, a branch on the
    device, so the common step costs a launch instead of a pass over the gradients."""
    s = tl.load(S)
    if s != 1.0:
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(X + offs, (x * s).to(X.dtype.element_ty), mask=mask)


def scale_(x: torch.Tensor, s: torch.Tensor) -> None:
    """x *= s (a 0-dim or one-element fp32 device tensor) in place, contiguous x: the backward's
    one pass over the forward's gradients. (torch's mul_ of a 16-bit tensor by a 0-dim fp32
    device tensor takes a non-vectorized kernel, ~3x slower on an H100.)"""
    n = x.numel()
    if n == 0:
        return
    BLOCK = 64 if interpreting() else 4096
    with device_context(x.device):
        _scale_kernel[(triton.cdiv(n, BLOCK),)](X=x, S=s.float().reshape(1), n=n, BLOCK=BLOCK)
