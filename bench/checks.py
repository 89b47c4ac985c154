"""Correctness at real sizes (``python -m bench --check linear|logits [--quick]``, GPU): impl="triton"
against bench.reference (linear level: fp32 results from the same bf16 inputs) or the float64 oracle
(logits level), with vocabularies large enough that N x V passes 2^31. One JSON line per case, a
table last, a JSON file in the output folder. Only the public API of cce is used.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

import cce
from cce.reference import cross_entropy_reference

from .data import IGNORE_EVERY, make_inputs
from .providers import versions
from .reference import linear_reference, rel_l2

BF, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32

# (N, D, V, regime, dtype, filter_eps); --quick keeps the first four.
LINEAR_CASES = [
    (2048, 2048, 32000, "zipf", BF, "auto"),
    (2048, 2048, 32000, "zipf", BF, None),
    (2048, 2048, 32000, "random", BF, "auto"),
    (1024, 2048, 32000, "zipf", FP16, "auto"),
    (4096, 4096, 128256, "zipf", BF, "auto"),
    (4096, 4096, 128256, "zipf", BF, None),
    (16384, 2304, 256000, "zipf", BF, "auto"),  # N * V > 2^31
    (16384, 2304, 256000, "random", BF, None),
]


def _emit(rows: list[dict], row: dict) -> None:
    print(json.dumps(row), flush=True)
    rows.append(row)


def linear_check(quick: bool = False) -> list[dict]:
    """Loss and gradient errors of cce.linear_cross_entropy (impl="triton") per case."""
    rows: list[dict] = []
    for N, D, V, regime, dtype, feps in LINEAR_CASES[:4] if quick else LINEAR_CASES:
        name = f"N={N} D={D} V={V} {regime} {str(dtype).split('.')[-1]} eps={feps}"
        try:
            e, c, t = make_inputs(N, D, V, regime, dtype=dtype, device="cuda", seed=1)
            ref = linear_reference(e, c, t)
            el, cl = e.detach().requires_grad_(), c.detach().requires_grad_()
            loss = cce.linear_cross_entropy(el, cl, t, impl="triton", filter_eps=feps)
            loss.backward()
            row = dict(case=name, loss_rel=abs(float(loss) - ref.loss) / abs(ref.loss),
                       dE_rel=rel_l2(el.grad, ref.de), dC_rel=rel_l2(cl.grad, ref.dc))  # fmt: skip
            del ref, el, cl
        except Exception as exc:  # keep going: one failing case must not hide the others
            row = dict(case=name, error=f"{type(exc).__name__}: {exc}"[:400])
        _emit(rows, row)
        torch.cuda.empty_cache()
    return rows


def _logits(N: int, V: int, dtype: torch.dtype, seed: int, lead: tuple[int, ...] | None = None):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = (torch.randn(N, V, generator=g, device="cuda") * 2.0).to(dtype)
    t = torch.randint(0, V, (N,), generator=g, device="cuda")
    t[::IGNORE_EVERY] = -100
    if lead is not None:
        x, t = x.view(*lead, V), t.view(*lead)
    return x, t


def _logits_case(name: str, x: torch.Tensor, t: torch.Tensor, **kw) -> dict:
    """cce.cross_entropy vs the float64 oracle on loss, lse and the gradient under random upstream
    gradients. The gradient is stored in the logits' dtype, so it can be no better than the exact
    one rounded once to that dtype: pass when its error is <= 1.5 x that rounding + 1e-5."""
    inplace = kw.pop("inplace_backward", False)
    g = torch.Generator(device="cuda").manual_seed(1)
    leaf = x.detach().clone().requires_grad_()
    xin = leaf.clone() if inplace else leaf
    out = cce.cross_entropy(xin, t, inplace_backward=inplace, **kw)
    outs = out if isinstance(out, tuple) else (out,)
    ups = [torch.randn(o.shape, generator=g, device="cuda") for o in outs]
    (gx,) = torch.autograd.grad(sum((o * u).sum() for o, u in zip(outs, ups, strict=True)), xin)
    x64 = x.detach().double().requires_grad_()
    ref = cross_entropy_reference(x64, t, dtype=torch.float64, **kw)
    refs = ref if isinstance(ref, tuple) else (ref,)
    (gr,) = torch.autograd.grad(sum((o * u.double()).sum() for o, u in zip(refs, ups, strict=True)), x64)
    err = max(
        rel_l2(o.detach().reshape(-1, 1), r.detach().reshape(-1, 1)) for o, r in zip(outs, refs, strict=True)
    )
    gerr = rel_l2(gx.reshape(-1, gx.shape[-1]), gr.reshape(-1, gr.shape[-1]))
    floor = rel_l2(gr.to(x.dtype).reshape(-1, gr.shape[-1]), gr.reshape(-1, gr.shape[-1]))
    ok = err < 1e-5 and gerr <= 1.5 * floor + 1e-5 and bool(torch.isfinite(gx).all())
    return dict(case=name, loss_err=err, grad_err=gerr, grad_rounding=floor, ok=ok)


def logits_check(quick: bool = False) -> list[dict]:
    """cce.cross_entropy (impl="triton") against the float64 oracle: dtypes, every option, few
    rows (vocabulary split over programs), shift, in-place, non-flattenable and sliced layouts."""
    rows: list[dict] = []
    for dtype in (BF, FP16, FP32):
        x, t = _logits(512, 32000, dtype, seed=2)
        _emit(rows, _logits_case(f"{dtype} plain", x, t))
        opts = dict(softcap=15.0, label_smoothing=0.1, z_loss=1e-4, return_lse=True)
        opts["weight"] = torch.rand(32000, device="cuda") + 0.5
        _emit(rows, _logits_case(f"{dtype} all options", x, t, **opts))
    if quick:
        return rows
    x, t = _logits(4, 256000, BF, seed=3)
    _emit(rows, _logits_case("bf16 split N=4 V=256000", x, t, label_smoothing=0.05, return_lse=True))
    x, t = _logits(600, 50257, BF, seed=4, lead=(6, 100))
    _emit(rows, _logits_case("bf16 shift (6,100,V) inplace", x, t, shift=True, inplace_backward=True))
    xt, tt = x.transpose(0, 1), t.transpose(0, 1)  # leading dims not flattenable: row-offset table
    _emit(rows, _logits_case("bf16 transposed rows", xt, tt, reduction="none"))
    _emit(rows, _logits_case("bf16 transposed inplace", xt, tt, inplace_backward=True))
    _emit(rows, _logits_case("bf16 sliced classes", x[..., :50000], t.clamp(max=49999), reduction="sum"))
    return rows


def run_check(level: str, quick: bool, out_dir: Path | None, tag: str = "") -> int:
    """Runs one check, prints its table last, writes its JSON; returns the number of failures."""
    rows = linear_check(quick) if level == "linear" else logits_check(quick)
    info = dict(gpu=torch.cuda.get_device_name(), **versions([]))
    print(json.dumps(info))
    failed = 0
    for r in rows:
        if "error" in r:
            failed += 1
            print(f"{r['case']:<48} ERROR {r['error'][:80]}")
        elif level == "linear":
            print(f"{r['case']:<48} loss {r['loss_rel']:.1e}  dE {r['dE_rel']:.2e}  dC {r['dC_rel']:.2e}")
        else:
            failed += not r["ok"]
            print(f"{r['case']:<48} loss/lse {r['loss_err']:.1e}  grad {r['grad_err']:.2e} "
                  f"(dtype rounding {r['grad_rounding']:.2e})  {'ok' if r['ok'] else 'FAIL'}")  # fmt: skip
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        name = f"check_{level}{'_' + tag if tag else ''}.json"
        (out_dir / name).write_text(json.dumps(dict(info=info, rows=rows), indent=1))
    return failed
