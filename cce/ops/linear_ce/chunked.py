"""impl="torch"'s algorithm: linear cross entropy in plain PyTorch, chunked over tokens, any device.

At most one chunk of logits (sized by a memory budget) exists at a time. With reduction "mean" or
"sum" and no lse output, the gradients of a chunk are computed while its logits are in hand
(forward) and only scaled by the upstream gradient in backward: three matmuls in all instead of
four. Otherwise the backward recomputes each chunk's logits.

On CPU, ignored tokens are dropped before any matmul, and the gradient matmuls of (chunk, vocab
block) tiles whose probabilities are all below ``filter_eps`` are skipped, their contribution
replaced by a rank-1 correction (rowsum x block mean; see docs/design.md for the error bound).
Both use data-dependent shapes, which on an accelerator would need a host synchronisation, so
there every row is processed (ignored rows with zero coefficients) and filtering is off. Also on
CPU: fp32 GEMMs run through oneDNN where torch has it (chunked_math.use_onednn), and the softmax
is aten's row-wise kernel in place, its per-row scale alpha applied to the [n, D] operands. The
filter itself is cpu_filter.py; the custom ops around this are torch_impl.py.
"""

from __future__ import annotations

import torch

from ... import _math
from .chunked_math import LINEAR, ONEDNN_SLICE, addmm_tn_, mm, use_onednn
from .cpu_filter import filtered_products, flush_corrections, kept_tiles

# Bytes of chunk-sized temporaries (the logits / gradient chunk, and tanh with softcap) unless
# Tuning.chunk_bytes says otherwise.
CHUNK_BYTES = 48 << 20

# On CPU, fp32 probabilities below this are set to 0 before the gradient products. Peaked
# softmaxes (trained models) put many entries below fp32's normal range (2^-126), and a GEMM with
# subnormal operands runs on the CPU's slow path: measured on 2 cores of an Intel Xeon at
# 2048 x 256 x 32000 with logits ~ N(0, 20^2) (a quarter of the entries subnormal), P @ C took
# 9.1 s against 0.25 s once they were 0 (the pass that zeroes them: 0.02 s). Entries this small
# (after the scale alpha ~ 1 / N, still above 2^-126) change a gradient by at most V 2^-100
# of its own scale: below fp32's rounding for any vocabulary. fp64 keeps every entry.
P_FLOOR = 2.0**-100


