"""The host side of the Triton backward algorithms: the exact one's row order, the sparse
one's plan, statistics and corrections.

``coefficient_backward`` (the exact backward for given per-row coefficients) serves
``loss_backward``; ``sparse_backward`` reads the forward's encoded tile statistics. (A
vocabulary-parallel rank runs the forward op and these backwards on its block:
cce/ops/linear_ce/local.py.) docs/design.md has the error bounds.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch
import torch.nn.functional as F

from ... import _math
from ..._dispatch import LinearPlan
from ...options import DEFAULT_TUNING as _T
from ...options import Tuning
from .host_peek import HostPeek
from .kernels import backward_sparse as KS
from .kernels.backward_exact import fp16_dz_bound, linear_ce_backward_exact
from .kernels.common import compact_lists, inverse_permutation, stats_blocks, tile_sizes
from .kernels.dc_skipped import KEPT_SUMS_BYTES
from .kernels.first_order import FirstOrder, gram, normalized
from .kernels.sparse_plan import PendingFirstOrder, SparsePlan, kept_scratch_tiles
from .kernels.stash import stash_code
from .kernels.tile_stats import decode_tile_mass, skipped_slogs, tile_means
from .rows import RowOrder, weighted_rows
from .slab_choice import SlabPlan, dense_slab_flags, mean_row_spread, slab_errors, slab_plan, tile_masses


def with_slab_plan(plan: LinearPlan, tuning: Tuning, dtype: torch.dtype, shape: tuple[int, int, int],
                   need_dc: bool) -> LinearPlan:  # fmt: skip
    """``plan`` (_dispatch.plan_triton's) with the sparse backward's SlabPlan for ``shape`` = (N, V,
    D) where its backward is "sparse" (the one sparse_backward then makes from the same options),
    unchanged otherwise."""
    if plan.backward != "sparse":
        return plan
    N, V, D = shape
    sp = slab_plan(
        N, V, D, dtype, need_dc, tuning.dense_slabs, tuning.dense_kept, tuning.slab_error,
        tuning.slab_error_dc, tuning.dense_slab_bytes, tuning.first_order,
    )  # fmt: skip
    return dataclasses.replace(plan, slabs=sp, reasons=(*plan.reasons, *sp.reasons))


def coefficient_backward(
    e2d, c, bias, weight, rows, targets, lse, alpha, beta, gamma, ignore_index, softcap, need_de, need_dc,
    need_dbias, dz_slab_bytes: int, eta=None, temperature: float = 1.0, entropy=None,
):  # fmt: skip
    """(dE, dC, dbias) (None where not needed) of the exact backward (dZ slabs and cuBLAS) for
    per-row coefficients: dZ = (alpha p - beta [v == t] - gamma w) softcap' (gamma None: no
    smoothing term), plus the entropy's term eta p z (with the rows' ``entropy``) where ``eta``
    is given; the logits are softcap(x) / ``temperature``, the coefficients scaled by 1 / T
    already. dE in e2d's dtype, dC in c's, dbias fp32."""
    r = RowOrder(targets, rows, ignore_index)
    srt = lambda x: x.index_select(0, r.perm).contiguous()  # noqa: E731
    ex = linear_ce_backward_exact(
        e2d, c, bias, weight, r.erow_s, srt(r.safe_t), r.n_valid, srt(lse), srt(alpha.float()),
        srt(beta.float()), None if gamma is None else srt(gamma.float()), softcap, need_de, need_dc,
        need_dbias, dz_slab_bytes, eta=None if eta is None else srt(eta.float()), temperature=temperature,
        entropy=None if eta is None else srt(entropy.float()),
        # Without `rows` the sorted rows are a permutation of e2d's: every row is written.
        erow_is_permutation=rows is None,
    )  # fmt: skip
    return ex.dE, ex.dC, ex.dbias


def loss_coefficients(
    weight, targets, lse, g, h, ignore_index: int, label_smoothing: float, z_loss: float, V: int, u=None,
    delta=None, entropy=None, temperature: float = 1.0,
):  # fmt: skip
    """(alpha, beta, gamma, eta, smoothing) per row of this loss for upstream gradients g (per-row
    loss), h (lse), u (the target logit: a log-probability output) and delta (the entropy, whose
    forward values are ``entropy``), cce/_math.py; eta is None without delta. With a temperature
    every coefficient carries the chain rule's 1 / T."""
    k = _math.LossConsts(label_smoothing, z_loss, V)
    valid = targets != ignore_index
    w_t = _math.target_weight(weight, targets, valid)
    W = _math.weight_total(weight, V, targets.device)
    alpha, beta, gamma = _math.coefficients(g, h, lse, w_t, W, valid, k)
    eta = None
    if u is not None or delta is not None:
        alpha, beta, eta = _math.output_coefficients(alpha, beta, u, delta, lse, entropy, valid)
    if temperature != 1.0:
        inv_t = 1.0 / temperature
        alpha, beta, gamma = alpha * inv_t, beta * inv_t, gamma * inv_t
        eta = None if eta is None else eta * inv_t
    return alpha, beta, gamma, eta, k.smoothing


