"""Context parallel for glm52 (MLA + DSA + MoE), applied from outside the model (it imports no torch.distributed).

Rank r of the CP group owns the CONTIGUOUS shard [start_r, end_r) of the P captured prompt tokens (`shard_bounds`)
and keeps only that shard's pages (latent, rope, index keys); `Resident.num_tokens` is the global count P.
The hooks replaced, per attention layer: `MLAttention.forward` (replay, scoring, decode) and
`MLAttention.capture_span` (capture); `model.capture` becomes `cp_capture_glm52`.

Replay / scoring / decode (the response is replicated on every rank):
- DSA selection is GLOBAL and equals the one-rank selection exactly (integer-equal): each rank scores the
  replicated index queries against its own index pages; the response's own (new) keys are replicated, so only
  the last rank scores them, as the continuation of its shard on the global key axis (positions P, P+1, ...);
  `cp_global_topk` merges the candidates, k = min(index_topk, P + new keys). Shared (IndexShare) layers reuse
  the previous full layer's global indices.
- Sparse attention: each rank attends to the pages it owns among the selected ones (a partial with its lse;
  rows with none: out 0, lse -inf), q passes through `_AllReduceGrad` first (every rank's pages contribute to
  dq), the partials merge across ranks (`_MergeAcrossRanks`), then locally with the replicated new-key part.
  Every rank ends with the parameter gradients of one rank.

Capture (no grad): every rank computes its shard's latent / rope / index keys and writes its own pages, then
all-gathers every rank's pages of the layer (576 + 128 numbers per token for glm52) and selects and attends
among all earlier keys, for its own ~1/N of the queries. Each rank's queries' selection is the one-rank
selection of those rows (a row's top-k does not depend on how queries are blocked).

What it simplifies: capture holds, transiently, ONE LAYER's whole-prompt pages on every rank (latent + rope +
index keys; ~1.4 KB per token in bf16 for GLM-5, 2.8 GB at 2M tokens, about twice that while the gathered
shards and their concatenation coexist), dropped after the layer: no ring passes. Shards are contiguous, so capture attention is imbalanced (rank N-1's queries see the whole prompt,
though DSA caps each query at index_topk keys, so the imbalance is in the indexer's scoring). Replay's
collectives block. No CPU offload of pages under CP.

Legend: B batch, T queries, S keys, C hidden, H heads, L latent, R rope, I index head dim, J index heads,
K = index_topk, W ranks in the CP group, X = L + R (+ I) numbers gathered per token.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from longstraw_cli.distributed.cp_attention import _AllReduceGrad, _MergeAcrossRanks
from longstraw_cli.distributed.cp_topk import cp_global_topk
from longstraw_cli.distributed.ep import tokens_sharded
from longstraw_cli.models.glm52.model import KeyAxis, _selected_mask, rope_cos_sin, score_rows
from longstraw_cli.resident import MLAPages
from longstraw_kernels import compute_dtype
from longstraw_kernels.mla import dense_mla_attention, merge_lse

__all__ = ["apply_context_parallel_glm52", "cp_capture_glm52"]


def _shard_bounds(num_tokens: int, num_ranks: int, rank: int) -> tuple[int, int]:
    from longstraw_cli.distributed.cp import shard_bounds  # cp.py imports this module
    return shard_bounds(num_tokens, num_ranks, rank)


# -- replay / scoring / decode ------------------------------------------------------------------------------------
@torch.no_grad()
def _cp_select(attn, x_BTC, q_resid_BTQ, cos_TF, sin_TF, index_PI, new_index_BSI, *, num_pages, start, last,
               group) -> torch.Tensor:
    """Global top-k over all ranks' pages plus the replicated new keys: [B, T, K] global positions, ascending,
    -1 where fewer keys are visible (the layout of `MLAttention.select`)."""
    B, T = x_BTC.shape[:2]
    S_new = new_index_BSI.shape[1]
    q_BTJI, w_BTJ = attn.indexer.queries(x_BTC, q_resid_BTQ, cos_TF, sin_TF)
    num_keys = num_pages + S_new
    k = min(attn.cfg.index_topk, num_keys)
    idx_BTK = torch.full((B, T, attn.cfg.index_topk), -1, dtype=torch.long, device=x_BTC.device)
    keys = [index_PI] + ([new_index_BSI] if last else [])
    keys = [key for key in keys if key.shape[-2] > 0]
    # new key j is visible to query t iff j <= t + S_new - T (pages are all visible)
    t_T1 = torch.arange(T, device=x_BTC.device)[:, None]
    visible_new_TS = torch.arange(S_new, device=x_BTC.device)[None, :] <= t_T1 + (S_new - T)
    # the row chunking depends only on replicated sizes: every rank makes the same number of collective calls
    rows = score_rows(num_keys, B, x_BTC.device)
    for t0 in range(0, T, rows):
        t1 = min(T, t0 + rows)
        if keys:
            scores_BTS = attn.indexer.scores(q_BTJI[:, t0:t1], w_BTJ[:, t0:t1], keys)
        else:
            scores_BTS = w_BTJ.new_empty((B, t1 - t0, 0))
        if last and S_new:
            pages_TS = visible_new_TS.new_ones((t1 - t0, scores_BTS.shape[-1] - S_new))
            mask_TS = torch.cat([pages_TS, visible_new_TS[t0:t1]], dim=1)
            scores_BTS = scores_BTS.masked_fill(~mask_TS, float("-inf"))
        g_Tk = cp_global_topk(scores_BTS.reshape(B * (t1 - t0), -1), k, start=start, group=group)
        g_BTk = g_Tk.view(B, t1 - t0, k).sort(dim=-1).values
        seen = (g_BTk < num_pages) | (g_BTk - num_pages <= t_T1[t0:t1] + (S_new - T))
        idx_BTK[:, t0:t1, :k] = g_BTk.masked_fill(~seen, -1)
    return idx_BTK


def _cp_attend(attn, q_BTHA, pages: MLAPages, idx_BTK, new, *, num_pages, start, group) -> torch.Tensor:
    """Selected pages of every rank (merged across ranks) LSE-merged with the selected new keys. -> out_BTHL."""
    out = None
    if num_pages > 0:
        q_c = q_BTHA.to(compute_dtype(q_BTHA.dtype))
        q_pages_BTHA = _AllReduceGrad.apply(q_c, group)
        P = pages.latent_PL.shape[0]
        if P > 0:
            local_BTK = idx_BTK - start
            local_BTK = torch.where((local_BTK >= 0) & (local_BTK < P), local_BTK, -1)
            out_r, lse_r_BTH = attn.sparse_attention_fn(q_pages_BTHA, pages.latent_PL, pages.rope_PR, local_BTK,
                                                        scale=attn.scale)
        else:
            # an empty partial, still computed from q so that this rank's backward reaches the dq all-reduce
            out_r = q_pages_BTHA[..., : pages.latent_PL.shape[-1]] * 0
            lse_r_BTH = q_pages_BTHA.new_full(q_pages_BTHA.shape[:3], float("-inf"))
        # _MergeAcrossRanks takes out [B, R, H, D] and lse [B, H, R]; the kernel's lse is [B, T, H]
        out, lse_BHT = _MergeAcrossRanks.apply(out_r.to(q_c.dtype), lse_r_BTH.to(q_c.dtype).transpose(1, 2),
                                               group)
        lse = lse_BHT.transpose(1, 2)
    allowed_BTS = _selected_mask(idx_BTK, num_pages, new[0].shape[1])
    out_new, lse_new = dense_mla_attention(q_BTHA, new[0], new[1], allowed_BTS, scale=attn.scale)
    if out is None:
        return out_new
    return merge_lse(out.to(out_new.dtype), lse.to(lse_new.dtype), out_new, lse_new)[0]


def cp_attention_forward(attn, x_BTC, positions_T, pages: MLAPages, num_cached: int = 0, write: bool = False,
                         prev_idx=None, decode=None, *, group):
    """`MLAttention.forward` against this rank's pages (the non-write paths: replay, scoring, decode).
    -> (y_BTC, idx_BTK of GLOBAL positions, the one-rank selection)."""
    if write:
        raise ValueError("under context parallel the prompt is captured by cp_capture_glm52, not block writes")
    cos, sin = rope_cos_sin(positions_T, attn.rope_dim, attn.cfg.rope_theta, x_BTC.dtype)
    q_resid, q_nope, q_rope = attn.project_q(x_BTC, cos, sin)
    latent_BTL, rope_BTR = attn.project_kv(x_BTC, cos, sin)
    index_BTI = None if attn.indexer is None else attn.indexer.keys(x_BTC, cos, sin)
    if decode is not None:
        latent_BTL, rope_BTR, index_BTI = decode.append(latent_BTL, rope_BTR, index_BTI)
    # the queries end the new keys, which follow the P captured tokens
    num_pages = int(positions_T[-1]) + 1 - latent_BTL.shape[1]
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    start, end = _shard_bounds(num_pages, world, rank)
    assert pages.latent_PL.shape[0] == end - start, "pages are not this rank's shard"
    common = dict(num_pages=num_pages, start=start, group=group)
    if attn.indexer is not None:
        idx_BTK = _cp_select(attn, x_BTC, q_resid, cos, sin, pages.index_PI, index_BTI, last=rank == world - 1,
                             **common)
    else:
        idx_BTK = prev_idx
    out = _cp_attend(attn, attn.absorb(q_nope, q_rope), pages, idx_BTK, (latent_BTL, rope_BTR), **common)
    return attn.output(out), idx_BTK


# -- capture -------------------------------------------------------------------------------------------------------
def _all_gather_rows(own_TX: torch.Tensor, sizes: list[int], group) -> list[torch.Tensor]:
    """Every rank's rows (sizes may differ): padded to the largest, all-gathered, trimmed."""
    pad_TX = own_TX.new_zeros((max(sizes), own_TX.shape[1]))
    pad_TX[: own_TX.shape[0]] = own_TX
    out = [torch.empty_like(pad_TX) for _ in sizes]
    dist.all_gather(out, pad_TX, group=group)
    return [t[:n] for t, n in zip(out, sizes)]


