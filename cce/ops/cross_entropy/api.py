"""cross_entropy over existing logits: the public function, CrossEntropyLoss, CausalLMLoss, dispatch.

For callers that already hold the logits (a model that must return them, distillation, RL
log-probabilities). Logits are ``(..., V)``: the class dim is LAST (the LLM convention), unlike
``torch.nn.CrossEntropyLoss``'s ``(N, C, d1, ...)``; for 2-D ``(N, V)`` logits the two agree.
"""

from __future__ import annotations

import torch
from torch import nn

from ... import _math
from ..._dispatch import select_impl
from ..._validation import check_logits_inputs, debug_checks_enabled, guard_targets
from ...options import CCEOptions
from ...outputs import assemble
from ..linear_ce.api import options_repr


def _check_inplace(logits: torch.Tensor, inplace_backward: bool) -> None:
    if not isinstance(inplace_backward, bool):
        raise TypeError(f"inplace_backward must be a bool, got {inplace_backward!r}")
    if not (inplace_backward and logits.requires_grad):
        return
    base = logits
    while base._base is not None:  # a view of a leaf shares the leaf's storage too
        base = base._base
    if base.is_leaf:
        raise ValueError(
            "inplace_backward=True overwrites the logits with their gradient, but these logits "
            f"(shape {tuple(logits.shape)}) are a leaf tensor that requires grad (or a view of one): "
            "its .grad would alias its data. Use it on intermediate logits (e.g. the lm_head output), or set "
            "inplace_backward=False"
        )


def _flat_targets(targets: torch.Tensor, opts: CCEOptions) -> torch.Tensor:
    """Targets aligned with the rows of the logits, flat int64 [N].

    With shift, row (..., s) predicts targets[..., s + 1] and the last position of each sequence is
    ignored: the logits are read in place (never sliced into a copy) at the price of B skipped rows.
    """
    return _row_aligned(targets.long(), opts.shift, opts.ignore_index)


def _row_aligned(x: torch.Tensor, shift: bool, fill: int | bool) -> torch.Tensor:
    """A per-target tensor aligned with the rows of the logits, flat [N]; with shift, position s
    holds x[..., s + 1] and each sequence's last position ``fill``."""
    if shift:
        x = torch.cat([x[..., 1:], torch.full_like(x[..., :1], fill)], dim=-1)
    return x.reshape(-1)


def _resolve_impl(opts: CCEOptions, logits: torch.Tensor) -> str:
    impl = select_impl(opts.impl, logits.device)
    if impl == "triton" and logits.dtype == torch.float64:
        if opts.impl == "triton":
            raise TypeError(
                "impl='triton' supports float32 / bfloat16 / float16 logits, got float64; "
                "use impl='torch' (or 'auto')"
            )
        return "torch"
    return impl


def cross_entropy_with_options(
    logits: torch.Tensor,
    targets: torch.Tensor,
    weight: torch.Tensor | None,
    opts: CCEOptions,
    inplace_backward: bool = False,
):
    """cross_entropy with its options already in a :class:`CCEOptions` (``filter_eps`` unused)."""
    check_logits_inputs(logits, targets, weight, opts)
    _check_inplace(logits, inplace_backward)
    host = debug_checks_enabled(logits.device)
    return _cross_entropy(logits, targets, weight, opts, inplace_backward, host)


def _cross_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    weight: torch.Tensor | None,
    opts: CCEOptions,
    inplace_backward: bool,
    check_on_host: bool,
):
    """The call after the shape, dtype and device checks. ``check_on_host``: how the targets' range
    is checked (cce._validation.guard_targets): an IndexError now, or NaN outputs where a target
    is bad, without a host synchronisation."""
    targets, bad = guard_targets(targets, logits.shape[-1], opts.ignore_index, check_on_host)
    impl = _resolve_impl(opts, logits)
    t = _flat_targets(targets, opts)
    bad = None if bad is None else _row_aligned(bad, opts.shift, False)  # over the rows, as t
    # Reduced loss without lse output: the backward's row coefficients are a fixed vector times the
    # upstream scalar, so they are computed in the forward (see autograd.py).
    precompute = (
        opts.reduction != "none"
        and not opts.differentiable_outputs
        and logits.requires_grad
        and torch.is_grad_enabled()
    )
    want_argmax = opts.return_argmax or opts.return_accuracy
    args = (
        logits, t, weight, opts.ignore_index, opts.reduction, opts.softcap_value,
        float(opts.label_smoothing), float(opts.z_loss), inplace_backward, precompute,
        opts.resolved_tuning.chunk_bytes, float(opts.temperature), opts.return_entropy, want_argmax,
    )  # fmt: skip
    if impl == "torch":
        from .torch_impl import ce_torch_fwd as fwd
    else:
        from .triton_impl import ce_triton_fwd as fwd
    # The loss is computed in fp32 from the logits as given; autocast must not re-cast inside.
    with torch.autocast(logits.device.type, enabled=False):
        loss, lse, tgt_logit, entropy, argmax, *_ = fwd(*args)

    def per_token(x: torch.Tensor) -> torch.Tensor:
        x = x.reshape(targets.shape)
        return x[..., :-1].contiguous() if opts.shift else x

    loss = _math.nan_at_bad_targets(loss, bad)
    if opts.reduction == "none":
        loss = per_token(loss)
    entropy = entropy if opts.return_entropy else None  # (empty when not asked for)
    argmax = argmax if want_argmax else None
    return assemble(opts, loss, lse, tgt_logit, entropy, argmax, t, per_token, bad)