def loss_backward(
    e2d, c, bias, weight, rows, targets, lse, g, h, ignore_index, softcap, label_smoothing, z_loss,
    need_de, need_dc, need_dbias, dz_slab_bytes: int, u=None, delta=None, entropy=None,
    temperature: float = 1.0,
):  # fmt: skip
    """coefficient_backward for upstream gradients g (per-row loss), h (lse), u (target logit)
    and delta (entropy) of this loss at a temperature."""
    alpha, beta, gamma, eta, smoothing = loss_coefficients(
        weight, targets, lse, g, h, ignore_index, label_smoothing, z_loss, c.shape[0], u, delta, entropy,
        temperature,
    )  # fmt: skip
    return coefficient_backward(
        e2d, c, bias, weight, rows, targets, lse, alpha, beta, gamma if smoothing else None,
        ignore_index, softcap, need_de, need_dc, need_dbias, dz_slab_bytes, eta, temperature, entropy,
    )  # fmt: skip


# Bytes of each temporary of _dc_inputs' row chunks (fp32 [rows, tiles], the gathered [rows, D]
# rows): one chunk up to these sizes, since every chunk costs about ten host launches and small
# steps are bound by the host (docs/benchmarks.md).
_SPARSE_CHUNK_BYTES = 64 << 20


