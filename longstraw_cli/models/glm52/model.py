"""glm52 = HF `glm_moe_dsa` (GLM-5: MLA + DSA lightning indexer + MoE) in plain PyTorch, single device.

The walks through the layers are the shared `models.core.CausalLM`'s; each layer has one method per named path:
- `forward`: the full-sequence reference, as HF computes it: kv_b expands the latent to per-head K/V and the DSA
  top-k becomes a mask on dense causal attention.
- `capture_block` / `capture_span`: the prompt's resident state under no_grad (block by block, or one layer over
  a span): per layer the MLA latent and rope key of each token, and the indexer keys on "full" indexer layers.
  No per-head K/V, no prompt logits.
- `replay` / `decode_step`: tokens after the prompt in absorbed-MLA form (kv_b's key part folded into the query,
  its value part applied to the output): the indexer scores the queries against all prompt indexer keys plus
  the new tokens' own (causal), the top-k picks entries, sparse attention reads the selected prompt pages
  (longstraw_kernels/mla) and the new keys, merged by LSE. The pages are read, never written.
- `replay_block`: one block of a response, its new keys the response's earlier blocks' (latent, rope and index
  keys) ahead of its own: blockwise replay and scoring (models/blockwise.py).
Module names mirror HF's so a checkpoint loads as it is (experts: see hf.py).

Selection (DSA top-k). Query t sees the keys at positions <= t; it attends to the min(index_topk, visible)
visible keys of highest index score: HF's semantics (HF takes top-min(index_topk, T) over scores with -inf at
future positions, and the causal mask removes what the top-k picked among those). Index scores are sums of
ReLUs, so exact ties (often at 0) occur; ours are broken toward the LOWER position (`topk_lowest_position`),
which makes the selection exactly reproducible (`longstraw_kernels.dsa.topk`, which context parallel's merge
uses too); torch.topk leaves the choice among ties unspecified.
Index scores come from `longstraw_kernels.dsa.indexer_scores` (a fused Triton kernel on CUDA, which skips key
tiles no query of a tile sees; the torch reference elsewhere). The indexer and the top-k carry no gradient (HF
runs the indexer under no_grad); gradients reach the indexer parameters from nowhere, as in HF.

Hooks (swapped from outside: GPU kernels, context parallel, expert parallel; the model only calls them):
- `MLAttention.topk_fn(scores_BTS, k) -> idx_BTk` (int64): the k best positions along the last axis of the
  index scores (future positions hold -inf; when fewer than k are finite, the rest of the k may be any
  masked positions: the model drops entries that are not visible). Default `topk_lowest_position`.
- `MLAttention.sparse_attention_fn(q_BTHA, latent_PL, rope_PR, idx_BTK, *, scale) -> (out_BTHL, lse_BTH)`:
  absorbed MLA over the selected prompt pages (idx -1 = none); lse differentiable, rows with no entry give
  lse -inf. Default `longstraw_kernels.mla.sparse_mla_attention`.
- `MLAttention.page_range_fn(pages, positions_T, num_new) -> (first, num_pages, scores_new)`: in replay and
  decode, which prompt positions `pages` hold ([first, first + len)) of num_pages, and whether this device
  scores the new keys. Default `all_pages`: (0, all, True).
- `MLAttention.block_range_fn(pages, positions_T, num_new) -> (first, num_pages, scores_new)`: the same for exact
  mode's reverse walk (`recompute_block`), where `pages` are the pages BEFORE the block that this device holds
  and the block's own keys are the new ones. Default `all_pages` (context parallel: `cp_block_range`).
- `MLAttention.pages_topk_fn(scores_BTS, k, first) -> idx_BTk`: replay and decode's top-k when the scores are of
  positions first.. only (context parallel: over every rank's keys). Default `pages_topk` (first is 0).
- `MLAttention.pages_attention_fn(q_BTHA, pages, idx_BTK, first, num_pages, *, scale, sparse_attention_fn)
  -> (out_BTHL, lse_BTH)`: replay and decode's attention over the selected prompt pages (context parallel: own
  pages, merged across ranks). Default `local_pages_attention`.
- `MLAttention.span_pages_fn(pages) -> MLAPages`: in `capture_span`, the pages of every prompt position up to
  the span's end (context parallel: the lower ranks' gathered before the own). Default `own_pages`.
- `MoE.experts_fn(x_NC, topk_idx_Nk, topk_w_Nk, gate_up_proj, down_proj) -> y_NC`: sum over the k chosen
  experts of w * down(silu(gate) * up); gate_up_proj [E, 2I, C], down_proj [E, C, I]. Default `local_experts`.
- `MoE.route_fn(gate, x_NC, positions_T) -> (topk_idx_Nk, topk_w_Nk)`: the routing of tokens after the prompt
  (replay, scoring, decode; N = B x T rows, positions_T their positions); the prompt's tokens are always routed
  live. Default `live_route` (the router's own choice); routing replay (glm52/routing.py) records or forces it.
- `MLAttention.select_fn(positions_T, live) -> idx_BTK`: the DSA selection of tokens after the prompt on "full"
  indexer layers, `live()` computing the indexer's own. Default `live_selection`; routing replay records or
  forces it.

Legend: B batch, T tokens (queries), S keys on the key axis, C hidden, H heads, N nope dim, R rope dim,
V v_head dim, L kv latent (kv_lora_rank), A = L + R, Q q_lora_rank, I indexer head dim, J indexer heads,
E experts, k chosen experts / selected keys, P pages.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from longstraw_cli.models import core
from longstraw_cli.models.core import MLP, Backbone, CausalLM, DecodeState, stop_grad_prefix
from longstraw_cli.models.glm52.config import Glm52Config
from longstraw_cli.models.glm52.decode import Glm52Decoder, ResponseMLA
from longstraw_cli.models.glm52.experts import local_experts
from longstraw_cli.models.glm52.positions import KeyAxis, rope_cos_sin
from longstraw_cli.quantize import dense
from longstraw_cli.resident import MLAPages, Resident
from longstraw_cli.resident.offload import OFFLOAD_CHOICES, host_buffer
from longstraw_kernels import at_least_fp32, compute_dtype
from longstraw_kernels.dsa import indexer_scores, prepare_topk, topk_lowest_position
from longstraw_kernels.mla import dense_mla_attention, merge_lse, sparse_mla_attention

# bound on index-score elements formed at once ([rows, keys] per chunk of queries, and the top-k's temporaries
# beside them, ~12 bytes an element): small on the CPU, larger on a GPU, where a few rows per call against a
# million keys would leave it launching tiny kernels
_SCORE_ELEMENTS = {"cpu": 1 << 24, "cuda": 1 << 27}


def score_rows(num_keys: int, batch: int, device: torch.device) -> int:
    """Query rows scored (and top-k'd) at once against num_keys keys."""
    return max(1, _SCORE_ELEMENTS.get(torch.device(device).type, 1 << 24) // max(1, batch * num_keys))


class RMSNorm(nn.Module):
    """fp32 RMSNorm times a plain weight (init ones), cast back before the weight, as HF's GlmMoeDsaRMSNorm."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = at_least_fp32(x)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def apply_rope_interleaved(x_BT_D: torch.Tensor, cos_TF: torch.Tensor, sin_TF: torch.Tensor) -> torch.Tensor:
    """GLM's interleaved RoPE: pairs (x0, x1), (x2, x3), ... rotate together; the output is laid out
    de-interleaved, [x_even * cos - x_odd * sin | x_odd * cos + x_even * sin], exactly as HF returns it."""
    shape = (cos_TF.shape[0],) + (1,) * (x_BT_D.dim() - 3) + (cos_TF.shape[1],)
    cos, sin = cos_TF.view(shape), sin_TF.view(shape)
    x1, x2 = x_BT_D[..., 0::2], x_BT_D[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class DSAIndexer(nn.Module):
    """The lightning indexer of a "full" layer. Computes under no_grad: it never receives a gradient."""

    def __init__(self, cfg: Glm52Config):
        super().__init__()
        self.num_heads, self.head_dim, self.rope_dim = cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_head_dim
        self.wq_b = nn.Linear(cfg.q_lora_rank, self.num_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        # HF keeps weights_proj in fp32 (`_keep_in_fp32_modules`)
        self.weights_proj = nn.Linear(cfg.hidden_size, self.num_heads, bias=False,
                                      dtype=compute_dtype(torch.get_default_dtype()))
        self.softmax_scale = self.head_dim**-0.5

    def _rope(self, x, cos, sin):
        return torch.cat([apply_rope_interleaved(x[..., : self.rope_dim], cos, sin), x[..., self.rope_dim :]], -1)

    @torch.no_grad()
    def keys(self, x_BTC: torch.Tensor, cos_TF, sin_TF) -> torch.Tensor:
        """Index keys [B, T, I]: LayerNorm(wk x), RoPE on the first rope dims."""
        return self.keys_from(self.wk(x_BTC), cos_TF, sin_TF)

    @torch.no_grad()
    def keys_from(self, wk_BTI: torch.Tensor, cos_TF, sin_TF) -> torch.Tensor:
        """`keys` from wk's output (the decode step computes it in one GEMM with the attention's input linears)."""
        return self._rope(self.k_norm(wk_BTI), cos_TF, sin_TF)

    @torch.no_grad()
    def queries(self, x_BTC, q_resid_BTQ, cos_TF, sin_TF):
        """Index queries [B, T, J, I] in the activations' dtype and per-head weights [B, T, J] fp32 (or wider).
        HF computes the scores in fp32: the scoring upcasts q (`indexer_scores`), exactly. A bf16 q stays bf16
        so that, against bf16 keys, the GPU kernel takes the tensor-core dot: its products of bf16 values are
        exact in fp32, the same numbers as the fp32 upcast."""
        return self.queries_from(self.wq_b(q_resid_BTQ), x_BTC, cos_TF, sin_TF)

    @torch.no_grad()
    def queries_from(self, wq_BTX: torch.Tensor, x_BTC, cos_TF, sin_TF):
        """`queries` from wq_b's output (the decode step computes it in one GEMM with q_b_proj's)."""
        B, T, _ = x_BTC.shape
        q_BTJI = self._rope(wq_BTX.view(B, T, self.num_heads, self.head_dim), cos_TF, sin_TF)
        w_BTJ = self.weights_proj(x_BTC.to(self.weights_proj.weight.dtype))
        return q_BTJI, at_least_fp32(w_BTJ) * self.num_heads**-0.5

    def scores(self, q_BTJI, w_BTJ, keys: list[torch.Tensor], offset: int | None = None) -> torch.Tensor:
        """sum_j w_j relu(scale * q_j . k) against each key group ([S, I] shared by the batch or [B, S, I]),
        concatenated along the key axis: [B, T, S_total], fp32 (or wider). With `offset`, query t sees position
        g of the concatenated axis iff g <= t + offset; the others are -inf."""
        out, first = [], 0
        keys = [k for k in keys if k.shape[-2] > 0]
        if not keys:
            # no key here (under context parallel a rank may own no page)
            return torch.empty(q_BTJI.shape[:2] + (0,), dtype=compute_dtype(q_BTJI), device=q_BTJI.device)
        for k in keys:
            S = k.shape[-2]
            # group-local positions: g = first + s; a group all of whose keys every query sees needs no mask
            local = None if offset is None or offset - first >= S - 1 else offset - first
            out.append(indexer_scores(q_BTJI, w_BTJ, k, self.softmax_scale, local))
            first += S
        return out[0] if len(out) == 1 else torch.cat(out, dim=-1)


def linear_weight(linear: nn.Linear) -> torch.Tensor:
    """The matrix a linear applies: its weight (dequantised if stored as NF4), or, for a wrapper that adds to it
    (a LoRA adapter), the wrapper's `folded_weight()` (differentiable)."""
    folded = getattr(linear, "folded_weight", None)
    return dense(linear.weight) if folded is None else folded()


