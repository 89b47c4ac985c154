"""Hugging Face ``transformers`` integration: ``patch(model)`` makes a causal LM compute its loss with cce.

    model = AutoModelForCausalLM.from_pretrained(...)
    cce.transformers.patch(model, impl="auto")   # in place; returns the model
    out = model(input_ids, labels=labels)         # out.loss from cce, out.logits is None

One generic mechanism serves every ``*ForCausalLM`` whose forward runs ``lm_head`` once on the final
hidden states. ``patch`` sets a forward on the model *instance* (never on its class) and one on its
``lm_head`` instance; both read one small per-instance state object (options, flags). When labels
are given, the model's own forward runs with ``labels=None`` while the head *captures* its input
instead of computing logits (it returns an empty ``(..., 0)`` tensor, so the family's own
post-processing of the logits runs on nothing). The loss is then computed from the captured hidden
states and ``lm_head.weight`` by :func:`cce.linear_cross_entropy`. The family's output transforms
are read from the model and its config when patching: ``final_logit_softcapping`` (Gemma 2/3)
becomes ``softcap``; ``logit_scale`` (Cohere, multiplies the logits) and ``logits_scaling``
(Granite, divides them) scale the hidden states, which is the same as scaling the logits and costs
an ``N x D`` product instead of a ``V x D`` copy; a mixture-of-experts router loss
(``aux_loss`` x ``router_aux_loss_coef``) is added as the unpatched forward adds it with labels.

A PEFT LoRA layer on ``lm_head`` is supported whether PEFT wraps the head before or after
``patch``: the head module is looked up at every labelled forward and the one the model calls now
captures (its adapters' rank-r factors included); the loss then runs on the adapted classifier as
one linear map of width D + r (cce/peft.py).

TRL's trainers install their own fused LM head on the model they train (an instance forward
called with ``fused_lm_head=True``). On a patched model cce serves those calls, whether TRL came
before or after ``patch``: so that TRL installing its head later cannot displace the patched
forward, ``patch`` gives the instance a subclass of its class (same name and module) whose
``__setattr__`` records TRL's forward (for its settings) instead of installing it; ``unpatch``
restores the class and TRL's head (cce/trl.py).

Without labels (generation, evaluation without labels) the model's own forward runs unchanged.
The state lives on the instance (``model._cce_state``), so two patched models can differ, and a
deep copy is patched independently. This module does not import ``transformers``: it works on
any model that follows these conventions, and it traces under ``torch.compile(fullgraph=True)``.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import numbers
import types
from typing import Any, NamedTuple

import torch
from torch import nn

from .distributed.fsdp import call_unsharded
from .ops.linear_ce.api import linear_cross_entropy_with_options
from .options import CCEOptions
from .peft import LoraInputs, check_lora_layer, is_peft_module, lora_base_layer, lora_inputs, lora_terms
from .trl import (
    CCE_OUTPUTS,
    FusedHead,
    fused_head,
    is_fused_head_forward,
    mean_logits,
    reinstall,
    tiled_metrics,
)

__all__ = ["is_patched", "options", "patch", "token_logprobs", "unpatch"]

_STATE_ATTR = "_cce_state"
_PREV_ATTR = "_cce_prev_forward"  # on a head module: its instance forward from before the patch


def _output_layer(model: nn.Module) -> nn.Module:
    """The module the model calls for its logits: ``lm_head`` (or get_output_embeddings()), as it is now."""
    head = getattr(model, "lm_head", None)
    if head is None and hasattr(model, "get_output_embeddings"):
        head = model.get_output_embeddings()
    if head is None:
        raise ValueError(
            f"cce.transformers.patch: {type(model).__name__} has no output layer: expected a `lm_head` "
            "attribute (or get_output_embeddings()) holding an nn.Linear"
        )
    _classifier(head)
    return head


def _classifier(head: nn.Module) -> nn.Linear:
    """The nn.Linear holding the classifier weight: the head itself, or the base layer of a PEFT LoRA
    head (whose adapters the loss adds, cce/peft.py); TypeError for anything else."""
    if isinstance(head, nn.Linear) and not is_peft_module(head):
        return head
    if is_peft_module(head):
        return lora_base_layer(head)
    raise TypeError(
        f"cce.transformers.patch: lm_head is a {type(head).__name__}, not an nn.Linear (or a PEFT LoRA "
        "layer around one); cce needs the classifier as a weight matrix"
    )


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


class _PatchState:
    """Everything :func:`patch` attaches to one model instance (shared with its head modules).

    ``capturing`` is set for the duration of one labelled forward; while it is, the head's forward
    stores its input in ``hidden`` (and a LoRA head its adapters' inputs in ``lora``) and returns
    an empty ``(..., 0)`` tensor instead of logits. ``heads`` are the modules that carry the
    capturing forward: the head when patching, and whatever module the model calls for its
    logits at a later labelled forward (e.g. a LoRA layer PEFT wrapped around the patched head).
    """

    def __init__(self, options: CCEOptions, scale: float, softcap: float | None, prev_forward):
        self.options = options
        self.scale, self.softcap = scale, softcap
        self.prev_forward = prev_forward
        # The four per-call variants, built (and validated) once so that a traced forward
        # (torch.compile) only looks them up.
        self.call_options = {
            (reduction, shift): dataclasses.replace(
                options, reduction=reduction, shift=shift, softcap=softcap, return_lse=False
            )
            for reduction in ("mean", "sum")
            for shift in (False, True)
        }
        self.heads: list[nn.Module] = []
        self.capturing = False
        self.hidden: torch.Tensor | None = None
        self.lora: LoraInputs | None = None
        self.aux_coef = 0.0
        # TRL's fused-head forward, when TRL installed one after the patch (kept for its settings;
        # the patched forward serves its calls: _fused_head_forward).
        self.trl_forward = None


def _head_forward(self: nn.Module, hidden: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """The forward installed on a patched model's head modules (bound to the module)."""
    st: _PatchState = self._cce_state
    if st.capturing:
        if st.hidden is not None:
            raise RuntimeError(
                "cce.transformers: the model's forward called lm_head more than once; only models "
                "that apply lm_head once to the final hidden states can be patched"
            )
        # A LoRA head's adapter inputs are taken now, where its forward would draw its dropouts.
        st.lora = lora_inputs(self, hidden, *args, **kwargs) if is_peft_module(self) else None
        st.hidden = hidden
        return hidden.new_empty(*hidden.shape[:-1], 0)
    prev = self.__dict__.get(_PREV_ATTR)
    if prev is not None:
        return prev(hidden, *args, **kwargs)
    return type(self).forward(self, hidden, *args, **kwargs)


def _install_head(st: _PatchState, head: nn.Module) -> None:
    """Gives ``head`` the capturing forward (once); its own instance forward, if any, is kept."""
    if getattr(head, _STATE_ATTR, None) is st:
        return
    if _STATE_ATTR in head.__dict__:
        raise RuntimeError(
            f"cce.transformers: this model's lm_head ({type(head).__name__}) is already patched through "
            "another model (e.g. a PEFT model and its base model both patched); patch only one of them"
        )
    head.__dict__[_PREV_ATTR] = head.__dict__.get("forward")
    # A partial rather than a bound method: torch.compile traces this install when it happens in a
    # compiled labelled forward (a head PEFT wrapped after patching), and not a MethodType call.
    head.__dict__["forward"] = functools.partial(_head_forward, head)
    head.__dict__[_STATE_ATTR] = st
    st.heads.append(head)


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


def _head_loss(
    hidden: torch.Tensor,
    adapter_inputs: tuple[torch.Tensor, ...],
    targets: torch.Tensor,
    *,
    head: nn.Module,
    lora_names: tuple[str, ...],
    scale: float,
    opts: CCEOptions,
    dtype: torch.dtype | None = None,
):
    """The loss from the head's parameters; runs where they are whole (see call_unsharded)."""
    linear = _classifier(head)
    c, bias = linear.weight, linear.bias
    e = hidden.to(c.device)
    # Match what the unpatched lm_head would compute in: under autocast the matmul runs in the
    # autocast dtype (a cast copy of the weight, as autocast itself makes); else in the weight's
    # dtype (FSDP2's mixed-precision param dtype included). ``dtype`` overrides both.
    dev = e.device.type
    dt = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else c.dtype
    dt = dtype or dt
    if lora_names:
        # LoRA head: logits = [x, u] @ [W, B]^T + (b + sum_a s_a b_a) (cce/peft.py), one linear map of
        # width D + R. The adapters' terms run in the base product's dtype (PEFT adds its fp32 adapter
        # output to the logits and rounds the sum to that dtype).
        u, blocks, lora_bias = lora_terms(head, LoraInputs(lora_names, adapter_inputs))
        e = torch.cat([e.to(dt), u.to(device=c.device, dtype=dt)], dim=-1)
        c = _with_columns(c, blocks, dt)
        if lora_bias is not None:
            bias = lora_bias if bias is None else bias + lora_bias
    else:
        e, c = e.to(dt), c.to(dt)
    bias = None if bias is None else bias.to(dt)
    if scale != 1.0:
        # softcap(s * (e c^T + b)) = softcap((s e) c^T + s b): scale the N x D side, not the V x D one.
        e = e * scale
        bias = None if bias is None else bias * scale
    # The cast above already picked the compute dtype; autocast must not re-cast inside the op.
    with torch.autocast(dev, enabled=False):
        return linear_cross_entropy_with_options(e, c, targets.to(e.device), bias, None, opts)


def _with_columns(c: torch.Tensor, blocks: list[torch.Tensor], dt: torch.dtype) -> torch.Tensor:
    """``[c, *blocks]`` along the columns, in ``dt``: one ``V x (D + R)`` buffer, each part cast as it
    is copied in (no separate cast copy of ``c``); differentiable with respect to every part."""
    width = c.shape[1] + sum(b.shape[1] for b in blocks)
    out = torch.empty((c.shape[0], width), dtype=dt, device=c.device)
    col = 0
    for part in (c, *blocks):
        out[:, col : col + part.shape[1]] = part
        col += part.shape[1]
    return out


def _call_targets(cap: _Captured, labels, shift_labels) -> tuple[bool, torch.Tensor]:
    """(shift, targets) of a labelled call: ``labels`` shifted by one, or ``shift_labels`` as given."""
    shift = shift_labels is None
    targets = labels if shift else shift_labels
    if targets.shape != cap.hidden.shape[:-1]:
        raise ValueError(
            f"cce.transformers: labels of shape {tuple(targets.shape)} do not match the hidden states "
            f"{tuple(cap.hidden.shape[:-1])} given to lm_head (a labelled forward must keep every position: "
            "leave logits_to_keep / num_logits_to_keep at 0)"
        )
    return shift, targets


def _cce_loss(
    st: _PatchState,
    cap: _Captured,
    labels: torch.Tensor,
    shift_labels: torch.Tensor | None,
    num_items_in_batch,
) -> torch.Tensor:
    shift, targets = _call_targets(cap, labels, shift_labels)
    opts = st.call_options[("mean" if num_items_in_batch is None else "sum", shift)]
    # A fully_shard-ed (FSDP2) head has resharded its weight after its own (capturing) forward:
    # call_unsharded gathers it again around the loss and reduce-scatters its gradient, as FSDP2
    # does around lm_head(hidden). For any other head it is a plain call.
    loss = _call_head_loss(st, cap, targets, opts)
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss


def _call_head_loss(
    st: _PatchState, cap: _Captured, targets: torch.Tensor, opts: CCEOptions, scale: float | None = None,
    dtype: torch.dtype | None = None,
):  # fmt: skip
    # The adapters' inputs go with the hidden states as positional arguments: what the loss
    # differentiates, so that FSDP2 hooks them (the adapters' weights are read inside, gathered).
    lora = LoraInputs((), ()) if cap.lora is None else cap.lora
    return call_unsharded(
        cap.head, _head_loss, cap.hidden, lora.inputs, targets,
        head=cap.head, lora_names=lora.names, scale=st.scale if scale is None else scale, opts=opts,
        dtype=dtype,
    )  # fmt: skip


class _Captured(NamedTuple):
    """One labelled forward's model output (no logits) and what its head received."""

    out: Any
    head: nn.Module
    hidden: torch.Tensor
    lora: LoraInputs | None


def _capture(model: nn.Module, st: _PatchState, kw: dict) -> _Captured:
    """The model's forward without labels, its head capturing its input instead of computing logits."""
    # The head is looked up at every call: PEFT (or anything else) may have replaced the patched
    # one since; the module the model calls now is the one that must capture.
    head = _output_layer(model)
    if is_peft_module(head):
        check_lora_layer(head)
    _install_head(st, head)
    st.capturing, st.hidden, st.lora = True, None, None
    try:
        if st.prev_forward is not None:
            out = st.prev_forward(**kw, labels=None, return_dict=True)
        else:
            out = type(model).forward(model, **kw, labels=None, return_dict=True)
        hidden, lora = st.hidden, st.lora
    finally:
        st.capturing, st.hidden, st.lora = False, None, None
    if hidden is None:
        raise RuntimeError(
            f"cce.transformers: {type(model).__name__}.forward never called lm_head; cannot compute the "
            "fused loss for this model"
        )
    return _Captured(out, head, hidden, lora)


def _trl_head(model: nn.Module, st: _PatchState) -> FusedHead:
    """The settings of the fused head TRL installed on ``model`` (after the patch: recorded by the
    watcher; before it: the forward the patch found; for a patched PEFT model, on its base model,
    where TRL installs it)."""
    head = fused_head(st.trl_forward) if st.trl_forward is not None else fused_head(st.prev_forward)
    base = getattr(model, "get_base_model", None)
    if head is None and callable(base):
        head = fused_head(base().__dict__.get("forward"))
    if head is None:
        raise ValueError(
            f"cce.transformers: {type(model).__name__} was called with fused_lm_head=True, but no TRL "
            "fused LM head was installed on it (trl.trainer.utils.add_fused_lm_head)"
        )
    return head


def _fused_head_forward(model: nn.Module, st: _PatchState, kw: dict):
    """TRL's ``model(..., labels=..., fused_lm_head=True)`` computed by cce: the per-token fields of
    TRL's ``FusedCausalLMOutput`` (log-probabilities, entropies, top-1 flags, zero at label -100)
    and its loss, ``-sum(log_probs) / (num_items_in_batch or the label count)``, under the settings
    TRL chose (temperature, the family's softcap and logit scale as TRL reads them, the fp32 cast)."""
    head = _trl_head(model, st)
    labels = kw.pop("labels", None)
    shift_labels = kw.pop("shift_labels", None)
    num_items_in_batch = kw.pop("num_items_in_batch", None)
    kw.pop("return_dict", None)
    if labels is None and shift_labels is None:
        raise ValueError("cce.transformers: a fused_lm_head=True call needs labels (or shift_labels)")
    kw["use_cache"] = False
    _, text_cfg = _text_config(model)
    if getattr(text_cfg, "output_router_logits", False):
        kw.setdefault("output_router_logits", True)
    cap = _capture(model, st, kw)
    shift, targets = _call_targets(cap, labels, shift_labels)
    opts = dataclasses.replace(
        st.options, ignore_index=-100, reduction="none", shift=shift, softcap=head.softcap,
        label_smoothing=0.0, z_loss=0.0, temperature=head.temperature, return_lse=False,
        return_logprobs=True, return_entropy="entropy" in head.outputs,
        return_argmax="is_top1" in head.outputs,
    )  # fmt: skip
    dtype = torch.float32 if head.cast_fp32 else None
    out = _call_head_loss(st, cap, targets, opts, scale=head.scale, dtype=dtype)
    t = targets[..., 1:] if shift else targets
    hidden = cap.hidden[..., :-1, :] if shift else cap.hidden
    mask = t != -100
    fields = {"log_probs": out.logprobs.masked_fill(~mask, 0.0)}
    if out.entropy is not None:
        fields["entropy"] = out.entropy.masked_fill(~mask, 0.0)
    if out.argmax is not None:
        fields["is_top1"] = (out.argmax == t.to(out.argmax.device)) & mask
    rest = tuple(o for o in head.outputs if o not in CCE_OUTPUTS)
    if rest:
        linear = _classifier(cap.head)
        c, bias = linear.weight, linear.bias
        h = hidden.to(c.device)
        if "mean_logits" in rest and head.softcap is None:
            fields["mean_logits"] = mean_logits(h, c, bias, head).masked_fill(~mask, 0.0)
            rest = tuple(o for o in rest if o != "mean_logits")
        if rest:
            # Every position, ignored ones too (their label clamped, their value zeroed): no
            # boolean indexing, whose count would need a host synchronisation.
            hm = h.reshape(-1, h.shape[-1])
            hm = hm.float() if head.cast_fp32 else hm
            for k, v in tiled_metrics(hm, c, bias, t.clamp(min=0).reshape(-1), rest, head).items():
                fields[k] = v.view(mask.shape).masked_fill(~mask, 0.0)
    loss = -fields["log_probs"].sum()
    if num_items_in_batch is None:
        loss = loss / mask.sum().clamp(min=1)
    else:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    aux = None
    if kw.get("output_router_logits"):
        aux = cap.out.get("aux_loss")
        if aux is not None:
            loss = loss + float(getattr(text_cfg, "router_aux_loss_coef", 0.0)) * aux.to(loss.device)
    return head.output_type(loss=loss, label_mask=mask, aux_loss=aux, **fields)


def _patched_forward(self: nn.Module, *args, **kwargs):
    """The body of the instance forward installed by :func:`patch`."""
    st: _PatchState = self._cce_state
    kw = _as_kwargs(self, args, kwargs)
    if kw.pop("fused_lm_head", False):  # TRL's fused head (cce/trl.py)
        return _fused_head_forward(self, st, kw)
    kwargs.pop("fused_lm_head", None)
    labels = kw.pop("labels", None)
    if labels is None:
        if st.prev_forward is not None:
            return st.prev_forward(*args, **kwargs)
        return type(self).forward(self, *args, **kwargs)
    shift_labels = kw.pop("shift_labels", None)
    num_items_in_batch = kw.pop("num_items_in_batch", None)
    return_dict = kw.pop("return_dict", None)
    if return_dict is None:
        return_dict = getattr(getattr(self, "config", None), "return_dict", True)

    cap = _capture(self, st, kw)
    loss = _cce_loss(st, cap, labels, shift_labels, num_items_in_batch)
    out = cap.out
    aux = out.get("aux_loss")
    if aux is not None and st.aux_coef:
        # Mixture-of-experts families add the router load-balancing loss only when labels are given.
        loss = loss + st.aux_coef * aux.to(loss.device)
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


def _watch_forward(model: nn.Module) -> None:
    """Gives ``model`` (this instance only) a subclass of its class, same name and module, whose
    ``__setattr__`` keeps the patched forward in front when TRL installs its fused LM head after
    the patch: the assignment ``model.forward = <TRL's fused forward>`` is recorded in the patch
    state (``trl_forward``, for its settings) instead of replacing the patched forward, which
    serves ``fused_lm_head=True`` itself. Any other assignment goes through unchanged."""
    cls = type(model)
    if cls.__dict__.get("_cce_watched_base") is not None:
        return

    def __setattr__(self, name, value):
        st = self.__dict__.get(_STATE_ATTR)
        if name == "forward" and st is not None and is_fused_head_forward(value):
            fused_head(value)  # refuses a form it does not know now, not at the first step
            st.trl_forward = value
            return
        super(watched, self).__setattr__(name, value)

    ns = {"__setattr__": __setattr__, "__module__": cls.__module__, "__qualname__": cls.__qualname__,
          "__doc__": cls.__doc__, "_cce_watched_base": cls}  # fmt: skip
    watched = type(cls.__name__, (cls,), ns)
    model.__class__ = watched


def _unwatch_forward(model: nn.Module) -> None:
    base = type(model).__dict__.get("_cce_watched_base")
    if base is not None:
        model.__class__ = base


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
    docs/api.md); ``reduction`` and ``shift`` follow from each call, ``softcap`` and the logit scale
    from the model's config, read now (patch again after changing them). They are stored on this
    instance only. Patching a patched model replaces its options. Returns ``model``.

    ``lm_head`` may be a PEFT LoRA layer (or become one after patching, through get_peft_model):
    the loss is then that of the adapted head, adapters' dropout and scaling included (see
    docs/integrations.md, "LoRA and frozen heads", for its memory cost and what is refused).

    Raises ValueError / TypeError naming what is missing when the model has no ``config``, no
    ``lm_head`` nn.Linear (or LoRA layer around one), or a forward without a ``labels`` argument.
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
    head = _output_layer(model)
    if "labels" not in inspect.signature(type(model).forward).parameters:
        raise ValueError(
            f"cce.transformers.patch: {type(model).__name__}.forward has no `labels` argument; "
            "expected a causal LM (*ForCausalLM)"
        )
    if is_peft_module(head):
        check_lora_layer(head)
    scale, softcap = _logit_transform(model)
    old = model.__dict__.get(_STATE_ATTR)
    if old is not None:  # re-patching: new options, same hooks
        st = _PatchState(opts, scale, softcap, old.prev_forward)
        st.heads = old.heads
        for m in st.heads:
            m.__dict__[_STATE_ATTR] = st
    else:
        # A forward already set on an instance (e.g. accelerate's device hooks) is kept and called.
        st = _PatchState(opts, scale, softcap, model.__dict__.get("forward"))
        model.__dict__["forward"] = types.MethodType(_instance_forward(type(model).forward), model)
    coef = getattr(model, "router_aux_loss_coef", None)
    if not isinstance(coef, numbers.Real):
        coef = getattr(_text_config(model)[1], "router_aux_loss_coef", None)
    st.aux_coef = float(coef) if isinstance(coef, numbers.Real) and not isinstance(coef, bool) else 0.0
    if old is not None:
        st.trl_forward = old.trl_forward
    if is_fused_head_forward(st.prev_forward):
        fused_head(st.prev_forward)  # refuses a TRL head of a form cce does not know
    model.__dict__[_STATE_ATTR] = st
    _install_head(st, head)
    _watch_forward(model)
    return model