def _chunk_rows(n_tiles: int, D: int, elem_bytes: int) -> int:
    """Rows per chunk of _dc_inputs: temporaries of at most _SPARSE_CHUNK_BYTES, at least 1024 rows."""
    by_tiles = _SPARSE_CHUNK_BYTES // (4 * max(1, n_tiles))
    return max(1024, min(by_tiles, _SPARSE_CHUNK_BYTES // max(1, D * elem_bytes)))


def sparse_backward(
    e2d, c, bias, weight, rows, targets, lse, g, h, ignore_index, softcap, label_smoothing, z_loss,
    need_de, need_dc, code, keep, zt_s, vperm, vscore, stash=None, *,
    de_block_slots: int = _T.de_block_slots, dc_scratch_tiles: int | None = _T.dc_scratch_tiles,
    move_bytes: int = _T.stash_move_bytes, return_plan: bool = False, dense_slabs: bool = False,
    dense_kept: float = _T.dense_kept, slab_error: float = _T.slab_error,
    slab_error_dc: float = _T.slab_error_dc, dense_slab_bytes: int = _T.dense_slab_bytes,
    first_order: bool = _T.first_order, host_gating: bool = _T.host_gating, u=None, delta=None,
    entropy=None, order=None, n_valid=None, cmeans=None, temperature: float = 1.0,
    kept_sums_bytes: int = KEPT_SUMS_BYTES,
):  # fmt: skip
    """(dE, dC) in e2d's / c's dtype from the forward's encoded tile statistics (a SparsePlan);
    ``u``: an upstream gradient on the target logit (a log-probability output), else None;
    ``delta``: one on the entropy output (whose forward values are ``entropy``), else None.

    dE is written into ``stash`` (the forward's buffer, whose tail may hold the codes: then
    ``code`` is empty) and returned; without one a new buffer is used.

    A tile (token block x vocabulary tile, vocabulary in vperm order) is recomputed only when
    ``keep`` says so (the forward found a non-target probability of one of its rows that may
    reach the threshold it gathered the statistics with). The others contribute alpha_i S_ij
    mean(C_j) to dE (S_ij: the tile's non-target mass, decoded from ``code``) and q_v G_j to dC;
    every target entry alpha p_t - beta is added exactly. Smoothing (never with softcap here) is
    the exact rank-1 term.

    With ``dense_slabs``, dense slabs (slab_choice.dense_slab_flags: slabs of whole tiles of
    about ``dense_slab_bytes`` of dZ where at least ``dense_kept`` of the (block, tile) pairs
    are kept, and those whose rank-1 corrections, measured on sampled rows, would leave more
    than ``slab_error`` relative error in dE or, estimated from them, ``slab_error_dc`` in dC)
    leave the plan and are done exactly by GEMM-shaped kernels (kernels/dense_slabs.py); values
    of 1 or more turn a rule off. The keyword defaults are Tuning's, except ``dense_slabs`` (off
    here: the sparse backward alone unless asked; the custom op passes Tuning's, on by default).
    ``kept_sums_bytes``: the dC writer's fp32 scratch of the target sums of its first tiles with
    kept blocks (kernels/dc_skipped.py, kept_target_sums).

    With ``first_order`` as well (and the error rule on), the device may apply the skipped
    tiles' first-order terms instead of (some) dense slabs, where they cost less
    (kernels/first_order.py, slab_choice.dense_slab_flags).

    With ``host_gating``, the launches (and buffers) of the dense slabs and first-order terms that
    the device's decision turns off are left out where that decision has reached the host by the
    time they would be issued (host_peek.py: never a wait); the gradients are the same bit for
    bit.

    ``order`` and ``n_valid`` (the forward's, linear_ce_triton_fwd): the row and vocabulary
    orders it made, read instead of made again; None or empty: made here. ``cmeans`` likewise:
    the forward's tile means of C in the vocabulary order (fp32 [n_tiles, D], tile_stats.tile_means).

    With ``delta`` the entropy's term eta p z is part of dZ (cce/_math.py): kept tiles and the
    target entries carry it exactly, a skipped tile j of row i through the coefficient
    a_ij = alpha_i + eta_i zbar_ij of its rank-1 correction, zbar_ij = lse_i + log(S_ij /
    BLOCK_V) its p-weighted mean logit to first order (with softcap, solved for the codes'
    softcap' factor: kernels.common.skipped_slog), and the dense-slab rule measures the
    corrections with that term; the first-order terms weigh a row's skipped tiles by a_ij + eta_i
    (kernels/first_order.py).

    With a ``temperature`` T the logits are softcap(x) / T = softcap_T(lam x) (lam = 1 / T,
    softcap_T = lam softcap) and the forward's statistics (codes, keep, zt, lse) are of those:
    the coefficients carry the chain rule's lam (loss_coefficients), the recomputing kernels
    scale their logits by lam, and the host-side estimates (the dense-slab rule's sampled rows,
    the codes' softcap', the mean-row spread of the dC corrections, the first-order terms, whose
    expansion is in the logit's deviation lam x) see lam x, lam bias and softcap_T. So the plan
    and the filter's bound are those of the tempered problem.
    """
    if delta is not None and entropy is None:
        raise ValueError("an upstream gradient of the entropy (delta) needs the entropy's values")
    st = _sparse_step(
        e2d, c, bias, weight, rows, targets, lse, g, h, ignore_index, softcap, label_smoothing, z_loss,
        vperm, vscore, u, delta, entropy, order, n_valid, temperature,
    )  # fmt: skip
    stash, src, code = _stash_and_codes(e2d, st, stash, code, need_de)
    coef = _target_coef(st, zt_s, softcap)
    keep = keep.bool()
    V, D = c.shape
    sp = slab_plan(
        st.N, V, D, e2d.dtype, need_dc, dense_slabs, dense_kept, slab_error, slab_error_dc, dense_slab_bytes,
        first_order,
    )  # fmt: skip
    cm_fwd = cmeans if cmeans is not None and cmeans.numel() > 0 else None
    q, slog = _shared_terms(st, code, need_dc)
    rule = _dense_slab_rule(
        e2d, c, vperm, st, sp, code, keep, coef, q, slog, cm_fwd, need_dc, dense_kept, slab_error,
        slab_error_dc, host_gating,
    )  # fmt: skip
    plan, gamma_s = _sparse_plan(
        e2d, c, weight, vperm, st, code, keep, coef, q, slog, rule, need_de, need_dc, dc_scratch_tiles
    )
    del q  # the plan holds its view of q alone from here: released after dC
    dz_bound = None
    if st.eta_s is not None and rule.dense is not None and e2d.dtype == torch.float16:
        dz_bound = fp16_dz_bound(st.alpha_s, st.eta_s, st.lse_s, st.sort(entropy.float()))
    dE, dC = KS.linear_ce_backward_sparse(
        e2d, c, bias, weight, st.r.erow_s, st.t_s, vperm, st.r.n_valid, st.lse_s, st.alpha_s, gamma_s, plan,
        softcap, need_de, need_dc, stash, src, release=not return_plan, de_block_slots=de_block_slots,
        move_bytes=move_bytes, dense=rule.dense, tiles_per_slab=sp.tiles_per_slab, eta=st.eta_s,
        dz_bound=dz_bound, cm=cm_fwd if rule.cm is None else rule.cm, decided=rule.decided,
        temperature=temperature, block_bytes=dense_slab_bytes, kept_sums_bytes=kept_sums_bytes,
    )  # fmt: skip
    return (dE, dC, plan) if return_plan else (dE, dC)


@dataclasses.dataclass
class _SparseStep:
    """What every part of one sparse backward step reads (_sparse_step makes it): the rows in the
    valid-first order (rows.RowOrder) and the per-row values in that order, the statistics'
    blocks, and the host-side estimates' view of the tempered logits (sparse_backward)."""

    r: RowOrder
    t_s: torch.Tensor  # each sorted row's target (0 at ignored rows)
    tp: torch.Tensor | None  # each sorted row's target's sorted position (the forward's), or None
    vpos: torch.Tensor  # each class's sorted position
    pos: torch.Tensor  # arange(N)
    valid_s: torch.Tensor  # the sorted rows below n_valid
    alpha_s: torch.Tensor
    beta_s: torch.Tensor
    lse_s: torch.Tensor
    eta_s: torch.Tensor | None
    gamma: torch.Tensor  # loss_coefficients' gamma, in the problem's row order
    smooth: bool
    lam: float  # 1 / temperature
    cap_t: float  # softcap_T = lam softcap
    bias_t: torch.Tensor | None  # lam bias
    vscore_t: torch.Tensor  # lam vscore
    BN: int
    BV: int
    nt: int  # vocabulary tiles of BV classes

    @property
    def N(self) -> int:
        return self.r.N

    def sort(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (one value per problem row) in the sorted row order, contiguous."""
        return x.index_select(0, self.r.perm).contiguous()


def _sparse_step(
    e2d: torch.Tensor, c: torch.Tensor, bias: torch.Tensor | None, weight: torch.Tensor | None,
    rows: torch.Tensor | None, targets: torch.Tensor, lse: torch.Tensor, g: torch.Tensor,
    h: torch.Tensor | None, ignore_index: int, softcap: float, label_smoothing: float, z_loss: float,
    vperm: torch.Tensor, vscore: torch.Tensor, u: torch.Tensor | None, delta: torch.Tensor | None,
    entropy: torch.Tensor | None, order: torch.Tensor | None, n_valid: torch.Tensor | None,
    temperature: float,
) -> _SparseStep:  # fmt: skip
    """The step's _SparseStep: loss_coefficients' coefficients, the row order (the forward's
    ``order`` where given, else made here) and the coefficients, lse and targets in it."""
    V = c.shape[0]
    dev = e2d.device
    alpha, beta, gamma, eta, smooth = loss_coefficients(
        weight, targets, lse, g, h, ignore_index, label_smoothing, z_loss, V, u, delta, entropy, temperature
    )
    # The host-side estimates' view of the tempered logits (sparse_backward): lam x + lam bias, softcap_T.
    lam = 1.0 / temperature
    cap_t = softcap * lam
    bias_t = bias if bias is None or lam == 1.0 else bias.float() * lam
    vscore_t = vscore if lam == 1.0 else vscore * lam
    tp = None
    if order is not None and order.numel() > 0:
        # (the forward's: the sorted rows' targets, their sorted positions, each class's)
        n = targets.numel()
        r = RowOrder.from_order(order[:n], n_valid, rows)
        t_s, tp, vpos = order[n : 2 * n], order[2 * n : 3 * n], order[3 * n :]
    else:
        r = RowOrder(targets, rows, ignore_index)
        t_s = r.safe_t.index_select(0, r.perm)
        vpos = inverse_permutation(vperm.long())
    srt = lambda x: x.index_select(0, r.perm).contiguous()  # noqa: E731
    alpha_s, beta_s, lse_s = srt(alpha.float()), srt(beta.float()), srt(lse)
    eta_s = None if eta is None else srt(eta.float())
    BN, BV = stats_blocks(e2d.dtype)
    pos = torch.arange(r.N, device=dev)
    valid_s = pos < r.n_valid
    return _SparseStep(
        r, t_s, tp, vpos, pos, valid_s, alpha_s, beta_s, lse_s, eta_s, gamma, smooth, lam, cap_t, bias_t,
        vscore_t, BN, BV, -(-V // BV),
    )  # fmt: skip


def _stash_and_codes(
    e2d: torch.Tensor, st: _SparseStep, stash: torch.Tensor | None, code: torch.Tensor, need_de: bool
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """(stash, src, code): dE's buffer (the forward's ``stash``, a new one where it is None or
    empty; None without dE), the sorted row of each e2d row for dE's final move (None without
    dE), and the codes [N, n_tiles] (read from the stash's tail where ``code`` is not of that
    shape)."""
    N, nt = st.N, st.nt
    dev = e2d.device
    src = None
    if need_de:
        if stash is None or stash.numel() == 0:
            stash = torch.empty(e2d.shape, dtype=e2d.dtype, device=dev)
        # dE's rows move from the sorted order to e2d's at the end: the sorted row of each e2d
        # row, -1 for ignored rows and rows outside ``rows`` (gradient 0).
        src = torch.full((e2d.shape[0],), -1, dtype=torch.long, device=dev)
        src.index_copy_(0, st.r.erow_s, torch.where(st.valid_s, st.pos, -1))
    else:
        stash = None
    code_in_stash = tuple(code.shape) != (N, nt)
    if code_in_stash:
        code = stash_code(stash, N, nt)
    return stash, src, code


def _target_coef(st: _SparseStep, zt_s: torch.Tensor, softcap: float) -> torch.Tensor:
    """coef, fp32 [N] per sorted row: the target entry's dZ (``zt_s``: the sorted rows' target
    logits, the forward's)."""
    # The target entries, exact: (p_t (alpha [+ eta z_t]) - beta) softcap'(z_t); 0 at ignored rows.
    a_t = st.alpha_s if st.eta_s is None else st.alpha_s + st.eta_s * zt_s
    coef = a_t * torch.exp(zt_s - st.lse_s) - st.beta_s
    if softcap > 0:
        coef = coef * (1.0 - (zt_s / st.cap_t) ** 2)
    return torch.where(st.valid_s, coef, 0.0)


def _shared_terms(
    st: _SparseStep, code: torch.Tensor, need_dc: bool
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(q, slog): the mean-row spread of the dC corrections (slab_choice.mean_row_spread; None
    without dC) and the skipped tiles' entropy terms (tile_stats.skipped_slogs; None without
    eta)."""
    # Read by several of the step's parts, made once (host time of a step at small N or on one
    # rank's block, docs/benchmarks.md): each class's sorted position (st.vpos), the
    # mean-row spread of the dC corrections, and the tiles' skipped masses summed over the rows.
    q = mean_row_spread(st.vscore_t, st.nt, st.BV) if need_dc else None
    # The entropy's term of the skipped tiles' corrections, S_ij (zbar_ij - lse_i + log BV), once
    # per step (read by the dense-slab rule's row sampling, _dc_inputs and the dE writer).
    slog = None if st.eta_s is None else skipped_slogs(code, st.lse_s, st.cap_t, st.BV)
    return q, slog


@dataclasses.dataclass
class _SlabRule:
    """The device's dense-slab decision (_dense_slab_rule) and what the first-order terms read;
    every field None where the rule does not run."""

    dense: torch.Tensor | None = None  # int8 [n_slabs]: 1 for the slabs done densely
    flag: torch.Tensor | None = None  # int32 [1]: the first-order terms' flag
    decided: HostPeek | None = None  # dense and flag on their way to the host
    live: torch.Tensor | None = None  # bool [n_tiles]: the tiles outside dense slabs
    cm: torch.Tensor | None = None  # the tile means of C where the first-order terms may apply
    masses: torch.Tensor | None = None  # slab_choice.tile_masses, with those terms and dC


def _dense_slab_rule(
    e2d: torch.Tensor, c: torch.Tensor, vperm: torch.Tensor, st: _SparseStep, sp: SlabPlan,
    code: torch.Tensor, keep: torch.Tensor, coef: torch.Tensor, q: torch.Tensor | None,
    slog: torch.Tensor | None, cm_fwd: torch.Tensor | None, need_dc: bool, dense_kept: float,
    slab_error: float, slab_error_dc: float, host_gating: bool,
) -> _SlabRule:  # fmt: skip
    """The _SlabRule where ``sp`` runs the rule (dense_slab_flags, with slab_errors' estimates
    where ``sp.measured``), an empty one otherwise. The dense slabs' tiles are taken out of
    ``keep`` (in place). ``cm_fwd``: the forward's tile means of C, or None."""
    if not sp.rule:
        return _SlabRule()
    tps = sp.tiles_per_slab
    errors = cm = masses = None
    if sp.measured:
        if sp.first_order_cost is not None:
            # (At a cost of the slab count or more the rule never turns the terms on: their
            # operands, D x D buffers, and gated launches are then left out: slab_plan.)
            cm = tile_means(c, vperm, st.BV, torch.float32) if cm_fwd is None else cm_fwd
            if need_dc:
                masses = tile_masses(code)
        # (dC's estimates only where dC is wanted.)
        errors = slab_errors(
            e2d, c, st.bias_t, st.r.erow_s, st.t_s, st.lse_s, st.alpha_s, st.beta_s, code, keep, vperm,
            st.r.n_valid, st.cap_t, st.BN, st.BV, tps * st.BV, cm=cm,
            vscore=st.vscore_t if sp.dc_rule else None, coef_t=coef, eta_s=st.eta_s, vpos=st.vpos, q=q,
            M=masses, logit_scale=st.lam, slog=slog,
        )  # fmt: skip
    dense, flag = dense_slab_flags(
        code, keep, st.r.n_valid, st.BN, tps, dense_kept, slab_error, errors, sp.first_order_cost,
        slab_error_dc=slab_error_dc,
    )  # fmt: skip
    del errors
    # The decisions on their way to the host: the launches they gate off are not issued
    # where they have arrived in time (host_peek.py; the same gradients either way).
    decided = HostPeek(dense, flag, enabled=host_gating)
    # The dense tiles leave the plan: not kept, and their codes read as no mass (the kernels
    # and _dc_inputs mask them; the forward's codes are not modified).
    live = (dense == 0).repeat_interleave(tps)[: st.nt]
    keep &= live[None, :]
    return _SlabRule(dense, flag, decided, live, cm, masses)


def _sparse_plan(
    e2d: torch.Tensor, c: torch.Tensor, weight: torch.Tensor | None, vperm: torch.Tensor, st: _SparseStep,
    code: torch.Tensor, keep: torch.Tensor, coef: torch.Tensor, q: torch.Tensor | None,
    slog: torch.Tensor | None, rule: _SlabRule, need_de: bool, need_dc: bool, dc_scratch_tiles: int | None,
) -> tuple[SparsePlan, torch.Tensor | None]:  # fmt: skip
    """(plan, gamma_s): the step's SparsePlan (the dE writer's tile lists and smoothing term,
    _dc_inputs' dC writer inputs, the kept tiles' scratch slots, the first-order terms) and
    the sorted rows' smoothing coefficients (None without smoothing)."""
    V = c.shape[0]
    gamma_s = st.sort(st.gamma.float()) if st.smooth else None
    w = None
    if st.smooth:
        w = weight.float() if weight is not None else torch.ones(V, dtype=torch.float32, device=e2d.device)
    list_e = cnt_e = wc = None
    dc_in = (None,) * 9
    if need_de:
        list_e, cnt_e = compact_lists(keep)
        if st.smooth:
            wc = weighted_rows(w, c)
    srow = None
    if need_dc:
        # (the rows' smoothing sum only with smoothing: without it gamma is 0, and the pass over
        # E's rows would go unread)
        gamma_dc = st.gamma if st.smooth else None
        dc_in, srow = _dc_inputs(
            e2d, st.r, st.valid_s, keep, code, st.alpha_s, coef, st.t_s, st.vpos, q, gamma_dc, st.BV,
            rule.live, rule.cm is not None, st.eta_s, slog, st.lse_s, st.tp,
        )  # fmt: skip
    gidx, klist, n_kept = _kept_scratch(keep, st.N, e2d.dtype, dc_scratch_tiles, need_dc)
    fo, fo_pending = _first_order_plan(e2d, c, vperm, st, rule, srow, need_dc)
    del srow
    # dC's inputs (list_c to seg): owned by the plan alone once it is returned, released after dC.
    list_c, cnt_c, G, q, trow, tpos, tcoef, seg, ge = dc_in
    plan = SparsePlan(
        keep.to(torch.int8), list_e, cnt_e, list_c, cnt_c, code, coef, G, q, trow, tpos, tcoef, seg, wc,
        ge, gidx.view(keep.shape), klist, n_kept, fo, fo_pending, slog,
    )  # fmt: skip
    return plan, gamma_s


def _kept_scratch(
    keep: torch.Tensor, N: int, dtype: torch.dtype, dc_scratch_tiles: int | None, need_dc: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(gidx, klist, n_kept), see kernels.backward_sparse.SparsePlan: each kept tile's index among
    the kept ones (int32, ``keep`` flattened), the flat index of each of the first ones with a dC
    scratch slot, and their count (int32 [1])."""
    dev = keep.device
    # Kept tiles numbered in (block, tile) order; the first `cap` get a dZ scratch slot of the dC
    # writer (in the stash, when there is one; fewer if it has no room for them).
    cap = kept_scratch_tiles(N, dtype, dc_scratch_tiles) if need_dc else 0
    kflat = keep.reshape(-1)
    gidx = (kflat.cumsum(0) - 1).to(torch.int32)
    slot = torch.where(kflat & (gidx < cap), gidx.long(), cap)
    klist = torch.zeros(cap + 1, dtype=torch.int32, device=dev).scatter_(
        0, slot, torch.arange(kflat.numel(), dtype=torch.int32, device=dev)
    )
    del slot
    n_kept = kflat.sum(dtype=torch.int32).reshape(1)
    return gidx, klist, n_kept


def _first_order_plan(
    e2d: torch.Tensor, c: torch.Tensor, vperm: torch.Tensor, st: _SparseStep, rule: _SlabRule,
    srow: torch.Tensor | None, need_dc: bool,
) -> tuple[FirstOrder | None, PendingFirstOrder | None]:  # fmt: skip
    """(fo, fo_pending): the first-order terms (_first_order) where their flag has reached the host
    set, their builder where it has not arrived (PendingFirstOrder), else (None, None), as
    where the rule has not made them a candidate (``rule.cm`` None). ``srow``: _dc_inputs'."""
    if rule.cm is None:
        return None, None
    # (Called after the plan's other host work, so that the device's flag has had time to reach
    # the host: where it says 0 the terms' operands and gated launches are left out, as the flag
    # would make them no-ops. Where it has not arrived, the operands are built after the dC
    # writer's launch, where it has had longer: PendingFirstOrder.)
    seen = rule.decided.get()
    dc_args = (e2d, st.r.erow_s, srow, rule.masses, rule.live, st.vpos) if need_dc else None
    if seen is None:
        build = functools.partial(_first_order, c, rule.cm, vperm, rule.flag, st.BV, dc_args, st.lam)
        return None, PendingFirstOrder(rule.flag, build)
    if int(seen[1][0]) != 0:
        return _first_order(c, rule.cm, vperm, rule.flag, st.BV, dc_args, st.lam), None
    return None, None


def first_order_terms(c, cm, vperm, flag, BV: int, lam: float = 1.0) -> FirstOrder:
    """The first-order terms' dE operands (kernels/first_order.py): Gbar = (C^T C - sum_j |j|
    mean(C_j) mean(C_j)^T) / V from the gated Gram kernel (zeros where ``flag`` is 0), in the
    operand dtype with its scale; the dC ones are filled in by _first_order_dc. ``lam`` (1 / the
    temperature) scales the terms: their expansion is in the tempered logit's deviation lam x."""
    V = c.shape[0]
    cnt = tile_sizes(V, BV, c.device)
    # The tile means' part in fp32 (it can nearly cancel C^T C's where the means dominate),
    # accumulated into the same buffer (one D x D buffer and no elementwise passes over it).
    g = gram(cm, flag, w=cnt, scale=-1.0 / V, out=gram(c, flag, scale=1.0 / V))
    gn, gs = normalized(g, c.dtype)
    if lam != 1.0:
        gs = gs * lam
    return FirstOrder(flag, gn, gs, cm)


def _first_order(c, cm, vperm, flag, BV: int, dc_args: tuple | None, lam: float = 1.0) -> FirstOrder:
    """first_order_terms, with their dC operands (_first_order_dc of ``dc_args``: e2d, erow_s,
    srow, masses, live, vpos) where dC is wanted; ``lam`` as first_order_terms'."""
    fo = first_order_terms(c, cm, vperm, flag, BV, lam)
    if dc_args is not None:
        _first_order_dc(fo, *dc_args, BV, lam)
    return fo


def _first_order_dc(fo: FirstOrder, e2d, erow_s, srow, masses, live, vpos, BV: int, lam: float = 1.0) -> None:
    """The first-order terms' dC operands into ``fo``: H = sum_i F_i e_i e_i^T (``srow``: F_i per
    sorted row, from _dc_inputs; the gated Gram kernel), rate = r_j / |j| (from ``masses``,
    slab_choice.tile_masses, restricted to the ``live`` tiles: those outside dense slabs, None:
    all) and tile_of (each class's tile; ``vpos``: each class's sorted position)."""
    V = vpos.numel()
    cnt = tile_sizes(V, BV, e2d.device)
    fo.H = gram(e2d, fo.flag, erow_s, srow)
    if lam != 1.0:
        fo.H.mul_(lam)
    mass = masses if live is None else masses * live
    fo.rate = mass / mass.sum().clamp(min=1e-30) / cnt
    fo.tile_of = (vpos // BV).to(torch.int32)


def _dc_inputs(
    e2d, r, valid_s, keep, code, alpha_s, coef, t_s, vpos, q, gamma, BV: int, live=None, want_srow=False,
    eta_s=None, slog=None, lse_s=None, tp=None,
):  # fmt: skip
    """((list_c, cnt_c, G, q, trow, tpos, tcoef, seg, ge), srow): the dC writer's inputs, see
    kernels.backward_sparse.SparsePlan. ``valid_s``: the sorted rows below n_valid; ``vpos``: each
    class's sorted position; ``q``: the mean-row spread of the corrections
    (slab_choice.mean_row_spread). With ``eta_s`` a skipped
    tile's mass carries the entropy's coefficient alpha_i + eta_i zbar_ij, as in dE: ``slog``
    [N, n_tiles] holds S_ij (zbar_ij - lse_i + log BV) (tile_stats.skipped_slogs) and ``lse_s``
    the rows' lse; ``tp`` each sorted row's target's sorted position (None: from vpos).

    ``live`` (bool [n_tiles] or None): the tiles outside dense slabs, the only ones whose codes
    count. Built in this function so that nothing but the plan holds them (the launcher releases them
    once dC is written, before dE and the tile means are allocated). With ``want_srow`` also
    srow, fp32 [N]: F_i = alpha_i S_i (with eta sum_j (a_ij + eta_i) S_ij) per sorted row, the
    first-order terms' row weights (_first_order_dc), else None; where their flag is set the dC
    writer spreads the zeroth-order correction uniformly over the tile instead of by q (the
    first-order term carries what the mean-row softmax spread would)."""
    N, nt = code.shape
    V, D = vpos.numel(), e2d.shape[1]
    dev, f32 = e2d.device, torch.float32
    list_c, cnt_c = compact_lists(keep.T)
    # G_j = sum_i a_ij S_ij e_i over the rows whose tile j is skipped (a_ij = alpha_i without eta).
    G = srow = None
    if want_srow:
        srow = torch.empty(N, dtype=f32, device=dev)  # F_i: alpha_i S_i, with eta sum_j (a_ij + eta_i) S_ij
    use_bf16 = e2d.dtype == torch.bfloat16 and e2d.is_cuda
    step = _chunk_rows(nt, D, e2d.element_size())
    for s in range(0, N, step):
        t = min(s + step, N)
        # 0 for kept tiles and ignored rows (code 255)
        M = decode_tile_mass(code[s:t])
        if live is not None:  # tiles of dense slabs: no correction
            M = M * live[None, :]
        S = M * alpha_s[s:t, None]  # alpha is 0 at ignored rows
        if eta_s is not None:  # (eta is 0 at ignored rows too)
            h, ls = eta_s[s:t, None], lse_s[s:t, None]
            sl = slog[s:t] if live is None else slog[s:t] * live[None, :]
            S += M * (h * (ls - math.log(BV))) + sl * h
        E_c = e2d.index_select(0, r.erow_s[s:t])
        if use_bf16:
            # S^T's leading dimension padded to 8 tiles: at an odd one (16-byte misaligned rows)
            # cuBLAS took a kernel 3x slower (n_tiles = 501: 0.24 against 0.04 ms per step, H200)
            S16 = (S if nt % 8 == 0 else F.pad(S, (0, -nt % 8))).to(e2d.dtype)
            part = torch.mm(S16.T, E_c, out_dtype=f32)[:nt]
        else:
            part = S.T @ E_c.float()
        G = part if G is None else G.add_(part)
        if srow is not None:
            srow[s:t] = S.sum(1) if eta_s is None else S.sum(1) + eta_s[s:t] * M.sum(1)
    if G is None:  # (no rows)
        G = torch.zeros(nt, D, dtype=f32, device=dev)
    q = q.reshape(-1)[:V]  # (the dC writer spreads uniformly instead where fo's flag is set)
    if tp is None:  # (each sorted row's target's sorted position, where the caller has none)
        tp = vpos.index_select(0, t_s)
    # The valid rows by their target's sorted position (so by its tile: seg, the tiles'
    # boundaries; and a class's rows consecutive: kernels/dc_skipped.py), the others after them
    # at nt * BV. int32 keys: a radix sort's passes go with the key's bytes.
    key = torch.where(valid_s, tp, nt * BV).to(torch.int32)
    tpos, order = torch.sort(key, stable=True)
    trow = r.erow_s.index_select(0, order)
    tcoef = coef.index_select(0, order)
    seg = torch.searchsorted(tpos, torch.arange(0, (nt + 1) * BV, BV, dtype=torch.int32, device=dev))
    ge = None if gamma is None else weighted_rows(gamma, e2d, r.erow)
    return (list_c, cnt_c, G, q, trow, tpos, tcoef, seg, ge), srow
