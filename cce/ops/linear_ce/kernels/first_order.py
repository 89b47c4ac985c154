"""First-order corrections of the sparse backward's skipped tiles, in launches the device gates.

The rank-1 corrections (backward_sparse.py) replace a skipped tile's non-target gradient by its
mass times the tile means. That is the zeroth-order term of p_iv about the tile: with
delta_v = c_v - mean(C_j) and x_iv = e_i . delta_v (the logit's deviation within tile j),

    p_iv = A_ij exp(x_iv) ~ (S_ij / |j|) (1 + x_iv)                  (sum_{v in j} x_iv = 0)

so the first-order terms of what the tile gives dE_i and dC_v are

    dE_i += alpha_i sum_j (S_ij / |j|) G_j e_i,        G_j = sum_{v in j} delta_v delta_v^T
    dC_v += sum_i alpha_i (S_ij / |j|) e_i e_i^T delta_v

On a near-uniform softmax (an untrained model, random logits) these carry the whole non-target
gradient that the rank-1 terms miss (it points along e_i: E[exp(e . d) d] = Cov(d) e E[exp(e . d)]
for Gaussian d), an error of about 1 / sqrt(D) of dE without them. They are applied with one
D x D matrix each, assuming the within-tile covariance alike over tiles and the skipped mass
separable into a row and a tile factor:

    sum_j (S_ij / |j|) G_j  ~  S_i Gbar,     Gbar = (1 / V) sum_v delta_v delta_v^T
    sum_i alpha_i (S_ij / |j|) e_i e_i^T  ~  (r_j / |j|) H,   H = sum_i alpha_i S_i e_i e_i^T,
                                                              r_j = m_j / sum_j m_j

(S_i = sum_j S_ij over the row's skipped tiles, m_j = sum_i S_ij over the tile's skipped rows).

With the entropy's term (dZ_iv = p_iv (alpha_i + eta_i z_iv), cce/_math.py) the same expansion,
z_iv = lse_i + log p_iv and log p_iv ~ log(S_ij / |j|) + x_iv, gives

    dZ_iv ~ (S_ij / |j|) (a_ij + (a_ij + eta_i) x_iv),   a_ij = alpha_i + eta_i (lse_i + log(S_ij / |j|))

(the kernels take |j| = BLOCK_V for every tile, the last, partial one too, and with softcap
solve for the codes' softcap' factor: common.skipped_slog)

(the rank-1 corrections take a_ij, backward_sparse.py), so alpha_i S_i above becomes
sum_j (a_ij + eta_i) S_ij, in the dE term and in H alike (r_j stays the mass's spread).
Cost: Gbar V D^2 multiply-adds (symmetric, upper tiles only), H 2 N D^2, the dC term 2 V D^2,
the dE term 2 N D^2 inside the dE writer: about 2 D / N of a logits pass, so the device turns
them on only where the measured error needs it and they cost less than dense slabs
(slab_choice.dense_slab_flags). Here: the gated Gram kernel and the gated dC term.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ...._dispatch import interpreting, num_sms
from ...launch import cached_launch
from .common import device_context, mm_f32, precision, tensor_descriptor, tma_rows_ok, use_tma


@dataclass
class FirstOrder:
    """The first-order terms' operands (triton_backward.first_order_terms builds them): ``flag``
    int32 [1] on the device (0: every launch below and the dE writer's term are no-ops); ``gram``
    Gbar / ``gscale`` in the operand dtype; ``cm`` fp32 [n_tiles, D] the tile means; for dC
    (None without it) ``H`` fp32 [D, D], ``rate`` fp32 [n_tiles] r_j / |j| and ``tile_of``
    int32 [V]."""

    flag: torch.Tensor
    gram: torch.Tensor
    gscale: torch.Tensor
    cm: torch.Tensor
    H: torch.Tensor | None = None
    rate: torch.Tensor | None = None
    tile_of: torch.Tensor | None = None


# The first-order GEMMs' time per flop relative to the dense slabs' (their D x D outputs
# reduce over V or N by split-K atomics). Measured on an H100 at llama3-70b's head (D = 8192,
# N = 8192, random logits): the Gram kernels and the dC term ran at 300-330 TFLOP/s, the dense
# slabs at 650 (docs/benchmarks.md); counted at par, the terms were turned on where they cost
# more than the slabs they replaced (132 ms against 112 without them).
SLOWDOWN = 2.0


def first_order_cost(N: int, V: int, D: int, slab_width: int) -> float:
    """The first-order terms' time in dense slabs of ``slab_width`` classes (3 passes of
    2 N width D each): Gbar V D^2 (symmetric), H and the dE term 2 N D^2 each, the dC term
    2 V D^2, at SLOWDOWN times a slab's time per flop."""
    return SLOWDOWN * (3.0 * V * D + 4.0 * N * D) / (6.0 * max(N, 1) * max(slab_width, 1))