def cross_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    shift: bool = False,
    softcap: float | None = None,
    label_smoothing: float = 0.0,
    weight: torch.Tensor | None = None,
    z_loss: float = 0.0,
    inplace_backward: bool = False,
    impl: str = "auto",
    return_lse: bool = False,
    temperature: float = 1.0,
    return_logprobs: bool = False,
    return_entropy: bool = False,
    return_argmax: bool = False,
    return_accuracy: bool = False,
):
    """Fused cross entropy over existing logits ``(..., V)`` (class dim LAST, the LLM convention).

    Equivalent plain PyTorch (up to fp32 rounding and the documented differences below)::

        L = logits.float()
        if softcap: L = softcap * torch.tanh(L / softcap)
        L = L / temperature
        if shift: L, targets = L[..., :-1, :], targets[..., 1:]
        loss = F.cross_entropy(L.flatten(0, -2), targets.flatten(), weight=weight,
                               ignore_index=ignore_index, reduction=reduction,
                               label_smoothing=label_smoothing)
        # plus z_loss * logsumexp(L)**2 for every non-ignored token

    but the forward reads the logits once and keeps only per-row statistics (no fp32 copy, no
    probabilities), and the backward reads them once more and writes the gradient once.

    Args:
        logits: ``(..., V)`` float32 / bfloat16 / float16 (float64 with impl="torch"), any strides.
            A class dim that is not unit-stride is copied once (with ``inplace_backward`` the
            gradient is then copied back into the logits); any leading strides are read in place.
        targets: integer class ids shaped ``logits.shape[:-1]``.
        ignore_index: targets equal to it contribute nothing (their rows are not even read).
        reduction: ``"mean"`` (over non-ignored tokens, weighted by ``weight`` if given),
            ``"sum"`` or ``"none"``.
        shift: causal LM shift, predicting ``targets[..., 1:]`` from ``logits[..., :-1, :]``. The
            logits are not copied: the last position of each sequence is simply skipped.
        softcap: ``L = softcap * tanh(logits / softcap)`` (Gemma 2/3); None disables it.
        label_smoothing: as in ``F.cross_entropy``.
        weight: class weights ``(V,)`` as in ``F.cross_entropy`` (not differentiated).
        z_loss: adds ``z_loss * lse**2`` to every non-ignored token's loss.
        inplace_backward: write the gradient into the logits' own buffer instead of a new N x V
            tensor (saves one logits-sized allocation). Valid when nothing reads the logits after
            this loss: the usual case of the ``lm_head`` output, whose matmul backward needs only
            the gradient. Autograd's version counter raises an error if another op saved the
            logits for its backward (e.g. a ``tanh`` applied before this loss). A leaf tensor that
            requires grad is refused (its ``.grad`` would alias its data). Under ``torch.compile``
            the functionalized graph may still allocate a copy.
        impl: ``"auto"`` (Triton on CUDA, PyTorch elsewhere), ``"triton"`` or ``"torch"``.
        return_lse: also return the (differentiable) log-sum-exp per token, 0 at ignored tokens.
        temperature, return_logprobs, return_entropy, return_argmax, return_accuracy: as in
            :func:`cce.linear_cross_entropy` (a :class:`cce.LossOutputs` is returned with any of
            the four outputs), formed by the same pass over the logits as the loss.

    Returns:
        The loss in float32 (float64 for float64 inputs with impl="torch"): a scalar, or per
        token shaped like ``targets`` (``targets[..., 1:]`` with ``shift``) for
        ``reduction="none"``, 0 at ignored positions. With ``return_lse``,
        ``(loss, lse)``; with a per-token output, a :class:`cce.LossOutputs`. A "mean" over an
        all-ignored batch is 0.0 with zero gradients (not NaN). The gradient comes back in the
        logits' dtype.
    """
    opts = CCEOptions(
        ignore_index=ignore_index, reduction=reduction, shift=shift, softcap=softcap,
        label_smoothing=label_smoothing, z_loss=z_loss, impl=impl, return_lse=return_lse,
        temperature=temperature, return_logprobs=return_logprobs, return_entropy=return_entropy,
        return_argmax=return_argmax, return_accuracy=return_accuracy,
    )  # fmt: skip
    return cross_entropy_with_options(logits, targets, weight, opts, inplace_backward)


