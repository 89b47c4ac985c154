"""``python -m bench``: cce against every peer, one table, JSON + PNG plots in bench/results/.

Examples::

    python -m bench                          # the main table: 4 shapes x random/zipf x fwd, fwd+bwd
    python -m bench --quick                  # gemma2-2b and llama3-8b only
    python -m bench --sweep                  # the N sweep 1024..65536 at llama3-8b (linear level)
    python -m bench --shapes llama3-8b,2048x1024x32000 --providers cce,torch --data zipf --modes fwd+bwd
    python -m bench --list                   # providers and whether they can run here
    python -m bench --matrix --matrix-heads gpt2 --matrix-n 8192   # a slice of the shape x data matrix
    python -m bench --matrix --matrix-gpus 4 # the whole matrix as one run on 4 GPUs of this host
    python -m bench --check linear|logits    # correctness of impl="triton" at real sizes (bench/checks.py)
    torchrun --nproc_per_node 2 -m bench.dist         # vocabulary parallelism on 2 GPUs (bench/dist.py)
    torchrun --nproc_per_node 2 -m bench.fsdp_check   # FSDP2 training of a patched HF model
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from . import data
from .harness import Config, run, save
from .matrix import MATRIX_HEADS, matrix_shapes, run_on_gpus, summarize
from .providers import LINEAR, LOGITS, MODES, all_providers

RESULTS = Path(__file__).resolve().parent / "results"
QUICK = ("gemma2-2b", "llama3-8b")


def _csv(s: str | None) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()] if s else []


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m bench", description=__doc__.split("\n")[0], epilog=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    add = ap.add_argument
    add("--quick", action="store_true", help=f"shapes {', '.join(QUICK)} only")
    add("--shapes", help=f"comma list of {', '.join(data.SHAPES)} or NxDxV (default: all named)")
    add("--sweep", action="store_true", help=f"the N sweep at {data.SWEEP_BASE} (linear level) instead")
    add("--sweep-n", help=f"comma list of N for --sweep (default {','.join(map(str, data.SWEEP_N))})")
    add("--providers", help="comma list of provider names (default: all; see --list)")
    add("--skip", help="comma list of provider names to leave out")
    add("--levels", default=f"{LINEAR},{LOGITS}", help="linear and/or logits (default both)")
    add("--data", help=f"comma list of {', '.join(data.ALL_REGIMES)} (default random,zipf; --matrix all)")
    add("--modes", help="fwd and/or fwd+bwd (default both; fwd+bwd with --matrix)")
    add("--device", help="cuda (default when available) or cpu")
    add("--seed", type=int, default=0)
    add("--warmup-ms", type=float, default=25.0)
    add("--rep-ms", type=float, default=100.0, help="do_bench's rep (widened to >= --min-reps calls)")
    add("--min-reps", type=int, default=10)
    add("--out", type=Path, help=f"output folder (default {RESULTS})")
    add("--tag", default="", help="suffix of the output file names ('debug' prints tracebacks)")
    add("--no-plots", action="store_true")
    add("--no-save", action="store_true", help="print the table only")
    add("--list", action="store_true", help="list the providers and exit")
    add("--resume", type=Path, help="an earlier result JSON of the same command: only its missing rows run")
    add("--check", choices=(LINEAR, LOGITS), help="correctness at real sizes instead of timings (GPU)")
    add("--matrix", action="store_true", help="the shape x data matrix: linear level, fwd+bwd, every regime")
    add("--matrix-heads", help="comma list of the matrix's heads (default all)")
    add("--matrix-n", help="comma list of the matrix's token counts (default 2048,8192,32768)")
    add("--matrix-gpus", type=int, default=1, help="split the matrix's heads over this many GPUs, one JSON")
    return ap


def config_from_args(args: argparse.Namespace) -> Config:
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    providers = all_providers()
    names = {p.name for p in providers}
    for opt in (args.providers, args.skip):
        unknown = [n for n in _csv(opt) if n not in names]
        if unknown:
            raise SystemExit(f"unknown provider(s) {unknown}; known: {sorted(names)}")
    if args.providers:
        keep = _csv(args.providers)
        providers = sorted((p for p in providers if p.name in keep), key=lambda p: keep.index(p.name))
    providers = [p for p in providers if p.name not in _csv(args.skip)]
    levels = tuple(_csv(args.levels))
    regimes = tuple(_csv(args.data)) or (data.ALL_REGIMES if args.matrix else data.REGIMES)
    modes = tuple(_csv(args.modes)) or (("fwd+bwd",) if args.matrix else MODES)
    checks = ((levels, (LINEAR, LOGITS), "level"), (regimes, data.ALL_REGIMES, "data regime"))
    for vals, allowed, what in (*checks, (modes, MODES, "mode")):
        bad = [v for v in vals if v not in allowed]
        if bad or not vals:
            raise SystemExit(f"bad {what}(s) {bad or vals}; expected some of {allowed}")
    if args.matrix:
        shapes = matrix_shapes(_csv(args.matrix_heads) or None, [int(n) for n in _csv(args.matrix_n)] or None)
        levels = (LINEAR,)
    elif args.sweep:
        _, D, V = data.SHAPES[data.SWEEP_BASE]
        ns = [int(n) for n in _csv(args.sweep_n)] or list(data.SWEEP_N)
        shapes = [data.Shape(f"{data.SWEEP_BASE}@N={n}", n, D, V, sweep=True) for n in ns]
        levels = tuple(lvl for lvl in levels if lvl == LINEAR) or (LINEAR,)
    else:
        shapes = [data.parse_shape(s) for s in _csv(args.shapes) or (QUICK if args.quick else data.SHAPES)]
    return Config(
        shapes=shapes, providers=providers, regimes=regimes, modes=modes, levels=levels, device=device,
        seed=args.seed, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms, min_reps=args.min_reps,
        out_dir=None if args.no_save else (args.out or RESULTS), plots=not args.no_plots,
        tag=args.tag or ("sweep" if args.sweep else ""), log=lambda s: print(s, flush=True),
        resume_rows=tuple(json.loads(args.resume.read_text())["rows"]) if args.resume else (),
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.list:
        for p in all_providers():
            why = p.unavailable()
            print(f"{p.name:<20} {p.level:<7} {'ok' if why is None else why:<32} {p.description}")
        return 0
    if args.check:  # (imported here: checks imports cce at once, the harness only when a row runs)
        from .checks import run_check

        out = None if args.no_save else (args.out or RESULTS)
        return 1 if run_check(args.check, args.quick, out, args.tag) else 0
    cfg = config_from_args(args)
    if args.matrix and args.matrix_gpus > 1:  # one run on several GPUs: the heads split over them
        out, heads = cfg.out_dir or RESULTS, _csv(args.matrix_heads) or list(MATRIX_HEADS)
        argv = sys.argv[1:] if argv is None else argv
        result = run_on_gpus(argv, heads, args.matrix_gpus, out / "matrix-parts", args.tag)
        for path in save(result, out, cfg.plots, args.tag or "matrix"):
            print(f"# wrote {path}")
    else:
        result = run(cfg)
    if args.matrix:
        print(summarize(result["rows"]))
    return 0 if all(c == 0 for c in result["meta"].get("part_exit_codes", ())) else 1


if __name__ == "__main__":
    sys.exit(main())
