"""cce.transformers.patch with PEFT LoRA adapters, LoRA on lm_head included (no downloads).

Each case builds the same tiny config-built model twice with identical weights and adapters: PEFT
alone (the reference, which computes the logits) and PEFT with the patch, in either order:
"patch_first" (patch the model, then get_peft_model, as docs/integrations.md describes) and
"lora_first" (get_peft_model, then patch its base model). Adapters start from random A and B
(init_lora_weights=False), so the adapter term changes the loss. In fp32 with impl="torch" the two
sides differ only in the order of fp32 reductions: the patched loss computes x W^T + u B^T as one
dot product of length D + r where PEFT adds two matmuls; measured at most 1.9e-7 relative on the
loss and 6.7e-7 on any gradient. TOL = 2e-5 leaves a wide margin, while a dropped adapter term,
another dropout mask or a lost scaling moves the loss by > 1e-2 (checked where it matters).
"""

from __future__ import annotations

import copy
import os
import socket
import warnings

import pytest
import torch
import torch.distributed as dist

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

import cce.transformers as cce_hf  # noqa: E402
from tests.helpers import rel_err  # noqa: E402

V = 128
TOL = 2e-5
ORDERS = ("patch_first", "lora_first")


def base_model(tied: bool = False):
    cfg = transformers.LlamaConfig(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
    )
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).float()


def lora(targets=("lm_head", "q_proj"), **kw):
    kw = {"r": 4, "lora_alpha": 8, "init_lora_weights": False, **kw}
    return peft.LoraConfig(target_modules=list(targets), **kw)


def get_peft(model, config):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # e.g. "lm_head is tied to the embedding" advice
        return peft.get_peft_model(model, config)


def pair(order: str, config, base=None, tied: bool = False):
    """(PEFT alone, PEFT with the patch in the given order), equal weights and adapters."""
    base = base_model(tied) if base is None else base
    torch.manual_seed(1)
    ref = get_peft(copy.deepcopy(base), config)
    if order == "patch_first":
        got = get_peft(cce_hf.patch(copy.deepcopy(base), impl="torch"), config)
    else:
        got = get_peft(copy.deepcopy(base), config)
    got.load_state_dict(ref.state_dict())
    if order == "lora_first":
        cce_hf.patch(got.get_base_model(), impl="torch")
    return ref, got


def batch(seed: int = 0, B: int = 2, T: int = 10, vocab: int = V):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (B, T), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100
    return ids, labels


def run(model, ids, labels, seed: int = 5, **kw):
    """Loss, the gradient of the input embeddings (the hidden states' end of backprop) and of every
    trainable parameter; the seed fixes the dropout masks."""
    model.zero_grad(set_to_none=True)
    emb = model.get_input_embeddings()(ids).detach().requires_grad_()
    torch.manual_seed(seed)
    out = model(inputs_embeds=emb, labels=labels, **kw)
    out.loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    return out, emb.grad, grads


def assert_match(ref, got, ids, labels, seed: int = 5, **kw):
    exp, exp_emb, exp_grads = run(ref, ids, labels, seed, **kw)
    out, out_emb, out_grads = run(got, ids, labels, seed, **kw)
    assert out.logits is None and exp.logits is not None
    assert abs(out.loss.item() - exp.loss.item()) <= TOL * abs(exp.loss.item())
    assert rel_err(out_emb, exp_emb) < TOL
    assert out_grads.keys() == exp_grads.keys()
    for name, g in exp_grads.items():
        assert (out_grads[name] is None) == (g is None), name
        if g is not None:
            assert rel_err(out_grads[name], g) < TOL, (name, rel_err(out_grads[name], g))
    return exp.loss.item()


