"""impl="triton": the autograd layer over the kernels of cce/kernels/linear_ce.py.

Forward: the kernel reduces each valid token's logits to (lse, target logit[, weighted logit
sum]); the loss is assembled from those by cce/_math.py. Saved for backward: e, c, bias, weight,
rows, targets (the inputs) and lse (O(N)); for a filtered training step also the encoded tile
statistics of the sparse backward (one byte per row and 256 classes, see use_sparse_backward),
which live in the tail of dE's buffer (the "stash") when e needs a gradient.

Backward: _math.coefficients turns the upstream gradient into (alpha, beta, gamma) per row.
Sparse path (sparse_backward): the forward's statistics decide which tiles are recomputed; dE and
dC are written once each, with rank-1 corrections for the skipped tiles and the target entries
exact. Recomputing path (triton_backward): the kernel forms dZ = (alpha p - beta [v == t]) *
softcap' per tile and adds its products; without softcap the rank-1 smoothing term -gamma w is
added exactly here, as are the rank-1 corrections of the tiles the filter skipped
(docs/design.md has the error bounds of both).

Nothing here synchronises with the host: the valid-first row order and its count stay on the
device, so a training step can be captured in a CUDA graph. Both entry points are
``torch.library.custom_op``s, opaque to torch.compile.
"""

from __future__ import annotations

import torch

from . import _math
from .kernels import linear_ce as K

# Rows of fp32 temporaries ([rows, D]) made at once by the O(N D) / O(V D) torch terms below.
_CHUNK_ROWS = 8192
# Filtered backward: dC by fp32 atomics per kept tile (True) or by cuBLAS on dZ slabs (False:
# dC exact up to rounding, no fp32 dC buffer). Measured on H100 (docs/benchmarks.md, zipf, N=8192):
# atomic 71 / 62 ms fwd+bwd at gemma2-2b / llama3-8b with 2.4 / 2.2 GB peak, slabs 86 / 72 ms with
# 0.54 / 0.67 GB. Filtering exists for speed, so the faster variant is the default; the exact path
# (filter_eps=None) has the slab layout and the lowest memory.
DC_ATOMIC = True


def _kernel_dtype_inputs(e2d, c, bias, weight):
    """float64 has no tensor-core dot: run it in float32 (the kernels accumulate in fp32 anyway)."""
    if e2d.dtype == torch.float64:
        e2d, c = e2d.float(), c.float()
    if e2d.stride(-1) != 1:
        e2d = e2d.contiguous()
    if c.stride(-1) != 1:
        c = c.contiguous()
    return e2d, c, bias, weight


