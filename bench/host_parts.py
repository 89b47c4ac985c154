"""Where a step's host time goes (``python -m bench.host_parts``): the host milliseconds of each
cce function and of each Triton kernel's launches, per step.

``bench.host`` gives a step's whole host time (issued while the device sleeps) and its op and
launch counts. This module splits the host time by function. Every function defined in ``cce``
(as each cce module binds it), ``RowOrder.__init__`` and ``from_order``, ``HostPeek.__init__`` /
``get`` and the launch entries (cce's ``CachedLaunch.launch``, cce/ops/launch.py, and Triton's
``JITFunction.run``; ``InterpretedFunction.run`` under TRITON_INTERPRET=1) are wrapped with
timers for the duration of the measurement, then restored. A function's time is
inclusive (its callees' time counts in it too) and taken at its outermost call only, so recursion
and nesting are not counted twice; a launch is counted only where no other launch encloses it.
On an H100 host the timers added 0.09-0.12 ms to a half step's 12.5-12.8 ms of host time
(docs/benchmarks.md, issue 16, session 23).

The steps are issued back to back, as ``triton.testing.do_bench`` issues them. So the device's
decisions (host gating, cce/ops/linear_ce/host_peek.py) arrive as they do in the benchmark:
rarely where host and device take about as long, often where the host is slower. On CUDA the
step's do_bench median and its unwrapped host time per step are printed first.

    python -m bench.host_parts --shape llama3-8b --data zipf --which half --steps 40

``--which half``: one rank's step on the first half of the head under a real rank's upstream
gradients (bench.vp_emulate.rank_step); ``one``: the same function on the whole head; ``vp``: the
vocabulary-parallel call itself (``linear_cross_entropy_vocab_parallel``, mean loss, gradients
of e and the rank's block), in a group of one rank, or under torchrun in the launched group
(NCCL on CUDA, each rank its own GPU), each rank printing its own parts: what a real rank's step
adds to the emulated half (the statistics' combine, the collectives, the call's own host work)::

    torchrun --nproc_per_node 2 -m bench.host_parts --shape llama3-8b --data zipf --which vp
"""

from __future__ import annotations

import argparse
import collections
import functools
import importlib
import json
import os
import pkgutil
import statistics
import sys
import time
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

import cce
from cce.distributed import linear_cross_entropy_vocab_parallel

from .data import SHAPES, make_inputs
from .vp_emulate import one_rank_group, rank_step, rest_lse, shares

_CLASS_METHODS = {"RowOrder": ("__init__", "from_order"), "HostPeek": ("__init__", "get")}


