"""GPU check of issue 7 (logits-level cross entropy) in one call: correctness, optional config
sweep, timing and memory against the peers, results as JSON (and optionally a markdown section).

    python3 bench/gpu_ce_check.py [--sweep] [--json $OUT/ce.json] [--md docs/benchmarks.md]

Shapes: bf16 logits, N = 8192, V = 256000 and 128256, every 17th target ignored (BRIEF.md's
setting). fwd+bwd = ``loss = f(x, t); torch.autograd.grad(loss, x)`` for a fresh intermediate
``x`` (a clone made outside the timed region: Liger overwrites its input, and cce's in-place
backward overwrites x). Each iteration is timed on its own with CUDA events; the median is
reported. The copy bandwidth is a device-to-device copy of a logits-sized bf16 tensor in the same
run, counting bytes read + written. "Bytes moved" for the cross entropy counts the logits read
twice and the gradient written once: 3 N V 2 bytes. Memory: peak allocated above the inputs
during forward+backward (the returned gradient included).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from cce.cross_entropy import cross_entropy  # noqa: E402
from cce.kernels import cross_entropy as K  # noqa: E402
from cce.reference import cross_entropy_reference  # noqa: E402

DEV = torch.device("cuda")
IGNORE_EVERY = 17


def rel(a, b):
    a, b = a.double(), b.double()
    d = b.norm()
    return float((a - b).norm() / d) if d > 0 else float((a - b).norm())


def make(N, V, dtype, seed=0, scale=2.0, lead=None):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = (torch.randn(N, V, generator=g, device=DEV) * scale).to(dtype)
    t = torch.randint(0, V, (N,), generator=g, device=DEV)
    t[::IGNORE_EVERY] = -100
    if lead is not None:
        x, t = x.view(*lead, V), t.view(*lead)
    return x, t


# ------------------------------------------------------------------------------------------------
# correctness


def check_case(name, x, t, tol, **kw):
    """cce vs the fp64 oracle on loss, lse and the gradient under random upstream gradients."""
    inplace = kw.pop("inplace_backward", False)
    g = torch.Generator(device=DEV).manual_seed(1)
    leaf = x.detach().clone().requires_grad_()
    xin = leaf.clone() if inplace else leaf
    out = cross_entropy(xin, t, inplace_backward=inplace, **kw)
    outs = out if isinstance(out, tuple) else (out,)
    ups = [torch.randn(o.shape, generator=g, device=DEV) for o in outs]
    total = sum((o * u).sum() for o, u in zip(outs, ups, strict=True))
    (gx,) = torch.autograd.grad(total, xin)
    x64 = x.detach().double().requires_grad_()
    ref = cross_entropy_reference(x64, t, dtype=torch.float64, **kw)
    refs = ref if isinstance(ref, tuple) else (ref,)
    rtotal = sum((o * u.double()).sum() for o, u in zip(refs, ups, strict=True))
    (ref_leaf,) = torch.autograd.grad(rtotal, x64)
    errs = [rel(o, r) for o, r in zip(outs, refs, strict=True)]
    gerr = rel(gx, ref_leaf)
    ok = all(e < 1e-5 for e in errs) and gerr < tol and bool(torch.isfinite(gx).all())
    print(f"  {name:34s} loss/lse err {max(errs):.2e}  grad err {gerr:.2e}  {'ok' if ok else 'FAIL'}")
    return {"case": name, "loss_err": max(errs), "grad_err": gerr, "ok": ok}


def correctness():
    res = []
    # Gradient tolerance: the gradient is rounded to the logits' dtype (bf16 unit 2^-8 -> ~4e-3
    # relative L2; fp16 2^-11; fp32 exact math in fp32, ~1e-6).
    tols = {torch.bfloat16: 8e-3, torch.float16: 1e-3, torch.float32: 1e-5}
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        x, t = make(512, 32000, dtype, seed=2)
        res.append(check_case(f"{dtype} plain", x, t, tols[dtype]))
        res.append(
            check_case(
                f"{dtype} all options",
                x,
                t,
                tols[dtype],
                softcap=15.0,
                label_smoothing=0.1,
                weight=torch.rand(32000, device=DEV) + 0.5,
                z_loss=1e-4,
                return_lse=True,
            )
        )
    x, t = make(4, 256000, torch.bfloat16, seed=3)  # few rows: vocabulary split across programs
    res.append(check_case("bf16 split N=4 V=256000", x, t, 8e-3, label_smoothing=0.05, return_lse=True))
    x, t = make(6 * 100, 50257, torch.bfloat16, seed=4, lead=(6, 100))
    res.append(check_case("bf16 shift (6,100,V) inplace", x, t, 8e-3, shift=True, inplace_backward=True))
    xt = x.transpose(0, 1)  # (100, 6, V): leading dims not flattenable -> row-offset table
    res.append(check_case("bf16 transposed rows", xt, t.transpose(0, 1), 8e-3, reduction="none"))
    res.append(check_case("bf16 transposed inplace", xt, t.transpose(0, 1), 8e-3, inplace_backward=True))
    xs = x[..., :50000]  # row stride != V
    res.append(check_case("bf16 sliced classes", xs, t.clamp(max=49999), 8e-3, reduction="sum"))
    # N * V > 2^31: int64 offsets. Compare the first and last rows with the oracle on those rows.
    N, V = 8448, 256000
    x, t = make(N, V, torch.bfloat16, seed=5)
    xl = x.requires_grad_()
    loss = cross_entropy(xl, t, reduction="none")
    (gx,) = torch.autograd.grad(loss.sum(), xl)
    errs = []
    for sl in (slice(0, 16), slice(N - 16, N)):
        xr = x.detach()[sl].double().requires_grad_()
        lr = cross_entropy_reference(xr, t[sl], dtype=torch.float64, reduction="none")
        (gr,) = torch.autograd.grad(lr.sum(), xr)
        errs += [rel(loss[sl], lr), rel(gx[sl], gr)]
    ok = errs[0] < 1e-5 and errs[2] < 1e-5 and errs[1] < 8e-3 and errs[3] < 8e-3
    print(f"  N*V={N * V} > 2^31 rows 0/-1: {errs}  {'ok' if ok else 'FAIL'}")
    res.append({"case": "N*V>2^31", "errs": errs, "ok": ok})
    del x, xl, gx, loss
    torch.cuda.empty_cache()
    return res


# ------------------------------------------------------------------------------------------------
# timing


def time_iters(setup, fn, iters=15, warmup=3):
    """Median ms of fn(*setup()) with each call timed alone (setup outside the timed region)."""
    times = []
    for i in range(warmup + iters):
        args = setup()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn(*args)
        b.record()
        b.synchronize()
        if i >= warmup:
            times.append(a.elapsed_time(b))
        del args
    return statistics.median(times)


def copy_bandwidth(nbytes):
    src = torch.randn(nbytes // 2, device=DEV).to(torch.bfloat16)
    dst = torch.empty_like(src)
    ms = time_iters(lambda: (), lambda: dst.copy_(src), iters=20)
    return 2 * nbytes / (ms * 1e-3) / 1e12  # TB/s, read + write


def peak_extra(setup, fn):
    args = setup()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn(*args)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out, args
    return peak / 2**20


def sweep(N, V):
    """Times the forward and backward launchers alone over a few (BLOCK_V, num_warps)."""
    x, t = make(N, V, torch.bfloat16, seed=7)
    lse, _, _ = K.ce_forward(x, t, None, -100, 0.0, False)
    a = torch.rand(N, device=DEV)
    z = torch.zeros(N, device=DEV)
    out = {}
    nbytes = N * V * 2
    for bv, nw in [(2048, 4), (4096, 4), (4096, 8), (8192, 8), (8192, 16), (16384, 16)]:

        def fwd(bv=bv, nw=nw):
            K.ce_forward(x, t, None, -100, 0.0, False, block_v=bv, num_warps=nw)

        def bwd(bv=bv, nw=nw):
            K.ce_backward(x, t, None, lse, a, a, z, -100, 0.0, False, inplace=True, block_v=bv, num_warps=nw)

        f = time_iters(lambda: (), fwd)
        b = time_iters(lambda: (), bwd)
        out[f"{bv}x{nw}"] = {
            "fwd_ms": f,
            "bwd_ms": b,
            "fwd_TBs": nbytes / f / 1e9,
            "bwd_TBs": 2 * nbytes / b / 1e9,
        }
        print(f"  V={V} BLOCK_V={bv:5d} warps={nw:2d}: fwd {f:.3f} ms ({nbytes / f / 1e9:.2f} TB/s)  "
              f"bwd {b:.3f} ms ({2 * nbytes / b / 1e9:.2f} TB/s)")  # fmt: skip
    torch.cuda.empty_cache()
    return out


def providers():
    ps = {
        "cce": lambda x, t: cross_entropy(x, t),
        "cce_inplace": lambda x, t: cross_entropy(x, t, inplace_backward=True),
        "torch_eager": lambda x, t: F.cross_entropy(x.float(), t),
    }
    compiled = torch.compile(lambda x, t: F.cross_entropy(x.float(), t))
    ps["torch_compile"] = compiled
    try:
        from liger_kernel.transformers.cross_entropy import LigerCrossEntropyLoss

        liger = LigerCrossEntropyLoss()
        ps["liger"] = lambda x, t: liger(x, t)
    except Exception as exc:  # noqa: BLE001 - a peer that does not import is reported, not fatal
        print("liger not importable:", exc)
    # Causal-shift losses on (1, N, V): the seeds' crossentropy-triton copies logits[..., :-1, :].
    ps["cce_shift"] = lambda x, t: cross_entropy(x[None], t[None], shift=True)
    try:
        from crossentropy_triton import CrossEntropyFunction

        ps["crossentropy_triton_shift"] = lambda x, t: CrossEntropyFunction.apply(x[None], t[None], -100)
    except Exception as exc:  # noqa: BLE001
        print("crossentropy_triton not importable:", exc)
    return ps


def bench_shape(N, V, ps):
    buf, t = make(N, V, torch.bfloat16, seed=11)
    leaf = buf.requires_grad_()
    nbytes = N * V * 2
    rows = {}
    for name, f in ps.items():
        # A fresh non-leaf intermediate per call, made outside the timed region.
        def setup_x():
            return (leaf.clone(),)

        def run(x, f=f):
            loss = f(x, t)
            (g,) = torch.autograd.grad(loss, x)
            return g

        try:
            ms = time_iters(setup_x, run, iters=10 if name == "torch_eager" else 15)
            mem = peak_extra(setup_x, run)
        except torch.OutOfMemoryError as exc:
            print(f"  {name}: OOM {exc}")
            continue
        rows[name] = {"ms": ms, "extra_MB": mem, "TBs_3NV": 3 * nbytes / ms / 1e9}
        print(f"  V={V} {name:14s} {ms:7.3f} ms  {3 * nbytes / ms / 1e9:5.2f} TB/s(3NV)  extra {mem:8.1f} MB")
        torch.cuda.empty_cache()
    return rows, nbytes


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--md", default=None)
    args = ap.parse_args()
    info = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": "python3 " + " ".join(sys.argv),
    }
    from importlib.metadata import PackageNotFoundError, version

    for pkg in ("liger-kernel", "crossentropy-triton"):
        try:
            info[pkg] = version(pkg)
        except PackageNotFoundError:
            info[pkg] = None
    print(info)
    t0 = time.time()
    result = {"info": info}
    print("correctness:")
    result["correctness"] = correctness()
    print(f"  ({time.time() - t0:.0f} s)")
    if args.sweep:
        print("config sweep:")
        result["sweep"] = {V: sweep(8192, V) for V in (256000, 128256)}
    ps = providers()
    result["shapes"] = {}
    for V in (256000, 128256):
        bw = copy_bandwidth(8192 * V * 2)
        print(f"copy bandwidth (N*V bf16): {bw:.2f} TB/s")
        rows, nbytes = bench_shape(8192, V, ps)
        result["shapes"][V] = {"copy_TBs": bw, "rows": rows}
    print(f"total {time.time() - t0:.0f} s")
    # Summary table (last in the output).
    print("\n| V | provider | fwd+bwd ms | TB/s (3NV·2) | % of copy | extra MB |")
    print("|---|---|---|---|---|---|")
    for V, s in result["shapes"].items():
        for name, r in s["rows"].items():
            pct = 100 * r["TBs_3NV"] / s["copy_TBs"]
            print(f"| {V} | {name} | {r['ms']:.3f} | {r['TBs_3NV']:.2f} | {pct:.1f} | {r['extra_MB']:.0f} |")
    print("correctness all ok:", all(c["ok"] for c in result["correctness"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, default=str)
    if args.md:
        write_md(args.md, result)


def write_md(path, result):
    info = result["info"]
    lines = [
        "",
        "## Logits-level cross entropy (issue 7)",
        "",
        f"{info['gpu']}, torch {info['torch']}, triton {info['triton']}, liger-kernel "
        f"{info['liger-kernel']}, crossentropy-triton {info['crossentropy-triton']}, {info['date']}. "
        f"Command: `{info['command']}`. `*_shift` rows: causal shift on (1, N, V) logits.",
        "bf16 logits, N = 8192, every 17th target ignored; fwd+bwd = loss and `torch.autograd.grad` "
        "w.r.t. a fresh intermediate logits tensor (cloned outside the timed region; Liger and cce's "
        "in-place backward overwrite it); median of per-call CUDA-event timings. Bandwidth counts "
        "3·N·V·2 bytes (logits read twice, gradient written once), compared with a device-to-device "
        "copy measured in the same run. Memory: peak allocated above the inputs, gradient included "
        "(one gradient is N·V·2 bytes).",
        "",
        "| V | provider | fwd+bwd ms | TB/s (3·N·V·2) | % of copy | peak extra MB |",
        "|---|---|---|---|---|---|",
    ]
    for V, s in result["shapes"].items():
        for name, r in s["rows"].items():
            lines.append(
                f"| {V} | {name} | {r['ms']:.2f} | {r['TBs_3NV']:.2f} | "
                f"{100 * r['TBs_3NV'] / s['copy_TBs']:.0f}% | {r['extra_MB']:.0f} |"
            )
        lines.append(f"| {V} | (copy bandwidth) | | {s['copy_TBs']:.2f} | 100% | |")
    with open(path, "a") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
