"""Shared test utilities: inputs, an oracle comparison with random upstream gradients."""

from __future__ import annotations

import torch

from cce.reference import linear_cross_entropy_reference


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
    grads = torch.autograd.grad(total, inputs, allow_unused=True) if total.requires_grad else [None] * len(inputs)
    return loss.detach(), None if lse is None else lse.detach(), list(grads)


def compare_with_reference(fn, e, c, t, b, *, seed: int = 0, ref_dtype=torch.float64, **kw):
    """(impl, reference) triples of (loss, lse, grads) under the same random upstream gradients."""
    g1 = torch.Generator().manual_seed(seed)
    g2 = torch.Generator().manual_seed(seed)
    got = loss_and_grads(fn, e, c, t, b, generator=g1, **kw)
    ref = loss_and_grads(
        lambda *a, **k: linear_cross_entropy_reference(*a, dtype=ref_dtype, **k), e, c, t, b, generator=g2, **kw
    )
    return got, ref