class _Rows:
    """Valid-first order of the problem rows, on the device (no host sync). ``rows`` (e2d row of
    each problem row) must increase, as the shift of cce/linear.py makes them: the sparse
    backward's final row move relies on sorted row <= e2d row."""

    def __init__(self, targets: torch.Tensor, rows: torch.Tensor | None, ignore_index: int):
        N = targets.numel()
        dev = targets.device
        self.N = N
        self.valid = targets != ignore_index
        self.safe_t = torch.where(self.valid, targets, torch.zeros_like(targets))
        # Stable partition (valid rows keep their relative order): row i goes to its rank among
        # the valid rows, or past them to its rank among the ignored ones. A cumsum and a scatter
        # instead of a sort.
        ar = torch.arange(N, device=dev)
        cv = torch.cumsum(self.valid, 0)
        self.n_valid = self.valid.sum(dtype=torch.int32).reshape(1)
        pos = torch.where(self.valid, cv - 1, self.n_valid + ar - cv)
        self.perm = torch.empty_like(ar).scatter_(0, pos, ar)
        self.erow = rows if rows is not None else ar  # e2d row, problem order
        self.erow_s = self.perm if rows is None else rows.index_select(0, self.perm).contiguous()

    def unsort(self, x_sorted: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(x_sorted).index_copy_(0, self.perm, x_sorted)


@torch.library.custom_op("cce::linear_ce_triton_fwd", mutates_args=())
def linear_ce_triton_fwd(
    e2d: torch.Tensor,
    c: torch.Tensor,
    bias: torch.Tensor | None,
    weight: torch.Tensor | None,
    rows: torch.Tensor | None,
    targets: torch.Tensor,
    ignore_index: int,
    reduction: str,
    softcap: float,
    label_smoothing: float,
    z_loss: float,
    filter_eps: float,
    stats: bool = False,
    stash: bool = False,
) -> tuple[
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
]:
    """(loss, lse, code, keep, tgt_logit, vperm, vscore, stash); lse is fp32 (N,), 0 at ignored rows.

    With ``stats`` (a training forward whose backward is the sparse one) the next outputs are the
    encoded tile statistics (K.encode_tile_stats: uint8 masses per sorted row and tile, int8 keep
    flags per token block and tile), the sorted rows' target logits, and the vocabulary order
    (int32) with its scores; otherwise they are empty. The raw statistics (3 bytes per row and
    tile) are freed here, before the backward allocates the gradients. With ``stash`` (dE will
    be needed) the last output is the uninitialised buffer the backward writes dE into (e2d's
    shape, the kernels' dtype), and the codes live in its tail when they fit
    (K.code_fits_stash; ``code`` is then empty): they are read before their bytes are
    overwritten, so the statistics cost no memory beyond the gradient.
    """
    e2d, c, bias, weight = _kernel_dtype_inputs(e2d, c, bias, weight)
    V = c.shape[0]
    k = _math.LossConsts(label_smoothing, z_loss, V)
    r = _Rows(targets, rows, ignore_index)
    perm = score = None
    if stats:
        perm, score = vocab_scores(e2d, c, bias, r)
    t_s = r.safe_t.index_select(0, r.perm)
    st = K.linear_ce_forward(
        e2d, c, bias, weight, r.erow_s, t_s, r.n_valid, softcap, k.smoothing, perm=perm, eps=filter_eps
    )
    lse, tgt = r.unsort(st.lse), r.unsort(st.tgt)
    ssum = None if st.ssum is None else r.unsort(st.ssum)
    if stats:
        BN = K.stats_blocks(e2d.dtype)[0]
        N, nt = r.N, _stats_tiles(V, e2d.dtype)
        buf = e2d.new_empty(e2d.shape if stash else (0,))
        in_stash = stash and K.code_fits_stash(N, nt, e2d.shape[0], e2d.shape[1], e2d.dtype)
        code, keep = K.encode_tile_stats(
            st.st, st.sq, st.m0, st.lse, r.n_valid, BN, code=K.stash_code(buf, N, nt) if in_stash else None
        )
        if in_stash:
            code = code.new_empty(0)
        zt_s = st.tgt
    del st
    w_t = _math.target_weight(weight, targets, r.valid)
    W = _math.weight_total(weight, V, e2d.device)
    loss_tok = _math.token_loss(lse, tgt, ssum, w_t, W, r.valid, k)
    loss = _math.reduce_loss(loss_tok, w_t, reduction)
    lse = torch.where(r.valid, lse, 0.0)
    if not stats:
        none = e2d.new_empty(0, dtype=torch.float32)
        return (
            loss, lse, none.to(torch.uint8), none.to(torch.int8), none.clone(), none.int(), none.clone(),
            e2d.new_empty(0),
        )  # fmt: skip
    return loss, lse, code, keep, zt_s, perm.int(), score, buf


def _stats_tiles(V: int, dtype: torch.dtype) -> int:
    BV = K.stats_blocks(torch.float32 if dtype == torch.float64 else dtype)[1]
    return -(-V // BV)


@linear_ce_triton_fwd.register_fake
def _(
    e2d, c, bias, weight, rows, targets, ignore_index, reduction, softcap, label_smoothing, z_loss,
    filter_eps, stats=False, stash=False,
):  # fmt: skip
    N, V = targets.shape[0], c.shape[0]
    f32 = torch.float32
    kdt = torch.float32 if e2d.dtype == torch.float64 else e2d.dtype
    loss = e2d.new_empty((N,) if reduction == "none" else (), dtype=f32)
    lse = e2d.new_empty((N,), dtype=f32)
    if not stats:
        none = e2d.new_empty(0, dtype=f32)
        return (
            loss, lse, none.to(torch.uint8), none.to(torch.int8), none.clone(), none.int(), none.clone(),
            e2d.new_empty(0, dtype=kdt),
        )  # fmt: skip
    BN = K.stats_blocks(kdt)[0]
    nt = _stats_tiles(V, e2d.dtype)
    in_stash = stash and K.code_fits_stash(N, nt, e2d.shape[0], e2d.shape[1], kdt)
    return (
        loss, lse, e2d.new_empty((0,) if in_stash else (N, nt), dtype=torch.uint8),
        e2d.new_empty((-(-N // BN), nt), dtype=torch.int8), e2d.new_empty((N,), dtype=f32),
        e2d.new_empty((V,), dtype=torch.int32), e2d.new_empty((V,), dtype=f32),
        e2d.new_empty(e2d.shape if stash else (0,), dtype=kdt),
    )  # fmt: skip


def _row_chunks(n: int):
    for s in range(0, n, _CHUNK_ROWS):
        yield s, min(s + _CHUNK_ROWS, n)


def vocab_scores(e2d, c, bias, r: _Rows) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids by decreasing mean logit ebar . c_v + b_v, those scores in that order); ebar is the
    mean of the valid rows.

    Frequent classes have large mean logits in every row, so the tiles that must be kept cluster
    at the front and the rest can be skipped as whole tiles.
    """
    esum = torch.zeros(e2d.shape[1], dtype=torch.float32, device=e2d.device)
    valid_s = torch.arange(r.N, device=e2d.device) < r.n_valid
    for s, t in _row_chunks(r.N):
        rows = e2d.index_select(0, r.erow_s[s:t]).float()
        esum += (rows * valid_s[s:t, None]).sum(0)
    ebar = esum / r.n_valid.clamp(min=1).float()
    score = torch.mv(c, ebar.to(c.dtype)).float()
    if bias is not None:
        score = score + bias.float()
    score, perm = torch.sort(score, descending=True)
    return perm, score


def vocab_order(e2d, c, bias, r: _Rows) -> torch.Tensor:
    """Vocabulary ids by decreasing mean logit (see vocab_scores)."""
    return vocab_scores(e2d, c, bias, r)[0]


def _weighted_rows(w: torch.Tensor, x: torch.Tensor, index: torch.Tensor | None = None) -> torch.Tensor:
    """sum_i w_i x[index[i]] (x's rows in order without index), fp32 [D], in row chunks."""
    out = torch.zeros(x.shape[1], dtype=torch.float32, device=x.device)
    for s, t in _row_chunks(w.numel()):
        rows = x[s:t] if index is None else x.index_select(0, index[s:t])
        out += w[s:t].float() @ rows.float()
    return out


def _block_means_e(e2d: torch.Tensor, r: _Rows, BN: int) -> torch.Tensor:
    """[n_blocks, D] mean of the valid rows of each sorted token block (0 for empty blocks)."""
    nb = -(-r.N // BN)
    dev = e2d.device
    pos = torch.arange(r.N, device=dev)
    valid_s = (pos < r.n_valid).float()
    sums = torch.zeros(nb, e2d.shape[1], dtype=torch.float32, device=dev)
    for s, t in _row_chunks(r.N):
        rows = e2d.index_select(0, r.erow_s[s:t]).float() * valid_s[s:t, None]
        sums.index_add_(0, pos[s:t] // BN, rows)
    counts = torch.zeros(nb, dtype=torch.float32, device=dev).index_add_(0, pos // BN, valid_s)
    return sums / counts.clamp(min=1.0)[:, None]


def triton_backward(
    e2d, c, bias, weight, rows, targets, lse, g, h, ignore_index, softcap, label_smoothing, z_loss,
    filter_eps, need_de, need_dc, need_dbias, *, sort_vocab: bool = True, record_skip: bool = False,
    dc_atomic: bool | None = None,
):  # fmt: skip
    """(dE, dC, dbias) (None where not needed) and the filtered kernel's output (skip flags; None
    on the exact path), for upstream gradients g (per-row loss) and h (lse). dE and dbias are
    fp32; dC is fp32 on the filtered path and in c's dtype on the exact path (filter_eps 0)."""
    V = c.shape[0]
    k = _math.LossConsts(label_smoothing, z_loss, V)
    valid = targets != ignore_index
    w_t = _math.target_weight(weight, targets, valid)
    W = _math.weight_total(weight, V, e2d.device)
    alpha, beta, gamma = _math.coefficients(g, h, lse, w_t, W, valid, k)
    return _backward_core(
        e2d, c, bias, weight, rows, targets, lse, alpha, beta, gamma if k.smoothing else None, ignore_index,
        softcap, filter_eps, need_de, need_dc, need_dbias, sort_vocab, record_skip, dc_atomic,
    )  # fmt: skip


def triton_backward_coeffs(
    e2d, c, bias, weight, rows, targets, lse, alpha, beta, gamma, ignore_index, softcap, filter_eps,
    need_de, need_dc, need_dbias,
):  # fmt: skip
    """(dE, dC, dbias) for given per-row coefficients: dZ = (alpha p - beta [v == t] - gamma w)
    softcap' (gamma None: no smoothing term). For callers that form their own coefficients
    (cce/distributed.py). dE, dbias fp32; dC fp32, or c's dtype when filter_eps is 0."""
    return _backward_core(
        e2d, c, bias, weight, rows, targets, lse, alpha, beta, gamma, ignore_index, softcap, filter_eps,
        need_de, need_dc, need_dbias, True, False,
    )[:3]  # fmt: skip


def _backward_core(
    e2d, c, bias, weight, rows, targets, lse, alpha, beta, gamma, ignore_index, softcap, filter_eps,
    need_de, need_dc, need_dbias, sort_vocab, record_skip, dc_atomic: bool | None = None,
):  # fmt: skip
    V, D = c.shape
    dev = e2d.device
    r = _Rows(targets, rows, ignore_index)
    alpha, beta = alpha.float(), beta.float()
    smoothing = gamma is not None
    if smoothing:
        gamma = gamma.float()
    fold = smoothing and softcap > 0
    # With softcap the smoothing term -gamma w_v is multiplied by softcap'(z_iv), no longer
    # rank-1; it is then part of every tile's dZ and the filter (whose bound assumes dZ ~ alpha p)
    # is off, as in impl="torch".
    eps = 0.0 if fold else float(filter_eps)
    srt = lambda x: x.index_select(0, r.perm).contiguous()  # noqa: E731
    args = (e2d, c, bias, weight, r.erow_s, srt(r.safe_t), r.n_valid, srt(lse), srt(alpha), srt(beta))
    if eps == 0:
        # Exact: dZ slabs + cuBLAS (no atomics); every term, smoothing included, is in dZ.
        dn = K.linear_ce_backward_slabs(
            *args, srt(gamma) if smoothing else None, softcap, need_de, need_dc, need_dbias
        )
        dE = None
        if dn.dE is not None:
            # Without `rows` the sorted rows are a permutation of e2d's: every row is written.
            make = torch.empty if rows is None else torch.zeros
            dE = make(e2d.shape, dtype=torch.float32, device=dev).index_copy_(0, r.erow_s, dn.dE)
        return dE, dn.dC, dn.dbias, dn
    perm = vocab_order(e2d, c, bias, r) if sort_vocab else None
    w = ge = None
    if smoothing:  # without softcap: -gamma_i w_v is rank-1, added exactly outside the tiles
        w = weight.float() if weight is not None else torch.ones(V, dtype=torch.float32, device=dev)
        if need_dc:
            ge = _weighted_rows(gamma, e2d, r.erow)
    if dc_atomic is None:
        dc_atomic = DC_ATOMIC
    if dc_atomic:
        out = K.linear_ce_backward(
            *args, None, perm, softcap, eps, need_de, need_dc, need_dbias, record_skip
        )  # fmt: skip
    else:
        out = K.linear_ce_backward_slabs(
            *args, None, softcap, need_de, need_dc, need_dbias, eps=eps, perm=perm,
            dc_rank1=None if ge is None else (w, ge), record_skip=record_skip,
        )  # fmt: skip
    dE, dC, db = out.dE, out.dC, out.dbias
    # Skipped tiles: rank-1 corrections rowsum(dZ_tile) x mean(C_tile), colsum(dZ_tile) x mean(E_block).
    if out.R is not None:
        order = perm if perm is not None else torch.arange(V, device=dev)
        Cm = K.tile_means(c, order, out.BLOCK_V, torch.float32)
        for s, t in _row_chunks(r.N):
            dE.index_add_(0, r.erow_s[s:t], out.R[s:t] @ Cm)
    if dc_atomic and out.CSK is not None:
        dC.addmm_(out.CSK.T, _block_means_e(e2d, r, out.BLOCK_N))
    if smoothing:
        if db is not None:
            db.sub_(w * gamma.sum())
        if dE is not None:
            dE.index_add_(0, r.erow, -gamma[:, None] * _weighted_rows(w, c)[None, :])
        if dc_atomic and dC is not None:
            dC.addr_(w, ge, alpha=-1.0)
    return dE, dC, db, out


@torch.library.custom_op("cce::linear_ce_triton_bwd", mutates_args=())
def linear_ce_triton_bwd(
    e2d: torch.Tensor,
    c: torch.Tensor,
    bias: torch.Tensor | None,
    weight: torch.Tensor | None,
    rows: torch.Tensor | None,
    targets: torch.Tensor,
    lse: torch.Tensor,
    g: torch.Tensor,
    h: torch.Tensor | None,
    ignore_index: int,
    softcap: float,
    label_smoothing: float,
    z_loss: float,
    filter_eps: float,
    need_de: bool,
    need_dc: bool,
    need_dbias: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dE, dC, dbias) in the dtypes of e2d, c, bias (empty where not needed)."""
    e_dtype, c_dtype = e2d.dtype, c.dtype
    e2d_k, c_k, bias, weight = _kernel_dtype_inputs(e2d, c, bias, weight)
    dE, dC, db, _ = triton_backward(
        e2d_k, c_k, bias, weight, rows, targets, lse, g, h, ignore_index, softcap, label_smoothing,
        z_loss, filter_eps, need_de, need_dc, need_dbias,
    )  # fmt: skip
    return (
        dE.to(e_dtype) if dE is not None else e2d.new_empty(0),
        dC.to(c_dtype) if dC is not None else c.new_empty(0),
        db.to(bias.dtype) if db is not None else c.new_empty(0),
    )


@linear_ce_triton_bwd.register_fake
def _(e2d, c, bias, weight, rows, targets, lse, g, h, ignore_index, softcap, label_smoothing, z_loss,
      filter_eps, need_de, need_dc, need_dbias):  # fmt: skip
    dE = e2d.new_empty(e2d.shape if need_de else (0,))
    dC = c.new_empty(c.shape if need_dc else (0,))
    db = c.new_empty((c.shape[0],) if need_dbias else (0,), dtype=bias.dtype if bias is not None else c.dtype)
    return dE, dC, db


# Rows per chunk of the sparse backward's O(rows x tiles) temporaries.
_SPARSE_ROWS = 1024


def _lists(keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The set columns of each row of ``keep`` (bool [A, B]) compacted to the front of an int32
    [A, B + 1] list (column B is a dump slot for the others), and their counts; no host sync."""
    A, B = keep.shape
    idx = torch.where(keep, keep.cumsum(1) - 1, B)
    cols = torch.arange(B, dtype=torch.int32, device=keep.device).expand(A, B)
    lst = torch.zeros((A, B + 1), dtype=torch.int32, device=keep.device).scatter_(1, idx, cols)
    return lst, keep.sum(1, dtype=torch.int32)


def sparse_backward(
    e2d, c, bias, weight, rows, targets, lse, g, h, ignore_index, softcap, label_smoothing, z_loss,
    filter_eps, need_de, need_dc, code, keep, zt_s, vperm, vscore, stash=None, *, return_plan: bool = False,
):  # fmt: skip
    """(dE, dC) in e2d's / c's dtype from the forward's encoded tile statistics (K.SparsePlan).

    dE is written into ``stash`` (the forward's buffer, whose tail may hold the codes: then
    ``code`` is empty) and returned; without one a new buffer is used.

    A tile (token block x vocabulary tile, vocabulary in vperm order) is recomputed only when
    ``keep`` says so (the forward found a non-target probability of one of its rows that may
    reach filter_eps). The others contribute alpha_i S_ij mean(C_j) to dE (S_ij: the tile's
    non-target mass, decoded from ``code``) and q_v G_j to dC; every target entry
    alpha p_t - beta is added exactly. Smoothing (never with softcap here) is the exact rank-1
    term.
    """
    V, D = c.shape
    dev = e2d.device
    f32 = torch.float32
    k = _math.LossConsts(label_smoothing, z_loss, V)
    valid = targets != ignore_index
    w_t = _math.target_weight(weight, targets, valid)
    W = _math.weight_total(weight, V, dev)
    alpha, beta, gamma = _math.coefficients(g, h, lse, w_t, W, valid, k)
    r = _Rows(targets, rows, ignore_index)
    srt = lambda x: x.index_select(0, r.perm).contiguous()  # noqa: E731
    alpha_s, beta_s, lse_s, t_s = srt(alpha.float()), srt(beta.float()), srt(lse), srt(r.safe_t)
    N = r.N
    BN, BV = K.stats_blocks(e2d.dtype)
    nt = _stats_tiles(V, e2d.dtype)
    pos = torch.arange(N, device=dev)
    valid_s = pos < r.n_valid
    src = None
    if need_de:
        if stash is None or stash.numel() == 0:
            stash = torch.empty(e2d.shape, dtype=e2d.dtype, device=dev)
        # dE's rows move from the sorted order to e2d's at the end: the sorted row of each e2d
        # row, -1 for ignored rows and rows outside ``rows`` (gradient 0).
        src = torch.full((e2d.shape[0],), -1, dtype=torch.long, device=dev)
        src.index_copy_(0, r.erow_s, torch.where(valid_s, pos, -1))
    else:
        stash = None
    code_in_stash = tuple(code.shape) != (N, nt)
    if code_in_stash:
        code = K.stash_code(stash, N, nt)
    # The target entries, exact: (alpha p_t - beta) softcap'(z_t); 0 at ignored rows.
    coef = alpha_s * torch.exp(zt_s - lse_s) - beta_s
    if softcap > 0:
        coef = coef * (1.0 - (zt_s / softcap) ** 2)
    coef = torch.where(valid_s, coef, 0.0)
    keep = keep.bool()
    smooth = k.smoothing
    gamma_s = srt(gamma.float()) if smooth else None
    w = None
    if smooth:
        w = weight.float() if weight is not None else torch.ones(V, dtype=f32, device=dev)
    list_e = cnt_e = wc = None
    dc_in = (None,) * 9
    if need_de:
        list_e, cnt_e = _lists(keep)
        if smooth:
            wc = _weighted_rows(w, c)
    if need_dc:
        dc_in = _dc_inputs(e2d, r, keep, code, alpha_s, coef, t_s, vperm, vscore, gamma, BV)
    # Kept tiles numbered in (block, tile) order; the first `cap` get a dZ scratch slot of the dC
    # writer (in the stash, when there is one; fewer if it has no room for them).
    cap = K.kept_scratch_tiles(N, e2d.dtype) if need_dc else 0
    kflat = keep.reshape(-1)
    gidx = (kflat.cumsum(0) - 1).to(torch.int32)
    slot = torch.where(kflat & (gidx < cap), gidx.long(), cap)
    klist = torch.zeros(cap + 1, dtype=torch.int32, device=dev).scatter_(
        0, slot, torch.arange(kflat.numel(), dtype=torch.int32, device=dev)
    )
    del slot
    n_kept = kflat.sum(dtype=torch.int32).reshape(1)
    list_c, cnt_c, G, q, trow, tpos, tcoef, seg, ge = dc_in
    del dc_in
    plan = K.SparsePlan(
        keep.to(torch.int8), list_e, cnt_e, list_c, cnt_c, code, coef, G, q, trow, tpos, tcoef, seg, wc,
        ge, gidx.view(keep.shape), klist, n_kept,
    )  # fmt: skip
    del list_c, cnt_c, G, q, trow, tpos, tcoef, seg  # owned by the plan: released after dC
    dE, dC = K.linear_ce_backward_sparse(
        e2d, c, bias, weight, r.erow_s, t_s, vperm, r.n_valid, lse_s, alpha_s, gamma_s, plan, softcap,
        need_de, need_dc, stash, src, release=not return_plan,
    )  # fmt: skip
    if return_plan:
        return dE, dC, plan
    return dE, dC


def _dc_inputs(e2d, r, keep, code, alpha_s, coef, t_s, vperm, vscore, gamma, BV: int):
    """The dC writer's inputs: (list_c, cnt_c, G, q, trow, tpos, tcoef, seg, ge); see K.SparsePlan.

    Built in this function so that nothing but the plan holds them (the launcher releases them
    once dC is written, before dE and the tile means are allocated)."""
    N, nt = code.shape
    V, D = vperm.numel(), e2d.shape[1]
    dev, f32 = e2d.device, torch.float32
    pos = torch.arange(N, device=dev)
    valid_s = pos < r.n_valid
    list_c, cnt_c = _lists(keep.T.contiguous())
    # G_j = sum_i alpha_i S_ij e_i over the rows whose tile j is skipped.
    G = torch.zeros(nt, D, dtype=f32, device=dev)
    use_bf16 = e2d.dtype == torch.bfloat16 and e2d.is_cuda
    for s in range(0, N, _SPARSE_ROWS):
        t = min(s + _SPARSE_ROWS, N)
        # 0 for kept tiles and ignored rows (code 255)
        S = K.decode_tile_mass(code[s:t]) * alpha_s[s:t, None]
        E_c = e2d.index_select(0, r.erow_s[s:t])
        if use_bf16:
            G += torch.mm(S.T.to(e2d.dtype), E_c, out_dtype=f32)
        else:
            G += S.T @ E_c.float()
    # q: how G_j is spread over the tile, the softmax of the mean-row logits within it.
    sc = torch.full((nt * BV,), float("-inf"), dtype=f32, device=dev)
    sc[:V] = vscore
    q = torch.softmax(sc.view(nt, BV), dim=1).reshape(-1)[:V].contiguous()
    tp = K.inverse_permutation(vperm.long()).index_select(0, t_s)
    tile_t = torch.where(valid_s, tp // BV, nt)
    tile_o, order = torch.sort(tile_t, stable=True)
    trow = r.erow_s.index_select(0, order).contiguous()
    tpos = tp.index_select(0, order).to(torch.int32)
    tcoef = coef.index_select(0, order).contiguous()
    seg = torch.searchsorted(tile_o, torch.arange(nt + 1, device=dev))
    ge = None if gamma is None else _weighted_rows(gamma, e2d, r.erow)
    return list_c, cnt_c, G, q, trow, tpos, tcoef, seg, ge


@torch.library.custom_op("cce::linear_ce_triton_bwd_sparse", mutates_args=("stash",))
def linear_ce_triton_bwd_sparse(
    e2d: torch.Tensor,
    c: torch.Tensor,
    bias: torch.Tensor | None,
    weight: torch.Tensor | None,
    rows: torch.Tensor | None,
    targets: torch.Tensor,
    lse: torch.Tensor,
    g: torch.Tensor,
    h: torch.Tensor | None,
    code: torch.Tensor,
    keep: torch.Tensor,
    zt: torch.Tensor,
    vperm: torch.Tensor,
    vscore: torch.Tensor,
    stash: torch.Tensor,
    ignore_index: int,
    softcap: float,
    label_smoothing: float,
    z_loss: float,
    filter_eps: float,
    need_de: bool,
    need_dc: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dE, dC) in the dtypes of e2d, c (empty where not needed), by the sparse backward. With a
    non-empty ``stash`` (the forward's) dE is written there (in the kernels' dtype) and the
    returned dE is empty."""
    e_dtype, c_dtype = e2d.dtype, c.dtype
    e2d_k, c_k, bias, weight = _kernel_dtype_inputs(e2d, c, bias, weight)
    own = stash.numel() == 0
    dE, dC = sparse_backward(
        e2d_k, c_k, bias, weight, rows, targets, lse, g, h, ignore_index, softcap, label_smoothing, z_loss,
        filter_eps, need_de, need_dc, code, keep, zt, vperm, vscore, None if own else stash,
    )  # fmt: skip
    return (
        dE.to(e_dtype) if dE is not None and own else e2d.new_empty(0),
        dC.to(c_dtype) if dC is not None else c.new_empty(0),
    )


@linear_ce_triton_bwd_sparse.register_fake
def _(e2d, c, bias, weight, rows, targets, lse, g, h, code, keep, zt, vperm, vscore, stash, ignore_index,
      softcap, label_smoothing, z_loss, filter_eps, need_de, need_dc):  # fmt: skip
    own = stash.numel() == 0
    return e2d.new_empty(e2d.shape if need_de and own else (0,)), c.new_empty(c.shape if need_dc else (0,))


def _setup_context(ctx, inputs, output):
    (e2d, c, bias, weight, rows, targets, ignore_index, reduction, softcap, ls, z_loss, eps, stats, _) = (
        inputs
    )
    _loss, lse, code, keep, zt, vperm, vscore, stash = output
    ctx.mark_non_differentiable(code, keep, zt, vperm, vscore, stash)
    # Unused incoming gradients stay None: materialised, the statistics' would be zero-filled
    # [N, V / 256] tensors alive through the backward.
    ctx.set_materialize_grads(False)
    ctx.opts = (ignore_index, reduction, softcap, ls, z_loss, eps, stats)
    ctx.save_for_backward(e2d, c, bias, weight, rows, targets, lse, code, keep, zt, vperm, vscore, stash)


def _backward(ctx, g_loss, g_lse, *_aux):
    ignore_index, reduction, softcap, ls, z_loss, eps, stats = ctx.opts
    e2d, c, bias, weight, rows, targets, lse, code, keep, zt, vperm, vscore, stash = ctx.saved_tensors
    need_de, need_dc, need_db = ctx.needs_input_grad[:3]
    need_db = need_db and bias is not None
    nothing = (None,) * 11
    if not (need_de or need_dc or need_db):
        return (None, None, None, *nothing)
    valid = targets != ignore_index
    w_t = _math.target_weight(weight, targets, valid)
    N = targets.numel()
    if g_loss is None:
        g = torch.zeros(N, dtype=torch.float32, device=targets.device)
    else:
        g = _math.row_upstream(g_loss, w_t, reduction, N).contiguous()
    if stats and not need_db:
        dE, dC = linear_ce_triton_bwd_sparse(
            e2d, c, bias, weight, rows, targets, lse, g, g_lse, code, keep, zt, vperm, vscore, stash,
            ignore_index, softcap, ls, z_loss, eps, need_de, need_dc,
        )  # fmt: skip
        if need_de and stash.numel() > 0:
            # dE was written into the forward's stash (a second backward through this graph
            # fails on the saved stash's version instead of reading a gradient as statistics).
            dE = stash.to(e2d.dtype)
        db = None
    else:
        dE, dC, db = linear_ce_triton_bwd(
            e2d, c, bias, weight, rows, targets, lse, g, g_lse, ignore_index, softcap, ls, z_loss, eps,
            need_de, need_dc, need_db,
        )  # fmt: skip
    return (dE if need_de else None, dC if need_dc else None, db if need_db else None, *nothing)


linear_ce_triton_fwd.register_autograd(_backward, setup_context=_setup_context)

# The sparse backward (forward tile statistics, no fp32 gradient buffers) serves filtered
# training steps; the slab / atomic kernels above remain for the exact path, bias gradients,
# smoothing under softcap and the vocabulary-parallel path (cce/distributed.py).
SPARSE_BACKWARD = True
# ... for thresholds from this one up (the bf16 / fp16 defaults): a kept tile past the dZ
# scratch costs the sparse kernels one recompute per D chunk of the output, cheap while few tiles
# are kept, not at smaller thresholds (fp32's 2^-20) where a large share of the tiles is kept
# (measured, H100, random data at 2^-12: 7.5% / 78% of the tiles kept, 242 ms / 3.1 s against
# 79 / 141 ms for the recomputing kernels).
SPARSE_MIN_EPS = 2.0**-10


def use_sparse_backward(
    need_de: bool, need_dc: bool, need_dbias: bool, filter_eps: float, softcap: float, label_smoothing: float
) -> bool:
    """Whether a forward should gather the tile statistics of the sparse backward."""
    return (
        SPARSE_BACKWARD
        and (need_de or need_dc)
        and not need_dbias
        and filter_eps >= SPARSE_MIN_EPS
        and not (softcap > 0 and label_smoothing > 0)
    )


def linear_ce_triton(
    e2d: torch.Tensor,
    c: torch.Tensor,
    bias: torch.Tensor | None,
    weight: torch.Tensor | None,
    rows: torch.Tensor | None,
    targets: torch.Tensor,
    ignore_index: int,
    reduction: str,
    softcap: float,
    label_smoothing: float,
    z_loss: float,
    filter_eps: float,
    need_de: bool,
    need_dc: bool,
    need_dbias: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, lse) with the meaning of cce.torch_impl.linear_ce_torch_fwd's arguments.

    need_de / need_dc / need_dbias (what autograd will ask for) choose the backward: with a
    filter and no bias gradient, the forward also gathers the sparse backward's statistics.
    """
    stats = use_sparse_backward(need_de, need_dc, need_dbias, filter_eps, softcap, label_smoothing)
    out = linear_ce_triton_fwd(
        e2d, c, bias, weight, rows, targets, ignore_index, reduction, softcap, label_smoothing, z_loss,
        filter_eps, stats, stats and need_de,
    )  # fmt: skip
    return out[0], out[1]
