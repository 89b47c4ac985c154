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


@pytest.mark.parametrize("flat_first", [True, False])
def test_filter_decision_first_block_unlike_the_rest(flat_first, monkeypatch):
    """Tokens near one hidden state (the same few classes dominate every row: most tiles
    filterable at filter_eps=1e-3) with some rows made flat (every tile kept). Flat first
    64-row block: the chunk is decided dense from that block alone; flat rows later: every block
    is examined and the chunk is filtered. Both stay within the oracle bounds (the filter's
    included)."""
    V = 2000
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
    check_against_oracle(e, c, t, b, filter_eps=1e-3, fn=lambda *a, **k: fn(*a, impl="torch", **k))
    assert decisions == [flat_first]
