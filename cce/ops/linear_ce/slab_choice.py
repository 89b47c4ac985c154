"""Which slabs of the sorted vocabulary the sparse backward does densely, decided on the device.

The sparse backward replaces each skipped (token block, tile) pair by a rank-1 correction whose
error depends on the data: about 0.01 of the skipped mass on zipf-like logits, 0.02-0.04 on
near-uniform ones, 0.3 or more on hidden states of a model trained on real text
(docs/design.md, "Dense slabs"). No rule on the statistics alone (a threshold, a skipped mass)
holds one error on all of them, so the error is measured: for a few sampled rows the exact
non-target gradient of every skipped tile is formed and compared with its correction, per slab.
The slabs whose corrections err the most are made dense until the sampled rows' remaining error
is at most ``slab_error`` of their exact gradient (relative Frobenius norm, the measure of the
accuracy target). The same holds for dC (dc_error_terms): its error is a sum over all rows,
whose systematic part grows like N against the exact gradient's sqrt N, so it is estimated from
the sampled rows' pairs (an unbiased U-statistic) against ||dC||^2 whose target part is computed
exactly. Slabs where the filter keeps many tiles are dense as well: recomputing kept tiles one by
one costs more than a GEMM there.

Everything stays on the device (the flags are a tensor the dense-slab kernels read), so a step
is still capturable in a CUDA graph. Cost: two passes over C for a few rows and a [rows, V]
softmax, about one token block's share of one matmul pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .kernels.backward_exact import exact_block_rows
from .kernels.common import de_norm_sq, inverse_permutation, mm_f32, slab_tiles, stats_blocks
from .kernels.dense_slabs import slab_products
from .kernels.dz import class_sample_dz
from .kernels.first_order import first_order_cost
from .kernels.slab_rule import (
    RULE_KERNEL_SLABS,
    dc_tile_errors,
    row_masses,
    sampled_dz,
    slab_flags,
    systematic_sample,
)
from .kernels.tile_stats import STATS_STEPS, decode_tile_mass

# Rows sampled by slab_errors. Their weighted error estimates the whole batch's; rows are drawn
# in proportion to their skipped mass (plus a uniform share), since on hidden states of a model
# trained on real text a few rows with much skipped mass carry most of the error: evenly spaced
# rows measured 2.3x less than the true dE error there (docs/benchmarks.md).
ERROR_ROWS = 32
# The uniform share of the sampling probability (keeps the estimate of ||dE|| itself, which
# every row carries about alike, from resting on the heavy rows only).
UNIFORM_SHARE = 0.5
# Rows per chunk when dc_error_terms sums the tiles' decoded masses over the rows (bounds the
# fp32 temporary).
_MASS_ROWS = 8192
# Classes whose exact dC rows estimate ||dC|| (dc_norm_estimate): the front of the sorted
# vocabulary, and an even sample of the rest.
NORM_HEAD = 1024
NORM_TAIL = 512
# Bytes of dc_norm_estimate's fp32 logits per row chunk.
_NORM_CHUNK_BYTES = 64 << 20


@dataclass(frozen=True)
class SlabPlan:
    """What the sparse backward decides on the host about dense slabs and first-order terms,
    from shapes and options alone (slab_plan; sparse_backward reads it, cce.explain shows it):
    the slabs' width, and which parts of the device's rule run. Which slabs end up dense, and
    whether the first-order terms apply, the device decides from the data (dense_slab_flags).

    tiles_per_slab: vocabulary tiles (of the statistics' BLOCK_V classes) per dense slab.
    row_blocks: the most row blocks the dense slabs run in (dense_slabs.DenseSlabRun: with dE
        and the rows of E gathered for tensor descriptors; fewer without them).
    rule: the dense-slab rule runs (dense_slab_flags).
    measured: its error estimates from sampled rows run (slab_errors).
    dc_rule: dC's part of those estimates (dC asked for and slab_error_dc < 1).
    first_order_cost: the first-order terms' cost in dense slabs where the rule may apply them
        (below the slab count), else None.
    reasons: the above in words.
    """

    tiles_per_slab: int
    row_blocks: int
    rule: bool
    measured: bool
    dc_rule: bool
    first_order_cost: float | None
    reasons: tuple[str, ...]


def slab_plan(
    N: int,
    V: int,
    D: int,
    dtype: torch.dtype,
    need_dc: bool,
    dense_slabs: bool,
    dense_kept: float,
    slab_error: float,
    slab_error_dc: float,
    dense_slab_bytes: int,
    first_order: bool,
) -> SlabPlan:
    """The SlabPlan of a sparse backward over N rows, V classes, D features of kernel operands
    in ``dtype`` (float64 runs in float32), with Tuning's dense-slab options (1 or more turns a
    rule off)."""
    kdtype = torch.float32 if dtype == torch.float64 else dtype
    _, BV = stats_blocks(kdtype)
    nt = -(-V // BV)
    tps = slab_tiles(N, nt, BV, kdtype.itemsize, dense_slab_bytes)
    n_slabs = -(-nt // tps)
    BN = stats_blocks(kdtype)[0]
    blocks = (
        -(-N // exact_block_rows(N, D, kdtype.itemsize, True, True, False, dense_slab_bytes, BN)) if N else 0
    )
    dc_rule = need_dc and slab_error_dc < 1
    measured = slab_error < 1 or dc_rule
    rule = dense_slabs and N > 0 and nt > 0 and (dense_kept <= 1 or measured)
    cost = first_order_cost(N, V, D, tps * BV) if rule and measured and first_order else None
    fo = cost is not None and cost < n_slabs
    if not rule:
        why = (
            "Tuning(dense_slabs=False)"
            if not dense_slabs
            else "no rows or classes"
            if N == 0 or nt == 0
            else "no rule on (every threshold is 1 or more)"
        )
        return SlabPlan(tps, blocks, False, False, dc_rule, None, (f"no dense slabs: {why}",))
    parts = [f"at least {dense_kept:g} of its tiles kept"] if dense_kept <= 1 else []
    if measured:
        bound = [f"{slab_error:g} in dE"] if slab_error < 1 else []
        bound += [f"{slab_error_dc:g} in dC"] if dc_rule else []
        parts.append(f"corrections erring more than {' / '.join(bound)} ({ERROR_ROWS} sampled rows)")
    reasons = [
        f"dense slabs: {n_slabs} slab(s) of {tps} tile(s) ({tps * BV} classes), each made dense on the "
        "device where it has " + " or ".join(parts) + f"; run by row blocks, at most {blocks} (their fp32 dE "
        f"rows and gathered rows of E within {dense_slab_bytes / 2**20:.3g} MiB)"
    ]
    if fo:
        reasons.append(f"first-order terms a candidate: their cost, {cost:.2g} slab(s), is below {n_slabs}")
    elif cost is not None:
        reasons.append(f"no first-order terms: their cost, {cost:.2g} slab(s), is not below {n_slabs}")
    elif measured:
        reasons.append("no first-order terms: Tuning(first_order=False)")
    else:
        reasons.append("no first-order terms: they need the corrections' measured errors")
    return SlabPlan(tps, blocks, True, measured, dc_rule, cost if fo else None, tuple(reasons))


class SlabErrors(NamedTuple):
    """What slab_errors measures on the sampled rows (each row times its sampling scale).

    err: fp32 [n_slabs, rows, D], each slab's rank-1 corrections' error in dE per row;
    ref: fp32 [rows, D], the rows' exact dE; fo: fp32 [n_slabs, rows, D] or None, the part of
    the first-order terms each slab's skipped tiles give dE. dc_err / dc_err_fo: fp32 [n_slabs]
    or None, each slab's squared dC error estimated (without / with the first-order terms);
    dc_ref: fp32 [] or None, ||dC||^2 estimated (dc_error_terms). ref_sq: fp32 [] or None,
    ||dE||^2 estimated with the target terms summed exactly over all rows (slab_errors'
    ``coef_t``, kernels.common.de_norm_sq); None: ||ref||^2 is the estimate.
    """

    err: torch.Tensor
    ref: torch.Tensor
    fo: torch.Tensor | None = None
    dc_err: torch.Tensor | None = None
    dc_err_fo: torch.Tensor | None = None
    dc_ref: torch.Tensor | None = None
    ref_sq: torch.Tensor | None = None


def sample_rows(
    code: torch.Tensor,
    alpha_s: torch.Tensor,
    n_valid: torch.Tensor,
    k: int,
    eta_s: torch.Tensor | None = None,
    lse_s: torch.Tensor | None = None,
    block_v: int = 1,
    softcap: float = 0.0,
    slog: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(pos, scale): k sorted-row positions and per-position weights, on the device.

    With N <= k every row is taken once (scale 1). Otherwise systematic sampling with probability
    pi_i = UNIFORM_SHARE / n_valid + (1 - UNIFORM_SHARE) m_i / sum(m) over the valid rows, m_i =
    |alpha_i| times the row's decoded skipped mass (its corrections' size; with the entropy's
    coefficient ``eta_s``, sum_j |a_ij S'_ij|, kernels/slab_rule.row_masses), deterministic (the
    k quantiles (j + 1/2) / k of the cumulative pi; no random state is drawn); scale_i =
    1 / sqrt(k pi_i), so that the sum over the sampled rows of scale^2 x (a row's squared norm) is
    an unbiased estimate of the sum over all rows: slab_errors scales each row's error and
    reference by it.
    """
    N = code.shape[0]
    dev = code.device
    if N <= k:
        return torch.arange(N, device=dev), torch.ones(N, dtype=torch.float32, device=dev)
    # Two launches (kernels/slab_rule.py): host time of a step at small N.
    m = row_masses(code, alpha_s, STATS_STEPS, eta_s, lse_s, block_v, softcap, slog)
    return systematic_sample(m, n_valid, k, rows=True, share=UNIFORM_SHARE)


