"""impl="triton": the custom ops and autograd over the kernels of cce/ops/linear_ce/kernels/.

Forward: the kernel reduces each valid token's logits to (lse, target logit[, weighted logit
sum]); the loss is assembled from those by cce/_math.py. Saved for backward: the inputs and lse
(O(N)); for a training step of the sparse backward also the encoded tile statistics (one byte per
row and 256 classes), which live in the tail of dE's buffer (the "stash") when e needs a
gradient. Backward: _math turns the upstream gradient into per-row coefficients, and the
algorithm cce._dispatch.linear_backward chose at the forward runs (triton_backward.py).

Nothing here synchronises with the host: the valid-first row order and its count stay on the
device, so a training step can be captured in a CUDA graph. The entry points are
``torch.library`` custom ops (arguments declared once, cce/_custom_ops.py), opaque to
torch.compile.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ... import _math
from ..._custom_ops import define_op, register_autograd, register_fake
from ..._dispatch import plan_triton
from ...options import Tuning
from .kernels.common import inverse_permutation, stats_blocks
from .kernels.forward import linear_ce_forward
from .kernels.fused_grads import linear_ce_fused, scale_
from .kernels.stash import code_fits_stash, stash_code
from .kernels.tile_stats import encode_tile_stats
from .rows import RowOrder, kernel_operands, vocab_scores
from .triton_backward import loss_backward, sparse_backward


class FwdArgs(NamedTuple):
    e2d: torch.Tensor  # [M, D] hidden states (problem row i reads e2d[rows[i]])
    c: torch.Tensor  # [V, D]
    bias: torch.Tensor | None
    weight: torch.Tensor | None  # class weights [V]
    rows: torch.Tensor | None  # [N] e2d row of each problem row (None: the identity)
    targets: torch.Tensor  # [N] int64
    ignore_index: int
    reduction: str
    softcap: float  # 0: none
    label_smoothing: float
    z_loss: float
    filter_eps: float  # 0: exact
    stats: bool  # the sparse backward's tile statistics
    stash: bool  # ... and the dE buffer they live in (e needs a gradient)
    stats_chain_tiles: int
    dz_slab_bytes: int
    de_block_slots: int
    dc_scratch_tiles: int | None
    stash_move_bytes: int
    dense_slabs: bool
    dense_kept: float
    slab_error: float
    slab_error_dc: float
    dense_slab_bytes: int
    first_order: bool
    host_gating: bool
    temperature: float  # the logits are softcap(x) / temperature
    entropy: bool  # the entropy output
    argmax: bool  # the argmax output


_FWD_OUT = tuple[(torch.Tensor,) * 14]


def _stats_tiles(V: int, dtype: torch.dtype) -> int:
    return -(-V // stats_blocks(dtype)[1])


@define_op("cce::linear_ce_triton_fwd", FwdArgs, _FWD_OUT)
def linear_ce_triton_fwd(a: FwdArgs):
    """(loss, lse, code, keep, tgt_logit, vperm, vscore, stash, tgt, entropy, argmax, order,
    n_valid, cmeans); lse, tgt (each row's target logit) and entropy are fp32 (N,), 0 at ignored rows;
    argmax int64 (N,), 0 at ignored rows; entropy and argmax are empty where not asked for.

    With ``stats`` the next outputs are the encoded tile statistics (tile_stats.encode_tile_stats:
    uint8 masses per sorted row and tile, int8 keep flags per token block and tile), the sorted
    rows' target logits, and the vocabulary order (int32) with its scores; otherwise they are
    empty. The raw statistics (3 bytes per row and tile) are freed here, before the backward
    allocates the gradients. With ``stash`` the last output is the uninitialised buffer the
    backward writes dE into (e2d's shape, the kernels' dtype), and the codes live in its tail
    when they fit (stash.code_fits_stash; ``code`` is then empty). With ``stats`` also the
    orders the backward reads (``order`` int64 [3N + V]: the valid-first row order, the sorted
    rows' targets, their positions in the vocabulary order and each class's position; the
    valid rows' count ``n_valid`` int32 [1]), and ``cmeans``, the tiles' means of C in the
    vocabulary order (fp32 [n_tiles, D], which the sparse backward reads; the sorted forward's slab
    copies form them); otherwise empty.
    """
    e2d, c, bias, weight = kernel_operands(a.e2d, a.c, a.bias, a.weight)
    V = c.shape[0]
    k = _math.LossConsts(a.label_smoothing, a.z_loss, V)
    r = RowOrder(a.targets, a.rows, a.ignore_index)
    perm = score = tpos = order = None
    t_s = r.safe_t.index_select(0, r.perm)
    if a.stats:
        perm, score = vocab_scores(e2d, c, bias, r)
        vpos = inverse_permutation(perm)
        tpos = vpos.index_select(0, t_s)
        # The orders for the backward, which would otherwise make them again (a sort and a pass
        # over the targets: host time of a step, docs/benchmarks.md, "Host time").
        order = torch.cat([r.perm, t_s, tpos, vpos])
    st = linear_ce_forward(
        e2d, c, bias, weight, r.erow_s, t_s, r.n_valid, a.softcap, k.smoothing, perm=perm, eps=a.filter_eps,
        temperature=a.temperature, entropy=a.entropy, argmax=a.argmax, tpos=tpos,
    )  # fmt: skip
    lse, tgt = r.unsort(st.lse), r.unsort(st.tgt)
    f32 = torch.float32
    ent = r.unsort(st.entropy) if a.entropy else e2d.new_empty(0, dtype=f32)
    amax = r.unsort(st.argmax) if a.argmax else e2d.new_empty(0, dtype=torch.long)
    ssum = None if st.ssum is None else r.unsort(st.ssum)
    if a.stats:
        BN = stats_blocks(e2d.dtype)[0]
        N, nt = r.N, _stats_tiles(V, e2d.dtype)
        buf = e2d.new_empty(e2d.shape if a.stash else (0,))
        in_stash = a.stash and code_fits_stash(N, nt, e2d.shape[0], e2d.shape[1], e2d.dtype)
        code, keep = encode_tile_stats(
            st.st, st.sq, st.m0, st.lse, r.n_valid, BN, a.stats_chain_tiles,
            code=stash_code(buf, N, nt) if in_stash else None,
        )  # fmt: skip
        if in_stash:
            code = code.new_empty(0)
        zt_s, cmeans = st.tgt, st.cm
    del st
    w_t = _math.target_weight(weight, a.targets, r.valid)
    W = _math.weight_total(weight, V, e2d.device)
    loss_tok = _math.token_loss(lse, tgt, ssum, w_t, W, r.valid, k)
    loss = _math.reduce_loss(loss_tok, w_t, a.reduction)
    lse = torch.where(r.valid, lse, 0.0)
    tgt = torch.where(r.valid, tgt, 0.0)
    if not a.stats:
        none = e2d.new_empty(0, dtype=torch.float32)
        return (
            loss, lse, none.to(torch.uint8), none.to(torch.int8), none.clone(), none.int(), none.clone(),
            e2d.new_empty(0), tgt, ent, amax, none.long(), none.int(), none.clone(),
        )  # fmt: skip
    return loss, lse, code, keep, zt_s, perm.int(), score, buf, tgt, ent, amax, order, r.n_valid, cmeans


def _fwd_fake(a: FwdArgs):
    e2d, c = a.e2d, a.c
    N, V = a.targets.shape[0], c.shape[0]
    f32 = torch.float32
    kdt = torch.float32 if e2d.dtype == torch.float64 else e2d.dtype
    loss = e2d.new_empty((N,) if a.reduction == "none" else (), dtype=f32)
    lse = e2d.new_empty((N,), dtype=f32)
    ent = e2d.new_empty((N,) if a.entropy else (0,), dtype=f32)
    amax = e2d.new_empty((N,) if a.argmax else (0,), dtype=torch.long)
    if not a.stats:
        none = e2d.new_empty(0, dtype=f32)
        return (
            loss, lse, none.to(torch.uint8), none.to(torch.int8), none.clone(), none.int(), none.clone(),
            e2d.new_empty(0, dtype=kdt), e2d.new_empty((N,), dtype=f32), ent, amax,
            e2d.new_empty(0, dtype=torch.long), e2d.new_empty(0, dtype=torch.int32), none.clone(),
        )  # fmt: skip
    BN = stats_blocks(kdt)[0]
    nt = _stats_tiles(V, kdt)
    in_stash = a.stash and code_fits_stash(N, nt, e2d.shape[0], e2d.shape[1], kdt)
    return (
        loss, lse, e2d.new_empty((0,) if in_stash else (N, nt), dtype=torch.uint8),
        e2d.new_empty((-(-N // BN), nt), dtype=torch.int8), e2d.new_empty((N,), dtype=f32),
        e2d.new_empty((V,), dtype=torch.int32), e2d.new_empty((V,), dtype=f32),
        e2d.new_empty(e2d.shape if a.stash else (0,), dtype=kdt), e2d.new_empty((N,), dtype=f32), ent, amax,
        e2d.new_empty((3 * N + V,), dtype=torch.long), e2d.new_empty((1,), dtype=torch.int32),
        e2d.new_empty((nt, e2d.shape[1]), dtype=f32),
    )  # fmt: skip


register_fake(linear_ce_triton_fwd, _fwd_fake)


class BwdArgs(NamedTuple):
    e2d: torch.Tensor
    c: torch.Tensor
    bias: torch.Tensor | None
    weight: torch.Tensor | None
    rows: torch.Tensor | None
    targets: torch.Tensor
    lse: torch.Tensor  # [N] fp32 saved by the forward
    g: torch.Tensor  # [N] fp32 upstream gradient of each row's loss
    h: torch.Tensor | None  # [N] upstream gradient of the lse output
    ignore_index: int
    softcap: float
    label_smoothing: float
    z_loss: float
    need_de: bool
    need_dc: bool
    need_dbias: bool
    dz_slab_bytes: int
    u: torch.Tensor | None  # [N] upstream gradient of the target logit output (log-probabilities)
    delta: torch.Tensor | None  # [N] upstream gradient of the entropy output
    entropy: torch.Tensor | None  # [N] fp32 the entropy's forward values (with delta)
    temperature: float


@define_op("cce::linear_ce_triton_bwd", BwdArgs, tuple[torch.Tensor, torch.Tensor, torch.Tensor])
def linear_ce_triton_bwd(a: BwdArgs):
    """(dE, dC, dbias) in the dtypes of e2d, c, bias (empty where not needed): the exact backward
    (triton_backward.loss_backward)."""
    e2d_k, c_k, bias, weight = kernel_operands(a.e2d, a.c, a.bias, a.weight)
    dE, dC, db = loss_backward(
        e2d_k, c_k, bias, weight, a.rows, a.targets, a.lse, a.g, a.h, a.ignore_index, a.softcap,
        a.label_smoothing, a.z_loss, a.need_de, a.need_dc, a.need_dbias, a.dz_slab_bytes, a.u, a.delta,
        a.entropy, a.temperature,
    )  # fmt: skip
    return (
        dE.to(a.e2d.dtype) if dE is not None else a.e2d.new_empty(0),
        dC.to(a.c.dtype) if dC is not None else a.c.new_empty(0),
        db.to(bias.dtype) if db is not None else a.c.new_empty(0),
    )


def _bwd_fake(a: BwdArgs):
    e2d, c, bias = a.e2d, a.c, a.bias
    dE = e2d.new_empty(e2d.shape if a.need_de else (0,))
    dC = c.new_empty(c.shape if a.need_dc else (0,))
    db = c.new_empty(
        (c.shape[0],) if a.need_dbias else (0,), dtype=bias.dtype if bias is not None else c.dtype
    )
    return dE, dC, db


register_fake(linear_ce_triton_bwd, _bwd_fake)


class SparseBwdArgs(NamedTuple):
    e2d: torch.Tensor
    c: torch.Tensor
    bias: torch.Tensor | None
    weight: torch.Tensor | None
    rows: torch.Tensor | None
    targets: torch.Tensor
    lse: torch.Tensor
    g: torch.Tensor
    h: torch.Tensor | None
    code: torch.Tensor  # the forward's outputs (see linear_ce_triton_fwd)
    keep: torch.Tensor
    zt: torch.Tensor
    vperm: torch.Tensor
    vscore: torch.Tensor
    stash: torch.Tensor
    ignore_index: int
    softcap: float
    label_smoothing: float
    z_loss: float
    need_de: bool
    need_dc: bool
    de_block_slots: int
    dc_scratch_tiles: int | None
    stash_move_bytes: int
    dense_slabs: bool
    dense_kept: float
    slab_error: float
    slab_error_dc: float
    dense_slab_bytes: int
    first_order: bool
    host_gating: bool
    u: torch.Tensor | None  # [N] upstream gradient of the target logit output
    delta: torch.Tensor | None  # [N] upstream gradient of the entropy output
    entropy: torch.Tensor | None  # [N] fp32 the entropy's forward values (with delta)
    order: torch.Tensor | None  # the forward's orders and valid rows' count (None: made again)
    n_valid: torch.Tensor | None
    cmeans: torch.Tensor | None  # the forward's tile means of C (None or empty: made again)
    temperature: float  # the forward's: its statistics are of softcap(x) / temperature


@define_op(
    "cce::linear_ce_triton_bwd_sparse",
    SparseBwdArgs,
    tuple[torch.Tensor, torch.Tensor],
    mutates_args=("stash",),
)
def linear_ce_triton_bwd_sparse(a: SparseBwdArgs):
    """(dE, dC) in the dtypes of e2d, c (empty where not needed), by the sparse backward. With a
    non-empty ``stash`` (the forward's) dE is written there (in the kernels' dtype) and the
    returned dE is empty."""
    e2d_k, c_k, bias, weight = kernel_operands(a.e2d, a.c, a.bias, a.weight)
    own = a.stash.numel() == 0
    dE, dC = sparse_backward(
        e2d_k, c_k, bias, weight, a.rows, a.targets, a.lse, a.g, a.h, a.ignore_index, a.softcap,
        a.label_smoothing, a.z_loss, a.need_de, a.need_dc, a.code, a.keep, a.zt, a.vperm, a.vscore,
        None if own else a.stash, de_block_slots=a.de_block_slots,
        dc_scratch_tiles=a.dc_scratch_tiles, move_bytes=a.stash_move_bytes, dense_slabs=a.dense_slabs,
        dense_kept=a.dense_kept, slab_error=a.slab_error, slab_error_dc=a.slab_error_dc,
        dense_slab_bytes=a.dense_slab_bytes, first_order=a.first_order, host_gating=a.host_gating, u=a.u,
        delta=a.delta, entropy=a.entropy, order=a.order, n_valid=a.n_valid, cmeans=a.cmeans,
        temperature=a.temperature,
    )  # fmt: skip
    return (
        dE.to(a.e2d.dtype) if dE is not None and own else a.e2d.new_empty(0),
        dC.to(a.c.dtype) if dC is not None else a.c.new_empty(0),
    )


def _sparse_fake(a: SparseBwdArgs):
    own = a.stash.numel() == 0
    e2d, c = a.e2d, a.c
    return e2d.new_empty(e2d.shape if a.need_de and own else (0,)), c.new_empty(
        c.shape if a.need_dc else (0,)
    )


register_fake(linear_ce_triton_bwd_sparse, _sparse_fake)


def _setup_context(ctx, a: FwdArgs, output) -> None:
    _loss, lse, code, keep, zt, vperm, vscore, stash, _tgt, ent, amax, order, n_valid, cmeans = output
    ctx.mark_non_differentiable(code, keep, zt, vperm, vscore, stash, amax, order, n_valid, cmeans)
    # Unused incoming gradients stay None: materialised, the statistics' would be zero-filled
    # [N, V / 256] tensors alive through the backward.
    ctx.set_materialize_grads(False)
    ctx.args = a._replace(e2d=None, c=None, bias=None, weight=None, rows=None, targets=None)
    ctx.save_for_backward(
        a.e2d, a.c, a.bias, a.weight, a.rows, a.targets, lse, code, keep, zt, vperm, vscore, stash, ent,
        order, n_valid, cmeans,
    )  # fmt: skip


def _backward(
    ctx, g_loss, g_lse, _g_code, _g_keep, _g_zt, _g_vperm, _g_vscore, _g_stash, g_tgt, g_ent, _g_amax,
    _g_order, _g_nvalid, _g_cmeans,
):  # fmt: skip
    a: FwdArgs = ctx.args
    (
        e2d, c, bias, weight, rows, targets, lse, code, keep, zt, vperm, vscore, stash, ent, order, n_valid,
        cmeans,
    ) = ctx.saved_tensors  # fmt: skip
    need_de, need_dc, need_db = ctx.needs_input_grad[:3]
    need_db = need_db and bias is not None
    nothing = (None,) * (len(FwdArgs._fields) - 3)
    if not (need_de or need_dc or need_db):
        return (None, None, None, *nothing)
    valid = targets != a.ignore_index
    w_t = _math.target_weight(weight, targets, valid)
    N = targets.numel()
    if g_loss is None:
        g = torch.zeros(N, dtype=torch.float32, device=targets.device)
    else:
        g = _math.row_upstream(g_loss, w_t, a.reduction, N).contiguous()
    # (A gradient reaching the entropy is part of the sparse backward's dZ,
    # triton_backward.sparse_backward.)
    if a.stats and not need_db:
        dE, dC = linear_ce_triton_bwd_sparse(
            e2d, c, bias, weight, rows, targets, lse, g, g_lse, code, keep, zt, vperm, vscore, stash,
            a.ignore_index, a.softcap, a.label_smoothing, a.z_loss, need_de, need_dc,
            a.de_block_slots, a.dc_scratch_tiles, a.stash_move_bytes, a.dense_slabs, a.dense_kept,
            a.slab_error, a.slab_error_dc, a.dense_slab_bytes, a.first_order, a.host_gating, g_tgt, g_ent,
            ent if g_ent is not None else None, order, n_valid, cmeans, a.temperature,
        )  # fmt: skip
        if need_de and stash.numel() > 0:
            # dE was written into the forward's stash (a second backward through this graph
            # fails on the saved stash's version instead of reading a gradient as statistics).
            dE = stash.to(e2d.dtype)
        db = None
    else:
        dE, dC, db = linear_ce_triton_bwd(
            e2d, c, bias, weight, rows, targets, lse, g, g_lse, a.ignore_index, a.softcap,
            a.label_smoothing, a.z_loss, need_de, need_dc, need_db, a.dz_slab_bytes, g_tgt, g_ent,
            ent if g_ent is not None else None, a.temperature,
        )  # fmt: skip
    return (dE if need_de else None, dC if need_dc else None, db if need_db else None, *nothing)


register_autograd(linear_ce_triton_fwd, _backward, _setup_context)


class FusedArgs(NamedTuple):
    e2d: torch.Tensor
    c: torch.Tensor
    bias: torch.Tensor | None
    weight: torch.Tensor | None
    rows: torch.Tensor | None
    targets: torch.Tensor
    ignore_index: int
    reduction: str  # "mean" or "sum"
    softcap: float
    label_smoothing: float
    z_loss: float
    need_de: bool
    need_dc: bool
    need_dbias: bool
    chunk_bytes: int
    dz_slab_bytes: int  # the exact backward's, for a gradient through lse
    temperature: float
    entropy: bool
    argmax: bool


@define_op(
    "cce::linear_ce_triton_fused",
    FusedArgs,
    tuple[(torch.Tensor,) * 8],
)
def linear_ce_triton_fused(a: FusedArgs):
    """(loss, lse, dE, dC, dbias, tgt, entropy, argmax): loss, lse, tgt, entropy and argmax as
    linear_ce_triton_fwd's, and the exact gradients of the loss for an upstream gradient of 1,
    formed in this forward pass (kernels/fused_grads.py), in the dtypes of e2d, c, bias (empty
    where not asked for)."""
    e2d, c, bias, weight = kernel_operands(a.e2d, a.c, a.bias, a.weight)
    V = c.shape[0]
    dev = e2d.device
    k = _math.LossConsts(a.label_smoothing, a.z_loss, V)
    valid = a.targets != a.ignore_index
    safe_t = torch.where(valid, a.targets, 0)
    w_t = _math.target_weight(weight, a.targets, valid)
    W = _math.weight_total(weight, V, dev)
    # One divisor for the coefficients and the loss; an upstream gradient of 1 (the backward
    # scales): the host launches of this O(N) glue count at small N (docs/benchmarks.md).
    den = _math.mean_denominator(w_t) if a.reduction == "mean" else None
    g = _math.row_upstream(None, w_t, a.reduction, a.targets.numel(), den)
    a0, a1, beta, gamma = _math.affine_coefficients(g, w_t, W, valid, k)
    if a.temperature != 1.0:  # the chain rule's 1 / T
        a0, a1, beta, gamma = (None if x is None else x / a.temperature for x in (a0, a1, beta, gamma))
    out = linear_ce_fused(
        e2d, c, bias, weight, a.rows, safe_t, a0, a1, beta, gamma, a.softcap,
        a.need_de, a.need_dc, a.need_dbias, a.chunk_bytes, a.temperature, a.entropy, a.argmax,
    )  # fmt: skip
    loss_tok = _math.token_loss(out.lse, out.tgt, out.ssum, w_t, W, valid, k)
    loss = _math.reduce_loss(loss_tok, w_t, a.reduction, den)
    return (
        loss,
        torch.where(valid, out.lse, 0.0),
        out.dE.to(a.e2d.dtype) if out.dE is not None else a.e2d.new_empty(0),
        out.dC.to(a.c.dtype) if out.dC is not None else a.c.new_empty(0),
        out.dbias.to(bias.dtype) if out.dbias is not None else a.c.new_empty(0),
        torch.where(valid, out.tgt, 0.0),
        torch.where(valid, out.entropy, 0.0) if a.entropy else e2d.new_empty(0, dtype=torch.float32),
        torch.where(valid, out.argmax, 0) if a.argmax else e2d.new_empty(0, dtype=torch.long),
    )


def _fused_fake(a: FusedArgs):
    e2d, c, bias = a.e2d, a.c, a.bias
    f32 = torch.float32
    return (
        e2d.new_empty((), dtype=f32),
        e2d.new_empty((a.targets.shape[0],), dtype=f32),
        e2d.new_empty(e2d.shape if a.need_de else (0,)),
        c.new_empty(c.shape if a.need_dc else (0,)),
        c.new_empty((c.shape[0],) if a.need_dbias else (0,), dtype=bias.dtype if a.need_dbias else c.dtype),
        e2d.new_empty((a.targets.shape[0],), dtype=f32),
        e2d.new_empty((a.targets.shape[0],) if a.entropy else (0,), dtype=f32),
        e2d.new_empty((a.targets.shape[0],) if a.argmax else (0,), dtype=torch.long),
    )


register_fake(linear_ce_triton_fused, _fused_fake)


class ScaleArgs(NamedTuple):
    xs: list[torch.Tensor]  # contiguous, each scaled in place
    s: torch.Tensor  # 0-dim fp32


@define_op("cce::scale_", ScaleArgs, None, mutates_args=("xs",))
def scale_inplace(a: ScaleArgs) -> None:
    """x *= s in place for every x in xs (kernels/fused_grads.scale_): one op call for all the
    forward's gradients."""
    for x in a.xs:
        scale_(x, a.s)


register_fake(scale_inplace, lambda a: None)


def _fused_setup_context(ctx, a: FusedArgs, output) -> None:
    _loss, lse, dE, dC, db, _tgt, ent, amax = output
    ctx.mark_non_differentiable(dE, dC, db, amax)
    ctx.set_materialize_grads(False)
    ctx.args = a._replace(e2d=None, c=None, bias=None, weight=None, rows=None, targets=None)
    # The forward's gradients stay on ctx, not saved tensors: the backward scales them in place
    # (no second copy), which would trip autograd's version check on saved tensors.
    ctx.pre = (dE, dC, db)
    ctx.save_for_backward(a.e2d, a.c, a.bias, a.weight, a.rows, a.targets, lse, ent)


def _fused_backward(ctx, g_loss, g_lse, _g_de, _g_dc, _g_db, g_tgt, g_ent, _g_amax):
    """The forward's gradients scaled in place by the (scalar) upstream gradient. A gradient
    reaching lse, the target logit (log-probabilities) or the entropy, or a second backward
    through a retained graph (the forward's gradients are then spent), takes the exact backward
    for what is left (one more pass)."""
    a: FusedArgs = ctx.args
    e2d, c, bias, weight, rows, targets, lse, ent = ctx.saved_tensors
    need = ctx.needs_input_grad[:3]
    pre, ctx.pre = ctx.pre, None
    grads = [None, None, None]
    g_rest = None
    if g_loss is not None and pre is not None:
        # (g_loss == 1 is short-cut inside the scale kernel, on the device: a host branch on the
        # value would sync, and is a data-dependent guard under torch.compile.)
        for j, x in enumerate(pre):
            if need[j]:
                grads[j] = x
        scale_inplace([x for x in grads if x is not None], g_loss.float())
    elif g_loss is not None:
        valid = targets != a.ignore_index
        w_t = _math.target_weight(weight, targets, valid)
        g_rest = _math.row_upstream(g_loss, w_t, a.reduction, targets.numel()).contiguous()
    if g_rest is not None or g_lse is not None or g_tgt is not None or g_ent is not None:
        if g_rest is None:
            g_rest = torch.zeros(targets.numel(), dtype=torch.float32, device=targets.device)
        # Through the exact backward's op (opaque to torch.compile, which traces this function):
        # its gradients come in the inputs' dtypes, added to the forward's with one more rounding.
        extra = linear_ce_triton_bwd(
            e2d, c, bias, weight, rows, targets, lse, g_rest, g_lse, a.ignore_index, a.softcap,
            a.label_smoothing, a.z_loss, need[0], need[1], need[2] and bias is not None, a.dz_slab_bytes,
            g_tgt, g_ent, ent if g_ent is not None else None, a.temperature,
        )  # fmt: skip
        for j, (x, ref) in enumerate(zip(extra, (e2d, c, bias), strict=True)):
            if need[j] and ref is not None:
                # (a 16-bit add computes in fp32 and rounds once: no fp32 [N, D] temporaries)
                grads[j] = x if grads[j] is None else grads[j] + x
    return (*grads, *(None,) * (len(FusedArgs._fields) - 3))


register_autograd(linear_ce_triton_fused, _fused_backward, _fused_setup_context)


def linear_ce_triton(
    e2d: torch.Tensor,
    c: torch.Tensor,
    bias: torch.Tensor | None,
    weight: torch.Tensor | None,
    rows: torch.Tensor | None,
    targets: torch.Tensor,
    ignore_index: int,
    reduction: str,
    softcap: float,
    label_smoothing: float,
    z_loss: float,
    filter_eps: float,
    need_de: bool,
    need_dc: bool,
    need_dbias: bool,
    tuning: Tuning,
    temperature: float = 1.0,
    entropy: bool = False,
    argmax: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(loss, lse, tgt, entropy, argmax): tgt each row's target logit (fp32, 0 at ignored rows;
    differentiable, for log-probabilities); entropy (differentiable) and argmax where asked for,
    else None. need_de / need_dc / need_dbias (what autograd will ask for) choose the backward
    (cce._dispatch.linear_backward): for the sparse one the forward also gathers the tile
    statistics (of the tempered logits, at any temperature); a gradient reaching the entropy is
    part of the sparse backward (after the fused forward it runs the exact one)."""
    N, (V, D) = targets.numel(), c.shape
    plan = plan_triton(
        tuning, reduction, e2d.dtype, (N, V, D), (need_de, need_dc, need_dbias), softcap, label_smoothing,
        filter_eps, c.is_cuda,
    )  # fmt: skip
    algo = plan.backward
    if algo == "fused":
        out = linear_ce_triton_fused(
            e2d, c, bias, weight, rows, targets, ignore_index, reduction, softcap, label_smoothing, z_loss,
            need_de, need_dc, need_dbias, plan.chunk_bytes, tuning.dz_slab_bytes,
            float(temperature), entropy, argmax,
        )  # fmt: skip
        return out[0], out[1], out[5], out[6] if entropy else None, out[7] if argmax else None
    stats = algo == "sparse"  # else "exact": no filter
    if not stats:
        filter_eps = 0.0
    out = linear_ce_triton_fwd(
        e2d, c, bias, weight, rows, targets, ignore_index, reduction, softcap, label_smoothing, z_loss,
        filter_eps, stats, stats and need_de, tuning.stats_chain_tiles, tuning.dz_slab_bytes,
        tuning.de_block_slots, tuning.dc_scratch_tiles, tuning.stash_move_bytes, tuning.dense_slabs,
        tuning.dense_kept, tuning.slab_error, tuning.slab_error_dc, tuning.dense_slab_bytes,
        tuning.first_order, tuning.host_gating, float(temperature), entropy, argmax,
    )  # fmt: skip
    return out[0], out[1], out[8], out[9] if entropy else None, out[10] if argmax else None
