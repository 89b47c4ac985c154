"""Per-token outputs under vocabulary parallelism (docs/api.md, "Per-token outputs"): the cases
test_distributed.py's gloo groups run (a module of its own, imported by that file's workers; not
collected by pytest).

Each case compares the vocabulary-parallel call with the single-process call of the same impl on
the whole classifier: the loss and every output (lse, log-probabilities, entropy, argmax,
accuracy), and the gradients of one random linear functional of the differentiable ones

    loss * g + (lse, u_1) + (logprobs, u_2) + (entropy, u_3)

(u_k ~ N(0, 1) per token, drawn alike on every side), so that each output's gradient path is
exercised with its own weight. Tolerance: fp32 on both sides with the summation order the only
difference (the blocks' entropies combine as sum_r w_r (H_r + lse - lse_r), against one
softmax-weighted sum on one device): a few fp32 ulps of the row sums, as test_distributed's
TOL_FP32 (2e-5) allows; a wrong term (a missing w_r, lse - lse_r, or eta) is O(1e-2) or more.
The argmax must be equal wherever a row's two largest logits are apart by more than the
logits' fp32 rounding (rows within it may resolve either way; the exact-tie case makes its ties
on purpose, in exact arithmetic).
"""

from __future__ import annotations

import torch
from vp_common import TOL_FP32, D, V, case_seed, leaf, split_sizes

ALL = dict(
    return_lse=True, return_logprobs=True, return_entropy=True, return_argmax=True, return_accuracy=True
)
DIFF = ("loss", "lse", "logprobs", "entropy")  # the differentiable outputs

