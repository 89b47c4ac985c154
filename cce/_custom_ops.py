"""Custom ops whose arguments are declared once, as a NamedTuple.

``torch.library.custom_op`` infers an op's schema from its function's signature; the fake
implementation and the autograd ``setup_context`` then receive the same arguments again. Here
the NamedTuple is the one declaration: its fields give the schema, and the implementation, the
fake and ``setup_context`` all read their inputs as ``Args(*inputs)`` by name.

The schema keeps the tensor and string fields as they are and packs the numeric options (int,
float, bool, and those of them that may be None) into one ``float[]`` argument. The reason is
the host's time per call: for an op with autograd, torch fills the call's defaults from the
schema (``torch._library.utils.fill_defaults``) and reads the schema's argument list once per
argument, which grows as the square of their number (28 arguments: about 0.45 ms per call on
a CPU core, as much as twenty kernel launches; 8: about 0.04 ms). The packing is exact: an
int or bool is a float64 below 2^53 (checked), None is a presence flag beside the value.

Every op call and every backward passes through here, which makes this the one place for what
the ops refuse: a functorch transform (torch.func.grad, vmap, jvp, ...) or forward-mode AD over
an op's inputs, and a double backward (create_graph=True). None of them has a formula here,
and without the refusals torch would give an obscure error, a gradient silently cut from the
graph (create_graph=True: a gradient penalty on it would be dropped), or a zero tangent
(forward-mode AD).
"""

from __future__ import annotations

import inspect
import types
import typing
from collections.abc import Callable

import torch
from torch.autograd import forward_ad

_EXACT_INT = 2**53

DOUBLE_BACKWARD_MESSAGE = (
    "cce does not support double backward (create_graph=True, e.g. torch.autograd.grad(loss, e, "
    "create_graph=True) or loss.backward(create_graph=True)): cce's gradients are computed by fused "
    "kernels and are not differentiable themselves, so a gradient penalty built on them would have no "
    "gradient. For higher-order gradients compute this loss with plain PyTorch, e.g. "
    "F.cross_entropy(e @ c.T, t) (or F.cross_entropy(logits, t)), whose gradient is differentiable."
)

TRANSFORMS_MESSAGE = (
    "cce does not support torch.func transforms (grad, vmap, vjp, jvp, jacrev, jacfwd, hessian, ...) "
    "or forward-mode AD (torch.autograd.forward_ad) over its inputs: its ops are fused kernels "
    "without functorch or forward-mode rules. Use torch.autograd.grad / loss.backward() for "
    "gradients and a Python loop for batches, or plain PyTorch (F.cross_entropy) inside a transform."
)


def refuse_transforms(*values: object) -> None:
    """NotImplementedError if an input is batched by vmap, needs a gradient inside a functorch
    transform (grad, vjp, jacrev: autograd would reach the op through the transform), or carries a
    forward-mode tangent (jvp, jacfwd, forward_ad). An input that a transform carries along without
    differentiating or batching it (a constant inside torch.func.grad) passes: the op's result is
    a constant there, which needs no rule. Nothing is read from the tensors' data."""
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    if torch._C._are_functorch_transforms_active():
        grad_mode = torch.is_grad_enabled()
        for t in tensors:
            if torch._C._functorch.is_batchedtensor(t) or (grad_mode and t.requires_grad):
                raise NotImplementedError(TRANSFORMS_MESSAGE)
    if forward_ad._current_level >= 0:
        for t in tensors:
            if forward_ad.unpack_dual(t).tangent is not None:
                raise NotImplementedError(TRANSFORMS_MESSAGE)


def _schema_type(hint):
    # `X | None` (types.UnionType) in the form infer_schema knows: typing.Optional[X].
    if isinstance(hint, types.UnionType):
        args = [a for a in hint.__args__ if a is not type(None)]
        if len(args) == 1 and len(hint.__args__) == 2:
            return typing.Optional[args[0]]  # noqa: UP045
    return hint


def _numeric(hint) -> tuple[type, bool] | None:
    """(int / float / bool, whether None is allowed) for a numeric hint, else None."""
    optional = False
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        rest = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(rest) != 1:
            return None
        hint, optional = rest[0], True
    return (hint, optional) if hint in (int, float, bool) else None


