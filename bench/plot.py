"""PNG plots of a benchmark result (matplotlib, headless).

- ``<stem>_<level>_<regime>.png``: per shape, grouped bars of median ms (the floor as a black
  tick) and of peak MB above the inputs (gradient buffers as a black tick), one column per mode;
- ``<stem>_sweep_<regime>.png``: the N sweep, ms and peak MB against N, one line per provider;
- ``<stem>_matrix.png`` (a ``--matrix`` result): per data regime, a grid of heads x token counts
  coloured by the speedup of cce's default over the fastest peer (fastest peer / default), each
  cell marked where cce's exact path or a peer is faster than the default.

Failed rows are left out of the plots (the table and the JSON keep them).
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _ok(rows):
    return [r for r in rows if r.get("status") == "ok" and r.get("ms") is not None]


def _order(seq):
    return list(dict.fromkeys(seq))


def _bars(result: dict, level: str, regime: str, path: Path) -> Path | None:
    rows = [r for r in result["rows"] if r["level"] == level and r["regime"] == regime and not r.get("sweep")]
    if not _ok(rows):
        return None
    shapes = _order(r["shape"] for r in rows)
    modes = _order(r["mode"] for r in rows)
    provs = _order(r["provider"] for r in _ok(rows))
    fig, axes = plt.subplots(2, len(modes), figsize=(5.5 * len(modes) + 1, 8), squeeze=False)
    width = 0.8 / max(len(provs), 1)
    for j, mode in enumerate(modes):
        for k, (key, label, ref_key) in enumerate(
            (("ms", "median ms", "floor_ms"), ("peak_mb", "peak MB above inputs", "grad_mb"))
        ):
            ax = axes[k][j]
            for pi, prov in enumerate(provs):
                xs, ys = [], []
                for si, shape in enumerate(shapes):
                    for r in _ok(rows):
                        if (r["shape"], r["mode"], r["provider"]) == (shape, mode, prov) and r.get(
                            key
                        ) is not None:
                            xs.append(si + (pi - (len(provs) - 1) / 2) * width)
                            ys.append(r[key])
                if xs:
                    ax.bar(xs, ys, width, label=prov)
            for si, shape in enumerate(shapes):
                if key == "peak_mb" and mode == "fwd":
                    break  # a forward without grad owes no gradient buffers
                refs = [r.get(ref_key) for r in rows if r["shape"] == shape and r["mode"] == mode]
                refs = [v for v in refs if v]
                if refs:
                    ax.hlines(refs[0], si - 0.45, si + 0.45, colors="k", linewidth=1.5)
            ax.set_xticks(range(len(shapes)))
            if len(shapes) > 6:  # long lists of names (the matrix's head@N) would overlap
                ax.set_xticklabels(shapes, fontsize=7, rotation=35, ha="right")
            else:
                ax.set_xticklabels(shapes, fontsize=8)
            ax.set_ylabel(label)
            if key == "peak_mb":
                ax.set_yscale("log")
            ref_name = "floor" if key == "ms" else ("gradient buffers" if mode != "fwd" else "")
            ax.set_title(
                f"{level} {regime} {mode}" + (f" (black: {ref_name})" if ref_name else ""), fontsize=9
            )
    axes[0][0].legend(fontsize=7, ncol=2)
    fig.suptitle(f"{result['meta']['gpu']}, {result['meta']['dtype']}, {result['meta']['date']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _sweep(result: dict, regime: str, path: Path) -> Path | None:
    rows = [r for r in result["rows"] if r.get("sweep") and r["regime"] == regime]
    if not _ok(rows):
        return None
    modes = _order(r["mode"] for r in rows)
    provs = _order(r["provider"] for r in _ok(rows))
    fig, axes = plt.subplots(2, len(modes), figsize=(5.5 * len(modes) + 1, 8), squeeze=False)
    for j, mode in enumerate(modes):
        for k, (key, label) in enumerate((("ms", "median ms"), ("peak_mb", "peak MB above inputs"))):
            ax = axes[k][j]
            for prov in provs:
                pts = sorted(
                    (r["N"], r[key])
                    for r in _ok(rows)
                    if r["mode"] == mode and r["provider"] == prov and r.get(key) is not None
                )
                if pts:
                    ax.plot(*zip(*pts, strict=True), marker="o", label=prov)
            ref_key = "floor_ms" if key == "ms" else "grad_mb"
            refs = sorted({(r["N"], r[ref_key]) for r in rows if r["mode"] == mode and r.get(ref_key)})
            if refs and (key == "ms" or mode != "fwd"):
                ax.plot(*zip(*refs, strict=True), "k--", label="floor" if key == "ms" else "gradient buffers")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("N (tokens)")
            ax.set_ylabel(label)
            ax.set_title(f"N sweep {rows[0]['D']}x{rows[0]['V']} {regime} {mode}", fontsize=9)
    axes[0][0].legend(fontsize=7, ncol=2)
    fig.suptitle(f"{result['meta']['gpu']}, {result['meta']['dtype']}, {result['meta']['date']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _matrix(result: dict, path: Path) -> Path | None:
    import math

    from matplotlib.colors import LogNorm

    from .matrix import CCE, EXACT, MATRIX_HEADS, cells, fastest_peer

    by_cell = cells(result["rows"])
    if not by_cell or not all("@N=" in shape for shape, _ in by_cell):
        return None
    regimes = _order(regime for _, regime in by_cell)
    heads = [h for h in MATRIX_HEADS if any(shape.startswith(h + "@") for shape, _ in by_cell)]
    ns = sorted({int(shape.split("@N=")[1]) for shape, _ in by_cell})
    size = (2.4 + 1.3 * len(ns) * len(regimes), 0.5 * len(heads) + 2)
    fig, axes = plt.subplots(1, len(regimes), figsize=size, squeeze=False)
    norm = LogNorm(vmin=0.5, vmax=2.0)
    for ax, regime in zip(axes[0], regimes, strict=True):
        grid = [[math.nan] * len(ns) for _ in heads]
        for i, h in enumerate(heads):
            for j, n in enumerate(ns):
                by = by_cell.get((f"{h}@N={n}", regime), {})
                d, best = by.get(CCE), fastest_peer(by)
                if not (d and best):
                    continue
                grid[i][j] = best["ms"] / d["ms"]
                rivals = [best["ms"]] + ([by[EXACT]["ms"]] if EXACT in by else [])
                mark = "" if d["ms"] <= min(rivals) else "*"
                ax.text(j, i, f"{grid[i][j]:.2f}{mark}", ha="center", va="center", fontsize=8)
        im = ax.imshow(grid, cmap="RdYlGn", norm=norm, aspect="auto")
        ax.set_xticks(range(len(ns)))
        ax.set_xticklabels([str(n) for n in ns], fontsize=8)
        ax.set_yticks(range(len(heads)))
        ax.set_yticklabels(heads if ax is axes[0][0] else [""] * len(heads), fontsize=8)
        ax.set_xlabel("N (tokens)", fontsize=8)
        ax.set_title(regime, fontsize=9)
    fig.colorbar(im, ax=axes[0].tolist(), shrink=0.8, label="fastest peer / cce default")
    fig.suptitle(
        f"{result['meta']['gpu']}, {result['meta']['dtype']}, {result['meta']['date']}: speedup of the "
        "default over the fastest peer (*: the default is not the fastest choice)",
        fontsize=8,
    )
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_result(result: dict, out_dir: Path, stem: str) -> list[Path]:
    """Writes the plots of ``result`` into ``out_dir``; returns the paths written."""
    out_dir = Path(out_dir)
    paths = []
    regimes = _order(r["regime"] for r in result["rows"])
    for level in ("linear", "logits"):
        for regime in regimes:
            p = _bars(result, level, regime, out_dir / f"{stem}_{level}_{regime}.png")
            if p:
                paths.append(p)
    for regime in regimes:
        p = _sweep(result, regime, out_dir / f"{stem}_sweep_{regime}.png")
        if p:
            paths.append(p)
    p = _matrix(result, out_dir / f"{stem}_matrix.png")
    if p:
        paths.append(p)
    return paths


def main(argv=None) -> None:
    """``python -m bench.plot RESULT.json``: (re)draws the plots of a saved result beside it."""
    import argparse
    import json

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("result", type=Path)
    args = ap.parse_args(argv)
    result = json.loads(args.result.read_text())
    for p in plot_result(result, args.result.parent, args.result.stem):
        print(p)


if __name__ == "__main__":
    main()
