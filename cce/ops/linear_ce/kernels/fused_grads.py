"""The fused exact path: loss statistics and gradients in one forward, three matmul passes.

Where the loss's upstream gradient is a scalar (reduction "mean" or "sum"), every row's
coefficients are known once its lse is: dZ = (alpha p - beta [v == t] - gamma w) softcap'(z)
with alpha = a0 + a1 lse (cce/_math.py, for an upstream gradient of 1). So the gradients can be
formed while a row chunk's logits are at hand, and the backward only scales them:

    per chunk of n rows:  Z tiles = E_c @ C^T   forward.py's kernel: online lse, and per tile
                                                q = e^(L - m') softcap'(z) in the operands'
                                                dtype, m' the running max     [n, V]   (pass 1)
                          dZ from q, in place   _dz_kernel: dZ = alpha e^(m' - lse) q - ...
                          dE_c = dZ @ C         cuBLAS, fp32 output           [n, D]   (pass 2)
                          dC  (+)= dZ^T @ E_c   cuBLAS, or dc_accumulate.py   [V, D]   (pass 3)

against four passes of the exact backward (forward, dZ recompute, two products). Besides the
three GEMMs' own operand and output traffic (q written once, dZ read twice: as three bf16
GEMMs), the step moves 4 bytes per logit (16-bit operands): _dz_kernel reading q and writing dZ
over it. Memory: one chunk of q (``chunk_bytes``; its rows padded to 16 classes, FUSED_PAD_CLASSES,
16-byte aligned for cuBLAS), the chunk's fp32 dE rows (finished into dE after each chunk) and,
where rows are read by index (``rows``), its rows of E gathered once for the forward's tensor
descriptors and the products (else a view of e2d): flat in N. dC sums the chunks in its own
storage: in c's dtype up to FUSED_DIRECT_CHUNKS chunks (cuBLAS, one rounding per chunk), past that
in scaled fp16 (dc_accumulate.py, 8x finer roundings), so its error stays bounded at any number
of chunks.

Rounding: q = e^(L - m') <= 1 rounds once (relative 2^-8 in bf16, which keeps fp32's exponent
range), dZ = f q once more: the same relative error per entry as a dZ rounded from fp32 logits,
twice. Not at the target entry with 16-bit q: dZ_t = alpha p_t - beta cancels where p_t ~ 1, so
it is formed in fp32 from the target's own logit (the forward's target-logit kernel), and its
rounding remainder dZ_t - round(dZ_t) goes back into dE in fp32 (fp32 q keeps p_t to 2^-24: there
the target entry comes from q like the rest of the row). Ignored rows have zero
coefficients, so their dZ rows are zero (q <= 1 is finite); they cost their share of the
matmuls (no row compaction, which would need the valid count on the host).

Softcap with label smoothing is not served: its smoothing term gamma w_v softcap'(z_v) would
need softcap'(z) per entry besides q (the dispatcher takes the exact backward there).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ...._dispatch import fused_chunk_rows, fused_dc16, fused_padded_classes, interpreting
from ... import jit_math as jm
from ...launch import cached_launch
from .common import aligned_parts, check_inputs, config, device_context, slab_products
from .dc_accumulate import dc16_scale, dc_accumulate, dz_row_bound
from .forward import linear_ce_forward


# dZ of chunk row r (problem row i = row0 + r) from the forward's q tiles, in place:
#   alpha = a0_i + a1_i lse_r;  per tile j: f_j = alpha e^(m'_rj - lse_r)
#   dZ_v = f_j q_v - gamma_i w_v                      (v in tile j, v != t_i)
#   dZ_t = (alpha e^(zt_r - lse_r) - beta_i - gamma_i w_t) (1 - th_t^2), th_t = zt_r T / softcap
# rounded to Q's dtype; Lo_i = dZ_t - round(dZ_t). Program (r, s) does row r's tiles
# [s tiles, (s + 1) tiles), TILES at a time ([TILES, BLOCK_V] blocks): a pass of 2 + 2 bytes per
# logit (16-bit q) bound by bandwidth, which needs many bytes in flight per SM (DZ_PROGRAMS and
# DZ_TILES, below), not one program per row.
@cached_launch
@triton.heuristics(
    {
        "HAS_WEIGHT": lambda a: a["W"] is not None,
        "HAS_SMOOTH": lambda a: a["Gamma"] is not None,
        "HAS_ZLOSS": lambda a: a["A1"] is not None,
        "TARGET_LO": lambda a: a["Lo"] is not None,
    }
)
@triton.jit
def _dz_kernel(
    Q,  # [n, Vp] the chunk's q, overwritten by dZ (same dtype); rows padded to Vp = stride_q classes
    Qm,  # [n, n_vtiles] fp32 running max m' of each (row, tile)
    W,  # [V] class weights (smoothing) or None
    Tgt,  # [N] int64 target (0 at ignored rows)
    Zt, Lse,  # [n] fp32 the chunk rows' target logit and lse
    A0, A1, Beta, Gamma,  # [N] fp32 coefficients (A1: None without z-loss; Gamma: without smoothing)
    Lo,  # [N] fp32 target remainders (16-bit operands) or None
    row0, V, n_vtiles, tiles, stride_q, th_scale,
    HAS_WEIGHT: tl.constexpr, HAS_SMOOTH: tl.constexpr, HAS_ZLOSS: tl.constexpr, TARGET_LO: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, BLOCK_V: tl.constexpr, TILES: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    i = row0 + r
    t = tl.load(Tgt + i)
    lse = tl.load(Lse + r)
    zt = tl.load(Zt + r)
    alpha = tl.load(A0 + i)
    if HAS_ZLOSS:
        alpha += tl.load(A1 + i) * lse
    dzt = alpha * jm.exp(zt - lse) - tl.load(Beta + i)  # (16-bit q)
    if HAS_SMOOTH:
        gamma = tl.load(Gamma + i)
        if HAS_WEIGHT:
            dzt -= gamma * tl.load(W + t).to(tl.float32)
        else:
            dzt -= gamma
    if HAS_SOFTCAP:
        th = zt * th_scale
        dzt *= 1.0 - th * th
    # fp32 q keeps the target entry to 2^-24 of p_t: there it comes from q, as the rest of the row
    # (from the same logits; the target-logit kernel's z_t differs from the matmul's by its
    # summation order, which p_t ~ 1 turns into a relative error of dZ_t)
    HALF: tl.constexpr = Q.dtype.element_ty != tl.float32
    beta_t = tl.load(Beta + i)
    if HAS_SOFTCAP:
        beta_t *= 1.0 - th * th
    q_row = Q + r * stride_q
    offs = tl.arange(0, BLOCK_V)
    j1 = tl.minimum(n_vtiles, (split + 1) * tiles)
    for j0 in range(split * tiles, j1, TILES):
        jj = j0 + tl.arange(0, TILES)  # [TILES]
        vid = jj[:, None] * BLOCK_V + offs[None, :]  # [TILES, BLOCK_V]
        # the row's padded classes (stride_q, a multiple of 16): vectorized loads and stores at
        # an odd V; the pad's columns are written 0
        live = (vid < stride_q) & (jj < j1)[:, None]
        m = tl.load(Qm + r * n_vtiles + jj, mask=jj < j1, other=0.0)
        f = alpha * jm.exp(m - lse)  # [TILES]
        dz = f[:, None] * tl.load(q_row + vid, mask=live, other=0.0).to(tl.float32)  # [TILES, BLOCK_V]
        if HAS_SMOOTH:
            if HAS_WEIGHT:
                dz -= gamma * tl.load(W + vid, mask=live & (vid < V), other=0.0).to(tl.float32)
            else:
                dz -= gamma
        if HALF:
            dz = tl.where(vid == t, dzt, dz)
        else:
            dz = tl.where(vid == t, dz - beta_t, dz)
        dz = tl.where(vid < V, dz, 0.0)
        tl.store(q_row + vid, dz.to(Q.dtype.element_ty), mask=live)
    if TARGET_LO:
        if split == 0:
            tl.store(Lo + i, dzt - dzt.to(Q.dtype.element_ty).to(tl.float32))


# Programs of _dz_kernel to aim for, and tiles per step of each: one program per row left 8-16
# warps per SM at the 1024 to 2048 rows of a chunk at large V (the pass at 1.7-2.8 TB/s on an
# H200); 8192 one-warp programs of one tile per step ran at 3.6-3.7 TB/s. Four tiles per step with
# four warps (16 bytes of q per thread) and about two waves of resident programs (16 per SM, 132
# SMs) took 2-4% less (docs/benchmarks.md). (Under the interpreter, which runs programs one by
# one, two per row and two tiles per step: the split and masked paths.)
DZ_PROGRAMS = 4096
DZ_TILES = 4
DZ_WARPS = 4


def dz_split_tiles(rows: int, n_vtiles: int) -> int:
    """Vocabulary tiles per program of _dz_kernel for a chunk of ``rows`` rows: each row split
    into about DZ_PROGRAMS / rows parts (at least one tile each)."""
    programs = 2 * rows if interpreting() else DZ_PROGRAMS
    splits = max(1, min(n_vtiles, -(-programs // max(1, rows))))
    return -(-n_vtiles // splits)


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
    coefficients a0, a1, beta, gamma of cce/_math.affine_coefficients (gamma None: no smoothing;
    not with a softcap). Operands fp32 or bf16 / fp16 of one dtype (the coefficients must keep
    dZ in its range). ``temperature`` divides the logits after the softcap (the coefficients
    carry its 1 / T); ``entropy`` and ``argmax`` add those outputs. ``chunk_bytes``: the q
    chunk's size (fused_chunk_rows)."""
    check_inputs(e2d, c, bias, weight, rows, safe_t, a0, a1, beta, gamma)
    if softcap > 0 and gamma is not None:
        raise ValueError("the fused path takes no label smoothing with a softcap")
    N = safe_t.numel()
    b = _buffers(e2d, c, rows, N, (need_de, need_dc, need_dbias), chunk_bytes)
    if b.dc16 and N > 0:
        b.S = dc16_scale(e2d, dz_row_bound(e2d, c, bias, weight, a0, a1, beta, gamma, softcap, temperature))
    erow = rows if rows is not None else torch.arange(N, device=e2d.device)
    n_valid: dict[int, torch.Tensor] = {}  # chunk length -> int32 [1] (balanced: two lengths at most)
    stats = []
    with device_context(e2d.device):
        for s in range(0, N, b.n):
            t = min(N, s + b.n)
            k = t - s
            if k not in n_valid:
                n_valid[k] = torch.full((1,), k, dtype=torch.int32, device=e2d.device)
            # the chunk's rows of e: a view, or gathered once for the forward's descriptors and
            # the products
            ec = e2d[s:t] if rows is None else e2d.index_select(0, rows[s:t])
            st = linear_ce_forward(
                e2d, c, bias, weight, erow[s:t], safe_t[s:t], n_valid[k], softcap, gamma is not None,
                temperature=temperature, entropy=entropy, argmax=argmax, q=b.qbuf[:k], qm=b.qm[:k],
                e_rows=ec, all_valid=True,
            )  # fmt: skip
            stats.append(st)
            tiles = dz_split_tiles(k, b.qm.shape[1])
            _dz_kernel[(k, triton.cdiv(b.qm.shape[1], tiles))](
                Q=b.qbuf, Qm=b.qm, W=weight, Tgt=safe_t, Zt=st.tgt, Lse=st.lse, A0=a0, A1=a1, Beta=beta,
                Gamma=gamma, Lo=b.lo, row0=s, V=c.shape[0], n_vtiles=b.qm.shape[1], tiles=tiles,
                stride_q=b.qbuf.stride(0), th_scale=temperature / softcap if softcap > 0 else 0.0,
                HAS_SOFTCAP=softcap > 0, BLOCK_V=b.block_v,
                TILES=2 if interpreting() else DZ_TILES, num_warps=DZ_WARPS,
            )  # fmt: skip
            _chunk_products(b, ec, c, rows, safe_t, s, t, t == N)
    if b.dbias is not None and b.lo is not None:
        b.dbias.index_add_(0, safe_t, b.lo)
    dC = None if b.dC is None else b.dC[: c.shape[0]]
    cat = _concat(stats, e2d.device)
    ssum = cat("ssum") if gamma is not None else None
    ent = cat("entropy") if entropy else None
    amx = cat("argmax", torch.long) if argmax else None
    return FusedOut(cat("lse"), cat("tgt"), ssum, b.dE, dC, b.dbias, ent, amx)


