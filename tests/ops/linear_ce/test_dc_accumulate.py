"""dC summed over row chunks in scaled fp16 (cce/ops/linear_ce/kernels/dc_accumulate.py), under
the Triton interpreter (fp16 operands and output: bf16 arithmetic is wrong there; the fused path
in bf16 over many chunks is checked on the GPU, test_gpu_linear.py).

Bounds. Each chunk's product is an fp32 sum of K <= 40 fp16 products (relative ~1e-7), scaled
by a power of two (exact) and added to the stored fp16 value, rounded once: at most 2^-11 of the
running value per chunk; the last chunk divides by S (exact) and rounds to fp16 once more. So
entry by entry |dC - sum| <= 2^-11 (sum over chunks of |running value| + |final|) + 1e-6 of the
absolute products, plus the subnormals' absolute half-steps: 2^-25 / S per stored rounding (the
scaled values) and 2^-25 for the final fp16 value (unscaled).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_linear import SETTINGS

from tests.helpers import examples, rel_err

pytest.importorskip("triton")

from cce._dispatch import FUSED_DIRECT_CHUNKS  # noqa: E402
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
    bound = 2.0**-11 * (sum(runs) + run.abs()) + 1e-6 * absprod + 2.0**-25 / s * chunks + 2.0**-25
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


@pytest.mark.parametrize("bound", [1e-30, 3e-3, 1.0, 2.0, 5e4, 1e30])
def test_dc16_scale_power_of_two(bound):
    """S is a power of two with 2^13 <= S B <= 2^14 (B = max|E| times the rows' sum; 2^13 where B
    is a power of two); B = 0 gives 1, a B too small for that 2^126 (fp32's range), a non-finite
    B NaN."""
    e = torch.tensor([[0.5, -2.0], [1.0, 0.25]])  # max |E| = 2
    rows = torch.tensor([bound / 4, bound / 4])
    s = float(dc16_scale(e, rows))
    assert math.log2(s) == round(math.log2(s))
    assert 2.0 ** (DC16_LOG2_TOP - 1) <= s * bound <= 2.0**DC16_LOG2_TOP
    assert float(dc16_scale(e, torch.zeros(2))) == 1.0
    assert float(dc16_scale(torch.zeros(0, 2), rows)) == 1.0
    assert float(dc16_scale(e, torch.tensor([1e-40, 0.0]))) == 2.0**126
    for bad in (float("inf"), float("nan")):
        assert math.isnan(float(dc16_scale(e, torch.tensor([bad, 1.0]))))


@settings(SETTINGS, max_examples=examples(40, 10))
@given(
    scale=st.sampled_from([0.1, 1.0, 8.0]),
    softcap=st.sampled_from([0.0, 3.0]),
    temperature=st.sampled_from([1.0, 0.5, 2.0]),
    smoothing=st.booleans(),
    weights=st.booleans(),
    z_loss=st.booleans(),
    bias=st.sampled_from(["none", "finite", "masked"]),
    seed=st.integers(0, 2**16),
)
def test_coef_bound_bounds_dz_rows(scale, softcap, temperature, smoothing, weights, z_loss, bias, seed):
    """The fused path's per-row bound of sum_v |dZ_iv| (dc_accumulate.dz_row_bound) holds for dZ
    formed from its coefficients in float64 (cce/_math.py's form: alpha = a0 + a1 lse, the
    softcap's derivative, the temperature after the softcap), with coefficients of either sign
    and large logits, with ignored rows (zero coefficients) and classes masked by a bias of -inf
    (which must not make the bound infinite or NaN)."""
    g = torch.Generator().manual_seed(seed)
    N, V, D = 12, 37, 9
    e = torch.randn(N, D, generator=g) * scale
    c = torch.randn(V, D, generator=g) * scale
    b = None if bias == "none" else torch.randn(V, generator=g) * 2
    if bias == "masked":
        b[:5] = float("-inf")
    w = torch.rand(V, generator=g) * 3 if weights else None
    t = torch.randint(0, V, (N,), generator=g)
    a0, beta = torch.randn(N, generator=g) / N, torch.randn(N, generator=g) / N
    a1 = torch.randn(N, generator=g) / N if z_loss else None
    gamma = torch.randn(N, generator=g) / N if smoothing and softcap == 0 else None
    for coef in (a0, a1, beta, gamma):
        if coef is not None:
            coef[:2] = 0  # two ignored rows
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
    assert torch.isfinite(bound).all()
    assert (dz.abs().sum(1) <= bound.double() * (1 + 1e-6)).all()


@pytest.mark.parametrize("grads", [(True, True, True), (False, True, False), (True, False, False)])
def test_fused_launcher_past_direct_chunks(grads, monkeypatch):
    """The fused launcher with fp16 operands (bf16 arithmetic is wrong in the interpreter) in 12
    row chunks, so that dC sums them in scaled fp16, through a row gather (``rows``), with
    smoothing, class weights, z-loss, a temperature and a bias: against the same launcher in fp32
    in one chunk. fp16 budget as in test_triton_linear.py (q and dZ rounded to fp16, 2^-11 each,
    fp16 outputs: 4e-3), the 12 roundings of dC's running sum at 2^-11 adding ~1e-3 RMS."""
    import cce.ops.linear_ce.kernels.fused_grads as fg

    calls = []
    real = fg.dc_accumulate
    monkeypatch.setattr(fg, "dc_accumulate", lambda *a, **k: calls.append(k["first"]) or real(*a, **k))
    g = torch.Generator().manual_seed(5)
    M, N, D, V = 70, 60, 24, 37
    e = torch.randn(M, D, generator=g).half()
    c = torch.randn(V, D, generator=g).half()
    b = (torch.randn(V, generator=g) * 0.5).half()
    w = torch.rand(V, generator=g) + 0.5
    rows = torch.randperm(M, generator=g)[:N]
    t = torch.randint(0, V, (N,), generator=g)
    a0, beta = torch.rand(N, generator=g) / N, torch.rand(N, generator=g) / N
    a1, gamma = torch.full((N,), 0.02 / N), torch.full((N,), 0.01 / N)
    need_de, need_dc, need_db = grads
    args = (rows, t, a0, a1, beta, gamma, 0.0, need_de, need_dc, need_db)
    budget = 5 * 2 * 48  # 5 rows of 48 padded fp16 classes: 12 chunks
    out = fg.linear_ce_fused(e, c, b, w, *args, budget, temperature=0.7)
    ref = fg.linear_ce_fused(e.float(), c.float(), b.float(), w, *args, 1 << 30, temperature=0.7)
    assert calls == ([True] + [False] * 11 if need_dc else [])
    for name in ("lse", "tgt", "ssum", "dE", "dC", "dbias"):
        x, y = getattr(out, name), getattr(ref, name)
        assert (x is None) == (y is None), name
        if x is not None:
            assert torch.isfinite(x).all() and rel_err(x.float(), y) <= 4e-3, name


@settings(SETTINGS, max_examples=examples(25, 5))
@given(
    N=st.integers(9, 48),
    V=st.integers(1, 70),
    D=st.integers(1, 40),
    chunks=st.integers(9, 14),
    gather=st.booleans(),
    opts=st.sampled_from(["plain", "smooth", "softcap", "masked"]),
    seed=st.integers(0, 2**16),
)
def test_fused_launcher_past_direct_chunks_property(N, V, D, chunks, gather, opts, seed):
    """Random shapes (V and D off the interpreter's tiles, a single class), more than
    FUSED_DIRECT_CHUNKS chunks, with or without a row gather, and option sets (label smoothing
    with class weights and z-loss; a softcap with a temperature; classes masked by a bias of
    -inf with z-loss): fp16 operands against the fp32 launcher in one chunk, within the fp16
    budget of test_fused_launcher_past_direct_chunks."""
    from cce.ops.linear_ce.kernels.fused_grads import linear_ce_fused

    g = torch.Generator().manual_seed(seed)
    M = N + 5 if gather else N
    e, c = torch.randn(M, D, generator=g).half(), torch.randn(V, D, generator=g).half()
    b = (torch.randn(V, generator=g) * 0.5).half()
    rows = torch.randperm(M, generator=g)[:N] if gather else None
    t = torch.randint(0, V, (N,), generator=g)
    a0, beta = torch.rand(N, generator=g) / N, torch.rand(N, generator=g) / N
    a0[0] = beta[0] = 0  # an ignored row
    w = gamma = a1 = None
    softcap, temperature = 0.0, 1.0
    if opts == "smooth":
        w, gamma, a1 = (
            torch.rand(V, generator=g) + 0.5,
            torch.full((N,), 0.01 / N),
            torch.full((N,), 0.02 / N),
        )
    elif opts == "softcap":
        softcap, temperature = 3.0, 0.7
    elif opts == "masked" and V > 1:
        b[: V // 2] = float("-inf")
        t = torch.randint(V // 2, V, (N,), generator=g)
        a1 = torch.full((N,), 0.02 / N)
    Vp = -(-V // 16) * 16
    budget = 2 * Vp * max(1, N // chunks)  # fp16 q rows per chunk: at least nine chunks
    assert -(-N // max(1, N // chunks)) > FUSED_DIRECT_CHUNKS
    args = (rows, t, a0, a1, beta, gamma, softcap, True, True, True)
    out = linear_ce_fused(e, c, b, w, *args, budget, temperature=temperature)
    ref = linear_ce_fused(e.float(), c.float(), b.float(), w, *args, 1 << 30, temperature=temperature)
    for name in ("lse", "dE", "dC", "dbias"):
        x, y = getattr(out, name), getattr(ref, name)
        assert torch.isfinite(x).all(), name
        assert rel_err(x.float(), y) <= 4e-3, (name, rel_err(x.float(), y))
