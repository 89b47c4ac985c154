"""Shared test utilities: inputs, an oracle comparison with random upstream gradients."""

from __future__ import annotations

import contextlib
import math
import os

import torch

from cce.reference import linear_cross_entropy_reference

# `make test-all` (CCE_TEST_TIER=all): the thorough tier, see tests/conftest.py.
THOROUGH = os.environ.get("CCE_TEST_TIER") == "all"


def examples(thorough: int, default: int) -> int:
    """A hypothesis property's example count: ``thorough`` in the thorough tier, ``default`` in
    the default one (each example of a kernel property runs the Triton interpreter)."""
    return thorough if THOROUGH else default


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64 (0 when both are 0)."""
    a, b = a.double(), b.double()
    den = b.norm()
    num = (a - b).norm()
    if den == 0:
        return float(num)
    return float(num / den)


def make_linear_inputs(
    lead: tuple[int, ...],
    D: int,
    V: int,
    dtype: torch.dtype = torch.float32,
    *,
    bias: bool = False,
    ignore_frac: float = 0.1,
    ignore_index: int = -100,
    device: str = "cpu",
    scale: float = 1.0,
    generator: torch.Generator | None = None,
):
    """e ~ N(0, 1/sqrt(D)), c likewise (logits ~ N(0, scale^2)), random targets, some ignored."""
    g = generator
    s = (scale / D**0.5) ** 0.5
    e = (torch.randn(*lead, D, generator=g) * s).to(device=device, dtype=dtype).requires_grad_()
    c = (torch.randn(V, D, generator=g) * s).to(device=device, dtype=dtype).requires_grad_()
    b = None
    if bias:
        b = (torch.randn(V, generator=g) * 0.5).to(device=device, dtype=dtype).requires_grad_()
    t = torch.randint(0, V, lead, generator=g)
    if ignore_frac > 0 and t.numel():
        mask = torch.rand(lead, generator=g) < ignore_frac
        t[mask] = ignore_index
    return e, c, t.to(device), b


def loss_and_grads(fn, e, c, t, b, *, generator=None, **kw):
    """Runs fn(e, c, t, b, **kw), backprops a random upstream gradient, returns (out, lse, grads)."""
    out = fn(e, c, t, b, **kw)
    loss, lse = out if isinstance(out, tuple) else (out, None)
    up = torch.randn(loss.shape, generator=generator, dtype=torch.float64).to(loss.device).float()
    total = (loss * up).sum()
    if lse is not None:
        up2 = torch.randn(lse.shape, generator=generator, dtype=torch.float64).to(lse.device).float()
        total = total + (lse * up2).sum()
    inputs = [x for x in (e, c, b) if x is not None and x.requires_grad]
    grads = (
        torch.autograd.grad(total, inputs, allow_unused=True) if total.requires_grad else [None] * len(inputs)
    )
    return loss.detach(), None if lse is None else lse.detach(), list(grads)


def compare_with_reference(fn, e, c, t, b, *, seed: int = 0, ref_dtype=torch.float64, **kw):
    """(impl, reference) triples of (loss, lse, grads) under the same random upstream gradients."""
    g1 = torch.Generator().manual_seed(seed)
    g2 = torch.Generator().manual_seed(seed)
    got = loss_and_grads(fn, e, c, t, b, generator=g1, **kw)
    ref = loss_and_grads(
        lambda *a, **k: linear_cross_entropy_reference(*a, dtype=ref_dtype, **k),
        e,
        c,
        t,
        b,
        generator=g2,
        **kw,
    )
    return got, ref


# --------------------------------------------------------------------------------------------
# Oracle comparison with error bounds (used by tests/ops/linear_ce/test_linear.py; any impl can use it)
# --------------------------------------------------------------------------------------------

# Unit roundoff (half an ulp at 1.0) of the dtype a gradient is stored in. Storing an exact value
# x in that dtype (round to nearest) moves it by at most u * |x|, so the relative L2 error of the
# stored gradient from that step alone is at most u.
UNIT_ROUNDOFF = {
    torch.float64: 2.0**-53,
    torch.float32: 2.0**-24,
    torch.bfloat16: 2.0**-8,  # 8 significant bits: the ulp at 1.0 is 2^-7
    torch.float16: 2.0**-11,
}


def make_weight(V: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """Positive class weights in [0.25, 2) (fp32, not differentiated, as in F.cross_entropy)."""
    return torch.rand(V, generator=generator) * 1.75 + 0.25


def problem_rows(e, c, t, b, *, shift: bool = False, softcap: float | None = None):
    """fp64 (E, L, z, t) of the problem rows: E the hidden rows actually used, z = E @ c.T + b
    before softcap, L after softcap, t the flattened targets (shift applied by slicing)."""
    E = e.detach().double()
    if shift:
        E = E[..., :-1, :]
        t = t[..., 1:]
    E = E.reshape(-1, e.shape[-1])
    z = E @ c.detach().double().T
    if b is not None:
        z = z + b.detach().double()
    L = z if softcap is None else softcap * torch.tanh(z / softcap)
    return E, L, z, t.reshape(-1).long()


def run_with_upstream(fn, e, c, t, b, *, seed: int, **kw):
    """fn(e, c, t, b, **kw) backpropagated with seeded N(0,1) upstream gradients on the loss (and
    on the lse when return_lse). Returns (loss, lse, {name: grad}, up_loss, up_lse)."""
    gen = torch.Generator().manual_seed(seed)
    out = fn(e, c, t, b, **kw)
    loss, lse = out if isinstance(out, tuple) else (out, None)
    up_loss = torch.randn(loss.shape, generator=gen, dtype=torch.float64).float()
    up_lse = None
    total = (loss * up_loss).sum()
    if lse is not None:
        up_lse = torch.randn(lse.shape, generator=gen, dtype=torch.float64).float()
        total = total + (lse * up_lse).sum()
    named = {k: x for k, x in (("e", e), ("c", c), ("bias", b)) if x is not None and x.requires_grad}
    grads = dict.fromkeys(named)
    if total.requires_grad and named:
        gs = torch.autograd.grad(total, list(named.values()), allow_unused=True)
        grads = dict(zip(named, gs, strict=True))
    return loss.detach(), None if lse is None else lse.detach(), grads, up_loss, up_lse


def reference_logit_grad(e, c, t, b, up_loss, up_lse, *, weight=None, **opts):
    """fp64 d(total)/dz for the problem rows (z = logits before softcap), from the oracle."""
    shift, softcap = opts.get("shift", False), opts.get("softcap")
    _, _, z, _ = problem_rows(e, c, t, b, shift=shift, softcap=softcap)
    z = z.clone().requires_grad_()
    ref_opts = {k: v for k, v in opts.items() if k not in ("shift", "filter_eps", "impl")}
    # Targets after the shift, logits of the problem rows: call the logits-level oracle unshifted.
    tt = t[..., 1:] if shift else t
    from cce.reference import cross_entropy_reference

    out = cross_entropy_reference(z.view(*tt.shape, -1), tt, weight=weight, dtype=torch.float64, **ref_opts)
    loss, lse = out if isinstance(out, tuple) else (out, None)
    total = (loss * up_loss.double()).sum()
    if lse is not None:
        total = total + (lse * up_lse.double()).sum()
    (dz,) = torch.autograd.grad(total, z) if total.requires_grad else (torch.zeros_like(z),)
    return dz.detach()


def grad_error_scales(e, c, t, b, dz, *, shift: bool = False):
    """Norms of |dZ| |C|, |dZ|^T |E| and colsum |dZ| for dZ = the magnitudes of the summed terms
    (abs_logit_grad_terms): each gradient entry is a sum of terms whose absolute values sum to the
    corresponding entry here, so rounding error in computing it is bounded by (gamma_n) times it,
    whatever cancellation makes the gradient itself small."""
    E, _, _, _ = problem_rows(e, c, t, b, shift=shift)
    a = dz.abs()
    return {
        "e": float((a @ c.detach().double().abs()).norm()),
        "c": float((a.T @ E.abs()).norm()),
        "bias": float(a.sum(0).norm()),
    }


def row_terms(e, c, t, b, up_loss, up_lse, *, weight=None, reduction="mean", **opts):
    """fp64 pieces of dL/dz_iv = (alpha_i p_iv - beta_i [v == t_i] - gamma_i w_v) softcap'_iv for the
    problem rows, with the row coefficients from cce._math (the formula every implementation
    shares): (E, p, sc, alpha, beta, gamma, w, t)."""
    from cce import _math

    shift, softcap = opts.get("shift", False), opts.get("softcap")
    E, L, z, tt = problem_rows(e, c, t, b, shift=shift, softcap=softcap)
    ignore_index = opts.get("ignore_index", -100)
    V = c.shape[0]
    valid = tt != ignore_index
    p = torch.softmax(L, dim=-1)
    sc = torch.ones_like(L) if softcap is None else 1 - torch.tanh(z / softcap) ** 2
    w = torch.ones(V, dtype=torch.float64) if weight is None else weight.double()
    w_t = _math.target_weight(None if weight is None else w, tt, valid).double()
    W = _math.weight_total(None if weight is None else w, V, e.device)
    k = _math.LossConsts(opts.get("label_smoothing", 0.0), opts.get("z_loss", 0.0), V)
    up = up_loss.reshape(-1) if reduction == "none" else up_loss
    g = _math.row_upstream(up.double(), w_t, reduction, tt.numel()).double()
    lse = torch.logsumexp(L, dim=-1)
    h = None if up_lse is None else up_lse.reshape(-1).double()
    alpha, beta, gamma = _math.coefficients(g, h, lse, w_t, W, valid, k)
    return E, p, sc, alpha.double(), beta.double(), gamma.double(), w, tt


def abs_logit_grad_terms(e, c, t, b, up_loss, up_lse, *, weight=None, times_softcap_grad=True, **opts):
    """(|alpha_i| p_iv + |beta_i| [v == t_i] + |gamma_i| w_v) |softcap'_iv|: the magnitude of the
    terms an implementation adds up into dL/dz_iv (they cancel, e.g. for V = 1 or a confident
    softmax, so |dL/dz| alone understates the rounding error of a correct implementation)."""
    E, p, sc, alpha, beta, gamma, w, tt = row_terms(e, c, t, b, up_loss, up_lse, weight=weight, **opts)
    A = alpha.abs()[:, None] * p + gamma.abs()[:, None] * w.abs()[None, :]
    if tt.numel():
        valid = beta != 0
        safe = torch.where(valid, tt, torch.zeros_like(tt))
        A[torch.arange(tt.numel()), safe] += beta.abs()
    return A * sc.abs() if times_softcap_grad else A


def filter_error_bounds(e, c, t, b, up_loss, up_lse, eps: float, *, weight=None, **opts):
    """Upper bounds on ||dE_filtered - dE_exact||_F and ||dC_filtered - dC_exact||_F for a filter that
    skips (row-chunk x vocab-block) tiles of small softmax entries and replaces a skipped tile's
    contribution by the rank-1 term rowsum(dZ_tile) (outer) mean(C_tile) (and
    colsum (outer) mean(E_chunk) for dC).

    "Small" may mean p_iv < eps or |alpha_i| p_iv < eps * max_j |alpha_j| (threshold relative to
    the largest row coefficient in the chunk); both imply |alpha_i| p_iv < eps * A with A the
    largest |alpha_j| of all rows, the set bounded here. A skipped entry's dense gradient is
    alpha_i p_iv softcap'_iv (|softcap'| <= 1). Replacing c_v by a block mean moves it by at most
    2 max_v ||c_v||, so row i of dE is off by at most sum_{skipped v} |alpha_i| p_iv * 2 max||c_v||;
    likewise column v of dC with 2 max_i ||e_i||. The bound holds for any tile shape and any
    subset of small entries skipped. The bias gradient is not filtered (bound 0)."""
    if eps <= 0:
        return {"e": 0.0, "c": 0.0, "bias": 0.0}
    E, p, _, alpha, _, _, _, _ = row_terms(e, c, t, b, up_loss, up_lse, weight=weight, **opts)
    dense = alpha.abs()[:, None] * p  # [N, V]
    A = float(alpha.abs().max()) if alpha.numel() else 0.0
    # 1e-3 margin: the implementation decides "small" in fp32, this check in fp64.
    small = torch.where(dense < eps * A * (1 + 1e-3), dense, 0.0)
    cmax = float(c.detach().double().norm(dim=1).max()) if c.shape[0] else 0.0
    emax = float(E.norm(dim=1).max()) if E.shape[0] else 0.0
    return {
        "e": float(small.sum(1).norm()) * 2 * cmax,
        "c": float(small.sum(0).norm()) * 2 * emax,
        "bias": 0.0,
    }


def tuned(**tuning):
    """cce.linear_cross_entropy's signature with internal options (cce.Tuning: the backward
    algorithm, memory budgets), passed as options rather than by changing module state."""
    import cce

    def fn(e, c, t, b=None, *, weight=None, process_group=None, **opts):
        o = cce.CCEOptions(**opts, tuning=cce.Tuning(**tuning))
        return cce.linear_cross_entropy_with_options(e, c, t, b, weight, o, process_group)

    return fn


def tuned_ce(**tuning):
    """cce.cross_entropy's signature with internal options (see tuned)."""
    import cce

    def fn(logits, t, *, weight=None, inplace_backward=False, **opts):
        o = cce.CCEOptions(**opts, tuning=cce.Tuning(**tuning))
        return cce.cross_entropy_with_options(logits, t, weight, o, inplace_backward)

    return fn


