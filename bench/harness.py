"""The benchmark loop. Per (level, shape, data regime): the inputs (bench.data), an fp32 reference
(bench.reference) and the floor (linear level: ``e @ c.T``; logits level: the bytes the loss must
move at the device's copy bandwidth); then every provider in each mode ("fwd" under no_grad,
"fwd+bwd" = loss + autograd.grad): one call for the errors, one for peak memory, then the timing.
An exception (OOM included) becomes the row's status and message. Table, JSON and plots last.
"""

from __future__ import annotations

import dataclasses
import datetime
import gc
import itertools
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
    resume_rows: tuple[dict, ...] = ()  # rows of an earlier result (--resume), kept and not re-run


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


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free(device: torch.device) -> None:
    if device.type == "cuda":
        gc.collect()  # tensors held by reference cycles (autograd graphs, tracebacks) go back now
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def _one_call_ms(fn, setup, device) -> float:
    args = setup() if setup else ()
    if device.type != "cuda":
        t0 = time.perf_counter()
        fn(*args)
        return (time.perf_counter() - t0) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn(*args)
    end.record()
    torch.cuda.synchronize(device)
    return start.elapsed_time(end)


def time_ms(fn, setup, device: torch.device, cfg: Config) -> float:
    """Median ms of ``fn(*setup())``, ``setup`` (may be None) outside the timed region: on CUDA
    ``triton.testing.do_bench`` (L2 flushed before each call), written out where there is a setup;
    on the CPU the wall clock."""
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
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
    for start, end in ev:
        args = setup()
        flush.zero_()
        start.record()
        out = fn(*args)
        end.record()
        del out, args  # (before the next call's fresh inputs are made)
    torch.cuda.synchronize(device)
    return statistics.median(start.elapsed_time(end) for start, end in ev)


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


def _failure(exc: BaseException) -> tuple[str, str]:
    """(status, message) of a row that raised: "oom" or "error", the exception in one short line."""
    oom = isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()
    return "oom" if oom else "error", re.sub(r"\s+", " ", f"{type(exc).__name__}: {exc}".strip())[:300]


def _linear_step(p: Provider, mode: str, e, c, t):
    loss_fn = p.fn
    if mode == FWD:
        fwd, e0, c0 = torch.no_grad()(loss_fn), e.detach(), c.detach()
        return (lambda: fwd(e0, c0, t)), None
    eg, cg = e.detach().requires_grad_(), c.detach().requires_grad_()

    def step():
        loss = loss_fn(eg, cg, t)
        de, dc = torch.autograd.grad(loss, (eg, cg))
        return loss.detach(), de, dc

    return step, None


def _logits_step(p: Provider, mode: str, x, t):
    loss_fn = p.fn
    if mode == FWD:
        fwd, x0 = torch.no_grad()(loss_fn), x.detach()
        if p.fresh_input:
            return (lambda xi: fwd(xi, t)), (lambda: (x.detach().clone(),))
        return (lambda: fwd(x0, t)), None

    def step(xi):
        loss = loss_fn(xi, t)
        (dx,) = torch.autograd.grad(loss, (xi,))
        return loss.detach(), dx

    if p.nonleaf_input:  # a non-leaf copy per call (its backward is never run: grad w.r.t. it)
        leaf = x.detach().requires_grad_()
        return step, torch.enable_grad()(lambda: (leaf.clone(),))
    if p.fresh_input:
        return step, lambda: (x.detach().clone().requires_grad_(),)
    xg = x.detach().requires_grad_()
    return (lambda: step(xg)), None


def run_row(p: Provider, case: dict, inputs: dict, device: torch.device, cfg: Config) -> dict:
    """Runs one provider on one case; never raises (the failure goes into the row)."""
    row = dict(case, provider=p.name, status="ok", error=None)
    t0 = time.perf_counter()
    why = p.unavailable() or ("needs CUDA" if p.needs_cuda and device.type != "cuda" else None)
    if why is not None:
        row.update(status="unavailable", error=why)
        return row
    step = setup = out = None
    try:
        linear, bwd = case["level"] == LINEAR, case["mode"] == FWDBWD
        if linear:
            step, setup = _linear_step(p, case["mode"], inputs["e"], inputs["c"], inputs["t"])
        else:
            step, setup = _logits_step(p, case["mode"], inputs["x"], inputs["t"])
        out = step(*(setup() if setup else ()))  # 1) warm-up / compilation, and the errors
        sync(device)
        ref = inputs["ref"]
        row["loss"] = float(out[0] if bwd else out)
        if p.reference:  # (False: another objective, nothing to compare with)
            ref_loss = ref.loss if linear else ref.losses[p.shift]
            row["ref_loss"] = ref_loss
            row["loss_err"] = abs(row["loss"] - ref_loss) / abs(ref_loss) if ref_loss else abs(row["loss"])
            if bwd and linear:
                row.update(de_err=rel_l2(out[1], ref.de), dc_err=rel_l2(out[2], ref.dc))
            elif bwd:
                row["dx_err"] = ref.grad_err(out[1].reshape(ref.x.shape), p.shift)
        out = None
        # 2) peak memory, 3) time
        row["peak_mb"] = peak_mb(step, setup, device)
        row["ms"] = time_ms(step, setup, device, cfg)
        if case.get("floor_ms"):
            row["x_floor"] = row["ms"] / case["floor_ms"]
        if row["peak_mb"] is not None and case.get("grad_mb"):
            row["mem_x_grad"] = row["peak_mb"] / case["grad_mb"]
        if case["level"] == LOGITS and case.get("copy_gbs"):
            row["bw_frac"] = case["bytes"] / (row["ms"] * 1e-3) / (case["copy_gbs"] * 1e9)
    except Exception as exc:  # noqa: BLE001 - every failure is a row, the run goes on
        row["status"], row["error"] = _failure(exc)
        if cfg.tag == "debug":
            traceback.print_exc()
    finally:
        out = step = setup = None
        _free(device)
        row["s"] = round(time.perf_counter() - t0, 2)  # the row's wall time: compile, warm-up, timing
    return row


