"""The forward's tile statistics as the sparse backward keeps them, and tile means of C.

The forward (forward.py, STATS) writes per sorted row i and vocabulary tile j a bound of the
tile's largest non-target probability and its non-target mass S_ij (fp16 / int8, 3 bytes).
encode_tile_stats turns them into 1 byte per (row, tile) plus one keep flag per (token block,
tile): what cce/ops/linear_ce/kernels/backward_sparse.py reads. tile_means gives mean(C_j), the
direction of a skipped tile's rank-1 correction.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...._dispatch import interpreting
from ...launch import cached_launch
from .common import check_inputs, device_context, skipped_slog, tile_cols

# ignored row, or a mass carried on to the next tile). 16 steps per nat (rounding <= 3.2%
# relative, span e^-15.9) with the rounding carried from tile to tile (see _encode_stats_kernel).
STATS_STEPS = 16.0


@cached_launch
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
    rounding is an order of magnitude worse on LM-like data, docs/design.md). Chains start at
    zero carry.
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
    chain_tiles: int,
    code: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(code uint8 [N, n_tiles], keep int8 [n_blocks, n_tiles]) from linear_ce_forward's raw tile
    statistics and the sorted rows' lse (see _encode_stats_kernel): what the sparse backward
    keeps of them, 1 byte per (row, tile) instead of 3, in carry chains of ``chain_tiles`` tiles
    (Tuning.stats_chain_tiles; the chains of a row run in parallel). ``code``: where to write the codes (rows
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
        with device_context(st.device):
            _encode_stats_kernel[(nb, triton.cdiv(nt, chain_tiles))](
                St=st, Sq=sq, M0=m0, Lse=lse, NValid=n_valid, Code=code, Keep=keep, N=N, n_vtiles=nt,
                stride_st=st.stride(0), stride_code=code.stride(0), chain=chain_tiles,
                STEPS=STATS_STEPS, BLOCK_N=BLOCK_N,
            )  # fmt: skip
    return code, keep


def decode_tile_mass(code: torch.Tensor) -> torch.Tensor:
    """The masses S of encode_tile_stats' codes, fp32 (0 for code 255)."""
    return torch.where(code < 255, torch.exp(code * (-1.0 / STATS_STEPS)), 0.0)


@cached_launch
@triton.jit
def _skipped_slog_kernel(
    Code, Lse, Out, N, nt, stride_code, softcap,
    STEPS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_T: tl.constexpr,
):  # fmt: skip
    """Out[i, j] = common.skipped_slog of row i's decoded mass in tile j (0 for code 255)."""
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    m = (offs_r < N)[:, None] & (offs_t < nt)[None, :]
    x = tl.load(Code + offs_r.to(tl.int64)[:, None] * stride_code + offs_t[None, :], mask=m, other=255).to(
        tl.float32
    )  # [BLOCK_R, BLOCK_T]
    S = tl.where(x < 255.0, tl.exp(-x / STEPS), 0.0)
    lse = tl.load(Lse + offs_r, mask=offs_r < N, other=0.0)
    out = skipped_slog(S, lse[:, None], softcap, BLOCK_V, HAS_SOFTCAP)
    tl.store(Out + offs_r.to(tl.int64)[:, None] * nt + offs_t[None, :], out, mask=m)


def skipped_slogs(code: torch.Tensor, lse: torch.Tensor, softcap: float, BLOCK_V: int) -> torch.Tensor:
    """fp32 [N, n_tiles]: common.skipped_slog of every (sorted row, tile) of the codes ``code``
    [N, n_tiles] (``lse`` [N] the rows'), once per step: the entropy's term of the skipped tiles'
    corrections reads it in the dE writer (once per D chunk there) and in _dc_inputs."""
    N, nt = code.shape
    out = torch.empty((N, nt), dtype=torch.float32, device=code.device)
    if N and nt:
        BR, BT = (16, 16) if interpreting() else (32, 128)
        with device_context(code.device):
            _skipped_slog_kernel[(triton.cdiv(N, BR), triton.cdiv(nt, BT))](
                Code=code, Lse=lse, Out=out, N=N, nt=nt, stride_code=code.stride(0), softcap=float(softcap),
                STEPS=STATS_STEPS, HAS_SOFTCAP=softcap > 0, BLOCK_V=BLOCK_V, BLOCK_R=BR, BLOCK_T=BT,
            )  # fmt: skip
    return out


