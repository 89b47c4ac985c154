"""CPU-specific paths of impl="torch" (cce/ops/linear_ce/chunked.py) that test_linear.py's small
vocabularies do not reach on their own:

* the in-place row-wise softmax that the forward statistics rely on (aliasing safety of aten's
  kernel, which is an implementation property, not a documented guarantee: checked here);
* the oneDNN GEMMs, done per vocabulary slice (several slices, the last one partial), against the
  fp64 oracle and against torch.mm (oneDNN disabled);
* the first-row-block shortcut of the tile filter's dense/filtered decision, on chunks whose
  first row block is unlike the rest.
"""

from __future__ import annotations

import pytest
import torch
from helpers import make_linear_inputs, make_weight, rel_err, run_with_upstream, tuned
from test_linear import cce_fn, check_against_oracle

import cce
from cce.ops.linear_ce import chunked
from cce.ops.linear_ce.chunked_math import ONEDNN_SLICE, use_onednn


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (5, 2049), (17, 32000)])
def test_inplace_softmax_equals_out_of_place(dtype, shape):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen, dtype=dtype) * 8
    x[0, 0] = 40.0  # one dominant entry
    y = x.clone()
    torch.ops.aten._softmax.out(y, 1, False, out=y)
    assert torch.equal(y, torch.softmax(x, 1))


OPTION_SETS = [
    dict(reduction="mean"),
    dict(reduction="sum", label_smoothing=0.1, z_loss=1e-3),
    dict(reduction="none", return_lse=True, softcap=5.0),
    dict(reduction="mean", shift=True, softcap=4.0, label_smoothing=0.1),
]


@pytest.mark.parametrize("opts", OPTION_SETS)
def test_onednn_slices_match_oracle(opts):
    """Three vocabulary slices, the last partial, with bias and class weights, several token
    chunks."""
    V = 2 * ONEDNN_SLICE + 37
    fn = tuned(chunk_bytes=11 * V * 4)
    e, c, t, b = make_linear_inputs((4, 9), 40, V, bias=True, ignore_frac=0.2)
    check_against_oracle(
        e, c, t, b, weight=make_weight(V), fn=lambda *a, **k: fn(*a, impl="torch", **k), **opts
    )


def test_onednn_natural_slice_size():
    """The default slice size over a vocabulary of two full slices and a partial one."""
    V = 2 * ONEDNN_SLICE + 37
    e, c, t, b = make_linear_inputs((3, 10), 32, V, bias=True, ignore_frac=0.1)
    check_against_oracle(e, c, t, b)


@pytest.mark.parametrize("opts", OPTION_SETS)
def test_onednn_agrees_with_torch_mm(opts):
    """Same results (to fp32 summation order) with the GEMMs in oneDNN and in torch.mm."""
    if not use_onednn(torch.ones(1)):
        pytest.skip("oneDNN not available")
    e, c, t, b = make_linear_inputs((4, 30), 48, 2500, bias=True, ignore_frac=0.1)
    got = run_with_upstream(cce_fn, e, c, t, b, seed=3, **opts)
    e.grad = c.grad = b.grad = None
    with torch.backends.mkldnn.flags(enabled=False):
        ref = run_with_upstream(cce_fn, e, c, t, b, seed=3, **opts)
    assert rel_err(got[0], ref[0]) <= 1e-5
    for name in ("e", "c", "bias"):
        assert rel_err(got[2][name], ref[2][name]) <= 1e-5, name


@pytest.mark.parametrize("V", [2000, 9000])
@pytest.mark.parametrize("flat_first", [True, False])
def test_filter_decision_first_block_unlike_the_rest(flat_first, V, monkeypatch):
    """Tokens near one hidden state (the same few classes dominate every row: most tiles
    filterable at filter_eps=2 / V) with some rows made flat (every tile kept). Flat first
    64-row block: the chunk is decided dense from that block alone; flat rows later: every block
    is examined and the chunk is filtered. Both stay within the oracle bounds (the filter's
    included). V = 9000 (70 whole vocabulary blocks): the first block's vote on a sample of them."""
    fn = tuned(chunk_bytes=200 * V * 4)  # one chunk of all 200 tokens
    decisions = []
    kept_tiles = chunked.kept_tiles

    def spy(pb, *args):
        keep = kept_tiles(pb, *args)
        decisions.append(keep is None)
        return keep

    monkeypatch.setattr(chunked, "kept_tiles", spy)
    gen = torch.Generator().manual_seed(4)
    e, c, t, b = make_linear_inputs((2, 100), 48, V, bias=True, generator=gen, scale=20.0, ignore_frac=0.0)
    with torch.no_grad():
        E = e.view(-1, 48)
        E.copy_(E[0] + 0.1 * E)
        E[slice(0, 64) if flat_first else slice(64, 100)] *= 0.02  # logits ~ N(0, 0.4^2)
    # eps 2 / V: the flat rows' probabilities (about 1 / V each) reach it in every tile.
    check_against_oracle(e, c, t, b, filter_eps=2.0 / V, fn=lambda *a, **k: fn(*a, impl="torch", **k))
    assert decisions == [flat_first]


