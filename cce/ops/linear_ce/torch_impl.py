"""impl="torch": the custom ops and autograd over the chunked PyTorch algorithm (chunked.py).

With reduction "mean" or "sum" and no lse output the forward also computes the gradients for a
unit upstream gradient (``precompute``) and the backward only scales them. The ops are
``torch.library`` custom ops (arguments declared once, cce/_custom_ops.py), so that
``torch.compile`` treats them as opaque nodes (no graph break, nothing data-dependent traced).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ... import _math
from ..._custom_ops import define_op, register_autograd, register_fake
from .chunked import ChunkedProblem


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
    precompute: bool  # gradients for a unit upstream gradient, in the forward
    need_de: bool
    need_dc: bool
    need_dbias: bool
    chunk_bytes: int | None
    temperature: float  # the logits are softcap(e c^T + bias) / temperature
    want_entropy: bool  # the per-row entropy of the softmax (an output)
    want_argmax: bool  # the per-row argmax (an output)


def _problem(a, filter_eps: float, want_entropy: bool = False, want_argmax: bool = False) -> ChunkedProblem:
    return ChunkedProblem(
        a.e2d, a.c, a.bias, a.weight, a.rows, a.targets, a.ignore_index, a.softcap, a.label_smoothing,
        a.z_loss, filter_eps, a.chunk_bytes, a.temperature, want_entropy, want_argmax,
    )  # fmt: skip


def _empty(ref: torch.Tensor) -> torch.Tensor:
    return ref.new_empty(0)


@define_op(
    "cce::linear_ce_torch_fwd",
    FwdArgs,
    tuple[
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
    ],
)
def linear_ce_torch_fwd(a: FwdArgs):
    """(loss, lse, tgt, entropy, argmax, dE, dC, dbias): lse, the target logit and the entropy
    per row (0 at ignored rows), the argmax (int64); entropy and argmax only when asked for, the
    gradients (for a unit upstream gradient) only when ``precompute`` (else empty). The loss and
    the per-row outputs are in the accumulation dtype: fp32, float64 for float64 inputs (whose
    results then carry no fp32 rounding, as torch.autograd.gradcheck needs)."""
    pb = _problem(a, a.filter_eps, a.want_entropy, a.want_argmax)
    g = None
    if a.precompute:
        ones = torch.ones((), dtype=pb.acc, device=a.e2d.device)
        g = _math.row_upstream(ones, pb.w_t, a.reduction, pb.N)
    coef = None if g is None else pb.loss_coefficients(g, None)
    lse, tgt, ssum, dE, dC, dbias = pb.run(coef, None, a.need_de, a.need_dc, a.need_dbias)
    loss_tok = _math.token_loss(lse, tgt, ssum, pb.w_t, pb.W, pb.valid, pb.k)
    loss = _math.reduce_loss(loss_tok, pb.w_t, a.reduction)
    lse_out = torch.where(pb.valid, lse, 0.0)
    tgt_out = torch.where(pb.valid, tgt, 0.0)
    ent = _empty(lse_out) if pb.entropy is None else torch.where(pb.valid, pb.entropy, 0.0)
    amax = a.targets.new_empty(0) if pb.argmax is None else pb.argmax
    return (
        loss,
        lse_out,
        tgt_out,
        ent,
        amax,
        _empty(a.e2d) if dE is None else dE,
        _empty(a.c) if dC is None else dC,
        _empty(a.c) if dbias is None else dbias,
    )


def _fwd_fake(a: FwdArgs):
    N = a.targets.shape[0]
    acc = _math.acc_dtype(a.e2d.dtype)
    pre = a.precompute
    loss = a.e2d.new_empty((N,) if a.reduction == "none" else (), dtype=acc)
    lse = a.e2d.new_empty((N,), dtype=acc)
    tgt = a.e2d.new_empty((N,), dtype=acc)
    ent = a.e2d.new_empty((N,) if a.want_entropy else (0,), dtype=acc)
    amax = a.targets.new_empty((N,) if a.want_argmax else (0,), dtype=torch.int64)
    dE = a.e2d.new_empty(a.e2d.shape if (pre and a.need_de) else (0,), dtype=acc)
    dC = a.c.new_empty(a.c.shape if (pre and a.need_dc) else (0,), dtype=acc)
    db = a.c.new_empty((a.c.shape[0],) if (pre and a.need_dbias) else (0,), dtype=acc)
    return loss, lse, tgt, ent, amax, dE, dC, db


register_fake(linear_ce_torch_fwd, _fwd_fake)


class BwdArgs(NamedTuple):
    e2d: torch.Tensor
    c: torch.Tensor
    bias: torch.Tensor | None
    weight: torch.Tensor | None
    rows: torch.Tensor | None
    targets: torch.Tensor
    lse: torch.Tensor  # [N] saved by the forward (accumulation dtype)
    g: torch.Tensor  # [N] upstream gradient of each row's loss (accumulation dtype)
    h: torch.Tensor | None  # [N] upstream gradient of the lse output
    u: torch.Tensor | None  # [N] upstream gradient of the target logit output
    delta: torch.Tensor | None  # [N] upstream gradient of the entropy output
    entropy: torch.Tensor | None  # [N] the entropy (forward), needed with delta
    ignore_index: int
    softcap: float
    label_smoothing: float
    z_loss: float
    filter_eps: float
    need_de: bool
    need_dc: bool
    need_dbias: bool
    chunk_bytes: int | None
    temperature: float


@define_op("cce::linear_ce_torch_bwd", BwdArgs, tuple[torch.Tensor, torch.Tensor, torch.Tensor])
def linear_ce_torch_bwd(a: BwdArgs):
    """(dE, dC, dbias) in the accumulation dtype for per-row upstream g (loss), h (lse), u (target
    logit) and delta (entropy). The entropy's gradient is not of the filter's form (its term
    p z grows with the logit), so with delta the backward is exact."""
    pb = _problem(a, 0.0 if a.delta is not None else a.filter_eps)
    coef = pb.loss_coefficients(a.g, a.h, a.u, a.delta, a.entropy)
    _, _, _, dE, dC, dbias = pb.run(coef, a.lse.to(pb.acc), a.need_de, a.need_dc, a.need_dbias)
    return (
        _empty(a.e2d) if dE is None else dE,
        _empty(a.c) if dC is None else dC,
        _empty(a.c) if dbias is None else dbias,
    )


def _bwd_fake(a: BwdArgs):
    acc = _math.acc_dtype(a.e2d.dtype)
    dE = a.e2d.new_empty(a.e2d.shape if a.need_de else (0,), dtype=acc)
    dC = a.c.new_empty(a.c.shape if a.need_dc else (0,), dtype=acc)
    db = a.c.new_empty((a.c.shape[0],) if a.need_dbias else (0,), dtype=acc)
    return dE, dC, db


register_fake(linear_ce_torch_bwd, _bwd_fake)


def _setup_context(ctx, a: FwdArgs, output) -> None:
    loss, lse, tgt, ent, amax, dE, dC, db = output
    ctx.mark_non_differentiable(amax, dE, dC, db)
    # No zero-filled incoming gradients for the unused outputs: dC's would be a fresh V x D
    # tensor filled each backward. _backward handles None for every incoming gradient.
    ctx.set_materialize_grads(False)
    ctx.args = a._replace(e2d=None, c=None, bias=None, weight=None, rows=None, targets=None)
    ctx.dtypes = (a.e2d.dtype, a.c.dtype, None if a.bias is None else a.bias.dtype)
    # Precomputed gradients are kept on ctx, not saved tensors: backward scales them in place,
    # which would trip autograd's version check on saved tensors.
    ctx.pre = (dE, dC, db) if a.precompute else None
    ctx.save_for_backward(a.e2d, a.c, a.bias, a.weight, a.rows, a.targets, lse, ent)


def _backward(ctx, g_loss, g_lse, g_tgt, g_ent, _g_amax, _g_de, _g_dc, _g_db):
    a: FwdArgs = ctx.args
    e_dtype, c_dtype, b_dtype = ctx.dtypes
    acc = _math.acc_dtype(e_dtype)
    need_de, need_dc, need_db = ctx.needs_input_grad[:3]
    needs = (need_de, need_dc, need_db)
    rest = (None,) * (len(FwdArgs._fields) - 3)
    others = (g_lse, g_tgt, g_ent)
    covered = a.precompute and all(
        d or not need for d, need in zip((a.need_de, a.need_dc, a.need_dbias), needs, strict=True)
    )
    if covered and all(x is None for x in others):
        # The gradients for a unit upstream gradient come from the forward: scaled in place (no
        # second copy). They are spent by the first backward; a second one through a retained
        # graph runs the forward's pass again, whose operations and summation order are the
        # same, so that every backward gives the same gradients bit for bit (a recomputation
        # from the saved lse, below, rounds differently: ~1e-7 relative in fp32).
        if g_loss is None:
            return (None, None, None, *rest)
        pre, ctx.pre = ctx.pre, None
        if pre is None:
            e2d, c, bias, weight, rows, targets, _, _ = ctx.saved_tensors
            full = a._replace(e2d=e2d, c=c, bias=bias, weight=weight, rows=rows, targets=targets)
            pre = linear_ce_torch_fwd(*full)[5:]
        dE, dC, db = pre
        s = g_loss.to(acc)

        # (No shortcut for s == 1: this backward is traced under torch.compile, where a Python
        # branch on a tensor's value is a data-dependent guard.)
        def scale(t, dtype, need):
            return t.mul_(s).to(dtype) if need else None

        return (scale(dE, e_dtype, need_de), scale(dC, c_dtype, need_dc), scale(db, b_dtype, need_db), *rest)
    e2d, c, bias, weight, rows, targets, lse, ent = ctx.saved_tensors
    valid = targets != a.ignore_index
    w_t = _math.target_weight(weight, targets, valid, acc)
    N = targets.numel()
    if g_loss is None:
        g = torch.zeros(N, dtype=acc, device=targets.device)
    else:
        g = _math.row_upstream(g_loss, w_t, a.reduction, N)
    need_db = need_db and bias is not None
    dE, dC, db = linear_ce_torch_bwd(
        e2d, c, bias, weight, rows, targets, lse, g.contiguous(), g_lse, g_tgt, g_ent,
        ent if g_ent is not None else None, a.ignore_index, a.softcap, a.label_smoothing, a.z_loss,
        a.filter_eps, need_de, need_dc, need_db, a.chunk_bytes, a.temperature,
    )  # fmt: skip
    return (
        dE.to(e_dtype) if need_de else None,
        dC.to(c_dtype) if need_dc else None,
        db.to(b_dtype) if need_db else None,
        *rest,
    )


register_autograd(linear_ce_torch_fwd, _backward, _setup_context)
