"""Targets outside [0, V) that are not ignore_index never give a finite loss.

On the host (CPU tensors, or debug mode on an accelerator) they raise an IndexError before any
kernel runs (tests/test_validation.py). Where the check would need a host synchronisation (CUDA
tensors by default, any device while torch.compile traces) the device path of
cce._validation.guard_targets runs instead: the kernels read a class in [0, V) in the bad target's
place, and cce._math.nan_at_bad_targets makes the outputs that target feeds NaN. The device path
is chosen by the entry points' ``check_on_host`` argument, so the tests below run it on CPU
tensors (impl="torch" and the Triton interpreter); test_cuda_bad_targets_give_nan checks the real
CUDA call.

The rows a bad target does not feed must be untouched: the ops then receive the same targets as
a call with the substituted class, so those rows are compared bit for bit.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

import cce
from cce import _math
from cce._validation import guard_targets
from cce.ops.cross_entropy.api import _cross_entropy
from cce.ops.linear_ce.api import _linear_cross_entropy
from cce.options import CCEOptions

N_LEAD, V, D = (2, 4), 16, 8
NAN = float("nan")


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    e = (torch.randn(*N_LEAD, D, generator=g) * 0.5).requires_grad_()
    c = (torch.randn(V, D, generator=g) * 0.5).requires_grad_()
    t = torch.randint(0, V, N_LEAD, generator=g)
    t[0, 0] = -100
    return e, c, t


def _device_path(level: str, impl: str, e, c, t, weight=None, **kw):
    """The entry point's call with the device-side range check (check_on_host=False)."""
    opts = CCEOptions(impl=impl, **kw)
    if level == "linear":
        return _linear_cross_entropy(e, c, t, None, weight, opts, False)
    return _cross_entropy(e @ c.T, t, weight, opts, False, False)


def _host_path(level: str, impl: str, e, c, t, weight=None, **kw):
    if level == "linear":
        return cce.linear_cross_entropy(e, c, t, weight=weight, impl=impl, **kw)
    return cce.cross_entropy(e @ c.T, t, weight=weight, impl=impl, **kw)


# --------------------------------------------------------------------------------------------
# guard_targets and nan_at_bad_targets


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8])
def test_guard_targets_device_path(dtype):
    """Bad ids (negative, >= V) are replaced by the nearest class and marked; good ids and
    ignore_index pass unchanged; nothing raises. uint8 / int8 ids are compared as int64: a uint8
    156 is not ignore_index = -100 (which wraps to 156 in uint8 arithmetic)."""
    ids = [0, 5, V - 1, V, V + 5, -1, -101, -100, 100]
    if dtype == torch.uint8:
        ids = [0, 5, V - 1, V, V + 5, 156, 255]
    elif dtype == torch.int8:
        ids = [0, 5, V - 1, V, V + 5, -1, -100, 127, -128]
    t = torch.tensor(ids, dtype=dtype)
    safe, bad = guard_targets(t, V, -100, check_on_host=False)
    ref = torch.tensor(ids, dtype=torch.int64)
    want_bad = (ref != -100) & ((ref < 0) | (ref >= V))
    assert safe.dtype == torch.int64 and bad.dtype == torch.bool
    assert torch.equal(bad, want_bad)
    assert torch.equal(safe[~bad], ref[~bad])  # good ids and ignore_index unchanged
    assert bool(((safe[bad] >= 0) & (safe[bad] < V)).all())


def test_guard_targets_custom_ignore_index_outside_the_range():
    """An ignore_index >= V (or < -1) is not a bad target."""
    t = torch.tensor([3, V + 2, V, -7])
    safe, bad = guard_targets(t, V, V + 2, check_on_host=False)
    assert bad.tolist() == [False, False, True, True]
    assert safe.tolist()[:2] == [3, V + 2]


def test_guard_targets_host_path():
    """check_on_host: the targets come back as they are (no mask), or an IndexError names the bad
    ones. A uint8 id equal to ignore_index's wrapped value (156 for -100) is bad, not ignored."""
    t = torch.tensor([1, 2, -100])
    same, bad = guard_targets(t, V, -100, check_on_host=True)
    assert same is t and bad is None
    with pytest.raises(IndexError, match=rf"\[0, {V}\).*\[{V + 5}\]"):
        guard_targets(torch.tensor([1, V + 5]), V, -100, check_on_host=True)
    with pytest.raises(IndexError, match=r"\[156\]"):
        guard_targets(torch.tensor([1, 156], dtype=torch.uint8), V, -100, check_on_host=True)


def test_nan_at_bad_targets():
    """Per row: NaN at the bad rows only; 0-d: NaN if any row is bad; exact elsewhere (x * 1). The
    NaN reaches the gradient through x; without bad rows the gradient is exact."""
    bad = torch.tensor([False, True, False])
    x = torch.tensor([1.5, 2.0, -3.0], requires_grad=True)
    y = _math.nan_at_bad_targets(x, bad)
    assert torch.equal(torch.isnan(y), bad) and torch.equal(y[~bad], x.detach()[~bad])
    y.sum().backward()
    assert torch.equal(torch.isnan(x.grad), bad)
    s = torch.tensor(0.25, requires_grad=True)
    assert torch.isnan(_math.nan_at_bad_targets(s, bad))
    assert _math.nan_at_bad_targets(s, torch.zeros(3, dtype=torch.bool)).item() == 0.25
    assert _math.nan_at_bad_targets(s, torch.zeros(0, dtype=torch.bool)).item() == 0.25  # N = 0
    assert _math.nan_at_bad_targets(s, None) is s
    _math.nan_at_bad_targets(s, bad).backward()
    assert torch.isnan(s.grad)


