"""Benchmark shapes and inputs, deterministic by seed (on ``device``'s generator, in float32, rounded
once to ``dtype``; every ``ignore_every``-th target is ``IGNORE_INDEX``). Data regimes:

- ``"random"``: e, c i.i.d. with variance 1/sqrt(D): logits ~ N(0, 1), a nearly uniform softmax.
- ``"zipf"`` (LM-like): ``c_v = g_v + log f_v u`` with ``log f`` a Zipf law (exponent 1.1) over
  permuted ids, ``u`` a unit vector, ``g_v`` random (norm ~1, orthogonal to u); targets drawn from
  f; ``e_i = u + 6.5 g_{t_i}``: ``logit_iv = log f_v + 6.5 g_{t_i}.g_v``, the target ~6.5 nats above
  its prior (mean loss ~2.0 nats at V = 256000).
- ``"real"`` / ``"init"``: hidden states and head of a small GPT trained in the run on the text of
  the installed packages, or untrained (bench/real.py).
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
MODEL_REGIMES = ("real", "init")  # bench/real.py
ALL_REGIMES = REGIMES + MODEL_REGIMES
ZIPF_EXPONENT = 1.1
ZIPF_TARGET_SCALE = 6.5  # scale of the target's own direction in e_i: its logit boost in nats
IGNORE_EVERY = 17
IGNORE_INDEX = -100
_GEN_ROWS = 16384  # rows of the (V, D) float32 temporaries generated at once
Inputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def parse_shape(spec: str) -> Shape:
    """A named shape (SHAPES) or ``NxDxV``."""
    if spec in SHAPES:
        return Shape(spec, *SHAPES[spec])
    parts = spec.lower().split("x")
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        raise ValueError(f"unknown shape {spec!r}: one of {sorted(SHAPES)} or NxDxV")
    return Shape(spec, *map(int, parts))


def _ignore(t: torch.Tensor, every: int) -> torch.Tensor:
    if every > 0:
        t[::every] = IGNORE_INDEX
    return t


def zipf_log_freq(V: int, *, generator: torch.Generator, device, exponent: float = ZIPF_EXPONENT):
    """log f_v (float32, [V]) of a normalized Zipf law over a random permutation of the ids."""
    ranks = torch.arange(1, V + 1, device=device, dtype=torch.float64)
    logf_by_rank = -exponent * torch.log(ranks)
    logf_by_rank = logf_by_rank - torch.logsumexp(logf_by_rank, 0)  # normalize: sum f = 1
    perm = torch.randperm(V, generator=generator, device=device)
    logf = torch.empty(V, device=device, dtype=torch.float64)
    logf[perm] = logf_by_rank
    return logf.float()


def random_inputs(
    N: int, D: int, V: int, *, dtype=torch.bfloat16, device="cpu", seed: int = 0, ignore_every=IGNORE_EVERY
) -> Inputs:
    """(e [N, D], c [V, D], targets [N] int64) of the "random" regime."""
    device = torch.device(device)
    g = torch.Generator(device=device).manual_seed(int(seed))
    std = D**-0.25  # variance 1/sqrt(D) for e and c: logits have variance D * (1/sqrt(D))^2 = 1
    e = (torch.randn(N, D, generator=g, device=device) * std).to(dtype)
    c = torch.empty(V, D, device=device, dtype=dtype)
    for s in range(0, V, _GEN_ROWS):
        rows = min(_GEN_ROWS, V - s)
        c[s : s + rows] = torch.randn(rows, D, generator=g, device=device) * std
    t = torch.randint(0, V, (N,), generator=g, device=device)
    return e, c, _ignore(t, ignore_every)


def zipf_inputs(
    N: int, D: int, V: int, *, dtype=torch.bfloat16, device="cpu", seed: int = 0, ignore_every=IGNORE_EVERY
) -> Inputs:
    """(e [N, D], c [V, D], targets [N] int64) of the "zipf" (LM-like) regime."""
    device = torch.device(device)
    g = torch.Generator(device=device).manual_seed(int(seed))
    logf = zipf_log_freq(V, generator=g, device=device)
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
        e32 += torch.where(hit[:, None], ZIPF_TARGET_SCALE * gv[idx], 0.0)
    return e32.to(dtype), c, _ignore(t, ignore_every)


def make_inputs(
    N, D, V, regime: str = "random", *, dtype=torch.bfloat16, device="cpu", seed=0, ignore_every=IGNORE_EVERY
) -> Inputs:
    """(e [N, D], c [V, D], targets [N]) of ``regime`` (one of ALL_REGIMES); no requires_grad set."""
    kw = dict(dtype=dtype, device=device, seed=seed, ignore_every=ignore_every)
    if regime == "random":
        return random_inputs(N, D, V, **kw)
    if regime == "zipf":
        return zipf_inputs(N, D, V, **kw)
    if regime in MODEL_REGIMES:
        from .real import real_inputs

        return real_inputs(N, D, V, trained=regime == "real", **kw)
    raise ValueError(f"unknown data regime {regime!r}; expected one of {ALL_REGIMES}")


def make_logits(
    N: int, D: int, V: int, regime="random", *, dtype=torch.bfloat16, device="cpu", seed=0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits [N, V], targets [N]) of ``regime``: ``e @ c.T`` of :func:`make_inputs`'s draws, taken
    in float32 and rounded once to ``dtype``, in row blocks (no N x V float32 buffer)."""
    e, c, t = make_inputs(N, D, V, regime, dtype=torch.float32, device=device, seed=seed)
    logits = torch.empty(N, V, device=e.device, dtype=dtype)
    block = max(1, (256 << 20) // (4 * V))
    for s in range(0, N, block):
        logits[s : s + block] = e[s : s + block] @ c.T
    return logits, t