@torch.no_grad()
def cp_attention_capture_span(attn, x_BTC, positions_T, pages: MLAPages, block_size: int, prev_idx=None, *,
                              start: int, sizes: list[int], group):
    """`MLAttention.capture_span` for this rank's shard [start, start + T): writes its own pages, then each block
    of its queries selects and attends among every earlier prompt key (all ranks' pages of this layer,
    all-gathered transiently). -> (y_BTC, idx_BTK of global positions)."""
    T = x_BTC.shape[1]
    cos, sin = attn.write_span_pages(x_BTC, positions_T, pages)
    # the pages as written (in the page dtype), as the one-rank capture reads them back
    rank = dist.get_rank(group)
    widths = [t.shape[1] for t in pages.tensors()]
    shards = _all_gather_rows(torch.cat(pages.tensors(), dim=1), sizes, group)
    # keys of the lower ranks and this one: all this rank's queries can see
    prompt_SX = torch.cat(shards[: rank + 1])
    parts = prompt_SX.split(widths, dim=1)
    seen = MLAPages(parts[0], parts[1], parts[2] if attn.indexer is not None else None)
    y, idx = [], []
    for b0 in range(0, T, block_size):
        b1 = min(T, b0 + block_size)
        x, c, s = x_BTC[:, b0:b1], cos[b0:b1], sin[b0:b1]
        q_resid, q_nope, q_rope = attn.project_q(x, c, s)
        axis = KeyAxis(start + b1, 0, b1 - b0)
        if attn.indexer is not None:
            idx_BTK = attn.select(x, q_resid, c, s, [seen.index_PI[: start + b1]], axis)
        else:
            idx_BTK = prev_idx[:, b0:b1]
        y.append(attn.output(attn.attend(attn.absorb(q_nope, q_rope), seen, idx_BTK, axis)))
        idx.append(idx_BTK)
    if T == 0:
        return x_BTC.clone(), x_BTC.new_zeros((1, 0, attn.cfg.index_topk), dtype=torch.long)
    return torch.cat(y, dim=1), torch.cat(idx, dim=1)


