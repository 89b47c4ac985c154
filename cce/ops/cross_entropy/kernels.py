"""Logits-level cross entropy: online-softmax forward (per-row statistics) and recomputing backward.

Layout: logits ``(..., V)`` seen as N rows of V classes (class dim LAST). Row ``i`` starts at element
``row_off[i]`` when a row-offset table is given (leading dims that cannot be flattened into one
stride), else at ``i * stride_n``. The last dim must be unit-stride (the launchers copy otherwise).

Forward: one program per (row, vocabulary split). It streams its slice of the row once, keeping a
running max ``m`` and a running sum ``s = sum exp(L - m)`` (one exp per element, in base 2), and
writes the row's lse, target logit and (label smoothing only) ``ssum = sum_v w_v L_v``. With
several splits per row each program writes a partial lse / ssum, combined by a tiny torch op.
Ignored rows are not read at all.

Backward: one program per (row, split) recomputes ``p = exp(L - lse)`` and writes
``dL = (alpha p - beta [v == t] - gamma w) * softcap'`` in the logits' dtype, possibly into the
logits buffer itself (each element is read before it is overwritten, by the same thread). Ignored
rows write zeros without reading.

Both loops run over full blocks without a bounds mask (so the loads stay 16-byte vectors) and
finish with one masked tail block. Offsets are int64: N * V passes 2^31 at N=16384, V=256000.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..._dispatch import interpreting, num_sms
from .. import jit_math as jm
from ..launch import cached_launch

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)
LN2: tl.constexpr = tl.constexpr(0.6931471805599453)


@triton.jit
def _capped(x, softcap, HAS_SOFTCAP: tl.constexpr):
    """(L, th): L = softcap * tanh(x / softcap) and th = tanh(x / softcap); (x, x) without softcap."""
    if HAS_SOFTCAP:
        L, th = jm.softcap(x, softcap)
    else:
        L, th = x, x
    return L, th


@triton.jit
def _fwd_block(
    x, cols, live, w, m, s, ssum, hs, av, amax, softcap, inv_temp,
    HAS_SOFTCAP: tl.constexpr, HAS_SMOOTHING: tl.constexpr, HAS_TEMP: tl.constexpr,
    ENTROPY: tl.constexpr, ARGMAX: tl.constexpr, TAIL: tl.constexpr,
):  # fmt: skip
    """One block of the online softmax; x already holds -inf at masked-off classes (TAIL: the
    columns where ``live`` is false, past the row's end).

    m is the running max of L * log2(e); s = sum 2^(L log2 e - m). Masked entries contribute
    exp2(-inf) = 0 to s and (via w = 0) nothing to ssum. L = softcap(x) [* inv_temp].

    ENTROPY: hs = sum 2^(L2 - m) (L2 - m), relative to the running max (rescaled when it grows:
    hs' = 2^(m - m') (hs + (m - m') s)); the entropy is ln 2 (log2 s - hs / s). ARGMAX: av, the
    running max of L, and amax the smallest class reaching it.
    """
    L, _ = _capped(x, softcap, HAS_SOFTCAP)
    if HAS_SOFTCAP and TAIL:
        # columns past the row's end are loaded as -inf, which the softcap would map to the live
        # -softcap: masked by position (a logit of -inf inside the row is softcap(-inf) = -softcap,
        # as F.cross_entropy of the capped logits has it)
        L = tl.where(live, L, float("-inf"))
    if HAS_TEMP:
        L = L * inv_temp
    if ARGMAX:
        mx = tl.max(L, 0)
        ti = tl.min(tl.where(L == mx, cols, 2147483647), 0)
        amax = tl.where(mx > av, ti, tl.where(mx == av, tl.minimum(amax, ti), amax))
        av = tl.maximum(av, mx)
    L2 = L * LOG2E
    m_new = tl.maximum(m, tl.max(L2, 0))
    # A block of -inf logits (masked classes) with nothing finite before it leaves m_new = -inf:
    # the exponents are then taken against 0 (-inf - -inf would be NaN; s stays 0 either way).
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    d = L2 - m_ref
    pe = tl.exp2(d)
    scale = tl.exp2(m - m_ref)
    if ENTROPY:
        # (s = 0 before the first live block; 0 * -inf at masked classes)
        hs = tl.where(s > 0, scale * (hs + (m - m_ref) * s), 0.0)
        hs += tl.sum(tl.where(pe > 0, pe * d, 0.0), 0)
    s = s * scale + tl.sum(pe, 0)
    if HAS_SMOOTHING:
        ssum += tl.sum(tl.where(w != 0, L, 0.0) * w, 0)  # masked: L = -inf, w = 0
    return m_new, s, ssum, hs, av, amax


@cached_launch
@triton.heuristics(
    {
        "HAS_ROW_OFF": lambda a: a["ROW_OFF"] is not None,
        "HAS_WEIGHT": lambda a: a["W"] is not None,
        "HAS_SMOOTHING": lambda a: a["SSUM"] is not None,
        "ENTROPY": lambda a: a["ENT"] is not None,
        "ARGMAX": lambda a: a["AMX"] is not None,
    }
)
@triton.jit
def _ce_fwd_kernel(
    X,  # logits, rows of V classes
    ROW_OFF,  # [N] int64 row offsets, or None: row i at i * stride_n
    stride_n,
    T,  # [N] targets
    W,  # [V] class weights, or None (ones)
    LSE,  # [N] fp32, or [N, n_splits] partial lse (SPLIT)
    TGT,  # [N] fp32 target logit
    SSUM,  # [N] or [N, n_splits] fp32 weighted logit sums, or None (no label smoothing)
    ENT,  # [N] or [N, n_splits] fp32 entropy (of the split's own softmax), or None
    AMV,  # [N, n_splits] fp32 the split's max logit (SPLIT and ARGMAX), or None
    AMX,  # [N] int64 or [N, n_splits] int32 argmax, or None
    V,
    v_per_split,  # multiple of BLOCK_V
    n_splits,
    ignore_index,
    softcap,
    inv_temp,
    HAS_ROW_OFF: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    HAS_TEMP: tl.constexpr,
    ENTROPY: tl.constexpr,
    ARGMAX: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    t = tl.load(T + row).to(tl.int64)
    active = t != ignore_index
    if HAS_ROW_OFF:
        base = tl.load(ROW_OFF + row)
    else:
        base = row * stride_n
    x_row = X + base
    v_start = split * v_per_split
    v_end = tl.minimum(v_start + v_per_split, V)
    n_full = (v_end - v_start) // BLOCK_V
    n_full = tl.where(active, n_full, 0)  # ignored rows: read nothing
    offs = tl.arange(0, BLOCK_V)

    m = tl.full((), float("-inf"), tl.float32)
    s = tl.zeros((), tl.float32)
    ssum = tl.zeros((), tl.float32)
    hs = tl.zeros((), tl.float32)
    av = tl.full((), float("-inf"), tl.float32)
    amax = tl.zeros((), tl.int32)
    one = tl.full((BLOCK_V,), 1.0, tl.float32)
    for b in range(0, n_full):
        cols = v_start + b * BLOCK_V + offs  # [BLOCK_V]
        x = tl.load(x_row + cols).to(tl.float32)
        w = one
        if HAS_WEIGHT:
            w = tl.load(W + cols).to(tl.float32)
        m, s, ssum, hs, av, amax = _fwd_block(
            x, cols, None, w, m, s, ssum, hs, av, amax, softcap, inv_temp,
            HAS_SOFTCAP, HAS_SMOOTHING, HAS_TEMP, ENTROPY, ARGMAX, False,
        )  # fmt: skip
    # Tail block (partial or empty); all masked for ignored rows. (The mask is one comparison:
    # the interpreter rejects a block mask combined with a scalar condition.)
    cols = v_start + n_full * BLOCK_V + offs
    mask = cols < tl.where(active, v_end, v_start)
    x = tl.load(x_row + cols, mask=mask, other=float("-inf")).to(tl.float32)
    w = tl.where(mask, 1.0, 0.0)
    if HAS_WEIGHT:
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    m, s, ssum, hs, av, amax = _fwd_block(
        x, cols, mask, w, m, s, ssum, hs, av, amax, softcap, inv_temp,
        HAS_SOFTCAP, HAS_SMOOTHING, HAS_TEMP, ENTROPY, ARGMAX, True,
    )  # fmt: skip

    lse = (m + tl.log2(s)) * LN2
    lse = tl.where(active, lse, 0.0)
    ssum = tl.where(active, ssum, 0.0)
    if ENTROPY:
        # (a split whose classes are all masked has s = 0 and no mass: 0, weighted by 0 below)
        ent = tl.where(active & (s > 0), (tl.log2(s) - hs / s) * LN2, 0.0)
    else:
        ent = hs  # (not stored)
    _store_row_stats(
        LSE, SSUM, ENT, AMV, AMX, row, split, n_splits, lse, ssum, ent, av, amax,
        HAS_SMOOTHING, ENTROPY, ARGMAX, SPLIT,
    )  # fmt: skip
    if split == 0:
        safe_t = tl.where(active, t, 0)  # an ignored row reads its first element, then drops it
        xt = tl.load(x_row + safe_t).to(tl.float32)
        Lt, _ = _capped(xt, softcap, HAS_SOFTCAP)
        if HAS_TEMP:
            Lt = Lt * inv_temp
        tl.store(TGT + row, tl.where(active, Lt, 0.0))


@triton.jit
def _store_row_stats(
    LSE, SSUM, ENT, AMV, AMX, row, split, n_splits, lse, ssum, ent, av, amax,
    HAS_SMOOTHING: tl.constexpr, ENTROPY: tl.constexpr, ARGMAX: tl.constexpr, SPLIT: tl.constexpr,
):  # fmt: skip
    """A (row, split)'s statistics: at [row, split] of the partials with SPLIT (the split's max
    logit in AMV, its argmax as int32), else the row's own (its argmax as int64)."""
    if SPLIT:
        tl.store(LSE + row * n_splits + split, lse)
        if HAS_SMOOTHING:
            tl.store(SSUM + row * n_splits + split, ssum)
        if ENTROPY:
            tl.store(ENT + row * n_splits + split, ent)
        if ARGMAX:
            tl.store(AMV + row * n_splits + split, av)
            tl.store(AMX + row * n_splits + split, amax)
    else:
        tl.store(LSE + row, lse)
        if HAS_SMOOTHING:
            tl.store(SSUM + row, ssum)
        if ENTROPY:
            tl.store(ENT + row, ent)
        if ARGMAX:
            tl.store(AMX + row, amax.to(tl.int64))


@triton.jit
def _bwd_block(
    x, cols, t, w, lse2, alpha, beta, gamma, eta, softcap, inv_temp,
    HAS_SOFTCAP: tl.constexpr, HAS_SMOOTHING: tl.constexpr, HAS_TEMP: tl.constexpr, HAS_ETA: tl.constexpr,
):  # fmt: skip
    """(alpha p [+ eta p L] - beta [v == t] [- gamma w]) softcap', L = softcap(x) [* inv_temp]
    (the coefficients carry the temperature's 1 / T)."""
    L, th = _capped(x, softcap, HAS_SOFTCAP)
    if HAS_TEMP:
        L = L * inv_temp
    p = tl.exp2(L * LOG2E - lse2)
    if HAS_ETA:
        # (masked classes: p = 0 at L = -inf, whose product with eta would be NaN)
        d = p * (alpha + eta * tl.where(p > 0, L, 0.0)) - tl.where(cols == t, beta, 0.0)
    else:
        d = alpha * p - tl.where(cols == t, beta, 0.0)
    if HAS_SMOOTHING:
        d -= gamma * w
    if HAS_SOFTCAP:
        d *= 1.0 - th * th
    return d


@cached_launch
@triton.heuristics(
    {
        "HAS_ROW_OFF": lambda a: a["ROW_OFF"] is not None,
        "HAS_WEIGHT": lambda a: a["W"] is not None,
        "HAS_SMOOTHING": lambda a: a["GAMMA"] is not None,
        "HAS_SCALE": lambda a: a["SCALE"] is not None,
        "HAS_ETA": lambda a: a["ETA"] is not None,
    }
)
@triton.jit
def _ce_bwd_kernel(
    X,  # logits, rows of V classes
    ROW_OFF,  # [N] int64 row offsets, or None: row i at i * stride_n
    stride_n,
    DX,  # gradient; DX == X for the in-place backward
    stride_dn,
    T,  # [N] targets
    W,  # [V] class weights, or None (ones)
    LSE,  # [N] fp32 (0 at ignored rows)
    ALPHA,  # [N] fp32 row coefficients (cce._math.coefficients)
    BETA,
    GAMMA,  # [N] fp32 smoothing coefficient, or None (no label smoothing)
    SCALE,  # 0-d fp32 multiplying alpha, beta, gamma (the upstream gradient), or None
    ETA,  # [N] fp32 the entropy's coefficient (eta p L), or None
    V,
    v_per_split,
    ignore_index,
    softcap,
    inv_temp,
    HAS_ROW_OFF: tl.constexpr,
    DX_ROW_OFF: tl.constexpr,  # DX rows at the same offsets as X's (in place)
    HAS_SCALE: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    HAS_TEMP: tl.constexpr,
    HAS_ETA: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    t = tl.load(T + row).to(tl.int64)
    active = t != ignore_index
    if HAS_ROW_OFF:
        base = tl.load(ROW_OFF + row)
    else:
        base = row * stride_n
    if DX_ROW_OFF:
        dbase = base
    else:
        dbase = row * stride_dn
    x_row = X + base
    dx_row = DX + dbase
    lse2 = tl.load(LSE + row) * LOG2E
    alpha = tl.load(ALPHA + row)
    beta = tl.load(BETA + row)
    gamma = tl.zeros((), tl.float32)
    if HAS_SMOOTHING:
        gamma = tl.load(GAMMA + row)
    eta = tl.zeros((), tl.float32)
    if HAS_ETA:
        eta = tl.load(ETA + row)
    if HAS_SCALE:
        sc = tl.load(SCALE)
        alpha *= sc
        beta *= sc
        gamma *= sc
    v_start = split * v_per_split
    v_end = tl.minimum(v_start + v_per_split, V)
    n_full = (v_end - v_start) // BLOCK_V
    offs = tl.arange(0, BLOCK_V)
    one = tl.full((BLOCK_V,), 1.0, tl.float32)
    if active:
        for b in range(0, n_full):
            cols = v_start + b * BLOCK_V + offs  # [BLOCK_V]
            x = tl.load(x_row + cols).to(tl.float32)
            w = one
            if HAS_WEIGHT:
                w = tl.load(W + cols).to(tl.float32)
            d = _bwd_block(
                x, cols, t, w, lse2, alpha, beta, gamma, eta, softcap, inv_temp,
                HAS_SOFTCAP, HAS_SMOOTHING, HAS_TEMP, HAS_ETA,
            )  # fmt: skip
            tl.store(dx_row + cols, d.to(DX.dtype.element_ty))
    else:
        # Ignored rows: zeros, without reading the logits.
        zero = tl.zeros((BLOCK_V,), DX.dtype.element_ty)
        for b in range(0, n_full):
            tl.store(dx_row + v_start + b * BLOCK_V + offs, zero)
    cols = v_start + n_full * BLOCK_V + offs
    mask = cols < v_end
    x = tl.load(x_row + cols, mask=cols < tl.where(active, v_end, v_start), other=0.0).to(tl.float32)
    w = one
    if HAS_WEIGHT:
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    d = _bwd_block(
        x, cols, t, w, lse2, alpha, beta, gamma, eta, softcap, inv_temp,
        HAS_SOFTCAP, HAS_SMOOTHING, HAS_TEMP, HAS_ETA,
    )  # fmt: skip
    d = tl.where(active, d, 0.0)
    tl.store(dx_row + cols, d.to(DX.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------------------------
# Launchers


def default_config(dtype: torch.dtype, backward: bool) -> tuple[int, int, int]:
    """(BLOCK_V, num_warps, min_splits). One fixed config under the interpreter (it is slow).

    ``min_splits`` > 1 cuts every row into that many programs even when rows are plentiful, which
    shortens the last, partly filled wave of programs.
    """
    if interpreting():
        return 256, 4, 1
    # Four 16-byte loads per thread and block: 4 KB blocks of 2 warps forward and 32 KB blocks of
    # 16 warps backward (the best of a sweep, docs/benchmarks.md). fp32 logits: the same bytes
    # per block, half the classes.
    div = 2 if dtype == torch.float32 else 1
    if backward:
        return 16384 // div, 16, 1
    return 2048 // div, 2, 1


def split_plan(
    N: int, V: int, block_v: int, device: torch.device, splits: int | None = None, min_splits: int = 1
):
    """(n_splits, v_per_split): split rows over programs when there are too few rows to fill the GPU."""
    n_blocks = triton.cdiv(V, block_v)
    if splits is None:
        want = 4 * num_sms(device)
        splits = max(min_splits, 1 if N >= want else triton.cdiv(want, max(N, 1)))
    splits = max(1, min(int(splits), n_blocks))
    v_per_split = triton.cdiv(n_blocks, splits) * block_v
    return triton.cdiv(V, v_per_split), v_per_split


def row_layout(logits: torch.Tensor):
    """(x, stride_n, row_off): how the kernels find row i of logits ``(..., V)``.

    A unit-stride class dim is required (callers copy otherwise). Leading dims that flatten into
    one stride give ``row_off=None``; otherwise (e.g. a transposed (T, B, V) view) an int64 table of
    row offsets is built (N entries) so that nothing is copied.
    """
    V = logits.shape[-1]
    assert logits.stride(-1) == 1 or V == 1
    try:
        x2 = logits.view(-1, V)
        stride = x2.stride(0) if x2.shape[0] > 1 else V
        return logits, stride, None
    except RuntimeError:
        pass
    off = torch.zeros((), dtype=torch.int64, device=logits.device)
    for size, st in zip(logits.shape[:-1], logits.stride()[:-1], strict=True):
        off = off.unsqueeze(-1) + torch.arange(size, device=logits.device, dtype=torch.int64) * st
    return logits, 0, off.reshape(-1).contiguous()


def ce_forward(
    logits: torch.Tensor,
    targets: torch.Tensor,
    weight: torch.Tensor | None,
    ignore_index: int,
    softcap: float,
    smoothing: bool,
    *,
    block_v: int | None = None,
    num_warps: int | None = None,
    splits: int | None = None,
    temperature: float = 1.0,
    entropy: bool = False,
    argmax: bool = False,
):
    """Per-row (lse, target logit, ssum or None, entropy or None, argmax or None) of logits
    ``(..., V)`` divided by ``temperature`` after the softcap; targets flat [N]. fp32, argmax
    int64 (the smallest class among the maxima).

    lse, tgt, ssum and entropy are 0 at ignored rows (targets == ignore_index).
    """
    V = logits.shape[-1]
    N = targets.numel()
    dev = logits.device
    f32 = torch.float32
    lse = torch.empty(N, dtype=f32, device=dev)
    tgt = torch.empty(N, dtype=f32, device=dev)
    ssum = torch.empty(N, dtype=f32, device=dev) if smoothing else None
    ent = torch.empty(N, dtype=f32, device=dev) if entropy else None
    amx = torch.empty(N, dtype=torch.long, device=dev) if argmax else None
    if N == 0:
        return lse, tgt, ssum, ent, amx
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    cfg = default_config(logits.dtype, backward=False)
    block_v = block_v or cfg[0]
    num_warps = num_warps or cfg[1]
    n_splits, v_per_split = split_plan(N, V, block_v, device=dev, splits=splits, min_splits=cfg[2])
    x, stride_n, row_off = row_layout(logits)
    split = n_splits > 1
    pamv = None
    if split:
        plse = torch.empty(N, n_splits, dtype=f32, device=dev)
        pssum = torch.empty(N, n_splits, dtype=f32, device=dev) if smoothing else None
        pent = torch.empty(N, n_splits, dtype=f32, device=dev) if entropy else None
        pamv = torch.empty(N, n_splits, dtype=f32, device=dev) if argmax else None
        pamx = torch.empty(N, n_splits, dtype=torch.int32, device=dev) if argmax else None
    else:
        plse, pssum, pent, pamx = lse, ssum, ent, amx
    _ce_fwd_kernel[(N, n_splits)](
        X=x, ROW_OFF=row_off, stride_n=stride_n, T=targets,
        W=weight.contiguous() if (weight is not None and smoothing) else None,
        LSE=plse, TGT=tgt, SSUM=pssum, ENT=pent, AMV=pamv, AMX=pamx, V=V, v_per_split=v_per_split,
        n_splits=n_splits, ignore_index=ignore_index, softcap=float(softcap), inv_temp=1.0 / temperature,
        HAS_SOFTCAP=softcap > 0, HAS_TEMP=temperature != 1.0, SPLIT=split, BLOCK_V=block_v,
        num_warps=num_warps,
    )  # fmt: skip
    if split:
        # Ignored rows hold 0 in every partial; their combined lse (log n_splits) is reset by the caller.
        torch.logsumexp(plse, dim=1, out=lse)
        if smoothing:
            torch.sum(pssum, dim=1, out=ssum)
        if entropy:
            # H = sum_s w_s (H_s + lse - lse_s), w_s = e^(lse_s - lse): the splits' own entropies
            # (each relative to its own max) and their share of the mass, no cancellation.
            dl = plse - lse[:, None]
            term = torch.where(plse > float("-inf"), torch.exp(dl) * (pent - dl), 0.0)
            torch.sum(term, dim=1, out=ent)
        if argmax:
            top = pamv.amax(1, keepdim=True)
            amx.copy_(torch.where(pamv == top, pamx, torch.iinfo(torch.int32).max).amin(1))
    return lse, tgt, ssum, ent, amx


def ce_backward(
    logits: torch.Tensor,
    targets: torch.Tensor,
    weight: torch.Tensor | None,
    lse: torch.Tensor,
    alpha: torch.Tensor,
    beta: torch.Tensor,
    gamma: torch.Tensor,
    ignore_index: int,
    softcap: float,
    smoothing: bool,
    *,
    scale: torch.Tensor | None = None,
    inplace: bool = False,
    block_v: int | None = None,
    num_warps: int | None = None,
    splits: int | None = None,
    eta: torch.Tensor | None = None,
    temperature: float = 1.0,
) -> torch.Tensor:
    """dloss/dlogits in the logits' dtype and shape (contiguous), or written into ``logits``.

    ``eta`` ([N] fp32) adds the entropy's term eta p L; a ``temperature`` divides the logits after
    the softcap (alpha, beta, gamma, eta carry its 1 / T already).

    ``scale`` (0-d fp32 tensor, or None) multiplies alpha, beta and gamma on the device.
    With ``inplace`` the gradient overwrites ``logits`` and ``logits`` is returned. A logits tensor
    whose class dim is not unit-stride is copied first (and the result copied back in place).
    """
    V = logits.shape[-1]
    N = targets.numel()
    if inplace and logits.stride(-1) != 1 and V > 1:
        tmp = ce_backward(logits.contiguous(), targets, weight, lse, alpha, beta, gamma, ignore_index,
                          softcap, smoothing, scale=scale, inplace=True, block_v=block_v,
                          num_warps=num_warps, splits=splits, eta=eta, temperature=temperature)  # fmt: skip
        logits.copy_(tmp)
        return logits
    src = logits if (logits.stride(-1) == 1 or V == 1) else logits.contiguous()
    dx = src if inplace else torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    if N == 0:
        return dx
    cfg = default_config(logits.dtype, backward=True)
    block_v = block_v or cfg[0]
    num_warps = num_warps or cfg[1]
    n_splits, v_per_split = split_plan(N, V, block_v, device=logits.device, splits=splits, min_splits=cfg[2])
    x, stride_n, row_off = row_layout(src)
    if inplace:
        stride_dn = stride_n
    else:
        stride_dn = V
    _ce_bwd_kernel[(N, n_splits)](
        X=x, ROW_OFF=row_off, stride_n=stride_n, DX=dx, stride_dn=stride_dn, T=targets,
        W=weight.contiguous() if (weight is not None and smoothing) else None,
        LSE=lse, ALPHA=alpha, BETA=beta, GAMMA=gamma if smoothing else None, SCALE=scale, ETA=eta,
        V=V, v_per_split=v_per_split, ignore_index=ignore_index, softcap=float(softcap),
        inv_temp=1.0 / temperature, DX_ROW_OFF=inplace and row_off is not None, HAS_SOFTCAP=softcap > 0,
        HAS_TEMP=temperature != 1.0, BLOCK_V=block_v, num_warps=num_warps,
    )  # fmt: skip
    return dx
