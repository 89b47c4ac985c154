"""The reference of the benchmarks and of the GPU tests: fp32 results from the same low-precision
inputs (TF32 off), chunked so that N x V never exists in fp32 at once; the relative L2 error."""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from .data import IGNORE_INDEX

REF_CHUNK_BYTES = 1 << 30  # bytes of fp32 logits a reference materializes at once


def _rows_per_chunk(V: int) -> int:
    return max(1, REF_CHUNK_BYTES // (4 * V))


@contextlib.contextmanager
def _fp32_matmul():
    """fp32 matmuls in full fp32 (no TF32), for the references."""
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved


def _shifted_targets(t: torch.Tensor) -> torch.Tensor:
    """Targets of the causal-shifted problem on the same rows: row i predicts t[i + 1], last ignored."""
    out = torch.full_like(t, IGNORE_INDEX)
    out[:-1] = t[1:]
    return out


@dataclasses.dataclass
class LinearReference:
    loss: float
    de: torch.Tensor  # fp32 [N, D]
    dc: torch.Tensor  # fp32 [V, D]


@torch.no_grad()
def linear_reference(
    e: torch.Tensor, c: torch.Tensor, t: torch.Tensor, *, bias=None, softcap=None, ignore_index=IGNORE_INDEX
) -> LinearReference:
    """Mean cross entropy of ``softcap(e @ c.T + bias)`` and its gradients with respect to e and c,
    in fp32 from the given (bf16) inputs (TF32 off), chunked over tokens so that N x V never exists
    in fp32 at once: the errors measured against it are the implementation's alone."""
    with _fp32_matmul():
        c32 = c.float()
        valid_all = t != ignore_index
        n_valid = max(int(valid_all.sum()), 1)
        de = torch.empty(e.shape, device=e.device, dtype=torch.float32)
        dc = torch.zeros(c.shape, device=c.device, dtype=torch.float32)
        total = torch.zeros((), device=e.device, dtype=torch.float64)
        step = _rows_per_chunk(c.shape[0])
        for s in range(0, e.shape[0], step):
            e32, tk = e[s : s + step].float(), t[s : s + step]
            valid = tk != ignore_index
            safe = torch.where(valid, tk, 0)
            logits = e32 @ c32.T  # [rows, V] fp32
            if bias is not None:
                logits += bias.float()
            th = None
            if softcap:
                th = torch.tanh(logits / softcap)
                logits = th * softcap
            lse = torch.logsumexp(logits, -1)
            tgt = logits.gather(1, safe[:, None])[:, 0]
            total += torch.where(valid, lse - tgt, 0.0).double().sum()
            p = (logits - lse[:, None]).exp_()
            del logits
            p.scatter_add_(1, safe[:, None], -torch.ones_like(p[:, :1]))
            p *= valid[:, None].float() / n_valid
            if th is not None:
                p *= 1.0 - th * th
                del th
            de[s : s + step] = p @ c32
            dc.addmm_(p.T, e32)
            del p
    return LinearReference(float(total) / n_valid, de, dc)


@dataclasses.dataclass
class LogitsReference:
    """Per-row fp32 statistics of the logits: the loss (plain and causal-shifted targets) is final at
    construction; the gradient error re-reads ``x`` (the harness checks that it is left unchanged)."""

    x: torch.Tensor  # the logits (as given, bf16)
    t: torch.Tensor
    lse: torch.Tensor  # fp32 [N]
    losses: dict[bool, float]  # shift -> mean loss

    @torch.no_grad()
    def grad_err(self, dx: torch.Tensor, shift: bool = False) -> float:
        """Relative L2 error of dx against d(mean loss)/dx in fp32, built chunk by chunk."""
        t = _shifted_targets(self.t) if shift else self.t
        n_valid = max(int((t != IGNORE_INDEX).sum()), 1)
        num = torch.zeros((), device=dx.device, dtype=torch.float64)
        den = torch.zeros((), device=dx.device, dtype=torch.float64)
        step = _rows_per_chunk(self.x.shape[1])
        for s in range(0, self.x.shape[0], step):
            tk = t[s : s + step]
            valid = tk != IGNORE_INDEX
            p = (self.x[s : s + step].float() - self.lse[s : s + step, None]).exp_()
            p.scatter_add_(1, torch.where(valid, tk, 0)[:, None], -torch.ones_like(p[:, :1]))
            p *= valid[:, None].float() / n_valid
            den += p.double().square().sum()
            p -= dx[s : s + step].float()
            num += p.double().square().sum()
            del p
        return _ratio(num, den)


@torch.no_grad()
def logits_reference(x: torch.Tensor, t: torch.Tensor) -> LogitsReference:
    """fp32 log-sum-exp per row of the (bf16) logits and the mean loss, plain and shifted."""
    step = _rows_per_chunk(x.shape[1])
    lse = torch.cat([torch.logsumexp(x[s : s + step].float(), -1) for s in range(0, x.shape[0], step)])
    losses = {}
    for shift in (False, True):
        tt = _shifted_targets(t) if shift else t
        valid = tt != IGNORE_INDEX
        tgt = x.gather(1, torch.where(valid, tt, 0)[:, None])[:, 0].float()
        tok = torch.where(valid, lse - tgt, 0.0).double()
        losses[shift] = float(tok.sum()) / max(int(valid.sum()), 1)
    return LogitsReference(x, t, lse, losses)


def _ratio(num: torch.Tensor, den: torch.Tensor) -> float:
    num, den = float(num.sqrt()), float(den.sqrt())
    return num / den if den > 0 else num


@torch.no_grad()
def rel_l2(a: torch.Tensor, ref: torch.Tensor) -> float:
    """||a - ref|| / ||ref||, summed in fp64 over row chunks (no full-size fp64 copy); a 0-d pair
    (a reduced loss) counts as one row."""
    a, ref = a.reshape(1, -1) if a.dim() == 0 else a, ref.reshape(1, -1) if ref.dim() == 0 else ref
    num = torch.zeros((), device=ref.device, dtype=torch.float64)
    den = torch.zeros((), device=ref.device, dtype=torch.float64)
    step = max(1, (256 << 20) // (8 * max(ref.shape[-1], 1)))
    for s in range(0, ref.shape[0], step):
        r = ref[s : s + step].double()
        den += r.square().sum()
        num += (a[s : s + step].double() - r).square().sum()
    return _ratio(num, den)
