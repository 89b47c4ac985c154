"""Per-token outputs and the temperature on impl="triton" at real sizes, bf16 (make test-gpu); the
linear level, and the logits level at the end.

The reference is cce.reference.linear_cross_entropy_reference in fp64 from the *same* bf16
inputs, so the errors are the kernels' alone:

* outputs (lse, log-probabilities, entropy): the kernels' fp32 logits differ from the fp64 ones
  by at most delta = D u max_i ||e_i|| max_v ||c_v|| (fp32 accumulation of a D-term dot product,
  u = 2^-24), and an output moves with its logits by at most lse: 1, log-prob: 2, entropy:
  sum_v p_v |lse - H - z_v| <= 2 (|lse| + H + max|z|) times delta; the fp32 sums of the
  statistics (V terms) add (V + 8) u of the same magnitudes (tests/test_token_outputs.py).
* argmax: equal wherever the two largest fp64 logits are more than 2 delta apart.
* gradients of loss - 0.01 entropy.mean() + (u, logprobs) + (w, lse): the exact backward's bf16
  rounding of dZ and of dE / dC, within the "Speed and accuracy" error target (rel L2 <= 5e-3).
"""

from __future__ import annotations

import math

import pytest
import torch

import cce
import cce.reference
from bench.data import make_inputs
from bench.reference import rel_l2
from cce import linear_cross_entropy
from cce.reference import linear_cross_entropy_reference
from tests.helpers import captured_step

pytestmark = pytest.mark.gpu

U32 = 2.0**-24
ALL = dict(
    return_lse=True, return_logprobs=True, return_entropy=True, return_argmax=True, return_accuracy=True
)


def _objective(out, gen_seed: int):
    """loss - 0.01 entropy.mean() + (u, logprobs) + (w, lse) with seeded u, w ~ N(0, 1) / N."""
    g = torch.Generator(device=out.lse.device).manual_seed(gen_seed)
    n = out.lse.numel()
    u = torch.randn(out.lse.shape, generator=g, device=out.lse.device, dtype=torch.float64) / n
    w = torch.randn(out.lse.shape, generator=g, device=out.lse.device, dtype=torch.float64) / n
    return (
        out.loss.double()
        - 0.01 * out.entropy.double().mean()
        + (out.logprobs.double() * u).sum()
        + (out.lse.double() * w).sum()
    )


@pytest.mark.parametrize(
    "temperature,softcap,regime",
    [(1.0, None, "zipf"), (0.7, None, "zipf"), (0.7, 30.0, "random"), (1.6, None, "random")],
)
def test_outputs_and_gradients_bf16(temperature, softcap, regime):
    N, D, V = 2048, 1024, 32003  # odd V: the last tile's mask
    e, c, t = make_inputs(N, D, V, regime, dtype=torch.bfloat16, device="cuda", seed=11)
    t[::9] = -100
    kw = dict(temperature=temperature, softcap=softcap, **ALL)
    ee, cc = e.detach().requires_grad_(), c.detach().requires_grad_()
    got = linear_cross_entropy(ee, cc, t, impl="triton", **kw)
    ge, gc = torch.autograd.grad(_objective(got, 3), (ee, cc))
    e64, c64 = e.double().requires_grad_(), c.double().requires_grad_()
    ref = linear_cross_entropy_reference(e64, c64, t, dtype=torch.float64, **kw)
    re, rc = torch.autograd.grad(_objective(ref, 3), (e64, c64))

    with torch.no_grad():
        z = e.double() @ c.double().T
        if softcap:
            z = softcap * torch.tanh(z / softcap)
        z = z / temperature
        delta = D * U32 * float(e.double().norm(dim=1).max() * c.double().norm(dim=1).max()) / temperature
        lse, H, zmax = ref.lse.abs(), ref.entropy, z.abs().amax(1)
        sums = (V + 8) * U32 * 4 * (1 + lse + 2 * zmax)
        bounds = {"lse": delta + sums, "logprobs": 2 * delta + sums}
        bounds["entropy"] = 2 * (lse + H + zmax) * delta + sums
        for name, bound in bounds.items():
            err = (getattr(got, name).double() - getattr(ref, name)).abs()
            assert bool((err <= bound).all()), (name, float((err - bound).max()))
        top2 = z.topk(2, dim=1).values
        clear = (top2[:, 0] - top2[:, 1] > 2 * delta) & (t != -100)
        assert bool((got.argmax[clear] == ref.argmax[clear]).all())
        assert bool((got.argmax[t == -100] == -1).all())
        n_valid = float((t != -100).sum())  # accuracy is over the valid tokens
        assert abs(float(got.accuracy) - float(ref.accuracy)) <= float((~clear & (t != -100)).sum()) / n_valid
    assert rel_l2(ge.float(), re.float()) <= 5e-3
    assert rel_l2(gc.float(), rc.float()) <= 5e-3


