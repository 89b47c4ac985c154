"""Which implementation and which backward algorithm run, decided once per call on the host.

Nothing here looks at tensor values (no host synchronisation) or probes a device at import: the
decisions depend on the options, the tensors' device and dtype, and what autograd will ask for.
The implementations themselves live in cce/ops/<op>/ and cce/distributed/.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass
from typing import Any

import torch

from .options import SPARSE_MIN_CLASSES_CUDA, SPARSE_MIN_FLOPS_CUDA, Tuning

# The sparse backward serves filtered training steps from this threshold up (the bf16 / fp16
# defaults): a kept tile past its dZ scratch costs one recompute per D chunk of the output, cheap
# while few tiles are kept, not at smaller thresholds (fp32's 2^-20) where a large share of the
# tiles is kept (docs/benchmarks.md); the exact path runs there. Tuning(backward="sparse") lifts
# this bound.
SPARSE_MIN_EPS = 2.0**-10


def interpreting() -> bool:
    """Whether Triton kernels run in the interpreter (TRITON_INTERPRET=1, on the CPU)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def select_impl(impl: str, device: torch.device) -> str:
    """'torch' or 'triton' for the requested impl and the tensors' device."""
    if impl == "torch":
        return "torch"
    if impl == "triton":
        if not triton_available():
            raise RuntimeError("impl='triton' needs the triton package, which is not installed")
        if device.type != "cuda" and not interpreting():
            raise ValueError(
                f"impl='triton' needs CUDA tensors, got tensors on {device}; use impl='torch' "
                "(or set TRITON_INTERPRET=1 before importing cce to run the kernels on the CPU)"
            )
        return "triton"
    return "triton" if device.type == "cuda" and triton_available() else "torch"


def is_dtensor(t: Any) -> bool:
    """Whether t is a torch.distributed DTensor (the class name first: no import of
    torch.distributed.tensor for plain tensors)."""
    if type(t).__name__ != "DTensor":
        return False
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        return False
    return isinstance(t, DTensor)


def autocast_operands(e: Any, c: Any, bias: Any) -> tuple[Any, Any, Any]:
    """Under autocast, the matmul operands in the autocast dtype, as ``lm_head(e)`` would use.

    The casts are ordinary differentiable ops, so fp32 parameters get fp32 gradients.
    """
    dev = e.device.type if isinstance(e, torch.Tensor) else "cpu"
    if dev not in ("cpu", "cuda", "mps", "xpu") or not torch.is_autocast_enabled(dev):
        return e, c, bias
    dt = torch.get_autocast_dtype(dev)

    def cast(t):
        return t.to(dt) if isinstance(t, torch.Tensor) and t.is_floating_point() else t

    return cast(e), cast(c), cast(bias)


def needs_grad(t: torch.Tensor | None) -> bool:
    """Whether autograd will ask for t's gradient."""
    return t is not None and t.requires_grad and torch.is_grad_enabled()


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 8 elsewhere (the interpreter: a small machine,
    so that small test problems exercise the splitting of work over programs)."""
    if device.type != "cuda":
        return 8
    return _cuda_properties(torch.cuda.current_device() if device.index is None else device.index)[0]


def capability(device: torch.device) -> tuple[int, int]:
    """A CUDA device's compute capability (major, minor)."""
    return _cuda_properties(torch.cuda.current_device() if device.index is None else device.index)[1]


@functools.cache
def _cuda_properties(index: int) -> tuple[int, tuple[int, int]]:
    """(SM count, capability) of CUDA device ``index``, read once per process on first use (a
    step asks several times; each read costs the host microseconds)."""
    p = torch.cuda.get_device_properties(index)
    return p.multi_processor_count, (p.major, p.minor)


def linear_backward(*args, **kwargs) -> str:
    """backward_choice's algorithm alone (its arguments)."""
    return backward_choice(*args, **kwargs)[0]


