"""What a loss call returns when it asks for per-token outputs besides the loss.

Every implementation reduces a token's logits to per-row statistics (cce/_math.py): lse, the
target logit and, where asked for, the entropy of the softmax and the argmax. The outputs are
functions of those, assembled here in O(N) with the conventions of :class:`LossOutputs`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from . import _math
from .options import CCEOptions


class LossOutputs(NamedTuple):
    """The loss first, then the per-token outputs that were asked for (None otherwise).

    All are of the logits ``softcap(e @ c.T + bias) / temperature`` and shaped like the targets
    (``targets[..., 1:]`` with ``shift``), except the scalar ``accuracy``. At ignored tokens the
    log-probability, lse and entropy are 0 and the argmax is -1.

    Attributes:
        loss: as without these outputs (a scalar, or per token for ``reduction="none"``).
        lse: ``logsumexp`` of the logits (``return_lse``), differentiable.
        logprobs: the target token's log-probability, ``log_softmax(logits)[target]``
            (``return_logprobs``), differentiable; independent of label smoothing, class weights
            and z-loss.
        entropy: ``-(p * log p).sum(-1)`` of ``p = softmax(logits)`` (``return_entropy``),
            differentiable.
        argmax: the id of the largest logit, the smallest id among ties, as ``torch.argmax``
            (``return_argmax``), int64.
        accuracy: the share of non-ignored tokens whose argmax is the target, a float32 scalar
            (``return_accuracy``; 0 when every token is ignored), not differentiable.
    """

    loss: torch.Tensor
    lse: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    argmax: torch.Tensor | None = None
    accuracy: torch.Tensor | None = None


def assemble(
    opts: CCEOptions,
    loss: torch.Tensor,
    lse: torch.Tensor,
    tgt: torch.Tensor | None,
    entropy: torch.Tensor | None,
    argmax: torch.Tensor | None,
    targets: torch.Tensor,
    per_token: Callable[[torch.Tensor], torch.Tensor],
    bad: torch.Tensor | None = None,
):
    """The call's result from flat per-row tensors over the problem's rows ([N]: lse and tgt fp32,
    0 at ignored rows; entropy fp32, 0 at ignored rows; argmax int64; ``targets`` the rows'
    targets): the loss alone, ``(loss, lse)`` with ``return_lse`` only, else a
    :class:`LossOutputs`. ``per_token`` shapes a flat [N] tensor as the per-token outputs.
    ``bad`` (per row, cce._validation.guard_targets): the log-probabilities of those rows and the
    accuracy are NaN (the caller has made the loss so)."""
    if not opts.token_outputs:
        return (loss, per_token(lse)) if opts.return_lse else loss
    valid = targets != opts.ignore_index
    out = {"loss": loss}
    if opts.return_lse:
        out["lse"] = per_token(lse)
    if opts.return_logprobs:
        out["logprobs"] = per_token(_math.nan_at_bad_targets(torch.where(valid, tgt - lse, 0.0), bad))
    if opts.return_entropy:
        out["entropy"] = per_token(entropy)
    if argmax is not None:
        amax = torch.where(valid, argmax, -1)
        if opts.return_argmax:
            out["argmax"] = per_token(amax)
        if opts.return_accuracy:
            hits = (valid & (amax == targets)).sum().float()
            out["accuracy"] = _math.nan_at_bad_targets(hits / valid.sum().clamp(min=1).float(), bad)
    return LossOutputs(**out)