class CrossEntropyLoss(nn.Module):
    """Module form of :func:`cross_entropy`: ``forward(logits, targets)``.

    A drop-in for ``nn.CrossEntropyLoss`` on LLM logits, with the class dim LAST: logits
    ``(..., V)`` and targets ``(...)`` (for 2-D ``(N, V)`` logits this is the same layout as
    ``nn.CrossEntropyLoss``). Takes :func:`cross_entropy`'s keyword options; ``weight`` may also
    be passed first, positionally, as in ``nn.CrossEntropyLoss``, and is kept as a buffer.
    """

    def __init__(
        self,
        weight: torch.Tensor | None = None,
        *,
        ignore_index: int = -100,
        reduction: str = "mean",
        shift: bool = False,
        softcap: float | None = None,
        label_smoothing: float = 0.0,
        z_loss: float = 0.0,
        inplace_backward: bool = False,
        impl: str = "auto",
        return_lse: bool = False,
        temperature: float = 1.0,
        return_logprobs: bool = False,
        return_entropy: bool = False,
        return_argmax: bool = False,
        return_accuracy: bool = False,
    ) -> None:
        super().__init__()
        self.options = CCEOptions(
            ignore_index=ignore_index, reduction=reduction, shift=shift, softcap=softcap,
            label_smoothing=label_smoothing, z_loss=z_loss, impl=impl, return_lse=return_lse,
            temperature=temperature, return_logprobs=return_logprobs, return_entropy=return_entropy,
            return_argmax=return_argmax, return_accuracy=return_accuracy,
        )  # fmt: skip
        if not isinstance(inplace_backward, bool):
            raise TypeError(f"inplace_backward must be a bool, got {inplace_backward!r}")
        self.inplace_backward = inplace_backward
        self.register_buffer("weight", weight)

    def forward(self, logits: torch.Tensor, targets: torch.Tensor):
        return cross_entropy_with_options(logits, targets, self.weight, self.options, self.inplace_backward)

    def extra_repr(self) -> str:
        return options_repr(
            self.options, self.weight, LOGITS_REPR_ALWAYS, skip=("filter_eps",),
            inplace_backward=self.inplace_backward,
        )  # fmt: skip


# The options CrossEntropyLoss's repr always shows (filter_eps, unused at the logits level, never).
LOGITS_REPR_ALWAYS: tuple[str, ...] = (
    "reduction", "ignore_index", "shift", "softcap", "label_smoothing", "z_loss", "impl",
)  # fmt: skip


class CausalLMLoss(CrossEntropyLoss):
    """Next-token loss on unshifted logits and labels: ``CrossEntropyLoss(shift=True)``.

    ``forward(logits, labels)`` with logits ``(B, T, V)`` (class dim LAST) and labels ``(B, T)``
    as a causal LM returns them; position ``s`` is scored against ``labels[:, s + 1]``, without
    copying ``logits[:, :-1]``.
    """

    def __init__(
        self,
        weight: torch.Tensor | None = None,
        *,
        ignore_index: int = -100,
        reduction: str = "mean",
        softcap: float | None = None,
        label_smoothing: float = 0.0,
        z_loss: float = 0.0,
        inplace_backward: bool = False,
        impl: str = "auto",
        return_lse: bool = False,
        temperature: float = 1.0,
        return_logprobs: bool = False,
        return_entropy: bool = False,
        return_argmax: bool = False,
        return_accuracy: bool = False,
    ) -> None:
        super().__init__(
            weight, ignore_index=ignore_index, reduction=reduction, shift=True, softcap=softcap,
            label_smoothing=label_smoothing, z_loss=z_loss, inplace_backward=inplace_backward,
            impl=impl, return_lse=return_lse, temperature=temperature, return_logprobs=return_logprobs,
            return_entropy=return_entropy, return_argmax=return_argmax, return_accuracy=return_accuracy,
        )  # fmt: skip
