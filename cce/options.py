"""The options of every cce loss, in one frozen dataclass, validated once."""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

import torch

Reduction = Literal["mean", "sum", "none"]
Impl = Literal["auto", "triton", "torch"]
FilterEps = float | Literal["auto"] | None

_REDUCTIONS = ("mean", "sum", "none")
_IMPLS = ("auto", "triton", "torch")

# Gradient-filter thresholds chosen by filter_eps="auto". A tile of the softmax is skipped when
# every (non-target) probability in it is below eps; its contribution is then replaced by a
# rank-1 correction (see docs/design.md), whose error is not eps per entry but the spread of the
# tile's classes around their mean times the tile's mass. bf16 / fp16: chosen so that the
# corrected filter error stays at the error of storing the gradient in that dtype (measured on
# H100, zipf data at gemma2-2b / llama3-8b sizes: dE, dC 1.9e-3 / 1.8e-3 relative at 2^-8 against
# 1.7e-3 / 1.7e-3 unfiltered; docs/benchmarks.md) while on random logits no tile is kept at all
# (at 2^-12 a logit above ~4 sigma, in most tiles, kept its tile). fp32: about its rounding unit.
AUTO_FILTER_EPS = {
    torch.bfloat16: 2.0**-8,
    torch.float16: 2.0**-10,
    torch.float32: 2.0**-20,
    torch.float64: 0.0,
}


@dataclasses.dataclass(frozen=True)
class CCEOptions:
    """Options shared by :func:`cce.linear_cross_entropy` and :func:`cce.cross_entropy`.

    Validated on construction, so a bad value fails before any tensor is touched.
    """

    ignore_index: int = -100
    reduction: Reduction = "mean"
    shift: bool = False
    softcap: float | None = None
    label_smoothing: float = 0.0
    z_loss: float = 0.0
    filter_eps: FilterEps = "auto"
    impl: Impl = "auto"
    return_lse: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.ignore_index, bool) or not isinstance(self.ignore_index, int):
            raise TypeError(f"ignore_index must be an int, got {self.ignore_index!r}")
        if self.reduction not in _REDUCTIONS:
            raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {self.reduction!r}")
        if self.impl not in _IMPLS:
            raise ValueError(f"impl must be one of {_IMPLS}, got {self.impl!r}")
        if not isinstance(self.shift, bool):
            raise TypeError(f"shift must be a bool, got {self.shift!r}")
        if not isinstance(self.return_lse, bool):
            raise TypeError(f"return_lse must be a bool, got {self.return_lse!r}")
        if self.softcap is not None:
            if isinstance(self.softcap, bool) or not isinstance(self.softcap, (int, float)):
                raise TypeError(f"softcap must be a float or None, got {self.softcap!r}")
            if not (self.softcap > 0 and math.isfinite(self.softcap)):
                raise ValueError(f"softcap must be a finite float > 0 (or None), got {self.softcap!r}")
        if not isinstance(self.label_smoothing, (int, float)) or isinstance(self.label_smoothing, bool):
            raise TypeError(f"label_smoothing must be a float, got {self.label_smoothing!r}")
        if not 0.0 <= self.label_smoothing <= 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1], got {self.label_smoothing!r}")
        if not isinstance(self.z_loss, (int, float)) or isinstance(self.z_loss, bool):
            raise TypeError(f"z_loss must be a float, got {self.z_loss!r}")
        if not (self.z_loss >= 0 and math.isfinite(self.z_loss)):
            raise ValueError(f"z_loss must be a finite float >= 0, got {self.z_loss!r}")
        eps = self.filter_eps
        if eps is not None and eps != "auto":
            if isinstance(eps, bool) or not isinstance(eps, (int, float)):
                raise TypeError(f"filter_eps must be 'auto', a float or None, got {eps!r}")
            if not (0.0 <= eps < 1.0):
                raise ValueError(f"filter_eps must be in [0, 1) (or 'auto' / None), got {eps!r}")

    def resolved_filter_eps(self, dtype: torch.dtype) -> float:
        """The probability threshold below which a softmax tile's gradient is filtered (0 = exact)."""
        if self.filter_eps is None:
            return 0.0
        if self.filter_eps == "auto":
            return AUTO_FILTER_EPS.get(dtype, 0.0)
        return float(self.filter_eps)

    @property
    def softcap_value(self) -> float:
        """softcap as a float, 0.0 meaning 'no softcap' (the form the kernels take)."""
        return 0.0 if self.softcap is None else float(self.softcap)
