"""Issue 18: the forward (no_grad) of the loss alone against the same forward with every per-token
output (log-probabilities, entropy, argmax, accuracy), and with them at temperature 0.7, in one
process: interleaved rounds of ``triton.testing.do_bench``, medians.

    python -m bench.outputs_ab [--rounds 5] [--rep-ms 150] [--out DIR]

bf16, N = 8192, gemma2-2b and llama3-8b heads, zipf and random data (bench.data). Writes
``<gpu>_<date>_fwd-outputs-ab.json`` to ``--out`` (default bench/results/).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
from pathlib import Path

import torch

import cce

from .data import make_inputs
from .providers import versions

SHAPES = {"gemma2-2b": (8192, 2304, 256000), "llama3-8b": (8192, 4096, 128256)}
ALL = dict(return_logprobs=True, return_entropy=True, return_argmax=True, return_accuracy=True)


def main() -> None:
    import triton

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rep-ms", type=int, default=150)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    a = ap.parse_args()
    variants = {
        "loss": {},
        "outputs": ALL,
        "outputs_t07": dict(temperature=0.7, **ALL),
    }
    rows = []
    for name, (N, D, V) in SHAPES.items():
        for regime in ("zipf", "random"):
            e, c, t = make_inputs(N, D, V, regime, device="cuda", seed=0)
            times = {k: [] for k in variants}
            with torch.no_grad():
                for _ in range(a.rounds):
                    for k, kw in variants.items():

                        def fn(e=e, c=c, t=t, kw=kw):
                            return cce.linear_cross_entropy(e, c, t, **kw)

                        times[k].append(triton.testing.do_bench(fn, warmup=25, rep=a.rep_ms))
            med = {k: statistics.median(v) for k, v in times.items()}
            r1, r2 = med["outputs"] / med["loss"], med["outputs_t07"] / med["loss"]
            rows.append(dict(shape=name, data=regime, ms=med, rounds=times, ratio=r1, ratio_t07=r2))
            print(
                f"{name:10s} {regime:7s} loss {med['loss']:7.3f} ms  every output {med['outputs']:7.3f} ms "
                f"({r1:.3f}x)  at T = 0.7 {med['outputs_t07']:7.3f} ms ({r2:.3f}x)",
                flush=True,
            )
    path = write_session_json(a.out, "fwd-outputs-ab", rows, rounds=a.rounds, rep_ms=a.rep_ms)
    print(f"# wrote {path}")


def write_session_json(out: Path, tag: str, rows: list[dict], **meta) -> Path:
    """``<gpu>_<date>_<tag>.json`` in ``out`` with {meta, rows}: the date, GPU, versions and the
    commit (CCE_BENCH_COMMIT) besides ``meta``; the path written."""
    now = datetime.datetime.now(datetime.timezone.utc)
    gpu = torch.cuda.get_device_name()
    info = dict(date=now.isoformat(timespec="seconds"), gpu=gpu, versions=versions([]), **meta,
                git=os.environ.get("CCE_BENCH_COMMIT"))  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{gpu.replace(' ', '-')}_{now:%Y%m%d-%H%M%S}_{tag}.json"
    path.write_text(json.dumps(dict(meta=info, rows=rows), indent=1))
    return path


if __name__ == "__main__":
    main()
