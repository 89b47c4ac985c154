"""Vocabulary-parallel cce on one host: equality with one GPU, per-rank time and memory.

    torchrun --nproc_per_node 2 -m bench.dist [--regime zipf|random] [--skip-options]   # 2 GPUs, NCCL
    torchrun --nproc_per_node 2 -m bench.dist --device cpu --shapes tiny --impl torch   # CPU, gloo

Every rank holds a block of the classifier's rows and the same e and targets. 1. Options check: at a
small shape with an uneven split, ``linear_cross_entropy_vocab_parallel`` against one-GPU
``cce.linear_cross_entropy`` (same impl) and the fp32 oracle, for several option sets. 2. Per model
shape: the one-GPU fwd+bwd (whole classifier, on each rank's GPU at the same time) and the
vocabulary-parallel one: median ms per rank (``_time``), peak MB above the inputs, gradient errors
against the fp32 reference. Pass: slowest rank <= 0.55 x one GPU in time, largest rank <= 0.55 x in
memory, rel. L2 errors at most 1.5 x one GPU's + 4e-3 (bf16 rounding; the ranks' gradient filters
see other tiles). Rank 0 prints the tables; JSON goes to $OUT or --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from datetime import timedelta
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

import cce
from cce.distributed import linear_cross_entropy_vocab_parallel
from cce.reference import linear_cross_entropy_reference

from .data import SHAPES, make_inputs
from .harness import fmt, peak_mb, sync
from .reference import linear_reference, rel_l2

ALL_SHAPES = {**SHAPES, "tiny": (256, 64, 1003)}
RESULTS = Path(__file__).resolve().parent / "results"
TIME_RATIO_MAX = 0.55
MEM_RATIO_MAX = 0.55
# Option sets of the equality check (bias / weight / options; every one with an uneven split).
OPTION_SETS = dict(
    plain=dict(),
    everything=dict(bias=True, shift=True, softcap=30.0, label_smoothing=0.1, z_loss=1e-4, return_lse=True),
    weight_sum=dict(weight=True, reduction="sum", label_smoothing=0.05),
    none_filter_off=dict(reduction="none", filter_eps=None),
)


def _split(V: int, world: int, uneven: bool) -> list[int]:
    """Rows per rank: as even as can be, or (uneven) ~40% fewer on rank 0 than on the others."""
    if not uneven:
        return [V // world + (1 if r < V % world else 0) for r in range(world)]
    first = int(V / world * 0.6)
    return [first] + _split(V - first, world - 1, uneven=False)


def _fwd_bwd(fn, e, c, t, b=None, up_seed=0, **kw):
    """(loss, lse, dE, dC[, db]) under a seeded random upstream gradient (the same on every rank)."""
    leaves = [x for x in (e, c, b) if x is not None]
    out = fn(e, c, t, b, **kw)
    loss, lse = out if isinstance(out, tuple) else (out, None)
    g = torch.Generator(device="cpu").manual_seed(up_seed)
    total = (loss.float() * torch.randn(loss.shape, generator=g).to(loss.device)).sum()
    if lse is not None:
        total = total + (lse * torch.randn(lse.shape, generator=g).to(lse.device)).sum()
    return (loss.detach(), None if lse is None else lse.detach(), *torch.autograd.grad(total, leaves))


def leaf(x, sl=slice(None), dtype=None):
    """A fresh leaf copy of ``x[sl]`` (in ``dtype``), or None."""
    return None if x is None else x.detach()[sl].to(dtype or x.dtype).clone().requires_grad_()


def options_check(args, dev, group) -> list[dict]:
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    N, D, V = (512, 256, 10007) if args.shapes != ["tiny"] else (64, 32, 301)
    rows = []
    for name, spec in OPTION_SETS.items():
        kw = dict(spec)
        use_bias, use_weight = kw.pop("bias", False), kw.pop("weight", False)
        e, c, t = make_inputs(N, D, V, "zipf", dtype=args.dtype, device=dev, seed=11)
        e = e.reshape(4, N // 4, D)  # (batch, seq, D) so that shift has sequences
        t = t.reshape(4, N // 4)
        g = torch.Generator(device="cpu").manual_seed(5)
        b = (torch.randn(V, generator=g) * 0.5).to(dev, args.dtype) if use_bias else None
        w = (torch.rand(V, generator=g) + 0.5).to(dev) if use_weight else None
        sizes = _split(V, world, uneven=True)
        blk = slice(sum(sizes[:rank]), sum(sizes[: rank + 1]))
        wl = None if w is None else w[blk]
        f32 = torch.float32
        one = _fwd_bwd(cce.linear_cross_entropy, leaf(e), leaf(c), t, leaf(b), weight=w, impl=args.impl, **kw)
        par = _fwd_bwd(
            linear_cross_entropy_vocab_parallel, leaf(e), leaf(c, blk), t, leaf(b, blk),
            weight=wl, process_group=group, impl=args.impl, **kw,
        )  # fmt: skip
        # The oracle on fp32 copies of the same (bf16) inputs.
        ref = _fwd_bwd(
            linear_cross_entropy_reference, leaf(e, dtype=f32), leaf(c, dtype=f32), t, leaf(b, dtype=f32),
            weight=w, dtype=f32, **kw,
        )  # fmt: skip
        row = dict(case=name, N=N, D=D, V=V, sizes=sizes, rank=rank, ok=True)
        for what, a, o, r in zip(("loss", "lse", "dE", "dC", "dbias"), par, one, ref, strict=False):
            if a is None:  # no lse
                continue
            if what in ("dC", "dbias"):  # this rank's rows of the one-GPU and oracle gradients
                o, r = o[blk], r[blk]
            a, o, r = (x.float().reshape(-1, 1) for x in (a, o, r))
            err_par, err_one = rel_l2(a, r), rel_l2(o, r)
            row.update({f"{what}_vs_one": rel_l2(a, o), f"{what}_err": err_par, f"{what}_err_one": err_one})
            row["ok"] = row["ok"] and err_par <= 1.5 * err_one + 4e-3
        rows.append(row)
    return rows


def _time(fn, dev, group, reps: int, warmup: int) -> float:
    """Median ms of fn() per call, pipelined as ``triton.testing.do_bench`` times a step: calls issued
    back to back, each between CUDA events after an L2 flush; the ranks start together (a barrier)
    and run the same number of calls. (CPU: the wall time of each call after a barrier.)"""
    for _ in range(warmup):
        fn()
    sync(dev)
    if dev.type != "cuda":
        times = []
        for _ in range(reps):
            dist.barrier(group)
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    flush = torch.empty(256 << 20, dtype=torch.int8, device=dev)  # (do_bench's L2 flush)
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    dist.barrier(group)
    sync(dev)
    for s, en in ev:
        flush.zero_()
        s.record()
        fn()
        en.record()
    sync(dev)
    return statistics.median(s.elapsed_time(en) for s, en in ev)


def _one_gpu(e, c_full, t, blk, args, dev, group):
    """One-GPU baseline on this rank's GPU; also returns the fp32 reference pieces for blk."""
    c_full = c_full.detach().requires_grad_()
    one = lambda: torch.autograd.grad(cce.linear_cross_entropy(e, c_full, t, impl=args.impl), [e, c_full])
    ref = linear_reference(e.detach(), c_full.detach(), t)  # fp32, mean loss, unit upstream
    dE1, dC1 = one()
    errs = dict(one_err_dE=rel_l2(dE1.float(), ref.de), one_err_dC=rel_l2(dC1.float(), ref.dc))
    del dE1, dC1
    ms = _time(one, dev, group, args.reps, args.warmup)
    mb = peak_mb(one, None, dev)
    return ms, mb, errs, (ref.loss, ref.de, ref.dc[blk].clone())


