"""The first-order corrections of the sparse backward's skipped tiles (kernels/first_order.py),
under the Triton interpreter on CPU (or on a GPU).

They add, where the device's rule turns them on, alpha_i S_i Gbar e_i to dE and
(r_j / |j|) (c_v - mean(C_j)) H to dC (and spread the zeroth-order dC term evenly over the
tile). The tests: the gated kernels against float64 (and as no-ops with the flag off); the
slab rule's first-order error estimate against float64; the sparse backward with the terms on
against the same formula in float64 from the forward's own masses; the rule on near-uniform
rows (terms on, no slab dense, gradients within 2e-3 of the oracle) and on zipf data (off);
the option reaches the backward.
"""

from __future__ import annotations

import math

import pytest
import torch

from bench.data import zipf_inputs
from cce import CCEOptions, Tuning, linear_cross_entropy_with_options
from cce.reference import linear_cross_entropy_reference
from tests.helpers import greedy_dense, near_uniform_inputs, rel_err, triton_training_forward

triton = pytest.importorskip("triton")

import cce.ops.linear_ce.triton_backward as TB  # noqa: E402
from cce.ops.linear_ce.kernels.common import stats_blocks  # noqa: E402
from cce.ops.linear_ce.kernels.first_order import add_dc_first_order, first_order_cost, gram  # noqa: E402
from cce.ops.linear_ce.kernels.tile_stats import decode_tile_mass, tile_means  # noqa: E402
from cce.ops.linear_ce.rows import RowOrder  # noqa: E402
from cce.ops.linear_ce.slab_choice import SlabErrors, dense_slab_flags, sample_rows, slab_errors  # noqa: E402
from cce.ops.linear_ce.triton_backward import loss_coefficients, sparse_backward  # noqa: E402

ON = torch.ones(1, dtype=torch.int32)
OFF = torch.zeros(1, dtype=torch.int32)
EPS = 2.0**-8  # bf16's default threshold: on near-uniform rows every tile is skipped


@pytest.mark.parametrize(
    "R,D,dtype", [(300, 40, torch.float32), (97, 70, torch.float16), (5, 16, torch.float32)]
)
def test_gram_against_float64(R, D, dtype):
    """gram: x^T x (whole and symmetric: off-diagonal tiles are mirrored) with fp32 accumulation
    (fp32: 1e-6 relative; fp16 operands are exact in fp32 products: the same), row counts and
    widths that are not multiples of the blocks, several row splits; zeros with the flag off;
    gathered rows with signed weights."""
    x = torch.randn(R, D, generator=torch.Generator().manual_seed(R)).to(dtype)
    want = x.double().T @ x.double()
    for splits in (1, 3):
        got = gram(x, ON, splits=splits)
        assert got.dtype == torch.float32 and got.shape == (D, D)
        assert rel_err(got, want) < 1e-6
    assert int(gram(x, OFF).count_nonzero()) == 0
    # gathered, weighted rows (signed weights): x[rows]^T diag(w) x[rows]
    g = torch.Generator().manual_seed(1)
    rows = torch.randint(0, R, (2 * R + 3,), generator=g)
    w = torch.randn(rows.numel(), generator=g)
    xr = x.double()[rows]
    want = xr.T @ (w.double()[:, None] * xr)
    # fp16: each weighted row is rounded to fp16 before its products (2^-11 relative)
    assert rel_err(gram(x, ON, rows, w, splits=2), want) < (1e-6 if dtype == torch.float32 else 1e-3)
    # scaled and added into a given buffer (Gbar's form: C^T C / V - means' part / V in one buffer)
    out = gram(x, ON, scale=1.0 / 3.0)
    both = gram(x, ON, rows, w, splits=2, scale=-0.5, out=out)
    assert both is out
    want2 = x.double().T @ x.double() / 3.0 - 0.5 * want
    assert rel_err(both, want2) < (1e-6 if dtype == torch.float32 else 1e-3)
    assert int(gram(x, OFF, scale=2.0, out=torch.zeros(D, D)).count_nonzero()) == 0


def test_dc_first_order_against_float64():
    """add_dc_first_order: dC[v] += rate[j] (c_v - cm[j]) @ H for j = tile_of[v], in place in
    dC's dtype (fp32 here: 1e-6); untouched with the flag off."""
    g = torch.Generator().manual_seed(1)
    V, D, nt = 150, 36, 7
    c = torch.randn(V, D, generator=g)
    H = torch.randn(D, D, generator=g) * 30.0
    cm = torch.randn(nt, D, generator=g)
    tile_of = torch.randint(0, nt, (V,), generator=g).to(torch.int32)
    rate = torch.rand(nt, generator=g)
    dC0 = torch.randn(V, D, generator=g)
    dC = dC0.clone()
    add_dc_first_order(dC, c, H, cm, tile_of, rate, ON)
    j = tile_of.long()
    want = dC0.double() + rate.double()[j, None] * ((c.double() - cm.double()[j]) @ H.double())
    assert rel_err(dC, want) < 1e-6
    dC = dC0.clone()
    add_dc_first_order(dC, c, H, cm, tile_of, rate, OFF)
    assert torch.equal(dC, dC0)


