"""The dense-slab rule's decision in two launches (cce/ops/linear_ce/slab_choice.py).

slab_choice.dense_slab_flags decides which slabs of the sorted vocabulary the sparse backward
does densely from a few dozen small tensors. As torch ops that was about 70 launches per step,
host time that a step at small N or on one rank's block of the vocabulary does not hide behind
its kernels (docs/benchmarks.md, "Host time"). Here:

1. _slab_gram_kernel: the Gram matrices of the slabs' sampled errors, G[s, s'] = <err_s, err_s'>
   and, with the first-order terms, D[s, s'] = <err_s - fo_s, err_s' - fo_s'> (fp32, IEEE
   products; partial sums over chunks of the k x D entries, one program per chunk).
2. _slab_flags_kernel: one program that sums the partials and applies the rule.

The greedy rule on Gram matrices. Slabs are taken in order of decreasing ||err_s|| (rank r_s;
ties to the lower index) and made dense until the vector sum of the others' errors is at most
``bound`` = slab_error ||dE||. With A the Gram matrix restricted to the sparse slabs (rows and
columns of dense ones zeroed: dense slabs are exact),

    rem(m)^2 = ||sum_{s: r_s >= m} err_s||^2 = sum_{s, s'} A[s, s'] [min(r_s, r_s') >= m],

so the first m with rem(m)^2 <= bound^2 (rem(n) = 0) is found on the [n, n] matrix alone,
and the chosen slabs are those with r_s < m. dC's rule is the same on squared errors that add
(dc_err >= 0, no cross terms). Rounding: a sum of Gram entries errs by about fp32's epsilon
times (sum_s ||err_s||)^2, where the vector sum's norm errs relative to ||sum_s err_s|| itself;
the two differ where slabs' errors cancel each other strongly. The decisions equal the float64
rule's (tests/ops/linear_ce/test_slab_rule.py, slabs cancelling to 0.1 of their size); at a
cancellation of ~1000x a decision within a few percent of the bound can differ from the torch
form's. Non-finite inputs (a NaN estimate) make every sparse slab with an error dense here
(tl.maximum returns the number), where the torch form makes none dense: the step's gradient is
not finite either way.

The single program holds [BLOCK_S, BLOCK_S] matrices in registers: up to RULE_KERNEL_SLABS slabs
(BLOCK_S 64). More slabs mean N past ~32k rows at V = 256k (slab_tiles: 256 MB slabs), where
the step's kernels take far longer than its host work; slab_choice keeps the torch ops there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...._dispatch import interpreting
from ... import jit_math as jm
from ...launch import cached_launch
from .common import device_context, skipped_coef0, skipped_slog

# The most slabs the one-program decision holds in registers.
RULE_KERNEL_SLABS = 64
# Partial Gram sums: about this many programs over the k x D entries.
_GRAM_PROGRAMS = 128


@cached_launch
@triton.heuristics({"HAS_FO": lambda a: a["Fo"] is not None})
@triton.jit
def _slab_gram_kernel(
    Err,  # [n_slabs, L] fp32 (rows of stride stride_err): each slab's sampled errors, flattened
    Fo,  # [n_slabs, L] fp32 or None: the first-order terms' share of each slab
    Part,  # [n_programs, 2, BLOCK_S, BLOCK_S] fp32: this program's partial Gram matrices
    n_slabs, L, stride_err, stride_fo, chunk,
    HAS_FO: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_L: tl.constexpr,
):  # fmt: skip
    """Part[p, 0] = sum over l in this program's chunk of err[s, l] err[s', l]; with Fo, Part[p, 1]
    the same for d = err - fo (formed in registers: no cancellation of separate Gram terms)."""
    pid = tl.program_id(0)
    offs_s = tl.arange(0, BLOCK_S)
    smask = offs_s < n_slabs
    row_e = offs_s.to(tl.int64)[:, None] * stride_err
    acc = tl.zeros((BLOCK_S, BLOCK_S), dtype=tl.float32)  # [BLOCK_S, BLOCK_S]
    acc_d = tl.zeros((BLOCK_S, BLOCK_S), dtype=tl.float32)
    l0 = pid * chunk
    for l in range(l0, tl.minimum(l0 + chunk, L), BLOCK_L):
        offs_l = l + tl.arange(0, BLOCK_L)
        m = smask[:, None] & (offs_l < L)[None, :]
        x = tl.load(Err + row_e + offs_l[None, :], mask=m, other=0.0)  # [BLOCK_S, BLOCK_L]
        acc += tl.dot(x, tl.trans(x), input_precision="ieee")
        if HAS_FO:
            f = tl.load(Fo + offs_s.to(tl.int64)[:, None] * stride_fo + offs_l[None, :], mask=m, other=0.0)
            d = x - f
            acc_d += tl.dot(d, tl.trans(d), input_precision="ieee")
    out = Part + pid.to(tl.int64) * 2 * BLOCK_S * BLOCK_S + offs_s[:, None] * BLOCK_S + offs_s[None, :]
    tl.store(out, acc)
    if HAS_FO:
        tl.store(out + BLOCK_S * BLOCK_S, acc_d)


@triton.jit
def _ranks(x, offs_s, smask):
    """Rank of each valid entry of x [BLOCK_S] in decreasing order (ties to the lower index), as
    (row vector [BLOCK_S] indexed along axis 0, the same along axis 1)."""
    eye = offs_s[:, None] == offs_s[None, :]
    x_col = tl.sum(tl.where(eye, x[:, None], 0.0), axis=0)  # x indexed along axis 1
    # before[s, s']: s' comes before s in the order
    before = (x_col[None, :] > x[:, None]) | (
        (x_col[None, :] == x[:, None]) & (offs_s[None, :] < offs_s[:, None])
    )
    before = before & smask[None, :]
    r = tl.sum(before.to(tl.int32), axis=1)  # [BLOCK_S]
    r = tl.where(smask, r, 1 << 20)  # past every rank
    r_col = tl.sum(tl.where(eye, r[:, None], 0), axis=0)
    return r, r_col


@triton.jit
def _greedy_gram(A, bound2, offs_s, smask, n_slabs):
    """bool [BLOCK_S]: the slabs of largest A[s, s] (squared norms) as few as leave the sum of A
    over the pairs of the others at most bound2 (the module docstring)."""
    eye = offs_s[:, None] == offs_s[None, :]
    r, r_col = _ranks(tl.sum(tl.where(eye, A, 0.0), axis=1), offs_s, smask)
    minr = tl.minimum(r[:, None], r_col[None, :])  # [BLOCK_S, BLOCK_S]
    mstar = tl.full((), 0, tl.int32) + n_slabs  # (a tensor: n_slabs may be specialised to 1)
    for i in range(0, n_slabs + 1):
        m = n_slabs - i
        rem2 = tl.sum(tl.sum(tl.where(minr >= m, A, 0.0), axis=1), axis=0)
        mstar = tl.where(rem2 <= bound2, m, mstar)
    return (r < mstar) & smask


@triton.jit
def _greedy_sq(x, bound2, offs_s, smask, n_slabs):
    """bool [BLOCK_S]: the slabs of largest x[s] (squared errors that add) as few as leave the
    others' sum at most bound2."""
    r, _ = _ranks(x, offs_s, smask)
    mstar = tl.full((), 0, tl.int32) + n_slabs
    for i in range(0, n_slabs + 1):
        m = n_slabs - i
        rem2 = tl.sum(tl.where(r >= m, x, 0.0), axis=0)
        mstar = tl.where(rem2 <= bound2, m, mstar)
    return (r < mstar) & smask


