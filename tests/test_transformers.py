"""cce.transformers.patch on tiny random-initialized models of each supported family (no downloads).

Every comparison is against the same model unpatched (a deep copy with identical weights), in fp32,
with impl="torch". The two sides differ only in the order of fp32 reductions (logits, softmax,
gradient matmuls), which measures ~1e-7 relative here; TOL = 2e-5 leaves a wide margin while a
dropped output transform (softcap, logit scale) or a wrong shift changes the loss by > 1e-2.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

import cce.transformers as cce_hf  # noqa: E402
from tests.helpers import rel_err  # noqa: E402

V = 384
TOL = 2e-5

_COMMON = dict(
    vocab_size=V,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=64,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
# family -> (config class, model class, extra config). A larger init for the families with an output
# transform makes the logits big enough (std ~2-4) for the softcap / scale to change the loss a lot.
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 8}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {}),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        {"final_logit_softcapping": 2.0, "sliding_window": 8, "initializer_range": 0.3},
    ),
    "gemma3_text": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {"final_logit_softcapping": 2.0, "sliding_window": 8, "initializer_range": 0.3},
    ),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),
    "granite": ("GraniteConfig", "GraniteForCausalLM", {"logits_scaling": 0.25, "initializer_range": 0.1}),
    "cohere": ("CohereConfig", "CohereForCausalLM", {"logit_scale": 4.0, "initializer_range": 0.1}),
    "cohere2": (
        "Cohere2Config",
        "Cohere2ForCausalLM",
        {"logit_scale": 4.0, "initializer_range": 0.1, "sliding_window": 8},
    ),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    # Mixture of experts: the router's load-balancing loss is added to the labelled loss.
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        {
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "output_router_logits": True,
            "router_aux_loss_coef": 0.5,
        },
    ),
}
TRANSFORMED = ("gemma2", "gemma3_text", "granite", "cohere", "cohere2")


def build(family: str, seed: int = 0):
    cfg_name, model_name, extra = FAMILIES[family]
    cfg_cls = getattr(transformers, cfg_name, None)
    model_cls = getattr(transformers, model_name, None)
    if cfg_cls is None or model_cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no {model_name}")
    cfg = cfg_cls(**{**_COMMON, **extra})
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    return model_cls(cfg).float().eval()


def batch(seed: int = 0, B: int = 2, T: int = 12):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, V, (B, T), generator=g)
    labels = ids.clone()
    labels[0, :4] = -100  # a masked prompt
    labels[1, torch.rand(T, generator=g) < 0.2] = -100
    return ids, labels


def grads(model):
    return {n: p.grad for n, p in model.named_parameters()}


def assert_grads_close(got: dict, ref: dict):
    assert got.keys() == ref.keys()
    for name in ref:
        g, r = got[name], ref[name]
        assert (g is None) == (r is None), name
        if r is not None:
            assert rel_err(g, r) < TOL, (name, rel_err(g, r))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_loss_grads_and_outputs_match_unpatched(family):
    ref = build(family)
    model = cce_hf.patch(copy.deepcopy(ref), impl="torch")
    ids, labels = batch()

    out = model(input_ids=ids, labels=labels)
    exp = ref(input_ids=ids, labels=labels)
    assert out.logits is None
    assert exp.logits is not None
    assert abs(out.loss.item() - exp.loss.item()) <= TOL * abs(exp.loss.item())
    out.loss.backward()
    exp.loss.backward()
    assert_grads_close(grads(model), grads(ref))

    if family in TRANSFORMED:
        # The family's transform must matter for these inputs, or the comparison above proves nothing.
        with torch.no_grad():
            raw = ref.lm_head(ref.model(input_ids=ids).last_hidden_state)
            plain = F.cross_entropy(raw[:, :-1].reshape(-1, V), labels[:, 1:].reshape(-1))
        assert abs(plain.item() - exp.loss.item()) > 1e-2

    # Without labels the patched model is the model: same logits, bit for bit.
    with torch.no_grad():
        a = model(input_ids=ids).logits
        b = ref(input_ids=ids).logits
    assert torch.equal(a, b)


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_num_items_in_batch(family):
    ref = build(family)
    model = cce_hf.patch(copy.deepcopy(ref), impl="torch")
    ids, labels = batch(1)
    n = torch.tensor(37)  # as the Trainer passes it: valid tokens over all accumulated micro-batches
    out = model(input_ids=ids, labels=labels, num_items_in_batch=n)
    exp = ref(input_ids=ids, labels=labels, num_items_in_batch=n)
    assert abs(out.loss.item() - exp.loss.item()) <= TOL * abs(exp.loss.item())
    out.loss.backward()
    exp.loss.backward()
    assert_grads_close(grads(model), grads(ref))


def test_return_dict_false_and_positional_labels():
    ref = build("llama")
    model = cce_hf.patch(copy.deepcopy(ref), impl="torch")
    ids, labels = batch(2)
    exp = ref(input_ids=ids, labels=labels).loss
    tup = model(ids, None, None, None, None, labels, return_dict=False)
    assert isinstance(tup, tuple)
    assert abs(tup[0].item() - exp.item()) <= TOL * exp.item()
    assert not any(t is not None and t.dim() == 3 and t.shape[-1] == V for t in tup if torch.is_tensor(t))


def _manual_loss(ref, ids, labels, **kw):
    with torch.no_grad():
        logits = ref(input_ids=ids).logits.float()
    z = logits[:, :-1].reshape(-1, V)
    t = labels[:, 1:].reshape(-1)
    ignore = kw.get("ignore_index", -100)
    loss = F.cross_entropy(z, t, ignore_index=ignore, label_smoothing=kw.get("label_smoothing", 0.0))
    if kw.get("z_loss"):
        valid = t != ignore
        loss = loss + kw["z_loss"] * (torch.logsumexp(z, -1)[valid] ** 2).mean()
    return loss.item()


def test_two_models_different_options():
    ref = build("gemma2")
    a = cce_hf.patch(copy.deepcopy(ref), impl="torch", label_smoothing=0.1, z_loss=1e-3)
    b = cce_hf.patch(copy.deepcopy(ref), impl="torch", ignore_index=-1)
    ids, labels = batch(3)
    labels_b = torch.where(labels == -100, -1, labels)
    want_a = _manual_loss(ref, ids, labels, label_smoothing=0.1, z_loss=1e-3)
    want_b = _manual_loss(ref, ids, labels_b, ignore_index=-1)
    for _ in range(2):  # interleaved calls: no state leaks from one model to the other
        la = a(input_ids=ids, labels=labels).loss.item()
        lb = b(input_ids=ids, labels=labels_b).loss.item()
        assert abs(la - want_a) <= TOL * want_a
        assert abs(lb - want_b) <= TOL * want_b
    assert abs(want_a - want_b) > 1e-2


def test_shift_labels_used_unshifted():
    ref = build("qwen3")
    model = cce_hf.patch(copy.deepcopy(ref), impl="torch")
    ids, labels = batch(4)
    shift = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)
    got = model(input_ids=ids, labels=labels, shift_labels=shift).loss.item()
    assert abs(got - _manual_loss(ref, ids, labels)) <= TOL * got


def test_unpatch_restores_and_repatch():
    ref = build("llama")
    model = copy.deepcopy(ref)
    cce_hf.patch(model, impl="torch")
    cce_hf.patch(model, impl="torch", label_smoothing=0.2)  # re-patching replaces the options
    assert cce_hf.is_patched(model)
    assert cce_hf.options(model).label_smoothing == 0.2
    cce_hf.unpatch(model)
    assert not cce_hf.is_patched(model)
    assert "forward" not in model.__dict__ and "forward" not in model.lm_head.__dict__
    ids, labels = batch(5)
    out = model(input_ids=ids, labels=labels)
    exp = ref(input_ids=ids, labels=labels)
    assert out.logits is not None
    assert torch.equal(out.loss, exp.loss)
    assert cce_hf.unpatch(model) is model  # no-op


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_options_report_what_the_labelled_loss_uses(family):
    """options(model) are the options of a labelled call: the config's softcap (Gemma 2's default
    final_logit_softcapping, 30), shift=True, reduction="mean". cce.linear_cross_entropy with
    exactly these options on the model's final hidden states gives the patched loss."""
    import dataclasses

    import cce

    cfg_name, model_name, _ = FAMILIES[family]
    cfg = getattr(transformers, cfg_name)(**_COMMON)  # the family's own softcap default
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = cce_hf.patch(getattr(transformers, model_name)(cfg).float(), impl="torch", z_loss=1e-3)
    opts = cce_hf.options(model)
    want_cap = getattr(cfg, "final_logit_softcapping", None)
    assert opts.softcap == want_cap and (family == "llama") == (want_cap is None)
    assert opts.shift is True and opts.reduction == "mean" and opts.z_loss == 1e-3
    ids, labels = batch(10)
    kw = {f.name: getattr(opts, f.name) for f in dataclasses.fields(opts) if f.name != "tuning"}
    with torch.no_grad():
        hidden = model.model(input_ids=ids).last_hidden_state
        want = cce.linear_cross_entropy(hidden, model.lm_head.weight, labels, **kw)
        got = model(input_ids=ids, labels=labels).loss
    assert abs(got.item() - want.item()) <= TOL * want.item()


