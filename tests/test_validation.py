"""Bad inputs: each raises ValueError / TypeError / IndexError naming the argument and showing the
offending shapes or values, before any kernel runs; and the edge cases that are not errors (D = 0,
N = 0, non-finite inputs), with what they give. docs/api.md's "Bad inputs" table lists them all.
Out-of-range targets where the check runs on the device: tests/test_bad_targets.py."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

import cce
import cce.ops.linear_ce.torch_impl

V, D = 11, 8


@pytest.fixture
def no_kernel(monkeypatch):
    """Makes any call into the PyTorch implementation fail loudly: validation must raise first."""

    def boom(*args, **kwargs):
        raise AssertionError("the implementation ran before validation rejected the input")

    monkeypatch.setattr(cce.ops.linear_ce.torch_impl, "linear_ce_torch_fwd", boom)


def good(lead=(2, 5), dtype=torch.float32):
    e = torch.randn(*lead, D, dtype=dtype, requires_grad=True)
    c = torch.randn(V, D, dtype=dtype, requires_grad=True)
    t = torch.randint(0, V, lead)
    return e, c, t


def call(e, c, t, bias=None, **kw):
    kw.setdefault("impl", "torch")
    return cce.linear_cross_entropy(e, c, t, bias, **kw)


def test_good_input_reaches_the_kernel(no_kernel):
    """The fixture works: a valid call does reach the (patched) implementation."""
    e, c, t = good()
    with pytest.raises(AssertionError, match="implementation ran"):
        call(e, c, t)


def test_hidden_size_mismatch(no_kernel):
    e, c, t = good()
    c = torch.randn(V, D + 3)
    with pytest.raises(ValueError, match=r"hidden size.*\(2, 5, 8\).*\(11, 11\)"):
        call(e, c, t)


@pytest.mark.parametrize("shape", [(V,), (V, D, 1), (1, V, D)])
def test_c_not_2d(no_kernel, shape):
    e, _, t = good()
    c = torch.randn(*shape)
    with pytest.raises(ValueError, match=r"\bc\b.*2-D.*" + re.escape(str(tuple(shape)))):
        call(e, c, t)


@pytest.mark.parametrize("tshape", [(2, 4), (10,), (2, 5, 1), (5, 2)])
def test_targets_shape(no_kernel, tshape):
    e, c, _ = good()
    t = torch.randint(0, V, tshape)
    with pytest.raises(ValueError, match=r"targets.*\(2, 5\).*" + re.escape(str(tuple(tshape)))):
        call(e, c, t)


@pytest.mark.parametrize("tdtype", [torch.float32, torch.bfloat16, torch.float64, torch.bool])
def test_floating_or_bool_targets(no_kernel, tdtype):
    e, c, t = good()
    with pytest.raises(TypeError, match=r"targets.*" + re.escape(str(tdtype))):
        call(e, c, t.to(tdtype))


@pytest.mark.parametrize("name", ["bias", "weight"])
@pytest.mark.parametrize("shape", [(V - 1,), (V + 1,), (1, V), (V, 1), ()])
def test_vector_shapes(no_kernel, name, shape):
    e, c, t = good()
    bad = torch.randn(shape)
    kw = {"bias": bad} if name == "bias" else {"weight": bad}
    with pytest.raises(ValueError, match=rf"{name}.*\({V},\).*" + re.escape(str(tuple(shape)))):
        call(e, c, t, **kw)


@pytest.mark.parametrize("name", ["bias", "weight"])
def test_vector_integer_dtype(no_kernel, name):
    e, c, t = good()
    bad = torch.ones(V, dtype=torch.int64)
    kw = {"bias": bad} if name == "bias" else {"weight": bad}
    with pytest.raises(TypeError, match=rf"{name}.*int64"):
        call(e, c, t, **kw)


def test_e_c_dtype_mismatch(no_kernel):
    e, c, t = good()
    with pytest.raises(TypeError, match=r"\be\b.*\bc\b.*float32.*bfloat16"):
        call(e, c.to(torch.bfloat16), t)


@pytest.mark.parametrize("which", ["e", "c"])
def test_non_float_operands(no_kernel, which):
    e, c, t = good()
    if which == "e":
        e = torch.ones(2, 5, D, dtype=torch.int32)
    else:
        c = torch.ones(V, D, dtype=torch.int32)
    with pytest.raises(TypeError, match=rf"\b{which}\b.*int32"):
        call(e, c, t)


def test_not_a_tensor(no_kernel):
    e, c, t = good()
    with pytest.raises(TypeError, match=r"targets.*list"):
        call(e, c, t.tolist())
    with pytest.raises(TypeError, match=r"\be\b.*ndarray"):
        call(e.detach().numpy(), c, t)


def test_empty_vocabulary(no_kernel):
    e, _, t = good()
    with pytest.raises(ValueError, match=r"\bc\b.*\(0, 8\)"):
        call(e, torch.randn(0, D), t)


@pytest.mark.parametrize("reduction", ["avg", "MEAN", "", None])
def test_unknown_reduction(no_kernel, reduction):
    e, c, t = good()
    with pytest.raises(ValueError, match=r"reduction.*" + re.escape(repr(reduction))):
        call(e, c, t, reduction=reduction)
    with pytest.raises(ValueError, match=r"reduction.*" + re.escape(repr(reduction))):
        cce.LinearCrossEntropy(reduction=reduction)


@pytest.mark.parametrize("impl", ["cuda", "Torch", "cce", None])
def test_unknown_impl(no_kernel, impl):
    e, c, t = good()
    with pytest.raises(ValueError, match=r"impl.*" + re.escape(repr(impl))):
        call(e, c, t, impl=impl)
    with pytest.raises(ValueError, match=r"impl.*" + re.escape(repr(impl))):
        cce.LinearCrossEntropy(impl=impl)


@pytest.mark.parametrize("softcap", [0.0, -1.0, -0.0, float("nan"), float("inf")])
def test_softcap_not_positive(no_kernel, softcap):
    e, c, t = good()
    with pytest.raises(ValueError, match=r"softcap.*" + re.escape(repr(softcap))):
        call(e, c, t, softcap=softcap)


def test_softcap_wrong_type(no_kernel):
    e, c, t = good()
    with pytest.raises(TypeError, match=r"softcap.*'30'"):
        call(e, c, t, softcap="30")


@pytest.mark.parametrize("ls", [-0.1, 1.5, float("nan"), float("inf")])
def test_label_smoothing_range(no_kernel, ls):
    e, c, t = good()
    with pytest.raises(ValueError, match=r"label_smoothing.*" + re.escape(repr(ls))):
        call(e, c, t, label_smoothing=ls)


@pytest.mark.parametrize("ls", [0.0, 1.0])
def test_label_smoothing_bounds_are_valid(no_kernel, ls):
    e, c, t = good()
    with pytest.raises(AssertionError, match="implementation ran"):
        call(e, c, t, label_smoothing=ls)


@pytest.mark.parametrize("z", [-1e-4, float("nan"), float("inf")])
def test_z_loss_range(no_kernel, z):
    e, c, t = good()
    with pytest.raises(ValueError, match=r"z_loss.*" + re.escape(repr(z))):
        call(e, c, t, z_loss=z)


@pytest.mark.parametrize("eps", [-0.1, 1.0, 2.0, "exact"])
def test_filter_eps(no_kernel, eps):
    e, c, t = good()
    exc = TypeError if isinstance(eps, str) else ValueError
    with pytest.raises(exc, match=r"filter_eps.*" + re.escape(repr(eps))):
        call(e, c, t, filter_eps=eps)


@pytest.mark.parametrize("lead", [(2, 1), (1,), (3, 4, 1)])
def test_shift_needs_two_positions(no_kernel, lead):
    e, c, t = good(lead)
    with pytest.raises(ValueError, match=r"shift.*" + re.escape(str(tuple(lead)))):
        call(e, c, t, shift=True)


@pytest.mark.parametrize("bad_target", [V, V + 5, -1, -101])
def test_target_out_of_range(no_kernel, bad_target):
    e, c, t = good()
    t[1, 3] = bad_target
    with pytest.raises(IndexError, match=rf"targets.*\[0, {V}\).*ignore_index=-100.*{bad_target}"):
        call(e, c, t)


def test_target_equal_to_custom_ignore_index_is_fine(no_kernel):
    e, c, t = good()
    t[0, 0] = -1
    with pytest.raises(AssertionError, match="implementation ran"):
        call(e, c, t, ignore_index=-1)
    with pytest.raises(IndexError, match=r"ignore_index=-100.*-1"):
        call(e, c, t)


def test_target_out_of_range_with_shift_checks_all_positions(no_kernel):
    """Even position 0 (never a target when shifting) is reported: targets are validated as given."""
    e, c, t = good()
    t[0, 0] = V
    with pytest.raises(IndexError, match=str(V)):
        call(e, c, t, shift=True)


@pytest.mark.parametrize("ignore_index", [1.5, "x", True, None])
def test_ignore_index_type(no_kernel, ignore_index):
    e, c, t = good()
    with pytest.raises(TypeError, match=r"ignore_index.*" + re.escape(repr(ignore_index))):
        call(e, c, t, ignore_index=ignore_index)


@pytest.mark.parametrize("name", ["shift", "return_lse"])
def test_flag_types(no_kernel, name):
    e, c, t = good()
    with pytest.raises(TypeError, match=rf"{name}.*'yes'"):
        call(e, c, t, **{name: "yes"})


@pytest.mark.parametrize("which", ["c", "targets", "bias", "weight"])
def test_tensors_on_different_devices(no_kernel, which):
    """One tensor on the 'meta' device stands in for a second device."""
    e, c, t = good()
    bias, weight = torch.randn(V), torch.rand(V)
    moved = {"c": c, "targets": t, "bias": bias, "weight": weight}
    moved[which] = moved[which].to("meta")
    with pytest.raises(ValueError, match=rf"same device.*{which} on meta"):
        call(e, moved["c"], moved["targets"], moved["bias"], weight=moved["weight"])


def test_module_validates_in_forward(no_kernel):
    mod = cce.LinearCrossEntropy(impl="torch")
    e, c, t = good()
    with pytest.raises(ValueError, match=r"targets.*\(2, 5\).*\(5, 2\)"):
        mod(e, c, t.T)


def test_bad_input_leaves_no_autograd_state():
    """A rejected call neither runs nor modifies anything (no .grad, inputs untouched)."""
    e, c, t = good()
    t[0, 0] = V
    e0, c0 = e.detach().clone(), c.detach().clone()
    with pytest.raises(IndexError):
        call(e, c, t)
    assert e.grad is None and c.grad is None
    assert torch.equal(e.detach(), e0) and torch.equal(c.detach(), c0)


def test_triton_on_cpu_without_interpreter():
    """impl='triton' with CPU tensors, TRITON_INTERPRET unset: a clear error naming impl and the
    device, raised before any kernel. Runs in a subprocess since this suite sets TRITON_INTERPRET."""
    code = textwrap.dedent(
        """
        import torch, cce
        e = torch.randn(3, 8); c = torch.randn(5, 8); t = torch.randint(0, 5, (3,))
        try:
            cce.linear_cross_entropy(e, c, t, impl="triton")
        except (ValueError, RuntimeError) as err:
            print(type(err).__name__, err)
        else:
            print("NO ERROR")
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    msg = out.stdout.strip()
    assert msg.startswith(("ValueError", "RuntimeError")), msg
    assert "impl='triton'" in msg and "cpu" in msg.lower(), msg