class Parts:
    """Seconds and calls per part name, accumulated while :func:`timed_parts` is active."""

    def __init__(self):
        self.seconds: collections.Counter = collections.Counter()
        self.calls: collections.Counter = collections.Counter()
        self._depth: collections.Counter = collections.Counter()

    def timer(self, name: str, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            self._depth[name] += 1
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth[name] -= 1
                if self._depth[name] == 0:
                    self.seconds[name] += time.perf_counter() - t0
                    self.calls[name] += 1

        return timed

    def launch_timer(self, run: Callable) -> Callable:
        @functools.wraps(run)
        def timed(kernel, *args, **kwargs):
            outer = self._depth["launch"] == 0
            self._depth["launch"] += 1
            t0 = time.perf_counter()
            try:
                return run(kernel, *args, **kwargs)
            finally:
                self._depth["launch"] -= 1
                if outer:
                    dt = time.perf_counter() - t0
                    fn = getattr(kernel, "fn", None) or getattr(getattr(kernel, "base", None), "fn", None)
                    name = getattr(fn, "__name__", "?")
                    for key in (f"launch:{name}", "launch:ALL"):
                        self.seconds[key] += dt
                        self.calls[key] += 1

        return timed

    def clear(self) -> None:
        self.seconds.clear()
        self.calls.clear()


def _launch_classes() -> list[tuple[type, str]]:
    """(class, method) of each launch entry: cce's cached launch (cce/ops/launch.py), Triton's."""
    from triton.runtime.jit import JITFunction

    from cce.ops.launch import CachedLaunch

    out = [(CachedLaunch, "launch"), (JITFunction, "run")]
    try:
        from triton.runtime.interpreter import InterpretedFunction

        out.append((InterpretedFunction, "run"))
    except ImportError:  # (a Triton without the interpreter module)
        pass
    return out


@contextmanager
def timed_parts() -> Iterator[Parts]:
    """Wrap cce's functions and Triton's launch entry with timers (module docstring); restore
    them on exit."""
    parts = Parts()
    undo: list[tuple[object, str, object]] = []
    wrapped: dict[int, Callable] = {}
    mods = [importlib.import_module(m.name) for m in pkgutil.walk_packages(cce.__path__, "cce.")]
    try:
        for mod in [cce, *mods]:
            for key, val in list(vars(mod).items()):
                if isinstance(val, types.FunctionType) and val.__module__.startswith("cce"):
                    if id(val) not in wrapped:
                        name = f"{val.__module__.removeprefix('cce.ops.linear_ce.')}.{val.__qualname__}"
                        wrapped[id(val)] = parts.timer(name, val)
                    undo.append((mod, key, val))
                    setattr(mod, key, wrapped[id(val)])
                elif isinstance(val, type) and val.__module__.startswith("cce"):
                    for meth in _CLASS_METHODS.get(val.__name__, ()):
                        fn = val.__dict__.get(meth)
                        if isinstance(fn, classmethod) and id(fn) not in wrapped:
                            wrapped[id(fn)] = classmethod(parts.timer(f"{val.__name__}.{meth}", fn.__func__))
                            undo.append((val, meth, fn))
                            setattr(val, meth, wrapped[id(fn)])
                        elif isinstance(fn, types.FunctionType) and id(fn) not in wrapped:
                            wrapped[id(fn)] = parts.timer(f"{val.__name__}.{meth}", fn)
                            undo.append((val, meth, fn))
                            setattr(val, meth, wrapped[id(fn)])
        for cls, meth in _launch_classes():
            undo.append((cls, meth, getattr(cls, meth)))
            setattr(cls, meth, parts.launch_timer(getattr(cls, meth)))
        yield parts
    finally:
        for owner, key, val in reversed(undo):
            setattr(owner, key, val)


def _group(device: torch.device):
    """(group, device): the torchrun group (initialised here; each rank on the GPU of its
    LOCAL_RANK) where RANK is set, else a group of one rank (bench.vp_emulate.one_rank_group)."""
    import torch.distributed as dist

    if "RANK" not in os.environ:
        return one_rank_group(device), device
    if not dist.is_initialized():
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(device)
            dist.init_process_group("nccl", device_id=device)
        else:
            dist.init_process_group("gloo")
    return dist.group.WORLD, device


def _vp_step(e, c, t, device: torch.device):
    import torch.distributed as dist

    group, device = _group(device)
    start, size = shares(c.shape[0], dist.get_world_size(group))[dist.get_rank(group)]
    e, c, t = e.to(device), c.to(device), t.to(device)
    # Sampling is not bit-identical across devices (zipf targets): every rank takes rank 0's
    # inputs, as replicated activations would be (bench.dist does the same).
    for x in (e, c, t):
        dist.broadcast(x, src=dist.get_global_rank(group, 0), group=group)
    e = e.detach().requires_grad_()
    cb = c[start : start + size].detach().clone().requires_grad_()

    def step():
        loss = linear_cross_entropy_vocab_parallel(e, cb, t, process_group=group)
        return torch.autograd.grad(loss, (e, cb))

    return step


def _step(shape: str, regime: str, which: str, device: torch.device):
    N, D, V = SHAPES[shape] if shape in SHAPES else (int(x) for x in shape.lower().split("x"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float16
    e, c, t = make_inputs(N, D, V, regime, dtype=dtype, device=device, seed=0)
    if which == "vp":
        return _vp_step(e, c, t, device)
    size = V // 2 if which == "half" else V
    cb = c[:size].detach().clone().requires_grad_()
    e = e.detach().requires_grad_()
    if which == "half":
        lse_rest = rest_lse(e.detach(), c, t, 0, size, -100)
    else:
        lse_rest = torch.full((N,), float("-inf"), device=device)
    return rank_step(e, cb, t, 0, size, lse_rest, -100)


def step_walls(step: Callable[[], object], steps: int) -> list[float]:
    """The host ms of each of ``steps`` calls of ``step``, issued back to back."""
    walls = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        walls.append((time.perf_counter() - t0) * 1e3)
    return walls


def measure(
    step: Callable[[], object], steps: int, device: torch.device, warmup: int = 3, bench: bool = True
) -> dict:
    """Per step: the host ms of each part (inclusive) and its calls, the wrapped steps' host ms
    (median, min, max); on CUDA also the unwrapped host ms (median) and the step's device-bound
    time: do_bench's median, or with ``bench=False`` (ranks of a group, which must all run the
    same number of steps: do_bench's count depends on timing) the unwrapped loop's wall time per
    step up to a synchronisation. ``warmup`` steps run before each of the two measurements."""
    out: dict = {}
    for _ in range(warmup):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        if bench:
            from triton.testing import do_bench

            out["do_bench_ms"] = float(do_bench(step, warmup=25, rep=200, return_mode="median"))
        t_loop = time.perf_counter()
        walls = step_walls(step, steps)
        torch.cuda.synchronize(device)
        out["loop_ms"] = (time.perf_counter() - t_loop) * 1e3 / steps
        out["host_ms_unwrapped"] = statistics.median(walls)
    with timed_parts() as parts:
        for _ in range(warmup):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        parts.clear()
        walls = step_walls(step, steps)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    out["host_ms"] = {"median": statistics.median(walls), "min": min(walls), "max": max(walls)}
    out["parts"] = {
        k: {"ms": v * 1e3 / steps, "calls": parts.calls[k] / steps}
        for k, v in sorted(parts.seconds.items(), key=lambda kv: -kv[1])
    }
    return out


def add_step_args(ap: argparse.ArgumentParser) -> None:
    """The step's arguments (--shape, --data, --which) of _step, for this module and
    bench.device_parts."""
    ap.add_argument("--shape", default="llama3-8b", help="a bench.data shape name or NxDxV")
    ap.add_argument("--data", default="zipf", help="a data regime (bench.data)")
    ap.add_argument("--which", choices=("half", "one", "vp"), default="half")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.host_parts", description=__doc__.split("\n\n")[0])
    add_step_args(ap)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--top", type=int, default=45, help="parts printed")
    ap.add_argument("--json", help="write the result to this file")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tag, world = "", 1
    if args.which == "vp":
        import torch.distributed as dist

        group, device = _group(device)  # (before the inputs: each rank's on its own GPU)
        world = dist.get_world_size(group)
        tag = f"rank {dist.get_rank(group)}/{world} "
    res = measure(_step(args.shape, args.data, args.which, device), args.steps, device, bench=world == 1)
    res.update(shape=args.shape, regime=args.data, which=args.which, steps=args.steps, world=world)
    if "loop_ms" in res:
        print(
            f"{tag}do_bench {res.get('do_bench_ms', float('nan')):.2f} ms, "
            f"loop {res['loop_ms']:.2f} ms per step; "
            f"unwrapped host ms per step median {res['host_ms_unwrapped']:.2f}"
        )
    h = res["host_ms"]
    n_launch = res["parts"].get("launch:ALL", {}).get("calls", 0.0)
    print(
        f"{tag}{args.shape} {args.data} {args.which}: host ms per step median {h['median']:.2f} "
        f"(min {h['min']:.2f}, max {h['max']:.2f}); launches/step {n_launch:.1f}"
    )
    for name, p in list(res["parts"].items())[: args.top]:
        print(f"{tag}{p['ms']:8.3f} ms {p['calls']:6.1f}x  {name}")
    if args.json:
        path = args.json if world == 1 else f"{args.json}.rank{tag.split()[1].split('/')[0]}"
        with open(path, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
