"""Routing replay (R3, "Rollout Routing Replay", arXiv 2510.11370; Megatron-LM's `moe_enable_routing_replay`):
the experts each response token was routed to, and its DSA selection, recorded where the response was sampled
and forced wherever it is scored or replayed, so that a token near a top-k boundary cannot take other experts
(or other prompt keys) at replay than it took at sampling.

A `RoutingRecord` holds, for B responses of up to S tokens, per MoE layer the top-k expert ids of every response
token ([B, S, k]) and per "full" indexer layer its DSA selection ([B, S, index_topk], key positions, -1 none;
"shared" layers reuse the full layer's, as they always do). Slot s is the token at position `first` + s, the
input of replay row s (`first` is the resident prompt's length: slot 0 is the prompt's last token).

The layers route tokens after the prompt through two hooks (model.py's `MoE.route_fn`, `MLAttention.select_fn`),
which the context managers here swap for the duration of a block and put back:
- `recording`: the live choice, also written into the record at the tokens' slots (`index_copy_` at positions
  held on the device: no host synchronisation, safe inside the decode step's CUDA graph);
- `forcing`: the recorded choice. The routing WEIGHTS are recomputed from the live router at the recorded ids
  (`TopkRouter.weights`), so the router keeps its gradient; the DSA selection carries none either way. Expert
  parallel dispatches by the ids it is given and context parallel attends to the global positions it is given,
  so forcing is exact under both (every rank of a CP group holds the same record: it decodes the same tokens);
- `measuring`: the live choice, unchanged (the numbers of no replay at all, bit for bit).
With a `FlipCount`, forcing and measuring also compare the live choice with the record: per layer the fraction
of tokens whose expert SET (or selected key set) differs, logged as `rollout/expert_flip_frac`,
`rollout/dsa_flip_frac` (mean over layers) and `..._max` (the worst layer). Under forcing the DSA comparison
runs the indexer that forcing would skip.

Where the records live: the decode writes them into device buffers (a CUDA graph step cannot synchronise with the
host) of as many slots as its own response buffers, grown with them (`RoutingReplay.grow`, models/slots.py), and
when the rollout ends `to_host` moves them to host memory in one synchronous copy (pinned, so that
staging them back is a plain DMA; on a CPU run they stay where they are). From then on the compute device holds
only the rows in use, through `StagedRows`: the slots of the current call (a score batch's responses while they
are scored, one response, or one block of it, while it replays), copied at each layer's first read and dropped
when a call names other positions. So the transaction's peak holds one call's rows, whatever G and R. A record
made at scoring (vLLM) is written through the same staging (`staged_recording`): a score batch's rows on the
device, copied into the host record as the batch ends.

`RoutingReplay` is what the family registers (models/spec.py `routing`) and the rollout and the transaction call;
they see records as opaque objects. Model code only: no torch.distributed here.

Legend: B responses (rows of a record), S response slots, T tokens of a call, N = B x T, k experts per token,
K selected keys (index_topk).
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch

from longstraw_cli.models.glm52.model import MoE, live_route, live_selection
from longstraw_cli.models.slots import grown, slot_buffer

__all__ = ["FlipCount", "RoutingRecord", "RoutingReplay", "StagedRows", "forcing", "measuring", "record_bytes",
           "recording", "staged_recording", "to_host"]


def expert_id_dtype(num_experts: int) -> torch.dtype:
    """The narrowest integer type the records keep expert ids in."""
    return torch.int16 if num_experts <= torch.iinfo(torch.int16).max else torch.int32


# DSA selections are key positions (prompt + response): int32 holds 2^31 - 1 of them
SELECTION_DTYPE = torch.int32


@dataclass
class RoutingRecord:
    """Recorded routing of B responses of up to S tokens (see the module doc)."""

    # prompt position of slot 0
    first: int
    # MoE layer index -> expert ids [B, S, k]
    experts: dict[int, torch.Tensor]
    # full indexer layer index -> selected key positions [B, S, K]
    selections: dict[int, torch.Tensor]

    def rows(self, rows: slice) -> RoutingRecord:
        """The records of responses `rows` (views)."""
        return self._indexed(rows)

    def slots(self, count: int) -> RoutingRecord:
        """The records of the first `count` slots (views): what a decode of `count` steps wrote."""
        return self._indexed((slice(None), slice(count)))

    def _indexed(self, index) -> RoutingRecord:
        return RoutingRecord(self.first, {i: t[index] for i, t in self.experts.items()},
                             {i: t[index] for i, t in self.selections.items()})

    def nbytes(self) -> int:
        return sum(t.numel() * t.itemsize for t in self.tensors())

    def tensors(self) -> list[torch.Tensor]:
        return [*self.experts.values(), *self.selections.values()]

    def grow(self, capacity: int) -> None:
        """Every layer's record moved to `capacity` slots, the written ones copied, one at a time (the decode's
        buffers grow so: models/slots.py). In place: each tensor object stays the same (`set_` to the grown
        storage), so that the recording hooks, which hold a layer's tensors, follow the growth."""
        for records in (self.experts, self.selections):
            for t in records.values():
                t.set_(grown(t, capacity))

    def expert_ids(self, layer: int, positions_T: torch.Tensor) -> torch.Tensor:
        """[B, T, k] expert ids of MoE layer `layer` at prompt positions `positions_T` (on the record's device)."""
        return self.experts[layer].index_select(1, positions_T - self.first)

    def selection(self, layer: int, positions_T: torch.Tensor) -> torch.Tensor:
        """[B, T, K] DSA selection of full indexer layer `layer` at `positions_T` (on the record's device)."""
        return self.selections[layer].index_select(1, positions_T - self.first)

    @classmethod
    def empty(cls, model, batch: int, capacity: int, first: int, *, host: bool = False) -> RoutingRecord:
        """Zeroed records for `batch` responses of up to `capacity` tokens after a prompt of `first` positions, on
        the model's device (host=True: in host memory, pinned where the model is on CUDA)."""
        cfg, device = model.config, model.lm_head.weight.device

        def zeros(row: int, dtype: torch.dtype) -> torch.Tensor:
            if host:
                return torch.zeros(batch, capacity, row, dtype=dtype, pin_memory=device.type == "cuda")
            # the decode's record: slots as the decoder's (the capacity a dynamic size of the compiled step)
            return slot_buffer(batch, capacity, row, dtype=dtype, device=device)

        ids_dtype = expert_id_dtype(cfg.n_routed_experts)
        experts = {i: zeros(cfg.num_experts_per_tok, ids_dtype) for i, _ in _moe_layers(model)}
        selections = {i: zeros(cfg.index_topk, SELECTION_DTYPE) for i, _ in _indexer_layers(model)}
        return cls(first, experts, selections)


