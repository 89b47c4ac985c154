"""impl="torch": linear cross entropy in plain PyTorch, chunked over tokens, for any device.

At most one chunk of logits (sized by a memory budget) exists at a time. With reduction "mean" or
"sum" and no lse output, the gradients of a chunk are computed while its logits are in hand
(forward) and only scaled by the upstream gradient in backward: three matmuls in all instead of
four. Otherwise the backward recomputes each chunk's logits.

On CPU, ignored tokens are dropped before any matmul, and the gradient matmuls of (chunk, vocab
block) tiles whose probabilities are all below ``filter_eps`` are skipped, their contribution
replaced by a rank-1 correction (rowsum x block mean; see docs/design.md for the error bound).
Both use data-dependent shapes, which on an accelerator would need a host synchronisation, so
there every row is processed (ignored rows with zero coefficients) and filtering is off.

Both entry points are ``torch.library.custom_op``s so that ``torch.compile`` treats them as
opaque nodes (no graph break, nothing data-dependent traced).
"""

from __future__ import annotations

import math

import torch

from . import _math

# Bytes of chunk-sized temporaries (logits, probabilities, tanh) allowed at once.
CHUNK_BYTES = 64 << 20
# Vocabulary block of the CPU gradient filter.
FILTER_BLOCK_V = 128


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _mm(a: torch.Tensor, b: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """a @ b accumulated and returned in ``acc``; a is cast to b's dtype first."""
    if b.dtype == acc:
        return torch.mm(a.to(acc), b)
    a = a.to(b.dtype)
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=acc)
    return torch.mm(a, b).to(acc)