class ChunkedProblem:
    """Per-call constants of one linear-cross-entropy evaluation."""

    def __init__(
        self, e2d, c, bias, weight, rows, targets, ignore_index, softcap, ls, z_loss, eps, chunk_bytes=None,
        temperature: float = 1.0, want_entropy: bool = False, want_argmax: bool = False,
    ):  # fmt: skip
        self.e2d, self.c, self.rows, self.targets = e2d, c, rows, targets
        self.acc = _math.acc_dtype(e2d.dtype)
        self.V, self.D = c.shape
        self.N = targets.numel()
        self.cpu = e2d.device.type == "cpu"
        # On CPU the matmuls run in the accumulation dtype (no fast bf16 kernels there anyway).
        self.c_op = c.to(self.acc) if (self.cpu or c.dtype == self.acc) else c
        self.bias = None if bias is None else bias.to(self.acc)
        self.weight = None if weight is None else weight.to(self.acc)
        self.softcap = softcap
        # The logits are softcap(e c^T + bias) / temperature; the gradients' chain rule divides
        # every coefficient by it (loss_coefficients).
        self.temperature = float(temperature)
        self.want_entropy, self.want_argmax = want_entropy, want_argmax
        self.entropy = self.argmax = None  # [N] per row after a forward run() that wants them
        self.k = _math.LossConsts(ls, z_loss, self.V)
        self.valid = targets != ignore_index
        self.safe_t = torch.where(self.valid, targets, torch.zeros_like(targets))
        self.w_t = _math.target_weight(weight, targets, self.valid, self.acc)
        self.W = _math.weight_total(weight, self.V, e2d.device, self.acc)
        # The smoothing term -gamma_i w_v is rank-1 unless softcap's derivative multiplies it.
        self.fold_smoothing = self.k.smoothing and softcap > 0
        self.eps = eps if (self.cpu and not self.fold_smoothing) else 0.0
        if self.cpu:
            self.order = self.valid.nonzero().squeeze(1)  # CPU: no device sync involved
        else:
            self.order = None
        n_rows = self.N if self.order is None else self.order.numel()
        # Chunk-sized temporaries: the logits, tanh with softcap, the softmax for the entropy.
        per_row = self.V * torch.finfo(self.acc).bits // 8 * (1 + (softcap > 0) + want_entropy)
        budget = CHUNK_BYTES if chunk_bytes is None else chunk_bytes
        self.chunk = max(1, min(n_rows, budget // max(per_row, 1)))
        self.n_rows = n_rows
        self.block_means_cache = None
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
        if use_onednn(ec, self.c_op):
            S = ONEDNN_SLICE
            for v in range(0, self.V, S):
                b = None if self.bias is None else self.bias[v : v + S]
                z[:, v : v + S] = LINEAR(ec, self.c_op[v : v + S], b, "none", [], "")
        else:
            mm(ec, self.c_op.T, self.acc, out=z)
            if self.bias is not None:
                z += self.bias
        if self.softcap > 0:
            th = z.div_(self.softcap).tanh_()
            return th * (self.softcap / self.temperature), th
        if self.temperature != 1.0:
            z.div_(self.temperature)
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
            self.flush_tiny_(L)
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
            self.flush_tiny_(L.sub_((lse - torch.log(alpha))[:, None]).exp_())
        else:
            self.flush_tiny_(L.sub_(lse[:, None]).exp_()).mul_(alpha[:, None])

    def flush_tiny_(self, P: torch.Tensor) -> torch.Tensor:
        """P (probabilities, or alpha times them, >= 0) with its entries below P_FLOOR set to 0 in
        place, for fp32 on CPU (subnormal GEMM operands); unchanged elsewhere."""
        if self.cpu and P.dtype == torch.float32:
            torch.threshold_(P, P_FLOOR, 0.0)
        return P

    @property
    def wC(self) -> torch.Tensor:
        """sum_v w_v c_v (D,), for the exact rank-1 smoothing term of dE."""
        if self._wC is None:
            c = self.c_op.to(self.acc)
            self._wC = c.sum(0) if self.weight is None else self.weight @ c
        return self._wC

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
        keep = kept_tiles(self, P, alpha, r)
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
        # alpha p_t alone would spoil (2^-8 alpha of error in a small difference; the Triton
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
                addmm_tn_(dC, P, ec if r is None else ec * r[:, None], scale=scale)
            dE_c = None
            if need_de:
                if use_onednn(P, self.c_op):
                    dE_c = LINEAR(P, self.c_op.T, None, "none", [], "")  # weights read transposed
                else:
                    dE_c = mm(P, self.c_op, self.acc)
                if r is not None:
                    dE_c.mul_(r[:, None])
                if scale is not None:
                    dE_c.mul_(scale)
        else:
            dE_c = filtered_products(self, ec, P, keep, need_de, dC, corr)
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

    def loss_coefficients(
        self,
        g: torch.Tensor,
        h: torch.Tensor | None,
        u: torch.Tensor | None = None,
        delta: torch.Tensor | None = None,
        entropy: torch.Tensor | None = None,
    ):
        """Per-chunk coefficients of this loss for upstream g (on the loss), h (lse), u (the
        target logit) and delta (the entropy, whose forward values ``entropy`` it needs):
        (alpha, beta, gamma), or (alpha, beta, gamma, eta) with the entropy's term (_math)."""
        inv_t = 1.0 / self.temperature

        def coef(prow, lse_c):
            hc = None if h is None else h[prow]
            v = self.valid[prow]
            alpha, beta, gamma = _math.coefficients(g[prow], hc, lse_c, self.w_t[prow], self.W, v, self.k)
            eta = None
            if u is not None or delta is not None:
                uc = None if u is None else u[prow]
                dc = None if delta is None else delta[prow]
                ent = None if entropy is None else entropy[prow]
                alpha, beta, eta = _math.output_coefficients(alpha, beta, uc, dc, lse_c, ent, v)
            if inv_t != 1.0:
                alpha, beta, gamma = alpha * inv_t, beta * inv_t, gamma * inv_t
                eta = None if eta is None else eta * inv_t
            return (alpha, beta, gamma) if eta is None else (alpha, beta, gamma, eta)

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
        forward = lse_in is None
        if forward and self.want_entropy:
            self.entropy = torch.zeros(N, dtype=acc, device=dev)
        if forward and self.want_argmax:
            self.argmax = torch.zeros(N, dtype=torch.int64, device=dev)
        buf = torch.empty(min(self.chunk, max(self.n_rows, 1)), self.V, dtype=acc, device=dev)
        for prow, erow in self.chunks():
            ec = self.e_rows(erow)
            tc = self.safe_t[prow]
            L, th = self.logits(ec, buf)
            rowsum = None
            if forward:
                if self.want_argmax:  # (before stats_ overwrites L; first index among ties)
                    self.argmax[prow] = L.argmax(1)
                pz = _math.mean_logit(L) if self.want_entropy else None  # E_p[z]
                lse_c, tgt_c, ssum_c, rowsum = self.stats_(L, tc)
                if pz is not None:
                    self.entropy[prow] = lse_c - pz
                lse[prow] = lse_c
                tgt[prow] = tgt_c
                if ssum is not None:
                    ssum[prow] = ssum_c
            else:
                lse_c = lse[prow]
            if not want_grad:
                continue
            alpha, beta, gamma, *eta = (None if x is None else x.to(acc) for x in coef(prow, lse_c))
            if eta and eta[0] is not None:
                # The entropy's term eta_i p_iv z_iv joins the dense part: P = p (alpha + eta z),
                # from the saved lse (only the backward asks for it).
                assert lse_in is not None, "the entropy's gradient is formed in the backward"
                _math.entropy_dlogits_(L, self.flush_tiny_((L - lse_c[:, None]).exp_()), alpha, eta[0])
                r = None
            elif lse_in is not None:
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
            flush_corrections(dC, corr)
        return lse, tgt, ssum, dE, dC, dbias
