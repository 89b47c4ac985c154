"""Input checks shared by every entry point. All of them run before any kernel does.

Shape and dtype checks cost nothing. The one data-dependent check, targets in [0, V) or equal to
ignore_index, runs on the host for CPU tensors, and on accelerators under
``torch.is_anomaly_enabled()`` or ``CCE_DEBUG=1``: an ``IndexError`` naming the values. Elsewhere
(accelerators by default, and every device while ``torch.compile`` traces, so that the graph has no
break) it would need a host synchronisation, so it runs on the device instead (guard_targets): a
bad target is replaced by a class in [0, V) before any kernel reads it, and the outputs it feeds
are made NaN (cce._math.nan_at_bad_targets). A bad target never gives a finite loss.
"""

from __future__ import annotations

import os

import torch

from ._custom_ops import check_no_transforms
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
        raise TypeError(f"{name} must be float32, bfloat16, float16 or float64, got dtype {t.dtype}")


# Integer dtypes of class ids: those whose comparisons, clamp and int64 conversion every device
# implements (torch's uint16 / uint32 / uint64 lack them on the CPU).
TARGET_DTYPES: tuple[torch.dtype, ...] = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)
_TARGET_DTYPE_NAMES = "int64, int32, int16, int8 or uint8"


def check_targets_dtype(targets: torch.Tensor) -> None:
    if not isinstance(targets, torch.Tensor):
        raise TypeError(f"targets must be a torch.Tensor, got {type(targets).__name__}")
    if targets.dtype not in TARGET_DTYPES:
        raise TypeError(
            f"targets must hold integer class ids ({_TARGET_DTYPE_NAMES}), got dtype {targets.dtype}"
        )


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


def _raise_for_bad_targets(targets: torch.Tensor, V: int, ignore_index: int) -> None:
    """IndexError for a target outside [0, V) that is not ignore_index; reads the targets on the host."""
    if targets.numel() == 0:
        return
    t = targets.long()  # (a uint8 / int8 id compared with ignore_index = -100 would wrap around)
    bad = (t != ignore_index) & ((t < 0) | (t >= V))
    if bool(bad.any()):
        first = t[bad][:5].tolist()
        raise IndexError(
            f"targets must be in [0, V) = [0, {V}) or equal ignore_index={ignore_index}; "
            f"found {first} (showing up to 5)"
        )


def check_target_range(targets: torch.Tensor, V: int, ignore_index: int) -> None:
    """IndexError for a target outside [0, V) that is not ignore_index, where debug_checks_enabled."""
    if debug_checks_enabled(targets.device):
        _raise_for_bad_targets(targets, V, ignore_index)


def guard_targets(
    targets: torch.Tensor, V: int, ignore_index: int, check_on_host: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The targets the kernels may read, and where a target was bad (outside [0, V), not ignore_index).

    ``check_on_host`` (the entry points pass debug_checks_enabled): an IndexError now for a bad
    target, which reads the targets on the host; returns ``(targets, None)``. Otherwise nothing is
    read on the host (no synchronisation; traceable by torch.compile): returns ``(safe, bad)``,
    both shaped like ``targets``. ``safe`` (int64) has each bad target replaced by the nearest class,
    0 or V - 1 (ignore_index and good targets unchanged), so that no kernel, gather or class-weight
    lookup reads outside the V classes; ``bad`` (bool) marks them, for cce._math.nan_at_bad_targets,
    which makes every output they feed NaN.
    """
    if check_on_host:
        _raise_for_bad_targets(targets, V, ignore_index)
        return targets, None
    t = targets.long()
    # A target is bad exactly where clamping it into [0, V - 1] changes it, ignore_index aside: four
    # element-wise passes over the N ids (eq, clamp, where, ne), no reduction here.
    safe = torch.where(t == ignore_index, t, t.clamp(0, V - 1))
    return safe, safe != t


def check_linear_inputs(
    e: torch.Tensor,
    c: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None,
    weight: torch.Tensor | None,
    opts: CCEOptions,
) -> None:
    """The shape, dtype and device checks of linear_cross_entropy's tensors; raises before anything
    runs. The targets' range is guard_targets' (the entry point calls it next)."""
    check_no_transforms(e, c, targets, bias, weight)  # (before the targets' data-dependent checks)
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


def check_logits_inputs(
    logits: torch.Tensor, targets: torch.Tensor, weight: torch.Tensor | None, opts: CCEOptions
) -> None:
    """The shape, dtype and device checks of cross_entropy's tensors; raises before anything runs.
    The targets' range is guard_targets' (the entry point calls it next)."""
    check_no_transforms(logits, targets, weight)  # (before the targets' data-dependent checks)
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
