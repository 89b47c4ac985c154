"""A/B of two cce trees in one run: ``python -m bench.ab OTHER_TREE [--rounds 2]``.

For a change that must not move speed (a refactor), or to measure one that should: the headline
shapes (gemma2-2b and llama3-8b, N = 8192, bf16, zipf and random, every 17th target ignored)
timed for the cce in OTHER_TREE (a checkout, e.g. ``git worktree add /tmp/old REV``) and for this
one, each in its own process, alternating for ``--rounds`` rounds so that drift hits both alike.
Inputs come from this tree's bench.data, the same for both. Medians of
``triton.testing.do_bench``: fwd (no grad), fwd+bwd with the default options and with
``filter_eps=None``, the matmul floor, and the peak memory above the inputs of one default step.
One JSON line per (tree, round, case); the table of mean ratios new / old last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
KEYS = ("floor", "fwd", "fwdbwd", "exact", "peak_mb")


def _measure(cce, e0, c0, t) -> dict:
    """The timings and peak memory of one case (see the module docstring)."""
    import torch
    from triton.testing import do_bench

    e, c = e0.detach().clone().requires_grad_(), c0.detach().clone().requires_grad_()

    def fwd():
        with torch.no_grad():
            return cce.linear_cross_entropy(e0, c0, t)

    def step(**kw):
        cce.linear_cross_entropy(e, c, t, **kw).backward()

    def exact():
        step(filter_eps=None)

    row = dict(floor=do_bench(lambda: e0 @ c0.T, warmup=100, rep=500, return_mode="median"))
    row["fwd"] = do_bench(fwd, warmup=100, rep=500, return_mode="median")
    row["fwdbwd"] = do_bench(step, warmup=200, rep=1000, grad_to_none=[e, c], return_mode="median")
    row["exact"] = do_bench(exact, warmup=200, rep=1000, grad_to_none=[e, c], return_mode="median")
    e.grad = c.grad = None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    row["peak_mb"] = (torch.cuda.max_memory_allocated() - before) / 2**20
    return row


def worker(tree: str, label: str, rnd: int) -> None:
    sys.path.insert(0, tree)
    import torch

    import cce

    from .data import SHAPES, make_inputs

    assert Path(cce.__file__).resolve().is_relative_to(Path(tree).resolve()), cce.__file__
    for name in ("gemma2-2b", "llama3-8b"):
        N, D, V = 8192, *SHAPES[name][1:]
        for regime in ("zipf", "random"):
            e0, c0, t = make_inputs(N, D, V, regime, dtype=torch.bfloat16, device="cuda", seed=1)
            row = dict(tree=label, round=rnd, shape=name, regime=regime, **_measure(cce, e0, c0, t))
            print(json.dumps(row), flush=True)
            del e0, c0, t
            torch.cuda.empty_cache()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("other", help="the other tree (its cce/ is imported)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--worker", nargs=3, metavar=("TREE", "LABEL", "ROUND"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker[0], args.worker[1], int(args.worker[2]))
        return 0
    rows = []
    for rnd in range(1, args.rounds + 1):
        for label, tree in (("old", args.other), ("new", str(HERE))):
            cmd = [sys.executable, "-m", "bench.ab", args.other, "--worker", tree, label, str(rnd)]
            out = subprocess.run(cmd, cwd=HERE, env=dict(os.environ), capture_output=True, text=True)
            sys.stderr.write(out.stderr[-2000:])
            for line in out.stdout.splitlines():
                print(line, flush=True)
                rows.append(json.loads(line))
    print(f"{'shape':<10} {'data':<7} " + " ".join(f"{k:>17}" for k in KEYS[1:]) + "   (old -> new ms, MB)")
    for name in ("gemma2-2b", "llama3-8b"):
        for regime in ("zipf", "random"):
            cells = []
            for k in KEYS[1:]:
                o, n = (
                    statistics.mean(
                        r[k] for r in rows if (r["tree"], r["shape"], r["regime"]) == (x, name, regime)
                    )
                    for x in ("old", "new")
                )
                cells.append(f"{o:6.1f}->{n:6.1f} {n / o - 1:+.1%}")
            print(f"{name:<10} {regime:<7} " + " ".join(f"{c:>17}" for c in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
