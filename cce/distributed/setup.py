"""The set-up check of a vocabulary-parallel call, and DTensor classifiers.

The check all-gathers a small descriptor per rank (block size, D, N, options, and checksums of
``e`` and ``targets``) so that a bad set-up fails with the same clear error on every rank instead
of a hang or a silently wrong loss. Reading it on the host is a synchronisation, so it runs once
per set-up (``check="once"``, the default) and its result, the blocks' layout, is cached under a
key of everything the check validates (setup_key); ``check="always"``, ``CCE_DEBUG=1`` or
``torch.autograd.set_detect_anomaly(True)`` check every call. A group of one rank has nothing to
compare: no collective, only the local checks. A token-sharded call (every rank its own tokens)
needs the ranks' token counts on the host and checks every call.

Why every rank takes the same branch (a rank that skips the check's all-gather while another
runs it would pair it with the next collective: a hang or garbage). The key is built from this
rank's arguments only: the group, the options, the shapes, dtypes and devices of every tensor
and whether ``e`` needs a gradient. Except the classifier block's rows (constant per rank for a
model), each of these is what the check compares across ranks and requires to be equal. An entry
is added only when the check passed, on every rank at the same call, so the ranks' caches hold
keys that agree in every compared field, added in the same order (the eviction of the oldest
entry is then the same too). At a later call whose compared fields agree across ranks, as a
correct program's do, either every rank finds its key or none does. What is not detected: a
program whose ranks disagree only after their first checked call with those fields (a rank
changing its shapes or options alone): some ranks may then skip the check while others run it,
and wait in the collective until its timeout. Checksums of ``e`` / ``targets`` and the targets'
range are checked with the set-up (and by the range check of cce/_validation.py, on CPU every
call). Debug mode must be switched on on every rank alike.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from dataclasses import replace as dataclasses_replace

import torch
import torch.distributed as dist

from .._dispatch import is_dtensor, needs_grad
from .._validation import check_linear_inputs, check_target_range
from ..options import FLOAT_DTYPES, IMPLS, REDUCTIONS, TOKEN_OUTPUTS, CCEOptions
from .collectives import all_gather, group_device

# Fields of the per-rank descriptor that must agree across ranks (in this order after V_local).
_SAME = (
    "D",
    "N",
    "dtype",
    "reduction",
    "shift",
    "softcap",
    "label_smoothing",
    "z_loss",
    "ignore_index",
    "return_lse",
    "temperature",
    "outputs",
    "has_bias",
    "has_weight",
    "impl",
    "filter_eps",
    "e_grad",
)
_CHECKSUMS = ("e_sum", "e_row_moment", "e_col_moment", "t_sum", "t_moment")


def _checksums(e2d: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """Cheap order-sensitive fingerprints of e and targets, deterministic for identical data.

    Sums and index-weighted sums of row and column sums, in float64 (no copy of e is made).
    Identical tensors give bitwise-identical values; different data almost never does.
    """
    N, D = e2d.shape
    dev = e2d.device
    rs = e2d.sum(1, dtype=torch.float64)  # [N]
    cs = e2d.sum(0, dtype=torch.float64)  # [D]
    tn = t.to(torch.float64)
    return torch.stack(
        [
            rs.sum(),
            (rs * torch.arange(1, N + 1, device=dev, dtype=torch.float64)).sum(),
            (cs * torch.arange(1, D + 1, device=dev, dtype=torch.float64)).sum(),
            tn.sum(),
            (tn * torch.arange(1, tn.numel() + 1, device=dev, dtype=torch.float64)).sum(),
        ]
    )


def _validate_local(e, c_local, targets, bias, weight, opts: CCEOptions) -> int:
    """Every local check of the one-device API; returns the problem rows N (after the shift).

    The target range is checked against the global V by the caller (targets hold global ids):
    a zero stand-in of targets' shape and dtype (expanded, no copy) keeps check_linear_inputs
    from range-checking them here."""
    if not isinstance(c_local, torch.Tensor) or c_local.dim() != 2 or c_local.shape[0] == 0:
        shape = tuple(c_local.shape) if isinstance(c_local, torch.Tensor) else type(c_local)
        raise ValueError(
            f"c_local must be this rank's non-empty block of classifier rows (V_local, D), "
            f"got {shape}; every rank of the group needs at least one row"
        )
    if not isinstance(targets, torch.Tensor):
        raise TypeError(f"targets must be a torch.Tensor, got {type(targets).__name__}")
    check_linear_inputs(e, c_local, targets.new_zeros(()).expand(targets.shape), bias, weight, opts)
    n = targets.numel()
    return n - (n // targets.shape[-1] if opts.shift else 0)


def _describe(e, c_local, targets, bias, weight, opts: CCEOptions, check_replicated: bool, dev):
    """This rank's descriptor (float64, on ``dev``) and its local validation error (or None).

    The checksums stay on the device (no host synchronisation before the gather)."""
    err = None
    fields = [0.0] * (2 + len(_SAME) + 1 + len(_CHECKSUMS))
    try:
        n = _validate_local(e, c_local, targets, bias, weight, opts)
        fields[0] = 0.0
        fields[1] = float(c_local.shape[0])
        same = dict(
            D=e.shape[-1],
            N=n,
            dtype=FLOAT_DTYPES.index(e.dtype),
            reduction=REDUCTIONS.index(opts.reduction),
            shift=float(opts.shift),
            softcap=opts.softcap_value,
            label_smoothing=float(opts.label_smoothing),
            z_loss=float(opts.z_loss),
            ignore_index=float(opts.ignore_index),
            return_lse=float(opts.return_lse),
            temperature=float(opts.temperature),
            # The per-token outputs asked for, as bits (they change what the ranks gather).
            outputs=sum(2**i for i, name in enumerate(TOKEN_OUTPUTS) if getattr(opts, name)),
            has_bias=float(bias is not None),
            has_weight=float(weight is not None),
            impl=IMPLS.index(opts.impl),
            filter_eps=-1.0
            if opts.filter_eps == "auto"
            else -2.0
            if opts.filter_eps is None
            else float(opts.filter_eps),
            e_grad=float(e.requires_grad and torch.is_grad_enabled()),
        )
        for i, name in enumerate(_SAME):
            fields[2 + i] = float(same[name])
        if check_replicated:
            fields[2 + len(_SAME)] = 1.0
        desc = torch.tensor(fields, dtype=torch.float64).to(dev)
        if check_replicated:
            e2d = e.reshape(-1, e.shape[-1])
            desc[3 + len(_SAME) :] = _checksums(e2d.detach(), targets.reshape(-1)).to(dev)
        return desc, None
    except Exception as exc:  # reported collectively after the gather, never alone (no hang)
        err = exc
    fields[0] = 1.0
    return torch.tensor(fields, dtype=torch.float64).to(dev), err


@dataclass(frozen=True)
class Layout:
    rank: int
    world: int
    sizes: tuple[int, ...]  # V_local of every rank, in rank order
    ns: tuple[int, ...]  # tokens of every rank (equal unless tokens are sharded)

    @property
    def start(self) -> int:
        return sum(self.sizes[: self.rank])

    @property
    def V(self) -> int:
        return sum(self.sizes)


CHECKS: tuple[str, ...] = ("once", "always")
# Layouts of the set-ups that passed the check, by setup_key (insertion order: the oldest goes
# first past _CHECKED_MAX entries). Every rank's cache evolves alike: see the module docstring.
_CHECKED: dict[tuple, Layout] = {}
_CHECKED_MAX = 64


def check_each_call(check: str) -> bool:
    """Whether the set-up check runs at every call: ``check="always"``, or debug mode
    (``CCE_DEBUG=1`` or anomaly detection, as for cce/_validation.py's data-dependent checks),
    never while torch.compile traces (the check reads its descriptor on the host)."""
    if check not in CHECKS:
        raise ValueError(f"check must be one of {CHECKS}, got {check!r}")
    if torch.compiler.is_compiling():
        return False
    return (
        check == "always" or torch.is_anomaly_enabled() or os.environ.get("CCE_DEBUG", "0") not in ("", "0")
    )


def _tensor_key(t):
    if not isinstance(t, torch.Tensor):
        return type(t)
    return tuple(t.shape), t.dtype, t.device


def setup_key(
    e, c_local, targets, bias, weight, opts: CCEOptions, group, check_replicated, global_V
) -> tuple:
    """Everything the set-up check validates of a call, from this rank's arguments alone: the
    group, the options (less the tuning, not compared across ranks), every tensor's shape, dtype
    and device, and whether e gets a gradient. The group object itself (not its name, which a
    new group after destroy_process_group may reuse) and the replication check's switch."""
    return (
        group, check_replicated, global_V, dataclasses_replace(opts, tuning=None),
        *(_tensor_key(x) for x in (e, c_local, targets, bias, weight)), needs_grad(e),
    )  # fmt: skip


def check_setup(
    e, c_local, targets, bias, weight, opts, group, check_replicated, global_V, tokens_sharded=False,
    check: str = "once",
) -> Layout:  # fmt: skip
    """The blocks' layout of this call, after the set-up check (module docstring): at the first
    call of a set-up (setup_key) and then from the cache, or at every call (check_each_call; a
    token-sharded call). A group of one rank runs the local checks only."""
    every = check_each_call(check)
    world = dist.get_world_size(group)
    if world == 1:
        n = _validate_local(e, c_local, targets, bias, weight, opts)
        lay = Layout(0, 1, (c_local.shape[0],), (n,))
        _check_cover(lay, global_V)
    elif tokens_sharded or every:
        lay = _collective_check(
            e, c_local, targets, bias, weight, opts, group, check_replicated, global_V, tokens_sharded
        )
    else:
        lay = _cached_check(e, c_local, targets, bias, weight, opts, group, check_replicated, global_V)
    # Targets hold global ids: checked against the global V (cce/_validation.py: on CUDA tensors
    # only in debug mode).
    check_target_range(targets, lay.V, opts.ignore_index)
    return lay


def _cached_check(e, c_local, targets, bias, weight, opts, group, check_replicated, global_V) -> Layout:
    key = setup_key(e, c_local, targets, bias, weight, opts, group, check_replicated, global_V)
    lay = _CHECKED.get(key)
    if lay is None:
        if torch.compiler.is_compiling():
            raise RuntimeError(
                "[cce vocab-parallel] torch.compile met a set-up (group, shapes, options) whose check "
                "has not run: the check reads a descriptor of every rank on the host. Run one step "
                "eagerly first (or pass a DTensor classifier / use a group of one rank)."
            )
        lay = _collective_check(e, c_local, targets, bias, weight, opts, group, check_replicated, global_V)
        if len(_CHECKED) >= _CHECKED_MAX:
            del _CHECKED[next(iter(_CHECKED))]
        _CHECKED[key] = lay
    return lay


def _check_cover(lay: Layout, global_V) -> None:
    if global_V is not None and lay.V != global_V:
        raise ValueError(
            f"[cce vocab-parallel, rank {lay.rank}] the ranks' blocks (sizes {list(lay.sizes)}, total "
            f"{lay.V}) do not cover the classifier's V = {global_V} rows"
        )


def _collective_check(
    e, c_local, targets, bias, weight, opts, group, check_replicated, global_V, tokens_sharded=False
) -> Layout:
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    desc, err = _describe(e, c_local, targets, bias, weight, opts, check_replicated, group_device(group))
    table = all_gather(desc, group).cpu()  # [world, fields]: the one host synchronisation
    failed = [r for r in range(world) if table[r, 0] != 0]
    if err is not None:
        raise type(err)(f"[cce vocab-parallel, rank {rank}] {err}") from err
    if failed:
        raise RuntimeError(
            f"[cce vocab-parallel, rank {rank}] rank(s) {failed} of the process group rejected "
            "their inputs (see the error raised there); no rank ran the loss"
        )
    for i, name in enumerate(_SAME):
        if name == "N" and tokens_sharded:
            continue
        col = table[:, 2 + i]
        if not bool((col == col[0]).all()):
            vals = col.tolist()
            hint = ""
            if name == "N":
                hint = " (e and targets must hold the same tokens on every rank)"
            raise ValueError(f"[cce vocab-parallel, rank {rank}] '{name}' differs across ranks: {vals}{hint}")
    sizes = tuple(int(v) for v in table[:, 1].tolist())
    ns = tuple(int(v) for v in table[:, 2 + _SAME.index("N")].tolist())
    lay = Layout(rank, world, sizes, ns)
    _check_cover(lay, global_V)
    k = 2 + len(_SAME)
    if bool((table[:, k] != 0).all()):
        sums = table[:, k + 1 :]
        bad = [_CHECKSUMS[j] for j in range(len(_CHECKSUMS)) if not bool((sums[:, j] == sums[0, j]).all())]
        if bad:
            what = "targets" if all(b.startswith("t_") for b in bad) else "e"
            raise ValueError(
                f"[cce vocab-parallel, rank {rank}] {what} differs across ranks (checksums {bad} "
                "disagree): vocabulary parallelism needs the same e and targets on every rank of "
                "the group. Under FSDP2 (data parallel, each rank its own tokens) use "
                "cce.distributed.lm_head_linear_cross_entropy(lm_head, e, targets) or compute "
                "the loss inside the model's forward, where FSDP2 has unsharded the weight. If e "
                "is replicated only up to rounding by design, pass check_replicated=False."
            )
    return lay


# ---------------------------------------------------------------------------------------------
# DTensor classifiers
# ---------------------------------------------------------------------------------------------


def from_dtensor(c, bias, weight, process_group):
    """(c_local, bias_local, weight_local, group, global V) for a Shard(0) DTensor classifier."""
    from torch.distributed.tensor import Replicate, Shard

    mesh, placements = c.device_mesh, c.placements
    shard_dims = [i for i, p in enumerate(placements) if isinstance(p, Shard) and p.dim == 0]
    others_ok = all(isinstance(p, Replicate) for i, p in enumerate(placements) if i not in shard_dims)
    if len(shard_dims) != 1 or not others_ok:
        raise ValueError(
            f"a DTensor classifier must be sharded on dim 0 (Shard(0)) over exactly one mesh "
            f"dimension and replicated over the others, got placements {tuple(placements)}"
        )
    group = mesh.get_group(shard_dims[0])
    if process_group is not None and process_group is not group:
        raise ValueError("process_group differs from the DTensor classifier's mesh group; pass one")

    def local(name, t):
        if t is None or not is_dtensor(t):
            return t
        if tuple(t.placements) != tuple(placements) or t.device_mesh != mesh:
            raise ValueError(
                f"{name} is a DTensor with placements {tuple(t.placements)}; it must be sharded "
                f"like the classifier ({tuple(placements)})"
            )
        return t.to_local()

    return c.to_local(), local("bias", bias), local("weight", weight), group, c.shape[0]


def replicated_local(name, t):
    if t is None or not is_dtensor(t):
        return t
    from torch.distributed.tensor import Replicate

    if not all(isinstance(p, Replicate) for p in t.placements):
        raise ValueError(f"{name} as a DTensor must be replicated, got placements {tuple(t.placements)}")
    return t.to_local()
