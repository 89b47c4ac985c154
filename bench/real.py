"""The ``real`` and ``init`` data regimes: final hidden states and output layer of a small GPT, whose
probable tokens depend on the context (a trained model) or hardly at all (an untrained one).

Inside the run, without downloads: the ``.py``, ``.md``, ``.rst``, ``.txt`` files under
site-packages (sorted, up to ``CORPUS_BYTES``); a byte-level BPE of ``V`` entries learned on them; a
GPT of width D trained ``steps`` steps on 95% of the tokens with cce's loss (``real``) or left at
init (``init``); the rows: hidden states of N held-out tokens, their next tokens as targets, the
head's weight as the classifier.
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


_LAST: dict = {}  # the last trained model, by its arguments


def trained_model(D: int, V: int, steps: int, seed: int, device: str, corpus_bytes: int = CORPUS_BYTES):
    """(model, held-out ids): a TinyGPT of width D over the BPE stream of vocabulary V, trained for
    ``steps`` AdamW steps with cce's loss (0: at init). Only the last trained model is cached: two
    large ones would not fit on the GPU beside the training of the next."""
    key = (D, V, steps, seed, device, corpus_bytes)
    if steps <= 0:
        return _build(*key)
    if key not in _LAST:
        _LAST.clear()  # the previous model goes before this one is built
        _LAST[key] = _build(*key)
    return _LAST[key]


def _build(D: int, V: int, steps: int, seed: int, device: str, corpus_bytes: int):
    import cce

    ids = tokenized(V, corpus_bytes)
    split = int(len(ids) * (1 - HELD_OUT))
    train, held = ids[:split], ids[split:]
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    with torch.device(device):
        model = TinyGPT(V, D, layers=6 if D <= 1024 else 4 if D <= 2304 else 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3 * min(1.0, 768 / D), weight_decay=0.1)
    dev = torch.device(device)
    warmup = max(1, min(50, steps // 10))
    batch = 64 if D <= 4096 else 16  # sequences per step: fewer where AdamW's state is large
    for step in range(steps):
        lr_scale = min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * step / steps))
        for group in opt.param_groups:
            group["lr"] = 1e-3 * min(1.0, 768 / D) * lr_scale
        starts = torch.randint(0, len(train) - SEQ - 1, (batch,), generator=g)
        chunk = torch.stack([train[s : s + SEQ + 1] for s in starts.tolist()]).to(dev)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            h = model.hidden(chunk[:, :-1])
            loss = cce.linear_cross_entropy(h, model.head.weight, chunk[:, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    model.zero_grad(set_to_none=True)
    return model.eval(), held


def real_inputs(N: int, D: int, V: int, *, trained=True, steps=300, corpus_bytes=CORPUS_BYTES,
                dtype=torch.bfloat16, device="cpu", seed=0, ignore_every=17):  # fmt: skip
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
        t[::ignore_every] = -100
    return e, model.head.weight.detach().to(dtype).contiguous(), t
