"""Benchmark inputs: the shapes and the data regimes of ../shared/BRIEF.md, deterministic by seed.

Regimes (bf16 by default; every ``ignore_every``-th target is ``ignore_index``, as in the measured
peer table):

- ``"random"``: e, c with i.i.d. entries of variance 1/sqrt(D), so the logits are ~ N(0, 1) and the
  softmax is nearly uniform; targets uniform. The easy case for gradient filtering.
- ``"zipf"`` (LM-like): unigram log-frequencies ``log f_v`` from a Zipf law (exponent 1.1) laid
  over a random permutation of the ids; one unit direction ``u``; ``g_v`` random, norm ~1,
  orthogonal to ``u``; ``c_v = g_v + log f_v * u``; targets drawn from ``f``;
  ``e_i = u + 6.5 * g_{t_i}``. Then ``logit_iv = log f_v + 6.5 g_{t_i}.g_v``: the target gets
  ~+6.5 over its prior, other entries follow the prior, and the frequent ids are scattered over
  the id range. Measured on 512 rows at V = 256000 (D = 512 and 2304): mean loss 2.0 nats
  (the expectation over t ~ f is 2.09; BRIEF.md quotes ~2.4), ~155 softmax entries per row
  above 2^-12 (BRIEF.md: ~200).

- ``"real"`` / ``"init"``: hidden states and head of a small GPT trained in the run on text of the
  installed packages, or untrained (bench/real.py).

Tensors are generated on ``device`` with a generator of that device seeded by ``seed``: the same
(seed, device type, shape) always gives the same tensors; CPU and CUDA streams differ. Generation
runs in float32 and rounds once to ``dtype``.
"""

from __future__ import annotations

import dataclasses
import math

import torch


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    N: int
    D: int
    V: int
    sweep: bool = False


# (N, D, V) of the benchmarked model heads.
SHAPES: dict[str, tuple[int, int, int]] = {
    "gemma2-2b": (8192, 2304, 256000),
    "llama3-8b": (8192, 4096, 128256),
    "qwen2.5-7b": (8192, 3584, 152064),
    "gpt2": (8192, 768, 50257),
}
# The N sweep runs at llama3-8b's (D, V).
SWEEP_BASE = "llama3-8b"
SWEEP_N: tuple[int, ...] = (1024, 2048, 4096, 8192, 16384, 32768, 65536)
REGIMES = ("random", "zipf")
# Regimes from a small GPT trained in the run on real text (bench/real.py), or left untrained.
MODEL_REGIMES = ("real", "init")
ALL_REGIMES = REGIMES + MODEL_REGIMES
ZIPF_EXPONENT = 1.1
# Scale of the target's own direction in e_i: sets the target's logit boost (~6.5 nats).
ZIPF_TARGET_SCALE = 6.5
IGNORE_EVERY = 17
IGNORE_INDEX = -100

# Rows of the (V, D) float32 temporaries generated at once, to bound the generation's peak memory.
_GEN_ROWS = 16384


