"""The prompt capture's FLOPs, analytically, from the model config alone (FamilySpec.flops).

`capture_flops(model, num_tokens)` counts the matrix products of `CausalLM.capture` over `num_tokens` captured tokens
(the prompt less its last token): every decoder layer, block by block, no final norm, no logits (capture computes
none). A multiply-add is 2 FLOPs. Elementwise work (norms, RoPE, activations, softmax, gates, top-k, the routing
weights) is not counted, nor are embeddings (a gather). The count is of the work the model needs, not of how a
kernel pads it: attention and index scores over the CAUSAL (query, key) pairs, sparse attention over the
min(index_topk, visible) keys a query selects. The keyword pair counts replace those: the torch references compute
rectangles per capture block (and the sparse reference all index_topk slots), which is how the test holds this count
equal to `torch.utils.flop_counter.FlopCounterMode` on CPU (tests/plan/test_flops.py).

qwen36, per token and layer (C hidden, D head dim, H query heads, G GDN value heads of K x V, X conv channels):
  linear      2 x weights of every decoder linear (GDN in_proj_qkv/z/b/a, out_proj; q (with its gate), k, v, o;
              the SwiGLU MLP)
  attention   4 H D per causal pair per attention layer (QK^T and PV)
  gdn_chunks  the chunked delta rule's products, per value head and token padded to chunks of c = 64:
              2 c (2K + V) within the chunk (k k^T, q k^T, attn U) + 6 K V against the state (w_k S, q S, k^T U);
              fla's kernel on the GPU orders the work differently; its triangular solve is not a matmul (left out)
  conv        the depthwise causal conv, 2 X kernel
glm52 (C, Q q_lora, H heads, N nope, R rope, V v_head, L latent, J x I indexer, E experts, k per token):
  mla_linear  q_a, q_b, kv_a_proj_with_mqa, o_proj
  mla_absorb  the absorbed form's two einsums with kv_b: 2 H N L (into the query) + 2 H L V (out of the latent)
  attention   2 H (2L + R) per selected pair (scores over [latent | rope], values over latent), every layer
  index_linear   "full" indexer layers: wq_b, wk, weights_proj
  index_scores   2 J I per causal pair (the J dots of relu(q_j . k)) on full layers
  index_weighting  2 J per causal pair (sum_j w_j relu(...)); the Triton kernel fuses it into the scores
  mlp         dense layers' SwiGLU, 6 C intermediate
  router      2 C E on MoE layers
  experts     k x 6 C moe_intermediate (gate_up and down of each chosen expert)
  shared      n_shared x 6 C moe_intermediate
`total` is their sum.
"""

from __future__ import annotations

import importlib

__all__ = ["capture_flops", "causal_pairs", "glm52_capture_flops", "qwen36_capture_flops", "selected_pairs"]

# the chunk size of the chunked delta rule (longstraw_kernels/gdn: gdn_forward's default, fla's too)
GDN_CHUNK = 64


def causal_pairs(num_tokens: int) -> int:
    """(query, key) pairs with key <= query over num_tokens tokens."""
    return num_tokens * (num_tokens + 1) // 2


def selected_pairs(num_tokens: int, topk: int) -> int:
    """sum over queries t of min(topk, t + 1): the keys DSA selects."""
    ramp = min(topk, num_tokens)
    return causal_pairs(ramp) + (num_tokens - ramp) * topk


def qwen36_capture_flops(cfg, num_tokens: int, *, attention_pairs: int | None = None,
                         gdn_tokens: int | None = None) -> dict[str, int]:
    """FLOPs by term of a qwen36 capture (module docstring). attention_pairs: (query, key) pairs of each attention
    layer (default causal); gdn_tokens: tokens through the chunked delta rule (default num_tokens, unpadded)."""
    P = num_tokens
    pairs = causal_pairs(P) if attention_pairs is None else attention_pairs
    gdn_tokens = P if gdn_tokens is None else gdn_tokens
    C, D, H = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads
    G, K, V = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    num_attn = sum(t == "full_attention" for t in cfg.layer_types)
    num_gdn = cfg.num_hidden_layers - num_attn
    mlp = 3 * C * cfg.intermediate_size
    gdn_weights = C * (cfg.conv_dim + G * V + 2 * G) + G * V * C
    attn_weights = C * (2 * H * D + 2 * cfg.num_key_value_heads * D) + H * D * C
    c = GDN_CHUNK
    return _total({
        "linear": 2 * P * (num_gdn * gdn_weights + num_attn * attn_weights + cfg.num_hidden_layers * mlp),
        "attention": num_attn * 4 * H * D * pairs,
        "gdn_chunks": num_gdn * G * gdn_tokens * (2 * c * (2 * K + V) + 6 * K * V),
        "conv": num_gdn * 2 * cfg.conv_dim * cfg.linear_conv_kernel_dim * P,
    })


def glm52_capture_flops(cfg, num_tokens: int, *, index_pairs: int | None = None,
                        attended_pairs: int | None = None) -> dict[str, int]:
    """FLOPs by term of a glm52 capture (module docstring). index_pairs: (query, key) pairs each full indexer layer
    scores (default causal); attended_pairs: (query, selected key) pairs of each layer's sparse attention (default
    sum of min(index_topk, t + 1))."""
    P = num_tokens
    index_pairs = causal_pairs(P) if index_pairs is None else index_pairs
    attended = selected_pairs(P, cfg.index_topk) if attended_pairs is None else attended_pairs
    C, Q, H = cfg.hidden_size, cfg.q_lora_rank, cfg.num_attention_heads
    N, R, V, L = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    J, I = cfg.index_n_heads, cfg.index_head_dim
    layers = cfg.num_hidden_layers
    num_full = sum(t == "full" for t in cfg.layer_indexer_types)
    num_moe = sum(t == "sparse" for t in cfg.layer_mlp_types)
    I_e = cfg.moe_intermediate_size
    return _total({
        "mla_linear": layers * 2 * P * (C * Q + Q * H * (N + R) + C * (L + R) + H * V * C),
        "mla_absorb": layers * 2 * P * H * L * (N + V),
        "attention": layers * 2 * H * (2 * L + R) * attended,
        "index_linear": num_full * 2 * P * (Q * J * I + C * I + C * J),
        "index_scores": num_full * 2 * J * I * index_pairs,
        "index_weighting": num_full * 2 * J * index_pairs,
        "mlp": (layers - num_moe) * 2 * P * 3 * C * cfg.intermediate_size,
        "router": num_moe * 2 * P * C * cfg.n_routed_experts,
        "experts": num_moe * 2 * P * cfg.num_experts_per_tok * 3 * C * I_e,
        "shared": num_moe * 2 * P * cfg.n_shared_experts * 3 * C * I_e,
    })


def capture_flops(model, num_tokens: int, **pairs) -> dict[str, int]:
    """FLOPs by term (and `total`) of capturing num_tokens tokens with `model`: a named config ("glm52_mini"), a
    family's config object, or a model; through its family's hook (FamilySpec.flops)."""
    from longstraw_cli.models import family_of
    from longstraw_cli.plan import _family

    if isinstance(model, str) or not hasattr(model, "config"):
        spec, cfg = _family(model)
    else:
        spec, cfg = family_of(model), model.config
    if spec.flops is None:
        raise ValueError(f"model family {spec.name!r} has no capture FLOP count")
    module, _, function = spec.flops.partition(":")
    return getattr(importlib.import_module(module), function)(cfg, num_tokens, **pairs)


def _total(terms: dict[str, int]) -> dict[str, int]:
    return {**terms, "total": sum(terms.values())}
