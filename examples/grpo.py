"""A GRPO-style policy-gradient step on a patched Hugging Face model, without logits.

    python -m examples.grpo                 # CPU, seconds; no downloads

Builds a tiny Llama from a config (random weights), samples G completions per prompt at a
temperature, scores them with a toy reward (the share of even token ids), and takes a few steps of
the clipped GRPO objective with an entropy bonus. The per-token log-probabilities and entropies
come from :func:`cce.transformers.token_logprobs`: the model never forms its ``(B, T, V)`` logits.
The first step is checked against the same objective computed from materialized logits (loss and
every parameter's gradient); the script prints both.

Each batch of samples gets ``--updates`` optimizer steps (PPO-style epochs). At the first one the
policy is the one that sampled, so the ratio is 1 and the clipped term's value is the mean
group-normalized advantage, 0: that loss shows only the entropy bonus, -beta * mean entropy,
although its gradient is the full policy gradient. The later updates move the ratio away from 1
and their loss falls below it. Per step the script prints the mean reward, the sampled tokens'
mean log-probability and entropy (what the updates change), and the loss of every update.
"""

from __future__ import annotations

import argparse
import copy

import torch

import cce.transformers

IGNORE = -100


def build(vocab: int = 512, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=128, pad_token_id=0, bos_token_id=1,
        eos_token_id=2,
    )  # fmt: skip
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).float()


@torch.no_grad()
def sample(model, prompts: torch.Tensor, group: int, new: int, temperature: float, gen: torch.Generator):
    """(sequences [P G, Tp + new], labels with the prompt masked): G completions per prompt."""
    seq = prompts.repeat_interleave(group, 0)
    for _ in range(new):
        logits = model(input_ids=seq).logits[:, -1].float() / temperature
        nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)
        seq = torch.cat([seq, nxt], 1)
    labels = seq.clone()
    labels[:, : prompts.shape[1]] = IGNORE
    return seq, labels


def reward(seq: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """A toy reward: the share of even token ids in the completion."""
    return (seq[:, prompt_len:] % 2 == 0).float().mean(1)


def grpo_loss(logprobs, old_logprobs, advantages, entropy, mask, clip: float = 0.2, beta: float = 0.01):
    """Clipped GRPO objective per token (a group-normalized advantage per sequence), minus an
    entropy bonus, averaged over the completion tokens."""
    ratio = torch.exp(logprobs - old_logprobs)
    adv = advantages[:, None]
    obj = torch.minimum(ratio * adv, ratio.clamp(1 - clip, 1 + clip) * adv) + beta * entropy
    return -(obj * mask).sum() / mask.sum()


def materialized(model, seq, labels, temperature):
    """The same per-token log-probabilities and entropies from the model's logits (the check)."""
    logits = model(input_ids=seq).logits[:, :-1].float() / temperature
    logp = torch.log_softmax(logits, -1)
    tgt = labels[:, 1:]
    valid = tgt != IGNORE
    lp = logp.gather(-1, tgt.clamp(min=0)[..., None]).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    return torch.where(valid, lp, 0.0), torch.where(valid, ent, 0.0)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--updates", type=int, default=2, help="optimizer steps per batch of samples")
    args = ap.parse_args(argv)

    ref = build()
    policy = cce.transformers.patch(copy.deepcopy(ref), impl="torch")
    opt = torch.optim.AdamW(policy.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 512, (2, 6), generator=gen)
    log = {"rewards": [], "check": None, "losses": [], "logprobs": []}
    for step in range(args.steps):
        seq, labels = sample(policy, prompts, args.group, 10, args.temperature, gen)
        r = reward(seq, prompts.shape[1]).view(-1, args.group)
        adv = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)).view(-1)
        mask = (labels[:, 1:] != IGNORE).float()
        losses, old = [], None
        for update in range(args.updates):
            out = cce.transformers.token_logprobs(
                policy, seq, labels=labels, temperature=args.temperature, entropy=True
            )
            if old is None:  # the policy that sampled: the ratio's denominator for every update
                old = out.logprobs.detach()
                mean_lp = float((old * mask).sum() / mask.sum())
                mean_ent = float((out.entropy.detach() * mask).sum() / mask.sum())
            loss = grpo_loss(out.logprobs, old, adv, out.entropy, mask)
            opt.zero_grad()
            loss.backward()
            if step == 0 and update == 0:
                log["check"] = check(ref, seq, labels, args.temperature, adv, mask, loss, policy)
            opt.step()
            losses.append(float(loss.detach()))
        log["rewards"].append(float(r.mean()))
        log["losses"].append(losses)
        log["logprobs"].append(mean_lp)
        print(
            f"step {step}: mean reward {float(r.mean()):.3f}, sampled tokens' mean log-prob {mean_lp:.4f}, "
            f"entropy {mean_ent:.4f}, loss per update " + ", ".join(f"{x:.4f}" for x in losses)
        )
    return log


def check(ref, seq, labels, temperature, adv, mask, loss, policy) -> tuple[float, float, float]:
    """The first update from materialized logits on an unpatched copy: (cce loss, materialized loss,
    largest relative difference of a parameter's gradient), printed."""
    lp, ent = materialized(ref, seq, labels, temperature)
    ref_loss = grpo_loss(lp, lp.detach(), adv, ent, mask)
    ref.zero_grad()
    ref_loss.backward()
    worst = max(
        float((p.grad - q.grad).norm() / q.grad.norm().clamp(min=1e-30))
        for p, q in zip(policy.parameters(), ref.parameters(), strict=True)
        if q.grad is not None
    )
    out = (float(loss.detach()), float(ref_loss.detach()), worst)
    print(
        f"step 0: cce loss {out[0]:.6f}, materialized {out[1]:.6f}, "
        f"largest relative gradient difference {worst:.2e}"
    )
    return out


if __name__ == "__main__":
    main()
