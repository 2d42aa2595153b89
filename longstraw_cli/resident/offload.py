"""CPU offload of resident pages: pinned host memory, staged onto the compute device one layer at a time.

Only PAGED layer states (attention K/V, MLA latent / rope / indexer keys) go to the host; CARRIED ones (GDN conv
+ recurrent state, a few MB a layer whatever the prompt) stay on the device and are handed out as they are.

`LayerStager` hands out layer l's pages on the compute device and, at that moment, starts copying the next paged
layer on a side CUDA stream, so the copy overlaps layer l's compute (and the carried layers' between them). On a
CPU-only machine the same code makes plain copies (same values, so offloaded and on-device results are identical).
Every host<->device copy of a device runs on ONE side stream (`side_stream`), so a layer's pages written back to
the host are read again only after the write.

The model walks reach offload through three entry points only, which are identities for a resident state on the
device: `stage_layers` (replay, scoring, decode: read layer l on the device), `BlockWriter` (block-by-block
capture, `capture(offload="cpu")`: for a block [start, end), layer l's pages [0, start) staged to the device, the
block's [start, end) written there and copied back to the host) and `PageWriter` (layer-by-layer capture,
`capture_span(offload="cpu")`: layer l's pages of the whole span written on the device, copied to the host).

Context parallel uses the same three: each rank captures its shard layer by layer (`PageWriter`; the CP hooks see
the layer's device buffer, exactly what they see without offload, and ring / all-gather it from there), and its
replay, scoring and decode stage its own shard's pages one layer at a time (`stage_layers`) before the CP
attention hooks merge the ranks' partials. Nothing here communicates: every rank moves only its own pages.
"""

from __future__ import annotations

import contextlib
import logging
import weakref

import torch

from longstraw_cli.resident.state import CARRIED_COMPONENTS
from longstraw_cli.telemetry.memory import proc_bytes

log = logging.getLogger(__name__)

# where a capture puts its pages: None (the compute device) or "cpu" (host memory)
OFFLOAD_CHOICES = (None, "cpu")
# the same choices as `capture.offload` and `longstraw plan` name them ("none": the compute device)
OFFLOAD_NAMES = ("none", "cpu")


def offload_refusal(offload: str, *, gradient: str) -> str | None:
    """One line when capture.offload does not run with the rest of the run (the trainer's config and
    `longstraw plan` refuse the same), else None. Any cp: under context parallel each rank keeps its own shard's
    pages on the host (distributed/cp.py, cp_glm52.py). Exact gradients are refused at every cp: the prompt's
    reverse walk reads and differentiates the pages (and, under cp, broadcasts their gradients) on the device."""
    if offload not in OFFLOAD_NAMES:
        return f"capture.offload={offload!r}; valid: {list(OFFLOAD_NAMES)}"
    if offload == "cpu" and gradient == "exact":
        return ("capture.offload=cpu with capture.gradient=exact: the prompt's walk differentiates the pages, "
                "which it needs on the device; valid: capture.offload=none with gradient=exact, or "
                "capture.offload=cpu with gradient=response_only")
    return None


def host_buffer(shape, dtype) -> torch.Tensor:
    """Zeros in CPU memory, pinned when CUDA is available (pinned memory makes host<->device copies async)."""
    return torch.zeros(shape, dtype=dtype, pin_memory=torch.cuda.is_available())