@cached_launch
@triton.heuristics(
    {
        "HAS_DE": lambda a: a["Part"] is not None,
        "HAS_DC": lambda a: a["DcErr"] is not None,
        "HAS_DC_FO": lambda a: a["DcErrFo"] is not None,
    }
)
@triton.jit
def _slab_flags_kernel(
    Kept,  # [nt] int32: kept (token block, tile) pairs per tile
    NValid, Part, RefSq, DcErr, DcErrFo, DcRef,
    Dense,  # [n_slabs] int8 out
    Flag,  # [1] int32 out: 1 where the first-order terms apply
    nt, n_slabs, tps, n_parts, dense_kept, slab_error, tol_c, fo_cost,
    BLOCK_N: tl.constexpr, WITH_FO: tl.constexpr, HAS_DE: tl.constexpr, HAS_DC: tl.constexpr,
    HAS_DC_FO: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_T: tl.constexpr,
):  # fmt: skip
    """The rule of slab_choice.dense_slab_flags in one program (the module docstring)."""
    offs_s = tl.arange(0, BLOCK_S)
    smask = offs_s < n_slabs
    # Slabs whose tiles the filter mostly keeps: dense (a GEMM beats recomputing tiles one by one).
    offs_t = tl.arange(0, BLOCK_T)
    kept = tl.zeros((BLOCK_S,), dtype=tl.float32)
    tiles = tl.zeros((BLOCK_S,), dtype=tl.float32)
    for t0 in range(0, tps, BLOCK_T):
        tile = offs_s[:, None] * tps + t0 + offs_t[None, :]  # [BLOCK_S, BLOCK_T]
        tm = smask[:, None] & ((t0 + offs_t) < tps)[None, :] & (tile < nt)
        kept += tl.sum(tl.load(Kept + tile, mask=tm, other=0).to(tl.float32), axis=1)
        tiles += tl.sum(tm.to(tl.float32), axis=1)
    n_valid = tl.load(NValid).to(tl.float32)
    blocks = tl.maximum(tl.floor((n_valid + (BLOCK_N - 1)) / BLOCK_N), 1.0)
    dense = (kept / tl.maximum(blocks * tiles, 1.0) >= dense_kept) & smask
    sp = tl.where(dense | ~smask, 0.0, 1.0)
    spp = (
        sp[:, None] * tl.sum(tl.where(offs_s[:, None] == offs_s[None, :], sp[:, None], 0.0), axis=0)[None, :]
    )
    out0 = offs_s < 0
    out1 = offs_s < 0
    if HAS_DE:
        G = tl.zeros((BLOCK_S, BLOCK_S), dtype=tl.float32)
        Gd = tl.zeros((BLOCK_S, BLOCK_S), dtype=tl.float32)
        idx = offs_s[:, None] * BLOCK_S + offs_s[None, :]
        for p in range(0, n_parts):
            G += tl.load(Part + p * 2 * BLOCK_S * BLOCK_S + idx)
            if WITH_FO:
                Gd += tl.load(Part + p * 2 * BLOCK_S * BLOCK_S + BLOCK_S * BLOCK_S + idx)
        bound = slab_error * tl.sqrt(tl.maximum(tl.load(RefSq), 0.0))
        out0 = _greedy_gram(G * spp, bound * bound, offs_s, smask, n_slabs)
        if WITH_FO:
            out1 = _greedy_gram(Gd * spp, bound * bound, offs_s, smask, n_slabs)
    if HAS_DC:
        bound_c = tol_c * tol_c * tl.maximum(tl.load(DcRef), 0.0)
        x = tl.maximum(tl.load(DcErr + offs_s, mask=smask, other=0.0), 0.0) * sp
        out0 = out0 | _greedy_sq(x, bound_c, offs_s, smask, n_slabs)
        if WITH_FO:
            if HAS_DC_FO:
                x = tl.maximum(tl.load(DcErrFo + offs_s, mask=smask, other=0.0), 0.0) * sp
            out1 = out1 | _greedy_sq(x, bound_c, offs_s, smask, n_slabs)
    if WITH_FO:
        n0 = tl.sum(out0.to(tl.float32), axis=0)
        n1 = tl.sum(out1.to(tl.float32), axis=0)
        use = n1 + fo_cost < n0
        res = dense | tl.where(use, out1, out0)
        tl.store(Flag, use.to(tl.int32))
    else:
        res = dense | out0
        tl.store(Flag, 0)
    tl.store(Dense + offs_s, res.to(tl.int8), mask=smask)


