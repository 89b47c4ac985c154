"""The collectives of vocabulary parallelism: all-gathers whose backward matches how their
result is consumed (the same loss on every rank, or each rank its own tokens)."""

from __future__ import annotations

import torch
import torch.distributed as dist


def group_device(group) -> torch.device:
    """The device collectives of ``group`` run on (NCCL: the current CUDA device)."""
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather(x: torch.Tensor, group) -> torch.Tensor:
    """[world, *x.shape] gathered in rank order (not differentiable)."""
    world = dist.get_world_size(group)
    x = x.contiguous()
    out = x.new_empty((world, *x.shape))
    if "nccl" in str(dist.get_backend(group)).lower():
        dist.all_gather_into_tensor(out, x, group=group)
    else:
        dist.all_gather(list(out.unbind(0)), x, group=group)
    return out


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
        g = g.contiguous().clone()
        dist.all_reduce(g, group=ctx.group)
        return g[ctx.rank], None


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
        g = g.contiguous()
        out = g.new_empty((g.shape[0] // world, *g.shape[1:]))
        dist.reduce_scatter_tensor(out, g, group=ctx.group)
        return out, None
