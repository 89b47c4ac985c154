"""Tuning.host_gating on and off, in one process: the single-GPU call on the whole head and one
rank's step on each half of it (bench.vp_emulate.rank_step, a real rank's upstream gradients),
interleaved rounds of ``triton.testing.do_bench`` (medians), the host's milliseconds to issue a
step while the device sleeps (bench.host.host_ms), the peak memory above the inputs, and whether
the gradients of the two settings are the same bit for bit.

    python -m bench.gating_ab [--data zipf,random] [--rounds 3] [--rep-ms 100] [--out DIR]

bf16, N = 8192, gemma2-2b and llama3-8b heads. Writes ``<gpu>_<date>_gating-ab.json`` to
``--out`` (default bench/results/).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

import cce

from .data import ALL_REGIMES, IGNORE_INDEX, make_inputs
from .host import host_ms
from .outputs_ab import write_session_json
from .vp_emulate import rank_step, rest_lse, shares

SHAPES = {"gemma2-2b": (8192, 2304, 256000), "llama3-8b": (8192, 4096, 128256)}


def _one(e, c, t, tuning):
    opts = cce.CCEOptions(impl="triton", tuning=tuning)

    def run():
        loss = cce.linear_cross_entropy_with_options(e, c, t, None, None, opts)
        return torch.autograd.grad(loss, (e, c))

    return run


def _peak(step) -> float | None:
    if not torch.cuda.is_available():
        return None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = step()
    torch.cuda.synchronize()
    del out
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def _ms(step, rep_ms: int) -> float:
    if torch.cuda.is_available():
        import triton

        return triton.testing.do_bench(step, warmup=25, rep=rep_ms)
    t0 = time.perf_counter()
    step()
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rep-ms", type=int, default=100)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    ap.add_argument("--data", default="zipf,random", help=f"comma list of {', '.join(ALL_REGIMES)}")
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma list of {', '.join(SHAPES)} or NxDxV")
    a = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # (the CPU: a smoke test)
    tunings = {"gated": cce.Tuning(host_gating=True), "all": cce.Tuning(host_gating=False)}
    rows = []
    for name in a.shapes.split(","):
        N, D, V = SHAPES[name] if name in SHAPES else (int(x) for x in name.split("x"))
        for regime in a.data.split(","):
            e0, c0, t = make_inputs(N, D, V, regime, device=dev, seed=0)
            e = e0.detach().requires_grad_()
            steps = {}
            for k, tu in tunings.items():
                steps[("one", k)] = _one(e, c0.detach().requires_grad_(), t, tu)
            start, size = shares(V, 2)[0]  # the first half (the sorted head's classes are spread)
            cb = c0[start : start + size].clone().requires_grad_()
            lr = rest_lse(e0, c0, t, start, size, IGNORE_INDEX)
            for k, tu in tunings.items():
                steps[("half", k)] = rank_step(e, cb, t, start, size, lr, IGNORE_INDEX, tuning=tu)
            same = {}
            for part in ("one", "half"):
                g1 = steps[(part, "all")]()
                g2 = steps[(part, "gated")]()
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                same[part] = all(torch.equal(x, y) for x, y in zip(g1, g2, strict=True))
                del g1, g2
            peak = {f"{p}/{k}": _peak(s) for (p, k), s in steps.items()}
            times = {f"{p}/{k}": [] for (p, k) in steps}
            for _ in range(a.rounds):
                for (p, k), s in steps.items():
                    times[f"{p}/{k}"].append(_ms(s, a.rep_ms))
            host = {f"{p}/{k}": statistics.median(host_ms(s, dev, reps=5)) for (p, k), s in steps.items()}
            med = {k: statistics.median(v) for k, v in times.items()}
            row = dict(
                shape=name, data=regime, ms=med, rounds=times, host_ms=host, peak_mb=peak, same_bits=same,
                ratio_gated=med["half/gated"] / med["one/gated"], ratio_all=med["half/all"] / med["one/all"],
            )  # fmt: skip
            rows.append(row)
            pk = {k: 0.0 if v is None else v for k, v in peak.items()}
            cols = [
                f"{name:10s} {regime:7s}",
                f"one {med['one/all']:6.2f} -> {med['one/gated']:6.2f} ms",
                f"half {med['half/all']:6.2f} -> {med['half/gated']:6.2f} ms",
                f"ratio {row['ratio_all']:.3f} -> {row['ratio_gated']:.3f}",
                f"host one {host['one/all']:5.1f} -> {host['one/gated']:5.1f}",
                f"half {host['half/all']:5.1f} -> {host['half/gated']:5.1f} ms",
                f"peak MB one {pk['one/all']:.0f} -> {pk['one/gated']:.0f}",
                f"half {pk['half/all']:.0f} -> {pk['half/gated']:.0f}",
                f"same bits {same}",
            ]
            print("  ".join(cols), flush=True)
            del steps, e, cb, lr, e0, c0
    path = write_session_json(a.out, "gating-ab", rows, rounds=a.rounds, rep_ms=a.rep_ms)
    print(f"# wrote {path}")


if __name__ == "__main__":
    main()
