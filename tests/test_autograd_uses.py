"""Every way autograd can be used over cce's losses, through every public entry point, at both
levels: the result is the materialized oracle's or a documented error, never a silent difference.

* a plain backward: the outputs and gradients of the fp64 oracle (cce.reference);
* retain_graph=True, then a second backward: the same gradients as the first, bit for bit
  (impl="torch"); with ``inplace_backward`` the first overwrote the saved logits, and the second
  is refused by autograd's version counter;
* create_graph=True (double backward): a RuntimeError naming it, raised when the backward is
  reached and before any of cce's backward ops runs; the graph stays usable for a plain backward;
* torch.func.grad and torch.func.vmap: a NotImplementedError naming torch.func, raised before any
  of cce's ops runs;
* activation checkpointing (a backward that recomputes a forward under grad mode): no refusal,
  the plain gradients.

float64 inputs (impl="torch") compute in float64, which lets torch.autograd.gradcheck check the
gradients at both levels. The logits level takes ``e @ c.T + bias`` as its logits, so every entry
point shares the linear oracle and differentiates to e, c and the bias.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.profiler import ProfilerActivity, profile

import cce
from cce.outputs import LossOutputs
from cce.reference import linear_cross_entropy_reference
from tests.helpers import examples, tuned

LINEAR = ("linear_cross_entropy", "LinearCrossEntropy", "linear_cross_entropy_with_options")
LOGITS = ("cross_entropy", "CrossEntropyLoss", "CausalLMLoss", "cross_entropy_with_options")
USES = ("backward", "retain_graph", "create_graph", "func_grad", "vmap")
FLOAT_OUTPUTS = ("loss", "lse", "logprobs", "entropy")

# Tolerances against the fp64 oracle, elementwise |got - ref| <= ATOL + RTOL |ref|.
# float64 inputs: every operation is in fp64 (u = 2^-53 ~ 1.1e-16) and differs from the oracle
# only in summation order (D <= 16 products per logit, V <= 48 terms per row sum) and in lse's
# formula, on terms of size <= ~30 (2 max|z| + log V + z-loss, logits of std ~1.5 divided by a
# temperature >= 0.7): a few hundred u of 30 at worst, ~1e-12; measured <= 5e-15 over 2600
# random problems. 1e-11 keeps a margin; a missing term or a wrong option is off by >= 1e-3.
TOL64 = dict(atol=1e-11, rtol=1e-11)
# float32 inputs (u = 2^-24 ~ 6e-8): the same sums in fp32, plus the loss' lse - target
# cancellation and the entropy's p z term on terms <= ~30: measured <= 3.3e-6 (gradients; outputs
# <= 1.3e-6) over 2600 random problems, ~50 u of unit-size values. Bound 1e-5.
TOL32 = dict(atol=1e-5, rtol=1e-5)


def _opts_for(entry: str, opts: dict) -> dict:
    """The options as the entry point takes them: CausalLMLoss fixes shift=True itself, the logits
    level has no filter_eps."""
    o = dict(opts)
    if entry == "CausalLMLoss":
        o.pop("shift")
    if entry in LOGITS:
        o.pop("filter_eps", None)
    return o


def _call(entry: str, e, c, t, b, w, opts: dict, inplace: bool):
    """The loss of ``entry`` on (e, c, t, bias b, class weights w); the logits level on the logits
    e @ c.T + b (an intermediate tensor, as ``inplace_backward`` needs)."""
    o = _opts_for(entry, opts)
    if entry == "linear_cross_entropy":
        return cce.linear_cross_entropy(e, c, t, b, weight=w, **o)
    if entry == "LinearCrossEntropy":
        return cce.LinearCrossEntropy(weight=w, **o)(e, c, t, b)
    if entry == "linear_cross_entropy_with_options":
        return cce.linear_cross_entropy_with_options(e, c, t, b, w, cce.CCEOptions(**o))
    logits = e @ c.T if b is None else e @ c.T + b
    if entry == "cross_entropy":
        return cce.cross_entropy(logits, t, weight=w, inplace_backward=inplace, **o)
    if entry == "CrossEntropyLoss":
        return cce.CrossEntropyLoss(w, inplace_backward=inplace, **o)(logits, t)
    if entry == "CausalLMLoss":
        return cce.CausalLMLoss(w, inplace_backward=inplace, **o)(logits, t)
    return cce.cross_entropy_with_options(logits, t, w, cce.CCEOptions(**o), inplace)


def _named(out) -> dict:
    """{name: tensor} of a call's result (a loss, (loss, lse) or a LossOutputs)."""
    if isinstance(out, LossOutputs):
        return {k: v for k, v in out._asdict().items() if v is not None}
    if isinstance(out, tuple):
        return {"loss": out[0], "lse": out[1]}
    return {"loss": out}