@pytest.mark.parametrize(
    "temperature,softcap,regime,bias,shift",
    [
        (1.0, None, "zipf", True, False),  # a bias gradient: the pointer-load dZ kernel (dense_dz)
        (0.7, None, "random", False, True),  # no bias gradient: TMA dZ kernel + _dz_target_kernel
        (0.7, 30.0, "zipf", False, False),  # p_t ~ 0.9: the target entries' eta term weighs
        (1.6, 4.0, "zipf", False, False),  # softcap' ~ 0.03 on most classes, not on the targets
    ],
)
def test_entropy_gradient_alone_bf16(temperature, softcap, regime, bias, shift):
    """The gradient of (entropy, r) alone (r ~ N(0, 1) / N seeded) and the entropy's values, on
    impl="triton" against the fp64 oracle from the same bf16 inputs. dZ_v = r p_v (lse - H - z_v)
    softcap' / T = p_v (alpha + eta z_v) softcap' with alpha = r (lse - H) / T, eta = -r / T
    (cce/_math.py): the HAS_ETA branches of the dZ kernels and of _dz_target_kernel.

    Tolerance: dZ is rounded to bf16 once, then dE, dC, dbias once each (<= 2^-8 relative per
    entry, ~1.7e-3 rms). With random-sign r, dZ's roundings do not average down against a dE / dC
    entry: ~sqrt(2) 1.7e-3 (an fp64 simulation of both roundings at these sizes, CPU inputs:
    1.1e-3 .. 3.1e-3); the fp32 logits' error (~sqrt(D) u ||e|| ||c|| <= 3e-4) less. Hence the
    5e-3 target, as above.
    Sensitivity: without eta, dZ = p alpha softcap' is the gradient of ((r (lse - H)).detach()
    lse).sum(), asserted > 2 tol from the truth (0.4 .. 27 simulated), so a kernel dropping eta
    fails. Simulated, the target entry alone: its eta term dropped moves dE or dC by 6.7e-3 ..
    3.9 (cases 2-4); its softcap' without the temperature, or left out, by >= 0.5 at (1.6, 4.0)
    (only ~2e-3 at (0.7, 30.0): not seen there)."""
    N, D, V = 2048, 1024, 32003  # odd V: the last tile's mask
    e, c, t = make_inputs(N, D, V, regime, dtype=torch.bfloat16, device="cuda", seed=12)
    t[::9] = -100
    g = torch.Generator(device="cuda").manual_seed(8)
    b = torch.randn(V, generator=g, device="cuda").bfloat16() if bias else None
    r = torch.randn(N - shift, generator=g, device="cuda", dtype=torch.float64) / N
    kw = dict(temperature=temperature, softcap=softcap, shift=shift, return_entropy=True)
    xs = [x.detach().requires_grad_() for x in (e, c, b) if x is not None]
    got = linear_cross_entropy(*xs[:2], t, *xs[2:], impl="triton", **kw)
    grads = torch.autograd.grad((got.entropy.double() * r).sum(), xs)
    x64 = [x.double().requires_grad_() for x in (e, c, b) if x is not None]
    ref = linear_cross_entropy_reference(*x64[:2], t, *x64[2:], dtype=torch.float64, return_lse=True, **kw)
    want = torch.autograd.grad((ref.entropy * r).sum(), x64, retain_graph=True)
    no_eta = torch.autograd.grad(((r * (ref.lse - ref.entropy)).detach() * ref.lse).sum(), x64)
    tol = 5e-3
    for name, a, w, w0 in zip(("dE", "dC", "dbias")[: len(xs)], grads, want, no_eta, strict=True):
        assert rel_l2(w0, w) > 2 * tol, (name, rel_l2(w0, w))  # the test sees a missing eta
        assert rel_l2(a, w) <= tol, (name, rel_l2(a, w))

    with torch.no_grad():  # the entropy's values: the bound of test_outputs_and_gradients_bf16
        x = e.double() @ c.double().T + (b.double() if bias else 0.0)
        z = (softcap * torch.tanh(x / softcap) if softcap else x)[: N - shift] / temperature
        # Per logit: the fp32 D-term dot product, the bias's add (one rounding), the kernels' tanh.
        ne_nc = float(e.double().norm(dim=1).max() * c.double().norm(dim=1).max())
        b_max = float(b.abs().max()) if bias else 0.0
        delta = ((D + 1) * ne_nc + b_max + 4 * (softcap or 0.0)) * U32 / temperature
        lse, H, zmax = ref.lse.abs(), ref.entropy, z.abs().amax(1)
        bound = 2 * (lse + H + zmax) * delta + (V + 8) * U32 * 4 * (1 + lse + 2 * zmax)
        err = (got.entropy.double() - ref.entropy).abs()
        assert bool((err <= bound).all()), float((err - bound).max())


