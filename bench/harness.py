"""The benchmark loop: inputs, fp32 references, timing, peak memory, errors, table and JSON.

Per (level, shape, data regime) the inputs are generated once (bench.data), an fp32 reference is
computed from the same bf16 inputs (chunked, never the whole N x V in fp32), and the "floor" is
measured in the same run:

- linear level: the forward matmul ``e @ c.T`` in the inputs' dtype, timed like the providers;
- logits level: the bytes the loss must move (fwd: read the logits once; fwd+bwd: read them twice
  and write the gradient once, 3 * N * V * 2 bytes in bf16) at the device-to-device copy bandwidth
  measured at the start of the run (bytes read + written per second).

Then every provider runs each mode ("fwd" under no_grad; "fwd+bwd" = loss + torch.autograd.grad
w.r.t. the inputs): one call that also compiles/warms up and gives the errors, one call for peak
memory, then the timing. Any exception (OOM included) becomes the row's status and message; memory
is freed and the CUDA cache emptied before the next provider.
"""

from __future__ import annotations

import dataclasses
import datetime
import gc
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

from . import data
from .data import Shape
from .providers import FWD, FWDBWD, LINEAR, LOGITS, MODES, Provider, versions
from .reference import linear_reference, logits_reference, rel_l2

IGNORE_INDEX = data.IGNORE_INDEX
COPY_BYTES = 1 << 31  # the bandwidth probe copies a 2 GiB buffer


@dataclasses.dataclass
class Config:
    shapes: list[Shape]
    providers: list[Provider]
    regimes: tuple[str, ...] = data.REGIMES
    modes: tuple[str, ...] = MODES
    levels: tuple[str, ...] = (LINEAR, LOGITS)
    device: str = "cuda"
    dtype: torch.dtype = torch.bfloat16
    seed: int = 0
    warmup_ms: float = 25.0
    rep_ms: float = 100.0
    min_reps: int = 10  # the timed window is widened to hold at least this many calls
    out_dir: Path | None = None
    plots: bool = True
    tag: str = ""
    log: Callable[[str], None] = print
    # Rows of an earlier result (--resume): the rows with the same key are kept and not re-run.
    resume_rows: tuple[dict, ...] = ()


def fingerprint(*tensors: torch.Tensor) -> list[int]:
    """Exact integer checksums of the tensors' bits (detects a provider writing into its inputs)."""
    out = []
    for x in tensors:
        ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]
        flat = x.detach().contiguous().view(ints).reshape(-1)
        step = 1 << 26  # chunks bound any int64 temporary of the reduction to 512 MB
        total = sum(flat[s : s + step].sum(dtype=torch.int64) for s in range(0, flat.numel(), step))
        out.append(int(total))
    return out


def _ratio(num: torch.Tensor, den: torch.Tensor) -> float:
    num, den = float(num.sqrt()), float(den.sqrt())
    return num / den if den > 0 else num


# --- timing and memory ------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free(device: torch.device) -> None:
    if device.type == "cuda":
        gc.collect()  # tensors held by reference cycles (autograd graphs, tracebacks) go back now
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def _one_call_ms(fn, setup, device) -> float:
    args = setup() if setup else ()
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn(*args)
        end.record()
        torch.cuda.synchronize(device)
        del out
        return start.elapsed_time(end)
    t0 = time.perf_counter()
    out = fn(*args)
    del out
    return (time.perf_counter() - t0) * 1e3


def time_ms(fn, setup, device: torch.device, cfg: Config) -> float:
    """Median ms of ``fn(*setup())``; ``setup`` (may be None) runs outside the timed region.

    CUDA without setup: ``triton.testing.do_bench(return_mode="median")`` (L2 flushed before each
    call). CUDA with setup: the same protocol written out (a fresh input per call, made before the
    L2 flush and the start event). CPU: wall clock.
    """
    est = max(_one_call_ms(fn, setup, device), 1e-3)
    rep = max(cfg.rep_ms, cfg.min_reps * est)
    if device.type != "cuda":
        times = [_one_call_ms(fn, setup, device) for _ in range(max(3, min(cfg.min_reps, int(rep / est))))]
        return statistics.median(times)
    if setup is None:
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=cfg.warmup_ms, rep=rep, return_mode="median"))
    flush = torch.empty(256 << 20, dtype=torch.int8, device=device)
    for _ in range(max(1, int(cfg.warmup_ms / est))):
        _one_call_ms(fn, setup, device)
    n = max(cfg.min_reps, int(rep / est))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    for i in range(n):
        args = setup()
        flush.zero_()
        starts[i].record()
        out = fn(*args)
        ends[i].record()
        del out, args
    torch.cuda.synchronize(device)
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True))


