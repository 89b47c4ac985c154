"""The fused exact path (cce/ops/linear_ce/kernels/fused_grads.py): gradients formed in the
forward, against the float64 oracle under random upstream gradients, under the Triton
interpreter (fp32; bf16 arithmetic is wrong there, fp16 never takes this path).

Tolerances as in test_triton_linear.py: fp32 logits from K <= 96 products and fp32 sums over V,
so 1e-5 on the loss and 2e-5 relative L2 on the gradients.

Shapes: V off the 16-class padding (150: the buffer's pad columns are written 0), V
below the interpreter's 32-class row block, a single token; chunk budgets that give one chunk,
two balanced ones, and one row per chunk.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_linear import SETTINGS, build, check_against_oracle, problems

from cce import Tuning
from cce._dispatch import (
    FUSED_DIRECT_CHUNKS,
    fused_chunk_rows,
    fused_chunks,
    fused_dc16,
    fused_fits,
    fused_one_chunk,
    linear_backward,
    plan_triton,
)
from tests.helpers import (
    compare_with_reference,
    examples,
    make_linear_inputs,
    poisoned_allocations,
    rel_err,
    spread_logits_problem,
    triton_grads,
    tuned,
)

pytest.importorskip("triton")

TOL_LOSS, TOL_GRAD = 1e-5, 2e-5

OPTIONS = [
    {},
    {"bias": True},
    {"softcap": 2.5, "temperature": 0.7, "z_loss": 1e-2},
    {"label_smoothing": 0.1, "weight": True, "z_loss": 1e-2},
    {"reduction": "sum", "bias": True, "softcap": 4.0},
    {"shift": True, "weight": True},
    {"return_lse": True, "z_loss": 1e-3},
    {"ignore_index": 3},
]


def _inputs(lead, D, V, opts, seed):
    g = torch.Generator().manual_seed(seed)
    e, c, t, b = make_linear_inputs(
        lead, D, V, torch.float32, bias=opts.pop("bias", False), ignore_frac=0.15,
        ignore_index=opts.get("ignore_index", -100), scale=3.0, generator=g,
    )  # fmt: skip
    if opts.pop("weight", False):
        opts["weight"] = torch.rand(V, generator=g) + 0.5
    return e, c, t, b, opts


def _check(got, ref):
    (loss, lse, grads), (rloss, rlse, rgrads) = got, ref
    assert rel_err(loss, rloss) <= TOL_LOSS
    if rlse is not None:
        assert rel_err(lse, rlse) <= TOL_LOSS
    for g, r in zip(grads, rgrads, strict=True):
        assert g is not None and torch.isfinite(g).all()
        assert rel_err(g, r) <= TOL_GRAD, rel_err(g, r)


def _spy(monkeypatch):
    """Counts the fused launcher's calls (so a test cannot pass on another path)."""
    import cce.ops.linear_ce.triton_impl as ti

    calls = []
    real = ti.linear_ce_fused

    def spy(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(ti, "linear_ce_fused", spy)
    return calls


# Two chunks in the default tier (the first chunk writes dC, the second accumulates into it);
# one chunk in the thorough tier.
@pytest.mark.parametrize("chunks", [pytest.param(1, marks=pytest.mark.slow), 2])
@pytest.mark.parametrize("opts", OPTIONS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()) or "plain")
def test_fused_vs_oracle(opts, chunks, monkeypatch):
    opts = dict(opts)
    V, D = 150, 40
    e, c, t, b, opts = _inputs((4, 16), D, V, opts, seed=len(str(opts)))
    # Two chunks: a budget of 4 V D bytes holds 37 rows of 160 padded classes, so the 64 rows (60
    # with shift) come in two balanced chunks.
    budget = 1 << 30 if chunks == 1 else 4 * V * D
    calls = _spy(monkeypatch)
    fn = tuned(fused_chunk_bytes=budget)
    got, ref = compare_with_reference(
        lambda *a, **k: fn(*a, impl="triton", **k), e, c, t, b, seed=3, filter_eps=None, **opts
    )
    assert calls, "the fused path did not run"
    _check(got, ref)


