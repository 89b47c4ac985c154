"""Hugging Face ``transformers`` integration: ``patch(model)`` makes a causal LM compute its loss with cce.

    model = AutoModelForCausalLM.from_pretrained(...)
    cce.transformers.patch(model, impl="auto")   # in place; returns the model
    out = model(input_ids, labels=labels)         # out.loss from cce, out.logits is None

One generic mechanism serves every ``*ForCausalLM`` whose forward runs ``lm_head`` once on the final
hidden states: the instance (never the class) gets a forward that, when ``labels`` are given, calls the
model's own forward with ``labels=None`` while ``lm_head`` temporarily *captures* its input instead of
computing logits (it returns an empty ``(..., 0)`` tensor, so the family's own post-processing of the
logits runs on nothing). The loss is then computed from the captured hidden states and
``lm_head.weight`` by :func:`cce.linear_cross_entropy`. The family's output transforms are read from
the config: ``final_logit_softcapping`` (Gemma 2/3) becomes ``softcap``, ``logit_scale`` (Cohere,
multiplies the logits) and ``logits_scaling`` (Granite, divides them) scale the hidden states, which
is the same as scaling the logits and costs an ``N x D`` copy instead of a ``V x D`` one.

Without labels (generation, evaluation without labels) the model's own forward runs unchanged.
The options live on the instance (``model._cce_options``), so two patched models can differ.
This module does not import ``transformers``; it works on any model that follows its conventions.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import numbers
import types

import torch
from torch import nn

from .linear import linear_cross_entropy_with_options
from .options import CCEOptions

__all__ = ["patch", "unpatch", "is_patched"]

# Options a user may set; the rest (reduction, shift, softcap, return_lse) follow from the model and
# from each call (softcap from the config, reduction "sum" when the Trainer passes num_items_in_batch).
_USER_OPTIONS = ("ignore_index", "label_smoothing", "z_loss", "filter_eps", "impl")

_OPTIONS_ATTR = "_cce_options"
_PREV_FORWARD_ATTR = "_cce_prev_forward"


def _output_layer(model: nn.Module) -> nn.Linear:
    head = getattr(model, "lm_head", None)
    if head is None and hasattr(model, "get_output_embeddings"):
        head = model.get_output_embeddings()
    if head is None:
        raise ValueError(
            f"cce.transformers.patch: {type(model).__name__} has no output layer: expected a `lm_head` "
            "attribute (or get_output_embeddings()) holding an nn.Linear"
        )
    if not isinstance(head, nn.Linear):
        raise TypeError(
            f"cce.transformers.patch: {type(model).__name__}.lm_head is a {type(head).__name__}, not an "
            "nn.Linear; cce needs the plain classifier weight (merge adapters into the head or keep "
            "the head out of them)"
        )
    return head


def _text_config(model: nn.Module):
    config = getattr(model, "config", None)
    if config is None:
        raise ValueError(f"cce.transformers.patch: {type(model).__name__} has no `config` attribute")
    get = getattr(config, "get_text_config", None)
    return config, (get() if callable(get) else config)


def _logit_transform(model: nn.Module) -> tuple[float, float | None]:
    """(scale, softcap): the family's ``logits = softcap(scale * lm_head(h))``, read at call time."""
    _, cfg = _text_config(model)
    scale = 1.0
    # Cohere keeps the multiplier on the model (copied from config.logit_scale); prefer the live value.
    ls = getattr(model, "logit_scale", None)
    if not isinstance(ls, numbers.Real):
        ls = getattr(cfg, "logit_scale", None)
    if isinstance(ls, numbers.Real) and not isinstance(ls, bool):
        scale *= float(ls)
    div = getattr(cfg, "logits_scaling", None)  # Granite: logits / logits_scaling
    if isinstance(div, numbers.Real) and not isinstance(div, bool):
        scale /= float(div)
    cap = getattr(cfg, "final_logit_softcapping", None)
    cap = float(cap) if isinstance(cap, numbers.Real) and not isinstance(cap, bool) and cap > 0 else None
    return scale, cap


