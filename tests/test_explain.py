"""cce.explain: the plan a call would run, against the path the call then takes (the launchers
it calls, and with which threshold), over options, gradients asked for and both impls; nothing
runs while explaining."""

from __future__ import annotations

import pytest
import torch

import cce
import cce.ops.linear_ce.torch_impl as tim
from cce._dispatch import fused_chunk_bytes
from tests.helpers import make_linear_inputs

pytest.importorskip("triton")

# (options, tuning, which inputs require a gradient): every branch of the triton plan on CPU
# tensors under the interpreter (there the size and vocabulary rules are off: Tuning's None).
CASES = [
    ({}, {}, "ec"),
    ({"filter_eps": None}, {}, "ec"),
    ({"filter_eps": None, "reduction": "none"}, {}, "ec"),
    ({"filter_eps": 0.01}, {}, "ec"),
    ({"filter_eps": 2.0**-12}, {}, "ec"),
    ({"filter_eps": 0.01, "reduction": "sum"}, {"fused_chunk_bytes": 1 << 30}, "c"),
    ({"filter_eps": None, "shift": True}, {"fused_chunk_bytes": None}, "ec"),
    ({"filter_eps": 0.01}, {"sparse_min_flops": 1e30}, "ec"),
    ({"filter_eps": 0.01, "bias": True}, {}, "ecb"),
    ({"filter_eps": 0.01, "softcap": 5.0, "label_smoothing": 0.1}, {"fused": False}, "e"),
    ({"filter_eps": 0.01, "shift": True, "return_entropy": True}, {}, "ec"),
    ({"filter_eps": None, "return_lse": True}, {"fused": False}, "ec"),
    ({}, {}, ""),
]


def _inputs(opts, grads, dtype=torch.float32):
    opts = dict(opts)
    g = torch.Generator().manual_seed(len(str(opts)) + len(grads))
    e, c, t, b = make_linear_inputs((2, 12), 16, 70, dtype, bias=opts.pop("bias", False), generator=g)
    e.requires_grad_("e" in grads)
    c.requires_grad_("c" in grads)
    if b is not None:
        b.requires_grad_("b" in grads)
    return e, c, t, b, opts


def _spy(monkeypatch):
    """The triton launchers the call reaches: ("fused", bytes of q per chunk) or ("fwd",
    filter_eps, stats)."""
    import cce.ops.linear_ce.triton_impl as ti

    seen = []
    fused, fwd = ti.linear_ce_triton_fused, ti.linear_ce_triton_fwd
    monkeypatch.setattr(ti, "linear_ce_triton_fused", lambda *a: seen.append(("fused", a[14])) or fused(*a))
    monkeypatch.setattr(ti, "linear_ce_triton_fwd", lambda *a: seen.append(("fwd", a[11], a[12])) or fwd(*a))
    return seen


@pytest.mark.parametrize("opts,tuning,grads", CASES)
def test_explain_triton_matches_the_path_taken(opts, tuning, grads, monkeypatch):
    e, c, t, b, opts = _inputs(opts, grads)
    o = cce.CCEOptions(**opts, impl="triton", tuning=cce.Tuning(**tuning))
    seen = _spy(monkeypatch)
    plan = cce.explain(e, c, t, b, impl="triton", tuning=cce.Tuning(**tuning), **opts)
    assert seen == []  # nothing ran
    assert plan.impl == "triton" and plan.reasons and str(plan).startswith("impl='triton'")
    out = cce.linear_cross_entropy_with_options(e, c, t, b, None, o)
    loss = out.loss if isinstance(out, cce.LossOutputs) else out[0] if isinstance(out, tuple) else out
    if grads:
        loss.sum().backward()
    first = seen[0]
    if plan.backward == "fused":
        # the chunk the op runs is the plan's (cce.Tuning's fused_chunk_bytes)
        assert first == ("fused", plan.chunk_bytes) and plan.filter_eps == 0 and plan.chunks >= 1
        size = cce.Tuning(**tuning).fused_chunk_bytes
        if size is None:  # sized to the memory target (cce/_dispatch.py, fused_chunk_bytes)
            n, (V, D) = t.numel() - 2 * opts.get("shift", False), c.shape
            grads = (e.requires_grad, c.requires_grad, False)
            size = fused_chunk_bytes(cce.Tuning(**tuning), (n, V, D), 4, grads)
            assert any("the memory target" in r for r in plan.reasons), plan
        assert plan.chunk_bytes == size
        assert any(f"{plan.chunks} chunk(s) of" in r for r in plan.reasons), plan
    else:
        assert first[0] == "fwd" and plan.chunks == 0 and plan.chunk_bytes == 0
        assert first[2] == (plan.backward == "sparse")  # the tile statistics
        assert (first[1] == 0) == (plan.backward == "exact")
        if plan.backward == "sparse":
            assert first[1] == plan.filter_eps > 0


@pytest.mark.parametrize(
    "opts,grads,want",
    [
        ({}, "ec", "chunked-forward"),
        ({"reduction": "none"}, "ec", "chunked"),
        ({"return_lse": True}, "c", "chunked"),
        ({"filter_eps": None}, "e", "chunked-forward"),
        ({}, "", "chunked"),
    ],
)
def test_explain_torch_matches_the_path_taken(opts, grads, want, monkeypatch):
    e, c, t, b, opts = _inputs(opts, grads)
    seen = []
    real = tim.linear_ce_torch_fwd
    monkeypatch.setattr(tim, "linear_ce_torch_fwd", lambda *a: seen.append((a[11], a[12])) or real(*a))
    plan = cce.explain(e, c, t, b, impl="torch", **opts)
    assert seen == [] and plan.impl == "torch" and plan.backward == want
    cce.linear_cross_entropy(e, c, t, b, impl="torch", **opts)
    eps, precompute = seen[0]
    assert precompute == (plan.backward == "chunked-forward")
    assert eps == plan.filter_eps  # CPU tensors: the threshold the filter uses


