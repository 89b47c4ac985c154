"""Host copies of small device decisions, read only once they have arrived: never a wait.

The sparse backward decides on the device which vocabulary slabs it does densely and whether the
first-order terms apply (slab_choice.dense_slab_flags), and issues every launch those decisions
gate: a gated launch whose flag is 0 returns at once. Issuing them costs the host tens of
microseconds each (a Triton launch) and their buffers are allocated for the worst case, which
makes small steps, and one rank's block under vocabulary parallelism, bound by the host
(docs/benchmarks.md, "Host time").

When the host is the slower side the device has long finished the decision by the time the host
reaches the launches it gates. A HostPeek starts a copy of the decision into pinned host memory
right after it is made and records an event; when the launches are issued, ``get()`` returns the
host copy if that event has completed (``Event.query``, which does not block) and None
otherwise. With the copy the caller issues only the launches that do work; without it, all of
them, gated, as before. The gradients are the same either way (the skipped launches would have
returned at once), and nothing waits on the device: a step that is bound by the device issues
the gated launches, which the device's queue hides, and a step bound by the host issues fewer.
Under CUDA-graph capture no copy is made (the decision must stay on the device in a replayed
graph). Off CUDA (the Triton interpreter on the CPU) the tensor is already on the host and is
read as it is.
"""

from __future__ import annotations

import torch


class HostPeek:
    """Host copies of ``tensors`` (small device tensors, final once made), available from
    ``get()`` once the device has written them; see the module docstring."""

    def __init__(self, *tensors: torch.Tensor, enabled: bool = True) -> None:
        self._host: tuple[torch.Tensor, ...] | None = None
        self._event = None
        if not enabled or not tensors:
            return
        dev = tensors[0].device
        if dev.type != "cuda":
            self._host = tensors
            return
        if torch.cuda.is_current_stream_capturing():
            return
        stream = torch.cuda.current_stream(dev)
        self._host = tuple(
            torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True) for t in tensors
        )
        self._event = torch.cuda.Event()
        self._event.record(stream)

    def get(self) -> tuple[torch.Tensor, ...] | None:
        """The host copies if they have arrived (never waits), else None."""
        if self._event is not None:
            if not self._event.query():
                return None
            self._event = None
        return self._host
