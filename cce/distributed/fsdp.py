"""FSDP2-sharded heads: the loss as a forward method of the ``fully_shard``-ed head, so that FSDP2
unshards and reshards the weight and reduce-scatters its gradient as it does for
``lm_head(hidden)``; or (``fsdp="vocab_parallel"``) the weight left sharded and the tokens
gathered instead."""

from __future__ import annotations

import types

import torch
from torch import nn

from .._dispatch import is_dtensor
from ..ops.linear_ce.api import linear_cross_entropy
from ..options import CCEOptions
from .vocab_parallel import linear_cross_entropy_vocab_parallel, vocab_parallel_sharded_tokens

_FSDP_METHOD = "_cce_fsdp_call"


def _call_with_module(self: nn.Module, fn, *args, **kwargs):
    return fn(*args, **kwargs)


def _fsdp_module(module: nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return False
    return isinstance(module, FSDPModule)


def call_unsharded(module: nn.Module, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` with ``module``'s FSDP2-sharded parameters gathered, as FSDP2 does
    around ``module.forward``; a plain call when ``module`` is not ``fully_shard``-ed.

    ``fn`` runs as a registered FSDP forward method of ``module``
    (``torch.distributed.fsdp.register_fsdp_forward_method``): FSDP2 all-gathers the parameters
    before it (``module.weight`` is then the whole, plain tensor), frees them after it when
    ``reshard_after_forward``, gathers them again before the backward of ``fn``'s outputs and
    reduce-scatters their gradients after it, exactly as for ``module(x)``. Pass the tensors that
    ``fn`` differentiates (e.g. the hidden states) in ``args`` so that FSDP2 can hook them.
    The first call stores a bound method on ``module`` (attribute ``_cce_fsdp_call``).
    """
    if not _fsdp_module(module):
        return fn(*args, **kwargs)
    if not callable(getattr(module, _FSDP_METHOD, None)):
        from torch.distributed.fsdp import register_fsdp_forward_method

        setattr(module, _FSDP_METHOD, types.MethodType(_call_with_module, module))
        register_fsdp_forward_method(module, _FSDP_METHOD)
    return getattr(module, _FSDP_METHOD)(fn, *args, **kwargs)


def lm_head_linear_cross_entropy(
    lm_head: nn.Module,
    e: torch.Tensor,
    targets: torch.Tensor,
    *,
    weight: torch.Tensor | None = None,
    fsdp: str = "gather",
    **options,
):
    """Linear cross entropy of an ``nn.Linear``-like head (``.weight (V, D)``, optional ``.bias``).

    - plain weight: :func:`cce.linear_cross_entropy`;
    - ``lm_head`` wrapped with ``torch.distributed.fsdp.fully_shard`` (FSDP2, data parallel, each
      rank its own tokens):

      - ``fsdp="gather"`` (default): through :func:`call_unsharded`, so that FSDP2 gathers the
        weight and reduce-scatters its gradient as it does for ``lm_head(hidden)``;
      - ``fsdp="vocab_parallel"``: the weight stays sharded; the tokens are all-gathered instead
        (O(N D) per rank rather than O(V D)) and each rank computes its shard's part of every
        rank's loss (:func:`vocab_parallel_sharded_tokens`). The shard's gradient is written
        directly, averaged over the ranks as FSDP2 does by default (a 1-D mesh is required;
        FSDP2's own hooks, e.g. a custom gradient divide factor or CPU offload, are bypassed);
    - weight a ``DTensor`` sharded ``Shard(0)`` (tensor parallel, the same tokens on every rank):
      vocabulary parallelism over its mesh group, no gather of the weight.

    A sharded weight is never read as if whole: a DTensor weight of a head that is not itself an
    FSDP module (e.g. managed by a parent's ``fully_shard`` and read outside the parent's forward)
    goes through the vocabulary-parallel checks, which reject differing (data-parallel) ``e``.
    """
    if fsdp not in ("gather", "vocab_parallel"):
        raise ValueError(f"fsdp must be 'gather' or 'vocab_parallel', got {fsdp!r}")
    if fsdp == "vocab_parallel" and _fsdp_module(lm_head) and is_dtensor(lm_head.weight):
        c = lm_head.weight
        if c.device_mesh.ndim != 1:
            raise ValueError(
                "fsdp='vocab_parallel' needs a 1-D FSDP2 mesh (plain FSDP, not HSDP); use fsdp='gather'"
            )
        bias = getattr(lm_head, "bias", None)
        # FSDP2 keeps the shards in the parameter dtype; compute in the hidden states' dtype as
        # its mixed-precision forward would (a differentiable cast, the gradient comes back fp32).
        c = c.to(e.dtype)
        bias = None if bias is None else bias.to(e.dtype)
        opts = CCEOptions(**options)
        world = c.device_mesh.size()
        return vocab_parallel_sharded_tokens(e, c, targets, bias, weight, opts, grad_divide=float(world))

    def loss(e_, t_):
        c = lm_head.weight
        bias = getattr(lm_head, "bias", None)
        if is_dtensor(c):
            return linear_cross_entropy_vocab_parallel(e_, c, t_, bias, weight=weight, **options)
        return linear_cross_entropy(e_, c, t_, bias, weight=weight, **options)

    return call_unsharded(lm_head, loss, e, targets)
