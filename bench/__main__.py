"""``python -m bench``: cce against every peer, one table, JSON + PNG plots in bench/results/.

Examples::

    python -m bench                          # the main table: 4 shapes x random/zipf x fwd, fwd+bwd
    python -m bench --quick                  # gemma2-2b and llama3-8b only
    python -m bench --sweep                  # the N sweep 1024..65536 at llama3-8b (linear level)
    python -m bench --shapes llama3-8b,2048x1024x32000 --providers cce,torch --data zipf --modes fwd+bwd
    python -m bench --list                   # providers and whether they can run here
    python -m bench --quick --levels linear --providers cce,cce-outputs,cce-entropy-bonus
                                             # per-token outputs' cost (issue 18)
    python -m bench --matrix --matrix-heads gpt2 --matrix-n 8192   # a slice of the shape x data matrix
    python -m bench --matrix --matrix-gpus 4 # the whole matrix as one run on 4 GPUs of this host
    python -m bench --check linear [--quick] # correctness of impl="triton" at real sizes (bench/checks.py)
    python -m bench --check logits           # the logits level against the float64 oracle
    torchrun --nproc_per_node 2 -m bench.dist   # vocabulary parallelism on 2 GPUs (bench/dist.py)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from . import data
from .harness import Config, Shape, run
from .providers import LINEAR, LOGITS, MODES, all_providers

RESULTS = Path(__file__).resolve().parent / "results"
QUICK = ("gemma2-2b", "llama3-8b")


def _csv(s: str | None) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()] if s else []


def parse_shape(spec: str) -> Shape:
    """A named shape (bench.data.SHAPES) or ``NxDxV``."""
    if spec in data.SHAPES:
        return Shape(spec, *data.SHAPES[spec])
    parts = spec.lower().split("x")
    if len(parts) == 3 and all(p.isdigit() for p in parts):
        N, D, V = map(int, parts)
        return Shape(spec, N, D, V)
    raise argparse.ArgumentTypeError(f"unknown shape {spec!r}: one of {sorted(data.SHAPES)} or NxDxV")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m bench", description=__doc__.split("\n")[0], epilog=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    ap.add_argument("--quick", action="store_true", help=f"shapes {', '.join(QUICK)} only")
    ap.add_argument("--shapes", help=f"comma list of {', '.join(data.SHAPES)} or NxDxV (default: all named)")
    ap.add_argument(
        "--sweep", action="store_true", help=f"the N sweep at {data.SWEEP_BASE} (linear level), not the table"
    )
    ap.add_argument(
        "--sweep-n", help=f"comma list of N for --sweep (default {','.join(map(str, data.SWEEP_N))})"
    )
    ap.add_argument("--providers", help="comma list of provider names (default: all; see --list)")
    ap.add_argument("--skip", help="comma list of provider names to leave out")
    ap.add_argument("--levels", default=f"{LINEAR},{LOGITS}", help="linear and/or logits (default both)")
    ap.add_argument(
        "--data",
        default=None,
        help=f"comma list of {', '.join(data.ALL_REGIMES)} (default {', '.join(data.REGIMES)}; --matrix all)",
    )
    ap.add_argument("--modes", default=None, help="fwd and/or fwd+bwd (default both; fwd+bwd with --matrix)")
    ap.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup-ms", type=float, default=25.0)
    ap.add_argument(
        "--rep-ms", type=float, default=100.0, help="do_bench's rep (widened to >= --min-reps calls)"
    )
    ap.add_argument("--min-reps", type=int, default=10)
    ap.add_argument("--out", type=Path, default=None, help=f"output folder (default {RESULTS})")
    ap.add_argument("--tag", default="", help="suffix of the output file names ('debug' prints tracebacks)")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--no-save", action="store_true", help="print the table only")
    ap.add_argument("--list", action="store_true", help="list the providers and exit")
    ap.add_argument(
        "--check", choices=(LINEAR, LOGITS), help="correctness at real sizes instead of timings (GPU)"
    )
    ap.add_argument(
        "--matrix",
        action="store_true",
        help="the shape x data matrix (bench/matrix.py): linear level, fwd+bwd, every regime unless --data",
    )
    ap.add_argument("--matrix-heads", help="comma list of the matrix's heads (default all)")
    ap.add_argument(
        "--resume",
        type=Path,
        help="an earlier result JSON of the same command: its rows are kept and only the missing ones run",
    )
    ap.add_argument("--matrix-n", help="comma list of the matrix's token counts (default 2048,8192,32768)")
    ap.add_argument(
        "--matrix-gpus",
        type=int,
        default=1,
        help="run the matrix as one run on this many GPUs of the host: its heads split over that many "
        "processes, one GPU each, results merged into one JSON",
    )
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
    skip = set(_csv(args.skip))
    providers = [p for p in providers if p.name not in skip]
    levels = tuple(_csv(args.levels))
    regimes = tuple(_csv(args.data)) or (data.ALL_REGIMES if args.matrix else data.REGIMES)
    modes = tuple(_csv(args.modes)) or (("fwd+bwd",) if args.matrix else MODES)
    checks = (
        (levels, (LINEAR, LOGITS), "level"),
        (regimes, data.ALL_REGIMES, "data regime"),
        (modes, MODES, "mode"),
    )
    for vals, allowed, what in checks:
        bad = [v for v in vals if v not in allowed]
        if bad or not vals:
            raise SystemExit(f"bad {what}(s) {bad or vals}; expected some of {allowed}")
    if args.matrix:
        from .matrix import matrix_shapes

        shapes = matrix_shapes(_csv(args.matrix_heads) or None, [int(n) for n in _csv(args.matrix_n)] or None)
        levels = (LINEAR,)
    elif args.sweep:
        _, D, V = data.SHAPES[data.SWEEP_BASE]
        ns = [int(n) for n in _csv(args.sweep_n)] or list(data.SWEEP_N)
        shapes = [Shape(f"{data.SWEEP_BASE}@N={n}", n, D, V, sweep=True) for n in ns]
        levels = tuple(lvl for lvl in levels if lvl == LINEAR) or (LINEAR,)
    elif args.shapes:
        shapes = [parse_shape(s) for s in _csv(args.shapes)]
    elif args.quick:
        shapes = [parse_shape(s) for s in QUICK]
    else:
        shapes = [parse_shape(s) for s in data.SHAPES]
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
    if args.check:
        from .checks import run_check

        out = None if args.no_save else (args.out or RESULTS)
        return 1 if run_check(args.check, args.quick, out, args.tag) else 0
    cfg = config_from_args(args)
    if args.matrix and args.matrix_gpus > 1:
        return _matrix_on_gpus(args, cfg, sys.argv[1:] if argv is None else argv)
    result = run(cfg)
    if args.matrix:
        from .matrix import summarize

        print(summarize(result["rows"]))
    return 0


def _matrix_on_gpus(args: argparse.Namespace, cfg: Config, argv: list[str]) -> int:
    from .harness import save
    from .matrix import MATRIX_HEADS, run_on_gpus, summarize

    drop = {"--matrix-gpus", "--matrix-heads", "--out", "--tag"}
    rest, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in drop:
            skip = True
        elif a.split("=")[0] not in drop:
            rest.append(a)
    heads = _csv(args.matrix_heads) or list(MATRIX_HEADS)
    out = cfg.out_dir or RESULTS
    merged = run_on_gpus(rest, heads, args.matrix_gpus, out / "matrix-parts", args.tag)
    merged["meta"]["argv"] = argv
    for path in save(merged, out, cfg.plots, args.tag or "matrix"):
        print(f"# wrote {path}")
    print(summarize(merged["rows"]))
    return 0 if all(c == 0 for c in merged["meta"]["part_exit_codes"]) else 1


if __name__ == "__main__":
    sys.exit(main())
