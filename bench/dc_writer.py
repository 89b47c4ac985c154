"""Where the sparse dC writer's time goes (``python -m bench.dc_writer``): its device ms on a
step's own plan and on three variants of it, for one rank's half of the head and for the whole
head (bench.host_parts' ``half`` and ``one`` steps), with the plan's shape.

The writer (cce/ops/linear_ce/kernels/backward_sparse.py, ``_sparse_dc_kernel``) has one program
per (vocabulary tile, D chunk), which adds the tile's kept token blocks (a loop over them), the
skipped blocks' spread correction and the exact target entries of the rows whose target lies in
the tile (a loop over them). The variants leave out parts of the plan: ``no_targets`` (no row's
target in any tile), ``no_kept`` (no kept block in any tile) and ``neither``. The sorted
vocabulary puts the frequent classes' targets and kept blocks in its first tiles, so the loops of
those few programs can be the kernel's longest path: then the kernel does not shrink with the
vocabulary (a rank's half of it). Each variant's plan is a copy of the step's; the writer runs on
it with dE, the dense slabs and the first-order terms left out::

    python -m bench.dc_writer --shape llama3-8b --data zipf

Prints per step: the writer's ms per variant, the target rows of the busiest tiles and the kept
tiles. On the CPU (no CUDA) the launcher's wall
time per variant under the interpreter is printed instead, which tests the module, not a device.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from cce.ops.linear_ce.kernels.backward_sparse import SparsePlan

from .device_parts import device_parts
from .host_parts import _step

PLAN_ARG = 11  # linear_ce_backward_sparse's positional index of the plan
_NEED_DE, _NEED_DC = 13, 14
_PLAN_TENSORS = (
    "list_c", "cnt_c", "g", "q", "trow", "tpos", "tcoef", "seg", "gidx", "klist", "n_kept", "keep", "code",
    "coef",
)  # fmt: skip


@contextmanager
def captured_call() -> Iterator[dict]:
    """Within it, the sparse backward's first call's arguments are kept (the plan copied, since
    the launcher releases its tensors) in the yielded dict; the function is restored after."""
    from cce.ops.linear_ce.kernels import backward_sparse as KS

    orig = KS.linear_ce_backward_sparse
    seen: dict = {}

    def keep_first(*args, **kwargs):
        if "args" not in seen:
            plan = copy.copy(args[PLAN_ARG])
            for f in _PLAN_TENSORS:
                v = getattr(plan, f)
                setattr(plan, f, None if v is None else v.clone())
            plan.fo = plan.fo_pending = None  # (the first-order terms: not the writer's part)
            seen["args"], seen["kwargs"], seen["orig"] = list(args), dict(kwargs), orig
            seen["args"][PLAN_ARG] = plan
        return orig(*args, **kwargs)

    KS.linear_ce_backward_sparse = keep_first
    try:
        yield seen
    finally:
        KS.linear_ce_backward_sparse = orig


def variants(plan: SparsePlan) -> dict:
    """The plan and its copies without target rows, without kept blocks, and without either."""
    no_t = copy.copy(plan)
    no_t.seg = torch.zeros_like(plan.seg)
    no_k = copy.copy(plan)
    no_k.cnt_c = torch.zeros_like(plan.cnt_c)
    neither = copy.copy(no_t)
    neither.cnt_c = no_k.cnt_c
    return {"base": plan, "no_targets": no_t, "no_kept": no_k, "neither": neither}


def writer_ms(seen: dict, plan: SparsePlan, device: torch.device, reps: int = 5) -> float:
    """ms per call of the dC writer on ``plan``: its device time on CUDA; off CUDA the wall time
    of the launcher's call (the interpreter's kernels are not profiler events)."""
    cuda = device.type == "cuda"
    args = list(seen["args"])
    args[PLAN_ARG], args[_NEED_DE], args[_NEED_DC] = plan, False, True
    kwargs = dict(seen["kwargs"], release=False, dense=None, decided=None)
    run = seen["orig"]
    run(*args, **kwargs)
    if not cuda:
        t0 = time.perf_counter()
        for _ in range(reps):
            run(*args, **kwargs)
        return (time.perf_counter() - t0) * 1e3 / reps
    _, rows = device_parts(lambda: run(*args, **kwargs), device, steps=reps, warmup=0)
    return sum(ms for name, ms, _ in rows if "_sparse_dc_kernel" in name)


def measure(shape: str, regime: str, which: str, device: torch.device, reps: int = 5) -> dict:
    """The writer's ms per variant and the plan's shape for bench.host_parts' step ``which``."""
    step = _step(shape, regime, which, device)
    with captured_call() as seen:
        step()
    if "args" not in seen:
        raise RuntimeError("the step did not take the sparse backward")
    plan = seen["args"][PLAN_ARG]
    per_tile = (plan.seg[1:] - plan.seg[:-1]).tolist()
    out = {name: writer_ms(seen, p, device, reps) for name, p in variants(plan).items()}
    out.update(
        tiles=len(per_tile),
        targets_top=sorted(per_tile, reverse=True)[:5],
        kept=int(plan.n_kept.sum()),
        tiles_with_kept=int((plan.cnt_c > 0).sum()),
    )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.dc_writer", description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama3-8b", help="a bench.data shape name or NxDxV")
    ap.add_argument("--data", default="zipf", help="a data regime (bench.data)")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    unit = "device" if device.type == "cuda" else "CPU wall"
    for which in ("one", "half"):
        r = measure(args.shape, args.data, which, device, args.reps)
        parts = ", ".join(f"{k} {r[k]:.3f}" for k in ("base", "no_targets", "no_kept", "neither"))
        print(
            f"{args.shape} {args.data} {which}: dC writer {unit} ms {parts}; target rows of the busiest "
            f"tiles {r['targets_top']} of {r['tiles']} tiles; {r['kept']} kept tiles in "
            f"{r['tiles_with_kept']}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
