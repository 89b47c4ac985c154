"""What every linear-cross-entropy kernel shares: tile configurations, the logit tile, the
target logits, device checks and the Hopper tensor-descriptor switch.

Conventions of all kernels here. Token rows are read through ``erow`` (the e2d row of each
position of the valid-first order, cce/ops/linear_ce/rows.py) and ``n_valid`` is a device
tensor: programs whose token block starts at or after it return at once, so ignored tokens cost
no matmul work and nothing synchronises with the host. Row and vocabulary indices are promoted to
int64 before they are multiplied by a stride, so N * V and V * D past 2^31 (N = 16384,
V = 256000) address correctly. ``HAS_*`` flags of optional operands are derived from ``None``
arguments by ``triton.heuristics``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ...._dispatch import capability, interpreting
from ... import jit_math as jm
from ...launch import cached_launch


@dataclass(frozen=True)
class KernelConfig:
    BLOCK_N: int
    BLOCK_V: int
    BLOCK_D: int
    num_warps: int
    num_stages: int


# One fixed, small config under the interpreter (no autotune there, and it is slow). On Hopper:
# 128 x 256 forward tiles and 128 x 128 tiles of the exact backward's pointer path, 64-wide D chunks,
# 8 warps, 4 pipeline stages in the backward (4 x 32 KB of bf16 operand tiles in shared memory,
# within Hopper's 228 KB); fp32 inputs need smaller D chunks. docs/benchmarks.md has the sweeps.
INTERPRET_CONFIG = KernelConfig(16, 32, 32, 4, 1)


def config(dtype: torch.dtype, kind: str) -> KernelConfig:
    """The tile configuration of the forward (``kind="fwd"``, also the tiles of the tile
    statistics and of the sparse backward) or of the exact backward's pointer path (``"bwd"``:
    its dZ slabs where tensor descriptors are not used)."""
    if interpreting():
        return INTERPRET_CONFIG
    if dtype == torch.float32:
        return KernelConfig(128, 128, 32, 8, 3)
    if kind == "fwd":
        return KernelConfig(128, 256, 64, 8, 3)
    return KernelConfig(128, 128, 64, 8, 4)


def slab_tiles(N: int, n_vtiles: int, BLOCK_V: int, elem_bytes: int, slab_bytes: int) -> int:
    """Vocabulary tiles per dZ slab of N rows: as many as ``slab_bytes`` hold (at least one)."""
    return max(1, min(n_vtiles, slab_bytes // max(1, N * elem_bytes * BLOCK_V)))


def stats_blocks(dtype: torch.dtype) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_V) of the forward's tiles for ``dtype``: the tiles of the tile statistics."""
    cfg = config(torch.float32 if dtype == torch.float64 else dtype, "fwd")
    return cfg.BLOCK_N, cfg.BLOCK_V


def tile_sizes(V: int, BLOCK_V: int, device: torch.device) -> torch.Tensor:
    """fp32 [n_tiles]: the classes in each vocabulary tile (BLOCK_V, the last what is left).

    Two device ops (V - j BLOCK_V for each tile j, clamped): no value is written from the
    host, so the call is capturable in a CUDA graph and does not synchronise."""
    nt = triton.cdiv(V, BLOCK_V)
    return torch.arange(V, V - nt * BLOCK_V, -BLOCK_V, dtype=torch.float32, device=device).clamp_(max=BLOCK_V)


def precision(dtype: torch.dtype) -> str:
    """tl.dot's input precision: tf32 for fp32 inputs only where the user allowed it for
    matmuls; bf16 / fp16 ignore it."""
    if dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return "ieee"