def backward_choice(
    tuning: Tuning,
    filter_eps: float,
    need_de: bool,
    need_dc: bool,
    need_dbias: bool,
    softcap: float,
    label_smoothing: float,
    flops: float = math.inf,
    cuda: bool = True,
    fused_ok: bool = False,
    fused_whole: bool = False,
    classes: int | None = None,
) -> tuple[str, str]:
    """(algorithm, the rule that chose it in words: cce.explain) of the Triton backward of a
    linear-cross-entropy call: "exact" (dZ slabs and cuBLAS; filter_eps 0, or a filtered call
    the sparse backward does not serve), "fused" (the exact gradients formed in the forward) or
    "sparse" (filtered, from the forward's tile statistics: e or c needing a gradient, no bias
    gradient, not softcap with label smoothing, whose smoothing term is then not rank-1, and with
    ``backward="auto"`` a threshold from SPARSE_MIN_EPS up). A filtered call outside those takes
    the exact path, which has no filter error and which no filtered algorithm beat there: the
    recomputing filtered backward that served them (every tile recomputed, the kept ones'
    products accumulated with fp32 atomics) took 5.4x the forward matmul per step on zipf data
    at the bf16 threshold, where the exact path takes 3.1-4.5x (docs/benchmarks.md, "The sparse
    backward and the sorted vocabulary").

    ``flops`` (2 N V D, one pass of the logits matmul): with ``backward="auto"`` a filtered call
    below ``tuning.sparse_min_flops`` (None: SPARSE_MIN_FLOPS_CUDA for ``cuda`` tensors, else 0)
    takes the exact path, which is then the faster one (the filtered backwards' fixed costs,
    their ordering, statistics and plan, outweigh what skipping saves) and has no filter error.

    ``fused_ok`` (fused_fits): the exact gradients are formed in the forward instead ("fused",
    three matmul passes instead of four) wherever the exact path would run. ``fused_whole``
    (fused_one_chunk, with fused_ok): on CUDA tensors with the calibrated size rule
    (``sparse_min_flops`` None), a filtered call takes the fused path at any size: where the
    logits fit one chunk the sparse backward's fixed costs stay large against what it skips
    (llama3-70b's head, N = 2048; docs/benchmarks.md). Likewise, with ``classes`` (V) below
    ``tuning.sparse_min_classes`` (None: SPARSE_MIN_CLASSES_CUDA on CUDA tensors, else 0), a
    filtered call takes the fused path wherever it fits, at any size: a small vocabulary has few
    tiles to skip, and off zipf-like data the sparse backward's kept tiles and dense slabs cost
    more than the fused path's three passes, and its corrections' dC error on real text was
    above 1e-2 (mistral-7b's head, N = 32768; docs/benchmarks.md, "Which backward runs: the size
    and vocabulary rules").

    A ``temperature`` changes nothing here: every backward takes the tempered logits (the tile
    statistics and the filter are of those). (An entropy output's gradient, known only in the
    backward, is part of the sparse backward's dZ; after the fused forward the op runs the exact
    backward for it: cce/ops/linear_ce/triton_impl.py.)"""
    exact = "fused" if fused_ok else "exact"
    if filter_eps <= 0:
        return exact, "exact: filter_eps is None (or 0)"
    min_flops = tuning.sparse_min_flops
    if min_flops is None:
        min_flops = SPARSE_MIN_FLOPS_CUDA if cuda else 0.0
    if tuning.backward == "auto" and flops < min_flops:
        return exact, f"exact: 2 N V D = {flops:.3g} flops is below Tuning.sparse_min_flops ({min_flops:.3g})"
    calibrated = tuning.backward == "auto" and fused_ok and tuning.sparse_min_flops is None
    if calibrated and fused_whole and cuda:
        return (
            "fused",
            f"exact (fused): the logits' q fits one chunk of {FUSED_MAX_CHUNK_BYTES >> 20} MiB (or "
            "Tuning.fused_chunk_bytes): filtering's fixed costs would outweigh what it skips",
        )
    min_classes = tuning.sparse_min_classes
    if min_classes is None:
        min_classes = SPARSE_MIN_CLASSES_CUDA if cuda else 0
    if calibrated and classes is not None and classes < min_classes:
        return "fused", f"exact (fused): V = {classes} is below Tuning.sparse_min_classes ({min_classes})"
    unserved = None
    if not (need_de or need_dc):
        unserved = "only the bias gradient is asked for"
    elif need_dbias:
        unserved = "a bias gradient is asked for (it needs every tile's sums)"
    elif softcap > 0 and label_smoothing > 0:
        unserved = "softcap with label smoothing (the smoothing term is not rank-1)"
    elif tuning.backward == "auto" and filter_eps < SPARSE_MIN_EPS:
        unserved = f"filter_eps {filter_eps:.3g} is below {SPARSE_MIN_EPS:.3g}, where most tiles are kept"
    if unserved is not None:
        return exact, f"exact: the sparse backward does not serve this call: {unserved}"
    return "sparse", "filtered from the forward's tile statistics (the sparse backward)"