def to_host(record: RoutingRecord, slots: int | None = None, spare: dict | None = None) -> RoutingRecord:
    """The record's first `slots` slots (all by default) in pinned host memory; a record already on the host gives
    views, no copy. One synchronous copy: every tensor's device-to-host copy is queued on the current stream and
    waited for once, so the device buffers are free the moment this returns (a side stream would keep them, and
    the rollout's peak with them, until it finished, to hide a copy that takes well under 1% of the decode that
    wrote them). Only the slots a decode wrote cross: its buffers hold at least `response_chunk` slots (1,024 by
    default), 16 times the bytes of a 64-token decode. spare: pinned flat buffers by (kind, layer) (`host_buffers`
    of a record no longer read), written where they hold the layer's record; new pinned memory elsewhere."""
    if slots is not None:
        record = record.slots(slots)
    tensors = record.tensors()
    if not tensors or tensors[0].device.type == "cpu":
        return record
    device, spare = tensors[0].device, spare or {}

    def pinned(key, t: torch.Tensor) -> torch.Tensor:
        flat = spare.get(key)
        if flat is not None and flat.dtype == t.dtype and flat.numel() >= t.numel():
            out = flat[:t.numel()].view(t.shape)
        else:
            out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        return out.copy_(t, non_blocking=True)

    host = RoutingRecord(record.first, {i: pinned(("experts", i), t) for i, t in record.experts.items()},
                         {i: pinned(("selections", i), t) for i, t in record.selections.items()})
    torch.cuda.current_stream(device).synchronize()
    return host


def host_buffers(record: RoutingRecord) -> dict:
    """A pinned host record's buffers, whole (each tensor's storage as a flat tensor), by (kind, layer): what
    `to_host` may write again."""
    def flat(t: torch.Tensor) -> torch.Tensor:
        return torch.empty(0, dtype=t.dtype).set_(t.untyped_storage())

    return {**{("experts", i): flat(t) for i, t in record.experts.items() if t.is_pinned()},
            **{("selections", i): flat(t) for i, t in record.selections.items() if t.is_pinned()}}


