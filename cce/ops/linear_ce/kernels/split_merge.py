"""The merge of the forward's vocabulary splits: per row, the partial running max and sum of
exponentials (and the smoothing's weighted logit sums) of every split into the row's log-sum-exp,
in one launch (kernels/forward.py writes the partials)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...._dispatch import interpreting
from ...launch import cached_launch
from .common import device_context


# The splits' partial statistics merged per row i (parts p = 0 .. P-1, rows of Mx / Se / Ss):
#
#   M_i = max_p Mx[p, i] (NaN if any is),  done_i = M_i > -inf or NaN (false for rows no split
#         wrote: m = -inf, S = 0),
#   lse_i = M_i + log sum_p Se[p, i] exp(Mx[p, i] - M_i)           (0 where not done; NaN where
#         M_i or a part's sum is: a non-finite logit reaches the loss, never a finite value),
#   Tl_i = Zt_i, SsOut_i = sum_p Ss[p, i]                           (0 where not done),
#   M0Out_i = M0_i where finite, else 0                             (the head tile's lse).
#
# Two passes over the parts (the max, then the rescaled sum), in one launch instead of about
# fifteen torch ops (host time of a step: docs/benchmarks.md, "Host time"). A program takes
# BLOCK rows and reads the parts BLOCK_P at a time ([BLOCK_P, BLOCK] tiles, each row of a tile
# contiguous), so that a chunk of a few thousand rows split over a hundred or more parts (the
# fused path's forward) still spreads over many programs with few dependent loads each; parts
# that never saw a row add Se exp(-inf - M) = 0.
@cached_launch
@triton.heuristics({"HAS_SS": lambda a: a["Ss"] is not None, "HAS_M0": lambda a: a["M0"] is not None})
@triton.jit
def _merge_kernel(
    Mx, Se, Ss, Zt, M0, Lse, Tl, SsOut, M0Out, N, parts, stride_part,
    HAS_SS: tl.constexpr, HAS_M0: tl.constexpr, BLOCK: tl.constexpr, BLOCK_P: tl.constexpr,
):  # fmt: skip
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    offs_p = tl.arange(0, BLOCK_P)
    M = tl.full([BLOCK], float("-inf"), tl.float32)
    n_nan = tl.zeros([BLOCK], tl.int32)
    for p0 in range(0, parts, BLOCK_P):
        # (64-bit part offsets: parts x N may pass 2^31)
        pp = p0 + offs_p
        ptr = (pp.to(tl.int64) * stride_part)[:, None] + offs[None, :]  # [BLOCK_P, BLOCK]
        m2 = (pp < parts)[:, None] & mask[None, :]
        x = tl.load(Mx + ptr, mask=m2, other=float("-inf"))
        M = tl.maximum(M, tl.max(x, axis=0))
        n_nan += tl.sum((x != x).to(tl.int32), axis=0)
    M = tl.where(n_nan > 0, float("nan"), M)  # (NaN propagates, as in torch's max)
    done = M != float("-inf")  # (true for NaN and +inf: those rows' lse is NaN, not 0)
    Mz = tl.where(done, M, 0.0)
    S = tl.zeros([BLOCK], tl.float32)
    ss = tl.zeros([BLOCK], tl.float32)
    for p0 in range(0, parts, BLOCK_P):
        pp = p0 + offs_p
        ptr = (pp.to(tl.int64) * stride_part)[:, None] + offs[None, :]
        m2 = (pp < parts)[:, None] & mask[None, :]
        x = tl.load(Mx + ptr, mask=m2, other=float("-inf"))
        S += tl.sum(tl.load(Se + ptr, mask=m2, other=0.0) * tl.exp(x - Mz[None, :]), axis=0)
        if HAS_SS:
            ss += tl.sum(tl.load(Ss + ptr, mask=m2, other=0.0), axis=0)
    # (S is NaN where a split's sum is, e.g. a row of NaN logits whose max reads -inf: its lse
    # is NaN too)
    nan_s = S != S
    tl.store(Lse + offs, tl.where(done | nan_s, Mz + tl.log(tl.where(done | nan_s, S, 1.0)), 0.0), mask=mask)
    tl.store(Tl + offs, tl.where(done, tl.load(Zt + offs, mask=mask, other=0.0), 0.0), mask=mask)
    if HAS_SS:
        tl.store(SsOut + offs, tl.where(done, ss, 0.0), mask=mask)
    if HAS_M0:
        m0 = tl.load(M0 + offs, mask=mask, other=0.0)
        tl.store(M0Out + offs, tl.where(tl.abs(m0) < float("inf"), m0, 0.0), mask=mask)


def merge_splits(
    Mx: torch.Tensor, Se: torch.Tensor, Ss: torch.Tensor | None, zt: torch.Tensor, m0: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(lse, target logit, weighted logit sum or None, m0 or None), fp32 [N], from the splits'
    partials Mx / Se / Ss [parts, N] (the comment above _merge_kernel); one launch."""
    P, N = Mx.shape
    f32 = torch.float32
    lse = torch.empty(N, dtype=f32, device=Mx.device)
    tl_ = torch.empty(N, dtype=f32, device=Mx.device)
    ss = None if Ss is None else torch.empty(N, dtype=f32, device=Mx.device)
    m0o = None if m0 is None else torch.empty(N, dtype=f32, device=Mx.device)
    if N > 0:
        # (The interpreter runs programs one after another at a fixed cost per operation: there
        # few programs of long rows.)
        BLOCK, BLOCK_P = (1024, 4) if interpreting() else (64, 16)
        with device_context(Mx.device):
            _merge_kernel[(triton.cdiv(N, BLOCK),)](
                Mx=Mx, Se=Se, Ss=Ss, Zt=zt, M0=m0, Lse=lse, Tl=tl_, SsOut=ss, M0Out=m0o, N=N, parts=P,
                stride_part=Mx.stride(0), BLOCK=BLOCK, BLOCK_P=BLOCK_P,
            )  # fmt: skip
    return lse, tl_, ss, m0o