@pytest.mark.parametrize("dropout", [0.0, 0.3])
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("order", ORDERS)
def test_lora_head_matches_peft(order, tied, dropout):
    """Loss, the adapters' gradients (on lm_head and q_proj) and the hidden states' gradient equal
    PEFT's, the base frozen; with dropout the same masks are drawn (the same RNG point)."""
    ref, got = pair(order, lora(lora_dropout=dropout), tied=tied)
    ref.train(), got.train()
    ids, labels = batch()
    loss = assert_match(ref, got, ids, labels)
    head = got.get_base_model().lm_head
    assert isinstance(head, peft.tuners.lora.Linear)
    assert {n for n, p in got.named_parameters() if p.requires_grad} >= {
        "base_model.model.lm_head.lora_A.default.weight",
        "base_model.model.lm_head.lora_B.default.weight",
    }
    with torch.no_grad(), ref.disable_adapter():
        plain = ref(input_ids=ids, labels=labels).loss.item()
    assert abs(plain - loss) > 1e-2  # the adapters matter for these inputs
    if dropout:
        other = run(ref, ids, labels, seed=6)[0].loss.item()
        assert abs(other - loss) > 1e-3  # the masks matter: matching above means the same masks


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("order", ORDERS)
def test_lora_head_with_trainable_base(order, tied):
    """The base weight W (the embedding too when tied) trained along with the adapters."""
    ref, got = pair(order, lora(lora_dropout=0.1), tied=tied)
    for m in (ref, got):
        m.train()
        for p in m.parameters():
            p.requires_grad_(True)
    assert_match(ref, got, *batch(1))


@pytest.mark.parametrize("order", ORDERS)
def test_several_adapters_lora_bias_and_rslora(order):
    """Two adapters active at once (concatenated: [x, u_1, u_2] @ [W, B_1, B_2]^T), one of them with
    a bias on B (added as s * b) and rank-stabilized scaling."""
    ref, got = pair(order, lora(lora_dropout=0.2))
    second = lora(r=2, lora_alpha=3, lora_bias=True, use_rslora=True, lora_dropout=0.1)
    for m in (ref, got):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "lora_bias on a layer without bias" advice
            m.add_adapter("second", second)
    got.load_state_dict(ref.state_dict())
    for m in (ref, got):
        m.base_model.set_adapter(["default", "second"])
        m.train()
    ids, labels = batch(2)
    both = assert_match(ref, got, ids, labels)
    with torch.no_grad():
        ref.base_model.set_adapter("default")
        one = ref(input_ids=ids, labels=labels).loss.item()
    assert abs(both - one) > 1e-2


@pytest.mark.parametrize("order", ORDERS)
def test_disabled_merged_and_unloaded(order):
    """The layer's own states: adapters disabled (base loss), merged into W (the base layer alone),
    and merge_and_unload() (a plain head again, still fused)."""
    ref, got = pair(order, lora())
    ids, labels = batch(3)
    with ref.disable_adapter(), got.disable_adapter():
        off = assert_match(ref, got, ids, labels)
    on = assert_match(ref, got, ids, labels)
    assert abs(on - off) > 1e-2
    for m in (ref, got):
        m.merge_adapter()
    assert_match(ref, got, ids, labels)
    for m in (ref, got):
        m.unmerge_adapter()
    ref, got = ref.merge_and_unload(), got.merge_and_unload()
    assert type(got.lm_head) is torch.nn.Linear
    out = got(input_ids=ids, labels=labels)
    assert out.logits is None
    exp = ref(input_ids=ids, labels=labels).loss
    assert abs(out.loss.item() - exp.item()) <= TOL * exp.item()
    assert abs(exp.item() - on) <= 1e-4 * on  # merging is the same function (up to W + sBA's rounding)


@pytest.mark.parametrize("order", ORDERS)
def test_logits_without_labels_and_unpatch(order):
    """Without labels the PEFT model's logits are untouched, bit for bit; unpatch removes every
    forward the patch installed (on the model, the LoRA layer and, patched first, its base layer)."""
    ref, got = pair(order, lora())
    ids, labels = batch(4)
    with torch.no_grad():
        assert torch.equal(got(input_ids=ids).logits, ref(input_ids=ids).logits)
    got(input_ids=ids, labels=labels)
    model = got.get_base_model()
    head = model.lm_head
    cce_hf.unpatch(model)
    assert not cce_hf.is_patched(model)
    for m in (model, head, head.base_layer):
        assert not any(k == "forward" or k.startswith("_cce") for k in m.__dict__), type(m).__name__
    out = got(input_ids=ids, labels=labels)
    assert out.logits is not None
    assert torch.equal(out.loss, ref(input_ids=ids, labels=labels).loss)


