"""The interface a vocabulary-parallel rank (cce/distributed/) uses: the statistics of one block
of the classifier, and its gradients from per-row coefficients, by either implementation.

    block_stats -> (lse, tgt, ssum) per problem row over this block's classes (cce/_math.py)
    block_grads -> (dE, dC, dbias) for dZ = (alpha p - beta [v == t] - gamma w) softcap'(z),
                   p = exp(L - lse) with the block's lse

Targets are block-local ids with ignore_index -1 (a stand-in id for rows whose target lives on
another rank: their beta is 0).
"""

from __future__ import annotations

import torch

from ...options import Tuning
from . import chunked


def block_stats(
    impl: str, e2d, c, bias, weight, rows, targets, softcap: float, smoothing: bool, tuning: Tuning
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(lse, tgt, ssum or None) per problem row (fp32 for "triton", the accumulation dtype for
    "torch"), 0 at ignored rows."""
    if impl == "torch":
        return chunked.forward_stats(
            e2d, c, bias, weight, rows, targets, -1, softcap, smoothing, tuning.chunk_bytes
        )
    from .triton_impl import forward_stats  # triton is optional: imported on use

    return forward_stats(e2d, c, bias, weight, rows, targets, -1, softcap, smoothing)


def block_grads(
    impl: str, e2d, c, bias, weight, rows, targets, lse, alpha, beta, gamma, softcap: float,
    filter_eps: float, need_de: bool, need_dc: bool, need_dbias: bool, tuning: Tuning,
):  # fmt: skip
    """(dE, dC, dbias), None where not needed: fp32 (dC in c's dtype on the exact Triton path),
    the accumulation dtype for "torch"."""
    if impl == "torch":
        return chunked.backward_coeffs(
            e2d, c, bias, weight, rows, targets, lse, alpha, beta, gamma, -1, softcap, filter_eps,
            need_de, need_dc, need_dbias, tuning.chunk_bytes,
        )  # fmt: skip
    from .rows import kernel_operands
    from .triton_backward import coefficient_backward

    e2d_k, c_k, bias_k, weight_k = kernel_operands(e2d, c, bias, weight)
    return coefficient_backward(
        e2d_k, c_k, bias_k, weight_k, rows, targets, lse.float(), alpha.float(), beta.float(),
        None if gamma is None else gamma.float(), -1, softcap, filter_eps, need_de, need_dc, need_dbias,
        tuning.dz_slab_bytes,
    )  # fmt: skip
