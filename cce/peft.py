"""PEFT LoRA on the output layer, in the form cce's fused loss takes.

A PEFT LoRA layer around a linear head computes, over its active adapters ``a``::

    y = x W^T + b + sum_a s_a * (drop_a(x) A_a^T B_a^T + b_a)

with ``W`` ``(V, D)`` the base weight, ``A_a`` ``(r_a, D)``, ``B_a`` ``(V, r_a)``, ``s_a`` the adapter's
scaling, ``drop_a`` its dropout and ``b_a`` its optional ``lora_bias``. With ``u_a = s_a drop_a(x) A_a^T``
(``N x r_a``) the logits are one linear map of width ``D + R`` (``R = sum_a r_a``)::

    y = [x, u_1, ..., u_k] @ [W, B_1, ..., B_k]^T + (b + sum_a s_a b_a)

so :func:`cce.linear_cross_entropy` on ``e' = [x, u]`` and ``c' = [W, B]`` is the loss of the adapted
head exactly, and autograd carries its gradients to ``W``, ``A_a``, ``B_a`` and ``x``. The dropouts
are applied where the model calls the head (:func:`lora_inputs`), so each draws its mask at the same
point of the RNG stream as the layer's own forward would; the adapters' parameters are read only by
the loss (:func:`lora_terms`), where a sharded (FSDP2) head has gathered them. The loss assembles
``c'``: a ``V x (D + R)`` copy per step.

This module reads PEFT's layers through their public attributes; ``peft`` is imported only once a
head built by it is met (it is then already imported).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

__all__ = [
    "LoraInputs",
    "check_lora_layer",
    "is_peft_module",
    "lora_base_layer",
    "lora_inputs",
    "lora_terms",
]

_WHAT_TO_DO = (
    "keep lm_head out of the PEFT config (target_modules, modules_to_save), merge the adapter into "
    "the head (merge_and_unload()), or cce.transformers.unpatch(model) to compute the loss from the logits"
)


class LoraInputs(NamedTuple):
    """The active adapters' names and their inputs ``drop_a(x)`` (in the adapter's dtype)."""

    names: tuple[str, ...]
    inputs: tuple[torch.Tensor, ...]


def is_peft_module(module: nn.Module) -> bool:
    """Whether ``module``'s class (or one it derives from, e.g. under FSDP2) comes from ``peft``."""
    return any(k.__module__.split(".", 1)[0] == "peft" for k in type(module).__mro__)


def _lora_linear_class():
    from peft.tuners.lora.layer import Linear

    return Linear


def lora_base_layer(module: nn.Module) -> nn.Linear:
    """The ``nn.Linear`` that a PEFT LoRA layer adapts.

    Raises TypeError, saying what to do, for any other PEFT wrapper (IA3, LoHa, modules_to_save, a
    quantized or nested base layer, ...) and for a LoRA layer whose forward is not the plain one.
    """
    name = type(module).__name__
    lora_linear = _lora_linear_class()
    if not isinstance(module, lora_linear) or type(module).forward is not lora_linear.forward:
        raise TypeError(
            f"cce.transformers: lm_head is a PEFT {name}; cce computes the fused loss of a plain nn.Linear "
            f"head or of a LoRA layer (peft LoraConfig) on one: {_WHAT_TO_DO}"
        )
    base = module.base_layer
    if not isinstance(base, nn.Linear) or getattr(module, "fan_in_fan_out", False):
        raise TypeError(
            f"cce.transformers: lm_head is a LoRA layer around a {type(base).__name__}"
            f"{' with fan_in_fan_out' if getattr(module, 'fan_in_fan_out', False) else ''}; cce needs it "
            f"around a plain nn.Linear: {_WHAT_TO_DO}"
        )
    return base


def _active(module: nn.Module) -> tuple[str, ...]:
    """The adapters whose terms the layer's forward adds now (none when disabled or merged)."""
    if module.disable_adapters or module.merged:
        return ()
    names = tuple(a for a in module.active_adapters if a in module.lora_A.keys())
    for a in names:
        variant = getattr(module, "lora_variant", {}).get(a)
        if variant is not None or getattr(module, "use_dora", {}).get(a, False):
            kind = "DoRA" if getattr(module, "use_dora", {}).get(a, False) else type(variant).__name__
            raise ValueError(
                f"cce.transformers: the LoRA adapter {a!r} on lm_head uses {kind}; the fused loss "
                f"supports plain LoRA on the output layer only: {_WHAT_TO_DO}"
            )
    return names


def check_lora_layer(module: nn.Module) -> None:
    """Raises, as the loss would, when the LoRA layer or its active adapters are not supported."""
    lora_base_layer(module)
    _active(module)


def lora_inputs(module: nn.Module, x: torch.Tensor, *args, **kwargs) -> LoraInputs | None:
    """The active adapters' inputs ``drop_a(x)`` for the input ``x`` of a LoRA layer (None when no
    adapter term is added).

    Called in place of the layer's forward: the same adapters, dropouts (one draw each, in the
    layer's order) and input casts. Extra arguments (PEFT's ``adapter_names`` for mixed-adapter
    batches) are refused: the fused loss has one set of adapters for all rows.
    """
    if args or any(v is not None for v in kwargs.values()):
        given = sorted(k for k, v in kwargs.items() if v is not None) or [f"{len(args)} positional"]
        raise ValueError(
            f"cce.transformers: lm_head was called with {', '.join(given)} argument(s) (a mixed-adapter "
            "batch); the fused loss applies one set of adapters to every row: call without them, or "
            "without labels to get logits"
        )
    lora_base_layer(module)
    if module.disable_adapters and module.merged:
        module.unmerge()  # as the layer's own forward does before running the base layer alone
    names = _active(module)
    if not names:
        return None
    cast = getattr(module, "cast_input_dtype_enabled", True)
    inputs = []
    for a in names:
        dtype = module.lora_A[a].weight.dtype
        inputs.append(module.lora_dropout[a](x.to(dtype) if cast else x))
    return LoraInputs(names, tuple(inputs))


def lora_terms(
    module: nn.Module, lora: LoraInputs
) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor | None]:
    """``u = [u_1, ..., u_k]`` ``(..., R)``, the blocks ``[B_1, ..., B_k]`` (``(V, r_a)`` each) and
    the summed ``s_a b_a`` bias (None without ``lora_bias``), all differentiable."""
    us, blocks, bias = [], [], None
    for a, xa in zip(lora.names, lora.inputs, strict=True):
        scaling = module.scaling[a]
        us.append(module.lora_A[a](xa) * scaling)
        lora_b = module.lora_B[a]
        blocks.append(lora_b.weight)
        if lora_b.bias is not None:
            term = lora_b.bias * scaling
            bias = term if bias is None else bias + term
    return (us[0] if len(us) == 1 else torch.cat(us, dim=-1)), blocks, bias
