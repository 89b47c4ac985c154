"""TRL's trainers on a patched model: cce serves TRL's fused LM head (cce/trl.py), patched before or
after the trainer is built, and the logged losses, gradient norms and trained weights match
stock TRL in fp32.

Tiny config-built Llama models and a word-level tokenizer built in memory (no downloads), three
optimizer steps per run on CPU. The tolerance, 1e-5 on the logged losses and gradient norms: the
fp32 log-probabilities of cce and TRL's tiled kernel differ by a few fp32 ulps of the logits
(about 5e-7 here, both against an fp64 reference), and three steps of Adam at lr 1e-2 keep the
runs within a few times that.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
tokenizers = pytest.importorskip("tokenizers")

import trl  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: E402
from trl.trainer.utils import add_fused_lm_head  # noqa: E402

import cce.transformers as ct  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore")

WORDS = [f"w{i}" for i in range(40)]
VOCAB = {"[PAD]": 0, "[EOS]": 1, "[UNK]": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
STEPS = 3
TOL = 1e-5


def _tokenizer() -> PreTrainedTokenizerFast:
    tk = tokenizers.Tokenizer(tokenizers.models.WordLevel(VOCAB, unk_token="[UNK]"))
    tk.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk, pad_token="[PAD]", eos_token="[EOS]", unk_token="[UNK]"
    )
    return tok


def _model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(VOCAB), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
        eos_token_id=1, bos_token_id=1,
    )  # fmt: skip
    return LlamaForCausalLM(cfg).float()


def _sentences(n: int, length: int, seed: int) -> list[str]:
    g = torch.Generator().manual_seed(seed)
    return [
        " ".join(WORDS[j] for j in torch.randint(0, len(WORDS), (length,), generator=g)) for _ in range(n)
    ]


def _reward(completions, **kwargs) -> list[float]:
    return [float(len(c)) / 10 for c in completions]


def _common() -> dict:
    return dict(
        output_dir="/tmp/cce_trl_test", max_steps=STEPS, logging_steps=1, report_to=[], use_cpu=True,
        save_strategy="no", learning_rate=1e-2, seed=0, bf16=False, disable_tqdm=True,
        dataloader_num_workers=0,
    )  # fmt: skip


def _trainer(kind: str, model, ref, tok, peft_config=None):
    """The trainer of ``kind``; DPO and KTO get ``ref`` as their reference model, RLOO builds its own
    from the model's path (GRPO's default beta 0 needs none); SFT takes ``peft_config``."""
    ds = datasets.Dataset.from_dict
    if kind == "sft":
        args = trl.SFTConfig(per_device_train_batch_size=4, **_common())
        data = ds({"text": _sentences(8, 8, 1)})
        torch.manual_seed(2)  # the adapters' initialization, with peft_config
        return trl.SFTTrainer(
            model=model, args=args, train_dataset=data, processing_class=tok, peft_config=peft_config
        )
    if kind == "dpo":
        args = trl.DPOConfig(per_device_train_batch_size=2, **_common())
        data = ds(
            {"prompt": _sentences(4, 3, 2), "chosen": _sentences(4, 4, 3), "rejected": _sentences(4, 4, 4)}
        )
        return trl.DPOTrainer(model=model, ref_model=ref, args=args, train_dataset=data, processing_class=tok)
    if kind == "kto":
        args = trl.KTOConfig(per_device_train_batch_size=4, **_common())
        data = ds(
            {"prompt": _sentences(8, 3, 5), "completion": _sentences(8, 4, 6), "label": [True, False] * 4}
        )
        return trl.KTOTrainer(model=model, ref_model=ref, args=args, train_dataset=data, processing_class=tok)
    gen = dict(
        per_device_train_batch_size=4, num_generations=4, max_completion_length=6, temperature=0.7,
        **_common(),
    )  # fmt: skip
    data = ds({"prompt": _sentences(8, 3, 7)})
    trainer, config = (
        (trl.GRPOTrainer, trl.GRPOConfig) if kind == "grpo" else (trl.RLOOTrainer, trl.RLOOConfig)
    )
    return trainer(
        model=model, reward_funcs=_reward, args=config(**gen), train_dataset=data, processing_class=tok
    )


class _CountingHead:
    """TRL's tiled kernel, counting its calls (TRL's fused head looks it up at every call)."""

    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def apply(self, *args):
        self.calls += 1
        return self.fn.apply(*args)


def _run(kind: str, order: str | None, monkeypatch, path, peft_config=None):
    """(logged losses, logged gradient norms, trained lm_head weight) of STEPS steps; ``order``: None
    (stock TRL), "before" (patch, then build the trainer) or "after" (build, then patch: with
    ``peft_config`` the PEFT model the trainer holds). A reference model the trainer built itself
    (RLOO) is patched once built. Asserts that TRL's own kernel ran in the stock run and never in
    the patched ones."""
    tok = _tokenizer()
    model, ref = _model(), _model()
    model.save_pretrained(path)
    model.config._name_or_path = str(path)  # where RLOO builds its reference model from
    counter = _CountingHead(trl.trainer.utils._ChunkedLogProbFunction)
    with monkeypatch.context() as m:
        m.setattr(trl.trainer.utils, "_ChunkedLogProbFunction", counter)
        if order == "before":
            ct.patch(model)
            ct.patch(ref)
        tr = _trainer(kind, model, ref, tok, peft_config)
        if order == "after":
            ct.patch(model if peft_config is None else tr.model)
            ct.patch(ref)
        if (
            order is not None
            and getattr(tr, "ref_model", None) is not None
            and not ct.is_patched(tr.ref_model)
        ):
            ct.patch(tr.ref_model)
        tr.train()
    assert (counter.calls > 0) == (order is None), (order, counter.calls)
    logs = [h for h in tr.state.log_history if "loss" in h]
    assert len(logs) == STEPS
    return [h["loss"] for h in logs], [h["grad_norm"] for h in logs], model.lm_head.weight.detach().clone()


KINDS = ["sft", "dpo", "kto", "grpo", "rloo"]


@pytest.mark.parametrize("kind", KINDS)
def test_trainers_match_stock_trl(kind, monkeypatch, tmp_path):
    loss0, gn0, w0 = _run(kind, None, monkeypatch, tmp_path)
    for order in ("before", "after"):
        loss, gn, w = _run(kind, order, monkeypatch, tmp_path)
        assert loss == pytest.approx(loss0, abs=TOL, rel=TOL), (order, loss, loss0)
        assert gn == pytest.approx(gn0, abs=TOL, rel=TOL), (order, gn, gn0)
        torch.testing.assert_close(w, w0, atol=TOL, rtol=TOL)


@pytest.mark.parametrize("order", ["before", "after"])
def test_sft_with_peft_matches_stock_trl(order, monkeypatch, tmp_path):
    """TRL wraps the model with PEFT (LoRA on the attention) from ``peft_config``: patching the model
    before, or the PEFT model the trainer holds after, serves TRL's head with cce."""
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    loss0 = _run("sft", None, monkeypatch, tmp_path, config)[0]
    assert _run("sft", order, monkeypatch, tmp_path, config)[0] == pytest.approx(loss0, abs=TOL, rel=TOL)