@pytest.mark.parametrize("order", ORDERS)
def test_lora_on_tied_embedding(order):
    """LoRA on the input embedding of a tied model (the head shares the embedding's base weight;
    the embedding's adapter applies to the lookup only, as in PEFT), and PEFT's tied adapters
    (ensure_weight_tying: one adapter for the embedding and lm_head)."""
    ref, got = pair(order, lora(("embed_tokens", "q_proj"), lora_alpha=1), tied=True)
    assert type(got.get_base_model().lm_head) is torch.nn.Linear
    assert_match(ref, got, *batch(5))
    if "ensure_weight_tying" not in peft.LoraConfig.__dataclass_fields__:
        return  # older PEFT: no tied adapters
    config = lora(("embed_tokens", "lm_head"), lora_alpha=1, ensure_weight_tying=True)
    ref, got = pair(order, config, tied=True)
    assert isinstance(got.get_base_model().lm_head, peft.tuners.lora.Linear)
    assert_match(ref, got, *batch(5))


@pytest.mark.parametrize("family", ["gemma2", "cohere"])
def test_lora_head_under_softcap_and_logit_scale(family):
    """The adapter term is inside the family's transform: softcap(scale * ([x, u] @ [W, B]^T))."""
    from tests.test_transformers import V as FV
    from tests.test_transformers import build

    ref, got = pair("lora_first", lora(lora_dropout=0.1), base=build(family))
    ref.train(), got.train()
    assert_match(ref, got, *batch(6, vocab=FV))


@pytest.mark.parametrize("case", ["autocast", "bf16_base"])
@pytest.mark.parametrize("order", ORDERS)
def test_bf16_no_worse_than_peft(order, case):
    """bf16 compute: under CPU autocast, and a bf16 model whose adapters PEFT keeps in fp32 (its
    default). The patched loss runs its matmuls on bf16 operands (the adapter factors and B cast to
    the base product's dtype) with fp32 accumulation, PEFT on bf16 logits: neither equals the fp32
    result. Against the fp32 computation (the same weights, exactly representable), the patched
    loss and gradients must err no more than twice as much as PEFT's own bf16 ones (plus 1e-3 for
    cases where PEFT happens to be near exact); gradients come back in the parameters' dtypes."""
    base = base_model() if case == "autocast" else base_model().to(torch.bfloat16)
    ref, got = pair(order, lora(), base=base)
    exact = copy.deepcopy(ref).float()
    ids, labels = batch(11)
    want, _, want_grads = run(exact, ids, labels)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=case == "autocast"):
        exp, _, exp_grads = run(ref, ids, labels)
        out, _, out_grads = run(got, ids, labels)
    assert out.loss.dtype == torch.float32
    w = want.loss.item()
    assert abs(out.loss.item() - w) <= 2 * abs(exp.loss.item() - w) + 1e-3 * w
    params = dict(got.named_parameters())
    for name, g in want_grads.items():
        assert out_grads[name].dtype == params[name].dtype, name
        bound = 2 * rel_err(exp_grads[name], g) + 1e-3
        assert rel_err(out_grads[name], g) <= bound, (name, rel_err(out_grads[name], g), bound)


def test_patching_the_peft_model_itself():
    """patch(peft_model) for a PeftModelForCausalLM (task_type="CAUSAL_LM") works as patching its
    base model; patching both is refused."""
    base = base_model()
    torch.manual_seed(1)
    config = lora(task_type="CAUSAL_LM")
    ref = get_peft(copy.deepcopy(base), config)
    got = get_peft(copy.deepcopy(base), config)
    got.load_state_dict(ref.state_dict())
    cce_hf.patch(got, impl="torch")
    assert_match(ref, got, *batch(7))
    with pytest.raises(RuntimeError, match="patch only one"):
        cce_hf.patch(got.get_base_model(), impl="torch")


def test_token_logprobs_with_lora_head():
    ref, got = pair("patch_first", lora())
    ids, labels = batch(8)
    out = cce_hf.token_logprobs(got.get_base_model(), ids, labels=labels, temperature=0.7)
    logp = torch.log_softmax(ref(input_ids=ids).logits[:, :-1] / 0.7, -1)
    tgt = labels[:, 1:]
    valid = tgt != -100
    want = torch.where(valid, logp.gather(-1, tgt.clamp(min=0)[..., None]).squeeze(-1), 0.0)
    assert rel_err(out.logprobs.detach(), want.detach()) < TOL
    out.logprobs.sum().backward()
    want.sum().backward()
    for (n, p), (_, q) in zip(ref.named_parameters(), got.named_parameters(), strict=True):
        if p.requires_grad:
            assert rel_err(q.grad, p.grad) < TOL, n


