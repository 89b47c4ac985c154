"""The skipped tiles' corrections in fp32 (TF32 off), outside the kernels: how much of dE and dC the
rank-1 terms of the sparse backward miss, and what the first-order terms of
cce/ops/linear_ce/kernels/first_order.py leave, on the harness's data regimes.

    python -m bench.first_order_sim gpt2:real+init+random+zipf:8192,mistral-7b:real+random:8192

Per head:regimes:N (heads of bench/matrix.py) it forms the exact softmax of the valid rows
(N x V in fp32: keep N x V below a few GB), the tiles the filter skips (128-row blocks x 256
sorted classes, eps 2^-8, as the bf16 training forward), and the relative L2 errors of dE and
dC (kept tiles exact, target entries exact) with: the rank-1 terms (dC spread by the mean-row
softmax, q, as the kernels); the first-order terms with one Gram matrix each (what the kernels
apply); and, for D <= 1024, the per-tile first-order terms (the ceiling of that expansion).
JSON to $OUT or /tmp.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

from .data import make_inputs
from .matrix import MATRIX_HEADS

BN, BV, EPS = 128, 256, 2.0**-8


def _rel(x: torch.Tensor, y: torch.Tensor) -> float:
    return float((x - y).norm() / y.norm())


def simulate(e: torch.Tensor, c: torch.Tensor, t: torch.Tensor, ceiling: bool) -> dict:
    """The errors of one problem (see the module docstring); e, c any float dtype, t with -100."""
    dev = e.device
    valid = t != -100
    e, t, c = e[valid].float(), t[valid], c.float()
    N = (e.shape[0] // BN) * BN
    e, t = e[:N], t[:N]
    D, V = e.shape[1], c.shape[0]
    nt = -(-V // BV)
    Vp = nt * BV
    perm = torch.argsort(c @ e.mean(0), descending=True)
    cs = torch.zeros(Vp, D, device=dev)
    cs[:V] = c[perm]
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(V, device=dev)
    tp = inv[t]
    z = e @ cs.T
    z[:, V:] = -float("inf")
    p = torch.exp(z - torch.logsumexp(z, 1, keepdim=True))
    del z
    ar = torch.arange(N, device=dev)
    pt = p[ar, tp].clone()
    p[ar, tp] = 0.0  # the non-target part
    ex_dE = p @ cs + (pt - 1)[:, None] * cs[tp]
    ex_dC = p.T @ e
    ex_dC.index_add_(0, tp, (pt - 1)[:, None] * e)
    nb = N // BN
    pv = p.view(nb, BN, nt, BV)
    skip = pv.amax(dim=(1, 3)) < EPS  # [nb, nt]
    skr = skip.repeat_interleave(BN, 0).float()  # [N, nt]
    P = pv.sum(3).view(N, nt) * skr  # skipped masses
    pk = p * (1 - skr).repeat_interleave(BV, 1)
    base_dE = pk @ cs + (pt - 1)[:, None] * cs[tp]
    base_dC = pk.T @ e
    base_dC.index_add_(0, tp, (pt - 1)[:, None] * e)
    del pk
    cnt = torch.full((nt,), float(BV), device=dev)
    cnt[-1] = V - (nt - 1) * BV
    cmask = (torch.arange(Vp, device=dev) < V).float()
    Cm = cs.view(nt, BV, D).sum(1) / cnt[:, None]
    delta = (cs - Cm.repeat_interleave(BV, 0)) * cmask[:, None]
    out = dict(N=N, D=D, V=V, kept=1 - float(skip.float().mean()), skipped_mass=float(P.sum(1).mean()))
    S = P.sum(1)
    out["dE_rank1"] = _rel(base_dE + P @ Cm, ex_dE)
    out["dE_gram"] = _rel(base_dE + P @ Cm + (S / V)[:, None] * (e @ (delta.T @ delta)), ex_dE)
    Gj = (P.T @ e).repeat_interleave(BV, 0)  # sum_i S_ij e_i per class of tile j
    sc = torch.full((Vp,), -float("inf"), device=dev)
    sc[:V] = cs[:V] @ e.mean(0)
    q = torch.softmax(sc.view(nt, BV), 1).view(-1)
    uni = (cmask / cnt.repeat_interleave(BV))[:, None] * Gj
    out["dC_rank1q"] = _rel(base_dC + q[:, None] * Gj, ex_dC)
    H = (e * S[:, None]).T @ e / S.sum().clamp(min=1e-30)
    rate = (P.sum(0) / cnt).repeat_interleave(BV) * cmask
    out["dC_gram_u"] = _rel(base_dC + uni + rate[:, None] * (delta @ H), ex_dC)
    if ceiling:
        accE, accC = torch.zeros_like(e), torch.zeros_like(cs)
        W = P / cnt[None]
        for j0 in range(0, nt, 64):
            j1 = min(nt, j0 + 64)
            dl = delta[j0 * BV : j1 * BV].view(j1 - j0, BV, D)
            x = torch.einsum("nd,jvd->njv", e, dl)  # the logits' deviations within the tiles
            accE += torch.einsum("nj,njv,jvd->nd", W[:, j0:j1], x, dl)
            accC[j0 * BV : j1 * BV] = torch.einsum("nj,njv,nd->jvd", W[:, j0:j1], x, e).reshape(-1, D)
        out["dE_tile_fo"] = _rel(base_dE + P @ Cm + accE, ex_dE)
        out["dC_tile_fo"] = _rel(base_dC + uni + accC, ex_dC)
    return out


def main(spec: str) -> list[dict]:
    torch.backends.cuda.matmul.allow_tf32 = False
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    rows = []
    for item in spec.split(","):
        head, regimes, N = item.split(":")
        D, V = MATRIX_HEADS[head]
        for regime in regimes.split("+"):
            t0 = time.time()
            e, c, t = make_inputs(int(N), D, V, regime, dtype=torch.bfloat16, device=dev, seed=1)
            t1 = time.time()
            r = simulate(e, c, t, ceiling=D <= 1024)
            r.update(head=head, regime=regime, setup_s=round(t1 - t0, 1), sim_s=round(time.time() - t1, 1))
            rows.append(r)
            shown = {k: f"{v:.2e}" if isinstance(v, float) else v for k, v in r.items()}
            print(json.dumps(shown), flush=True)
            del e, c, t
    return rows


if __name__ == "__main__":
    res = main(sys.argv[1])
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "first_order_sim.json"), "w") as f:
        json.dump(res, f, indent=1)