def peak_mb(fn, setup, device: torch.device) -> float | None:
    """Peak allocated MB above what was allocated before the call (inputs, fresh copies included)."""
    if device.type != "cuda":
        return None
    _free(device)
    args = setup() if setup else ()
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    out = fn(*args)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del out, args
    return peak / 2**20


def copy_bandwidth_gbs(device: torch.device, cfg: Config) -> float | None:
    """Device-to-device copy bandwidth, GB/s counting bytes read + written."""
    if device.type != "cuda":
        return None
    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), None, device, cfg)
    return 2 * COPY_BYTES / (ms * 1e-3) / 1e9


# --- one row ----------------------------------------------------------------------------------


def _status_of(exc: BaseException) -> str:
    if isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower():
        return "oom"
    return "error"


def _short(exc: BaseException) -> str:
    msg = f"{type(exc).__name__}: {exc}".strip()
    msg = re.sub(r"\s+", " ", msg)
    return msg[:300]


def _linear_step(p: Provider, mode: str, e, c, t):
    loss_fn = p.fn()
    if mode == FWD:
        e0, c0 = e.detach(), c.detach()

        def step():
            with torch.no_grad():
                return loss_fn(e0, c0, t)

        return step, None
    eg, cg = e.detach().requires_grad_(), c.detach().requires_grad_()

    def step():
        loss = loss_fn(eg, cg, t)
        de, dc = torch.autograd.grad(loss, (eg, cg))
        return loss.detach(), de, dc

    return step, None


def _logits_step(p: Provider, mode: str, x, t):
    loss_fn = p.fn()
    if mode == FWD:
        if p.fresh_input:
            return (lambda xi: _no_grad(loss_fn, xi, t)), (lambda: (x.detach().clone(),))
        x0 = x.detach()
        return (lambda: _no_grad(loss_fn, x0, t)), None

    def step(xi):
        loss = loss_fn(xi, t)
        (dx,) = torch.autograd.grad(loss, (xi,))
        return loss.detach(), dx

    if p.nonleaf_input:
        leaf = x.detach().requires_grad_()

        def setup():
            with torch.enable_grad():
                return (leaf.clone(),)  # a non-leaf: its backward is never run (grad w.r.t. it)

        return step, setup
    if p.fresh_input:
        return step, lambda: (x.detach().clone().requires_grad_(),)
    xg = x.detach().requires_grad_()
    return (lambda: step(xg)), None


def _no_grad(fn, *args):
    with torch.no_grad():
        return fn(*args)


def run_row(p: Provider, case: dict, inputs: dict, device: torch.device, cfg: Config) -> dict:
    """Runs one provider on one case; never raises (the failure goes into the row)."""
    row = dict(case, provider=p.name, status="ok", error=None)
    t0 = time.perf_counter()
    why = p.unavailable()
    if why is None and p.needs_cuda and device.type != "cuda":
        why = "needs CUDA"
    if why is not None:
        row.update(status="unavailable", error=why)
        return row
    step = setup = out = None
    try:
        if case["level"] == LINEAR:
            e, c, t = inputs["e"], inputs["c"], inputs["t"]
            step, setup = _linear_step(p, case["mode"], e, c, t)
        else:
            x, t = inputs["x"], inputs["t"]
            step, setup = _logits_step(p, case["mode"], x, t)
        # 1) warm-up / compile, and the errors
        out = step(*(setup() if setup else ()))
        _sync(device)
        ref = inputs["ref"]
        loss = out if case["mode"] == FWD else out[0]
        row["loss"] = float(loss)
        if not p.reference:  # another objective: nothing to compare with the reference
            pass
        elif case["level"] == LINEAR:
            ref_loss = ref.loss
            if case["mode"] == FWDBWD:
                row["de_err"] = rel_l2(out[1], ref.de)
                row["dc_err"] = rel_l2(out[2], ref.dc)
        else:
            ref_loss = ref.losses[p.shift]
            if case["mode"] == FWDBWD:
                row["dx_err"] = ref.grad_err(out[1].reshape(ref.x.shape), p.shift)
        if p.reference:
            row["ref_loss"] = ref_loss
            row["loss_err"] = abs(row["loss"] - ref_loss) / abs(ref_loss) if ref_loss else abs(row["loss"])
        out = None
        # 2) peak memory, 3) time
        row["peak_mb"] = peak_mb(step, setup, device)
        row["ms"] = time_ms(step, setup, device, cfg)
        floor = case.get("floor_ms")
        if floor:
            row["x_floor"] = row["ms"] / floor
        if row["peak_mb"] is not None and case.get("grad_mb"):
            row["mem_x_grad"] = row["peak_mb"] / case["grad_mb"]
        if case["level"] == LOGITS and case.get("copy_gbs"):
            row["bw_frac"] = case["bytes"] / (row["ms"] * 1e-3) / (case["copy_gbs"] * 1e9)
    except Exception as exc:  # noqa: BLE001 - every failure is a row, the run goes on
        row.update(status=_status_of(exc), error=_short(exc))
        if cfg.tag == "debug":
            traceback.print_exc()
    finally:
        out = step = setup = None
        _free(device)
        row["s"] = round(time.perf_counter() - t0, 2)  # the row's wall time: compile, warm-up, timing
    return row


