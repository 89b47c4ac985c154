"""bench/vp_emulate.py (``python -m bench --vp-emulate K``) on CPU: a group of one rank (gloo), the
Triton interpreter, a tiny shape. Its timings mean nothing here; what is checked is that every
block runs, that the full-vocabulary call in the group of one gives the single-device gradients,
and that the JSON and table come out."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist

from bench.harness import Config, Shape
from bench.vp_emulate import rank_step, rest_lse, run_emulation, shares

INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"


def test_shares():
    assert shares(7, 2) == [(0, 4), (4, 3)]
    assert shares(9, 3) == [(0, 3), (3, 3), (6, 3)]


@pytest.mark.skipif(not INTERPRETING, reason="impl='triton' on CPU tensors needs the Triton interpreter")
@pytest.mark.parametrize("k", [2, 3])
def test_rank_steps_add_up_to_one_device(k):
    """The emulated ranks' steps are a real rank's work: their dE summed over the blocks and their
    dC rows equal the single-device gradients of the mean loss (fp32; the filter at fp32's
    2^-20 and the blocks' lse combine differ from one device by fp32 roundings, 1e-5 relative)."""
    import cce

    gen = torch.Generator().manual_seed(3)
    N, D, V = 24, 16, 131
    e = (torch.randn(N, D, generator=gen) / 2).requires_grad_()
    c = torch.randn(V, D, generator=gen)
    t = torch.randint(0, V, (N,), generator=gen)
    t[::5] = -100
    cf = c.clone().requires_grad_()
    dE1, dC1 = torch.autograd.grad(cce.linear_cross_entropy(e, cf, t, impl="triton"), (e, cf))
    dE = torch.zeros_like(dE1)
    for start, size in shares(V, k):
        cb = c[start : start + size].clone().requires_grad_()
        rest = rest_lse(e.detach(), c, t, start, size, -100)
        dEr, dCr = rank_step(e, cb, t, start, size, rest, -100)()
        dE += dEr
        assert float((dCr - dC1[start : start + size]).norm() / dC1[start : start + size].norm()) < 1e-5
    assert float((dE - dE1).norm() / dE1.norm()) < 1e-5


@pytest.mark.skipif(not INTERPRETING, reason="impl='triton' on CPU tensors needs the Triton interpreter")
def test_emulation_runs_on_cpu(tmp_path, capsys):
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    cfg = Config(
        shapes=[], providers=[], device="cpu", dtype=torch.float32, warmup_ms=0.0, rep_ms=0.0, min_reps=1
    )
    try:
        rc = run_emulation([Shape("tiny", 24, 16, 131)], ("random", "zipf"), 2, cfg, tmp_path)
    finally:
        dist.destroy_process_group()
    assert rc == 0
    (path,) = tmp_path.glob("vp_emulate_k2_*.json")
    rows = json.loads(path.read_text())["rows"]
    assert [r["regime"] for r in rows] == ["random", "zipf"]
    for r in rows:
        assert "error" not in r, r
        assert [b["V_local"] for b in r["blocks"]] == [66, 65]
        # fp32: the group of one and one device run the same kernels on the same tiles; only the
        # per-row coefficients' rounding differs (a few ulps).
        assert r["full_dE_vs_one"] < 1e-5 and r["full_dC_vs_one"] < 1e-5
        # the host ms of one call, for the single-GPU call and each block; the slowest block's
        assert r["one_host_ms"] > 0 and all(b["host_ms"] > 0 for b in r["blocks"])
        slowest = max(r["blocks"], key=lambda b: b["ms"])
        assert r["vp_host_ms"] == slowest["host_ms"] and r["vp_ms"] == slowest["ms"]
    out = capsys.readouterr().out
    assert "VP(1/2) ms" in out and "host ms one/VP" in out
