"""Kernel launches with less host work: each launch's specialization mapped to its compiled
kernel, in front of Triton's launch path.

Triton's ``JITFunction.run`` binds and specializes every argument, builds its cache key and
reads its knobs at every launch, and ``triton.heuristics`` rebuilds a dict of all arguments per
heuristic. For an empty kernel of 34 arguments that measured 34-66 us of host time per launch
on H100 hosts, of which the compiled kernel's own launcher takes 10-13 us; through this cache
24 us on the faster host (docs/benchmarks.md, "Host time"). A vocabulary-parallel
rank's step and small steps are bound by the host, so the difference is their time.

``cached_launch`` wraps a kernel (a ``triton.jit`` function, under ``triton.heuristics`` or
not); ``kernel[grid](**kwargs)`` launches it as before, keyword arguments only (cce's launchers
pass every argument by name). Per launch the wrapper sets the heuristics' values from the
keyword arguments and builds a key of everything Triton's specialization depends on, at least
as finely:

- constexpr arguments and launch options (``num_warps``, ...) by value;
- tensors by dtype and whether the data pointer is 16-byte aligned;
- ints by whether they equal 1, are divisible by 16, and their range (int32, int64, uint64);
- floats and bools by type, ``None`` as itself;
- host tensor descriptors by their base's dtype and alignment, rank, block shape, padding and
  tf32 rounding;
- the current device.

On a miss it launches through Triton (compiling where needed) and keeps the compiled kernel;
on a hit it launches that compiled kernel (``CompiledKernel[grid](*args)``, Triton's launcher
for compiled kernels, which passes the launch hooks of profilers as Triton's path does) with the
arguments in the kernel's parameter order. The kernel and its arguments are the same either
way, so are the results.

Triton's path is taken for every launch under the interpreter, for a Triton without ``knobs``,
while the kernel has pre-run hooks, for an argument of another type or an unhashable constexpr,
and for a callable grid.
The key does not hold Triton's knobs (TRITON_DEBUG and the like): changing them within a
process leaves the kernels already cached as they were compiled.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch

try:  # (the knobs module exists from Triton 3.3 on; without it every launch takes Triton's path)
    from triton import knobs as _knobs
except ImportError:  # pragma: no cover
    _knobs = None

try:
    from triton.runtime.driver import driver as _driver
except ImportError:  # pragma: no cover
    _driver = None

try:
    from triton.tools.tensor_descriptor import TensorDescriptor as _TensorDescriptor
except ImportError:  # pragma: no cover
    _TensorDescriptor = None

# Compiled kernels kept per wrapped kernel: past this many keys the map is cleared (a key per
# specialization, not per value, so a long run with varying shapes adds few).
MAX_ENTRIES = 256


def _arg_key(v: Any) -> Any:
    """A runtime argument's part of the key (module docstring). Raises TypeError for a type the
    cache does not know (the launch then takes Triton's path)."""
    if v is None:
        return None
    if isinstance(v, torch.Tensor):
        return v.dtype, v.data_ptr() % 16 == 0
    if isinstance(v, bool):
        return "b"
    if isinstance(v, int):
        return v == 1, v % 16 == 0, -(2**31) <= v < 2**31, v >= 2**63
    if isinstance(v, float):
        return "f"
    if _TensorDescriptor is not None and isinstance(v, _TensorDescriptor):
        return (
            "td",
            v.base.dtype,
            v.base.data_ptr() % 16 == 0,
            len(v.shape),
            tuple(v.block_shape),
            getattr(v, "padding", None),
            getattr(v, "round_f32_to_tf32", None),
        )
    raise TypeError(f"no launch key for {type(v).__name__}")


def _binder(names: Sequence[str], constexprs: frozenset, defaults: dict) -> Callable[[dict], tuple]:
    """A function of the keyword arguments returning (key parts, arguments in parameter order,
    launch options), generated per kernel (one expression per parameter instead of a loop and
    calls: the point of the module is host time). Plain tensors and ints, the common arguments,
    are keyed inline; the others by _arg_key, with the same result. The launch options are the
    arguments that are no parameter: num_warps and num_stages as a pair where they are all there
    is, else every such (name, value) sorted by name. A missing argument without a default
    raises KeyError."""
    ns = {"T": torch.Tensor, "I": int, "slow": _arg_key, "NAMES": frozenset(names)}
    get, keys, present = [], [], [str(len(names) - len(defaults))]
    for i, n in enumerate(names):
        if n in defaults:
            ns[f"d{i}"] = defaults[n]
            get.append(f"a{i} = kw.get({n!r}, d{i})")
            present.append(f"({n!r} in kw)")
        else:
            get.append(f"a{i} = kw[{n!r}]")
        if n in constexprs:
            keys.append(f"a{i}")
        else:
            keys.append(
                f"((a{i}.dtype, a{i}.data_ptr() % 16 == 0) if a{i}.__class__ is T else "
                f"(a{i} == 1, a{i} % 16 == 0, -2147483648 <= a{i} < 2147483648, a{i} >= 9223372036854775808) "
                f"if a{i}.__class__ is I else slow(a{i}))"
            )
    args = ", ".join(f"a{i}" for i in range(len(names)))
    body = [
        *get,
        "o = (kw.get('num_warps'), kw.get('num_stages'))",
        f"if len(kw) != {' + '.join(present)} + (o[0] is not None) + (o[1] is not None):",
        "    o = tuple(sorted((k, v) for k, v in kw.items() if k not in NAMES))",
        f"return ({', '.join(keys)},), ({args},), o",
    ]
    exec("def bind(kw):\n    " + "\n    ".join(body) + "\n", ns)
    return ns["bind"]


class CachedLaunch:
    """A kernel whose launches skip Triton's per-launch binding where its specialization has
    been seen (module docstring). ``kernel[grid](**kwargs)`` launches; ``.kernel`` is the
    wrapped Triton object."""

    def __init__(self, kernel: Any):
        self.kernel = kernel
        # triton.heuristics wrappers, outermost first (the order Triton applies them in).
        self.heuristics: list[tuple[str, Callable[[dict], Any]]] = []
        base = kernel
        while hasattr(base, "fn") and isinstance(getattr(base, "values", None), dict):
            self.heuristics.extend(base.values.items())
            base = base.fn
        self.base = base
        # key -> (compiled kernel, its launchers by grid)
        self.cache: dict[tuple, tuple[Any, dict]] = {}
        self.bind: Callable[[dict], tuple] | None = None
        try:
            from triton.runtime.jit import JITFunction
        except ImportError:  # pragma: no cover
            JITFunction = None
        if (
            _knobs is not None
            and _driver is not None
            and JITFunction is not None
            and isinstance(base, JITFunction)
        ):
            sig = inspect.signature(base.fn)
            defaults = {
                n: p.default for n, p in sig.parameters.items() if p.default is not inspect.Parameter.empty
            }
            constexprs = frozenset(p.name for p in base.params if p.is_constexpr)
            self.bind = _binder(tuple(sig.parameters), constexprs, defaults)

    def __getitem__(self, grid: Sequence[int] | Callable) -> Callable[..., Any]:
        return lambda **kwargs: self.launch(grid, kwargs)

    def launch(self, grid: Sequence[int] | Callable, kwargs: dict) -> Any:
        """Launch with keyword arguments ``kwargs`` (completed here with the heuristics' values);
        returns the compiled kernel (on Triton's path, what its launch returns)."""
        if self.bind is None:
            return self.kernel[grid](**kwargs)
        for name, h in self.heuristics:
            kwargs[name] = h(kwargs)
        key = None
        if not (callable(grid) or getattr(self.base, "pre_run_hooks", None)):
            try:
                parts, args, opts = self.bind(kwargs)
            except (KeyError, TypeError):
                pass  # (Triton's path: it raises for a missing argument, or knows the type)
            else:
                key = (_driver.active.get_current_device(), parts, opts)
        try:
            entry = None if key is None else self.cache.get(key)
        except TypeError:  # (an unhashable constexpr or option: Triton's path, uncached)
            entry = key = None
        if entry is None:
            compiled = self.base.run(grid=grid, warmup=False, **kwargs)
            if key is not None and compiled is not None:
                if len(self.cache) >= MAX_ENTRIES:
                    self.cache.clear()
                self.cache[key] = (compiled, {})
            return compiled
        compiled, runners = entry
        # The compiled kernel's launcher for this grid, kept (a step's grids repeat).
        g = tuple(grid)
        run = runners.get(g)
        if run is None:
            if len(runners) >= MAX_ENTRIES:
                runners.clear()
            run = runners[g] = compiled[g + (1,) * (3 - len(g))]
        run(*args)
        return compiled


def cached_launch(kernel: Any) -> CachedLaunch:
    """Decorator: ``kernel`` (a ``triton.jit`` function, possibly under ``triton.heuristics``)
    as a CachedLaunch."""
    return CachedLaunch(kernel)