# --- the run ----------------------------------------------------------------------------------


def _gpu_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()})"


def _git_commit() -> str | None:
    """The checkout's commit (+ "-dirty"), or None where there is no git repository (a copied tree).
    CCE_BENCH_COMMIT names it where the tree was copied without (or with a stale) history."""
    if os.environ.get("CCE_BENCH_COMMIT"):
        return os.environ["CCE_BENCH_COMMIT"]
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10)  # fmt: skip
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)  # fmt: skip
        return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def _floor_matmul_ms(e, c, device, cfg: Config) -> float:
    return time_ms(lambda: e @ c.T, None, device, cfg)


def _progress(i: int, total: int, row: dict) -> str:
    head = f"[{i:>3}/{total}] {row['level']:<6} {row['shape']:<18} {row['regime']:<6} {row['mode']:<7} "
    head += f"{row['provider']:<20}"
    if row["status"] != "ok":
        return head + f" {row['status'].upper()}: {row['error']}"
    parts = [f"{row['ms']:9.3f} ms"] + ([f"({row['s']:.0f} s)"] if "s" in row else [])
    if row.get("x_floor") is not None:
        parts.append(f"{row['x_floor']:5.2f}x floor")
    if row.get("peak_mb") is not None:
        parts.append(f"{row['peak_mb']:9.1f} MB")
    if "loss_err" in row:
        parts.append(f"loss_err {row['loss_err']:.1e}")
    for k in ("de_err", "dc_err", "dx_err"):
        if k in row:
            parts.append(f"{k[:2]} {row[k]:.1e}")
    if row.get("bw_frac") is not None:
        parts.append(f"bw {100 * row['bw_frac']:.0f}%")
    return head + " " + "  ".join(parts)


def _case_inputs(lvl: str, shape: Shape, regime: str, device, cfg: Config, base: dict):
    """(inputs, None) or ({}, (status, message)); fills the floor / gradient size into ``base``."""
    inputs: dict = {}
    try:
        if lvl == LINEAR:
            e, c, t = data.make_inputs(shape.N, shape.D, shape.V, regime, dtype=cfg.dtype, device=device,
                                       seed=cfg.seed)  # fmt: skip
            inputs.update(e=e, c=c, t=t, ref=linear_reference(e, c, t), check=(e, c, t))
            if base is not None:
                base["floor_ms"] = _floor_matmul_ms(e, c, device, cfg)
                base["grad_mb"] = (e.numel() * e.element_size() + c.numel() * c.element_size()) / 2**20
        else:
            x, t = data.make_logits(shape.N, shape.D, shape.V, regime, dtype=cfg.dtype, device=device,
                                    seed=cfg.seed)  # fmt: skip
            inputs.update(x=x, t=t, ref=logits_reference(x, t), check=(x, t))
            if base is not None:
                base["grad_mb"] = x.numel() * x.element_size() / 2**20
        inputs["fingerprint"] = fingerprint(*inputs["check"])
        _sync(device)
        return inputs, None
    except Exception as exc:  # noqa: BLE001 - e.g. OOM while building a sweep case's inputs
        err = (_status_of(exc), _short(exc))
    inputs.clear()
    _free(device)
    return {}, err


def row_key(row: dict, provider: str) -> tuple:
    """What identifies a row of a result: (level, shape, regime, mode, provider)."""
    return (row["level"], row["shape"], row["regime"], row["mode"], provider)


