"""Context parallel for glm52 (MLA + DSA + MoE), applied from outside the model (it imports no torch.distributed).

Rank r of the CP group owns the CONTIGUOUS shard [start_r, end_r) of the P captured prompt tokens (`shard_bounds`)
and keeps only that shard's pages (latent, rope, index keys); `Resident.num_tokens` is the global count P.
Only the model's page hooks are set, per attention layer (the model calls them; see models/glm52/model.py):
`page_range_fn`, `pages_topk_fn`, `pages_attention_fn` (replay, scoring, decode), `block_range_fn` (exact mode's
walk) and `span_pages_fn` (capture); `model.capture` becomes `cp_capture_glm52`, `model.decoder` the eager
`StepDecoder` (decode_step through the hooks), `model.prompt_placement_fn` cp_walk.py's `ShardedPrompt`.

Replay / scoring / decode (the response is replicated on every rank):
- DSA selection is GLOBAL and equals the one-rank selection exactly (integer-equal): each rank scores the
  replicated index queries against its own index pages; the response's own (new) keys are replicated, so only
  the last rank scores them, as the continuation of its shard on the global key axis (positions P, P+1, ...);
  `cp_global_topk` merges the candidates, k = min(index_topk, P + new keys). Shared (IndexShare) layers reuse
  the previous full layer's global indices.
- Sparse attention: each rank attends to the pages it owns among the selected ones (a partial with its lse;
  rows with none: out 0, lse -inf), q passes through `AllReduceGrad` first (every rank's pages contribute to
  dq), the partials merge across ranks (`MergeAcrossRanks`), then locally with the replicated new-key part.
  Every rank ends with the parameter gradients of one rank.

Exact mode (`capture.gradient=exact`): the prompt's reverse walk runs on every rank over every block
(cp_walk.py). A block's queries select among every rank's pages before the block plus the block's own keys
(`cp_block_range` says where this rank's part of them lies; the last rank scores the block's keys, as the
continuation of its part, maybe empty) by the same global top-k, and attend to them through
`cp_pages_attention`; its MoE layers see REPLICATED tokens (expert parallel: the all-reduce mode). glm52 has no
carried state: its capture keeps no boundary states.

Capture (no grad): every rank computes its shard's latent / rope / index keys and writes its own pages, then
all-gathers every rank's pages of the layer (576 + 128 numbers per token for glm52) and selects and attends
among all earlier keys, for its own ~1/N of the queries. Each rank's queries' selection is the one-rank
selection of those rows (a row's top-k does not depend on how queries are blocked).

What it simplifies: capture holds, transiently, ONE LAYER's whole-prompt pages on every rank (latent + rope +
index keys; ~1.4 KB per token in bf16 for GLM-5, 2.8 GB at 2M tokens, about twice that while the gathered
shards and their concatenation coexist), dropped after the layer: no ring passes. Shards are contiguous, so
capture attention is imbalanced (rank N-1's queries see the whole prompt, though DSA caps each query at
index_topk keys, so the imbalance is in the indexer's scoring). Replay's collectives block. `span_pages_fn`
all-gathers the shard sizes once per layer besides the pages.

Host-resident pages (`capture.offload=cpu`, the paper's GLM layout): each rank's shard of latent, rope and index
pages lives in its pinned host memory. Capture writes a layer's shard into a device buffer (all-gathered from
there as above) and copies it to the host while the next layer computes (`PageWriter`); replay, scoring and the
eager decode stage the shard one layer at a time (`stage_layers`), and the hooks above read the staged copy, so
values equal the on-device CP run's (tests/distributed/test_cp_offload.py). Exact mode refuses it.

Legend: B batch, T queries, S keys, C hidden, H heads, L latent, R rope, I index head dim, J index heads,
K = index_topk, W ranks in the CP group, X = L + R (+ I) numbers gathered per token.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from longstraw_cli.distributed.comm import shard_bounds
from longstraw_cli.distributed.cp_attention import AllReduceGrad, MergeAcrossRanks
from longstraw_cli.distributed.cp_topk import cp_global_topk
from longstraw_cli.distributed.cp_walk import ShardedPrompt, owned_blocks
from longstraw_cli.distributed.ep import tokens_sharded
from longstraw_cli.models.core import StepDecoder, check_prompt, tail_start
from longstraw_cli.resident import MLAPages
from longstraw_cli.resident.offload import PageWriter
from longstraw_kernels import compute_dtype

__all__ = ["apply_context_parallel_glm52", "cp_block_range", "cp_capture_glm52"]


# -- replay / scoring / decode ------------------------------------------------------------------------------------
def cp_page_range(pages: MLAPages, positions_T: torch.Tensor, num_new: int, *, group) -> tuple[int, int, bool]:
    """`MLAttention.page_range_fn`: (first prompt position this rank's pages hold, number of prompt pages P,
    whether this rank scores the replicated new keys: the last rank, as the continuation of its shard)."""
    # the queries end the new keys, which follow the P captured tokens
    num_pages = int(positions_T[-1]) + 1 - num_new
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    start, end = shard_bounds(num_pages, world, rank)
    assert pages.latent_PL.shape[0] == end - start, "pages are not this rank's shard"
    return start, num_pages, rank == world - 1


def cp_block_range(pages: MLAPages, positions_T: torch.Tensor, num_new: int, *, group) -> tuple[int, int, bool]:
    """`MLAttention.block_range_fn` (exact mode's walk): `pages` are this rank's pages before the block. The ranks'
    parts partition the positions before the block in rank order (contiguous shards), so this rank's first
    position is the count of the lower ranks' pages (one all-gather of the counts). -> (that first position,
    the block's start, whether this rank scores the block's own keys: the last rank, whose part ends at the
    start)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    count = torch.tensor([pages.latent_PL.shape[0]], device=pages.latent_PL.device)
    counts = [torch.empty_like(count) for _ in range(world)]
    dist.all_gather(counts, count, group=group)
    counts = [int(n) for n in counts]
    assert sum(counts) == int(positions_T[-1]) + 1 - num_new, "pages are not the ranks' pages before the block"
    return sum(counts[:rank]), sum(counts), rank == world - 1


