"""Vocabulary-parallel cce and FSDP2 heads on CPU: gloo process groups on 127.0.0.1, started here.

One group of 2 and one of 3 processes (torch.multiprocessing spawn, a free port) run every case
below once; each case's outcome on each rank comes back in a JSON file and is one pytest item.
Equality cases compare the distributed loss, lse and gradients with the single-process result
(impl="torch" on the whole classifier) under the same random upstream gradients; error cases
check that every rank raises a clear error (none hangs: gloo's timeout is short), with the set-up
checked at every call; cache cases test the default, checked once per set-up. A group of one
process runs the world-size-1 cases (equality with one device, torch.compile).
"""

from __future__ import annotations

import inspect
import json
import os
import socket
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: helpers
sys.path.insert(0, str(Path(__file__).resolve().parent))  # output_cases, vp_common

from helpers import (  # noqa: E402
    THOROUGH,
    filter_error_bounds,
    loss_and_grads,
    make_linear_inputs,
    rel_err,
    tuned,
)
from output_cases import (  # noqa: E402
    OUTPUT_CASES,
    RANDOM_OUTPUT_CASES,
    SHARDED_OUTPUT_CASES,
    TRITON_OUTPUT_CASES,
    WORLD1_OUTPUT_CASES,
    run_output_case,
)
from vp_common import TOL_FP32, D, V, case_seed, leaf, split_sizes  # noqa: E402

import cce  # noqa: E402
import cce.distributed  # noqa: E402
from cce.distributed import (  # noqa: E402
    linear_cross_entropy_vocab_parallel,
    lm_head_linear_cross_entropy,
)
from cce.reference import linear_cross_entropy_reference  # noqa: E402

# bf16 inputs: both sides accumulate in fp32 and round the gradients to bf16 once; the rounding
# (2^-8 relative per entry) can land differently when the fp32 values differ in the last bits.
TOL_BF16 = 1e-2
# The tokens (batch, sequence) of the inputs: (3, 11); those of the cases whose sparse backward
# the interpreter runs most (triton_sparse, w1_explain, w1_compile_fullgraph): 2 sequences of 9,
# 16 rows after the shift (one token block with a partial valid part; every row in the slab
# rule's sample, as with the 30 of (3, 11)), where their launches take about half the time.
SMALL_LEAD = (2, 9)


