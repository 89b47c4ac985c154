"""The oracle: materialized logits in fp32 (or fp64) + ``F.cross_entropy``.

Tests and benchmarks compare every implementation with these functions. They allocate the full
N x V logits, so they are only for checking, never for training at scale.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .outputs import LossOutputs


def _softcap(logits: torch.Tensor, softcap: float | None) -> torch.Tensor:
    if softcap is None:
        return logits
    return softcap * torch.tanh(logits / softcap)


def cross_entropy_reference(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    shift: bool = False,
    softcap: float | None = None,
    label_smoothing: float = 0.0,
    weight: torch.Tensor | None = None,
    z_loss: float = 0.0,
    return_lse: bool = False,
    temperature: float = 1.0,
    return_logprobs: bool = False,
    return_entropy: bool = False,
    return_argmax: bool = False,
    return_accuracy: bool = False,
    dtype: torch.dtype = torch.float32,
):
    """``F.cross_entropy(softcap(logits) / temperature, targets)`` in ``dtype`` with cce's conventions.

    Conventions (the deliberate differences from torch): the result is in ``dtype``; "mean" over
    an all-ignored batch is 0 (not NaN); "none" is shaped like ``targets`` (``targets[..., 1:]``
    with ``shift``) and 0 at ignored positions; ``z_loss * lse**2`` is added to each valid token's
    loss; the returned lse is 0 at ignored positions. With any ``return_logprobs``,
    ``return_entropy``, ``return_argmax`` or ``return_accuracy`` the result is a
    :class:`cce.LossOutputs` (the conventions of its fields are documented there).
    """
    L = _softcap(logits.to(dtype), softcap) / temperature
    if shift:
        L = L[..., :-1, :]
        targets = targets[..., 1:]
    out_shape = targets.shape
    V = L.shape[-1]
    L = L.reshape(-1, V)
    t = targets.reshape(-1).long()
    valid = t != ignore_index
    w = None if weight is None else weight.to(dtype)
    ce = F.cross_entropy(
        L, t, weight=w, ignore_index=ignore_index, reduction="none", label_smoothing=label_smoothing
    )
    lse = torch.where(valid, torch.logsumexp(L, dim=-1), 0.0)
    tok = torch.where(valid, ce + z_loss * lse * lse, 0.0)
    if reduction == "none":
        loss = tok.reshape(out_shape)
    elif reduction == "sum":
        loss = tok.sum()
    else:
        if w is None:
            den = valid.sum().to(dtype)
        else:
            den = torch.where(valid, w[torch.where(valid, t, 0)], 0.0).sum()
        loss = tok.sum() / torch.where(den != 0, den, torch.ones_like(den))
    if not (return_logprobs or return_entropy or return_argmax or return_accuracy):
        return (loss, lse.reshape(out_shape)) if return_lse else loss
    safe = torch.where(valid, t, 0)
    logp = F.log_softmax(L, dim=-1)
    out = {"loss": loss}
    if return_lse:
        out["lse"] = lse.reshape(out_shape)
    if return_logprobs:
        out["logprobs"] = torch.where(valid, logp.gather(1, safe[:, None]).squeeze(1), 0.0).reshape(out_shape)
    if return_entropy:
        # -p log p, 0 where p = 0 (a -inf logit), its gradient too (entr's is NaN there)
        p = logp.exp()
        ent = -(p * logp.masked_fill(p == 0, 0.0)).sum(-1)
        out["entropy"] = torch.where(valid, ent, 0.0).reshape(out_shape)
    amax = torch.where(valid, L.argmax(dim=-1), -1)
    if return_argmax:
        out["argmax"] = amax.reshape(out_shape)
    if return_accuracy:
        hits = (valid & (amax == t)).sum().to(torch.float32)
        out["accuracy"] = hits / valid.sum().clamp(min=1).to(torch.float32)
    return LossOutputs(**out)


def linear_cross_entropy_reference(
    e: torch.Tensor,
    c: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    **options,
):
    """``F.cross_entropy(softcap(e @ c.T + bias), targets, ...)`` with logits materialized in ``dtype``.

    Takes the same keyword options as :func:`cce.linear_cross_entropy` (``filter_eps`` and ``impl``
    are accepted and ignored: the oracle is always exact).
    """
    options.pop("filter_eps", None)
    options.pop("impl", None)
    logits = e.to(dtype) @ c.to(dtype).T
    if bias is not None:
        logits = logits + bias.to(dtype)
    return cross_entropy_reference(logits, targets, dtype=dtype, **options)
