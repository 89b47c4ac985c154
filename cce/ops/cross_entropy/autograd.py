"""The logits-level ops, declared once for both implementations.

Both implementations reduce each row of logits to per-row statistics (lse, target logit, ssum) in
the forward and write ``dL = (alpha p - beta [v == t] - gamma w) * softcap'`` in the backward; the
loss and the coefficients come from :mod:`cce._math`. Only the two row passes differ, so
:func:`define_ce_ops` turns an implementation's pair of row passes into its three custom ops
(forward; backward into a new tensor; backward into the logits buffer) with their autograd.

Targets reaching these ops are flat ``[N]`` over the rows of logits ``(..., V)`` (a causal shift
has already been turned into shifted targets, with the last position of each sequence ignored).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from ... import _math
from ..._custom_ops import define_op, register_autograd, register_fake


class FwdArgs(NamedTuple):
    logits: torch.Tensor  # (..., V)
    targets: torch.Tensor  # [N] int64
    weight: torch.Tensor | None  # class weights [V]
    ignore_index: int
    reduction: str
    softcap: float  # 0: none
    label_smoothing: float
    z_loss: float
    inplace: bool  # the backward writes the gradient into the logits
    precompute: bool  # the row coefficients for a unit upstream gradient, in the forward
    chunk_bytes: int | None  # impl="torch": bytes of chunk temporaries (None: its default)
    temperature: float  # the logits are softcap(logits) / temperature
    want_entropy: bool  # the per-row entropy of the softmax, an output
    want_argmax: bool  # the per-row argmax, an output


class BwdArgs(NamedTuple):
    logits: torch.Tensor
    targets: torch.Tensor
    weight: torch.Tensor | None
    lse: torch.Tensor  # [N] accumulation dtype (fp32; float64 for float64 logits)
    alpha: torch.Tensor  # [N] row coefficients (cce._math.coefficients), same dtype
    beta: torch.Tensor
    gamma: torch.Tensor
    scale: torch.Tensor | None  # 0-d, multiplying alpha, beta, gamma (the upstream gradient)
    ignore_index: int
    softcap: float
    smoothing: bool
    chunk_bytes: int | None
    eta: torch.Tensor | None  # [N] coefficient of the entropy's term p z
    temperature: float


def _row_consts(targets, weight, ignore_index, V, label_smoothing, z_loss, acc):
    valid = targets != ignore_index
    w_t = _math.target_weight(weight, targets, valid, acc)
    W = _math.weight_total(weight, V, targets.device, acc)
    k = _math.LossConsts(float(label_smoothing), float(z_loss), V)
    return valid, w_t, W, k


def _finish_forward(a: FwdArgs, lse, tgt, ssum, entropy, argmax):
    """(loss, lse, tgt, entropy, argmax, alpha, beta, gamma) in the accumulation dtype (fp32;
    float64 for float64 logits, so that their results carry no fp32 rounding; argmax int64) from
    the per-row statistics; lse, tgt and entropy are 0 at ignored rows, entropy and argmax empty
    unless asked for.

    With ``precompute`` (reduction "mean" / "sum", no lse output), the row coefficients for a unit
    upstream gradient are computed here, while the forward kernel still runs on the device: the
    coefficients are linear in the upstream gradient, so the backward only scales them by it
    (inside the kernel) and issues no other op. Otherwise alpha / beta / gamma are empty.
    """
    V = a.logits.shape[-1]
    acc = _math.acc_dtype(a.logits.dtype)
    valid, w_t, W, k = _row_consts(a.targets, a.weight, a.ignore_index, V, a.label_smoothing, a.z_loss, acc)
    lse = torch.where(valid, lse.to(acc), 0.0)
    tgt = torch.where(valid, tgt.to(acc), 0.0)
    tok = _math.token_loss(lse, tgt, None if ssum is None else ssum.to(acc), w_t, W, valid, k)
    loss = _math.reduce_loss(tok, w_t, a.reduction)
    entropy = lse.new_empty(0) if entropy is None else torch.where(valid, entropy.to(acc), 0.0)
    argmax = a.targets.new_empty(0) if argmax is None else argmax
    if a.precompute:
        ones = torch.ones((), dtype=acc, device=lse.device)
        g = _math.row_upstream(ones, w_t, a.reduction, a.targets.numel())
        alpha, beta, gamma = (x / a.temperature for x in _math.coefficients(g, None, lse, w_t, W, valid, k))
    else:
        alpha, beta, gamma = (lse.new_empty(0) for _ in range(3))  # distinct: outputs may not alias
    return loss, lse, tgt, entropy, argmax, alpha, beta, gamma


def _fake_forward(a: FwdArgs):
    N = a.targets.shape[0]
    acc = _math.acc_dtype(a.logits.dtype)
    loss = a.logits.new_empty((N,) if a.reduction == "none" else (), dtype=acc)
    coef = [a.logits.new_empty((N,) if a.precompute else (0,), dtype=acc) for _ in range(3)]
    stats = [a.logits.new_empty((N,), dtype=acc) for _ in range(2)]
    entropy = a.logits.new_empty((N,) if a.want_entropy else (0,), dtype=acc)
    argmax = a.targets.new_empty((N,) if a.want_argmax else (0,), dtype=torch.int64)
    return (loss, *stats, entropy, argmax, *coef)


def define_ce_ops(name: str, stats: Callable, grad: Callable):
    """The custom ops ``cce::ce_{name}_fwd``, ``_bwd`` and ``_bwd_`` (in place) with autograd.

    ``stats(a: FwdArgs) -> (lse, tgt, ssum, entropy, argmax)`` per row (None where not computed);
    ``grad(a: BwdArgs, inplace)`` returns dloss/dlogits in the logits' dtype, written into
    ``a.logits`` when ``inplace``. Returns the forward op:
    ``(loss, lse, tgt, entropy, argmax, alpha, beta, gamma)``.
    """
    out8 = tuple[(torch.Tensor,) * 8]

    @define_op(f"cce::ce_{name}_fwd", FwdArgs, out8)
    def fwd(a: FwdArgs):
        return _finish_forward(a, *stats(a))

    register_fake(fwd, _fake_forward)

    @define_op(f"cce::ce_{name}_bwd", BwdArgs, torch.Tensor)
    def bwd(a: BwdArgs):
        return grad(a, False)

    register_fake(bwd, lambda a: torch.empty_like(a.logits, memory_format=torch.contiguous_format))

    @define_op(f"cce::ce_{name}_bwd_", BwdArgs, None, mutates_args=("logits",))
    def bwd_inplace(a: BwdArgs):
        grad(a, True)

    def setup_context(ctx, a: FwdArgs, output):
        _, lse, _tgt, entropy, argmax, alpha, beta, gamma = output
        ctx.mark_non_differentiable(argmax, alpha, beta, gamma)
        # Outputs nobody used (tgt, entropy, lse) get None, not zero-filled gradients.
        ctx.set_materialize_grads(False)
        ctx.args = a._replace(logits=None, targets=None, weight=None)
        ctx.V = a.logits.shape[-1]
        ctx.acc = _math.acc_dtype(a.logits.dtype)
        ctx.save_for_backward(a.logits, a.targets, a.weight, lse, entropy, alpha, beta, gamma)

    def backward(ctx, g_loss, g_lse, g_tgt, g_ent, _g_amax, _ga, _gb, _gc):
        a: FwdArgs = ctx.args
        logits, targets, weight, lse, entropy, alpha, beta, gamma = ctx.saved_tensors
        none = (None,) * len(FwdArgs._fields)
        if not ctx.needs_input_grad[0]:
            return none
        eta = None
        if a.precompute:  # unit-upstream coefficients from the forward, scaled in the kernel
            # (precompute is off whenever an output other than the loss can carry a gradient)
            if g_loss is None:
                return none
            scale = g_loss.to(ctx.acc)
            smoothing = a.label_smoothing > 0
        else:
            valid, w_t, W, k = _row_consts(
                targets, weight, a.ignore_index, ctx.V, a.label_smoothing, a.z_loss, ctx.acc
            )
            N = targets.numel()
            if g_loss is None:
                g = torch.zeros(N, dtype=ctx.acc, device=targets.device)
            else:
                g = _math.row_upstream(g_loss, w_t, a.reduction, N)
            alpha, beta, gamma = _math.coefficients(g, g_lse, lse, w_t, W, valid, k)
            if g_tgt is not None or g_ent is not None:
                ent = entropy if g_ent is not None else None
                alpha, beta, eta = _math.output_coefficients(alpha, beta, g_tgt, g_ent, lse, ent, valid)
            if a.temperature != 1.0:  # the chain rule's 1 / temperature
                alpha, beta, gamma = (x / a.temperature for x in (alpha, beta, gamma))
                eta = None if eta is None else eta / a.temperature
            scale = None
            smoothing = k.smoothing
        args = (
            logits, targets, weight, lse, alpha, beta, gamma, scale, a.ignore_index, a.softcap, smoothing,
            a.chunk_bytes, eta, a.temperature,
        )  # fmt: skip
        if a.inplace:
            bwd_inplace(*args)
            grad_logits = logits
        else:
            grad_logits = bwd(*args)
        return (grad_logits, *none[1:])

    register_autograd(fwd, backward, setup_context)
    return fwd