def device_context(device: torch.device):
    """The launches' device context (a no-op off CUDA)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def check_inputs(e2d: torch.Tensor, c: torch.Tensor, *others: torch.Tensor | None) -> None:
    """The launchers' preconditions: one device (CUDA, or the CPU under the interpreter), unit
    stride along D, and vectors (index lists, per-row values) of unit stride: the kernels read
    them by offsets alone."""
    if e2d.device.type != "cuda" and not interpreting():
        raise ValueError(
            f"the Triton kernels need CUDA tensors, got {e2d.device} (set TRITON_INTERPRET=1 before "
            "importing cce to run them on the CPU)"
        )
    for t in (c, *others):
        if t is not None and t.device != e2d.device:
            raise ValueError(f"all tensors must be on one device, got {e2d.device} and {t.device}")
        if t is not None and t.dim() == 1 and t.numel() > 1 and t.stride(0) != 1:
            raise ValueError(f"a vector argument of the kernels has stride {t.stride(0)}, not 1")
    if e2d.stride(-1) != 1 or c.stride(-1) != 1:
        raise ValueError("e2d and c must have unit stride along D")


def inverse_permutation(perm: torch.Tensor) -> torch.Tensor:
    """inv with inv[perm[i]] = i (int64): the position of each vocabulary id in the order."""
    n = perm.numel()
    return torch.empty(n, dtype=torch.long, device=perm.device).index_copy_(
        0, perm, torch.arange(n, device=perm.device)
    )


# Row a of a 0/1 matrix K [A, B] compacted: List[a, i] = the column of its i-th set entry for
# i < Cnt[a], 0 for Cnt[a] <= i <= B (List [A, B + 1]; the last column is where the torch form
# of this, a scatter, dumped the unset entries). The set entries' slots (cumsum - 1) and the
# zeroed tail are disjoint, so the two stores of a program never meet. One launch for what
# took six torch ops and a transposed copy (host time of a step: docs/benchmarks.md, "Host time").
@cached_launch
@triton.jit
def _compact_kernel(K, List, Cnt, B, stride_a, stride_b, BLOCK_B: tl.constexpr):
    a = tl.program_id(0)
    offs = tl.arange(0, BLOCK_B)
    k = tl.load(K + a.to(tl.int64) * stride_a + offs.to(tl.int64) * stride_b, mask=offs < B, other=0) != 0
    ki = k.to(tl.int32)
    slot = tl.cumsum(ki, axis=0) - 1
    cnt = tl.sum(ki, axis=0)
    row = List + a.to(tl.int64) * (B + 1)
    tl.store(row + slot, offs.to(tl.int32), mask=k)
    tl.store(row + offs, tl.zeros([BLOCK_B], tl.int32), mask=(offs >= cnt) & (offs <= B))
    tl.store(Cnt + a, cnt)


# Columns (the dump slot included) from which compact_lists takes torch ops (one program holds
# a row).
COMPACT_MAX_COLS = 1 << 14


def compact_lists(keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(List int32 [A, B + 1], Cnt int32 [A]): the set columns of each row of ``keep`` (bool
    [A, B], any strides) compacted to the front of its list, zeros after (the comment above
    _compact_kernel), and their counts; no host sync. One launch (below COMPACT_MAX_COLS
    columns; from there on torch ops)."""
    A, B = keep.shape
    dev = keep.device
    if B + 1 > COMPACT_MAX_COLS:
        idx = torch.where(keep, keep.cumsum(1) - 1, B)
        cols = torch.arange(B, dtype=torch.int32, device=dev).expand(A, B)
        lst = torch.zeros((A, B + 1), dtype=torch.int32, device=dev).scatter_(1, idx, cols)
        lst[:, B] = 0  # (the dump slot)
        return lst, keep.sum(1, dtype=torch.int32)
    lst = torch.empty((A, B + 1), dtype=torch.int32, device=dev)
    cnt = torch.empty(A, dtype=torch.int32, device=dev)
    if A > 0:
        k8 = keep.view(torch.uint8) if keep.dtype == torch.bool else keep
        with device_context(dev):
            _compact_kernel[(A,)](
                K=k8, List=lst, Cnt=cnt, B=B, stride_a=k8.stride(0), stride_b=k8.stride(1),
                BLOCK_B=max(16, triton.next_power_of_2(B + 1)),
            )  # fmt: skip
    return lst, cnt