@torch.no_grad()
def cp_pages_topk(scores_BTS: torch.Tensor, k: int, first: int, *, group) -> torch.Tensor:
    """`MLAttention.pages_topk_fn`: the GLOBAL top-k of the replicated queries over every rank's keys, from this
    rank's scores of positions first, first + 1, ... -> [B, T, k] global positions, ascending."""
    B, T, _ = scores_BTS.shape
    idx_Tk = cp_global_topk(scores_BTS.reshape(B * T, -1), k, start=first, group=group)
    return idx_Tk.view(B, T, k).sort(dim=-1).values


def cp_pages_attention(q_BTHA, pages: MLAPages, idx_BTK, first: int, num_pages: int, *, scale, sparse_attention_fn,
                       group):
    """`MLAttention.pages_attention_fn`: each rank attends to the selected pages it owns (a partial with its lse;
    rows with none: out 0, lse -inf), q passing through `AllReduceGrad` first (every rank's pages contribute to
    dq); the partials merge across ranks. -> (out_BTHL in q's dtype, lse_BTH), every rank the same."""
    q_c = q_BTHA.to(compute_dtype(q_BTHA))
    q_pages_BTHA = AllReduceGrad.apply(q_c, group)
    P = pages.latent_PL.shape[0]
    if P > 0:
        local_BTK = idx_BTK - first
        local_BTK = torch.where((local_BTK >= 0) & (local_BTK < P), local_BTK, -1)
        out_r, lse_r_BTH = sparse_attention_fn(q_pages_BTHA, pages.latent_PL, pages.rope_PR, local_BTK, scale=scale)
    else:
        # an empty partial, still computed from q so that this rank's backward reaches the dq all-reduce
        out_r = q_pages_BTHA[..., : pages.latent_PL.shape[-1]] * 0
        lse_r_BTH = q_pages_BTHA.new_full(q_pages_BTHA.shape[:3], float("-inf"))
    # MergeAcrossRanks takes out [B, R, H, D] and lse [B, H, R]; the kernel's lse is [B, T, H]
    out, lse_BHT = MergeAcrossRanks.apply(out_r.to(q_c.dtype), lse_r_BTH.to(q_c.dtype).transpose(1, 2), group)
    return out.to(q_BTHA.dtype), lse_BHT.transpose(1, 2)