class StagedRows:
    """Rows `rows` of a (host) record as the forcing hooks read them on `device`: per call, only the slots its
    positions name, each layer's copied at its first read and kept while calls name the same positions (a call's
    other layers, its backward), dropped when a call names others (the next block of a response). Finding the slots
    costs one host synchronisation per call (the positions are a device tensor), none per layer."""

    def __init__(self, record: RoutingRecord, rows: slice, device: torch.device):
        self.record, self.device = record.rows(rows), torch.device(device)
        # the positions of the call staged for, their slots on the host, and ("expert" | "dsa", layer) -> rows
        self.positions_T, self.slots_T, self.staged = None, None, {}

    @property
    def first(self) -> int:
        return self.record.first

    def expert_ids(self, layer: int, positions_T: torch.Tensor) -> torch.Tensor:
        return self._stage(("expert", layer), self.record.experts[layer], positions_T)

    def selection(self, layer: int, positions_T: torch.Tensor) -> torch.Tensor:
        return self._stage(("dsa", layer), self.record.selections[layer], positions_T)

    def device_bytes(self) -> int:
        """Bytes of the record this view holds on its device now."""
        return sum(t.numel() * t.itemsize for t in self.staged.values())

    def _stage(self, key, host_BSX: torch.Tensor, positions_T: torch.Tensor) -> torch.Tensor:
        if positions_T is not self.positions_T:
            slots_T = (positions_T - self.first).cpu()
            if self.slots_T is None or not torch.equal(slots_T, self.slots_T):
                self.staged = {}
            self.positions_T, self.slots_T = positions_T, slots_T
        if key not in self.staged:
            self.staged[key] = _at_slots(host_BSX, self.slots_T).to(self.device, non_blocking=True)
        return self.staged[key]


def _at_slots(x_BSX: torch.Tensor, slots_T: torch.Tensor) -> torch.Tensor:
    """x_BSX at slots `slots_T` (host): a view where they are consecutive (a call's usual positions: pinned memory
    stays pinned, so the copy to the device is asynchronous), a gathered copy otherwise."""
    T = slots_T.numel()
    if T and int(slots_T[-1]) - int(slots_T[0]) == T - 1 and bool((slots_T.diff() == 1).all()):
        return x_BSX.narrow(1, int(slots_T[0]), T)
    return x_BSX.index_select(1, slots_T)


def record_bytes(cfg, batch: int, capacity: int) -> int:
    """Bytes of one `RoutingRecord` of a model config (`longstraw plan`)."""
    num_moe = sum(t == "sparse" for t in cfg.layer_mlp_types)
    num_full = sum(t == "full" for t in cfg.layer_indexer_types)
    per_token = (num_moe * cfg.num_experts_per_tok * expert_id_dtype(cfg.n_routed_experts).itemsize
                 + num_full * cfg.index_topk * SELECTION_DTYPE.itemsize)
    return batch * capacity * per_token


class FlipCount:
    """Per layer, tokens whose live choice differs from the record (a device tensor until `metrics()`, which
    synchronises once) and tokens compared (a host count)."""

    def __init__(self):
        # (kind, layer) -> [flipped (device tensor), compared (int)]
        self.counts: dict[tuple[str, int], list] = {}

    def add(self, kind: str, layer: int, live_NX: torch.Tensor, recorded_NX: torch.Tensor) -> None:
        """Compare two choices per token as SETS (rows of ids in any order)."""
        live_NX, recorded_NX = live_NX.reshape(-1, live_NX.shape[-1]), recorded_NX.reshape(live_NX.shape)
        differs_N = (live_NX.long().sort(-1).values != recorded_NX.long().sort(-1).values).any(-1)
        count = self.counts.setdefault((kind, layer), [0, 0])
        count[0], count[1] = count[0] + differs_N.sum(), count[1] + differs_N.numel()

    def metrics(self) -> dict[str, float]:
        """{rollout/<kind>_flip_frac: mean over layers, rollout/<kind>_flip_frac_max: worst layer}; counts reset."""
        out = {}
        for kind in ("expert", "dsa"):
            keys = sorted(key for key in self.counts if key[0] == kind)
            if not keys:
                continue
            flipped = torch.stack([torch.as_tensor(self.counts[key][0]) for key in keys]).double().cpu()
            fracs = flipped / torch.tensor([max(1, self.counts[key][1]) for key in keys], dtype=torch.float64)
            out[f"rollout/{kind}_flip_frac"] = float(fracs.mean())
            out[f"rollout/{kind}_flip_frac_max"] = float(fracs.max())
        self.counts = {}
        return out


def _moe_layers(model) -> list[tuple[int, MoE]]:
    return [(i, layer.mlp) for i, layer in enumerate(model.model.layers) if isinstance(layer.mlp, MoE)]