EQ_CASES: dict[str, dict] = {
    "mean": dict(),
    "sum": dict(opts=dict(reduction="sum")),
    "none": dict(opts=dict(reduction="none")),
    "shift": dict(opts=dict(shift=True)),
    "softcap": dict(opts=dict(softcap=3.0), scale=9.0),
    "label_smoothing": dict(opts=dict(label_smoothing=0.2)),
    "smoothing_softcap_none": dict(opts=dict(label_smoothing=0.1, softcap=2.0, reduction="none")),
    "weight": dict(weight=True),
    "weight_smoothing_sum": dict(weight=True, opts=dict(label_smoothing=0.3, reduction="sum")),
    "z_loss": dict(opts=dict(z_loss=1e-2)),
    "return_lse": dict(opts=dict(return_lse=True)),
    "return_lse_none_shift": dict(opts=dict(return_lse=True, reduction="none", shift=True)),
    "bias": dict(bias=True),
    "bias_everything": dict(
        bias=True,
        weight=True,
        opts=dict(shift=True, softcap=4.0, label_smoothing=0.1, z_loss=1e-3, return_lse=True),
    ),
    "uneven_blocks": dict(split="skewed"),
    "all_ignored": dict(ignore_frac=1.0, bias=True),
    "ignore_index_0": dict(opts=dict(ignore_index=0)),
    "multi_chunk": dict(chunk_bytes=2048, bias=True, opts=dict(label_smoothing=0.1)),
    "bf16": dict(dtype=torch.bfloat16, bias=True),
    "filter_auto": dict(opts=dict(filter_eps="auto")),
}
# impl="triton" (Triton interpreter on CPU: fp32 only, bf16 dots are wrong there), compared with
# the single-process Triton result. Skipped on a CUDA machine (these groups hold CPU tensors).
TRITON_CASES: dict[str, dict] = {
    "triton_mean": dict(opts=dict(impl="triton", filter_eps=None)),
    "triton_everything": dict(
        bias=True,
        weight=True,
        split="skewed",
        opts=dict(impl="triton", shift=True, softcap=4.0, label_smoothing=0.1, z_loss=1e-3, return_lse=True),
    ),
    "triton_smoothing_none": dict(opts=dict(impl="triton", label_smoothing=0.2, reduction="none")),
    "triton_smoothing_weight_bias": dict(
        bias=True, weight=True, opts=dict(impl="triton", label_smoothing=0.2, reduction="sum")
    ),
    "triton_filter_auto": dict(bias=True, opts=dict(impl="triton", filter_eps="auto")),
    # The sparse backward (the single-device fast path) on every block: with a threshold far
    # below the softmax entries here, the skipped tiles' mass is < 1e-9 per entry and both sides
    # are exact up to fp32 rounding, so the per-block coefficients (alpha = g_lse, beta = -g_tgt,
    # gamma = -g_ssum through local.block_stats) are compared at TOL_FP32. The stand-in
    # target of rows whose target is on another rank is every rank's case here.
    "triton_sparse": dict(
        tuning=dict(backward="sparse"),
        opts=dict(impl="triton", filter_eps=1e-9, shift=True),
        lead=SMALL_LEAD,
    ),
    "triton_sparse_everything": dict(
        weight=True,
        split="skewed",
        tuning=dict(backward="sparse"),
        opts=dict(impl="triton", filter_eps=1e-9, label_smoothing=0.2, z_loss=1e-3, return_lse=True),
    ),
    "triton_sparse_softcap_none": dict(
        tuning=dict(backward="sparse"),
        opts=dict(impl="triton", filter_eps=1e-9, softcap=4.0, reduction="none"),
    ),
}
INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"
# filter_eps with impl="torch": every rank filters its own block with impl="torch"'s CPU tile
# filter (as the Triton path does per block). A block skips entries with |alpha_loc| p_loc <
# eps * max |alpha_loc|, and alpha_loc p_loc = alpha p while max |alpha_loc| <= max |alpha|, so the
# skipped set is one helpers.filter_error_bounds covers: the error vs the fp64 oracle stays within
# that proven bound plus fp32 rounding (filter_eps=1e-3 on peaked logits, so tiles are skipped).
FILTER_CASES = {"filter_1e-3": dict(opts=dict(filter_eps=1e-3), scale=16.0)}
# impl="triton"'s sparse backward per block (the single-device fast path, interpreter): the block
# filters on its own softmax p_loc = p exp(lse - lse_r) >= p, so every entry it skips has
# p < eps as well, and the same bound applies (cce/distributed/vocab_parallel.py).
TRITON_FILTER_CASES = {
    "triton_filter_sparse_1e-3": dict(
        opts=dict(filter_eps=1e-3), impl="triton", tuning=dict(backward="sparse"), scale=16.0
    )
}
DTENSOR_CASES = ("dtensor", "dtensor_bias_shift")
# Data parallel (each rank its own tokens, different counts) with the classifier split by rows:
# vocab_parallel_sharded_tokens against one process on each rank's own tokens.
SHARDED_TOKEN_CASES: dict[str, dict] = {
    "tokens_sharded_mean": dict(bias=True, opts=dict(shift=True)),
    "tokens_sharded_everything": dict(
        bias=True,
        weight=True,
        opts=dict(softcap=4.0, label_smoothing=0.1, z_loss=1e-3, return_lse=True, reduction="none"),
    ),  # fmt: skip
}
# ... with impl="triton" (interpreter): the gathered tokens' block through the single-device op.
TRITON_SHARDED_TOKEN_CASES: dict[str, dict] = {
    "tokens_sharded_triton": dict(
        impl="triton",
        tuning=dict(backward="sparse"),
        opts=dict(shift=True, label_smoothing=0.1, filter_eps=1e-9),
    ),
}
ERROR_CASES = (
    "err_e_mismatch",
    "err_targets_mismatch",
    "err_n_mismatch",
    "err_option_mismatch",
    "err_egrad_mismatch",
    "err_local_bad_shape",
    "err_empty_block",
    "err_target_beyond_blocks",
    "err_dtensor_not_covering",
    "err_no_group",
)
# The set-up check's cache (check="once", the default): checked at a set-up's first call on every
# rank, then no collective (a rank's e perturbed alone goes unnoticed, as documented); every call
# with check="always", CCE_DEBUG=1 or anomaly detection; a new set-up (shapes) checked again.
CACHE_CASES = ("cache_once", "cache_new_setup")
# ... and a cached set-up traces under torch.compile(fullgraph=True) (impl="triton": interpreter).
CACHE_COMPILE_CASES = ("cache_compile",)
# A group of one rank: no set-up collective; impl="triton"'s
# sparse backward equals the single-device call's (the same vocabulary tiles: only the per-row
# coefficients' rounding differs); a step traces under torch.compile(fullgraph=True) (the
# interpreter's kernels behind the custom ops; backend aot_eager: no C++ compiler needed).
WORLD1_CASES = ("w1_sparse_equal", "w1_autocast", "w1_explain", "w1_compile_fullgraph")
WORLD1_LEADS = {"w1_explain": SMALL_LEAD, "w1_compile_fullgraph": SMALL_LEAD}
FSDP_CASES = ("fsdp_head_separate", "fsdp_head_vocab_parallel", "fsdp_root_only_inside_forward")
# cce.linear_cross_entropy(..., process_group=) and a DTensor classifier through the public API
# (run once cce.linear forwards them to cce.distributed).
API_INTEGRATED = "process_group" in inspect.signature(cce.linear_cross_entropy).parameters
API_CASES = ("api_process_group", "api_dtensor", "api_module", "api_verl")
# cce.transformers.patch on a tiny Llama under FSDP2 (lm_head in the root's group, or its own).
# Only in the 2-process group (importing transformers costs ~8 s per process on 2 cores).
HF_CASES = ("hf_patch_fsdp_layers", "hf_patch_fsdp_head")
try:
    import transformers
except ImportError:
    transformers = None


def _inputs(name: str, spec: dict):
    g = torch.Generator().manual_seed(case_seed(name))
    e, c, t, b = make_linear_inputs(
        spec.get("lead", (3, 11)),
        D,
        V,
        spec.get("dtype", torch.float32),
        bias=spec.get("bias", False),
        ignore_frac=spec.get("ignore_frac", 0.15),
        scale=spec.get("scale", 4.0),
        generator=g,
    )
    w = (torch.rand(V, generator=g) + 0.25) if spec.get("weight") else None
    return e, c, t, b, w