# The fused exact path (cce/ops/linear_ce/kernels/fused_grads.py) stores q per logit in the
# operands' dtype and rewrites it as dZ: about 4 bytes of memory traffic per logit (16-bit
# operands) more than the exact backward's dZ slabs, against one matmul pass (2 D flops per
# logit) less, which at ~200 flops per byte of bandwidth pays from D ~ 400 on. It is taken at
# every D: measured on an H200 against the four-pass backward, 0.79-0.92x its time at D = 768
# and 896 (gpt2's and qwen2.5-0.5b's heads, N = 8192 to 65536, zipf and random data) with
# 0.99-1.23x its memory (docs/benchmarks.md, "The fused exact path at small D").


def fused_fits(*args, **kwargs) -> bool:
    """Whether the fused exact path serves the call (fused_misfit's arguments)."""
    return fused_misfit(*args, **kwargs) is None


def fused_misfit(
    tuning: Tuning,
    reduction: str,
    dtype: torch.dtype,
    need_grad: bool,
    softcap: float = 0.0,
    label_smoothing: float = 0.0,
) -> str | None:
    """Why the fused exact path does not serve a call, in words (None where it does: cce.explain).

    The fused exact path (cce/ops/linear_ce/kernels/fused_grads.py) serves a training
    step where the exact backward would run: the upstream gradient is a scalar (reduction "mean"
    or "sum"); the operands are bf16 or fp32 (fp16 would need dZ scaled: alpha p with alpha ~ 1 / N
    of a "mean" falls below its normal range); not softcap with label smoothing (whose smoothing
    term needs the softcap's derivative per entry). Any number of row chunks: memory is one chunk
    (fused_chunk_bytes) and its rows, and dC's sum over the chunks keeps its accuracy (fused_dc16)."""
    if not need_grad:
        return "no gradient is asked for"
    if not tuning.fused:
        return "Tuning(fused=False)"
    if reduction not in ("mean", "sum"):
        return f"reduction {reduction!r}: the upstream gradient is not one scalar"
    if softcap > 0 and label_smoothing > 0:
        return "softcap with label smoothing"
    if dtype not in (torch.bfloat16, torch.float32):
        return f"{dtype} operands"
    return None


# dC of the fused path over several row chunks: up to FUSED_DIRECT_CHUNKS chunks cuBLAS adds each
# chunk's fp32 product to the stored dC, one rounding to c's dtype per chunk (a bf16 dC's RMS
# error grows ~ sqrt(k) times one rounding's: against fp32 gradients on one H200, 1.6e-3 to
# 2.1e-3 with the four-pass exact backward, 2.9e-3 with 4 chunks, up to 3.6e-3 with 8 and 4.7e-3
# with 16, docs/benchmarks.md, "The fused exact path"). With more chunks and 16-bit operands the
# running sum is kept in dC's storage as scaled fp16, 8x finer per rounding
# (kernels/dc_accumulate.py: 1.8e-3 to 2.1e-3 with 32 chunks); its Triton product takes 1.03-1.15x
# cuBLAS's time per chunk (H200, 1024 to 8192 rows), so it starts where bf16 would round too often.
# fp32 operands accumulate in dC itself.
FUSED_DIRECT_CHUNKS = 8


def fused_dc16(chunks: int, dtype: torch.dtype) -> bool:
    """Whether the fused path's dC sums its chunks in scaled fp16 (16-bit operands in more than
    FUSED_DIRECT_CHUNKS chunks) rather than by cuBLAS in c's dtype."""
    return dtype != torch.float32 and chunks > FUSED_DIRECT_CHUNKS


# Rows of the fused path's chunk buffer: q (then dZ) padded to a multiple of this many classes
# (16-byte aligned rows for cuBLAS, also at odd V).
FUSED_PAD_CLASSES = 16