def _indexer_layers(model) -> list:
    return [(i, layer.self_attn) for i, layer in enumerate(model.model.layers) if layer.self_attn.indexer is not None]


# -- the hooks --------------------------------------------------------------------------------------------------
def recorded_route(ids_BSk: torch.Tensor, first_1: torch.Tensor, gate, x_NC, positions_T):
    """`route_fn` that records: the live choice, written into the layer's record `ids_BSk` at the tokens' slots
    (slot 0 at position `first_1`, a tensor: a compiled step does not specialise on the prompt's length)."""
    topk_idx_Nk, topk_w_Nk = gate(x_NC)
    ids_BSk.index_copy_(1, positions_T - first_1, topk_idx_Nk.view(ids_BSk.shape[0], -1, ids_BSk.shape[2])
                        .to(ids_BSk.dtype))
    return topk_idx_Nk, topk_w_Nk


def forced_route(record, flips: FlipCount | None, layer: int, gate, x_NC, positions_T):
    """`route_fn` that forces the recorded experts (`record`: a RoutingRecord or its StagedRows), weighted by the
    live router's scores at them."""
    ids_BTk = record.expert_ids(layer, positions_T)
    forced_Nk = ids_BTk.reshape(-1, ids_BTk.shape[2]).long()
    scores_NE = gate.scores(x_NC)
    if flips is not None:
        flips.add("expert", layer, gate.choose(scores_NE), forced_Nk)
    return forced_Nk, gate.weights(scores_NE, forced_Nk)


def measured_route(record, flips: FlipCount, layer: int, gate, x_NC, positions_T):
    """`route_fn` that routes live and counts where the live choice differs from the record."""
    topk_idx_Nk, topk_w_Nk = gate(x_NC)
    flips.add("expert", layer, topk_idx_Nk, record.expert_ids(layer, positions_T))
    return topk_idx_Nk, topk_w_Nk


def recorded_selection(selected_BSK: torch.Tensor, first_1: torch.Tensor, positions_T, live):
    """`select_fn` that records the live selection into the layer's record `selected_BSK` at the tokens' slots."""
    idx_BTK = live()
    selected_BSK.index_copy_(1, positions_T - first_1, idx_BTK.to(SELECTION_DTYPE))
    return idx_BTK


def forced_selection(record, flips: FlipCount | None, layer: int, positions_T, live):
    """`select_fn` that forces the recorded selection (the indexer runs only to count flips)."""
    forced_BTK = record.selection(layer, positions_T).long()
    if flips is not None:
        flips.add("dsa", layer, live(), forced_BTK)
    return forced_BTK


def measured_selection(record, flips: FlipCount, layer: int, positions_T, live):
    """`select_fn` that selects live and counts where the selection differs from the record."""
    idx_BTK = live()
    flips.add("dsa", layer, idx_BTK, record.selection(layer, positions_T))
    return idx_BTK


def _hooks(model, route, select, *args):
    """Every MoE layer i's `route_fn` = route(*args, i, ...), every full indexer layer i's `select_fn` =
    select(*args, i, ...) inside the block; the live hooks after it."""
    return _layer_hooks(model, lambda i: functools.partial(route, *args, i),
                        lambda i: functools.partial(select, *args, i))


@contextlib.contextmanager
def _layer_hooks(model, route_of, select_of):
    """Every MoE layer i's `route_fn` = route_of(i), every full indexer layer i's `select_fn` = select_of(i)
    inside the block; the live hooks after it."""
    moe, indexer = _moe_layers(model), _indexer_layers(model)
    try:
        for i, mlp in moe:
            mlp.route_fn = route_of(i)
        for i, attn in indexer:
            attn.select_fn = select_of(i)
        yield
    finally:
        for _, mlp in moe:
            mlp.route_fn = live_route
        for _, attn in indexer:
            attn.select_fn = live_selection


def recording(model, record: RoutingRecord, rows: slice = slice(None)):
    """Within the block, tokens after the prompt route live and their choices go into `record` rows `rows` (the
    call's batch rows, in order); `record` is on the model's device (the decode's buffers). Each layer's hook holds
    that layer's tensors and the first position as a tensor, no Python int: an int would be a constant of the
    compiled decode step's graph, one recompilation per prompt length (and, while the step broke its graph at each
    layer's kernels, one per layer: past dynamo's limit of 8 the rest ran eagerly). All rows: the hooks hold
    `record`'s own tensors, not views, which `RoutingRecord.grow` grows in place."""
    part = record if rows == slice(None) else record.rows(rows)
    tensors = part.tensors()
    first_1 = torch.tensor([part.first], device=tensors[0].device if tensors else None)
    return _layer_hooks(model, lambda i: functools.partial(recorded_route, part.experts[i], first_1),
                        lambda i: functools.partial(recorded_selection, part.selections[i], first_1))


