"""CPU offload of resident pages: pinned host memory, staged onto the compute device one layer at a time.

`LayerStager` hands out layer l's pages on the compute device and, at that moment, starts copying layer l + 1
on a side CUDA stream, so the copy overlaps layer l's compute. On a CPU-only machine the same code makes
plain copies (same values, so offloaded and on-device results are identical).

The model walks reach offload through two entry points only, which are identities for a resident state on the
device: `stage_layers` (replay, scoring, decode: read layer l on the device) and `PageWriter` (layer-by-layer
capture: write layer l on the device, copy it to the host).
"""

from __future__ import annotations

import torch


def host_buffer(shape, dtype) -> torch.Tensor:
    """Zeros in CPU memory, pinned when CUDA is available (pinned memory makes host<->device copies async)."""
    return torch.zeros(shape, dtype=dtype, pin_memory=torch.cuda.is_available())


class LayerStager:
    """Device copies of per-layer pages, one layer ahead. `get(l)` must be called in increasing order of l
    (a skipped or repeated layer is staged synchronously). Objects staged must have `.to(device, non_blocking)`
    returning a copy and `.tensors()`."""

    def __init__(self, layers: list, device: torch.device, wanted=None, **to_kwargs):
        self.layers, self.device, self.to_kwargs = layers, torch.device(device), to_kwargs
        # which layers to stage (others are returned as they are); default all
        self.wanted = wanted or (lambda i: True)
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
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
        nxt = next((j for j in range(i + 1, len(self.layers)) if self.wanted(j)), None)
        if nxt is not None and nxt not in self.pending:
            self._issue(nxt)
        return staged


def stage_layers(resident, device, grad: bool):
    """layer index -> that layer's resident state on the compute device: the state itself, or staged copies when
    offloaded. Under autograd only the index keys are staged: the sparse attention saves the pages it reads for
    backward, so it reads the host pages (gathering the selected rows) instead of keeping a device copy per
    layer."""
    if resident.offload is None:
        return lambda i: resident.layers[i]
    return LayerStager(resident.layers, device, index_only=grad).get


class PageWriter:
    """Layer-by-layer capture's pages: `get(l)` the layer's state to write on the compute device, `done(l)` once
    written, `finish()` after the last layer. Offloaded pages are written into a device buffer and copied to the
    host asynchronously while the next layer computes."""

    def __init__(self, resident, device):
        self.resident, self.device = resident, device
        self.work: dict[int, object] = {}

    def get(self, i: int):
        if self.resident.offload is None:
            return self.resident.layers[i]
        self.work[i] = self.resident.layers[i].empty_on(self.device)
        return self.work[i]

    def done(self, i: int) -> None:
        if self.resident.offload is not None:
            copy_to_host(self.resident.layers[i].tensors(), self.work.pop(i).tensors())

    def finish(self) -> None:
        if self.resident.offload is not None and torch.cuda.is_available():
            torch.cuda.synchronize()


def copy_to_host(dst_host: list[torch.Tensor], src_device: list[torch.Tensor]) -> None:
    """dst.copy_(src) for each pair, asynchronously on a side stream when CUDA is in use (the next layer's compute
    overlaps the copy); call `torch.cuda.synchronize()` before reading the host tensors."""
    if not any(s.is_cuda for s in src_device):
        for d, s in zip(dst_host, src_device):
            d.copy_(s)
        return
    device = src_device[0].device
    stream = _side_streams.setdefault(device, torch.cuda.Stream(device))
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for d, s in zip(dst_host, src_device):
            d.copy_(s, non_blocking=True)
            # the source must outlive the copy even if the caller drops it
            s.record_stream(stream)


_side_streams: dict = {}
