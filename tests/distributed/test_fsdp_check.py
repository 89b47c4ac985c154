"""bench/fsdp_check.py (FSDP2 training of a patched HF model vs one device) on CPU: the module run by
torchrun in 2 gloo processes, a tiny fp32 Llama, a few steps. Checked: it passes with the
global-token weighting (losses and step-0 gradients within its tolerances, the loss falls), and it
fails when each rank takes its own mean over unequal token counts (the weighting error the check
exists to catch). Also bench/dist.py (vocabulary parallelism) the same way, at its tiny shape."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")

from bench.fsdp_check import GRAD_TOL_FP32, TINY, CheckConfig, counted, global_batch  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
STEPS = 6


def _torchrun(out: Path, *extra: str, module: str = "bench.fsdp_check") -> tuple[int, dict, str]:
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")  # fmt: skip
    args = ["--tiny", "--steps", str(STEPS)] if module == "bench.fsdp_check" else []
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", module, "--device", "cpu", *args, "--out", str(out), *extra]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    log = proc.stdout + proc.stderr
    path = out / ("fsdp_check.json" if module == "bench.fsdp_check" else "dist_check.json")
    assert path.exists(), log[-4000:]
    return proc.returncode, json.loads(path.read_text()), log


def test_batches_weight_ranks_unequally():
    cfg = CheckConfig(size=TINY)
    ids, labels = global_batch(cfg, 3)
    again_ids, again_labels = global_batch(cfg, 3)
    assert torch.equal(ids, again_ids) and torch.equal(labels, again_labels)
    assert ids.shape == (TINY.batch, TINY.seq) and 0 <= int(ids.min()) and int(ids.max()) < TINY.vocab
    half = TINY.batch // 2
    assert counted(labels) == counted(labels[:half]) + counted(labels[half:]) > 0
    # Rank 0's share of the counted tokens at step 0 (where the gradients are compared) is far from
    # 1/2: a per-rank mean would weight the ranks' tokens unequally.
    labels0 = global_batch(cfg, 0)[1]
    assert abs(counted(labels0[:half]) / counted(labels0) - 0.5) > 0.1


def test_fsdp_check_passes_on_gloo(tmp_path):
    rc, result, log = _torchrun(tmp_path)
    assert rc == 0, log[-4000:]
    assert result["passed"] and result["meta"]["world"] == 2 and result["meta"]["backend"] == "gloo"
    for r in result["per_rank"]:
        assert len(r["steps"]) == STEPS and r["loss_fell"]
        assert all(s["diff"] <= s["tol"] for s in r["steps"])
        assert r["grad_err_max"] <= GRAD_TOL_FP32 and r["grad_ok"]
    assert "PASSED: True" in log


def test_fsdp_check_flags_per_rank_mean(tmp_path):
    rc, result, log = _torchrun(tmp_path, "--per-rank-mean")
    assert rc == 1, log[-4000:]
    assert not result["passed"]
    # The weighting error is far above rounding (the ranks' token counts differ by ~10% or more).
    assert all(r["grad_err_max"] > 100 * GRAD_TOL_FP32 for r in result["per_rank"])


def test_dist_check_runs_on_gloo(tmp_path):
    """bench.dist on the CPU: the options check on uneven blocks passes, and the tiny shape's
    vocabulary-parallel step is as accurate as the one-device step (timings mean nothing here)."""
    args = ("--shapes", "tiny", "--impl", "torch", "--reps", "1", "--warmup", "0")
    rc, result, log = _torchrun(tmp_path, *args, module="bench.dist")
    assert rc == 0 and not result["errors"], log[-4000:]
    assert result["options_ok"] and len(result["per_rank"][0]["options"]) == 4
    assert [s["shape"] for s in result["summary"]] == ["tiny"] and result["summary"][0]["accurate"]
    assert "options check all ok: True" in log