class LayerStager:
    """Device copies of per-layer pages, one layer ahead. `get(l)` must be called in increasing order of l
    (`step=-1`: decreasing, as a backward walks the layers; a skipped or repeated layer is staged synchronously).
    Objects staged must have `.to(device, non_blocking)` returning a copy and `.tensors()`."""

    def __init__(self, layers: list, device: torch.device, wanted=None, step: int = 1, **to_kwargs):
        self.layers, self.device, self.step, self.to_kwargs = layers, torch.device(device), step, to_kwargs
        # which layers to stage (others are returned as they are); default all
        self.wanted = wanted or (lambda i: True)
        self.stream = side_stream(self.device) if self.device.type == "cuda" else None
        self.pending: dict[int, tuple] = {}

    def _issue(self, i: int) -> None:
        if self.stream is None:
            self.pending[i] = (self.layers[i].to(self.device, **self.to_kwargs), None)
            return
        # the side stream must not read pages before work queued on the current stream (e.g. capture's writes)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            staged = self.layers[i].to(self.device, non_blocking=True, **self.to_kwargs)
            event = torch.cuda.Event()
            event.record(self.stream)
        self.pending[i] = (staged, event)

    def get(self, i: int):
        if not self.wanted(i):
            return self.layers[i]
        if i not in self.pending:
            self._issue(i)
        staged, event = self.pending.pop(i)
        if event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(event)
            # memory allocated on the side stream is now used on the current one
            for t in staged.tensors():
                if t.device.type == self.device.type:
                    t.record_stream(current)
        ahead = range(i + 1, len(self.layers)) if self.step > 0 else range(i - 1, -1, -1)
        nxt = next((j for j in ahead if self.wanted(j)), None)
        if nxt is not None and nxt not in self.pending:
            self._issue(nxt)
        return staged


def side_stream(device, purpose: str = "pages") -> torch.cuda.Stream:
    """The one stream of a CUDA device for `purpose`, made once: "pages" carries its host<->device page copies;
    rollout/native.py warms its CUDA-graph decode step on another ("decode warm-up"). One stream per purpose, not
    one per call: cuBLAS keeps a 32 MiB workspace per stream it runs on for the life of the process, and torch
    hands out up to 32 pooled streams a device (a new warm-up stream per rollout held 32 MiB more each step)."""
    device = torch.device(device)
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if (device, purpose) not in _side_streams:
        _side_streams[device, purpose] = torch.cuda.Stream(device)
    return _side_streams[device, purpose]


@contextlib.contextmanager
def stage_layers(resident, device, grad: bool):
    """Context yielding layer index -> that layer's resident state on the compute device: the state itself, or
    a device copy of its pages when offloaded (carried states are on the device already), staged one layer ahead
    on the side stream. Under autograd (`grad`) the kernels save the pages they read for backward; inside this
    context a saved staged copy is kept as its host pages instead (`_HostSaved`) and staged again when the
    backward reads it, so no layer's device copy outlives its forward; the backward stages the layers in reverse,
    one ahead on the side stream as the forward does."""
    if resident.offload is None:
        yield resident.layers.__getitem__
        return
    layers = resident.layers
    stager = LayerStager(layers, device, wanted=lambda i: not layers[i].CARRIED)
    if not grad:
        yield stager.get
        return
    saved = _HostSaved(layers, device, _outer_hooks())
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
        yield lambda i: saved.add(i, stager.get(i))


def _outer_hooks():
    """The saved-tensor hooks active now (e.g. the transaction's GraphMemory meter), or None. Only the innermost
    hooks see a saved tensor, so `_HostSaved` hands every tensor it does not replace on to these. (A private torch
    function, the one torch.utils.checkpoint uses; without it the outer hooks miss what the layers save.)"""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top(False) if top is not None else None