@dataclass
class _Bufs:
    """The fused path's buffers: ``n`` rows per chunk; the target remainders ``lo`` (16-bit
    operands); dbias (fp32); dC in c's dtype, its rows padded to 8 classes where V is not (the
    products over the padded classes are aligned; dC is its first V rows), or with ``dc16``
    (fused_dc16) summed in scaled fp16 instead (V rows; S, dc16's scale, set by the caller); the
    chunk's q / dZ ``qbuf`` (rows padded to fused_padded_classes) and running maxima ``qm`` (per
    forward tile of ``block_v`` classes); dE and the chunk's fp32 dE rows ``de_buf`` (None: the
    product accumulates in dE itself); ``tail``: dE's products stop at the last multiple of 8
    classes and _finish_de_kernel adds the rest (an odd V with 16-bit operands)."""

    n: int
    block_v: int
    dc16: bool
    lo: torch.Tensor | None
    dbias: torch.Tensor | None
    dC: torch.Tensor | None
    qbuf: torch.Tensor
    qm: torch.Tensor
    dE: torch.Tensor | None
    de_buf: torch.Tensor | None
    tail: bool
    S: torch.Tensor | None = None


def _buffers(
    e2d: torch.Tensor, c: torch.Tensor, rows: torch.Tensor | None, N: int, grads: tuple[bool, bool, bool],
    chunk_bytes: int,
) -> _Bufs:  # fmt: skip
    """The fused path's buffers (_Bufs) for N problem rows and ``grads`` (dE, dC, dbias asked for)."""
    need_de, need_dc, need_dbias = grads
    V, D = c.shape
    dev, f32 = e2d.device, torch.float32
    lo = torch.empty(N, dtype=f32, device=dev) if (e2d.dtype != f32 and (need_de or need_dbias)) else None
    n = fused_chunk_rows(N, V, chunk_bytes, e2d.element_size())
    rows_q = min(n, N)
    block_v = config(e2d.dtype, "fwd").BLOCK_V
    # dC: written by the first chunk, accumulated by the next ones in its own storage (cuBLAS in
    # c's dtype, or scaled fp16 past FUSED_DIRECT_CHUNKS chunks: cce._dispatch.fused_dc16).
    dc16 = need_dc and fused_dc16(-(-N // n), c.dtype)
    dC = None
    if need_dc:
        V8 = V if dc16 else -(-V // 8) * 8
        dC = (torch.zeros if N == 0 else torch.empty)((V8, D), dtype=c.dtype, device=dev)
    # The pad classes [V, Vp): q and dZ are 0 there (written so that the forward's stores and
    # _dz_kernel's loads and stores stay vectorized at an odd V, and read by dC's padded product).
    qbuf = torch.empty((rows_q, fused_padded_classes(V)), dtype=e2d.dtype, device=dev)
    qm = torch.empty((rows_q, triton.cdiv(V, block_v)), dtype=f32, device=dev)
    # dE: each chunk's rows are complete after its product (the whole vocabulary is in the
    # chunk), so they are accumulated in a chunk-sized fp32 buffer and finished into dE right
    # away (the target remainders added, one rounding): no fp32 [N, D] buffer.
    dE = de_buf = None
    if need_de:
        direct = lo is None and rows is None  # fp32 operands: the product accumulates in dE itself
        dE = (torch.empty if rows is None else torch.zeros)((e2d.shape[0], D), dtype=e2d.dtype, device=dev)
        de_buf = None if direct else torch.empty((rows_q, D), dtype=f32, device=dev)
    dbias = torch.zeros(V, dtype=f32, device=dev) if need_dbias else None
    tail = need_de and lo is not None and V % 8 != 0
    return _Bufs(n, block_v, dc16, lo, dbias, dC, qbuf, qm, dE, de_buf, tail)


def _concat(stats: list, device: torch.device):
    """cat(name, dtype): a statistic of all rows from the chunks' (one chunk: as it is)."""

    def cat(name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        parts = [getattr(x, name) for x in stats]
        if len(parts) == 1:
            return parts[0]
        return torch.cat(parts) if parts else torch.empty(0, dtype=dtype, device=device)

    return cat


def _chunk_products(
    b: _Bufs, ec: torch.Tensor, c: torch.Tensor, rows: torch.Tensor | None, safe_t: torch.Tensor, s: int,
    t: int, last: bool,
) -> None:  # fmt: skip
    """The products of the chunk of problem rows [s, t) (their rows of e: ``ec``) from its dZ
    in b.qbuf: dbias += its column sums; dE's rows (in b.de_buf's fp32 rows, then finished into
    dE with the target remainders; de_buf None: in dE itself); dC written (first chunk) or
    accumulated (by cuBLAS in its dtype over its padded classes, or with b.S in scaled fp16 until
    the ``last`` chunk)."""
    k, V = t - s, c.shape[0]
    dz = b.qbuf[:k, :V]
    if b.dbias is not None:
        b.dbias += torch.sum(dz, 0, dtype=torch.float32)
    if b.S is not None:
        dc_accumulate(dz, ec.contiguous(), b.dC, b.S, first=s == 0, last=last)
    elif b.dC is not None:  # (one product: the pad classes' dZ columns are 0)
        slab_products(b.qbuf[:k, : b.dC.shape[0]], None, ec, None, b.dC, 0, None, accumulate_dc=s > 0)
    if b.dE is None:
        return
    dE_c = b.dE[s:t] if b.de_buf is None else b.de_buf[:k]
    cols = V - V % 8 if b.tail else V
    if cols == 0:  # (V < 8: _finish_de_kernel adds every class)
        dE_c.zero_()
    for k0, k1 in aligned_parts(cols) if cols else ():  # (the first part writes dE_c)
        slab_products(dz[:, k0:k1], c[k0:k1], ec, dE_c, None, k0, None, accumulate_de=k0 > 0)
    if b.de_buf is not None:
        r = None if rows is None else rows[s:t]
        if b.lo is not None:
            _finish_de(dE_c, b.lo[s:t], c, safe_t[s:t], r, s, b.dE, dz, cols)
        else:
            b.dE.index_copy_(0, r, dE_c)


# out[rows[i]] = round(dE_i + lo_i c[t_i] + sum_{v in [v0, V)} dz_iv c_v) (rows None: out[row0 +
# i]) for the rows i of one chunk: the target entries' rounding remainders and the classes past
# the products' last multiple of 8 (TAIL = V - v0 <= 7 of them at an odd V, else 0) added in fp32
# and dE rounded to the operands' dtype, in one pass over the chunk's fp32 dE.
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
    Dz,  # [n, >= V] the chunk's dZ (operands' dtype): its classes [v0, v0 + TAIL) are read
    row0, D, stride_c, stride_dz, v0,
    HAS_ROWS: tl.constexpr, TAIL: tl.constexpr, BLOCK_D: tl.constexpr,
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
        for j in tl.static_range(TAIL):
            v = v0 + j
            dz = tl.load(Dz + i * stride_dz + v).to(tl.float32)
            x += dz * tl.load(C + v * stride_c + d0 + offs, mask=m, other=0.0).to(tl.float32)
        tl.store(Out + r * D + d0 + offs, x.to(Out.dtype.element_ty), mask=m)


def _finish_de(dE, lo, c, safe_t, rows, row0: int, out: torch.Tensor, dz: torch.Tensor, v0: int) -> None:
    """out[rows or row0 + i] = round(dE_i + lo_i c[t_i] + dz_i[v0:] c[v0:]) for the chunk rows i
    of dE (fp32), dz's classes from v0 (at most 7) being those the products left out."""
    n, D = dE.shape
    if n:
        BLOCK_D = 32 if interpreting() else min(1024, triton.next_power_of_2(D))
        _finish_de_kernel[(n,)](
            DE=dE, Lo=lo, C=c, Tgt=safe_t, Rows=rows, Out=out, Dz=dz, row0=row0, D=D, stride_c=c.stride(0),
            stride_dz=dz.stride(0), v0=v0, TAIL=c.shape[0] - v0, BLOCK_D=BLOCK_D, num_warps=4,
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
