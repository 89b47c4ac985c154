"""What the sparse backward's kernels read besides the problem tensors (backward_sparse.py):
the plan that triton_backward.py builds on the device, the first-order terms not built yet, and
the dC writer's scratch slots."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton

from .common import stats_blocks
from .first_order import FirstOrder


class PendingFirstOrder(NamedTuple):
    """The first-order terms where their flag had not reached the host when the plan was made:
    ``flag`` (int32 [1], the device's; the dC writer reads it meanwhile) and ``build``, which
    makes their operands (a FirstOrder). linear_ce_backward_sparse calls it after the dC writer's
    launch unless the flag has reached the host as 0 by then (host time: the operands are a few
    launches and D x D buffers, made for nothing where the flag is 0)."""

    flag: torch.Tensor
    build: Callable[[], FirstOrder]


@dataclass
class SparsePlan:
    """Everything the sparse backward kernels read besides the problem tensors (triton_backward.py
    builds it with torch ops on the device; rows are in the valid-first order, tiles are the
    forward's tiles of the vocabulary in ``perm`` order).

    keep [n_blocks, n_tiles] int8; list_e [n_blocks, n_tiles + 1] / cnt_e: kept tiles per block;
    list_c [n_tiles, n_blocks + 1] / cnt_c: kept blocks per tile; code [N, n_tiles] uint8: the
    skipped tiles' masses (encode_tile_stats);
    coef: per row, the exact target entry p_t (alpha [+ eta z_t]) - beta (times softcap');
    g [n_tiles, D] fp32 skipped mass times its coefficient times e per tile, q [V]
    its spread within the tile (per position; uniform instead where fo's flag is set);
    trow / tpos / tcoef: the valid rows ordered by their target's sorted position (e2d row, that
    position as int32, coef), then the others (position n_tiles * BLOCK_V), with seg
    [n_tiles + 1] the tiles' boundaries; wc, ge: the smoothing terms
    sum_v w_v c_v and sum_i gamma_i e_i (fp32 [D]).
    """

    keep: torch.Tensor
    list_e: torch.Tensor
    cnt_e: torch.Tensor
    list_c: torch.Tensor
    cnt_c: torch.Tensor
    code: torch.Tensor
    coef: torch.Tensor
    g: torch.Tensor | None
    q: torch.Tensor | None
    trow: torch.Tensor | None
    tpos: torch.Tensor | None
    tcoef: torch.Tensor | None
    seg: torch.Tensor | None
    wc: torch.Tensor | None
    ge: torch.Tensor | None
    gidx: torch.Tensor  # [n_blocks, n_tiles] int32: index of each kept tile among the kept ones
    klist: torch.Tensor  # [cap + 1] int32: flat index (block * n_tiles + tile) of kept tile k < cap
    n_kept: torch.Tensor  # [1] int32
    fo: FirstOrder | None = None  # the first-order terms (first_order.py), or None
    fo_pending: PendingFirstOrder | None = None  # or, not built yet, their flag and builder
    # fp32 [N, n_tiles] with the entropy's term: common.skipped_slog of every skipped tile, or None
    slog: torch.Tensor | None = None


def kept_scratch_tiles(N: int, dtype: torch.dtype, tiles: int | None = None) -> int:
    """Scratch slots of the dC writer's kept dZ tiles (Tuning.dc_scratch_tiles; by default two
    per token block: LM-like data keeps about one, the head of the sorted vocabulary); kept
    tiles past them are recomputed by the writer."""
    if tiles is not None:
        return tiles
    return 2 * triton.cdiv(N, stats_blocks(dtype)[0])
