"""Issue 18: a training step of ``loss - 0.01 * entropy.mean()`` (an RL-style entropy bonus)
against the loss alone, in one process: interleaved rounds of ``triton.testing.do_bench`` of
the forward + backward, medians; the peak memory above the inputs; dE / dC errors against the
fp32 reference of each objective (bench.reference.linear_reference, ``entropy_coef``).

    python -m bench.entropy_step [--data zipf,random] [--softcap S] [--rounds 5] [--rep-ms 150] [--out DIR]

bf16, N = 8192, gemma2-2b and llama3-8b heads, zipf and random data by default (``--data``: any of
bench.data.ALL_REGIMES; real and init train / build a small GPT in the run), cce's defaults
(``--softcap``: every call and the reference with that logit softcap, as Gemma 2's 30);
the same objective with ``filter_eps=None`` (the exact backward) beside it. Writes
``<gpu>_<date>_entropy-step.json`` to ``--out`` (default bench/results/).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

import cce

from .data import ALL_REGIMES, make_inputs
from .outputs_ab import write_session_json
from .reference import linear_reference, rel_l2

SHAPES = {"gemma2-2b": (8192, 2304, 256000), "llama3-8b": (8192, 4096, 128256)}
COEF = 0.01


def _step(kind: str, softcap: float | None = None):
    """The objective of ``kind`` as a function of (e, c, t)."""

    def fn(e, c, t):
        if kind == "loss":
            return cce.linear_cross_entropy(e, c, t, softcap=softcap)
        kw = dict(filter_eps=None) if kind == "bonus_exact" else {}
        out = cce.linear_cross_entropy(e, c, t, return_entropy=True, softcap=softcap, **kw)
        return out.loss - COEF * out.entropy.mean()

    return fn


def main() -> None:
    import triton

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rep-ms", type=int, default=150)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    ap.add_argument("--data", default="zipf,random", help=f"comma list of {', '.join(ALL_REGIMES)}")
    ap.add_argument("--softcap", type=float, default=None, help="logit softcap of every call (default: none)")
    a = ap.parse_args()
    regimes = [x.strip() for x in a.data.split(",") if x.strip()]
    for x in regimes:
        if x not in ALL_REGIMES:
            ap.error(f"unknown data regime {x!r}: one of {', '.join(ALL_REGIMES)}")
    kinds = ("loss", "bonus", "bonus_exact")
    rows = []
    for name, (N, D, V) in SHAPES.items():
        for regime in regimes:
            e0, c0, t = make_inputs(N, D, V, regime, device="cuda", seed=0)
            e, c = e0.detach().requires_grad_(), c0.detach().requires_grad_()
            refs = {
                "loss": linear_reference(e0, c0, t, softcap=a.softcap),
                "bonus": linear_reference(e0, c0, t, softcap=a.softcap, entropy_coef=COEF),
            }
            err, mem = {}, {}
            for k in kinds:
                fn = _step(k, a.softcap)
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                de, dc = torch.autograd.grad(fn(e, c, t), (e, c))
                torch.cuda.synchronize()
                # (the gradients themselves count, as in bench.harness)
                mem[k] = (torch.cuda.max_memory_allocated() - base) / 2**20
                ref = refs["loss" if k == "loss" else "bonus"]
                err[k] = dict(de=rel_l2(de, ref.de), dc=rel_l2(dc, ref.dc))
                del de, dc
            del refs
            times = {k: [] for k in kinds}
            for _ in range(a.rounds):
                for k in kinds:
                    fn = _step(k, a.softcap)

                    def run(fn=fn, e=e, c=c, t=t):
                        return torch.autograd.grad(fn(e, c, t), (e, c))

                    times[k].append(triton.testing.do_bench(run, warmup=25, rep=a.rep_ms))
            med = {k: statistics.median(v) for k, v in times.items()}
            r, rx = med["bonus"] / med["loss"], med["bonus_exact"] / med["loss"]
            rows.append(
                dict(
                    shape=name,
                    data=regime,
                    ms=med,
                    rounds=times,
                    ratio=r,
                    ratio_exact=rx,
                    err=err,
                    peak_mb=mem,
                )
            )
            er = {k: f"{v['de']:.1e}/{v['dc']:.1e}" for k, v in err.items()}
            print(
                f"{name:10s} {regime:7s} loss {med['loss']:7.2f} ms  bonus {med['bonus']:7.2f} ms "
                f"({r:.3f}x)  bonus exact {med['bonus_exact']:7.2f} ms ({rx:.3f}x)  dE/dC err "
                f"{er['loss']} / {er['bonus']} / {er['bonus_exact']}  "
                f"MB {mem['loss']:.0f}/{mem['bonus']:.0f}/{mem['bonus_exact']:.0f}",
                flush=True,
            )
    path = write_session_json(
        a.out, "entropy-step", rows, rounds=a.rounds, rep_ms=a.rep_ms, coef=COEF, softcap=a.softcap
    )
    print(f"# wrote {path}")


if __name__ == "__main__":
    main()