@pytest.mark.parametrize("name", ["dense_kept", "slab_error", "slab_error_dc"])
@pytest.mark.parametrize("bad", [-1e-3, float("nan"), float("inf"), True, "0.1"])
def test_tuning_error_targets(name, bad):
    """The dense-slab rules' numbers: finite and >= 0, or a ValueError naming the field."""
    with pytest.raises(ValueError, match=name):
        cce.Tuning(**{name: bad})
    assert getattr(cce.Tuning(**{name: 0.0}), name) == 0.0


# --------------------------------------------------------------------------------------------
# Target dtypes, the range check's two paths, D = 0, N = 0, non-finite inputs, module reprs


@pytest.mark.parametrize("tdtype", [torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8])
def test_accepted_target_dtypes(no_kernel, tdtype):
    """Every dtype the message lists reaches the implementation."""
    e, c, t = good()
    with pytest.raises(AssertionError, match="implementation ran"):
        call(e, c, t.to(tdtype))


def test_target_dtype_message_lists_exactly_the_accepted_dtypes(no_kernel):
    """The TypeError names the accepted dtypes, which are exactly TARGET_DTYPES; an integer dtype
    outside them (torch's uint16 / uint32 / uint64, whose comparisons the CPU lacks) is refused
    before any kernel, at both levels."""
    from cce._validation import TARGET_DTYPES

    e, c, t = good()
    msg = (
        r"targets must hold integer class ids \(int64, int32, int16, int8 or uint8\), got dtype torch.uint16"
    )
    with pytest.raises(TypeError, match=msg):
        call(e, c, t.to(torch.uint16))
    with pytest.raises(TypeError, match=msg):
        cce.cross_entropy(torch.randn(2, 5, V), t.to(torch.uint16))
    names = {str(d).removeprefix("torch.") for d in TARGET_DTYPES}
    assert names == {"int64", "int32", "int16", "int8", "uint8"}