def test_error_names_what_is_missing():
    class NoHead(torch.nn.Module):
        config = transformers.LlamaConfig()

        def forward(self, input_ids=None, labels=None):
            return input_ids

    with pytest.raises(ValueError, match="lm_head"):
        cce_hf.patch(NoHead())

    class ConvHead(NoHead):
        def __init__(self):
            super().__init__()
            self.lm_head = torch.nn.Conv1d(4, 4, 1)

    with pytest.raises(TypeError, match="nn.Linear"):
        cce_hf.patch(ConvHead())

    class NoLabels(NoHead):
        def __init__(self):
            super().__init__()
            self.lm_head = torch.nn.Linear(4, 4)

        def forward(self, input_ids=None):
            return input_ids

    with pytest.raises(ValueError, match="labels"):
        cce_hf.patch(NoLabels())

    class NoConfig(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lm_head = torch.nn.Linear(4, 4)

    with pytest.raises(ValueError, match="config"):
        cce_hf.patch(NoConfig())
    with pytest.raises(TypeError, match="reduction"):  # set by the patch, not by the user
        cce_hf.patch(build("llama"), reduction="sum")


def test_patched_forward_keeps_signature():
    """The Trainer reads model.forward's signature (column filter, loss kwargs): it must be the real one."""
    import inspect

    model = cce_hf.patch(build("llama"), impl="torch")
    params = inspect.signature(model.forward).parameters
    assert "input_ids" in params and "labels" in params
    assert any(p.kind == p.VAR_KEYWORD for p in params.values())


def test_trainer_with_gradient_accumulation_matches_unpatched():
    """End to end through the stock Trainer: with gradient accumulation it passes num_items_in_batch."""
    pytest.importorskip("accelerate")
    from examples.hf_trainer import train

    a, _ = train(False, steps=3, vocab=512, grad_accum=2)
    b, _ = train(True, steps=3, vocab=512, grad_accum=2, impl="torch")
    assert len(a) == len(b) == 3
    for x, y in zip(a, b, strict=True):
        assert abs(x - y) <= TOL * abs(x)


def test_deepcopy_of_patched_model_is_independent():
    ref = build("llama")
    a = cce_hf.patch(copy.deepcopy(ref), impl="torch")
    b = copy.deepcopy(a)
    assert cce_hf.is_patched(b)
    with torch.no_grad():
        for p in b.parameters():
            p.mul_(0.5)  # b's weights now differ from a's
    ids, labels = batch(6)
    la = a(input_ids=ids, labels=labels).loss.item()
    assert abs(la - ref(input_ids=ids, labels=labels).loss.item()) <= TOL * la
    with torch.no_grad():
        # b's lm_head (no labels path) uses b's own weights, not a's.
        assert torch.equal(b(input_ids=ids).logits, cce_hf.unpatch(copy.deepcopy(b))(input_ids=ids).logits)
    assert abs(b(input_ids=ids, labels=labels).loss.item() - la) > 1e-3


def test_autocast_bf16():
    """Under CPU autocast the patched loss is computed in bf16 operands (as the unpatched lm_head is)."""
    ref = build("llama")
    model = cce_hf.patch(copy.deepcopy(ref), impl="torch")
    ids, labels = batch(7)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = model(input_ids=ids, labels=labels).loss
        exp = ref(input_ids=ids, labels=labels).loss
    got.backward()
    assert got.dtype == torch.float32
    assert model.lm_head.weight.grad.dtype == torch.float32
    # The unpatched loss reads bf16-rounded logits (relative rounding 2^-8 per logit, errors that
    # mostly average out over tokens) while cce accumulates the bf16 products in fp32: measured
    # 2e-5 relative; 1e-3 bounds it. What this guards is that the patched path runs at all under
    # autocast (autocast must not leak into cce's op) and returns an fp32 loss and gradients.
    assert abs(got.item() - exp.item()) <= 1e-3 * exp.item()


def test_existing_instance_forwards_are_kept():
    """Forwards already set on the instances (accelerate's hooks, as device_map="auto" adds) still run."""
    hooks = pytest.importorskip("accelerate.hooks")

    class Count(hooks.ModelHook):
        def __init__(self):
            super().__init__()
            self.calls = 0

        def pre_forward(self, module, *args, **kwargs):
            self.calls += 1
            return args, kwargs

    ref = build("llama")
    model = copy.deepcopy(ref)
    top, head = Count(), Count()
    hooks.add_hook_to_module(model, top)
    hooks.add_hook_to_module(model.lm_head, head)
    cce_hf.patch(model, impl="torch")
    ids, labels = batch(8)
    out = model(input_ids=ids, labels=labels)
    assert top.calls == 1 and head.calls == 0  # labelled: the head's matmul (and its hook) is skipped
    assert abs(out.loss.item() - ref(input_ids=ids, labels=labels).loss.item()) <= TOL * out.loss.item()
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, ref(input_ids=ids).logits)
    assert top.calls == 2 and head.calls == 1
    cce_hf.unpatch(model)
    model(input_ids=ids)
    assert top.calls == 3 and head.calls == 2  # the hooks survive unpatch