def live_selection(positions_T: torch.Tensor, live) -> torch.Tensor:
    """`select_fn` without routing replay: the indexer's own selection."""
    return live()


def pages_topk(scores_BTS: torch.Tensor, k: int, first: int) -> torch.Tensor:
    """`pages_topk_fn` on one device: the scores are of every key (first is 0)."""
    return topk_lowest_position(scores_BTS, k)


def all_pages(pages: MLAPages, positions_T: torch.Tensor, num_new: int) -> tuple[int, int, bool]:
    """`page_range_fn` on one device: (first prompt position the pages hold, number of prompt pages, whether this
    device scores the new keys) = (0, all of them, True)."""
    return 0, pages.latent_PL.shape[0], True


def own_pages(pages: MLAPages) -> MLAPages:
    """`span_pages_fn` on one device: a span's own pages are all the prompt's keys it sees."""
    return pages


def local_pages_attention(q_BTHA, pages: MLAPages, idx_BTK, first: int, num_pages: int, *, scale,
                          sparse_attention_fn):
    """`pages_attention_fn` on one device: absorbed attention over the selected pages of [0, num_pages), which
    `pages` hold from position 0 on. -> (out_BTHL, lse_BTH)."""
    idx_pages = idx_BTK.masked_fill(idx_BTK >= num_pages, -1)
    return sparse_attention_fn(q_BTHA, pages.latent_PL[:num_pages], pages.rope_PR[:num_pages], idx_pages,
                               scale=scale)


