"""Triton kernels of linear cross entropy, and one launcher each (checks, allocation, grid, strides).

No autograd here: cce/triton_impl.py assembles the loss from the statistics these kernels return
and turns the upstream gradient into the per-row coefficients (alpha, gamma) they take.

Row order. Both kernels read token rows through a permutation that puts the valid (non-ignored)
rows first (``erow``: e2d row of each sorted position) and take ``n_valid`` as a device tensor:
programs whose token block starts at or after ``n_valid`` return at once, so ignored tokens cost
no matmul work and nothing synchronises with the host.

Vocabulary order (backward only). With filtering on, the backward walks the vocabulary through a
permutation ``perm`` (ids sorted by mean logit) so that the tiles whose probabilities are all
below ``eps`` cluster and can be skipped; see docs/design.md.

Tile loads. On Hopper (``use_tma``) the forward and the exact backward's dZ slabs read their
tiles through tensor descriptors from gathered copies (the valid-first rows of e; a sorted
vocabulary slab by slab); elsewhere, and under the interpreter unless forced, through pointers.

Offsets: row and vocabulary indices are promoted to int64 before they are multiplied by a stride,
so N * V and V * D past 2^31 (N = 16384, V = 256000) address correctly.
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@dataclass(frozen=True)
class KernelConfig:
    BLOCK_N: int
    BLOCK_V: int
    BLOCK_D: int
    num_warps: int
    num_stages: int


# One fixed, small config under the interpreter (no autotune there, and it is slow); on Hopper
# 128 x 256 (forward) / 128 x 128 (backward) logit tiles with 64-wide D chunks, 8 warps (fp32
# inputs need smaller D chunks to keep the shared-memory pipeline within the limit).
_INTERPRET_CONFIG = KernelConfig(16, 32, 32, 4, 1)


def _config(dtype: torch.dtype, kind: str) -> KernelConfig:
    if _interpreting():
        return _INTERPRET_CONFIG
    if dtype == torch.float32:
        return KernelConfig(128, 128, 32, 8, 3)
    if kind == "fwd":
        # Measured on H100 (gemma2-2b shape, bf16): 128x256 tiles 17.4 ms vs 22.7 ms for 128x128.
        return KernelConfig(128, 256, 64, 8, 3)
    # Measured on H100 (gemma2-2b zipf, filtered backward kernel): 4 stages 37.8 ms vs 41.2 ms
    # for 3 (4 x 32 KB of bf16 operand tiles in shared memory, within Hopper's 228 KB).
    return KernelConfig(128, 128, 64, 8, 4)


def _precision(dtype: torch.dtype) -> str:
    # fp32 inputs: tf32 only where the user allowed it for matmuls; bf16/fp16 ignore this.
    if dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return "ieee"


@triton.jit
def _tanh(x):
    # tanh through exp (libdevice's tanh does not run in the interpreter); exp(-2|x|) <= 1, so
    # neither overflow nor cancellation for large |x|.
    t = tl.exp(-2.0 * tl.abs(x))
    r = (1.0 - t) / (1.0 + t)
    return tl.where(x < 0, -r, r)


@triton.jit
def _logit_tile(
    E, C, erow, vid, row_mask, col_mask, D, stride_e, stride_c,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """e[erow] @ c[vid].T in fp32, [BLOCK_N, BLOCK_V]; erow, vid int64."""
    offs_d = tl.arange(0, BLOCK_D)
    e_ptr = E + erow[:, None] * stride_e + offs_d[None, :]  # [BLOCK_N, BLOCK_D]
    c_ptr = C + vid[:, None] * stride_c + offs_d[None, :]  # [BLOCK_V, BLOCK_D]
    acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        dm = (d0 + offs_d) < D
        e = tl.load(e_ptr, mask=row_mask[:, None] & dm[None, :], other=0.0)
        c = tl.load(c_ptr, mask=col_mask[:, None] & dm[None, :], other=0.0)
        acc = tl.dot(e, tl.trans(c), acc, input_precision=PRECISION)
        e_ptr += BLOCK_D
        c_ptr += BLOCK_D
    return acc


@triton.jit
def _exp(x):
    # exp through exp2 of the scaled difference (see _fwd_tile for the measured effect). The
    # scale is applied to the difference (x = z - m), so its rounding stays relative to x.
    return tl.exp2(x * 1.4426950408889634)


@triton.jit
def _target_logit_kernel(
    E, C, Bias, Erow, Tgt, NValid, Out, N, D, stride_e, stride_c, softcap,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Out[i] = z of row i's target (bias and softcap applied), fp32; 0 past the valid rows."""
    n_valid = tl.load(NValid)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = offs_n < n_valid
    erow = tl.load(Erow + offs_n, mask=row_mask, other=0).to(tl.int64)
    tgt = tl.load(Tgt + offs_n, mask=row_mask, other=0).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    acc = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        m = row_mask[:, None] & ((d0 + offs_d) < D)[None, :]
        e = tl.load(E + erow[:, None] * stride_e + (d0 + offs_d)[None, :], mask=m, other=0.0)
        c = tl.load(C + tgt[:, None] * stride_c + (d0 + offs_d)[None, :], mask=m, other=0.0)
        acc += e.to(tl.float32) * c.to(tl.float32)
    z = tl.sum(acc, axis=1)
    if HAS_BIAS:
        z += tl.load(Bias + tgt, mask=row_mask, other=0.0).to(tl.float32)
    if HAS_SOFTCAP:
        z = softcap * _tanh(z / softcap)
    tl.store(Out + offs_n, tl.where(row_mask, z, 0.0), mask=offs_n < N)


@triton.jit
def _fwd_tile(
    L, tile, m, s, ssum, ref, zt, Bias, W, Perm, St, Sq, offs_n, row_mask, tpos,
    V, n_vtiles, stride_st, softcap, log_eps,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SMOOTH: tl.constexpr, HAS_WEIGHT: tl.constexpr,
    SORTED: tl.constexpr, STATS: tl.constexpr, HAS_INIT: tl.constexpr, EVEN_V: tl.constexpr,
    BLOCK_V: tl.constexpr,
):  # fmt: skip
    """One logit tile L [BLOCK_N, BLOCK_V] (fp32, before bias and softcap) into the online softmax.

    Per-entry work is kept to the minimum (it is the part of the tile time that the matmul does
    not hide: a target comparison, selection and sum per entry measured +25% of the matmul's
    time on H100): the column mask only on the last tile; with STATS one comparison that takes
    the target out of the tile's max and mass, its term then added from zt (the target logit,
    computed beforehand); without STATS the target is an entry like any other. The exponent is
    scaled after the subtraction: exp2 of a pre-scaled logit z * log2(e) would carry an absolute
    rounding error of |z| 2^-24 into every term.
    """
    lo = tile * BLOCK_V
    offs_p = lo + tl.arange(0, BLOCK_V)
    col_mask = offs_p < V
    if HAS_BIAS or HAS_WEIGHT:
        if SORTED:
            vid = tl.load(Perm + offs_p, mask=col_mask, other=0).to(tl.int64)
        else:
            vid = offs_p.to(tl.int64)
    if HAS_BIAS:
        b = tl.load(Bias + vid, mask=col_mask, other=0.0).to(tl.float32)
        L += b[None, :]  # once per tile, after the whole D loop
    if HAS_SOFTCAP:
        th = _tanh(L / softcap)
        L = softcap * th
    if HAS_SMOOTH:
        if HAS_WEIGHT:
            w = tl.load(W + vid, mask=col_mask, other=0.0).to(tl.float32)
            ssum += tl.sum(tl.where(col_mask[None, :], L, 0.0) * w[None, :], axis=1)
        else:
            ssum += tl.sum(tl.where(col_mask[None, :], L, 0.0), axis=1)
    if not EVEN_V:
        # Columns past V by an additive mask on every tile. Not `if lo + BLOCK_V > V:` around
        # a masking tl.where: that branch on the tile index measured +10-15% of the whole
        # kernel's time on H100 (triton 3.6, the same with it never taken); the extra add 0-5%.
        L = L + tl.where(col_mask, 0.0, float("-inf"))[None, :]
    if STATS:
        # The non-target max and mass are the tile statistics (tpos: the target's position in
        # the walking order).
        L = tl.where(offs_p[None, :] == tpos[:, None], float("-inf"), L)
        has_t = (tpos >= lo) & (tpos < lo + BLOCK_V)
    mx = tl.max(L, axis=1)
    # m is finite after the first tile (every launch's split starts with a column < V) or from
    # the start (HAS_INIT), hence exp(m - m_new) never sees -inf - -inf.
    m_new = tl.maximum(m, mx)
    if STATS:
        m_new = tl.where(has_t, tl.maximum(m_new, zt), m_new)
    pe = _exp(L - m_new[:, None])  # [BLOCK_N, BLOCK_V], 0 at masked (and target) columns
    snt = tl.sum(pe, axis=1)
    s = s * _exp(m - m_new) + snt
    if STATS:
        s += tl.where(has_t, _exp(zt - m_new), 0.0)
        if not HAS_INIT:
            ref = m_new + tl.log(s)  # the head launch walks this one tile only
        if HAS_SOFTCAP:
            snt = tl.sum(pe * (1.0 - th * th), axis=1)
        st = tl.log(snt) + (m_new - ref)  # -inf where the tile holds no mass
        u = mx - ref - log_eps
        code = tl.minimum(tl.maximum(tl.ceil(u * 8.0), -1.0), 127.0)
        # (tile + 0 * offs_n): a vector mask (the interpreter rejects scalar ones here).
        smask = row_mask & ((tile + 0 * offs_n) < n_vtiles)
        sptr = offs_n.to(tl.int64) * stride_st + tile
        tl.store(St + sptr, st.to(St.dtype.element_ty), mask=smask)
        tl.store(Sq + sptr, code.to(tl.int8), mask=smask)
    return m_new, s, ssum, ref


