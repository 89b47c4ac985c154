"""The options of every cce loss, in one frozen dataclass, validated once.

:class:`CCEOptions` holds what a user chooses (the loss's semantics, the filter threshold, the
implementation). Its ``tuning`` field, a :class:`Tuning`, holds the internal choices: which
backward algorithm runs and the memory budgets of the implementations. The defaults are what
the library is tuned for; tests and benchmarks pass other values (never by overwriting module
state) to exercise every path on small problems. ``docs/design.md`` lists each algorithm and
when ``backward="auto"`` picks it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

import torch

Reduction = Literal["mean", "sum", "none"]
Impl = Literal["auto", "triton", "torch"]
FilterEps = float | Literal["auto"] | None
Backward = Literal["auto", "sparse"]

REDUCTIONS: tuple[str, ...] = ("mean", "sum", "none")
# The per-token outputs a call may ask for besides the loss and lse (cce.LossOutputs' fields).
TOKEN_OUTPUTS: tuple[str, ...] = ("return_logprobs", "return_entropy", "return_argmax", "return_accuracy")
IMPLS: tuple[str, ...] = ("auto", "triton", "torch")
BACKWARDS: tuple[str, ...] = ("auto", "sparse")
# Input dtypes every entry point accepts (float64 runs the Triton kernels in fp32).
FLOAT_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16, torch.float64)

# Gradient-filter thresholds chosen by filter_eps="auto". A tile of the softmax is skipped when
# every (non-target) probability in it is below eps; its contribution is then replaced by a
# rank-1 correction (see docs/design.md), whose error is not eps per entry but the spread of the
# tile's classes around their mean times the tile's mass. bf16 / fp16: chosen so that the
# corrected filter error stays at the error of storing the gradient in that dtype while on
# random logits no tile is kept at all (docs/benchmarks.md has the measurements). fp32: about
# its rounding unit.
AUTO_FILTER_EPS = {
    torch.bfloat16: 2.0**-8,
    torch.float16: 2.0**-10,
    torch.float32: 2.0**-20,
    torch.float64: 0.0,
}
# impl="torch" (whose filter runs on CPU tensors) filters 16-bit inputs with fp32's threshold: it
# computes in fp32, and it has no measured dense-slab rule (the Triton sparse backward's), so
# the rank-1 corrections stand alone. With bf16's threshold they erred by 6.2e-2 in dE on
# near-uniform logits, where every tile falls below it (CPU, bf16, N = 2048, D = 256,
# V = 32000; exact: 3e-7 against the fp64 reference's gradients rounded to bf16).
TORCH_IMPL_16BIT_EPS = AUTO_FILTER_EPS[torch.float32]


def _check_positive_int(name: str, value: object, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1{' or None' if allow_none else ''}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class Tuning:
    """Internal choices of the implementations (defaults: what cce is tuned for).

    Attributes:
        backward: the filtered Triton backward (filter_eps > 0): ``"auto"`` (the sparse backward
            from the forward's tile statistics where it applies and the threshold is at least
            2^-10, see docs/design.md; the exact path otherwise) or ``"sparse"`` (the sparse
            backward wherever it applies, whatever the threshold). Where it does not apply (a
            bias gradient, softcap with label smoothing) the exact path runs.
        chunk_bytes: bytes of chunk-sized temporaries of the PyTorch implementations (None: each
            implementation's default).
        dz_slab_bytes: bytes of the exact Triton backward's dZ slab, and of its row block's
            fp32 dE rows and gathered E rows (the blocks: at most 8 where dC is 16-bit,
            cce/ops/linear_ce/kernels/backward_exact.py).
        stats_chain_tiles: vocabulary tiles per carry chain of the tile-statistics encoder.
        de_block_slots: kept-tile dZ scratch slots per token block of the sparse dE writer.
        dc_scratch_tiles: kept-tile dZ scratch slots of the sparse dC writer (None: two per
            token block).
        stash_move_bytes: bytes of the temporary that moves dE rows into e's order.
        dense_slabs: whether the sparse backward does some vocabulary slabs densely
            (GEMM-shaped kernels, chosen on the device by the two rules below;
            docs/design.md, "Dense slabs"). On by default: without them the filter's error
            on near-uniform softmaxes and on real-text hidden states is 1e-2 to 5e-2, and
            the sparse backward slows down many times where it keeps most tiles.
        dense_kept: a slab is dense where the tile filter keeps at least this share of its
            (token block, tile) pairs; above 1: never for this reason.
        slab_error: ... and the slabs whose rank-1 corrections err the most, measured on
            sampled rows, are dense until the corrections' relative error in dE is at most
            this (cce/ops/linear_ce/slab_choice.py); 1 or more: never for this reason.
        slab_error_dc: the same for their estimated relative error in dC (from the sampled
            rows' pairs and an estimate of ||dC||). Both leave room for bf16's own rounding
            (about 1.8e-3 of each gradient) within a total of 5e-3 (docs/design.md, "Numerical
            guarantees"): each target is that room divided by how far its estimate has been
            measured to fall short (dE 1.3x; dC 1.4x on real text at N = 32768, where 3.5e-3
            left a total dC error of 5.2e-3).
        first_order: whether the error rule of the dense slabs may instead apply the skipped
            tiles' first-order corrections (cce/ops/linear_ce/kernels/first_order.py): one
            D x D Gram matrix of C and one of the rows, about 2 D / N of a logits pass, chosen
            on the device where they and the slabs the rule still needs cost less than the
            slabs the rank-1 corrections alone need (near-uniform softmaxes: an untrained
            model, random logits).
        host_gating: where the device's choice of dense slabs and first-order terms has
            reached the host by the time the launches it gates are issued (a small copy started
            when the choice is made and read once it has completed: never a wait or a
            synchronisation), the launches and buffers it turns off are left out; a step bound
            by the host then issues fewer launches (cce/ops/linear_ce/host_peek.py). False:
            every gated launch is issued. The gradients are the same bit for bit either way;
            under CUDA-graph capture every gated launch is issued.
        dense_slab_bytes: bytes of the dZ slab of the dense slabs (with the gated launches per
            slab, larger slabs cost fewer host launches and fill the GPU better:
            docs/benchmarks.md), and of one row block's fp32 dE rows and gathered rows of E
            (the slabs run by row blocks: their memory flat in N).
        sparse_min_flops: with ``backward="auto"``, problems whose logits matmul (2 N V D) is
            smaller than this take the exact backward even when filtered: below it the exact
            path is the faster one and has no filter error. None: SPARSE_MIN_FLOPS_CUDA on CUDA
            tensors (calibrated on an H100, docs/benchmarks.md), 0 elsewhere (the Triton
            interpreter has no speed to gain, and its tests exercise the filtered paths).
        sparse_min_classes: with ``backward="auto"`` and ``sparse_min_flops`` None, filtered
            calls over a vocabulary of fewer classes take the fused exact path wherever it
            runs (``fused`` below), at any size: few tiles to skip, and the fused path was the
            faster one there off zipf-like data. None: SPARSE_MIN_CLASSES_CUDA on CUDA tensors
            (docs/benchmarks.md), 0 elsewhere.
        fused: wherever the exact backward would run (filter_eps None or 0, a problem below
            ``sparse_min_flops``, or a filtered call the sparse backward does not serve) and the
            loss's upstream gradient is a scalar (reduction ``"mean"`` or ``"sum"``), form the
            exact gradients in the forward pass instead: three matmul passes instead of four
            (cce/ops/linear_ce/kernels/fused_grads.py). The backward then only scales them; a
            gradient through the returned lse costs one more exact pass.
        fused_chunk_bytes: bytes of the fused path's chunk of per-logit values in the operands'
            dtype (rows in balanced chunks): its extra memory, flat in N. None: sized so that
            the step holds at most 5% of its gradients plus 256 MB beyond them, at most 512 MiB
            (cce/_dispatch.py, fused_chunk_bytes), which took 3-25% more time per step than
            512 MiB on an H200 (docs/benchmarks.md, "The fused chunk against the memory
            target"). Any number of chunks: up to 8 dC accumulates in c's dtype (one rounding
            per chunk), past that in its own storage as scaled fp16 (FUSED_DIRECT_CHUNKS).
            Smaller chunks take less memory and more time (more chunks: dC is read and written
            once per chunk, and the products are smaller).
    """

    backward: Backward = "auto"
    chunk_bytes: int | None = None
    dz_slab_bytes: int = 256 << 20
    stats_chain_tiles: int = 128
    de_block_slots: int = 2
    dc_scratch_tiles: int | None = None
    stash_move_bytes: int = 8 << 20
    dense_slabs: bool = True
    dense_kept: float = 0.25
    slab_error: float = 2.5e-3
    slab_error_dc: float = 3.0e-3
    dense_slab_bytes: int = 256 << 20
    first_order: bool = True
    host_gating: bool = True
    sparse_min_flops: float | None = None
    sparse_min_classes: int | None = None
    fused: bool = True
    fused_chunk_bytes: int | None = 1 << 29

    def __post_init__(self) -> None:
        if self.backward not in BACKWARDS:
            raise ValueError(f"backward must be one of {BACKWARDS}, got {self.backward!r}")
        _check_positive_int("chunk_bytes", self.chunk_bytes, allow_none=True)
        _check_positive_int("dz_slab_bytes", self.dz_slab_bytes)
        _check_positive_int("stats_chain_tiles", self.stats_chain_tiles)
        _check_positive_int("stash_move_bytes", self.stash_move_bytes)
        _check_positive_int("dc_scratch_tiles", self.dc_scratch_tiles, allow_none=True)
        _check_positive_int("dense_slab_bytes", self.dense_slab_bytes)
        _check_positive_int("fused_chunk_bytes", self.fused_chunk_bytes, allow_none=True)
        for name in ("dense_slabs", "first_order", "host_gating", "fused"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        for name in ("dense_kept", "slab_error", "slab_error_dc"):
            x = getattr(self, name)
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {x!r}")
        x = self.sparse_min_flops
        if x is not None and (isinstance(x, bool) or not isinstance(x, (int, float)) or not x >= 0):
            raise ValueError(f"sparse_min_flops must be a number >= 0 or None, got {x!r}")
        x = self.sparse_min_classes
        if x is not None and (isinstance(x, bool) or not isinstance(x, int) or x < 0):
            raise ValueError(f"sparse_min_classes must be an int >= 0 or None, got {x!r}")
        if isinstance(self.de_block_slots, bool) or not isinstance(self.de_block_slots, int):
            raise ValueError(f"de_block_slots must be an int >= 0, got {self.de_block_slots!r}")
        if self.de_block_slots < 0:
            raise ValueError(f"de_block_slots must be an int >= 0, got {self.de_block_slots!r}")


DEFAULT_TUNING = Tuning()

# Tuning.sparse_min_flops on CUDA: one logits matmul of 3 TFLOP (4.5 ms on an H100). Measured
# crossover of the exact and the filtered backward with its dense slabs (H100, bf16, zipf and
# random data): the exact path was faster at every problem up to 2.2e12, the filtered one on
# zipf data from 4.3e12 up (on near-uniform data the dense slabs cost 1.15-1.3x the exact path
# at every size before the first-order corrections: they are there for the error bound);
# docs/benchmarks.md, "Which backward runs: the size and vocabulary rules".
SPARSE_MIN_FLOPS_CUDA = 3e12

# Tuning.sparse_min_classes on CUDA: 256 vocabulary tiles of the bf16 / fp16 statistics (256
# classes each). At V = 32000 (125 tiles; mistral-7b, N = 32768) the fused exact path was the
# faster one on random, untrained-model and real-text data (slower on zipf data only); from
# V = 128256 (501 tiles) up the sparse backward was the faster one at N = 32768 in every regime.
# Between the two nothing was measured: 256 is about their geometric midpoint. The figures, and
# the rule's measured effect, are in docs/benchmarks.md, "Which backward runs: the size and
# vocabulary rules".
SPARSE_MIN_CLASSES_CUDA = 65536


@dataclasses.dataclass(frozen=True)
class CCEOptions:
    """Options shared by :func:`cce.linear_cross_entropy` and :func:`cce.cross_entropy`.

    Validated on construction, so a bad value fails before any tensor is touched.
    """

    ignore_index: int = -100
    reduction: Reduction = "mean"
    shift: bool = False
    softcap: float | None = None
    label_smoothing: float = 0.0
    z_loss: float = 0.0
    filter_eps: FilterEps = "auto"
    impl: Impl = "auto"
    return_lse: bool = False
    temperature: float = 1.0
    return_logprobs: bool = False
    return_entropy: bool = False
    return_argmax: bool = False
    return_accuracy: bool = False
    tuning: Tuning | None = None  # None: Tuning() (a default instance here would not trace)

    def __post_init__(self) -> None:
        if isinstance(self.ignore_index, bool) or not isinstance(self.ignore_index, int):
            raise TypeError(f"ignore_index must be an int, got {self.ignore_index!r}")
        if self.reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {REDUCTIONS}, got {self.reduction!r}")
        if self.impl not in IMPLS:
            raise ValueError(f"impl must be one of {IMPLS}, got {self.impl!r}")
        if not isinstance(self.shift, bool):
            raise TypeError(f"shift must be a bool, got {self.shift!r}")
        for name in ("return_lse", *TOKEN_OUTPUTS):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)):
            raise TypeError(f"temperature must be a float > 0, got {t!r}")
        if not (t > 0 and math.isfinite(t)):
            raise ValueError(f"temperature must be a finite float > 0, got {t!r}")
        if self.tuning is not None and not isinstance(self.tuning, Tuning):
            raise TypeError(f"tuning must be a cce.Tuning or None, got {self.tuning!r}")
        if self.softcap is not None:
            if isinstance(self.softcap, bool) or not isinstance(self.softcap, (int, float)):
                raise TypeError(f"softcap must be a float or None, got {self.softcap!r}")
            if not (self.softcap > 0 and math.isfinite(self.softcap)):
                raise ValueError(f"softcap must be a finite float > 0 (or None), got {self.softcap!r}")
        if not isinstance(self.label_smoothing, (int, float)) or isinstance(self.label_smoothing, bool):
            raise TypeError(f"label_smoothing must be a float, got {self.label_smoothing!r}")
        if not 0.0 <= self.label_smoothing <= 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1], got {self.label_smoothing!r}")
        if not isinstance(self.z_loss, (int, float)) or isinstance(self.z_loss, bool):
            raise TypeError(f"z_loss must be a float, got {self.z_loss!r}")
        if not (self.z_loss >= 0 and math.isfinite(self.z_loss)):
            raise ValueError(f"z_loss must be a finite float >= 0, got {self.z_loss!r}")
        eps = self.filter_eps
        if eps is not None and eps != "auto":
            if isinstance(eps, bool) or not isinstance(eps, (int, float)):
                raise TypeError(f"filter_eps must be 'auto', a float or None, got {eps!r}")
            if not (0.0 <= eps < 1.0):
                raise ValueError(f"filter_eps must be in [0, 1) (or 'auto' / None), got {eps!r}")

    def resolved_filter_eps(self, dtype: torch.dtype, impl: str = "triton") -> float:
        """The probability threshold below which a softmax tile's gradient is filtered (0 = exact)
        for inputs of ``dtype`` under ``impl`` ("triton" or "torch", as chosen)."""
        if self.filter_eps is None:
            return 0.0
        if self.filter_eps == "auto":
            if impl == "torch" and dtype in (torch.bfloat16, torch.float16):
                return TORCH_IMPL_16BIT_EPS
            return AUTO_FILTER_EPS.get(dtype, 0.0)
        return float(self.filter_eps)

    @property
    def token_outputs(self) -> bool:
        """Whether any per-token output beyond the loss and lse is asked for (the result is then
        a :class:`cce.LossOutputs`)."""
        return any(getattr(self, name) for name in TOKEN_OUTPUTS)

    @property
    def differentiable_outputs(self) -> bool:
        """Whether an output other than the loss can carry a gradient back (lse, log-probs,
        entropy): the loss' upstream gradient then does not determine the gradients alone."""
        return self.return_lse or self.return_logprobs or self.return_entropy

    @property
    def resolved_tuning(self) -> Tuning:
        """The internal choices: ``tuning``, or the defaults."""
        return DEFAULT_TUNING if self.tuning is None else self.tuning

    @property
    def softcap_value(self) -> float:
        """softcap as a float, 0.0 meaning 'no softcap' (the form the kernels take)."""
        return 0.0 if self.softcap is None else float(self.softcap)
