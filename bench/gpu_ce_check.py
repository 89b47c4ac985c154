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


def check_case(name, x, t, _tol=None, **kw):
    """cce vs the fp64 oracle on loss, lse and the gradient under random upstream gradients.

    The gradient is stored in the logits' dtype, so it can be no better than the exact gradient
    rounded once to that dtype (bf16: up to 2^-8 relative per element; fp16 also underflows below
    6e-8). Pass: error <= 1.5 x that rounding error + 1e-5 (fp32 accumulation).
    """
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
    (gr,) = torch.autograd.grad(rtotal, x64)
    errs = [rel(o.detach(), r.detach()) for o, r in zip(outs, refs, strict=True)]
    gerr = rel(gx, gr)
    floor = rel(gr.to(x.dtype), gr)
    ok = all(e < 1e-5 for e in errs) and gerr <= 1.5 * floor + 1e-5 and bool(torch.isfinite(gx).all())
    print(f"  {name:34s} loss/lse err {max(errs):.2e}  grad err {gerr:.2e} (dtype rounding {floor:.2e})  "
          f"{'ok' if ok else 'FAIL'}")  # fmt: skip
    return {"case": name, "loss_err": max(errs), "grad_err": gerr, "grad_rounding": floor, "ok": ok}


def correctness():
    res = []
    tols = {torch.bfloat16: None, torch.float16: None, torch.float32: None}
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
        errs += [rel(loss[sl].detach(), lr.detach()), rel(gx[sl], gr)]
    ok = errs[0] < 1e-5 and errs[2] < 1e-5 and errs[1] < 8e-3 and errs[3] < 8e-3  # 2 x bf16's 2^-8
    print(f"  N*V={N * V} > 2^31 rows 0/-1: {errs}  {'ok' if ok else 'FAIL'}")
    res.append({"case": "N*V>2^31", "errs": errs, "ok": ok})
    del x, xl, gx, loss
    torch.cuda.empty_cache()
    return res


# ------------------------------------------------------------------------------------------------
# timing


def time_iters(setup, fn, iters=15, warmup=3, raw=False, sync=True):
    """Median ms of fn(*setup()), each call timed alone with CUDA events around it.

    sync=True: the GPU is idle when the call starts, so the call's CPU work before its first
    kernel (Python, validation, launch) is timed too: the latency of a lone call.
    sync=False: setup's GPU work (a logits-sized clone) is still running when the call starts, so
    the CPU is ahead of the GPU as in a training step: the time is the GPU's, plus any wait for
    the CPU inside the call (e.g. a host synchronisation).
    """
    times = []
    for i in range(warmup + iters):
        args = setup()
        if sync:
            torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn(*args)
        b.record()
        b.synchronize()
        if i >= warmup:
            times.append(a.elapsed_time(b))
        del args
    return times if raw else statistics.median(times)


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


FWD_CONFIGS = [(4096, 4, 1), (8192, 4, 1), (4096, 8, 1), (2048, 2, 1), (4096, 4, 2)]
BWD_CONFIGS = [
    (4096, 8, 1),
    (8192, 8, 1),
    (16384, 16, 1),
    (8192, 4, 1),
    (16384, 8, 1),
    (4096, 8, 2),
    (8192, 8, 2),
]


def sweep(N, V):
    """Times the forward and backward launchers alone over (BLOCK_V, num_warps, splits)."""
    x, t = make(N, V, torch.bfloat16, seed=7)
    lse, _, _ = K.ce_forward(x, t, None, -100, 0.0, False)
    a = torch.rand(N, device=DEV)
    z = torch.zeros(N, device=DEV)
    out = {"fwd": {}, "bwd": {}}
    nbytes = N * V * 2
    for bv, nw, sp in FWD_CONFIGS:

        def fwd(bv=bv, nw=nw, sp=sp):
            K.ce_forward(x, t, None, -100, 0.0, False, block_v=bv, num_warps=nw, splits=sp)

        f = time_iters(lambda: (), fwd)
        out["fwd"][(bv, nw, sp)] = f
        print(
            f"  V={V} fwd BLOCK_V={bv:5d} warps={nw:2d} splits={sp}: {f:.3f} ms ({nbytes / f / 1e9:.2f} TB/s)"
        )
    for bv, nw, sp in BWD_CONFIGS:

        def bwd(bv=bv, nw=nw, sp=sp):
            K.ce_backward(x, t, None, lse, a, a, z, -100, 0.0, False, inplace=True, block_v=bv, num_warps=nw,
                          splits=sp)  # fmt: skip

        b = time_iters(lambda: (), bwd)
        out["bwd"][(bv, nw, sp)] = b
        tbs = 2 * nbytes / b / 1e9
        print(f"  V={V} bwd BLOCK_V={bv:5d} warps={nw:2d} splits={sp}: {b:.3f} ms ({tbs:.2f} TB/s)")
    torch.cuda.empty_cache()
    return out