SPARSE = cce.Tuning(backward="sparse", sparse_min_flops=0, fused=False)


# The default tier runs the zipf case (kept tiles and dense slabs); the others in the thorough one.
@pytest.mark.parametrize(
    "regime,softcap",
    [
        ("zipf", None),
        pytest.param("random", None, marks=pytest.mark.slow),
        pytest.param("zipf", 30.0, marks=pytest.mark.slow),
        pytest.param("random", 5.0, marks=pytest.mark.slow),
    ],
)
@pytest.mark.parametrize("objective", ["bonus", "entropy"])
def test_entropy_gradient_sparse_bf16(regime, softcap, objective):
    """The sparse backward with the entropy's term (temperature 1, the filter on, dense slabs and
    their error rule as by default): loss - 0.01 entropy.mean(), and the entropy alone with a
    random-sign upstream r ~ N(0, 1) / N (where the entropy's gradient -r p (log p + H) sits in
    the tail, which the filter skips: the rule must keep what it leaves out within bounds),
    against the fp64 oracle from the same bf16 inputs: the 5e-3 target of the module docstring
    (the rule's own bound is 2.5e-3 of dE on sampled rows, plus bf16 rounding). With softcap (30,
    Gemma 2's; 5, where softcap' varies strongly) the codes' masses carry softcap', which the
    skipped tiles' mean logit accounts for (kernels.common.skipped_slog)."""
    N, D, V = 4096, 1024, 32003
    e, c, t = make_inputs(N, D, V, regime, dtype=torch.bfloat16, device="cuda", seed=13)
    t[::9] = -100
    g = torch.Generator(device="cuda").manual_seed(9)
    r = torch.randn(N, generator=g, device="cuda", dtype=torch.float64) / N

    def obj(out):
        if objective == "bonus":
            return out.loss.double() - 0.01 * out.entropy.double().mean()
        return (out.entropy.double() * r).sum()

    ee, cc = e.detach().requires_grad_(), c.detach().requires_grad_()
    opts = cce.CCEOptions(impl="triton", tuning=SPARSE, return_entropy=True, softcap=softcap)
    got = cce.linear_cross_entropy_with_options(ee, cc, t, None, None, opts)
    ge, gc = torch.autograd.grad(obj(got), (ee, cc))
    e64, c64 = e.double().requires_grad_(), c.double().requires_grad_()
    ref = linear_cross_entropy_reference(
        e64, c64, t, dtype=torch.float64, return_entropy=True, softcap=softcap
    )
    re, rc = torch.autograd.grad(obj(ref), (e64, c64))
    assert rel_l2(ge.float(), re.float()) <= 5e-3
    assert rel_l2(gc.float(), rc.float()) <= 5e-3