def fused_padded_classes(V: int) -> int:
    """The fused chunk buffer's row length, in classes."""
    return -(-V // FUSED_PAD_CLASSES) * FUSED_PAD_CLASSES


def fused_chunk_rows(N: int, V: int, chunk_bytes: int, itemsize: int = 4) -> int:
    """Rows per chunk of the fused path: as many rows of ``itemsize``-byte q (the operands'
    dtype; fused_padded_classes) as ``chunk_bytes`` hold, at least one; balanced, so that the
    chunks have equal rows up to one."""
    per = max(1, chunk_bytes // (itemsize * fused_padded_classes(V)))
    k = -(-max(N, 1) // per)
    return -(-max(N, 1) // k)


def fused_chunks(N: int, V: int, chunk_bytes: int, itemsize: int = 4) -> int:
    """The fused path's row chunks for a chunk of ``chunk_bytes`` (fused_chunk_rows)."""
    return -(-max(N, 1) // fused_chunk_rows(N, V, chunk_bytes, itemsize))


# The fused path's chunk is Tuning.fused_chunk_bytes (512 MiB by default) or, where that is None,
# sized so that the step holds at most FUSED_MEMORY_SHARE of its gradients plus FUSED_MEMORY_BYTES
# beyond them (per chunk row its q, fp32 dE row, row of e gathered (with shift) and tiles' running
# maxima; FUSED_MEMORY_MARGIN for the forward's partial statistics and the like, FUSED_ROW_BYTES
# per problem row for the O(N) vectors: targets, coefficients, statistics), at most
# FUSED_MAX_CHUNK_BYTES of q. Smaller chunks cost time: dC is read and written once more per
# chunk (4 V D bytes), past FUSED_DIRECT_CHUNKS chunks by the slower fp16-sum product, the
# products are smaller and each chunk costs its launches: 3-25% more per step than 512 MiB chunks
# on an H200 (docs/benchmarks.md, "The fused chunk against the memory target"), so it is not the
# default.
FUSED_MEMORY_SHARE = 0.05
FUSED_MEMORY_BYTES = 256 * 10**6
FUSED_MEMORY_MARGIN = 8 << 20
FUSED_ROW_BYTES = 96
FUSED_MAX_CHUNK_BYTES: int = Tuning().fused_chunk_bytes  # the default chunk, 512 MiB


def fused_chunk_bytes(
    tuning: Tuning, shape: tuple[int, int, int], itemsize: int, grads: tuple[bool, bool, bool]
) -> int:
    """Bytes of the fused path's q chunk for ``shape`` = (N, V, D), operands of ``itemsize``
    bytes and ``grads`` = (dE, dC, dbias asked for): Tuning.fused_chunk_bytes, or where that is
    None sized to the memory target (the comment above); at least one row."""
    if tuning.fused_chunk_bytes is not None:
        return tuning.fused_chunk_bytes
    (N, V, D), (need_de, need_dc, need_dbias) = shape, grads
    gradients = itemsize * D * (N * need_de + V * need_dc) + 4 * V * need_dbias
    allowance = (
        FUSED_MEMORY_SHARE * gradients + FUSED_MEMORY_BYTES - FUSED_MEMORY_MARGIN - FUSED_ROW_BYTES * N
    )
    q_row = itemsize * fused_padded_classes(V)
    per_row = q_row + (4 * need_de + itemsize) * D + 4 * -(-V // 128)
    rows = max(1, int(allowance // per_row))
    return min(rows * q_row, FUSED_MAX_CHUNK_BYTES)


def fused_one_chunk(tuning: Tuning, N: int, V: int, itemsize: int = 4) -> bool:
    """The size rule's test (backward_choice's ``fused_whole``): whether the logits' q (padded rows
    of ``itemsize`` bytes) fits one chunk of FUSED_MAX_CHUNK_BYTES (or Tuning.fused_chunk_bytes),
    the size it was calibrated at: a cost rule, apart from the memory target's chunks."""
    size = FUSED_MAX_CHUNK_BYTES if tuning.fused_chunk_bytes is None else tuning.fused_chunk_bytes
    return fused_chunks(N, V, size, itemsize) == 1


@dataclass(frozen=True)
class LinearPlan:
    """What a linear-cross-entropy call runs, decided on the host before any kernel (the op reads
    it; ``cce.explain`` returns it): the implementation, the backward algorithm (impl="triton":
    "fused", "exact" or "sparse", linear_backward; impl="torch": "chunked-forward",
    the gradients formed by the forward's chunks, or "chunked", recomputed in the backward), the
    threshold the backward filters with (0: exact), the fused path's row chunks (0 off it) and
    the rules that chose them, in words; with the sparse backward also ``slabs``, its host-side
    plan of dense slabs and first-order terms (cce/ops/linear_ce/slab_choice.SlabPlan, whose
    reasons are among ``reasons``), else None."""

    impl: str
    backward: str
    filter_eps: float
    chunks: int
    reasons: tuple[str, ...]
    slabs: Any = None
    chunk_bytes: int = 0

    def __str__(self) -> str:
        head = f"impl={self.impl!r}, backward={self.backward!r}, filter_eps={self.filter_eps:.3g}"
        if self.chunks:
            head += f", {self.chunks} row chunk(s)"
        return "\n".join([head, *(f"  - {r}" for r in self.reasons)])


def plan_triton(
    tuning: Tuning,
    reduction: str,
    dtype: torch.dtype,
    shape: tuple[int, int, int],
    grads: tuple[bool, bool, bool],
    softcap: float,
    label_smoothing: float,
    filter_eps: float,
    cuda: bool,
) -> LinearPlan:
    """impl="triton"'s plan for ``shape`` = (N rows, V classes, D features) and ``grads`` =
    (dE, dC, dbias asked for): fused_misfit, then backward_choice."""
    (N, V, D), (need_de, need_dc, need_dbias) = shape, grads
    need = need_de or need_dc or need_dbias
    misfit = fused_misfit(tuning, reduction, dtype, need, softcap, label_smoothing)
    algo, why = backward_choice(
        tuning, filter_eps, need_de, need_dc, need_dbias, softcap, label_smoothing, 2.0 * N * V * D, cuda,
        misfit is None, fused_one_chunk(tuning, N, V, dtype.itemsize), classes=V,
    )  # fmt: skip
    reasons = [why] if need else ["no gradient is asked for: the forward alone runs"]
    size = chunks = 0
    if algo == "fused":  # (a gradient is asked for: fused_misfit)
        size = fused_chunk_bytes(tuning, shape, dtype.itemsize, grads)
        chunks = fused_chunks(N, V, size, dtype.itemsize)
        rows = fused_chunk_rows(N, V, size, dtype.itemsize)
        q = rows * fused_padded_classes(V) * dtype.itemsize / 2**20
        sized = (
            "Tuning.fused_chunk_bytes"
            if tuning.fused_chunk_bytes is not None
            else f"the memory target: {FUSED_MEMORY_SHARE:.0%} of the gradients + "
            f"{FUSED_MEMORY_BYTES // 10**6} MB, at most {FUSED_MAX_CHUNK_BYTES >> 20} MiB"
        )
        reasons.append(
            f"gradients formed in the forward by row chunks: three matmul passes; {chunks} chunk(s) of "
            f"{rows} rows, {q:.3g} MiB of q ({sized})"
        )
        if need_dc and fused_dc16(chunks, dtype):
            reasons.append(
                f"more than {FUSED_DIRECT_CHUNKS} chunks: dC sums them in its own storage in scaled fp16"
            )
    else:
        if need and algo == "exact":
            reasons.append(f"not the fused path ({misfit}): four matmul passes")
    eps = filter_eps if algo == "sparse" else 0.0
    return LinearPlan("triton", algo, eps, chunks, tuple(reasons), chunk_bytes=size)


def plan_torch(
    reduction: str,
    differentiable_outputs: bool,
    need_grad: bool,
    filter_eps: float,
    cpu: bool,
    smoothing_under_softcap: bool = False,
) -> LinearPlan:
    """impl="torch"'s plan (cce/ops/linear_ce/chunked.py: filtering on CPU tensors only, and not
    for label smoothing under a softcap)."""
    eps = filter_eps if cpu and not smoothing_under_softcap else 0.0
    if not need_grad:
        return LinearPlan("torch", "chunked", eps, 0, ("no gradient is asked for: the forward alone runs",))
    if reduction != "none" and not differentiable_outputs:
        algo, why = (
            "chunked-forward",
            f"reduction {reduction!r}: the gradients are formed by the forward's chunks",
        )
    else:
        algo, why = "chunked", "per-token upstream gradients: the backward recomputes the chunks' logits"
    if eps > 0:
        filt = f"CPU: the products of tiles whose probabilities are all below {eps:.3g} are skipped"
    elif filter_eps > 0:
        filt = (
            "exact: filtering runs on CPU tensors only"
            if not cpu
            else "exact: label smoothing under a softcap"
        )
    else:
        filt = "exact: filter_eps is None (or 0)"
    return LinearPlan("torch", algo, eps, 0, (why, filt))
