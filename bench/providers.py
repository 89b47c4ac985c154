"""What the harness compares: cce and the peers a user could pick instead. A :class:`Provider`
computes a mean cross-entropy loss from hidden states and the classifier ("linear" level:
``loss(e, c, t)``) or from logits ("logits" level: ``loss(x, t)``)."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.metadata
from collections.abc import Callable

import torch
import torch.nn.functional as F

LINEAR = "linear"
LOGITS = "logits"
FWD = "fwd"
FWDBWD = "fwd+bwd"
MODES = (FWD, FWDBWD)


@dataclasses.dataclass
class Provider:
    """One implementation under test; ``make()`` (called once) returns its loss function."""

    name: str
    level: str  # LINEAR or LOGITS
    make: Callable[[], Callable[..., torch.Tensor]]
    description: str
    package: str | None = None  # distribution whose version is recorded; None for cce / torch
    needs_cuda: bool = False
    fresh_input: bool = False  # overwrites its logits input: a fresh copy per call
    nonleaf_input: bool = False  # wants the logits as a non-leaf (cce's inplace_backward)
    shift: bool = False  # computes the causal-shifted loss (logits[:-1] vs targets[1:])
    modes: tuple[str, ...] = MODES
    reference: bool = True  # False: another objective (timed, not compared with the reference)

    def unavailable(self) -> str | None:
        """Why this provider cannot run here (package missing), or None."""
        if self.package is None or _version(self.package) is not None:
            return None
        return f"{self.package} is not installed"

    @functools.cached_property
    def fn(self) -> Callable[..., torch.Tensor]:
        return self.make()


def _cce(entry: str = "linear_cross_entropy", tuning: dict | None = None, **kw):
    """make() of ``cce.<entry>(..., **kw)``, or of the linear entry with ``cce.Tuning(**tuning)``."""

    def make():
        import cce

        if tuning is None:
            return functools.partial(getattr(cce, entry), **kw)
        opts = cce.CCEOptions(tuning=cce.Tuning(**tuning))
        return lambda e, c, t: cce.linear_cross_entropy_with_options(e, c, t, None, None, opts)

    return make


def _cce_outputs():
    """cce with every per-token output (log-probs, entropy, argmax, accuracy); the loss as cce's."""
    import cce

    kw = dict(return_logprobs=True, return_entropy=True, return_argmax=True, return_accuracy=True)
    return lambda e, c, t: cce.linear_cross_entropy(e, c, t, **kw).loss


def _cce_entropy_bonus():
    """loss - 0.01 * entropy.mean(): an RL-style objective whose entropy receives a gradient."""
    import cce

    def fn(e, c, t):
        out = cce.linear_cross_entropy(e, c, t, return_entropy=True)
        return out.loss - 0.01 * out.entropy.mean()

    return fn


def _torch_linear(e, c, t):
    return F.cross_entropy((e @ c.T).float(), t)


def _compiled(fn):
    def make():
        # Every (shape, mode) is a new specialization: past the default limit (8) dynamo runs eager.
        cfg = torch._dynamo.config
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(cfg, name):
                setattr(cfg, name, max(getattr(cfg, name), 256))
        return torch.compile(fn, dynamic=False)

    return make


class _ChunkedCE(torch.autograd.Function):
    """Mean cross entropy of ``e @ c.T`` over ``chunks`` row chunks, logits upcast per chunk and
    recomputed in the backward (the "chunked cross entropy" of fine-tuning libraries); dC is
    accumulated over the chunks in c's dtype."""

    @staticmethod
    def forward(ctx, e, c, t, chunks, ignore_index):
        n_valid = (t != ignore_index).sum().clamp_min(1)
        total = torch.zeros((), device=e.device, dtype=torch.float32)
        for e_k, t_k in zip(e.chunk(chunks), t.chunk(chunks), strict=True):
            logits = (e_k @ c.T).float()  # [N / chunks, V]
            total = total + F.cross_entropy(logits, t_k, ignore_index=ignore_index, reduction="sum")
            del logits
        ctx.save_for_backward(e, c, t, n_valid)
        ctx.chunks, ctx.ignore_index = chunks, ignore_index
        return total / n_valid

    @staticmethod
    def backward(ctx, grad):
        e, c, t, n_valid = ctx.saved_tensors
        scale = grad / n_valid
        de = torch.empty_like(e) if ctx.needs_input_grad[0] else None
        dc = torch.zeros_like(c) if ctx.needs_input_grad[1] else None
        row = 0
        for e_k, t_k in zip(e.chunk(ctx.chunks), t.chunk(ctx.chunks), strict=True):
            p = (e_k @ c.T).float().softmax(-1)  # [N / chunks, V]
            valid = t_k != ctx.ignore_index
            p.scatter_add_(1, torch.where(valid, t_k, 0)[:, None], -valid[:, None].float())
            p *= torch.where(valid, scale, 0.0)[:, None]
            g = p.to(e.dtype)
            del p
            if de is not None:
                torch.mm(g, c, out=de[row : row + e_k.shape[0]])
            if dc is not None:
                dc.addmm_(g.T, e_k)
            row += e_k.shape[0]
            del g
        return de, dc, None, None, None


