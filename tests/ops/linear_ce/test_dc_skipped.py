"""The sparse backward's dC rows of the tiles without kept blocks (kernels/dc_skipped.py), under
the Triton interpreter on CPU (or on a GPU): the rank-1 stream and the target classes' rows
against their formula in float64, from the plan's own inputs.

    dC[v] = q_p G_j + sum_{i: t_i = v} coef_i e_i [- w_v sum_i gamma_i e_i]   p = pos(v), j = p // BV

A class's target rows are consecutive in the plan's order and may span several of the target
kernel's row groups (BLOCK_R = 16 rows under the interpreter, the rows past the group in blocks
of BLOCK_X = 16): the curated runs below put one class's rows across three or more groups, start
classes mid-group and leave ignored rows after the valid ones.
"""

from __future__ import annotations

import pytest
import torch

from bench.data import zipf_inputs

pytest.importorskip("triton")

from cce.ops.linear_ce.kernels.common import stats_blocks  # noqa: E402
from cce.ops.linear_ce.kernels.dc_skipped import dc_skipped_config  # noqa: E402
from cce.ops.linear_ce.triton_backward import sparse_backward  # noqa: E402
from tests.ops.linear_ce.test_triton_sparse import _fwd  # noqa: E402

N, D, V = 160, 40, 300


IGNORED = torch.arange(5, N, 11)  # ignored rows, sorted after the valid ones


def _targets(order: torch.Tensor, runs: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Targets: ``runs[k]`` valid rows of the class at sorted position V - 1 - 7 k, the other
    valid rows spread over the classes before position V - 7 len(runs)."""
    t = order.long()[torch.randint(0, V - 7 * len(runs), (N,), generator=gen)]
    t[IGNORED] = -100
    valid = (t != -100).nonzero()[:, 0]
    valid = valid[torch.randperm(valid.numel(), generator=gen)]
    lo = 0
    for k, n in enumerate(runs):
        t[valid[lo : lo + n]] = int(order[V - 1 - 7 * k])
        lo += n
    return t


@pytest.mark.parametrize(
    "device, dtype",
    [
        pytest.param("cpu", torch.float32, id="cpu-fp32"),
        pytest.param("cuda", torch.float32, marks=pytest.mark.gpu, id="cuda-fp32"),
        pytest.param("cuda", torch.bfloat16, marks=pytest.mark.gpu, id="cuda-bf16"),
    ],
)
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("runs", [(40, 17, 1, 33), (16, 15, 1), (1,)])
def test_skipped_tiles_dc_against_its_formula(runs, smoothing, device, dtype):
    """Every class in a tile without kept blocks: dC[v] equals the formula above in float64 from
    the plan's q, G, ordered target rows and coefficients, to fp32 rounding of the sums (the
    terms summed in fp32: at most ~n 2^-24 of the sum of their magnitudes, n <= N) and one
    rounding into dC's dtype (2^-24 in fp32, 2^-8 in bf16, relative). (bf16 only on the GPU:
    the interpreter's bf16 arithmetic is wrong.)"""
    gen = torch.Generator().manual_seed(len(runs) + int(smoothing * 10))
    e, c, _ = zipf_inputs(N, D, V, dtype=dtype, device=device, seed=11)
    eps = 2e-3
    # The vocabulary order depends on the valid rows only (their mean hidden state): a first
    # forward gives it, the targets then name its tail classes.
    t0 = torch.zeros(N, dtype=torch.long)
    t0[IGNORED] = -100
    t0 = t0.to(device)
    order = _fwd(e, c, None, None, t0, "mean", 0.0, smoothing, 0.0, eps)[5].cpu()
    t = _targets(order, runs, gen).to(device)
    out = _fwd(e, c, None, None, t, "mean", 0.0, smoothing, 0.0, eps)
    assert torch.equal(out[5].cpu(), order)
    g = (torch.rand(N, generator=gen) / N).to(device)
    # Only the head tile keeps its blocks (the sparse dC writer's), whatever the forward kept: the
    # other tiles are this module's, at any data (the gradients then leave the filter's bound,
    # which this test does not check: it checks the writer against its own formula).
    keep = out[3].clone()
    keep[:, 1:] = 0
    assert keep[:, 0].any()
    args = (
        e,
        c,
        None,
        None,
        None,
        t,
        out[1],
        g,
        None,
        -100,
        0.0,
        smoothing,
        0.0,
        True,
        True,
        out[2],
        keep,
        *out[4:8],
    )
    _, dC, plan = sparse_backward(*args, return_plan=True)
    BV = stats_blocks(e.dtype)[1]
    perm = order.long()
    plan_t = {k: getattr(plan, k).cpu() for k in ("seg", "tpos", "tcoef", "trow", "q", "g", "cnt_c")}
    n_t = int(plan_t["seg"][-1])
    pos_t = plan_t["tpos"][:n_t].long()
    e64 = e.cpu().double()
    x = plan_t["tcoef"][:n_t].double()[:, None] * e64[plan_t["trow"][:n_t].long()]
    tsum = torch.zeros(V, D, dtype=torch.float64).index_add_(0, pos_t, x)  # per sorted position
    tabs = torch.zeros(V, D, dtype=torch.float64).index_add_(0, pos_t, x.abs())
    tile = torch.arange(V) // BV
    rank1 = plan_t["q"].double()[:, None] * plan_t["g"].double()[tile]
    ref = rank1 + tsum
    ge = torch.zeros(D, dtype=torch.float64)
    if smoothing:
        ge = plan.ge.cpu().double()
        ref = ref - ge[None, :]
    own = plan_t["cnt_c"].long()[tile] == 0
    # the curated classes' runs are what the test is about; the head tile is the other writer's
    heads = [V - 1 - 7 * k for k in range(len(runs))]
    assert own[heads].all() and not own[0]
    assert [int((pos_t == p).sum()) for p in heads] == list(runs)
    got = dC.cpu().double()[perm]
    u_out = 2.0**-24 if dtype == torch.float32 else 2.0**-8
    tol = 4 * N * 2.0**-24 * (tabs + rank1.abs() + ge.abs()[None, :]) + u_out * ref.abs()
    err = (got - ref).abs()
    assert (err[own] <= tol[own]).all(), float((err - tol)[own].max())


def test_config_blocks_fit_the_kernels():
    """tl.dot needs every dimension of at least 16; the row group and D chunks are powers of two."""
    for b in dc_skipped_config()[:4]:
        assert b >= 16 and b & (b - 1) == 0
