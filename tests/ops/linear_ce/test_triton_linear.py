"""impl="triton" kernels against the oracle, under the Triton interpreter on CPU (or on a GPU).

Shapes are small (interpreter speed) but chosen so that every edge shows: V and D not multiples
of the blocks (interpreter blocks: BLOCK_N=16, BLOCK_V=32, BLOCK_D=32), V below one block, several
D chunks, one token, all tokens ignored, several vocabulary splits in the forward. fp32 and fp16
only: bf16 dot / arithmetic is wrong in the interpreter.

Tolerances. The oracle is float64 on the same (rounded) inputs. fp32: the kernels accumulate in
fp32 (K <= 96 products per logit), so logits, lse and gradients carry ~1e-7 relative error;
2e-5 leaves room for the sums over V and the accumulation of dC over tokens. fp16: the softmax
gradient tile is rounded to fp16 (2^-11 relative) before the gradient matmuls and the gradients
are returned in fp16 (2^-11), so 4e-3 relative L2; the loss is fp32-accumulated: 1e-5.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cce
from bench.data import zipf_inputs
from cce import linear_cross_entropy
from tests.helpers import (
    compare_with_reference,
    examples,
    loss_and_grads,
    make_linear_inputs,
    poisoned_allocations,
    rel_err,
    skip_rate,
    spread_logits_problem,
    triton_grads,
    tuned,
)

triton = pytest.importorskip("triton")

TOL = {torch.float32: (1e-5, 2e-5), torch.float16: (1e-5, 4e-3)}  # (loss/lse, grads)


def _triton(*a, **k):
    return linear_cross_entropy(*a, impl="triton", **k)


def _check(got, ref, dtype):
    tl, tg = TOL[dtype]
    (loss, lse, grads), (rloss, rlse, rgrads) = got, ref
    assert loss.dtype == torch.float32 and loss.shape == rloss.shape
    assert torch.isfinite(loss).all()
    assert rel_err(loss, rloss) <= tl, rel_err(loss, rloss)
    if rlse is not None:
        assert rel_err(lse, rlse) <= tl
    assert len(grads) == len(rgrads)
    for g, r in zip(grads, rgrads, strict=True):
        if r is None:
            assert g is None or (g == 0).all()
            continue
        assert g is not None and torch.isfinite(g).all()
        assert rel_err(g, r) <= tg, rel_err(g, r)


OPTIONS = [
    {},
    {"bias": True},
    {"softcap": 2.5},
    {"bias": True, "softcap": 4.0},
    {"label_smoothing": 0.1},
    {"label_smoothing": 0.2, "softcap": 3.0},
    {"label_smoothing": 0.1, "weight": True},
    {"weight": True, "reduction": "mean"},
    {"z_loss": 1e-2},
    {"return_lse": True},
    {"return_lse": True, "reduction": "none", "z_loss": 1e-3},
    {"reduction": "sum"},
    {"reduction": "none"},
    {"shift": True},
    {"shift": True, "bias": True, "label_smoothing": 0.05, "softcap": 5.0, "weight": True},
    {"ignore_index": 3},
]


def _inputs(lead, D, V, dtype, opts, seed, ignore_frac=0.15, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    ii = opts.get("ignore_index", -100)
    e, c, t, b = make_linear_inputs(
        lead, D, V, dtype, bias=opts.pop("bias", False), ignore_frac=ignore_frac, ignore_index=ii,
        scale=scale, generator=g,
    )  # fmt: skip
    if opts.pop("weight", False):
        opts["weight"] = (torch.rand(V, generator=g) + 0.5).to(dtype)
    return e, c, t, b, opts


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("opts", OPTIONS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()) or "plain")
def test_options_vs_oracle(opts, dtype):
    opts = dict(opts)
    e, c, t, b, opts = _inputs((2, 23), 70, 150, dtype, opts, seed=len(str(opts)))
    got, ref = compare_with_reference(_triton, e, c, t, b, seed=1, filter_eps=None, **opts)
    _check(got, ref, dtype)


# (lead shape, D, V): V and D off the block grid, V < BLOCK_V, several D chunks, a single token,
# and V on the block grid (512: whole vocabulary tiles for the interpreter's and the GPU's
# BLOCK_V, the forward then compiles without its column mask).
SHAPES = [((1,), 40, 50), ((37,), 96, 300), ((64,), 33, 20), ((3, 7), 17, 129), ((24,), 40, 512)]


@pytest.mark.parametrize("lead,D,V", SHAPES)
def test_shapes(lead, D, V):
    e, c, t, b, opts = _inputs(lead, D, V, torch.float32, {"bias": True}, seed=D + V, ignore_frac=0.1)
    got, ref = compare_with_reference(_triton, e, c, t, b, seed=2, filter_eps=None, **opts)
    _check(got, ref, torch.float32)


@pytest.mark.parametrize("grads", ["ecb", "e", "c"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_exact_path_row_blocks_and_slabs(dtype, grads, monkeypatch):
    """The exact backward walks the sorted rows in blocks and the vocabulary in dZ slabs within
    Tuning.dz_slab_bytes; a budget of two tiles' slab at the smallest block forces three blocks
    of 40 rows (the last partial; the sorted rows' ignored tail in the later blocks, whose dZ rows
    past the valid ones must not keep the previous block's) and three slabs (the last partial),
    with every option the
    pointer kernel takes. (fp32 "mean" would take the fused path: turned off here.)"""
    import cce.ops.linear_ce.kernels.backward_exact as bx
    from cce.ops.linear_ce.kernels.common import config

    cfg = config(dtype, "bwd")
    N, V = 40, 5 * cfg.BLOCK_V - 10
    fn = tuned(dz_slab_bytes=2 * cfg.BLOCK_N * cfg.BLOCK_V * dtype.itemsize, fused=False)
    opts = {"bias": True, "softcap": 3.0, "label_smoothing": 0.1, "weight": True, "return_lse": True}
    e, c, t, b, opts = _inputs((N,), 50, V, dtype, opts, seed=12)
    for name, x in (("e", e), ("c", c), ("b", b)):
        x.requires_grad_(name in grads)
    assert cfg.BLOCK_N < int((t != -100).sum()) < N  # blocks past the first with rows past the valid
    calls = []
    block = bx._exact_block
    monkeypatch.setattr(bx, "_exact_block", lambda *a: calls.append(a[6].shape) or block(*a))
    got, ref = compare_with_reference(
        lambda *a, **k: fn(*a, impl="triton", **k), e, c, t, b, seed=5, filter_eps=None, **opts
    )
    _check(got, ref, dtype)
    assert [s[0] for s in calls] == [cfg.BLOCK_N, cfg.BLOCK_N, N - 2 * cfg.BLOCK_N]
    assert all(s[1] == 2 * cfg.BLOCK_V for s in calls)  # two tiles per slab: three slabs


@given(
    N=st.integers(1, 1 << 17),
    D=st.integers(1, 8192),
    e_bytes=st.sampled_from([2, 4]),
    need=st.sampled_from([(True, True), (True, False), (False, True)]),
    budget=st.integers(1, 1 << 30),
    BLOCK_N=st.sampled_from([16, 64, 128]),
)
@settings(max_examples=examples(400, 100), deadline=None)
def test_exact_block_rows(N, D, e_bytes, need, budget, BLOCK_N):
    """exact_block_rows: whole token blocks that cover the rows in as few blocks as the budget
    allows (at most EXACT_MAX_ROW_BLOCKS with a 16-bit dC), fitting it unless one token block
    alone does not or the cap makes them larger."""
    from cce.ops.linear_ce.kernels.backward_exact import EXACT_MAX_ROW_BLOCKS, exact_block_rows

    need_de, e_rows = need
    dc_16bit = e_rows and e_bytes == 2
    R = exact_block_rows(N, D, e_bytes, need_de, e_rows, dc_16bit, budget, BLOCK_N)
    k = -(-N // R)
    per_row = D * (4 * need_de + e_bytes * e_rows)
    fit = max(BLOCK_N, budget // per_row // BLOCK_N * BLOCK_N)  # the most rows the budget holds
    capped = dc_16bit and -(-N // fit) > EXACT_MAX_ROW_BLOCKS
    assert R % BLOCK_N == 0 and R >= BLOCK_N
    assert R - BLOCK_N < -(-N // k)  # balanced: no block is a token block larger than needed
    if capped:
        assert k <= EXACT_MAX_ROW_BLOCKS
    else:  # as few blocks as the budget allows, each within it unless one token block is not
        assert k == -(-N // fit)
        assert R * per_row <= budget or R == BLOCK_N


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_sparse_backward_with_tiny_threshold(dtype):
    """The sparse backward (Tuning.backward="sparse") with every option it serves and eps tiny, so
    that nothing is skipped and the oracle's tolerance applies (the skip branch is checked
    against its bound in test_triton_sparse.py)."""
    opts = {"label_smoothing": 0.1, "weight": True, "z_loss": 1e-3, "temperature": 0.7}
    e, c, t, b, opts = _inputs((40,), 50, 150, dtype, opts, seed=13)
    fn = tuned(backward="sparse")
    got, ref = compare_with_reference(
        lambda *a, **k: fn(*a, impl="triton", **k), e, c, t, b, seed=6, filter_eps=1e-12, **opts
    )
    _check(got, ref, dtype)


@pytest.mark.parametrize(
    "opts,tuning",
    [
        ({"bias": True}, {}),
        ({"softcap": 3.0, "label_smoothing": 0.1}, {}),
        ({}, {"backward": "auto"}),
        ({"bias": True}, {"backward": "sparse", "fused": False}),
    ],
    ids=["bias", "softcap-smoothing", "tiny-eps", "bias-sparse-unfused"],
)
def test_filtered_calls_the_sparse_backward_does_not_serve_are_exact(opts, tuning):
    """A filtered call the sparse backward does not serve (a bias gradient, softcap with label
    smoothing, or with backward="auto" a threshold below 2^-10) takes the exact path: the plan
    says so, and the loss and gradients are bit for bit those of filter_eps=None."""
    from cce._dispatch import SPARSE_MIN_EPS

    eps = 2e-3 if opts else SPARSE_MIN_EPS / 4
    e, c, t, b, opts = _inputs((33,), 24, 257, torch.float32, dict(opts), seed=14)
    fn = tuned(**tuning)
    plan = cce.explain(e, c, t, b, impl="triton", tuning=cce.Tuning(**tuning), filter_eps=eps, **opts)
    assert plan.backward in ("exact", "fused") and plan.filter_eps == 0, str(plan)
    assert "does not serve" in str(plan)

    def run(feps):
        return loss_and_grads(
            lambda *a, **k: fn(*a, impl="triton", **k), e, c, t, b,
            generator=torch.Generator().manual_seed(3), filter_eps=feps, **opts,
        )  # fmt: skip

    (loss, _, grads), (loss0, _, grads0) = run(eps), run(None)
    assert torch.equal(loss, loss0) and len(grads) == len(grads0) == 2 + (b is not None)
    for x, y in zip(grads, grads0, strict=True):
        assert torch.equal(x, y)


@pytest.mark.parametrize("fused", [True, False])
def test_shift_over_two_position_sequences(fused):
    """shift=True over sequences of two positions: the problem rows (each sequence's first) are a
    stride-2 index view of the flattened rows, which every launcher must read as such (the fused
    path once read rows 0, 1 instead of 0, 2)."""
    e, c, t, b, opts = _inputs((3, 2), 8, 40, torch.float32, {"shift": True}, seed=21, ignore_frac=0.0)
    fn = tuned(fused=fused)
    got, ref = compare_with_reference(
        lambda *a, **k: fn(*a, impl="triton", **k), e, c, t, b, seed=7, filter_eps=None, **opts
    )
    _check(got, ref, torch.float32)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_all_ignored(reduction):
    e, c, t, b, _ = _inputs((20,), 40, 70, torch.float32, {"bias": True}, seed=5)
    t = torch.full_like(t, -100)
    loss = _triton(e, c, t, b, reduction=reduction)
    assert (loss == 0).all()
    loss.sum().backward()
    for x in (e, c, b):
        assert x.grad is not None and (x.grad == 0).all()


@pytest.mark.parametrize("which", ["e", "c", "bias"])
def test_partial_requires_grad(which):
    """c frozen (LoRA), e frozen, or only the bias trained: the others get no gradient."""
    e, c, t, b, _ = _inputs((30,), 40, 100, torch.float32, {"bias": True}, seed=6)
    for name, x in (("e", e), ("c", c), ("bias", b)):
        x.requires_grad_(name == which)
    got, ref = compare_with_reference(_triton, e, c, t, b, seed=3, filter_eps=None)
    _check(got, ref, torch.float32)


def test_no_grad_forward():
    e, c, t, b, _ = _inputs((30,), 40, 100, torch.float32, {}, seed=7)
    with torch.no_grad():
        loss = _triton(e, c, t)
    ref = linear_cross_entropy(e.detach(), c.detach(), t, impl="torch")
    assert rel_err(loss, ref) <= 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_default_filter_close_to_exact(dtype):
    """filter_eps="auto" on LM-like data stays within the exact path's tolerance."""
    e, c, t = zipf_inputs(48, 64, 400, dtype=dtype, seed=8)
    e.requires_grad_()
    c.requires_grad_()
    got, ref = compare_with_reference(_triton, e, c, t, None, seed=4)
    _check(got, ref, dtype)


@pytest.mark.parametrize("sorted_", [False, True])
def test_tile_means(sorted_):
    """Per-tile means of c in walking order (gathered through the order; a partial last tile;
    D not a multiple of the kernel's D chunk)."""
    from cce.ops.linear_ce.kernels.tile_stats import tile_means

    V, D, BV = 150, 7, 32
    c = torch.randn(V, D)
    perm = torch.randperm(V) if sorted_ else None
    got = tile_means(c, perm if sorted_ else torch.arange(V), BV, torch.float32)
    cs = c if perm is None else c[perm]
    ref = torch.stack([cs[s : s + BV].mean(0) for s in range(0, V, BV)])
    assert torch.allclose(got, ref, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tiles", [(0, 5), (1, 3), (3, 5)])
def test_gather_tile_means(tiles, dtype):
    """gather_tile_means: the rows of a range of tiles of the order copied as index_select copies
    them (bit for bit), the rest of the buffer untouched (NaN-poisoned), and those tiles' means as
    tile_means gives them; the last tile partial, D not a multiple of the kernel's D chunk."""
    from cce.ops.linear_ce.kernels.tile_stats import gather_tile_means, tile_means

    V, D, BV = 150, 37, 32
    g = torch.Generator().manual_seed(tiles[0] * 7 + tiles[1])
    c = torch.randn(V, D, generator=g).to(dtype)
    perm = torch.randperm(V, generator=g)
    lo, hi = tiles
    v0, v1 = lo * BV, min(hi * BV, V)
    out = torch.full((5 * BV + 9, D), float("nan"), dtype=dtype)
    cm = torch.full((-(-V // BV), D), float("nan"))
    gather_tile_means(c, perm, lo, hi, BV, out, cm)
    assert torch.equal(out[: v1 - v0], c.index_select(0, perm[v0:v1]))
    assert out[v1 - v0 :].isnan().all()
    assert torch.equal(cm[lo:hi], tile_means(c, perm, BV, torch.float32)[lo:hi])
    assert cm[:lo].isnan().all() and cm[hi:].isnan().all()


def test_vocab_sorting_clusters_skippable_tiles():
    """Walking the vocabulary by mean logit skips far more tiles than id order on zipf data."""
    e, c, t = zipf_inputs(64, 48, 800, dtype=torch.float32, seed=9)
    assert skip_rate(e, c, t, 2e-3, True) > skip_rate(e, c, t, 2e-3, False) + 0.2


def test_compile_fullgraph_eager_backend():
    """The custom ops trace under torch.compile(fullgraph=True) (fake-tensor registrations)."""
    e, c, t, b, _ = _inputs((16,), 40, 70, torch.float32, {"bias": True}, seed=10)
    f = torch.compile(lambda e, c, t, b: _triton(e, c, t, b, softcap=3.0), fullgraph=True, backend="eager")
    loss = f(e, c, t, b)
    ref = linear_cross_entropy(e, c, t, b, softcap=3.0, impl="torch")
    assert rel_err(loss, ref) <= 1e-5
    loss.backward()
    assert e.grad is not None and c.grad is not None and b.grad is not None


def test_cpu_tensors_rejected_outside_interpreter(monkeypatch):
    from cce.ops.linear_ce.kernels.forward import linear_ce_forward

    monkeypatch.setenv("TRITON_INTERPRET", "0")  # read at each launch (cce._dispatch.interpreting)
    e, c, t, _, _ = _inputs((8,), 16, 20, torch.float32, {}, seed=11)
    rows = torch.arange(8)
    with pytest.raises(ValueError, match="CUDA"):
        linear_ce_forward(e, c, None, None, rows, t, torch.tensor([8], dtype=torch.int32), 0.0, False)


def test_exact_below_sparse_min_flops():
    """Tuning.sparse_min_flops: a filtered call whose 2 N V D is below it runs the exact backward
    (the same gradients, bit for bit, as filter_eps=None); at 0 the filter acts (random logits
    of std 1.5: every tile skipped, the rank-1 corrections' error, far above fp32 rounding)
    unless the dense slabs (on by default) take the tiles whose corrections err: then the error
    is within the 5e-3 target (the rule aims at slab_error = 2.5e-3 on sampled rows)."""
    e, c, t = spread_logits_problem(2)
    (N, D), V = e.shape, c.shape[0]

    def grads(fn, **kw):
        return triton_grads(fn, e, c, t, **kw)

    exact = grads(tuned(), filter_eps=None)
    big = grads(tuned(sparse_min_flops=2.0 * N * V * D + 1), filter_eps=0.25)
    small = grads(tuned(sparse_min_flops=2.0 * N * V * D, dense_slabs=False), filter_eps=0.25)
    dense = grads(tuned(sparse_min_flops=2.0 * N * V * D), filter_eps=0.25)
    assert torch.equal(big[0], exact[0]) and torch.equal(big[1], exact[1])
    assert rel_err(small[0], exact[0]) > 1e-3
    assert rel_err(dense[0], exact[0]) < 5e-3 and rel_err(dense[1], exact[1]) < 5e-3


def test_dispatch_by_size():
    """_dispatch.linear_backward: the size rule applies to backward="auto" only, with None read as
    the CUDA calibration on CUDA tensors and as 0 elsewhere."""
    from cce import Tuning
    from cce._dispatch import linear_backward
    from cce.options import SPARSE_MIN_FLOPS_CUDA

    args = (1 / 256, True, True, False, 0.0, 0.0)
    small = SPARSE_MIN_FLOPS_CUDA / 2
    assert linear_backward(Tuning(), *args, small, True) == "exact"
    assert linear_backward(Tuning(), *args, small, False) == "sparse"
    assert linear_backward(Tuning(), *args, 2 * SPARSE_MIN_FLOPS_CUDA, True) == "sparse"
    assert linear_backward(Tuning(backward="sparse"), *args, small, True) == "sparse"
    assert linear_backward(Tuning(sparse_min_flops=0), *args, small, True) == "sparse"
    assert linear_backward(Tuning(sparse_min_flops=1e30), *args, 1e20, False) == "exact"


@pytest.mark.parametrize("parts", [1, 3, 37])
@pytest.mark.parametrize("smoothing", [False, True])
def test_merge_splits_matches_the_torch_merge(parts, smoothing):
    """split_merge.merge_splits against the splits' merge written in torch: rows no split wrote
    (m = -inf, S = 0: 0), parts that never saw a row, a NaN partial in the last part (NaN: a
    non-finite logit reaches the loss), a non-finite head lse; N not a multiple of the kernel's
    row block, 37 parts not a multiple of its part block. Equal to fp32 rounding (the sums over
    parts may associate differently)."""
    from cce.ops.linear_ce.kernels.split_merge import merge_splits

    N = 1500
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    Mx = torch.randn(parts, N, device=dev) * 5
    Se = torch.rand(parts, N, device=dev) * 3 + 0.5
    unseen = torch.rand(parts, N, device=dev) < 0.3
    Mx[unseen], Se[unseen] = float("-inf"), 0.0
    Mx[:, :7], Se[:, :7] = float("-inf"), 0.0  # never written
    Mx[-1, 20] = float("nan")  # a NaN in one part: torch's max propagates it, and so does the lse
    Se[:, 30] = float("nan")  # a NaN sum under a -inf max (a row of NaN logits): NaN too
    Mx[:, 30] = float("-inf")
    Ss = torch.randn(parts, N, device=dev) if smoothing else None
    zt = torch.randn(N, device=dev)
    m0 = torch.randn(N, device=dev)
    m0[3], m0[11], m0[-1] = float("-inf"), float("nan"), float("inf")
    lse, tl_, ss, m0o = merge_splits(Mx, Se, Ss, zt, m0)

    M = Mx.max(0).values
    done = M != float("-inf")
    Mz = torch.where(done, M, 0.0)
    S = (Se * torch.exp(Mx - Mz)).sum(0)
    live = done | S.isnan()
    ref = torch.where(live, Mz + torch.log(torch.where(live, S, 1.0)), 0.0)
    torch.testing.assert_close(lse, ref, rtol=1e-6, atol=1e-6, equal_nan=True)
    assert torch.equal(tl_, torch.where(done, zt, 0.0))
    assert torch.equal(m0o, torch.where(torch.isfinite(m0), m0, 0.0))
    assert (lse[:7] == 0).all() and lse[20].isnan() and lse[30].isnan() and tl_[20] == zt[20]
    if smoothing:
        ref_ss = torch.where(done, Ss.sum(0), 0.0)
        # Either side's sum of P terms in another order: within 2 (P - 1) 2^-24 sum |terms| each.
        bound = 2 * max(parts - 1, 1) * 2.0**-24 * Ss.abs().sum(0) + 1e-7
        assert ((ss - ref_ss).abs() <= bound).all()
    else:
        assert ss is None
    assert merge_splits(Mx, Se, Ss, zt, None)[3] is None


@pytest.mark.parametrize(
    "variant",
    [
        {"fused": False},
        {"fused": False, "dz_slab_bytes": 4096},
        {"backward": "sparse", "sparse_min_flops": 0},
        {"backward": "sparse", "sparse_min_flops": 0, "dense_kept": 0.0},
    ],
    ids=["exact", "exact-row-blocks", "sparse", "sparse-all-dense"],
)
def test_poisoned_allocations_change_nothing(variant):
    """Every buffer torch.empty / empty_like / new_empty makes during the step filled first
    (helpers.poisoned_allocations): the loss and gradients are bit for bit those of an ordinary
    run (the interpreter runs programs in a fixed order), so no path reads memory it has not
    written. N = 33 (a partial token block),
    V = 257 (an odd V, a partial tile), label smoothing; the exact backward also in row blocks
    (a 4 KB budget: three, the last of one row, its dE rows buffer reused); the sparse backward
    also with every slab dense (dense_kept 0). The fused path has its own (test_triton_fused.py)."""
    e, c, t = zipf_inputs(33, 24, 257, dtype=torch.float32, seed=11)
    e.requires_grad_()
    c.requires_grad_()
    fn = tuned(**variant)
    feps = None if "backward" not in variant else 2e-3

    def run():
        return loss_and_grads(
            lambda *a, **k: fn(*a, impl="triton", **k), e, c, t, None,
            generator=torch.Generator().manual_seed(2), filter_eps=feps, label_smoothing=0.1,
        )  # fmt: skip

    want = run()
    with poisoned_allocations():
        got = run()
    assert torch.equal(got[0], want[0])
    for g, w in zip(got[2], want[2], strict=True):
        assert torch.equal(g, w)


def test_add_target_lo_row_chunks():
    """The target remainders added by row chunks of a few rows (a small ``chunk_bytes``) equal
    the one-chunk sums: index_add_ over repeated rows and targets, in any chunking."""
    from cce.ops.linear_ce.kernels.common import add_target_lo

    g = torch.Generator().manual_seed(2)
    N, V, D = 50, 7, 12
    e2d, c = torch.randn(N, D, generator=g).half(), torch.randn(V, D, generator=g).half()
    erow = torch.randperm(N, generator=g)
    tgt, lo = torch.randint(0, V, (N,), generator=g), torch.randn(N, generator=g) * 1e-3
    outs = []
    for chunk_bytes in (4 * D * 3, 1 << 20):
        dE, dC = torch.zeros(N, D), torch.zeros(V, D)
        add_target_lo(e2d, c, erow, tgt, lo, dE, dC, chunk_bytes=chunk_bytes)
        outs.append((dE, dC))
    ref_dE = torch.zeros(N, D, dtype=torch.float64).index_add_(
        0, erow, lo[:, None].double() * c[tgt].double()
    )
    ref_dC = torch.zeros(V, D, dtype=torch.float64).index_add_(
        0, tgt, lo[:, None].double() * e2d[erow].double()
    )
    for dE, dC in outs:
        assert rel_err(dE, ref_dE) <= 1e-6 and rel_err(dC, ref_dC) <= 1e-6
