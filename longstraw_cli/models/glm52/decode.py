"""glm52 native decode: one static-shaped step for G responses that share the resident prompt.

Per layer, each response's latent, rope key and (on "full" indexer layers) index key of its generated tokens
live in buffers of `capacity` slots (grown in steps with the response, models/slots.py), filled at slot `step`;
the token ids and the step counter are device tensors. The DSA selection scores each query against every prompt
index key and every response slot, masks the slots not yet filled, and takes the top-k with the model's tie rule
(equal scores: the lower position wins) without a host synchronisation (`topk_lowest_position_static`); sparse MLA
then reads only the selected prompt pages (the Triton kernel on CUDA) and the selected response keys. Routed experts
run with static shapes: where B x k pairs are fewer than the experts, on a GPU that takes them (bf16, sm90+), as the
grouped GEMMs over the pairs, which read only the chosen experts' weights (`experts.grouped_experts`); else densely
over all experts with the routing weights (zero where not chosen), each expert's weights read once (NF4 experts,
lora.quantize=nf4: dequantised a few at a time, `experts.dense_experts`). The routing and the DSA selection go
through the layers' `route_fn` / `select_fn` hooks, by which routing replay (routing.py) records them.

A step is CUDA-graph safe, and compiled by torch.compile first (rollout.native.compile), when the pages are on
the device and the experts are local (`graph_safe`); with pages left in host memory or expert parallelism (whose
all-to-all sizes depend on the routing) it runs eagerly.
Offloaded pages: the layers that fit in the device's free memory are copied there once for the rollout (as
qwen36's, `resident.offload.rollout_pages`); the others do not move whole per token: their index keys (every
token scores all of them: 128 values a token on each "full" layer) go to the device once per rollout, and of the
latent and rope pages only the rows the top-k selects cross per token (B x index_topk x 576 values a layer,
whatever the prompt's length).

Legend: B responses, S response capacity, P prompt pages, C hidden, L latent, R rope dim, I index head dim,
K selected keys (index_topk), E experts, N tokens (B), X = 2 * moe_intermediate, V vocab.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from longstraw_cli.models.core import StaticDecoder
from longstraw_cli.models.glm52.experts import (
    dense_experts,
    grouped_experts,
    grouped_mm_serves,
    local_experts,
    skinny_experts,
    skinny_serves,
)
from longstraw_cli.models.glm52.positions import rope_cos_sin
from longstraw_cli.models.projections import one_gemm_each
from longstraw_cli.models.slots import ResponseSlots, slot_buffer
from longstraw_cli.quantize import is_nf4_experts
from longstraw_cli.resident import Resident
from longstraw_cli.resident.offload import device_total_bytes, left_on_host, rollout_pages
from longstraw_kernels import kernel_choice, say_once
from longstraw_kernels.dsa.topk import topk_lowest_position_static
from longstraw_kernels.mla import sparse_mla_two_sources
from longstraw_kernels.moe import route_select, route_serves


def fused_route(gate, x_NC: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`gate(x_NC)` (models/glm52/model.py `TopkRouter`, every group kept) for the decode step: the router's fp32
    GEMM, then the sigmoid, the biased top-k and the weights in one kernel (longstraw_kernels.moe `route_select`)
    where the module runs a top-k, a sort and ~4 small kernels. The routing hooks (live, recording) call it as
    they call the router."""
    cfg = gate.cfg
    return route_select(gate.logits(x_NC), gate.e_score_correction_bias, cfg.num_experts_per_tok, cfg.norm_topk_prob,
                        cfg.routed_scaling_factor)


class ResponseMLA(ResponseSlots):
    """One layer's latent, rope and index keys of the generated tokens, per response, in `capacity` slots (grown by
    the decoder)."""

    SLOTS = ("latent_BSL", "rope_BSR", "index_BSI")

    def __init__(self, batch: int, capacity: int, cfg, full_indexer: bool, dtype, device):
        self.latent_BSL = slot_buffer(batch, capacity, cfg.kv_lora_rank, dtype=dtype, device=device)
        self.rope_BSR = slot_buffer(batch, capacity, cfg.qk_rope_head_dim, dtype=dtype, device=device)
        self.index_BSI = (slot_buffer(batch, capacity, cfg.index_head_dim, dtype=dtype, device=device)
                          if full_indexer else None)