class _Packing:
    """The map between an Args NamedTuple and the op's schema arguments: the other fields in
    order, then the numeric ones packed into one float list."""

    def __init__(self, args: type):
        hints = typing.get_type_hints(args)
        self.args = args
        kinds = [_numeric(hints[f]) for f in args._fields]
        self.direct = [i for i, k in enumerate(kinds) if k is None]
        self.numeric = [(i, *k) for i, k in enumerate(kinds) if k is not None]
        self.hints = {f: _schema_type(hints[f]) for f in (args._fields[i] for i in self.direct)}

    def pack(self, values: tuple) -> tuple:
        nums: list[float] = []
        for i, kind, optional in self.numeric:
            x = values[i]
            if optional:
                nums.append(0.0 if x is None else 1.0)
                x = 0 if x is None else x
            if kind is not float and abs(int(x)) >= _EXACT_INT:
                raise ValueError(f"{self.args._fields[i]} = {x} does not fit the op's packed options")
            nums.append(float(x))
        return (*(values[i] for i in self.direct), nums)

    def unpack(self, inputs: tuple):
        values: list = [None] * len(self.args._fields)
        for k, i in enumerate(self.direct):
            values[i] = inputs[k]
        nums, j = inputs[len(self.direct)], 0
        for i, kind, optional in self.numeric:
            present = True
            if optional:
                present, j = nums[j] != 0.0, j + 1
            x = nums[j]
            j += 1
            if present:
                values[i] = kind(x) if kind is float else kind(int(x))
        return self.args(*values)

    def per_field(self, per_input: tuple) -> tuple:
        """A flag per schema input (ctx.needs_input_grad) as one per Args field (False for the
        packed numeric fields)."""
        out = [False] * len(self.args._fields)
        for k, i in enumerate(self.direct):
            out[i] = per_input[k]
        return tuple(out)

    def grads(self, per_field: tuple) -> tuple:
        """The backward's gradients per Args field, as the schema's inputs take them."""
        return (*(per_field[i] for i in self.direct), None)


def check_no_transforms(*values: object) -> None:
    """refuse_transforms where a transform or forward-mode AD is active at all (two flag reads
    otherwise). Under torch.compile the graph holds the op itself, and Dynamo traces torch.func
    transforms on its own: nothing to check while tracing."""
    if not torch.compiler.is_compiling() and (
        forward_ad._current_level >= 0 or torch._C._are_functorch_transforms_active()
    ):
        refuse_transforms(*values)


class _Op:
    """A custom op called with its Args fields in order (``op(*fields)``): packs them into the
    schema's arguments. ``op.op`` is the torch custom op."""

    def __init__(self, op, packing: _Packing):
        self.op = op
        self.packing = packing
        self.args_type = packing.args

    def __call__(self, *fields):
        check_no_transforms(*fields)
        return self.op(*self.packing.pack(fields))


def define_op(name: str, args: type, returns, mutates_args: tuple[str, ...] = ()):
    """Decorator: ``fn(a: Args) -> returns`` becomes the custom op ``name``, called with the fields
    of the NamedTuple ``args`` in order (with their annotations; numeric fields packed, module
    docstring)."""
    packing = _Packing(args)
    params = [
        inspect.Parameter(f, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=h)
        for f, h in packing.hints.items()
    ]
    params.append(
        inspect.Parameter("options", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=list[float])
    )

    def prototype(*_): ...

    prototype.__signature__ = inspect.Signature(params, return_annotation=returns)
    schema = torch.library.infer_schema(prototype, mutates_args=mutates_args)

    def wrap(fn: Callable):
        def impl(*inputs):
            return fn(packing.unpack(inputs))

        return _Op(torch.library.custom_op(name, impl, mutates_args=mutates_args, schema=schema), packing)

    return wrap


def register_fake(op: _Op, fn: Callable) -> None:
    """The op's fake implementation, ``fn(a: Args)``."""
    op.op.register_fake(lambda *inputs: fn(op.packing.unpack(inputs)))


def register_autograd(op: _Op, backward: Callable, setup_context: Callable) -> None:
    """``setup_context(ctx, a: Args, output)`` and ``backward(ctx, *grads)``; the backward returns
    one gradient per field of Args (None for the non-differentiable ones).

    The backward refuses a double backward: autograd runs a backward with grad mode on exactly
    when it was asked for create_graph=True (torch.compile's AOTAutograd traces backwards with
    it off), and the gradients computed here have no formula of their own.
    """
    p = op.packing

    def bwd(ctx, *grads):
        if torch.is_grad_enabled():
            raise RuntimeError(DOUBLE_BACKWARD_MESSAGE)
        # (ctx.needs_input_grad, per schema input, read per Args field by the backward)
        prev = ctx.needs_input_grad
        ctx.needs_input_grad = p.per_field(prev)
        try:
            return p.grads(backward(ctx, *grads))
        finally:
            ctx.needs_input_grad = prev

    op.op.register_autograd(
        bwd, setup_context=lambda ctx, inputs, output: setup_context(ctx, p.unpack(inputs), output)
    )
