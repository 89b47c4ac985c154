"""impl="triton" for the logits-level cross entropy: the row passes are the kernels of
kernels.py; the ops and their autograd: autograd.py. Nothing here synchronises with the host."""

from __future__ import annotations

import torch

from .autograd import BwdArgs, FwdArgs, define_ce_ops
from .kernels import ce_backward, ce_forward


def _stats(a: FwdArgs):
    return ce_forward(
        a.logits, a.targets, a.weight, a.ignore_index, a.softcap, a.label_smoothing > 0,
        temperature=a.temperature, entropy=a.want_entropy, argmax=a.want_argmax,
    )  # fmt: skip


def _grad(a: BwdArgs, inplace: bool) -> torch.Tensor:
    return ce_backward(
        a.logits, a.targets, a.weight, a.lse, a.alpha, a.beta, a.gamma, a.ignore_index, a.softcap,
        a.smoothing, scale=a.scale, inplace=inplace, eta=a.eta, temperature=a.temperature,
    )  # fmt: skip


ce_triton_fwd = define_ce_ops("triton", _stats, _grad)