# Which dense part reaches the gradient products: the chunked forward's (mean), the backward's
# recompute (per-token upstream gradients) and the entropy's term (a gradient on the entropy).
SUBNORMAL_CASES = {
    "forward": dict(reduction="mean"),
    "recompute": dict(reduction="none"),
    "entropy": dict(reduction="none", return_entropy=True),
}


@pytest.mark.parametrize("case", list(SUBNORMAL_CASES))
def test_peaked_logits_reach_the_products_without_subnormals(case, monkeypatch):
    """Logits ~ N(0, 20^2) put a large share of fp32 softmax entries below 2^-126 (a GEMM with
    subnormal operands runs on the CPU's slow path, 9 s against 0.25 s measured): every dense
    part handed to the gradient products has none, and the gradients match the fp64 oracle
    within test_linear's bounds (the entries zeroed, below chunked.P_FLOOR, are below fp32's
    rounding of any gradient)."""
    seen = []
    grads = chunked.ChunkedProblem.grads

    def spy(self, ec, tc, P, *a, **k):
        if P.dtype == torch.float32:  # (fp64, as the entropy case's reference, keeps them)
            seen.append(int(((P != 0) & (P.abs() < 2.0**-126)).sum()))
        return grads(self, ec, tc, P, *a, **k)

    monkeypatch.setattr(chunked.ChunkedProblem, "grads", spy)
    g = torch.Generator().manual_seed(3)
    N, D, V = 24, 16, 600
    e = (torch.randn(N, D, generator=g) * 5.0).requires_grad_()
    c = torch.randn(V, D, generator=g).requires_grad_()
    t = torch.randint(0, V, (N,), generator=g)
    with torch.no_grad():
        p = torch.softmax(e @ c.T, 1)
    assert float(((p > 0) & (p < 2.0**-126)).float().mean()) > 0.05  # the precondition
    opts = SUBNORMAL_CASES[case]
    if case == "entropy":
        out = cce_fn(e, c, t, filter_eps=None, **opts)
        (out.loss.sum() + 0.1 * out.entropy.sum()).backward()
        ref_e, ref_c = e.detach().double().requires_grad_(), c.detach().double().requires_grad_()
        r = cce_fn(ref_e, ref_c, t, filter_eps=None, **opts)
        (r.loss.sum() + 0.1 * r.entropy.sum()).backward()
        assert rel_err(e.grad, ref_e.grad) < 1e-5 and rel_err(c.grad, ref_c.grad) < 1e-5
    else:
        check_against_oracle(e, c, t, None, filter_eps=None, **opts)
    assert seen and all(n == 0 for n in seen)


def test_16bit_inputs_filter_with_fp32s_threshold():
    """impl="torch" resolves filter_eps="auto" for bf16 / fp16 inputs to fp32's threshold
    (options.TORCH_IMPL_16BIT_EPS): on near-uniform logits bf16's 2^-8 would skip every tile,
    leaving the rank-1 corrections alone (6.2e-2 dE error measured at 2048 x 256 x 32000); here
    the default's gradients are the exact path's."""
    from cce.options import TORCH_IMPL_16BIT_EPS

    g = torch.Generator().manual_seed(4)
    e = (torch.randn(40, 16, generator=g) * 0.05).to(torch.bfloat16).requires_grad_()
    c = torch.randn(700, 16, generator=g).to(torch.bfloat16).requires_grad_()
    t = torch.randint(0, 700, (40,), generator=g)
    assert cce.explain(e, c, t, impl="torch").filter_eps == TORCH_IMPL_16BIT_EPS
    out = []
    for eps in ("auto", None):
        e.grad = c.grad = None
        cce_fn(e, c, t, filter_eps=eps).backward()
        out.append((e.grad.clone(), c.grad.clone()))
    assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1])
