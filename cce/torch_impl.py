"""impl="torch": linear cross entropy in plain PyTorch, chunked over tokens, for any device.

At most one chunk of logits (sized by a memory budget) exists at a time. With reduction "mean" or
"sum" and no lse output, the gradients of a chunk are computed while its logits are in hand
(forward) and only scaled by the upstream gradient in backward: three matmuls in all instead of
four. Otherwise the backward recomputes each chunk's logits.

On CPU, ignored tokens are dropped before any matmul, and the gradient matmuls of (chunk, vocab
block) tiles whose probabilities are all below ``filter_eps`` are skipped, their contribution
replaced by a rank-1 correction (rowsum x block mean; see docs/design.md for the error bound).
Both use data-dependent shapes, which on an accelerator would need a host synchronisation, so
there every row is processed (ignored rows with zero coefficients) and filtering is off. Also on
CPU: fp32 GEMMs run through oneDNN where torch has it (see _use_onednn), and the softmax is
aten's row-wise kernel in place, its per-row scale alpha applied to the [n, D] operands.

Both entry points are ``torch.library.custom_op``s so that ``torch.compile`` treats them as
opaque nodes (no graph break, nothing data-dependent traced).
"""

from __future__ import annotations

import math

import torch

from . import _math

# Bytes of chunk-sized temporaries (the logits / gradient chunk, and tanh with softcap).
CHUNK_BYTES = 48 << 20
# Tile of the CPU gradient filter: row block x vocabulary block (as the GPU kernels' tiles).
FILTER_BLOCK_N = 64
FILTER_BLOCK_V = 128
# Above this fraction of kept tiles the dense exact products are cheaper than gathering.
DENSE_FRACTION = 0.5
# Skipped-tile dC corrections queued before one GEMM applies them (bounds their memory).
CORR_BATCH = 32


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _mm(a: torch.Tensor, b: torch.Tensor, acc: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """a @ b accumulated and returned in ``acc`` (into ``out`` if given); a is cast to b's dtype."""
    if b.dtype == acc:
        return torch.mm(a.to(acc), b, out=out)
    a = a.to(b.dtype)
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=acc, out=out)
    r = torch.mm(a, b).to(acc)
    return r if out is None else out.copy_(r)


def _onednn_linear():
    """torch.ops.mkldnn._linear_pointwise (x @ w.T through oneDNN), or None where unavailable."""
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._linear_pointwise.default
    except (AttributeError, RuntimeError):
        return None


_LINEAR = _onednn_linear()
# Vocabulary slice of the oneDNN logits and dC GEMMs. The op has no out= form: each slice's result
# (1.6 MB of logits at n = 400, 2 MB of dC rows) is copied or added into place while in cache,
# where one chunk-sized result would page-fault 48 MB per chunk. Smaller slices hold fewer
# transient bytes at the peak (measured: 1024 vs 2048 ~5 MB less peak RSS, same time).
ONEDNN_SLICE = 1024


def _use_onednn(*ts: torch.Tensor) -> bool:
    """Whether these fp32 CPU operands' GEMMs go through oneDNN rather than torch.mm (BLAS).

    Same fp32 products with fp32 accumulation (only the summation order differs; a reduced
    precision chosen through torch.backends.mkldnn applies to both), different kernels: on the
    AMD EPYC of docs/benchmarks.md torch.mm's MKL sgemm runs at ~170 GFLOP/s, the 256-bit FMA
    peak, and oneDNN's AVX-512 brgemm at ~340 (measured).
    """
    return (
        _LINEAR is not None
        and torch._C._get_mkldnn_enabled()
        and all(t.device.type == "cpu" and t.dtype == torch.float32 and t.numel() for t in ts)
    )


def _addmm_(
    out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, block: int = 8192, scale: torch.Tensor | None = None
) -> None:
    """out += a @ b [* scale] (out in the accumulation dtype), bounding temporaries to ``block``
    rows."""
    if b.dtype == out.dtype and scale is None:
        out.addmm_(a.to(out.dtype), b)
        return
    for s in range(0, out.shape[0], block):
        r = _mm(a[s : s + block], b, out.dtype)
        out[s : s + block] += r if scale is None else r * scale