# -- capture -------------------------------------------------------------------------------------------------------
@torch.no_grad()
def cp_span_pages(pages: MLAPages, *, group) -> MLAPages:
    """`MLAttention.span_pages_fn`: the pages of every prompt position up to the end of this rank's span (the
    lower ranks' and its own), all-gathered transiently: each rank's pages as written (in the page dtype), as the
    one-rank capture reads them back."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    own_TX = torch.cat(pages.tensors(), dim=1)
    size = torch.tensor([own_TX.shape[0]], device=own_TX.device)
    sizes = [torch.empty_like(size) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    sizes = [int(n) for n in sizes]
    # every rank's rows (sizes may differ): padded to the largest, all-gathered, trimmed
    pad_TX = own_TX.new_zeros((max(sizes), own_TX.shape[1]))
    pad_TX[: own_TX.shape[0]] = own_TX
    shards = [torch.empty_like(pad_TX) for _ in sizes]
    dist.all_gather(shards, pad_TX, group=group)
    prompt_SX = torch.cat([t[:n] for t, n in zip(shards[: rank + 1], sizes)])
    parts = prompt_SX.split([t.shape[1] for t in pages.tensors()], dim=1)
    return MLAPages(parts[0], parts[1], parts[2] if pages.index_PI is not None else None)


@torch.no_grad()
def cp_capture_glm52(model, prompt_ids: torch.Tensor, block_size: int = 4096, page_dtype=None,
                     offload: str | None = None, boundaries: bool = False, tail: int = 0, *, group):
    """This rank's resident state of a 1-D prompt that every rank of the CP group holds: the pages of its shard,
    num_tokens the global count. MoE layers see SHARDED tokens here (`tokens_sharded`: expert parallel uses
    all-to-all), and every rank runs the same number of MLP blocks (the largest shard's), so that collective
    calls match across ranks. offload="cpu": the shard's pages in (pinned) host memory, each layer's written in a
    device buffer (which `cp_span_pages` all-gathers from) and copied to the host while the next layer computes
    (`PageWriter`). boundaries=True (exact mode): `Resident.boundaries` as cp_walk.py lays them out, with no
    carried state in them. tail=n > 0 (capture reuse): `Resident.tail_start` where one device's capture would
    start its tail (`capture_blocks`), no carried state kept (glm52 has none)."""
    check_prompt(prompt_ids, block_size)
    if boundaries and offload is not None:
        raise ValueError(f"exact gradients (boundaries=True) need the resident state on the device; got "
                         f"offload={offload!r}")
    num_tokens = prompt_ids.numel() - 1
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    bounds = [shard_bounds(num_tokens, world, r) for r in range(world)]
    start, end = bounds[rank]
    model.prepare_capture(end)  # this span's last queries see every key up to its end (`cp_span_pages`)
    sizes = [e - s for s, e in bounds]
    resident = model.empty_resident(end - start, page_dtype, offload)
    resident.num_tokens, resident.last_token = num_tokens, int(prompt_ids[-1])
    device = model.lm_head.weight.device
    positions_T = torch.arange(start, end, device=device)
    x_BTC, idx = model.model.embed_tokens(prompt_ids[start:end].to(device))[None], None
    num_blocks = -(-max(sizes) // block_size)
    pages = PageWriter(resident, device)
    with tokens_sharded():
        for i, layer in enumerate(model.model.layers):
            x_BTC, idx = layer.capture_span(x_BTC, positions_T, pages.get(i), block_size, idx, num_blocks)
            pages.done(i)
    pages.finish()
    if boundaries:
        resident.boundaries = [None] * -(-num_tokens // block_size)
        for b in owned_blocks(num_tokens, block_size, start, end):
            resident.boundaries[b] = [None] * len(resident.layers)
    if tail:
        resident.tail, resident.tail_start = [None] * len(resident.layers), tail_start(num_tokens, block_size, tail)
    return resident


def apply_context_parallel_glm52(model, group) -> None:
    """Set every attention layer's page hooks to their CP versions, the model's capture to `cp_capture_glm52`, its
    decoder to the eager `StepDecoder` and its walk's placement to `ShardedPrompt`."""
    for layer in model.model.layers:
        attn = layer.self_attn
        attn.page_range_fn = functools.partial(cp_page_range, group=group)
        attn.pages_topk_fn = functools.partial(cp_pages_topk, group=group)
        attn.pages_attention_fn = functools.partial(cp_pages_attention, group=group)
        attn.block_range_fn = functools.partial(cp_block_range, group=group)
        attn.span_pages_fn = functools.partial(cp_span_pages, group=group)
    model.capture = functools.partial(cp_capture_glm52, model, group=group)
    model.prompt_placement_fn = functools.partial(ShardedPrompt, group=group)
    # the static-shaped decode step selects and attends on one device only; the eager step goes through the hooks
    model.decoder = functools.partial(StepDecoder, model)