def shape_run(name: str, args, dev, group) -> dict:
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    N, D, V = ALL_SHAPES[name]
    e, c, t = make_inputs(N, D, V, args.regime, dtype=args.dtype, device=dev, seed=0)
    # Sampling on two GPUs is not bit-identical (zipf targets): every rank takes rank 0's inputs,
    # as replicated activations would be.
    for x in (e, c, t):
        dist.broadcast(x, src=dist.get_global_rank(group, 0), group=group)
    sizes = _split(V, world, uneven=False)
    blk = slice(sum(sizes[:rank]), sum(sizes[: rank + 1]))
    e = e.requires_grad_()
    t_one, m_one, err_one, (ref_loss, ref_de, ref_dc) = _one_gpu(e, c, t, blk, args, dev, group)
    c_local = c[blk].clone().requires_grad_()
    del c
    if dev.type == "cuda":
        torch.cuda.empty_cache()

    def par():
        loss = linear_cross_entropy_vocab_parallel(e, c_local, t, process_group=group, impl=args.impl)
        return (loss.detach(), *torch.autograd.grad(loss, [e, c_local]))

    loss_p, dEp, dCp = par()
    err_par = dict(par_err_loss=abs(float(loss_p) - ref_loss) / abs(ref_loss))
    err_par.update(par_err_dE=rel_l2(dEp.float(), ref_de), par_err_dC=rel_l2(dCp.float(), ref_dc))
    del loss_p, dEp, dCp, ref_de, ref_dc
    t_par = _time(par, dev, group, args.reps, args.warmup)
    m_par = peak_mb(par, None, dev)
    return dict(
        shape=name, N=N, D=D, V=V, rank=rank, world=world, V_local=sizes[rank], regime=args.regime,
        one_ms=t_one, par_ms=t_par, one_peak_mb=m_one, par_peak_mb=m_par, **err_one, **err_par,
    )  # fmt: skip


