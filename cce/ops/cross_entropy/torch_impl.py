"""impl="torch" for the logits-level cross entropy: chunked PyTorch row passes, on any device.

At most ``CHUNK_BYTES`` (or Tuning.chunk_bytes) of fp32 temporaries exist at a time, so the
working memory beyond the gradient stays bounded for any N x V. The ops and their autograd:
autograd.py.
"""

from __future__ import annotations

import torch

from ... import _math
from .autograd import BwdArgs, FwdArgs, define_ce_ops

# Bytes of fp32 chunk temporaries (upcast logits, probabilities, tanh) allowed at once.
CHUNK_BYTES = 64 << 20


def _rows(logits: torch.Tensor) -> torch.Tensor:
    """(N, V) view of logits (a copy only when the leading dims cannot be flattened)."""
    return logits.reshape(-1, logits.shape[-1])


def _chunk_rows(V: int, acc: torch.dtype, temporaries: int, chunk_bytes: int | None) -> int:
    per_row = V * torch.finfo(acc).bits // 8 * temporaries
    budget = CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    return max(1, budget // max(per_row, 1))


def _softcapped(x: torch.Tensor, softcap: float, temperature: float = 1.0):
    """(L, th) with L = softcap * tanh(x / softcap) / temperature, th = tanh(x / softcap) (None
    without softcap)."""
    if softcap > 0:
        th = torch.tanh(x / softcap)
        return th * (softcap / temperature), th
    return (x if temperature == 1.0 else x / temperature), None


def torch_stats(a: FwdArgs):
    """Per-row (lse, tgt, ssum, entropy, argmax) in the accumulation dtype, chunk by chunk (ssum
    None without smoothing, entropy and argmax None unless asked for)."""
    logits, targets, weight, ignore_index, softcap = a.logits, a.targets, a.weight, a.ignore_index, a.softcap
    smoothing = a.label_smoothing > 0
    V = logits.shape[-1]
    x2 = _rows(logits)
    N = x2.shape[0]
    acc = _math.acc_dtype(logits.dtype)
    dev = logits.device
    lse = torch.zeros(N, dtype=acc, device=dev)
    tgt = torch.zeros(N, dtype=acc, device=dev)
    ssum = torch.zeros(N, dtype=acc, device=dev) if smoothing else None
    entropy = torch.zeros(N, dtype=acc, device=dev) if a.want_entropy else None
    argmax = torch.zeros(N, dtype=torch.int64, device=dev) if a.want_argmax else None
    safe_t = torch.where(targets != ignore_index, targets, torch.zeros_like(targets))
    w = None if weight is None else weight.to(acc)
    step = _chunk_rows(V, acc, 2 + (softcap > 0) + a.want_entropy, a.chunk_bytes)
    for s in range(0, N, step):
        e = min(s + step, N)
        L, _ = _softcapped(x2[s:e].to(acc), softcap, a.temperature)
        tgt[s:e] = L.gather(1, safe_t[s:e, None]).squeeze(1)
        if smoothing:
            ssum[s:e] = L.sum(1) if w is None else L @ w
        lse[s:e] = torch.logsumexp(L, dim=1)
        if entropy is not None:  # lse - E_p[L]
            entropy[s:e] = lse[s:e] - _math.mean_logit(L)
        if argmax is not None:
            argmax[s:e] = L.argmax(1)
    return lse, tgt, ssum, entropy, argmax


def torch_grad(a: BwdArgs, inplace: bool) -> torch.Tensor:
    """dloss/dlogits ((..., V), logits' dtype), written into the logits themselves if ``inplace``."""
    logits, targets, weight, lse, ignore_index, softcap = (
        a.logits, a.targets, a.weight, a.lse, a.ignore_index, a.softcap
    )  # fmt: skip
    alpha, beta, gamma, scale, smoothing = a.alpha, a.beta, a.gamma, a.scale, a.smoothing
    out = logits if inplace else torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    V = logits.shape[-1]
    if scale is not None:
        alpha, beta, gamma = alpha * scale, beta * scale, gamma * scale
    x2 = _rows(logits)
    try:
        o2 = out.view(-1, V)
        writes_through = True
    except RuntimeError:  # leading dims that do not flatten (in place only): write back at the end
        o2 = torch.empty(x2.shape, dtype=out.dtype, device=out.device)
        writes_through = False
    N = x2.shape[0]
    acc = _math.acc_dtype(logits.dtype)
    valid = targets != ignore_index
    safe_t = torch.where(valid, targets, torch.zeros_like(targets))
    w = None
    if smoothing:
        w = torch.ones(V, dtype=acc, device=logits.device) if weight is None else weight.to(acc)
    step = _chunk_rows(V, acc, 3 if softcap > 0 else 2, a.chunk_bytes)
    for s in range(0, N, step):
        e = min(s + step, N)
        L, th = _softcapped(x2[s:e].to(acc, copy=True), softcap, a.temperature)  # d is built in place
        if a.eta is None:
            d = L.sub_(lse[s:e, None].to(acc)).exp_().mul_(alpha[s:e, None].to(acc))  # alpha p
        else:  # p (alpha + eta L): the entropy's term (cce/_math.py)
            p = (L - lse[s:e, None].to(acc)).exp_()
            d = _math.entropy_dlogits_(L, p, alpha[s:e].to(acc), a.eta[s:e].to(acc))
        d.scatter_add_(1, safe_t[s:e, None], -beta[s:e, None].to(acc))
        if smoothing:
            d.addr_(gamma[s:e].to(acc), w, alpha=-1.0)
        if th is not None:
            d.mul_(th.square_().neg_().add_(1.0))  # softcap' = 1 - tanh^2
        # Ignored rows: zero coefficients, but p = exp(L - 0) may overflow (0 * inf = NaN).
        d = torch.where(valid[s:e, None], d, 0.0)
        o2[s:e] = d
    if not writes_through:
        out.copy_(o2.view(out.shape))
    return out


ce_torch_fwd = define_ce_ops("torch", torch_stats, torch_grad)