OUTPUT_CASES: dict[str, dict] = {
    "out_all_temperature_bias": dict(bias=True, opts=dict(**ALL, temperature=0.7)),
    "out_softcap_shift_none": dict(
        opts=dict(**ALL, softcap=4.0, shift=True, reduction="none", temperature=1.6), scale=3.0
    ),
    # (a small chunk budget: several row chunks in the chunked loop and in logits_at)
    "out_smoothing_weight_skewed": dict(
        weight=True,
        split="skewed",
        tuning=dict(chunk_bytes=2048),
        opts=dict(**ALL, label_smoothing=0.1, z_loss=1e-3, reduction="sum"),
    ),  # fmt: skip
    # The entropy asked for but only logged: the gradients are the loss's alone.
    "out_entropy_logged": dict(opts=dict(return_entropy=True, return_accuracy=True), logged=True),
    "out_masked_classes": dict(bias=True, masked=True, opts=dict(**ALL, temperature=0.8)),
    "out_filter_auto": dict(bias=True, opts=dict(**ALL, filter_eps="auto", temperature=0.9)),
    # The last rank's block masked whole by a -inf bias (a padded vocabulary): its lse is -inf, so
    # it adds no mass to the loss, the entropy or the gradients (the kernels report such a row's
    # lse as 0, and exp(-inf - -inf) is NaN).
    "out_masked_last_block": dict(
        bias=True, mask_last=True, split="skewed", opts=dict(**ALL, temperature=0.8)
    ),
    # Equal classifier rows in every block: the largest logit is tied across ranks, and the
    # smallest id (the first block's) must win, as torch.argmax. (The entropy is only logged:
    # with one dominant class split over equal copies its gradient is ~0, a difference of
    # logits of ~40, and its relative error would measure that cancellation only.)
    "out_ties_across_blocks": dict(
        ties=True, bias=True, logged=True, opts=dict(return_argmax=True, return_entropy=True)
    ),
}
# impl="triton" (Triton interpreter, fp32): the rank's block through the single-device op.
TRITON_OUTPUT_CASES: dict[str, dict] = {
    "out_triton_all": dict(
        bias=True, impl="triton", opts=dict(**ALL, temperature=0.7, shift=True, filter_eps=None)
    ),
    # The sparse backward per block while the outputs are only logged; the exact one (as on one
    # device) once the entropy's gradient is asked for.
    "out_triton_sparse_logged": dict(
        impl="triton",
        tuning=dict(backward="sparse"),
        logged=True,
        opts=dict(return_entropy=True, return_argmax=True, return_logprobs=True, filter_eps=1e-9),
    ),  # fmt: skip
    # The sparse backward per block at a temperature: each rank's statistics and filter of its
    # block's tempered logits, the gradients through every output.
    "out_triton_sparse_temperature": dict(
        impl="triton",
        tuning=dict(backward="sparse"),
        opts=dict(return_entropy=True, return_logprobs=True, filter_eps=1e-9, temperature=0.7),
    ),  # fmt: skip
    # Masked classes (a -inf bias, frozen: the sparse backward needs no bias gradient) at every
    # block's first class: the rows whose target lives on another rank must not take a masked
    # class as their stand-in target (its tile statistics' target term gave a NaN entropy).
    "out_triton_sparse_masked": dict(
        impl="triton",
        tuning=dict(backward="sparse"),
        bias=True,
        frozen_bias=True,
        masked=True,
        opts=dict(return_entropy=True, return_logprobs=True, filter_eps=1e-3),
    ),  # fmt: skip
    "out_triton_masked_last_block": dict(
        bias=True, mask_last=True, impl="triton", opts=dict(**ALL, temperature=0.8, filter_eps=None)
    ),
    "out_triton_sparse_entropy_grad": dict(
        impl="triton",
        tuning=dict(backward="sparse"),
        split="skewed",
        opts=dict(**ALL, softcap=4.0, filter_eps=1e-9),
    ),  # fmt: skip
}
# A group of one rank (Triton interpreter): a step with every output traces under
# torch.compile(fullgraph=True) and matches eager (backend aot_eager: no C++ compiler needed).
WORLD1_OUTPUT_CASES = ("out_w1_compile_fullgraph", "out_w1_compile_fullgraph_torch")
# Options drawn at random (seeded alike on every rank), each compared with the float64 oracle
# (cce.reference): a property test over temperature, softcap, shift, ignored tokens, label
# smoothing, z-loss, class weights, bias, reduction, the split and the outputs asked for.
RANDOM_OUTPUT_CASES = ("out_random_configs",)
RANDOM_CONFIGS = 10
# Every rank its own tokens (data parallel) with the classifier split by rows.
SHARDED_OUTPUT_CASES: dict[str, dict] = {
    "out_tokens_sharded": dict(bias=True, opts=dict(**ALL, temperature=0.8, shift=True)),
}


def _inputs(name: str, spec: dict, world: int, lead=(3, 11)):
    g = torch.Generator().manual_seed(case_seed(name))
    scale = spec.get("scale", 4.0)
    s = (scale / D**0.5) ** 0.5
    e = torch.randn(*lead, D, generator=g) * s
    c = torch.randn(V, D, generator=g) * s
    b = torch.randn(V, generator=g) * 0.5 if spec.get("bias") else None
    t = torch.randint(0, V, lead, generator=g)
    t[torch.rand(lead, generator=g) < 0.15] = -100
    w = torch.rand(V, generator=g) + 0.25 if spec.get("weight") else None
    if spec.get("masked"):
        # Classes masked by a -inf bias, each block's first among them (where a stand-in target
        # of 0 would read a -inf logit); no target on a masked class (its loss would be inf).
        sizes = split_sizes(world, spec.get("split", "even"))
        b[[sum(sizes[:r]) for r in range(world)]] = float("-inf")
        b[7::11] = float("-inf")
        t = torch.where((t >= 0) & (b[t.clamp(min=0)] == float("-inf")), t + 1, t)
    if spec.get("mask_last"):
        # the last block's classes all masked; targets there moved to the first block
        start = sum(split_sizes(world, spec.get("split", "even"))[:-1])
        b[start:] = float("-inf")
        t = torch.where(t >= start, t % start, t)
    if spec.get("ties"):
        # Exact arithmetic (multiples of 1/4 with |z| <= 10, sums exact in fp32), so that equal
        # rows give equal logits on every side; one class per block with the same row of c and
        # a bias of 32 beats every other logit and ties across the blocks.
        e = torch.randint(-2, 3, e.shape, generator=g) / 4.0
        c = torch.randint(-2, 3, c.shape, generator=g) / 4.0
        b = torch.zeros(V)
        for pos in _tie_positions(world, spec):
            c[pos], b[pos] = c[0], 32.0
    return e, c, t, b, w


