"""What a Triton launch costs the host, by its arguments (``python -m bench.launch_cost``, CUDA).

Empty kernels launched back to back (each does nothing on the device, so the launch queue never
fills and the time is the host's), beside a torch op, a device allocation and the device context
cce's launchers enter. Median over 5 rounds of ``--n`` calls, microseconds per call. cce's
kernels take 3-41 runtime arguments, the most-launched heavy ones 30-41; docs/benchmarks.md
(issue 16, session 23) compares.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from cce.ops.launch import cached_launch


@triton.jit
def _one_arg(X, BLOCK: tl.constexpr):
    pass


@triton.jit
def _twelve_args(A, B, C, D, E, F, n0, n1, n2, n3, s0, s1, BLOCK: tl.constexpr, FLAG: tl.constexpr):
    pass


@triton.heuristics({"FLAG": lambda a: a["B"] is not None})
@triton.jit
def _twelve_args_heuristic(A, B, C, D, E, F, n0, n1, n2, n3, s0, s1, BLOCK: tl.constexpr, FLAG: tl.constexpr):
    pass


@triton.jit
def _thirty_four_args(
    A, B, C, D, E, F, G, H, I, J, K, L, M, N_, O, P, n0, n1, n2, n3, n4, n5, n6, n7, s0, s1, s2, s3,
    s4, s5, s6, s7, f0, f1, BLOCK: tl.constexpr, B1: tl.constexpr, B2: tl.constexpr, B3: tl.constexpr,
    W: tl.constexpr, S: tl.constexpr,
):  # fmt: skip
    pass


# The same kernels through cce's launch cache (cce/ops/launch.py).
_twelve_args_heuristic_cached = cached_launch(_twelve_args_heuristic)
_thirty_four_args_cached = cached_launch(_thirty_four_args)


def per_call_us(f: Callable[[], object], n: int, device: torch.device) -> float:
    for _ in range(200):
        f()
    torch.cuda.synchronize(device)
    rounds = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            f()
        rounds.append((time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize(device)
    return statistics.median(rounds)


def _in_context(device: torch.device) -> None:
    with torch.cuda.device(device):
        pass


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.launch_cost", description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=3000, help="calls per round")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.launch_cost needs a CUDA device")
        return 1
    dev = torch.device("cuda")
    t = [torch.empty(1024, device=dev) for _ in range(16)]
    six = dict(A=t[0], B=t[1], C=t[2], D=t[3], E=t[4], F=t[5])
    ints = dict(n0=1024, n1=7, n2=3, n3=5, s0=64, s1=128)
    big = {name: t[i] for i, name in enumerate("ABCDEFGHIJKLM")} | dict(N_=t[13], O=t[14], P=t[15])
    big |= {f"n{i}": 1000 + i for i in range(8)} | {f"s{i}": 64 * (i + 1) for i in range(8)}
    big |= dict(f0=1.5, f1=0.25, BLOCK=64, B1=32, B2=16, B3=8, W=4, S=2)
    cases = {
        "x.add_(1) (a torch op)": lambda: t[0].add_(1),
        "torch.empty(1024) on the device": lambda: torch.empty(1024, device=dev),
        "with torch.cuda.device(dev): pass": lambda: _in_context(dev),
        "empty kernel, 1 tensor + 1 constexpr": lambda: _one_arg[(1,)](t[0], BLOCK=64),
        "12 runtime args (6 tensors, 6 ints) + 2 constexpr, by keyword": lambda: _twelve_args[(1,)](
            **six, **ints, BLOCK=64, FLAG=True
        ),
        "the same through triton.heuristics (one flag)": lambda: _twelve_args_heuristic[(1,)](
            **six, **ints, BLOCK=64
        ),
        "the same with 3 tensors None": lambda: _twelve_args[(1,)](
            **(six | dict(B=None, C=None, E=None)), **ints, BLOCK=64, FLAG=False
        ),
        "34 runtime args (16 tensors, 16 ints, 2 floats) + 6 constexpr": lambda: _thirty_four_args[(1,)](
            **big
        ),
        "12 args through triton.heuristics, cce's cached launch": lambda: _twelve_args_heuristic_cached[(1,)](
            **six, **ints, BLOCK=64
        ),
        "34 args, cce's cached launch": lambda: _thirty_four_args_cached[(1,)](**big),
    }
    print(torch.__version__, triton.__version__, torch.cuda.get_device_name(dev))
    for name, f in cases.items():
        print(f"{per_call_us(f, args.n, dev):8.2f} us  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