def test_gradient_checkpointing():
    ref = build("qwen2")
    model = cce_hf.patch(copy.deepcopy(ref), impl="torch")
    for m in (ref, model):
        m.train()
        m.gradient_checkpointing_enable()
    ids, labels = batch(9)
    out = model(input_ids=ids, labels=labels, use_cache=False)
    exp = ref(input_ids=ids, labels=labels, use_cache=False)
    assert abs(out.loss.item() - exp.loss.item()) <= TOL * exp.loss.item()
    out.loss.backward()
    exp.loss.backward()
    assert_grads_close(grads(model), grads(ref))


@pytest.mark.parametrize("family", ["llama", "gemma2", "cohere"])
def test_token_logprobs_match_materialized(family):
    """token_logprobs: the next-token log-probabilities and entropies at a temperature equal those
    of the unpatched model's logits (with its softcap / logit scale), 0 at ignored labels, and
    the gradients of a GRPO-style objective through both match."""
    ref = build(family)
    model = cce_hf.patch(copy.deepcopy(ref), impl="torch")
    ids, labels = batch()
    T = 0.7
    out = cce_hf.token_logprobs(model, ids, labels=labels, temperature=T, entropy=True)
    logits = ref(input_ids=ids).logits[:, :-1].float() / T
    logp = torch.log_softmax(logits, -1)
    tgt = labels[:, 1:]
    valid = tgt != -100
    want_lp = torch.where(valid, logp.gather(-1, tgt.clamp(min=0)[..., None]).squeeze(-1), 0.0)
    want_ent = torch.where(valid, -(logp.exp() * logp).sum(-1), 0.0)
    assert out.logprobs.shape == tgt.shape and out.entropy.shape == tgt.shape
    assert rel_err(out.logprobs, want_lp) < TOL and rel_err(out.entropy, want_ent) < TOL
    assert bool((out.logprobs[~valid] == 0).all())
    g = torch.randn(tgt.shape, generator=torch.Generator().manual_seed(1))
    (torch.exp(out.logprobs) * g).sum().backward()
    (torch.exp(want_lp) * g).sum().backward()
    assert_grads_close(grads(model), grads(ref))
    # labels default to the input ids (every position scored)
    full = cce_hf.token_logprobs(model, ids, temperature=T)
    want_full = logp.gather(-1, ids[:, 1:, None]).squeeze(-1)
    assert rel_err(full.logprobs, want_full) < TOL and full.entropy is None