@pytest.mark.parametrize("lead,D,V", [((1,), 24, 20), ((37,), 33, 16), ((5,), 8, 257)])
def test_fused_shapes(lead, D, V, monkeypatch):
    e, c, t, b, opts = _inputs(lead, D, V, {"bias": True}, seed=D + V)
    calls = _spy(monkeypatch)
    got, ref = compare_with_reference(
        lambda *a, **k: tuned(fused_chunk_bytes=4 * V * D)(*a, impl="triton", **k), e, c, t, b, seed=4,
        filter_eps=None, **opts,
    )  # fmt: skip
    assert calls
    _check(got, ref)


@pytest.mark.parametrize("V", [150, 257])
def test_fused_buffers_poisoned(V, monkeypatch):
    """Every buffer made during the step poisoned first (helpers.poisoned_allocations): the
    gradients still match the oracle (nothing reads what was not written), and the q / dZ chunk
    buffer's pad classes [V, Vp) hold 0 when each chunk's products run (the forward's q store and
    _dz_kernel mask at the padded row length, which keeps their accesses vectorized on a GPU at a
    V off 16, and write the pad); its first V columns are finite. Two chunks: the pad is
    rewritten for the second."""
    import cce.ops.linear_ce.kernels.fused_grads as fg
    from cce._dispatch import fused_padded_classes

    D = 24
    e, c, t, b, _ = _inputs((40,), D, V, {"bias": True}, seed=V)
    calls = _spy(monkeypatch)
    bufs = []
    products = fg._chunk_products

    def spy(b, ec, c, rows, safe_t, s, t, last):
        bufs.append(b.qbuf[: t - s].clone())  # the chunk's dZ, its pad classes included
        return products(b, ec, c, rows, safe_t, s, t, last)

    monkeypatch.setattr(fg, "_chunk_products", spy)
    fn = tuned(fused_chunk_bytes=4 * 25 * fused_padded_classes(V))
    with poisoned_allocations():
        got, ref = compare_with_reference(
            lambda *a, **k: fn(*a, impl="triton", **k), e, c, t, b, seed=5, filter_eps=None
        )
    assert calls
    _check(got, ref)
    assert len(bufs) == 2  # two chunks of 20 rows
    for q in bufs:
        assert q.shape == (20, fused_padded_classes(V)) and q.shape[1] > V
        assert (q[:, V:] == 0).all() and torch.isfinite(q[:, :V]).all()


def test_fused_one_row_chunks():
    """The launcher with one row per chunk (dC accumulated in fp32 over 20 chunks) against one
    chunk (two token blocks, the last partial): the same up to fp32 summation order; with
    smoothing, and with a softcap (which the launcher refuses together with smoothing)."""
    from cce.ops.linear_ce.kernels.fused_grads import linear_ce_fused

    e, c, t, b, _ = _inputs((20,), 24, 70, {"bias": True}, seed=9)
    e, c, b = e.detach(), c.detach(), b.detach()
    t = t.clamp(min=0)
    n = t.numel()
    a0, beta = torch.rand(n) / n, torch.rand(n) / n
    gamma, a1 = torch.full((n,), 0.01 / n), torch.full((n,), 0.02 / n)
    outs = [
        linear_ce_fused(e, c, b, None, None, t, a0, a1, beta, gam, cap, True, True, True, budget)
        for gam, cap in ((gamma, 0.0), (None, 3.0))
        for budget in (1, 1 << 30)
    ]
    outs = [outs[:2], outs[2:]]
    for one, whole in outs:
        for x, y in zip(one, whole, strict=True):
            assert (x is None and y is None) or rel_err(x, y) <= 1e-6  # (no entropy or argmax asked)
    with pytest.raises(ValueError, match="smoothing with a softcap"):
        linear_ce_fused(e, c, b, None, None, t, a0, a1, beta, gamma, 3.0, True, True, True, 1)


