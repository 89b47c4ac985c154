"""The shape x data matrix (``python -m bench --matrix``): common LM heads at several token counts
in every data regime, summarised per cell as the speedup of cce's default over the fastest peer.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

from .data import Shape

MATRIX_N: tuple[int, ...] = (2048, 8192, 32768)
# (D, V) of the heads people train.
MATRIX_HEADS: dict[str, tuple[int, int]] = {
    "gpt2": (768, 50257),
    "qwen2.5-0.5b": (896, 151936),
    "llama3.2-1b": (2048, 128256),
    "qwen3.5": (2048, 248320),
    "gemma2-2b": (2304, 256000),
    "mistral-7b": (4096, 32000),
    "llama3-8b": (4096, 128256),
    "llama3-70b": (8192, 128256),
}
CCE, EXACT = "cce", "cce-exact"


def matrix_shapes(heads: list[str] | None = None, ns: list[int] | None = None) -> list[Shape]:
    """The matrix's shapes, named ``head@N=n``."""
    heads = heads or list(MATRIX_HEADS)
    unknown = [h for h in heads if h not in MATRIX_HEADS]
    if unknown:
        raise ValueError(f"unknown head(s) {unknown}; known: {list(MATRIX_HEADS)}")
    return [Shape(f"{h}@N={n}", n, *MATRIX_HEADS[h]) for h in heads for n in ns or MATRIX_N]


def cells(rows: list[dict]) -> dict[tuple[str, str], dict[str, dict]]:
    """The matrix's fwd+bwd rows that ran, by (shape, regime), then by provider."""
    out: dict[tuple[str, str], dict[str, dict]] = {}
    for r in rows:
        if r.get("level") == "linear" and r.get("mode") == "fwd+bwd" and r.get("status") == "ok":
            out.setdefault((r["shape"], r["regime"]), {})[r["provider"]] = r
    return out


def fastest_peer(by_provider: dict[str, dict]) -> dict | None:
    """The row of the fastest provider that is not cce (None where no peer ran)."""
    peers = [r for n, r in by_provider.items() if not n.startswith("cce")]
    return min(peers, key=lambda r: r["ms"], default=None)


def summarize(rows: list[dict]) -> str:
    """One line per (shape, data) of the fwd+bwd rows: cce default and exact, the fastest peer,
    the speedup over it, whether the default is the fastest choice, its errors; the geometric
    mean of the speedups last."""
    cols = ["shape", "data", "cce ms", "exact ms", "fastest peer", "peer ms", "speedup", "default fastest",
            "dE err", "dC err"]  # fmt: skip
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    speedups = []
    f = lambda v, spec: "-" if v is None else format(v, spec)
    for (shape, regime), by in sorted(cells(rows).items()):
        d, x = by.get(CCE), by.get(EXACT)
        best = fastest_peer(by)
        sp = best["ms"] / d["ms"] if (d and best) else None
        if sp:
            speedups.append(sp)
        rivals = [r["ms"] for n, r in by.items() if not n.startswith("cce")] + ([x["ms"]] if x else [])
        fastest = None if not (d and rivals) else d["ms"] <= min(rivals)
        out.append(
            f"| {shape} | {regime} | {f(d and d['ms'], '.2f')} | {f(x and x['ms'], '.2f')} | "
            f"{best['provider'] if best else '-'} | {f(best and best['ms'], '.2f')} | {f(sp, '.2f')} | "
            f"{'-' if fastest is None else 'yes' if fastest else 'no'} | {f(d and d.get('de_err'), '.1e')} | "
            f"{f(d and d.get('dc_err'), '.1e')} |"
        )
    if speedups:
        gm = math.exp(sum(math.log(s) for s in speedups) / len(speedups))
        out.append(f"\ngeometric mean of (fastest peer / cce default) over {len(speedups)} cells: {gm:.2f}")
    return "\n".join(out)


def split_heads(heads: list[str], k: int) -> list[list[str]]:
    """The heads in k groups of about equal work (D V per head, a token count's cost up to a
    constant), largest first into the lightest group; empty groups dropped."""
    groups: list[list[str]] = [[] for _ in range(max(1, k))]
    load = [0] * len(groups)
    for h in sorted(heads, key=lambda h: -MATRIX_HEADS[h][0] * MATRIX_HEADS[h][1]):
        i = load.index(min(load))
        groups[i].append(h)
        load[i] += MATRIX_HEADS[h][0] * MATRIX_HEADS[h][1]
    return [g for g in groups if g]


def merge(results: list[dict]) -> dict:
    """Several results of one matrix (slices run side by side, or one after another) as one:
    the rows of all, the first's meta with every part's GPU, date, duration and completeness."""
    if not results:
        raise ValueError("nothing to merge")
    meta = dict(results[0]["meta"])
    meta["parts"] = [
        {k: r["meta"].get(k) for k in ("gpu", "date", "seconds", "complete", "argv", "git")} for r in results
    ]
    meta["complete"] = all(r["meta"].get("complete") for r in results)
    meta["seconds"] = max((r["meta"].get("seconds") or 0.0) for r in results)
    return {"meta": meta, "rows": [row for r in results for row in r["rows"]]}


def run_on_gpus(argv: list[str], heads: list[str], k: int, out_dir: Path, tag: str) -> dict:
    """``python -m bench <argv> --matrix-heads <group>`` once per group of split_heads(heads, k), side
    by side, process i on GPU i (CUDA_VISIBLE_DEVICES), ``argv``'s own --matrix-gpus, --matrix-heads,
    --out and --tag left out; their results merged."""
    drop, rest = ("--matrix-gpus", "--matrix-heads", "--out", "--tag"), []
    for i, a in enumerate(argv):
        if a.split("=")[0] not in drop and not (i and argv[i - 1] in drop):
            rest.append(a)
    groups = split_heads(heads, k)
    parts = [out_dir / f"part{i}" for i in range(len(groups))]
    for part in parts:  # results of an earlier run there are not this run's
        for f in part.glob("*.json"):
            f.unlink()
    procs = []
    for i, (group, part) in enumerate(zip(groups, parts, strict=True)):
        cmd = [sys.executable, "-m", "bench", *rest, "--matrix-heads", ",".join(group), "--out", str(part),
               "--tag", f"{tag}-part{i}" if tag else f"part{i}", "--no-plots"]  # fmt: skip
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=str(i))
        procs.append(subprocess.Popen(cmd, env=env))
    codes = [p.wait() for p in procs]
    latest = [max(part.glob("*.json"), key=lambda f: f.stat().st_mtime, default=None) for part in parts]
    results = [json.loads(f.read_text()) for f in latest if f is not None]
    if not results:
        raise RuntimeError(f"no part of the matrix wrote a result (exit codes {codes})")
    merged = merge(results)
    merged["meta"].update(part_exit_codes=codes, argv=argv)
    return merged