@contextlib.contextmanager
def staged_recording(model, record: RoutingRecord, rows: slice, device: torch.device):
    """`recording` into rows `rows` of a host record through zeroed rows on `device`, copied into the host record
    as the block ends (a score batch's rows on the device at a time)."""
    part = record.rows(rows)
    staged = RoutingRecord(part.first, {i: torch.zeros_like(t, device=device) for i, t in part.experts.items()},
                           {i: torch.zeros_like(t, device=device) for i, t in part.selections.items()})
    with recording(model, staged):
        yield
    for host, t in zip(part.tensors(), staged.tensors()):
        host.copy_(t)


def forcing(model, record, flips: FlipCount | None = None):
    """Within the block, tokens after the prompt take the choices of `record` (a RoutingRecord on the model's
    device or StagedRows; its rows are the call's batch rows); with `flips`, the live choices are compared with
    it."""
    return _hooks(model, forced_route, forced_selection, record, flips)


def measuring(model, record, flips: FlipCount):
    """Within the block, tokens after the prompt route live (unchanged numbers) and are compared with `record`."""
    return _hooks(model, measured_route, measured_selection, record, flips)


def _device(model) -> torch.device:
    return model.lm_head.weight.device


class RoutingReplay:
    """`rollout.replay_routing` for glm52 (models/spec.py `routing`): force=True forces the records in scoring
    and replay (`true`, `auto`), False only measures the flips (`measure`). Flips are counted in the replays.
    Records reach the transaction in host memory (`offload`); scoring and each replay stage their rows
    (`staged`: the device view of the context open now, None outside one)."""

    def __init__(self, force: bool = True):
        self.force, self.flips, self.staged = force, FlipCount(), None
        # the pinned buffers of the last record released (`release`), by (kind, layer), for the next `offload`
        self.spare: dict = {}

    def new_record(self, model, resident, batch: int, capacity: int, *, host: bool = False) -> RoutingRecord:
        """Zeroed records on the model's device (the decode's buffers), or, host=True, in host memory."""
        return RoutingRecord.empty(model, batch, capacity, resident.num_tokens, host=host)

    def offload(self, record: RoutingRecord, slots: int | None = None) -> RoutingRecord:
        """The record's first `slots` slots (the decode's steps) in host memory, once its writer (the decode) is
        done with the device buffers: `to_host`, into the pinned buffers of the last record `release`d where they
        hold it."""
        spare, self.spare = self.spare, {}
        return to_host(record, slots, spare)

    def release(self, record: RoutingRecord | None) -> None:
        """`record`, an `offload`ed record, is read no more: the next `offload` writes into its pinned buffers.
        Pinning host memory costs far more than the copy into it (on the H200's host: 0.43 s to pin 0.75 GiB, 15 ms
        to copy it; glm52_mini's record at G = 8 and 1,024 tokens, 0.25 GiB, took 0.10-0.14 s to offload, 0.1 ms a
        decode step). The caller promises that nothing reads it after this call."""
        if record is not None:
            self.spare = host_buffers(record)

    def recording(self, record: RoutingRecord, model, rows: slice = slice(None)):
        """Calls in the block record their routing into `record` rows `rows`: directly where the record is on the
        model's device (the decode), through staged rows where it is in host memory (scoring)."""
        device = _device(model)
        if record.tensors() and record.tensors()[0].device != device:
            return staged_recording(model, record, rows, device)
        return recording(model, record, rows)

    def scoring(self, record: RoutingRecord, model, rows: slice):
        """Graph-free scoring of responses `rows` (old and reference log-probs): forced, no flips counted."""
        return self._staged(record, model, rows, None) if self.force else contextlib.nullcontext()

    def replaying(self, record: RoutingRecord, model, rows: slice):
        """The replay of responses `rows`: forced (or live) with the flips counted."""
        return self._staged(record, model, rows, self.flips)

    @contextlib.contextmanager
    def _staged(self, record: RoutingRecord, model, rows: slice, flips: FlipCount | None):
        self.staged = StagedRows(record, rows, _device(model))
        hooks = forcing(model, self.staged, flips) if self.force else measuring(model, self.staged, flips)
        try:
            with hooks:
                yield
        finally:
            self.staged = None

    def metrics(self) -> dict[str, float]:
        return self.flips.metrics()