def _git_commit() -> str | None:
    """The checkout's commit (+ "-dirty"), or None without git; CCE_BENCH_COMMIT names it instead
    (a tree copied without its history)."""
    if os.environ.get("CCE_BENCH_COMMIT"):
        return os.environ["CCE_BENCH_COMMIT"]
    root = str(Path(__file__).resolve().parents[1])
    try:
        out = subprocess.run(["git", "-C", root, "describe", "--always", "--dirty", "--exclude=*"],
                             capture_output=True, text=True, timeout=10)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _progress(i: int, total: int, row: dict) -> str:
    head = f"[{i:>3}/{total}] {row['level']:<6} {row['shape']:<18} {row['regime']:<6} {row['mode']:<7} "
    head += f"{row['provider']:<20}"
    if row["status"] != "ok":
        return head + f" {row['status'].upper()}: {row['error']}"
    parts = [f"{row['ms']:9.3f} ms", f"({row['s']:.0f} s)"]
    fields = (("x_floor", "{:5.2f}x floor"), ("peak_mb", "{:9.1f} MB"), ("loss_err", "loss_err {:.1e}"),
              ("de_err", "de {:.1e}"), ("dc_err", "dc {:.1e}"), ("dx_err", "dx {:.1e}"))  # fmt: skip
    parts += [spec.format(row[k]) for k, spec in fields if row.get(k) is not None]
    if row.get("bw_frac") is not None:
        parts.append(f"bw {100 * row['bw_frac']:.0f}%")
    return head + " " + "  ".join(parts)


def _case_inputs(lvl: str, shape: Shape, regime: str, device, cfg: Config, base: dict):
    """(inputs, None) or ({}, (status, message)); fills the floor / gradient size into ``base``."""
    inputs: dict = {}
    kw = dict(dtype=cfg.dtype, device=device, seed=cfg.seed)
    try:
        if lvl == LINEAR:
            e, c, t = data.make_inputs(shape.N, shape.D, shape.V, regime, **kw)
            inputs.update(e=e, c=c, t=t, ref=linear_reference(e, c, t), check=(e, c, t))
            if base is not None:
                base["floor_ms"] = time_ms(lambda: e @ c.T, None, device, cfg)
                base["grad_mb"] = (e.numel() * e.element_size() + c.numel() * c.element_size()) / 2**20
        else:
            x, t = data.make_logits(shape.N, shape.D, shape.V, regime, **kw)
            inputs.update(x=x, t=t, ref=logits_reference(x, t), check=(x, t))
            if base is not None:
                base["grad_mb"] = x.numel() * x.element_size() / 2**20
        inputs["fingerprint"] = fingerprint(*inputs["check"])
        sync(device)
        return inputs, None
    except Exception as exc:  # noqa: BLE001 - e.g. OOM while building a sweep case's inputs
        err = _failure(exc)
    inputs.clear()
    _free(device)
    return {}, err


def row_key(row: dict, provider: str) -> tuple:
    """What identifies a row of a result: (level, shape, regime, mode, provider)."""
    return (row["level"], row["shape"], row["regime"], row["mode"], provider)


