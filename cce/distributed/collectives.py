"""The collectives of vocabulary parallelism: all-gathers whose backward matches how their
result is consumed (the same loss on every rank, or each rank its own tokens), and the sum over
ranks of the hidden states' gradient.

They run as torch's functional collectives (``torch.ops._c10d_functional``, what
``torch.distributed._functional_collectives`` and DTensor use): plain tensor ops that
torch.compile traces into one graph and that a CUDA graph can capture (NCCL), where the
``dist.*`` calls would break the graph. Nothing here reads a tensor on the host.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_c10d = torch.ops._c10d_functional


def group_device(group) -> torch.device:
    """The device collectives of ``group`` run on (NCCL: the current CUDA device)."""
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather(x: torch.Tensor, group) -> torch.Tensor:
    """[world, *x.shape] gathered in rank order (not differentiable)."""
    world = dist.get_world_size(group)
    out = _c10d.wait_tensor(_c10d.all_gather_into_tensor(x.contiguous(), world, group.group_name))
    return out.view(world, *x.shape)


def all_reduce_(x: torch.Tensor, group) -> torch.Tensor:
    """x summed over the ranks of ``group``, in x's dtype: in place (x contiguous), except while
    torch.compile traces (AOTAutograd functionalizes no in-place collective; the out-of-place one
    is traced instead, and the compiler may reuse x's buffer)."""
    if torch.compiler.is_compiling():
        return _c10d.wait_tensor(_c10d.all_reduce(x, "sum", group.group_name))
    return _c10d.wait_tensor(_c10d.all_reduce_(x, "sum", group.group_name))


class GatherReplicated(torch.autograd.Function):
    """All-gather whose backward takes this rank's slice: the consumer (the loss) is computed
    identically on every rank, so the gradients reaching the gathered copies are identical."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.rank = dist.get_rank(group)
        return all_gather(x, group)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return g[ctx.rank], None


class GatherSummed(torch.autograd.Function):
    """All-gather whose backward sums every rank's gradient of this rank's slice (a
    reduce-scatter): for consumers that differ across ranks (each rank its own tokens' loss)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.rank, ctx.group = dist.get_rank(group), group
        return all_gather(x, group)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return all_reduce_(g.contiguous().clone(), ctx.group)[ctx.rank], None


class SumGrad(torch.autograd.Function):
    """Identity forward; backward sums the gradient over the ranks of ``group``, in place and in
    the gradient's dtype (Megatron's "copy to the tensor-parallel region"): for an input every
    rank holds the same copy of and whose consumers (each rank's vocabulary block) differ."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        # (The incoming gradient is the block op's own dE buffer, used by nothing else.)
        return all_reduce_(g if g.is_contiguous() else g.contiguous(), ctx.group), None


class ScaleGrad(torch.autograd.Function):
    """Identity forward; multiplies the gradient by ``scale`` (FSDP2's averaging over ranks)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return g * ctx.scale, None


class GatherTokens(torch.autograd.Function):
    """[n, D] -> [world * n, D] all-gather of every rank's tokens; backward reduce-scatters
    (sums every rank's gradient of this rank's rows)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return all_gather(x, group).flatten(0, 1)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        world = dist.get_world_size(ctx.group)
        out = _c10d.reduce_scatter_tensor(g.contiguous(), "sum", world, ctx.group.group_name)
        return _c10d.wait_tensor(out), None
