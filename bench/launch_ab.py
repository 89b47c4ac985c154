"""cce's launch cache against Triton's own launch path, in one process (``python -m bench.launch_ab``).

One rank's half step (``bench.host_parts``'s ``--which half``) is timed in interleaved rounds,
its launches going through the cache (cce/ops/launch.py) or, with ``CachedLaunch.launch``
swapped for a pass-through to the wrapped Triton kernel for the round and restored afterwards,
through Triton's path. The kernels and their arguments are the same either way (same results);
what differs is the host's work per launch. Per round: the median host ms per step of steps
issued back to back, and ``do_bench``'s median.

    python -m bench.launch_ab --shapes llama3-8b,gemma2-2b --rounds 4
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import torch

from cce.ops.launch import CachedLaunch

from .host_parts import _step, step_walls


@contextmanager
def tritons_path() -> Iterator[None]:
    """Every cce launch through Triton's own path while active (CachedLaunch.launch restored
    on exit)."""
    cached = CachedLaunch.launch

    def plain(self, grid, kwargs):
        return self.kernel[grid](**kwargs)

    CachedLaunch.launch = plain
    try:
        yield
    finally:
        CachedLaunch.launch = cached


def host_ms(step, steps: int, device: torch.device, warmup: int = 5) -> float:
    """Median host ms per step, steps issued back to back (after ``warmup`` steps)."""
    for _ in range(warmup):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    walls = step_walls(step, steps)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return statistics.median(walls)


def compare(shape: str, rounds: int, steps: int, device: torch.device, warmup: int = 5) -> dict:
    """{"cache": [(host ms, do_bench ms)], "triton": [...]} over interleaved rounds (the order
    alternates; do_bench only on CUDA)."""
    step = _step(shape, "zipf", "half", device)
    out: dict = {"cache": [], "triton": []}
    for rnd in range(rounds):
        order = ("cache", "triton") if rnd % 2 == 0 else ("triton", "cache")
        for name in order:
            with tritons_path() if name == "triton" else nullcontext():
                h = host_ms(step, steps, device, warmup)
                db = float("nan")
                if device.type == "cuda":
                    from triton.testing import do_bench

                    db = float(do_bench(step, warmup=25, rep=200, return_mode="median"))
            out[name].append((h, db))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.launch_ab", description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="llama3-8b,gemma2-2b", help="bench.data shape names or NxDxV")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    for shape in args.shapes.split(","):
        res = compare(shape, args.rounds, args.steps, device)
        for name, v in res.items():
            hs = " ".join(f"{h:6.2f}" for h, _ in v)
            ds = " ".join(f"{d:6.2f}" for _, d in v)
            print(f"{shape} {name:7s} host ms/step {hs}   do_bench {ds}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