def _total(named: dict, seed: int):
    """sum_k <output_k, u_k> with seeded N(0, 1) upstream gradients u_k on the float outputs."""
    gen = torch.Generator().manual_seed(seed)
    total = 0.0
    for k in FLOAT_OUTPUTS:
        if k in named:
            x = named[k]
            total = total + (x * torch.randn(x.shape, generator=gen, dtype=torch.float64).to(x.dtype)).sum()
    return total


def _inputs(lead, D, V, dtype, bias, weighted, ignore, seed, std=1.5):
    gen = torch.Generator().manual_seed(seed)
    s = std**0.5 / D**0.25  # logits of standard deviation ~std
    e = (torch.randn(*lead, D, generator=gen, dtype=torch.float64) * s).to(dtype).requires_grad_()
    c = (torch.randn(V, D, generator=gen, dtype=torch.float64) * s).to(dtype).requires_grad_()
    b = (torch.randn(V, generator=gen, dtype=torch.float64) * 0.5).to(dtype).requires_grad_()
    b = b if bias else None
    w = (torch.rand(V, generator=gen, dtype=torch.float64) + 0.5).to(dtype) if weighted else None
    t = torch.randint(0, V, lead, generator=gen)
    t[torch.rand(lead, generator=gen) < ignore] = -100
    return e, c, t, b, w


def _oracle(e, c, t, b, w, opts: dict, seed: int):
    """The fp64 oracle's outputs and gradients w.r.t. (e, c, b) under _total's upstream."""
    leaves = [x.detach().double().requires_grad_() for x in (e, c) + ((b,) if b is not None else ())]
    eb = leaves[2] if b is not None else None
    o = {k: v for k, v in opts.items() if k not in ("impl", "filter_eps")}
    ref = _named(
        linear_cross_entropy_reference(
            leaves[0], leaves[1], t, eb, weight=None if w is None else w.double(), dtype=torch.float64, **o
        )
    )
    grads = torch.autograd.grad(_total(ref, seed), leaves)
    return {k: v.detach() for k, v in ref.items()}, grads


def _assert_matches(named: dict, grads, ref: dict, rgrads, tol: dict) -> None:
    assert set(named) == set(ref)
    for k, x in named.items():
        if k in ("argmax", "accuracy"):
            assert torch.equal(x.to(ref[k].dtype), ref[k]), k
        else:
            torch.testing.assert_close(x.detach().double(), ref[k], **tol, msg=lambda m, k=k: f"{k}: {m}")
    assert len(grads) == len(rgrads)
    for name, g, r in zip("ecb", grads, rgrads, strict=False):
        torch.testing.assert_close(g.double(), r, **tol, msg=lambda m, n=name: f"d{n}: {m}")


