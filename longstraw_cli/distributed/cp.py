"""Context parallel for qwen36, applied from outside the model (the model files import no torch.distributed).

The captured prompt is split into CONTIGUOUS shards, rank i of the CP group owning tokens [start_i, end_i) of
the P-1 captured ones. Contiguous rather than zigzag because the GDN layers (3 of every 4) need their span in
order: a contiguous shard maps the incoming state by one affine map (M, S_ext), composed across ranks with a
single all-gather, and replay reads pages in prompt order. The price is attention load imbalance in capture
(rank N-1's queries see the whole prompt, rank 0's only its shard); the pages, and so memory, split evenly.

What changes, through the model's swappable hooks:
- capture: every rank runs the layer-by-layer capture of its shard. Attention layers pass K/V shards around the
  ring and merge with LSE; GDN layers exchange (M, S_ext) and the conv tails. Each rank keeps only its pages;
  the GDN state at the end of the prompt (and the conv window) reaches every rank.
- replay, scoring and decode: the response is replicated; each rank attends to its pages and the partials are
  merged across ranks inside the attention Function, whose backward all-reduces dq, so every rank holds the
  same parameter gradients as one rank would. GDN layers replay from the replicated final state.
- host-resident pages (`capture.offload=cpu`): each rank's K/V shard lives in its pinned host memory, written
  layer by layer in capture and staged one layer at a time for replay, scoring and decode (resident/offload.py),
  the hooks above reading the staged copy; values equal the on-device CP run's (tests/distributed/
  test_cp_offload.py). Exact mode refuses it (its walk differentiates the pages on the device).
- exact mode (`capture.gradient=exact`): the capture also keeps the GDN states at the starts of the capture
  blocks in the rank's shard (the span hooks keep them while they scan), and the prompt's reverse walk runs on
  every rank over every block with the pages where they are (cp_walk.py).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from longstraw_cli.distributed.comm import shard_bounds
from longstraw_cli.distributed.cp_attention import cp_capture_attention, cp_decode_pages_attention, cp_replay_attention
from longstraw_cli.distributed.cp_gdn import SpanBoundaries, cp_conv_window, cp_gdn_scan
from longstraw_cli.distributed.cp_walk import ShardedPrompt, owned_blocks
from longstraw_cli.models.core import tail_start
from longstraw_cli.models.spec import family_of
from longstraw_cli.resident import RecurrentState
from longstraw_kernels.gdn import gdn_forward

__all__ = ["apply_context_parallel", "apply_context_parallel_qwen36", "cp_capture", "shard_bounds"]


def cp_capture(model, prompt_ids: torch.Tensor, block_size: int = 4096, page_dtype=None, offload: str | None = None,
               boundaries: bool = False, tail: int = 0, *, group=None):
    """This rank's resident state of a 1-D prompt that every rank of the CP group holds. offload="cpu": this
    rank's K/V pages in (pinned) host memory, each layer's written on the device and copied there while the next
    layer computes (`capture_span`'s `PageWriter`); the GDN states stay on the device. boundaries=True (exact
    mode): also the GDN states at the start of each capture block that starts in this rank's shard
    (`Resident.boundaries`, None for the other blocks), kept by the GDN span hooks while they scan. tail=n > 0
    (capture reuse): `Resident.tail_start` where one device's capture would start its tail (`capture_blocks`),
    and on the rank whose shard holds that position the GDN states there (`Resident.tail`; None elsewhere)."""
    if prompt_ids.dim() != 1 or prompt_ids.numel() == 0:
        raise ValueError(f"capture takes a non-empty 1-D prompt, got shape {tuple(prompt_ids.shape)}")
    if boundaries and tail:
        raise ValueError("a capture keeps either the exact walk's boundaries or reuse's tail, not both")
    if boundaries and offload is not None:
        raise ValueError(f"exact gradients (boundaries=True) need the resident state on the device; got "
                         f"offload={offload!r}")
    num_tokens = prompt_ids.numel() - 1
    start, end = shard_bounds(num_tokens, dist.get_world_size(group), dist.get_rank(group))
    capture = functools.partial(model.capture_span, prompt_ids[start:end], start=start, num_tokens=num_tokens,
                                last_token=int(prompt_ids[-1]), block_size=block_size, page_dtype=page_dtype,
                                offload=offload)
    if not (boundaries or tail):
        return capture()
    first_tail = tail_start(num_tokens, block_size, tail) if tail else None
    positions = ([b * block_size for b in owned_blocks(num_tokens, block_size, start, end)] if boundaries
                 else [first_tail] if start <= first_tail < end else [])
    spans = {i: SpanBoundaries([p - start for p in positions])
             for i, layer in enumerate(model.model.layers) if not layer.is_attention}
    _set_span_hooks(model, group, spans)
    try:
        resident = capture()
    finally:
        _set_span_hooks(model, group)
    kept = [[RecurrentState(spans[i].conv_XW[j], spans[i].ssm_GKV[j]) if i in spans else None
             for i in range(len(resident.layers))] for j in range(len(positions))]
    if tail:
        resident.tail, resident.tail_start = (kept[0] if kept else None), first_tail
        return resident
    resident.boundaries = [None] * -(-num_tokens // block_size)
    for b, states in zip(owned_blocks(num_tokens, block_size, start, end), kept):
        resident.boundaries[b] = states
    return resident


def _set_span_hooks(model, group, spans: dict[int, SpanBoundaries] | None = None) -> None:
    """The GDN layers' capture hooks: the span's state composed across shards and its conv window gathered; with
    `spans` (layer index -> SpanBoundaries) the states at their offsets kept there too."""
    for i, layer in enumerate(model.model.layers):
        if not layer.is_attention:
            kept = None if spans is None else spans[i]
            # the local scans go through the model's dispatcher: fla's kernel on CUDA (bf16), torch elsewhere
            layer.linear_attn.span_gdn_fn = functools.partial(cp_gdn_scan, group=group, gdn_fn=gdn_forward,
                                                              boundaries=kept)
            layer.linear_attn.window_fn = functools.partial(cp_conv_window, group=group, boundaries=kept)


def apply_context_parallel(model, group) -> None:
    """Swap the model's attention hooks and its capture for their context-parallel versions: the model family's
    own `context_parallel` hook (qwen36: `apply_context_parallel_qwen36` below; glm52:
    `cp_glm52.apply_context_parallel_glm52`)."""
    family_of(model).apply_context_parallel(model, group)


def apply_context_parallel_qwen36(model, group) -> None:
    """qwen36: ring attention over the CP group's pages, GDN state composed across shards, sharded capture, the
    exact-mode walk over sharded pages."""
    for layer in model.model.layers:
        if layer.is_attention:
            layer.self_attn.attention_fn = functools.partial(cp_replay_attention, group=group)
            layer.self_attn.decode_pages_fn = functools.partial(cp_decode_pages_attention, group=group)
            layer.self_attn.span_attention_fn = functools.partial(cp_capture_attention, group=group)
    _set_span_hooks(model, group)
    model.capture = functools.partial(cp_capture, model, group=group)
    model.prompt_placement_fn = functools.partial(ShardedPrompt, group=group)