def tile_skips(e, c, t, eps: float, BN: int, BV: int, perm=None, ignore_index: int = -100):
    """[n_blocks, n_tiles] int8: the filter's decision per (token block, vocabulary tile), from
    the logits in fp32: 1 (skip) when every probability in the tile is below eps and no row's
    target lies in it, 0 (keep); -1 for blocks past the valid rows. Rows in the valid-first
    order, the vocabulary in ``perm`` order (ids when None)."""
    valid = t != ignore_index
    order = torch.argsort((~valid).int(), stable=True)
    n_valid = int(valid.sum())
    V = c.shape[0]
    perm = torch.arange(V, device=c.device) if perm is None else perm
    pos = torch.empty_like(perm).index_copy_(0, perm, torch.arange(V, device=c.device))
    nb, nt = -(-len(t) // BN), -(-V // BV)
    out = torch.full((nb, nt), -1, dtype=torch.int8)
    cs = c.float()[perm]
    for b in range(nb):
        rows = order[b * BN : min((b + 1) * BN, n_valid)]
        if rows.numel() == 0:
            continue
        L = e.float()[rows] @ cs.T
        p = torch.softmax(L, 1)
        p = torch.nn.functional.pad(p, (0, nt * BV - V))
        maxp = p.view(len(rows), nt, BV).amax(dim=(0, 2))
        has_t = torch.zeros(nt, dtype=torch.bool, device=c.device)
        has_t[pos[t[rows]] // BV] = True
        out[b] = ((maxp < eps) & ~has_t).to(torch.int8).cpu()
    return out


def skip_rate(e, c, t, eps: float, sort_vocab: bool) -> float:
    """Fraction of the decided (token block, tile) pairs that the filter skips (tile_skips, at
    the exact backward's pointer tiles), on the vocabulary sorted by mean logit (as the filtered
    backward walks it) or in id order."""
    from cce.ops.linear_ce.kernels.common import config
    from cce.ops.linear_ce.rows import RowOrder, vocab_scores

    cfg = config(e.dtype, "bwd")
    perm = vocab_scores(e, c, None, RowOrder(t, None, -100))[0] if sort_vocab else None
    sk = tile_skips(e, c, t, eps, cfg.BLOCK_N, cfg.BLOCK_V, perm)
    return float((sk == 1).sum() / (sk >= 0).sum().clamp(min=1))


def spread_logits_problem(seed: int, N: int = 48, D: int = 32, V: int = 600):
    """(e, c, t), fp32: logits of std ~1.5 over a small vocabulary, so that a large filter_eps
    (0.25) skips nearly every tile and the filtered gradients differ visibly from the exact ones."""
    g = torch.Generator().manual_seed(seed)
    e = torch.randn(N, D, generator=g) * 1.5**0.5 / D**0.25
    c = torch.randn(V, D, generator=g) * 1.5**0.5 / D**0.25
    return e, c, torch.randint(0, V, (N,), generator=g)


def triton_grads(fn, e, c, t, **kw):
    """(dE, dC) of ``fn(e, c, t, impl="triton", **kw).backward()`` on fresh leaves."""
    ee, cc = e.clone().requires_grad_(), c.clone().requires_grad_()
    fn(ee, cc, t, impl="triton", **kw).backward()
    return ee.grad, cc.grad


def greedy_dense(err: torch.Tensor, bound: float, squared: bool = False) -> set[int]:
    """The dense-slab rule in float64, one slab at a time: the slabs of largest error (err
    [n_slabs, ...] vectors whose sum is the error; with ``squared``, err [n_slabs] squared errors
    that add up, negative ones counting as 0) made dense until the rest's error is at most
    ``bound`` (for squared errors, a bound on the sum)."""
    x = err.double()
    if squared:
        x = x.clamp(min=0)
    size = (lambda i: float(x[i])) if squared else (lambda i: float(x[i].norm()))
    rest = (
        (lambda ids: float(sum(x[i] for i in ids)))
        if squared
        else (lambda ids: float(sum(x[i] for i in ids).norm()))
    )
    left = sorted(range(x.shape[0]), key=lambda i: -size(i))
    chosen = set()
    while left and rest(left) > bound:
        chosen.add(left.pop(0))
    return chosen


def near_uniform_inputs(N: int, D: int, V: int, std: float, seed: int = 3):
    """Random hidden states and classes with logits of standard deviation ``std`` (an untrained
    model's near-uniform softmax), every 9th target ignored."""
    g = torch.Generator().manual_seed(seed)
    e = torch.randn(N, D, generator=g) * std**0.5 / D**0.25
    c = torch.randn(V, D, generator=g) * std**0.5 / D**0.25
    t = torch.randint(0, V, (N,), generator=g)
    t[::9] = -100
    return e, c, t


def triton_training_forward(e, c, t, eps: float, tuning, temperature: float = 1.0):
    """The Triton training forward that the sparse backward reads (mean reduction, no bias,
    softcap or smoothing; ignore_index -100), with ``tuning``'s choices, at ``temperature``."""
    from cce.ops.linear_ce.triton_impl import linear_ce_triton_fwd

    return linear_ce_triton_fwd(
        e, c, None, None, None, t, -100, "mean", 0.0, 0.0, 0.0, eps, True, False, tuning.stats_chain_tiles,
        tuning.dz_slab_bytes, tuning.de_block_slots, tuning.dc_scratch_tiles, tuning.stash_move_bytes,
        tuning.dense_slabs, tuning.dense_kept, tuning.slab_error, tuning.slab_error_dc,
        tuning.dense_slab_bytes, tuning.first_order, tuning.host_gating, temperature, False, False,
    )  # fmt: skip


def capture_step(step, e, c, t):
    """(graph, its loss): ``step(e, c, t)`` (a loss) and its backward captured in a CUDA graph, after
    a warm-up on a side stream (compiles and autotunes the kernels outside the capture); e and c
    are leaves used only by the graph afterwards (their .grad holds the replayed gradients)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            e.grad = c.grad = None
            step(e, c, t).backward()
    torch.cuda.current_stream().wait_stream(s)
    e.grad = c.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(e, c, t)
        out.backward()
    return graph, out


def replay_on(graph, static, new) -> None:
    """Copies the tensors ``new`` into the graph's ``static`` inputs, replays it and waits."""
    with torch.no_grad():
        for x, y in zip(static, new, strict=True):
            x.copy_(y)
    graph.replay()
    torch.cuda.synchronize()


def captured_step(step, shape, regime: str, seed: int):
    """Captures ``step(e, c, t)`` (a loss) and its backward in a CUDA graph on inputs of ``seed``,
    replays it on inputs of ``seed + 1`` copied into the same tensors; returns (the graph's loss,
    (e, c) holding the replayed gradients, the new inputs)."""
    from bench.data import make_inputs

    N, D, V = shape
    e0, c0, t0 = make_inputs(N, D, V, regime, dtype=torch.bfloat16, device="cuda", seed=seed)
    # Fresh leaves, used only inside the graph's stream (autograd accumulates on their stream).
    e, c, t = e0.clone().requires_grad_(), c0.clone().requires_grad_(), t0.clone()
    graph, out = capture_step(step, e, c, t)
    e2, c2, t2 = make_inputs(N, D, V, regime, dtype=torch.bfloat16, device="cuda", seed=seed + 1)
    replay_on(graph, (e, c, t), (e2, c2, t2))
    return out, (e, c), (e2, c2, t2)


def skipped_mean_logit64(S: torch.Tensor, lse: torch.Tensor, softcap: float, BV: int) -> torch.Tensor:
    """float64: a skipped tile's p-weighted mean logit as the sparse backward models it (to first
    order in the tile's logit spread), lse + log(S / BV); with softcap the forward's codes hold
    S = sum_v p_v softcap'(z_v), and zbar solves zbar + log(1 - (zbar / softcap)^2) =
    lse + log(S / BV) on the branch below z* = sqrt(1 + softcap^2) - 1 (bisection, not the
    kernels' Newton steps). 0 where S = 0 (no correction there)."""
    base = lse + torch.log(torch.where(S > 0, S, 1.0)) - math.log(BV)
    z = base
    if softcap:
        lo = torch.full_like(base, -softcap * (1 - 1e-6))
        hi = torch.full_like(base, math.sqrt(1 + softcap**2) - 1)
        for _ in range(80):
            mid = (lo + hi) / 2
            up = mid + torch.log(1 - (mid / softcap) ** 2) < base
            lo, hi = torch.where(up, mid, lo), torch.where(up, hi, mid)
        z = (lo + hi) / 2
    return torch.where(S > 0, z, 0.0)


@contextlib.contextmanager
def poisoned_allocations():
    """While active, torch.empty, torch.empty_like and Tensor.new_empty fill what they make
    (NaN for floats, -7 for integers, 201 for uint8), so that a kernel or op that reads memory it
    did not write shows it in its results. Yields the list of tensors made."""
    made: list[torch.Tensor] = []
    real = (torch.empty, torch.empty_like, torch.Tensor.new_empty)

    def wrap(f):
        def g(*a, **k):
            x = f(*a, **k)
            if x.is_floating_point():
                x.fill_(float("nan"))
            elif x.dtype == torch.uint8:
                x.fill_(201)
            elif x.dtype != torch.bool and not x.is_complex():
                x.fill_(-7)
            made.append(x)
            return x

        return g

    torch.empty, torch.empty_like, torch.Tensor.new_empty = (wrap(f) for f in real)
    try:
        yield made
    finally:
        torch.empty, torch.empty_like, torch.Tensor.new_empty = real
