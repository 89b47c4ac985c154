"""CPU comparison (``make bench-cpu``): cce impl="torch" against PyTorch's chunked linear cross entropy.

    python bench/cpu_compare.py [--rounds 3] [--data random|peaked] [--json bench/results/cpu.json]

N=2048, D=512, V=32000, fp32, every 13th target ignored. Each provider runs in its own process
(alternating), one warm-up and ``--iters`` timed forward+backward passes (median); peak memory is
the growth of the process' peak RSS over its RSS after the inputs were made.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

PROVIDERS = ("cce_torch", "cce_torch_exact", "torch_chunked", "torch_materialized", "matmul")


def _child(provider: str, data: str, iters: int) -> dict:
    import resource

    import torch
    import torch.nn.functional as F

    N, D, V = 2048, 512, 32000
    g = torch.Generator().manual_seed(0)
    # "random": logits ~ N(0, 1) (nearly uniform softmax); "peaked": logits ~ N(0, 20^2).
    scale = 1.0 if data == "random" else 20.0
    s = (scale / D**0.5) ** 0.5
    e = (torch.randn(N, D, generator=g) * s).requires_grad_()
    c = (torch.randn(V, D, generator=g) * s).requires_grad_()
    t = torch.randint(0, V, (N,), generator=g)
    t[::13] = -100

    def step():
        e.grad = None
        c.grad = None
        if provider == "matmul":
            with torch.no_grad():
                return e @ c.T
        if provider == "torch_chunked":
            loss = F.linear_cross_entropy(
                e, c, t, ignore_index=-100, options=torch.nn.LinearCrossEntropyOptions()
            )
        elif provider == "torch_materialized":
            loss = F.cross_entropy(e @ c.T, t, ignore_index=-100)
        else:
            import cce

            eps = None if provider == "cce_torch_exact" else "auto"
            loss = cce.linear_cross_entropy(e, c, t, impl="torch", filter_eps=eps)
        loss.backward()
        return loss.detach()

    if provider.startswith("cce"):
        import cce  # noqa: F401  (import-time memory is not the op's)
    with open("/proc/self/statm") as f:  # resident pages: the RSS after the inputs were made
        base = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    times = []
    for i in range(iters + 1):
        t0 = time.perf_counter()
        out = step()
        if i:  # (the first call warms up)
            times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB -> MiB
    loss = float(out) if out.dim() == 0 else None  # (the matmul alone has no loss)
    return dict(provider=provider, median_s=statistics.median(times), times_s=times,
                peak_rss_growth_mb=peak - base, loss=loss)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=2)
    ap.add_argument("--data", choices=("random", "peaked"), default="random")
    ap.add_argument("--providers", default=",".join(PROVIDERS))
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(_child(a.child, a.data, a.iters)))
        return
    import torch

    providers = a.providers.split(",")
    results: dict[str, list[dict]] = {p: [] for p in providers}
    for r in range(a.rounds):
        for p in providers:
            cmd = [sys.executable, __file__, "--child", p, "--data", a.data, "--iters", str(a.iters)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True)
            res = json.loads(out.stdout.strip().splitlines()[-1])
            results[p].append(res)
            loss = "-" if res["loss"] is None else f"{res['loss']:.5f}"
            print(f"round {r + 1}/{a.rounds} {p:20s} {res['median_s']:.3f} s  "
                  f"+{res['peak_rss_growth_mb']:.0f} MB  loss {loss}", flush=True)  # fmt: skip
    summary = {
        p: {k: statistics.median(x[k] for x in rs) for k in ("median_s", "peak_rss_growth_mb")}
        | {"loss": rs[0]["loss"]}
        for p, rs in results.items()
    }
    ref = summary.get("torch_chunked")
    print(f"\nN=2048 D=512 V=32000 fp32, data={a.data}, {os.cpu_count()} CPUs, torch {torch.__version__}")
    print(f"{'provider':22s} {'median s':>9s} {'vs chunked':>10s} {'peak RSS +MB':>13s}")
    for p, s in summary.items():
        ratio = f"{s['median_s'] / ref['median_s']:.2f}" if ref else "-"  # (torch_chunked not run)
        print(f"{p:22s} {s['median_s']:9.3f} {ratio:>10s} {s['peak_rss_growth_mb']:13.0f}")
    if a.json:
        meta = dict(
            torch=torch.__version__, cpus=os.cpu_count(), machine=platform.processor() or platform.machine(),
            date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), data=a.data,
            shape={"N": 2048, "D": 512, "V": 32000, "dtype": "float32", "ignore": "every 13th"},
        )  # fmt: skip
        os.makedirs(os.path.dirname(a.json) or ".", exist_ok=True)
        Path(a.json).write_text(json.dumps({"meta": meta, "summary": summary, "runs": results}, indent=1))


if __name__ == "__main__":
    main()
