"""The rows of a linear-cross-entropy problem: flattening and the causal shift, the valid-first
order the Triton kernels walk, the vocabulary order by mean logit, and O(N D) helpers over rows.
"""

from __future__ import annotations

import torch

# Rows of fp32 temporaries ([rows, D]) made at once by the O(N D) helpers below.
CHUNK_ROWS = 8192


def flatten_rows(e: torch.Tensor, targets: torch.Tensor, shift: bool):
    """Flattens to (rows, D) without copying contiguous inputs.

    Returns (e2d, rows, targets_flat, out_shape): problem row i reads e2d[rows[i]] (rows is None
    for the identity) and targets_flat[i]. With shift, rows skip each sequence's last position so
    that e[..., :-1, :] is read by index, not copied.
    """
    D = e.shape[-1]
    e2d = e.reshape(-1, D)
    if shift:
        T = targets.shape[-1]
        tgt = targets[..., 1:]
        # (contiguous: with T = 2 the reshape is a view of stride 2, and the kernels read index
        # vectors with unit stride)
        rows = torch.arange(e2d.shape[0], device=e.device).view(-1, T)[:, :-1].reshape(-1).contiguous()
    else:
        tgt = targets
        rows = None
    return e2d, rows, tgt.reshape(-1).long(), tgt.shape


def kernel_operands(e2d, c, bias, weight):
    """float64 has no tensor-core dot: run it in float32 (the kernels accumulate in fp32 anyway).
    Rows of unit stride along D for the kernels (an empty tensor counts as contiguous whatever its
    strides, so it is made anew)."""
    if e2d.dtype == torch.float64:
        e2d, c = e2d.float(), c.float()
    return _unit_stride(e2d), _unit_stride(c), bias, weight


def _unit_stride(x: torch.Tensor) -> torch.Tensor:
    if x.stride(-1) == 1:
        return x
    return x.contiguous() if x.numel() else x.new_empty(x.shape)


class RowOrder:
    """Valid-first order of the problem rows, on the device (no host sync). ``rows`` (e2d row of
    each problem row) must increase, as flatten_rows makes them: the sparse
    backward's final row move relies on sorted row <= e2d row."""

    def __init__(self, targets: torch.Tensor, rows: torch.Tensor | None, ignore_index: int):
        N = targets.numel()
        self.N = N
        self.valid = targets != ignore_index
        self.safe_t = torch.where(self.valid, targets, 0)
        # Stable partition (valid rows keep their relative order, then the ignored ones in
        # theirs): a stable sort of the one-bit key "ignored", one op for the host.
        perm = torch.sort(~self.valid, stable=True).indices
        self._set_order(perm, self.valid.sum(dtype=torch.int32).reshape(1), rows)

    @classmethod
    def from_order(cls, perm: torch.Tensor, n_valid: torch.Tensor, rows: torch.Tensor | None) -> RowOrder:
        """The order a forward made (its ``perm`` and ``n_valid``), for its backward: no sort and
        no pass over the targets (host time of a step, docs/benchmarks.md). ``valid`` and
        ``safe_t`` are None: the caller has the sorted targets."""
        self = cls.__new__(cls)
        self.N = perm.numel()
        self.valid = self.safe_t = None
        self._set_order(perm, n_valid, rows)
        return self

    def _set_order(self, perm: torch.Tensor, n_valid: torch.Tensor, rows: torch.Tensor | None) -> None:
        self.perm, self.n_valid = perm, n_valid
        self.identity = rows is None  # problem row i is e2d row i
        self._rows = rows
        self._erow = None
        self.erow_s = perm if rows is None else rows.index_select(0, perm).contiguous()

    @property
    def erow(self) -> torch.Tensor:
        """The e2d row of each problem row (problem order), made on first use."""
        if self._erow is None:
            self._erow = (
                self._rows if self._rows is not None else torch.arange(self.N, device=self.perm.device)
            )
        return self._erow

    def unsort(self, x_sorted: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(x_sorted).index_copy_(0, self.perm, x_sorted)


def row_chunks(n: int):
    for s in range(0, n, CHUNK_ROWS):
        yield s, min(s + CHUNK_ROWS, n)


def vocab_scores(e2d, c, bias, r: RowOrder) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids by decreasing mean logit ebar . c_v + b_v, those scores in that order); ebar is the
    mean of the valid rows.

    Frequent classes have large mean logits in every row, so the tiles that must be kept cluster
    at the front and the rest can be skipped as whole tiles.
    """
    # The valid rows' sum as one product with fp32 accumulation: w (0 / 1 per e2d row, exact in
    # any dtype) times e2d, no gathered or converted copy of the rows.
    if r.identity:
        w = r.valid.to(e2d.dtype)
    else:  # (index_add_: a row read twice counts twice, as in the mean over the problem's rows)
        w = e2d.new_zeros(e2d.shape[0]).index_add_(0, r.erow, r.valid.to(e2d.dtype))
    if e2d.is_cuda and e2d.dtype in (torch.bfloat16, torch.float16):
        esum = torch.mm(w[None], e2d, out_dtype=torch.float32)[0]
    else:
        esum = w.float() @ e2d.float()
    ebar = esum / r.n_valid.clamp(min=1).float()
    score = torch.mv(c, ebar.to(c.dtype)).float()
    if bias is not None:
        score = score + bias.float()
    score, perm = torch.sort(score, descending=True)
    return perm, score


def weighted_rows(w: torch.Tensor, x: torch.Tensor, index: torch.Tensor | None = None) -> torch.Tensor:
    """sum_i w_i x[index[i]] (x's rows in order without index), fp32 [D], in row chunks."""
    out = torch.zeros(x.shape[1], dtype=torch.float32, device=x.device)
    for s, t in row_chunks(w.numel()):
        rows = x[s:t] if index is None else x.index_select(0, index[s:t])
        out += w[s:t].float() @ rows.float()
    return out
