"""The interface a vocabulary-parallel rank (cce/distributed/) uses: the statistics of one block
of the classifier, by either implementation, differentiable.

    block_stats -> (lse, tgt, ssum[, entropy, argmax]) per problem row over this block's classes
    (cce/_math.py), of the logits L = softcap(e c^T + bias) / temperature

Both implementations pose the block as a one-device problem and run their single-device custom
op on it (impl="triton": triton_impl.linear_ce_triton_fwd; impl="torch":
torch_impl.linear_ce_torch_fwd), whose upstream gradients are the rank's (below), so that
autograd runs the op's own backward: for impl="triton" the same tile statistics, vocabulary
order and backward algorithm as one device (sparse or exact, chosen by
block_plan, cce._dispatch.plan_triton), dE written into the forward's stash in e's dtype (no fp32
gradient buffers); for impl="torch" the chunked loop and its CPU filter. Both are opaque to
torch.compile.

The entropy and argmax are the block's: the entropy of its softmax p, the argmax as a block-local
id (:func:`logits_at` gives its logit, to compare blocks).

Targets are block-local ids with ignore_index -1 (a stand-in id for rows whose target lives on
another rank: the caller zeroes their target logit, so their beta is 0).
"""

from __future__ import annotations

import dataclasses

import torch

from ..._dispatch import LinearPlan, plan_torch, plan_triton
from ...options import Tuning


def block_plan(
    impl: str,
    tuning: Tuning,
    dtype: torch.dtype,
    shape: tuple[int, int, int],
    grads: tuple[bool, bool, bool],
    softcap: float,
    smoothing: bool,
    filter_eps: float,
    device: torch.device,
) -> LinearPlan:
    """The plan of a rank's block problem (block_stats): reduction "none" (so never the fused
    path), label smoothing 1 where the rank needs ssum, the block's classes ``shape[1]``."""
    if impl == "triton":
        from .triton_backward import with_slab_plan  # triton is optional: imported on use

        ls = 1.0 if smoothing else 0.0
        plan = plan_triton(
            tuning, "none", dtype, shape, grads, softcap, ls, filter_eps, device.type == "cuda"
        )
        plan = with_slab_plan(plan, tuning, dtype, shape, grads[1])
    else:
        plan = plan_torch(
            "none", True, any(grads), filter_eps, device.type == "cpu", smoothing and softcap > 0
        )
    why = f"vocabulary parallelism: this rank's block of {shape[1]} classes, per-token upstream gradients"
    return dataclasses.replace(plan, reasons=(why, *plan.reasons))


