"""Hugging Face ``Trainer`` with ``cce.transformers.patch``: one line, same training, no logits.

    python -m examples.hf_trainer            # CPU, about a minute; no downloads

Builds a tiny Llama from a config (random weights), a word-level dataset from a few files of the
Python standard library (variable-length, padded, prompt tokens masked with -100), and trains it
with the stock ``Trainer`` twice from the same seed: unpatched, then patched. Gradient accumulation
is on, so the Trainer passes ``num_items_in_batch`` to the model; the patched model must normalize
by it exactly as the unpatched one does. Prints both loss logs side by side.
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
import sysconfig
import tempfile
from pathlib import Path

import torch

import cce.transformers

_TOKEN = re.compile(r"\w+|[^\w\s]")
FILES = ("textwrap.py", "shlex.py", "fnmatch.py", "glob.py", "bisect.py", "heapq.py", "calendar.py")


def make_dataset(vocab: int, n_seq: int, max_len: int, seed: int = 0) -> list[dict]:
    """Variable-length word sequences; the first quarter of each is a 'prompt' masked from the loss."""
    root = Path(sysconfig.get_paths()["stdlib"])
    words = [w for f in FILES if (root / f).exists() for w in _TOKEN.findall((root / f).read_text())]
    top = [w for w, _ in collections.Counter(words).most_common(vocab - 3)]
    stoi = {w: i + 3 for i, w in enumerate(top)}  # 0 pad, 1 bos, 2 unk
    ids = [stoi.get(w, 2) for w in words]
    g = torch.Generator().manual_seed(seed)
    data = []
    for _ in range(n_seq):
        n = int(torch.randint(max_len // 2, max_len, (1,), generator=g))
        s = int(torch.randint(0, len(ids) - n, (1,), generator=g))
        x = [1] + ids[s : s + n - 1]
        labels = list(x)
        labels[: n // 4] = [-100] * (n // 4)
        data.append({"input_ids": x, "labels": labels})
    return data


def collate(batch: list[dict]) -> dict:
    T = max(len(b["input_ids"]) for b in batch)
    ids = torch.zeros(len(batch), T, dtype=torch.long)
    labels = torch.full((len(batch), T), -100, dtype=torch.long)
    mask = torch.zeros(len(batch), T, dtype=torch.long)
    for i, b in enumerate(batch):
        n = len(b["input_ids"])
        ids[i, :n] = torch.tensor(b["input_ids"])
        labels[i, :n] = torch.tensor(b["labels"])
        mask[i, :n] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def tiny_llama(vocab: int, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg)


def train(
    patched: bool, *, steps: int = 20, vocab: int = 4096, grad_accum: int = 2, seed: int = 0, **cce_options
):
    """Trains the tiny model with the Trainer; returns (per-step training losses, model)."""
    from transformers import Trainer, TrainingArguments

    model = tiny_llama(vocab, seed)
    if patched:
        cce.transformers.patch(model, **cce_options)  # <- the one line
    data = make_dataset(vocab, n_seq=steps * grad_accum * 4, max_len=96, seed=seed)
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out, per_device_train_batch_size=4, gradient_accumulation_steps=grad_accum,
            max_steps=steps, learning_rate=3e-3, lr_scheduler_type="constant", logging_steps=1,
            save_strategy="no", report_to="none", use_cpu=True, seed=seed, data_seed=seed,
            disable_tqdm=True, dataloader_num_workers=0,
        )  # fmt: skip
        trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=collate)
        trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return losses, model


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--impl", default="auto")
    args = p.parse_args(argv)
    a, _ = train(False, steps=args.steps)
    b, model = train(True, steps=args.steps, impl=args.impl)
    print(f"{'step':>5} {'unpatched':>10} {'patched (cce)':>14} {'|diff|':>9}")
    for i, (x, y) in enumerate(zip(a, b, strict=True), 1):
        print(f"{i:>5} {x:>10.4f} {y:>14.4f} {abs(x - y):>9.1e}")
    # Without labels the patched model is the ordinary model: generation works as before.
    model.eval()
    out = model.generate(torch.tensor([[1, 5, 6, 7]]), max_new_tokens=5, do_sample=False)
    print("generate() without labels still works:", out.tolist())
    return 0


if __name__ == "__main__":
    sys.exit(main())
