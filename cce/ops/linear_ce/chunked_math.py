"""Matrix products of the chunked PyTorch implementation: accumulation dtype, oneDNN on CPU."""

from __future__ import annotations

import torch


def mm(a: torch.Tensor, b: torch.Tensor, acc: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """a @ b accumulated and returned in ``acc`` (into ``out`` if given); a is cast to b's dtype."""
    if b.dtype == acc:
        return torch.mm(a.to(acc), b, out=out)
    a = a.to(b.dtype)
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=acc, out=out)
    r = torch.mm(a, b).to(acc)
    return r if out is None else out.copy_(r)


def onednn_linear():
    """torch.ops.mkldnn._linear_pointwise (x @ w.T through oneDNN), or None where unavailable."""
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._linear_pointwise.default
    except (AttributeError, RuntimeError):
        return None


LINEAR = onednn_linear()
# Vocabulary slice of the oneDNN logits and dC GEMMs. The op has no out= form: each slice's result
# (1.6 MB of logits at n = 400, 2 MB of dC rows) is copied or added into place while in cache,
# where one chunk-sized result would page-fault 48 MB per chunk. Smaller slices hold fewer
# transient bytes at the peak at the same speed.
ONEDNN_SLICE = 1024


def use_onednn(*ts: torch.Tensor) -> bool:
    """Whether these fp32 CPU operands' GEMMs go through oneDNN rather than torch.mm (BLAS).

    Same fp32 products with fp32 accumulation (only the summation order differs; a reduced
    precision chosen through torch.backends.mkldnn applies to both), different kernels: on the
    AMD EPYC of docs/benchmarks.md torch.mm's MKL sgemm runs at ~170 GFLOP/s, the 256-bit FMA
    peak, and oneDNN's AVX-512 brgemm at ~340 (measured).
    """
    return (
        LINEAR is not None
        and torch._C._get_mkldnn_enabled()
        and all(t.device.type == "cpu" and t.dtype == torch.float32 and t.numel() for t in ts)
    )


def addmm_(
    out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, block: int = 8192, scale: torch.Tensor | None = None
) -> None:
    """out += a @ b [* scale] (out in the accumulation dtype), bounding temporaries to ``block``
    rows."""
    if b.dtype == out.dtype and scale is None:
        out.addmm_(a.to(out.dtype), b)
        return
    for s in range(0, out.shape[0], block):
        r = mm(a[s : s + block], b, out.dtype)
        out[s : s + block] += r if scale is None else r * scale


def addmm_tn_(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor | None = None) -> None:
    """out += a.T @ b [* scale] (fp32 CPU: oneDNN, per vocabulary slice of a's columns)."""
    if scale is not None or not use_onednn(a, b, out):
        addmm_(out, a.T, b, scale=scale)
        return
    bT = b.T.contiguous()  # [D, n]
    S = ONEDNN_SLICE
    for v in range(0, a.shape[1], S):
        # The op takes a plain (row-major) input: the [n, S] slice is transposed into one
        # (cache-sized) copy; its [S, D] product is added to out's rows while in cache.
        out[v : v + S] += LINEAR(a[:, v : v + S].T.contiguous(), bT, None, "none", [], "")