def test_token_logprobs_entropy_gradient_and_errors():
    """The entropy's gradient reaches the parameters as through the logits; an unpatched model
    is refused with a message naming patch()."""
    ref = build("llama")
    model = cce_hf.patch(copy.deepcopy(ref), impl="torch")
    ids, labels = batch()
    out = cce_hf.token_logprobs(model, ids, labels=labels, temperature=1.3, entropy=True)
    out.entropy.sum().backward()
    logp = torch.log_softmax(ref(input_ids=ids).logits[:, :-1].float() / 1.3, -1)
    valid = labels[:, 1:] != -100
    torch.where(valid, -(logp.exp() * logp).sum(-1), 0.0).sum().backward()
    assert_grads_close(grads(model), grads(ref))
    with pytest.raises(ValueError, match="patch"):
        cce_hf.token_logprobs(build("llama"), ids)


def test_grpo_example_matches_materialized():
    """examples/grpo.py: its first step's loss and gradients equal the materialized computation."""
    from examples.grpo import main

    log = main(["--steps", "1"])
    loss, ref_loss, worst = log["check"]
    assert abs(loss - ref_loss) <= TOL * max(1.0, abs(ref_loss)) and worst < TOL
    # The printed progress: the batch's second update (ratio no longer 1) has a lower loss.
    first, second = log["losses"][0]
    assert second < first
