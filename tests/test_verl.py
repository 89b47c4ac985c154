"""cce.verl.linear_cross_entropy against the semantics of verl's fused kernel, materialized.

verl's kernel itself needs CUDA and verl's dependencies; its documented semantics are the
reference here: fp32 log-probabilities and entropies of softmax(hidden @ weight.T / T), hidden
flattened to tokens, logprobs reduced by "sum" / "mean", the entropy per token. The
vocabulary-parallel form (dist_process_group) runs in tests/distributed ("api_verl").
"""

from __future__ import annotations

import inspect
import zlib

import pytest
import torch

import cce.verl

# fp64 inputs: the portable path computes in fp64, so the outputs and gradients agree with the
# materialized fp64 reference to rounding.
TOL64 = 1e-10
# fp32 inputs: both sides accumulate in fp32; log-probs of size ~10 carry a few ulp of it.
TOL32 = 2e-5


def _reference(hidden, weight, labels, temperature, reduction):
    logits = (hidden.reshape(-1, hidden.shape[-1]) @ weight.T) / temperature
    logp = torch.log_softmax(logits, -1)
    lab = labels.reshape(-1)
    valid = lab != -100
    lp = logp.gather(-1, lab.clamp(min=0)[:, None]).squeeze(-1) * valid
    ent = -(logp.exp() * logp).sum(-1) * valid
    lp = {"none": lp, "sum": lp.sum(), "mean": lp.mean()}[reduction]
    return lp, ent


def test_signature_is_verls():
    params = inspect.signature(cce.verl.linear_cross_entropy).parameters
    assert list(params) == ["hidden", "weight", "labels", "temperature", "reduction", "dist_process_group"]
    assert params["temperature"].default == 1.0
    assert params["reduction"].default == "none"
    assert params["dist_process_group"].default is None


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.3])
def test_matches_materialized(dtype, reduction, temperature):
    g = torch.Generator().manual_seed(zlib.crc32(f"{dtype}{reduction}{temperature}".encode()))
    B, S, D, V = 2, 7, 24, 50
    hidden = (torch.randn(B, S, D, generator=g) * 0.7).to(dtype)
    weight = torch.randn(V, D, generator=g).to(dtype)
    labels = torch.randint(0, V, (B, S), generator=g)
    labels[1, 2] = -100
    tol = TOL64 if dtype == torch.float64 else TOL32
    outs, grads = [], []
    for fn in (cce.verl.linear_cross_entropy, _reference):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        lp, ent = fn(h, w, labels, temperature, reduction)
        assert lp.dtype == ent.dtype == torch.promote_types(dtype, torch.float32)
        assert ent.shape == (B * S,) and lp.shape == (() if reduction != "none" else (B * S,))
        gu = torch.Generator().manual_seed(5)
        up_lp = torch.randn(lp.shape, generator=gu, dtype=lp.dtype)
        up_ent = torch.randn(ent.shape, generator=gu, dtype=ent.dtype)
        ((lp * up_lp).sum() + (ent * up_ent).sum()).backward()
        outs.append((lp.detach(), ent.detach()))
        grads.append((h.grad, w.grad))
    for a, b in zip(outs[0] + grads[0], outs[1] + grads[1], strict=True):
        torch.testing.assert_close(a, b, atol=tol, rtol=tol)


def test_bad_reduction_is_refused():
    h, w = torch.randn(3, 4), torch.randn(5, 4)
    with pytest.raises(ValueError, match="reduction must be one of"):
        cce.verl.linear_cross_entropy(h, w, torch.zeros(3, dtype=torch.long), 1.0, "avg")
