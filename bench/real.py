"""The ``real`` and ``init`` data regimes: final hidden states and output layer of a small GPT.

Synthetic regimes put every row's probable tokens in the same place (zipf: the globally
frequent ones; random: nowhere). Hidden states of a model trained on real text have
context-specific probable tokens, and an untrained model's softmax is near-uniform. So, inside
the benchmark run:

1. text: source code and documentation shipped with the installed Python packages (``.py``,
   ``.md``, ``.rst``, ``.txt`` under site-packages, in sorted path order), up to
   ``CORPUS_BYTES``; no download;
2. a byte-level BPE tokenizer (the ``tokenizers`` package) learned on it with ``V`` entries (the
   classifier has exactly V rows; merges the text cannot support leave rows that no target uses,
   as in real vocabularies);
3. a GPT of width D (pre-norm transformer blocks, learned positions, untied head) trained for
   ``steps`` steps on 95% of the token stream with cce's own loss, AdamW, bf16 autocast
   (``real``), or left at its initialisation (``init``);
4. the measurement rows: the final (normed) hidden states of N held-out tokens and their next
   tokens as targets, the head's weight as the classifier, in ``dtype``; every
   ``ignore_every``-th target ignored as in the other regimes.

Deterministic for a seed on one device (up to the nondeterminism of GPU training kernels). One
model per (D, V, seed, steps) per process: the matrix reuses it for every N.
"""

from __future__ import annotations

import math
import site
import sys
from functools import lru_cache
from pathlib import Path

import torch
from torch import nn

CORPUS_BYTES = 64 << 20
SEQ = 256
HELD_OUT = 0.05


def corpus(max_bytes: int = CORPUS_BYTES) -> list[str]:
    """Texts of installed packages (site-packages), sorted by path, at most max_bytes in all."""
    roots = [Path(p) for p in site.getsitepackages() + [site.getusersitepackages()] if Path(p).is_dir()]
    roots += [Path(p) for p in sys.path if p.endswith("site-packages") and Path(p).is_dir()]
    files = sorted({f for r in roots for ext in ("py", "md", "rst", "txt") for f in r.rglob(f"*.{ext}")})
    texts, total = [], 0
    for f in files:
        try:
            s = f.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        texts.append(s)
        total += len(s)
        if total >= max_bytes:
            break
    if not texts:
        raise RuntimeError("no text found under site-packages for the real data regime")
    return texts


