"""verl integration: verl's fused log-prob / entropy kernel's signature, computed by cce.

verl's actors, with ``use_fused_kernels`` (``fused_kernels_backend="triton"``), score each token
through ``verl.utils.kernel.linear_cross_entropy.linear_cross_entropy``. :func:`linear_cross_entropy`
here takes the same arguments and returns the same values, so it can stand in for it (the recipe,
run inside every worker process, is in docs/integrations.md, "verl")::

    import verl.utils.kernel.linear_cross_entropy as verl_lce
    verl_lce.linear_cross_entropy = cce.verl.linear_cross_entropy

This module does not import verl.
"""

from __future__ import annotations

import torch

from .ops.linear_ce.api import linear_cross_entropy_with_options
from .options import CCEOptions

__all__ = ["linear_cross_entropy"]

_REDUCTIONS = ("none", "sum", "mean")


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    reduction: str = "none",
    dist_process_group=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probabilities, entropies) of the labels under ``softmax(hidden @ weight.T / temperature)``.

    The plain-PyTorch equivalent (without the ``N x V`` logits, and with ``weight`` the full
    classifier)::

        logits = (hidden.reshape(-1, D).float() @ weight.float().T) / temperature
        logp = torch.log_softmax(logits, -1)
        logprobs = logp.gather(-1, labels.reshape(-1, 1)).squeeze(-1)   # [N] fp32
        entropy = -(logp.exp() * logp).sum(-1)                          # [N] fp32
        logprobs = {"none": logprobs, "sum": logprobs.sum(), "mean": logprobs.mean()}[reduction]

    As verl's kernel: ``hidden`` is ``(..., D)`` and flattened to ``N`` tokens, ``labels`` holds
    ``N`` ids; both outputs are fp32 (fp64 for fp64 inputs) and differentiable with respect to
    ``hidden`` and ``weight`` (the entropy too: entropy bonuses train through it); the entropy
    stays per token whatever the reduction. With ``dist_process_group`` the vocabulary is split
    over that group (tensor parallelism): ``weight`` is this rank's contiguous block of rows,
    ``hidden`` and ``labels`` (global ids) are the same on every rank, and every rank gets the
    full outputs
    (docs/distributed.md).

    Unlike verl's kernel, a label of -100 marks a token to skip: its log-probability and entropy
    are 0 and it sends no gradient ("mean" still divides by every token, as verl's mean does).
    Any other label outside ``[0, V)`` raises on CPU and gives NaN outputs on CUDA
    (docs/api.md, "Bad inputs"). The computation is cce's exact one at any temperature
    (``filter_eps="auto"``: gradient filtering, with its bound, where it applies).
    """
    if reduction not in _REDUCTIONS:
        raise ValueError(
            f"cce.verl.linear_cross_entropy: reduction must be one of {_REDUCTIONS}, got {reduction!r}"
        )
    if hidden.dim() < 1:
        raise ValueError("cce.verl.linear_cross_entropy: hidden must have a last dimension of size D")
    e = hidden.reshape(-1, hidden.shape[-1])
    targets = labels.reshape(-1)
    opts = CCEOptions(
        reduction="none", temperature=float(temperature), return_logprobs=True, return_entropy=True
    )
    out = linear_cross_entropy_with_options(e, weight, targets, None, None, opts, dist_process_group)
    # fp32 outputs, as verl's (fp64 inputs keep fp64).
    wide = torch.promote_types(out.logprobs.dtype, torch.float32)
    logprobs, entropy = out.logprobs.to(wide), out.entropy.to(wide)
    if reduction == "sum":
        logprobs = logprobs.sum()
    elif reduction == "mean":
        logprobs = logprobs.mean()
    return logprobs, entropy