def test_float_dtype_message_lists_exactly_the_accepted_dtypes(no_kernel):
    """e, c, bias, weight and logits: the TypeError lists FLOAT_DTYPES, float64 included (the
    linear level and impl="torch" accept it)."""
    from cce.options import FLOAT_DTYPES

    e, c, t = good()
    msg = r"\be must be float32, bfloat16, float16 or float64, got dtype torch.int32"
    with pytest.raises(TypeError, match=msg):
        call(e.to(torch.int32), c, t)
    with pytest.raises(TypeError, match=r"logits must be float32, bfloat16, float16 or float64"):
        cce.cross_entropy(torch.ones(2, 5, V, dtype=torch.int32), t)
    names = {str(d).removeprefix("torch.") for d in FLOAT_DTYPES}
    assert names == {"float32", "bfloat16", "float16", "float64"}
    with pytest.raises(AssertionError, match="implementation ran"):
        call(e.double(), c.double(), t)


def test_uint8_target_equal_to_wrapped_ignore_index_is_out_of_range(no_kernel):
    """A uint8 id of 156 is -100 (the default ignore_index) wrapped to 8 bits, but as a class id it
    is 156: out of range for V = 11, an IndexError, not an ignored token."""
    e, c, t = good()
    t = t.to(torch.uint8)
    t[0, 1] = 156
    with pytest.raises(IndexError, match=r"\[156\]"):
        call(e, c, t)