def _apple(impl: str):
    def make():
        from cut_cross_entropy import linear_cross_entropy

        return functools.partial(linear_cross_entropy, impl=impl)

    return make


def _liger_flce():
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    mod = LigerFusedLinearCrossEntropyLoss()
    return lambda e, c, t: mod(c, e, t)


def _quack():
    from quack.linear_cross_entropy import chunked_linear_cross_entropy

    return chunked_linear_cross_entropy


def _torch_ce(x, t):
    return F.cross_entropy(x.float(), t)


def _liger_ce():
    from liger_kernel.transformers import LigerCrossEntropyLoss

    return LigerCrossEntropyLoss()


def _crossentropy_triton():
    from crossentropy_triton import CrossEntropyFunction

    # Its causal shift is built in (and copies logits[:-1]): the problem is (N - 1) rows.
    return lambda x, t: CrossEntropyFunction.apply(x[None], t[None], -100)


def all_providers() -> list[Provider]:
    """Every provider, in table order; fresh objects (each holds its own compiled functions)."""
    P = Provider
    return [
        P("cce", LINEAR, _cce(), "cce.linear_cross_entropy (defaults: filter_eps='auto')"),
        P("cce-exact", LINEAR, _cce(filter_eps=None), "cce, filter_eps=None (no gradient filtering)"),
        P("cce-sparse", LINEAR, _cce(tuning=dict(dense_slabs=False)), "cce, Tuning(dense_slabs=False): the "
          "sparse backward without dense slabs", needs_cuda=True, modes=(FWDBWD,)),
        P("cce-torch", LINEAR, _cce(impl="torch"), "cce, impl='torch' (chunked PyTorch)"),
        P("cce-outputs", LINEAR, _cce_outputs, "cce with every per-token output (log-probs, entropy, ...)"),
        P("cce-entropy-bonus", LINEAR, _cce_entropy_bonus,
          "cce, loss - 0.01 * entropy.mean() (not compared with the reference)", modes=(FWDBWD,),
          reference=False),
        P("torch", LINEAR, lambda: _torch_linear, "F.cross_entropy((e @ c.T).float(), t), eager"),
        P("torch-compile", LINEAR, _compiled(_torch_linear), "the same under torch.compile"),
        P("chunked8", LINEAR, lambda: lambda e, c, t: _ChunkedCE.apply(e, c, t, 8, -100),
          "8 row chunks, logits upcast per chunk, recomputed in bwd"),
        P("apple-cce", LINEAR, _apple("cce"), "cut_cross_entropy.linear_cross_entropy, impl='cce'",
          package="cut-cross-entropy", needs_cuda=True),
        P("apple-cce-compile", LINEAR, _apple("torch_compile"), "cut_cross_entropy, impl='torch_compile'",
          package="cut-cross-entropy", needs_cuda=True),
        P("liger-flce", LINEAR, _liger_flce, "LigerFusedLinearCrossEntropyLoss (its inner cross entropy "
          "in CuTe DSL where nvidia-cutlass-dsl is installed, on Hopper and newer)", package="liger-kernel",
          needs_cuda=True),
        P("quack", LINEAR, _quack, "quack.linear_cross_entropy.chunked_linear_cross_entropy (CuTe DSL)",
          package="quack-kernels", needs_cuda=True),
        P("cce-ce", LOGITS, _cce("cross_entropy"), "cce.cross_entropy"),
        P("cce-ce-inplace", LOGITS, _cce("cross_entropy", inplace_backward=True),
          "cce.cross_entropy, inplace_backward=True", fresh_input=True, nonleaf_input=True, modes=(FWDBWD,)),
        P("torch-ce", LOGITS, lambda: _torch_ce, "F.cross_entropy(x.float(), t), eager"),
        P("torch-ce-compile", LOGITS, _compiled(_torch_ce), "the same under torch.compile"),
        P("liger-ce", LOGITS, _liger_ce, "LigerCrossEntropyLoss (writes the gradient into its input)",
          package="liger-kernel", needs_cuda=True, fresh_input=True),
        P("crossentropy-triton", LOGITS, _crossentropy_triton, "crossentropy_triton.CrossEntropyFunction "
          "(built-in causal shift; writes the gradient into its input)", package="crossentropy-triton",
          needs_cuda=True, shift=True, fresh_input=True),
    ]  # fmt: skip


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions(providers: list[Provider]) -> dict[str, str | None]:
    """Versions of torch, triton, cce and every peer package (None: not installed)."""
    out = {"torch": torch.__version__, "cuda": torch.version.cuda}
    out.update({d: _version(d) for d in ("triton", "cce", "matplotlib", "nvidia-cutlass-dsl")})
    if out["cce"] is None:  # run from a checkout without installing
        try:
            out["cce"] = getattr(importlib.import_module("cce"), "__version__", None)
        except Exception:  # noqa: BLE001 - a broken cce is reported by its rows
            pass
    out.update({p.package: _version(p.package) for p in providers if p.package})
    return out
