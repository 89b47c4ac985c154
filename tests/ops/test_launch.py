"""cce/ops/launch.py: the launch cache's key and its hit / miss control flow (CPU), and a cached
kernel's results against Triton's own launch path on every specialization it keys (GPU).

On the CPU the kernels run in the interpreter, where every launch takes Triton's path; the
cache's logic is tested here with a stand-in for the compiled kernel and the driver.
"""

from __future__ import annotations

import types

import pytest
import torch
import triton
import triton.language as tl

from cce.ops import launch as L


def _k(X, Y, n, m, scale, flag, B=None, BLOCK: tl.constexpr = 16, MODE: tl.constexpr = "a"):
    pass


NAMES = ("X", "Y", "n", "m", "scale", "flag", "B", "BLOCK", "MODE")
CONSTEXPRS = frozenset({"BLOCK", "MODE"})
DEFAULTS = {"B": None, "BLOCK": 16, "MODE": "a"}


def _bind():
    return L._binder(NAMES, CONSTEXPRS, DEFAULTS)


def _kwargs(**over):
    x = torch.zeros(64)
    kw = dict(X=x, Y=torch.zeros(64, dtype=torch.float16), n=32, m=7, scale=0.5, flag=True, B=None)
    kw.update(over)
    return kw


def test_binder_keys_like_arg_key_and_orders_the_arguments():
    """The generated binder's parts are _arg_key's for runtime arguments and the values of
    constexprs, defaults filled in; the arguments come back in parameter order."""
    kw = _kwargs(MODE="b")
    parts, args, opts = _bind()(kw)
    assert opts == (None, None)
    full = {**DEFAULTS, **kw}
    assert args == tuple(full[n] for n in NAMES)
    expect = tuple(full[n] if n in CONSTEXPRS else L._arg_key(full[n]) for n in NAMES)
    assert parts == expect
    assert parts[0] == (torch.float32, True) and parts[2] == (False, True, True, False)
    assert parts[5] == "b" and parts[4] == "f" and parts[6] is None and parts[-1] == "b"


@pytest.mark.parametrize(
    "over",
    [
        dict(X=torch.zeros(65)[1:]),  # 4-byte offset: not 16-byte aligned
        dict(X=torch.zeros(64, dtype=torch.float64)),
        dict(n=1),  # Triton specializes ints equal to 1
        dict(n=33),  # ... and their divisibility by 16
        dict(m=2**31),  # ... and their range
        dict(m=2**63),
        dict(flag=1),  # an int where a bool was
        dict(B=torch.zeros(4)),  # a tensor where None was
        dict(BLOCK=32),  # constexprs by value
        dict(scale=1),  # an int where a float was
    ],
)
def test_key_separates_what_triton_specializes_on(over):
    bind = _bind()
    assert bind(_kwargs(**over))[0] != bind(_kwargs())[0]


def test_launch_options_are_keyed():
    """num_warps / num_stages as a pair; any other option by name and value."""
    bind = _bind()
    assert bind(_kwargs(num_warps=4))[2] == (4, None)
    assert bind(_kwargs(num_warps=4, num_stages=3))[2] == (4, 3)
    assert bind(_kwargs(num_warps=4, maxnreg=128))[2] == (("maxnreg", 128), ("num_warps", 4))
    kw = _kwargs(num_warps=4)
    del kw["B"]  # (a default left out: still the pair)
    assert bind(kw)[2] == (4, None)


def test_key_ignores_what_triton_does_not_specialize_on():
    """Values of the same specialization share a key (one entry per specialization, not per
    value): other aligned tensors, other ints of the same class, other floats."""
    bind = _bind()
    same = _kwargs(X=torch.ones(8), n=48, m=9, scale=3.0, flag=False)
    assert bind(same)[0] == bind(_kwargs())[0]


def test_unknown_type_and_missing_argument_raise_for_the_fallback():
    bind = _bind()
    with pytest.raises(TypeError):
        bind(_kwargs(m="seven"))
    kw = _kwargs()
    del kw["X"]
    with pytest.raises(KeyError):
        bind(kw)