# ---------------------------------------------------------------------------------------------
# Hopper tensor descriptors


def tensor_descriptor():
    """triton's host-side TensorDescriptor class, or None for a triton without it."""
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:
        return None
    return TensorDescriptor


def tma_rows_ok(t: torch.Tensor) -> bool:
    """A 2-D operand that a tensor descriptor can read in place (16-byte aligned rows)."""
    es = t.element_size()
    return t.stride(1) == 1 and (t.stride(0) * es) % 16 == 0 and t.data_ptr() % 16 == 0


def use_tma(e2d: torch.Tensor, c: torch.Tensor) -> bool:
    """Whether tiles are read by tensor descriptors: Hopper or newer, 16-bit operands, rows of a
    multiple of 16 bytes (TMA's alignment), a triton that has them, not the interpreter."""
    if interpreting() or e2d.device.type != "cuda" or tensor_descriptor() is None:
        return False
    if e2d.dtype not in (torch.bfloat16, torch.float16) or c.dtype != e2d.dtype:
        return False
    if (c.shape[1] * c.element_size()) % 16 != 0:
        return False
    return capability(e2d.device)[0] >= 9


def split_dot(device: torch.device) -> bool:
    """add_dc_targets' SPLIT_DOT: bf16 tensor-core products (Ampere or newer), not the
    interpreter (whose bf16 products are wrong)."""
    return not interpreting() and device.type == "cuda" and capability(device)[0] >= 8


# ---------------------------------------------------------------------------------------------
# Shared jit pieces