def run(cfg: Config) -> dict:
    """Runs every (level, shape, regime, mode, provider) row of ``cfg``; returns the result dict."""
    device = torch.device(cfg.device)
    started = datetime.datetime.now(datetime.timezone.utc)
    cpu = f"cpu ({platform.processor() or platform.machine()})"
    meta = dict(
        date=started.isoformat(timespec="seconds"),
        gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else cpu, device=str(device),
        python=sys.version.split()[0], versions=versions(cfg.providers),
        dtype=str(cfg.dtype).replace("torch.", ""), seed=cfg.seed, ignore_every=data.IGNORE_EVERY,
        timing=dict(warmup_ms=cfg.warmup_ms, rep_ms=cfg.rep_ms, min_reps=cfg.min_reps, return_mode="median"),
        providers={p.name: p.description for p in cfg.providers}, argv=sys.argv[1:], git=_git_commit(),
    )  # fmt: skip
    keys = set(itertools.product(cfg.levels, [s.name for s in cfg.shapes], cfg.regimes, cfg.modes,
                                 [p.name for p in cfg.providers]))  # fmt: skip
    rows: list[dict] = [r for r in cfg.resume_rows if row_key(r, r["provider"]) in keys]
    done = {row_key(r, r["provider"]) for r in rows}
    if rows:
        meta["resumed_rows"] = len(rows)
    want = {lvl: [p for p in cfg.providers if p.level == lvl] for lvl in cfg.levels}
    cases = [(lvl, shape, regime) for lvl in cfg.levels if want[lvl] for shape in cfg.shapes
             if not (shape.sweep and lvl == LOGITS) for regime in cfg.regimes]  # fmt: skip
    total = sum(len([p for p in want[lvl] if m in p.modes]) for lvl, _, _ in cases for m in cfg.modes)
    copy_gbs = None  # device-to-device copy bandwidth, GB/s counting bytes read + written
    if device.type == "cuda" and any(lvl == LOGITS for lvl, _, _ in cases):
        src = torch.empty(COPY_BYTES, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        copy_gbs = 2 * COPY_BYTES / (time_ms(lambda: dst.copy_(src), None, device, cfg) * 1e-3) / 1e9
        del src, dst
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
        floor = f", floor {base['floor_ms']:.3f} ms" if "floor_ms" in base else ""
        cfg.log(f"# {lvl} {shape.name} (N={shape.N}, D={shape.D}, V={shape.V}) {regime}: inputs + reference "
                f"{time.perf_counter() - t0:.1f} s{floor}")  # fmt: skip
        for mode in cfg.modes:
            case = dict(base, mode=mode)
            if lvl == LOGITS:
                elt = torch.finfo(cfg.dtype).bits // 8
                case["bytes"] = (3 if mode == FWDBWD else 1) * shape.N * shape.V * elt
                case["copy_gbs"] = copy_gbs
                if copy_gbs:
                    case["floor_ms"] = case["bytes"] / (copy_gbs * 1e9) * 1e3
            for p in (p for p in want[lvl] if mode in p.modes):
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
    result = {"meta": dict(meta, complete=True), "rows": rows}
    cfg.log("\n" + format_table(result))
    for path in save(result, cfg.out_dir, cfg.plots, cfg.tag) if cfg.out_dir is not None else ():
        cfg.log(f"# wrote {path}")
    return result


def fmt(v, spec: str) -> str:
    return "-" if v is None or (isinstance(v, float) and not math.isfinite(v)) else format(v, spec)


_COLUMNS = {  # (header, row key, format) of each level's table, between the case and the status
    LINEAR: (("ms", "ms", ".2f"), ("floor ms", "floor_ms", ".2f"), ("x floor", "x_floor", ".2f"),
             ("peak MB", "peak_mb", ".0f"), ("x grads", "mem_x_grad", ".2f"), ("loss err", "loss_err", ".1e"),
             ("dE err", "de_err", ".1e"), ("dC err", "dc_err", ".1e")),
    LOGITS: (("ms", "ms", ".2f"), ("floor ms", "floor_ms", ".2f"), ("x floor", "x_floor", ".2f"),
             ("bw %", "bw_pct", ".0f"), ("peak MB", "peak_mb", ".0f"), ("x grad", "mem_x_grad", ".2f"),
             ("loss err", "loss_err", ".1e"), ("dX err", "dx_err", ".1e")),
}  # fmt: skip


def format_table(result: dict) -> str:
    """The rows as a Markdown table (one per level), failures with their message."""
    out = []
    for lvl, cols in _COLUMNS.items():
        rows = [r for r in result["rows"] if r["level"] == lvl]
        if not rows:
            continue
        head = ["shape", "data", "mode", "provider", *(c[0] for c in cols), "status"]
        out += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in rows:
            r = dict(r, bw_pct=None if r.get("bw_frac") is None else 100 * r["bw_frac"])
            cells = [r[k] for k in ("shape", "regime", "mode", "provider")]
            cells += [fmt(r.get(k), f) for _, k, f in cols]
            ok = r["status"] == "ok"
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
    """Writes ``<gpu>_<date>[_tag].json`` (+ PNG plots) under ``out_dir``; returns the paths. (The
    date is the run's start: the partial saves during a run overwrite one file.)"""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.fromisoformat(result["meta"]["date"]).strftime("%Y%m%d-%H%M%S")
    stem = f"{_slug(result['meta']['gpu'].split(' (')[0])}_{stamp}"
    stem += f"_{_slug(tag)}" if tag and tag != "debug" else ""
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