FUSED_OUTPUTS = ("log_probs", "entropy", "is_top1", "mean_logits", "log_sum_sq_probs")


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("order", ["before", "after"])
def test_fused_head_fields_and_gradients(order, temperature):
    """Every field of TRL's FusedCausalLMOutput, and the gradients of a GRPO-like objective through
    log_probs and entropy, as TRL's own head computes them, with random upstream weights."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, len(VOCAB), (2, 9), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100
    adv = torch.randn(2, 8, generator=g)

    def step(model):
        out = model(input_ids=ids, labels=labels, fused_lm_head=True)
        j = (out.log_probs * adv).sum() + 0.1 * (out.entropy * adv.flip(0)).sum() + out.loss
        j.backward()
        return out, {n: p.grad.clone() for n, p in model.named_parameters()}

    stock = _model()
    add_fused_lm_head(stock, temperature=temperature, outputs=FUSED_OUTPUTS)
    ref, ref_grads = step(stock)
    model = _model()
    if order == "before":
        ct.patch(model)
    add_fused_lm_head(model, temperature=temperature, outputs=FUSED_OUTPUTS)
    if order == "after":
        ct.patch(model)
    out, grads = step(model)
    for k in (*FUSED_OUTPUTS, "loss", "label_mask"):
        a, b = getattr(out, k), getattr(ref, k)
        assert a.dtype == b.dtype and a.shape == b.shape, k
        torch.testing.assert_close(a, b, atol=2e-6, rtol=1e-5, msg=k)
    for n, gr in ref_grads.items():
        torch.testing.assert_close(grads[n], gr, atol=1e-6, rtol=1e-5, msg=n)


def test_unpatch_gives_trl_its_head_back():
    model = _model()
    ct.patch(model)
    add_fused_lm_head(model, temperature=0.5, outputs=("log_probs",))
    assert "forward" in model.__dict__ and type(model).__name__ == "LlamaForCausalLM"
    ct.unpatch(model)
    assert type(model) is LlamaForCausalLM
    ids = torch.randint(3, len(VOCAB), (1, 5))
    out = model(input_ids=ids, labels=ids, fused_lm_head=True)  # TRL's own head again
    assert out.log_probs.shape == (1, 4)


def test_deepcopy_and_plain_calls_unchanged():
    """A patched model under TRL's head still generates and computes logits as before, and a deep
    copy (TRL's reference model) keeps serving the fused head with cce."""
    model = _model()
    ct.patch(model)
    add_fused_lm_head(model, outputs=("log_probs",))
    ref = copy.deepcopy(model)
    ids = torch.randint(3, len(VOCAB), (1, 6))
    logits = model(input_ids=ids).logits
    torch.testing.assert_close(logits, LlamaForCausalLM.forward(model, input_ids=ids).logits)
    a = model(input_ids=ids, labels=ids, fused_lm_head=True).log_probs
    b = ref(input_ids=ids, labels=ids, fused_lm_head=True).log_probs
    torch.testing.assert_close(a, b)
    assert ct.is_patched(ref)


def test_fused_call_without_trl_head_is_refused():
    model = ct.patch(_model())
    ids = torch.randint(3, len(VOCAB), (1, 5))
    with pytest.raises(ValueError, match="no TRL fused LM head"):
        model(input_ids=ids, labels=ids, fused_lm_head=True)
