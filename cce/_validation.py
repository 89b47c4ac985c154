"""Input checks shared by every entry point. All of them run before any kernel does.

Shape and dtype checks cost nothing. The one data-dependent check (targets in [0, V)) runs on CPU
tensors always; on accelerators only under ``torch.is_anomaly_enabled()`` or ``CCE_DEBUG=1``,
because it needs a host synchronisation. While ``torch.compile`` traces, data-dependent checks are
skipped so that the graph has no break.
"""

from __future__ import annotations

import os

import torch

from .options import FLOAT_DTYPES, CCEOptions


def _is_compiling() -> bool:
    return torch.compiler.is_compiling()


def debug_checks_enabled(device: torch.device) -> bool:
    """Whether data-dependent checks (which synchronise with the host) may run."""
    if _is_compiling():
        return False
    if device.type in ("cpu", "meta"):
        return device.type == "cpu"
    return torch.is_anomaly_enabled() or os.environ.get("CCE_DEBUG", "0") not in ("", "0")


def check_float(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32, bfloat16 or float16, got dtype {t.dtype}")


def check_targets_dtype(targets: torch.Tensor) -> None:
    if not isinstance(targets, torch.Tensor):
        raise TypeError(f"targets must be a torch.Tensor, got {type(targets).__name__}")
    if targets.dtype.is_floating_point or targets.dtype.is_complex or targets.dtype == torch.bool:
        raise TypeError(f"targets must hold integer class ids (int64/int32), got dtype {targets.dtype}")


def check_vector(name: str, t: torch.Tensor | None, V: int) -> None:
    if t is None:
        return
    check_float(name, t)
    if t.shape != (V,):
        raise ValueError(f"{name} must have shape (V,) = ({V},), got {tuple(t.shape)}")


def check_same_device(**tensors: torch.Tensor | None) -> torch.device:
    present = {k: v for k, v in tensors.items() if v is not None}
    devices = {v.device for v in present.values()}
    if len(devices) > 1:
        where = ", ".join(f"{k} on {v.device}" for k, v in present.items())
        raise ValueError(f"all tensors must be on the same device, got {where}")
    return next(iter(present.values())).device


def check_shift(opts: CCEOptions, lead_shape: torch.Size, what: str) -> None:
    if opts.shift and (len(lead_shape) < 1 or lead_shape[-1] < 2):
        raise ValueError(
            f"shift=True needs a sequence dimension of length >= 2 in {what}, got leading shape "
            f"{tuple(lead_shape)}"
        )


def check_target_range(targets: torch.Tensor, V: int, ignore_index: int) -> None:
    """IndexError for a target outside [0, V) that is not ignore_index (data-dependent)."""
    if targets.numel() == 0 or not debug_checks_enabled(targets.device):
        return
    bad = (targets != ignore_index) & ((targets < 0) | (targets >= V))
    if bool(bad.any()):
        first = targets[bad][:5].tolist()
        raise IndexError(
            f"targets must be in [0, V) = [0, {V}) or equal ignore_index={ignore_index}; "
            f"found {first} (showing up to 5)"
        )


def check_linear_inputs(
    e: torch.Tensor,
    c: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None,
    weight: torch.Tensor | None,
    opts: CCEOptions,
) -> None:
    """All checks of linear_cross_entropy's tensors; raises before anything runs."""
    check_float("e", e)
    check_float("c", c)
    check_targets_dtype(targets)
    if e.dim() < 1:
        raise ValueError("e must have shape (..., D), got a 0-d tensor")
    if c.dim() != 2:
        raise ValueError(f"c must be 2-D (V, D), got shape {tuple(c.shape)}")
    if c.shape[1] != e.shape[-1]:
        raise ValueError(
            f"hidden size mismatch: e has shape {tuple(e.shape)} (D={e.shape[-1]}) but c has shape "
            f"{tuple(c.shape)} (D={c.shape[1]})"
        )
    if c.dtype != e.dtype:
        raise TypeError(f"e and c must have the same dtype, got e: {e.dtype}, c: {c.dtype}")
    if targets.shape != e.shape[:-1]:
        raise ValueError(
            f"targets must have shape e.shape[:-1] = {tuple(e.shape[:-1])}, got {tuple(targets.shape)}"
        )
    V = c.shape[0]
    if V == 0:
        raise ValueError(f"c must have at least one class (row), got shape {tuple(c.shape)}")
    check_vector("bias", bias, V)
    check_vector("weight", weight, V)
    check_same_device(e=e, c=c, targets=targets, bias=bias, weight=weight)
    check_shift(opts, targets.shape, "e / targets")
    check_target_range(targets, V, opts.ignore_index)


def check_logits_inputs(
    logits: torch.Tensor, targets: torch.Tensor, weight: torch.Tensor | None, opts: CCEOptions
) -> None:
    """All checks of cross_entropy's tensors; raises before anything runs."""
    check_float("logits", logits)
    check_targets_dtype(targets)
    if logits.dim() < 1:
        raise ValueError("logits must have shape (..., V) with the class dim last, got a 0-d tensor")
    if targets.shape != logits.shape[:-1]:
        raise ValueError(
            f"targets must have shape logits.shape[:-1] = {tuple(logits.shape[:-1])} (logits are "
            f"(..., V), class dim last), got targets of shape {tuple(targets.shape)} for logits of "
            f"shape {tuple(logits.shape)}"
        )
    V = logits.shape[-1]
    if V == 0:
        raise ValueError(f"logits must have at least one class, got shape {tuple(logits.shape)}")
    check_vector("weight", weight, V)
    check_same_device(logits=logits, targets=targets, weight=weight)
    check_shift(opts, targets.shape, "logits / targets")
    check_target_range(targets, V, opts.ignore_index)