@pytest.mark.parametrize("temperature", [0.8, pytest.param(1.0, marks=pytest.mark.slow)])
def test_entropy_bonus_step_captures_and_compiles(temperature):
    """A training step of loss - 0.01 entropy.mean() (at a temperature: the exact backward; at 1,
    forced onto the sparse backward): no host synchronisation (CUDA graph capture and replay on
    new inputs equal eager), and torch.compile(fullgraph=True) traces it."""
    N, D, V = 1024, 512, 16000
    tuning = SPARSE if temperature == 1.0 else cce.Tuning()

    opts = cce.CCEOptions(impl="triton", temperature=temperature, return_entropy=True, tuning=tuning)

    def step(e, c, t):
        out = cce.linear_cross_entropy_with_options(e, c, t, None, None, opts)
        return out.loss - 0.01 * out.entropy.mean()

    loss, (e, c), (e2, c2, t2) = captured_step(step, (N, D, V), "zipf", 1)
    ee, cc = e2.clone().requires_grad_(), c2.clone().requires_grad_()
    want = step(ee, cc, t2)
    want.backward()
    assert torch.equal(loss, want.detach())
    assert torch.equal(e.grad, ee.grad) and torch.equal(c.grad, cc.grad)

    compiled = torch.compile(step, fullgraph=True)
    ee2, cc2 = e2.clone().requires_grad_(), c2.clone().requires_grad_()
    got = compiled(ee2, cc2, t2)
    got.backward()
    torch.testing.assert_close(got, want.detach())
    assert rel_l2(ee2.grad.float(), ee.grad.float()) <= 1e-6


@pytest.mark.parametrize("temperature,softcap", [(1.0, None), (0.7, 30.0)])
def test_logits_level_outputs_bf16(temperature, softcap):
    """cce.cross_entropy (logits level) on bf16 logits: every output against the fp64 oracle on
    the same logits (exact in fp32). The kernels' fp32 sums: a tree within each block of
    BLOCK_V classes (log2 BLOCK_V roundings) and a running sum over the blocks (one per block),
    so k = log2(BLOCK_V) + V / BLOCK_V + 8 units u in place of the CPU tests' (V + 8); the
    gradient (bf16, rounded once) within the 5e-3 target."""
    from cce.ops.cross_entropy.kernels import default_config

    N, V = 2048, 32003
    g = torch.Generator(device="cuda").manual_seed(4)
    x = (torch.randn(N, V, generator=g, device="cuda") * 3).bfloat16()
    t = torch.randint(0, V, (N,), generator=g, device="cuda")
    t[::9] = -100
    kw = dict(temperature=temperature, softcap=softcap, **ALL)
    xx = x.clone().requires_grad_()
    got = cce.cross_entropy(xx, t, impl="triton", **kw)
    (gx,) = torch.autograd.grad(_objective(got, 5), (xx,))
    x64 = x.double().requires_grad_()
    ref = cce.reference.cross_entropy_reference(x64, t, dtype=torch.float64, **kw)
    (rx,) = torch.autograd.grad(_objective(ref, 5), (x64,))
    with torch.no_grad():
        z = x.double()
        if softcap:
            z = softcap * torch.tanh(z / softcap)
        z = z / temperature
        block_v = default_config(torch.bfloat16, backward=False)[0]
        k = math.log2(block_v) + -(-V // block_v) + 8
        bound = 4 * k * U32 * (1 + ref.lse.abs() + 2 * z.abs().amax(1))
        if softcap:  # the kernels' tanh (exp2-based, a few roundings) moves each logit by ~4 u softcap / T
            bound = (
                bound + 2 * (ref.lse.abs() + ref.entropy + z.abs().amax(1)) * 4 * U32 * softcap / temperature
            )
        for name in ("lse", "logprobs", "entropy"):
            err = (getattr(got, name).double() - getattr(ref, name)).abs()
            assert bool((err <= bound).all()), (name, float((err - bound).max()))
        assert torch.equal(got.argmax, ref.argmax)
        assert float(got.accuracy) == float(ref.accuracy)
    assert rel_l2(gx.float(), rx.float()) <= 5e-3