def pick(sweeps, key):
    """The config with the smallest total time over the swept shapes."""
    cfgs = sweeps[next(iter(sweeps))][key]
    return min(cfgs, key=lambda c: sum(sw[key][c] for sw in sweeps.values()))


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


def bench_shape(N, V, ps, rounds=3, iters=6):
    buf, t = make(N, V, torch.bfloat16, seed=11)
    leaf = buf.requires_grad_()
    nbytes = N * V * 2

    def setup_x():  # a fresh non-leaf intermediate per call, made outside the timed region
        return (leaf.clone(),)

    def runner(f):
        def run(x):
            loss = f(x, t)
            (g,) = torch.autograd.grad(loss, x)
            return g

        return run

    times = {(name, sync): [] for name in ps for sync in (False, True)}
    failed = set()
    for _ in range(rounds):  # providers interleaved: drifts of the GPU's state hit all of them
        for name, f in ps.items():
            for sync in (False, True):
                if name in failed:
                    continue
                try:
                    times[name, sync] += time_iters(
                        setup_x, runner(f), iters=iters, warmup=2, raw=True, sync=sync
                    )
                except torch.OutOfMemoryError as exc:
                    print(f"  {name}: OOM {exc}")
                    failed.add(name)
                torch.cuda.empty_cache()
    rows = {}
    for name, f in ps.items():
        if name in failed:
            continue
        ms = statistics.median(times[name, False])
        ms_sync = statistics.median(times[name, True])
        mem = peak_extra(setup_x, runner(f))
        torch.cuda.empty_cache()
        rows[name] = {"ms": ms, "ms_sync": ms_sync, "extra_MB": mem, "TBs_3NV": 3 * nbytes / ms / 1e9,
                      "n": len(times[name, False]), "min_ms": min(times[name, False])}  # fmt: skip
        print(f"  V={V} {name:26s} {ms:7.3f} ms (min {rows[name]['min_ms']:.3f}, lone call {ms_sync:.3f})  "
              f"{3 * nbytes / ms / 1e9:5.2f} TB/s(3NV)  extra {mem:8.1f} MB")  # fmt: skip
    return rows, nbytes


def overhead(ps):
    """fwd+bwd of a tiny problem: the fixed cost of a call (Python, launches, small ops)."""
    x0, t = make(64, 1024, torch.bfloat16, seed=12)
    leaf = x0.requires_grad_()
    res = {}
    for name in ("cce", "cce_inplace", "liger"):
        if name not in ps:
            continue
        f = ps[name]

        def run(x, f=f):
            (g,) = torch.autograd.grad(f(x, t), x)
            return g

        res[name] = time_iters(lambda: (leaf.clone(),), run, iters=20)
        print(f"  tiny (64 x 1024) {name}: {res[name] * 1e3:.0f} us")
    return res


