"""Vocabulary-parallel linear cross entropy over ``torch.distributed``, and FSDP2-sharded heads.

Vocabulary parallelism (Megatron / flash-attn style): every rank of a process group holds a
contiguous block of classifier rows ``c_local`` (blocks in rank order, sizes may differ), the
same hidden states ``e`` and the same global ``targets``. Each rank reduces its block of logits
to per-token statistics (see cce/_math.py)::

    lse_r = logsumexp_{v in block r} L_v,   tgt_r = L_t if t in block r else 0,
    ssum_r = sum_{v in block r} w_v L_v,   W_r = sum_{v in block r} w_v

one all-gather of these (O(N) per rank, never O(N V)) gives the global ones

    lse = logsumexp_r lse_r,  tgt = sum_r tgt_r,  ssum = sum_r ssum_r,  W = sum_r W_r

and the loss is ``_math.token_loss`` of them: the same on every rank, equal to the one-device
loss. The combine is plain differentiable torch; autograd hands each rank's local op upstream
gradients (g_lse, g_tgt, g_ssum) on its own statistics, so that its logit gradient is

    dL_v = g_lse p_v + g_tgt [v == t] + g_ssum w_v,     p_v = exp(L_v - lse_r)

which is the kernels' (alpha, beta, gamma) form with alpha = g_lse, beta = -g_tgt,
gamma = -g_ssum (g_lse p_v equals the global alpha times the global softmax, since
g_lse = alpha exp(lse_r - lse)). dC_local and dbias_local stay local; dE is summed over ranks
by an all-reduce in backward (the only collective there).

Either implementation runs its single-device forward op and that op's backward on the block
(local.block_stats): for impl="triton" the same tile statistics, vocabulary order, backward
algorithm and stash as one device; for impl="torch" the chunked loop. dE is written in e's dtype
and summed over ranks in that dtype (SumGrad): with impl="triton" no fp32 gradient buffer exists
(impl="torch" accumulates in fp32 per chunk loop, as on one device). The filter is
the one device's on the block's softmax p_loc = exp(L - lse_r) = p exp(lse - lse_r) >= p (on
CPU only with impl="torch", as on one device): an entry it skips (p_loc < eps) has p < eps too, so
the skipped set is one the single-device bound covers (a subset of what eps would skip on the
global softmax, tile by tile in the block's own vocabulary order). Summing k bf16 shares
costs roundings: each rank rounds its share once (2^-8 relative to the share), and the sum is
rounded once per addition (k - 1; NCCL adds in fp32 and rounds to the dtype). At k = 2 dE's
error is at most 2^-8 (|dE_0| + |dE_1| + |dE|) per entry against 2^-8 |dE| on one device:
about sqrt(3) times one device's rounding (independent roundings), more only where the shares
cancel (|dE_r| > |dE|). Keeping an fp32 dE for the sum would cost N x D x 4 bytes beyond the
gradients (128 MiB at llama3-8b's D and N = 8192), against the memory target.

Replicated-loss convention: the loss is computed redundantly on every rank, so the backward of
the all-gather just takes this rank's slice (no communication). This is exact when every rank
back-propagates the same upstream gradient, which is the case for ``loss.backward()`` on the
replicated loss (as in Megatron's vocab-parallel cross entropy).

The set-up is checked across ranks at its first call (setup.py; cached, no host
synchronisation afterwards). The rank's own work goes through
the implementations' per-block interface, cce/ops/linear_ce/local.py. FSDP2 (data parallel,
each rank its own tokens) is a different set-up: fsdp.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .. import _math
from .._dispatch import autocast_operands, is_dtensor, needs_grad, select_impl
from .._validation import debug_checks_enabled, guard_targets
from ..ops.linear_ce.local import block_stats, logits_at
from ..ops.linear_ce.rows import flatten_rows
from ..options import CCEOptions
from ..outputs import assemble
from .collectives import (
    GatherReplicated,
    GatherSummed,
    GatherTokens,
    ScaleGrad,
    SumGrad,
    all_gather,
)
from .setup import Layout, check_setup, from_dtensor, replicated_local

# ---------------------------------------------------------------------------------------------
# Public entry points
# ---------------------------------------------------------------------------------------------


@dataclass
class _Rows:
    """Per-token results over the whole vocabulary for the problem's rows (fp32 [N] unless
    noted; lse, tgt and entropy 0 at ignored rows)."""

    loss: torch.Tensor  # the token losses (_math.token_loss)
    lse: torch.Tensor
    tgt: torch.Tensor  # the target logit
    valid: torch.Tensor  # [N] bool
    w_t: torch.Tensor  # the target's class weight
    entropy: torch.Tensor | None
    argmax: torch.Tensor | None  # [N] int64 global ids

    def select(self, rows: slice) -> _Rows:
        def pick(x):
            return None if x is None else x[rows]

        return _Rows(*(pick(getattr(self, f)) for f in self.__dataclass_fields__))


def _stats_loss(e2d, rows, tgt, c, bias, weight, opts: CCEOptions, lay: Layout, impl, group, tokens_sharded):
    """Per-token results (:class:`_Rows`) over the whole vocabulary for the rows e2d[rows] and
    the global targets tgt, from this rank's block and one all-gather of statistics.

    With the per-token outputs each block also gives its entropy H_r (of its own softmax, whose
    lse is lse_r) and its argmax. They combine as (O(N) more in the same all-gather)

        H = sum_r w_r (H_r + lse - lse_r),   w_r = exp(lse_r - lse)   (w_r: block r's mass)

    (since -sum_v p_v log p_v over block r = w_r (H_r - log w_r)) and the argmax is the
    block argmax of the first rank whose maximum logit (local.logits_at) is the largest: blocks
    are contiguous in rank order, so ties go to the smallest id as in torch.argmax. The gathered
    ids are fp32, exact below 2^24 classes (checked). Autograd takes H's gradient to lse_r and
    H_r; the rank's op turns the latter into the entropy's term of its logit gradient.
    """
    valid = tgt != opts.ignore_index
    start, V_local = lay.start, c.shape[0]
    inblk = valid & (tgt >= start) & (tgt < start + V_local)
    # The block's one-device problem (ignore_index -1): the target's id in the block, a stand-in
    # for rows whose target lives on another rank (they need lse; their target term is dropped
    # below, so its gradient is 0), -1 at ignored rows. The stand-in is a class of finite logit
    # (the block's largest bias: a class a -inf bias masks would give the kernels' target terms
    # 0 * -inf), found on the device.
    # A block whose classes a -inf bias masks whole (a padded vocabulary's last rank; decided on
    # the device) has no finite logit, and its one-device statistics would be NaN (a softmax of
    # -inf only): it runs on a bias of 0 instead, and then counts with lse_r = -inf, so that it
    # adds no mass, and its gradients are 0. (With a softcap a -inf bias is the finite -softcap.)
    dead = None
    if bias is not None and not opts.softcap_value:
        dead = torch.isneginf(bias.detach()).all()
        bias = torch.where(dead, torch.zeros_like(bias), bias)
    stand_in = torch.zeros((), dtype=tgt.dtype, device=tgt.device) if bias is None else bias.detach().argmax()
    local_t = torch.where(valid, torch.where(inblk, tgt - start, stand_in), -1)
    smoothing = opts.label_smoothing > 0
    want_ent = opts.return_entropy
    want_amax = opts.return_argmax or opts.return_accuracy
    if want_amax and lay.V > 2**24:
        raise ValueError(f"the argmax under vocabulary parallelism supports up to 2^24 classes, got {lay.V}")
    softcap, temperature, eps = (
        opts.softcap_value,
        float(opts.temperature),
        opts.resolved_filter_eps(e2d.dtype, impl),
    )
    # Replicated tokens: dE is summed over the ranks (SumGrad, in e's dtype). Sharded tokens: the
    # all-gather of the tokens reduce-scatters it.
    e_in = e2d if tokens_sharded or not needs_grad(e2d) else SumGrad.apply(e2d, group)
    lse_r, tgt_r, ssum_r, ent_r, amax_r = block_stats(
        impl, e_in, c, bias, weight, rows, local_t, softcap, smoothing, eps, needs_grad(e2d), needs_grad(c),
        needs_grad(bias), opts.resolved_tuning, temperature, want_ent, want_amax,
    )  # fmt: skip
    tgt_r = torch.where(inblk, tgt_r, 0.0)  # the stand-in target of rows on other ranks
    if dead is not None:
        lse_r = torch.where(dead, float("-inf"), lse_r)  # no mass (w_r = 0: no gradient either)
        if smoothing:  # the masked logits' sum, as on one device
            ssum_r = torch.where(dead, float("-inf"), ssum_r)

    # One all-gather of everything the loss needs: lse, tgt[, ssum][, H][, max, argmax][, w_t, W].
    parts = [lse_r, tgt_r]
    if smoothing:
        parts.append(ssum_r)
    if want_ent:
        parts.append(ent_r.float())
    if want_amax:
        top = logits_at(e2d.detach(), rows, c.detach(), None if bias is None else bias.detach(),
                        amax_r, softcap, temperature, opts.resolved_tuning.chunk_bytes)  # fmt: skip
        if dead is not None:
            top = torch.where(dead, float("-inf"), top)  # never the largest logit
        parts += [top, (amax_r + start).float()]
    if weight is not None:
        wl = weight.to(lse_r.dtype)
        w_t_r = torch.where(inblk, wl[local_t.clamp(min=0)], 0.0)  # w_t where t is in my block
        parts += [w_t_r, wl.sum().reshape(1)]
    gather = GatherSummed if tokens_sharded else GatherReplicated
    G = gather.apply(torch.cat(parts), group).float()  # [world, K]
    return _combine(G, valid, opts, lay.V, want_ent, want_amax, weight is not None)


def _combine(
    G: torch.Tensor, valid: torch.Tensor, opts: CCEOptions, V: int, want_ent: bool, want_amax: bool,
    weighted: bool,
) -> _Rows:  # fmt: skip
    """The per-token results (:class:`_Rows`) from the all-gathered statistics G [world, K] of
    _stats_loss (in its order: lse_r, tgt_r[, ssum_r][, H_r][, top, argmax][, w_t, W]), over the
    whole vocabulary of V classes."""
    N = valid.numel()
    smoothing = opts.label_smoothing > 0

    def take(k: int) -> torch.Tensor:
        nonlocal off
        out = G[:, off : off + k]
        off += k
        return out

    off = 0
    lse_all = take(N)
    lse = torch.logsumexp(lse_all, dim=0)
    tgt_g = take(N).sum(0)
    ssum = take(N).sum(0) if smoothing else None
    entropy = argmax = None
    if want_ent:
        w = torch.exp(lse_all - lse)
        # (a block of no mass, w = 0 with lse_r = -inf, adds 0: not 0 * inf, nor in the gradient)
        d = torch.where(w > 0, take(N) + lse - lse_all, 0.0)
        entropy = torch.where(valid, (w * d).sum(0), 0.0)
    if want_amax:
        top_all, ids = take(N), take(N)
        argmax = ids.gather(0, top_all.argmax(0, keepdim=True)).squeeze(0).long()
    if weighted:
        w_t = take(N).sum(0).detach()
        W = take(1).sum().detach()
    else:
        w_t = valid.float()
        W = float(V)
    k = _math.LossConsts(float(opts.label_smoothing), float(opts.z_loss), V)
    loss = _math.token_loss(lse, tgt_g, ssum, w_t, W, valid, k)
    return _Rows(
        loss, torch.where(valid, lse, 0.0), torch.where(valid, tgt_g, 0.0), valid, w_t, entropy, argmax
    )


def _guard(targets: torch.Tensor, V: int, opts: CCEOptions) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The targets the kernels may read and, where the range is not checked on the host, the
    problem rows whose target was bad (after the shift), for _finish (cce._validation.guard_targets
    against the global V: no host synchronisation on accelerators)."""
    targets, bad = guard_targets(targets, V, opts.ignore_index, debug_checks_enabled(targets.device))
    if bad is not None:
        bad = (bad[..., 1:] if opts.shift else bad).reshape(-1)
    return targets, bad


def _finish(r: _Rows, tgt: torch.Tensor, opts: CCEOptions, out_shape, bad: torch.Tensor | None = None):
    """The reduced loss and the outputs; NaN where a target was bad (``bad``: per problem row)."""
    loss = _math.nan_at_bad_targets(_math.reduce_loss(r.loss, r.w_t, opts.reduction), bad)
    if opts.reduction == "none":
        loss = loss.reshape(out_shape)
    return assemble(opts, loss, r.lse, r.tgt, r.entropy, r.argmax, tgt, lambda x: x.reshape(out_shape), bad)


def _group_of(c, bias, weight, process_group):
    global_V = None
    if is_dtensor(c):
        c, bias, weight, process_group, global_V = from_dtensor(c, bias, weight, process_group)
    if process_group is None:
        raise ValueError(
            "vocabulary parallelism needs process_group= (or a DTensor classifier sharded Shard(0))"
        )
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized (call init_process_group first)")
    return c, bias, weight, process_group, global_V


def vocab_parallel_with_options(
    e: torch.Tensor,
    c: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None,
    weight: torch.Tensor | None,
    opts: CCEOptions,
    process_group=None,
    *,
    check_replicated: bool = True,
    check: str = "once",
):
    """:func:`linear_cross_entropy_vocab_parallel` with its options in a :class:`CCEOptions`
    (the form ``cce.linear_cross_entropy_with_options`` dispatches to). Under autocast the
    operands are cast to its dtype first, as on one device (cce._dispatch.autocast_operands)."""
    e, c, bias = autocast_operands(e, c, bias)
    with torch.autocast(e.device.type if isinstance(e, torch.Tensor) else "cpu", enabled=False):
        c, bias, weight, group, global_V = _group_of(c, bias, weight, process_group)
        e = replicated_local("e", e)
        targets = replicated_local("targets", targets)
        lay = check_setup(e, c, targets, bias, weight, opts, group, check_replicated, global_V, check=check)
        targets, bad = _guard(targets, lay.V, opts)
        impl = select_impl(opts.impl, e.device)
        e2d, rows, tgt, out_shape = flatten_rows(e, targets, opts.shift)
        out = _stats_loss(e2d, rows, tgt, c, bias, weight, opts, lay, impl, group, tokens_sharded=False)
        return _finish(out, tgt, opts, out_shape, bad)


def vocab_parallel_sharded_tokens(
    e: torch.Tensor,
    c: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None,
    weight: torch.Tensor | None,
    opts: CCEOptions,
    process_group=None,
    *,
    grad_divide: float = 1.0,
):
    """Vocabulary parallelism when every rank has its own tokens (data parallel, e.g. FSDP2).

    The tokens (``e`` rows, O(N D) per rank, after the shift) are all-gathered instead of the
    classifier (O(V D)); every rank computes its block's statistics for all ranks' tokens, the
    statistics are combined as in :func:`linear_cross_entropy_vocab_parallel`, and each rank
    returns the loss of its own tokens (and the per-token outputs asked for in ``opts``, its
    accuracy over its own tokens). Backward: each rank's ``e`` gets the gradient of its own
    loss (a reduce-scatter); ``c_local`` / ``bias`` get the sum over ranks of every rank's loss
    gradient for the block, divided by ``grad_divide`` (the number of ranks reproduces FSDP2's
    gradient averaging). Ranks may hold different numbers of tokens.
    """
    c, bias, weight, group, global_V = _group_of(c, bias, weight, process_group)
    lay = check_setup(e, c, targets, bias, weight, opts, group, False, global_V, tokens_sharded=True)
    targets, bad = _guard(targets, lay.V, opts)
    impl = select_impl(opts.impl, e.device)
    e2d, rows, tgt, out_shape = flatten_rows(e, targets, opts.shift)
    if rows is not None:
        e2d = e2d.index_select(0, rows)  # the shifted rows, so that all ranks' rows line up
    n, n_max = tgt.numel(), max(lay.ns)
    if n_max > n:  # pad to a common length with ignored rows
        e2d = torch.nn.functional.pad(e2d, (0, 0, 0, n_max - n))
        tgt = torch.nn.functional.pad(tgt, (0, n_max - n), value=opts.ignore_index)
    E = GatherTokens.apply(e2d.contiguous(), group)  # [world * n_max, D]
    T = all_gather(tgt, group).flatten()
    if grad_divide != 1.0:
        c = ScaleGrad.apply(c, 1.0 / grad_divide)
        bias = None if bias is None else ScaleGrad.apply(bias, 1.0 / grad_divide)
    out = _stats_loss(E, None, T, c, bias, weight, opts, lay, impl, group, True)
    mine = slice(lay.rank * n_max, lay.rank * n_max + n)
    return _finish(out.select(mine), T[mine], opts, out_shape, bad)


def linear_cross_entropy_vocab_parallel(
    e: torch.Tensor,
    c_local: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    process_group=None,
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
    check_replicated: bool = True,
    check: str = "once",
):
    """:func:`cce.linear_cross_entropy` with the classifier split by vocabulary rows over ranks.

    Args:
        e: hidden states ``(..., D)``, the same on every rank of ``process_group``.
        c_local: this rank's block of classifier rows ``(V_local, D)``; the blocks are contiguous
            and in rank order, sizes may differ (V need not divide evenly), none empty. A
            ``DTensor`` sharded ``Shard(0)`` may be passed instead: its local block and its mesh
            group are used (``bias`` / ``weight`` then likewise DTensors or plain local blocks).
        targets: global class ids, the same on every rank.
        bias, weight: this rank's blocks ``(V_local,)`` of the bias and class weights.
        process_group: the group the vocabulary is split over (None with a DTensor ``c_local``).
        check_replicated: compare checksums of ``e`` and ``targets`` across ranks (two
            reductions over ``e``, with the set-up check; on unless disabled here).
        check: ``"once"`` (default): the set-up check (every rank's block size, shapes, options,
            checksums; one all-gather read on the host) runs at the first call of each set-up
            (group, shapes, dtypes, options) and its result is cached, so that later calls make
            no host synchronisation (CUDA-graph capture, torch.compile). ``"always"``: at every
            call, as do ``CCE_DEBUG=1`` and anomaly detection (set alike on every rank). A group
            of one rank has nothing to compare and runs the local checks only.
        Other options: as :func:`cce.linear_cross_entropy`, the temperature and the per-token
            outputs included (the entropy and the argmax combine across ranks in the same O(N)
            all-gather as the loss's statistics).

    Returns:
        What :func:`cce.linear_cross_entropy` returns for the whole classifier, identical on
        every rank. ``e``'s gradient is the full one (summed over ranks), ``c_local``'s and
        ``bias``'s the gradient of this rank's block. Call ``backward`` on every rank with the
        same upstream gradient (as ``loss.backward()`` does).
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
    return vocab_parallel_with_options(
        e, c_local, targets, bias, weight, opts, process_group, check_replicated=check_replicated, check=check
    )