class _HostSaved:
    """Saved-tensor hooks for a replay over staged pages: a tensor that autograd saves whose storage is a staged
    copy's (the copy itself or a view of it: kernels save `pages[:n]` too) is packed as (its layer, which of the
    layer's tensors, the view's geometry), and unpacked from a device copy of that layer made again for the
    backward: the backward reaches the layers last first, so a `LayerStager` walking down stages them, the next
    one's copy on the side stream during this one's backward. The layer whose backward runs is kept for the
    other tensors it saved (at most it and the next in flight are on the device). Other saved tensors go to the
    hooks this one shadows (`outer`), or are kept as they are."""

    def __init__(self, layers: list, device, outer=None):
        self.layers, self.device = layers, device
        # the staged copy's storage address -> (a weak reference to the copy, its layer, its index in tensors())
        self.staged: dict[int, tuple] = {}
        # the hooks this one shadows: every other saved tensor goes through them
        self.outer = outer
        # the backward's stager (made at the first unpack) and the layer it handed out last: (index, device copy)
        self.back, self.current = None, (None, None)

    def add(self, i: int, staged_state):
        if staged_state is not self.layers[i]:
            for k, copy in enumerate(staged_state.tensors()):
                self.staged[copy.untyped_storage().data_ptr()] = (weakref.ref(copy), i, k)
        return staged_state

    def pack(self, t: torch.Tensor):
        # staged pages are plain tensors (parameters and NF4 weights, which have no storage of their own, are not)
        entry = self.staged.get(t.untyped_storage().data_ptr()) if type(t) is torch.Tensor else None
        copy = None if entry is None else entry[0]()
        if copy is None or copy.untyped_storage().data_ptr() != t.untyped_storage().data_ptr():
            return False, t if self.outer is None else self.outer[0](t)
        return True, (entry[1], entry[2], t.shape, t.stride(), t.storage_offset())

    def unpack(self, packed):
        staged, value = packed
        if not staged:
            return value if self.outer is None else self.outer[1](value)
        i, k, shape, stride, offset = value
        if self.current[0] != i:
            if self.back is None:
                # the filter must not refer to self: the stager it goes into is self's, and a cycle would keep the
                # layer copy held in self.current alive past the backward until Python's cycle collector ran
                layers = self.layers
                self.back = LayerStager(layers, self.device, wanted=lambda j: not layers[j].CARRIED, step=-1)
            # the previous layer's copy is released here (the graph holds what it still needs of it)
            self.current = (i, self.back.get(i))
        return self.current[1].tensors()[k].as_strided(shape, stride, offset)


def host_bytes(resident_bytes: dict[str, int]) -> int:
    """Bytes an offloaded resident state keeps in host memory (a `resident_bytes` / `nbytes()` dict): all but the
    carried states, which stay on the device."""
    return resident_bytes["total"] - sum(resident_bytes.get(name, 0) for name in CARRIED_COMPONENTS)


def host_available_bytes() -> int | None:
    """The host's MemAvailable (/proc/meminfo), or None where it cannot be read."""
    return proc_bytes("/proc/meminfo", "MemAvailable")


def rollout_pages(resident, device, budget: int | None = None) -> list:
    """The layer states a native rollout reads: the resident's own when on the device; offloaded, device copies of
    as many paged layers as fit in the device's free memory with 10% to spare and in `budget` bytes if given
    (rollout.native.offload_copy_gib; first layers first; a CUDA device:
    rollout holds no gradients and no graph, so room freed by the offload is there), made once for the rollout,
    and the other paged layers left in host memory (`left_on_host`), read from there at every decode step: qwen36
    stages them whole (its dense attention reads all of its K/V each token), glm52 fetches the selected rows;
    their rate is the host link's. A CPU device has no memory of its own beside the host's: every paged layer
    stays on the host (the host paths run there)."""
    if resident.offload is None:
        return resident.layers
    free = device_free_bytes(device)
    room = 0 if free is None else int(free / 1.1)
    if budget is not None:
        room = min(room, budget)
    layers, copied, left = [], 0, 0
    for layer in resident.layers:
        nbytes = 0 if layer.CARRIED else sum(t.nbytes for t in layer.tensors())
        if layer.CARRIED or nbytes > room:
            layers.append(layer)
            left += nbytes
            continue
        layers.append(layer.to(device))
        room -= nbytes
        copied += nbytes
    log.info("rollout over offloaded pages: %.2f GiB copied to the device for the rollout, %.2f GiB left in host "
             "memory and read from there at every decode step%s", copied / 2**30, left / 2**30,
             " (eager, no CUDA graph)" if left else "")
    return layers


def left_on_host(resident, pages: list) -> list[bool]:
    """Per layer, whether `rollout_pages` left it in host memory (staged at every decode step)."""
    if resident.offload is None:
        return [False] * len(pages)
    return [page is state and not state.CARRIED for page, state in zip(pages, resident.layers)]


def stage_rollout_pages(pages: list, device, on_host: list[bool]):
    """layer index -> that layer's state on `device` for one decode step: `rollout_pages`' device copies as they
    are, the layers left in host memory staged one at a time (the next one's copy during this one's compute)."""
    if not any(on_host):
        return pages.__getitem__
    return LayerStager(pages, device, wanted=on_host.__getitem__).get


