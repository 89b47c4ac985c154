"""The loss as a function of per-token statistics, and its gradient with respect to the logits.

Every implementation (PyTorch chunks, Triton kernels, vocabulary-parallel ranks, logits-level)
reduces a token's logits ``L_i`` (after bias and softcap, in fp32; in float64 for float64 inputs
of the PyTorch implementations) to three numbers:

    lse_i  = logsumexp_v L_iv
    tgt_i  = L_{i, t_i}
    ssum_i = sum_v w_v L_iv          (w = class weights, or ones; only needed for label smoothing)

and everything the options add is a function of those, computed here in O(N):

    loss_i = (1 - ls) w_t (lse_i - tgt_i) + (ls / V) (W lse_i - ssum_i) + z lse_i^2,   W = sum_v w_v

which is ``F.cross_entropy(L, t, weight=w, label_smoothing=ls, reduction="none")`` plus the z-loss.
Its gradient with respect to the logits has the form

    dloss / dL_iv = alpha_i p_iv - beta_i [v == t_i] - gamma_i w_v,     p = softmax(L_i)

with, for an upstream gradient ``g_i`` on loss_i and ``h_i`` on lse_i (return_lse=True):

    alpha_i = g_i ((1 - ls) w_t + ls W / V + 2 z lse_i) + h_i
    beta_i  = g_i (1 - ls) w_t
    gamma_i = g_i ls / V

Kernels only ever see (alpha, beta, gamma): they never need to know which options produced them.

Per-token outputs (cce.LossOutputs) add two terms. The target's log-probability tgt_i - lse_i
is differentiable through lse (h above) and tgt, whose gradient u_i enters as beta_i -= u_i.
The entropy H_i = lse_i - sum_v p_iv L_iv has dH_i / dL_iv = p_iv (lse_i - H_i - L_iv): for an
upstream gradient delta_i, alpha_i += delta_i (lse_i - H_i) and a term eta_i p_iv L_iv with
eta_i = -delta_i, the one term that is not of the form above (output_coefficients). With a
temperature T (logits softcap(x) / T) every coefficient is divided by T: the chain rule's factor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The accumulation dtype of the PyTorch implementations: float64 for float64 inputs, else fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass(frozen=True)
class LossConsts:
    """The scalar options that enter the loss formula."""

    label_smoothing: float
    z_loss: float
    num_classes: int

    @property
    def smoothing(self) -> bool:
        return self.label_smoothing > 0.0


def target_weight(
    weight: torch.Tensor | None,
    targets: torch.Tensor,
    valid: torch.Tensor,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """w_{t_i} for valid rows, 0 for ignored ones, in ``dtype`` (the accumulation dtype: the
    row quantities derived from it, g and the coefficients, follow its dtype)."""
    if weight is None:
        return valid.to(dtype)
    safe = torch.where(valid, targets, torch.zeros_like(targets))
    return torch.where(valid, weight.to(dtype)[safe], 0.0)


def weight_total(
    weight: torch.Tensor | None, V: int, device: torch.device, dtype: torch.dtype = torch.float32
) -> torch.Tensor | float:
    """W = sum_v w_v (V without class weights), in ``dtype``."""
    return float(V) if weight is None else weight.to(dtype).sum()


def mean_denominator(w_t: torch.Tensor) -> torch.Tensor:
    """The 'mean' divisor: number of valid tokens (sum of their class weights with weights).

    An all-ignored (or empty) batch divides by 1 instead of 0, so its loss and gradients are 0.
    """
    den = w_t.sum()
    return torch.where(den != 0, den, 1.0)


def token_loss(
    lse: torch.Tensor,
    tgt: torch.Tensor,
    ssum: torch.Tensor | None,
    w_t: torch.Tensor,
    W: torch.Tensor | float,
    valid: torch.Tensor,
    k: LossConsts,
) -> torch.Tensor:
    """Per-token loss from the statistics (0 at ignored positions)."""
    ls = k.label_smoothing
    loss = w_t * (lse - tgt)
    if ls:
        loss = (1.0 - ls) * loss
    if k.smoothing:
        loss = loss + (ls / k.num_classes) * (W * lse - ssum)
    if k.z_loss:
        loss = loss + k.z_loss * lse * lse
    return torch.where(valid, loss, 0.0)


def reduce_loss(
    loss_tok: torch.Tensor, w_t: torch.Tensor, reduction: str, den: torch.Tensor | None = None
) -> torch.Tensor:
    """The reduced loss; ``den``: mean_denominator(w_t) if the caller has it already."""
    if reduction == "none":
        return loss_tok
    total = loss_tok.sum()
    if reduction == "sum":
        return total
    return total / (mean_denominator(w_t) if den is None else den)


def nan_at_bad_targets(x: torch.Tensor, bad: torch.Tensor | None) -> torch.Tensor:
    """``x`` made NaN where a target was bad (outside [0, V), not ignore_index; the mask of
    cce._validation.guard_targets, over the problem's rows), ``x`` itself for ``bad`` None.

    ``x`` per row (as many entries as ``bad``: the loss with reduction "none", the target logit
    behind the log-probabilities): NaN at the bad rows only. ``x`` 0-d (a reduced loss, the
    accuracy): NaN if any row is bad. Formed as ``x * f`` with f = 1 or NaN: exact where f = 1, and
    the NaN also multiplies the upstream gradient through x, so the gradients of a bad row (of
    every row, for a reduced loss) are NaN as well: neither the loss nor a step taken from it is
    finite. Device ops only: ``bad.any()`` stays a device tensor, nothing is read on the host.
    """
    if bad is None:
        return x
    flag = bad.any() if x.dim() == 0 else bad.reshape(x.shape)
    return x * torch.where(flag, float("nan"), 1.0)


def row_upstream(
    grad_loss: torch.Tensor | None, w_t: torch.Tensor, reduction: str, n: int, den: torch.Tensor | None = None
) -> torch.Tensor | float:
    """g_i: the gradient reaching each token's loss from the reduced loss' gradient, in w_t's
    dtype. ``grad_loss`` None: an upstream gradient of 1 ("mean" / "sum"; a scalar, for the fused
    forward: 1 / den, or 1.0). ``den``: mean_denominator(w_t) if the caller has it already."""
    if reduction == "none":
        return grad_loss.to(w_t.dtype)
    if reduction == "mean":
        den = mean_denominator(w_t) if den is None else den
        return den.reciprocal() if grad_loss is None else grad_loss.to(w_t.dtype).expand(n) / den
    return 1.0 if grad_loss is None else grad_loss.to(w_t.dtype).expand(n)


def affine_coefficients(
    g: torch.Tensor | float,
    w_t: torch.Tensor,
    W: torch.Tensor | float,
    valid: torch.Tensor,
    k: LossConsts,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """(a0, a1, beta, gamma) per row with alpha = a0 + a1 lse (no lse gradient h): for kernels
    that compute lse themselves. a1 is None without z-loss, gamma None without label smoothing;
    all zero at ignored rows. Without smoothing a0 is beta (the same tensor)."""
    ls = k.label_smoothing
    g = torch.where(valid, g, 0.0).to(w_t.dtype)
    beta = (g * w_t if not ls else g * ((1.0 - ls) * w_t)).contiguous()
    a0, gamma = beta, None
    if k.smoothing:
        a0 = (g * ((1.0 - ls) * w_t + ls * W / k.num_classes)).contiguous()
        gamma = (g * (ls / k.num_classes)).contiguous()
    a1 = (g * (2.0 * k.z_loss)).contiguous() if k.z_loss else None
    return a0, a1, beta, gamma


def coefficients(
    g: torch.Tensor,
    h: torch.Tensor | None,
    lse: torch.Tensor,
    w_t: torch.Tensor,
    W: torch.Tensor | float,
    valid: torch.Tensor,
    k: LossConsts,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(alpha, beta, gamma) per row in w_t's dtype; all zero at ignored rows (three distinct
    tensors)."""
    alpha, a1, beta, gamma = affine_coefficients(g, w_t, W, valid, k)
    if a1 is not None:
        alpha = alpha + a1 * lse
    if h is not None:
        alpha = alpha + torch.where(valid, h.to(alpha.dtype), 0.0)
    if alpha is beta:
        alpha = alpha.clone()
    if gamma is None:
        gamma = torch.zeros_like(beta)
    return alpha.contiguous(), beta, gamma


def output_coefficients(
    alpha: torch.Tensor,
    beta: torch.Tensor,
    u: torch.Tensor | None,
    delta: torch.Tensor | None,
    lse: torch.Tensor,
    entropy: torch.Tensor | None,
    valid: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(alpha, beta, eta) with the gradients of the per-token outputs added: u on the target
    logit, delta on the entropy (``entropy``: its forward values). eta (the coefficient of
    p_iv L_iv) is None without delta; ignored rows get nothing (their outputs are constants)."""
    if u is not None:
        beta = beta - torch.where(valid, u.to(beta.dtype), 0.0)
    eta = None
    if delta is not None:
        d = torch.where(valid, delta.to(alpha.dtype), 0.0)
        alpha = alpha + d * (lse - entropy.to(alpha.dtype))
        eta = -d
    return alpha, beta, eta


def mean_logit(L: torch.Tensor) -> torch.Tensor:
    """[rows] E_p[L] = sum_v p_v L_v with p = softmax(L) per row of a chunk of logits, a class of
    probability 0 adding 0 (0 log 0 = 0 in the entropy lse - E_p[L]: a -inf logit, a masked class,
    gives 0, not 0 * -inf = NaN). One chunk-sized temporary besides a bool mask."""
    p = torch.softmax(L, 1)
    zero = p == 0
    return p.mul_(L).masked_fill_(zero, 0.0).sum(1)


def entropy_dlogits_(
    L: torch.Tensor, p: torch.Tensor, alpha: torch.Tensor, eta: torch.Tensor
) -> torch.Tensor:
    """p (alpha + eta L) per row (alpha, eta: [rows]) written into L, 0 where p = 0 (so a -inf
    logit gets no gradient, not NaN): the softmax and entropy terms of the logit gradient."""
    zero = p == 0
    return L.mul_(eta[:, None]).add_(alpha[:, None]).mul_(p).masked_fill_(zero, 0.0)