def run_ranks(device: str, prog: str, hint: str, work, report) -> list | None:
    """A check under torchrun: the default process group up (NCCL bound to the rank's GPU, or gloo
    on the CPU), ``work(dev)`` on every rank, ``report(per_rank)`` with every rank's result on rank 0;
    returns the results (None, with a message, outside torchrun or without a GPU)."""
    if "RANK" not in os.environ:
        print(f"launch with torchrun, e.g.: torchrun --nproc_per_node 2 -m {prog}", file=sys.stderr)
        return None
    if device == "cuda" and not torch.cuda.is_available():
        print(f"no CUDA device: use {hint}", file=sys.stderr)
        return None
    if device == "cpu":
        dev = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timedelta(minutes=5))
    else:
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(dev)
        dist.init_process_group("nccl", timeout=timedelta(minutes=5), device_id=dev)
    try:
        per_rank: list = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, work(dev))
        if dist.get_rank() == 0:
            report(per_rank)
        dist.barrier()  # every rank leaves together: none tears down connections another still uses
    finally:
        dist.destroy_process_group()
    return per_rank


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--impl", default="triton", choices=("triton", "torch", "auto"))
    ap.add_argument("--shapes", default="gemma2-2b,llama3-8b", help=f"comma list of {list(ALL_SHAPES)}")
    ap.add_argument("--regime", default="random", choices=("random", "zipf"))
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--skip-options", action="store_true", help="skip the options equality check")
    ap.add_argument("--out", default=os.environ.get("OUT") or str(RESULTS))
    args = ap.parse_args()
    args.shapes = [s for s in args.shapes.split(",") if s]
    args.dtype = getattr(torch, args.dtype)
    hint = "--device cpu --shapes tiny --impl torch"
    per_rank = run_ranks(args.device, "bench.dist", hint, partial(work, args), partial(report, args=args))
    return 2 if per_rank is None else 0


def work(args, dev: torch.device) -> dict:
    """This rank's part: the options check, then every shape; exceptions go into ``errors``."""
    group, rank, world = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    backend = dist.get_backend()
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    if rank == 0:
        print(f"bench.dist: world={world} backend={backend} device={name} impl={args.impl}, {args.dtype}")
    result: dict = dict(world=world, backend=backend, device=name, impl=args.impl, torch=torch.__version__,
                        options=[], shapes=[], errors=[])  # fmt: skip
    if not args.skip_options:
        try:
            result["options"] = options_check(args, dev, group)
        except Exception:
            result["errors"].append(f"rank {rank} options: {traceback.format_exc()}")
    for s in args.shapes:
        try:
            result["shapes"].append(shape_run(s, args, dev, group))
        except Exception:
            result["errors"].append(f"rank {rank} {s}: {traceback.format_exc()}")
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return result