class LayerProjections:
    """A decode layer's projections, from one GEMM a group where the decoder made the group's concatenated copy
    (models/projections.py `one_gemm_each`; `input_groups`), else one by one: the attention's input linears with the
    indexer's wk, q_b_proj with the indexer's wq_b, the MLP's gate and up. glm52_mini's decode step at 256K, G=8 on
    an H200: 2.754 ms with every linear its own GEMM, 2.551 grouped (docs/BENCHMARKS.md, 2026-12-04)."""

    def __init__(self, x_in, q_in, mlp_in):
        self.x_in, self.q_in, self.mlp_in = x_in, q_in, mlp_in

    def attention(self, attn, x_BTC, cos, sin):
        """-> (q_nope, q_rope, latent, rope key, index keys or None, the index queries' function)."""
        x_outs = self.x_in(x_BTC)
        q_outs = self.q_in(attn.q_a_layernorm(x_outs[0]))
        q_nope, q_rope = attn.q_heads(q_outs[0], cos, sin)
        latent_BTL, rope_BTR = attn.kv_from(x_outs[1], cos, sin)
        if attn.indexer is None:
            return q_nope, q_rope, latent_BTL, rope_BTR, None, None
        return (q_nope, q_rope, latent_BTL, rope_BTR, attn.indexer.keys_from(x_outs[2], cos, sin),
                lambda: attn.indexer.queries_from(q_outs[1], x_BTC, cos, sin))

    def mlp(self, mlp, x_BTC):
        return mlp.swiglu(*self.mlp_in(x_BTC))


def input_groups(model) -> list[tuple[list[nn.Module], ...]]:
    """Each layer's linears that read one input: (q_a_proj, kv_a_proj_with_mqa[, the indexer's wk]), (q_b_proj[,
    the indexer's wq_b]), (the MLP's or shared experts' gate_proj, up_proj). The indexer's weights_proj stays apart
    (HF keeps it in fp32)."""
    groups = []
    for layer in model.model.layers:
        attn = layer.self_attn
        mlp = layer.mlp.shared_experts if hasattr(layer.mlp, "experts_fn") else layer.mlp
        extra_x, extra_q = ([attn.indexer.wk], [attn.indexer.wq_b]) if attn.indexer is not None else ([], [])
        groups.append(([attn.q_a_proj, attn.kv_a_proj_with_mqa] + extra_x, [attn.q_b_proj] + extra_q,
                       [mlp.gate_proj, mlp.up_proj]))
    return groups