class MLAttention(nn.Module):
    """Multi-head latent attention with DSA: full-sequence (expanded, HF's route) or against pages (absorbed)."""

    def __init__(self, cfg: Glm52Config, layer_idx: int):
        super().__init__()
        self.cfg = cfg
        self.num_heads = cfg.num_attention_heads
        self.nope, self.rope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.latent = cfg.kv_lora_rank
        self.scale = cfg.qk_head_dim**-0.5
        self.q_a_proj = nn.Linear(cfg.hidden_size, cfg.q_lora_rank, bias=False)
        # trap: HF builds both latent norms with the default eps 1e-6, not rms_norm_eps
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, 1e-6)
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, self.num_heads * cfg.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(cfg.hidden_size, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, 1e-6)
        # read as a weight (absorbed into q and the output; see kv_b_weight), never called as a module
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, self.num_heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.v_dim, cfg.hidden_size, bias=False)
        self.full_indexer = cfg.layer_indexer_types[layer_idx] == "full"
        self.indexer = DSAIndexer(cfg) if self.full_indexer else None
        # swapped from outside (GPU kernels, context parallel); the model only calls them (see the module doc)
        self.topk_fn = topk_lowest_position
        self.sparse_attention_fn = sparse_mla_attention
        self.page_range_fn = all_pages
        self.block_range_fn = all_pages
        self.pages_topk_fn = pages_topk
        self.pages_attention_fn = local_pages_attention
        self.span_pages_fn = own_pages
        self.select_fn = live_selection

    # -- projections ------------------------------------------------------------------------------------------
    def project_q(self, x_BTC, cos_TF, sin_TF):
        q_resid_BTQ = self.q_a_layernorm(self.q_a_proj(x_BTC))
        return (q_resid_BTQ, *self.q_heads(self.q_b_proj(q_resid_BTQ), cos_TF, sin_TF))

    def q_heads(self, q_BTX, cos_TF, sin_TF):
        """q_b_proj's output [B, T, H * (N + R)] -> (q_nope [B, T, H, N], q_rope after RoPE [B, T, H, R])."""
        B, T, _ = q_BTX.shape
        q_nope_BTHN, q_rope_BTHR = q_BTX.view(B, T, self.num_heads, self.nope + self.rope_dim).split(
            [self.nope, self.rope_dim], dim=-1)
        return q_nope_BTHN, apply_rope_interleaved(q_rope_BTHR, cos_TF, sin_TF)

    def project_kv(self, x_BTC, cos_TF, sin_TF):
        """-> latent [B, T, L] (after kv_a_layernorm), rope key [B, T, R] (after RoPE): what pages hold."""
        return self.kv_from(self.kv_a_proj_with_mqa(x_BTC), cos_TF, sin_TF)

    def kv_from(self, kv_BTX, cos_TF, sin_TF):
        """`project_kv` from kv_a_proj_with_mqa's output [B, T, L + R]."""
        latent_BTL, rope_BTR = kv_BTX.split([self.latent, self.rope_dim], dim=-1)
        return self.kv_a_layernorm(latent_BTL), apply_rope_interleaved(rope_BTR, cos_TF, sin_TF)

    def kv_b_weight(self) -> torch.Tensor:
        """kv_b_proj's weight, read as a matrix (absorbed form), with whatever a wrapper adds to it (a LoRA update,
        differentiably): `linear_weight`."""
        return linear_weight(self.kv_b_proj)

    def kv_b(self):
        """kv_b's key part W_uk [H, N, L] and value part W_uv [H, V, L]."""
        w_HXL = self.kv_b_weight().view(self.num_heads, self.nope + self.v_dim, self.latent)
        return w_HXL[:, : self.nope], w_HXL[:, self.nope :]

    def absorb(self, q_nope_BTHN, q_rope_BTHR) -> torch.Tensor:
        """[q_nope W_uk | q_rope]: the query against [latent | rope] keys."""
        w_uk_HNL, _ = self.kv_b()
        return torch.cat([torch.einsum("bthn,hnl->bthl", q_nope_BTHN, w_uk_HNL), q_rope_BTHR], dim=-1)

    def output(self, o_BTHL: torch.Tensor) -> torch.Tensor:
        _, w_uv_HVL = self.kv_b()
        o_BTHV = torch.einsum("bthl,hvl->bthv", o_BTHL, w_uv_HVL)
        return self.o_proj(o_BTHV.reshape(*o_BTHV.shape[:2], -1))

    # -- DSA selection ----------------------------------------------------------------------------------------
    @torch.no_grad()
    def select(self, x_BTC, q_resid_BTQ, cos_TF, sin_TF, index_keys: list, axis: KeyAxis, first: int = 0,
               topk_fn=None) -> torch.Tensor:
        """Top-k key positions on `axis` per query, [B, T, index_topk], -1 where fewer keys are visible.
        `index_keys` hold positions first, first + 1, ... of the axis: all of it (first 0, `topk_fn` default
        self.topk_fn), or under context parallel this rank's part, `topk_fn` selecting over every rank's."""
        topk_fn = topk_fn or self.topk_fn
        B, T = x_BTC.shape[:2]
        q_BTJI, w_BTJ = self.indexer.queries(x_BTC, q_resid_BTQ, cos_TF, sin_TF)
        num_keys = axis.num_pages + axis.num_new
        k = min(self.cfg.index_topk, num_keys)
        idx_BTK = torch.full((B, T, self.cfg.index_topk), -1, dtype=torch.long, device=x_BTC.device)
        t_T1 = torch.arange(T, device=x_BTC.device)[:, None]
        # the row chunking depends on the whole axis only: under context parallel every rank makes as many calls
        rows = score_rows(num_keys, B, x_BTC.device)
        for t0 in range(0, T, rows):
            t1 = min(T, t0 + rows)
            # invisible positions (g > t + offset) come back -inf; the kernel skips tiles that are wholly so
            scores_BTS = self.indexer.scores(q_BTJI[:, t0:t1], w_BTJ[:, t0:t1], index_keys, axis.offset + t0 - first)
            chosen = topk_fn(scores_BTS, k)
            # what the top-k picked among masked positions (fewer than k visible) is not attended
            seen = chosen <= t_T1[t0:t1] + axis.offset
            idx_BTK[:, t0:t1, :k] = chosen.masked_fill(~seen, -1)
        return idx_BTK

    # -- attention over selected keys -------------------------------------------------------------------------
    def attend(self, q_BTHA, pages: MLAPages, idx_BTK, axis: KeyAxis, new=None, first: int = 0,
               pages_attention_fn=local_pages_attention) -> torch.Tensor:
        """Selected prompt pages (`pages_attention_fn`: all of them here, or, under context parallel, this rank's
        from position `first` on, merged across ranks) LSE-merged with the selected new keys, densely under their
        mask (the decode's static-shaped step attends to its response slots sparsely: `sparse_mla_two_sources` in
        glm52/decode.py). -> out_BTHL."""
        P = axis.num_pages
        out = None
        if P > 0:
            out, lse = pages_attention_fn(q_BTHA, pages, idx_BTK, first, P, scale=self.scale,
                                          sparse_attention_fn=self.sparse_attention_fn)
        if new is None:
            return out
        latent_BSL, rope_BSR = new[0], new[1]
        allowed_BTS = selected_mask(idx_BTK, P, axis.num_new)
        out_new, lse_new = dense_mla_attention(q_BTHA, latent_BSL, rope_BSR, allowed_BTS, scale=self.scale)
        return out_new if out is None else merge_lse(out, lse, out_new, lse_new)[0]

    # -- named paths (see models/core.py) ---------------------------------------------------------------------
    def forward(self, x_BTC, positions_T, prev_idx=None, grad_prefix: int = 0):
        """Full-sequence causal DSA attention, HF's route: expanded per-head K/V, top-k as a mask."""
        B, T, _ = x_BTC.shape
        cos, sin = rope_cos_sin(positions_T, self.rope_dim, self.cfg.rope_theta, x_BTC.dtype)
        q_resid, q_nope, q_rope = self.project_q(x_BTC, cos, sin)
        latent_BTL, rope_BTR = self.project_kv(x_BTC, cos, sin)
        latent_BTL, rope_BTR = stop_grad_prefix(latent_BTL, grad_prefix), stop_grad_prefix(rope_BTR, grad_prefix)
        axis = KeyAxis(0, T, T)
        if self.indexer is not None:
            idx_BTK = self.select(x_BTC, q_resid, cos, sin, [self.indexer.keys(x_BTC, cos, sin)], axis)
        else:
            idx_BTK = prev_idx
        allowed_BTS = selected_mask(idx_BTK, 0, T)
        kv_BTHX = F.linear(latent_BTL, self.kv_b_weight()).view(B, T, self.num_heads, self.nope + self.v_dim)
        k_nope, v_BTHV = kv_BTHX.split([self.nope, self.v_dim], dim=-1)
        k_BTHD = torch.cat([k_nope, rope_BTR[:, :, None].expand(-1, -1, self.num_heads, -1)], dim=-1)
        q_BTHD = torch.cat([q_nope, q_rope], dim=-1)
        o_BHTV = F.scaled_dot_product_attention(
            q_BTHD.transpose(1, 2), k_BTHD.transpose(1, 2), v_BTHV.transpose(1, 2),
            attn_mask=allowed_BTS[:, None], scale=self.scale,
        )
        return self.o_proj(o_BHTV.transpose(1, 2).reshape(B, T, -1)), idx_BTK

    def capture_block(self, x_BTC, positions_T, pages: MLAPages, start: int, prev_idx=None):
        """x's latent/rope/index keys become pages start.., then x attends to pages [0, start + T) causally.
        -> (y_BTC, idx_BTK): the selection, in prompt positions (shared layers reuse it)."""
        end = start + x_BTC.shape[1]
        cos, sin, (q_resid, q_nope, q_rope), new = self.project(x_BTC, positions_T)
        for page, block in zip((pages.latent_PL, pages.rope_PR, pages.index_PI), new):
            if page is not None:
                page[start:end].copy_(block[0])
        axis = KeyAxis(end, 0, x_BTC.shape[1])
        if self.indexer is not None:
            idx_BTK = self.select(x_BTC, q_resid, cos, sin, [pages.index_PI[:end]], axis)
        else:
            idx_BTK = prev_idx
        return self.output(self.attend(self.absorb(q_nope, q_rope), pages, idx_BTK, axis)), idx_BTK

    def recompute_block(self, x_BTC, positions_T, before: MLAPages, prev_idx=None):
        """capture_block's function (B = 1): x's keys, rounded to the page dtype, continue the pages before it
        (`before`: those this device holds; `block_range_fn` says which); x selects among both and attends to the
        selected pages and the selected keys of its own (sparse, merged by LSE).
        -> (y_BTC, idx_BTK, x's pages: latent, rope and, on indexer layers, the index keys; these select only, so
        the exact walk differentiates the other two; the drift probe's re-capture writes all three)."""
        T = x_BTC.shape[1]
        first, start, scores_new = self.block_range_fn(before, positions_T, T)
        cos, sin, (q_resid, q_nope, q_rope), new = self.project(x_BTC, positions_T)
        latent_TL, rope_TR = new[0][0].to(before.latent_PL.dtype), new[1][0].to(before.rope_PR.dtype)
        index_TI = None
        if self.indexer is not None:
            index_TI = new[2][0].to(before.index_PI.dtype)
            keys = [before.index_PI] + ([index_TI] if scores_new else [])
            idx_BTK = self.select(x_BTC, q_resid, cos, sin, keys, KeyAxis(start, T, T), first,
                                  lambda scores_BTS, k: self.pages_topk_fn(scores_BTS, k, first))
        else:
            idx_BTK = prev_idx
        q_BTHA = self.absorb(q_nope, q_rope)
        own_BTK = torch.where(idx_BTK >= start, idx_BTK - start, -1)
        out, lse = self.sparse_attention_fn(q_BTHA, latent_TL, rope_TR, own_BTK, scale=self.scale)
        if start > 0:
            out_pages, lse_pages = self.pages_attention_fn(q_BTHA, before, idx_BTK, first, start, scale=self.scale,
                                                           sparse_attention_fn=self.sparse_attention_fn)
            out, lse = merge_lse(out_pages, lse_pages, out, lse)
        return self.output(out), idx_BTK, MLAPages(latent_TL, rope_TR, index_TI)

    def replay(self, x_BTC, positions_T, pages: MLAPages, prev_idx=None):
        """x continues the prompt: it attends to the selected pages plus its own keys (causal), pages read only.
        -> (y_BTC, idx_BTK on the key axis [prompt pages | x's keys])."""
        cos, sin, q, new = self.project(x_BTC, positions_T)
        return self.continue_pages(x_BTC, positions_T, cos, sin, q, pages, new, prev_idx)

    def replay_block(self, x_BTC, positions_T, pages: MLAPages, before: MLAPages | None, prev_idx=None):
        """One block of the response: `replay` with the response's keys `before` it (batched [B, S, ...], None for
        the first block) ahead of x's own on the new-key axis. -> (y_BTC, idx_BTK, x's latent, rope and index keys,
        batched)."""
        cos, sin, q, new = self.project(x_BTC, positions_T)
        keys = new
        if before is not None:
            keys = tuple(None if b is None else torch.cat([a, b], dim=1)
                         for a, b in zip((before.latent_PL, before.rope_PR, before.index_PI), new))
        y_BTC, idx_BTK = self.continue_pages(x_BTC, positions_T, cos, sin, q, pages, keys, prev_idx)
        return y_BTC, idx_BTK, MLAPages(*new)

    def decode_step(self, x_BTC, positions_T, pages: MLAPages, prev_idx, cache: ResponseMLA):
        """One token per sequence: its keys are appended to `cache`; it attends to the selected pages plus every
        generated key. -> (y_BTC, idx_BTK)."""
        cos, sin, q, new = self.project(x_BTC, positions_T)
        return self.continue_pages(x_BTC, positions_T, cos, sin, q, pages, cache.append(*new), prev_idx)

    def project(self, x_BTC, positions_T):
        """-> (cos, sin, (q_resid, q_nope, q_rope), (latent, rope key, index key or None)) of tokens x."""
        cos, sin = rope_cos_sin(positions_T, self.rope_dim, self.cfg.rope_theta, x_BTC.dtype)
        q = self.project_q(x_BTC, cos, sin)
        latent_BTL, rope_BTR = self.project_kv(x_BTC, cos, sin)
        index_BTI = None if self.indexer is None else self.indexer.keys(x_BTC, cos, sin)
        return cos, sin, q, (latent_BTL, rope_BTR, index_BTI)

    def continue_pages(self, x_BTC, positions_T, cos, sin, q, pages: MLAPages, new, prev_idx):
        """Replay and decode after the projections: `new` = (latent, rope, index keys) of the tokens after the
        prompt, ending at x's last token. `page_range_fn` says which prompt positions `pages` hold."""
        q_resid, q_nope, q_rope = q
        first, num_pages, scores_new = self.page_range_fn(pages, positions_T, new[0].shape[1])
        axis = KeyAxis(num_pages, new[0].shape[1], x_BTC.shape[1])
        if self.indexer is not None:
            # the new keys continue the prompt's last pages (positions num_pages, ...)
            keys = [pages.index_PI] + ([new[2]] if scores_new else [])
            idx_BTK = self.select_fn(positions_T, lambda: self.select(
                x_BTC, q_resid, cos, sin, keys, axis, first,
                lambda scores_BTS, k: self.pages_topk_fn(scores_BTS, k, first)))
        else:
            idx_BTK = prev_idx
        out_BTHL = self.attend(self.absorb(q_nope, q_rope), pages, idx_BTK, axis, new, first, self.pages_attention_fn)
        return self.output(out_BTHL), idx_BTK

    @torch.no_grad()
    def write_span_pages(self, x_BTC, positions_T, pages: MLAPages):
        """A span's latent, rope and index keys written as its pages. -> the span's (cos, sin)."""
        cos, sin = rope_cos_sin(positions_T, self.rope_dim, self.cfg.rope_theta, x_BTC.dtype)
        latent_BTL, rope_BTR = self.project_kv(x_BTC, cos, sin)
        pages.latent_PL.copy_(latent_BTL[0])
        pages.rope_PR.copy_(rope_BTR[0])
        if self.indexer is not None:
            pages.index_PI.copy_(self.indexer.keys(x_BTC, cos, sin)[0])
        return cos, sin

    @torch.no_grad()
    def capture_span(self, x_BTC, positions_T, pages: MLAPages, block_size: int, prev_idx=None):
        """Layer-by-layer capture of the span at prompt positions [first, first + T): the span's keys become its
        pages, then each block of queries attends to every prompt key up to its end (`span_pages_fn`: the pages
        of positions [0, first + T); on one device the span is the prompt, first 0).
        -> (y_BTC, idx_BTK for the whole span)."""
        T = x_BTC.shape[1]
        cos, sin = self.write_span_pages(x_BTC, positions_T, pages)
        seen = self.span_pages_fn(pages)
        if T == 0:
            return x_BTC.clone(), x_BTC.new_zeros((1, 0, self.cfg.index_topk), dtype=torch.long)
        first = int(positions_T[0])
        y, idx = [], []
        for b0 in range(0, T, block_size):
            b1 = min(T, b0 + block_size)
            x, c, s = x_BTC[:, b0:b1], cos[b0:b1], sin[b0:b1]
            q_resid, q_nope, q_rope = self.project_q(x, c, s)
            axis = KeyAxis(first + b1, 0, b1 - b0)
            if self.indexer is not None:
                idx_BTK = self.select(x, q_resid, c, s, [seen.index_PI[: first + b1]], axis)
            else:
                idx_BTK = prev_idx[:, b0:b1]
            y.append(self.output(self.attend(self.absorb(q_nope, q_rope), seen, idx_BTK, axis)))
            idx.append(idx_BTK)
        return torch.cat(y, dim=1), torch.cat(idx, dim=1)


