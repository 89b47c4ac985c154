"""cce/_custom_ops.py: an op's Args fields reach its implementation, fake and autograd functions
exactly, with the numeric fields packed into one float list in the schema."""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch

from cce._custom_ops import define_op, register_autograd, register_fake


class ToyArgs(NamedTuple):
    x: torch.Tensor
    big: int
    flag: bool
    maybe: int | None
    eps: float
    name: str
    w: torch.Tensor | None
    neg: int


SEEN: list[ToyArgs] = []


@define_op("cce_test::toy", ToyArgs, torch.Tensor)
def toy(a: ToyArgs):
    SEEN.append(a)
    out = a.x * a.eps
    return out if a.w is None else out * a.w


register_fake(toy, lambda a: torch.empty_like(a.x))

NEEDS: list[tuple] = []


def _setup(ctx, a: ToyArgs, output) -> None:
    ctx.save_for_backward(a.w)
    ctx.eps = a.eps


def _backward(ctx, g):
    NEEDS.append(tuple(ctx.needs_input_grad))
    (w,) = ctx.saved_tensors
    gx = g * ctx.eps if w is None else g * ctx.eps * w
    return (gx, None, None, None, None, None, None, None)


register_autograd(toy, _backward, _setup)


def test_schema_packs_the_numeric_fields():
    schema = str(torch.ops.cce_test.toy.default._schema)
    assert "float[] options" in schema and "str name" in schema and "Tensor? w" in schema
    assert "int big" not in schema and "bool flag" not in schema


@pytest.mark.parametrize(
    "big,flag,maybe,eps,neg",
    [(2**53 - 1, True, None, 0.5, -7), (0, False, 3, 1e-30, -(2**40)), (256 << 20, True, 0, -2.5, 0)],
)
def test_fields_round_trip_exactly(big, flag, maybe, eps, neg):
    SEEN.clear()
    x = torch.randn(5)
    out = toy(x, big, flag, maybe, eps, "mean", None, neg)
    a = SEEN[-1]
    assert (a.big, a.flag, a.maybe, a.eps, a.name, a.neg) == (big, flag, maybe, eps, "mean", neg)
    assert type(a.big) is int and type(a.flag) is bool and type(a.eps) is float
    assert a.maybe is None or type(a.maybe) is int
    torch.testing.assert_close(out, x * eps)


def test_an_int_past_float64s_exact_range_is_refused():
    with pytest.raises(ValueError, match="big"):
        toy(torch.randn(3), 2**53, False, None, 1.0, "sum", None, 0)


def test_autograd_sees_the_fields():
    """setup_context reads the fields by name, the backward's per-field gradients reach the
    tensors, and ctx.needs_input_grad is indexed by field."""
    NEEDS.clear()
    x = torch.randn(4, requires_grad=True)
    w = torch.randn(4)
    toy(x, 1, True, None, 3.0, "none", w, -1).sum().backward()
    torch.testing.assert_close(x.grad, 3.0 * w)
    needs = NEEDS[-1]
    assert len(needs) == len(ToyArgs._fields)
    assert needs[0] is True and not any(needs[1:])


def test_compile_traces_the_op():
    """The packed call traces under torch.compile (fullgraph) through the fake."""
    x = torch.randn(6)

    @torch.compile(fullgraph=True, backend="eager")
    def f(x):
        return toy(x, 7, False, 2, 0.25, "mean", None, 0) + 1

    torch.testing.assert_close(f(x), x * 0.25 + 1)
