"""impl="triton" for the logits-level cross entropy: custom ops around the kernels of
:mod:`cce.kernels.cross_entropy`, with the autograd glue shared with impl="torch".

The ops are ``torch.library.custom_op``s, so ``torch.compile`` treats them as opaque nodes (no graph
break, nothing data-dependent traced). Nothing here synchronises with the host.
"""

from __future__ import annotations

import torch

from .ce_torch import fake_forward, finish_forward, register_ce_autograd
from .kernels import cross_entropy as K


@torch.library.custom_op("cce::ce_triton_fwd", mutates_args=())
def ce_triton_fwd(
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
    :func:`cce.ce_torch.finish_forward`); ``inplace`` only affects the backward."""
    smoothing = label_smoothing > 0
    lse, tgt, ssum = K.ce_forward(logits, targets, weight, ignore_index, softcap, smoothing)
    V = logits.shape[-1]
    return finish_forward(
        lse, tgt, ssum, targets, weight, ignore_index, reduction, V, label_smoothing, z_loss, precompute
    )


@ce_triton_fwd.register_fake
def _(
    logits, targets, weight, ignore_index, reduction, softcap, label_smoothing, z_loss, inplace, precompute
):
    return fake_forward(logits, targets, reduction, precompute)


@torch.library.custom_op("cce::ce_triton_bwd", mutates_args=())
def ce_triton_bwd(
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
    return K.ce_backward(
        logits, targets, weight, lse, alpha, beta, gamma, ignore_index, softcap, smoothing, scale=scale
    )


@ce_triton_bwd.register_fake
def _(logits, targets, weight, lse, alpha, beta, gamma, scale, ignore_index, softcap, smoothing):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


@torch.library.custom_op("cce::ce_triton_bwd_", mutates_args=("logits",))
def ce_triton_bwd_(
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
    K.ce_backward(
        logits, targets, weight, lse, alpha, beta, gamma, ignore_index, softcap, smoothing, scale=scale,
        inplace=True,
    )  # fmt: skip


register_ce_autograd(ce_triton_fwd, ce_triton_bwd, ce_triton_bwd_)