def _all_cases(cfg: Config) -> list[dict]:
    return [
        dict(level=p_lvl, shape=shape.name, regime=regime, mode=mode)
        for p_lvl in cfg.levels
        for shape in cfg.shapes
        for regime in cfg.regimes
        for mode in cfg.modes
    ]


def run(cfg: Config) -> dict:
    """Runs every (level, shape, regime, mode, provider) row of ``cfg``; returns the result dict."""
    device = torch.device(cfg.device)
    started = datetime.datetime.now(datetime.timezone.utc)
    meta = {
        "date": started.isoformat(timespec="seconds"),
        "gpu": _gpu_name(device),
        "device": str(device),
        "python": sys.version.split()[0],
        "versions": versions(cfg.providers),
        "dtype": str(cfg.dtype).replace("torch.", ""),
        "seed": cfg.seed,
        "ignore_every": data.IGNORE_EVERY,
        "timing": {"warmup_ms": cfg.warmup_ms, "rep_ms": cfg.rep_ms, "min_reps": cfg.min_reps,
                   "return_mode": "median"},
        "providers": {p.name: p.description for p in cfg.providers},
        "argv": sys.argv[1:],
        "git": _git_commit(),
    }  # fmt: skip
    keys = {row_key(c, p.name) for c in _all_cases(cfg) for p in cfg.providers}
    rows: list[dict] = [r for r in cfg.resume_rows if row_key(r, r["provider"]) in keys]
    done = {row_key(r, r["provider"]) for r in rows}
    if rows:
        meta["resumed_rows"] = len(rows)
    want = {lvl: [p for p in cfg.providers if p.level == lvl] for lvl in cfg.levels}
    cases = [
        (lvl, shape, regime)
        for lvl in cfg.levels
        if want[lvl]
        for shape in cfg.shapes
        if not (shape.sweep and lvl == LOGITS)
        for regime in cfg.regimes
    ]
    total = sum(len([p for p in want[lvl] if m in p.modes]) for lvl, _, _ in cases for m in cfg.modes)
    copy_gbs = copy_bandwidth_gbs(device, cfg) if any(lvl == LOGITS for lvl, _, _ in cases) else None
    meta["copy_gbs"] = copy_gbs
    cfg.log(f"# {meta['gpu']}  torch {meta['versions']['torch']}  triton {meta['versions'].get('triton')}")
    if copy_gbs:
        cfg.log(f"# device-to-device copy: {copy_gbs:.0f} GB/s (read + write)")
    i = 0
    for lvl, shape, regime in cases:
        t0 = time.perf_counter()
        base = dict(level=lvl, shape=shape.name, N=shape.N, D=shape.D, V=shape.V, regime=regime,
                    sweep=shape.sweep)  # fmt: skip
        todo = [(m, p) for m in cfg.modes for p in want[lvl] if m in p.modes]
        if all(row_key(dict(base, mode=m), p.name) in done for m, p in todo):
            i += len(todo)  # every row of this case is in the resumed result: no inputs made
            continue
        inputs, setup_err = _case_inputs(lvl, shape, regime, device, cfg, base)
        base["inputs_s"] = round(time.perf_counter() - t0, 2)  # inputs (a model's training) + reference
        cfg.log(
            f"# {lvl} {shape.name} (N={shape.N}, D={shape.D}, V={shape.V}) {regime}: inputs + reference "
            f"{time.perf_counter() - t0:.1f} s"
            + (f", floor {base['floor_ms']:.3f} ms" if "floor_ms" in base else "")
        )
        for mode in cfg.modes:
            case = dict(base, mode=mode)
            if lvl == LOGITS:
                elt = torch.finfo(cfg.dtype).bits // 8
                case["bytes"] = (3 if mode == FWDBWD else 1) * shape.N * shape.V * elt
                case["copy_gbs"] = copy_gbs
                if copy_gbs:
                    case["floor_ms"] = case["bytes"] / (copy_gbs * 1e9) * 1e3
            for p in want[lvl]:
                if mode not in p.modes:
                    continue
                i += 1
                if row_key(case, p.name) in done:
                    continue
                if setup_err is not None:
                    row = dict(case, provider=p.name, status=setup_err[0], error="inputs: " + setup_err[1])
                else:
                    row = run_row(p, case, inputs, device, cfg)
                    if fingerprint(*inputs["check"]) != inputs["fingerprint"]:
                        # A provider wrote into its inputs: its row is void and the rest need fresh ones.
                        row.update(status="error", error="modified its inputs (row void; inputs regenerated)")
                        inputs.clear()
                        _free(device)
                        inputs, setup_err = _case_inputs(lvl, shape, regime, device, cfg, None)
                rows.append(row)
                cfg.log(_progress(i, total, row))
        inputs.clear()
        setup_err = None
        _free(device)
        if cfg.out_dir is not None:  # partial results survive a run cut short
            save({"meta": dict(meta, complete=False), "rows": rows}, cfg.out_dir, plots=False, tag=cfg.tag)
    meta["seconds"] = round((datetime.datetime.now(datetime.timezone.utc) - started).total_seconds(), 1)
    meta["complete"] = True
    result = {"meta": meta, "rows": rows}
    cfg.log("")
    cfg.log(format_table(result))
    if cfg.out_dir is not None:
        paths = save(result, cfg.out_dir, cfg.plots, cfg.tag)
        for path in paths:
            cfg.log(f"# wrote {path}")
    return result


