"""Memory and time by phase.

`GraphMemory` is the project's own accounting of autograd graph memory, valid on any device: it counts the bytes
of the storages that autograd saves for backward while they are alive, skipping the storages that are accounted
for elsewhere (parameters, the resident state). A graph freed by its backward drops back to zero, so a graph
that outlives its replay shows up as live bytes. On CUDA `PhaseClock` also records the allocator's peak.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from contextlib import contextmanager

import torch

from longstraw_cli.quantize import storage_anchor


def proc_bytes(path: str, field: str) -> int | None:
    """A kB field of a Linux /proc file in bytes ("MemAvailable" of /proc/meminfo, "VmRSS" of
    /proc/self/status), or None where it cannot be read."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    # an NF4 weight (lora.quantize=nf4) wraps tensors and has no storage of its own: its codes stand for it
    t = storage_anchor(t)
    return (str(t.device), t.untyped_storage().data_ptr())


class _Saved:
    __slots__ = ("tensor", "meter", "key", "__weakref__")

    def __init__(self, tensor: torch.Tensor, meter: GraphMemory, key):
        self.tensor, self.meter, self.key = tensor, meter, key

    def __del__(self):
        self.meter._release(self.key)


class GraphMemory:
    """Live and peak bytes of autograd-saved storages inside `with meter:` (parameters/resident excluded)."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()):
        self.excluded = {_storage_key(t) for t in exclude}
        self.refs: dict[tuple[str, int], int] = {}
        self.sizes: dict[tuple[str, int], int] = {}
        self.live_bytes = 0
        self.peak_bytes = 0
        # tensors a walk holds beside its graph, not saved by autograd (blockwise replay's response pages, their
        # gradient, its carried states): the largest set reported by `hold`
        self.held_peak_bytes = 0
        # made on entry and dropped on exit: hooks held by the meter would make a meter -> hooks -> bound method ->
        # meter cycle, left for Python's cycle collector
        self._hooks = None

    def _pack(self, t: torch.Tensor):
        key = _storage_key(t)
        if key in self.excluded or t.device.type == "meta":
            return t
        if self.refs.get(key, 0) == 0:
            self.sizes[key] = t.untyped_storage().nbytes()
            self.live_bytes += self.sizes[key]
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        self.refs[key] = self.refs.get(key, 0) + 1
        # detached: a saved OUTPUT kept with its grad_fn would form a node -> holder -> tensor -> node cycle
        # through C++ that Python's collector cannot break, and the graph would never be freed
        return _Saved(t.detach(), self, key)

    @staticmethod
    def _unpack(saved):
        return saved.tensor if isinstance(saved, _Saved) else saved

    def _release(self, key):
        self.refs[key] -= 1
        if self.refs[key] == 0:
            del self.refs[key]
            self.live_bytes -= self.sizes.pop(key)

    def hold(self, nbytes: int) -> None:
        """A walk holds `nbytes` beside its graph (accounted apart from the saved storages)."""
        self.held_peak_bytes = max(self.held_peak_bytes, nbytes)

    @property
    def live_tensors(self) -> int:
        return sum(self.refs.values())

    def __enter__(self):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
        self._hooks = None


class PhaseClock:
    """Wall time and peak memory of an iteration's named phases: one clock per iteration, made by the trainer and
    handed to the transaction, so every phase (capture, rollout, reward, score, replay, finalize, step) is
    measured the same way. Repeated phases accumulate their time and keep their highest peak.

    On CUDA a phase starts and ends with a device synchronize (its time is the work it launched, not the launches),
    and its peak is `torch.cuda.max_memory_allocated` with the peak statistics reset at its start. On CPU the
    clock records time only; memory there is `GraphMemory`'s accounting (and the process RSS) instead.
    """

    def __init__(self, device: torch.device | str = "cpu", on_phase: Callable[[str], None] | None = None):
        self.device = torch.device(device)
        self.seconds: dict[str, float] = {}
        self.cuda_peak_bytes: dict[str, int] = {}
        # told each phase's name as it starts (the live progress display)
        self.on_phase = on_phase
        # the phase entered last: where an error raised inside the iteration came from
        self.last: str | None = None

    @contextmanager
    def phase(self, name: str):
        self.last = name
        cuda = self.device.type == "cuda"
        if self.on_phase is not None:
            self.on_phase(name)
        if cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        start = time.perf_counter()
        try:
            yield
        finally:
            if cuda:
                torch.cuda.synchronize(self.device)
                peak = torch.cuda.max_memory_allocated(self.device)
                self.cuda_peak_bytes[name] = max(self.cuda_peak_bytes.get(name, 0), peak)
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def time_metrics(self) -> dict[str, float]:
        """`time/<phase>` in seconds, in the order the phases first ran."""
        return {f"time/{name}": s for name, s in self.seconds.items()}

    def memory_metrics(self) -> dict[str, int]:
        """`mem/peak_<phase>` in bytes (CUDA only: empty on CPU)."""
        return {f"mem/peak_{name}": b for name, b in self.cuda_peak_bytes.items()}