def _addmm_tn_(
    out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor | None = None
) -> None:
    """out += a.T @ b [* scale] (fp32 CPU: oneDNN, per vocabulary slice of a's columns)."""
    if scale is not None or not _use_onednn(a, b, out):
        _addmm_(out, a.T, b, scale=scale)
        return
    bT = b.T.contiguous()  # [D, n]
    S = ONEDNN_SLICE
    for v in range(0, a.shape[1], S):
        # The op takes a plain (row-major) input: the [n, S] slice is transposed into one
        # (cache-sized) copy; its [S, D] product is added to out's rows while in cache.
        out[v : v + S] += _LINEAR(a[:, v : v + S].T.contiguous(), bT, None, "none", [], "")


class _Problem:
    """Per-call constants of one linear-cross-entropy evaluation."""

    def __init__(self, e2d, c, bias, weight, rows, targets, ignore_index, softcap, ls, z_loss, eps):
        self.e2d, self.c, self.rows, self.targets = e2d, c, rows, targets
        self.acc = _acc_dtype(e2d.dtype)
        self.V, self.D = c.shape
        self.N = targets.numel()
        self.cpu = e2d.device.type == "cpu"
        # On CPU the matmuls run in the accumulation dtype (no fast bf16 kernels there anyway).
        self.c_op = c.to(self.acc) if (self.cpu or c.dtype == self.acc) else c
        self.bias = None if bias is None else bias.to(self.acc)
        self.weight = None if weight is None else weight.to(self.acc)
        self.softcap = softcap
        self.k = _math.LossConsts(ls, z_loss, self.V)
        self.valid = targets != ignore_index
        self.safe_t = torch.where(self.valid, targets, torch.zeros_like(targets))
        self.w_t = _math.target_weight(weight, targets, self.valid)
        self.W = _math.weight_total(weight, self.V, e2d.device)
        # The smoothing term -gamma_i w_v is rank-1 unless softcap's derivative multiplies it.
        self.fold_smoothing = self.k.smoothing and softcap > 0
        self.eps = eps if (self.cpu and not self.fold_smoothing) else 0.0
        if self.cpu:
            self.order = self.valid.nonzero().squeeze(1)  # CPU: no device sync involved
        else:
            self.order = None
        n_rows = self.N if self.order is None else self.order.numel()
        per_row = self.V * torch.finfo(self.acc).bits // 8 * (2 if softcap > 0 else 1)
        self.chunk = max(1, min(n_rows, CHUNK_BYTES // max(per_row, 1)))
        self.n_rows = n_rows
        self._block_means = None
        self._wC = None

    def chunks(self):
        """Yields (problem-row indices or slice, e-rows tensor or slice) per chunk."""
        for s in range(0, self.n_rows, self.chunk):
            e = min(s + self.chunk, self.n_rows)
            if self.order is None:
                prow = slice(s, e)
                erow = prow if self.rows is None else self.rows[s:e]
            else:
                prow = self.order[s:e]
                erow = prow if self.rows is None else self.rows[prow]
            yield prow, erow

    def e_rows(self, erow) -> torch.Tensor:
        ec = self.e2d[erow] if isinstance(erow, slice) else self.e2d.index_select(0, erow)
        return ec.to(self.acc) if self.cpu else ec

    def logits(self, ec: torch.Tensor, buf: torch.Tensor):
        """(L, th): fp32 logits of the chunk and tanh(z / softcap) (None without softcap).

        The logits are written into ``buf`` (one chunk buffer reused for every chunk, so that two
        chunks never coexist and no chunk pays fresh page faults).
        """
        z = buf[: ec.shape[0]]  # [n, V]
        if _use_onednn(ec, self.c_op):
            S = ONEDNN_SLICE
            for v in range(0, self.V, S):
                b = None if self.bias is None else self.bias[v : v + S]
                z[:, v : v + S] = _LINEAR(ec, self.c_op[v : v + S], b, "none", [], "")
        else:
            _mm(ec, self.c_op.T, self.acc, out=z)
            if self.bias is not None:
                z += self.bias
        if self.softcap > 0:
            th = z.div_(self.softcap).tanh_()
            return th * self.softcap, th
        return z, None

    def stats_(self, L: torch.Tensor, tc: torch.Tensor):
        """(lse, tgt, ssum, rowsum) of a chunk, overwriting L in place with rowsum_i * softmax(L)_i.

        In place and without a chunk-sized temporary (torch.logsumexp would allocate one).

        On CPU L becomes the softmax itself (rowsum None) through aten's row-wise softmax kernel:
        it finishes one row (max, exp-and-sum, scale; 128 KB at V = 32000) before the next, so its
        sweeps run from L2 instead of as separate passes over the whole chunk from memory. Run
        in place, each output entry is written from its own input entry only (the kernel's
        map(x -> exp(x - max)) and map(x -> x * (1 / sum)), checked by
        tests/test_torch_impl_cpu.py). The entry at the row max m is exp(0) / rowsum, the row's
        largest, so lse = m - log(max_v p_v): one rounding of 1 / rowsum from m + log(rowsum).
        Elsewhere L becomes exp(L - m) (softmax = L / rowsum).
        """
        tgt = L.gather(1, tc[:, None]).squeeze(1)
        ssum = None
        if self.k.smoothing:
            ssum = L.sum(1) if self.weight is None else L @ self.weight
        m = L.amax(1)
        if self.cpu:
            torch.ops.aten._softmax.out(L, 1, False, out=L)
            # A row of -inf (or with +inf) has no finite max: lse is m itself, as below.
            lse = torch.where(torch.isfinite(m), m - L.amax(1).log(), m)
            return lse, tgt, ssum, None
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        L.sub_(m[:, None]).exp_()
        rowsum = L.sum(1)
        return m + rowsum.log(), tgt, ssum, rowsum

    def scaled_softmax_(self, L: torch.Tensor, lse: torch.Tensor, alpha: torch.Tensor) -> None:
        """L := alpha_i * softmax(L)_iv in place, from the saved lse (backward recompute).

        With alpha >= 0 the scale folds into the exponent, exp(L - (lse - log alpha)), saving a
        pass over the chunk (alpha = 0 gives exp(-inf) = 0). The sign test needs the values on the
        host, so it only runs on CPU.
        """
        if self.cpu and bool((alpha >= 0).all()):
            L.sub_((lse - torch.log(alpha))[:, None]).exp_()
        else:
            L.sub_(lse[:, None]).exp_().mul_(alpha[:, None])

    @property
    def block_means(self) -> torch.Tensor:
        """[n_blocks, D] mean of c's rows per filter block (for the skipped-tile correction)."""
        if self._block_means is None:
            B, V = FILTER_BLOCK_V, self.V
            nb = math.ceil(V / B)
            sums = torch.zeros(nb, self.D, dtype=self.acc, device=self.c.device)
            sums.index_add_(0, torch.arange(V, device=self.c.device) // B, self.c_op.to(self.acc))
            counts = torch.full((nb,), float(B), dtype=self.acc, device=self.c.device)
            counts[-1] = V - (nb - 1) * B
            self._block_means = sums / counts[:, None]
        return self._block_means

    @property
    def wC(self) -> torch.Tensor:
        """sum_v w_v c_v (D,), for the exact rank-1 smoothing term of dE."""
        if self._wC is None:
            c = self.c_op.to(self.acc)
            self._wC = c.sum(0) if self.weight is None else self.weight @ c
        return self._wC

    def kept_tiles(self, P: torch.Tensor, alpha: torch.Tensor, r: torch.Tensor | None) -> torch.Tensor | None:
        """[row blocks, vocab blocks] bool: tiles to compute exactly (None: the whole chunk).

        The dense part of dZ is diag(r) P (r None: P itself, already scaled). A (FILTER_BLOCK_N x
        FILTER_BLOCK_V) tile is filtered when every |alpha_i p_iv| in it is below
        eps * max_i |alpha_i| (for mean/sum without weights or z-loss alpha is the same for all
        rows, so this is exactly "every probability below eps"). With a pending row scale r
        (P >= 0) the test is colmax_tile(P) * max_tile |r_i| < thr, which implies it, and is the
        same test where r is constant over the tile's rows.

        When most tiles are kept, the dense exact product is cheaper than gathering: None. That
        choice only trades time (the dense product is exact), so the first row block decides it
        when that block alone keeps most of its tiles, sparing a pass over the chunk on data
        where nothing can be filtered.
        """
        if self.eps <= 0:
            return None
        B, R = FILTER_BLOCK_V, FILTER_BLOCK_N
        n, nb = P.shape[0], math.ceil(self.V / B)
        nonneg = r is not None or bool((alpha >= 0).all())  # CPU only (filtering is)
        thr = self.eps * alpha.abs().max()
        keep = torch.empty(math.ceil(n / R), nb, dtype=torch.bool)
        for i in range(keep.shape[0]):
            Pr = P[i * R : (i + 1) * R]
            colmax = Pr.amax(0) if nonneg else Pr.abs().amax(0)
            if r is not None:
                colmax = colmax * r[i * R : (i + 1) * R].abs().max()
            colmax = torch.nn.functional.pad(colmax, (0, nb * B - self.V))
            keep[i] = colmax.view(nb, B).amax(1) >= thr
            if i == 0 and float(keep[0].float().mean()) > DENSE_FRACTION:
                return None
        return None if float(keep.float().mean()) > DENSE_FRACTION else keep

    def grads(self, ec, tc, P, th, alpha, beta, gamma, r, need_de, dC, dbias, corr):
        """One chunk's gradient; returns dE of the chunk's rows (or None), accumulates dC, dbias.

        dZ = (alpha p - beta onehot(t) - gamma w) * softcap'(z), whose dense part alpha p is
        diag(r) P: P holds alpha_i p_iv when r is None, else a row scale r is still pending
        (p itself with r = alpha, or exp(z - m) with r = alpha / rowsum), and is consumed in
        place. A pending scale stays out of the chunk when no tile is filtered: it multiplies
        the [n, D] operands instead (dC += P^T diag(r) E, dE = diag(r) (P C)), saving a pass
        over the chunk. The target and (without softcap) smoothing terms are rank-1 per row and
        always added exactly outside P. Filtering (per row block x vocab block tile, a skipped
        tile contributing a rank-1 correction) works on the scaled P.
        """
        keep = self.kept_tiles(P, alpha, r)
        dense = keep is None
        w = self.weight
        # (Off CPU the [n, D] operands may be in a 16-bit dtype: scaling them would add a rounding.)
        if r is not None and (not dense or self.fold_smoothing or not self.cpu):
            P.mul_(r[:, None])
            r = None
        sc = None
        if th is not None:
            sc = th.square_().neg_().add_(1.0)  # softcap'(z) = 1 - tanh^2, in place of th
        if self.fold_smoothing:  # -gamma_i w_v softcap'_iv is not rank-1: into P (scaled)
            P.addr_(gamma, w if w is not None else torch.ones_like(P[0]), alpha=-1.0)
        if sc is not None:
            bt = beta * sc.gather(1, tc[:, None]).squeeze(1)
            P.mul_(sc)
        else:
            bt = beta
        # The target entry alpha p_t - beta is added exactly outside P (coefficient tcoef), except
        # with 16-bit operands (off CPU): there it is a cancellation (p_t near 1) that rounding
        # alpha p_t alone would spoil (2^-9 alpha of error in a small difference; the Triton
        # kernels' TARGET_LO note measures the effect), so it is formed in fp32 inside P and only
        # its rounding remainder lo_i = dZ_it - round(dZ_it) goes outside. fp16: P is also divided
        # by its largest |entry| (a device scalar, no sync), as alpha p can sit below fp16's normal
        # range (alpha ~ 1/N for "mean"); the products are multiplied back.
        tcoef = -bt
        scale = None
        folded = dense and self.c_op.dtype != self.acc
        if folded:
            P.scatter_add_(1, tc[:, None], -bt[:, None])
            if self.c_op.dtype == torch.float16:
                scale = P.abs().amax().clamp(min=1e-30)
                P.div_(scale)
            pt = P.gather(1, tc[:, None]).squeeze(1)
            tcoef = pt - pt.to(self.c_op.dtype).to(self.acc)
            if scale is not None:
                tcoef = tcoef * scale
        if dbias is not None:
            if r is not None:
                dbias.addmv_(P.T, r)
            else:
                dbias += P.sum(0) if scale is None else P.sum(0) * scale
        if dense:
            if dC is not None:
                _addmm_tn_(dC, P, ec if r is None else ec * r[:, None], scale=scale)
            dE_c = None
            if need_de:
                if _use_onednn(P, self.c_op):
                    dE_c = _LINEAR(P, self.c_op.T, None, "none", [], "")  # weights read transposed
                else:
                    dE_c = _mm(P, self.c_op, self.acc)
                if r is not None:
                    dE_c.mul_(r[:, None])
                if scale is not None:
                    dE_c.mul_(scale)
        else:
            dE_c = self._filtered(ec, P, keep, need_de, dC, corr)
        # Exact terms outside the filter.
        unfolded_smoothing = self.k.smoothing and not self.fold_smoothing
        if dbias is not None:
            if not folded:  # (folded: the target entry is in P's column sums)
                dbias.index_add_(0, tc, -bt)
            if unfolded_smoothing:
                # gamma.sum() stays a tensor: a Python float would synchronise with the device.
                dbias.sub_((w if w is not None else torch.ones_like(dbias)) * gamma.sum())
        if need_de:
            dE_c += tcoef[:, None] * self.c_op.index_select(0, tc).to(self.acc)
            if unfolded_smoothing:
                dE_c -= gamma[:, None] * self.wC
        if dC is not None:
            ecf = ec.to(self.acc)
            dC.index_add_(0, tc, tcoef[:, None] * ecf)
            if unfolded_smoothing:
                wv = w if w is not None else torch.ones(self.V, dtype=self.acc, device=ec.device)
                dC.addr_(wv, gamma @ ecf, alpha=-1.0)
        return dE_c

    def _filtered(self, ec, P, keep, need_de, dC, corr):
        """dE of the chunk (or None) and dC accumulation for the dense part P (scaled) filtered
        per kept tile; a skipped tile contributes rowsum (outer) mean(C_tile) to dE and
        colsum (outer) mean(E_tile) to dC."""
        n = P.shape[0]
        B, R = FILTER_BLOCK_V, FILTER_BLOCK_N
        blk_of_col = torch.arange(self.V, device=P.device) // B
        dE_c = torch.zeros(n, self.D, dtype=self.acc, device=P.device) if need_de else None
        blk = None
        if need_de:  # rowsum of P per vocab block [n, n_blocks], for the skipped tiles
            blk = torch.zeros(n, keep.shape[1], dtype=P.dtype, device=P.device)
            blk.index_add_(1, blk_of_col, P)
        for i in range(keep.shape[0]):
            rows = slice(i * R, min((i + 1) * R, n))
            Pr, er = P[rows], ec[rows]
            col_keep = keep[i][blk_of_col]
            kcols = col_keep.nonzero().squeeze(1)
            if kcols.numel():
                Pk = Pr.index_select(1, kcols)
                if need_de:
                    dE_c[rows] += _mm(Pk, self.c_op.index_select(0, kcols), self.acc)
                if dC is not None:
                    dC.index_add_(0, kcols, _mm(Pk.T, er, self.acc))
            skip = ~keep[i]
            if need_de:
                dE_c[rows] += blk[rows][:, skip] @ self.block_means[skip]
            if dC is not None:
                corr.append((torch.where(col_keep, 0.0, Pr.sum(0)), er.to(self.acc).mean(0)))
                if len(corr) >= CORR_BATCH:
                    _flush_corrections(dC, corr)
        return dE_c

    def loss_coefficients(self, g: torch.Tensor, h: torch.Tensor | None):
        """Per-chunk (alpha, beta, gamma) of this loss for upstream g (on the loss) and h (lse)."""

        def coef(prow, lse_c):
            hc = None if h is None else h[prow]
            return _math.coefficients(
                g[prow], hc, lse_c.float(), self.w_t[prow], self.W, self.valid[prow], self.k
            )

        return coef

    def run(self, coef, lse_in, need_de, need_dc, need_dbias):
        """One pass over the chunks: statistics always; gradients if ``coef`` is given.

        ``coef(prow, lse_chunk) -> (alpha, beta, gamma)`` gives the rows' coefficients of
        dZ = alpha p - beta [v == t] - gamma w (gamma may be None without smoothing).
        ``lse_in`` (backward) is the saved lse; else it is computed here.
        """
        acc, dev = self.acc, self.e2d.device
        N = self.N
        want_grad = coef is not None
        lse = torch.zeros(N, dtype=acc, device=dev) if lse_in is None else lse_in
        tgt = torch.zeros(N, dtype=acc, device=dev)
        ssum = torch.zeros(N, dtype=acc, device=dev) if self.k.smoothing else None
        dE = torch.zeros(self.e2d.shape, dtype=acc, device=dev) if (want_grad and need_de) else None
        dC = torch.zeros(self.V, self.D, dtype=acc, device=dev) if (want_grad and need_dc) else None
        dbias = torch.zeros(self.V, dtype=acc, device=dev) if (want_grad and need_dbias) else None
        corr: list = []
        buf = torch.empty(min(self.chunk, max(self.n_rows, 1)), self.V, dtype=acc, device=dev)
        for prow, erow in self.chunks():
            ec = self.e_rows(erow)
            tc = self.safe_t[prow]
            L, th = self.logits(ec, buf)
            rowsum = None
            if lse_in is None:
                lse_c, tgt_c, ssum_c, rowsum = self.stats_(L, tc)
                lse[prow] = lse_c
                tgt[prow] = tgt_c
                if ssum is not None:
                    ssum[prow] = ssum_c
            else:
                lse_c = lse[prow]
            if not want_grad:
                continue
            alpha, beta, gamma = (None if x is None else x.to(acc) for x in coef(prow, lse_c))
            if lse_in is not None:
                self.scaled_softmax_(L, lse_c, alpha)
                r = None
            else:  # L holds rowsum * softmax: the row scale alpha / rowsum is left to grads
                r = alpha if rowsum is None else alpha / rowsum
            dE_c = self.grads(ec, tc, L, th, alpha, beta, gamma, r, dE is not None, dC, dbias, corr)
            if dE is not None:
                if isinstance(erow, slice):
                    dE[erow] = dE_c
                else:
                    dE.index_copy_(0, erow, dE_c)
        if corr and dC is not None:
            _flush_corrections(dC, corr)
        return lse, tgt, ssum, dE, dC, dbias


def _flush_corrections(dC: torch.Tensor, corr: list) -> None:
    """dC += sum_k colsum_k (outer) mean(E_k) over the queued skipped-tile corrections (one GEMM)."""
    U = torch.stack([u for u, _ in corr])  # [k, V]
    Eb = torch.stack([m for _, m in corr])  # [k, D]
    dC.addmm_(U.T, Eb)
    corr.clear()


def forward_stats(e2d, c, bias, weight, rows, targets, ignore_index: int, softcap: float, smoothing: bool):
    """(lse, tgt, ssum or None) per problem row in the accumulation dtype, 0 at ignored rows.

    The statistics alone, for callers that assemble the loss themselves (cce.distributed).
    ``label_smoothing`` enters _Problem only as the flag that asks for ssum.
    """
    pb = _Problem(e2d, c, bias, weight, rows, targets, ignore_index, softcap, float(smoothing), 0.0, 0.0)
    lse, tgt, ssum, *_ = pb.run(None, None, False, False, False)
    return lse, tgt, ssum


def backward_coeffs(
    e2d, c, bias, weight, rows, targets, lse, alpha, beta, gamma, ignore_index: int, softcap: float,
    filter_eps: float, need_de: bool, need_dc: bool, need_dbias: bool,
):  # fmt: skip
    """(dE, dC, dbias) in the accumulation dtype (None where not needed) for given per-row
    coefficients: dZ = (alpha p - beta [v == t] - gamma w) softcap'(z), p = exp(L - lse).

    The impl="torch" twin of cce.triton_impl.triton_backward_coeffs (gamma None: no smoothing).
    """
    smoothing = gamma is not None
    pb = _Problem(
        e2d, c, bias, weight, rows, targets, ignore_index, softcap, float(smoothing), 0.0, filter_eps
    )

    def coef(prow, _lse):
        return alpha[prow], beta[prow], None if gamma is None else gamma[prow]

    _, _, _, dE, dC, db = pb.run(coef, lse.to(pb.acc), need_de, need_dc, need_dbias)
    return dE, dC, db


def _empty(ref: torch.Tensor) -> torch.Tensor:
    return ref.new_empty(0)


@torch.library.custom_op("cce::linear_ce_torch_fwd", mutates_args=())
def linear_ce_torch_fwd(
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
    precompute: bool,
    need_de: bool,
    need_dc: bool,
    need_dbias: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, lse, dE, dC, dbias); the gradients are for a unit upstream gradient and only
    computed (else empty) when ``precompute``."""
    pb = _Problem(
        e2d, c, bias, weight, rows, targets, ignore_index, softcap, label_smoothing, z_loss, filter_eps
    )
    g = None
    if precompute:
        ones = torch.ones((), dtype=torch.float32, device=e2d.device)
        g = _math.row_upstream(ones, pb.w_t, reduction, pb.N)
    coef = None if g is None else pb.loss_coefficients(g, None)
    lse, tgt, ssum, dE, dC, dbias = pb.run(coef, None, need_de, need_dc, need_dbias)
    loss_tok = _math.token_loss(
        lse.float(), tgt.float(), None if ssum is None else ssum.float(), pb.w_t, pb.W, pb.valid, pb.k
    )
    loss = _math.reduce_loss(loss_tok, pb.w_t, reduction)
    lse_out = torch.where(pb.valid, lse.float(), 0.0)
    return (
        loss,
        lse_out,
        _empty(e2d) if dE is None else dE,
        _empty(c) if dC is None else dC,
        _empty(c) if dbias is None else dbias,
    )


@linear_ce_torch_fwd.register_fake
def _(
    e2d,
    c,
    bias,
    weight,
    rows,
    targets,
    ignore_index,
    reduction,
    softcap,
    label_smoothing,
    z_loss,
    filter_eps,
    precompute,
    need_de,
    need_dc,
    need_dbias,
):
    N = targets.shape[0]
    acc = _acc_dtype(e2d.dtype)
    loss = e2d.new_empty((N,) if reduction == "none" else (), dtype=torch.float32)
    lse = e2d.new_empty((N,), dtype=torch.float32)
    dE = e2d.new_empty(e2d.shape if (precompute and need_de) else (0,), dtype=acc)
    dC = c.new_empty(c.shape if (precompute and need_dc) else (0,), dtype=acc)
    db = c.new_empty((c.shape[0],) if (precompute and need_dbias) else (0,), dtype=acc)
    return loss, lse, dE, dC, db


@torch.library.custom_op("cce::linear_ce_torch_bwd", mutates_args=())
def linear_ce_torch_bwd(
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
    """(dE, dC, dbias) in the accumulation dtype for per-row upstream g (loss) and h (lse)."""
    pb = _Problem(
        e2d, c, bias, weight, rows, targets, ignore_index, softcap, label_smoothing, z_loss, filter_eps
    )
    _, _, _, dE, dC, dbias = pb.run(pb.loss_coefficients(g, h), lse.to(pb.acc), need_de, need_dc, need_dbias)
    return (
        _empty(e2d) if dE is None else dE,
        _empty(c) if dC is None else dC,
        _empty(c) if dbias is None else dbias,
    )


@linear_ce_torch_bwd.register_fake
def _(
    e2d,
    c,
    bias,
    weight,
    rows,
    targets,
    lse,
    g,
    h,
    ignore_index,
    softcap,
    label_smoothing,
    z_loss,
    filter_eps,
    need_de,
    need_dc,
    need_dbias,
):
    acc = _acc_dtype(e2d.dtype)
    dE = e2d.new_empty(e2d.shape if need_de else (0,), dtype=acc)
    dC = c.new_empty(c.shape if need_dc else (0,), dtype=acc)
    db = c.new_empty((c.shape[0],) if need_dbias else (0,), dtype=acc)
    return dE, dC, db


def _setup_context(ctx, inputs, output):
    (
        e2d,
        c,
        bias,
        weight,
        rows,
        targets,
        ignore_index,
        reduction,
        softcap,
        ls,
        z_loss,
        eps,
        precompute,
        need_de,
        need_dc,
        need_dbias,
    ) = inputs
    loss, lse, dE, dC, db = output
    ctx.mark_non_differentiable(dE, dC, db)
    # No zero-filled incoming gradients for the unused outputs: dC's would be a fresh V x D
    # tensor filled each backward (page faults included: measured ~17 ms and ~17 MB of peak RSS
    # at V = 32000, D = 512). _backward handles None for every incoming gradient.
    ctx.set_materialize_grads(False)
    ctx.opts = (ignore_index, reduction, softcap, ls, z_loss, eps, precompute)
    ctx.dtypes = (e2d.dtype, c.dtype, None if bias is None else bias.dtype)
    # Precomputed gradients are kept on ctx, not saved tensors: backward scales them in place,
    # which would trip autograd's version check on saved tensors.
    ctx.pre = ((dE, dC, db), (need_de, need_dc, need_dbias)) if precompute else None
    ctx.save_for_backward(e2d, c, bias, weight, rows, targets, lse)


def _backward(ctx, g_loss, g_lse, _g_de, _g_dc, _g_db):
    ignore_index, reduction, softcap, ls, z_loss, eps, _ = ctx.opts
    e_dtype, c_dtype, b_dtype = ctx.dtypes
    need_de, need_dc, need_db = ctx.needs_input_grad[:3]
    needs = (need_de, need_dc, need_db)
    if ctx.pre is not None and all(done or not need for done, need in zip(ctx.pre[1], needs, strict=True)):
        # The gradients were computed in forward for a unit upstream gradient: scale them in
        # place (no second copy). A second backward through a retained graph recomputes below.
        (dE, dC, db), _ = ctx.pre
        ctx.pre = None
        if g_loss is None:
            return (None,) * 16
        s = g_loss.float()

        # (No shortcut for s == 1: this backward is traced under torch.compile, where a Python
        # branch on a tensor's value is a data-dependent guard.)
        def scale(t, dtype, need):
            return t.mul_(s).to(dtype) if need else None

        return (
            scale(dE, e_dtype, need_de),
            scale(dC, c_dtype, need_dc),
            scale(db, b_dtype, need_db),
            *([None] * 13),
        )
    e2d, c, bias, weight, rows, targets, lse = ctx.saved_tensors
    valid = targets != ignore_index
    w_t = _math.target_weight(weight, targets, valid)
    N = targets.numel()
    if g_loss is None:
        g = torch.zeros(N, dtype=torch.float32, device=targets.device)
    else:
        g = _math.row_upstream(g_loss, w_t, reduction, N)
    dE, dC, db = linear_ce_torch_bwd(
        e2d,
        c,
        bias,
        weight,
        rows,
        targets,
        lse,
        g.contiguous(),
        g_lse,
        ignore_index,
        softcap,
        ls,
        z_loss,
        eps,
        need_de,
        need_dc,
        need_db and bias is not None,
    )
    return (
        dE.to(e_dtype) if need_de else None,
        dC.to(c_dtype) if need_dc else None,
        db.to(b_dtype) if (need_db and bias is not None) else None,
        *([None] * 13),
    )


linear_ce_torch_fwd.register_autograd(_backward, setup_context=_setup_context)
