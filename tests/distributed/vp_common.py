"""What the gloo-group cases of test_distributed.py and output_cases.py share: the problem size,
the fp32 tolerance, the vocabulary split and the per-case seeds."""

from __future__ import annotations

import zlib

# fp32 on both sides, only the summation order differs (logsumexp over blocks then ranks, dE summed
# over ranks): errors are a few fp32 ulps of the row sums, ~1e-7 relative; 2e-5 leaves room for the
# small, cancellation-prone gradients (label smoothing, z-loss) without hiding a wrong term (those
# are O(1e-2) or larger).
TOL_FP32 = 2e-5
D, V = 40, 263  # V: not a multiple of the 3-way split, more than one 128-row filter block


def split_sizes(world: int, how: str) -> list[int]:
    """Every rank's block size: "even" (differing by at most 1) or "skewed" (rank 0 small, the
    last rank large)."""
    if how == "skewed":
        sizes = [1 + 7 * r * r for r in range(world)]
        sizes[-1] += V - sum(sizes)
        return sizes
    return [V // world + (1 if r < V % world else 0) for r in range(world)]


def case_seed(name: str) -> int:
    return zlib.crc32(name.encode())


def leaf(x, rows=None):
    """A fresh leaf copy of x (of its rows, when given) that requires grad; None stays None."""
    if x is None:
        return None
    x = x.detach()
    if rows is not None:
        x = x[rows]
    return x.clone().requires_grad_()