def selected_mask(idx_BTK: torch.Tensor, first: int, num: int) -> torch.Tensor:
    """[B, T, num] bool: key first + s is among the selected (idx -1 and other keys ignored)."""
    B, T, _ = idx_BTK.shape
    local = idx_BTK - first
    local = torch.where((local >= 0) & (local < num), local, num)
    mask = torch.zeros(B, T, num + 1, dtype=torch.bool, device=idx_BTK.device)
    return mask.scatter_(-1, local, True)[..., :num]


class TopkRouter(nn.Module):
    """Sigmoid router in fp32: choice by score + e_score_correction_bias within the best groups, weights the
    UNBIASED scores at the choice, renormalised, times routed_scaling_factor."""

    def __init__(self, cfg: Glm52Config):
        super().__init__()
        self.cfg = cfg
        dtype = compute_dtype(torch.get_default_dtype())
        # HF keeps both in fp32 (`_keep_in_fp32_modules_strict`); the bias is a (checkpointed) buffer, not trained
        self.weight = nn.Parameter(torch.zeros(cfg.n_routed_experts, cfg.hidden_size, dtype=dtype))
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_routed_experts, dtype=dtype))

    def logits(self, x_NC: torch.Tensor) -> torch.Tensor:
        """Router logits [N, E] in fp32 (or wider): differentiable."""
        return F.linear(x_NC.to(self.weight.dtype), self.weight)

    def scores(self, x_NC: torch.Tensor) -> torch.Tensor:
        """sigmoid(router logits) [N, E]."""
        return self.logits(x_NC).sigmoid()

    @torch.no_grad()
    def choose(self, scores_NE: torch.Tensor) -> torch.Tensor:
        """The top-k experts [N, k] by score + e_score_correction_bias within the best groups."""
        cfg = self.cfg
        N, E, G = scores_NE.shape[0], cfg.n_routed_experts, cfg.n_group
        choice_NE = scores_NE + self.e_score_correction_bias
        # every group kept (topk_group = n_group: GLM-5's 1 of 1) masks nothing: the same top-k without the groups'
        # two top-k's, scatter and mask (a decode step's MoE layer ran 3 top-k's and 2 sorts: glm52_mini on an H200,
        # 55 launches, 0.22 ms of its 3.41 ms)
        if cfg.topk_group < G:
            group_NG = choice_NE.view(N, G, E // G).topk(min(2, E // G), dim=-1).values.sum(-1)
            group_idx = group_NG.topk(cfg.topk_group, dim=-1).indices
            keep_NG = torch.zeros_like(group_NG, dtype=torch.bool).scatter_(1, group_idx, True)
            keep_NE = keep_NG[:, :, None].expand(N, G, E // G).reshape(N, E)
            choice_NE = choice_NE.masked_fill(~keep_NE, float("-inf"))
        return choice_NE.topk(cfg.num_experts_per_tok, dim=-1).indices

    def weights(self, scores_NE: torch.Tensor, topk_idx_Nk: torch.Tensor) -> torch.Tensor:
        """The routing weights [N, k] of the chosen experts: their unbiased scores, renormalised, scaled
        (differentiable: routing replay recomputes them for recorded ids so the router keeps its gradient)."""
        w_Nk = scores_NE.gather(1, topk_idx_Nk)
        if self.cfg.norm_topk_prob:
            w_Nk = w_Nk / (w_Nk.sum(-1, keepdim=True) + 1e-20)
        return w_Nk * self.cfg.routed_scaling_factor

    def forward(self, x_NC: torch.Tensor):
        scores_NE = self.scores(x_NC)
        topk_idx_Nk = self.choose(scores_NE)
        return topk_idx_Nk, self.weights(scores_NE, topk_idx_Nk)


def live_route(gate: TopkRouter, x_NC: torch.Tensor, positions_T: torch.Tensor):
    """`MoE.route_fn` without routing replay: the router's own choice."""
    return gate(x_NC)


class Experts(nn.Module):
    """Routed experts as 3-D parameters (HF 5.24's in-memory layout): rows lo..hi-1 of the n_routed_experts,
    `expert_rows` = (lo, hi); all of them unless built with a slice. A model holding a slice computes its MoE
    layers only once expert parallelism (distributed/ep.py) has swapped `experts_fn` for one that routes tokens
    to the other slices."""

    def __init__(self, cfg: Glm52Config, expert_rows: tuple[int, int] | None = None):
        super().__init__()
        E, C, I = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        lo, hi = (0, E) if expert_rows is None else expert_rows
        if not 0 <= lo < hi <= E:
            raise ValueError(f"expert_rows=({lo}, {hi}) must satisfy 0 <= lo < hi <= n_routed_experts={E}")
        self.expert_rows = (lo, hi)
        self.gate_up_proj = nn.Parameter(torch.empty(hi - lo, 2 * I, C))
        self.down_proj = nn.Parameter(torch.empty(hi - lo, C, I))

    @torch.no_grad()
    def reset_parameters(self, std: float) -> None:
        """normal(0, std), expert by expert: expert e from its own generator, seeded by a base drawn once from the
        global generator and e, so expert e gets the same numbers whichever rows this module holds (a model built
        expert-parallel equals the one-device model), and the global stream advances by one draw whatever the
        slice (the replicated parts after it are drawn alike)."""
        base = int(torch.randint(0, 2**62, (), device="cpu"))
        if self.gate_up_proj.is_meta:
            return
        device = self.gate_up_proj.device
        for i, e in enumerate(range(*self.expert_rows)):
            g = torch.Generator(device).manual_seed((base + e * 0x9E3779B97F4A7C15) % 2**63)
            self.gate_up_proj[i].normal_(0.0, std, generator=g)
            self.down_proj[i].normal_(0.0, std, generator=g)


class MoE(nn.Module):
    def __init__(self, cfg: Glm52Config, expert_rows: tuple[int, int] | None = None):
        super().__init__()
        self.experts = Experts(cfg, expert_rows)
        self.gate = TopkRouter(cfg)
        self.shared_experts = MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts)
        self.experts_fn = local_experts
        self.route_fn = live_route

    def forward(self, x_BTC: torch.Tensor, positions_T: torch.Tensor | None = None) -> torch.Tensor:
        """positions_T: given for tokens after the prompt (replay, scoring, decode), routed by `route_fn`; the
        prompt's tokens (None) by the router itself."""
        x_NC = x_BTC.reshape(-1, x_BTC.shape[-1])
        if positions_T is None:
            topk_idx_Nk, topk_w_Nk = self.gate(x_NC)
        else:
            topk_idx_Nk, topk_w_Nk = self.route_fn(self.gate, x_NC, positions_T)
        y_NC = self.experts_fn(x_NC, topk_idx_Nk, topk_w_Nk, self.experts.gate_up_proj, self.experts.down_proj)
        return y_NC.view_as(x_BTC) + self.shared_experts(x_BTC)


class DecoderLayer(core.DecoderLayer):
    """One named path per method (see models/core.py); `carry` is the DSA selection [B, T, index_topk] that
    "shared" indexer layers reuse from the full layer before them."""

    def __init__(self, cfg: Glm52Config, layer_idx: int, expert_rows: tuple[int, int] | None = None):
        super().__init__()
        self.self_attn = MLAttention(cfg, layer_idx)
        sparse = cfg.layer_mlp_types[layer_idx] == "sparse"
        self.mlp = MoE(cfg, expert_rows) if sparse else MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x_BTC, positions_T, carry=None, grad_prefix: int = 0):
        h, idx = self.self_attn(self.input_layernorm(x_BTC), positions_T, carry, grad_prefix)
        return self.mlp_residual(x_BTC, h), idx

    def capture_block(self, x_BTC, positions_T, pages, start: int, carry=None):
        h, idx = self.self_attn.capture_block(self.input_layernorm(x_BTC), positions_T, pages, start, carry)
        return self.mlp_residual(x_BTC, h), idx

    def recompute_block(self, x_BTC, positions_T, pages, carry=None):
        h, idx, written = self.self_attn.recompute_block(self.input_layernorm(x_BTC), positions_T, pages, carry)
        return self.mlp_residual(x_BTC, h), idx, written

    def capture_span(self, x_BTC, positions_T, pages, block_size: int, carry=None, num_blocks: int | None = None):
        h, idx = self.self_attn.capture_span(self.input_layernorm(x_BTC), positions_T, pages, block_size, carry)
        return self.mlp_residual_blocks(x_BTC, h, block_size, num_blocks), idx

    def replay(self, x_BTC, positions_T, pages, carry=None):
        h, idx = self.self_attn.replay(self.input_layernorm(x_BTC), positions_T, pages, carry)
        return self.continued_residual(x_BTC, h, positions_T), idx

    def replay_block(self, x_BTC, positions_T, pages, before, carry=None):
        h, idx, written = self.self_attn.replay_block(self.input_layernorm(x_BTC), positions_T, pages, before, carry)
        return self.continued_residual(x_BTC, h, positions_T), idx, written

    def decode_step(self, x_BTC, positions_T, pages, cache, carry=None):
        h, idx = self.self_attn.decode_step(self.input_layernorm(x_BTC), positions_T, pages, carry, cache)
        return self.continued_residual(x_BTC, h, positions_T), idx

    def continued_residual(self, x_BTC, mixed_BTC, positions_T):
        """`mlp_residual` for tokens after the prompt: a MoE routes them by their positions (`MoE.route_fn`)."""
        if not isinstance(self.mlp, MoE):
            return self.mlp_residual(x_BTC, mixed_BTC)
        x_BTC = x_BTC + mixed_BTC
        return x_BTC + self.mlp(self.post_attention_layernorm(x_BTC), positions_T)


