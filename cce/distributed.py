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
by an all-reduce in backward (the only collective there), in fp32 before the cast to e's dtype.

Replicated-loss convention: the loss is computed redundantly on every rank, so the backward of
the all-gather just takes this rank's slice (no communication). This is exact when every rank
back-propagates the same upstream gradient, which is the case for ``loss.backward()`` on the
replicated loss (as in Megatron's vocab-parallel cross entropy).

Every call first all-gathers a small descriptor per rank (block size, D, N, options, and
checksums of ``e`` and ``targets``) so that a bad set-up fails with the same clear error on
every rank instead of a hang or a silently wrong loss. Reading it on the host is one
synchronisation per call (at the end of the forward pass, where the loss sits anyway).

FSDP2 (data parallel, each rank its own tokens) is a different set-up: see
:func:`lm_head_linear_cross_entropy`, which runs the loss as a forward method of the
``fully_shard``-ed head so that FSDP2 unshards and reshards the weight and reduce-scatters its
gradient as it does for ``lm_head(hidden)``.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from . import _math
from ._validation import check_linear_inputs, check_target_range
from .options import CCEOptions

# ---------------------------------------------------------------------------------------------
# Process-group helpers
# ---------------------------------------------------------------------------------------------


def _is_dtensor(t: Any) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        return False
    return isinstance(t, DTensor)


def _group_device(group) -> torch.device:
    """The device collectives of ``group`` run on (NCCL: the current CUDA device)."""
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _all_gather(x: torch.Tensor, group) -> torch.Tensor:
    """[world, *x.shape] gathered in rank order (not differentiable)."""
    world = dist.get_world_size(group)
    x = x.contiguous()
    out = x.new_empty((world, *x.shape))
    if "nccl" in str(dist.get_backend(group)).lower():
        dist.all_gather_into_tensor(out, x, group=group)
    else:
        dist.all_gather(list(out.unbind(0)), x, group=group)
    return out


class _GatherReplicated(torch.autograd.Function):
    """All-gather whose backward takes this rank's slice: the consumer (the loss) is computed
    identically on every rank, so the gradients reaching the gathered copies are identical."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.rank = dist.get_rank(group)
        return _all_gather(x, group)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return g[ctx.rank], None


class _GatherSummed(torch.autograd.Function):
    """All-gather whose backward sums every rank's gradient of this rank's slice (a
    reduce-scatter): for consumers that differ across ranks (each rank its own tokens' loss)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.rank, ctx.group = dist.get_rank(group), group
        return _all_gather(x, group)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        g = g.contiguous().clone()
        dist.all_reduce(g, group=ctx.group)
        return g[ctx.rank], None


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; multiplies the gradient by ``scale`` (FSDP2's averaging over ranks)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return g * ctx.scale, None


# ---------------------------------------------------------------------------------------------
# Local statistics of one vocabulary block (the per-rank op)
# ---------------------------------------------------------------------------------------------


@dataclass
class _Local:
    """What the local op needs besides the differentiable inputs (e2d, c_local, bias_local)."""

    weight: torch.Tensor | None  # [V_local] class weights of this block
    rows: torch.Tensor | None  # shift: problem row -> row of e2d
    local_t: torch.Tensor  # [N] target id within this block, -1 when not in it / ignored
    valid: torch.Tensor  # [N] target != ignore_index (the row counts somewhere)
    softcap: float
    smoothing: bool  # whether ssum is needed
    filter_eps: float


def torch_local_stats(e2d, c, bias, lc: _Local):
    """(lse, tgt, ssum) of this block per row, in the accumulation dtype (impl="torch": the
    one-device chunk loop of cce.torch_impl on the local targets, a stand-in 0 where the target
    lives on another rank, masked out here). ssum is None without smoothing."""
    from .torch_impl import forward_stats

    t = _local_problem_targets(lc)
    lse, tgt, ssum = forward_stats(e2d, c, bias, lc.weight, lc.rows, t, -1, lc.softcap, lc.smoothing)
    tgt = torch.where(lc.local_t >= 0, tgt, 0.0)
    return lse, tgt, ssum


def torch_local_grads(e2d, c, bias, lc: _Local, lse, tgt, alpha, beta, gamma, need_de, need_dc, need_db):
    """(dE, dC, dbias) of this block (None where not needed) for
    dZ = (alpha p - beta [v == t] - gamma w) softcap'(z), p = exp(L - lse) with this block's lse
    (impl="torch": cce.torch_impl.backward_coeffs, the one-device backward with the coefficients
    given, tile filter included on CPU)."""
    from .torch_impl import backward_coeffs

    t = _local_problem_targets(lc)
    return backward_coeffs(
        e2d, c, bias, lc.weight, lc.rows, t, lse, alpha, beta, gamma, -1, lc.softcap, lc.filter_eps,
        need_de, need_dc, need_db,
    )  # fmt: skip


def triton_local_stats(e2d, c, bias, lc: _Local):
    """(lse, tgt, ssum) of this block per row, fp32 (impl="triton"): the forward launcher of
    cce/kernels/linear_ce.py on the local targets (a stand-in 0 where the target lives on
    another rank, masked out below), in cce.triton_impl's valid-first row order."""
    from .kernels import linear_ce as K
    from .triton_impl import _kernel_dtype_inputs, _Rows

    t = _local_problem_targets(lc)
    e2d_k, c_k, bias_k, weight_k = _kernel_dtype_inputs(e2d, c, bias, lc.weight)
    r = _Rows(t, lc.rows, -1)
    st = K.linear_ce_forward(
        e2d_k, c_k, bias_k, weight_k, r.erow_s, r.safe_t.index_select(0, r.perm), r.n_valid,
        lc.softcap, lc.smoothing,
    )  # fmt: skip
    lse, tgt = r.unsort(st.lse), r.unsort(st.tgt)
    ssum = r.unsort(st.ssum) if lc.smoothing else None
    tgt = torch.where(lc.local_t >= 0, tgt, 0.0)
    return lse, tgt, ssum


def triton_local_grads(e2d, c, bias, lc: _Local, lse, tgt, alpha, beta, gamma, need_de, need_dc, need_db):
    """(dE, dC, dbias) for dZ = (alpha p - beta [v == t] - gamma w) softcap'(z), p = exp(L - lse)
    with this block's lse (impl="triton": cce.triton_impl.triton_backward_coeffs, the one-device
    backward with the coefficients given: filtered kernel with rank-1 corrections, or the exact
    path for filter_eps = 0). dE, dbias fp32; dC fp32 or c's dtype."""
    from .triton_impl import _kernel_dtype_inputs, triton_backward_coeffs

    t = _local_problem_targets(lc)
    e2d_k, c_k, bias_k, weight_k = _kernel_dtype_inputs(e2d, c, bias, lc.weight)
    return triton_backward_coeffs(
        e2d_k, c_k, bias_k, weight_k, lc.rows, t, lse.float(), alpha.float(), beta.float(),
        None if gamma is None else gamma.float(), -1, lc.softcap, lc.filter_eps,
        need_de, need_dc, need_db,
    )  # fmt: skip


def _local_problem_targets(lc: _Local) -> torch.Tensor:
    """Local targets for a one-block problem with ignore_index=-1: -1 at ignored rows, the local
    id in the block, a stand-in 0 for rows whose target lives on another rank (they still need
    lse; their target coefficient is 0)."""
    return torch.where(lc.valid, lc.local_t.clamp(min=0), torch.full_like(lc.local_t, -1))


def _backend(impl: str):
    if impl == "torch":
        return torch_local_stats, torch_local_grads
    return triton_local_stats, triton_local_grads


class _LocalStats(torch.autograd.Function):
    """(lse, tgt, ssum) of this rank's block; backward takes upstream gradients on them."""

    @staticmethod
    def forward(ctx, e2d, c, bias, lc: _Local, impl: str, group):
        stats_fn, _ = _backend(impl)
        lse, tgt, ssum = stats_fn(e2d, c, bias, lc)
        ctx.lc, ctx.impl, ctx.group = lc, impl, group
        ctx.save_for_backward(e2d, c, bias, lse, tgt)
        if ssum is None:
            ssum = lse.new_zeros(0)
        return lse, tgt, ssum

    @staticmethod
    def backward(ctx, g_lse, g_tgt, g_ssum):
        e2d, c, bias, lse, tgt = ctx.saved_tensors
        lc: _Local = ctx.lc
        need_de, need_dc, need_db = ctx.needs_input_grad[:3]
        need_db = need_db and bias is not None
        if not (need_de or need_dc or need_db):
            return None, None, None, None, None, None
        _, grads_fn = _backend(ctx.impl)
        zero = torch.zeros((), dtype=lse.dtype, device=lse.device)
        alpha = torch.where(lc.valid, g_lse.to(lse.dtype), zero)
        beta = torch.where(lc.valid & (lc.local_t >= 0), -g_tgt.to(lse.dtype), zero)
        gamma = torch.where(lc.valid, -g_ssum.to(lse.dtype), zero) if lc.smoothing else None
        dE, dC, db = grads_fn(e2d, c, bias, lc, lse, tgt, alpha, beta, gamma, need_de, need_dc, need_db)
        if need_de and ctx.group is not None:
            # This block's share of dE; the full dE is the sum over ranks, reduced in the
            # accumulation dtype and rounded to e's dtype once. (Every rank needs dE here: the
            # set-up check compared e.requires_grad across ranks.)
            dist.all_reduce(dE, group=ctx.group)
        # Cast one gradient at a time, dropping each fp32 buffer before the next cast, so the
        # peak holds one fp32 / low-precision pair, not all of them.
        dE = dE.to(e2d.dtype) if need_de else None
        dC = dC.to(c.dtype) if need_dc else None
        db = db.to(bias.dtype) if need_db else None
        return dE, dC, db, None, None, None


# ---------------------------------------------------------------------------------------------
# Set-up checks: one small all-gather per call
# ---------------------------------------------------------------------------------------------

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_REDUCTIONS = ("mean", "sum", "none")
_IMPLS = ("auto", "triton", "torch")
# Fields of the per-rank descriptor that must agree across ranks (in this order after V_local).
_SAME = (
    "D",
    "N",
    "dtype",
    "reduction",
    "shift",
    "softcap",
    "label_smoothing",
    "z_loss",
    "ignore_index",
    "return_lse",
    "has_bias",
    "has_weight",
    "impl",
    "filter_eps",
    "e_grad",
)
_CHECKSUMS = ("e_sum", "e_row_moment", "e_col_moment", "t_sum", "t_moment")


def _checksums(e2d: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """Cheap order-sensitive fingerprints of e and targets, deterministic for identical data.

    Sums and index-weighted sums of row and column sums, in float64 (no copy of e is made).
    Identical tensors give bitwise-identical values; different data almost never does.
    """
    N, D = e2d.shape
    dev = e2d.device
    rs = e2d.sum(1, dtype=torch.float64)  # [N]
    cs = e2d.sum(0, dtype=torch.float64)  # [D]
    tn = t.to(torch.float64)
    return torch.stack(
        [
            rs.sum(),
            (rs * torch.arange(1, N + 1, device=dev, dtype=torch.float64)).sum(),
            (cs * torch.arange(1, D + 1, device=dev, dtype=torch.float64)).sum(),
            tn.sum(),
            (tn * torch.arange(1, tn.numel() + 1, device=dev, dtype=torch.float64)).sum(),
        ]
    )


def _describe(e, c_local, targets, bias, weight, opts: CCEOptions, check_replicated: bool, dev):
    """This rank's descriptor (float64, on ``dev``) and its local validation error (or None).

    The checksums stay on the device (no host synchronisation before the gather)."""
    err = None
    fields = [0.0] * (2 + len(_SAME) + 1 + len(_CHECKSUMS))
    try:
        if not isinstance(c_local, torch.Tensor) or c_local.dim() != 2 or c_local.shape[0] == 0:
            shape = tuple(c_local.shape) if isinstance(c_local, torch.Tensor) else type(c_local)
            raise ValueError(
                f"c_local must be this rank's non-empty block of classifier rows (V_local, D), "
                f"got {shape}; every rank of the group needs at least one row"
            )
        # Every local check of the one-device API; the target range is checked against the global
        # V after the gather (targets hold global ids). A zero stand-in of targets' shape and
        # dtype (expanded, no copy) keeps check_linear_inputs from range-checking them here.
        if not isinstance(targets, torch.Tensor):
            raise TypeError(f"targets must be a torch.Tensor, got {type(targets).__name__}")
        check_linear_inputs(e, c_local, targets.new_zeros(()).expand(targets.shape), bias, weight, opts)
        e2d = e.reshape(-1, e.shape[-1])
        t = targets.reshape(-1)
        n = t.numel() - (t.numel() // targets.shape[-1] if opts.shift else 0)
        fields[0] = 0.0
        fields[1] = float(c_local.shape[0])
        same = dict(
            D=e.shape[-1],
            N=n,
            dtype=_DTYPES.index(e.dtype),
            reduction=_REDUCTIONS.index(opts.reduction),
            shift=float(opts.shift),
            softcap=opts.softcap_value,
            label_smoothing=float(opts.label_smoothing),
            z_loss=float(opts.z_loss),
            ignore_index=float(opts.ignore_index),
            return_lse=float(opts.return_lse),
            has_bias=float(bias is not None),
            has_weight=float(weight is not None),
            impl=_IMPLS.index(opts.impl),
            filter_eps=-1.0
            if opts.filter_eps == "auto"
            else -2.0
            if opts.filter_eps is None
            else float(opts.filter_eps),
            e_grad=float(e.requires_grad and torch.is_grad_enabled()),
        )
        for i, name in enumerate(_SAME):
            fields[2 + i] = float(same[name])
        if check_replicated:
            fields[2 + len(_SAME)] = 1.0
        desc = torch.tensor(fields, dtype=torch.float64).to(dev)
        if check_replicated:
            desc[3 + len(_SAME) :] = _checksums(e2d.detach(), t).to(dev)
        return desc, None
    except Exception as exc:  # reported collectively after the gather, never alone (no hang)
        err = exc
    fields[0] = 1.0
    return torch.tensor(fields, dtype=torch.float64).to(dev), err


@dataclass(frozen=True)
class _Layout:
    rank: int
    world: int
    sizes: tuple[int, ...]  # V_local of every rank, in rank order
    ns: tuple[int, ...]  # tokens of every rank (equal unless tokens are sharded)

    @property
    def start(self) -> int:
        return sum(self.sizes[: self.rank])

    @property
    def V(self) -> int:
        return sum(self.sizes)


def _layout(
    e, c_local, targets, bias, weight, opts, group, check_replicated, global_V, tokens_sharded=False
) -> _Layout:
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    desc, err = _describe(e, c_local, targets, bias, weight, opts, check_replicated, _group_device(group))
    table = _all_gather(desc, group).cpu()  # [world, fields]: the one host synchronisation
    failed = [r for r in range(world) if table[r, 0] != 0]
    if err is not None:
        raise type(err)(f"[cce vocab-parallel, rank {rank}] {err}") from err
    if failed:
        raise RuntimeError(
            f"[cce vocab-parallel, rank {rank}] rank(s) {failed} of the process group rejected "
            "their inputs (see the error raised there); no rank ran the loss"
        )
    for i, name in enumerate(_SAME):
        if name == "N" and tokens_sharded:
            continue
        col = table[:, 2 + i]
        if not bool((col == col[0]).all()):
            vals = col.tolist()
            hint = ""
            if name == "N":
                hint = " (e and targets must hold the same tokens on every rank)"
            raise ValueError(f"[cce vocab-parallel, rank {rank}] '{name}' differs across ranks: {vals}{hint}")
    sizes = tuple(int(v) for v in table[:, 1].tolist())
    ns = tuple(int(v) for v in table[:, 2 + _SAME.index("N")].tolist())
    lay = _Layout(rank, world, sizes, ns)
    if global_V is not None and lay.V != global_V:
        raise ValueError(
            f"[cce vocab-parallel, rank {rank}] the ranks' blocks (sizes {list(sizes)}, total "
            f"{lay.V}) do not cover the classifier's V = {global_V} rows"
        )
    k = 2 + len(_SAME)
    if bool((table[:, k] != 0).all()):
        sums = table[:, k + 1 :]
        bad = [_CHECKSUMS[j] for j in range(len(_CHECKSUMS)) if not bool((sums[:, j] == sums[0, j]).all())]
        if bad:
            what = "targets" if all(b.startswith("t_") for b in bad) else "e"
            raise ValueError(
                f"[cce vocab-parallel, rank {rank}] {what} differs across ranks (checksums {bad} "
                "disagree): vocabulary parallelism needs the same e and targets on every rank of "
                "the group. Under FSDP2 (data parallel, each rank its own tokens) use "
                "cce.distributed.lm_head_linear_cross_entropy(lm_head, e, targets) or compute "
                "the loss inside the model's forward, where FSDP2 has unsharded the weight. If e "
                "is replicated only up to rounding by design, pass check_replicated=False."
            )
    # Targets hold global ids: check them against the global V (identical on every rank).
    check_target_range(targets, lay.V, opts.ignore_index)
    return lay


# ---------------------------------------------------------------------------------------------
# DTensor classifiers
# ---------------------------------------------------------------------------------------------


def _from_dtensor(c, bias, weight, process_group):
    """(c_local, bias_local, weight_local, group, global V) for a Shard(0) DTensor classifier."""
    from torch.distributed.tensor import Replicate, Shard

    mesh, placements = c.device_mesh, c.placements
    shard_dims = [i for i, p in enumerate(placements) if isinstance(p, Shard) and p.dim == 0]
    others_ok = all(isinstance(p, Replicate) for i, p in enumerate(placements) if i not in shard_dims)
    if len(shard_dims) != 1 or not others_ok:
        raise ValueError(
            f"a DTensor classifier must be sharded on dim 0 (Shard(0)) over exactly one mesh "
            f"dimension and replicated over the others, got placements {tuple(placements)}"
        )
    group = mesh.get_group(shard_dims[0])
    if process_group is not None and process_group is not group:
        raise ValueError("process_group differs from the DTensor classifier's mesh group; pass one")

    def local(name, t):
        if t is None or not _is_dtensor(t):
            return t
        if tuple(t.placements) != tuple(placements) or t.device_mesh != mesh:
            raise ValueError(
                f"{name} is a DTensor with placements {tuple(t.placements)}; it must be sharded "
                f"like the classifier ({tuple(placements)})"
            )
        return t.to_local()

    return c.to_local(), local("bias", bias), local("weight", weight), group, c.shape[0]


def _replicated_local(name, t):
    if t is None or not _is_dtensor(t):
        return t
    from torch.distributed.tensor import Replicate

    if not all(isinstance(p, Replicate) for p in t.placements):
        raise ValueError(f"{name} as a DTensor must be replicated, got placements {tuple(t.placements)}")
    return t.to_local()


# ---------------------------------------------------------------------------------------------
# Public entry points
# ---------------------------------------------------------------------------------------------


def _stats_loss(e2d, rows, tgt, c, bias, weight, opts: CCEOptions, lay: _Layout, impl, group, tokens_sharded):
    """Per-token (loss, lse, valid, w_t) over the whole vocabulary for the rows e2d[rows] and
    the global targets tgt, from this rank's block and one all-gather of statistics."""
    valid = tgt != opts.ignore_index
    start, V_local = lay.start, c.shape[0]
    inblk = valid & (tgt >= start) & (tgt < start + V_local)
    local_t = torch.where(inblk, tgt - start, torch.full_like(tgt, -1))
    smoothing = opts.label_smoothing > 0
    lc = _Local(
        weight=weight,
        rows=rows,
        local_t=local_t,
        valid=valid,
        softcap=opts.softcap_value,
        smoothing=smoothing,
        filter_eps=opts.resolved_filter_eps(e2d.dtype),
    )
    # Replicated tokens: the local op all-reduces dE itself. Sharded tokens: the all-gather of
    # the tokens reduce-scatters it in its backward.
    lse_r, tgt_r, ssum_r = _LocalStats.apply(e2d, c, bias, lc, impl, None if tokens_sharded else group)

    # One all-gather of everything the loss needs: lse, tgt[, ssum][, w_t, W] per rank.
    parts = [lse_r, tgt_r]
    if smoothing:
        parts.append(ssum_r)
    if weight is not None:
        wl = weight.to(lse_r.dtype)
        w_t_r = torch.where(inblk, wl[local_t.clamp(min=0)], 0.0)  # w_t where t is in my block
        parts += [w_t_r, wl.sum().reshape(1)]
    gather = _GatherSummed if tokens_sharded else _GatherReplicated
    G = gather.apply(torch.cat(parts), group).float()  # [world, K]
    N = tgt.numel()
    lse = torch.logsumexp(G[:, :N], dim=0)
    tgt_g = G[:, N : 2 * N].sum(0)
    off = 2 * N
    ssum = None
    if smoothing:
        ssum = G[:, off : off + N].sum(0)
        off += N
    if weight is not None:
        w_t = G[:, off : off + N].sum(0).detach()
        W = G[:, off + N].sum().detach()
    else:
        w_t = valid.float()
        W = float(lay.V)
    k = _math.LossConsts(float(opts.label_smoothing), float(opts.z_loss), lay.V)
    return _math.token_loss(lse, tgt_g, ssum, w_t, W, valid, k), lse, valid, w_t


def _finish(loss_tok, lse, valid, w_t, opts: CCEOptions, out_shape):
    loss = _math.reduce_loss(loss_tok, w_t, opts.reduction)
    if opts.reduction == "none":
        loss = loss.reshape(out_shape)
    if opts.return_lse:
        return loss, torch.where(valid, lse, 0.0).reshape(out_shape)
    return loss


def _group_of(c, bias, weight, process_group):
    global_V = None
    if _is_dtensor(c):
        c, bias, weight, process_group, global_V = _from_dtensor(c, bias, weight, process_group)
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
):
    """:func:`linear_cross_entropy_vocab_parallel` with its options in a :class:`CCEOptions`
    (the form ``cce.linear.linear_cross_entropy_with_options`` dispatches to)."""
    from .linear import _prepare, select_impl

    c, bias, weight, group, global_V = _group_of(c, bias, weight, process_group)
    e = _replicated_local("e", e)
    targets = _replicated_local("targets", targets)
    lay = _layout(e, c, targets, bias, weight, opts, group, check_replicated, global_V)
    impl = select_impl(opts.impl, e.device)
    e2d, rows, tgt, out_shape = _prepare(e, targets, opts.shift)
    out = _stats_loss(e2d, rows, tgt, c, bias, weight, opts, lay, impl, group, tokens_sharded=False)
    return _finish(*out, opts, out_shape)


class _GatherTokens(torch.autograd.Function):
    """[n, D] -> [world * n, D] all-gather of every rank's tokens; backward reduce-scatters
    (sums every rank's gradient of this rank's rows)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return _all_gather(x, group).flatten(0, 1)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        world = dist.get_world_size(ctx.group)
        g = g.contiguous()
        out = g.new_empty((g.shape[0] // world, *g.shape[1:]))
        dist.reduce_scatter_tensor(out, g, group=ctx.group)
        return out, None


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
    returns the loss of its own tokens. Backward: each rank's ``e`` gets the gradient of its own
    loss (a reduce-scatter); ``c_local`` / ``bias`` get the sum over ranks of every rank's loss
    gradient for the block, divided by ``grad_divide`` (the number of ranks reproduces FSDP2's
    gradient averaging). Ranks may hold different numbers of tokens.
    """
    from .linear import _prepare, select_impl

    c, bias, weight, group, global_V = _group_of(c, bias, weight, process_group)
    lay = _layout(e, c, targets, bias, weight, opts, group, False, global_V, tokens_sharded=True)
    impl = select_impl(opts.impl, e.device)
    e2d, rows, tgt, out_shape = _prepare(e, targets, opts.shift)
    if rows is not None:
        e2d = e2d.index_select(0, rows)  # the shifted rows, so that all ranks' rows line up
    n, n_max = tgt.numel(), max(lay.ns)
    if n_max > n:  # pad to a common length with ignored rows
        e2d = torch.nn.functional.pad(e2d, (0, 0, 0, n_max - n))
        tgt = torch.nn.functional.pad(tgt, (0, n_max - n), value=opts.ignore_index)
    E = _GatherTokens.apply(e2d.contiguous(), group)  # [world * n_max, D]
    T = _all_gather(tgt, group).flatten()
    if grad_divide != 1.0:
        c = _ScaleGrad.apply(c, 1.0 / grad_divide)
        bias = None if bias is None else _ScaleGrad.apply(bias, 1.0 / grad_divide)
    loss_tok, lse, valid, w_t = _stats_loss(E, None, T, c, bias, weight, opts, lay, impl, group, True)
    mine = slice(lay.rank * n_max, lay.rank * n_max + n)
    return _finish(loss_tok[mine], lse[mine], valid[mine], w_t[mine], opts, out_shape)


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
    check_replicated: bool = True,
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
            reductions over ``e``; always on unless disabled here).
        Other options: as :func:`cce.linear_cross_entropy`.

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
    )
    return vocab_parallel_with_options(
        e, c_local, targets, bias, weight, opts, process_group, check_replicated=check_replicated
    )


# ---------------------------------------------------------------------------------------------
# lm_head modules: plain, tensor-parallel (DTensor Shard(0)) or FSDP2-sharded
# ---------------------------------------------------------------------------------------------

_FSDP_METHOD = "_cce_fsdp_call"


def _call_with_module(self: nn.Module, fn, *args, **kwargs):
    return fn(*args, **kwargs)


def _fsdp_module(module: nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return False
    return isinstance(module, FSDPModule)


def call_unsharded(module: nn.Module, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` with ``module``'s FSDP2-sharded parameters gathered, as FSDP2 does
    around ``module.forward``; a plain call when ``module`` is not ``fully_shard``-ed.

    ``fn`` runs as a registered FSDP forward method of ``module``
    (``torch.distributed.fsdp.register_fsdp_forward_method``): FSDP2 all-gathers the parameters
    before it (``module.weight`` is then the whole, plain tensor), frees them after it when
    ``reshard_after_forward``, gathers them again before the backward of ``fn``'s outputs and
    reduce-scatters their gradients after it, exactly as for ``module(x)``. Pass the tensors that
    ``fn`` differentiates (e.g. the hidden states) in ``args`` so that FSDP2 can hook them.
    The first call stores a bound method on ``module`` (attribute ``_cce_fsdp_call``).
    """
    if not _fsdp_module(module):
        return fn(*args, **kwargs)
    if not callable(getattr(module, _FSDP_METHOD, None)):
        from torch.distributed.fsdp import register_fsdp_forward_method

        setattr(module, _FSDP_METHOD, types.MethodType(_call_with_module, module))
        register_fsdp_forward_method(module, _FSDP_METHOD)
    return getattr(module, _FSDP_METHOD)(fn, *args, **kwargs)


def lm_head_linear_cross_entropy(
    lm_head: nn.Module,
    e: torch.Tensor,
    targets: torch.Tensor,
    *,
    weight: torch.Tensor | None = None,
    fsdp: str = "gather",
    **options,
):
    """Linear cross entropy of an ``nn.Linear``-like head (``.weight (V, D)``, optional ``.bias``).

    - plain weight: :func:`cce.linear_cross_entropy`;
    - ``lm_head`` wrapped with ``torch.distributed.fsdp.fully_shard`` (FSDP2, data parallel, each
      rank its own tokens):

      - ``fsdp="gather"`` (default): through :func:`call_unsharded`, so that FSDP2 gathers the
        weight and reduce-scatters its gradient as it does for ``lm_head(hidden)``;
      - ``fsdp="vocab_parallel"``: the weight stays sharded; the tokens are all-gathered instead
        (O(N D) per rank rather than O(V D)) and each rank computes its shard's part of every
        rank's loss (:func:`vocab_parallel_sharded_tokens`). The shard's gradient is written
        directly, averaged over the ranks as FSDP2 does by default (a 1-D mesh is required;
        FSDP2's own hooks, e.g. a custom gradient divide factor or CPU offload, are bypassed);
    - weight a ``DTensor`` sharded ``Shard(0)`` (tensor parallel, the same tokens on every rank):
      vocabulary parallelism over its mesh group, no gather of the weight.

    A sharded weight is never read as if whole: a DTensor weight of a head that is not itself an
    FSDP module (e.g. managed by a parent's ``fully_shard`` and read outside the parent's forward)
    goes through the vocabulary-parallel checks, which reject differing (data-parallel) ``e``.
    """
    if fsdp not in ("gather", "vocab_parallel"):
        raise ValueError(f"fsdp must be 'gather' or 'vocab_parallel', got {fsdp!r}")
    if fsdp == "vocab_parallel" and _fsdp_module(lm_head) and _is_dtensor(lm_head.weight):
        c = lm_head.weight
        if c.device_mesh.ndim != 1:
            raise ValueError(
                "fsdp='vocab_parallel' needs a 1-D FSDP2 mesh (plain FSDP, not HSDP); use fsdp='gather'"
            )
        bias = getattr(lm_head, "bias", None)
        # FSDP2 keeps the shards in the parameter dtype; compute in the hidden states' dtype as
        # its mixed-precision forward would (a differentiable cast, the gradient comes back fp32).
        c = c.to(e.dtype)
        bias = None if bias is None else bias.to(e.dtype)
        opts = CCEOptions(**options)
        world = c.device_mesh.size()
        return vocab_parallel_sharded_tokens(e, c, targets, bias, weight, opts, grad_divide=float(world))

    def loss(e_, t_):
        c = lm_head.weight
        bias = getattr(lm_head, "bias", None)
        if _is_dtensor(c):
            return linear_cross_entropy_vocab_parallel(e_, c, t_, bias, weight=weight, **options)
        from .linear import linear_cross_entropy

        return linear_cross_entropy(e_, c, t_, bias, weight=weight, **options)

    return call_unsharded(lm_head, loss, e, targets)


__all__ = [
    "call_unsharded",
    "linear_cross_entropy_vocab_parallel",
    "lm_head_linear_cross_entropy",
    "vocab_parallel_sharded_tokens",
    "vocab_parallel_with_options",
]