class _Compiled:
    """Stands in for a CompiledKernel: records its launches."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args: self.launches.append((grid, args))


class _Base:
    """Stands in for a JITFunction: run compiles (a new _Compiled per call) and launches."""

    def __init__(self):
        self.runs = []

    def run(self, *, grid, warmup, **kwargs):
        self.runs.append((grid, kwargs))
        return _Compiled()


def _cached(monkeypatch):
    heur = types.SimpleNamespace(fn=_Base(), values={"MODE": lambda a: "c" if a["B"] is not None else "a"})
    cl = L.CachedLaunch(heur)
    assert cl.bind is None  # (not a JITFunction: Triton's path)
    cl.bind = _bind()
    driver = types.SimpleNamespace(active=types.SimpleNamespace(get_current_device=lambda: 0))
    monkeypatch.setattr(L, "_driver", driver)
    return cl


def test_hit_launches_the_compiled_kernel_with_arguments_in_parameter_order(monkeypatch):
    cl = _cached(monkeypatch)
    first = cl[(4,)](**_kwargs(), num_warps=4)
    assert len(cl.kernel.fn.runs) == 1 and cl.kernel.fn.runs[0][1]["MODE"] == "a"  # heuristics applied
    kw = _kwargs(X=torch.ones(64), n=64)
    again = cl[(4, 2)](**kw, num_warps=4)
    assert again is first and len(cl.kernel.fn.runs) == 1  # a hit: no new run
    grid, args = first.launches[0]
    assert grid == (4, 2, 1)
    full = {**DEFAULTS, **kw, "MODE": "a"}
    assert all(a is full[n] or a == full[n] for a, n in zip(args, NAMES, strict=True))
    # Another specialization, another launch option, a heuristic's other value: misses.
    cl[(4,)](**_kwargs(X=torch.zeros(65)[1:]), num_warps=4)
    cl[(4,)](**_kwargs(), num_warps=8)
    cl[(4,)](**_kwargs(B=torch.zeros(4)), num_warps=4)
    assert len(cl.kernel.fn.runs) == 4 and cl.kernel.fn.runs[-1][1]["MODE"] == "c"
    assert len(cl.cache) == 4


def test_callable_grid_pre_run_hooks_and_unhashable_constexprs_take_tritons_path(monkeypatch):
    cl = _cached(monkeypatch)
    cl[(1,)](**_kwargs())
    cl[lambda meta: (1,)](**_kwargs())
    assert len(cl.kernel.fn.runs) == 2
    cl[(1,)](**_kwargs(BLOCK=[16]))  # (a list: no key; launched, not cached)
    cl[(1,)](**_kwargs(BLOCK=[16]))
    assert len(cl.kernel.fn.runs) == 4 and len(cl.cache) == 1
    del cl.kernel.fn.runs[2:]
    cl.base.pre_run_hooks = [lambda *a, **k: None]
    cl[(1,)](**_kwargs())
    assert len(cl.kernel.fn.runs) == 3


# ---------------------------------------------------------------------------------------------
# GPU: a cached kernel against Triton's path on every specialization the key separates.


@L.cached_launch
@triton.heuristics({"HAS_B": lambda a: a["B"] is not None})
@triton.jit
def _axpy_kernel(X, B, Out, n, step, scale, HAS_B: tl.constexpr, BLOCK: tl.constexpr):
    # Out[i] = scale X[i * step] (+ B[i]) for i < n: exercises pointer alignment, ints equal to
    # 1 or divisible by 16, a float and an optional operand.
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(X + offs.to(tl.int64) * step, mask=mask, other=0.0)
    y = x * scale
    if HAS_B:
        y += tl.load(B + offs, mask=mask, other=0.0)
    tl.store(Out + offs, y, mask=mask)


@pytest.mark.gpu
def test_gpu_cached_launch_equals_torch_on_each_specialization():
    dev = torch.device("cuda")
    base = torch.randn(4096 + 7, device=dev)
    b = torch.randn(4096, device=dev)
    cases = [
        (base[:4096], None, 4096, 1),  # aligned, step 1 (an int specialized to 1)
        (base[1:4097], None, 4096, 1),  # 4-byte offset: not aligned
        (base[:4096], b, 4000, 1),  # an operand, n not divisible by 16
        (base, None, 2048, 2),  # step 2
        (base[3:], b, 1000, 4),
        (base[:4096], None, 4096, 1),  # the first again: a hit
    ]
    for _ in range(2):  # the second round hits the cache on every case
        for x, bb, n, step in cases:
            out = torch.full((n,), float("nan"), device=dev)
            _axpy_kernel[(triton.cdiv(n, 256),)](X=x, B=bb, Out=out, n=n, step=step, scale=1.5, BLOCK=256)
            ref = 1.5 * x[: n * step : step]
            if bb is not None:
                ref = ref + bb[:n]
            # (fp32's default tolerances: the kernel may fuse the multiply-add into one FMA)
            torch.testing.assert_close(out, ref)
    assert 1 < len(_axpy_kernel.cache) <= len(cases)
