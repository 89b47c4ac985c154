"""TRL integration: TRL's fused LM head, served by cce on a patched model.

TRL's trainers (SFT, DPO, GRPO, KTO, RLOO; TRL >= 1.16) install their own chunked LM head on the
model they train (``trl.trainer.utils.add_fused_lm_head``: an instance forward that, called with
``fused_lm_head=True``, runs the backbone and scores the next-token labels in tiles) and read
per-token log-probabilities, entropies and metrics from it. On a model patched with
:func:`cce.transformers.patch`, those calls run on cce instead, whichever came first, the patch or
the trainer (cce/transformers.py keeps its forward in front of TRL's and serves
``fused_lm_head=True`` itself). This module reads the settings TRL chose for a model from the
forward TRL built (temperature, the requested outputs, the head's fp32 cast, the family's softcap
and logit scale) and computes the two metrics cce's kernels do not (``mean_logits`` and
``log_sum_sq_probs``, without gradient). It does not import TRL: what it needs comes from the
module of the forward TRL installed.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

__all__ = ["FusedHead", "fused_head", "is_fused_head_forward", "mean_logits", "reinstall", "tiled_metrics"]

# The function add_fused_lm_head installs (bound to the model) and the closure names read from it.
_TRL_QUALNAME = "add_fused_lm_head.<locals>._fused_forward"
_SETTINGS = ("temperature", "outputs", "cast_lm_head_to_fp32", "final_logit_softcapping", "logit_scale")
# Outputs cce computes itself; the others are TRL's metrics without gradient (tiled_metrics).
CCE_OUTPUTS = ("log_probs", "entropy", "is_top1")
KNOWN_OUTPUTS = (*CCE_OUTPUTS, "mean_logits", "log_sum_sq_probs")


@dataclasses.dataclass(frozen=True)
class FusedHead:
    """The settings of one ``add_fused_lm_head(model, ...)`` call and the TRL pieces to honour them.

    ``softcap`` and ``scale``: the logits are ``softcap(scale * (h W^T + b)) / temperature`` as
    TRL reads them from the config; ``outputs`` the per-token fields TRL asked for;
    ``cast_fp32`` runs the head in fp32 outside autocast. ``output_type`` builds the
    ``FusedCausalLMOutput`` TRL's trainers read; ``chunked`` (TRL's tiled kernel) and
    ``chunk_size`` compute the metrics cce does not; ``install`` is ``add_fused_lm_head``."""

    temperature: float
    outputs: tuple[str, ...]
    cast_fp32: bool
    softcap: float | None
    scale: float
    output_type: Any
    chunked: Any
    chunk_size: int
    install: Any


def _function(forward) -> Any:
    return getattr(forward, "__func__", forward)


def is_fused_head_forward(forward) -> bool:
    """Whether ``forward`` (a model's instance forward) is the one TRL's add_fused_lm_head installs
    (recognized by its code object and module: TRL gives it the model forward's name and
    docstring with functools.wraps)."""
    fn = _function(forward)
    code = getattr(fn, "__code__", None)
    if code is None:
        return False
    name = getattr(code, "co_qualname", code.co_name)
    module = str(getattr(fn, "__globals__", {}).get("__name__", ""))
    return name in (_TRL_QUALNAME, _TRL_QUALNAME.rsplit(".", 1)[-1]) and module.startswith("trl.")


def fused_head(forward) -> FusedHead | None:
    """The settings of TRL's fused head ``forward`` (None if ``forward`` is not one). RuntimeError
    if it is one but not in the form this module knows (TRL 1.16's): never guess TRL's settings."""
    if not is_fused_head_forward(forward):
        return None
    fn = _function(forward)
    cells = dict(zip(fn.__code__.co_freevars, fn.__closure__ or (), strict=True))
    g = fn.__globals__
    need = (
        "FusedCausalLMOutput",
        "_ChunkedLogProbFunction",
        "_CHUNKED_LOGPROB_CHUNK_SIZE",
        "add_fused_lm_head",
    )
    missing = [k for k in _SETTINGS if k not in cells] + [k for k in need if k not in g]
    if missing:
        raise RuntimeError(
            "cce.transformers: this TRL version's fused LM head is not the form cce knows (TRL 1.16's): "
            f"missing {missing}. Unpatch the model (cce.transformers.unpatch) to train with TRL's own head"
        )
    s = {k: cells[k].cell_contents for k in _SETTINGS}
    unknown = [o for o in s["outputs"] if o not in KNOWN_OUTPUTS]
    if unknown:
        raise RuntimeError(
            f"cce.transformers: TRL asked its fused LM head for outputs cce does not know: {unknown}"
        )
    cap = s["final_logit_softcapping"]
    return FusedHead(
        temperature=float(s["temperature"]),
        outputs=tuple(s["outputs"]),
        cast_fp32=bool(s["cast_lm_head_to_fp32"]),
        softcap=None if cap is None else float(cap),
        scale=float(s["logit_scale"]),
        output_type=g["FusedCausalLMOutput"],
        chunked=g["_ChunkedLogProbFunction"],
        chunk_size=int(g["_CHUNKED_LOGPROB_CHUNK_SIZE"]),
        install=g["add_fused_lm_head"],
    )


def reinstall(model: torch.nn.Module, head: FusedHead) -> None:
    """Installs TRL's own fused head on ``model`` again, with ``head``'s settings (used when the
    cce patch that served it is undone)."""
    head.install(
        model, temperature=head.temperature, cast_lm_head_to_fp32=head.cast_fp32, outputs=head.outputs
    )


def mean_logits(e: torch.Tensor, c: torch.Tensor, bias: torch.Tensor | None, head: FusedHead) -> torch.Tensor:
    """[N] fp32: the mean over the vocabulary of ``scale (e c^T + b) / temperature``, without softcap
    (then it is linear: ``e`` times the mean class row), in O((N + V) D)."""
    with torch.no_grad():
        cbar = c.sum(0, dtype=torch.float32) / c.shape[0]
        out = e.float() @ cbar
        if bias is not None:
            out = out + bias.sum(dtype=torch.float32) / c.shape[0]
        return out * (head.scale / head.temperature)


def tiled_metrics(
    e: torch.Tensor,
    c: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    names: tuple[str, ...],
    head: FusedHead,
) -> dict[str, torch.Tensor]:
    """TRL's own tiled kernel, without gradient, for the metrics in ``names`` (``mean_logits`` under
    softcap, ``log_sum_sq_probs``) over the rows ``e`` [n, D] with ``targets`` [n]: one more pass of
    the logits matmul, as TRL's head would make."""
    with torch.no_grad():
        out = head.chunked.apply(
            e, c, bias, targets, head.temperature, head.chunk_size, head.softcap, head.scale, names
        )
    fields = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
    return {k: v for k, v in zip(fields, out, strict=True) if k in names}