@triton.jit
def finish_logits(
    L, Bias, vid, col_mask, softcap, inv_temp,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_TEMP: tl.constexpr,
):  # fmt: skip
    """(z, th) of a tile of products L [BLOCK_N, BLOCK_V] (classes vid, where col_mask), fp32:
    the logits z = softcap(L + b) [* inv_temp] and th, the tanh whose 1 - th^2 is softcap' (the
    bias added once per tile, after the whole D loop; th is L, unused, without HAS_SOFTCAP)."""
    if HAS_BIAS:
        L += tl.load(Bias + vid, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    th = L
    if HAS_SOFTCAP:
        L, th = jm.softcap(L, softcap)
    if HAS_TEMP:  # the logits softcap(x) / T (the coefficients carry the chain rule's 1 / T)
        L = L * inv_temp
    return L, th


@triton.jit
def logit_tile(
    E, C, erow, vid, row_mask, col_mask, D, stride_e, stride_c,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """e[erow] @ c[vid].T in fp32, [BLOCK_N, BLOCK_V], by pointer loads; erow, vid int64."""
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
def tile_cols(Perm, j, V, BLOCK_V: tl.constexpr):
    """(positions, their mask, vocabulary ids int64) of tile j of the walking order Perm."""
    offs_p = j * BLOCK_V + tl.arange(0, BLOCK_V)
    col_mask = offs_p < V
    vid = tl.load(Perm + offs_p, mask=col_mask, other=0).to(tl.int64)
    return offs_p, col_mask, vid


@triton.jit
def add_dc_targets(
    acc, Seg, TRow, TPos, TCoef, E, j, p0, offs_do, dmask, stride_e,
    LANES: tl.constexpr, BLOCK_R: tl.constexpr, SPLIT_DOT: tl.constexpr,
):  # fmt: skip
    """acc [LANES, BLOCK_DO] (dC rows of sorted positions p0 + lane, all in tile j) plus, for each
    valid row i whose target lies there, coef_i e_i: the rows ordered by their target's sorted
    position, so by tile (Seg, TRow, TPos, TCoef of backward_sparse.SparsePlan), one one-hot
    product per BLOCK_R of them, to fp32 accuracy (the coefficient alpha p_t - beta is a
    cancellation).

    With SPLIT_DOT the product runs on the tensor cores: x = coef_i e_i (fp32) is split into three
    bf16 parts whose sum is x exactly (bf16 keeps fp32's exponent range and 8 of its 24
    significant bits: each part is the bf16 rounding of what the parts before it leave, and the
    remainder shrinks by 8 bits at each step; exact where 2^-110 <= |x| < 3.39e38, below which the
    last part is under bf16's smallest normal and the error under 2^-126, above which the first
    part rounds to inf), the one-hot is exact in bf16, and the products are summed in the tensor
    cores' fp32 accumulator, which may truncate where an FMA rounds: a few ulp of fp32 per sum.
    (A compiler's fusing of coef_i e_i - hi into one FMA only brings the parts closer to the exact
    product.) Without it (``split_dot``: the interpreter, whose bf16 products are wrong, and GPUs
    before Ampere) one fp32 product of FMAs ("ieee"). The frequent classes' targets sit in the
    first tiles of the sorted vocabulary (half of a zipf-like batch's rows in one tile at
    N = 8192): those tiles' programs loop over thousands of rows while the others have a few, so
    the loop is the writer's longest path (docs/benchmarks.md, "The dC writer's target rows on
    the tensor cores")."""
    seg0 = tl.load(Seg + j)
    seg1 = tl.load(Seg + j + 1)
    lanes = tl.arange(0, LANES)
    ar = tl.arange(0, BLOCK_R)
    # Software-pipelined by hand: the rows' indices are loaded two groups ahead and their rows of
    # E one group ahead, so neither load's latency (the gather waits on its indices) stalls the
    # products of the group at hand (a few thousand rows loop in the frequent classes' tiles).
    rm = seg0 + ar < seg1
    row = tl.load(TRow + seg0 + ar, mask=rm, other=0).to(tl.int64)
    lp = tl.load(TPos + seg0 + ar, mask=rm, other=-1) - p0
    cf = tl.load(TCoef + seg0 + ar, mask=rm, other=0.0)
    ev = tl.load(E + row[:, None] * stride_e + offs_do[None, :], mask=rm[:, None] & dmask[None, :], other=0.0)
    rm1 = seg0 + BLOCK_R + ar < seg1
    row1 = tl.load(TRow + seg0 + BLOCK_R + ar, mask=rm1, other=0).to(tl.int64)
    lp1 = tl.load(TPos + seg0 + BLOCK_R + ar, mask=rm1, other=-1) - p0
    cf1 = tl.load(TCoef + seg0 + BLOCK_R + ar, mask=rm1, other=0.0)
    for r0 in range(seg0, seg1, BLOCK_R):
        ev1 = tl.load(
            E + row1[:, None] * stride_e + offs_do[None, :], mask=rm1[:, None] & dmask[None, :], other=0.0
        )  # [BLOCK_R, BLOCK_DO] of the next group
        offs2 = r0 + 2 * BLOCK_R + ar
        rm2 = offs2 < seg1
        row2 = tl.load(TRow + offs2, mask=rm2, other=0).to(tl.int64)
        lp2 = tl.load(TPos + offs2, mask=rm2, other=-1) - p0
        cf2 = tl.load(TCoef + offs2, mask=rm2, other=0.0)
        x = ev.to(tl.float32) * cf[:, None]  # [BLOCK_R, BLOCK_DO]
        onehot = tl.where(lanes[:, None] == lp[None, :], 1.0, 0.0)  # [LANES, BLOCK_R]
        if SPLIT_DOT:
            oh = onehot.to(tl.bfloat16)  # exact
            hi = x.to(tl.bfloat16)
            rest = x - hi.to(tl.float32)  # exact: x's bits below hi's
            mid = rest.to(tl.bfloat16)
            lo = (rest - mid.to(tl.float32)).to(tl.bfloat16)  # exact: at most 8 bits remain
            acc = tl.dot(oh, hi, acc)
            acc = tl.dot(oh, mid, acc)
            acc = tl.dot(oh, lo, acc)
        else:
            acc = tl.dot(onehot, x, acc, input_precision="ieee")
        ev, lp, cf = ev1, lp1, cf1
        row1, lp1, cf1, rm1 = row2, lp2, cf2, rm2
    return acc


# A skipped tile's mean logit under softcap (skipped_slog): Newton steps on
# g(z) = z + log(1 - (z / s)^2) = b over [-s, z*], g's increasing, concave branch (z* = sqrt(1 + s^2)
# - 1, where g' = 0), from z0 = max(b, -s + (s / 2) e^(b + s)) (the root near -s, where the log
# dominates): the steps converge monotonically once left of the root, quadratically near it.
SOFTCAP_MEAN_STEPS: tl.constexpr = tl.constexpr(5)


@triton.jit
def skipped_coef0(alpha, eta, lse, BLOCK_V: tl.constexpr):
    """a0 = alpha + eta (lse - log BLOCK_V), any shape: with the entropy's term a skipped tile's
    correction coefficient times its decoded mass S is a S = a0 S + eta skipped_slog(S, ...)."""
    return alpha + eta * (lse - tl.log(tl.full((), BLOCK_V, tl.float32)))


@triton.jit
def skipped_slog(S, lse, softcap, BLOCK_V: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    """S (zbar - lse + log BLOCK_V), 0 where S = 0, for a skipped tile's decoded mass S (any shape,
    lse broadcast to it): zbar the tile's p-weighted mean logit to first order in the tile's
    logit spread (kernels/first_order.py), lse + log(S / BLOCK_V) without softcap (the value is
    then S log S, in [-1/e, 0]). With softcap s the codes hold S = sum_v p_v softcap'(z_v), so
    zbar solves zbar + log(softcap'(zbar)) = b := lse + log(S / BLOCK_V), softcap'(z) =
    1 - (z / s)^2, on the branch z <= z* (SOFTCAP_MEAN_STEPS Newton steps; the tile's logits lie
    below the row's probable ones); zbar - b lies in [0, s + z* - b]."""
    pos = S > 0
    ls = tl.log(tl.where(pos, S, 1.0))
    if HAS_SOFTCAP:
        b = lse + ls - tl.log(tl.full((), BLOCK_V, tl.float32))
        lo = -softcap * (1.0 - 1e-6)
        hi = tl.sqrt(1.0 + softcap * softcap) - 1.0
        z = tl.maximum(b, -softcap + 0.5 * softcap * tl.exp(tl.minimum(b + softcap, 0.0)))
        z = tl.minimum(tl.maximum(z, lo), hi)
        for _ in tl.static_range(SOFTCAP_MEAN_STEPS):
            q = softcap * softcap - z * z
            g = z + tl.log(q / (softcap * softcap))
            gp = tl.maximum(1.0 - 2.0 * z / q, 1e-6)
            z = tl.minimum(tl.maximum(z - (g - b) / gp, lo), hi)
        ls = ls + (z - b)
    return tl.where(pos, S * ls, 0.0)


@triton.jit
def sub_dc_smoothing(acc, W, GE, vid, col_mask, offs_do, dmask, HAS_WEIGHT: tl.constexpr):
    """acc (dC rows of classes vid) minus the smoothing term w_v sum_i gamma_i e_i (GE, fp32 [D];
    W: class weights, or None for 1)."""
    if HAS_WEIGHT:
        w = tl.load(W + vid, mask=col_mask, other=0.0).to(tl.float32)
    else:
        w = tl.where(col_mask, 1.0, 0.0)
    ge = tl.load(GE + offs_do, mask=dmask, other=0.0)
    return acc - w[:, None] * ge[None, :]


# ---------------------------------------------------------------------------------------------
# Target logits


@cached_launch
@triton.heuristics({"HAS_BIAS": lambda a: a["Bias"] is not None})
@triton.jit
def _target_logit_kernel(
    E,  # [*, D] hidden states (rows read through Erow)
    C,  # [V, D] classifier
    Bias,  # [V] or None
    Erow,  # [N] e2d row of each sorted position
    Tgt,  # [N] target id of each sorted position
    NValid,  # [1] int32: positions from here on are ignored rows
    Out,  # [N] fp32
    N, D, stride_e, stride_c, softcap, inv_temp,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_TEMP: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Out[i] = z of row i's target (bias, softcap and temperature applied), fp32; 0 past the
    valid rows."""
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
        z, _ = jm.softcap(z, softcap)
    if HAS_TEMP:
        z = z * inv_temp
    tl.store(Out + offs_n, tl.where(row_mask, z, 0.0), mask=offs_n < N)


# Rows and D chunk of a _target_logit_kernel program: N x D gathered reads are a memory-bound
# job, so small row blocks keep many programs in flight.
TARGET_BLOCK_N = 4
TARGET_BLOCK_D = 256


def target_logits(
    e2d, c, bias, erow, tgt, n_valid, softcap: float, out: torch.Tensor, temperature: float = 1.0
) -> None:
    """out[i] = z of sorted row i's target (bias, softcap and temperature applied), fp32; 0 past
    n_valid."""
    N, D = erow.numel(), e2d.shape[1]
    _target_logit_kernel[(triton.cdiv(N, TARGET_BLOCK_N),)](
        E=e2d, C=c, Bias=bias, Erow=erow, Tgt=tgt, NValid=n_valid, Out=out, N=N, D=D,
        stride_e=e2d.stride(0), stride_c=c.stride(0), softcap=float(softcap), inv_temp=1.0 / temperature,
        HAS_SOFTCAP=softcap > 0, HAS_TEMP=temperature != 1.0, BLOCK_N=TARGET_BLOCK_N,
        BLOCK_D=TARGET_BLOCK_D,
    )  # fmt: skip


@cached_launch
@triton.jit
def _target_term_sq_kernel(
    C,  # [V, D] classifier
    Tgt,  # [N] target id of each sorted position
    Coef,  # [N] fp32 target-entry coefficient of each sorted position
    NValid,  # [1] int32: positions from here on are ignored rows
    Out,  # [N] fp32
    N, D, stride_c,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Out[i] = coef_i^2 ||c_{t_i}||^2 in fp32 (the squared norm of row i's target term in dE);
    0 past the valid rows."""
    n_valid = tl.load(NValid)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = offs_n < n_valid
    tgt = tl.load(Tgt + offs_n, mask=row_mask, other=0).to(tl.int64)
    coef = tl.load(Coef + offs_n, mask=row_mask, other=0.0)
    offs_d = tl.arange(0, BLOCK_D)
    acc = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)  # [BLOCK_N, BLOCK_D]
    for d0 in range(0, D, BLOCK_D):
        m = row_mask[:, None] & ((d0 + offs_d) < D)[None, :]
        c = tl.load(C + tgt[:, None] * stride_c + (d0 + offs_d)[None, :], mask=m, other=0.0).to(tl.float32)
        acc += c * c
    sq = tl.sum(acc, axis=1) * coef * coef
    tl.store(Out + offs_n, tl.where(row_mask, sq, 0.0), mask=offs_n < N)


# ||dE||^2 from k sampled rows and the target terms of all N rows (one program):
#
#   r_m = ||Ref[m]||^2,  y_m = ok_m^2 Tsq[pos_m]  (Ref's rows and ok carry the sampling scale s_m,
#                                                  so sum r and sum y are unbiased for ||dE||^2
#                                                  and for T = sum_i Tsq[i])
#   lam = max(0, sum (r - mean r)(y - mean y) / sum (y - mean y)^2)   (regression slope)
#   Out = sum r - lam (sum y - T)
#
# With every row sampled once (ok = 1), sum y = T and Out = sum r exactly.
@cached_launch
@triton.jit
def _de_norm_sq_kernel(
    Ref,  # [k, D] fp32 sampled rows' exact dE, times their scale
    Tsq,  # [N] fp32 coef_i^2 ||c_{t_i}||^2
    Pos,  # [k] sorted position of each sampled row
    Ok,  # [k] fp32 scale of each sampled row (0 where it is past the valid rows)
    Out,  # [1] fp32
    N, k, D, stride_ref,
    BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    offs_r = tl.arange(0, BLOCK_R)
    acc_t = tl.zeros((BLOCK_R,), dtype=tl.float32)  # [BLOCK_R]
    for r0 in range(0, N, BLOCK_R):
        acc_t += tl.load(Tsq + r0 + offs_r, mask=(r0 + offs_r) < N, other=0.0)
    total_t = tl.sum(acc_t, axis=0)
    offs_k = tl.arange(0, BLOCK_K)
    km = offs_k < k
    offs_d = tl.arange(0, BLOCK_D)
    acc = tl.zeros((BLOCK_K, BLOCK_D), dtype=tl.float32)  # [BLOCK_K, BLOCK_D]
    for d0 in range(0, D, BLOCK_D):
        m = km[:, None] & ((d0 + offs_d) < D)[None, :]
        x = tl.load(
            Ref + offs_k.to(tl.int64)[:, None] * stride_ref + (d0 + offs_d)[None, :], mask=m, other=0.0
        )
        acc += x * x
    r = tl.sum(acc, axis=1)  # [BLOCK_K], 0 past k
    pos = tl.load(Pos + offs_k, mask=km, other=0).to(tl.int64)
    ok = tl.load(Ok + offs_k, mask=km, other=0.0)
    y = tl.load(Tsq + pos, mask=km, other=0.0) * ok * ok
    rc = tl.where(km, r - tl.sum(r, axis=0) / k, 0.0)
    yc = tl.where(km, y - tl.sum(y, axis=0) / k, 0.0)
    lam = tl.sum(rc * yc, axis=0) / tl.maximum(tl.sum(yc * yc, axis=0), 1e-30)
    lam = tl.maximum(lam, 0.0)
    tl.store(Out, tl.sum(r, axis=0) - lam * (tl.sum(y, axis=0) - total_t))


def de_norm_sq(c, tgt, coef, n_valid, ref, pos, ok) -> torch.Tensor:
    """fp32 [1]: ||dE||^2 estimated from the k sampled rows ``ref`` (fp32 [k, D], each times its
    scale; ``pos`` their sorted positions, ``ok`` their scales, 0 past n_valid) with every row's
    target term (``coef`` fp32 [N]: (alpha p_t - beta) softcap' per sorted row, 0 past n_valid;
    ``tgt`` the sorted targets) summed exactly as a control variate (the comment above
    _de_norm_sq_kernel). Two launches, no host synchronisation."""
    N, D = tgt.numel(), c.shape[1]
    k = pos.numel()
    tsq = torch.empty(N, dtype=torch.float32, device=c.device)
    out = torch.empty(1, dtype=torch.float32, device=c.device)
    if N:
        _target_term_sq_kernel[(triton.cdiv(N, TARGET_BLOCK_N),)](
            C=c, Tgt=tgt, Coef=coef, NValid=n_valid, Out=tsq, N=N, D=D, stride_c=c.stride(0),
            BLOCK_N=TARGET_BLOCK_N, BLOCK_D=TARGET_BLOCK_D,
        )  # fmt: skip
    ref = ref.contiguous()
    _de_norm_sq_kernel[(1,)](
        Ref=ref, Tsq=tsq, Pos=pos, Ok=ok, Out=out, N=N, k=k, D=D, stride_ref=ref.stride(0),
        BLOCK_K=max(16, triton.next_power_of_2(k)), BLOCK_D=128, BLOCK_R=1024,
    )  # fmt: skip
    return out


def add_target_lo(e2d, c, erow, tgt, lo, dE, dC, chunk_bytes: int = 32 << 20) -> None:
    """Adds the target entries' rounding remainders in fp32 (see dz.py): dE_i += lo_i c_t,
    dC_t += lo_i e_i (rows in the sorted order; lo is 0 at ignored rows). By row chunks whose
    fp32 rows take ``chunk_bytes``: the temporaries stay small at any N and D."""
    chunk = max(1, chunk_bytes // (4 * max(1, c.shape[1])))
    for s in range(0, lo.numel(), chunk):
        ls, ts, es = lo[s : s + chunk, None], tgt[s : s + chunk], erow[s : s + chunk]
        if dE is not None:
            dE.index_add_(0, es, c.index_select(0, ts).float().mul_(ls))
        if dC is not None:
            dC.index_add_(0, ts, e2d.index_select(0, es).float().mul_(ls))


# ---------------------------------------------------------------------------------------------
# cuBLAS gradient products of a dZ slab (the exact backward, the fused forward)


def aligned_parts(width: int) -> list[tuple[int, int]]:
    """A slab's columns as [0, width) or, when width is not a multiple of 8 (the last slab of an
    odd V), [0, width8) and [width8, width): cuBLAS falls back to kernels 4-6x slower on an
    H100 when the products' class dimension is not a multiple of 8 (docs/benchmarks.md)."""
    w8 = width - width % 8
    return [(0, width)] if w8 in (0, width) else [(0, w8), (w8, width)]


def slab_products(
    dz, c_slab, E_s, dE, dC, v0: int, scale, accumulate_dc: bool = False, accumulate_de: bool = True
) -> None:
    """dE += dz @ c_slab (dE fp32; ``accumulate_de`` False: =) and dC[v0 : v0 + width] = dz^T @
    E_s for one slab's columns (``accumulate_dc``: +=, in fp32 with one rounding to dC's dtype)."""
    f32 = torch.float32
    if dE is not None:
        if scale is None and dz.is_cuda and dz.dtype != f32:
            # Accumulated by the GEMM itself (beta = 1, fp32 output): no fp32 [N, D]
            # temporary per slab to write, read back and add.
            if accumulate_de:
                torch.addmm(dE, dz, c_slab, out_dtype=f32, out=dE)
            else:
                torch.mm(dz, c_slab, out_dtype=f32, out=dE)
        elif accumulate_de:
            dE += mm_f32(dz, c_slab, scale)
        else:
            dE.copy_(mm_f32(dz, c_slab, scale))
    if dC is not None:
        rows = dC[v0 : v0 + dz.shape[1]]
        if accumulate_dc:
            if scale is None and dz.is_cuda and dz.dtype != f32:
                # beta = 1: the stored rows added to the fp32 product inside the GEMM, one
                # rounding to dC's dtype (fp32, or c's dtype for few chunks of the fused path).
                if rows.dtype == f32:
                    torch.addmm(rows, dz.T, E_s, out_dtype=f32, out=rows)
                else:
                    torch.addmm(rows, dz.T, E_s, out=rows)
            else:
                rows += mm_f32(dz.T, E_s, scale)
        elif scale is None and dC.dtype != f32 and dz.is_cuda:
            # fp32 accumulation inside the GEMM, one rounding to c's dtype, no fp32 temporary.
            torch.mm(dz.T, E_s, out=rows)
        else:
            rows.copy_(mm_f32(dz.T, E_s, scale))


def mm_f32(a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """a @ b in fp32 (GEMM accumulation in fp32), times ``scale`` if given."""
    if a.dtype == torch.float32:
        out = torch.mm(a, b)
    elif a.is_cuda:
        out = torch.mm(a, b, out_dtype=torch.float32)
    else:
        out = torch.mm(a.float(), b.float())
    return out if scale is None else out * scale