@torch.no_grad()
def cp_capture_glm52(model, prompt_ids: torch.Tensor, block_size: int = 4096, page_dtype=None, *, group):
    """This rank's resident state of a 1-D prompt that every rank of the CP group holds: the pages of its shard,
    num_tokens the global count. MoE layers see SHARDED tokens here (`tokens_sharded`: expert parallel uses
    all-to-all), and every rank runs the same number of MLP blocks (the largest shard's), so that collective
    calls match across ranks."""
    model._check_prompt(prompt_ids, block_size)
    num_tokens = prompt_ids.numel() - 1
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    bounds = [_shard_bounds(num_tokens, world, r) for r in range(world)]
    start, end = bounds[rank]
    sizes = [e - s for s, e in bounds]
    resident = model.empty_resident(end - start, page_dtype)
    resident.num_tokens, resident.last_token = num_tokens, int(prompt_ids[-1])
    device = model.lm_head.weight.device
    positions_T = torch.arange(start, end, device=device)
    x_BTC, idx = model.model.embed_tokens(prompt_ids[start:end].to(device))[None], None
    num_blocks = -(-max(sizes) // block_size)
    with tokens_sharded():
        for layer, pages in zip(model.model.layers, resident.layers):
            h, idx = layer.self_attn.capture_span(layer.input_layernorm(x_BTC), positions_T, pages, block_size, idx,
                                                  start=start, sizes=sizes)
            x_BTC = x_BTC + h
            for b in range(num_blocks):
                block = x_BTC[:, b * block_size : (b + 1) * block_size]
                block += layer.mlp(layer.post_attention_layernorm(block))
    return resident


def apply_context_parallel_glm52(model, group) -> None:
    """Swap every attention layer's replay and capture paths, and the model's capture, for their CP versions."""
    for layer in model.model.layers:
        attn = layer.self_attn
        # instance attributes shadow the class's methods; nn.Module.__call__ calls self.forward
        attn.forward = functools.partial(cp_attention_forward, attn, group=group)
        attn.capture_span = functools.partial(cp_attention_capture_span, attn, group=group)
    model.capture = functools.partial(cp_capture_glm52, model, group=group)
