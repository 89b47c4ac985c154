"""One-call GPU check of impl="triton": correctness at real sizes, skip rates, quick timings.

    PYTHONUNBUFFERED=1 python3 bench/gpu_linear_check.py [--quick] [--no-timing]

Correctness is measured against :func:`chunked_reference` (fp32 logits from the same low-precision
inputs, TF32 off, chunked over tokens so that N x V never exists in fp32 at once). Prints a table
last and writes everything to $OUT/gpu_linear_check.json (or bench/results/ without $OUT).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.data import make_inputs  # noqa: E402
from cce import linear_cross_entropy  # noqa: E402


def chunked_reference(e, c, t, *, ignore_index: int = -100, bias=None, softcap=None, chunk_bytes=2 << 30):
    """(mean loss, dE, dC) in fp32 from fp32 copies of e, c (TF32 off), unit upstream gradient."""
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        N, D = e.shape
        V = c.shape[0]
        cf = c.float()
        valid = t != ignore_index
        n = valid.sum().clamp(min=1).float()
        safe = torch.where(valid, t, 0)
        dE = torch.zeros(N, D, dtype=torch.float32, device=e.device)
        dC = torch.zeros(V, D, dtype=torch.float32, device=e.device)
        total = torch.zeros((), dtype=torch.float64, device=e.device)
        rows = max(1, chunk_bytes // (4 * V))
        for s in range(0, N, rows):
            ef = e[s : s + rows].float()
            z = ef @ cf.T
            if bias is not None:
                z += bias.float()
            if softcap:
                th = torch.tanh(z / softcap)
                z = th * softcap
            lse = torch.logsumexp(z, 1)
            ts = safe[s : s + rows]
            vs = valid[s : s + rows]
            total += torch.where(vs, lse - z.gather(1, ts[:, None]).squeeze(1), 0.0).double().sum()
            z.sub_(lse[:, None]).exp_()  # softmax in place
            z[torch.arange(z.shape[0], device=z.device), ts] -= 1.0
            z.mul_((vs.float() / n)[:, None])
            if softcap:
                z.mul_(1.0 - th * th)
                del th
            dE[s : s + rows] = z @ cf
            dC.addmm_(z.T, ef)
            del z
        return (total / n.double()).float(), dE, dC
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp(min=1e-300))


def triton_run(e, c, t, filter_eps, **kw):
    e = e.detach().requires_grad_()
    c = c.detach().requires_grad_()
    loss = linear_cross_entropy(e, c, t, impl="triton", filter_eps=filter_eps, **kw)
    loss.backward()
    return loss.detach(), e.grad, c.grad


def skip_rate(e, c, t, filter_eps, sort_vocab: bool) -> float:
    """Fraction of the valid (token block, vocab tile) tiles the backward filter skipped."""
    from cce import _math
    from cce.options import CCEOptions
    from cce.triton_impl import linear_ce_triton_fwd, triton_backward

    eps = CCEOptions(filter_eps=filter_eps).resolved_filter_eps(e.dtype)
    loss, lse = linear_ce_triton_fwd(e, c, None, None, None, t, -100, "mean", 0.0, 0.0, 0.0, eps)[:2]
    valid = t != -100
    w_t = _math.target_weight(None, t, valid)
    g = _math.row_upstream(torch.ones((), device=e.device), w_t, "mean", t.numel())
    *_, out = triton_backward(
        e, c, None, None, None, t, lse, g, None, -100, 0.0, 0.0, 0.0, eps, True, True, False,
        sort_vocab=sort_vocab, record_skip=True,
    )  # fmt: skip
    sk = out.skip
    done = sk >= 0
    return float((sk == 1).sum() / done.sum().clamp(min=1))


def correctness(cases, results):
    for N, D, V, regime, dtype, feps in cases:
        name = f"N={N} D={D} V={V} {regime} {str(dtype).split('.')[-1]} eps={feps}"
        try:
            e, c, t = make_inputs(N, D, V, regime, dtype=dtype, device="cuda", seed=1)
            ref_loss, ref_dE, ref_dC = chunked_reference(e, c, t)
            torch.cuda.synchronize()
            loss, dE, dC = triton_run(e, c, t, feps)
            torch.cuda.synchronize()
            row = dict(
                case=name, N=N, D=D, V=V, regime=regime, dtype=str(dtype), filter_eps=str(feps),
                loss=float(loss), loss_rel=abs(float(loss) - float(ref_loss)) / abs(float(ref_loss)),
                dE_rel=rel(dE, ref_dE), dC_rel=rel(dC, ref_dC),
            )  # fmt: skip
            if feps == "auto" and regime == "zipf":
                row["skip_sorted"] = skip_rate(e, c, t, feps, True)
                row["skip_unsorted"] = skip_rate(e, c, t, feps, False)
            del ref_dE, ref_dC, dE, dC
        except Exception as exc:  # keep going: one failing case must not hide the others
            row = dict(case=name, error=f"{type(exc).__name__}: {exc}"[:400])
        print(json.dumps(row), flush=True)
        results["correctness"].append(row)
        torch.cuda.empty_cache()


def _time_case(e, c, t) -> dict:
    from triton.testing import do_bench

    row = dict(floor_ms=do_bench(lambda: e @ c.T, warmup=25, rep=100, return_mode="median"))
    row["fwd_ms"] = do_bench(
        lambda: linear_cross_entropy(e, c, t, impl="triton"), warmup=25, rep=100, return_mode="median"
    )
    for feps in ("auto", None):
        er = e.detach().requires_grad_()
        cr = c.detach().requires_grad_()

        def step(er=er, cr=cr, feps=feps):
            er.grad = cr.grad = None
            linear_cross_entropy(er, cr, t, impl="triton", filter_eps=feps).backward()

        step()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        key = "auto" if feps == "auto" else "exact"
        row[f"peak_{key}_MB"] = (torch.cuda.max_memory_allocated() - base) / 2**20
        row[f"fwdbwd_{key}_ms"] = do_bench(step, warmup=10, rep=200, return_mode="median")
    return row


def timing(shapes, results):
    for label, (N, D, V) in shapes:
        for regime in ("random", "zipf"):
            try:
                e, c, t = make_inputs(N, D, V, regime, dtype=torch.bfloat16, device="cuda", seed=2)
                row = dict(shape=label, N=N, D=D, V=V, regime=regime, **_time_case(e, c, t))
            except Exception as exc:
                row = dict(shape=label, regime=regime, error=f"{type(exc).__name__}: {exc}"[:400])
            print(json.dumps(row), flush=True)
            results["timing"].append(row)
            torch.cuda.empty_cache()


def sweep(results, N=8192, D=2304, V=256000):
    """Forward kernel configs, and the backward split into kernel / torch parts (zipf, bf16)."""
    from triton.testing import do_bench

    from cce import _math
    from cce.kernels import linear_ce as K
    from cce.triton_impl import _Rows, linear_ce_triton_fwd, triton_backward, vocab_order

    e, c, t = make_inputs(N, D, V, "zipf", dtype=torch.bfloat16, device="cuda", seed=3)
    r = _Rows(t, None, -100)
    ts = r.safe_t.index_select(0, r.perm)
    cfgs = [
        K.KernelConfig(128, 128, 64, 8, 3),
        K.KernelConfig(128, 128, 64, 8, 4),
        K.KernelConfig(128, 128, 128, 8, 3),
        K.KernelConfig(128, 256, 64, 8, 3),
        K.KernelConfig(256, 128, 64, 8, 3),
        K.KernelConfig(64, 256, 64, 8, 3),
        K.KernelConfig(128, 128, 64, 4, 3),
    ]
    for cfg in cfgs:
        try:
            ms = do_bench(
                lambda cfg=cfg: K.linear_ce_forward(
                    e, c, None, None, r.erow_s, ts, r.n_valid, 0.0, False, config=cfg
                ),
                warmup=25, rep=100, return_mode="median",
            )  # fmt: skip
            row = dict(what="fwd", cfg=str(cfg), ms=ms)
        except Exception as exc:
            row = dict(what="fwd", cfg=str(cfg), error=f"{type(exc).__name__}: {exc}"[:300])
        print(json.dumps(row), flush=True)
        results["sweep"].append(row)
    row = dict(what="floor", ms=do_bench(lambda: e @ c.T, warmup=25, rep=100, return_mode="median"))
    results["sweep"].append(row)
    eps = 2.0**-12
    loss, lse = linear_ce_triton_fwd(e, c, None, None, None, t, -100, "mean", 0.0, 0.0, 0.0, eps)[:2]
    valid = t != -100
    w_t = _math.target_weight(None, t, valid)
    g = _math.row_upstream(torch.ones((), device=e.device), w_t, "mean", N)
    a_, b_, _ = _math.coefficients(g, None, lse, w_t, float(V), valid, _math.LossConsts(0.0, 0.0, V))
    perm = vocab_order(e, c, None, r)
    srt = lambda x: x.index_select(0, r.perm).contiguous()  # noqa: E731
    parts = {
        "bwd_total_filtered": lambda: triton_backward(
            e, c, None, None, None, t, lse, g, None, -100, 0.0, 0.0, 0.0, eps, True, True, False
        ),
        "bwd_total_filtered_atomic_dC": lambda: triton_backward(
            e, c, None, None, None, t, lse, g, None, -100, 0.0, 0.0, 0.0, eps, True, True, False,
            dc_atomic=True,
        ),
        "bwd_total_exact": lambda: triton_backward(
            e, c, None, None, None, t, lse, g, None, -100, 0.0, 0.0, 0.0, 0.0, True, True, False
        ),
        "bwd_vocab_order": lambda: vocab_order(e, c, None, r),
        "bwd_kernel_filtered": lambda: K.linear_ce_backward(
            e, c, None, None, r.erow_s, ts, r.n_valid, srt(lse), srt(a_), srt(b_), None, perm, 0.0, eps,
            True, True, False,
        ),
        "bwd_kernel_filtered_dE_only": lambda: K.linear_ce_backward(
            e, c, None, None, r.erow_s, ts, r.n_valid, srt(lse), srt(a_), srt(b_), None, perm, 0.0, eps,
            True, False, False,
        ),
        "bwd_kernel_slabs_exact": lambda: K.linear_ce_backward_slabs(
            e, c, None, None, r.erow_s, ts, r.n_valid, srt(lse), srt(a_), srt(b_), None, 0.0,
            True, True, False,
        ),
    }  # fmt: skip
    for cfg in (
        K.KernelConfig(128, 128, 64, 8, 4),
        K.KernelConfig(64, 128, 64, 4, 3),
        K.KernelConfig(128, 64, 64, 4, 3),
    ):
        parts[f"bwd_kernel_filtered {cfg}"] = lambda cfg=cfg: K.linear_ce_backward(
            e, c, None, None, r.erow_s, ts, r.n_valid, srt(lse), srt(a_), srt(b_), None, perm, 0.0, eps,
            True, True, False, config=cfg,
        )  # fmt: skip
    try:  # where the filtered backward's time goes (kernels, GEMMs, torch glue)
        from torch.profiler import ProfilerActivity, profile

        for name in ("bwd_total_filtered", "bwd_total_filtered_atomic_dC"):
            parts[name]()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                parts[name]()
                torch.cuda.synchronize()
            table = prof.key_averages().table(
                sort_by="cuda_time_total", row_limit=10, max_name_column_width=60
            )
            print(f"profile {name}\n{table}", flush=True)
            results.setdefault("profiles", {})[name] = table
    except Exception as exc:
        print(f"profile failed: {type(exc).__name__}: {exc}"[:300], flush=True)
    for name, fn in parts.items():
        try:
            row = dict(what=name, ms=do_bench(fn, warmup=10, rep=100, return_mode="median"))
        except Exception as exc:
            row = dict(what=name, error=f"{type(exc).__name__}: {exc}"[:300])
        print(json.dumps(row), flush=True)
        results["sweep"].append(row)


def sanitize(N: int = 1024, D: int = 2048, V: int = 32000, device: str = "cuda") -> None:
    """One fwd+bwd of every kernel path at a mid size (for compute-sanitizer; no reference)."""
    for dtype, feps, kw in (
        (torch.bfloat16, "auto", dict(bias=True)),
        (torch.bfloat16, None, dict(bias=True, softcap=20.0, label_smoothing=0.1)),
        (torch.float16, "auto", dict(label_smoothing=0.1, return_lse=True)),
        (torch.float32, None, dict(shift=True, reduction="none")),
        (torch.bfloat16, "auto", dict(dc_atomic=True, label_smoothing=0.1)),
    ):
        import cce.triton_impl as TI

        TI.DC_ATOMIC = kw.pop("dc_atomic", False)
        e, c, t = make_inputs(N, D, V, "zipf", dtype=dtype, device=device, seed=11)
        b = (
            (torch.randn(V, device=device) * 0.1).to(dtype).requires_grad_()
            if kw.pop("bias", False)
            else None
        )
        e = e.view(4, N // 4, D).requires_grad_()
        c = c.requires_grad_()
        out = linear_cross_entropy(e, c, t.view(4, N // 4), b, impl="triton", filter_eps=feps, **kw)
        loss = out[0] if isinstance(out, tuple) else out
        loss.float().sum().backward()
        if device == "cuda":
            torch.cuda.synchronize()
        ok = all(torch.isfinite(x.grad.float()).all() for x in (e, c) + ((b,) if b is not None else ()))
        print(
            f"sanitize {dtype} eps={feps} {kw} dc_atomic={TI.DC_ATOMIC}: finite grads {bool(ok)}", flush=True
        )
    TI.DC_ATOMIC = False


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="only the mid-size correctness cases")
    ap.add_argument("--no-timing", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="forward configs and backward breakdown")
    ap.add_argument("--sanitize", action="store_true", help="only one pass of each path (memcheck)")
    args = ap.parse_args()
    if args.sanitize:
        sanitize()
        return
    import triton

    results = dict(
        gpu=torch.cuda.get_device_name(),
        torch=torch.__version__,
        triton=triton.__version__,
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        correctness=[],
        timing=[],
        sweep=[],
    )
    print(
        f"{results['gpu']} torch {results['torch']} triton {results['triton']} {results['date']}", flush=True
    )
    bf, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    cases = [
        (1024, 2048, 32000, "zipf", bf, "auto"),
        (1024, 2048, 32000, "zipf", bf, None),
        (1024, 2048, 32000, "random", bf, "auto"),
        (1024, 2048, 32000, "zipf", fp16, "auto"),
        (1024, 2048, 32000, "zipf", fp32, "auto"),
    ]
    if not args.quick:
        cases += [
            (4096, 4096, 128256, "zipf", bf, "auto"),
            (4096, 4096, 128256, "zipf", bf, None),
            (16384, 2304, 256000, "zipf", bf, "auto"),
            (16384, 2304, 256000, "random", bf, None),
        ]
    t0 = time.time()
    correctness(cases, results)
    print(f"correctness: {time.time() - t0:.1f} s", flush=True)
    if not args.no_timing:
        t0 = time.time()
        timing([("gemma2-2b", (8192, 2304, 256000)), ("llama3-8b", (8192, 4096, 128256))], results)
        print(f"timing: {time.time() - t0:.1f} s", flush=True)
    if args.sweep:
        t0 = time.time()
        sweep(results)
        print(f"sweep: {time.time() - t0:.1f} s", flush=True)
    out = Path(os.environ.get("OUT", Path(__file__).parent / "results"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_linear_check.json").write_text(json.dumps(results, indent=1))
    print("\n| case | loss rel | dE rel | dC rel | skip sorted / unsorted |")
    print("|---|---|---|---|---|")
    for r in results["correctness"]:
        if "error" in r:
            print(f"| {r['case']} | ERROR {r['error'][:120]} |")
            continue
        sk = f"{r['skip_sorted']:.4f} / {r['skip_unsorted']:.4f}" if "skip_sorted" in r else ""
        print(f"| {r['case']} | {r['loss_rel']:.2e} | {r['dE_rel']:.2e} | {r['dC_rel']:.2e} | {sk} |")
    print("\n| shape | data | floor ms | fwd ms | fwd+bwd auto ms (MB) | fwd+bwd exact ms (MB) |")
    print("|---|---|---|---|---|---|")
    for r in results["timing"]:
        if "error" in r:
            print(f"| {r['shape']} | {r['regime']} | ERROR {r['error'][:120]} |")
            continue
        print(
            f"| {r['shape']} | {r['regime']} | {r['floor_ms']:.2f} | {r['fwd_ms']:.2f} | "
            f"{r['fwdbwd_auto_ms']:.2f} ({r['peak_auto_MB']:.0f}) | "
            f"{r['fwdbwd_exact_ms']:.2f} ({r['peak_exact_MB']:.0f}) |"
        )

    if results["sweep"]:
        print("\n| sweep (gemma2-2b zipf bf16) | ms |")
        print("|---|---|")
        for r in results["sweep"]:
            print(f"| {r['what']} {r.get('cfg', '')} | {r.get('ms', r.get('error', ''))} |")


if __name__ == "__main__":
    main()
