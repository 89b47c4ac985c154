"""Where a step's device time goes (``python -m bench.device_parts``): each kernel's device
milliseconds per step, from ``torch.profiler``.

``--which`` as in ``bench.host_parts``: ``half`` (one rank's step on the first half of the head,
one GPU), ``one`` (the same function on the whole head), ``vp`` (the vocabulary-parallel call,
in a group of one or under torchrun, where each rank prints its own kernels; NCCL's kernels
count their waits for the other rank, and run beside the compute on their own stream)::

    torchrun --nproc_per_node 2 -m bench.device_parts --shape llama3-8b --data zipf --which vp
    python -m bench.device_parts --shape llama3-8b --data zipf --which one

On the CPU (no CUDA) the CPU ops' self time is listed instead (the interpreter's kernels among
them), which tests the module, not a device.
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from .host_parts import _group, _step, add_step_args


def device_parts(step, device: torch.device, steps: int = 5, warmup: int = 3) -> tuple[float, list[tuple]]:
    """(total ms per step, [(name, ms per step, calls per step)] by decreasing time): the self
    device time (CPU self time off CUDA) of every profiled op and kernel over ``steps`` steps."""
    cuda = device.type == "cuda"
    for _ in range(warmup):
        step()
    if cuda:
        torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as p:
        for _ in range(steps):
            step()
        if cuda:
            torch.cuda.synchronize(device)
    rows = []
    for ev in p.key_averages():
        us = ev.self_device_time_total if cuda else ev.self_cpu_time_total
        if us > 0:
            rows.append((ev.key, us / steps / 1e3, ev.count / steps))
    rows.sort(key=lambda r: -r[1])
    return sum(r[1] for r in rows), rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.device_parts", description=__doc__.split("\n\n")[0])
    add_step_args(ap)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--top", type=int, default=24, help="kernels printed")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tag = ""
    if args.which == "vp":
        import torch.distributed as dist

        group, device = _group(device)
        tag = f"rank {dist.get_rank(group)}/{dist.get_world_size(group)} "
    total, rows = device_parts(_step(args.shape, args.data, args.which, device), device, args.steps)
    unit = "device" if device.type == "cuda" else "CPU self"
    out = [f"{tag}{args.shape} {args.data} {args.which}: {unit} ms per step {total:.2f}"]
    out += [f"{tag}{ms:8.3f} ms {n:6.1f}x  {name[:100]}" for name, ms, n in rows[: args.top]]
    print("\n".join(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