class Glm52Decoder(StaticDecoder):
    """`step()` feeds `tokens_B` at position num_tokens + step and returns next-token logits [B, V] (fp32+)."""

    def __init__(self, model, resident: Resident, batch: int, max_new_tokens: int, page_budget: int | None = None,
                 response_chunk: int | None = None):
        super().__init__(model, resident, batch, max_new_tokens, response_chunk)
        dtype = resident.layers[0].latent_PL.dtype if resident.layers else model.lm_head.weight.dtype
        self.layers = [ResponseMLA(batch, self.capacity, model.config, layer.self_attn.full_indexer, dtype, self.device)
                       for layer in model.model.layers]
        # offloaded pages: whole layers copied to the device for the rollout where its free memory holds them
        # (`rollout_pages`, as qwen36); of the others the index keys, which every token scores in full, move to the
        # device once, and the latent and rope pages stay on the host: sparse attention fetches the selected rows
        pages = rollout_pages(resident, self.device, page_budget)
        self.on_host = left_on_host(resident, pages)
        self.pages = [p.to(self.device, index_only=True) if on_host else p for p, on_host in zip(pages, self.on_host)]
        moe = [layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "experts_fn")]
        self.graph_safe = not any(self.on_host) and all(mlp.experts_fn is local_experts for mlp in moe)
        # the experts (all on this device): through the decode linear kernel with an expert axis (`skinny_experts`)
        # where it serves (CUDA, bf16/fp16, at most 16 tokens), which reads only the chosen experts' weights with
        # static shapes; else as the grouped GEMMs where they serve (bf16 on sm90+) and the step's batch x k pairs are
        # fewer than the experts; else every expert densely, weighted by the routing (`dense_experts`). On an H200, a
        # layer compiled and graph-replayed at B = 8 (`bench_experts.py`): GLM-5's 256 experts, k = 8 (57 chosen):
        # 4.66 ms dense, 1.52 grouped, 1.07 skinny; glm52_mini's 32, k = 4 (21 chosen): 0.089 dense, 0.106 grouped,
        # 0.063 skinny. kernels.decode_linear=torch keeps the grouped-or-dense rule (A/B runs)
        cfg = model.config
        x_1C = torch.empty(1, cfg.hidden_size, dtype=model.lm_head.weight.dtype, device=self.device)
        self.experts_grouped = batch * cfg.num_experts_per_tok < cfg.n_routed_experts and bool(moe) and all(
            grouped_mm_serves(x_1C, mlp.experts.gate_up_proj, mlp.experts.down_proj) for mlp in moe)
        skinny = kernel_choice("decode_linear") == "auto"
        self.experts_skinny = bool(moe) and all(
            skinny_serves(x_1C.expand(batch, -1), mlp.experts.gate_up_proj, mlp.experts.down_proj) for mlp in moe)
        local = bool(moe) and all(mlp.experts_fn is local_experts for mlp in moe)
        if skinny and local and self.device.type == "cuda" and not self.experts_skinny:
            say_once(f"decode experts: the skinny kernel does not take {batch} tokens of {x_1C.dtype} (at most 16, "
                     f"bf16/fp16, plain contiguous expert weights, Triton); the "
                     f"{'grouped GEMMs' if self.experts_grouped else 'dense experts (every expert read)'} run them")
        # each MoE layer's choice and weights in one kernel after its router's GEMM (`fused_route`), where every
        # group is kept and the kernel serves (kernels.router=torch: the router module). On an H200, glm52_mini's
        # decode step at 256K, G=8: 3.207 -> 3.071 ms (docs/BENCHMARKS.md, 2026-12-04)
        fused = kernel_choice("router") == "auto"
        self.router_fused = fused and bool(moe) and cfg.topk_group == cfg.n_group and route_serves(
            torch.empty(batch, cfg.n_routed_experts, dtype=moe[0].gate.weight.dtype, device=self.device),
            cfg.num_experts_per_tok)
        if fused and moe and not self.router_fused and self.device.type == "cuda":
            say_once(f"decode router: the fused kernel does not serve (it needs every group kept, topk_group="
                     f"{cfg.topk_group} of n_group={cfg.n_group}, and fp32 router logits with Triton); the router "
                     f"module runs (a top-k, a sort and ~4 small kernels a layer)")
        self.projections = [LayerProjections(*layer)
                            for layer in one_gemm_each(input_groups(model), device_total_bytes(self.device))]
        # torch.compile fuses the step's ~2,000 small kernels (seen on an H200, glm52_mini at 256K, G=8: see
        # docs/BENCHMARKS.md). Not over NF4 experts (lora.quantize=nf4): compiling their dequantisation has not
        # run on a GPU. The page count is a dynamic size of the compiled layer function (`compiled`): its graphs (and
        # on-disk cache entries) serve every prompt length
        self.compile_safe = self.graph_safe and not any(is_nf4_experts(mlp.experts.gate_up_proj) for mlp in moe)
        for pages in self.pages:
            for t in (pages.latent_PL, pages.rope_PR, pages.index_PI):
                if t is not None:
                    torch._dynamo.maybe_mark_dynamic(t, 0)
        # the layer function the step calls, `compiled()` compiles it: the class's function, called with the
        # decoder (a bound method held by the decoder would be a reference cycle, keeping the decoder's buffers
        # until Python's cycle collector runs)
        self.layer_fn = type(self).layer

    def compiled(self, **options):
        """The step with its layer function compiled by torch.compile (`options`: its keyword arguments), not the
        whole step: the layer's modules, pages and buffers are the compiled function's inputs, so one compiled
        graph serves every layer of a kind (dense or MoE, "full" or "shared" indexer): two in glm52's 78 layers,
        three in glm52_mini's 12 (tests/models/test_decode_shapes.py), and a first launch compiles those, not the
        model's depth. The embedding and the logits run eagerly around them; the CUDA graph still
        replays the whole step."""
        self.layer_fn = torch.compile(type(self).layer, **options)
        return self.step

    def step(self) -> torch.Tensor:
        model, cfg = self.model, self.model.config
        (x_BTC, positions_1), idx_BTK = self.embed(), None
        cos, sin = rope_cos_sin(positions_1, cfg.qk_rope_head_dim, cfg.rope_theta, x_BTC.dtype)
        for layer, pages, buf, proj in zip(model.model.layers, self.pages, self.layers, self.projections):
            x_BTC, idx_BTK = self.layer_fn(self, layer, pages, buf, proj, x_BTC, cos, sin, idx_BTK, positions_1)
        return self.logits(x_BTC)

    def layer(self, layer, pages, buf: ResponseMLA, proj: LayerProjections, x_BTC, cos, sin, idx_BTK, positions_1):
        """One decoder layer of the step -> (its output [B, 1, C], the DSA selection it used, for the next
        "shared" indexer layer)."""
        h_BTC, idx_BTK = self._attention(layer.self_attn, proj, layer.input_layernorm(x_BTC), cos, sin, pages, buf,
                                         idx_BTK, positions_1)
        x_BTC = x_BTC + h_BTC
        return x_BTC + self._mlp(layer.mlp, proj, layer.post_attention_layernorm(x_BTC), positions_1), idx_BTK

    def _attention(self, attn, proj, x_BTC, cos, sin, pages, buf: ResponseMLA, prev_idx_BTK, positions_1):
        q_nope, q_rope, latent_BTL, rope_BTR, index_BTI, queries = proj.attention(attn, x_BTC, cos, sin)
        buf.latent_BSL.index_copy_(1, self.step_1, latent_BTL.to(buf.latent_BSL.dtype))
        buf.rope_BSR.index_copy_(1, self.step_1, rope_BTR.to(buf.rope_BSR.dtype))
        P, S = pages.latent_PL.shape[0], buf.latent_BSL.shape[1]
        if attn.indexer is not None:
            buf.index_BSI.index_copy_(1, self.step_1, index_BTI.to(buf.index_BSI.dtype))
            # `select_fn`: routing replay records the selection (in place, at the step: graph safe)
            idx_BTK = attn.select_fn(positions_1, lambda: self._select(attn, queries, pages, buf, P, S))
        else:
            idx_BTK = prev_idx_BTK
        B = buf.latent_BSL.shape[0]
        out_BTHL, _ = sparse_mla_two_sources(attn.absorb(q_nope, q_rope), pages.latent_PL, pages.rope_PR,
                                             buf.latent_BSL.reshape(B * S, -1), buf.rope_BSR.reshape(B * S, -1),
                                             idx_BTK, S, scale=attn.scale, attention_fn=attn.sparse_attention_fn)
        return attn.output(out_BTHL), idx_BTK

    def _select(self, attn, queries, pages, buf, P: int, S: int):
        """Top-k over the prompt's index keys and the filled response slots; -1 for what is not visible.
        queries() -> the index queries and weights (`LayerProjections.attention`)."""
        q_BTJI, w_BTJ = queries()
        # the prompt's keys are shared: the B responses are B query rows of one call, so the keys are read once
        pages_1BP = attn.indexer.scores(q_BTJI.transpose(0, 1), w_BTJ.transpose(0, 1), [pages.index_PI])
        # every prompt key is visible; of the response slots only the filled ones
        own_BTS = attn.indexer.scores(q_BTJI, w_BTJ, [buf.index_BSI]).masked_fill(~self.filled(), float("-inf"))
        scores_BTS = torch.cat([pages_1BP.transpose(0, 1), own_BTS], dim=-1)
        topk = attn.cfg.index_topk
        k = min(topk, P + S)
        chosen_BTk = topk_lowest_position_static(scores_BTS, k)
        # a slot not yet filled is picked only when fewer than k keys are visible: it is not attended
        chosen_BTk = chosen_BTk.masked_fill(chosen_BTk > P + self.step_1, -1)
        if k < topk:
            chosen_BTk = F.pad(chosen_BTk, (0, topk - k), value=-1)
        return chosen_BTk

    def _mlp(self, mlp, proj, x_BTC, positions_1):
        if not hasattr(mlp, "experts_fn"):
            return proj.mlp(mlp, x_BTC)
        x_NC = x_BTC.reshape(-1, x_BTC.shape[-1])
        gate = functools.partial(fused_route, mlp.gate) if self.router_fused else mlp.gate
        topk_idx_Nk, topk_w_Nk = mlp.route_fn(gate, x_NC, positions_1)
        experts_fn = mlp.experts_fn
        if experts_fn is local_experts:
            experts_fn = (skinny_experts if self.experts_skinny else grouped_experts if self.experts_grouped
                          else dense_experts)
        y_NC = experts_fn(x_NC, topk_idx_Nk, topk_w_Nk, mlp.experts.gate_up_proj, mlp.experts.down_proj)
        return y_NC.view_as(x_BTC) + proj.mlp(mlp.shared_experts, x_BTC)