def slab_flags(
    keep: torch.Tensor,
    n_valid: torch.Tensor,
    BLOCK_N: int,
    tiles_per_slab: int,
    dense_kept: float,
    slab_error: float,
    err: torch.Tensor | None,
    ref_sq: torch.Tensor | None,
    fo: torch.Tensor | None,
    first_order_cost: float | None,
    dc_err: torch.Tensor | None,
    dc_err_fo: torch.Tensor | None,
    dc_ref: torch.Tensor | None,
    tol_c: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dense int8 [n_slabs], first_order int32 [1]) by slab_choice.dense_slab_flags' rule, in
    two launches (one without ``err``): ``err`` fp32 [n_slabs, k, D] (None: dE's rule off) with
    ``ref_sq`` fp32 (||dE||^2 estimated); ``fo`` (same shape) and ``first_order_cost`` (both or
    neither: the first-order variant); ``dc_err`` / ``dc_err_fo`` fp32 [n_slabs] with ``dc_ref``
    (None: dC's rule off; dc_err_fo None: dc_err for both variants). At most RULE_KERNEL_SLABS
    slabs."""
    nt = keep.shape[1]
    dev = keep.device
    n_slabs = triton.cdiv(nt, tiles_per_slab)
    if n_slabs > RULE_KERNEL_SLABS:
        raise ValueError(f"slab_flags holds at most {RULE_KERNEL_SLABS} slabs, got {n_slabs}")
    BS = max(16, triton.next_power_of_2(n_slabs))
    with_fo = fo is not None and first_order_cost is not None
    dense = torch.empty(n_slabs, dtype=torch.int8, device=dev)
    flag = torch.empty(1, dtype=torch.int32, device=dev)
    kept = keep.sum(0, dtype=torch.int32)
    part = None
    n_parts = 0
    with device_context(dev):
        if err is not None:
            ev = err.reshape(n_slabs, -1)
            fv = fo.reshape(n_slabs, -1) if with_fo else None
            L = ev.shape[1]
            BL = 16 if interpreting() else 64
            chunk = BL * max(1, triton.cdiv(triton.cdiv(L, BL), _GRAM_PROGRAMS))
            n_parts = max(1, triton.cdiv(L, chunk))
            part = torch.empty((n_parts, 2, BS, BS), dtype=torch.float32, device=dev)
            _slab_gram_kernel[(n_parts,)](
                Err=ev, Fo=fv, Part=part, n_slabs=n_slabs, L=L, stride_err=ev.stride(0),
                stride_fo=0 if fv is None else fv.stride(0), chunk=chunk, BLOCK_S=BS, BLOCK_L=BL,
                num_warps=4,
            )  # fmt: skip
        _slab_flags_kernel[(1,)](
            Kept=kept, NValid=n_valid, Part=part, RefSq=ref_sq, DcErr=dc_err, DcErrFo=dc_err_fo,
            DcRef=dc_ref, Dense=dense, Flag=flag, nt=nt, n_slabs=n_slabs, tps=tiles_per_slab,
            n_parts=n_parts, dense_kept=float(dense_kept), slab_error=float(slab_error),
            tol_c=float(tol_c), fo_cost=float(first_order_cost or 0.0), BLOCK_N=BLOCK_N,
            WITH_FO=with_fo, BLOCK_S=BS, BLOCK_T=16, num_warps=4,
        )  # fmt: skip
    return dense, flag


@triton.jit
def skipped_coef(
    S, alpha, eta, lse, softcap, BLOCK_V: tl.constexpr, HAS_ETA: tl.constexpr, HAS_SOFTCAP: tl.constexpr
):  # fmt: skip
    """a S: a skipped tile's correction coefficient times its decoded mass S (any shape, alpha,
    eta, lse broadcast to it): alpha S, and with the entropy's term (HAS_ETA) (alpha + eta zbar) S,
    zbar the tile's p-weighted mean logit to first order (common.skipped_slog; as
    backward_sparse._sparse_de_kernel takes it)."""
    if HAS_ETA:
        slog = skipped_slog(S, lse, softcap, BLOCK_V, HAS_SOFTCAP)
        return skipped_coef0(alpha, eta, lse, BLOCK_V) * S + eta * slog
    return alpha * S


@cached_launch
@triton.heuristics({"HAS_ETA": lambda a: a["Eta"] is not None, "HAS_SLOG": lambda a: a["Slog"] is not None})
@triton.jit
def _row_mass_kernel(
    Code,  # [N, nt] uint8: encode_tile_stats' codes (255: no mass)
    Alpha,  # [N] fp32
    Eta, Lse,  # [N] fp32 the entropy's coefficient and the rows' lse, or None
    Slog,  # [N, nt] fp32 tile_stats.skipped_slogs of the codes (with Eta), or None: solved here
    Out,  # [N] fp32: sum_j |a_ij S'_ij|
    N, nt, stride_code, softcap, STEPS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_V: tl.constexpr, HAS_ETA: tl.constexpr, HAS_SLOG: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
):  # fmt: skip
    """Out[i] = sum_j |a_ij S'_ij|, the row's decoded skipped masses (tile_stats.decode_tile_mass)
    times their corrections' coefficients (skipped_coef; |alpha_i| sum_j S'_ij without eta). With
    Slog the entropy's term reads the step's skipped_slog values instead of solving them again
    (with softcap the solve is most of this kernel's time)."""
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = offs_r < N
    a = tl.load(Alpha + offs_r, mask=rmask, other=0.0)
    if HAS_ETA:
        eta = tl.load(Eta + offs_r, mask=rmask, other=0.0)
        lse = tl.load(Lse + offs_r, mask=rmask, other=0.0)
    else:
        eta = a
        lse = a
    acc = tl.zeros((BLOCK_R, BLOCK_T), dtype=tl.float32)  # [BLOCK_R, BLOCK_T]
    for t0 in range(0, nt, BLOCK_T):
        offs_t = t0 + tl.arange(0, BLOCK_T)
        m = rmask[:, None] & (offs_t < nt)[None, :]
        x = tl.load(
            Code + offs_r.to(tl.int64)[:, None] * stride_code + offs_t[None, :], mask=m, other=255
        ).to(tl.float32)
        S = tl.where(x < 255.0, tl.exp(-x / STEPS), 0.0)
        if HAS_SLOG:
            sl = tl.load(
                Slog + offs_r.to(tl.int64)[:, None] * nt + offs_t[None, :], mask=m, other=0.0
            )  # [BLOCK_R, BLOCK_T]
            a_s = skipped_coef0(a, eta, lse, BLOCK_V)[:, None] * S
            acc += tl.abs(a_s + eta[:, None] * sl)
        elif HAS_ETA:
            acc += tl.abs(
                skipped_coef(
                    S, a[:, None], eta[:, None], lse[:, None], softcap, BLOCK_V, HAS_ETA, HAS_SOFTCAP
                )
            )
        else:
            acc += S
    if HAS_ETA:
        tl.store(Out + offs_r, tl.sum(acc, axis=1), mask=rmask)
    else:
        tl.store(Out + offs_r, tl.sum(acc, axis=1) * tl.abs(a), mask=rmask)


def row_masses(
    code: torch.Tensor,
    alpha: torch.Tensor,
    steps: float,
    eta: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    block_v: int = 1,
    softcap: float = 0.0,
    slog: torch.Tensor | None = None,
) -> torch.Tensor:
    """fp32 [N]: |alpha_i| sum_j S'_ij, the decoded skipped masses (``steps`` per nat of the
    codes, tile_stats.STATS_STEPS) of each row of ``code`` [N, nt] times |alpha|; with ``eta``
    (and the rows' ``lse``, tiles of ``block_v`` classes, the ``softcap``) sum_j |a_ij S'_ij|
    (skipped_coef), its skipped_slog values read from ``slog`` (contiguous fp32 [N, nt],
    tile_stats.skipped_slogs) where given; one launch."""
    if slog is not None and (eta is None or not slog.is_contiguous() or slog.shape != code.shape):
        raise ValueError("slog must be a contiguous [N, n_tiles] tensor, given with eta")
    N, nt = code.shape
    out = torch.empty(N, dtype=torch.float32, device=code.device)
    if N == 0:
        return out
    BR, BT = (16, 16) if interpreting() else (32, 128)
    with device_context(code.device):
        _row_mass_kernel[(triton.cdiv(N, BR),)](
            Code=code, Alpha=alpha, Eta=eta, Lse=lse, Slog=slog, Out=out, N=N, nt=nt,
            stride_code=code.stride(0), softcap=float(softcap), STEPS=steps, BLOCK_R=BR, BLOCK_T=BT,
            BLOCK_V=block_v, HAS_SOFTCAP=softcap > 0,
        )  # fmt: skip
    return out


# Systematic sampling of k items of M with probabilities pi_i = w_i / W, in three launches over
# chunks of BLOCK items (a single program took 0.2-0.4 ms on 64k-128k classes of an H200):
#
#   ROWS (sample_rows):   w_i = share [i < n_valid] / n + (1 - share) m_i / sum(m)   (n = max(n_valid, 1);
#                         sum(m) = 0: w_i = [i < n_valid] / n)
#   classes:              w_i = m_i + n add                                          (dc_norm_estimate)
#
#   cdf_i = w_0 + ... + w_i (fp32: the chunks' sums in a fixed order, then a scan in the chunk),
#   u_j = (j + 1/2) / k W, W = sum_i w_i,
#   Pos[j] = #{i : cdf_i <= u_j} (torch.searchsorted(cdf, u, right=True)), clamped to M - 1 (a
#            quantile on an item's end may go to either side of it under rounding). Since
#            cdf_i <= u_j  <=>  j >= J_i = ceil(k cdf_i / W - 1/2), the counts are the cumulative
#            histogram of J (bin BLOCK_K - 1 > k - 1 collects the items past every quantile),
#   Wt[j] = 1 / sqrt(k pi_Pos[j]) for ROWS (sample_rows' scale), else 1 / (k pi_Pos[j]) (the
#           inverse of the expected draws; dc_norm_estimate's weight); 0 where pi is 0.
@cached_launch
@triton.jit
def _chunk_sums_kernel(Mass, Out, M, BLOCK: tl.constexpr):
    """Out[c] = sum of Mass over chunk c."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(Out + tl.program_id(0), tl.sum(tl.load(Mass + offs, mask=offs < M, other=0.0), axis=0))


@triton.jit
def _weights(
    Sm, NValid, M, n_chunks, share, add, ROWS: tl.constexpr, BLOCK: tl.constexpr, BLOCK_C: tl.constexpr
):
    """(a, b, lim, cw [BLOCK_C], W): w_i = a [i < lim] + b m_i, the chunks' sums of w and their
    total (the same values in every program: the same loads and reductions)."""
    offs_c = tl.arange(0, BLOCK_C)
    sm = tl.load(Sm + offs_c, mask=offs_c < n_chunks, other=0.0)
    total = tl.sum(sm, axis=0)
    nv = tl.load(NValid).to(tl.float32)
    n = tl.maximum(nv, 1.0)
    if ROWS:
        a = tl.where(total > 0, share / n, 1.0 / n)
        b = tl.where(total > 0, (1.0 - share) / tl.maximum(total, 1e-30), 0.0)
        lim = tl.minimum(nv, M * 1.0)
    else:
        a = n * add
        b = total * 0.0 + 1.0
        lim = M * 1.0
    inside = tl.minimum(tl.maximum(lim - offs_c.to(tl.float32) * BLOCK, 0.0), BLOCK * 1.0)
    cw = tl.where(offs_c < n_chunks, a * inside + b * sm, 0.0)
    return a, b, lim, cw, tl.sum(cw, axis=0)


@cached_launch
@triton.jit
def _quantile_hist_kernel(
    Mass, Sm, NValid, Counts, M, n_chunks, k, share, add,
    ROWS: tl.constexpr, BLOCK: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Counts[j] += #{i in this chunk : J_i = j} (J_i past k - 1 in bin BLOCK_K - 1)."""
    c = tl.program_id(0)
    a, b, lim, cw, W = _weights(Sm, NValid, M, n_chunks, share, add, ROWS, BLOCK, BLOCK_C)
    prefix = tl.sum(tl.where(tl.arange(0, BLOCK_C) < c, cw, 0.0), axis=0)
    idx = c * BLOCK + tl.arange(0, BLOCK)
    w = tl.where(idx < M, a * (idx < lim) + b * tl.load(Mass + idx, mask=idx < M, other=0.0), 0.0)
    cdf = prefix + tl.cumsum(w, axis=0)  # [BLOCK]
    J = tl.maximum(tl.ceil(cdf * (k / W) - 0.5), 0.0).to(tl.int32)
    J = tl.where(idx < M, tl.minimum(J, BLOCK_K - 1), BLOCK_K - 1)
    tl.atomic_add(Counts + tl.arange(0, BLOCK_K), tl.histogram(J, BLOCK_K))


@cached_launch
@triton.jit
def _quantile_pick_kernel(
    Mass, Sm, NValid, Counts, Pos, Wt, M, n_chunks, k, share, add,
    ROWS: tl.constexpr, BLOCK: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Pos[j] = the cumulative count of J up to j (clamped to M - 1), Wt[j] its weight."""
    a, b, lim, cw, W = _weights(Sm, NValid, M, n_chunks, share, add, ROWS, BLOCK, BLOCK_C)
    offs_k = tl.arange(0, BLOCK_K)
    kmask = offs_k < k
    pos = tl.minimum(tl.cumsum(tl.load(Counts + offs_k), axis=0), M - 1)
    wp = a * (pos < lim) + b * tl.load(Mass + pos, mask=kmask, other=0.0)
    kp = k * wp / W
    if ROWS:
        wt = tl.where(kp > 0, 1.0 / tl.sqrt(tl.maximum(kp, 1e-30)), 0.0)
    else:
        wt = tl.where(kp > 0, 1.0 / tl.maximum(kp, 1e-30), 0.0)
    tl.store(Pos + offs_k, pos.to(tl.int64), mask=kmask)
    tl.store(Wt + offs_k, wt, mask=kmask)


def systematic_sample(
    mass: torch.Tensor, n_valid: torch.Tensor, k: int, *, rows: bool, share: float = 0.0, add: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(pos int64 [k], wt fp32 [k]): k of the M = mass.numel() items drawn by systematic sampling
    (the comment above _chunk_sums_kernel), deterministic, no host synchronisation.
    ``rows``: probabilities share / n_valid on the valid items plus (1 - share) in proportion to
    ``mass``, and wt = 1 / sqrt(k pi); else in proportion to mass + n_valid ``add``, and
    wt = 1 / (k pi). M >= 1."""
    M = mass.numel()
    dev = mass.device
    BLOCK = 256 if interpreting() else 1024
    n_chunks = triton.cdiv(M, BLOCK)
    BK = max(16, triton.next_power_of_2(k + 1))
    meta = dict(
        M=M, n_chunks=n_chunks, share=float(share), add=float(add), ROWS=rows, BLOCK=BLOCK,
        BLOCK_C=max(16, triton.next_power_of_2(n_chunks)),
    )  # fmt: skip
    sm = torch.empty(n_chunks, dtype=torch.float32, device=dev)
    counts = torch.zeros(BK, dtype=torch.int32, device=dev)
    pos = torch.empty(k, dtype=torch.int64, device=dev)
    wt = torch.empty(k, dtype=torch.float32, device=dev)
    with device_context(dev):
        _chunk_sums_kernel[(n_chunks,)](Mass=mass, Out=sm, M=M, BLOCK=BLOCK)
        _quantile_hist_kernel[(n_chunks,)](
            Mass=mass, Sm=sm, NValid=n_valid, Counts=counts, k=k, BLOCK_K=BK, **meta, num_warps=8
        )
        _quantile_pick_kernel[(1,)](
            Mass=mass, Sm=sm, NValid=n_valid, Counts=counts, Pos=pos, Wt=wt, k=k, BLOCK_K=BK, **meta
        )
    return pos, wt


@cached_launch
@triton.heuristics({"HAS_BIAS": lambda a: a["Bias"] is not None, "HAS_ETA": lambda a: a["EtaS"] is not None})
@triton.jit
def _sampled_dz_kernel(
    Z,  # [k, V] fp32: the sampled rows' logits e_m . c_v, class order (bias not added)
    Bias, Vperm, Pos, Ok, AlphaS, BetaS, EtaS, TS, LseS, Code, Keep,
    W2,  # [2k, nt BLOCK_V] fp32 out, sorted positions: rows [0, k) the corrections' error weights, [k, 2k) dZ
    S,  # [k, nt] fp32 out: alpha_m S'_mj, the decoded skipped mass of row m in tile j (0 where kept)
    SF,  # [k, nt] fp32 out with EtaS: (a_mj + eta_m) S'_mj, the first-order terms' weight; or None
    k, V, nt, stride_z, stride_w, stride_code, stride_keep, softcap,
    STEPS: tl.constexpr, BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_ETA: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    """One sampled row m (sorted row Pos[m], weight Ok[m]: its scale, 0 past the valid rows) and
    one tile j of the sorted vocabulary (slab_choice.slab_errors):

        dZ_mv = (p_mv (a_m [+ h_m z_mv]) - b_m [v == t_m]) softcap'(z_mv)
                                      (a, b, h = alpha, beta, eta times Ok; eta: EtaS or None)
        W2[k + m, p] = dZ_m,vperm[p]
        W2[m, p]     = [tile j skipped for the row's block] dZ_m,vperm[p] (target entry 0) - S[m, j] / |j|
        S[m, j]      = a_m S'_{Pos[m], j}   (with eta: skipped_coef, the sparse backward's correction)
        SF[m, j]     = S[m, j] + h_m S'_{Pos[m], j}  (with eta: the first-order terms' weight)

    (so that W2[m] times C summed over a slab is what its rank-1 corrections get wrong, and
    W2[k + m] times C the row's exact dE); positions past V are 0."""
    m = tl.program_id(0)
    j = tl.program_id(1)
    row = tl.load(Pos + m)
    ok = tl.load(Ok + m)
    a = tl.load(AlphaS + row) * ok
    b = tl.load(BetaS + row) * ok
    t = tl.load(TS + row)
    lse = tl.load(LseS + row)
    offs_p = j * BLOCK_V + tl.arange(0, BLOCK_V)
    pm = offs_p < V
    v = tl.load(Vperm + offs_p, mask=pm, other=0)
    z = tl.load(Z + m.to(tl.int64) * stride_z + v, mask=pm, other=0.0)  # [BLOCK_V]
    if HAS_BIAS:
        z += tl.load(Bias + v, mask=pm, other=0.0).to(tl.float32)
    if HAS_SOFTCAP:
        z, th = jm.softcap(z, softcap)
        d = 1.0 - th * th
    else:
        d = 1.0
    if HAS_ETA:
        h = tl.load(EtaS + row) * ok
        p = tl.exp(z - lse)
        dz = tl.where(pm, p * (a + h * tl.where(p > 0, z, 0.0)) * d, 0.0)
    else:
        h = a
        dz = tl.where(pm, a * tl.exp(z - lse) * d, 0.0)
    is_t = (v == t) & pm
    code = tl.load(Code + row.to(tl.int64) * stride_code + j).to(tl.float32)
    mass = tl.where(code < 255.0, tl.exp(-code / STEPS), 0.0)
    s = skipped_coef(mass, a, h, lse, softcap, BLOCK_V, HAS_ETA, HAS_SOFTCAP)
    if HAS_ETA:
        tl.store(SF + m * nt + j, s + h * mass)
    skipped = tl.load(Keep + (row // BLOCK_N) * stride_keep + j) == 0
    size = tl.minimum(V - j * BLOCK_V, BLOCK_V).to(tl.float32)
    full = dz - tl.where(is_t, b * d, 0.0)
    err = tl.where(is_t, 0.0, dz) * skipped.to(tl.float32) - tl.where(pm, s / size, 0.0)
    tl.store(W2 + (k + m).to(tl.int64) * stride_w + offs_p, full)
    tl.store(W2 + m.to(tl.int64) * stride_w + offs_p, err)
    tl.store(S + m * nt + j, s)


def sampled_dz(
    z, bias, vperm, pos, ok, alpha_s, beta_s, t_s, lse_s, code, keep, softcap: float, BLOCK_N: int,
    BLOCK_V: int, steps: float, eta_s=None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(W2 fp32 [2k, nt BLOCK_V], S fp32 [k, nt], SF fp32 [k, nt]) of slab_choice.slab_errors'
    sampled rows from their logits ``z`` (fp32 [k, V], class order): the comment of
    _sampled_dz_kernel. One launch in place of some thirty torch ops. ``eta_s``: the entropy's
    coefficient per sorted row, or None (then SF is S)."""
    k, V = z.shape
    nt = code.shape[1]
    w2 = torch.empty((2 * k, nt * BLOCK_V), dtype=torch.float32, device=z.device)
    S = torch.empty((k, nt), dtype=torch.float32, device=z.device)
    SF = None if eta_s is None else torch.empty_like(S)
    if k and nt:
        with device_context(z.device):
            _sampled_dz_kernel[(k, nt)](
                Z=z, Bias=bias, Vperm=vperm, Pos=pos, Ok=ok, AlphaS=alpha_s, BetaS=beta_s, EtaS=eta_s,
                TS=t_s, LseS=lse_s, Code=code, Keep=keep, W2=w2, S=S, SF=SF, k=k, V=V, nt=nt,
                stride_z=z.stride(0), stride_w=w2.stride(0), stride_code=code.stride(0),
                stride_keep=keep.stride(0), softcap=float(softcap), STEPS=steps,
                BLOCK_N=BLOCK_N, HAS_SOFTCAP=softcap > 0, BLOCK_V=BLOCK_V,
            )  # fmt: skip
    return w2, S, S if SF is None else SF


# dC's squared error per tile from the sampled rows (slab_choice.dc_error_terms). For the k
# sampled rows m and the positions p < V of tile j (sorted vocabulary):
#
#   W0[m, p] = w[m, p] + S[m, j] (1 / |j| - q[p])              (the correction spread by q)
#   W1[m, p] = w[m, p] - X[m, vperm[p]] F[m] rate[j] / |j|      (the first-order terms': spread
#                                                                uniform, their x_mv share off)
#   Out[b, j] = sum_p sum_{m, m'} W_b[m, p] P[m, m'] W_b[m', p]
#
# with P = pair_scale x Pair, its diagonal zeroed with ZERO_DIAG (the U-statistic leaves out the
# rows' squares where rows are sampled). The k rows go in blocks of BLOCK_K, fp32 IEEE products
# (an estimate, but one that is exact when every row is sampled: tests compare it with float64).
@triton.jit
def _dc_weights(
    W, S, Q, X, Vperm, F, offs_m, offs_p, j, inv_size, rate, k, V, nt, stride_w, stride_x,
    FO: tl.constexpr,
):  # fmt: skip
    """W0 (FO False) or W1 (FO True) of the rows offs_m, [BLOCK_K, BLOCK_V]; 0 past k and V."""
    mm = offs_m < k
    pm = offs_p < V
    msk = mm[:, None] & pm[None, :]
    w = tl.load(W + offs_m.to(tl.int64)[:, None] * stride_w + offs_p[None, :], mask=msk, other=0.0)
    if FO:
        v = tl.load(Vperm + offs_p, mask=pm, other=0).to(tl.int64)
        x = tl.load(X + offs_m.to(tl.int64)[:, None] * stride_x + v[None, :], mask=msk, other=0.0)
        f = tl.load(F + offs_m, mask=mm, other=0.0)
        return w - x * (f * (rate * inv_size))[:, None]
    s = tl.load(S + offs_m * nt + j, mask=mm, other=0.0)
    q = tl.load(Q + offs_p, mask=pm, other=0.0)
    return tl.where(msk, w + s[:, None] * (inv_size - q)[None, :], 0.0)


@triton.jit
def _dc_pair_product(
    acc, pair, wm, W, S, Q, X, Vperm, F, offs_n, offs_p, j, inv_size, rate, k, V, nt, stride_w, stride_x,
    FO: tl.constexpr, ONE_BLOCK: tl.constexpr,
):  # fmt: skip
    """acc + pair @ W_b[offs_n] (b = FO), [BLOCK_K, BLOCK_V]: with ONE_BLOCK the rows offs_n are
    offs_m's, so their weights are ``wm`` as formed; otherwise formed for offs_n."""
    if ONE_BLOCK:
        wn = wm
    else:
        wn = _dc_weights(
            W, S, Q, X, Vperm, F, offs_n, offs_p, j, inv_size, rate, k, V, nt, stride_w, stride_x, FO
        )
    return tl.dot(pair, wn, acc, input_precision="ieee")


@cached_launch
@triton.heuristics({"HAS_FO": lambda a: a["X"] is not None, "ONE_BLOCK": lambda a: a["k"] <= a["BLOCK_K"]})
@triton.jit
def _dc_error_kernel(
    W,  # [k, >= V] fp32 (rows of stride stride_w): the corrections' error weights (sampled_dz)
    S,  # [k, nt] fp32: alpha_m S'_mj (sampled_dz)
    Q,  # [nt BLOCK_V] fp32: the mean-row spread within each tile (0 past V)
    Pair,  # [k, k] fp32: s_m s_m' (e_m . e_m')
    X, Vperm, Rate, F,  # with the first-order terms: [k, V] fp32 x_mv (class order), [V], [nt], [k]; or None
    Out,  # [2, stride_out] fp32 out: row 0 the Out[0, j] above, row 1 Out[1, j] (HAS_FO)
    k, V, nt, stride_w, stride_x, stride_out, pair_scale,
    ZERO_DIAG: tl.constexpr, HAS_FO: tl.constexpr, ONE_BLOCK: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
):  # fmt: skip
    """With ONE_BLOCK (k <= BLOCK_K: the sampled rows in one block) each weight tile is formed
    once, one gather of X by Vperm per tile; otherwise per pair of row blocks."""
    j = tl.program_id(0)
    offs_p = j * BLOCK_V + tl.arange(0, BLOCK_V)
    inv_size = 1.0 / tl.minimum(V - j * BLOCK_V, BLOCK_V).to(tl.float32)
    rate = 0.0
    if HAS_FO:
        rate = tl.load(Rate + j)
    col0 = tl.zeros([BLOCK_V], dtype=tl.float32)
    col1 = tl.zeros([BLOCK_V], dtype=tl.float32)
    for m0 in range(0, k, BLOCK_K):
        offs_m = m0 + tl.arange(0, BLOCK_K)
        wm0 = _dc_weights(
            W, S, Q, X, Vperm, F, offs_m, offs_p, j, inv_size, rate, k, V, nt, stride_w, stride_x, False
        )  # [BLOCK_K, BLOCK_V]
        if HAS_FO:
            wm1 = _dc_weights(
                W, S, Q, X, Vperm, F, offs_m, offs_p, j, inv_size, rate, k, V, nt, stride_w, stride_x, True
            )
        acc0 = tl.zeros([BLOCK_K, BLOCK_V], dtype=tl.float32)
        acc1 = tl.zeros([BLOCK_K, BLOCK_V], dtype=tl.float32)
        for m1 in range(0, k, BLOCK_K):
            offs_n = m1 + tl.arange(0, BLOCK_K)
            pmask = (offs_m < k)[:, None] & (offs_n < k)[None, :]
            pair = tl.load(Pair + offs_m[:, None] * k + offs_n[None, :], mask=pmask, other=0.0)
            if ZERO_DIAG:
                pair = tl.where(offs_m[:, None] == offs_n[None, :], 0.0, pair)
            pair = pair * pair_scale  # [BLOCK_K, BLOCK_K]
            acc0 = _dc_pair_product(
                acc0, pair, wm0, W, S, Q, X, Vperm, F, offs_n, offs_p, j, inv_size, rate, k, V, nt,
                stride_w, stride_x, False, ONE_BLOCK,
            )  # fmt: skip
            if HAS_FO:
                acc1 = _dc_pair_product(
                    acc1, pair, wm1, W, S, Q, X, Vperm, F, offs_n, offs_p, j, inv_size, rate, k, V, nt,
                    stride_w, stride_x, True, ONE_BLOCK,
                )  # fmt: skip
        col0 += tl.sum(wm0 * acc0, axis=0)
        if HAS_FO:
            col1 += tl.sum(wm1 * acc1, axis=0)
    tl.store(Out + j, tl.sum(col0, axis=0))
    if HAS_FO:
        tl.store(Out + stride_out + j, tl.sum(col1, axis=0))


# Rows of one block in _dc_error_kernel: ERROR_ROWS (slab_choice) = 32 sampled rows take one.
DC_ERROR_ROWS = 32


def dc_tile_errors(
    w, S, q, pair, zero_diag: bool, pair_scale: float, V: int, n_out: int, x=None, vperm=None, rate=None,
    f=None,
) -> torch.Tensor:  # fmt: skip
    """fp32 [2, n_out]: the per-tile sums Out[0, j] (and Out[1, j] with ``x``, the first-order
    terms' variant: x, vperm, rate (fp32 [nt], M_j / sum M) and f (fp32 [k]) all given) of the
    comment above _dc_error_kernel for tiles j < nt (S's columns); entries past nt (and row 1
    without x) are 0. One launch in place of some thirty torch ops over [k, V] temporaries."""
    k, nt = S.shape
    BV = q.numel() // max(1, nt)
    out = torch.zeros((2, n_out), dtype=torch.float32, device=w.device)
    BK = max(16, min(triton.next_power_of_2(k), DC_ERROR_ROWS))
    if k and nt:
        with device_context(w.device):
            _dc_error_kernel[(nt,)](
                W=w, S=S, Q=q, Pair=pair, X=x, Vperm=vperm, Rate=rate, F=f, Out=out, k=k, V=V, nt=nt,
                stride_w=w.stride(0), stride_x=0 if x is None else x.stride(0), stride_out=out.stride(0),
                pair_scale=float(pair_scale), ZERO_DIAG=zero_diag, BLOCK_K=BK, BLOCK_V=BV, num_warps=8,
            )  # fmt: skip
    return out
