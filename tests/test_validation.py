"""Bad inputs: each raises ValueError / TypeError / IndexError naming the argument and showing the
offending shapes or values, before any kernel runs."""

from __future__ import annotations

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