# --- output -----------------------------------------------------------------------------------


def _fmt(v, spec: str) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    return format(v, spec)


def format_table(result: dict) -> str:
    """The rows as a Markdown table (one per level), failures with their message."""
    out = []
    for lvl in (LINEAR, LOGITS):
        rows = [r for r in result["rows"] if r["level"] == lvl]
        if not rows:
            continue
        if lvl == LINEAR:
            head = ["shape", "data", "mode", "provider", "ms", "floor ms", "x floor", "peak MB", "x grads",
                    "loss err", "dE err", "dC err", "status"]  # fmt: skip
        else:
            head = ["shape", "data", "mode", "provider", "ms", "floor ms", "x floor", "bw %", "peak MB",
                    "x grad", "loss err", "dX err", "status"]  # fmt: skip
        out.append("| " + " | ".join(head) + " |")
        out.append("|" + "---|" * len(head))
        for r in rows:
            ok = r["status"] == "ok"
            cells = [r["shape"], r["regime"], r["mode"], r["provider"], _fmt(r.get("ms"), ".2f"),
                     _fmt(r.get("floor_ms"), ".2f"), _fmt(r.get("x_floor"), ".2f")]  # fmt: skip
            if lvl == LOGITS:
                cells.append(_fmt(None if r.get("bw_frac") is None else 100 * r["bw_frac"], ".0f"))
            cells += [
                _fmt(r.get("peak_mb"), ".0f"),
                _fmt(r.get("mem_x_grad"), ".2f"),
                _fmt(r.get("loss_err"), ".1e"),
            ]
            if lvl == LINEAR:
                cells += [_fmt(r.get("de_err"), ".1e"), _fmt(r.get("dc_err"), ".1e")]
            else:
                cells.append(_fmt(r.get("dx_err"), ".1e"))
            cells.append("ok" if ok else f"{r['status']}: {(r.get('error') or '')[:80]}".replace("|", "/"))
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    meta = result["meta"]
    vers = ", ".join(f"{k} {v}" for k, v in meta["versions"].items() if v)
    out.append(f"{meta['gpu']}; {vers}; {meta['date']}")
    if meta.get("copy_gbs"):
        out.append(f"copy bandwidth {meta['copy_gbs']:.0f} GB/s (read + write)")
    return "\n".join(out)


def _slug(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "-", s).strip("-")[:60]


def save(result: dict, out_dir: Path, plots: bool = True, tag: str = "") -> list[Path]:
    """Writes ``<gpu>_<date>[_tag].json`` (+ PNG plots) under ``out_dir``; returns the paths.

    The date is the run's start, so the partial saves during a run overwrite one file.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = result["meta"]
    stamp = datetime.datetime.fromisoformat(meta["date"]).strftime("%Y%m%d-%H%M%S")
    gpu = meta["gpu"].split(" (")[0]
    stem = f"{_slug(gpu)}_{stamp}" + (f"_{_slug(tag)}" if tag and tag != "debug" else "")
    path = out_dir / f"{stem}.json"
    path.write_text(json.dumps(result, indent=1, default=str) + "\n")
    paths = [path]
    if plots:
        try:
            from .plot import plot_result

            paths += plot_result(result, out_dir, stem)
        except ImportError as exc:  # matplotlib missing: the JSON is the result
            print(f"# no plots: {exc}")
    return paths