@lru_cache(maxsize=4)
def tokenized(V: int, max_bytes: int = CORPUS_BYTES) -> torch.Tensor:
    """The corpus as one int64 stream of BPE ids (< V), the tokenizer learned on it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    texts = corpus(max_bytes)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=V, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(texts, trainer=trainer)
    ids = [i for enc in tok.encode_batch(texts) for i in enc.ids]
    return torch.tensor(ids, dtype=torch.int64)


class Block(nn.Module):
    def __init__(self, D: int, heads: int) -> None:
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.mlp = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        q, k, v = self.qkv(self.n1(x)).view(B, T, 3, self.heads, D // self.heads).unbind(2)
        a = nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(a.transpose(1, 2).reshape(B, T, D))
        return x + self.mlp(self.n2(x))


class TinyGPT(nn.Module):
    """Token and position embeddings, ``layers`` blocks, a final norm and an untied head."""

    def __init__(self, V: int, D: int, layers: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(V, D), nn.Embedding(SEQ, D)
        self.blocks = nn.ModuleList(Block(D, max(1, D // 128)) for _ in range(layers))
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, V, bias=False)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def hidden(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for b in self.blocks:
            x = b(x)
        return self.norm(x)


def _layers(D: int) -> int:
    # Depth for a few hundred steps within a benchmark run: shallower as D grows.
    return 6 if D <= 1024 else 4 if D <= 2304 else 2


def _batch(D: int) -> int:
    # Sequences per training step. Past D = 4096 (llama3-70b's 8192: 3.7e9 parameters even at
    # two blocks) a quarter of them: 300 steps of 64 x 256 tokens took over 200 s there and
    # AdamW's state with the activations of 16384 tokens filled most of an 80 GB GPU.
    return 64 if D <= 4096 else 16


def trained_model(
    D: int, V: int, steps: int, seed: int, device: str, corpus_bytes: int = CORPUS_BYTES
) -> tuple[TinyGPT, torch.Tensor]:
    """(model, held-out ids): a TinyGPT of width D over the BPE stream of vocabulary V, trained
    for ``steps`` AdamW steps (batch _batch(D) x 256 tokens) with cce's loss; steps 0 leaves it at init.

    Only trained models are cached, one at a time (training is what costs; an untrained one is
    rebuilt from its seed): at D = 8192 a model holds ~15 GB of fp32 weights, and AdamW's training
    needs four times that, so a second cached model left no room for it on an 80 GB GPU."""
    if steps <= 0:
        return _build(D, V, 0, seed, device, corpus_bytes)
    return _trained(D, V, steps, seed, device, corpus_bytes)


@lru_cache(maxsize=1)
def _trained(
    D: int, V: int, steps: int, seed: int, device: str, corpus_bytes: int
) -> tuple[TinyGPT, torch.Tensor]:
    _trained.cache_clear()  # the previous model goes before this one is built
    return _build(D, V, steps, seed, device, corpus_bytes)


def _build(
    D: int, V: int, steps: int, seed: int, device: str, corpus_bytes: int
) -> tuple[TinyGPT, torch.Tensor]:
    import cce

    ids = tokenized(V, corpus_bytes)
    split = int(len(ids) * (1 - HELD_OUT))
    train, held = ids[:split], ids[split:]
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    # Built on the device: at D = 8192 the CPU took tens of seconds to initialise its 3.7e9
    # parameters, once per cell of the init regime. (The device's generator draws them, so
    # they differ from a CPU build of the same seed.)
    with torch.device(device):
        model = TinyGPT(V, D, _layers(D))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3 * min(1.0, 768 / D), weight_decay=0.1)
    dev = torch.device(device)
    warmup = max(1, min(50, steps // 10))
    for step in range(steps):
        lr_scale = min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * step / steps))
        for group in opt.param_groups:
            group["lr"] = 1e-3 * min(1.0, 768 / D) * lr_scale
        starts = torch.randint(0, len(train) - SEQ - 1, (_batch(D),), generator=g)
        chunk = torch.stack([train[s : s + SEQ + 1] for s in starts.tolist()]).to(dev)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            h = model.hidden(chunk[:, :-1])
            loss = cce.linear_cross_entropy(h, model.head.weight, chunk[:, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    # The last step's gradients and AdamW's state are not needed to read hidden states.
    del opt
    model.zero_grad(set_to_none=True)
    return model.eval(), held


def real_inputs(
    N: int,
    D: int,
    V: int,
    *,
    trained: bool = True,
    steps: int = 300,
    corpus_bytes: int = CORPUS_BYTES,
    dtype: torch.dtype = torch.bfloat16,
    device="cpu",
    seed: int = 0,
    ignore_every: int = 17,
    ignore_index: int = -100,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e [N, D], c [V, D], targets [N]) from the held-out text: the ``real`` regime, or the
    ``init`` one with ``trained=False``."""
    dev = str(torch.device(device))
    model, held = trained_model(D, V, steps if trained else 0, seed, dev, corpus_bytes)
    n_seq = -(-N // SEQ)
    need = n_seq * (SEQ + 1)
    reps = -(-need // len(held))
    stream = held.repeat(reps)[:need].view(n_seq, SEQ + 1).to(dev)
    with torch.no_grad():
        e = torch.cat([model.hidden(stream[i : i + 16, :-1]).reshape(-1, D) for i in range(0, n_seq, 16)])
    t = stream[:, 1:].reshape(-1)
    e, t = e[:N].to(dtype).contiguous(), t[:N].clone()
    if ignore_every > 0:
        t[::ignore_every] = ignore_index
    return e, model.head.weight.detach().to(dtype).contiguous(), t
