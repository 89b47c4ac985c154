"""The interface a vocabulary-parallel rank (cce/distributed/) uses: the statistics of one block
of the classifier, and their gradients, by either implementation.

    block_stats -> (lse, tgt, ssum[, entropy, argmax]) per problem row over this block's classes
    (cce/_math.py), of the logits L = softcap(e c^T + bias) / temperature

impl="triton" (:func:`triton_block_stats`): the single-device custom op
(triton_impl.linear_ce_triton_fwd) on the block, differentiable: its forward gathers the same
tile statistics and vocabulary order as one device, and its backward is the one device's
(sparse, recomputing or exact, chosen by cce._dispatch.linear_backward), writing dE into the
forward's stash in e's dtype (no fp32 gradient buffers). The block is posed as a one-device
problem whose upstream gradients are the rank's (below).

impl="torch" (:func:`block_stats`, :func:`block_grads`): the chunked loop, with the gradients
from per-row coefficients for dL = alpha p - beta [v == t] - gamma w + eta p L, p = exp(L -
lse) with the block's lse (dZ = dL softcap'(z) / temperature).

The entropy and argmax are the block's: the entropy of its softmax p, the argmax as a block-local
id (:func:`logits_at` gives its logit, to compare blocks).

Targets are block-local ids with ignore_index -1 (a stand-in id for rows whose target lives on
another rank: the caller zeroes their target logit, so their beta is 0).
"""

from __future__ import annotations

import torch

from ..._dispatch import linear_backward
from ...options import Tuning
from . import chunked


def triton_block_stats(
    e2d, c, bias, weight, rows, targets, softcap: float, smoothing: bool, filter_eps: float,
    need_de: bool, need_dc: bool, need_dbias: bool, tuning: Tuning, temperature: float = 1.0,
    entropy: bool = False, argmax: bool = False,
) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """(lse, tgt, ssum or None, entropy or None, argmax or None) per problem row of the block;
    the first four fp32, 0 at ignored rows; through the single-device forward op, so that
    autograd runs its backward (an upstream gradient on the entropy included: the op then runs
    its exact backward, as on one device).

    The op's block problem has reduction "none", no z-loss, and label smoothing 1 when the rank
    needs ssum (0 otherwise, and no class weights). Its per-row outputs are then (cce/_math.py,
    with W_r = sum of the block's class weights, V_r its classes)

        loss_i = (W_r lse_i - ssum_i) / V_r     (smoothing 1: the target term's factor 1 - 1 = 0)

    so ssum_i = W_r lse_i - V_r loss_i. For upstream gradients (a, b, s) on (lse, tgt, ssum) the
    op receives g = -V_r s on its loss, h = a + W_r s on lse and u = b on the target logit, and
    forms the coefficients (triton_backward.loss_coefficients) alpha = g W_r / V_r + h = a,
    beta = -u = -b, gamma = g / V_r = -s: the rank's logit gradient a p + b [v == t] + s w,
    with p the block's softmax. (alpha is a difference of fp32 terms of size |s| W_r: its error,
    2^-24 |s| W_r, is that relative part of the smoothing term's mass s W_r, negligible.)
    Without smoothing g is 0 (no gradient reaches the loss output) and alpha = h, beta = -u
    exactly.

    The backward algorithm is the one device's choice for this block (V_r classes), without the
    fused path, whose upstream gradient must be one scalar (here it is per row).
    """
    from .triton_impl import linear_ce_triton_fwd  # triton is optional: imported on use

    N, (V, D) = targets.numel(), c.shape
    ls = 1.0 if smoothing else 0.0
    algo = linear_backward(
        tuning, filter_eps, need_de, need_dc, need_dbias, softcap, ls, 2.0 * N * V * D, c.is_cuda, classes=V,
        temperature=temperature,
    )  # fmt: skip
    stats = algo == "sparse"
    eps = 0.0 if algo == "exact" else filter_eps
    args = dict(
        e2d=e2d, c=c, bias=bias, weight=weight if smoothing else None, rows=rows, targets=targets,
        ignore_index=-1, reduction="none", softcap=softcap, label_smoothing=ls, z_loss=0.0, filter_eps=eps,
        stats=stats, stash=stats and need_de, stats_chain_tiles=tuning.stats_chain_tiles,
        dz_slab_bytes=tuning.dz_slab_bytes, de_block_slots=tuning.de_block_slots,
        dc_scratch_tiles=tuning.dc_scratch_tiles, stash_move_bytes=tuning.stash_move_bytes,
        dense_slabs=tuning.dense_slabs, dense_kept=tuning.dense_kept, slab_error=tuning.slab_error,
        slab_error_dc=tuning.slab_error_dc, dense_slab_bytes=tuning.dense_slab_bytes,
        first_order=tuning.first_order, temperature=float(temperature), entropy=entropy, argmax=argmax,
    )  # fmt: skip
    out = linear_ce_triton_fwd(*(args[f] for f in linear_ce_triton_fwd.args_type._fields))
    loss, lse, tgt = out[0], out[1], out[8]
    ssum = None
    if smoothing:
        W = float(V) if weight is None else weight.float().sum()
        ssum = W * lse - V * loss
    return lse, tgt, ssum, out[9] if entropy else None, out[10] if argmax else None