def profile_once(N, V):
    """Kernel timeline of one cce fwd+bwd (device times, us from the first kernel)."""
    from torch.profiler import ProfilerActivity, profile

    x0, t = make(N, V, torch.bfloat16, seed=13)
    leaf = x0.requires_grad_()
    for _ in range(2):
        x = leaf.clone()
        torch.autograd.grad(cross_entropy(x, t), x)
    x = leaf.clone()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        (g,) = torch.autograd.grad(cross_entropy(x, t), x)
        torch.cuda.synchronize()
    kern = sorted(
        (e for e in prof.events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start
    )
    cpu = [e for e in prof.events() if e.device_type.name == "CPU"]
    t0 = min(e.time_range.start for e in cpu) if cpu else kern[0].time_range.start
    lines = []
    for e in kern:
        lines.append(
            f"{e.time_range.start - t0:9.1f} {e.time_range.end - e.time_range.start:8.1f}  {e.name[:60]}"
        )
    busy = sum(e.time_range.end - e.time_range.start for e in kern)
    span = kern[-1].time_range.end - kern[0].time_range.start
    print(f"  profile V={V}: {len(kern)} kernels, first kernel starts {kern[0].time_range.start - t0:.0f} us "
          f"after the first CPU op, span {span:.0f} us, busy {busy:.0f} us")  # fmt: skip
    return {"kernels": lines, "span_us": span, "busy_us": busy}


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
        sw = {V: sweep(8192, V) for V in (256000, 128256)}
        fcfg, bcfg = pick(sw, "fwd"), pick(sw, "bwd")
        print(f"  picked fwd {fcfg}, bwd {bcfg}")
        result["sweep"] = {
            str(V): {k: {str(c): ms for c, ms in d.items()} for k, d in v.items()} for V, v in sw.items()
        }
        result["picked"] = {"fwd": fcfg, "bwd": bcfg}

        def cfg(dtype, backward, f=fcfg, b=bcfg):  # bf16 timings below use the picked configs
            return b if backward else f

        K.default_config = cfg
    result["default_config"] = {"fwd": K.default_config(torch.bfloat16, False),
                                "bwd": K.default_config(torch.bfloat16, True)}  # fmt: skip
    ps = providers()
    print("overhead:")
    result["overhead_ms"] = overhead(ps)
    result["profile"] = {V: profile_once(8192, V) for V in (128256,)}
    result["shapes"] = {}
    for V in (256000, 128256):
        bw = copy_bandwidth(8192 * V * 2)
        print(f"copy bandwidth (N*V bf16): {bw:.2f} TB/s")
        rows, nbytes = bench_shape(8192, V, ps)
        result["shapes"][V] = {"copy_TBs": bw, "rows": rows}
    for line in result["profile"][128256]["kernels"]:
        print("   ", line)
    print(f"total {time.time() - t0:.0f} s")
    # Summary table (last in the output).
    print("\n| V | provider | fwd+bwd ms | lone call ms | TB/s (3NV·2) | % of copy | extra MB |")
    print("|---|---|---|---|---|---|---|")
    for V, s in result["shapes"].items():
        for name, r in s["rows"].items():
            pct = 100 * r["TBs_3NV"] / s["copy_TBs"]
            print(f"| {V} | {name} | {r['ms']:.3f} | {r['ms_sync']:.3f} | {r['TBs_3NV']:.2f} | {pct:.1f} "
                  f"| {r['extra_MB']:.0f} |")  # fmt: skip
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
        "in-place backward overwrite it); median of per-call CUDA-event timings, providers interleaved "
        "over 3 rounds. 'fwd+bwd ms': the call starts while the clone still runs on the GPU, so the CPU "
        "is ahead as in a training step (GPU time plus any wait for the CPU inside the call, e.g. a host "
        "sync). 'lone call ms': the GPU idles when the call starts (CPU work before the first kernel "
        "included). Bandwidth counts 3·N·V·2 bytes (logits read twice, gradient written once) over "
        "'fwd+bwd ms', compared with a device-to-device copy (read + write) measured in the same run. "
        "Memory: peak allocated above the inputs, gradient included (one gradient is N·V·2 bytes).",
        "",
        "| V | provider | fwd+bwd ms | lone call ms | TB/s (3·N·V·2) | % of copy | peak extra MB |",
        "|---|---|---|---|---|---|---|",
    ]
    for V, s in result["shapes"].items():
        for name, r in s["rows"].items():
            lines.append(
                f"| {V} | {name} | {r['ms']:.2f} | {r['ms_sync']:.2f} | {r['TBs_3NV']:.2f} | "
                f"{100 * r['TBs_3NV'] / s['copy_TBs']:.0f}% | {r['extra_MB']:.0f} |"
            )
        lines.append(f"| {V} | (copy bandwidth) | | | {s['copy_TBs']:.2f} | 100% | |")
    with open(path, "a") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
