"""torch.compile and CUDA graphs with cce on a GPU (make test-gpu). Skipped without CUDA.

Eager and compiled runs call the same kernels (custom ops are opaque to the compiler), and a
replayed CUDA graph re-launches exactly the captured kernels. They can still differ by accumulation
order where a kernel accumulates with atomics: ~1e-7 relative in fp32, which a bf16 gradient
rounds to at most one ulp (2^-8) on a few elements. Bounds: fp32 1e-5; bf16 loss 1e-5 (fp32 loss),
bf16 gradients 4e-3 relative L2. A wrong or stale result (e.g. a replay that kept old inputs) is off
by O(1).
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

import cce
from tests.helpers import capture_step, rel_err, replay_on

pytestmark = pytest.mark.gpu

V, D = 32000, 1024


def _tol(dtype):
    return (1e-5, 1e-5) if dtype == torch.float32 else (1e-5, 4e-3)


def _inputs(N, dtype, *, bias=False, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    s = D**-0.25
    e = (torch.randn(N, D, device="cuda", generator=g) * s).to(dtype).requires_grad_()
    c = (torch.randn(V, D, device="cuda", generator=g) * s).to(dtype).requires_grad_()
    b = (torch.randn(V, device="cuda", generator=g) * 0.5).to(dtype).requires_grad_() if bias else None
    t = torch.randint(0, V, (N,), device="cuda", generator=g)
    t[::17] = -100
    return e, c, t, b


def _fwd_bwd(fn, e, c, t, b):
    for x in (e, c, b):
        if x is not None:
            x.grad = None
    loss = fn(e, c, t, b)
    loss.backward()
    return loss.detach().clone(), [x.grad.clone() for x in (e, c, b) if x is not None]


CASES = [
    (torch.bfloat16, dict(), False),
    (torch.bfloat16, dict(softcap=30.0, label_smoothing=0.1), True),
    (torch.float32, dict(z_loss=1e-4, reduction="sum"), False),
]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_compile_fullgraph_matches_eager(impl, case):
    dtype, opts, has_bias = CASES[case]
    e, c, t, b = _inputs(4096, dtype, bias=has_bias)

    def fn(e, c, t, b):
        return cce.linear_cross_entropy(e, c, t, b, impl=impl, **opts)

    tl, tg = _tol(dtype)
    ref_loss, ref_grads = _fwd_bwd(fn, e, c, t, b)
    compiled = torch.compile(fn, fullgraph=True)
    loss, grads = _fwd_bwd(compiled, e, c, t, b)
    assert rel_err(loss, ref_loss) <= tl
    for a, r in zip(grads, ref_grads, strict=True):
        assert rel_err(a, r) <= tg


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_cross_entropy_compile_fullgraph(impl):
    from cce import cross_entropy

    g = torch.Generator(device="cuda").manual_seed(1)
    z = (torch.randn(2, 2048, V, device="cuda", generator=g) * 2).bfloat16().requires_grad_()
    t = torch.randint(0, V, (2, 2048), device="cuda", generator=g)

    def fn(z, t):
        return cross_entropy(z, t, shift=True, impl=impl)

    def run(f):
        z.grad = None
        loss = f(z, t)
        loss.backward()
        return loss.detach(), z.grad.clone()

    l0, g0 = run(fn)
    l1, g1 = run(torch.compile(fn, fullgraph=True))
    assert rel_err(l1, l0) <= 1e-5
    assert rel_err(g1, g0) <= 4e-3


@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_graph_capture_and_replay(impl, dtype):
    """Forward + backward captured once, replayed on new data copied into the static inputs."""
    N = 2048
    e, c, t, _ = _inputs(N, dtype, seed=0)

    def fn(e, c, t):
        return cce.linear_cross_entropy(e, c, t, shift=False, impl=impl)

    graph, static_loss = capture_step(fn, e, c, t)
    static_de, static_dc = e.grad, c.grad

    tl, tg = _tol(dtype)
    for seed in (1, 2):
        e2, c2, t2, _ = _inputs(N, dtype, seed=seed)
        replay_on(graph, (e, c, t), (e2, c2, t2))
        ref_loss, (ref_de, ref_dc) = _fwd_bwd(lambda e, c, t, b: fn(e, c, t), e2, c2, t2, None)
        assert rel_err(static_loss, ref_loss) <= tl
        assert rel_err(static_de, ref_de) <= tg
        assert rel_err(static_dc, ref_dc) <= tg


SYNC_CASES = [
    dict(softcap=20.0),
    dict(label_smoothing=0.1),  # bias + smoothing without softcap: the unfolded smoothing terms
    dict(reduction="none", return_lse=True, z_loss=1e-4),
]


@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("case", range(len(SYNC_CASES)))
def test_no_host_sync_in_forward_backward(impl, case):
    """torch.cuda sync debug mode 'error' raises on any synchronizing call (.item(), .nonzero(), ...)."""
    opts = SYNC_CASES[case]
    e, c, t, b = _inputs(1024, torch.bfloat16, bias=True)

    def step():
        out = cce.linear_cross_entropy(e, c, t, b, impl=impl, **opts)
        loss = out[0].sum() + out[1].sum() if isinstance(out, tuple) else out.sum()
        loss.backward()

    step()  # warm-up (autotuning and lazy initialisation may synchronise)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