def slab_errors(
    e2d: torch.Tensor, c: torch.Tensor, bias: torch.Tensor | None, erow_s: torch.Tensor, t_s: torch.Tensor,
    lse_s: torch.Tensor, alpha_s: torch.Tensor, beta_s: torch.Tensor, code: torch.Tensor, keep: torch.Tensor,
    vperm: torch.Tensor, n_valid: torch.Tensor, softcap: float, BLOCK_N: int, BLOCK_V: int, width: int,
    rows: int = ERROR_ROWS, cm: torch.Tensor | None = None, vscore: torch.Tensor | None = None,
    coef_t: torch.Tensor | None = None, eta_s: torch.Tensor | None = None, *,
    vpos: torch.Tensor | None = None, q: torch.Tensor | None = None, M: torch.Tensor | None = None,
    logit_scale: float = 1.0, slog: torch.Tensor | None = None,
) -> SlabErrors:  # fmt: skip
    """SlabErrors for ``rows`` sorted rows i drawn by sample_rows (all of them when N <= rows),
    each times its scale: err[s, i] is what the rank-1 corrections of the skipped tiles of slab s
    (``width`` sorted positions) get wrong in dE_i,

        err[s, i] = sum_{skipped j in s} ( sum_{v in j, v != t_i} dZ_iv c_v - alpha_i S'_ij mean(C_j) ),

    with dZ_iv = alpha_i p_iv softcap'(z_iv) and S'_ij the decoded mass the sparse backward uses
    (with ``eta_s``, the entropy's coefficient per sorted row: dZ_iv = p_iv (alpha_i + eta_i z_iv)
    softcap'(z_iv) and the corrections' coefficients of kernels/slab_rule.skipped_coef);
    ref[i] is the exact sum_v dZ_iv c_v with the target term (alpha p_t - beta) softcap'. Sorted
    rows past n_valid count with alpha = beta = 0.

    With ``cm`` (fp32 [n_tiles, D], the tile means of the sorted vocabulary) also fo[s, i], the
    part of the first-order term (kernels/first_order.py) that slab s's skipped tiles give dE_i:
    (F_is / V) G e_i, F_is = alpha_i S'_is (with the entropy's term, sum_{j in s} (a_ij + eta_i)
    S'_ij, kernels/first_order.py), S'_is the row's decoded mass in the slab and G e_i =
    sum_v (e_i . (c_v - mean(C_j(v)))) c_v computed exactly for the row (so err - fo is what the
    corrections with that term get wrong).

    With ``vscore`` (the forward's class scores, sorted positions) also dC's estimates
    (dc_error_terms; dc_err_fo with ``cm``).

    With ``coef_t`` (fp32 [N], every sorted row's target coefficient (alpha p_t - beta)
    softcap', 0 past n_valid) also ref_sq, ||dE||^2 estimated with the target terms as a
    control variate: sum_m ||ref_m||^2 - lam (sum_m s_m^2 coef_m^2 ||c_t_m||^2 - T), with
    T = sum_i coef_i^2 ||c_t_i||^2 over all rows (exact, O(N D)) and lam >= 0 the sampled
    rows' regression slope of the first terms on the second (unbiased for a fixed lam; the
    slope taken from the same rows adds a bias of order 1 / k). It removes the target terms'
    spread from row to row: under vocabulary parallelism only the rows whose target lies in
    the rank's block have one, and ||ref|| alone then erred by up to 15% on 32 sampled rows
    (random data, a half of llama3-8b's head, docs/benchmarks.md), flipping the rule's
    decision where the corrections' error sits near the bound. The slope, not 1: on zipf-like
    data the rest of a row's gradient is correlated with its target term, and lam = 1 erred
    more there than ||ref|| alone. Exact when every row is sampled.

    ``logit_scale`` (lam, 1 / the temperature): the logits are lam (e c^T) + bias; the caller
    passes the bias and softcap scaled by lam as well (softcap_T(lam x) = lam softcap(x) with
    softcap_T = lam softcap), so that every estimate here is of the tempered logits.

    ``slog`` (with ``eta_s``): the step's tile_stats.skipped_slogs, which the row sampling then
    reads instead of solving them again.
    """
    pos, scale = sample_rows(code, alpha_s, n_valid, rows, eta_s, lse_s, BLOCK_V, softcap, slog)
    k = pos.numel()
    ok = (pos < n_valid.long()).float() * scale
    vp = vperm.long()
    es = e2d.index_select(0, erow_s.index_select(0, pos))
    w2, S, SF, x, xs = _sampled_weights(
        es, c, bias, vperm, vp, pos, ok, alpha_s, beta_s, t_s, lse_s, code, keep, softcap, BLOCK_N, BLOCK_V,
        eta_s, cm, vpos, vscore is not None, logit_scale,
    )  # fmt: skip
    err, ref, fo, ref_sq = _de_errors(w2, SF, xs, c, vperm, t_s, coef_t, n_valid, pos, ok, BLOCK_V, width)
    if vscore is None:
        return SlabErrors(err, ref, fo, ref_sq=ref_sq)
    dc_err, dc_err_fo = dc_error_terms(
        code, es, scale, w2[:k], S, x, vp, vscore, BLOCK_V, width, None if SF is S else SF, q=q, M=M
    )
    del w2, x
    dc_ref = dc_norm_estimate(
        e2d, c, bias, erow_s, t_s, lse_s, alpha_s, beta_s, n_valid, vp, softcap, eta_s=eta_s,
        logit_scale=logit_scale,
    )  # fmt: skip
    return SlabErrors(err, ref, fo, dc_err, dc_err_fo, dc_ref, ref_sq)


