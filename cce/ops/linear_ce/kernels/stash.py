"""The gradient stash: where the sparse backward's O(N) inputs live inside dE's own buffer.

The training forward allocates the buffer dE will be written into and puts the tile codes in
its tail (when they take at most half of it). The backward writes the dE writer's kept-tile
slots just before the codes, the dC writer's slots at the front, then dE in rounds of sorted
rows, each writing only rows that end before the first byte its own and later rows still read;
the last round reads copies. Finally the rows move from the sorted order to e2d's, in place.
So the backward allocates nothing of O(N) bytes per row besides the gradients. Host-side
planning only; docs/design.md ("The gradient stash") has the picture.
"""

from __future__ import annotations

import torch
import triton

from ...._dispatch import interpreting

# The dE pass ends with one round on copies once at most de_final_blocks() token blocks remain,
# or at the last of at most this many rounds.
DE_MAX_ROUNDS = 16
# Element alignment of the slots inside the stash (16-byte aligned tiles).
STASH_ALIGN = 64


def de_final_blocks() -> int:
    """Token blocks of the dE pass's last round on copies (1 under the interpreter, whose tiny
    blocks would otherwise leave no room for a round in place)."""
    return 1 if interpreting() else 4


def code_fits_stash(n_rows: int, n_vtiles: int, stash_rows: int, D: int, dtype: torch.dtype) -> bool:
    """Whether the training forward puts the tile codes (n_rows x n_vtiles bytes) in the tail of the
    dE stash ([stash_rows, D] of ``dtype``): when they take at most half of it, so that the dE
    pass can write around them in a few rounds (see de_rounds)."""
    return 2 * n_rows * n_vtiles <= stash_rows * D * torch.empty((), dtype=dtype).element_size()


def stash_code(stash: torch.Tensor, n_rows: int, n_vtiles: int) -> torch.Tensor:
    """The codes in the stash's tail: its last n_rows * n_vtiles bytes as uint8 [n_rows, n_vtiles]."""
    raw = stash.view(-1).view(torch.uint8)
    return raw[raw.numel() - n_rows * n_vtiles :].view(n_rows, n_vtiles)


def stash_layout(N: int, M: int, D: int, es: int, code_bytes: int, BN: int, BV: int, S: int):
    """Where the dE pass's inputs sit in a stash of M x D elements of es bytes: (slot0, code_lo,
    protect). The codes (code_bytes per sorted row, 0 when they are elsewhere) fill its tail from
    element code_lo on; the S kept-tile slots per token block (BN x BV elements each) sit just
    before them from element slot0 (None when they do not fit: a separate buffer). protect(a):
    the first element that the rows from a on still read (their slots, then their codes)."""
    tile = BN * BV
    code_lo = (M * D * es - N * code_bytes) // es
    slot0 = (code_lo - triton.cdiv(N, BN) * S * tile) // STASH_ALIGN * STASH_ALIGN
    if S == 0 or slot0 < 0:
        slot0 = None

    def protect(a: int) -> int:
        if slot0 is not None:
            return slot0 + (a // BN) * S * tile
        return (M * D * es - (N - a) * code_bytes) // es

    return slot0, code_lo, protect


def de_rounds(N: int, D: int, BN: int, protect) -> list[tuple[int, int, bool]]:
    """The dE pass as rounds of sorted rows [a, b) (whole token blocks) written in place into the
    stash, rows of D elements: a round may write up to element protect(a), where what the rows
    from a on still read begins (their kept-tile slots, then their codes). A round frees the
    slots of its blocks for the next (the codes of written rows stay, between the slots and the
    codes still read), so the remainder shrinks toward ~ N codes / (dE bytes - slot bytes per
    row) rows; the last round (flag True) reads copies of what it needs, made first: at most
    de_final_blocks() blocks, that remainder, or what is left after DE_MAX_ROUNDS rounds."""
    rounds, a = [], 0
    while a < N:
        lim = protect(a) // max(D, 1)
        if lim >= N:
            rounds.append((a, N, False))
            break
        b = lim // BN * BN
        if b <= a or N - a <= de_final_blocks() * BN or len(rounds) + 1 >= DE_MAX_ROUNDS:
            rounds.append((a, N, True))
            break
        rounds.append((a, b, False))
        a = b
    return rounds


def to_e_rows(stash: torch.Tensor, src: torch.Tensor, move_bytes: int) -> None:
    """In place: stash row r <- stash row src[r] (0 where src[r] < 0). Needs src[r] <= r (the
    valid-first order of increasing e2d rows); moves blocks of rows from the last one down
    through a temporary of at most ``move_bytes`` (Tuning.stash_move_bytes), so a block's
    sources are never overwritten before they are read."""
    M, D = stash.shape
    step = max(1, move_bytes // max(1, D * stash.element_size()))
    # Two ops per block (host time of a step at small N): the rows of src < 0 read row 0 and
    # are zeroed by one pass at the end.
    gone, src = src < 0, src.clamp(min=0)
    for r1 in range(M, 0, -step):
        r0 = max(0, r1 - step)
        tmp = stash.index_select(0, src[r0:r1])
        stash[r0:r1] = tmp
        del tmp  # before the next block's temporary is allocated (else two are alive at once)
    stash.masked_fill_(gone[:, None], 0)


def shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.numel() == 0 or b.numel() == 0:
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return b0 <= a0 < b0 + b.numel() * b.element_size()