def test_explain_plain_user_call():
    """A new user's call: the default options on CPU tensors, printed."""
    e, c, t, _, _ = _inputs({}, "ec")
    text = str(cce.explain(e, c, t))
    assert text.splitlines()[0] == "impl='torch', backward='chunked-forward', filter_eps=9.54e-07"
    assert "skipped" in text


def test_explain_refusals():
    """The call's own validation: a bad option, mismatched shapes."""
    e, c, t, _, _ = _inputs({}, "ec")
    with pytest.raises(ValueError):
        cce.explain(e, c, t, reduction="avg")
    with pytest.raises(ValueError):
        cce.explain(e, c[:, :8], t)


def test_explain_vocabulary_parallel_block():
    """With a process group: this rank's block (c) as a one-device problem with per-token
    upstream gradients, so never the fused path (no group traffic while explaining; the plan
    against the path the block's op takes: tests/distributed, w1_explain)."""
    e, c, t, _, _ = _inputs({}, "ec")
    plan = cce.explain(e, c[:30], t, impl="triton", filter_eps=None, process_group=object())
    assert plan.backward == "exact" and plan.reasons[0].startswith("vocabulary parallelism")
    assert "30 classes" in plan.reasons[0]


# (tuning, which inputs require a gradient, rows): every part of the sparse backward's slab plan
# (the first-order terms a candidate in the first four; 4 rows: their cost above the one slab's).
SLAB_CASES = [
    ({}, "ec", 16),
    ({}, "e", 16),
    ({"dense_slab_bytes": 1}, "ec", 16),
    ({"slab_error": 1.0}, "c", 16),
    ({}, "ec", 4),
    ({"dense_slab_bytes": 1, "first_order": False}, "ec", 16),
    ({"slab_error": 1.0, "slab_error_dc": 1.0}, "ec", 16),
    ({"dense_slabs": False}, "ec", 16),
    ({"dense_kept": 2.0, "slab_error": 1.0, "slab_error_dc": 1.0}, "ec", 16),
]


@pytest.mark.parametrize("tuning,grads,rows", SLAB_CASES)
def test_explain_slab_plan_is_the_sparse_backwards(tuning, grads, rows, monkeypatch):
    """The sparse backward's host-side plan (dense slabs' width, which parts of the rule run,
    the first-order terms' candidacy) that cce.explain shows is the one the backward then runs
    with: the rule's inputs it passes (slab width, first-order cost, dC's estimates) and whether
    it measures the corrections' errors at all; the dense slabs' row blocks at most the plan's."""
    import cce.ops.linear_ce.kernels.backward_sparse as KS
    import cce.ops.linear_ce.triton_backward as tb

    seen = {}
    flags, errors, run = tb.dense_slab_flags, tb.slab_errors, KS.DenseSlabRun

    def spy_flags(code, keep, n_valid, BN, tps, kept, err, errs, cost, **kw):
        seen["flags"] = (tps, cost, errs is not None)
        return flags(code, keep, n_valid, BN, tps, kept, err, errs, cost, **kw)

    def spy_errors(*a, **kw):
        seen["dc"] = kw["vscore"] is not None
        return errors(*a, **kw)

    def spy_run(*a, **kw):
        r = run(*a, **kw)
        seen["blocks"] = r.n_blocks
        return r

    monkeypatch.setattr(tb, "dense_slab_flags", spy_flags)
    monkeypatch.setattr(tb, "slab_errors", spy_errors)
    monkeypatch.setattr(KS, "DenseSlabRun", spy_run)
    g = torch.Generator().manual_seed(5)
    e, c, t, _ = make_linear_inputs((2, rows // 2), 16, 100, torch.float32, generator=g)
    e.requires_grad_("e" in grads)
    c.requires_grad_("c" in grads)
    kw = dict(impl="triton", filter_eps=0.01, tuning=cce.Tuning(**tuning))
    plan = cce.explain(e, c, t, **kw)
    assert plan.backward == "sparse" and plan.slabs is not None
    sp = plan.slabs
    assert set(sp.reasons) <= set(plan.reasons) and len(sp.reasons) == (2 if sp.rule else 1)
    cce.linear_cross_entropy_with_options(e, c, t, None, None, cce.CCEOptions(**kw)).backward()
    if not sp.rule:
        assert seen == {}
        return
    assert seen["flags"] == (sp.tiles_per_slab, sp.first_order_cost, sp.measured)
    assert seen.get("blocks", 0) <= sp.row_blocks and f"at most {sp.row_blocks}" in sp.reasons[0]
    assert seen.get("dc", False) == sp.dc_rule and (not sp.dc_rule or sp.measured)
    assert sp.dc_rule == ("c" in grads and tuning.get("slab_error_dc", 0.0) < 1)
    idx = SLAB_CASES.index((tuning, grads, rows))
    assert (sp.first_order_cost is not None) == (idx < 4)