class Glm52ForCausalLM(CausalLM):
    family = "glm52"

    def __init__(self, cfg: Glm52Config, expert_slice=None):
        """expert_slice: None (every routed expert), or a function num_experts -> (lo, hi), the rows of the
        routed experts this model holds (distributed/ep.py's `ep_slice` gives a rank its own); nothing else
        is sliced."""
        rows = None if expert_slice is None else tuple(expert_slice(cfg.n_routed_experts))
        layers = (DecoderLayer(cfg, i, rows) for i in range(cfg.num_hidden_layers))
        super().__init__(cfg, Backbone(cfg.vocab_size, cfg.hidden_size, layers, RMSNorm, cfg.rms_norm_eps))

    def init_module(self, module: nn.Module, std: float) -> None:
        """Norms at one, LayerNorm bias zero; router and experts normal(0, std) (experts expert by expert,
        `Experts.reset_parameters`), the router's bias zero."""
        if isinstance(module, RMSNorm):
            module.weight.fill_(1.0)
        elif isinstance(module, nn.LayerNorm):
            module.weight.fill_(1.0)
            module.bias.zero_()
        elif isinstance(module, TopkRouter):
            module.weight.normal_(0.0, std)
            module.e_score_correction_bias.zero_()
        elif isinstance(module, Experts):
            module.reset_parameters(std)

    def prepare_capture(self, longest: int) -> None:
        """The selection's kernels for the capture's rows, up to `longest` keys, compiled at once (a fresh machine
        would compile them one at a time as the blocks grow)."""
        prepare_topk(longest, self.config.index_topk, self.lm_head.weight.device)

    # -- resident state ---------------------------------------------------------------------------------------
    def empty_resident(self, num_tokens: int, page_dtype: torch.dtype | None = None,
                       offload: str | None = None) -> Resident:
        """Preallocated pages for `num_tokens` captured tokens; offload="cpu" puts them in (pinned) CPU memory."""
        if offload not in OFFLOAD_CHOICES:
            raise ValueError(f"offload={offload!r}; valid: {list(OFFLOAD_CHOICES)}")
        cfg, w = self.config, self.lm_head.weight
        page_dtype = page_dtype or w.dtype

        def buffer(*shape):
            if offload == "cpu":
                return host_buffer(shape, page_dtype)
            return torch.zeros(shape, dtype=page_dtype, device=w.device)

        layers = [
            MLAPages(buffer(num_tokens, cfg.kv_lora_rank), buffer(num_tokens, cfg.qk_rope_head_dim),
                     buffer(num_tokens, cfg.index_head_dim) if kind == "full" else None)
            for kind in cfg.layer_indexer_types
        ]
        return Resident(layers=layers, num_tokens=num_tokens, last_token=-1, offload=offload)

    def resident_bytes(self, num_tokens: int, page_dtype: torch.dtype | None = None) -> dict[str, int]:
        """Analytic size of the resident state: what `Resident.nbytes()` must report."""
        cfg = self.config
        size = (page_dtype or self.lm_head.weight.dtype).itemsize
        num_full = sum(t == "full" for t in cfg.layer_indexer_types)
        out = {
            "latent_pages": cfg.num_hidden_layers * num_tokens * cfg.kv_lora_rank * size,
            "rope_pages": cfg.num_hidden_layers * num_tokens * cfg.qk_rope_head_dim * size,
            "index_pages": num_full * num_tokens * cfg.index_head_dim * size,
        }
        out["total"] = sum(out.values())
        return out

    @torch.no_grad()
    def capture_span(self, span_ids: torch.Tensor, *, num_tokens: int, last_token: int,
                     page_dtype: torch.dtype | None = None, offload: str | None = None, **kwargs) -> Resident:
        """`CausalLM.capture_span`; an empty span has empty pages and runs nothing (glm52's context parallel
        captures by `cp_capture_glm52`, whose empty shards still join the collectives)."""
        if span_ids.dim() == 1 and span_ids.numel() == 0 and kwargs.get("block_size", 1) >= 1:
            resident = self.empty_resident(0, page_dtype, offload)
            resident.num_tokens, resident.last_token = num_tokens, last_token
            return resident
        return super().capture_span(span_ids, num_tokens=num_tokens, last_token=last_token, page_dtype=page_dtype,
                                    offload=offload, **kwargs)

    # -- native rollout ---------------------------------------------------------------------------------------
    def decoder(self, resident: Resident, batch: int, max_new_tokens: int, page_budget: int | None = None,
                response_chunk: int | None = None):
        """The static-shaped decode of `batch` responses of up to `max_new_tokens` tokens (glm52/decode.py), its
        response slots `response_chunk` at first (None: all), grown in steps; with offloaded pages, at most
        `page_budget` bytes of whole layers copied to the device (None: what fits)."""
        return Glm52Decoder(self, resident, batch, max_new_tokens, page_budget, response_chunk)

    @torch.no_grad()
    def start_decode(self, resident: Resident, batch: int, capacity: int) -> DecodeState:
        """Per-sequence latent/rope/index keys of the generated tokens in `capacity` slots; the prompt pages are
        shared, never copied."""
        w = self.lm_head.weight
        dtype = resident.layers[0].latent_PL.dtype if resident.layers else w.dtype
        layers = [ResponseMLA(batch, capacity, self.config, layer.self_attn.full_indexer, dtype, w.device)
                  for layer in self.model.layers]
        return DecodeState(layers)