@cached_launch
@triton.heuristics({"HAS_OUT": lambda a: a["Out"] is not None})
@triton.jit
def _tile_means_kernel(
    C, Perm, Cm, Out, V, D, stride_c, stride_cm, stride_out, d_lo, d_hi, tile0,
    BLOCK_V: tl.constexpr, BLOCK_DO: tl.constexpr, HAS_OUT: tl.constexpr,
):  # fmt: skip
    """Cm[j, d - d_lo] = mean of c[:, d] over the rows at positions [j BLOCK_V, (j + 1) BLOCK_V)
    of the order, for d in [d_lo, d_hi) and the tiles j = tile0 + program_id(0). With HAS_OUT the
    rows themselves too, gathered into Out (row p - tile0 BLOCK_V for position p; d_lo = 0)."""
    j = tile0 + tl.program_id(0)
    offs_do = d_lo + tl.program_id(1) * BLOCK_DO + tl.arange(0, BLOCK_DO)
    dmask = offs_do < d_hi
    offs_p, col_mask, vid = tile_cols(Perm, j, V, BLOCK_V)
    x = tl.load(
        C + vid[:, None] * stride_c + offs_do[None, :], mask=col_mask[:, None] & dmask[None, :], other=0.0
    )  # [BLOCK_V, BLOCK_DO]
    if HAS_OUT:
        rows = (offs_p - tile0 * BLOCK_V).to(tl.int64)
        tl.store(
            Out + rows[:, None] * stride_out + offs_do[None, :], x, mask=col_mask[:, None] & dmask[None, :]
        )
    cnt = tl.sum(col_mask.to(tl.float32), axis=0)
    mean = tl.sum(x.to(tl.float32), axis=0) / cnt
    tl.store(Cm + j.to(tl.int64) * stride_cm + offs_do - d_lo, mean.to(Cm.dtype.element_ty), mask=dmask)


def _launch_tile_means(
    c, perm, cm, out, d_lo: int, d_hi: int, tile_lo: int, tile_hi: int, BLOCK_V: int
) -> None:
    V, D = c.shape
    BDO = 32 if interpreting() else 128
    if V > 0 and d_hi > d_lo and tile_hi > tile_lo:
        with device_context(c.device):
            _tile_means_kernel[(tile_hi - tile_lo, triton.cdiv(d_hi - d_lo, BDO))](
                C=c, Perm=perm, Cm=cm, Out=out, V=V, D=D, stride_c=c.stride(0), stride_cm=cm.stride(0),
                stride_out=0 if out is None else out.stride(0), d_lo=d_lo, d_hi=d_hi, tile0=tile_lo,
                BLOCK_V=BLOCK_V, BLOCK_DO=BDO,
            )  # fmt: skip


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
    check_inputs(c, c, perm)
    V, D = c.shape
    d_hi = D if d_hi is None else d_hi
    nt = triton.cdiv(V, BLOCK_V)
    cm = torch.empty((nt, d_hi - d_lo), dtype=dtype, device=c.device)
    _launch_tile_means(c, perm, cm, None, d_lo, d_hi, 0, nt, BLOCK_V)
    return cm


def gather_tile_means(
    c: torch.Tensor, perm: torch.Tensor, tile_lo: int, tile_hi: int, BLOCK_V: int, out: torch.Tensor,
    cm: torch.Tensor,
) -> None:  # fmt: skip
    """The rows of ``c`` at the positions of tiles [tile_lo, tile_hi) of ``perm`` gathered into
    ``out`` (``out[p - tile_lo BLOCK_V] = c[perm[p]]``, as ``torch.index_select``) and those tiles'
    means into ``cm[tile_lo:tile_hi]`` (fp32 [n_tiles, D], as tile_means): one pass over the rows
    for both (the sorted forward's slab copy, kernels/forward.py)."""
    check_inputs(c, c, perm, out, cm)
    D = c.shape[1]
    if out.shape[1] != D or out.stride(1) != 1 or cm.shape[1] != D or cm.stride(1) != 1:
        raise ValueError("out and cm must have D unit-stride columns")
    _launch_tile_means(c, perm, cm, out, 0, D, tile_lo, tile_hi, BLOCK_V)