def unpatch(model: nn.Module) -> nn.Module:
    """Undoes :func:`patch` (a no-op on an unpatched model). Returns ``model``."""
    st = model.__dict__.pop(_STATE_ATTR, None)
    if st is None:
        return model
    heads = [(m, m.__dict__.pop(_PREV_ATTR, None)) for m in st.heads]
    for m in st.heads:
        m.__dict__.pop(_STATE_ATTR, None)
    for mod, prev in ((model, st.prev_forward), *heads):
        if prev is None:
            mod.__dict__.pop("forward", None)
        else:
            mod.__dict__["forward"] = prev
    _unwatch_forward(model)
    if st.trl_forward is not None:
        # TRL installed its fused head after the patch: it gets its own one back.
        reinstall(model, fused_head(st.trl_forward))
    return model


def options(model: nn.Module) -> CCEOptions | None:
    """The options of a patched model's labelled loss (None if it is not patched).

    As a call with ``labels`` uses them: the patch's options, ``softcap`` from the model's config,
    ``shift=True`` and ``reduction="mean"``. Two things vary per call and are not shown: a call
    given ``shift_labels`` runs with ``shift=False``, and one given ``num_items_in_batch`` with
    ``reduction="sum"`` divided by it. A logit scale (Cohere's ``logit_scale``, Granite's
    ``logits_scaling``), which scales the hidden states, is not a field of :class:`cce.CCEOptions`.
    """
    st = model.__dict__.get(_STATE_ATTR)
    return None if st is None else st.call_options[("mean", True)]


