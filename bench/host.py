"""The host's share of a training step (``python -m bench.host``): how long the host takes to
issue one forward + backward when nothing waits for the device, beside the device-timed step,
and how many aten ops and Triton launches the step makes.

A step whose host time exceeds its kernels' time is host-bound: do_bench then measures the
host. On CUDA each timed issue follows ``torch.cuda._sleep``, long enough that the device is
still asleep when the step has been issued, and one step at a time (a few hundred launches,
well within the launch queue), so no call waits for the device unless it synchronises. The
counts (top-level aten ops outside launches from torch.profiler, Triton launches from
``sys.setprofile``) are a device-free proxy: under TRITON_INTERPRET=1 they show on a CPU how a
change moves the host's work (on an H100 host an aten op took ~13 us to issue, a Triton launch
~20-60 us; docs/benchmarks.md, session 9). With the device asleep the sparse backward's
decisions never reach the host in time, so host_ms always times the path that issues every gated
launch (Tuning.host_gating, cce/ops/linear_ce/host_peek.py): the most a step issues.

    python -m bench.host --shape 8192x2048x128256 --data zipf --providers cce,cce-exact
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable

import torch

from .data import make_inputs
from .providers import LINEAR, all_providers

_LAUNCH_FILES = ("triton/runtime/jit.py", "triton/runtime/interpreter.py")


def host_ms(
    step: Callable[[], object], device: torch.device, reps: int = 5, sleep_ms: float = 300.0
) -> list[float]:
    """Host milliseconds to issue ``step`` once, ``reps`` times, sorted. On CUDA each issue starts
    while the device sleeps ``sleep_ms`` (a step must issue within it: the result is then the
    host's own time); elsewhere it is the wall time of the call."""
    out = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda._sleep(int(sleep_ms * 2e6))  # cycles: >= sleep_ms at clocks <= 2 GHz
        t0 = time.perf_counter()
        step()
        out.append((time.perf_counter() - t0) * 1e3)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return sorted(out)


# Aten ops that only make views or read metadata: not counted.
_VIEWS = frozenset(
    "aten::" + n
    for n in (
        "view", "_unsafe_view", "reshape", "_reshape_alias", "as_strided", "alias", "detach", "t",
        "transpose", "permute", "expand", "unsqueeze", "squeeze", "slice", "select", "lift_fresh",
        "numpy_T",
    )
)  # fmt: skip
_LAUNCH = "bench.host::triton_launch"


def call_counts(step: Callable[[], object]) -> tuple[int, int]:
    """(aten ops, Triton launches) of one call of ``step``: the top-level aten operators it
    dispatches outside its kernel launches (torch.profiler, CPU activity; view and metadata ops
    left out, and whatever runs inside a launch, such as the interpreter's own tensor work on a
    CPU), and its launches (each marked in the profile by a record_function range)."""
    from torch.autograd.profiler import record_function
    from torch.profiler import ProfilerActivity, profile

    launches = 0
    inside: list = []  # (frame, its record_function range) of the launches under way

    def prof(frame, event, arg):
        nonlocal launches
        if (
            event == "call"
            and frame.f_code.co_name == "run"
            and frame.f_code.co_filename.endswith(_LAUNCH_FILES)
        ):
            rf = None
            if not inside:
                launches += 1
                rf = record_function(_LAUNCH)
                rf.__enter__()
            inside.append((frame, rf))
        elif event == "return" and inside and frame is inside[-1][0]:
            rf = inside.pop()[1]
            if rf is not None:
                rf.__exit__(None, None, None)

    with profile(activities=[ProfilerActivity.CPU]) as p:
        sys.setprofile(prof)
        try:
            step()
        finally:
            sys.setprofile(None)
    ops = 0
    for ev in p.events():
        if not ev.name.startswith("aten::") or ev.name in _VIEWS:
            continue
        parent, top = ev.cpu_parent, True
        while parent is not None:
            if parent.name.startswith("aten::") or parent.name == _LAUNCH:
                top = False
                break
            parent = parent.cpu_parent
        ops += top
    return ops, launches


def _step(fn, e, c, t):
    e = e.detach().requires_grad_()
    c = c.detach().requires_grad_()

    def step():
        return torch.autograd.grad(fn(e, c, t), (e, c))

    return step


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.host", description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="8192x2048x128256", help="comma list of NxDxV")
    ap.add_argument("--data", default="zipf", help="comma list of regimes (bench.data)")
    ap.add_argument("--providers", default="cce,cce-exact", help="comma list of linear-level providers")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", help="write the rows to this file")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype)
    by_name = {p.name: p for p in all_providers() if p.level == LINEAR}
    rows = []
    for shape in args.shape.split(","):
        N, D, V = (int(x) for x in shape.lower().split("x"))
        for regime in args.data.split(","):
            e, c, t = make_inputs(N, D, V, regime, dtype=dtype, device=device, seed=0)
            for name in args.providers.split(","):
                step = _step(by_name[name].fn(), e, c, t)
                step()  # warm-up: compilation, autotuning
                row = dict(shape=shape, regime=regime, provider=name)
                if device.type == "cuda":
                    from triton.testing import do_bench

                    row["ms"] = float(do_bench(step, warmup=25, rep=100, return_mode="median"))
                hs = host_ms(step, device, args.reps)
                row.update(host_ms=statistics.median(hs), host_ms_all=hs)
                row["aten_ops"], row["launches"] = call_counts(step)
                rows.append(row)
                print(
                    f"{shape:>18} {regime:>6} {name:>14}  step {row.get('ms', float('nan')):8.2f} ms  "
                    f"host {row['host_ms']:8.2f} ms  aten ops {row['aten_ops']:5d}  "
                    f"launches {row['launches']:4d}",
                    flush=True,
                )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(device), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
