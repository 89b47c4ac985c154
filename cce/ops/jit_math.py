"""Triton jit helpers shared by the kernels of both levels.

Written with exp2 only: libdevice functions (tanh, exp through libdevice) do not run in the
Triton interpreter, which the CPU test suite uses.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)


@triton.jit
def exp(x):
    """e^x as exp2(x log2 e). The callers pass a difference (z - m), so the scale's rounding stays
    relative to it: exp2 of a pre-scaled logit z log2(e) would carry an absolute error of
    |z| 2^-24 into every term."""
    return tl.exp2(x * 1.4426950408889634)


@triton.jit
def tanh(x):
    """tanh(x) = sign(x) (1 - t) / (1 + t), t = exp(-2|x|) <= 1: neither overflow nor
    cancellation for large |x|."""
    t = tl.exp2(tl.abs(x) * -2.8853900817779268)  # exp(-2|x|); tensor first (interpreter)
    r = (1.0 - t) / (1.0 + t)
    return tl.where(x < 0, -r, r)


@triton.jit
def softcap(x, cap):
    """(cap tanh(x / cap), tanh(x / cap)): the capped logits and the tanh that their derivative
    1 - tanh^2 needs."""
    th = tanh(x / cap)
    return cap * th, th
