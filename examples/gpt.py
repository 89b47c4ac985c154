"""A small GPT in plain PyTorch whose training loss is cce.LinearCrossEntropy.

    model = GPT(GPTConfig(vocab_size=32768), loss="cce")
    loss = model(ids, labels=ids)        # next-token loss; the (N, V) logits are never built
    logits = model(ids)                  # without labels: logits, as usual (generation, eval)

``loss="torch"`` gives the standard ``lm_head`` + ``F.cross_entropy`` path on the same parameters,
which is what examples/demo.py compares against. The loss module holds no parameters, so both
variants built from the same seed start from identical weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import cce


@dataclass
class GPTConfig:
    vocab_size: int
    seq_len: int = 128
    d_model: int = 128
    n_layer: int = 2
    n_head: int = 4
    tie_embeddings: bool = True


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, 4 * cfg.d_model), nn.GELU(), nn.Linear(4 * cfg.d_model, cfg.d_model)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(D, dim=-1)
        q, k, v = (t.view(B, T, self.n_head, D // self.n_head).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(B, T, D))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Decoder-only transformer; ``loss`` is "cce" (fused) or "torch" (lm_head + F.cross_entropy)."""

    def __init__(self, cfg: GPTConfig, loss: str = "cce", **cce_options) -> None:
        super().__init__()
        if loss not in ("cce", "torch"):
            raise ValueError(f"loss must be 'cce' or 'torch', got {loss!r}")
        self.cfg, self.loss_kind = cfg, loss
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok.weight
        # Next-token loss on unshifted labels: shift=True reads hidden[:, :-1] without a copy.
        self.cce_loss = cce.LinearCrossEntropy(shift=True, **cce_options)
        self.apply(self._init)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def hidden(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(T, device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        return self.ln_f(x)

    def forward(self, idx: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``(B, T, V)`` without labels; the mean next-token loss (fp32 scalar) with them."""
        h = self.hidden(idx)
        if labels is None:
            return self.lm_head(h)
        if self.loss_kind == "torch":
            logits = self.lm_head(h)
            return F.cross_entropy(
                logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100
            )
        w = self.lm_head.weight
        dev = h.device.type
        if torch.is_autocast_enabled(dev):
            # What autocast does to the lm_head matmul of the torch path: both operands in its dtype.
            dt = torch.get_autocast_dtype(dev)
            h, w = h.to(dt), w.to(dt)
        with torch.autocast(dev, enabled=False):
            return self.cce_loss(h, w, labels)