def _generator(device: torch.device, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(int(seed))


def _ignore(t: torch.Tensor, every: int, ignore_index: int) -> torch.Tensor:
    if every > 0:
        t[::every] = ignore_index
    return t


def zipf_log_freq(
    V: int, *, generator: torch.Generator, device, exponent: float = ZIPF_EXPONENT
) -> torch.Tensor:
    """log f_v (float32, [V]) of a normalized Zipf law over a random permutation of the ids."""
    ranks = torch.arange(1, V + 1, device=device, dtype=torch.float64)
    logf_by_rank = -exponent * torch.log(ranks)
    logf_by_rank = logf_by_rank - torch.logsumexp(logf_by_rank, 0)  # normalize: sum f = 1
    perm = torch.randperm(V, generator=generator, device=device)
    logf = torch.empty(V, device=device, dtype=torch.float64)
    logf[perm] = logf_by_rank
    return logf.float()


def random_inputs(
    N: int,
    D: int,
    V: int,
    *,
    dtype: torch.dtype = torch.bfloat16,
    device="cpu",
    seed: int = 0,
    ignore_every: int = IGNORE_EVERY,
    ignore_index: int = IGNORE_INDEX,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e [N, D], c [V, D], targets [N] int64) of the "random" regime."""
    device = torch.device(device)
    g = _generator(device, seed)
    std = D**-0.25  # variance 1/sqrt(D) for e and c: logits have variance D * (1/sqrt(D))^2 = 1
    e = (torch.randn(N, D, generator=g, device=device) * std).to(dtype)
    c = torch.empty(V, D, device=device, dtype=dtype)
    for s in range(0, V, _GEN_ROWS):
        rows = min(_GEN_ROWS, V - s)
        c[s : s + rows] = torch.randn(rows, D, generator=g, device=device) * std
    t = torch.randint(0, V, (N,), generator=g, device=device)
    return e, c, _ignore(t, ignore_every, ignore_index)


def zipf_inputs(
    N: int,
    D: int,
    V: int,
    *,
    dtype: torch.dtype = torch.bfloat16,
    device="cpu",
    seed: int = 0,
    ignore_every: int = IGNORE_EVERY,
    ignore_index: int = IGNORE_INDEX,
    exponent: float = ZIPF_EXPONENT,
    target_scale: float = ZIPF_TARGET_SCALE,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e [N, D], c [V, D], targets [N] int64) of the "zipf" (LM-like) regime."""
    device = torch.device(device)
    g = _generator(device, seed)
    logf = zipf_log_freq(V, generator=g, device=device, exponent=exponent)
    u = torch.randn(D, generator=g, device=device)
    u = u / u.norm()
    t = torch.multinomial(logf.exp(), N, replacement=True, generator=g)
    c = torch.empty(V, D, device=device, dtype=dtype)
    e32 = u.expand(N, D).clone()
    # Token i's own direction g_{t_i} goes into e_i; the chunks visit each vocabulary row once.
    for s in range(0, V, _GEN_ROWS):
        rows = min(_GEN_ROWS, V - s)
        gv = torch.randn(rows, D, generator=g, device=device) / math.sqrt(D)  # norm ~1
        gv -= (gv @ u)[:, None] * u  # orthogonal to u
        c[s : s + rows] = gv + logf[s : s + rows, None] * u
        hit = (t >= s) & (t < s + rows)
        idx = torch.where(hit, t - s, 0)
        e32 += torch.where(hit[:, None], target_scale * gv[idx], 0.0)
    e = e32.to(dtype)
    return e, c, _ignore(t, ignore_every, ignore_index)


def make_inputs(
    N: int,
    D: int,
    V: int,
    regime: str = "random",
    *,
    dtype: torch.dtype = torch.bfloat16,
    device="cpu",
    seed: int = 0,
    ignore_every: int = IGNORE_EVERY,
    ignore_index: int = IGNORE_INDEX,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e [N, D], c [V, D], targets [N]) of ``regime`` (one of ALL_REGIMES); no requires_grad set."""
    kw = dict(dtype=dtype, device=device, seed=seed, ignore_every=ignore_every, ignore_index=ignore_index)
    if regime == "random":
        return random_inputs(N, D, V, **kw)
    if regime == "zipf":
        return zipf_inputs(N, D, V, **kw)
    if regime in MODEL_REGIMES:
        from .real import real_inputs

        return real_inputs(N, D, V, trained=regime == "real", **kw)
    raise ValueError(f"unknown data regime {regime!r}; expected one of {ALL_REGIMES}")


def make_logits(
    N: int,
    D: int,
    V: int,
    regime: str = "random",
    *,
    dtype: torch.dtype = torch.bfloat16,
    device="cpu",
    seed: int = 0,
    ignore_every: int = IGNORE_EVERY,
    ignore_index: int = IGNORE_INDEX,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits [N, V], targets [N]) of ``regime``: ``e @ c.T`` of :func:`make_inputs`'s inputs.

    e and c are generated in float32 (the same random draws as :func:`make_inputs`, unrounded), the
    product is taken in float32 and rounded once to ``dtype``, in row blocks (no N x V float32
    buffer beside the result).
    """
    e, c, t = make_inputs(
        N, D, V, regime, dtype=torch.float32, device=device, seed=seed,
        ignore_every=ignore_every, ignore_index=ignore_index,
    )  # fmt: skip
    logits = torch.empty(N, V, device=e.device, dtype=dtype)
    block = max(1, (256 << 20) // (4 * V))
    for s in range(0, N, block):
        logits[s : s + block] = e[s : s + block] @ c.T
    return logits, t