@pytest.mark.parametrize("order", ORDERS)
def test_unsupported_heads_are_refused(order):
    """DoRA on lm_head, a mixed-adapter batch and other PEFT wrappers of the head (modules_to_save)
    raise one error saying what to do, never a loss without the adapter."""
    ids, labels = batch(9)
    if order == "patch_first":  # met at the first labelled forward
        _, got = pair(order, lora(use_dora=True))
        with pytest.raises(ValueError, match="DoRA.*merge_and_unload"):
            got(input_ids=ids, labels=labels)
    else:  # met when patching
        with pytest.raises(ValueError, match="DoRA.*merge_and_unload"):
            pair(order, lora(use_dora=True))

    _, got = pair(order, lora())
    got.eval()
    with pytest.raises(ValueError, match="mixed-adapter"):
        got(input_ids=ids, labels=labels, adapter_names=["default", "__base__"])
    with torch.no_grad():  # without labels, PEFT's own forward handles it
        assert got(input_ids=ids, adapter_names=["default", "__base__"]).logits.shape == (*ids.shape, V)

    config = lora(("q_proj",), modules_to_save=["lm_head"])
    if order == "patch_first":
        got = get_peft(cce_hf.patch(base_model(), impl="torch"), config)
        with pytest.raises(TypeError, match="ModulesToSaveWrapper.*modules_to_save"):
            got(input_ids=ids, labels=labels)
    else:
        with pytest.raises(TypeError, match="ModulesToSaveWrapper.*modules_to_save"):
            cce_hf.patch(get_peft(base_model(), config).get_base_model())


@pytest.mark.slow
def test_compile_fullgraph_with_lora_head_wrapped_after_patch():
    """torch.compile(fullgraph=True) of a model patched before PEFT wrapped its head: the first
    compiled labelled forward installs the capturing forward on the LoRA layer and traces through
    it. The aot_eager backend (no inductor code generation) keeps it to ~10 s on 2 cores."""
    ref, got = pair("patch_first", lora())
    ids, labels = batch(12)
    out = torch.compile(got, fullgraph=True, backend="aot_eager")(input_ids=ids, labels=labels)
    exp = ref(input_ids=ids, labels=labels)
    assert out.logits is None
    assert abs(out.loss.item() - exp.loss.item()) <= TOL * exp.loss.item()
    out.loss.backward()
    exp.loss.backward()
    for (name, p), (_, q) in zip(got.named_parameters(), ref.named_parameters(), strict=True):
        if q.requires_grad:
            assert rel_err(p.grad, q.grad) < TOL, name


def _fsdp_worker(rank: int, world: int, port: int) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        data = [batch(20 + r) for r in range(world)]
        for order in ORDERS:
            ref, got = pair(order, lora())
            model = got.get_base_model()
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model.lm_head, mesh=mesh)  # the LoRA layer: W, A and B in one unit
            fully_shard(model, mesh=mesh)
            got(input_ids=data[rank][0], labels=data[rank][1]).loss.backward()
            (sum(ref(input_ids=i, labels=t).loss for i, t in data) / world).backward()
            for (name, p), (_, q) in zip(got.named_parameters(), ref.named_parameters(), strict=True):
                assert (p.grad is None) == (q.grad is None), name
                if q.grad is not None:
                    g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                    assert rel_err(g, q.grad) < TOL, (order, name, rel_err(g, q.grad))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_lora_head_under_fsdp2():
    """FSDP2 (2 ranks, gloo, CPU), the LoRA head its own unit, both orders: the adapters' weights
    are read by the loss inside call_unsharded (gathered there and again for its backward), so
    the gradients, averaged over the ranks, equal PEFT's on one device for the mean of the ranks'
    losses. About 25 s on 2 cores (each process imports transformers and PEFT)."""
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    torch.multiprocessing.spawn(_fsdp_worker, args=(2, port), nprocs=2)