def device_total_bytes(device) -> int | None:
    """Total memory of a CUDA device; None for a CPU device (its memory is the host's)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).total_memory


def device_free_bytes(device) -> int | None:
    """Free memory of a CUDA device; None for a CPU device (its memory is the host's)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return torch.cuda.mem_get_info(device)[0]


class PageWriter:
    """Layer-by-layer capture's pages: `get(l)` the layer's state to write on the compute device, `done(l)` once
    written, `finish()` after the last layer. Offloaded pages are written into a device buffer and copied to the
    host asynchronously while the next layer computes; carried states are written where they are."""

    def __init__(self, resident, device):
        self.resident, self.device = resident, device
        self.work: dict[int, object] = {}

    def _offloaded(self, i: int) -> bool:
        return self.resident.offload is not None and not self.resident.layers[i].CARRIED

    def get(self, i: int):
        if not self._offloaded(i):
            return self.resident.layers[i]
        self.work[i] = self.resident.layers[i].empty_on(self.device)
        return self.work[i]

    def done(self, i: int) -> None:
        if self._offloaded(i):
            copy_to_host(self.resident.layers[i].tensors(), self.work.pop(i).tensors())

    def finish(self) -> None:
        if self.resident.offload is not None and torch.cuda.is_available():
            torch.cuda.synchronize()


class _Window:
    """Stages pages [0, end) of a paged state for a capture block [start, end): rows [0, start) copied from the
    host, rows [start, end) left for the block to write (LayerStager's `.to` / `.tensors` interface)."""

    def __init__(self, state, start: int, end: int):
        self.state, self.start, self.end = state, start, end

    def to(self, device, non_blocking: bool = False):
        staged = self.state.empty_on(device, self.end)
        for dst, src in zip(staged.tensors(), self.state.tensors()):
            dst[: self.start].copy_(src[: self.start], non_blocking=non_blocking)
        return staged


class BlockWriter:
    """Block-by-block capture's state for block [start, end): `get(l)` layer l's state to read and write on the
    compute device (offloaded pages: a device window of positions [0, end), [0, start) staged from the host, the
    next paged layer's on the side stream while this layer computes), `done(l)` once the layer wrote the block
    (its rows [start, end) go back to the host on the side stream), `finish()` after the last layer (waits for
    the copies: the host pages are complete). Per block each paged layer's earlier pages cross to the device
    once: traffic grows as prompt^2 / block_size, like the attention FLOPs it overlaps (docs/guide/long-context.md)."""

    def __init__(self, resident, device, start: int, end: int):
        self.resident, self.start, self.end = resident, start, end
        layers = resident.layers
        self.offloaded = resident.offload is not None
        if self.offloaded:
            windows = [_Window(state, start, end) for state in layers]
            self.stager = LayerStager(windows, device, wanted=lambda i: not layers[i].CARRIED)
        self.staged: dict[int, object] = {}

    def get(self, i: int):
        state = self.resident.layers[i]
        if not self.offloaded or state.CARRIED:
            return state
        self.staged[i] = self.stager.get(i)
        return self.staged[i]

    def done(self, i: int) -> None:
        if i in self.staged:
            rows = slice(self.start, self.end)
            copy_to_host([t[rows] for t in self.resident.layers[i].tensors()],
                         [t[rows] for t in self.staged.pop(i).tensors()])

    def finish(self) -> None:
        if self.offloaded and torch.cuda.is_available():
            torch.cuda.synchronize()


def copy_to_host(dst_host: list[torch.Tensor], src_device: list[torch.Tensor]) -> None:
    """dst.copy_(src) for each pair, asynchronously on the side stream when CUDA is in use (the next layer's
    compute overlaps the copy); call `torch.cuda.synchronize()` before reading the host tensors."""
    if not any(s.is_cuda for s in src_device):
        for d, s in zip(dst_host, src_device):
            d.copy_(s)
        return
    device = src_device[0].device
    stream = side_stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for d, s in zip(dst_host, src_device):
            d.copy_(s, non_blocking=True)
            # the source must outlive the copy even if the caller drops it
            s.record_stream(stream)


_side_streams: dict = {}
