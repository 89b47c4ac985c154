"""dC summed over row chunks in scaled fp16 (cce/ops/linear_ce/kernels/dc_accumulate.py), under
the Triton interpreter (fp16 operands and output: bf16 arithmetic is wrong there; the fused path
in bf16 over many chunks is checked on the GPU, test_gpu_linear.py).

Bounds. Each chunk's product is an fp32 sum of K <= 40 fp16 products (relative ~1e-7), scaled
by a power of two (exact) and added to the stored fp16 value, rounded once: at most 2^-11 of the
running value per chunk; the last chunk divides by S (exact) and rounds to fp16 once more. So
entry by entry |dC - sum| <= 2^-11 (sum over chunks of |running value| + |final|) + 1e-6 of the
absolute products; scaled values stay above fp16's subnormals here (the inputs are scaled so).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_linear import SETTINGS

from tests.helpers import examples

pytest.importorskip("triton")

from cce.ops.linear_ce.kernels.dc_accumulate import (  # noqa: E402
    DC16_LOG2_TOP,
    dc16_scale,
    dc_accumulate,
    dz_row_bound,
)


@settings(SETTINGS, max_examples=examples(30, 8))
@given(
    K=st.integers(1, 40),
    V=st.integers(1, 70),
    D=st.integers(1, 70),
    chunks=st.integers(1, 4),
    pad=st.integers(0, 9),
    seed=st.integers(0, 2**16),
)
def test_dc_accumulate_vs_float64(K, V, D, chunks, pad, seed):
    """Chunks of dZ [K, V + pad] (a row stride past V: the fused path's padded q buffer) and E
    [K, D] against the float64 sum, entry by entry within the roundings' bound (module
    docstring); the scale from the rows' actual sums of |dZ| (the bound dc16_scale is given) keeps
    every stored value within 2^14. V and D off the interpreter's 32-wide tiles, K off its 16."""
    g = torch.Generator().manual_seed(seed)
    parts = [
        (
            (torch.randn(K, V + pad, generator=g) * 1e-3).half(),
            torch.randn(K, D, generator=g).half(),
        )
        for _ in range(chunks)
    ]
    e_all = torch.cat([e for _, e in parts])
    rows = torch.cat([dz[:, :V].float().abs().sum(1) for dz, _ in parts])
    S = dc16_scale(e_all, rows)
    dC = torch.full((V, D), float("nan"), dtype=torch.float16)
    run = torch.zeros(V, D, dtype=torch.float64)
    runs, absprod = [], torch.zeros(V, D, dtype=torch.float64)
    for i, (dz, e) in enumerate(parts):
        dc_accumulate(dz[:, :V], e, dC, S, first=i == 0, last=i == chunks - 1)
        run = run + dz[:, :V].double().T @ e.double()
        runs.append(run.abs())
        absprod += dz[:, :V].double().abs().T @ e.double().abs()
    s = float(S)
    assert max(float(r.max()) for r in runs) * s <= 2.0**DC16_LOG2_TOP
    bound = 2.0**-11 * (sum(runs) + run.abs()) + 1e-6 * absprod + 2.0**-24 / s * (chunks + 1)
    assert torch.isfinite(dC).all()
    assert ((dC.double() - run).abs() <= bound).all()


def test_dc_accumulate_poisoned_and_partial_tiles():
    """dC's storage holds NaN before the first chunk (the first chunk reads nothing of it), and
    one chunk (first and last) writes the product itself."""
    g = torch.Generator().manual_seed(3)
    dz = (torch.randn(20, 45, generator=g) * 1e-2).half()
    e = torch.randn(20, 33, generator=g).half()
    dC = torch.full((45, 33), float("nan"), dtype=torch.float16)
    dc_accumulate(dz, e, dC, torch.tensor([1024.0]), first=True, last=True)
    ref = dz.double().T @ e.double()
    assert ((dC.double() - ref).abs() <= 2.0**-11 * ref.abs() + 1e-6).all()
    with pytest.raises(ValueError, match="16-bit dC"):
        dc_accumulate(dz, e, dC.float(), torch.tensor([1.0]), first=True, last=True)


@pytest.mark.parametrize("bound", [1e-30, 3e-3, 1.0, 2.0, 5e4])
def test_dc16_scale_power_of_two(bound):
    """S is a power of two with 2^13 <= S B <= 2^14 (B = max|E| times the rows' sum; 2^13 where B
    is a power of two); B = 0 gives 1."""
    e = torch.tensor([[0.5, -2.0], [1.0, 0.25]])  # max |E| = 2
    rows = torch.tensor([bound / 4, bound / 4])
    s = float(dc16_scale(e, rows))
    assert math.log2(s) == round(math.log2(s))
    assert 2.0 ** (DC16_LOG2_TOP - 1) <= s * bound <= 2.0**DC16_LOG2_TOP
    assert float(dc16_scale(e, torch.zeros(2))) == 1.0
    assert float(dc16_scale(torch.zeros(0, 2), rows)) == 1.0


@settings(SETTINGS, max_examples=examples(40, 10))
@given(
    scale=st.sampled_from([0.1, 1.0, 8.0]),
    softcap=st.sampled_from([0.0, 3.0]),
    temperature=st.sampled_from([1.0, 0.5, 2.0]),
    smoothing=st.booleans(),
    weights=st.booleans(),
    z_loss=st.booleans(),
    bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_coef_bound_bounds_dz_rows(scale, softcap, temperature, smoothing, weights, z_loss, bias, seed):
    """The fused path's per-row bound of sum_v |dZ_iv| (dc_accumulate.dz_row_bound) holds for dZ
    formed from its coefficients in float64 (cce/_math.py's form: alpha = a0 + a1 lse, the
    softcap's derivative, the temperature after the softcap), with coefficients of either sign
    and large logits."""
    g = torch.Generator().manual_seed(seed)
    N, V, D = 12, 37, 9
    e = torch.randn(N, D, generator=g) * scale
    c = torch.randn(V, D, generator=g) * scale
    b = torch.randn(V, generator=g) * 2 if bias else None
    w = torch.rand(V, generator=g) * 3 if weights else None
    t = torch.randint(0, V, (N,), generator=g)
    a0, beta = torch.randn(N, generator=g) / N, torch.randn(N, generator=g) / N
    a1 = torch.randn(N, generator=g) / N if z_loss else None
    gamma = torch.randn(N, generator=g) / N if smoothing and softcap == 0 else None
    x = e.double() @ c.double().T + (b.double() if b is not None else 0.0)
    sd = torch.ones_like(x)
    if softcap > 0:
        th = torch.tanh(x / softcap)
        x, sd = softcap * th, 1 - th * th
    z = x / temperature
    lse = torch.logsumexp(z, 1)
    p = torch.exp(z - lse[:, None])
    alpha = a0.double() + (a1.double() * lse if a1 is not None else 0.0)
    dz = alpha[:, None] * p
    dz[torch.arange(N), t] -= beta.double()
    if gamma is not None:
        dz -= gamma.double()[:, None] * (w.double() if w is not None else 1.0)
    dz = dz * sd
    bound = dz_row_bound(e, c, b, w, a0, a1, beta, gamma, softcap, temperature)
    assert (dz.abs().sum(1) <= bound.double() * (1 + 1e-6)).all()