@pytest.mark.parametrize("which", ["e", "c", "bias"])
def test_fused_partial_requires_grad(which, monkeypatch):
    """Only the gradients asked for are formed (the others come back None)."""
    e, c, t, b, _ = _inputs((30,), 40, 100, {"bias": True}, seed=6)
    for name, x in (("e", e), ("c", c), ("bias", b)):
        x.requires_grad_(name == which)
    calls = _spy(monkeypatch)
    loss = tuned()(e, c, t, b, impl="triton", filter_eps=None)
    (g,) = torch.autograd.grad(loss * 0.75, [dict(e=e, c=c, bias=b)[which]])
    ref_loss = tuned(fused=False)(e, c, t, b, impl="triton", filter_eps=None)
    (r,) = torch.autograd.grad(ref_loss * 0.75, [dict(e=e, c=c, bias=b)[which]])
    assert calls and rel_err(g, r) <= TOL_GRAD


def test_fused_all_ignored():
    e, c, t, b, _ = _inputs((20,), 40, 70, {"bias": True}, seed=5)
    t = torch.full_like(t, -100)
    loss = tuned()(e, c, t, b, impl="triton", filter_eps=None)
    assert loss == 0
    loss.backward()
    for x in (e, c, b):
        assert x.grad is not None and (x.grad == 0).all()


def test_fused_backward_twice():
    """retain_graph: the first backward scales the forward's gradients in place, the second
    (they are spent) takes the exact backward; both give the oracle's gradients."""
    e, c, t, b, _ = _inputs((20,), 40, 70, {"weight": True}, seed=8)
    loss = tuned()(e, c, t, impl="triton", filter_eps=None)
    g1 = torch.autograd.grad(0.5 * loss, (e, c), retain_graph=True)
    g2 = torch.autograd.grad(2.0 * loss, (e, c))
    ref = tuned(fused=False)(e, c, t, impl="triton", filter_eps=None)
    r = torch.autograd.grad(ref, (e, c))
    for a, b2, rr in zip(g1, g2, r, strict=True):
        assert rel_err(2.0 * a, rr) <= TOL_GRAD and rel_err(0.5 * b2, rr) <= TOL_GRAD