def is_patched(model: nn.Module) -> bool:
    """Whether :func:`patch` is in effect on this instance."""
    return _STATE_ATTR in getattr(model, "__dict__", {})


def token_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    *,
    labels: torch.Tensor | None = None,
    temperature: float = 1.0,
    entropy: bool = False,
    **forward_kwargs,
):
    """Per-token log-probabilities (and entropies) of a patched causal LM, without its logits.

    What RL trainers compute as ``log_softmax(model(input_ids).logits / temperature)`` gathered
    at the next token: position ``s`` scores ``labels[..., s + 1]`` (``labels`` defaults to
    ``input_ids``; positions whose label is the patch's ``ignore_index`` get 0), under the
    model's own logit transforms (softcap, logit scale) and then ``temperature``::

        logits = model(input_ids, **forward_kwargs).logits.float() / temperature
        logp = torch.log_softmax(logits[:, :-1], -1)
        logprobs = logp.gather(-1, labels[:, 1:, None]).squeeze(-1)
        entropy = -(logp.exp() * logp).sum(-1)

    Returns a :class:`cce.LossOutputs` shaped ``labels[..., 1:]``: ``logprobs`` (and ``entropy``
    with ``entropy=True``) differentiable with respect to the model's parameters, ``loss`` the
    per-token cross entropy (``-logprobs`` without label smoothing). ``forward_kwargs`` (an
    attention mask, position ids, ...) go to the model's forward. ``model`` must be patched
    (:func:`patch`), whose options (``impl``, ``ignore_index``, ``filter_eps``) apply.
    """
    st = model.__dict__.get(_STATE_ATTR)
    if st is None:
        raise ValueError(
            "cce.transformers.token_logprobs: the model is not patched; call cce.transformers.patch(model)"
        )
    targets = input_ids if labels is None else labels
    forward_kwargs.pop("labels", None)
    cap = _capture(model, st, dict(forward_kwargs, input_ids=input_ids))
    if targets.shape != cap.hidden.shape[:-1]:
        raise ValueError(
            f"cce.transformers.token_logprobs: labels of shape {tuple(targets.shape)} do not match the "
            f"hidden states {tuple(cap.hidden.shape[:-1])} (leave logits_to_keep at 0)"
        )
    opts = dataclasses.replace(
        st.options, reduction="none", shift=True, softcap=st.softcap, return_lse=False,
        temperature=temperature, return_logprobs=True, return_entropy=entropy,
    )  # fmt: skip
    return _call_head_loss(st, cap, targets, opts)