def _addmm_(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, block: int = 8192) -> None:
    """out += a @ b (out in the accumulation dtype), bounding temporaries to ``block`` rows."""
    if b.dtype == out.dtype:
        out.addmm_(a.to(out.dtype), b)
        return
    for s in range(0, out.shape[0], block):
        out[s : s + block] += _mm(a[s : s + block], b, out.dtype)


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

    def logits(self, ec: torch.Tensor):
        """(L, th): fp32 logits of the chunk and tanh(z / softcap) (None without softcap)."""
        z = _mm(ec, self.c_op.T, self.acc)  # [n, V]
        if self.bias is not None:
            z += self.bias
        if self.softcap > 0:
            th = z.div_(self.softcap).tanh_()
            return th * self.softcap, th
        return z, None

    def stats(self, L: torch.Tensor, tc: torch.Tensor):
        """lse, target logit, weighted logit sum of a chunk; L becomes exp(L - max) in place."""
        tgt = L.gather(1, tc[:, None]).squeeze(1)
        ssum = None
        if self.k.smoothing:
            ssum = L.sum(1) if self.weight is None else L @ self.weight
        m = L.amax(1)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        L.sub_(m[:, None]).exp_()
        lse = m + L.sum(1).log()
        return lse, tgt, ssum

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

    def grads(self, ec, tc, P, th, alpha, beta, gamma, dE_c, dC, dbias, corr):
        """Accumulates one chunk's gradient. P holds exp(L - m) / s = softmax (consumed in place).

        dZ = (alpha P - beta onehot(t) - gamma w) * softcap'(z); the dense part alpha P is
        filtered per vocab block, the target and (without softcap) smoothing terms are exact.
        """
        n = P.shape[0]
        keep = None
        if self.eps > 0:
            B = FILTER_BLOCK_V
            nb = math.ceil(self.V / B)
            colmax = P.amax(0)
            pad = nb * B - self.V
            if pad:
                colmax = torch.nn.functional.pad(colmax, (0, pad))
            keep = colmax.view(nb, B).amax(1) >= self.eps  # [nb]
            n_keep = int(keep.sum())
            if n_keep == nb:
                keep = None
        sc = None
        if th is not None:
            sc = th.square_().neg_().add_(1.0)  # softcap'(z) = 1 - tanh^2, in place of th
        P.mul_(alpha[:, None])
        if self.fold_smoothing:
            w = self.weight if self.weight is not None else torch.ones_like(P[0])
            P.addr_(gamma, w, alpha=-1.0)
        if sc is not None:
            P.mul_(sc)
            bt = beta * sc.gather(1, tc[:, None]).squeeze(1)
        else:
            bt = beta
        cs = P.sum(0) if (dbias is not None or (keep is not None and dC is not None)) else None
        if dbias is not None:
            dbias += cs
            dbias.index_add_(0, tc, -bt)
            if self.k.smoothing and not self.fold_smoothing:
                w = self.weight if self.weight is not None else torch.ones_like(dbias)
                dbias.add_(w, alpha=-float(gamma.sum()))
        if keep is None:
            if dE_c is not None:
                dE_c += _mm(P, self.c_op, self.acc)
            if dC is not None:
                _addmm_(dC, P.T, ec)
        else:
            B = FILTER_BLOCK_V
            vid = torch.arange(self.V, device=P.device)
            col_keep = keep[vid // B]
            kcols = col_keep.nonzero().squeeze(1)
            if kcols.numel():
                Pk = P.index_select(1, kcols)
                if dE_c is not None:
                    dE_c += _mm(Pk, self.c_op.index_select(0, kcols), self.acc)
                if dC is not None:
                    dC.index_add_(0, kcols, _mm(Pk.T, ec, self.acc))
            # Skipped tiles: rowsum(P_tile) (outer) mean(C_tile) to dE, colsum (outer) mean(E) to dC.
            skip = ~keep
            if dE_c is not None:
                blk = torch.zeros(n, keep.numel(), dtype=P.dtype, device=P.device)
                blk.index_add_(1, vid // B, P)
                dE_c += blk[:, skip] @ self.block_means[skip]
            if dC is not None:
                corr.append((torch.where(col_keep, 0.0, cs), ec.to(self.acc).mean(0)))
        if dE_c is not None:
            dE_c -= bt[:, None] * self.c_op.index_select(0, tc).to(self.acc)
            if self.k.smoothing and not self.fold_smoothing:
                dE_c -= gamma[:, None] * self.wC
        if dC is not None:
            ecf = ec.to(self.acc)
            dC.index_add_(0, tc, -(bt[:, None] * ecf))
            if self.k.smoothing and not self.fold_smoothing:
                w = self.weight if self.weight is not None else torch.ones(self.V, dtype=self.acc, device=ec.device)
                dC.addr_(w, gamma @ ecf, alpha=-1.0)

    def run(self, g, h, lse_in, need_de, need_dc, need_dbias):
        """One pass over the chunks: statistics always; gradients if g is given.

        ``lse_in`` (backward) is the saved lse; else it is computed here.
        """
        acc, dev = self.acc, self.e2d.device
        N = self.N
        want_grad = g is not None
        lse = torch.zeros(N, dtype=acc, device=dev) if lse_in is None else lse_in
        tgt = torch.zeros(N, dtype=acc, device=dev)
        ssum = torch.zeros(N, dtype=acc, device=dev) if self.k.smoothing else None
        dE = torch.zeros(self.e2d.shape, dtype=acc, device=dev) if (want_grad and need_de) else None
        dC = torch.zeros(self.V, self.D, dtype=acc, device=dev) if (want_grad and need_dc) else None
        dbias = torch.zeros(self.V, dtype=acc, device=dev) if (want_grad and need_dbias) else None
        corr: list = []
        for prow, erow in self.chunks():
            ec = self.e_rows(erow)
            tc = self.safe_t[prow]
            L, th = self.logits(ec)
            lse_c, tgt_c, ssum_c = self.stats(L, tc)  # L is now exp(L - m)
            if lse_in is None:
                lse[prow] = lse_c
                tgt[prow] = tgt_c
                if ssum is not None:
                    ssum[prow] = ssum_c
            if not want_grad:
                continue
            L.div_(L.sum(1, keepdim=True))  # softmax
            valid = self.valid[prow]
            hc = None if h is None else h[prow]
            alpha, beta, gamma = _math.coefficients(
                g[prow], hc, lse[prow], self.w_t[prow], self.W, valid, self.k
            )
            alpha, beta, gamma = alpha.to(acc), beta.to(acc), gamma.to(acc)
            dE_c = None
            if dE is not None:
                dE_c = torch.zeros(ec.shape[0], self.D, dtype=acc, device=dev)
            self.grads(ec, tc, L, th, alpha, beta, gamma, dE_c, dC, dbias, corr)
            if dE is not None:
                if isinstance(erow, slice):
                    dE[erow] = dE_c
                else:
                    dE.index_copy_(0, erow, dE_c)
        if corr and dC is not None:
            U = torch.stack([u for u, _ in corr])  # [n_chunks, V]
            Eb = torch.stack([m for _, m in corr])  # [n_chunks, D]
            dC.addmm_(U.T, Eb)
        return lse, tgt, ssum, dE, dC, dbias


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
    pb = _Problem(e2d, c, bias, weight, rows, targets, ignore_index, softcap, label_smoothing, z_loss, filter_eps)
    g = None
    if precompute:
        ones = torch.ones((), dtype=torch.float32, device=e2d.device)
        g = _math.row_upstream(ones, pb.w_t, reduction, pb.N)
    lse, tgt, ssum, dE, dC, dbias = pb.run(g, None, None, need_de, need_dc, need_dbias)
    loss_tok = _math.token_loss(lse.float(), tgt.float(), None if ssum is None else ssum.float(),
                                pb.w_t, pb.W, pb.valid, pb.k)
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
def _(e2d, c, bias, weight, rows, targets, ignore_index, reduction, softcap, label_smoothing, z_loss,
      filter_eps, precompute, need_de, need_dc, need_dbias):
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
    pb = _Problem(e2d, c, bias, weight, rows, targets, ignore_index, softcap, label_smoothing, z_loss, filter_eps)
    _, _, _, dE, dC, dbias = pb.run(g, h, lse.to(pb.acc), need_de, need_dc, need_dbias)
    return (
        _empty(e2d) if dE is None else dE,
        _empty(c) if dC is None else dC,
        _empty(c) if dbias is None else dbias,
    )


@linear_ce_torch_bwd.register_fake
def _(e2d, c, bias, weight, rows, targets, lse, g, h, ignore_index, softcap, label_smoothing, z_loss,
      filter_eps, need_de, need_dc, need_dbias):
    acc = _acc_dtype(e2d.dtype)
    dE = e2d.new_empty(e2d.shape if need_de else (0,), dtype=acc)
    dC = c.new_empty(c.shape if need_dc else (0,), dtype=acc)
    db = c.new_empty((c.shape[0],) if need_dbias else (0,), dtype=acc)
    return dE, dC, db


def _setup_context(ctx, inputs, output):
    (e2d, c, bias, weight, rows, targets, ignore_index, reduction, softcap, ls, z_loss, eps,
     precompute, need_de, need_dc, need_dbias) = inputs
    loss, lse, dE, dC, db = output
    ctx.mark_non_differentiable(dE, dC, db)
    ctx.opts = (ignore_index, reduction, softcap, ls, z_loss, eps, precompute)
    ctx.dtypes = (e2d.dtype, c.dtype, None if bias is None else bias.dtype)
    if precompute:
        ctx.save_for_backward(dE, dC, db)
    else:
        ctx.save_for_backward(e2d, c, bias, weight, rows, targets, lse)


def _backward(ctx, g_loss, g_lse, _g_de, _g_dc, _g_db):
    ignore_index, reduction, softcap, ls, z_loss, eps, precompute = ctx.opts
    e_dtype, c_dtype, b_dtype = ctx.dtypes
    need_de, need_dc, need_db = ctx.needs_input_grad[:3]
    if precompute:
        dE, dC, db = ctx.saved_tensors
        s = g_loss.float() if g_loss is not None else None

        def scale(t, dtype, need):
            if not need or t.numel() == 0 or s is None:
                return None
            return (t * s).to(dtype)

        return (scale(dE, e_dtype, need_de), scale(dC, c_dtype, need_dc), scale(db, b_dtype, need_db),
                *([None] * 13))
    e2d, c, bias, weight, rows, targets, lse = ctx.saved_tensors
    valid = targets != ignore_index
    w_t = _math.target_weight(weight, targets, valid)
    N = targets.numel()
    if g_loss is None:
        g = torch.zeros(N, dtype=torch.float32, device=targets.device)
    else:
        g = _math.row_upstream(g_loss, w_t, reduction, N)
    dE, dC, db = linear_ce_torch_bwd(
        e2d, c, bias, weight, rows, targets, lse, g.contiguous(), g_lse, ignore_index, softcap, ls, z_loss,
        eps, need_de, need_dc, need_db and bias is not None,
    )
    return (
        dE.to(e_dtype) if need_de else None,
        dC.to(c_dtype) if need_dc else None,
        db.to(b_dtype) if (need_db and bias is not None) else None,
        *([None] * 13),
    )


linear_ce_torch_fwd.register_autograd(_backward, setup_context=_setup_context)