def _compare(name, got, ref, tol, block):
    (l1, s1, g1), (l2, s2, g2) = got, ref
    assert rel_err(l1, l2) <= tol, f"{name}: loss {l1} vs {l2}"
    if s2 is not None:
        assert rel_err(s1, s2) <= tol, f"{name}: lse rel err {rel_err(s1, s2)}"
    names = ("dE", "dC", "dbias")
    for i, (a, b) in enumerate(zip(g1, g2, strict=True)):
        if i > 0 and b is not None:
            b = b[block]
        if a is None or b is None:
            assert a is None and b is None, f"{name}: {names[i]} missing on one side"
            continue
        err = rel_err(a, b)
        assert err <= tol, f"{name}: {names[i]} rel err {err:.3g} > {tol}"


def _eq_case(name, spec, rank, world, group):
    e, c, t, b, w = _inputs(name, spec)
    opts = dict(spec.get("opts", {}))
    impl = opts.pop("impl", "torch")
    sizes = split_sizes(world, spec.get("split", "even"))
    start = sum(sizes[:rank])
    block = slice(start, start + sizes[rank])
    # A small chunk budget (one device and every block share impl="torch"'s loop) makes
    # several row chunks.
    fn = tuned(chunk_bytes=spec.get("chunk_bytes"), **spec.get("tuning", {}))
    ref = loss_and_grads(
        lambda *a, **k: fn(*a, weight=w, impl=impl, **k),
        leaf(e),
        leaf(c),
        t,
        leaf(b),
        generator=torch.Generator().manual_seed(7),
        **opts,
    )
    wl = None if w is None else w[block]
    got = loss_and_grads(
        lambda *a, **k: fn(*a, weight=wl, process_group=group, impl=impl, **k),
        leaf(e),
        leaf(c, block),
        t,
        leaf(b, block),
        generator=torch.Generator().manual_seed(7),
        **opts,
    )
    tol = TOL_BF16 if spec.get("dtype") == torch.bfloat16 else TOL_FP32
    _compare(name, got, ref, tol, block)


def _filter_case(name, spec, rank, world, group):
    e, c, t, b, w = _inputs(name, spec)
    opts = spec["opts"]
    vp = tuned(**spec.get("tuning", {}))
    sizes = split_sizes(world, "even")
    start = sum(sizes[:rank])
    block = slice(start, start + sizes[rank])

    def run(fn, *args):
        return loss_and_grads(fn, *args, generator=torch.Generator().manual_seed(3), **opts)

    exact = run(
        lambda *a, **k: linear_cross_entropy_reference(*a, dtype=torch.float64, **k),
        leaf(e),
        leaf(c),
        t,
        None,
    )
    par = run(
        lambda *a, **k: vp(*a, process_group=group, impl=spec.get("impl", "auto"), **k),
        leaf(e),
        leaf(c, block),
        t,
        None,
    )
    # The upstream gradient loss_and_grads drew (mean loss: one scalar, first draw of seed 3).
    up = torch.randn((), generator=torch.Generator().manual_seed(3), dtype=torch.float64).float()
    bound = filter_error_bounds(e, c, t, None, up, None, opts["filter_eps"], **opts)
    for i, what in enumerate(("dE", "dC")):
        ref_i = exact[2][i] if i == 0 else exact[2][i][block]
        err = float((par[2][i].double() - ref_i.double()).norm())
        allowed = bound["e" if i == 0 else "c"] + TOL_FP32 * float(ref_i.double().norm())
        assert err <= allowed, f"{name}: {what} error {err:.3g} above the filter bound {allowed:.3g}"
    assert rel_err(par[0], exact[0]) <= TOL_FP32


def _sharded_tokens_case(name, spec, rank, world, group):
    from cce.distributed import vocab_parallel_sharded_tokens
    from cce.options import CCEOptions, Tuning

    opts = spec["opts"]
    impl = spec.get("impl", "torch")
    inputs = [_inputs(f"{name}-{r}", spec) for r in range(world)]
    # Every rank's tokens: the first 3 + r sequences (different counts per rank); c, b, w shared.
    _, c, _, b, w = inputs[0]
    toks = [(inp[0][: 1 + r % 3], inp[2][: 1 + r % 3]) for r, inp in enumerate(inputs)]
    sizes = split_sizes(world, "skewed")
    block = slice(sum(sizes[:rank]), sum(sizes[: rank + 1]))
    refs = [
        loss_and_grads(
            lambda *a, **k: cce.linear_cross_entropy(*a, weight=w, impl=impl, **k),
            leaf(er),
            leaf(c),
            tr,
            leaf(b),
            generator=torch.Generator().manual_seed(7 + r),
            **opts,
        )  # fmt: skip
        for r, (er, tr) in enumerate(toks)
    ]
    e, t = toks[rank]
    wl = None if w is None else w[block]

    def fn(e_, c_, t_, b_, **k):
        o = CCEOptions(impl=impl, tuning=Tuning(**spec.get("tuning", {})), **k)
        return vocab_parallel_sharded_tokens(e_, c_, t_, b_, wl, o, group)

    got = loss_and_grads(fn, leaf(e), leaf(c, block), t, leaf(b, block),
                         generator=torch.Generator().manual_seed(7 + rank), **opts)  # fmt: skip
    # This rank's loss and dE are its own tokens'; dC / dbias of the block sum every rank's.
    ref_loss, ref_lse, ref_grads = refs[rank]
    summed = [ref_grads[0]] + [sum(ref[2][i] for ref in refs) for i in range(1, len(ref_grads))]
    _compare(name, got, (ref_loss, ref_lse, summed), TOL_FP32, block)


