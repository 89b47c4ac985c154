"""PNG plots of a benchmark result (failed rows left out): ``<stem>_<level>_<regime>.png`` (bars of
median ms and peak MB per shape and provider), ``<stem>_sweep_<regime>.png`` (the same against N),
``<stem>_matrix.png`` (a ``--matrix`` result: per regime, heads x N coloured by fastest peer / cce
default, marked where the default is not the fastest). ``python -m bench.plot RESULT.json`` redraws.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.colors import LogNorm  # noqa: E402

from .matrix import CCE, EXACT, MATRIX_HEADS, cells, fastest_peer  # noqa: E402


def _ok(rows):
    return [r for r in rows if r.get("status") == "ok" and r.get("ms") is not None]


def _order(seq):
    return list(dict.fromkeys(seq))


def _save(fig, path: Path, result: dict, tight: bool = True, extra: str = "", fontsize: int = 9) -> Path:
    meta = result["meta"]
    fig.suptitle(f"{meta['gpu']}, {meta['dtype']}, {meta['date']}{extra}", fontsize=fontsize)
    if tight:
        fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# (key, axis label, key of the black reference, its name) of the two rows of panels
PANELS = (("ms", "median ms", "floor_ms", "floor"),
          ("peak_mb", "peak MB above inputs", "grad_mb", "gradient buffers"))  # fmt: skip


def _panels(result: dict, rows: list[dict], path: Path, name: str, sweep: bool) -> Path | None:
    """ms and peak MB (rows of panels) per mode (columns), one series per provider: bars grouped by
    shape, or lines against N (``sweep``); the floor and the gradient buffers in black."""
    ok = _ok(rows)
    if not ok:
        return None
    shapes, modes = _order(r["shape"] for r in rows), _order(r["mode"] for r in rows)
    provs = _order(r["provider"] for r in ok)
    fig, axes = plt.subplots(2, len(modes), figsize=(5.5 * len(modes) + 1, 8), squeeze=False)
    width = 0.8 / max(len(provs), 1)
    x = (lambda r: r["N"]) if sweep else (lambda r: shapes.index(r["shape"]))
    for j, mode in enumerate(modes):
        for k, (key, label, ref_key, ref_name) in enumerate(PANELS):
            ax = axes[k][j]
            for pi, prov in enumerate(provs):
                mine = [r for r in ok if (r["mode"], r["provider"]) == (mode, prov)]
                pts = sorted((x(r), r[key]) for r in mine if r.get(key) is not None)
                if pts and sweep:
                    ax.plot(*zip(*pts, strict=True), marker="o", label=prov)
                elif pts:
                    shift = (pi - (len(provs) - 1) / 2) * width
                    ax.bar([i + shift for i, _ in pts], [y for _, y in pts], width, label=prov)
            owed = key == "ms" or mode != "fwd"  # a forward without grad owes no gradient buffers
            refs = sorted({(x(r), r[ref_key]) for r in rows if r["mode"] == mode and r.get(ref_key) and owed})
            if refs and sweep:
                ax.plot(*zip(*refs, strict=True), "k--", label=ref_name)
            for i, v in refs if not sweep else ():
                ax.hlines(v, i - 0.45, i + 0.45, colors="k", linewidth=1.5)
            if sweep:
                ax.set_xscale("log", base=2)
                ax.set_xlabel("N (tokens)")
            else:  # long lists of names (the matrix's head@N) are turned so as not to overlap
                turn = dict(fontsize=7, rotation=35, ha="right") if len(shapes) > 6 else dict(fontsize=8)
                ax.set_xticks(range(len(shapes)), shapes, **turn)
            if sweep or key == "peak_mb":
                ax.set_yscale("log")
            ax.set_ylabel(label)
            black = f" (black: {ref_name})" if owed and not sweep else ""
            ax.set_title(f"{name} {mode}{black}", fontsize=9)
    axes[0][0].legend(fontsize=7, ncol=2)
    return _save(fig, path, result)


def _matrix(result: dict, path: Path) -> Path | None:
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
        ax.set_xticks(range(len(ns)), [str(n) for n in ns], fontsize=8)
        ax.set_yticks(range(len(heads)), heads if ax is axes[0][0] else [""] * len(heads), fontsize=8)
        ax.set_xlabel("N (tokens)", fontsize=8)
        ax.set_title(regime, fontsize=9)
    fig.colorbar(im, ax=axes[0].tolist(), shrink=0.8, label="fastest peer / cce default")
    extra = ": speedup of the default over the fastest peer (*: the default is not the fastest choice)"
    return _save(fig, path, result, tight=False, extra=extra, fontsize=8)


def plot_result(result: dict, out_dir: Path, stem: str) -> list[Path]:
    """Writes the plots of ``result`` into ``out_dir``; returns the paths written."""
    out_dir = Path(out_dir)
    paths = []
    regimes = _order(r["regime"] for r in result["rows"])
    table = [r for r in result["rows"] if not r.get("sweep")]
    for level in ("linear", "logits"):
        for regime in regimes:
            rows = [r for r in table if (r["level"], r["regime"]) == (level, regime)]
            path = out_dir / f"{stem}_{level}_{regime}.png"
            paths.append(_panels(result, rows, path, f"{level} {regime}", sweep=False))
    for regime in regimes:
        rows = [r for r in result["rows"] if r.get("sweep") and r["regime"] == regime]
        name = f"N sweep {rows[0]['D']}x{rows[0]['V']} {regime}" if rows else ""
        paths.append(_panels(result, rows, out_dir / f"{stem}_sweep_{regime}.png", name, sweep=True))
    paths.append(_matrix(result, out_dir / f"{stem}_matrix.png"))
    return [p for p in paths if p]


if __name__ == "__main__":  # python -m bench.plot RESULT.json: redraws a saved result's plots beside it
    for arg in sys.argv[1:]:
        print(*plot_result(json.loads(Path(arg).read_text()), Path(arg).parent, Path(arg).stem), sep="\n")