def _cce_ops(fn) -> tuple[object, set[str]]:
    """(what fn raised or returned, the names of cce's ops that ran meanwhile)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        try:
            result = fn()
        except Exception as ex:  # the caller asserts on it
            result = ex
    return result, {ev.name for ev in prof.events() if ev.name.startswith("cce::")}


def _check_use(entry, use, e, c, t, b, w, opts, inplace, seed, tol, bitwise: bool) -> None:
    """One autograd use of one entry point, against the oracle or the documented error."""
    if use == "func_grad":
        f = lambda x: _total(_named(_call(entry, x, c, t, b, w, opts, inplace)), seed)
        with pytest.raises(NotImplementedError, match="torch.func"):
            torch.func.grad(f)(e.detach())
        return
    if use == "vmap":
        f = lambda x: _named(_call(entry, x, c.detach(), t, None, w, opts, inplace))["loss"]
        with pytest.raises(NotImplementedError, match="torch.func"):
            torch.func.vmap(f)(torch.stack([e.detach(), e.detach()]))
        return

    leaves = [x for x in (e, c, b) if x is not None]
    ref, rgrads = _oracle(e, c, t, b, w, opts, seed)
    named = _named(_call(entry, e, c, t, b, w, opts, inplace))
    total = _total(named, seed)
    if use == "create_graph":
        with pytest.raises(RuntimeError, match=r"double backward \(create_graph=True"):
            torch.autograd.grad(total, leaves, create_graph=True)
        # Refused on arrival: the retained graph still gives the plain backward's gradients.
    grads = torch.autograd.grad(total, leaves, retain_graph=use == "retain_graph")
    _assert_matches(named, grads, ref, rgrads, tol)
    if use == "retain_graph":
        if inplace:  # the first backward wrote the gradient into the saved logits
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                torch.autograd.grad(total, leaves)
            return
        again = torch.autograd.grad(total, leaves)
        if bitwise:
            assert all(torch.equal(a, g) for a, g in zip(again, grads, strict=True))
        else:
            _assert_matches(named, again, ref, rgrads, tol)


@st.composite
def problems(draw):
    entry = draw(st.sampled_from(LINEAR + LOGITS))
    shift = entry == "CausalLMLoss" or draw(st.booleans())
    lead = (draw(st.integers(1, 2)), draw(st.integers(2, 6))) if shift else (draw(st.integers(1, 12)),)
    outputs = draw(st.sampled_from(["loss", "lse", "token"]))
    opts = dict(
        impl="torch",
        shift=shift,
        reduction=draw(st.sampled_from(["mean", "sum", "none"])),
        label_smoothing=draw(st.sampled_from([0.0, 0.1])),
        z_loss=draw(st.sampled_from([0.0, 1e-3])),
        softcap=draw(st.sampled_from([None, 3.0])),
        temperature=draw(st.sampled_from([1.0, 0.7])),
        return_lse=outputs == "lse",
        return_logprobs=outputs == "token",
        return_entropy=outputs == "token",
        return_argmax=outputs == "token",
    )
    dtype = draw(st.sampled_from([torch.float64, torch.float64, torch.float32]))
    sizes = (draw(st.integers(1, 16)), draw(st.integers(1, 48)))  # D, V
    flags = (draw(st.booleans()), draw(st.booleans()), draw(st.sampled_from([0.0, 0.3, 1.0])))
    inplace = entry in LOGITS and draw(st.booleans())
    use, seed = draw(st.sampled_from(USES)), draw(st.integers(0, 999))
    return entry, use, lead, sizes, dtype, flags, opts, inplace, seed


@settings(max_examples=examples(400, 100))
@given(problems())
def test_autograd_uses_torch(problem):
    """impl="torch": each entry point x options x autograd use gives the oracle's result or the
    documented error; a second backward repeats the first bit for bit."""
    entry, use, lead, (D, V), dtype, (bias, weighted, ignore), opts, inplace, seed = problem
    e, c, t, b, w = _inputs(lead, D, V, dtype, bias, weighted, ignore, seed)
    tol = TOL64 if dtype == torch.float64 else TOL32
    _check_use(entry, use, e, c, t, b, w, opts, inplace, seed, tol, bitwise=True)


# impl="triton" in the interpreter (seconds per kernel launch): a few tiny fp32 cases.
TRITON_CASES = [
    ("linear_cross_entropy", "backward", dict(reduction="mean")),
    ("linear_cross_entropy", "retain_graph", dict(reduction="none", return_lse=True, softcap=3.0)),
    ("LinearCrossEntropy", "retain_graph", dict(reduction="sum", label_smoothing=0.1)),
    ("linear_cross_entropy", "create_graph", dict(reduction="mean")),
    ("linear_cross_entropy", "func_grad", dict(reduction="mean")),
    ("linear_cross_entropy", "vmap", dict(reduction="mean")),
    ("cross_entropy", "retain_graph", dict(reduction="mean", z_loss=1e-3)),
    ("cross_entropy", "create_graph", dict(reduction="sum")),
    ("CrossEntropyLoss", "func_grad", dict(reduction="mean")),
]


@pytest.mark.parametrize(("entry", "use", "opts"), TRITON_CASES)
def test_autograd_uses_triton(entry, use, opts):
    """impl="triton", fp32, V <= 64: the oracle's result within fp32's tolerance (a second
    backward too, which may take another backward algorithm than the first), or the documented
    error."""
    e, c, t, b, w = _inputs((12,), 16, 40, torch.float32, False, False, 0.2, 5)
    opts = dict(impl="triton", shift=False, **opts)
    _check_use(entry, use, e, c, t, b, w, opts, False, 7, TOL32, bitwise=False)


GRADCHECK_OPTIONS = [
    dict(),
    dict(reduction="sum", label_smoothing=0.1, z_loss=1e-2),
    dict(reduction="none", softcap=3.0),
    dict(return_lse=True, temperature=0.7, label_smoothing=0.2, softcap=2.0),
    dict(reduction="none", return_logprobs=True, return_entropy=True),
]


@pytest.mark.parametrize("level", ["linear", "logits"])
@pytest.mark.parametrize("opts", GRADCHECK_OPTIONS)
def test_gradcheck(level, opts):
    """torch.autograd.gradcheck (finite differences in fp64, and its check that repeated backwards
    agree exactly) at both levels, with ignored rows, class weights and a bias."""
    e, c, t, b, w = _inputs((2, 4), 5, 11, torch.float64, True, True, 0.0, 3)
    t[0, 1] = t[1, 3] = -100

    def f(e, c, b):
        if level == "linear":
            out = cce.linear_cross_entropy(e, c, t, b, weight=w, impl="torch", **opts)
        else:
            out = cce.cross_entropy(e @ c.T + b, t, weight=w, impl="torch", **opts)
        return tuple(x for k, x in _named(out).items() if k in FLOAT_OUTPUTS)

    assert torch.autograd.gradcheck(f, (e, c, b))


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("level", ["linear", "logits"])
def test_refusals_run_no_op(impl, level):
    """torch.func.grad / vmap are refused before any of cce's ops runs; create_graph=True before
    any of its backward ops runs (the forward's op has run, and only it)."""
    e, c, t, b, w = _inputs((6,), 8, 24, torch.float32, True, False, 0.0, 1)
    entry = "linear_cross_entropy" if level == "linear" else "cross_entropy"
    opts = dict(impl=impl, shift=False)

    def loss(x, cc=c, bb=b):
        return _call(entry, x, cc, t, bb, w, opts, False)

    got, ran = _cce_ops(lambda: torch.func.grad(loss)(e.detach()))
    assert isinstance(got, NotImplementedError) and not ran
    got, ran = _cce_ops(lambda: torch.func.vmap(lambda x: loss(x, c.detach(), None))(e.detach()[None]))
    assert isinstance(got, NotImplementedError) and not ran
    out = loss(e)
    got, ran = _cce_ops(lambda: torch.autograd.grad(out, (e, c, b), create_graph=True))
    assert isinstance(got, RuntimeError) and "double backward" in str(got) and not ran


@pytest.mark.parametrize("reentrant", [True, False])
@pytest.mark.parametrize("level", ["linear", "logits"])
def test_activation_checkpointing_is_no_double_backward(reentrant, level):
    """torch.utils.checkpoint recomputes its forward under grad mode inside the backward; cce's
    backward still runs with grad mode off there (it is no create_graph=True) and gives the plain
    gradients."""
    e, c, t, b, _ = _inputs((6,), 8, 24, torch.float64, True, False, 0.2, 6)
    entry = "linear_cross_entropy" if level == "linear" else "cross_entropy"
    opts = dict(impl="torch", shift=False)
    f = lambda x: _call(entry, torch.tanh(x), c, t, b, None, opts, False)
    f(e).backward()
    plain, e.grad = e.grad, None
    torch.utils.checkpoint.checkpoint(f, e, use_reentrant=reentrant).backward()
    assert torch.equal(e.grad, plain)


def test_float64_dtypes():
    """float64 inputs: impl="torch" keeps the loss, lse and gradients in float64 (16-bit and fp32
    inputs keep fp32 results); the linear level's Triton kernels compute in fp32 (fp32 loss); the
    logits level's impl="triton" refuses float64 logits."""
    e, c, t, b, _ = _inputs((5,), 8, 20, torch.float64, True, False, 0.0, 2)
    for level in ("linear", "logits"):
        if level == "linear":
            loss, lse = cce.linear_cross_entropy(e, c, t, b, impl="torch", return_lse=True)
        else:
            loss, lse = cce.cross_entropy(e @ c.T + b, t, impl="torch", return_lse=True)
        assert loss.dtype == lse.dtype == torch.float64
        assert all(g.dtype == torch.float64 for g in torch.autograd.grad(loss, (e, c, b)))
    for dtype in (torch.float32, torch.bfloat16):
        x = e.detach().to(dtype)
        assert cce.linear_cross_entropy(x, c.detach().to(dtype), t, impl="torch").dtype == torch.float32
        assert cce.cross_entropy(x @ c.detach().to(dtype).T, t, impl="torch").dtype == torch.float32
    assert cce.linear_cross_entropy(e, c, t, b, impl="triton").dtype == torch.float32
    with pytest.raises(TypeError, match="float64"):
        cce.cross_entropy(e @ c.T, t, impl="triton")


@pytest.mark.parametrize("opts", [dict(), dict(return_lse=True, softcap=4.0), dict(reduction="none")])
@pytest.mark.parametrize("filter_eps", [None, 2.0**-6])
def test_second_backward_is_bitwise_over_chunks(opts, filter_eps):
    """fp32 on CPU over several token chunks, exact or with tiles filtered: a second and a third
    backward through a retained graph give the first one's gradients bit for bit, whether the
    forward computed them (reduction "mean" or "sum") or the backward recomputes them."""
    # Logits of std 16 over 8 vocabulary blocks of 128 and chunks of 2 to 4 rows: every row's
    # mass sits in one or two blocks, so most tiles are filtered at 2^-6.
    V = 1000
    e, c, t, b, _ = _inputs((3, 40), 24, V, torch.float32, True, False, 0.1, 4, std=16.0)
    fn = tuned(chunk_bytes=4 * V * 4)
    named = _named(fn(e, c, t, b, impl="torch", filter_eps=filter_eps, **opts))
    total = _total(named, 0)
    first = torch.autograd.grad(total, (e, c, b), retain_graph=True)
    second = torch.autograd.grad(total, (e, c, b), retain_graph=True)
    third = torch.autograd.grad(total, (e, c, b))
    assert all(torch.equal(x, y) and torch.equal(x, z) for x, y, z in zip(first, second, third, strict=True))