def test_slab_errors_first_order_against_float64():
    """slab_errors' fo: for each sampled row and slab, (alpha_i S'_is / V) G e_i with
    G = sum_v delta_v delta_v^T about the sorted tiles' means (float64 here; fp32 products
    over 750 classes: 1e-5)."""
    N, D, V = 60, 24, 750
    e, c, t = near_uniform_inputs(N, D, V, std=0.3)
    tu = Tuning(backward="sparse")
    out = triton_training_forward(e, c, t, EPS, tu)
    r = RowOrder(t, None, -100)
    g = torch.rand(N, generator=torch.Generator().manual_seed(2))
    alpha, beta, *_ = loss_coefficients(None, t, out[1], g, None, -100, 0.0, 0.0, V)
    srt = lambda x: x.index_select(0, r.perm).contiguous()  # noqa: E731
    BN, BV = stats_blocks(torch.float32)
    nt = out[2].shape[1]
    width = 3 * BV
    cm = tile_means(c, out[5], BV, torch.float32)
    args = (e, c, None, r.erow_s, srt(r.safe_t), srt(out[1]), srt(alpha.float()), srt(beta.float()), out[2])
    rest = (out[3].bool(), out[5], r.n_valid, 0.0, BN, BV, width, 20)
    err, ref, fo = slab_errors(*args, *rest, cm=cm)[:3]
    assert slab_errors(*args, *rest[:-1], 2)[2] is None  # no cm, no fo (2 sampled rows show it)
    pos, scale = sample_rows(out[2], srt(alpha.float()), r.n_valid, 20)
    perm = out[5].long()
    Cs = c.double()[perm]
    tile = torch.arange(V) // BV
    cmd = torch.stack([Cs[tile == j].mean(0) for j in range(nt)])
    delta = Cs - cmd[tile]
    G = delta.T @ delta
    E = e.double()[r.erow_s[pos]]
    a = srt(alpha.float()).double()[pos] * (pos < r.n_valid).double() * scale.double()
    S = decode_tile_mass(out[2][pos]).double() * a[:, None]
    want = torch.zeros(fo.shape, dtype=torch.float64)
    for s in range(fo.shape[0]):
        Ss = S[:, s * 3 : (s + 1) * 3].sum(1)
        want[s] = (Ss / V)[:, None] * (E @ G)
    assert rel_err(fo, want) < 1e-5
    assert float(want.norm()) > 0
    # at a temperature (logit_scale lam = 1 / T) the deviations, so G e_i, are lam times the
    # plain logits' (the same rows: sampling reads the codes, not the logits)
    fo_t = slab_errors(*args, *rest, cm=cm, logit_scale=2.5)[2]
    assert rel_err(fo_t, 2.5 * want) < 1e-5