def block_stats(
    e2d, c, bias, weight, rows, targets, softcap: float, smoothing: bool, tuning: Tuning,
    temperature: float = 1.0, entropy: bool = False, argmax: bool = False,
) -> tuple[torch.Tensor | None, ...]:  # fmt: skip
    """impl="torch": (lse, tgt, ssum or None, entropy or None, argmax or None) per problem row,
    the first four in the accumulation dtype and 0 at ignored rows (not differentiable:
    block_grads is their backward)."""
    return chunked.forward_stats(
        e2d, c, bias, weight, rows, targets, -1, softcap, smoothing, tuning.chunk_bytes, temperature, entropy,
        argmax,
    )  # fmt: skip


def block_grads(
    e2d, c, bias, weight, rows, targets, lse, alpha, beta, gamma, softcap: float,
    filter_eps: float, need_de: bool, need_dc: bool, need_dbias: bool, tuning: Tuning,
    temperature: float = 1.0, eta: torch.Tensor | None = None,
):  # fmt: skip
    """impl="torch": (dE, dC, dbias) in the accumulation dtype, None where not needed."""
    return chunked.backward_coeffs(
        e2d, c, bias, weight, rows, targets, lse, alpha, beta, gamma, -1, softcap, filter_eps,
        need_de, need_dc, need_dbias, tuning.chunk_bytes, temperature, eta,
    )  # fmt: skip


# Rows per chunk of logits_at's fp32 products (a [rows, D] fp32 pair: 16 MiB at D = 4096).
_LOGITS_AT_BYTES = 16 << 20


@torch.no_grad()
def logits_at(e2d, rows, c, bias, cls, softcap: float, temperature: float) -> torch.Tensor:
    """[N] fp32: the logit softcap(e_i . c_k + bias_k) / temperature of class ``cls[i]`` (a
    block-local id) of each problem row i, from the operands in fp32 (O(N D), no logits).

    It ranks the blocks' argmaxes against each other. Its rounding differs from the kernels'
    (fp32 products of the stored operands, summed by torch), so blocks whose maxima lie within
    rounding of each other may resolve a near tie otherwise than one device would; exact ties
    (equal rows of c and bias) compare equal, the lower block winning, as torch.argmax."""
    N, D = cls.numel(), c.shape[1]
    step = max(1, _LOGITS_AT_BYTES // (8 * D))
    out = []
    for i in range(0, N, step):
        k = cls[i : i + step]
        er = e2d[i : i + step] if rows is None else e2d.index_select(0, rows[i : i + step])
        z = (er.float() * c.index_select(0, k).float()).sum(1)
        if bias is not None:
            z = z + bias.index_select(0, k).float()
        if softcap > 0:
            z = softcap * torch.tanh(z / softcap)
        out.append(z * (1.0 / temperature))
    return torch.cat(out) if out else e2d.new_zeros(0, dtype=torch.float32)