def test_fused_dispatch():
    """Where the fused path runs: scalar upstream gradients, bf16 / fp32, at any shape (as in
    _dispatch's cost note), and memory bounded by the chunk budget."""
    T = Tuning()
    bf16, f16, f32 = torch.bfloat16, torch.float16, torch.float32
    assert fused_fits(T, "mean", bf16, True)
    assert fused_fits(T, "sum", f32, True)
    assert not fused_fits(T, "none", bf16, True)
    assert not fused_fits(T, "mean", f16, True)
    assert not fused_fits(T, "mean", bf16, False)
    assert not fused_fits(Tuning(fused=False), "mean", bf16, True)
    assert fused_fits(T, "mean", bf16, True, 30.0, 0.0)
    assert fused_fits(T, "mean", bf16, True, 0.0, 0.1)
    assert not fused_fits(T, "mean", bf16, True, 30.0, 0.1)
    # Any shape: D and the number of logits do not enter (three passes were the faster ones
    # down to D = 768), nor the chunks (below).
    for D in (1, 768, 896, 4096):
        plan = plan_triton(T, "mean", bf16, (1 << 16, 50257, D), (True, True, False), 0.0, 0.0, 0.0, True)
        assert plan.backward == "fused", plan
    # Any number of chunks (memory is one chunk: 16 rows of 16000 fp32 logits per MiB); past
    # FUSED_DIRECT_CHUNKS chunks dC sums them in scaled fp16 with 16-bit operands, in itself with fp32.
    MiB = 1 << 20
    Tb = Tuning(fused_chunk_bytes=MiB)
    assert fused_chunks(16, 16000, MiB) == 1 and fused_chunks(17, 16000, MiB) == 2
    assert fused_chunks(16 * FUSED_DIRECT_CHUNKS, 16000, MiB) == FUSED_DIRECT_CHUNKS
    assert fused_chunks(1 << 16, 16000, MiB, 2) == 2048
    for dt in (f32, bf16):
        assert fused_fits(Tb, "mean", dt, True)
    assert not fused_dc16(FUSED_DIRECT_CHUNKS, bf16) and fused_dc16(FUSED_DIRECT_CHUNKS + 1, bf16)
    assert not fused_dc16(FUSED_DIRECT_CHUNKS + 1, f32)

    # cce.explain names the scaled-fp16 sum where it runs (dC asked for, 16-bit, past the limit).
    def says_fp16(N, dtype, need_dc=True):
        plan = plan_triton(Tb, "mean", dtype, (N, 16000, 1024), (True, need_dc, False), 0.0, 0.0, 0.0, True)
        assert plan.backward == "fused"
        return any("scaled fp16" in r for r in plan.reasons)

    limit = 32 * FUSED_DIRECT_CHUNKS  # rows of bf16 q in the limit's chunks
    assert not says_fp16(limit, bf16) and says_fp16(limit + 1, bf16)
    assert not says_fp16(limit + 1, bf16, need_dc=False) and not says_fp16(1 << 12, f32)
    # Balanced chunks: 33 rows at 16 per chunk are 3 chunks of 11; q in bf16 holds twice the rows.
    assert fused_chunk_rows(33, 16000, 1 << 20) == 11
    assert fused_chunk_rows(33, 16000, 1 << 20, 2) == 17 and fused_chunks(33, 16000, MiB, 2) == 2
    # The backward choice: "fused" wherever "exact" would be.
    args = (True, True, False, 0.0, 0.0)
    assert linear_backward(T, 0.0, *args, 1e20, True, True) == "fused"
    assert linear_backward(T, 1 / 256, *args, 1e6, True, True) == "fused"
    assert linear_backward(T, 1 / 256, *args, 1e20, True, True) == "sparse"
    assert linear_backward(T, 0.0, *args, 1e6, True, False) == "exact"
    # One chunk: the fused path also serves filtered calls of any size (CUDA, calibrated rule).
    assert linear_backward(T, 1 / 256, *args, 1e20, True, True, True) == "fused"
    assert linear_backward(T, 1 / 256, *args, 1e20, False, True, True) == "sparse"
    assert linear_backward(Tuning(sparse_min_flops=3e12), 1 / 256, *args, 1e20, True, True, True) == "sparse"
    assert linear_backward(Tuning(backward="sparse"), 1 / 256, *args, 1e20, True, True, True) == "sparse"
    assert fused_one_chunk(T, 2048, 128256, 2) and not fused_one_chunk(T, 8192, 128256, 2)