def block_stats(
    impl: str, e2d, c, bias, weight, rows, targets, softcap: float, smoothing: bool, filter_eps: float,
    need_de: bool, need_dc: bool, need_dbias: bool, tuning: Tuning, temperature: float = 1.0,
    entropy: bool = False, argmax: bool = False,
) -> tuple[torch.Tensor | None, ...]:  # fmt: skip
    """(lse, tgt, ssum or None, entropy or None, argmax or None) per problem row of the block;
    the first four fp32, 0 at ignored rows; through ``impl``'s single-device forward op, so that
    autograd runs its backward (an upstream gradient on the entropy included, as on one device).

    The op's block problem has reduction "none", no z-loss, and label smoothing 1 when the rank
    needs ssum (0 otherwise, and no class weights). Its per-row outputs are then (cce/_math.py,
    with W_r = sum of the block's class weights, V_r its classes)

        loss_i = (W_r lse_i - ssum_i) / V_r     (smoothing 1: the target term's factor 1 - 1 = 0)

    so ssum_i = W_r lse_i - V_r loss_i. For upstream gradients (a, b, s) on (lse, tgt, ssum) the
    op receives g = -V_r s on its loss, h = a + W_r s on lse and u = b on the target logit, and
    forms the coefficients (cce/_math.py) alpha = g W_r / V_r + h = a, beta = -u = -b,
    gamma = g / V_r = -s: the rank's logit gradient a p + b [v == t] + s w, with p the block's
    softmax. (alpha is a difference of fp32 terms of size |s| W_r: its error, 2^-24 |s| W_r, is
    that relative part of the smoothing term's mass s W_r, negligible.) Without smoothing g is 0
    (no gradient reaches the loss output) and alpha = h, beta = -u exactly.

    impl="triton"'s backward algorithm is the one device's choice for this block (V_r classes),
    without the fused path, whose upstream gradient must be one scalar (here it is per row).
    """
    V = c.shape[0]
    ls = 1.0 if smoothing else 0.0
    common = dict(
        e2d=e2d, c=c, bias=bias, weight=weight if smoothing else None, rows=rows, targets=targets,
        ignore_index=-1, reduction="none", softcap=softcap, label_smoothing=ls, z_loss=0.0,
        temperature=float(temperature),
    )  # fmt: skip
    if impl == "triton":
        from .triton_impl import linear_ce_triton_fwd as op  # triton is optional: imported on use

        shape, grads = (targets.numel(), V, c.shape[1]), (need_de, need_dc, need_dbias)
        algo = block_plan(
            impl, tuning, e2d.dtype, shape, grads, softcap, smoothing, filter_eps, c.device
        ).backward
        stats = algo == "sparse"
        args = dict(
            common, filter_eps=0.0 if algo == "exact" else filter_eps, stats=stats, stash=stats and need_de,
            stats_chain_tiles=tuning.stats_chain_tiles, dz_slab_bytes=tuning.dz_slab_bytes,
            de_block_slots=tuning.de_block_slots, dc_scratch_tiles=tuning.dc_scratch_tiles,
            stash_move_bytes=tuning.stash_move_bytes, dense_slabs=tuning.dense_slabs,
            dense_kept=tuning.dense_kept, slab_error=tuning.slab_error, slab_error_dc=tuning.slab_error_dc,
            dense_slab_bytes=tuning.dense_slab_bytes, first_order=tuning.first_order,
            host_gating=tuning.host_gating, entropy=entropy, argmax=argmax,
        )  # fmt: skip
        out = op(*(args[f] for f in op.args_type._fields))
        loss, lse, tgt, ent, amax = out[0], out[1], out[8], out[9], out[10]
    else:
        from .torch_impl import linear_ce_torch_fwd as op

        args = dict(
            common, filter_eps=filter_eps, precompute=False, need_de=need_de, need_dc=need_dc,
            need_dbias=need_dbias, chunk_bytes=tuning.chunk_bytes, want_entropy=entropy, want_argmax=argmax,
        )  # fmt: skip
        loss, lse, tgt, ent, amax = op(*(args[f] for f in op.args_type._fields))[:5]
    ssum = None
    if smoothing:
        W = float(V) if weight is None else weight.float().sum()
        ssum = W * lse - V * loss
    return lse, tgt, ssum, ent if entropy else None, amax if argmax else None


# Bytes of logits_at's fp32 products per chunk of rows (Tuning.chunk_bytes None): a [rows, D]
# fp32 pair, 16 MiB.
LOGITS_AT_BYTES = 16 << 20


@torch.no_grad()
def logits_at(
    e2d, rows, c, bias, cls, softcap: float, temperature: float, chunk_bytes: int | None = None
) -> torch.Tensor:
    """[N] fp32: the logit softcap(e_i . c_k + bias_k) / temperature of class ``cls[i]`` (a
    block-local id) of each problem row i, from the operands in fp32 (O(N D), no logits).

    It ranks the blocks' argmaxes against each other. Its rounding differs from the kernels'
    (fp32 products of the stored operands, summed by torch), so blocks whose maxima lie within
    rounding of each other may resolve a near tie otherwise than one device would; exact ties
    (equal rows of c and bias) compare equal, the lower block winning, as torch.argmax. The rows
    go in chunks of ``chunk_bytes`` of fp32 products."""
    N, D = cls.numel(), c.shape[1]
    step = max(1, (LOGITS_AT_BYTES if chunk_bytes is None else chunk_bytes) // (8 * D))
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
