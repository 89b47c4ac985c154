"""The forward: per-row log-sum-exp, target logit and (label smoothing) weighted logit sum of
the logits e2d[erow] @ c.T, by an online softmax over vocabulary tiles, never storing a logit.

Grid: (token block, vocabulary split); the partial statistics of the splits are merged by one O(N)
launch (no locks; split_merge.py). With a vocabulary order ``perm`` (training steps of the sparse backward)
it also writes per (row, tile) statistics, from which tile_stats.py derives what the sparse
backward keeps; docs/design.md states the maths and the error bound.

On Hopper (common.use_tma) tiles are read by tensor descriptors from gathered copies (the
valid-first rows of e; a sorted vocabulary slab by slab) in one flat (tile, D chunk) loop;
elsewhere through pointers.
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
    check_inputs,
    config,
    device_context,
    finish_logits,
    inverse_permutation,
    logit_tile,
    precision,
    target_logits,
    tensor_descriptor,
    tma_rows_ok,
    use_tma,
)
from .split_merge import merge_splits
from .tile_stats import gather_tile_means, tile_means


@triton.jit
def _fwd_tile(
    L, tile, m, s, ssum, ref, zt, hs, av, amax, Bias, W, Perm, St, Sq, Q, Qm, offs_n, row_mask, tpos,
    V, n_vtiles, stride_st, stride_q, softcap, log_eps, inv_temp,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SMOOTH: tl.constexpr, HAS_WEIGHT: tl.constexpr,
    SORTED: tl.constexpr, STATS: tl.constexpr, HAS_INIT: tl.constexpr, EVEN_V: tl.constexpr,
    HAS_TEMP: tl.constexpr, ENTROPY: tl.constexpr, ARGMAX: tl.constexpr, STORE_Q: tl.constexpr,
    BLOCK_V: tl.constexpr,
):  # fmt: skip
    """One logit tile L [BLOCK_N, BLOCK_V] (fp32, before bias and softcap) into the online softmax.

    Per-entry work is kept to the minimum (it is the part of the tile time that the matmul does
    not hide: a target comparison, selection and sum per entry cost a quarter of the matmul's
    time, docs/benchmarks.md): the column mask only where V is not a multiple of the tile; with
    STATS one comparison that takes the target out of the tile's max and mass, its term then
    added from zt (the target logit, computed beforehand); without STATS the target is an entry
    like any other. The exponent is scaled after the subtraction (jit_math.exp).

    HAS_TEMP divides the logits by the temperature after the softcap (every statistic is of
    those). ENTROPY keeps hs = sum_v e^(z_v - m) (z_v - m) relative to the running reference m
    (the running max, or with HAS_INIT a bound above it), so that the entropy log s - hs / s
    never subtracts two numbers of the logits' size; when m grows to m',
    hs' = e^(m - m') (hs + (m - m') s); with STATS the target's term is added from zt, as for s.
    ARGMAX: _tile_argmax. STATS: _store_tile_codes. STORE_Q: _store_q.
    """
    lo = tile * BLOCK_V
    offs_p = lo + tl.arange(0, BLOCK_V)
    col_mask = offs_p < V
    if HAS_BIAS or HAS_WEIGHT or (ARGMAX and SORTED):
        if SORTED:
            vid = tl.load(Perm + offs_p, mask=col_mask, other=0).to(tl.int64)
        else:
            vid = offs_p.to(tl.int64)
    else:
        vid = offs_p  # (unused: no bias, no weights)
    L, th = finish_logits(L, Bias, vid, col_mask, softcap, inv_temp, HAS_BIAS, HAS_SOFTCAP, HAS_TEMP)
    if HAS_SMOOTH:
        if HAS_WEIGHT:
            w = tl.load(W + vid, mask=col_mask, other=0.0).to(tl.float32)
            ssum += tl.sum(tl.where(col_mask[None, :], L, 0.0) * w[None, :], axis=1)
        else:
            ssum += tl.sum(tl.where(col_mask[None, :], L, 0.0), axis=1)
    if not EVEN_V:
        # Columns past V by an additive mask on every tile. Not `if lo + BLOCK_V > V:` around
        # a masking tl.where: on triton 3.6 that branch on the tile index slows the whole kernel
        # even where it is never taken (docs/design.md); the extra add is cheap.
        L = L + tl.where(col_mask, 0.0, float("-inf"))[None, :]
    if STATS:
        # The non-target max and mass are the tile statistics (tpos: the target's position in
        # the walking order).
        L = tl.where(offs_p[None, :] == tpos[:, None], float("-inf"), L)
        has_t = (tpos >= lo) & (tpos < lo + BLOCK_V)
    mx = tl.max(L, axis=1)
    m_new = tl.maximum(m, mx)
    if STATS:
        m_new = tl.where(has_t, tl.maximum(m_new, zt), m_new)
    # m_new stays -inf while every tile so far is masked whole (classes a -inf bias masks, such
    # as a padded vocabulary's): the exponents then take 0 as their reference (e^(-inf - 0) = 0)
    # instead of -inf - -inf = NaN. m_new itself stays -inf, so the next finite tile's rescale
    # e^(m - m_new) is 0 as it is after an empty start.
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    if ARGMAX:
        av, amax = _tile_argmax(L, mx, vid, offs_p, av, amax, SORTED)
    dl = L - m_ref[:, None]  # [BLOCK_N, BLOCK_V], -inf at masked (and target) columns
    pe = jm.exp(dl)  # 0 at masked (and target) columns
    snt = tl.sum(pe, axis=1)
    scale = jm.exp(m - m_ref)
    if ENTROPY:
        pdl = pe * dl
        if STATS or not EVEN_V or HAS_BIAS:
            # 0 * -inf at masked (target) columns, and at classes a -inf bias masks
            pdl = tl.where(dl > float("-inf"), pdl, 0.0)
        # (s = 0 before the first tile, where m - m_new is -inf)
        hs = tl.where(s > 0, scale * (hs + (m - m_new) * s), 0.0) + tl.sum(pdl, axis=1)
        if STATS:
            hs += tl.where(has_t, jm.exp(zt - m_new) * (zt - m_new), 0.0)
    s = s * scale + snt
    if STATS:
        s += tl.where(has_t, jm.exp(zt - m_new), 0.0)
        if not HAS_INIT:
            ref = m_new + tl.log(s)  # the head launch walks this one tile only
        if HAS_SOFTCAP:
            snt = tl.sum(pe * (1.0 - th * th), axis=1)
        _store_tile_codes(St, Sq, snt, mx, m_new, ref, tile, offs_n, row_mask, n_vtiles, stride_st, log_eps)
    if STORE_Q:
        _store_q(Q, Qm, pe, th, m_new, tile, offs_n, offs_p, row_mask, n_vtiles, stride_q, HAS_SOFTCAP)
    return m_new, s, ssum, ref, hs, av, amax


@triton.jit
def _tile_argmax(L, mx, vid, offs_p, av, amax, SORTED: tl.constexpr):
    """(av, amax) after the tile L [BLOCK_N, BLOCK_V] whose row max is mx: the running max and
    the smallest id among the entries reaching it (ties compared by id, so any walking order
    gives torch's first index). With STATS the target is out of L: the caller compares it (zt)
    at the merge."""
    # int32 ids: a tile-wide int64 select and min cost a few percent of the forward
    if SORTED:
        ids = vid.to(tl.int32)
    else:
        ids = offs_p
    ti = tl.min(tl.where(L == mx[:, None], ids[None, :], 2147483647), axis=1)
    amax = tl.where(mx > av, ti, tl.where(mx == av, tl.minimum(amax, ti), amax))
    av = tl.maximum(av, mx)
    return av, amax


@triton.jit
def _store_tile_codes(St, Sq, snt, mx, m_new, ref, tile, offs_n, row_mask, n_vtiles, stride_st, log_eps):
    """A tile j's statistics (_fwd_kernel, STATS) from its non-target mass snt = sum e^(z - m_new)
    [softcap'] and non-target max mx, with ref = M0 (HAS_INIT) or, in the one-tile head launch,
    the tile's own log-sum-exp (= M0):
    - St (fp16): log sum_{v in j, v != t} exp(z_v) softcap'(z_v) - ref, the non-target mass;
    - Sq (int8): ceil(8 u) clamped to [-1, 127], u = max_{v in j, v != t} z_v - ref - log(eps).
      A tile's largest non-target probability reaches eps only if u >= lse - ref, so the
      backward decides from Sq (code 127 meaning "keep") without recomputing the tile."""
    st = tl.log(snt) + (m_new - ref)  # -inf where the tile holds no mass
    u = mx - ref - log_eps
    code = tl.minimum(tl.maximum(tl.ceil(u * 8.0), -1.0), 127.0)
    # (tile + 0 * offs_n): a vector mask (the interpreter rejects scalar ones here).
    smask = row_mask & ((tile + 0 * offs_n) < n_vtiles)
    sptr = offs_n.to(tl.int64) * stride_st + tile
    tl.store(St + sptr, st.to(St.dtype.element_ty), mask=smask)
    tl.store(Sq + sptr, code.to(tl.int8), mask=smask)


@triton.jit
def _store_q(
    Q, Qm, pe, th, m_new, tile, offs_n, offs_p, row_mask, n_vtiles, stride_q, HAS_SOFTCAP: tl.constexpr
):
    """STORE_Q (the fused exact path, kernels/fused_grads.py; not with SORTED or STATS): the
    tile's q = e^(L - m') softcap'(z) in Q's dtype (pe = e^(L - m')), m' the running max after
    this tile, and m' itself per (row, tile) in Qm: dZ = (alpha e^(m' - lse)) q - (target and
    smoothing terms) once lse is known. q <= 1; its rounding is relative (bf16 has fp32's
    exponent range, so only entries below 2^-126 of the running max flush to 0)."""
    q = pe
    if HAS_SOFTCAP:
        q = pe * (1.0 - th * th)
    rows = offs_n.to(tl.int64)
    qptr = Q + rows[:, None] * stride_q + offs_p[None, :]  # [BLOCK_N, BLOCK_V]
    # Q's rows are padded to a multiple of 16 classes (stride_q): the pad's columns take
    # q = 0 (masked logits), and a mask in steps of 16 columns keeps the store vectorized
    # at an odd V (a mask at V made it one element per store)
    tl.store(qptr, q.to(Q.dtype.element_ty), mask=row_mask[:, None] & (offs_p < stride_q)[None, :])
    tl.store(Qm + rows * n_vtiles + tile, m_new, mask=row_mask)


@cached_launch
@triton.heuristics(
    {
        "HAS_BIAS": lambda a: a["Bias"] is not None,
        "HAS_WEIGHT": lambda a: a["W"] is not None,
        "HAS_SMOOTH": lambda a: a["Ss"] is not None,
        "SORTED": lambda a: a["Perm"] is not None,
        "STATS": lambda a: a["St"] is not None,
        "HAS_INIT": lambda a: a["M0"] is not None,
        "ENTROPY": lambda a: a["Hs"] is not None,
        "ARGMAX": lambda a: a["Ix"] is not None,
        "STORE_Q": lambda a: a["Q"] is not None,
    }
)
@triton.jit
def _fwd_kernel(
    E, C, Bias, W, Erow, TPos, Zt, NValid, Perm, M0,
    Mx, Se, Ss, St, Sq, Hs, Ax, Ix, Q, Qm,
    N, V, D, stride_e, stride_c, stride_part, stride_st, stride_q, n_vtiles, tile_lo, tile_hi, n_splits,
    desc_tile0, softcap, log_eps, inv_temp,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SMOOTH: tl.constexpr, HAS_WEIGHT: tl.constexpr,
    SORTED: tl.constexpr, STATS: tl.constexpr, HAS_INIT: tl.constexpr, TMA: tl.constexpr,
    EVEN_V: tl.constexpr, HAS_TEMP: tl.constexpr, ENTROPY: tl.constexpr, ARGMAX: tl.constexpr,
    STORE_Q: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """Per (token block, vocabulary split): running max, sum of exp, weighted logit sum (Ss),
    entropy accumulator (Hs), max and argmax (Ax, Ix) of the logits (times inv_temp with HAS_TEMP).

    Split pid_s of n_splits covers tiles [tile_lo + pid_s T // n_splits, tile_lo + (pid_s + 1) T //
    n_splits) with T = tile_hi - tile_lo (the splits differ by at most one tile), of the
    vocabulary read through ``Perm`` (position -> id) if
    SORTED; TPos holds each row's target position in that order (STATS only) and Zt its logit.
    HAS_INIT starts the running reference at M0 (the head tile's log-sum-exp: a lower bound of
    every row's lse), else at -inf.

    TMA: E and C are tensor descriptors (Hopper's bulk tensor copies) of the gathered rows (row
    i of E = sorted row i) and of the vocabulary in walking order from tile ``desc_tile0`` on;
    one loop runs over all (tile, D chunk) steps, so that the software pipeline already loads
    the next tile while the last one's epilogue runs. Otherwise plain loads through Erow / Perm.

    STATS (training forward; see linear_ce_backward_sparse) also writes per row and tile the
    statistics of _store_tile_codes.
    """
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    n_valid = tl.load(NValid)
    start = pid_n * BLOCK_N
    if start >= n_valid:
        return  # only ignored rows left: no work
    offs_n = start + tl.arange(0, BLOCK_N)
    row_mask = offs_n < n_valid
    if STATS:
        tpos = tl.load(TPos + offs_n, mask=row_mask, other=-1)
        zt = tl.load(Zt + offs_n, mask=row_mask, other=0.0)
    else:
        tpos = offs_n
        zt = tl.zeros((BLOCK_N,), dtype=tl.float32)
    if HAS_INIT:
        m = tl.load(M0 + offs_n, mask=row_mask, other=0.0)
    else:
        m = tl.full((BLOCK_N,), float("-inf"), dtype=tl.float32)
    ref = m
    s = tl.zeros((BLOCK_N,), dtype=tl.float32)
    ssum = tl.zeros((BLOCK_N,), dtype=tl.float32)
    hs = tl.zeros((BLOCK_N,), dtype=tl.float32)
    av = tl.full((BLOCK_N,), float("-inf"), dtype=tl.float32)
    amax = tl.zeros((BLOCK_N,), dtype=tl.int32)
    # Balanced splits: a short last split would leave most SMs idle in the grid's last wave.
    t0 = tile_lo + (pid_s * (tile_hi - tile_lo)) // n_splits
    t1 = tile_lo + ((pid_s + 1) * (tile_hi - tile_lo)) // n_splits
    if TMA:
        k_tiles = tl.cdiv(D, BLOCK_D)
        ki = -1
        tile = t0 - 1
        acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
        for _ in range(0, (t1 - t0) * k_tiles):
            ki = tl.where(ki == k_tiles - 1, 0, ki + 1)
            if ki == 0:
                tile += 1
            a = E.load([start, ki * BLOCK_D])  # [BLOCK_N, BLOCK_D]; zeros past N and D
            b = C.load([(tile - desc_tile0) * BLOCK_V, ki * BLOCK_D])  # [BLOCK_V, BLOCK_D]
            acc = tl.dot(a, b.T, acc, input_precision=PRECISION)
            if ki == k_tiles - 1:
                m, s, ssum, ref, hs, av, amax = _fwd_tile(
                    acc, tile, m, s, ssum, ref, zt, hs, av, amax, Bias, W, Perm, St, Sq, Q, Qm, offs_n,
                    row_mask, tpos, V, n_vtiles, stride_st, stride_q, softcap, log_eps, inv_temp,
                    HAS_BIAS, HAS_SOFTCAP, HAS_SMOOTH, HAS_WEIGHT, SORTED, STATS, HAS_INIT, EVEN_V,
                    HAS_TEMP, ENTROPY, ARGMAX, STORE_Q, BLOCK_V,
                )  # fmt: skip
                acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    else:
        erow = tl.load(Erow + offs_n, mask=row_mask, other=0).to(tl.int64)
        for tile in range(t0, t1):
            offs_p = tile * BLOCK_V + tl.arange(0, BLOCK_V)
            col_mask = offs_p < V
            if SORTED:
                vid = tl.load(Perm + offs_p, mask=col_mask, other=0).to(tl.int64)
            else:
                vid = offs_p.to(tl.int64)
            L = logit_tile(
                E, C, erow, vid, row_mask, col_mask, D, stride_e, stride_c,
                BLOCK_N, BLOCK_V, BLOCK_D, PRECISION,
            )  # fmt: skip  # [BLOCK_N, BLOCK_V]
            m, s, ssum, ref, hs, av, amax = _fwd_tile(
                L, tile, m, s, ssum, ref, zt, hs, av, amax, Bias, W, Perm, St, Sq, Q, Qm, offs_n, row_mask,
                tpos, V, n_vtiles, stride_st, stride_q, softcap, log_eps, inv_temp,
                HAS_BIAS, HAS_SOFTCAP, HAS_SMOOTH, HAS_WEIGHT, SORTED, STATS, HAS_INIT, EVEN_V,
                HAS_TEMP, ENTROPY, ARGMAX, STORE_Q, BLOCK_V,
            )  # fmt: skip
    out = pid_s * stride_part + offs_n
    _store_partials(
        Mx, Se, Ss, Hs, Ax, Ix, out, row_mask, m, s, ssum, hs, av, amax, HAS_SMOOTH, ENTROPY, ARGMAX
    )


@triton.jit
def _store_partials(
    Mx, Se, Ss, Hs, Ax, Ix, out, row_mask, m, s, ssum, hs, av, amax,
    HAS_SMOOTH: tl.constexpr, ENTROPY: tl.constexpr, ARGMAX: tl.constexpr,
):  # fmt: skip
    """A split's running statistics of its rows, at ``out`` (split_merge.merge_splits reads them)."""
    tl.store(Mx + out, m, mask=row_mask)
    tl.store(Se + out, s, mask=row_mask)
    if HAS_SMOOTH:
        tl.store(Ss + out, ssum, mask=row_mask)
    if ENTROPY:
        tl.store(Hs + out, hs, mask=row_mask)
    if ARGMAX:
        tl.store(Ax + out, av, mask=row_mask)
        tl.store(Ix + out, amax, mask=row_mask)


@dataclass
class FwdStats:
    """Per sorted row (first n_valid rows meaningful; the others are 0): lse, target logit, ssum.

    With ``perm`` given to linear_ce_forward, also the tile statistics of the sparse backward
    (see _fwd_kernel): ``st`` [N, n_tiles] fp16, ``sq`` [N, n_tiles] int8 and ``m0`` [N] fp32
    (the head tile's log-sum-exp, their reference), on the forward's (BLOCK_N, BLOCK_V) tiles of
    the vocabulary in ``perm`` order, and ``cm``, the tiles' means of C (tile_stats.tile_means in
    fp32), which the sorted walk's slab copies form on the way.
    """

    lse: torch.Tensor
    tgt: torch.Tensor
    ssum: torch.Tensor | None
    st: torch.Tensor | None = None
    sq: torch.Tensor | None = None
    m0: torch.Tensor | None = None
    entropy: torch.Tensor | None = None  # fp32 [N] (entropy=True)
    argmax: torch.Tensor | None = None  # int64 [N] (argmax=True)
    cm: torch.Tensor | None = None  # fp32 [n_tiles, D] the tiles' means of C (with perm)


# Forward programs (token block x vocabulary split) per SM: each runs one tile at a time, so the
# last wave idles (1 - fraction of a wave) of the SMs; more, shorter programs shrink that tail at
# the cost of more partial statistics to merge (O(N) each). The TMA kernel is best at 16.
FWD_PROGRAMS_PER_SM = 8
FWD_PROGRAMS_PER_SM_TMA = 16

# Sorted walks with TMA copy the vocabulary rows of each slab of tiles, in walking order, into
# a buffer of at most this size (Hopper has no gathering tensor copy), and of about half of C
# or less (fwd_slab_tiles): a transient of the training forward below the backward's peak,
# which holds dC (C's size) and dE besides (a buffer of all of C made the forward the step's
# peak, growing with N by the forward's statistics). Each slab costs a copy, a descriptor and
# a launch on the host (~0.1 ms per slab on an H100 host: 16 slabs of 64 MB at V = 248320,
# D = 2048) and a tail wave on the device.
FWD_SLAB_BYTES = 256 << 20
# ... and the sorted walk goes by descriptors from this many rows on: below, its per-slab row
# copies, descriptors and launches cost more host time than the descriptors save.
FWD_TMA_SORTED_MIN_N = 4096


def fwd_slab_tiles(V: int, D: int, elt: int, BLOCK_V: int, slab_bytes: int | None = None) -> int:
    """Vocabulary tiles per slab of the sorted TMA walk. By default the fewest slabs, at least two,
    of at most FWD_SLAB_BYTES of gathered rows each, balanced (so each holds about half of C or
    less: a slab of a tile or two left over would cost a copy, a descriptor and a launch of its
    own); with ``slab_bytes``, as many whole tiles as that holds. At least one tile."""
    nt = -(-V // BLOCK_V)
    tile = BLOCK_V * D * elt
    if slab_bytes:
        return max(1, slab_bytes // tile)
    slabs = max(2, -(-(nt * tile) // FWD_SLAB_BYTES))
    return max(1, -(-nt // slabs))


def linear_ce_forward(
    e2d: torch.Tensor,
    c: torch.Tensor,
    bias: torch.Tensor | None,
    weight: torch.Tensor | None,
    erow: torch.Tensor,
    tgt: torch.Tensor,
    n_valid: torch.Tensor,
    softcap: float,
    smoothing: bool,
    perm: torch.Tensor | None = None,
    eps: float = 0.0,
    programs_per_sm: int | None = None,
    tma: bool | None = None,
    slab_bytes: int | None = None,
    temperature: float = 1.0,
    entropy: bool = False,
    argmax: bool = False,
    tpos: torch.Tensor | None = None,
    q: torch.Tensor | None = None,
    qm: torch.Tensor | None = None,
    e_rows: torch.Tensor | None = None,
    all_valid: bool = False,
) -> FwdStats:
    """Statistics of the rows ``e2d[erow]`` (valid rows first, ``n_valid`` of them, int32 [1]).

    ``tgt`` are the sorted rows' targets (any value for ignored rows). Partials of the vocabulary
    splits are merged here by one O(N * splits) launch (merge_splits), no locks.

    ``perm`` (vocabulary ids in walking order, most probable classes first) and ``eps`` (the
    filter threshold) turn on the tile statistics: one launch over the first (head) tile gives
    every row's log-sum-exp there, M0, the reference of the statistics; the next launches walk
    the other tiles with the online softmax started at M0.

    ``tma`` (default: ``use_tma``, for a sorted walk from FWD_TMA_SORTED_MIN_N rows on) reads tiles
    by tensor descriptors: the rows ``e2d[erow]`` are gathered once into an [N, D] buffer, and a
    sorted vocabulary is walked in slabs (fwd_slab_tiles: at most FWD_SLAB_BYTES and about half of
    c by default, else ``slab_bytes``) whose rows are gathered into a buffer first.

    ``tpos`` (with ``perm``): each sorted row's target's position in ``perm``, where the caller
    has it (else computed here).

    ``temperature`` divides the logits after the softcap (target logits included; the tile
    statistics are of the tempered logits); ``entropy`` and ``argmax`` add those outputs.

    ``q`` ([N, >= V], unit column stride) and ``qm`` (fp32 [N, tiles of the forward config]),
    without ``perm``: every tile's q = e^(L - m') softcap'(z) and running max m' (_fwd_tile's
    STORE_Q), in sorted row order.

    ``e_rows``: the rows ``e2d[erow]`` where the caller has them (a view of a row range, or rows
    it gathers anyway), read in place of a gather of its own by the tensor descriptors.
    ``all_valid``: the caller knows n_valid == N on the host; every split then writes every row
    of its partials, which need no neutral fill.
    """
    check_inputs(e2d, c, bias, weight, erow, tgt, n_valid, perm)
    p = _fwd_plan(e2d, c, erow.numel(), perm, eps, q, qm, tma, programs_per_sm, slab_bytes)
    f = _FwdCall(
        e2d=e2d, c=c, bias=bias, weight=weight, erow=erow, tgt=tgt, n_valid=n_valid, perm=perm,
        softcap=softcap, smoothing=smoothing, eps=eps, temperature=temperature, entropy=entropy,
        argmax=argmax, q=q, qm=qm, e_rows=e_rows, all_valid=all_valid,
    )  # fmt: skip
    b = _fwd_buffers(f, p, tpos)
    m0, cm = _fwd_walk(f, p, b)
    # Merge the splits: lse = M + log sum_s S_s exp(m_s - M). Rows never written (ignored) keep
    # m = -inf, S = 0 everywhere and are zeroed through `done`.
    lse, tl_, ss, m0 = merge_splits(b.Mx, b.Se, b.Ss, b.zt, m0)
    ent, amax = _fwd_entropy_argmax(f, p, b)
    return FwdStats(lse, tl_, ss, b.St, b.Sq, m0, ent, amax, cm)


@dataclass
class _FwdCall:
    """The inputs and options of one linear_ce_forward call (as documented there)."""

    e2d: torch.Tensor
    c: torch.Tensor
    bias: torch.Tensor | None
    weight: torch.Tensor | None
    erow: torch.Tensor
    tgt: torch.Tensor
    n_valid: torch.Tensor
    perm: torch.Tensor | None
    softcap: float
    smoothing: bool
    eps: float
    temperature: float
    entropy: bool
    argmax: bool
    q: torch.Tensor | None
    qm: torch.Tensor | None
    e_rows: torch.Tensor | None
    all_valid: bool


@dataclass
class _FwdPlan:
    """The launch geometry of one forward: N rows in n_blocks token blocks, the vocabulary V in
    n_vtiles tiles (``cfg``), with the tile statistics (``stats``, the head tile first: ``head``
    = 1) or not, by tensor descriptors (``tma``; ``TD`` their class) or pointers, over ``slabs``
    of tiles [lo, hi), at most ``max_splits`` vocabulary splits per launch."""

    cfg: KernelConfig
    N: int
    V: int
    D: int
    n_blocks: int
    n_vtiles: int
    stats: bool
    tma: bool
    TD: type | None
    max_splits: int
    head: int
    slabs: list[tuple[int, int]]

    def split(self, lo: int, hi: int) -> int:
        """Splits of a launch over tiles [lo, hi) (balanced: their sizes differ by one at most)."""
        return min(hi - lo, self.max_splits)

    @property
    def parts(self) -> int:
        """Rows of the partial statistics: the head tile's, then every launch's splits."""
        head = self.head
        return head + sum(self.split(max(lo, head), hi) for lo, hi in self.slabs if hi > max(lo, head))


@dataclass
class _FwdBufs:
    """The tensors of the launches: the partial statistics [parts, N] (Mx, Se, Ss, Hs, Ax, Ix),
    the target logits ``zt`` and positions ``tpos``, the tile statistics St / Sq and tiles' means
    ``cm`` (or None), the E argument ``e_arg`` (e2d, or a descriptor of its gathered rows) and
    the slab buffer ``c_buf`` (or None)."""

    tpos: torch.Tensor
    Mx: torch.Tensor
    Se: torch.Tensor
    Ss: torch.Tensor | None
    Hs: torch.Tensor | None
    Ax: torch.Tensor | None
    Ix: torch.Tensor | None
    zt: torch.Tensor
    St: torch.Tensor | None
    Sq: torch.Tensor | None
    e_arg: object
    c_buf: torch.Tensor | None
    cm: torch.Tensor | None


def _fwd_tma(
    e2d: torch.Tensor, c: torch.Tensor, N: int, stats: bool, tma: bool | None
) -> tuple[bool, type | None]:
    """(tma, the tensor descriptor class or None without tma): ``tma`` resolved (None: use_tma,
    for a sorted walk from FWD_TMA_SORTED_MIN_N rows on) and checked."""
    D = c.shape[1]
    if tma is None:
        tma = use_tma(e2d, c) and (not stats or N >= FWD_TMA_SORTED_MIN_N)
    TD = tensor_descriptor() if tma else None
    if tma and TD is None:
        raise ValueError("tma=True needs triton.tools.tensor_descriptor")
    if tma and (D * e2d.element_size()) % 16 != 0:
        raise ValueError(f"tma=True needs rows of a multiple of 16 bytes, got D = {D}")
    return tma, TD


def _fwd_plan(
    e2d: torch.Tensor,
    c: torch.Tensor,
    N: int,
    perm: torch.Tensor | None,
    eps: float,
    q: torch.Tensor | None,
    qm: torch.Tensor | None,
    tma: bool | None,
    programs_per_sm: int | None,
    slab_bytes: int | None,
) -> _FwdPlan:
    """The launch geometry of linear_ce_forward's arguments (ValueError where the options do not
    go together)."""
    V, D = c.shape
    dev = e2d.device
    cfg = config(e2d.dtype, "fwd")
    BN, BV = cfg.BLOCK_N, cfg.BLOCK_V
    n_blocks = triton.cdiv(N, BN)
    n_vtiles = triton.cdiv(V, BV)
    stats = perm is not None
    if (q is None) != (qm is None) or (q is not None and stats):
        raise ValueError("q and qm go together, and not with the tile statistics (perm)")
    if q is not None and (q.shape[0] < N or q.shape[1] < V or q.stride(1) != 1 or qm.shape != (N, n_vtiles)):
        raise ValueError(f"q must be [N, >= V] with unit column stride and qm [N, {n_vtiles}]")
    tma, TD = _fwd_tma(e2d, c, N, stats, tma)
    pps = programs_per_sm or (FWD_PROGRAMS_PER_SM_TMA if tma else FWD_PROGRAMS_PER_SM)
    max_splits = max(1, triton.cdiv(pps * num_sms(dev), max(n_blocks, 1)))
    head = 1 if stats else 0

    # Slabs of tiles [lo, hi), each one descriptor range of gathered rows (TMA, sorted or unaligned c).
    if tma and (stats or not tma_rows_ok(c)):
        slab_tiles = fwd_slab_tiles(V, D, c.element_size(), BV, slab_bytes)
        slabs = [(lo, min(lo + slab_tiles, n_vtiles)) for lo in range(0, n_vtiles, slab_tiles)]
    else:
        slabs = [(0, n_vtiles)]
    if stats and not eps > 0:
        raise ValueError(f"the tile statistics need a filter threshold eps > 0, got {eps}")
    return _FwdPlan(cfg, N, V, D, n_blocks, n_vtiles, stats, tma, TD, max_splits, head, slabs)


def _fwd_tma_operands(f: _FwdCall, p: _FwdPlan) -> tuple[object, torch.Tensor | None]:
    """(E argument, slab buffer or None): with TMA (and rows) a descriptor of the rows e2d[erow]
    gathered once, and where C is read through slab copies an empty buffer of the first slab's
    rows (as large as any other slab); else e2d and None."""
    e_arg = f.e2d
    c_buf = None
    if p.tma and p.N > 0:
        rows = f.e_rows
        if rows is None or not tma_rows_ok(rows):
            rows = f.e2d.index_select(0, f.erow)
        e_arg = p.TD.from_tensor(rows, [p.cfg.BLOCK_N, p.cfg.BLOCK_D])
        if len(p.slabs) > 1 or p.stats or not tma_rows_ok(f.c):
            rows = min(p.V, p.slabs[0][1] * p.cfg.BLOCK_V)
            c_buf = torch.empty((rows, p.D), dtype=f.c.dtype, device=f.e2d.device)
    return e_arg, c_buf


def _fwd_buffers(f: _FwdCall, p: _FwdPlan, tpos: torch.Tensor | None) -> _FwdBufs:
    """The launches' tensors (_FwdBufs): each sorted row's target position in ``perm`` (with the
    tile statistics; ``tpos`` where the caller has it) else its target, the partial statistics at
    their neutral values (Mx and Ax -inf, the sums 0), the outputs, and the TMA operands."""
    N, n_vtiles, stats, dev = p.N, p.n_vtiles, p.stats, f.e2d.device
    parts = p.parts
    f32 = torch.float32
    if stats:
        if tpos is None:
            tpos = inverse_permutation(f.perm).index_select(0, f.tgt)
    else:
        tpos = f.tgt

    def part(fill: float, dtype: torch.dtype = f32) -> torch.Tensor:
        # (every row valid: each part's rows are all written by their split)
        if f.all_valid:
            return torch.empty((parts, N), dtype=dtype, device=dev)
        return torch.full((parts, N), fill, dtype=dtype, device=dev)

    Mx = part(float("-inf"))
    Se = part(0.0)
    Ss = part(0.0) if f.smoothing else None
    Hs = part(0.0) if f.entropy else None
    Ax = part(float("-inf")) if f.argmax else None
    Ix = part(0, torch.int32) if f.argmax else None
    zt = torch.empty(N, dtype=f32, device=dev)
    St = torch.empty((N, n_vtiles), dtype=torch.float16, device=dev) if stats else None
    Sq = torch.empty((N, n_vtiles), dtype=torch.int8, device=dev) if stats else None
    e_arg, c_buf = _fwd_tma_operands(f, p)
    # The tiles' means: filled by the slab copies where there are some (else one pass, _fwd_walk).
    cm = torch.empty((n_vtiles, p.D), dtype=f32, device=dev) if stats and c_buf is not None else None
    return _FwdBufs(tpos, Mx, Se, Ss, Hs, Ax, Ix, zt, St, Sq, e_arg, c_buf, cm)


def _slab_operand(f: _FwdCall, p: _FwdPlan, b: _FwdBufs, lo: int, hi: int) -> tuple[object, int]:
    """(C argument, first tile it holds) for the slab of tiles [lo, hi): with TMA a descriptor of c
    itself or of the slab's rows gathered into c_buf."""
    c, BV, BLOCK_D, V = f.c, p.cfg.BLOCK_V, p.cfg.BLOCK_D, p.V
    if not p.tma:
        return c, 0
    if b.c_buf is None:
        return p.TD.from_tensor(c, [BV, BLOCK_D]), 0
    v0, v1 = lo * BV, min(hi * BV, V)
    buf = b.c_buf[: v1 - v0]
    if p.stats:  # (the copy's pass over the rows gives the tiles' means too)
        gather_tile_means(c, f.perm, lo, hi, BV, buf, b.cm)
    else:
        buf.copy_(c[v0:v1])
    return p.TD.from_tensor(buf, [BV, BLOCK_D]), lo


def _launch_fwd(
    f: _FwdCall,
    p: _FwdPlan,
    b: _FwdBufs,
    c_arg: object,
    tile0: int,
    grid: tuple[int, int],
    part0: int,
    tile_lo: int,
    tile_hi: int,
    m0: torch.Tensor | None,
) -> None:
    """One _fwd_kernel launch over tiles [tile_lo, tile_hi) in grid[1] splits, into the partial
    rows from ``part0`` on; C read through ``c_arg`` (holding the tiles from ``tile0`` on)."""
    stats, cfg, q, temperature = p.stats, p.cfg, f.q, f.temperature
    Ss, Hs, Ax, Ix = b.Ss, b.Hs, b.Ax, b.Ix
    _fwd_kernel[grid](
        E=b.e_arg, C=c_arg, Bias=f.bias, W=f.weight if f.smoothing else None, Erow=f.erow,
        TPos=b.tpos if stats else None, Zt=b.zt, NValid=f.n_valid, Perm=f.perm, M0=m0,
        Mx=b.Mx[part0:], Se=b.Se[part0:], Ss=None if Ss is None else Ss[part0:], St=b.St, Sq=b.Sq,
        Hs=None if Hs is None else Hs[part0:], Ax=None if Ax is None else Ax[part0:],
        Ix=None if Ix is None else Ix[part0:], Q=q, Qm=f.qm,
        N=p.N, V=p.V, D=p.D, stride_e=f.e2d.stride(0), stride_c=f.c.stride(0), stride_part=p.N,
        stride_st=p.n_vtiles, stride_q=0 if q is None else q.stride(0), n_vtiles=p.n_vtiles,
        tile_lo=tile_lo, tile_hi=tile_hi, n_splits=grid[1],
        desc_tile0=tile0, softcap=float(f.softcap), log_eps=math.log(f.eps) if stats else 0.0,
        inv_temp=1.0 / temperature, HAS_TEMP=temperature != 1.0,
        HAS_SOFTCAP=f.softcap > 0, EVEN_V=p.V % cfg.BLOCK_V == 0, TMA=p.tma, BLOCK_N=cfg.BLOCK_N,
        BLOCK_V=cfg.BLOCK_V, BLOCK_D=cfg.BLOCK_D, PRECISION=precision(f.e2d.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip


def _fwd_walk(f: _FwdCall, p: _FwdPlan, b: _FwdBufs) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The launches: the target logits, then per slab the head tile (tile statistics) and the
    slab's other tiles in splits, filling b's partials. Returns (m0, cm): the head tile's
    log-sum-exp and the tiles' means of C (both None without the tile statistics)."""
    N, head, stats = p.N, p.head, p.stats
    m0 = None
    cm = b.cm
    with device_context(f.e2d.device):
        if N > 0:
            # The target logits first, by a kernel of their own (N x D reads): the tile epilogue
            # then needs no per-entry target extraction.
            target_logits(f.e2d, f.c, f.bias, f.erow, f.tgt, f.n_valid, f.softcap, b.zt, f.temperature)
        part = head
        for lo, hi in p.slabs if N > 0 else ():
            c_arg, tile0 = _slab_operand(f, p, b, lo, hi)
            if stats and lo == 0:
                _launch_fwd(f, p, b, c_arg, tile0, (p.n_blocks, 1), 0, 0, 1, None)
                # The head tile's log-sum-exp (rows past n_valid: -inf + log 0, never read).
                m0 = b.Mx[0] + torch.log(b.Se[0])
            lo = max(lo, head)
            if hi > lo:
                splits = p.split(lo, hi)
                _launch_fwd(f, p, b, c_arg, tile0, (p.n_blocks, splits), part, lo, hi, m0)
                part += splits
        if stats and m0 is None:  # N == 0
            m0 = b.Mx[0] + torch.log(b.Se[0])
        if stats and b.c_buf is None:  # (no slab copies: a pass of its own)
            cm = tile_means(f.c, f.perm, p.cfg.BLOCK_V, torch.float32)
    return m0, cm


def _fwd_entropy_argmax(
    f: _FwdCall, p: _FwdPlan, b: _FwdBufs
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(entropy fp32 [N] or None, argmax int64 [N] or None) of the rows, merged from the splits'
    partials (0 for rows never written)."""
    Mx, Se, zt, stats = b.Mx, b.Se, b.zt, p.stats
    ent = amax = None
    if f.entropy or f.argmax:
        M = Mx.max(0).values
        done = M != float("-inf")  # (NaN / +inf rows propagate, as in split_merge.merge_splits)
        Mz = torch.where(done, M, 0.0)
        S = (Se * torch.exp(Mx - Mz)).sum(0)
    if f.entropy:
        # H = log S - A / S with A = sum_s e^(m_s - M) (Hs_s + (m_s - M) Se_s) (the splits'
        # accumulators moved to the common max M; see _fwd_tile).
        w = torch.exp(Mx - Mz)
        A = (w * (b.Hs + torch.where(Se > 0, (Mx - Mz) * Se, 0.0))).sum(0)
        Sd = torch.where(done, S, 1.0)
        ent = torch.where(done, torch.log(Sd) - A / Sd, 0.0)
    if f.argmax:
        # the smallest id among the splits reaching the max (with the tile statistics the
        # target, kept out of the kernel's max, is one more candidate)
        big = torch.iinfo(torch.int32).max
        A = b.Ax.amax(0)
        if stats:
            A = torch.maximum(A, zt)
        amax = torch.where(b.Ax == A, b.Ix, big).amin(0).long()
        if stats:
            amax = torch.where(zt == A, torch.minimum(amax, f.tgt), amax)
        amax = torch.where(done, amax, 0)
    return ent, amax