@settings(SETTINGS, max_examples=examples(60, 30))
@given(
    N=st.integers(1, 1 << 17),
    V=st.integers(1, 300000),
    D=st.integers(1, 16384),
    itemsize=st.sampled_from([2, 4]),
    grads=st.tuples(st.booleans(), st.booleans(), st.booleans()).filter(any),
)
def test_fused_chunk_memory_target(N, V, D, itemsize, grads):
    """The chunk sized to the memory target (Tuning.fused_chunk_bytes None) keeps the fused
    step's memory beyond its gradients within 5% of them plus 256 MB by its own accounting (per
    chunk row: q, fp32 dE, the gathered row of e, the running maxima; a margin and bytes per
    problem row), with the most rows that do (or one), at most FUSED_MAX_CHUNK_BYTES of q; a set
    size is taken as it is."""
    from cce._dispatch import (
        FUSED_MAX_CHUNK_BYTES,
        FUSED_MEMORY_MARGIN,
        FUSED_ROW_BYTES,
        fused_chunk_bytes,
        fused_padded_classes,
    )

    need_de, need_dc, need_db = grads
    size = fused_chunk_bytes(Tuning(fused_chunk_bytes=None), (N, V, D), itemsize, grads)
    q_row = itemsize * fused_padded_classes(V)
    assert size % q_row == 0 or size == FUSED_MAX_CHUNK_BYTES
    assert q_row <= size <= max(q_row, FUSED_MAX_CHUNK_BYTES) or size == FUSED_MAX_CHUNK_BYTES
    most = size // q_row  # rows of a chunk at most (balanced chunks may hold fewer)
    assert fused_chunk_rows(N, V, size, itemsize) <= most
    per_row = q_row + (4 * need_de + itemsize) * D + 4 * -(-V // 128)
    gradients = itemsize * D * (N * need_de + V * need_dc) + 4 * V * need_db
    fixed = FUSED_MEMORY_MARGIN + FUSED_ROW_BYTES * N
    allowed = 0.05 * gradients + 256e6
    if most > 1:
        assert most * per_row + fixed <= allowed
    if size <= FUSED_MAX_CHUNK_BYTES - q_row:  # the budget, not the cap, bounds it
        assert (most + 1) * per_row + fixed > allowed
    assert fused_chunk_bytes(Tuning(fused_chunk_bytes=12345), (N, V, D), itemsize, grads) == 12345


@settings(SETTINGS, max_examples=examples(60, 30))
@given(rows=st.integers(1, 70000), n_vtiles=st.integers(1, 5000))
def test_dz_split_tiles_cover_each_row_once(rows, n_vtiles):
    """_dz_kernel's programs (r, s) take tiles [s tiles, (s + 1) tiles) of row r: every tile of
    a row in exactly one program, none empty, and a row split into more parts where the chunk
    has fewer rows than DZ_PROGRAMS (so that enough programs are in flight)."""
    from cce.ops.linear_ce.kernels import fused_grads as fg

    with mock.patch.object(fg, "interpreting", return_value=False):
        tiles = fg.dz_split_tiles(rows, n_vtiles)
    splits = -(-n_vtiles // tiles)
    assert 1 <= tiles <= n_vtiles
    assert (splits - 1) * tiles < n_vtiles <= splits * tiles
    assert splits == 1 or rows * (splits - 1) < fg.DZ_PROGRAMS
    assert rows * splits >= min(fg.DZ_PROGRAMS, rows * n_vtiles) / 2


def test_fused_dispatch_small_vocabulary():
    """A filtered call over fewer classes than Tuning.sparse_min_classes (None: the CUDA
    calibration on CUDA tensors, 0 elsewhere) takes the fused path where it fits, at any size;
    only with backward="auto" and the calibrated size rule (sparse_min_flops None)."""
    from cce.options import SPARSE_MIN_CLASSES_CUDA

    T = Tuning()
    args = (1 / 256, True, True, False, 0.0, 0.0, 1e20)
    small, big = SPARSE_MIN_CLASSES_CUDA - 1, SPARSE_MIN_CLASSES_CUDA
    assert linear_backward(T, *args, True, True, classes=small) == "fused"
    assert linear_backward(T, *args, True, True, classes=big) == "sparse"
    assert linear_backward(T, *args, True, True) == "sparse"  # no classes given: no rule
    assert linear_backward(T, *args, True, False, classes=small) == "sparse"  # fused does not fit
    assert linear_backward(T, *args, False, True, classes=small) == "sparse"  # not CUDA: 0 classes
    assert linear_backward(Tuning(sparse_min_classes=0), *args, True, True, classes=small) == "sparse"
    assert linear_backward(Tuning(sparse_min_classes=big + 1), *args, False, True, classes=big) == "fused"
    assert linear_backward(Tuning(sparse_min_flops=3e12), *args, True, True, classes=small) == "sparse"
    assert linear_backward(Tuning(backward="sparse"), *args, True, True, classes=small) == "sparse"
    # Not filtered, or needing a path the fused one does not replace: unchanged.
    assert linear_backward(T, 0.0, *args[1:], True, True, classes=small) == "fused"
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="sparse_min_classes"):
            Tuning(sparse_min_classes=bad)


@pytest.mark.slow  # the rule itself: test_fused_dispatch_small_vocabulary
def test_fused_small_vocabulary_end_to_end():
    """The launcher passes V to the rule: with sparse_min_classes above V a heavily filtered call
    (filter_eps 0.25, random logits: nearly every tile skipped) gives the fused path's exact
    gradients, bit for bit those of filter_eps=None; at sparse_min_classes = V the filter acts."""
    e, c, t = spread_logits_problem(3)
    V = c.shape[0]
    exact = triton_grads(tuned(), e, c, t, filter_eps=None)
    below = triton_grads(tuned(sparse_min_classes=V + 1), e, c, t, filter_eps=0.25)
    at = triton_grads(tuned(sparse_min_classes=V, dense_slabs=False), e, c, t, filter_eps=0.25)
    assert torch.equal(below[0], exact[0]) and torch.equal(below[1], exact[1])
    assert rel_err(at[0], exact[0]) > 1e-3


@pytest.mark.parametrize("V", [70, 5])
def test_fused_half_operands_rows(V):
    """16-bit operands (fp16: the interpreter's bf16 is wrong): dE is finished in one pass (the
    target entries' rounding remainders and, at a V off a multiple of 8, the classes past the
    products' last multiple of 8 added in fp32, one rounding; V = 5: all of them) and scattered
    to the e2d rows read (``rows``; the rows not read stay 0), in two chunks with dC accumulated
    in fp16 over its padded classes, against the same launcher on the fp32 copies of the same
    values (dE's products over every class). Tolerance: dZ and the gradients rounded to fp16
    (unit roundoff 2^-11), sums over at most 70 classes / 30 rows: 5e-3 relative."""
    from cce._dispatch import fused_padded_classes
    from cce.ops.linear_ce.kernels.fused_grads import linear_ce_fused

    g = torch.Generator().manual_seed(21)
    M, n, D = 40, 30, 24
    e = (torch.randn(M, D, generator=g) * 0.5).half()
    c = (torch.randn(V, D, generator=g) * 0.5).half()
    b = (torch.randn(V, generator=g) * 0.5).half()
    rows = torch.randperm(M, generator=g)[:n]
    t = torch.randint(0, V, (n,), generator=g)
    a0 = beta = torch.full((n,), 1.0 / n)
    rows_per_chunk = 15  # two chunks
    outs = [
        linear_ce_fused(x_e, x_c, x_b, None, rows, t, a0, None, beta, None, 0.0, True, True, True, budget)
        for x_e, x_c, x_b in ((e, c, b), (e.float(), c.float(), b.float()))
        for budget in (x_e.element_size() * fused_padded_classes(V) * rows_per_chunk,)
    ]
    (lse16, _, _, dE16, dC16, db16, *_), (lse32, _, _, dE32, dC32, db32, *_) = outs
    assert dE16.dtype == dC16.dtype == torch.float16 and dE16.shape == (M, D) and dC16.shape == (V, D)
    unread = torch.ones(M, dtype=torch.bool)
    unread[rows] = False
    assert (dE16[unread] == 0).all() and (dE32[unread] == 0).all()
    assert rel_err(lse16, lse32) <= 1e-6
    for x, y in ((dE16, dE32), (dC16, dC32), (db16, db32)):
        assert rel_err(x.float(), y) <= 5e-3


@settings(SETTINGS, max_examples=examples(25, 6))
@given(p=problems(dtypes=(torch.float32,)), rows=st.sampled_from([None, 1, 5]))
def test_fused_property_vs_oracle(p, rows):
    """Random small problems (shapes, every option, ignored rows, partial requires_grad) with a
    scalar loss, in one chunk or in chunks of few rows, within test_linear.py's oracle bounds."""
    import cce.ops.linear_ce.triton_impl as ti

    opts = dict(p["opts"], filter_eps=None, impl="triton")
    if opts["reduction"] == "none":
        opts["reduction"] = "mean"
    e, c, t, b, w = build(p)
    V = p["V"]
    # fp32 operands: dC accumulates in itself over any number of chunks.
    budget = 1 << 30 if rows is None else rows * 4 * (-(-V // 16) * 16)
    with mock.patch.object(ti, "linear_ce_fused", wraps=ti.linear_ce_fused) as spy:
        check_against_oracle(e, c, t, b, weight=w, seed=p["seed"], fn=tuned(fused_chunk_bytes=budget), **opts)
    # (softcap with label smoothing takes the exact backward: cce._dispatch.fused_fits)
    assert spy.called == (not ((opts["softcap"] or 0) > 0 and opts["label_smoothing"] > 0))
