"""Custom ops whose arguments are declared once, as a NamedTuple.

``torch.library.custom_op`` infers an op's schema from its function's signature; the fake
implementation and the autograd ``setup_context`` then receive the same arguments again. Here
the NamedTuple is the one declaration: its fields give the schema, and the implementation, the
fake and ``setup_context`` all read their inputs as ``Args(*inputs)`` by name.
"""

from __future__ import annotations

import inspect
import types
import typing
from collections.abc import Callable

import torch


def _schema_type(hint):
    # `X | None` (types.UnionType) in the form infer_schema knows: typing.Optional[X].
    if isinstance(hint, types.UnionType):
        args = [a for a in hint.__args__ if a is not type(None)]
        if len(args) == 1 and len(hint.__args__) == 2:
            return typing.Optional[args[0]]  # noqa: UP045
    return hint


def define_op(name: str, args: type, returns, mutates_args: tuple[str, ...] = ()):
    """Decorator: ``fn(a: Args) -> returns`` becomes the custom op ``name`` whose positional
    arguments are the fields of the NamedTuple ``args`` (in order, with their annotations)."""
    hints = typing.get_type_hints(args)
    params = [
        inspect.Parameter(f, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=_schema_type(hints[f]))
        for f in args._fields
    ]

    def prototype(*_): ...

    prototype.__signature__ = inspect.Signature(params, return_annotation=returns)
    schema = torch.library.infer_schema(prototype, mutates_args=mutates_args)

    def wrap(fn: Callable):
        def impl(*inputs):
            return fn(args(*inputs))

        op = torch.library.custom_op(name, impl, mutates_args=mutates_args, schema=schema)
        op.args_type = args
        return op

    return wrap


def register_fake(op, fn: Callable) -> None:
    """The op's fake implementation, ``fn(a: Args)``."""
    args = op.args_type
    op.register_fake(lambda *inputs: fn(args(*inputs)))


def register_autograd(op, backward: Callable, setup_context: Callable) -> None:
    """``setup_context(ctx, a: Args, output)`` and ``backward(ctx, *grads)``; the backward returns
    one gradient per field of Args (None for the non-differentiable ones)."""
    args = op.args_type
    op.register_autograd(
        backward, setup_context=lambda ctx, inputs, output: setup_context(ctx, args(*inputs), output)
    )
