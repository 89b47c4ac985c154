"""impl="triton" for the logits-level cross entropy: the row passes are the kernels of
kernels.py; the ops and their autograd: autograd.py. Nothing here synchronises with the host."""

from __future__ import annotations

import torch

from .autograd import BwdArgs, FwdArgs, define_ce_ops
from .kernels import ce_backward, ce_forward


def _stats(a: FwdArgs):
    # (The dispatch sends a temperature and the per-token outputs to impl="torch" for now.)
    assert a.temperature == 1.0 and not (a.want_entropy or a.want_argmax)
    lse, tgt, ssum = ce_forward(
        a.logits, a.targets, a.weight, a.ignore_index, a.softcap, a.label_smoothing > 0
    )
    return lse, tgt, ssum, None, None


def _grad(a: BwdArgs, inplace: bool) -> torch.Tensor:
    assert a.eta is None and a.temperature == 1.0
    return ce_backward(
        a.logits, a.targets, a.weight, a.lse, a.alpha, a.beta, a.gamma, a.ignore_index, a.softcap,
        a.smoothing, scale=a.scale, inplace=inplace,
    )  # fmt: skip


ce_triton_fwd = define_ce_ops("triton", _stats, _grad)