def test_range_check_runs_on_the_host_for_cpu_and_in_debug_mode(monkeypatch):
    """Where the range check runs (debug_checks_enabled): on the host for CPU tensors; for an
    accelerator's tensors only with CCE_DEBUG=1 or under anomaly detection (elsewhere on the
    device: tests/test_bad_targets.py). No GPU needed: only the device's type is read."""
    from cce._validation import debug_checks_enabled

    cuda = torch.device("cuda")
    monkeypatch.delenv("CCE_DEBUG", raising=False)
    assert debug_checks_enabled(torch.device("cpu"))
    assert not debug_checks_enabled(cuda)
    monkeypatch.setenv("CCE_DEBUG", "1")
    assert debug_checks_enabled(cuda)
    monkeypatch.setenv("CCE_DEBUG", "0")
    assert not debug_checks_enabled(cuda)
    with torch.autograd.set_detect_anomaly(True):
        assert debug_checks_enabled(cuda)


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_no_hidden_features(impl, bias, reduction):
    """D = 0 (e: (..., 0), c: (V, 0)) is supported as F.cross_entropy(e @ c.T + bias, t) supports
    it: the logits are the bias (0 without one, a loss of log V per token), dE and dC are empty,
    the bias gets its usual gradient. Tolerance of the loss: fp32 rounding of a log-sum-exp over
    V = 11 classes against torch's (a few ulps, within 1e-6)."""
    e = torch.randn(2, 5, 0, requires_grad=True)
    c = torch.randn(V, 0, requires_grad=True)
    b = torch.randn(V, requires_grad=True) if bias else None
    t = torch.randint(0, V, (2, 5))
    t[0, 0] = -100
    loss = cce.linear_cross_entropy(e, c, t, b, impl=impl, reduction=reduction)
    b_ref = None if b is None else b.detach().clone().requires_grad_()
    logits = (e.detach() @ c.detach().T).reshape(10, V)
    if b_ref is not None:
        logits = logits + b_ref
    ref = torch.nn.functional.cross_entropy(logits, t.reshape(-1), reduction=reduction)
    if reduction == "none":
        ref = ref.reshape(2, 5)
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-6)
    if not bias:
        valid = t != -100
        per_token = loss[valid] if loss.dim() else loss
        torch.testing.assert_close(per_token, torch.full_like(per_token, math.log(V)))
    loss.sum().backward()
    assert e.grad.shape == e.shape and c.grad.shape == c.shape
    if bias:
        ref.sum().backward()
        # (dbias sums p - onehot over 9 rows, each p within a few fp32 ulps of torch's: absolute
        # errors up to ~9 * 2^-23 * 8 ~ 1e-6 where the sum cancels)
        torch.testing.assert_close(b.grad, b_ref.grad, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_no_tokens_at_both_levels(impl):
    """N = 0: "mean" and "sum" are 0.0 (F.cross_entropy's "mean" is NaN), "none" is empty, and
    the gradients are zero tensors of the inputs' shapes."""
    for reduction in ("mean", "sum", "none"):
        e = torch.randn(0, D, requires_grad=True)
        c = torch.randn(V, D, requires_grad=True)
        x = torch.randn(0, V, requires_grad=True)
        t = torch.zeros(0, dtype=torch.int64)
        for loss, inputs in (
            (cce.linear_cross_entropy(e, c, t, impl=impl, reduction=reduction), (e, c)),
            (cce.cross_entropy(x, t, impl=impl, reduction=reduction), (x,)),
        ):
            assert loss.shape == ((0,) if reduction == "none" else ())
            if reduction != "none":
                assert loss.item() == 0.0
            loss.sum().backward()
            for inp in inputs:
                assert inp.grad.shape == inp.shape and not bool(inp.grad.any())


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_logits_propagate(impl, bad):
    """At the logits level a NaN or +inf logit gives a non-finite loss in exactly the rows where
    F.cross_entropy's is (never 0 or a finite value), and a "mean" over them is not finite; a -inf
    logit of a class that is not the target masks that class (a finite loss, as in torch)."""
    x = torch.randn(2, 5, V)
    t = torch.randint(1, V, (2, 5))
    x[0, 1, 4] = bad
    x[1, 3, 0] = float("-inf")  # (targets are >= 1: a masked class)
    loss = cce.cross_entropy(x, t, impl=impl, reduction="none")
    ref = torch.nn.functional.cross_entropy(x.reshape(10, V), t.reshape(-1), reduction="none").reshape(2, 5)
    assert not bool(torch.isfinite(ref[0, 1])) and bool(torch.isfinite(ref[1, 3]))
    assert torch.equal(torch.isfinite(loss), torch.isfinite(ref))
    assert not bool(torch.isfinite(cce.cross_entropy(x, t, impl=impl)))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_logit_reaches_the_triton_linear_loss(bad):
    """A row whose largest logit is NaN or +inf has a non-finite loss (the split merge takes its
    max as it is), never a finite value in its place."""
    e, c, t = good()
    with torch.no_grad():
        e[1, 2, 3] = bad
    loss = call(e, c, t, impl="triton", reduction="none")
    assert not bool(torch.isfinite(loss[1, 2]))


def test_module_reprs_show_every_option_set():
    """The modules' repr: the core options always, every other option where it differs from its
    default (temperature, the return_* flags), the class weights' shape and the process group."""
    default = repr(cce.LinearCrossEntropy())
    for name in ("reduction='mean'", "ignore_index=-100", "softcap=None", "filter_eps='auto'", "impl='auto'"):
        assert name in default
    assert "temperature" not in default and "return_" not in default
    mod = cce.LinearCrossEntropy(
        reduction="none", temperature=0.7, return_lse=True, return_logprobs=True, return_entropy=True,
        return_argmax=True, return_accuracy=True, weight=torch.ones(V),
    )  # fmt: skip
    r = repr(mod)
    for name in (
        "reduction='none'", "temperature=0.7", "return_lse=True", "return_logprobs=True",
        "return_entropy=True", "return_argmax=True", "return_accuracy=True",
        f"weight=<tensor of shape ({V},)>",
    ):  # fmt: skip
        assert name in r, (name, r)
    ce = repr(cce.CausalLMLoss(temperature=2.0, return_entropy=True, inplace_backward=True))
    for name in ("shift=True", "temperature=2.0", "return_entropy=True", "inplace_backward=True"):
        assert name in ce, (name, ce)
    assert "filter_eps" not in ce  # (unused at the logits level)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_no_tokens_with_strided_hidden_states(impl):
    """N = 0 with hidden states of stride 2 along D (an empty tensor counts as contiguous
    whatever its strides): a loss of 0 and empty gradients, as with contiguous ones."""
    if impl == "triton":
        pytest.importorskip("triton")
    e = torch.randn(0, 32)[:, ::2].requires_grad_()
    c = torch.randn(33, 16, requires_grad=True)
    loss = cce.linear_cross_entropy(e, c, torch.zeros(0, dtype=torch.long), impl=impl)
    loss.backward()
    assert float(loss) == 0.0 and (c.grad == 0).all()
