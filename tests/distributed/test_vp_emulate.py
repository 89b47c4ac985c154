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
from bench.vp_emulate import block_targets, run_emulation, shares

INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"


def test_shares_and_block_targets():
    assert shares(7, 2) == [(0, 4), (4, 3)]
    assert shares(9, 3) == [(0, 3), (3, 3), (6, 3)]
    t = torch.tensor([0, 3, 4, 6, -100, 5])
    # Block [4, 7): in-block ids moved to 0..2, others to the stand-in 0, ignored kept.
    assert block_targets(t, 4, 3, -100).tolist() == [0, 0, 0, 2, -100, 1]


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
    assert "VP(1/2) ms" in capsys.readouterr().out