def _dtensor_case(name, rank, world, group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    with_bias = name == "dtensor_bias_shift"
    opts = dict(shift=True, label_smoothing=0.1) if with_bias else {}
    e, c, t, b, _ = _inputs(name, dict(bias=with_bias))
    ref = loss_and_grads(
        lambda *a, **k: cce.linear_cross_entropy(*a, impl="torch", **k),
        leaf(e),
        leaf(c),
        t,
        leaf(b),
        generator=torch.Generator().manual_seed(5),
        **opts,
    )
    c_dt = distribute_tensor(c.detach(), mesh, [Shard(0)]).requires_grad_()
    b_dt = None if b is None else distribute_tensor(b.detach(), mesh, [Shard(0)]).requires_grad_()
    loss, lse, grads = loss_and_grads(
        lambda *a, **k: linear_cross_entropy_vocab_parallel(*a, **k),
        leaf(e),
        c_dt,
        t,
        b_dt,
        generator=torch.Generator().manual_seed(5),
        **opts,
    )
    # torch.chunk's split (what Shard(0) uses): ceil(V / world) rows per rank, the rest last.
    per = -(-V // world)
    block = slice(min(rank * per, V), min((rank + 1) * per, V))
    grads = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
    _compare(name, (loss, lse, grads), ref, TOL_FP32, block)


def _expect(fn, types, text):
    try:
        fn()
    except types as exc:
        assert text in str(exc), f"message {str(exc)!r} lacks {text!r}"
        return
    raise AssertionError(f"no error raised (expected {types} with {text!r})")


def _error_case(name, rank, world, group):
    e, c, t, b, _ = _inputs(name, dict())
    sizes = split_sizes(world, "even")
    start = sum(sizes[:rank])
    cl = c.detach()[start : start + sizes[rank]]
    ed = e.detach()

    # check="always": these calls share set-ups (shapes, options) with other cases, whose checked
    # set-ups the default check="once" caches (cache_* cases test that mode).
    def vp(e_, c_, t_, **k):
        return linear_cross_entropy_vocab_parallel(e_, c_, t_, process_group=group, check="always", **k)

    last = rank == world - 1
    if name == "err_e_mismatch":
        e2 = ed + 1e-3 if last else ed
        _expect(lambda: vp(e2, cl, t), ValueError, "e differs across ranks")
    elif name == "err_targets_mismatch":
        t2 = t.clone()
        if last:
            t2[0, 0] = (int(t2[0, 0]) + 1) % V
        _expect(lambda: vp(ed, cl, t2), ValueError, "targets differs across ranks")
    elif name == "err_n_mismatch":
        n = 2 if last else 3
        _expect(lambda: vp(ed[:n], cl, t[:n]), ValueError, "'N' differs across ranks")
    elif name == "err_option_mismatch":
        ls = 0.1 if last else 0.0
        _expect(lambda: vp(ed, cl, t, label_smoothing=ls), ValueError, "'label_smoothing' differs")
    elif name == "err_egrad_mismatch":  # only some ranks would all-reduce dE in backward
        e2 = ed.clone().requires_grad_(last)
        _expect(lambda: vp(e2, cl, t), ValueError, "'e_grad' differs")
    elif name == "err_local_bad_shape":
        c2 = cl[:, :-1] if last else cl
        if last:
            _expect(lambda: vp(ed, c2, t), ValueError, "hidden size mismatch")
        else:
            _expect(lambda: vp(ed, c2, t), RuntimeError, f"rank(s) [{world - 1}]")
    elif name == "err_empty_block":
        c2 = cl[:0] if last else cl
        if last:
            _expect(lambda: vp(ed, c2, t), ValueError, "at least one row")
        else:
            _expect(lambda: vp(ed, c2, t), RuntimeError, "rejected their inputs")
    elif name == "err_target_beyond_blocks":
        c2 = cl[:-1] if last else cl  # the blocks now cover V - 1 rows
        t2 = t.clone()
        t2[0, 0] = V - 1
        _expect(lambda: vp(ed, c2, t2), IndexError, f"[0, {V - 1})")
    elif name == "err_dtensor_not_covering":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Shard

        mesh = init_device_mesh("cpu", (world,))
        # A DTensor claiming more rows than its shards hold (run_check=False skips torch's check).
        c_dt = DTensor.from_local(cl, mesh, [Shard(0)], run_check=False, shape=(V + 5, D), stride=(D, 1))
        _expect(
            lambda: linear_cross_entropy_vocab_parallel(ed, c_dt, t, check="always"),
            ValueError,
            "do not cover",
        )
    elif name == "err_no_group":
        _expect(lambda: linear_cross_entropy_vocab_parallel(ed, cl, t), ValueError, "process_group")
    else:
        raise KeyError(name)
    dist.barrier(group)  # every rank got here: nobody hangs in a collective


def _cache_case(name, rank, world, group):
    # (2, 5 + world) tokens: a set-up no other case uses (the cache is per process and group).
    g = torch.Generator().manual_seed(case_seed(name))
    e, c, t, _ = make_linear_inputs((2, 5 + world), D, V, torch.float32, ignore_frac=0.1, generator=g)
    sizes = split_sizes(world, "even")
    cl = c[sum(sizes[:rank]) : sum(sizes[: rank + 1])]
    last = rank == world - 1
    e_bad = e + 1e-3 if last else e

    def vp(e_, t_=t, **k):
        return linear_cross_entropy_vocab_parallel(e_, cl, t_, process_group=group, impl="torch", **k)

    if name == "cache_once":
        # A set-up's first call is checked on every rank (a failed check caches nothing).
        _expect(lambda: vp(e_bad), ValueError, "e differs across ranks")
        ref = vp(e, check="always")
        assert torch.equal(vp(e), ref)  # checked and cached
        assert torch.equal(vp(e), ref)  # from the cache: the same layout
        vp(e_bad)  # from the cache: no collective check, so no error (documented)
        _expect(lambda: vp(e_bad, check="always"), ValueError, "e differs across ranks")
        os.environ["CCE_DEBUG"] = "1"
        try:
            _expect(lambda: vp(e_bad), ValueError, "e differs across ranks")
        finally:
            del os.environ["CCE_DEBUG"]
        with torch.autograd.set_detect_anomaly(True):
            _expect(lambda: vp(e_bad), ValueError, "e differs across ranks")
    elif name == "cache_compile":
        el = e.clone().requires_grad_()
        cb = cl.clone().requires_grad_()

        def step(e_, c_):
            return linear_cross_entropy_vocab_parallel(e_, c_, t, process_group=group, impl="triton")

        eager = step(el, cb)  # checks and caches the set-up
        ge, gc = torch.autograd.grad(eager, (el, cb))
        comp = torch.compile(step, fullgraph=True, backend="aot_eager")(el, cb)
        ge2, gc2 = torch.autograd.grad(comp, (el, cb))
        assert (
            rel_err(comp, eager) <= TOL_FP32 and rel_err(ge2, ge) <= TOL_FP32 and rel_err(gc2, gc) <= TOL_FP32
        )
    elif name == "cache_new_setup":
        vp(e)  # cached
        # A different N is a new set-up on every rank: checked, here an option differs.
        ls = 0.1 if last else 0.0
        _expect(lambda: vp(e[:1], t[:1], label_smoothing=ls), ValueError, "'label_smoothing' differs")
        _expect(lambda: vp(e, check="sometimes"), ValueError, "check must be one of")
    else:
        raise KeyError(name)
    dist.barrier(group)


def _world1_case(name, rank, world, group):
    e, c, t, b, w = _inputs(name, dict(weight=True, lead=WORLD1_LEADS.get(name, (3, 11))))
    fn = tuned(backward="sparse")
    opts = dict(impl="triton", filter_eps=1e-3, shift=True, label_smoothing=0.1)

    def vp(e_, c_, t_, b_=None, **k):
        return fn(e_, c_, t_, b_, weight=w, process_group=group, **opts, **k)

    if name == "w1_sparse_equal":
        ref = loss_and_grads(lambda *a, **k: fn(*a, weight=w, **opts, **k), leaf(e), leaf(c), t, None,
                             generator=torch.Generator().manual_seed(3), reduction="none")  # fmt: skip
        got = loss_and_grads(
            vp, leaf(e), leaf(c), t, None, generator=torch.Generator().manual_seed(3), reduction="none"
        )
        _compare(name, got, ref, TOL_FP32, slice(None))
    elif name == "w1_autocast":
        # Under autocast the process group's call computes in bf16 as the one-device call does
        # (its operands cast as lm_head's would be): the same loss to fp32 rounding, where
        # computing in fp32 instead differs by ~5e-4; fp32 gradients for the fp32 leaves.
        tf = cce.linear_cross_entropy

        def run(**k):
            el, cl = leaf(e), leaf(c)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = tf(el, cl, t, impl="torch", shift=True, **k)
            return (loss, *torch.autograd.grad(loss, (el, cl)))

        got, ref = run(process_group=group), run()
        with torch.autocast("cpu", enabled=False):
            fp32 = tf(leaf(e), leaf(c), t, impl="torch", shift=True)
        assert rel_err(ref[0], fp32) > 1e-5  # (the case tells the two apart)
        assert rel_err(got[0], ref[0]) <= TOL_FP32, f"{name}: loss {got[0]} vs {ref[0]}"
        for a, r in zip(got[1:], ref[1:], strict=True):
            assert a.dtype == torch.float32 and rel_err(a, r) <= TOL_BF16
    elif name == "w1_explain":
        # cce.explain's plan for the rank's block against the path its op takes (the triton
        # forward's threshold and tile statistics), exact and sparse
        import cce.ops.linear_ce.triton_impl as ti

        real, seen = ti.linear_ce_triton_fwd, []

        def spy(*a):
            seen.append((a[11], a[12]))
            return real(*a)

        spy.args_type = real.args_type  # (block_stats reads the op's argument names)
        ti.linear_ce_triton_fwd = spy
        try:
            for eps_in in (None, 1e-3):
                o = dict(opts, filter_eps=eps_in)
                el, cl = leaf(e), leaf(c)
                plan = cce.explain(
                    el, cl, t, weight=w, tuning=cce.Tuning(backward="sparse"), process_group=group, **o
                )
                seen.clear()
                fn(el, cl, t, weight=w, process_group=group, **o).backward()
                eps, stats = seen[0]
                assert stats == (plan.backward == "sparse") and (eps == 0) == (plan.backward == "exact"), seen
                assert plan.backward == ("exact" if eps_in is None else "sparse"), plan
        finally:
            ti.linear_ce_triton_fwd = real
    elif name == "w1_compile_fullgraph":
        el, cl = leaf(e), leaf(c)
        eager = vp(el, cl, t)
        ge, gc = torch.autograd.grad(eager, (el, cl))
        comp = torch.compile(vp, fullgraph=True, backend="aot_eager")(el, cl, t)
        ge2, gc2 = torch.autograd.grad(comp, (el, cl))
        assert (
            rel_err(comp, eager) <= TOL_FP32 and rel_err(ge2, ge) <= TOL_FP32 and rel_err(gc2, gc) <= TOL_FP32
        )
    else:
        raise KeyError(name)


class _Model(torch.nn.Module):
    def __init__(self, head_bias=False):
        super().__init__()
        self.body = torch.nn.Linear(D, D)
        self.lm_head = torch.nn.Linear(D, V, bias=head_bias)

    def forward(self, x, t=None):
        h = torch.tanh(self.body(x))
        if t is None:
            return h
        # As a patched model forward would: loss on the head's weight, inside the forward.
        return cce.linear_cross_entropy(h, self.lm_head.weight, t, impl="torch", shift=True)


def _fsdp_case(name, rank, world, group):
    """FSDP2 (data parallel): each rank its own tokens; the sharded head's gradient after
    FSDP2's reduce-scatter must equal the one-device gradient of the mean of the ranks' losses."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(case_seed(name))
    vp = name == "fsdp_head_vocab_parallel"
    model = _Model(head_bias=vp)
    ref_model = copy.deepcopy(model)
    data = []
    for r in range(world):
        g = torch.Generator().manual_seed(case_seed(name) + r)
        T = 9 + 2 * r if vp else 9  # vocab_parallel: ranks with different token counts
        x = torch.randn(2, T, D, generator=g)
        t = torch.randint(0, V, (2, T), generator=g)
        t[0, 3] = -100
        data.append((x, t))
    if vp:
        fully_shard(model.lm_head, mesh=mesh)
        fully_shard(model, mesh=mesh)

        def step(m, x, t):
            return lm_head_linear_cross_entropy(
                m.lm_head, m(x), t, fsdp="vocab_parallel", shift=True, label_smoothing=0.1, impl="torch"
            )

    elif name == "fsdp_head_separate":
        fully_shard(model.lm_head, mesh=mesh)
        fully_shard(model, mesh=mesh)

        def step(m, x, t):
            return lm_head_linear_cross_entropy(m.lm_head, m(x), t, shift=True, impl="torch")

        # The lm_head's weight is sharded outside its own forward: plain linear_cross_entropy
        # would read a DTensor; vocabulary parallelism on it must refuse data-parallel tokens.
        x, t = data[rank]
        assert hasattr(model.lm_head.weight, "to_local")
        if world > 1:
            _expect(
                lambda: linear_cross_entropy_vocab_parallel(model(x).detach(), model.lm_head.weight, t),
                ValueError,
                "differs across ranks",
            )
    else:
        fully_shard(model, mesh=mesh)

        def step(m, x, t):
            return m(x, t)

    x, t = data[rank]
    step(model, x, t).backward()
    # One device: FSDP2 averages gradients over ranks, i.e. the gradient of the mean loss.
    total = sum(step(ref_model, xr, tr) for xr, tr in data) / world
    total.backward()
    for (pname, p), (_, q) in zip(model.named_parameters(), ref_model.named_parameters(), strict=True):
        got = p.grad.full_tensor()
        err = rel_err(got, q.grad)
        assert err <= TOL_FP32, f"{name}: grad of {pname} rel err {err:.3g}"
    # The head's gradient stays sharded (FSDP2 reduce-scattered it): never a whole tensor here.
    assert model.lm_head.weight.grad.to_local().shape[0] < V


def _verl_case(name, rank, world, group):
    """cce.verl.linear_cross_entropy with dist_process_group (verl's tensor parallelism): every
    rank's log-probabilities, entropies and gradients (its block of dC) equal the one-process
    call's, under random upstream gradients on both outputs, at a temperature."""
    import cce.verl

    e, c, t, _, _ = _inputs(name, dict(ignore_frac=0.0))
    g = torch.Generator().manual_seed(11)
    up = torch.randn(2, t.numel(), generator=g)
    sizes = split_sizes(world, "skewed")
    block = slice(sum(sizes[:rank]), sum(sizes[: rank + 1]))

    def run(c_in, pg):
        e_in = leaf(e)
        lp, ent = cce.verl.linear_cross_entropy(e_in, c_in, t, 0.7, "none", pg)
        (lp * up[0] + ent * up[1]).sum().backward()
        return lp.detach(), ent.detach(), e_in.grad, c_in.grad

    ref = run(leaf(c), None)
    got = run(leaf(c, block), group)
    for k, a, b in zip(("logprobs", "entropy", "dE"), got[:3], ref[:3], strict=True):
        assert rel_err(a, b) <= TOL_FP32, f"{name}: {k} rel err {rel_err(a, b):.3g}"
    assert rel_err(got[3], ref[3][block]) <= TOL_FP32, f"{name}: dC rel err"


def _api_case(name, rank, world, group):
    if name == "api_verl":
        return _verl_case(name, rank, world, group)
    e, c, t, b, _ = _inputs(name, dict(bias=True))
    opts = dict(label_smoothing=0.1, shift=True)
    ref = loss_and_grads(
        lambda *a, **k: cce.linear_cross_entropy(*a, impl="torch", **k),
        leaf(e), leaf(c), t, leaf(b), generator=torch.Generator().manual_seed(9), **opts,
    )  # fmt: skip
    if name == "api_dtensor":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        mesh = init_device_mesh("cpu", (world,))
        c_in = distribute_tensor(c.detach(), mesh, [Shard(0)]).requires_grad_()
        b_in = distribute_tensor(b.detach(), mesh, [Shard(0)]).requires_grad_()
        per = -(-V // world)
        block = slice(min(rank * per, V), min((rank + 1) * per, V))
        fn = lambda *a, **k: cce.linear_cross_entropy(*a, impl="torch", **k)  # noqa: E731
    else:
        sizes = split_sizes(world, "skewed")
        block = slice(sum(sizes[:rank]), sum(sizes[: rank + 1]))
        c_in, b_in = leaf(c, block), leaf(b, block)
        if name == "api_module":
            mod = cce.LinearCrossEntropy(impl="torch", process_group=group, **opts)
            fn = lambda e_, c_, t_, b_: mod(e_, c_, t_, b_)  # noqa: E731
            opts = {}
        else:
            fn = lambda *a, **k: cce.linear_cross_entropy(*a, impl="torch", process_group=group, **k)  # noqa: E731
    loss, lse, grads = loss_and_grads(
        fn, leaf(e), c_in, t, b_in, generator=torch.Generator().manual_seed(9), **opts
    )
    grads = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
    _compare(name, (loss, lse, grads), ref, TOL_FP32, block)


def _hf_case(name, rank, world, group):
    """Data parallel: the patched, sharded model's gradients (after FSDP2's reduce-scatter, an
    average over ranks) must equal those of the unpatched model on one device for the mean of
    the ranks' losses."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import cce.transformers as cce_hf

    mesh = init_device_mesh("cpu", (world,))
    cfg = transformers.LlamaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=32, pad_token_id=0,
    )  # fmt: skip
    cfg._attn_implementation = "eager"
    torch.manual_seed(case_seed(name))
    ref = transformers.LlamaForCausalLM(cfg).float()
    model = cce_hf.patch(copy.deepcopy(ref), impl="torch")
    if name == "hf_patch_fsdp_layers":
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
    if name == "hf_patch_fsdp_head":
        fully_shard(model.lm_head, mesh=mesh)
    fully_shard(model, mesh=mesh)
    data = []
    for r in range(world):
        g = torch.Generator().manual_seed(case_seed(name) + r)
        ids = torch.randint(3, V, (2, 10), generator=g)
        labels = ids.clone()
        labels[0, :3] = -100
        data.append((ids, labels))
    ids, labels = data[rank]
    model(input_ids=ids, labels=labels).loss.backward()
    total = sum(ref(input_ids=i, labels=lab).loss for i, lab in data) / world
    total.backward()
    for (pname, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        got = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        err = rel_err(got, q.grad)
        assert err <= TOL_FP32, f"{name}: grad of {pname} rel err {err:.3g}"


def _worker(rank: int, world: int, port: int, out_dir: str, names: list[str]) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
    )
    group = dist.group.WORLD
    results = {}
    seconds = {}
    for name in names:
        t0 = time.perf_counter()
        try:
            if name in EQ_CASES:
                _eq_case(name, EQ_CASES[name], rank, world, group)
            elif name in TRITON_CASES:
                _eq_case(name, TRITON_CASES[name], rank, world, group)
            elif name in FILTER_CASES or name in TRITON_FILTER_CASES:
                _filter_case(name, {**FILTER_CASES, **TRITON_FILTER_CASES}[name], rank, world, group)
            elif name in SHARDED_TOKEN_CASES or name in TRITON_SHARDED_TOKEN_CASES:
                spec = {**SHARDED_TOKEN_CASES, **TRITON_SHARDED_TOKEN_CASES}[name]
                _sharded_tokens_case(name, spec, rank, world, group)
            elif name in DTENSOR_CASES:
                _dtensor_case(name, rank, world, group)
            elif name in ERROR_CASES:
                _error_case(name, rank, world, group)
            elif name in CACHE_CASES or name in CACHE_COMPILE_CASES:
                _cache_case(name, rank, world, group)
            elif name in WORLD1_CASES:
                _world1_case(name, rank, world, group)
            elif name in FSDP_CASES:
                _fsdp_case(name, rank, world, group)
            elif name in API_CASES:
                _api_case(name, rank, world, group)
            elif name in HF_CASES:
                _hf_case(name, rank, world, group)
            elif name.startswith("out_"):  # output_cases.py
                run_output_case(name, rank, world, group, tuned)
            results[name] = "ok"
        except Exception:
            results[name] = traceback.format_exc()
        seconds[name] = time.perf_counter() - t0
        dist.barrier(group)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    with open(os.path.join(out_dir, f"rank{rank}_seconds.json"), "w") as f:
        json.dump(seconds, f)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


ALL_CASES = [
    *EQ_CASES,
    *(TRITON_CASES if INTERPRETING else ()),
    *FILTER_CASES,
    *(TRITON_FILTER_CASES if INTERPRETING else ()),
    *DTENSOR_CASES,
    *SHARDED_TOKEN_CASES,
    *(TRITON_SHARDED_TOKEN_CASES if INTERPRETING else ()),
    *ERROR_CASES,
    *CACHE_CASES,
    *(CACHE_COMPILE_CASES if INTERPRETING else ()),
    *FSDP_CASES,
    *OUTPUT_CASES,
    *(TRITON_OUTPUT_CASES if INTERPRETING else ()),
    *SHARDED_OUTPUT_CASES,
    *RANDOM_OUTPUT_CASES,
]
HF_ACTIVE = HF_CASES if transformers is not None else ()
# The thorough tier's cases (make test-all): further interpreter runs of the sparse backward
# under vocabulary parallelism (softcap, every option, token-sharded, the per-token outputs
# masked, logged and with an entropy gradient, a 1e-3 threshold), whose kernels the default
# tier's triton_sparse and out_triton_all already run; the one-rank sparse equality; a cached
# set-up under torch.compile (w1_compile_fullgraph compiles in the default tier). The group of 3
# (uneven blocks) repeats every case of the group of 2 there too.
THOROUGH_CASES = frozenset(
    {
        "triton_sparse_softcap_none",
        "triton_sparse_everything",
        "tokens_sharded_triton",
        "out_triton_sparse_masked",
        "out_triton_sparse_logged",
        "out_triton_sparse_entropy_grad",
        "w1_sparse_equal",
        "triton_filter_sparse_1e-3",
        "cache_compile",
    }
)


def _tier(cases) -> list:
    """The cases as pytest parameters, the thorough tier's marked slow."""
    return [pytest.param(c, marks=pytest.mark.slow) if c in THOROUGH_CASES else c for c in cases]


def _run_group(world: int, tmp: Path) -> dict[str, list[str]]:
    if world == 1:
        names = list(WORLD1_CASES) + list(WORLD1_OUTPUT_CASES)
    else:
        names = ALL_CASES + list(API_CASES if API_INTEGRATED else ()) + list(HF_ACTIVE if world == 2 else ())
    if not THOROUGH:
        names = [n for n in names if n not in THOROUGH_CASES]
    mp.spawn(_worker, args=(world, _free_port(), str(tmp), names), nprocs=world, join=True)
    out: dict[str, list[str]] = {}
    for r in range(world):
        for name, res in json.loads((tmp / f"rank{r}.json").read_text()).items():
            out.setdefault(name, []).append(res)
    return out


def _shared_group(world: int, tmp_path_factory) -> dict[str, list[str]]:
    """_run_group once per test run: under pytest-xdist the group's tests may reach several
    workers (an xdist_group does not hold them together when a worker has other modules' tests
    between them), so the first worker to ask runs the group and writes its results into the
    run's shared temporary directory under a file lock; the others wait and read them."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return _run_group(world, tmp_path_factory.mktemp(f"world{world}"))
    from filelock import FileLock  # (a dependency of torch)

    shared = tmp_path_factory.getbasetemp().parent / f"gloo-world{world}.json"  # one per run
    with FileLock(str(shared) + ".lock"):
        if not shared.is_file():
            shared.write_text(json.dumps(_run_group(world, tmp_path_factory.mktemp(f"world{world}"))))
        return json.loads(shared.read_text())


# Each group's processes run once per test run (_shared_group); the fixtures are session-scoped,
# as a worker may run other modules' tests between a group's (a module-scoped fixture would then
# be torn down and the group started again). `make test` sends this file's tests to one worker
# (--dist loadfile); the xdist_group marks do the same under --dist loadgroup where the installed
# pytest-xdist can group tests.
@pytest.fixture(
    scope="session",
    params=[
        pytest.param(2, marks=pytest.mark.xdist_group("gloo-world2")),
        pytest.param(3, marks=[pytest.mark.xdist_group("gloo-world3"), pytest.mark.slow]),
    ],
    ids=lambda w: f"world{w}",
)
def group_results(request, tmp_path_factory):
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    world = request.param
    return world, _shared_group(world, tmp_path_factory)


@pytest.mark.parametrize("case", _tier(ALL_CASES))
def test_distributed(group_results, case):
    _check(group_results, case)


@pytest.fixture(scope="session")
def world1_results(tmp_path_factory):
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    return 1, _shared_group(1, tmp_path_factory)


@pytest.mark.skipif(not INTERPRETING, reason="impl='triton' on CPU tensors needs the Triton interpreter")
@pytest.mark.xdist_group("gloo-world1")
@pytest.mark.parametrize("case", _tier(WORLD1_CASES + WORLD1_OUTPUT_CASES))
def test_world_size_one(world1_results, case):
    _check(world1_results, case)


@pytest.mark.skipif(not API_INTEGRATED, reason="cce.linear_cross_entropy has no process_group yet")
@pytest.mark.parametrize("case", API_CASES)
def test_public_api(group_results, case):
    _check(group_results, case)


@pytest.mark.skipif(transformers is None, reason="needs transformers")
@pytest.mark.parametrize(
    "case",
    ["hf_patch_fsdp_layers", "hf_patch_fsdp_head"],
)
def test_transformers_patch_fsdp2(group_results, case):
    if group_results[0] != 2:
        pytest.skip("run in the 2-process group only")
    _check(group_results, case)


def _check(group_results, case):
    world, results = group_results
    if case in THOROUGH_CASES and not THOROUGH:
        pytest.skip("a thorough-tier case: run with CCE_TEST_TIER=all (make test-all)")
    got = results.get(case)
    assert got is not None and len(got) == world, f"{case}: no result from every rank"
    failures = [f"rank {r}:\n{res}" for r, res in enumerate(got) if res != "ok"]
    assert not failures, "\n".join(failures)