class _HeadCapture:
    """Stands in for ``lm_head.forward`` during one labelled forward: keeps the hidden states and
    returns an empty ``(..., 0)`` tensor so that no logits are computed."""

    def __init__(self, model_name: str) -> None:
        self.hidden: torch.Tensor | None = None
        self.model_name = model_name

    def __call__(self, hidden: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if self.hidden is not None:
            raise RuntimeError(
                f"cce.transformers: {self.model_name}.forward called lm_head more than once; only models "
                "that apply lm_head once to the final hidden states can be patched"
            )
        self.hidden = hidden
        return hidden.new_empty(*hidden.shape[:-1], 0)


def _as_kwargs(model: nn.Module, args: tuple, kwargs: dict) -> dict:
    """Positional arguments of the model's forward turned into keywords (so `labels` can be found)."""
    if not args:
        return dict(kwargs)
    params = [
        p
        for p in inspect.signature(type(model).forward).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ][1:]  # drop self
    if len(args) > len(params):
        raise TypeError(f"{type(model).__name__}.forward got {len(args)} positional arguments")
    out = {p.name: a for p, a in zip(params[: len(args)], args, strict=True)}
    out.update(kwargs)
    return out


def _cce_loss(
    model: nn.Module,
    hidden: torch.Tensor,
    labels: torch.Tensor,
    shift_labels: torch.Tensor | None,
    num_items_in_batch,
    opts: CCEOptions,
) -> torch.Tensor:
    head = _output_layer(model)
    c, bias = head.weight, head.bias
    scale, softcap = _logit_transform(model)
    e = hidden.to(c.device)
    # Match what the unpatched lm_head would compute in: under autocast the matmul runs in the
    # autocast dtype (a cast copy of the weight, as autocast itself makes); else in the weight's dtype.
    dev = e.device.type
    if torch.is_autocast_enabled(dev):
        dt = torch.get_autocast_dtype(dev)
    else:
        dt = c.dtype
    e, c = e.to(dt), c.to(dt)
    bias = None if bias is None else bias.to(dt)
    if scale != 1.0:
        # softcap(s * (e c^T + b)) = softcap((s e) c^T + s b): scale the N x D side, not the V x D one.
        e = e * scale
        bias = None if bias is None else bias * scale
    if shift_labels is not None:
        targets, shift = shift_labels, False
    else:
        targets, shift = labels, True
    targets = targets.to(e.device)
    if targets.shape != e.shape[:-1]:
        raise ValueError(
            f"cce.transformers: labels of shape {tuple(targets.shape)} do not match the hidden states "
            f"{tuple(e.shape[:-1])} given to lm_head (a labelled forward must keep every position: "
            "leave logits_to_keep / num_logits_to_keep at 0)"
        )
    reduction = "mean" if num_items_in_batch is None else "sum"
    call_opts = dataclasses.replace(opts, reduction=reduction, shift=shift, softcap=softcap, return_lse=False)
    # The cast above already picked the compute dtype; autocast must not re-cast inside the op.
    with torch.autocast(dev, enabled=False):
        loss = linear_cross_entropy_with_options(e, c, targets, bias, None, call_opts)
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss


def _patched_forward(self: nn.Module, *args, **kwargs):
    """The instance forward installed by :func:`patch`."""
    prev = self.__dict__.get(_PREV_FORWARD_ATTR)
    forward = prev if prev is not None else types.MethodType(type(self).forward, self)
    kw = _as_kwargs(self, args, kwargs)
    labels = kw.pop("labels", None)
    if labels is None:
        return forward(*args, **kwargs)
    opts: CCEOptions = self.__dict__[_OPTIONS_ATTR]
    shift_labels = kw.pop("shift_labels", None)
    num_items_in_batch = kw.pop("num_items_in_batch", None)
    return_dict = kw.pop("return_dict", None)
    if return_dict is None:
        return_dict = getattr(getattr(self, "config", None), "return_dict", True)

    head = _output_layer(self)
    capture = _HeadCapture(type(self).__name__)
    had_own = "forward" in head.__dict__
    own = head.__dict__.get("forward")
    head.forward = capture
    try:
        out = forward(**kw, labels=None, return_dict=True)
    finally:
        if had_own:
            head.forward = own
        else:
            del head.forward
    if capture.hidden is None:
        raise RuntimeError(
            f"cce.transformers: {type(self).__name__}.forward never called lm_head; cannot compute the "
            "fused loss for this model"
        )
    loss = _cce_loss(self, capture.hidden, labels, shift_labels, num_items_in_batch, opts)
    # Rebuild the output without logits (ModelOutput cannot drop a key in place).
    fields = {k: v for k, v in out.items() if k not in ("loss", "logits")}
    out = type(out)(loss=loss, **fields)
    return out if return_dict else out.to_tuple()


def _instance_forward(cls_forward):
    """A function with the class forward's name, docstring and signature (``__wrapped__``), so that
    tools introspecting ``model.forward`` (the Trainer's column filter and loss-kwargs check) see
    the real parameters."""

    @functools.wraps(cls_forward)
    def forward(self, *args, **kwargs):
        return _patched_forward(self, *args, **kwargs)

    return forward


def patch(
    model: nn.Module,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    filter_eps: float | str | None = "auto",
    impl: str = "auto",
) -> nn.Module:
    """Makes ``model`` (a Hugging Face ``*ForCausalLM`` instance) compute its labelled loss with cce.

    In a forward with ``labels`` the model never computes logits: it returns ``logits=None`` and the
    causal-LM loss (``labels`` shifted by one, ``ignore_index`` skipped, mean over the remaining
    tokens, or sum divided by ``num_items_in_batch`` when the Trainer passes it). A ``shift_labels``
    argument is used as given, unshifted. Without labels the model behaves exactly as before.

    The options are those of :func:`cce.linear_cross_entropy` that make sense for a model (see
    docs/api.md); ``softcap`` and the logit scale come from the model's config. They are stored on
    this instance only. Patching a patched model replaces its options. Returns ``model``.

    Raises ValueError / TypeError naming what is missing when the model has no ``config``, no
    ``lm_head`` nn.Linear, or a forward without a ``labels`` argument.
    """
    opts = CCEOptions(
        ignore_index=ignore_index,
        label_smoothing=label_smoothing,
        z_loss=z_loss,
        filter_eps=filter_eps,
        impl=impl,
    )
    if not isinstance(model, nn.Module):
        raise TypeError(f"cce.transformers.patch expects an nn.Module, got {type(model).__name__}")
    _text_config(model)
    _output_layer(model)
    if "labels" not in inspect.signature(type(model).forward).parameters:
        raise ValueError(
            f"cce.transformers.patch: {type(model).__name__}.forward has no `labels` argument; "
            "expected a causal LM (*ForCausalLM)"
        )
    if not is_patched(model):
        # A forward already set on the instance (e.g. accelerate's device hooks) is kept and called.
        model.__dict__[_PREV_FORWARD_ATTR] = model.__dict__.get("forward")
        model.__dict__["forward"] = types.MethodType(_instance_forward(type(model).forward), model)
    model.__dict__[_OPTIONS_ATTR] = opts
    return model


def unpatch(model: nn.Module) -> nn.Module:
    """Undoes :func:`patch` (a no-op on an unpatched model). Returns ``model``."""
    if not is_patched(model):
        return model
    prev = model.__dict__.pop(_PREV_FORWARD_ATTR)
    model.__dict__.pop(_OPTIONS_ATTR, None)
    if prev is None:
        del model.__dict__["forward"]
    else:
        model.__dict__["forward"] = prev
    return model


def is_patched(model: nn.Module) -> bool:
    """Whether :func:`patch` is in effect on this instance."""
    return _OPTIONS_ATTR in getattr(model, "__dict__", {})