def _tie_positions(world: int, spec: dict) -> list[int]:
    sizes = split_sizes(world, spec.get("split", "even"))
    return [sum(sizes[:r]) + min(sizes) // 2 for r in range(world)]


def _outputs_and_grads(fn, e, c, t, b, logged: bool, seed: int, **opts):
    """(outputs dict, [dE, dC, dbias]) of fn's call under the case's random linear functional."""
    out = fn(e, c, t, b, **opts)
    gen = torch.Generator().manual_seed(seed)
    total = 0.0
    vals = {}
    for name in out._fields:
        x = getattr(out, name)
        if x is None:
            continue
        vals[name] = x.detach()
        if name in DIFF and (name == "loss" or not logged):
            total = total + (x * torch.randn(x.shape, generator=gen, dtype=torch.float64).float()).sum()
    inputs = [x for x in (e, c, b) if x is not None and x.requires_grad]
    grads = iter(torch.autograd.grad(total, inputs, allow_unused=True))
    return vals, [next(grads) if x is not None and x.requires_grad else None for x in (e, c, b)]


def _compare(name: str, got, ref, block: slice, clear: torch.Tensor | None = None) -> None:
    from helpers import rel_err

    (vg, gg), (vr, gr) = got, ref
    assert vg.keys() == vr.keys(), f"{name}: outputs {sorted(vg)} vs {sorted(vr)}"
    for k in vr:
        if k == "argmax":
            m = torch.ones_like(vr[k], dtype=torch.bool) if clear is None else clear.reshape(vr[k].shape)
            bad = int((vg[k] != vr[k])[m].sum())
            assert bad == 0, f"{name}: argmax differs at {bad} tokens"
        elif k == "accuracy" and clear is not None and not bool(clear.all()):
            # Over the rows clear of near ties only, from the compared argmaxes: a near tie at
            # a target may flip one hit.
            continue
        else:
            err = rel_err(vg[k], vr[k])
            assert err <= TOL_FP32, f"{name}: {k} rel err {err:.3g}"
    for i, what in enumerate(("dE", "dC", "dbias")):
        a, b = gg[i], gr[i]
        if b is not None and i > 0:
            b = b[block]
        assert (a is None) == (b is None), f"{name}: {what} missing on one side"
        if a is not None:
            err = rel_err(a, b)
            assert err <= TOL_FP32, f"{name}: {what} rel err {err:.3g} > {TOL_FP32}"


def _clear_rows(e, c, b, opts: dict) -> torch.Tensor:
    """[N] bool: rows whose two largest logits (fp64, after softcap and the temperature) are apart
    by more than 4 delta, where delta = (D 2^-24 max ||e_i|| max ||c_v|| + 2^-24 max |z| [+ 4
    2^-24 softcap]) / T bounds a fp32 logit's rounding (a D-term dot product and the bias;
    softcap' <= 1, and tanh's own rounding): there every side's argmax is the same. -inf logits
    (masked classes) are left out of the bound."""
    e2, c2 = e.reshape(-1, D).double(), c.double()
    L = e2 @ c2.T + (0.0 if b is None else b.double())
    fin = L[torch.isfinite(L)]
    T = opts.get("temperature", 1.0)
    delta = D * 2.0**-24 * float(e2.norm(dim=1).max() * c2.norm(dim=1).max()) + 2.0**-24 * float(
        fin.abs().max()
    )
    if opts.get("softcap"):
        L = opts["softcap"] * torch.tanh(L / opts["softcap"])
        delta += 4 * 2.0**-24 * opts["softcap"]  # tanh's own fp32 rounding, a few ulps of the cap
    top2 = (L / T).topk(2, dim=1).values
    return (top2[:, 0] - top2[:, 1]) > 4 * delta / T


def run_output_case(name: str, rank: int, world: int, group, tuned) -> None:
    """One case on this rank (raises on failure); ``tuned`` is tests/helpers.tuned."""
    import cce
    from cce.distributed import vocab_parallel_sharded_tokens
    from cce.options import CCEOptions, Tuning

    if name in WORLD1_OUTPUT_CASES:
        _world1_compile(name, group, tuned)
        return
    if name in RANDOM_OUTPUT_CASES:
        for k in range(RANDOM_CONFIGS):
            _random_config(f"{name}-{k}", rank, world, group)
        return
    spec = {**OUTPUT_CASES, **TRITON_OUTPUT_CASES, **SHARDED_OUTPUT_CASES}[name]
    opts = dict(spec["opts"])
    impl = spec.get("impl", "torch")
    logged = spec.get("logged", False)
    fn = tuned(**spec.get("tuning", {}))
    sizes = split_sizes(world, spec.get("split", "even"))
    start = sum(sizes[:rank])
    block = slice(start, start + sizes[rank])
    if name in SHARDED_OUTPUT_CASES:
        # Every rank its own tokens (1 + r sequences): the outputs and dE compared with one
        # process on this rank's tokens; dC and dbias, the sum over ranks of every rank's
        # objective's gradient for the block, with the sum of the one-process gradients of every
        # rank's tokens (each under the upstream draws that rank makes).
        _, c, _, b, w = _inputs(name, spec, world)
        refs = []
        for r in range(world):
            e_r, _, t_r, _, _ = _inputs(f"{name}-{r}", spec, world, lead=(1 + r, 11))
            refs.append(_outputs_and_grads(lambda *a, **k: cce.linear_cross_entropy(*a, impl=impl, **k),
                                           leaf(e_r), leaf(c), t_r, leaf(b), logged, 7, **opts))  # fmt: skip
        e, _, t, _, _ = _inputs(f"{name}-{rank}", spec, world, lead=(1 + rank, 11))
        o = CCEOptions(**opts, impl=impl, tuning=Tuning(**spec.get("tuning", {})))

        def vp(e_, c_, t_, b_, **_k):
            return vocab_parallel_sharded_tokens(e_, c_, t_, b_, None, o, group, grad_divide=1.0)

        got = _outputs_and_grads(vp, leaf(e), leaf(c, block), t, leaf(b, block), logged, 7)
        summed = [None if refs[0][1][i] is None else sum(r[1][i] for r in refs) for i in (1, 2)]
        ref = (refs[rank][0], [refs[rank][1][0], *summed])
        _compare(name, got, ref, block)
        return
    e, c, t, b, w = _inputs(name, spec, world)

    def bias(x, rows=None):  # a frozen bias (no gradient) takes the sparse backward
        if spec.get("frozen_bias"):
            return None if x is None else x[rows if rows is not None else slice(None)].clone()
        return leaf(x, rows)

    ref = _outputs_and_grads(lambda *a, **k: fn(*a, weight=w, impl=impl, **k),
                             leaf(e), leaf(c), t, bias(b), logged, 7, **opts)  # fmt: skip
    wl = None if w is None else w[block]
    got = _outputs_and_grads(lambda *a, **k: fn(*a, weight=wl, process_group=group, impl=impl, **k),
                             leaf(e), leaf(c, block), t, bias(b, block), logged, 7, **opts)  # fmt: skip
    clear = None
    if not spec.get("ties"):
        clear = _clear_rows(e, c, b, opts).reshape(t.shape)
        if opts.get("shift"):
            clear = clear[..., :-1]
        assert clear.float().mean() > 0.9, f"{name}: too many near ties to compare the argmax"
    _compare(name, got, ref, block, clear)
    if spec.get("mask_last"):
        # the last block's classes all masked; targets there moved to the first block
        start = sum(split_sizes(world, spec.get("split", "even"))[:-1])
        b[start:] = float("-inf")
        t = torch.where(t >= start, t % start, t)
    if spec.get("ties"):
        valid = t.reshape(-1) != -100
        first = _tie_positions(world, spec)[0]  # the copy in the first block
        assert bool((got[0]["argmax"].reshape(-1)[valid] == first).all()), f"{name}: the tie is not exercised"


def _world1_compile(name: str, group, tuned) -> None:
    from helpers import rel_err

    e, c, t, b, _ = _inputs(name, dict(bias=True), 1)
    fn = tuned()
    impl = "torch" if name.endswith("_torch") else "triton"

    def step(e_, c_, b_):
        out = fn(e_, c_, t, b_, process_group=group, impl=impl, temperature=0.8, shift=True, **ALL)
        return out.loss - 0.1 * out.entropy.mean() + out.logprobs.sum(), out.argmax, out.accuracy

    leaves = [leaf(x) for x in (e, c, b)]
    eager = step(*leaves)
    g1 = torch.autograd.grad(eager[0], leaves)
    comp = torch.compile(step, fullgraph=True, backend="aot_eager")(*leaves)
    g2 = torch.autograd.grad(comp[0], leaves)
    assert rel_err(comp[0], eager[0]) <= TOL_FP32
    assert torch.equal(comp[1], eager[1]) and torch.equal(comp[2], eager[2])
    for a, b_ in zip(g2, g1, strict=True):
        assert rel_err(a, b_) <= TOL_FP32


def _random_config(name: str, rank: int, world: int, group) -> None:
    """One configuration drawn from ``name``'s seed, the vocabulary-parallel call (impl="torch",
    exact) against the float64 oracle."""
    import cce
    from cce.reference import linear_cross_entropy_reference

    g = torch.Generator().manual_seed(case_seed(name))

    def coin(p=0.5) -> bool:
        return bool(torch.rand((), generator=g) < p)

    outs = {k: coin() for k in ALL}
    outs["return_entropy"] = outs["return_entropy"] or not any(outs.values())  # at least one output
    opts = dict(
        outs,
        temperature=float(torch.empty(()).uniform_(0.4, 2.5, generator=g)),
        softcap=float(torch.empty(()).uniform_(2.0, 12.0, generator=g)) if coin() else None,
        shift=coin(),
        reduction=("mean", "sum", "none")[int(torch.randint(3, (), generator=g))],
        label_smoothing=0.1 if coin(0.3) else 0.0,
        z_loss=1e-3 if coin(0.3) else 0.0,
    )
    spec = dict(
        bias=coin(), weight=coin(0.3), split="skewed" if coin() else "even", scale=float(1 + 8 * coin())
    )
    logged = coin(0.3)
    e, c, t, b, w = _inputs(name, spec, world)
    sizes = split_sizes(world, spec["split"])
    block = slice(sum(sizes[:rank]), sum(sizes[: rank + 1]))
    ref = _outputs_and_grads(
        lambda *a, **k: linear_cross_entropy_reference(*a, weight=w, dtype=torch.float64, **k),
        leaf(e), leaf(c), t, leaf(b), logged, 11, **opts,
    )  # fmt: skip
    wl = None if w is None else w[block]
    got = _outputs_and_grads(
        lambda *a, **k: cce.linear_cross_entropy(*a, weight=wl, process_group=group, impl="torch",
                                                 filter_eps=None, **k),
        leaf(e), leaf(c, block), t, leaf(b, block), logged, 11, **opts,
    )  # fmt: skip
    clear = _clear_rows(e, c, b, opts).reshape(t.shape)
    if opts["shift"]:
        clear = clear[..., :-1]
    try:
        _compare(name, got, ref, block, clear)
    except AssertionError as exc:
        raise AssertionError(f"{exc} (options {opts}, {spec}, logged {logged})") from None
