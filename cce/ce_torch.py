"""impl="torch" for the logits-level cross entropy, and the autograd glue shared with impl="triton".

Both implementations reduce each row of logits to per-row statistics (lse, target logit, ssum) in the
forward and write ``dL = (alpha p - beta [v == t] - gamma w) * softcap'`` in the backward; the loss
and the coefficients come from :mod:`cce._math`. Only the two row passes differ, so each
implementation registers three ``torch.library.custom_op``s (forward; backward into a new tensor;
backward into the logits buffer) and :func:`register_ce_autograd` wires them together.

Here the row passes are chunked PyTorch: at most ``CHUNK_BYTES`` of fp32 temporaries at a time, so
the working memory beyond the gradient stays bounded for any N x V. They run on any device.

Targets reaching these ops are flat ``[N]`` over the rows of logits ``(..., V)`` (a causal shift has
already been turned into shifted targets, with the last position of each sequence ignored).
"""

from __future__ import annotations

import torch

from . import _math

# Bytes of fp32 chunk temporaries (upcast logits, probabilities, tanh) allowed at once.
CHUNK_BYTES = 64 << 20


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# ----------------------------------------------------------------------------------------------
# Shared glue: loss from statistics, coefficients from upstream gradients (all via cce._math)


def _row_consts(targets, weight, ignore_index, V, label_smoothing, z_loss):
    valid = targets != ignore_index
    w_t = _math.target_weight(weight, targets, valid)
    W = _math.weight_total(weight, V, targets.device)
    k = _math.LossConsts(float(label_smoothing), float(z_loss), V)
    return valid, w_t, W, k


def finish_forward(
    lse, tgt, ssum, targets, weight, ignore_index, reduction, V, label_smoothing, z_loss, precompute
):
    """(loss, lse, alpha, beta, gamma) in fp32 from the per-row statistics; lse is 0 at ignored rows.

    With ``precompute`` (reduction "mean" / "sum", no lse output), the row coefficients for a unit
    upstream gradient are computed here, while the forward kernel still runs on the device: the
    coefficients are linear in the upstream gradient, so the backward only scales them by it
    (inside the kernel) and issues no other op. Otherwise alpha / beta / gamma are empty.
    """
    valid, w_t, W, k = _row_consts(targets, weight, ignore_index, V, label_smoothing, z_loss)
    lse = torch.where(valid, lse.float(), 0.0)
    tok = _math.token_loss(lse, tgt.float(), None if ssum is None else ssum.float(), w_t, W, valid, k)
    loss = _math.reduce_loss(tok, w_t, reduction)
    if precompute:
        ones = torch.ones((), dtype=torch.float32, device=lse.device)
        g = _math.row_upstream(ones, w_t, reduction, targets.numel())
        alpha, beta, gamma = _math.coefficients(g, None, lse, w_t, W, valid, k)
    else:
        alpha, beta, gamma = (lse.new_empty(0) for _ in range(3))  # distinct: outputs may not alias
    return loss, lse, alpha, beta, gamma


def fake_forward(logits, targets, reduction, precompute):
    N = targets.shape[0]
    loss = logits.new_empty((N,) if reduction == "none" else (), dtype=torch.float32)
    coef = [logits.new_empty((N,) if precompute else (0,), dtype=torch.float32) for _ in range(3)]
    return (loss, logits.new_empty((N,), dtype=torch.float32), *coef)


def register_ce_autograd(fwd_op, bwd_op, bwd_inplace_op) -> None:
    """Autograd for a forward op ``(logits, targets, weight, ignore_index, reduction, softcap,
    label_smoothing, z_loss, inplace, precompute) -> (loss, lse, alpha, beta, gamma)`` whose
    backward is ``bwd_op`` (returns the gradient) or ``bwd_inplace_op`` (writes it into logits),
    both called as ``(logits, targets, weight, lse, alpha, beta, gamma, scale, ignore_index, softcap,
    smoothing)``; ``scale`` (a 0-d tensor or None) multiplies alpha, beta and gamma."""

    def setup_context(ctx, inputs, output):
        logits, targets, weight, ignore_index, reduction, softcap, ls, z_loss, inplace, precompute = inputs
        _, lse, alpha, beta, gamma = output
        ctx.mark_non_differentiable(alpha, beta, gamma)
        ctx.opts = (ignore_index, reduction, softcap, ls, z_loss, inplace, precompute, logits.shape[-1])
        ctx.save_for_backward(logits, targets, weight, lse, alpha, beta, gamma)

    def backward(ctx, g_loss, g_lse, _ga, _gb, _gc):
        ignore_index, reduction, softcap, ls, z_loss, inplace, precompute, V = ctx.opts
        logits, targets, weight, lse, alpha, beta, gamma = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return (None,) * 10
        if precompute:  # unit-upstream coefficients from the forward, scaled in the kernel
            if g_loss is None:
                return (None,) * 10
            scale = g_loss.float()
            smoothing = ls > 0
        else:
            valid, w_t, W, k = _row_consts(targets, weight, ignore_index, V, ls, z_loss)
            N = targets.numel()
            if g_loss is None:
                g = torch.zeros(N, dtype=torch.float32, device=targets.device)
            else:
                g = _math.row_upstream(g_loss, w_t, reduction, N)
            alpha, beta, gamma = _math.coefficients(g, g_lse, lse, w_t, W, valid, k)
            scale = None
            smoothing = k.smoothing
        args = (logits, targets, weight, lse, alpha, beta, gamma, scale, ignore_index, softcap, smoothing)
        if inplace:
            bwd_inplace_op(*args)
            grad = logits
        else:
            grad = bwd_op(*args)
        return (grad,) + (None,) * 9

    fwd_op.register_autograd(backward, setup_context=setup_context)