# --------------------------------------------------------------------------------------------
# The entry points' device path, both levels, both implementations


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("level", ["linear", "logits"])
def test_device_path_loss_is_nan(level, impl, reduction):
    """One target at V + 5 (and one at -1 for "none"): a reduced loss is NaN, and so are dC and
    every non-ignored row of dE (a step from it is not finite either; an ignored row's gradient
    is 0 or NaN by implementation); per token, the bad rows are NaN and every other row equals,
    bit for bit, the call with the class the kernels read in their place."""
    e, c, t = _inputs()
    t[1, 2] = V + 5
    if reduction == "none":
        t[0, 3] = -1
    loss = _device_path(level, impl, e, c, t, reduction=reduction)
    safe, bad = guard_targets(t, V, -100, check_on_host=False)
    ref = _host_path(level, impl, e, c, safe, reduction=reduction)
    if reduction != "none":
        assert torch.isnan(loss)
        loss.backward()
        assert bool(torch.isnan(e.grad[t != -100]).all()) and bool(torch.isnan(c.grad).all())
        return
    assert torch.equal(torch.isnan(loss), bad)
    assert torch.equal(loss[~bad], ref.detach()[~bad])
    loss.sum().backward()
    assert bool(torch.isnan(e.grad[bad]).all()) and bool(torch.isfinite(e.grad[~bad]).all())


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("level", ["linear", "logits"])
def test_device_path_outputs(level, impl):
    """The per-token outputs a target feeds are NaN at the bad rows (log-probabilities) or
    altogether (accuracy); those it does not feed (lse, entropy, argmax) are those of the call
    with the substituted class. Class weights: the bad id never indexes the weight vector."""
    e, c, t = _inputs(1)
    t[1, 1] = V
    w = torch.rand(V) + 0.5
    kw = dict(
        reduction="none", weight=w, return_lse=True, return_logprobs=True, return_entropy=True,
        return_argmax=True, return_accuracy=True,
    )  # fmt: skip
    out = _device_path(level, impl, e, c, t, **kw)
    safe, bad = guard_targets(t, V, -100, check_on_host=False)
    ref = _host_path(level, impl, e, c, safe, **kw)
    for name in ("loss", "logprobs"):
        got, want = getattr(out, name).detach(), getattr(ref, name).detach()
        assert torch.equal(torch.isnan(got), bad), name
        assert torch.equal(got[~bad], want[~bad]), name
    for name in ("lse", "entropy", "argmax"):
        assert torch.equal(getattr(out, name).detach(), getattr(ref, name).detach()), name
    assert torch.isnan(out.accuracy)


@pytest.mark.parametrize("level", ["linear", "logits"])
def test_device_path_with_shift(level):
    """With shift the mask follows the rows: a bad id at position 0 (never a target) changes
    nothing; one at position 2 makes row 1 (which predicts it) NaN."""
    e, c, t = _inputs(2)
    t[:, 0] = V + 1
    loss = _device_path(level, "torch", e, c, t, reduction="none", shift=True)
    assert bool(torch.isfinite(loss).all())
    t[1, 2] = V + 1
    loss = _device_path(level, "torch", e, c, t, reduction="none", shift=True)
    assert torch.isnan(loss[1, 1]) and int(torch.isnan(loss).sum()) == 1


def test_compiled_call_takes_the_device_path():
    """While torch.compile traces, the host check is off on every device: the traced call takes
    the device path (no graph break), so a bad target gives NaN instead of an IndexError."""
    torch._dynamo.reset()
    try:
        fn = torch.compile(
            lambda e, c, t: cce.linear_cross_entropy(e, c, t, impl="torch"), backend="eager", fullgraph=True
        )
        e, c, t = _inputs(3)
        assert torch.isfinite(fn(e, c, t))
        t[0, 1] = V
        assert torch.isnan(fn(e, c, t))
    finally:
        torch._dynamo.reset()


@pytest.mark.gpu
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("level", ["linear", "logits"])
def test_cuda_bad_targets_give_nan(level, impl, reduction):
    """The real CUDA call (the device path by default): targets at V + 5 and -1 give a NaN loss
    (NaN rows with "none"), without any host synchronisation (checked by torch's sync debug mode
    after a warm-up call), and the other rows equal the call with the substituted class."""
    g = torch.Generator().manual_seed(0)
    N, Vc, Dc = 256, 1000, 64
    e = (torch.randn(N, Dc, generator=g) * 0.3).cuda().requires_grad_()
    c = (torch.randn(Vc, Dc, generator=g) * 0.3).cuda().requires_grad_()
    t = torch.randint(0, Vc, (N,), generator=g).cuda()
    t[7], t[100] = Vc + 5, -1
    safe, bad = guard_targets(t, Vc, -100, check_on_host=False)
    assert bad.sum().item() == 2

    def run(targets):
        if level == "linear":
            return cce.linear_cross_entropy(e, c, targets, impl=impl, reduction=reduction)
        return cce.cross_entropy(e @ c.T, targets, impl=impl, reduction=reduction)

    run(safe).sum().backward()  # warm-up (kernel compilation, lazy initialisation)
    e.grad = c.grad = None
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss = run(t)
        loss.sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    if reduction != "none":
        assert torch.isnan(loss).item()
        assert torch.isnan(c.grad).all().item()
        return
    ref = run(safe).detach()
    assert torch.equal(torch.isnan(loss), bad)
    assert torch.equal(loss.detach()[~bad], ref[~bad])
    assert torch.isnan(e.grad[bad]).all().item()
