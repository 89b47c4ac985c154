"""GPU tests of cce.cross_entropy (impl="triton" on CUDA, bf16 included). Run with `make test-gpu`."""

from __future__ import annotations

import pytest
import torch
from helpers import rel_err

from cce import CausalLMLoss, cross_entropy
from cce.reference import cross_entropy_reference

pytestmark = pytest.mark.gpu

# Loss and lse are fp32 sums (errors ~1e-6). The gradient is stored in the logits' dtype, so it can
# be no better than the exact gradient rounded once to that dtype (bf16: up to 2^-8 relative per
# element; fp16 also flushes entries below 6e-8, which dominates its error at large V): the bound
# is 1.5 x that rounding error, plus 1e-5 for fp32 accumulation.
LOSS_TOL = 2e-5


def grad_tol(ref: torch.Tensor, dtype: torch.dtype) -> float:
    return 1.5 * rel_err(ref.to(dtype), ref) + 1e-5


def _inputs(lead, V, dtype, ignore_frac=0.1, scale=3.0, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = (torch.randn(*lead, V, generator=g, device="cuda") * scale).to(dtype)
    t = torch.randint(0, V, lead, generator=g, device="cuda")
    t[torch.rand(lead, generator=g, device="cuda") < ignore_frac] = -100
    return x, t


def _check(x, t, dtype, *, inplace=False, seed=1, **kw):
    g = torch.Generator(device="cuda").manual_seed(seed)
    leaf = x.detach().clone().requires_grad_()
    xin = leaf * 1.0 if inplace else leaf
    out = cross_entropy(xin, t, impl="triton", inplace_backward=inplace, **kw)
    outs = out if isinstance(out, tuple) else (out,)
    ups = [torch.randn(o.shape, generator=g, device="cuda") for o in outs]
    (gx,) = torch.autograd.grad(sum((o * u).sum() for o, u in zip(outs, ups, strict=True)), xin)
    x64 = x.detach().double().requires_grad_()
    ref = cross_entropy_reference(x64, t, dtype=torch.float64, **kw)
    refs = ref if isinstance(ref, tuple) else (ref,)
    (gr,) = torch.autograd.grad(sum((o * u.double()).sum() for o, u in zip(refs, ups, strict=True)), x64)
    for o, r in zip(outs, refs, strict=True):
        assert o.dtype == torch.float32 and o.shape == r.shape
        assert rel_err(o.detach(), r.detach()) < LOSS_TOL
    assert gx.dtype == x.dtype and gx.shape == x.shape
    assert torch.isfinite(gx).all()
    assert rel_err(gx, gr) <= grad_tol(gr, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(
    "opts",
    [
        {},
        {"reduction": "sum", "softcap": 20.0},
        {"reduction": "none", "label_smoothing": 0.1, "z_loss": 1e-4, "return_lse": True},
        {"shift": True, "weight": "rand", "label_smoothing": 0.05},
    ],
)
def test_matches_oracle(dtype, opts):
    opts = dict(opts)
    x, t = _inputs((3, 170), 32003, dtype)  # odd V: tail blocks and unaligned rows
    if opts.get("weight") == "rand":
        opts["weight"] = torch.rand(32003, device="cuda") + 0.5
    _check(x, t, dtype, **opts)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_few_rows_split_vocab(dtype):
    x, t = _inputs((3,), 256000, dtype, ignore_frac=0.0)
    _check(x, t, dtype, label_smoothing=0.1, return_lse=True)


def test_inplace_and_strided_layouts():
    x, t = _inputs((5, 64), 50257, torch.bfloat16)
    _check(x, t, torch.bfloat16, inplace=True, shift=True)
    _check(x.transpose(0, 1), t.transpose(0, 1), torch.bfloat16, reduction="none")  # row-offset table
    _check(x.transpose(0, 1), t.transpose(0, 1), torch.bfloat16, inplace=True)
    _check(x[..., :40000], t.clamp(max=39999), torch.bfloat16, reduction="sum")  # row stride != V


def test_inplace_writes_logits_buffer():
    x, t = _inputs((256,), 128256, torch.bfloat16)
    leaf = x.clone().requires_grad_()
    y = leaf * 1.0
    ptr = y.data_ptr()
    loss = cross_entropy(y, t, inplace_backward=True)
    (g,) = torch.autograd.grad(loss, y)
    assert g.data_ptr() == ptr
    with pytest.raises(ValueError, match="leaf"):
        cross_entropy(leaf, t, inplace_backward=True)


def test_all_ignored_and_compile():
    x, t = _inputs((64,), 1000, torch.bfloat16)
    t[:] = -100
    xl = x.clone().requires_grad_()
    loss = cross_entropy(xl, t)
    loss.backward()
    assert loss.item() == 0.0 and xl.grad.abs().max().item() == 0.0
    x, t = _inputs((2, 64), 1000, torch.bfloat16)
    f = torch.compile(CausalLMLoss(), fullgraph=True)
    xl = x.clone().requires_grad_()
    loss = f(xl, t)
    ref = cross_entropy_reference(x, t, shift=True)
    assert rel_err(loss.detach(), ref) < LOSS_TOL
    loss.backward()
    assert torch.isfinite(xl.grad).all()


def test_int64_offsets_large():
    """N * V > 2^31: rows past element 2^31 must be read and written at the right place."""
    N, V = 8448, 256000
    x, t = _inputs((N,), V, torch.bfloat16, scale=1.0)
    xl = x.requires_grad_()
    loss = cross_entropy(xl, t, reduction="none")
    (g,) = torch.autograd.grad(loss.sum(), xl)
    for sl in (slice(0, 8), slice(N - 8, N)):
        xr = x.detach()[sl].double().requires_grad_()
        lr = cross_entropy_reference(xr, t[sl], dtype=torch.float64, reduction="none")
        (gr,) = torch.autograd.grad(lr.sum(), xr)
        assert rel_err(loss[sl].detach(), lr.detach()) < LOSS_TOL
        assert rel_err(g[sl], gr) <= grad_tol(gr, torch.bfloat16)