@triton.jit
def _fwd_kernel(
    E, C, Bias, W, Erow, TPos, Zt, NValid, Perm, M0,
    Mx, Se, Ss, St, Sq,
    N, V, D, stride_e, stride_c, stride_part, stride_st, n_vtiles, tile_lo, tile_hi, n_splits,
    desc_tile0, softcap, log_eps,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SMOOTH: tl.constexpr, HAS_WEIGHT: tl.constexpr,
    SORTED: tl.constexpr, STATS: tl.constexpr, HAS_INIT: tl.constexpr, TMA: tl.constexpr,
    EVEN_V: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Per (token block, vocabulary split): running max, sum of exp, weighted logit sum.

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

    STATS (training forward; see linear_ce_backward_sparse) also writes, per row and tile j, with
    ref = M0 (HAS_INIT) or, in the one-tile head launch, the tile's own log-sum-exp (= M0):
    - St (fp16): log sum_{v in j, v != t} exp(z_v) softcap'(z_v) - ref, the non-target mass;
    - Sq (int8): ceil(8 u) clamped to [-1, 127], u = max_{v in j, v != t} z_v - ref - log(eps).
      A tile's largest non-target probability reaches eps only if u >= lse - ref, so the
      backward decides from Sq (code 127 meaning "keep") without recomputing the tile.
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
                m, s, ssum, ref = _fwd_tile(
                    acc, tile, m, s, ssum, ref, zt, Bias, W, Perm, St, Sq, offs_n, row_mask,
                    tpos, V, n_vtiles, stride_st, softcap, log_eps,
                    HAS_BIAS, HAS_SOFTCAP, HAS_SMOOTH, HAS_WEIGHT, SORTED, STATS, HAS_INIT, EVEN_V,
                    BLOCK_V,
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
            L = _logit_tile(
                E, C, erow, vid, row_mask, col_mask, D, stride_e, stride_c,
                BLOCK_N, BLOCK_V, BLOCK_D, PRECISION,
            )  # fmt: skip  # [BLOCK_N, BLOCK_V]
            m, s, ssum, ref = _fwd_tile(
                L, tile, m, s, ssum, ref, zt, Bias, W, Perm, St, Sq, offs_n, row_mask,
                tpos, V, n_vtiles, stride_st, softcap, log_eps,
                HAS_BIAS, HAS_SOFTCAP, HAS_SMOOTH, HAS_WEIGHT, SORTED, STATS, HAS_INIT, EVEN_V,
                BLOCK_V,
            )  # fmt: skip
    out = pid_s * stride_part + offs_n
    tl.store(Mx + out, m, mask=row_mask)
    tl.store(Se + out, s, mask=row_mask)
    if HAS_SMOOTH:
        tl.store(Ss + out, ssum, mask=row_mask)


@dataclass
class FwdStats:
    """Per sorted row (first n_valid rows meaningful; the others are 0): lse, target logit, ssum.

    With ``perm`` given to linear_ce_forward, also the tile statistics of the sparse backward
    (see _fwd_kernel): ``st`` [N, n_tiles] fp16, ``sq`` [N, n_tiles] int8 and ``m0`` [N] fp32
    (the head tile's log-sum-exp, their reference), on the forward's (BLOCK_N, BLOCK_V) tiles of
    the vocabulary in ``perm`` order.
    """

    lse: torch.Tensor
    tgt: torch.Tensor
    ssum: torch.Tensor | None
    st: torch.Tensor | None = None
    sq: torch.Tensor | None = None
    m0: torch.Tensor | None = None


def _check(e2d: torch.Tensor, c: torch.Tensor, *others: torch.Tensor | None) -> None:
    if e2d.device.type != "cuda" and not _interpreting():
        raise ValueError(
            f"the Triton kernels need CUDA tensors, got {e2d.device} (set TRITON_INTERPRET=1 before "
            "importing cce to run them on the CPU)"
        )
    for t in (c, *others):
        if t is not None and t.device != e2d.device:
            raise ValueError(f"all tensors must be on one device, got {e2d.device} and {t.device}")
    if e2d.stride(-1) != 1 or c.stride(-1) != 1:
        raise ValueError("e2d and c must have unit stride along D")


def _n_sm(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


# Forward programs (token block x vocabulary split) per SM: each runs one tile at a time, so the
# last wave idles (1 - fraction of a wave) of the SMs; more, shorter programs shrink that tail at
# the cost of more partial statistics to merge (O(N) each). The TMA kernel measured best at 16
# (H100, gemma2-2b shape: 1.01x the matmul floor against 1.03x at 8).
FWD_PROGRAMS_PER_SM = 8
FWD_PROGRAMS_PER_SM_TMA = 16

# Sorted walks with TMA copy the vocabulary rows of each slab of tiles, in walking order, into
# a buffer of about this size (Hopper has no gathering tensor copy): a transient of the forward
# only, at ~0.07x of the matmul's time for the whole vocabulary.
FWD_SLAB_BYTES = 64 << 20
# ... and the sorted walk goes by descriptors from this many rows on: below, its per-slab row copies,
# descriptors and launches (16 slabs at llama3-8b) cost more host time than the descriptors save
# (H100, llama3-8b zipf fwd+bwd: N = 1024 11.5 -> 8.0 ms, 2048 8.6 -> 7.6 ms with pointer loads;
# 4096 11.5 vs 11.8, 8192 19.1 vs 20.3 ms: `.gpu/s4i.py`).
FWD_TMA_SORTED_MIN_N = 4096


def inverse_permutation(perm: torch.Tensor) -> torch.Tensor:
    """inv with inv[perm[i]] = i (int64): the position of each vocabulary id in the order."""
    n = perm.numel()
    return torch.empty(n, dtype=torch.long, device=perm.device).index_copy_(
        0, perm, torch.arange(n, device=perm.device)
    )


def stats_blocks(dtype: torch.dtype) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_V) of the forward's tiles for ``dtype``: the tiles of the tile statistics."""
    cfg = _config(dtype, "fwd")
    return cfg.BLOCK_N, cfg.BLOCK_V


def _tensor_descriptor():
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:  # a triton without host-side tensor descriptors
        return None
    return TensorDescriptor


def _tma_rows_ok(t: torch.Tensor) -> bool:
    """A 2-D operand that a tensor descriptor can read in place (16-byte aligned rows)."""
    es = t.element_size()
    return t.stride(1) == 1 and (t.stride(0) * es) % 16 == 0 and t.data_ptr() % 16 == 0


def use_tma(e2d: torch.Tensor, c: torch.Tensor) -> bool:
    """Whether the forward reads its tiles by tensor descriptors: Hopper or newer, 16-bit
    operands, rows of a multiple of 16 bytes (TMA's alignment), a triton that has them."""
    if _interpreting() or e2d.device.type != "cuda" or _tensor_descriptor() is None:
        return False
    if e2d.dtype not in (torch.bfloat16, torch.float16) or c.dtype != e2d.dtype:
        return False
    if (c.shape[1] * c.element_size()) % 16 != 0:
        return False
    return torch.cuda.get_device_capability(e2d.device)[0] >= 9


# Rows and D chunk of a _target_logit_kernel program.
TARGET_BLOCK_N = 4
TARGET_BLOCK_D = 256


def _target_logits(e2d, c, bias, erow, tgt, n_valid, softcap: float, out: torch.Tensor) -> None:
    """out[i] = z of sorted row i's target (bias and softcap applied), fp32; 0 past n_valid.
    Small row blocks: N x D gathered reads are a memory-bound job, so many programs in flight."""
    N, D = erow.numel(), e2d.shape[1]
    ZB = TARGET_BLOCK_N
    _target_logit_kernel[(triton.cdiv(N, ZB),)](
        e2d, c, bias if bias is not None else e2d, erow, tgt, n_valid, out, N, D,
        e2d.stride(0), c.stride(0), float(softcap),
        HAS_BIAS=bias is not None, HAS_SOFTCAP=softcap > 0, BLOCK_N=ZB, BLOCK_D=TARGET_BLOCK_D,
    )  # fmt: skip


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
    config: KernelConfig | None = None,
    perm: torch.Tensor | None = None,
    eps: float = 0.0,
    programs_per_sm: int | None = None,
    tma: bool | None = None,
    slab_bytes: int | None = None,
) -> FwdStats:
    """Statistics of the rows ``e2d[erow]`` (valid rows first, ``n_valid`` of them, int32 [1]).

    ``tgt`` are the sorted rows' targets (any value for ignored rows). Partials of the vocabulary
    splits are merged here in O(N * splits) torch ops, no locks.

    ``perm`` (vocabulary ids in walking order, most probable classes first) and ``eps`` (the
    filter threshold) turn on the tile statistics: one launch over the first (head) tile gives
    every row's log-sum-exp there, M0, the reference of the statistics; the next launches walk
    the other tiles with the online softmax started at M0.

    ``tma`` (default: ``use_tma``, for a sorted walk from FWD_TMA_SORTED_MIN_N rows on) reads tiles
    by tensor descriptors: the rows ``e2d[erow]`` are gathered once into an [N, D] buffer, and a
    sorted vocabulary is walked in slabs of about ``slab_bytes`` (default FWD_SLAB_BYTES) whose
    rows are gathered into a buffer first.
    """
    _check(e2d, c, bias, weight, erow, tgt, n_valid, perm)
    N = erow.numel()
    V, D = c.shape
    dev = e2d.device
    cfg = config or _config(e2d.dtype, "fwd")
    BN, BV = cfg.BLOCK_N, cfg.BLOCK_V
    n_blocks = triton.cdiv(N, BN)
    n_vtiles = triton.cdiv(V, BV)
    stats = perm is not None
    if tma is None:
        tma = use_tma(e2d, c) and (not stats or N >= FWD_TMA_SORTED_MIN_N)
    TD = _tensor_descriptor() if tma else None
    if tma and TD is None:
        raise ValueError("tma=True needs triton.tools.tensor_descriptor")
    if tma and (D * e2d.element_size()) % 16 != 0:
        raise ValueError(f"tma=True needs rows of a multiple of 16 bytes, got D = {D}")
    pps = programs_per_sm or (FWD_PROGRAMS_PER_SM_TMA if tma else FWD_PROGRAMS_PER_SM)
    max_splits = max(1, triton.cdiv(pps * _n_sm(dev), max(n_blocks, 1)))
    head = 1 if stats else 0

    # Slabs of tiles [lo, hi), each one descriptor range of gathered rows (TMA, sorted or unaligned c).
    if tma and (stats or not _tma_rows_ok(c)):
        slab_tiles = max(1, (slab_bytes or FWD_SLAB_BYTES) // (BV * D * c.element_size()))
        slabs = [(lo, min(lo + slab_tiles, n_vtiles)) for lo in range(0, n_vtiles, slab_tiles)]
    else:
        slabs = [(0, n_vtiles)]

    def split(lo: int, hi: int) -> int:
        # splits of a launch over tiles [lo, hi) (balanced: their sizes differ by one at most)
        return min(hi - lo, max_splits)

    parts = head + sum(split(max(lo, head), hi) for lo, hi in slabs if hi > max(lo, head))

    f32 = torch.float32
    tpos = tgt
    if stats:
        if not eps > 0:
            raise ValueError(f"the tile statistics need a filter threshold eps > 0, got {eps}")
        tpos = inverse_permutation(perm).index_select(0, tgt)
    Mx = torch.full((parts, N), float("-inf"), dtype=f32, device=dev)
    Se = torch.zeros((parts, N), dtype=f32, device=dev)
    Ss = torch.zeros((parts, N), dtype=f32, device=dev) if smoothing else Se
    zt = torch.empty(N, dtype=f32, device=dev)
    St = torch.empty((N, n_vtiles), dtype=torch.float16, device=dev) if stats else None
    Sq = torch.empty((N, n_vtiles), dtype=torch.int8, device=dev) if stats else None
    e_arg = e2d
    c_buf = None
    if tma and N > 0:
        e_arg = TD.from_tensor(e2d.index_select(0, erow), [BN, cfg.BLOCK_D])
        if len(slabs) > 1 or stats or not _tma_rows_ok(c):
            c_buf = torch.empty((min(V, slabs[0][1] * BV), D), dtype=c.dtype, device=dev)

    def slab_operand(lo: int, hi: int):
        # (C argument, first tile it holds) for the slab of tiles [lo, hi): with TMA a
        # descriptor of c itself or of the slab's rows gathered into c_buf.
        if not tma:
            return c, 0
        if c_buf is None:
            return TD.from_tensor(c, [BV, cfg.BLOCK_D]), 0
        v0, v1 = lo * BV, min(hi * BV, V)
        buf = c_buf[: v1 - v0]
        if stats:
            torch.index_select(c, 0, perm[v0:v1], out=buf)
        else:
            buf.copy_(c[v0:v1])
        return TD.from_tensor(buf, [BV, cfg.BLOCK_D]), lo

    def launch(c_arg, tile0, grid, part0, tile_lo, tile_hi, m0):
        _fwd_kernel[grid](
            e_arg, c_arg, bias if bias is not None else e2d, weight if weight is not None else e2d,
            erow, tpos, zt, n_valid, perm if stats else erow, m0 if m0 is not None else Mx,
            Mx[part0:], Se[part0:], Ss[part0:],
            St if stats else Mx, Sq if stats else Mx,
            N, V, D, e2d.stride(0), c.stride(0), N, n_vtiles, n_vtiles, tile_lo, tile_hi, grid[1], tile0,
            float(softcap), math.log(eps) if stats else 0.0,
            HAS_BIAS=bias is not None, HAS_SOFTCAP=softcap > 0, HAS_SMOOTH=smoothing,
            HAS_WEIGHT=weight is not None, SORTED=stats, STATS=stats, HAS_INIT=m0 is not None,
            EVEN_V=V % BV == 0,
            TMA=tma, BLOCK_N=BN, BLOCK_V=BV, BLOCK_D=cfg.BLOCK_D,
            PRECISION=_precision(e2d.dtype), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip

    ctx = torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext()
    m0 = None
    with ctx:
        if N > 0:
            # The target logits first, by a kernel of their own (N x D reads): the tile epilogue
            # then needs no per-entry target extraction.
            _target_logits(e2d, c, bias, erow, tgt, n_valid, softcap, zt)
        part = head
        for lo, hi in slabs if N > 0 else ():
            c_arg, tile0 = slab_operand(lo, hi)
            if stats and lo == 0:
                launch(c_arg, tile0, (n_blocks, 1), 0, 0, 1, None)
                # The head tile's log-sum-exp (rows past n_valid: -inf + log 0, never read).
                m0 = Mx[0] + torch.log(Se[0])
            lo = max(lo, head)
            if hi > lo:
                splits = split(lo, hi)
                launch(c_arg, tile0, (n_blocks, splits), part, lo, hi, m0)
                part += splits
        if stats and m0 is None:  # N == 0
            m0 = Mx[0] + torch.log(Se[0])
    # Merge the splits: lse = M + log sum_s S_s exp(m_s - M). Rows never written (ignored) keep
    # m = -inf, S = 0 everywhere and are zeroed through `done`.
    M = Mx.max(0).values
    done = torch.isfinite(M)
    Mz = torch.where(done, M, 0.0)
    S = (Se * torch.exp(Mx - Mz)).sum(0)
    lse = torch.where(done, Mz + torch.log(torch.where(done, S, 1.0)), 0.0)
    tl_ = torch.where(done, zt, 0.0)
    ss = torch.where(done, Ss.sum(0), 0.0) if smoothing else None
    if m0 is not None:
        m0 = torch.where(torch.isfinite(m0), m0, 0.0)
    return FwdStats(lse, tl_, ss, St, Sq, m0)


@triton.jit
def _dense_dz(
    L, lse, alpha, beta, Gamma, W, offs_n, vid, is_t, row_mask, col_mask, softcap,
    HAS_SOFTCAP: tl.constexpr, FOLD_SMOOTH: tl.constexpr, HAS_WEIGHT: tl.constexpr,
):  # fmt: skip
    """(dZ, p) of a logit tile L (bias added, softcap not yet), fp32, 0 outside the rows / columns:
    dZ = (alpha p - beta [v == t] [- gamma w]) softcap'. The target term is formed in the tile,
    before any rounding (see _bwd_kernel)."""
    if HAS_SOFTCAP:
        th = _tanh(L / softcap)
        L = softcap * th
    mask2 = row_mask[:, None] & col_mask[None, :]
    p = tl.where(mask2, tl.exp(L - lse[:, None]), 0.0)
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
def _round_dz(dz, DZ, InvScale, SCALE_DZ: tl.constexpr):
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
def _store_dz(
    dz, is_t, offs_n, row_mask, offs_p, col_mask, DZ, InvScale, TLo, N, stride_dz, col0,
    SCALE_DZ: tl.constexpr, TARGET_LO: tl.constexpr,
):  # fmt: skip
    """Round the dZ tile to DZ's dtype and store it at columns offs_p - col0 of the slab; returns
    (rounded tile, inv) with inv the fp16 scale's inverse (1 without SCALE_DZ). Rows past n_valid
    in a partly valid block are stored as zeros. TARGET_LO: the target entry's rounding remainder
    goes to TLo[row] (added back in fp32 outside)."""
    dzr, back, inv = _round_dz(dz, DZ, InvScale, SCALE_DZ)
    if TARGET_LO:
        lo = tl.sum(tl.where(is_t, dz - back, 0.0), axis=1)
        row_t = tl.max(is_t.to(tl.int32), axis=1) > 0
        tl.store(TLo + offs_n, lo, mask=row_mask & row_t)
    dz_ptr = DZ + offs_n.to(tl.int64)[:, None] * stride_dz + (offs_p - col0)[None, :]
    tl.store(dz_ptr, dzr, mask=(offs_n < N)[:, None] & col_mask[None, :])
    return dzr, inv


@triton.jit
def _bwd_kernel(
    E, C, Bias, W, Erow, Tgt, Perm, NValid, Lse, Alpha, Beta, Gamma,
    dE, dC, dBias, R, CSK, Skip, DZ, InvScale, TLo,
    N, V, D, stride_e, stride_c, stride_de, stride_dc, n_vtiles, softcap, eps, tile0, stride_dz,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, FOLD_SMOOTH: tl.constexpr, HAS_WEIGHT: tl.constexpr,
    SORTED: tl.constexpr, FILTER: tl.constexpr, WRITE_SKIP: tl.constexpr, SCALE_DZ: tl.constexpr,
    STORE_DZ: tl.constexpr, TARGET_LO: tl.constexpr,
    NEED_DE: tl.constexpr, NEED_DC: tl.constexpr, NEED_DBIAS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """One (token block, vocabulary tile): recompute the logits, form the dense part of dZ and
    add dZ @ C to dE, dZ^T @ E to dC (fp32 atomics), colsum(dZ) to dbias.

    dZ = (alpha p - beta [v == t] [- gamma w with softcap]) * softcap'. The target term is
    formed in the tile, before dZ is rounded to the operand dtype: rounding alpha p_it and
    subtracting beta exactly outside would turn the cancellation alpha p_it - beta (p_it near 1)
    into a large relative error of dC (measured: 1.4e-2 instead of 3e-3 on zipf data). Without
    softcap, the smoothing term -gamma w is rank-1 and added exactly outside (triton_impl.py).
    With FILTER, a tile whose probabilities are all < eps and that holds no row's target skips
    both gradient matmuls and writes rowsum(dZ) to R[row, tile] and colsum(dZ) to CSK[block, id]
    instead, for the rank-1 corrections (rowsum x mean C_tile, colsum x mean E_block) outside.
    With STORE_DZ (exact path), the tile of dZ is stored instead, at column (position - tile0 *
    BLOCK_V) of the [N, slab] buffer DZ, for cuBLAS products outside; rows past n_valid in a
    partly valid block are stored as zeros.

    TARGET_LO (bf16 / fp16 operands): the target entry dZ_it is the one entry whose rounding
    error is not averaged away (it carries the -beta term; rounding it, or rounding alpha p_it
    and adding -beta exactly, costs 2^-9 of ||c_t|| in dE_i and of the row sums in dC_t, where
    dE_i itself is a small difference). Its rounding remainder dZ_it - round(dZ_it) goes to
    TLo[row] and is added back in fp32 outside, so the target term is exact.
    """
    pid_n = tl.program_id(0)
    pid_v = tl.program_id(1) + tile0
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
    L = _logit_tile(
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
    dz, p = _dense_dz(
        L, lse, alpha, beta, Gamma, W, offs_n, vid, is_t, row_mask, col_mask, softcap,
        HAS_SOFTCAP, FOLD_SMOOTH, HAS_WEIGHT,
    )  # fmt: skip
    if NEED_DBIAS:
        tl.atomic_add(dBias + vid, tl.sum(dz, axis=0), mask=col_mask, sem="relaxed")
    if STORE_DZ:
        dzr, inv = _store_dz(
            dz, is_t, offs_n, row_mask, offs_p, col_mask, DZ, InvScale, TLo, N, stride_dz,
            tile0 * BLOCK_V, SCALE_DZ, TARGET_LO,
        )  # fmt: skip
        if not NEED_DE:
            return  # exact path: both products by cuBLAS on the slab
    if FILTER:
        has_t = tl.max(tl.max(is_t.to(tl.int32), axis=1), axis=0) > 0
        skip = (tl.max(tl.max(p, axis=1), axis=0) < eps) & (not has_t)
        if WRITE_SKIP:
            tl.store(Skip + pid_n.to(tl.int64) * n_vtiles + pid_v, skip.to(tl.int8))
        if skip:
            if NEED_DE:
                tl.store(R + offs_n.to(tl.int64) * n_vtiles + pid_v, tl.sum(dz, axis=1), mask=row_mask)
            if NEED_DC:
                tl.store(CSK + pid_n.to(tl.int64) * V + vid, tl.sum(dz, axis=0), mask=col_mask)
            return
    if STORE_DZ:
        # Filtered slab path: dE of a kept tile from the same rounded tile (lo already stored).
        dzc = dzr
        if SCALE_DZ:
            scale = 1.0 / inv
        else:
            scale = 1.0
    else:
        if SCALE_DZ:
            # fp16 operands: alpha p can sit below fp16's normal range (alpha ~ 1/N for "mean"),
            # so the tile is scaled to max |dZ| = 1 before rounding and the products scaled back.
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
class BwdOut:
    """fp32 accumulators; R / CSK hold the skipped tiles' row / column sums (None unfiltered)."""

    dE: torch.Tensor | None
    dC: torch.Tensor | None
    dbias: torch.Tensor | None
    R: torch.Tensor | None  # [N, n_vtiles] per sorted row
    CSK: torch.Tensor | None  # [n_blocks, V] per vocabulary id
    skip: torch.Tensor | None  # [n_blocks, n_vtiles] int8, only with record_skip
    BLOCK_N: int
    BLOCK_V: int


def backward_blocks(dtype: torch.dtype) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_V) the backward uses for ``dtype``: the filter's tile shape."""
    cfg = _config(dtype, "bwd")
    return cfg.BLOCK_N, cfg.BLOCK_V


def linear_ce_backward(
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
    record_skip: bool = False,
    config: KernelConfig | None = None,
) -> BwdOut:
    """Gradients of the sorted rows ``e2d[erow]`` (tgt, lse, alpha, beta, gamma per sorted row).

    ``gamma`` given means the smoothing term is folded into the tiles (softcap on); ``perm``
    (vocabulary ids in walking order) given means the tiles are walked in that order.
    """
    _check(e2d, c, bias, weight, erow, tgt, n_valid, lse, alpha, beta, gamma, perm)
    N = erow.numel()
    V, D = c.shape
    dev = e2d.device
    cfg = config or _config(e2d.dtype, "bwd")
    n_blocks = triton.cdiv(N, cfg.BLOCK_N)
    n_vtiles = triton.cdiv(V, cfg.BLOCK_V)
    f32 = torch.float32
    filt = eps > 0
    dE = torch.zeros(e2d.shape, dtype=f32, device=dev) if need_de else None
    dC = torch.zeros(c.shape, dtype=f32, device=dev) if need_dc else None
    db = torch.zeros(V, dtype=f32, device=dev) if need_dbias else None
    R = torch.zeros((N, n_vtiles), dtype=f32, device=dev) if (filt and need_de) else None
    CSK = torch.zeros((n_blocks, V), dtype=f32, device=dev) if (filt and need_dc) else None
    skip = None
    if record_skip and filt:
        skip = torch.full((n_blocks, n_vtiles), -1, dtype=torch.int8, device=dev)
    dummy = alpha
    lo = None
    if e2d.dtype != f32 and (need_de or need_dc):
        lo = torch.zeros(N, dtype=f32, device=dev)
    if N > 0 and (need_de or need_dc or need_dbias):
        with torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext():
            _bwd_kernel[(n_blocks, n_vtiles)](
                e2d, c, bias if bias is not None else dummy, weight if weight is not None else dummy,
                erow, tgt, perm if perm is not None else erow, n_valid, lse, alpha, beta,
                gamma if gamma is not None else dummy,
                dE if dE is not None else dummy, dC if dC is not None else dummy,
                db if db is not None else dummy, R if R is not None else dummy,
                CSK if CSK is not None else dummy, skip if skip is not None else dummy, dummy, dummy,
                lo if lo is not None else dummy,
                N, V, D, e2d.stride(0), c.stride(0), D, D, n_vtiles, float(softcap), float(eps), 0, 0,
                HAS_BIAS=bias is not None, HAS_SOFTCAP=softcap > 0, FOLD_SMOOTH=gamma is not None,
                HAS_WEIGHT=weight is not None, SORTED=perm is not None, FILTER=filt,
                WRITE_SKIP=skip is not None, SCALE_DZ=e2d.dtype == torch.float16, STORE_DZ=False,
                TARGET_LO=lo is not None,
                NEED_DE=need_de, NEED_DC=need_dc, NEED_DBIAS=need_dbias,
                BLOCK_N=cfg.BLOCK_N, BLOCK_V=cfg.BLOCK_V, BLOCK_D=cfg.BLOCK_D,
                PRECISION=_precision(e2d.dtype), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            )  # fmt: skip
    if lo is not None and N > 0:
        _add_target_lo(e2d, c, erow, tgt, lo, dE, dC)
    return BwdOut(dE, dC, db, R, CSK, skip, cfg.BLOCK_N, cfg.BLOCK_V)


def _add_target_lo(e2d, c, erow, tgt, lo, dE, dC, chunk: int = 8192) -> None:
    """Adds the target entries' rounding remainders (TLo) in fp32: dE_i += lo_i c_t,
    dC_t += lo_i e_i (rows in the sorted order; lo is 0 at ignored rows)."""
    for s in range(0, lo.numel(), chunk):
        ls, ts, es = lo[s : s + chunk, None], tgt[s : s + chunk], erow[s : s + chunk]
        if dE is not None:
            dE.index_add_(0, es, ls * c.index_select(0, ts).float())
        if dC is not None:
            dC.index_add_(0, ts, ls * e2d.index_select(0, es).float())


@triton.jit
def _dz_slab_kernel(
    E, C, Bias, W, NValid, Lse, Alpha, Gamma, DZ, InvScale,
    N, V, D, stride_dz, tile0, tile_hi, n_splits, softcap,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, FOLD_SMOOTH: tl.constexpr, HAS_WEIGHT: tl.constexpr,
    SCALE_DZ: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """The exact path's dZ slab by tensor descriptors (Hopper) for unsorted vocabularies: each
    program walks its balanced share (see _fwd_kernel) of the slab's tiles [tile0, tile_hi) for
    one token block in one flat (tile, D chunk) loop, as _fwd_kernel does. E: descriptor of the
    gathered rows (row i = sorted row i), C: descriptor of c; DZ column 0 is tile0's first class.

    The tile's epilogue has no per-entry target or row work: it stores
    (alpha p [- gamma w]) softcap' and _dz_target_kernel then overwrites the target entries;
    rows past n_valid get p = 0 through lse = +inf (and alpha = 0), columns past V are not stored.
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
            L = acc
            if HAS_BIAS:
                L += tl.load(Bias + offs_p, mask=col_mask, other=0.0).to(tl.float32)[None, :]
            if HAS_SOFTCAP:
                th = _tanh(L / softcap)
                L = softcap * th
            dz = alpha[:, None] * _exp(L - lse[:, None])  # [BLOCK_N, BLOCK_V]
            if FOLD_SMOOTH:
                if HAS_WEIGHT:
                    w = tl.load(W + offs_p, mask=col_mask, other=0.0).to(tl.float32)
                    dz -= gamma[:, None] * w[None, :]
                else:
                    dz -= gamma[:, None]
            if HAS_SOFTCAP:
                dz *= 1.0 - th * th
            dz_ptr = row_ptr + (offs_p - tile0 * BLOCK_V)[None, :]
            tl.store(dz_ptr, dz.to(DZ.dtype.element_ty), mask=(offs_n < N)[:, None] & col_mask[None, :])
            acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)


@triton.jit
def _dz_target_kernel(
    Zt, Tgt, NValid, Lse, Alpha, Beta, Gamma, W, DZ, InvScale, TLo, v0, v1, stride_dz, softcap,
    HAS_SOFTCAP: tl.constexpr, FOLD_SMOOTH: tl.constexpr, HAS_WEIGHT: tl.constexpr,
    SCALE_DZ: tl.constexpr, TARGET_LO: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Overwrites the target entries of a dZ slab (classes [v0, v1)) with their exact value
    (alpha p_t - beta [- gamma w_t]) softcap'(z_t), p_t = exp(z_t - lse), from the target logits
    Zt (softcap applied): the slab kernel stored alpha p_t [- gamma w_t] there. TARGET_LO: the
    rounding remainder of that entry to TLo (added back in fp32 outside, as _bwd_kernel does)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    n_valid = tl.load(NValid)
    valid = offs < n_valid
    t = tl.load(Tgt + offs, mask=valid, other=-1).to(tl.int64)
    m = valid & (t >= v0) & (t < v1)
    zt = tl.load(Zt + offs, mask=m, other=0.0)
    lse = tl.load(Lse + offs, mask=m, other=0.0)
    alpha = tl.load(Alpha + offs, mask=m, other=0.0)
    beta = tl.load(Beta + offs, mask=m, other=0.0)
    v = alpha * tl.exp(zt - lse) - beta
    if FOLD_SMOOTH:
        gamma = tl.load(Gamma + offs, mask=m, other=0.0)
        if HAS_WEIGHT:
            gamma *= tl.load(W + t, mask=m, other=0.0).to(tl.float32)
        v -= gamma
    if HAS_SOFTCAP:
        r = zt / softcap
        v *= 1.0 - r * r
    vr, back, _inv = _round_dz(v, DZ, InvScale, SCALE_DZ)
    tl.store(DZ + offs.to(tl.int64) * stride_dz + (t - v0), vr, mask=m)
    if TARGET_LO:
        tl.store(TLo + offs, v - back, mask=m)


# Bytes of the exact path's dZ slab ([N, slab] in the operand dtype).
DZ_SLAB_BYTES = 256 << 20


@dataclass
class DenseOut:
    """dE (fp32; sorted rows [N, D] if ``dE_sorted`` else e2d-shaped), dC (c.dtype), dbias (fp32),
    R (skipped tiles' row sums, filtered only), skip flags (record_skip only)."""

    dE: torch.Tensor | None
    dE_sorted: bool
    dC: torch.Tensor | None
    dbias: torch.Tensor | None
    R: torch.Tensor | None
    skip: torch.Tensor | None
    BLOCK_N: int
    BLOCK_V: int


def linear_ce_backward_slabs(
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
    eps: float = 0.0,
    perm: torch.Tensor | None = None,
    dc_rank1: tuple[torch.Tensor, torch.Tensor] | None = None,
    record_skip: bool = False,
    slab_bytes: int | None = None,
    config: KernelConfig | None = None,
    tma: bool | None = None,
) -> DenseOut:
    """Backward through vocabulary slabs: dC by cuBLAS, never by atomics.

    For each slab of (sorted, if ``perm``) vocabulary positions the kernel stores dZ[:, slab]
    (operand dtype, target term included, smoothing folded in when ``gamma`` is given); cuBLAS
    writes dC[slab] = dZ_slab^T @ E_sorted once (fp32 accumulation inside the GEMM, one rounding
    to c's dtype: no fp32 dC buffer, no filter error in dC). dE:

    - eps == 0 (exact): dE_sorted += dZ_slab @ C_slab by cuBLAS into an fp32 [N, D] buffer;
    - eps > 0 (filtered): the kernel adds dZ_tile @ C_tile to an fp32 e2d-shaped dE with atomics
      for kept tiles only and writes rowsum(dZ_tile) to R for skipped ones (rank-1 correction
      outside, see triton_impl.py).

    ``dc_rank1 = (w, ge)`` subtracts w (outer) ge from dC (the smoothing term without softcap,
    which the filtered path keeps out of the tiles) before the rounding. Extra memory: the slab
    (<= slab_bytes) and the sorted rows of e.

    ``tma`` (default: ``use_tma``, exact path with the vocabulary in id order and no bias
    gradient only) forms the slabs by _dz_slab_kernel, with the forward's tiles.
    """
    _check(e2d, c, bias, weight, erow, tgt, n_valid, lse, alpha, beta, gamma, perm)
    N = erow.numel()
    V, D = c.shape
    dev = e2d.device
    simple = eps == 0 and perm is None and not need_dbias and _tma_rows_ok(c)
    tma = (simple and use_tma(e2d, c)) if tma is None else tma
    if tma and not simple:
        raise ValueError("tma=True: exact path, vocabulary in id order, no bias gradient only")
    cfg = config or _config(e2d.dtype, "fwd" if tma else "bwd")
    n_blocks = triton.cdiv(N, cfg.BLOCK_N)
    n_vtiles = triton.cdiv(V, cfg.BLOCK_V)
    f32 = torch.float32
    filt = eps > 0
    esz = e2d.element_size()
    slab_bytes = DZ_SLAB_BYTES if slab_bytes is None else slab_bytes
    slab_tiles = max(1, min(n_vtiles, slab_bytes // max(1, N * esz * cfg.BLOCK_V)))
    if tma:
        max_splits = max(1, triton.cdiv(FWD_PROGRAMS_PER_SM_TMA * _n_sm(dev), n_blocks))
        if max_splits <= slab_tiles < n_vtiles:
            # A whole number of tiles per split (the splits are the grid's waves of equal programs).
            slab_tiles = min(n_vtiles, round(slab_tiles / max_splits) * max_splits)
    slab = slab_tiles * cfg.BLOCK_V
    if filt:
        dE = torch.zeros(e2d.shape, dtype=f32, device=dev) if need_de else None
    else:
        dE = torch.zeros((N, D), dtype=f32, device=dev) if need_de else None
    # Every slab writes all of its rows of dC (no memset of V x D) unless there are no rows at all.
    dC = (torch.empty if N > 0 else torch.zeros)((V, D), dtype=c.dtype, device=dev) if need_dc else None
    db = torch.zeros(V, dtype=f32, device=dev) if need_dbias else None
    R = torch.zeros((N, n_vtiles), dtype=f32, device=dev) if (filt and need_de) else None
    skip = None
    if record_skip and filt:
        skip = torch.full((n_blocks, n_vtiles), -1, dtype=torch.int8, device=dev)
    out = DenseOut(dE, not filt, dC, db, R, skip, cfg.BLOCK_N, cfg.BLOCK_V)
    if N == 0 or not (need_de or need_dc or need_dbias):
        return out
    # Rows past n_valid are never written by the kernel: zero once, they stay zero.
    DZ = torch.zeros((N, slab), dtype=e2d.dtype, device=dev)
    scale = None
    inv = alpha
    if e2d.dtype == torch.float16:
        scale = alpha.abs().amax().clamp(min=1e-30).reshape(1)
        inv = (1.0 / scale).contiguous()
    E_s = e2d.index_select(0, erow) if (need_dc or tma) else None
    if tma:
        TD = _tensor_descriptor()
        e_desc = TD.from_tensor(E_s, [cfg.BLOCK_N, cfg.BLOCK_D])
        c_desc = TD.from_tensor(c, [cfg.BLOCK_V, cfg.BLOCK_D])
    # The target entry's rounding remainder goes back into the fp32 dE (dC is rounded once).
    lo = torch.zeros(N, dtype=f32, device=dev) if (e2d.dtype != f32 and need_de) else None
    dummy = alpha
    zt = None
    if tma:
        zt = torch.empty(N, dtype=f32, device=dev)
        with torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext():
            _target_logits(e2d, c, bias, erow, tgt, n_valid, softcap, zt)
    for t0 in range(0, n_vtiles, slab_tiles):
        nt = min(slab_tiles, n_vtiles - t0)
        v0, v1 = t0 * cfg.BLOCK_V, min(V, (t0 + nt) * cfg.BLOCK_V)
        with torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext():
            if tma:
                splits = min(nt, max_splits)
                _dz_slab_kernel[(n_blocks, splits)](
                    e_desc, c_desc, bias if bias is not None else dummy,
                    weight if weight is not None else dummy, n_valid, lse, alpha,
                    gamma if gamma is not None else dummy, DZ, inv,
                    N, V, D, slab, t0, t0 + nt, splits, float(softcap),
                    HAS_BIAS=bias is not None, HAS_SOFTCAP=softcap > 0, FOLD_SMOOTH=gamma is not None,
                    HAS_WEIGHT=weight is not None, SCALE_DZ=scale is not None,
                    BLOCK_N=cfg.BLOCK_N, BLOCK_V=cfg.BLOCK_V, BLOCK_D=cfg.BLOCK_D,
                    PRECISION=_precision(e2d.dtype), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                )  # fmt: skip
                TB = 256
                _dz_target_kernel[(triton.cdiv(N, TB),)](
                    zt, tgt, n_valid, lse, alpha, beta, gamma if gamma is not None else dummy,
                    weight if weight is not None else dummy, DZ, inv, lo if lo is not None else dummy,
                    v0, v1, slab, float(softcap),
                    HAS_SOFTCAP=softcap > 0, FOLD_SMOOTH=gamma is not None, HAS_WEIGHT=weight is not None,
                    SCALE_DZ=scale is not None, TARGET_LO=lo is not None, BLOCK=TB,
                )  # fmt: skip
            else:
                _bwd_kernel[(n_blocks, nt)](
                    e2d, c, bias if bias is not None else dummy, weight if weight is not None else dummy,
                    erow, tgt, perm if perm is not None else erow, n_valid, lse, alpha, beta,
                    gamma if gamma is not None else dummy,
                    dE if (filt and dE is not None) else dummy, dummy, db if db is not None else dummy,
                    R if R is not None else dummy, dummy, skip if skip is not None else dummy, DZ, inv,
                    lo if lo is not None else dummy,
                    N, V, D, e2d.stride(0), c.stride(0), D, D, n_vtiles, float(softcap), float(eps), t0, slab,
                    HAS_BIAS=bias is not None, HAS_SOFTCAP=softcap > 0, FOLD_SMOOTH=gamma is not None,
                    HAS_WEIGHT=weight is not None, SORTED=perm is not None, FILTER=filt,
                    WRITE_SKIP=skip is not None, SCALE_DZ=scale is not None, STORE_DZ=True,
                    TARGET_LO=lo is not None, NEED_DE=filt and need_de, NEED_DC=False, NEED_DBIAS=need_dbias,
                    BLOCK_N=cfg.BLOCK_N, BLOCK_V=cfg.BLOCK_V, BLOCK_D=cfg.BLOCK_D,
                    PRECISION=_precision(e2d.dtype), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                )  # fmt: skip
        dz = DZ[:, : v1 - v0]
        ids = None if perm is None else perm[v0:v1]
        if dE is not None and not filt:
            c_slab = c[v0:v1] if ids is None else c.index_select(0, ids)
            if scale is None and dz.is_cuda and dz.dtype != f32:
                # Accumulated by the GEMM itself (beta = 1, fp32 output): no fp32 [N, D]
                # temporary per slab to write, read back and add.
                torch.addmm(dE, dz, c_slab, out_dtype=f32, out=dE)
            else:
                dE += _mm_f32(dz, c_slab, scale)
        if dC is not None:
            if scale is None and dc_rank1 is None and c.dtype != f32 and dev.type == "cuda":
                # fp32 accumulation inside the GEMM, one rounding to c's dtype, no fp32 temporary.
                if ids is None:
                    torch.mm(dz.T, E_s, out=dC[v0:v1])
                else:
                    dC.index_copy_(0, ids, torch.mm(dz.T, E_s))
                continue
            g = _mm_f32(dz.T, E_s, scale)
            if dc_rank1 is not None:
                w, ge = dc_rank1
                wv = w[v0:v1] if ids is None else w.index_select(0, ids)
                g.addr_(wv, ge, alpha=-1.0)
            if ids is None:
                dC[v0:v1] = g
            else:
                dC.index_copy_(0, ids, g.to(c.dtype))
    if lo is not None:
        rows = erow if filt else torch.arange(N, device=dev)
        _add_target_lo(e2d, c, rows, tgt, lo, dE, None)
    return out


def _mm_f32(a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """a @ b in fp32 (GEMM accumulation in fp32), times ``scale`` if given."""
    if a.dtype == torch.float32:
        out = torch.mm(a, b)
    elif a.is_cuda:
        out = torch.mm(a, b, out_dtype=torch.float32)
    else:
        out = torch.mm(a.float(), b.float())
    return out if scale is None else out * scale


# ---------------------------------------------------------------------------------------------
# Sparse backward: the forward's tile statistics decide which tiles are recomputed at all.


@triton.jit
def _block_rows(Erow, Tgt, Lse, Alpha, offs_n, row_mask):
    """(e2d row int64, target int64 (-1 masked), lse, alpha) of a token block's sorted rows."""
    erow = tl.load(Erow + offs_n, mask=row_mask, other=0).to(tl.int64)
    tgt = tl.load(Tgt + offs_n, mask=row_mask, other=-1).to(tl.int64)
    lse = tl.load(Lse + offs_n, mask=row_mask, other=0.0)
    alpha = tl.load(Alpha + offs_n, mask=row_mask, other=0.0)
    return erow, tgt, lse, alpha


@triton.jit
def _tile_cols(Perm, j, V, BLOCK_V: tl.constexpr):
    """(positions, their mask, vocabulary ids int64) of tile j of the walking order Perm."""
    offs_p = j * BLOCK_V + tl.arange(0, BLOCK_V)
    col_mask = offs_p < V
    vid = tl.load(Perm + offs_p, mask=col_mask, other=0).to(tl.int64)
    return offs_p, col_mask, vid


@triton.jit
def _dz_tile(
    E, C, Bias, erow, vid, tgt, lse, alpha, row_mask, col_mask, D, stride_e, stride_c, softcap,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, SCALE_DZ: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """(dZ tile in the operand dtype, its scale): alpha p softcap' at the non-target entries.

    The target entries are 0 here; their exact term is added in fp32 by the caller. SCALE_DZ
    (fp16): the tile is scaled to max |dZ| = 1 before rounding (alpha p can sit below fp16's
    normal range), the products are to be multiplied by the returned scale.
    """
    L = _logit_tile(
        E, C, erow, vid, row_mask, col_mask, D, stride_e, stride_c, BLOCK_N, BLOCK_V, BLOCK_D, PRECISION
    )  # [BLOCK_N, BLOCK_V]
    if HAS_BIAS:
        b = tl.load(Bias + vid, mask=col_mask, other=0.0).to(tl.float32)
        L += b[None, :]
    if HAS_SOFTCAP:
        th = _tanh(L / softcap)
        L = softcap * th
    nt = row_mask[:, None] & col_mask[None, :] & (vid[None, :] != tgt[:, None])
    dz = tl.where(nt, alpha[:, None] * tl.exp(L - lse[:, None]), 0.0)
    if HAS_SOFTCAP:
        dz *= 1.0 - th * th
    if SCALE_DZ:
        scale = tl.max(tl.max(tl.abs(dz), axis=1), axis=0)
        scale = tl.where(scale > 0, scale, 1.0)
        dzc = (dz / scale).to(E.dtype.element_ty)
    else:
        scale = 1.0
        dzc = dz.to(E.dtype.element_ty)
    return dzc, scale


@triton.jit
def _kept_dz(
    Scratch, ScaleBuf, gk, cap,
    E, C, Bias, erow, vid, tgt, lse, alpha, row_mask, col_mask, D, stride_e, stride_c, softcap,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, SCALE_DZ: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """The dZ tile of the gk-th kept tile: from the scratch written by _kept_dz_kernel when it has a
    slot there (gk < cap), else recomputed."""
    if gk < cap:
        offs = tl.arange(0, BLOCK_N)[:, None] * BLOCK_V + tl.arange(0, BLOCK_V)[None, :]
        dzc = tl.load(Scratch + gk.to(tl.int64) * (BLOCK_N * BLOCK_V) + offs)
        if SCALE_DZ:
            scale = tl.load(ScaleBuf + gk)
        else:
            scale = 1.0
    else:
        dzc, scale = _dz_tile(
            E, C, Bias, erow, vid, tgt, lse, alpha, row_mask, col_mask, D, stride_e, stride_c, softcap,
            HAS_BIAS, HAS_SOFTCAP, SCALE_DZ, BLOCK_N, BLOCK_V, BLOCK_D, PRECISION,
        )  # fmt: skip
    return dzc, scale


@triton.jit
def _kept_dz_to_slot(
    E, C, Bias, Erow, Tgt, Perm, NValid, Lse, Alpha, Scratch, ScaleBuf, blk, j, slot,
    V, D, stride_e, stride_c, softcap,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, SCALE_DZ: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """The dZ tile (token block blk, vocabulary tile j) into scratch slot ``slot``."""
    n_valid = tl.load(NValid)
    offs_n = blk * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = offs_n < n_valid
    erow, tgt, lse, alpha = _block_rows(Erow, Tgt, Lse, Alpha, offs_n, row_mask)
    offs_p, col_mask, vid = _tile_cols(Perm, j, V, BLOCK_V)
    dzc, scale = _dz_tile(
        E, C, Bias, erow, vid, tgt, lse, alpha, row_mask, col_mask, D, stride_e, stride_c, softcap,
        HAS_BIAS, HAS_SOFTCAP, SCALE_DZ, BLOCK_N, BLOCK_V, BLOCK_D, PRECISION,
    )  # fmt: skip
    offs = tl.arange(0, BLOCK_N)[:, None] * BLOCK_V + tl.arange(0, BLOCK_V)[None, :]
    tl.store(Scratch + slot.to(tl.int64) * (BLOCK_N * BLOCK_V) + offs, dzc)
    if SCALE_DZ:
        one = tl.arange(0, 1)
        tl.store(ScaleBuf + slot + one, scale + tl.zeros((1,), tl.float32))


@triton.jit
def _kept_dz_kernel(
    E, C, Bias, Erow, Tgt, Perm, NValid, Lse, Alpha, KList, NKept, Scratch, ScaleBuf,
    V, D, stride_e, stride_c, n_vtiles, softcap,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, SCALE_DZ: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Program k: the dZ tile of the k-th kept tile (in (block, tile) order), once, into scratch
    slot k (the dC writer reads it once per D chunk instead of recomputing it)."""
    k = tl.program_id(0)
    if k >= tl.load(NKept):
        return
    flat = tl.load(KList + k)
    _kept_dz_to_slot(
        E, C, Bias, Erow, Tgt, Perm, NValid, Lse, Alpha, Scratch, ScaleBuf,
        flat // n_vtiles, flat % n_vtiles, k, V, D, stride_e, stride_c, softcap,
        HAS_BIAS, HAS_SOFTCAP, SCALE_DZ, BLOCK_N, BLOCK_V, BLOCK_D, PRECISION,
    )  # fmt: skip


@triton.jit
def _kept_dz_block_kernel(
    E, C, Bias, Erow, Tgt, Perm, NValid, Lse, Alpha, ListE, CntE, Scratch, ScaleBuf,
    V, D, stride_e, stride_c, n_vtiles, softcap,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, SCALE_DZ: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Program (b, s): the s-th kept tile of token block b into slot b * n_slots + s (the dE
    writer's per-block slots; the block's later kept tiles are recomputed there)."""
    blk = tl.program_id(0)
    s = tl.program_id(1)
    if s >= tl.load(CntE + blk):
        return
    j = tl.load(ListE + blk * (n_vtiles + 1) + s)
    _kept_dz_to_slot(
        E, C, Bias, Erow, Tgt, Perm, NValid, Lse, Alpha, Scratch, ScaleBuf,
        blk, j, blk * tl.num_programs(1) + s, V, D, stride_e, stride_c, softcap,
        HAS_BIAS, HAS_SOFTCAP, SCALE_DZ, BLOCK_N, BLOCK_V, BLOCK_D, PRECISION,
    )  # fmt: skip


# Codes of the skipped tiles' masses: S = exp(-code / STATS_STEPS), code 255 = no mass (kept tile,
# ignored row, or a mass carried on to the next tile). 16 steps per nat (rounding <= 3.2%
# relative, span e^-15.9) with the rounding carried from tile to tile (see _encode_stats_kernel).
STATS_STEPS = 16.0
# Tiles per carry chain of _encode_stats_kernel (the chains of one row run in parallel).
STATS_CHAIN_TILES = 128


@triton.jit
def _encode_stats_kernel(
    St, Sq, M0, Lse, NValid, Code, Keep, N, n_vtiles, stride_st, stride_code, chain,
    STEPS: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """From the forward's raw statistics of one token block over one chain of tiles: which tiles
    the backward recomputes (Keep, per block) and a uint8 code of every other tile's non-target
    mass S_ij = exp(St_ij + M0_i - lse_i) (Code, per row).

    A tile is kept if a row's bound Sq / 8 reaches lse - M0 (or is 127). The codes round
    -log(x) to 1/STEPS nat, x = S_ij plus the rounding left over from the row's previous skipped
    tile (error diffusion along the sorted vocabulary): each decoded mass is within 3.2% of x, and
    the decoded masses of a chain sum to the true ones up to the last tile's carry, so the dE
    correction sum_j S_ij mean(C_j) keeps the accuracy of its sum, not of one 8-bit code (plain
    rounding measured 14x worse on zipf data). Chains start at zero carry.
    """
    pid_n = tl.program_id(0)
    j0 = tl.program_id(1) * chain
    n_valid = tl.load(NValid)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = offs_n < n_valid
    m0 = tl.load(M0 + offs_n, mask=row_mask, other=0.0)
    lse = tl.load(Lse + offs_n, mask=row_mask, other=0.0)
    need = tl.where(row_mask, lse - m0, float("inf"))
    shift = m0 - lse
    carry = tl.zeros((BLOCK_N,), dtype=tl.float32)
    row_off = offs_n.to(tl.int64) * stride_st
    code_off = offs_n.to(tl.int64) * stride_code
    for j in range(j0, tl.minimum(j0 + chain, n_vtiles)):
        sq = tl.load(Sq + row_off + j, mask=row_mask, other=-1).to(tl.float32)
        st = tl.load(St + row_off + j, mask=row_mask, other=float("-inf")).to(tl.float32)
        kr = ((sq / 8.0 >= need) | (sq >= 127.0)) & row_mask
        keep = tl.max(kr.to(tl.int32), axis=0)
        tl.store(Keep + pid_n * n_vtiles + j, keep.to(tl.int8))
        x = tl.exp(st + shift) + carry  # [BLOCK_N]
        code = tl.floor(-tl.log(tl.where(x > 0, x, 1.0)) * STEPS + 0.5)
        code = tl.where(x > 0, tl.minimum(tl.maximum(code, 0.0), 255.0), 255.0)
        dec = tl.where(code < 255.0, tl.exp(-code / STEPS), 0.0)
        skip = keep == 0
        carry = tl.where(skip, x - dec, carry)
        code = tl.where(skip, code, 255.0)
        tl.store(Code + code_off + j, code.to(tl.uint8), mask=offs_n < N)


def encode_tile_stats(
    st: torch.Tensor,
    sq: torch.Tensor,
    m0: torch.Tensor,
    lse: torch.Tensor,
    n_valid: torch.Tensor,
    BLOCK_N: int,
    code: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(code uint8 [N, n_tiles], keep int8 [n_blocks, n_tiles]) from linear_ce_forward's raw tile
    statistics and the sorted rows' lse (see _encode_stats_kernel): what the sparse backward
    keeps of them, 1 byte per (row, tile) instead of 3. ``code``: where to write the codes (rows
    of stride >= n_tiles, e.g. the tail of a gradient stash), a new tensor by default."""
    N, nt = st.shape
    nb = triton.cdiv(N, BLOCK_N)
    if code is None:
        code = torch.empty((N, nt), dtype=torch.uint8, device=st.device)
    if code.shape != (N, nt) or code.dtype != torch.uint8 or (nt > 1 and code.stride(1) != 1):
        raise ValueError(
            f"code must be uint8 {(N, nt)} with unit column stride, got {code.dtype} {code.shape}"
        )
    keep = torch.empty((nb, nt), dtype=torch.int8, device=st.device)
    if N > 0 and nt > 0:
        with torch.cuda.device(st.device) if st.is_cuda else contextlib.nullcontext():
            _encode_stats_kernel[(nb, triton.cdiv(nt, STATS_CHAIN_TILES))](
                st, sq, m0, lse, n_valid, code, keep, N, nt, st.stride(0), code.stride(0), STATS_CHAIN_TILES,
                STEPS=STATS_STEPS, BLOCK_N=BLOCK_N,
            )  # fmt: skip
    return code, keep


def decode_tile_mass(code: torch.Tensor) -> torch.Tensor:
    """The masses S of encode_tile_stats' codes, fp32 (0 for code 255)."""
    x = code.float()
    return torch.where(x < 255, torch.exp(-x / STATS_STEPS), 0.0)


@triton.jit
def _tile_means_kernel(
    C, Perm, Cm, V, D, stride_c, stride_cm, d_lo, d_hi, BLOCK_V: tl.constexpr, BLOCK_DO: tl.constexpr
):  # fmt: skip
    """Cm[j, d - d_lo] = mean of c[:, d] over the rows at positions [j BLOCK_V, (j + 1) BLOCK_V)
    of the order, for d in [d_lo, d_hi)."""
    j = tl.program_id(0)
    offs_do = d_lo + tl.program_id(1) * BLOCK_DO + tl.arange(0, BLOCK_DO)
    dmask = offs_do < d_hi
    offs_p, col_mask, vid = _tile_cols(Perm, j, V, BLOCK_V)
    x = tl.load(
        C + vid[:, None] * stride_c + offs_do[None, :], mask=col_mask[:, None] & dmask[None, :], other=0.0
    )
    cnt = tl.sum(col_mask.to(tl.float32), axis=0)
    mean = tl.sum(x.to(tl.float32), axis=0) / cnt
    tl.store(Cm + j.to(tl.int64) * stride_cm + offs_do - d_lo, mean.to(Cm.dtype.element_ty), mask=dmask)


@triton.jit
def _sparse_de_kernel(
    E, C, Bias, Erow, Tgt, Perm, NValid, Lse, Alpha, Gamma, Coef, Code, ListE, CntE, Cm, WC,
    Scratch, ScaleBuf, dE,
    V, D, stride_e, stride_c, stride_de, stride_code, stride_cm, n_vtiles, softcap, blk0, code_row0,
    slot_blk0, cap,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SMOOTH: tl.constexpr, SCALE_DZ: tl.constexpr,
    N_SLOTS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DO: tl.constexpr, BLOCK_J: tl.constexpr, STEPS: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """dE[sorted rows of token block blk0 + program_id(0), one D chunk], written once in dE's
    dtype at the sorted rows (the caller moves them to e2d's rows):

    sum over the block's kept tiles of dZ_tile @ C_tile (the first N_SLOTS from the scratch
    slots of _kept_dz_block_kernel, block slot_blk0's first, the others recomputed)
    + alpha_i sum over its skipped tiles j of S_ij mean(C_j)   (S_ij from Code, encode_tile_stats)
    + coef_i c_{t_i} (the target entries, exact in fp32) [- gamma_i sum_v w_v c_v].

    Code row 0 is sorted row code_row0. Rows from n_valid on are not written.
    """
    pid_n = blk0 + tl.program_id(0)
    pid_d = tl.program_id(1)
    n_valid = tl.load(NValid)
    start = pid_n * BLOCK_N
    if start >= n_valid:
        return
    offs_n = start + tl.arange(0, BLOCK_N)
    row_mask = offs_n < n_valid
    erow, tgt, lse, alpha = _block_rows(Erow, Tgt, Lse, Alpha, offs_n, row_mask)
    offs_do = pid_d * BLOCK_DO + tl.arange(0, BLOCK_DO)
    dmask = offs_do < D
    acc = tl.zeros((BLOCK_N, BLOCK_DO), dtype=tl.float32)
    cnt = tl.load(CntE + pid_n)
    for k in range(0, cnt):
        j = tl.load(ListE + pid_n * (n_vtiles + 1) + k)
        offs_p, col_mask, vid = _tile_cols(Perm, j, V, BLOCK_V)
        gk = tl.where(k < N_SLOTS, (pid_n - slot_blk0) * N_SLOTS + k, cap)
        dzc, scale = _kept_dz(
            Scratch, ScaleBuf, gk, cap,
            E, C, Bias, erow, vid, tgt, lse, alpha, row_mask, col_mask, D, stride_e, stride_c, softcap,
            HAS_BIAS, HAS_SOFTCAP, SCALE_DZ, BLOCK_N, BLOCK_V, BLOCK_D, PRECISION,
        )  # fmt: skip
        c = tl.load(
            C + vid[:, None] * stride_c + offs_do[None, :], mask=col_mask[:, None] & dmask[None, :], other=0.0
        )  # [BLOCK_V, BLOCK_DO]
        acc += tl.dot(dzc, c, input_precision=PRECISION) * scale
    # Skipped tiles: S_ij = exp(-code / STEPS), the tile's non-target probability mass (times
    # softcap'; code 255, kept tiles included: 0), against the tile mean of C. Masses <= 1, so
    # the operand dtype holds them.
    corr = tl.zeros((BLOCK_N, BLOCK_DO), dtype=tl.float32)
    for j0 in range(0, n_vtiles, BLOCK_J):
        offs_j = j0 + tl.arange(0, BLOCK_J)
        jm = offs_j < n_vtiles
        code = tl.load(
            Code + (offs_n - code_row0).to(tl.int64)[:, None] * stride_code + offs_j[None, :],
            mask=row_mask[:, None] & jm[None, :], other=255,
        ).to(tl.float32)  # fmt: skip  # [BLOCK_N, BLOCK_J]
        S = tl.where(code < 255.0, tl.exp(code * (-1.0 / STEPS)), 0.0)
        cm = tl.load(
            Cm + offs_j.to(tl.int64)[:, None] * stride_cm + offs_do[None, :],
            mask=jm[:, None] & dmask[None, :], other=0.0,
        )  # fmt: skip  # [BLOCK_J, BLOCK_DO]
        corr = tl.dot(S.to(Cm.dtype.element_ty), cm, corr, input_precision=PRECISION)
    acc += alpha[:, None] * corr
    coef = tl.load(Coef + offs_n, mask=row_mask, other=0.0)
    ct = tl.load(
        C + tgt[:, None] * stride_c + offs_do[None, :], mask=row_mask[:, None] & dmask[None, :], other=0.0
    ).to(tl.float32)
    acc += coef[:, None] * ct
    if HAS_SMOOTH:
        gamma = tl.load(Gamma + offs_n, mask=row_mask, other=0.0)
        wc = tl.load(WC + offs_do, mask=dmask, other=0.0)
        acc -= gamma[:, None] * wc[None, :]
    tl.store(
        dE + offs_n.to(tl.int64)[:, None] * stride_de + offs_do[None, :], acc.to(dE.dtype.element_ty),
        mask=row_mask[:, None] & dmask[None, :],
    )  # fmt: skip


@triton.jit
def _sparse_dc_kernel(
    E, C, Bias, W, Erow, Tgt, Perm, NValid, Lse, Alpha, ListC, CntC, Seg, TRow, TPos, TCoef, Q, G, GE,
    Gidx, Scratch, ScaleBuf, dC,
    V, D, stride_e, stride_c, stride_dc, stride_g, n_blocks, n_vtiles, softcap, cap,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SMOOTH: tl.constexpr, HAS_WEIGHT: tl.constexpr,
    SCALE_DZ: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DO: tl.constexpr,
    BLOCK_R: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """dC[ids of one vocabulary tile, one D chunk], written once in dC's dtype:

    sum over the tile's kept token blocks of dZ_tile^T @ E_block (recomputed)
    + q_v G_j (the skipped blocks' mass sum_i alpha_i S_ij e_i, spread by q within the tile)
    + sum over the rows i with t_i in the tile of coef_i e_i (exact in fp32) [- w_v sum_i gamma_i e_i].
    """
    pid_v = tl.program_id(0)
    pid_d = tl.program_id(1)
    n_valid = tl.load(NValid)
    offs_p, col_mask, vid = _tile_cols(Perm, pid_v, V, BLOCK_V)
    offs_do = pid_d * BLOCK_DO + tl.arange(0, BLOCK_DO)
    dmask = offs_do < D
    acc = tl.zeros((BLOCK_V, BLOCK_DO), dtype=tl.float32)
    cnt = tl.load(CntC + pid_v)
    for k in range(0, cnt):
        blk = tl.load(ListC + pid_v * (n_blocks + 1) + k)
        offs_n = blk * BLOCK_N + tl.arange(0, BLOCK_N)
        row_mask = offs_n < n_valid
        erow, tgt, lse, alpha = _block_rows(Erow, Tgt, Lse, Alpha, offs_n, row_mask)
        gk = tl.load(Gidx + blk * n_vtiles + pid_v)
        dzc, scale = _kept_dz(
            Scratch, ScaleBuf, gk, cap,
            E, C, Bias, erow, vid, tgt, lse, alpha, row_mask, col_mask, D, stride_e, stride_c, softcap,
            HAS_BIAS, HAS_SOFTCAP, SCALE_DZ, BLOCK_N, BLOCK_V, BLOCK_D, PRECISION,
        )  # fmt: skip
        e = tl.load(
            E + erow[:, None] * stride_e + offs_do[None, :],
            mask=row_mask[:, None] & dmask[None, :],
            other=0.0,
        )  # [BLOCK_N, BLOCK_DO]
        acc += tl.dot(tl.trans(dzc), e, input_precision=PRECISION) * scale
    q = tl.load(Q + offs_p, mask=col_mask, other=0.0)
    g = tl.load(G + pid_v.to(tl.int64) * stride_g + offs_do, mask=dmask, other=0.0)
    acc += q[:, None] * g[None, :]
    # Target entries: the rows whose target lies in this tile, one fp32 one-hot product per
    # BLOCK_R of them (fp32 operands: the coefficient alpha p_t - beta is a cancellation).
    seg0 = tl.load(Seg + pid_v)
    seg1 = tl.load(Seg + pid_v + 1)
    lanes = tl.arange(0, BLOCK_V)
    for r0 in range(seg0, seg1, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        rm = offs_r < seg1
        row = tl.load(TRow + offs_r, mask=rm, other=0).to(tl.int64)
        lp = tl.load(TPos + offs_r, mask=rm, other=-1) - pid_v * BLOCK_V
        cf = tl.load(TCoef + offs_r, mask=rm, other=0.0)
        x = tl.load(
            E + row[:, None] * stride_e + offs_do[None, :], mask=rm[:, None] & dmask[None, :], other=0.0
        ).to(tl.float32) * cf[:, None]  # fmt: skip  # [BLOCK_R, BLOCK_DO]
        onehot = tl.where(lanes[:, None] == lp[None, :], 1.0, 0.0)  # [BLOCK_V, BLOCK_R]
        acc = tl.dot(onehot, x, acc, input_precision="ieee")
    if HAS_SMOOTH:
        if HAS_WEIGHT:
            w = tl.load(W + vid, mask=col_mask, other=0.0).to(tl.float32)
        else:
            w = tl.where(col_mask, 1.0, 0.0)
        ge = tl.load(GE + offs_do, mask=dmask, other=0.0)
        acc -= w[:, None] * ge[None, :]
    tl.store(
        dC + vid[:, None] * stride_dc + offs_do[None, :], acc.to(dC.dtype.element_ty),
        mask=col_mask[:, None] & dmask[None, :],
    )  # fmt: skip


@dataclass
class SparsePlan:
    """Everything the sparse backward kernels read besides the problem tensors (triton_impl.py
    builds it with torch ops on the device; rows are in the valid-first order, tiles are the
    forward's tiles of the vocabulary in ``perm`` order).

    keep [n_blocks, n_tiles] int8; list_e [n_blocks, n_tiles + 1] / cnt_e: kept tiles per block;
    list_c [n_tiles, n_blocks + 1] / cnt_c: kept blocks per tile; code [N, n_tiles] uint8: the
    skipped tiles' masses (encode_tile_stats);
    coef: per row, the exact target entry alpha p_t - beta (times softcap'); g [n_tiles, D] fp32
    skipped mass times e per tile, q [V]
    its spread within the tile (per position); trow / tpos / tcoef: valid rows ordered by the
    tile of their target (e2d row, target position, coef) with seg [n_tiles + 1] the tile
    boundaries; wc, ge: the smoothing terms sum_v w_v c_v and sum_i gamma_i e_i (fp32 [D]).
    """

    keep: torch.Tensor
    list_e: torch.Tensor
    cnt_e: torch.Tensor
    list_c: torch.Tensor
    cnt_c: torch.Tensor
    code: torch.Tensor
    coef: torch.Tensor
    g: torch.Tensor | None
    q: torch.Tensor | None
    trow: torch.Tensor | None
    tpos: torch.Tensor | None
    tcoef: torch.Tensor | None
    seg: torch.Tensor | None
    wc: torch.Tensor | None
    ge: torch.Tensor | None
    gidx: torch.Tensor  # [n_blocks, n_tiles] int32: index of each kept tile among the kept ones
    klist: torch.Tensor  # [cap + 1] int32: flat index (block * n_tiles + tile) of kept tile k < cap
    n_kept: torch.Tensor  # [1] int32


def _sparse_config() -> tuple[int, int, int, int, int, int]:
    """(BLOCK_D of the recompute, BLOCK_DO of dE and of dC, BLOCK_J, BLOCK_R, num_warps).

    A kept tile is recomputed once per D chunk of the output, so the chunks are as wide as the
    accumulator allows: [BLOCK_N, 128] for dE, [BLOCK_V = 256, 64] for dC (fp32 registers)."""
    if _interpreting():
        return 32, 32, 32, 16, 16, 4
    return 64, 128, 64, 64, 32, 8


def kept_scratch_tiles(N: int, dtype: torch.dtype) -> int:
    """Scratch slots for the dC writer's kept dZ tiles when they cannot live in the gradient stash:
    two per token block (LM-like data keeps about one, the head of the sorted vocabulary); kept
    tiles past them are recomputed by the writer."""
    BN = _config(dtype, "fwd").BLOCK_N
    return 2 * triton.cdiv(N, BN)


# Scratch slots per token block of the dE writer (its block's first kept tiles; later ones are
# recomputed once per D chunk).
DE_BLOCK_SLOTS = 2
# The dE pass ends with one round on copies once at most this many token blocks remain, or at
# the last of at most this many rounds.
DE_FINAL_BLOCKS = 1 if _interpreting() else 4
DE_MAX_ROUNDS = 16
# Bytes of the temporary that moves dE rows from the sorted order to e2d's.
STASH_MOVE_BYTES = 8 << 20
# Element alignment of the slots inside the stash (16-byte aligned tiles).
_STASH_ALIGN = 64


def code_fits_stash(n_rows: int, n_vtiles: int, stash_rows: int, D: int, dtype: torch.dtype) -> bool:
    """Whether the training forward puts the tile codes (n_rows x n_vtiles bytes) in the tail of the
    dE stash ([stash_rows, D] of ``dtype``): when they take at most half of it, so that the dE
    pass can write around them in a few rounds (see _de_rounds)."""
    return 2 * n_rows * n_vtiles <= stash_rows * D * torch.empty((), dtype=dtype).element_size()


def stash_code(stash: torch.Tensor, n_rows: int, n_vtiles: int) -> torch.Tensor:
    """The codes in the stash's tail: its last n_rows * n_vtiles bytes as uint8 [n_rows, n_vtiles]."""
    raw = stash.view(-1).view(torch.uint8)
    return raw[raw.numel() - n_rows * n_vtiles :].view(n_rows, n_vtiles)


def _stash_layout(N: int, M: int, D: int, es: int, code_bytes: int, BN: int, BV: int, S: int):
    """Where the dE pass's inputs sit in a stash of M x D elements of es bytes: (slot0, code_lo,
    protect). The codes (code_bytes per sorted row, 0 when they are elsewhere) fill its tail from
    element code_lo on; the S kept-tile slots per token block (BN x BV elements each) sit just
    before them from element slot0 (None when they do not fit: a separate buffer). protect(a):
    the first element that the rows from a on still read (their slots, then their codes)."""
    tile = BN * BV
    code_lo = (M * D * es - N * code_bytes) // es
    slot0 = (code_lo - triton.cdiv(N, BN) * S * tile) // _STASH_ALIGN * _STASH_ALIGN
    if S == 0 or slot0 < 0:
        slot0 = None

    def protect(a: int) -> int:
        if slot0 is not None:
            return slot0 + (a // BN) * S * tile
        return (M * D * es - (N - a) * code_bytes) // es

    return slot0, code_lo, protect


def _de_rounds(N: int, D: int, BN: int, protect) -> list[tuple[int, int, bool]]:
    """The dE pass as rounds of sorted rows [a, b) (whole token blocks) written in place into the
    stash, rows of D elements: a round may write up to element protect(a), where what the rows
    from a on still read begins (their kept-tile slots, then their codes). A round frees the
    slots of its blocks for the next (the codes of written rows stay, between the slots and the
    codes still read), so the remainder shrinks toward ~ N codes / (dE bytes - slot bytes per
    row) rows; the last round (flag True) reads copies of what it needs, made first: at most
    DE_FINAL_BLOCKS blocks, that remainder, or what is left after DE_MAX_ROUNDS rounds."""
    rounds, a = [], 0
    while a < N:
        lim = protect(a) // max(D, 1)
        if lim >= N:
            rounds.append((a, N, False))
            break
        b = lim // BN * BN
        if b <= a or N - a <= DE_FINAL_BLOCKS * BN or len(rounds) + 1 >= DE_MAX_ROUNDS:
            rounds.append((a, N, True))
            break
        rounds.append((a, b, False))
        a = b
    return rounds


def _to_e_rows(stash: torch.Tensor, src: torch.Tensor) -> None:
    """In place: stash row r <- stash row src[r] (0 where src[r] < 0). Needs src[r] <= r (the
    valid-first order of increasing e2d rows); moves blocks of rows from the last one down
    through a bounded temporary, so a block's sources are never overwritten before they are read."""
    M, D = stash.shape
    step = max(1, STASH_MOVE_BYTES // max(1, D * stash.element_size()))
    for r1 in range(M, 0, -step):
        r0 = max(0, r1 - step)
        s = src[r0:r1]
        tmp = stash.index_select(0, s.clamp(min=0))
        tmp.masked_fill_((s < 0)[:, None], 0)
        stash[r0:r1] = tmp
        del tmp  # before the next block's temporary is allocated (else two are alive at once)


def tile_means(
    c: torch.Tensor,
    perm: torch.Tensor,
    BLOCK_V: int,
    dtype: torch.dtype,
    d_lo: int = 0,
    d_hi: int | None = None,
) -> torch.Tensor:
    """[n_tiles, d_hi - d_lo] mean of c[:, d_lo:d_hi]'s rows over each BLOCK_V positions of
    ``perm``, in ``dtype`` (all of D by default)."""
    _check(c, c, perm)
    V, D = c.shape
    d_hi = D if d_hi is None else d_hi
    nt = triton.cdiv(V, BLOCK_V)
    cm = torch.empty((nt, d_hi - d_lo), dtype=dtype, device=c.device)
    BDO = 32 if _interpreting() else 128
    if V > 0 and d_hi > d_lo:
        with torch.cuda.device(c.device) if c.device.type == "cuda" else contextlib.nullcontext():
            _tile_means_kernel[(nt, triton.cdiv(d_hi - d_lo, BDO))](
                c, perm, cm, V, D, c.stride(0), cm.stride(0), d_lo, d_hi, BLOCK_V=BLOCK_V, BLOCK_DO=BDO
            )  # fmt: skip
    return cm


def linear_ce_backward_sparse(
    e2d: torch.Tensor,
    c: torch.Tensor,
    bias: torch.Tensor | None,
    weight: torch.Tensor | None,
    erow: torch.Tensor,
    tgt: torch.Tensor,
    perm: torch.Tensor,
    n_valid: torch.Tensor,
    lse: torch.Tensor,
    alpha: torch.Tensor,
    gamma: torch.Tensor | None,
    plan: SparsePlan,
    softcap: float,
    need_de: bool,
    need_dc: bool,
    stash: torch.Tensor | None = None,
    src: torch.Tensor | None = None,
    release: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(dE, dC), each written once by its kernel: dE into ``stash`` (e2d's shape and dtype; the
    codes plan.code may be its tail, see stash_code), which is returned; dC newly allocated.

    No fp32 gradient accumulators and no atomics: one program owns a (token block, D chunk) of dE
    or a (vocabulary tile, D chunk) of dC. The skipped tiles enter through the forward's
    statistics; kept tiles' dZ are computed once into a scratch (past its slots, once per D chunk).
    dC is written first, its scratch in the stash (plan.klist numbers its slots). The dE pass
    then runs in rounds of sorted rows (_de_rounds) whose scratch sits in the stash past the
    round's rows and before the codes still to be read; at the end the rows are moved to e2d's
    order (src: sorted row of each e2d row, -1 for rows whose gradient is 0). So nothing of
    O(N) bytes per row is allocated besides the gradients. gamma (smoothing without softcap) is
    given with plan.wc / plan.ge. With ``release`` the plan's dC-only tensors are dropped once dC
    is written.
    """
    _check(e2d, c, bias, weight, erow, tgt, perm, n_valid, lse, alpha, gamma)
    N = erow.numel()
    V, D = c.shape
    dev = e2d.device
    cfg = _config(e2d.dtype, "fwd")
    BN, BV = cfg.BLOCK_N, cfg.BLOCK_V
    n_blocks, n_vtiles = triton.cdiv(N, BN), triton.cdiv(V, BV)
    BD, BDO_E, BDO_C, BJ, BR, warps = _sparse_config()
    dummy = alpha
    smooth = gamma is not None
    scale_dz = e2d.dtype == torch.float16
    prec = _precision(e2d.dtype)
    ctx = torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext()
    common = dict(
        HAS_BIAS=bias is not None, HAS_SOFTCAP=softcap > 0, SCALE_DZ=scale_dz,
        BLOCK_N=BN, BLOCK_V=BV, BLOCK_D=cfg.BLOCK_D, PRECISION=prec,
    )  # fmt: skip
    bias_arg = bias if bias is not None else dummy
    dE = dC = None
    S = DE_BLOCK_SLOTS if need_de and N > 0 else 0
    tile = BN * BV
    free = e2d.numel()  # elements of the stash free for the dC writer's slots
    if need_de:
        if stash is None or src is None or stash.shape != e2d.shape or stash.dtype != e2d.dtype:
            raise ValueError("need_de needs a stash of e2d's shape and dtype and its row map src")
        code_in_stash = _shares_memory(plan.code, stash)
        # The stash's tail: [kept-tile slots of the dE writer, S per block][codes]. The slots go
        # there when they fit, else to a separate buffer (small D).
        flat = stash.view(-1)
        M, es = e2d.shape[0], e2d.element_size()
        code_bytes = n_vtiles if code_in_stash else 0
        A0, code_lo, protect = _stash_layout(N, M, D, es, code_bytes, BN, BV, S)
        slots_in_stash = A0 is not None
        if slots_in_stash:
            slots = flat[A0 : A0 + n_blocks * S * tile].view(n_blocks * S, BN, BV)
            free = A0
        else:
            slots = torch.empty((n_blocks * S, BN, BV), dtype=e2d.dtype, device=dev)
            free = code_lo
        slot_scale = torch.empty(n_blocks * S if scale_dz else 1, dtype=torch.float32, device=dev)
        if S > 0:
            with ctx:
                _kept_dz_block_kernel[(n_blocks, S)](
                    e2d, c, bias_arg, erow, tgt, perm, n_valid, lse, alpha, plan.list_e, plan.cnt_e,
                    slots, slot_scale, V, D, e2d.stride(0), c.stride(0), n_vtiles, float(softcap),
                    num_warps=cfg.num_warps, num_stages=cfg.num_stages, **common,
                )  # fmt: skip
    if need_dc:
        cap = min(plan.klist.numel() - 1, free // tile)
        if need_de and cap > 0:
            scratch = stash.view(-1)[: cap * tile].view(cap, BN, BV)
        else:
            scratch = torch.empty((cap, BN, BV), dtype=e2d.dtype, device=dev)
        scalebuf = torch.empty(cap if scale_dz else 1, dtype=torch.float32, device=dev)
        if N > 0 and cap > 0:
            with ctx:
                _kept_dz_kernel[(cap,)](
                    e2d, c, bias_arg, erow, tgt, perm, n_valid, lse, alpha, plan.klist, plan.n_kept,
                    scratch, scalebuf, V, D, e2d.stride(0), c.stride(0), n_vtiles, float(softcap),
                    num_warps=cfg.num_warps, num_stages=cfg.num_stages, **common,
                )  # fmt: skip
        dC = torch.empty(c.shape, dtype=c.dtype, device=dev)
        if V > 0:
            with ctx:
                _sparse_dc_kernel[(n_vtiles, triton.cdiv(D, BDO_C))](
                    e2d, c, bias_arg, weight if weight is not None else dummy,
                    erow, tgt, perm, n_valid, lse, alpha, plan.list_c, plan.cnt_c, plan.seg, plan.trow,
                    plan.tpos, plan.tcoef, plan.q, plan.g, plan.ge if smooth else dummy,
                    plan.gidx, scratch, scalebuf, dC,
                    V, D, e2d.stride(0), c.stride(0), dC.stride(0), plan.g.stride(0), n_blocks, n_vtiles,
                    float(softcap), cap,
                    HAS_BIAS=bias is not None, HAS_SOFTCAP=softcap > 0, HAS_SMOOTH=smooth,
                    HAS_WEIGHT=weight is not None, SCALE_DZ=scale_dz,
                    BLOCK_N=BN, BLOCK_V=BV, BLOCK_D=BD, BLOCK_DO=BDO_C, BLOCK_R=BR,
                    PRECISION=prec, num_warps=warps, num_stages=2,
                )  # fmt: skip
        del scratch, scalebuf
    if release:
        plan.list_c = plan.cnt_c = plan.g = plan.q = plan.trow = plan.tpos = plan.tcoef = plan.seg = None
        plan.gidx = plan.klist = None
    if need_de:
        if N > 0:
            # The tile means of C, all of D: [n_tiles, D], O(V D / BLOCK_V), alive through the pass.
            cm = tile_means(c, perm, BV, e2d.dtype)
            for a, b, last in _de_rounds(N, D, BN, protect):
                code, row0, sl, sl_scale, sl_blk0 = plan.code, 0, slots, slot_scale, 0
                if last:  # copies of what the rows [a, N) read in the region they write
                    if code_in_stash:
                        code, row0 = plan.code[a:].clone(), a
                    sl_blk0 = a // BN
                    sl = slots[sl_blk0 * S :]
                    sl = sl.clone() if slots_in_stash else sl
                    sl_scale = slot_scale[sl_blk0 * S :] if scale_dz else slot_scale
                with ctx:
                    _sparse_de_kernel[(triton.cdiv(b - a, BN), triton.cdiv(D, BDO_E))](
                        e2d, c, bias_arg, erow, tgt, perm, n_valid, lse, alpha,
                        gamma if smooth else dummy, plan.coef, code, plan.list_e,
                        plan.cnt_e, cm, plan.wc if smooth else dummy, sl, sl_scale, stash,
                        V, D, e2d.stride(0), c.stride(0), stash.stride(0), code.stride(0), cm.stride(0),
                        n_vtiles, float(softcap), a // BN, row0, sl_blk0, sl.shape[0],
                        HAS_BIAS=bias is not None, HAS_SOFTCAP=softcap > 0, HAS_SMOOTH=smooth,
                        SCALE_DZ=scale_dz, N_SLOTS=S, BLOCK_N=BN, BLOCK_V=BV, BLOCK_D=BD, BLOCK_DO=BDO_E,
                        BLOCK_J=BJ, STEPS=STATS_STEPS, PRECISION=prec, num_warps=warps, num_stages=2,
                    )  # fmt: skip
                del code, sl, sl_scale
            del cm
        del slots, slot_scale
        _to_e_rows(stash, src)
        dE = stash
    return dE, dC


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.numel() == 0 or b.numel() == 0:
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return b0 <= a0 < b0 + b.numel() * b.element_size()