def first_order_config(tma: bool = False) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) of the two GEMMs here (with tensor
    descriptors: the dE / dC slab GEMMs' best on an H100, docs/benchmarks.md)."""
    if interpreting():
        return 16, 16, 16, 4, 1
    if tma:
        return 128, 256, 64, 8, 4
    return 128, 128, 64, 8, 3


def _tma(x: torch.Tensor) -> bool:
    return use_tma(x, x) and tma_rows_ok(x)


@cached_launch
@triton.heuristics(
    {
        "HAS_ROWS": lambda a: a["Rows"] is not None,
        "HAS_W": lambda a: a["W"] is not None,
        "USE_TMA": lambda a: a["Xd"] is not None,
    }
)
@triton.jit
def _gram_kernel(
    X,  # [*, D] rows
    Xd,  # descriptor of X [R, D] with [BLOCK_K, BLOCK_M] blocks (no Rows, no W), or None
    Rows,  # [R] int: the rows of X taken (None: X's first R rows)
    W,  # [R] fp32 row weights, or None (1)
    Flag,  # [1] int32: 0 turns the launch into a no-op
    G,  # [D, D] fp32, accumulated (atomics)
    R, D, stride_x, rows_per_split, scale,
    HAS_ROWS: tl.constexpr, HAS_W: tl.constexpr, USE_TMA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """G += scale X_r^T diag(w) X_r over the rows [s rows_per_split, (s + 1) rows_per_split) of
    X_r = X[Rows] for program (pair, s), ``pair`` numbering the upper-triangle tile pairs
    (tm, tn), tm <= tn, row by row (BLOCK_M == BLOCK_N); an off-diagonal tile is added at its
    mirror as well, so G comes out whole and symmetric. The weights scale one operand in fp32
    before its rounding to X's dtype."""
    if tl.load(Flag) == 0:
        return
    pair = tl.program_id(0)
    split = tl.program_id(1)
    # (tm, tn) of the pair: row tm holds nb - tm pairs (a scalar walk over at most nb rows).
    nb = tl.cdiv(D, BLOCK_M)
    tm = 0
    rem = pair
    for _ in range(0, nb):
        if rem >= nb - tm:
            rem -= nb - tm
            tm += 1
    tn = tm + rem
    offs_m = tm * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tn * BLOCK_N + tl.arange(0, BLOCK_N)
    mm = offs_m < D
    nm = offs_n < D
    r0 = split * rows_per_split
    r1 = tl.minimum(r0 + rows_per_split, R)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(r0, r1, BLOCK_K):
        if USE_TMA:
            # rows_per_split is a multiple of BLOCK_K: a block never crosses into the next split
            a = Xd.load([k0, tm * BLOCK_M])  # [BLOCK_K, BLOCK_M], zeros past R and D
            b = Xd.load([k0, tn * BLOCK_N])
        else:
            offs_k = k0 + tl.arange(0, BLOCK_K)
            km = offs_k < r1
            if HAS_ROWS:
                rows = tl.load(Rows + offs_k, mask=km, other=0).to(tl.int64)[:, None] * stride_x
            else:
                rows = offs_k.to(tl.int64)[:, None] * stride_x
            a = tl.load(
                X + rows + offs_m[None, :], mask=km[:, None] & mm[None, :], other=0.0
            )  # [BLOCK_K, BM]
            b = tl.load(
                X + rows + offs_n[None, :], mask=km[:, None] & nm[None, :], other=0.0
            )  # [BLOCK_K, BN]
            if HAS_W:
                w = tl.load(W + offs_k, mask=km, other=0.0)
                b = (b.to(tl.float32) * w[:, None]).to(X.dtype.element_ty)
        acc = tl.dot(tl.trans(a), b, acc, input_precision=PRECISION)
    acc *= scale
    ptr = G + offs_m.to(tl.int64)[:, None] * D + offs_n[None, :]
    tl.atomic_add(ptr, acc, mask=mm[:, None] & nm[None, :], sem="relaxed")
    if tm != tn:
        ptr_t = G + offs_n.to(tl.int64)[None, :] * D + offs_m[:, None]
        tl.atomic_add(ptr_t, acc, mask=mm[:, None] & nm[None, :], sem="relaxed")


def gram(
    x: torch.Tensor,
    flag: torch.Tensor,
    rows: torch.Tensor | None = None,
    w: torch.Tensor | None = None,
    splits: int | None = None,
    *,
    scale: float = 1.0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """fp32 [D, D] scale x_r^T diag(w) x_r, x_r = x[rows] (all of x without ``rows``; w fp32, 1
    without), with fp32 accumulation, if flag (int32 [1] on the device) is nonzero, else zeros;
    added to ``out`` (fp32 [D, D], returned) where given; no host synchronisation. The
    upper-triangle tiles split the rows over ``splits`` programs each (default: enough programs
    to fill the device about twice). fp32 operands go through
    TF32 products on a GPU (2^-11 relative per product; ieee fp32 dots ran 40x slower on an
    H100), exactly in the interpreter."""
    R = x.shape[0] if rows is None else rows.numel()
    D = x.shape[1]
    tma = rows is None and w is None and _tma(x)
    BM, _BN, BK, warps, stages = first_order_config()
    prec = precision(x.dtype)
    if tma:
        BM, BK, warps, stages = 128, 64, 8, 4
    elif x.dtype == torch.float32 and not interpreting():
        BK, prec = 32, "tf32"
    g = torch.zeros((D, D), dtype=torch.float32, device=x.device) if out is None else out
    if R == 0 or D == 0:
        return g
    nb = triton.cdiv(D, BM)
    pairs = nb * (nb + 1) // 2
    if splits is None:
        sms = 4 if interpreting() else num_sms(x.device)
        splits = max(1, min(triton.cdiv(R, 4 * BK), triton.cdiv(2 * sms, pairs)))
    per = triton.cdiv(triton.cdiv(R, splits), BK) * BK
    with device_context(x.device):
        _gram_kernel[(pairs, triton.cdiv(R, per))](
            X=x, Xd=tensor_descriptor().from_tensor(x, [BK, BM]) if tma else None, Rows=rows, W=w,
            Flag=flag, G=g, R=R, D=D, stride_x=x.stride(0), rows_per_split=per, scale=float(scale),
            BLOCK_M=BM, BLOCK_N=BM, BLOCK_K=BK, PRECISION=prec, num_warps=warps,
            num_stages=stages,
        )  # fmt: skip
    return g


@cached_launch
@triton.heuristics({"USE_TMA": lambda a: a["Cd"] is not None})
@triton.jit
def _dc_first_order_kernel(
    C,  # [V, D] classifier
    Cd, Hd,  # descriptors of C [BLOCK_M, BLOCK_K] and Hn [BLOCK_K, BLOCK_N], or None
    Hn,  # [D, D] H / HScale in c's dtype
    HScale,  # [1] fp32
    CmH,  # [n_tiles, D] fp32 mean(C_j) @ H
    TileOf,  # [V] int32: each class's tile (sorted position // BLOCK_V)
    Rate,  # [n_tiles] fp32: r_j / |j|, 0 for tiles without skipped mass
    Flag,  # [1] int32: 0 turns the launch into a no-op
    dC,  # [V, D], read and written
    V, D, stride_c, stride_dc, stride_cmh,
    USE_TMA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """dC[v, cols] += (r_j / |j|) (c_v @ H - mean(C_j) @ H)[cols], j = TileOf[v], for a block of
    classes v and a D chunk of columns (fp32 accumulation; one rounding to dC's dtype)."""
    if tl.load(Flag) == 0:
        return
    # Consecutive programs take the column chunks of one class block: its rows of C are read
    # from memory once and from L2 after (Hn, D x D, stays in L2).
    pid = tl.program_id(0)
    n_chunks = tl.cdiv(D, BLOCK_N)
    offs_v = (pid // n_chunks) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = (pid % n_chunks) * BLOCK_N + tl.arange(0, BLOCK_N)
    vm = offs_v < V
    nm = offs_n < D
    vid = offs_v.to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):
        if USE_TMA:
            a = Cd.load([(pid // n_chunks) * BLOCK_M, k0])  # zeros past V and D
            b = Hd.load([k0, (pid % n_chunks) * BLOCK_N])
        else:
            offs_k = k0 + tl.arange(0, BLOCK_K)
            km = offs_k < D
            a = tl.load(
                C + vid[:, None] * stride_c + offs_k[None, :], mask=vm[:, None] & km[None, :], other=0.0
            )
            b = tl.load(
                Hn + offs_k.to(tl.int64)[:, None] * D + offs_n[None, :],
                mask=km[:, None] & nm[None, :],
                other=0.0,
            )
        acc = tl.dot(a, b, acc, input_precision=PRECISION)  # [BLOCK_M, BLOCK_N]
    j = tl.load(TileOf + offs_v, mask=vm, other=0).to(tl.int64)
    rate = tl.load(Rate + j, mask=vm, other=0.0)
    m = vm[:, None] & nm[None, :]
    cmh = tl.load(CmH + j[:, None] * stride_cmh + offs_n[None, :], mask=m, other=0.0)
    corr = rate[:, None] * (acc * tl.load(HScale) - cmh)
    ptr = dC + vid[:, None] * stride_dc + offs_n[None, :]
    old = tl.load(ptr, mask=m, other=0.0).to(tl.float32)
    tl.store(ptr, (old + corr).to(dC.dtype.element_ty), mask=m)


def normalized(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(x / s in ``dtype``, s fp32 [1]): fp16 takes s = max |x| (1 where x is 0), so that
    operands of any scale fit its range; bf16 and fp32 have fp32's range and take s = 1 (two
    fewer passes over x)."""
    if dtype != torch.float16:
        return x.to(dtype), torch.ones(1, dtype=torch.float32, device=x.device)
    s = x.abs().amax().reshape(1)
    s = torch.where(s > 0, s, 1.0)
    return (x / s).to(dtype), s


def add_dc_first_order(
    dC: torch.Tensor,
    c: torch.Tensor,
    H: torch.Tensor,
    cm: torch.Tensor,
    tile_of: torch.Tensor,
    rate: torch.Tensor,
    flag: torch.Tensor,
) -> None:
    """dC[v] += rate[j] (c_v - cm[j]) @ H for j = tile_of[v], in place, if flag is nonzero (no
    host synchronisation); H fp32 [D, D], cm fp32 [n_tiles, D] the tile means."""
    V, D = c.shape
    if V == 0 or D == 0:
        return
    hn, hs = normalized(H, c.dtype)
    # mean(C_j) @ H from the same rounded operands as the kernel's c_v @ H (both cancel in
    # fp32 where the tile mean dominates; a tile's error is 2^-8 of |mean(C_j) H| there).
    cmh = mm_f32(cm.to(c.dtype), hn, hs)  # [n_tiles, D] fp32
    tma = _tma(c) and tma_rows_ok(hn)
    BM, BN, BK, warps, stages = first_order_config(tma)
    TD = tensor_descriptor()
    with device_context(c.device):
        _dc_first_order_kernel[(triton.cdiv(V, BM) * triton.cdiv(D, BN),)](
            C=c, Cd=TD.from_tensor(c, [BM, BK]) if tma else None,
            Hd=TD.from_tensor(hn, [BK, BN]) if tma else None, Hn=hn, HScale=hs, CmH=cmh, TileOf=tile_of,
            Rate=rate, Flag=flag, dC=dC, V=V, D=D,
            stride_c=c.stride(0), stride_dc=dC.stride(0), stride_cmh=cmh.stride(0), BLOCK_M=BM,
            BLOCK_N=BN, BLOCK_K=BK, PRECISION=precision(c.dtype), num_warps=warps, num_stages=stages,
        )  # fmt: skip