def _model_grads(e, c, t, g, out, fo_on: bool, delta=None, ent=None, temperature=1.0):
    """(dE, dC) of the sparse backward's model in float64 from the forward's codes: the rank-1
    corrections (dC spread by q, or evenly with fo_on) plus, with fo_on, the first-order terms.
    With ``delta`` (an upstream gradient of the entropy, whose values are ``ent``) the entropy's
    term: dZ = p (alpha + eta z), a skipped tile's weight (alpha + eta (lse + log(S' / BV))) S'
    and its first-order weight that plus eta S' (kernels/first_order.py). At a ``temperature``
    the logits are lam z (lam = 1 / T): the coefficients carry lam, and so do the mean-row spread
    and the first-order terms (an expansion in lam x)."""
    lam = 1.0 / temperature
    N, D = e.shape
    V = c.shape[0]
    BN, BV = stats_blocks(torch.float32)
    r = RowOrder(t, None, -100)
    srt = lambda x: x.index_select(0, r.perm).contiguous()  # noqa: E731
    alpha, beta, _, eta, _ = loss_coefficients(
        None, t, out[1], g, None, -100, 0.0, 0.0, V, delta=delta, entropy=ent, temperature=temperature
    )
    a = srt(alpha.double()) * (torch.arange(N) < r.n_valid).double()
    b = srt(beta.double())
    h = torch.zeros_like(a) if eta is None else srt(eta.double())
    lse_s = srt(out[1]).double()
    E = e.double()[r.erow_s]
    ts = srt(r.safe_t)
    perm = out[5].long()
    C = c.double()
    z = (E @ C.T) * lam
    p = torch.exp(z - srt(out[1]).double()[:, None])
    nt = out[2].shape[1]
    keep = out[3].bool()
    M = decode_tile_mass(out[2]).double()  # [N, nt], 0 where kept
    S = M * (a + h * (lse_s - math.log(BV)))[:, None] + h[:, None] * torch.xlogy(M, M)
    SF = S + h[:, None] * M
    dE = torch.zeros(N, D, dtype=torch.float64)
    dC = torch.zeros(V, D, dtype=torch.float64)
    tile_of = torch.empty(V, dtype=torch.long)
    tile_of[perm] = torch.arange(V) // BV
    cnt = torch.bincount(tile_of, minlength=nt).double()
    cm = torch.stack([C[tile_of == j].mean(0) for j in range(nt)])
    rows = torch.arange(N)
    dz = p * (a[:, None] + h[:, None] * z)
    dz[rows, ts] = 0.0
    kept_mask = keep[rows // BN][:, tile_of]  # [N, V]
    dzk = dz * kept_mask
    dE += dzk @ C + S @ cm
    dC += dzk.T @ E
    Gj = S.T @ E  # [nt, D]
    if fo_on:
        spread = 1.0 / cnt[tile_of]
    else:
        q = torch.empty(V, dtype=torch.float64)
        score = out[6].double() * lam
        for j in range(nt):
            q[perm[j * BV : (j + 1) * BV]] = torch.softmax(score[j * BV : (j + 1) * BV], 0)
        spread = q
    dC += spread[:, None] * Gj[tile_of]
    zt = out[4].double()  # out[4]: sorted rows
    coef = (a + h * zt) * torch.exp(zt - lse_s) - b
    coef = coef * (torch.arange(N) < r.n_valid).double()
    dE += coef[:, None] * C[ts]
    dC.index_add_(0, ts, coef[:, None] * E)
    if fo_on:
        delta = C - cm[tile_of]
        Gbar = delta.T @ delta / V
        dE += lam * SF.sum(1)[:, None] * (E @ Gbar)
        valid = (torch.arange(N) < r.n_valid).double()
        mass = (decode_tile_mass(out[2]).double() * valid[:, None]).sum(0)  # unsigned S_ij
        H = (E * SF.sum(1)[:, None]).T @ E
        rate = mass / mass.sum() / cnt
        dC += lam * rate[tile_of][:, None] * (delta @ H)
    dE_e = torch.zeros(N, D, dtype=torch.float64).index_copy_(0, r.erow_s, dE)
    return dE_e, dC


# V: the first case (the default tier's) at 790 classes, 25 tiles (the last partial), where
# every probability is below eps (at most 0.003) and the rule turns the terms on as at 1500; the
# others at 1500 (at 790 the tempered logits' filter keeps tiles, and the entropy's rule makes the
# slab dense; at 1000 too).
@pytest.mark.parametrize(
    "std,entropy,temp,V",
    [
        (0.2, False, 1.0, 790), pytest.param(0.05, False, 1.0, 1500, marks=pytest.mark.slow),
        (0.2, True, 1.0, 1500), (0.2, False, 0.7, 1500),
    ],
)  # fmt: skip
def test_sparse_backward_with_first_order_is_the_model(std, entropy, temp, V, monkeypatch):
    """On near-uniform rows the rule turns the terms on (flag 1, no slab dense: their estimated
    error is within the target, the rank-1 corrections' is not), and the sparse backward then
    computes exactly the model: rank-1 corrections with an even dC spread plus alpha_i S_i Gbar e_i
    and rate_j delta_v H, from the forward's own decoded masses (float64 model; fp32 GEMMs over
    D = 32 and up to 1500 classes: 2e-5). With ``entropy`` an upstream gradient on the entropy
    output as well (loss - 0.3 H per row, random weights): the model's coefficients with eta. At
    a temperature, the model of the tempered logits (every term times 1 / T where it is linear in
    the logit). N = 64 > ERROR_ROWS: the rule's rows are sampled."""
    N, D = 64, 32
    e, c, t = near_uniform_inputs(N, D, V, std=std)
    tu = Tuning(backward="sparse", dense_slabs=True)
    out = triton_training_forward(e, c, t, EPS, tu, temp)
    assert int(out[3].sum()) == 0  # every tile skipped
    g = torch.rand(N, generator=torch.Generator().manual_seed(4))
    seen = {}
    orig = TB.dense_slab_flags

    def spy(*a, **k):
        seen["flags"] = orig(*a, **k)
        return seen["flags"]

    args = (e, c, None, None, None, t, out[1], g, None, -100, 0.0, 0.0, 0.0, True, True, *out[2:8])
    kw = {"temperature": temp}
    if entropy:
        z = e.double() @ c.double().T
        ent = (torch.logsumexp(z, 1) - (torch.softmax(z, 1) * z).sum(1)).float()
        kw.update(delta=-0.3 * torch.rand(N, generator=torch.Generator().manual_seed(5)), entropy=ent)
    monkeypatch.setattr(TB, "dense_slab_flags", spy)
    dE, dC = sparse_backward(*args, dense_slabs=True, **kw)
    dense, flag = seen["flags"]
    assert flag.tolist() == [1] and int(dense.sum()) == 0
    mE, mC = _model_grads(e, c, t, g, out, True, kw.get("delta"), kw.get("entropy"), temp)
    assert rel_err(dE, mE) < 2e-5 and rel_err(dC, mC) < 2e-5
    # without the terms: the rank-1 model with the q spread (the terms are not a no-op here)
    dE0, dC0 = sparse_backward(*args, dense_slabs=False, **kw)
    mE0, mC0 = _model_grads(e, c, t, g, out, False, kw.get("delta"), kw.get("entropy"), temp)
    assert rel_err(dE0, mE0) < 2e-5 and rel_err(dC0, mC0) < 2e-5
    assert rel_err(mE, mE0) > 1e-3


def _grads(e, c, t, tuning):
    ee, cc = e.clone().requires_grad_(), c.clone().requires_grad_()
    o = CCEOptions(impl="triton", filter_eps=EPS, tuning=tuning)
    loss = linear_cross_entropy_with_options(ee, cc, t, None, None, o)
    up = torch.rand((), generator=torch.Generator().manual_seed(1))
    (loss * up).backward()
    e0, c0 = e.double().requires_grad_(), c.double().requires_grad_()
    (linear_cross_entropy_reference(e0, c0, t) * up.double()).backward()
    return rel_err(ee.grad, e0.grad), rel_err(cc.grad, c0.grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rule_on_near_uniform_rows_meets_the_target_without_dense_slabs(dtype):
    """Near-uniform rows (logit std 0.2, eps 2^-8: every tile skipped): the rank-1 corrections
    alone err by > 1e-2 in dE; the default rules (first order on) bring dE and dC within 2e-3 of
    float64 (the rule's 2.5e-3 target on the sampled rows) with no slab dense, and with
    first_order=False by making the slabs dense (exact: fp32 1e-5; fp16 rounds dZ and the
    gradients, 2^-11 each: 2e-3). fp16 runs the terms' operands scaled into its range."""
    e, c, t = (
        x.to(dtype) if x.is_floating_point() else x for x in near_uniform_inputs(64, 32, 3000, std=0.2)
    )
    r1 = _grads(e, c, t, Tuning(backward="sparse", dense_slabs=False))
    fo = _grads(e, c, t, Tuning(backward="sparse"))
    dense = _grads(e, c, t, Tuning(backward="sparse", first_order=False))
    assert r1[0] > 1e-2
    assert max(fo) < (2e-3 if dtype == torch.float32 else 3e-3)
    assert max(dense) < (1e-5 if dtype == torch.float32 else 2e-3)


def test_rule_off_where_rank1_meets_the_target():
    """zipf data where the rank-1 corrections meet the target (at this toy size they err by
    2.2e-2 on the sampled rows, the terms would leave 3.7e-3: a target of 3e-2): the rule
    neither turns the terms on nor makes a slab dense; at 5e-3 the terms (costing half a slab)
    replace the one dense slab, at 3e-3 they do not suffice and the slab is dense."""
    N, D, V = 64, 32, 3000
    e, c, t = zipf_inputs(N, D, V, dtype=torch.float32, seed=5)
    tu = Tuning(backward="sparse", dense_slabs=True, slab_error=3e-2)
    out = triton_training_forward(e, c, t, EPS, tu)
    r = RowOrder(t, None, -100)
    g = torch.full((N,), 1.0 / N)
    alpha, beta, *_ = loss_coefficients(None, t, out[1], g, None, -100, 0.0, 0.0, V)
    srt = lambda x: x.index_select(0, r.perm).contiguous()  # noqa: E731
    BN, BV = stats_blocks(torch.float32)
    nt = out[2].shape[1]
    cm = tile_means(c, out[5], BV, torch.float32)
    errors = slab_errors(
        e, c, None, r.erow_s, srt(r.safe_t), srt(out[1]), srt(alpha.float()), srt(beta.float()), out[2],
        out[3].bool(), out[5], r.n_valid, 0.0, BN, BV, nt * BV, cm=cm,
    )  # fmt: skip
    cost = first_order_cost(N, V, D, nt * BV)
    stats = (out[2], out[3].bool(), r.n_valid, BN, nt, tu.dense_kept)
    dense, flag = dense_slab_flags(*stats, tu.slab_error, errors, cost)
    assert flag.tolist() == [0] and dense.tolist() == [0]
    dense, flag = dense_slab_flags(*stats, 5e-3, errors, 0.5)
    assert flag.tolist() == [1] and dense.tolist() == [0]  # the terms meet 5e-3, for half a slab
    dense, flag = dense_slab_flags(*stats, 3e-3, errors, 0.5)
    assert flag.tolist() == [0] and dense.tolist() == [1]  # they miss 3e-3: the one slab dense


def test_flags_with_first_order_follow_the_rule():
    """dense_slab_flags with fo: the greedy rule run on err and on err - fo (float64 here); the
    terms are on exactly where the second's slab count plus their cost is below the first's."""
    g = torch.Generator().manual_seed(0)
    n_slabs, k, D = 6, 5, 8
    err = torch.randn(n_slabs, k, D, generator=g)
    fo = err * 0.9 + 0.01 * torch.randn(n_slabs, k, D, generator=g)
    ref = torch.randn(k, D, generator=g) * 10
    code = torch.full((k, n_slabs), 255, dtype=torch.uint8)
    keep = torch.zeros(1, n_slabs, dtype=torch.bool)
    n_valid = torch.tensor([k], dtype=torch.int32)

    for slab_error in (0.05, 0.2, 0.5):
        bound = slab_error * float(ref.double().norm())
        c1, c2 = greedy_dense(err, bound), greedy_dense(err - fo, bound)
        for cost in (0.5, 2.5, 10.0):
            dense, flag = dense_slab_flags(
                code, keep, n_valid, 16, 1, 2.0, slab_error, SlabErrors(err, ref, fo), cost
            )
            use = len(c2) + cost < len(c1)
            want = c2 if use else c1
            assert flag.tolist() == [int(use)]
            assert dense.tolist() == [int(i in want) for i in range(n_slabs)]
    dense, flag = dense_slab_flags(code, keep, n_valid, 16, 1, 2.0, 0.05, SlabErrors(err, ref, fo), None)
    assert flag.tolist() == [0]


def test_option_reaches_the_backward(monkeypatch):
    """Tuning(first_order=...) is validated and passed to the sparse backward."""
    import cce.ops.linear_ce.triton_impl as TI

    with pytest.raises(ValueError, match="first_order"):
        Tuning(first_order=1)
    e, c, t = near_uniform_inputs(16, 16, 160, std=0.2)
    seen = []
    orig = TI.sparse_backward

    def spy(*a, **k):
        seen.append(k["first_order"])
        return orig(*a, **k)

    monkeypatch.setattr(TI, "sparse_backward", spy)
    for fo in (True, False):
        _grads(e, c, t, Tuning(backward="sparse", first_order=fo))
    assert seen == [True, False]


def test_terms_left_out_where_they_cannot_pay(monkeypatch):
    """With fewer rows than D the terms' D x D work costs more than every slab (first_order_cost
    >= the slab count), so the rule can never turn them on: their operands are not built and the
    gradients are those of first_order=False, bit for bit."""
    N, D, V = 16, 64, 200
    e, c, t = near_uniform_inputs(N, D, V, std=0.2)
    BV = stats_blocks(torch.float32)[1]
    assert first_order_cost(N, V, D, -(-V // BV) * BV) >= 1  # one slab holds the whole vocabulary
    built = []
    orig = TB.first_order_terms

    def spy(*a, **k):
        built.append(1)
        return orig(*a, **k)

    monkeypatch.setattr(TB, "first_order_terms", spy)
    grads = {}
    for fo in (True, False):
        ee, cc = e.clone().requires_grad_(), c.clone().requires_grad_()
        o = CCEOptions(impl="triton", filter_eps=EPS, tuning=Tuning(backward="sparse", first_order=fo))
        linear_cross_entropy_with_options(ee, cc, t, None, None, o).backward()
        grads[fo] = (ee.grad, cc.grad)
    assert not built
    assert torch.equal(grads[True][0], grads[False][0]) and torch.equal(grads[True][1], grads[False][1])