# ----------------------------------------------------------------------------------------------
# impl="torch": chunked row passes


def _rows(logits: torch.Tensor) -> torch.Tensor:
    """(N, V) view of logits (a copy only when the leading dims cannot be flattened)."""
    return logits.reshape(-1, logits.shape[-1])


def _chunk_rows(V: int, acc: torch.dtype, temporaries: int) -> int:
    per_row = V * torch.finfo(acc).bits // 8 * temporaries
    return max(1, CHUNK_BYTES // max(per_row, 1))


def _softcapped(x: torch.Tensor, softcap: float):
    """(L, th) with L = softcap * tanh(x / softcap), th = tanh(x / softcap) (None without softcap)."""
    if softcap > 0:
        th = torch.tanh(x / softcap)
        return th * softcap, th
    return x, None


def torch_stats(logits, targets, weight, ignore_index, softcap, smoothing):
    """Per-row (lse, tgt, ssum or None) in the accumulation dtype, chunk by chunk."""
    V = logits.shape[-1]
    x2 = _rows(logits)
    N = x2.shape[0]
    acc = _acc_dtype(logits.dtype)
    dev = logits.device
    lse = torch.zeros(N, dtype=acc, device=dev)
    tgt = torch.zeros(N, dtype=acc, device=dev)
    ssum = torch.zeros(N, dtype=acc, device=dev) if smoothing else None
    safe_t = torch.where(targets != ignore_index, targets, torch.zeros_like(targets))
    w = None if weight is None else weight.to(acc)
    step = _chunk_rows(V, acc, 3 if softcap > 0 else 2)
    for s in range(0, N, step):
        e = min(s + step, N)
        L, _ = _softcapped(x2[s:e].to(acc), softcap)
        tgt[s:e] = L.gather(1, safe_t[s:e, None]).squeeze(1)
        if smoothing:
            ssum[s:e] = L.sum(1) if w is None else L @ w
        lse[s:e] = torch.logsumexp(L, dim=1)
    return lse, tgt, ssum


def torch_grad(
    logits, targets, weight, lse, alpha, beta, gamma, scale, ignore_index, softcap, smoothing, out
):
    """Writes dloss/dlogits into ``out`` ((..., V), logits' dtype; may be logits itself)."""
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
    acc = _acc_dtype(logits.dtype)
    valid = targets != ignore_index
    safe_t = torch.where(valid, targets, torch.zeros_like(targets))
    w = None
    if smoothing:
        w = torch.ones(V, dtype=acc, device=logits.device) if weight is None else weight.to(acc)
    step = _chunk_rows(V, acc, 3 if softcap > 0 else 2)
    for s in range(0, N, step):
        e = min(s + step, N)
        L, th = _softcapped(x2[s:e].to(acc, copy=True), softcap)  # a copy: d is built in place
        d = L.sub_(lse[s:e, None].to(acc)).exp_().mul_(alpha[s:e, None].to(acc))  # alpha p
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


@torch.library.custom_op("cce::ce_torch_fwd", mutates_args=())
def ce_torch_fwd(
    logits: torch.Tensor,
    targets: torch.Tensor,
    weight: torch.Tensor | None,
    ignore_index: int,
    reduction: str,
    softcap: float,
    label_smoothing: float,
    z_loss: float,
    inplace: bool,
    precompute: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, lse, alpha, beta, gamma) of logits (..., V) against flat targets [N] (see
    :func:`finish_forward`); ``inplace`` only affects the backward."""
    smoothing = label_smoothing > 0
    lse, tgt, ssum = torch_stats(logits, targets, weight, ignore_index, softcap, smoothing)
    V = logits.shape[-1]
    return finish_forward(
        lse, tgt, ssum, targets, weight, ignore_index, reduction, V, label_smoothing, z_loss, precompute
    )


@ce_torch_fwd.register_fake
def _(
    logits, targets, weight, ignore_index, reduction, softcap, label_smoothing, z_loss, inplace, precompute
):
    return fake_forward(logits, targets, reduction, precompute)


@torch.library.custom_op("cce::ce_torch_bwd", mutates_args=())
def ce_torch_bwd(
    logits: torch.Tensor,
    targets: torch.Tensor,
    weight: torch.Tensor | None,
    lse: torch.Tensor,
    alpha: torch.Tensor,
    beta: torch.Tensor,
    gamma: torch.Tensor,
    scale: torch.Tensor | None,
    ignore_index: int,
    softcap: float,
    smoothing: bool,
) -> torch.Tensor:
    out = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    return torch_grad(
        logits, targets, weight, lse, alpha, beta, gamma, scale, ignore_index, softcap, smoothing, out
    )


@ce_torch_bwd.register_fake
def _(logits, targets, weight, lse, alpha, beta, gamma, scale, ignore_index, softcap, smoothing):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


@torch.library.custom_op("cce::ce_torch_bwd_", mutates_args=("logits",))
def ce_torch_bwd_(
    logits: torch.Tensor,
    targets: torch.Tensor,
    weight: torch.Tensor | None,
    lse: torch.Tensor,
    alpha: torch.Tensor,
    beta: torch.Tensor,
    gamma: torch.Tensor,
    scale: torch.Tensor | None,
    ignore_index: int,
    softcap: float,
    smoothing: bool,
) -> None:
    torch_grad(
        logits, targets, weight, lse, alpha, beta, gamma, scale, ignore_index, softcap, smoothing, logits
    )


register_ce_autograd(ce_torch_fwd, ce_torch_bwd, ce_torch_bwd_)