def report(per_rank: list[dict], args) -> None:
    r0 = per_rank[0]
    errors = [e for r in per_rank for e in r["errors"]]
    lines = [
        "\n== options check (vocab-parallel vs one GPU, same impl; errors vs the fp32 oracle) ==",
        "case            rank  sizes                 loss~one   dE err (one)          dC err (one)"
        "          ok",
    ]
    options = [row for r in per_rank for row in r["options"]]
    all_ok = all(bool(row["ok"]) for row in options)
    for row in options:
        lines.append(
            f"{row['case']:<15} {row['rank']:>4}  {str(row['sizes']):<20}"
            f"  {fmt(row['loss_vs_one'], '.1e'):>8}"
            f"   {fmt(row['dE_err'], '.2e')} ({fmt(row['dE_err_one'], '.2e')})"
            f"   {fmt(row['dC_err'], '.2e')} ({fmt(row['dC_err_one'], '.2e')})   {row['ok']}"
        )
    lines += [
        "\n== per-rank fwd+bwd vs one GPU (median ms, pipelined as do_bench; peak MB above the inputs) ==",
        "shape       rank  V_local   one ms   par ms  ratio   one MB   par MB  ratio   dE err one/par"
        "      dC err one/par",
    ]
    by_shape: dict[str, list[dict]] = {}
    for row in (row for r in per_rank for row in r["shapes"]):
        by_shape.setdefault(row["shape"], []).append(row)
    summary, tail = [], ["\n== summary (slowest rank / one GPU; largest per-rank peak / one GPU) =="]
    for shape, rows in by_shape.items():
        for x in rows:
            mr = None if x["one_peak_mb"] is None else x["par_peak_mb"] / x["one_peak_mb"]
            lines.append(
                f"{shape:<11} {x['rank']:>4}  {x['V_local']:>7}  {x['one_ms']:7.2f}  {x['par_ms']:7.2f}"
                f"  {x['par_ms'] / x['one_ms']:5.2f}  {fmt(x['one_peak_mb'], '7.0f')}"
                f"  {fmt(x['par_peak_mb'], '7.0f')}  {fmt(mr, '5.2f')}   {x['one_err_dE']:.2e}"
                f"/{x['par_err_dE']:.2e}   {x['one_err_dC']:.2e}/{x['par_err_dC']:.2e}"
            )
        # The step is as slow as the slowest rank; memory per rank is each rank's own peak.
        t_ratio = max(x["par_ms"] for x in rows) / statistics.median(x["one_ms"] for x in rows)
        m_ratio = max((x["par_peak_mb"] / x["one_peak_mb"] for x in rows if x["one_peak_mb"]), default=None)
        accurate = all(x[f"par_err_d{g}"] <= 1.5 * x[f"one_err_d{g}"] + 4e-3 for x in rows for g in "EC")
        time_ok, mem_ok = t_ratio <= TIME_RATIO_MAX, None if m_ratio is None else m_ratio <= MEM_RATIO_MAX
        summary.append(dict(shape=shape, time_ratio=t_ratio, mem_ratio=m_ratio, accurate=accurate,
                            time_ok=time_ok, mem_ok=mem_ok))  # fmt: skip
        tail.append(
            f"{shape:<11} time {t_ratio:.2f} (<= {TIME_RATIO_MAX}: {time_ok})  memory "
            f"{fmt(m_ratio, '.2f')} (<= {MEM_RATIO_MAX}: {mem_ok})  accurate: {accurate}"
        )
    lines += tail
    ok = ": skipped (--skip-options)" if args.skip_options else f" all ok: {all_ok and bool(r0['options'])}"
    lines.append(f"options check{ok}")
    if errors:
        lines += [f"\n{len(errors)} error(s):", *errors]
    out = dict(
        world=r0["world"], backend=r0["backend"], device=r0["device"], impl=r0["impl"], torch=r0["torch"],
        dtype=str(args.dtype), regime=args.regime, reps=args.reps, per_rank=per_rank, summary=summary,
        options_ok=all_ok, errors=errors,
    )  # fmt: skip
    Path(args.out).mkdir(parents=True, exist_ok=True)
    path = Path(args.out) / "dist_check.json"
    path.write_text(json.dumps(out, indent=1))
    lines.append(f"\nwrote {path}")
    print("\n".join(lines), flush=True)


def exit_now(code: int) -> None:
    """Exit without the interpreter's finalization: gloo's worker threads can outlive
    destroy_process_group (a cached device mesh or a process group a module still references
    keeps them), and tearing them down while the interpreter finalizes aborts the process now and
    then ("terminate called without an active exception"; torch 2.13, CPU, about one run in
    ten), after the results are written."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
