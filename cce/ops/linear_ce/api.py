"""linear_cross_entropy: the public function and module; validation and dispatch to an
implementation (impl="torch": torch_impl.py, impl="triton": triton_impl.py, a process group or
a sharded classifier: cce/distributed/)."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from ... import _math
from ..._dispatch import (
    LinearPlan,
    autocast_operands,
    is_dtensor,
    needs_grad,
    plan_torch,
    plan_triton,
    select_impl,
)
from ..._validation import check_linear_inputs, debug_checks_enabled, guard_targets
from ...options import CCEOptions
from ...outputs import assemble
from .local import block_plan
from .rows import flatten_rows


def linear_cross_entropy_with_options(
    e: torch.Tensor,
    c: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None,
    weight: torch.Tensor | None,
    opts: CCEOptions,
    process_group=None,
):
    """linear_cross_entropy with its options already in a :class:`CCEOptions`."""
    # Under autocast the operands are cast as lm_head's would be (autocast_operands; the
    # vocabulary-parallel path does the same), and autocast must not re-cast the matmuls inside
    # the ops, which compute in the operands' dtype with fp32 accumulation (it would mix dtypes in
    # their in-place accumulations).
    if process_group is not None or is_dtensor(c):
        from ...distributed.vocab_parallel import vocab_parallel_with_options

        return vocab_parallel_with_options(e, c, targets, bias, weight, opts, process_group)
    e, c, bias = autocast_operands(e, c, bias)
    check_linear_inputs(e, c, targets, bias, weight, opts)
    with torch.autocast(e.device.type, enabled=False):
        return _linear_cross_entropy(e, c, targets, bias, weight, opts, debug_checks_enabled(e.device))


def _linear_cross_entropy(e, c, targets, bias, weight, opts: CCEOptions, check_on_host: bool):
    """The call after the shape, dtype and device checks. ``check_on_host``: how the targets' range
    is checked (cce._validation.guard_targets): an IndexError now, or NaN outputs where a target
    is bad, without a host synchronisation."""
    targets, bad = guard_targets(targets, c.shape[0], opts.ignore_index, check_on_host)
    if e.shape[-1] == 0:
        # D = 0: every logit is the bias (0 without one), as e @ c.T gives. One zero feature
        # computes exactly that, and the padding's backward slices its gradients back to the
        # empty dE and dC.
        e, c = F.pad(e, (0, 1)), F.pad(c, (0, 1))
    impl = select_impl(opts.impl, e.device)
    e2d, rows, tgt, out_shape = flatten_rows(e, targets, opts.shift)
    if bad is not None:  # over the problem's rows, as tgt
        bad = (bad[..., 1:] if opts.shift else bad).reshape(-1)
    need_de, need_dc, need_db = needs_grad(e), needs_grad(c), needs_grad(bias)
    eps = opts.resolved_filter_eps(e.dtype, impl)
    args = (
        e2d, c, bias, weight, rows, tgt, opts.ignore_index, opts.reduction, opts.softcap_value,
        float(opts.label_smoothing), float(opts.z_loss), eps,
    )  # fmt: skip
    if impl == "torch":
        from .torch_impl import linear_ce_torch_fwd

        grads, cpu = need_de or need_dc or need_db, e.device.type == "cpu"
        plan = plan_torch(opts.reduction, opts.differentiable_outputs, grads, eps, cpu)
        precompute = plan.backward == "chunked-forward"
        loss, lse, tgt_logit, entropy, argmax, *_ = linear_ce_torch_fwd(
            *args, precompute, need_de, need_dc, need_db, opts.resolved_tuning.chunk_bytes,
            float(opts.temperature), opts.return_entropy, opts.return_argmax or opts.return_accuracy,
        )  # fmt: skip
        entropy = entropy if opts.return_entropy else None  # (empty when not asked for)
        argmax = argmax if (opts.return_argmax or opts.return_accuracy) else None
    else:
        from .triton_impl import linear_ce_triton

        want_argmax = opts.return_argmax or opts.return_accuracy
        loss, lse, tgt_logit, entropy, argmax = linear_ce_triton(
            *args, need_de, need_dc, need_db, opts.resolved_tuning, float(opts.temperature),
            opts.return_entropy, want_argmax,
        )  # fmt: skip
    loss = _math.nan_at_bad_targets(loss, bad)
    if opts.reduction == "none":
        loss = loss.reshape(out_shape)
    return assemble(opts, loss, lse, tgt_logit, entropy, argmax, tgt, lambda x: x.reshape(out_shape), bad)


def explain(
    e: torch.Tensor,
    c: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    weight: torch.Tensor | None = None,
    **options,
) -> LinearPlan:
    """What ``linear_cross_entropy(e, c, targets, bias, weight=weight, **options)`` would run, and
    why, without running it: a :class:`cce.LinearPlan` (print it for the rules in words).

    Decided as the call decides it, on the host, from the options (``tuning`` included), the
    tensors' shapes, dtype and device, and which gradients autograd would ask for (the tensors'
    ``requires_grad`` under the current grad mode); never from their values. For example::

        print(cce.explain(hidden, lm_head.weight, labels, shift=True))
        # impl='triton', backward='sparse', filter_eps=0.00391
        #   - filtered from the forward's tile statistics (the sparse backward)

    With vocabulary parallelism (``process_group``, a sharded ``c``) it is this rank's plan: its
    block of classes posed as a one-device problem with per-token upstream gradients
    (cce/ops/linear_ce/local.py); the set-up checks that need the group are not run (explaining
    does not communicate).
    """
    group = options.pop("process_group", None)
    opts = CCEOptions(**options)
    e, c, bias = autocast_operands(e, c, bias)
    impl = select_impl(opts.impl, e.device)
    need_de, need_dc, need_db = needs_grad(e), needs_grad(c), needs_grad(bias)
    eps = opts.resolved_filter_eps(e.dtype, impl)
    D = max(e.shape[-1], 1)  # (D = 0 runs as one zero feature)
    if group is not None or is_dtensor(c):
        c_r = c.to_local() if is_dtensor(c) else c
        _, _, tgt, _ = flatten_rows(e, targets, opts.shift)
        return block_plan(
            impl, opts.resolved_tuning, e.dtype, (tgt.numel(), c_r.shape[0], D), (need_de, need_dc, need_db),
            opts.softcap_value, opts.label_smoothing > 0, eps, c_r.device,
        )  # fmt: skip
    check_linear_inputs(e, c, targets, bias, weight, opts)
    _, _, tgt, _ = flatten_rows(e, targets, opts.shift)
    if impl == "torch":
        grads, cpu = need_de or need_dc or need_db, e.device.type == "cpu"
        smooth_cap = opts.label_smoothing > 0 and opts.softcap_value > 0
        return plan_torch(opts.reduction, opts.differentiable_outputs, grads, eps, cpu, smooth_cap)
    from .triton_backward import with_slab_plan  # triton is optional: imported on use

    shape = (tgt.numel(), c.shape[0], D)
    plan = plan_triton(
        opts.resolved_tuning, opts.reduction, e.dtype, shape, (need_de, need_dc, need_db),
        opts.softcap_value, float(opts.label_smoothing), eps, c.is_cuda,
    )  # fmt: skip
    return with_slab_plan(plan, opts.resolved_tuning, e.dtype, shape, need_dc)


def linear_cross_entropy(
    e: torch.Tensor,
    c: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    shift: bool = False,
    softcap: float | None = None,
    label_smoothing: float = 0.0,
    weight: torch.Tensor | None = None,
    z_loss: float = 0.0,
    filter_eps: float | str | None = "auto",
    impl: str = "auto",
    return_lse: bool = False,
    temperature: float = 1.0,
    return_logprobs: bool = False,
    return_entropy: bool = False,
    return_argmax: bool = False,
    return_accuracy: bool = False,
    process_group=None,
):
    """Cross entropy of the linear classifier ``e @ c.T + bias``, without materializing the logits.

    Equivalent plain PyTorch (up to fp32 rounding and the documented differences below)::

        logits = (e @ c.T + bias).float()
        if softcap: logits = softcap * torch.tanh(logits / softcap)
        logits = logits / temperature
        if shift: logits, targets = logits[..., :-1, :], targets[..., 1:]
        loss = F.cross_entropy(logits.flatten(0, -2), targets.flatten(), weight=weight,
                               ignore_index=ignore_index, reduction=reduction,
                               label_smoothing=label_smoothing)
        # plus z_loss * logsumexp(logits)**2 for every non-ignored token

    Args:
        e: hidden states ``(..., D)``, float32 / bfloat16 / float16.
        c: classifier weight ``(V, D)`` (``lm_head.weight``), same dtype as ``e``.
        targets: integer class ids shaped ``e.shape[:-1]``.
        bias: optional classifier bias ``(V,)``.
        ignore_index: targets equal to it contribute nothing.
        reduction: ``"mean"`` (over non-ignored tokens, weighted by ``weight`` if given),
            ``"sum"`` or ``"none"``.
        shift: causal LM shift, predicting ``targets[..., 1:]`` from ``e[..., :-1, :]`` (no copy).
        softcap: ``logits = softcap * tanh(logits / softcap)`` (Gemma 2/3); None disables it.
        label_smoothing: as in ``F.cross_entropy``.
        weight: class weights ``(V,)`` as in ``F.cross_entropy`` (not differentiated).
        z_loss: adds ``z_loss * lse**2`` to every non-ignored token's loss.
        filter_eps: gradient filtering threshold: ``"auto"`` (by dtype), a float, or None (exact).
        impl: ``"auto"`` (Triton on CUDA, PyTorch elsewhere), ``"triton"`` or ``"torch"``.
        return_lse: also return the (differentiable) log-sum-exp per token, 0 at ignored tokens.
        temperature: divides the logits (after softcap), as samplers apply it; every output is
            of the divided logits.
        return_logprobs: also return the target token's log-probability
            (``log_softmax(logits).gather(-1, targets)``), differentiable.
        return_entropy: also return the softmax's entropy per token, differentiable.
        return_argmax: also return the argmax id per token (ties: the smallest id).
        return_accuracy: also return the share of non-ignored tokens whose argmax is the target.
            With any of these four the result is a :class:`cce.LossOutputs` (loss first; the
            outputs' conventions at ignored tokens are documented there). A temperature keeps
            gradient filtering (the filter sees the tempered logits). With impl="triton" the
            outputs, and gradients through the log-probabilities or the entropy, keep the
            sparse (filtered) backward; with impl="torch", or where the fused or recomputing
            path was chosen, a gradient through the entropy runs an exact one.
        process_group: vocabulary parallelism: ``c`` (and ``bias`` / ``weight``) are this rank's
            contiguous block of classifier rows, ``e`` and ``targets`` (global ids) are the same
            on every rank (see :mod:`cce.distributed`). A ``DTensor`` ``c`` sharded ``Shard(0)``
            selects this mode by itself.

    Returns:
        The loss in float32 (float64 for float64 inputs with impl="torch"): a scalar, or per
        token shaped like ``targets`` (``targets[..., 1:]`` with ``shift``) for
        ``reduction="none"``, 0 at ignored positions. With ``return_lse``,
        ``(loss, lse)``; with a per-token output, a :class:`cce.LossOutputs`. A "mean" over an
        all-ignored batch is 0.0 with zero gradients (not NaN). Gradients come back in each
        input's dtype; inputs are never modified.
    """
    opts = CCEOptions(
        ignore_index=ignore_index,
        reduction=reduction,
        shift=shift,
        softcap=softcap,
        label_smoothing=label_smoothing,
        z_loss=z_loss,
        filter_eps=filter_eps,
        impl=impl,
        return_lse=return_lse,
        temperature=temperature,
        return_logprobs=return_logprobs,
        return_entropy=return_entropy,
        return_argmax=return_argmax,
        return_accuracy=return_accuracy,
    )
    return linear_cross_entropy_with_options(e, c, targets, bias, weight, opts, process_group)


class LinearCrossEntropy(nn.Module):
    """Module form of :func:`linear_cross_entropy`: ``forward(e, c, targets, bias=None)``.

    Replaces ``lm_head`` + ``nn.CrossEntropyLoss``: pass the hidden states and the head's weight
    instead of logits. Takes the same keyword options; ``weight`` is kept as a buffer and
    ``process_group`` (vocabulary parallelism) as an attribute.
    """

    def __init__(
        self,
        *,
        ignore_index: int = -100,
        reduction: str = "mean",
        shift: bool = False,
        softcap: float | None = None,
        label_smoothing: float = 0.0,
        weight: torch.Tensor | None = None,
        z_loss: float = 0.0,
        filter_eps: float | str | None = "auto",
        impl: str = "auto",
        return_lse: bool = False,
        temperature: float = 1.0,
        return_logprobs: bool = False,
        return_entropy: bool = False,
        return_argmax: bool = False,
        return_accuracy: bool = False,
        process_group=None,
    ) -> None:
        super().__init__()
        self.process_group = process_group
        self.options = CCEOptions(
            ignore_index=ignore_index,
            reduction=reduction,
            shift=shift,
            softcap=softcap,
            label_smoothing=label_smoothing,
            z_loss=z_loss,
            filter_eps=filter_eps,
            impl=impl,
            return_lse=return_lse,
            temperature=temperature,
            return_logprobs=return_logprobs,
            return_entropy=return_entropy,
            return_argmax=return_argmax,
            return_accuracy=return_accuracy,
        )
        self.register_buffer("weight", weight)

    def forward(
        self,
        e: torch.Tensor,
        c: torch.Tensor,
        targets: torch.Tensor,
        bias: torch.Tensor | None = None,
    ):
        return linear_cross_entropy_with_options(
            e, c, targets, bias, self.weight, self.options, self.process_group
        )

    def extra_repr(self) -> str:
        extra = {} if self.process_group is None else {"process_group": self.process_group}
        return options_repr(self.options, self.weight, LINEAR_REPR_ALWAYS, **extra)


# The options a module's repr always shows; every other one is shown where it is not the default.
LINEAR_REPR_ALWAYS: tuple[str, ...] = (
    "reduction", "ignore_index", "shift", "softcap", "label_smoothing", "z_loss", "filter_eps", "impl",
)  # fmt: skip
_DEFAULT_OPTIONS = CCEOptions()


def options_repr(
    opts: CCEOptions,
    weight: torch.Tensor | None,
    always: tuple[str, ...],
    skip: tuple[str, ...] = (),
    **extra: object,
) -> str:
    """A loss module's extra_repr: the options named in ``always`` (in that order), then every
    other field of ``opts`` not in ``skip`` that differs from its default (in field order), the
    class weights' shape where given, and ``extra`` (name=value) as they are."""
    rest = [f.name for f in dataclasses.fields(CCEOptions) if f.name not in always and f.name not in skip]
    shown = [*always, *(n for n in rest if getattr(opts, n) != getattr(_DEFAULT_OPTIONS, n))]
    parts = [f"{n}={getattr(opts, n)!r}" for n in shown]
    if weight is not None:
        parts.append(f"weight=<tensor of shape {tuple(weight.shape)}>")
    parts += [f"{k}={v!r}" for k, v in extra.items()]
    return ", ".join(parts)