def _sampled_weights(
    es: torch.Tensor, c: torch.Tensor, bias: torch.Tensor | None, vperm: torch.Tensor, vp: torch.Tensor,
    pos: torch.Tensor, ok: torch.Tensor, alpha_s: torch.Tensor, beta_s: torch.Tensor, t_s: torch.Tensor,
    lse_s: torch.Tensor, code: torch.Tensor, keep: torch.Tensor, softcap: float, BLOCK_N: int, BLOCK_V: int,
    eta_s: torch.Tensor | None, cm: torch.Tensor | None, vpos: torch.Tensor | None, keep_x: bool,
    logit_scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:  # fmt: skip
    """(w2, S, SF, x, xs) of slab_errors' k sampled rows (hidden states ``es``, sorted positions
    ``pos``, scales ``ok``, 0 past n_valid): kernels/slab_rule.sampled_dz's outputs from the rows'
    logits (fp32 [k, V], dropped here), and with ``cm`` the first-order terms' deviations x (fp32
    [k, V], class order; None unless ``keep_x``: dC's estimates read them) and the same in the
    sorted order, xs (_de_errors forms G e_i = sum_v x_iv c_v from them); both None without
    ``cm``. x and xs are times ``logit_scale``, as the logits are."""
    z = mm_f32(es, c.T, None)  # [k, V]
    x = xs = None
    if logit_scale != 1.0:  # the tempered logits (and so their deviations within the tiles)
        z.mul_(logit_scale)
    if cm is not None:
        # x_iv = e_i . (c_v - mean(C_j(v))) (class order), lam x with the temperature
        tile_of = (inverse_permutation(vp) if vpos is None else vpos) // BLOCK_V
        zbar = mm_f32(es, cm.T.to(es.dtype), None)  # [k, n_tiles]
        if logit_scale != 1.0:
            zbar.mul_(logit_scale)
        x = z - zbar.index_select(1, tile_of)
        xs = x.index_select(1, vp)
        if not keep_x:
            x = None
    # Rows [0, k) of w2: the non-target dZ where the tile is skipped minus the correction
    # alpha_i S'_ij mean(C_j) as weights alpha_i S'_ij / |j| on the tile's classes (the
    # corrections' error weights); rows [k, 2k): the full dZ (the reference). Sorted positions;
    # one slab_products call reads C once for both. S: alpha_i S'_ij [k, nt], 0 where kept.
    w2, S, SF = sampled_dz(
        z, bias, vperm, pos, ok, alpha_s, beta_s, t_s, lse_s, code, keep, softcap, BLOCK_N, BLOCK_V,
        STATS_STEPS, eta_s,
    )  # fmt: skip
    return w2, S, SF, x, xs


def _de_errors(
    w2: torch.Tensor, SF: torch.Tensor, xs: torch.Tensor | None, c: torch.Tensor, vperm: torch.Tensor,
    t_s: torch.Tensor, coef_t: torch.Tensor | None, n_valid: torch.Tensor, pos: torch.Tensor,
    ok: torch.Tensor, BLOCK_V: int, width: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:  # fmt: skip
    """(err, ref, fo, ref_sq) of slab_errors' SlabErrors from _sampled_weights' w2, SF and xs: err,
    ref and (with ``xs``) G e_i = sum_v x_iv c_v from one slab_products pass over C (its rows: w2's,
    then xs's), fo (None without ``xs``) from each slab's share of the first-order weights SF and
    G e_i, ref_sq (None without ``coef_t``) from kernels.common.de_norm_sq."""
    k, nt = SF.shape
    V = c.shape[0]
    w = w2 if xs is None else torch.cat([w2, F.pad(xs, (0, w2.shape[1] - xs.shape[1]))])  # (w2: V padded)
    prod = slab_products(w, c, vperm, width)  # [n_slabs, 2k (+ k), D]
    err, ref = prod[:, :k], prod[:, k : 2 * k].sum(0)
    ref_sq = None
    if coef_t is not None:
        # The target terms as a control variate, weighted by the sample's regression slope (1
        # where the rest of dE is independent of the target term, less where it is not).
        ref_sq = de_norm_sq(c, t_s, coef_t, n_valid, ref, pos, ok)[0]
    n_slabs = err.shape[0]
    fo = None
    if xs is not None:
        gx = prod[:, 2 * k :].sum(0)  # [k, D]
        per_slab = (
            F.pad(SF, (0, n_slabs * (width // BLOCK_V) - nt)).view(k, n_slabs, -1).sum(2)
        )  # [k, n_slabs]
        fo = (per_slab.T / V)[:, :, None] * gx[None]
    return err, ref, fo, ref_sq


def mean_row_spread(vscore: torch.Tensor, n_tiles: int, BLOCK_V: int) -> torch.Tensor:
    """fp32 [n_tiles, BLOCK_V]: how a skipped tile's dC correction G_j spreads over its classes,
    the softmax of the forward's class scores ``vscore`` (the mean-row logits, sorted positions)
    within each tile; 0 past V and in a tile whose classes a -inf bias masks (softmax NaN there:
    no mass to spread)."""
    sc = F.pad(vscore, (0, n_tiles * BLOCK_V - vscore.numel()), value=float("-inf"))
    return torch.softmax(sc.view(n_tiles, BLOCK_V), dim=1).nan_to_num_(0.0)


def tile_masses(code: torch.Tensor) -> torch.Tensor:
    """fp32 [n_tiles]: each tile's decoded skipped masses summed over the rows (kept tiles and
    ignored rows have code 255, mass 0), in chunks of _MASS_ROWS rows (bounds the fp32
    temporary)."""
    N, nt = code.shape
    M = torch.zeros(nt, dtype=torch.float32, device=code.device)
    for s0 in range(0, N, _MASS_ROWS):
        M += decode_tile_mass(code[s0 : s0 + _MASS_ROWS]).sum(0)
    return M


def dc_error_terms(
    code: torch.Tensor,
    es: torch.Tensor,
    scale: torch.Tensor,
    w: torch.Tensor,
    S: torch.Tensor,
    x: torch.Tensor | None,
    vp: torch.Tensor,
    vscore: torch.Tensor,
    BLOCK_V: int,
    width: int,
    SF: torch.Tensor | None = None,
    *,
    q: torch.Tensor | None = None,
    M: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(dc_err [n_slabs], dc_err_fo [n_slabs] or None): dC's squared error per slab (``width``
    sorted positions, a multiple of BLOCK_V) estimated from slab_errors' sampled rows (its es,
    scale, w, S, x; SF: the first-order terms' weights (a_ij + eta_i) S'_ij with the entropy's
    term, None: S). ``q``: mean_row_spread(vscore) and ``M``: tile_masses(code), where the caller
    has them.

    dC = sum_i F_i e_i^T (F_i the row's dZ over the classes), and each skipped (row, class) pair
    errs by W_iv = dZ_iv - alpha_i S'_ij q_v, q the spread of the correction G_j = sum_i alpha_i
    S'_ij e_i over the tile (the mean-row softmax; uniform with the first-order terms, which
    also take alpha_i S_i r_j / |j| x_iv off: kernels/first_order.py, with S_i and r_j from all
    of the row's and the tile's skipped mass, as if no slab were dense). A slab's dC error is
    then X = sum_i W_i,s e_i^T, a sum over all N rows whose rows' errors add up coherently (they
    share the classes that are probable in many contexts): its squared norm grows like N^2
    where the exact gradient's grows like N. With y_m = X_m / (k pi_m) for the k sampled rows m,

        ||X||^2 ~ k / (k - 1) sum_{m != m'} <y_m, y_m'> = k / (k - 1) sum_{m != m'} s_m^2 s_m'^2
                  (e_m . e_m') (W_m,s . W_m',s)

    (s = scale) is unbiased for independent draws (the pairs' means are the sum's; the k
    squared terms, which would add the rows' own noise, are left out) and exact with every row
    sampled (then all pairs, the squares included, and scale 1). The sums over a tile's
    positions and pairs run in one launch (kernels/slab_rule.dc_tile_errors), the tiles' sums
    per slab here.
    """
    N, nt = code.shape
    V = vp.numel()
    k = es.shape[0]
    tps = width // BLOCK_V
    n_slabs = -(-nt // tps)
    esc = es.float() * scale[:, None]
    pair = esc @ esc.T  # [k, k]: s_m s_m' (e_m . e_m')
    if q is None:
        q = mean_row_spread(vscore, nt, BLOCK_V)
    fo = {}
    if x is not None:
        if M is None:
            M = tile_masses(code)
        f = (S if SF is None else SF).sum(1)
        fo = dict(x=x, vperm=vp, rate=M / M.sum().clamp(min=1e-30), f=f)
    sampled = N > k
    out = (
        dc_tile_errors(
            w, S, q.reshape(-1), pair, sampled, k / (k - 1) if sampled else 1.0, V, n_slabs * tps, **fo
        )
        .view(2, n_slabs, tps)
        .sum(2)
    )
    return out[0], None if x is None else out[1]


def dc_norm_estimate(
    e2d: torch.Tensor,
    c: torch.Tensor,
    bias: torch.Tensor | None,
    erow_s: torch.Tensor,
    t_s: torch.Tensor,
    lse_s: torch.Tensor,
    alpha_s: torch.Tensor,
    beta_s: torch.Tensor,
    n_valid: torch.Tensor,
    vp: torch.Tensor,
    softcap: float,
    head: int = NORM_HEAD,
    tail: int = NORM_TAIL,
    chunk_bytes: int = _NORM_CHUNK_BYTES,
    eta_s: torch.Tensor | None = None,
    logit_scale: float = 1.0,
) -> torch.Tensor:
    """fp32 []: ||dC||^2 (the label-smoothing term left out) from the exact dC rows of ``head``
    classes at the front of the sorted vocabulary and of ``tail`` classes of the rest, drawn by
    systematic sampling in proportion to their target count plus its mean (unbiased: each
    sampled class's squared row divided by its expected number of draws).

    From sampled rows this norm cannot be had: on a trained model dC_v = sum_i dZ_iv e_i is a
    small difference of the target rows' pull and the other rows' push on class v (calibration),
    which no few rows see. Exact rows of a class sample can: the sorted vocabulary puts the
    classes of large gradient (probable in many rows, or frequent targets) at its front, where
    they are taken whole, and the tail's classes are alike enough for a sample once the targets'
    share is accounted for. Cost:
    (head + tail) / V of two logits passes (all N rows times the sampled classes).
    ``logit_scale``: as slab_errors' (the bias and softcap given scaled by it).
    """
    V, D = c.shape
    N = t_s.numel()
    dev = c.device
    f32 = torch.float32
    h = min(head, V)
    m = min(tail, V - h)
    posn = torch.arange(h, device=dev)
    wt = torch.ones(h + m, dtype=f32, device=dev)
    if m > 0:
        # Systematic sampling in proportion to (targets of the class + their mean over classes):
        # a class's target rows make a large part of its gradient, so a class that is the
        # target of many rows is taken with a weight near 1 (else it is a rare, heavily weighted
        # spike), the others evenly.
        # (index_add_, not bincount, which reads its input's maximum on the host; sums of
        # ones in fp32 are exact in any order below 2^24 rows)
        valid = torch.arange(N, device=dev) < n_valid.long()
        cnt = torch.zeros(V, dtype=f32, device=dev).index_add_(0, t_s.long(), valid.float())
        j, wt_tail = systematic_sample(cnt.index_select(0, vp[h:]), n_valid, m, rows=False, add=1.0 / V)
        posn = torch.cat([posn, h + j])
        wt[h:] = wt_tail
    cls = vp.index_select(0, posn)
    Cs = c.index_select(0, cls)
    bs = None if bias is None else bias.float().index_select(0, cls)
    dC = torch.zeros((h + m, D), dtype=f32, device=dev)
    # (alpha, beta and eta are 0 at the ignored rows, which sort past n_valid: _math.coefficients)
    a, b, et = alpha_s, beta_s, eta_s
    rows = max(1, chunk_bytes // (4 * max(h + m, 1)))
    t_l = t_s.long()
    for s0 in range(0, N, rows):
        s1 = min(s0 + rows, N)
        E = e2d.index_select(0, erow_s[s0:s1])
        z = mm_f32(E, Cs.T, None)  # [rows, h + m]
        if logit_scale != 1.0:
            z.mul_(logit_scale)
        # (dZ rounded to the operand dtype, as the backward's GEMMs do: an estimate's accuracy)
        dz = class_sample_dz(
            z, cls, t_l[s0:s1], lse_s[s0:s1], a[s0:s1], b[s0:s1], bs, softcap, E.dtype,
            None if et is None else et[s0:s1],
        )  # fmt: skip
        dC += mm_f32(dz.T, E, None)
    return torch.dot(dC.square_().sum(1), wt)


def dense_slab_flags(
    code: torch.Tensor,
    keep: torch.Tensor,
    n_valid: torch.Tensor,
    BLOCK_N: int,
    tiles_per_slab: int,
    dense_kept: float,
    slab_error: float,
    errors: SlabErrors | None = None,
    first_order_cost: float | None = None,
    *,
    slab_error_dc: float | None = None,
    max_kernel_slabs: int = RULE_KERNEL_SLABS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dense, first_order) on the device, no host synchronisation: dense int8 [n_slabs], 1 for
    the slabs of ``tiles_per_slab`` vocabulary tiles (in the sorted order) that the sparse
    backward does densely; first_order int32 [1], 1 where it applies the first-order terms.

    A slab is dense where the tile filter keeps at least ``dense_kept`` of its (token block,
    tile) pairs. With ``errors`` (slab_errors'), the other slabs are taken in order of decreasing
    ||err[s]|| and made dense until the sum of the remaining slabs' err is at most
    ``slab_error`` ||ref|| (the vector sum: errors of different slabs may cancel or add up; 1 or
    more: this rule off); with its dC estimates as well, the slabs of largest dc_err are also
    made dense until the remaining ones' sum is at most slab_error_dc^2 dc_ref (dC's rows of
    different slabs are disjoint: their squared errors add; slab_error_dc None: slab_error; 1 or
    more: this rule off). With fo and ``first_order_cost`` (the
    first-order terms' cost in dense slabs), the same rules on err - fo and dc_err_fo as well;
    the first-order terms are applied, with those rules' slabs, where they and their slabs cost
    less than the first rules' slabs.

    Up to ``max_kernel_slabs`` slabs the rule runs in two launches (kernels/slab_rule.py: on the
    slabs' Gram matrices), past it as torch ops; both give the same flags.
    """
    nt = code.shape[1]
    dev = code.device
    n_slabs = -(-nt // tiles_per_slab)
    tol_c = slab_error if slab_error_dc is None else slab_error_dc
    ref_sq = None
    if errors is not None:
        ref_sq = errors.ref.square().sum() if errors.ref_sq is None else errors.ref_sq
    if n_slabs <= max_kernel_slabs:
        # The same rule in two launches (kernels/slab_rule.py): host time of a step at small N
        # or on one rank's block of the vocabulary.
        err = fo = cost = dc = dc_fo = dc_ref = None
        if errors is not None:
            if slab_error < 1:
                err = errors.err
            if errors.fo is not None and first_order_cost is not None:
                fo, cost = errors.fo, first_order_cost
            if errors.dc_err is not None and errors.dc_ref is not None and tol_c < 1:
                dc, dc_fo, dc_ref = errors.dc_err, errors.dc_err_fo, errors.dc_ref
        return slab_flags(
            keep, n_valid, BLOCK_N, tiles_per_slab, dense_kept, slab_error, err, ref_sq, fo, cost, dc, dc_fo,
            dc_ref, tol_c,
        )  # fmt: skip
    pad = n_slabs * tiles_per_slab - nt
    blocks = ((n_valid.float() + (BLOCK_N - 1)) // BLOCK_N).clamp(min=1)
    tiles = F.pad(torch.ones(nt, device=dev), (0, pad)).view(n_slabs, -1).sum(1)
    kept = F.pad(keep.sum(0, dtype=torch.float32), (0, pad)).view(n_slabs, -1).sum(1)
    dense = kept / (blocks * tiles) >= dense_kept
    off = torch.zeros(1, dtype=torch.int32, device=dev)
    if errors is None:
        return dense.to(torch.int8), off
    sparse = (~dense).float()
    bound = slab_error * ref_sq.clamp(min=0).sqrt()
    bound_c = None if errors.dc_ref is None else tol_c**2 * errors.dc_ref.clamp(min=0)

    # Both variants (without and with the first-order terms) go through one batched rule: the
    # rule's few dozen small ops once instead of twice (host time of a step at small N).
    with_fo = errors.fo is not None and first_order_cost is not None
    out = torch.zeros((2 if with_fo else 1, dense.numel()), dtype=torch.bool, device=dev)
    if slab_error < 1:
        err = errors.err * sparse[:, None, None]  # dense slabs are exact
        err = torch.stack([err, err - errors.fo * sparse[:, None, None]]) if with_fo else err[None]
        out |= _worst_until(err, bound)
    if errors.dc_err is not None and bound_c is not None and tol_c < 1:
        dc = errors.dc_err
        if with_fo:
            dc = torch.stack([dc, errors.dc_err_fo if errors.dc_err_fo is not None else dc])
        out |= _worst_until_sq(dc.reshape(out.shape) * sparse, bound_c)
    if not with_fo:
        return (dense | out[0]).to(torch.int8), off
    chosen, chosen_fo = out[0], out[1]
    use = chosen_fo.sum() + first_order_cost < chosen.sum()
    return (dense | torch.where(use, chosen_fo, chosen)).to(torch.int8), use.int().reshape(1)


def _worst_until(err: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    """bool [B, n_slabs]: per batch entry b, the slabs of largest ||err[b, s]|| (err [B, n_slabs,
    rows, D]), as few as leave the norm of the other slabs' summed err at most ``bound``."""
    B, n = err.shape[:2]
    flat = err.reshape(B, n, -1)
    order = torch.argsort(flat.norm(dim=2), dim=1, descending=True)
    cum = flat.gather(1, order[:, :, None].expand(-1, -1, flat.shape[2])).cumsum(1)
    # rem[b, m]: the error left when the first m slabs of order[b] are dense (rem[b, n] = 0).
    total = cum[:, -1:]
    rem = torch.cat([total.norm(dim=2), (total - cum).norm(dim=2)], dim=1)
    return _first_m(order, rem, bound)


def _worst_until_sq(err2: torch.Tensor, bound2: torch.Tensor) -> torch.Tensor:
    """bool [B, n_slabs]: per batch entry, the slabs of largest err2[b, s] (squared errors that add
    up; estimates below 0 count as 0), as few as leave the others' sum at most ``bound2``."""
    x = err2.clamp(min=0)
    order = torch.argsort(x, dim=1, descending=True)
    cum = x.gather(1, order).cumsum(1)
    rem = torch.cat([cum[:, -1:], (cum[:, -1:] - cum).clamp(min=0)], dim=1)
    return _first_m(order, rem, bound2)


def _first_m(order: torch.Tensor, rem: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    """bool [B, n_slabs]: per batch entry, the first m slabs of ``order[b]``, m the first index with
    rem[b, m] <= bound (rem[b, n_slabs] = 0, so one exists)."""
    m = (rem <= bound).int().argmax(dim=1, keepdim=True)
    rank = torch.empty_like(order).scatter_(
        1, order, torch.arange(order.shape[1], device=order.device).expand_as(order)
    )
    return rank < m
