"""Memory plan of one LongStraw transaction per rank, from the config alone (no model is built).

    capture = weights + optimizer + resident + one capture block's activations
    score   = weights + optimizer + resident + one graph-free scoring batch
    replay  = weights + optimizer + grads + resident + one response graph + the logits chunk's backward
    step    = weights + optimizer + grads + resident + AdamW's foreach temporary
    prompt  = weights + optimizer + grads + resident + state gradient + one block's graph + one layer's page
              gradient (exact mode's reverse walk; `gradient="exact"`)
    drift   = weights + optimizer + resident + one capture block's activations (or one response's scoring) +
              the tail's pages (the last probe_tokens positions) and the carried states, copied (`reuse=True`:
              capture.reuse_steps > 1)
    peak    = the largest phase

Exact mode (`capture.gradient=exact`, resident/gradient.py) adds to the resident state the boundary states (the
GDN conv + recurrent state at each capture block's start, kept from capture on), and from the first replay to
the end of the walk the state gradient (the pages' and GDN states' size in the compute dtype) plus, transiently,
one attention layer's page gradient in the page dtype (what a backward produces for one layer's pages before it
is added into the buffer). The walk's graph is one capture block's through every layer: `response_graph_bytes`
of block_size tokens (a prompt block saves per token what a response token saves); with `walk_checkpoint` every
layer's block input plus the largest single layer's graph (the layers are recomputed inside the backward).

Grads exist only from the first replay to the step (the transaction zeroes them to None), so capture and score
do not carry them. `bound` is the method's analytic bound, weights + grads + optimizer + resident + one response
graph: the replay phase without its transients.

Where the bytes come from (s: bytes per element of `dtype`, f: of the compute dtype, at least fp32):
- weights: every parameter of the qwen36 layout, counted from the config widths; grads in the parameter dtype.
  `quantize="nf4"` (QLoRA, quantize.py): every decoder layer's linear in torchao's NF4 layout, `nf4_bytes`
  (4-bit codes, an int8 scaler per 64 weights, a factor per 256 scalers: ~0.516 bytes a weight), the rest
  (embeddings, lm_head, norms, GDN's conv and gates, the adapters) in `dtype`; plus, in every phase, one
  linear's dequantisation transient (`dequant_transient`).
- optimizer: torch.optim.AdamW keeps two moments per trainable parameter in the PARAMETER's dtype (it allocates
  zeros_like(p)); `moment_dtype="float32"` gives the fp32-moment figure of a master-weight setup instead.
- resident: K/V pages of the captured (prompt - 1) / cp tokens for every attention layer in `dtype`, an fp32
  [value heads, Dk, Dv] recurrent state and a [conv_dim, kernel - 1] conv state per GDN layer: the formula of
  `Qwen36ForCausalLM.resident_bytes`. Context parallelism splits the pages only; the GDN state is whole per rank.
- response graph: what autograd saves per response token and layer, written term by term from what the code
  saves (`_gdn_graph`, `_attention_graph_per_token`): with kernels="reference" the torch chunked GDN (for
  qwen36_mini in bf16 295 KB per token per GDN layer and 162 KB per attention layer, the project's GraphMemory
  accounting to within 1%, tests/models/test_plan.py); with kernels="gpu" the GDN rule is the Triton op of
  kernels/gdn/triton_chunk.py, which saves its inputs only and recomputes the chunked terms in its backward,
  one layer at a time (counted once, as a transient).
- capture activations: one block of `block_size` tokens through the heaviest layer, estimated as what that
  layer would save for backward (everything inside it coexists at some point, graph or not) plus the kernels'
  own buffers. `kernels="gpu"` (CUDA, bf16/fp16): flash attention keeps scores on chip but merges two partial
  outputs in fp32 (FLASH_FP32_COPIES x [heads, block, head dim]); fla's GDN forward holds its fp32 q/k/v
  copies and one state per chunk. `kernels="reference"` (CPU, fp32): the block's queries against its own keys
  form [q heads, block, block] fp32 scores, SCORE_COPIES at once plus a bool mask; against the prompt, pages
  are read `attention_block` at a time, which bounds those scores.
- score: min(G, score_batch) responses at once without a graph: [batch, chunk, vocab] logits in fp32 plus one
  fp32 temporary (LOGIT_BYTES_SCORE per logit), or the layers' activations, whichever is larger. This is the
  one term that grows with G (up to score_batch); with a 248K vocabulary it is 2 GiB per scored response.
- replay transient: the log-prob backward's one chunk of recomputed logits (fp32, turned into the gradient in
  place, plus a bf16 copy: LOGIT_BYTES_REPLAY per logit) plus one weight-sized gradient (the output layer's,
  accumulated over the chunks in one buffer before it is added into .grad).
Left out: the CUDA context and library workspaces (outside the allocator's count), allocator fragmentation,
cp > 1's communication buffers (exact mode: per block walked, the received gradient of the block's pages, every
attention layer's, in the compute dtype; distributed/cp_walk.py), and fla being absent on a GPU (then capture
runs the torch chunked GDN, whose activations are `_gdn_graph`).
"""

from __future__ import annotations

import argparse
import math
import sys

import torch

from longstraw_cli.lora import DEFAULT_TARGETS, LoraConfig
from longstraw_cli.models.qwen36.config import NAMED_CONFIGS, Qwen36Config, named_config
from longstraw_cli.quantize import QUANTIZE_CHOICES, dtype_refusal, nf4_bytes
from longstraw_cli.resident.gradient import check_gradient_mode
from longstraw_cli.resident.offload import OFFLOAD_NAMES, offload_refusal

GIB = 2**30
DTYPE_NAMES = ("float32", "bfloat16", "float16", "float64")

# the chunk length of kernels/gdn's chunked form
GDN_CHUNK = 64
KERNELS = ("auto", "gpu", "reference")
# fp32 copies of a [heads, queries, keys] score block the reference attention holds at once
SCORE_COPIES = 3
# fp32 [heads, queries, head dim] buffers of the flash path's LSE merge (two partial outputs, their weighted
# copies, the sum) on top of its bf16 copies of q and the expanded new keys
FLASH_FP32_COPIES = 6
# bytes per logit element: graph-free (fp32 logits + the exp temporary), and the log-prob backward's chunk
# (the fp32 logits it works on in place, plus the bf16 matmul output before it or the bf16 gradient after it)
LOGIT_BYTES_SCORE = 8
LOGIT_BYTES_REPLAY = 6


def _itemsize(dtype: str) -> int:
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"dtype={dtype!r}; valid: {list(DTYPE_NAMES)}")
    return getattr(torch, dtype).itemsize


def _config(model_name_or_cfg) -> Qwen36Config:
    if isinstance(model_name_or_cfg, Qwen36Config):
        return model_name_or_cfg
    if isinstance(model_name_or_cfg, str):
        return named_config(model_name_or_cfg)
    raise ValueError(f"model must be a name in {sorted(NAMED_CONFIGS)} or a Qwen36Config, got {model_name_or_cfg!r}")


def _layer_linears(cfg: Qwen36Config, layer_type: str) -> dict[str, tuple[int, int]]:
    """(in, out) features of every nn.Linear of one decoder layer, by module name."""
    C = cfg.hidden_size
    if layer_type == "full_attention":
        q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        mixer = {"q_proj": (C, 2 * q), "k_proj": (C, kv), "v_proj": (C, kv), "o_proj": (q, C)}
    else:
        v = cfg.linear_num_value_heads * cfg.linear_value_head_dim
        g = cfg.linear_num_value_heads
        mixer = {"in_proj_qkv": (C, cfg.conv_dim), "in_proj_z": (C, v), "in_proj_b": (C, g), "in_proj_a": (C, g),
                 "out_proj": (v, C)}
    I = cfg.intermediate_size
    return {**mixer, "gate_proj": (C, I), "up_proj": (C, I), "down_proj": (I, C)}


def param_counts(cfg: Qwen36Config, lora_rank: int = 0, lora_targets=DEFAULT_TARGETS) -> dict[str, int]:
    """Parameters of the model (`total`), the largest single matrix, the LoRA adapters' count, and the decoder
    layers' linears (`linears`: what quantize="nf4" stores 4-bit; `largest_linear`: the largest of them)."""
    C = cfg.hidden_size
    embeddings = cfg.vocab_size * C * (1 if cfg.tie_word_embeddings else 2)
    total, adapters, largest = embeddings + C, 0, cfg.vocab_size * C
    linear_params, largest_linear = 0, 0
    for layer_type in cfg.layer_types:
        linears = _layer_linears(cfg, layer_type)
        linear_params += sum(i * o for i, o in linears.values())
        largest_linear = max(largest_linear, *(i * o for i, o in linears.values()))
        total += sum(i * o for i, o in linears.values()) + 2 * C
        if layer_type == "full_attention":
            total += 2 * cfg.head_dim  # q_norm, k_norm
        else:
            # conv1d (depthwise), dt_bias, A_log, gated norm
            total += cfg.conv_dim * cfg.linear_conv_kernel_dim + 2 * cfg.linear_num_value_heads
            total += cfg.linear_value_head_dim
        if lora_rank > 0:
            adapters += sum(lora_rank * (i + o) for name, (i, o) in linears.items() if name in lora_targets)
    return {"total": total, "lora": adapters, "largest_matrix": largest, "linears": linear_params,
            "largest_linear": largest_linear}


def linear_bytes(cfg: Qwen36Config, dtype: str, quantize: str = "none") -> int:
    """Bytes of the decoder layers' linear weights: NF4 storage (quantize.nf4_bytes, linear by linear) or dtype's."""
    s = _itemsize(dtype)
    return sum(nf4_bytes(i * o, s) if quantize == "nf4" else i * o * s
               for layer_type in cfg.layer_types for i, o in _layer_linears(cfg, layer_type).values())


def dequant_transient(numel: int, dtype: str) -> int:
    """Live bytes while one NF4 weight of `numel` is dequantised for its product: on a GPU the Triton kernel
    (longstraw_kernels.nf4) writes the weight in `dtype` directly and nothing else. (The torch reference that
    CPUs run forms int64 codes and half-size intermediates besides: ~3x this, not planned.)"""
    return numel * _itemsize(dtype)


def resident_bytes(cfg: Qwen36Config, num_tokens: int, dtype: str = "bfloat16") -> dict[str, int]:
    """What `Qwen36ForCausalLM.resident_bytes(num_tokens)` reports for a model in `dtype`."""
    s = _itemsize(dtype)
    f = max(s, 4)
    num_attn = sum(t == "full_attention" for t in cfg.layer_types)
    num_gdn = cfg.num_hidden_layers - num_attn
    out = {
        "kv_pages": num_attn * 2 * num_tokens * cfg.num_key_value_heads * cfg.head_dim * s,
        "recurrent_state": num_gdn * cfg.linear_num_value_heads * cfg.linear_key_head_dim
        * cfg.linear_value_head_dim * f,
        "conv_state": num_gdn * cfg.conv_dim * (cfg.linear_conv_kernel_dim - 1) * s,
    }
    out["total"] = sum(out.values())
    return out


def _gdn_outside_kernel_per_token(cfg: Qwen36Config, s: int, f: int) -> float:
    """Saved bytes per token of a GDN layer outside the gated-delta-rule kernel."""
    C, I, X = cfg.hidden_size, cfg.intermediate_size, cfg.conv_dim
    G, Vd, Kd = cfg.linear_num_value_heads, cfg.linear_num_value_heads * cfg.linear_value_head_dim, (
        cfg.linear_num_key_heads * cfg.linear_key_head_dim)
    return (
        4 * C * f  # two RMSNorms: fp32 input and normalised value each
        + 2 * C * s + Vd * s  # inputs of in_proj_*, gate/up_proj, out_proj
        + 2 * X * s  # conv input (with its window) and output
        + 2 * Kd * f  # l2norm inputs of q and k
        + 3 * Vd * f + 2 * Vd * s  # gated RMSNorm and silu(z)
        + 2 * G * f  # beta, softplus(a)
        + 4 * I * s  # SwiGLU: gate, silu(gate), up, their product
    )


def _gdn_rule_graph(cfg: Qwen36Config, tokens: int, f: int) -> float:
    """Saved bytes of the gated delta rule itself in kernels/gdn's torch chunked form over `tokens` (also, as a
    transient, what the Triton op's backward recomputes for one layer)."""
    G, Dk, Dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    Vd, Ke = G * Dv, G * Dk  # Ke: keys repeated to the value heads
    # the chunked form pads the tokens to whole chunks
    chunks = -(-tokens // GDN_CHUNK)
    per_padded_token = (
        10 * Ke * f + 3 * Vd * f  # q/k copies, k*beta, the two triangular solves, decayed q/k, u
        + 5 * G * GDN_CHUNK * f  # [chunk x chunk] decay, A and attention matrices per head
    )
    # one [G, Dk, Dv] state per chunk
    return chunks * GDN_CHUNK * per_padded_token + chunks * G * Dk * Dv * f


def _gdn_graph(cfg: Qwen36Config, tokens: int, s: int, f: int, kernels: str = "reference") -> float:
    """Saved bytes of a GDN layer over `tokens`. reference: the torch chunked rule's graph; gpu: the Triton op
    (kernels/gdn/triton_chunk.py), which saves its inputs only (fp32 q and k, v, fp32 g and beta)."""
    outside = tokens * _gdn_outside_kernel_per_token(cfg, s, f)
    if kernels == "gpu":
        G, Kd = cfg.linear_num_value_heads, cfg.linear_num_key_heads * cfg.linear_key_head_dim
        return outside + tokens * (2 * Kd * f + G * cfg.linear_value_head_dim * s + 2 * G * f)
    return outside + _gdn_rule_graph(cfg, tokens, f)


def _attention_graph_per_token(cfg: Qwen36Config, s: int, f: int) -> float:
    C, I = cfg.hidden_size, cfg.intermediate_size
    Q, qd, kvd = cfg.num_attention_heads, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    return (
        4 * C * f  # two RMSNorms
        + 2 * C * s + qd * s  # inputs of q/k/v_proj, gate/up_proj, o_proj
        + 2 * (qd + kvd) * f  # q_norm, k_norm
        + 2 * cfg.rotary_dim * s  # rope cos/sin
        + 2 * qd * s + 2 * kvd * s + Q * f  # replay attention: q, out, new k, new v, lse (pages are resident)
        + qd * s  # sigmoid(gate)
        + 4 * I * s  # SwiGLU
    )


def response_graph_bytes(cfg: Qwen36Config, response_tokens: int, dtype: str = "bfloat16",
                         kernels: str = "reference") -> int:
    """Saved-for-backward bytes of one replayed response (what GraphMemory counts at its peak); kernels="gpu":
    the GDN layers' Triton op, plus one layer's backward transient (it recomputes the chunked terms)."""
    s = _itemsize(dtype)
    f = max(s, 4)
    # final norm, the checkpointed logits input, the token ids
    total = response_tokens * (2 * cfg.hidden_size * f + cfg.hidden_size * s + 8)
    for layer_type in cfg.layer_types:
        if layer_type == "full_attention":
            total += response_tokens * _attention_graph_per_token(cfg, s, f)
        else:
            total += _gdn_graph(cfg, response_tokens, s, f, kernels)
    if kernels == "gpu" and "linear_attention" in cfg.layer_types:
        total += _gdn_rule_graph(cfg, response_tokens, f)
    return int(total)


def _layer_activations(cfg: Qwen36Config, tokens: int, s: int, f: int, kernels: str) -> int:
    """Live bytes of one layer's graph-free forward over `tokens`, estimated as what its graph would save plus
    the kernels' own buffers (see the module docstring)."""
    attention = tokens * _attention_graph_per_token(cfg, s, f)
    if kernels == "reference":
        return int(max(_gdn_graph(cfg, tokens, s, f), attention))
    G, Dk, Dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    chunks = -(-tokens // GDN_CHUNK)
    fla = tokens * (4 * G * Dk + 2 * G * Dv) * f + chunks * G * Dk * Dv * f
    flash = tokens * FLASH_FP32_COPIES * cfg.num_attention_heads * cfg.head_dim * 4
    return int(max(tokens * _gdn_outside_kernel_per_token(cfg, s, f) + fla, attention + flash))


def _attention_scores(cfg: Qwen36Config, batch: int, queries: int, keys: int, kernels: str) -> int:
    """Score buffers of the torch reference attention: folded GQA [batch, kv heads, q-per-kv x queries, keys]
    in fp32, SCORE_COPIES at once, plus the bool causal mask. Flash attention keeps scores on chip."""
    if kernels != "reference":
        return 0
    mask = (cfg.num_attention_heads // cfg.num_key_value_heads) * queries * keys if queries == keys else 0
    return SCORE_COPIES * batch * cfg.num_attention_heads * queries * keys * 4 + mask


def plan(model_name_or_cfg, *, cp: int = 1, prompt_tokens: int, group_size: int, response_tokens: int,
         dtype: str = "bfloat16", lora_rank: int = 0, gpu_mem_gib: float = 139.0, block_size: int = 8192,
         score_batch: int = 8, logprob_chunk: int = 1024, attention_block: int = 1024,
         moment_dtype: str | None = None, kernels: str = "auto", gradient: str = "response_only",
         walk_checkpoint: bool = False, reuse: bool = False, probe_tokens: int = 1024, quantize: str = "none",
         offload: str = "none", host_mem_gib: float = 128.0, offload_copy_gib: float | str = "auto") -> dict:
    """Per-rank bytes of one transaction by component and by phase; see the module docstring.
    kernels: "gpu" (flash attention, fla's GDN forward), "reference" (the torch kernels), "auto": gpu for
    bf16/fp16, where the model dispatches to them on CUDA, reference otherwise. gradient: response_only | exact.
    reuse: the resident state also keeps the carried states at the tail's start (`Resident.tail`), and the drift
    probe copies the tail's pages (its last min(probe_tokens, block_size) positions) and the carried states aside
    while it re-captures the tail.
    quantize: "none" | "nf4" (lora.quantize; needs lora_rank > 0): the base linears' storage, see the docstring.
    offload_copy_gib (rollout.native.offload_copy_gib, offload="cpu"): the rollout's copies of host pages, whole
    attention layers, into the GPU memory the other phases leave free (`rollout_copies`; "auto": what gpu_mem_gib
    holds with 10% spare, as `resident.offload.rollout_pages` does with the device's free memory). The rollout's
    figure (`rollout`) is not a phase of `peak`: the copies take only memory that is free, so they never decide
    whether a prompt fits; they raise the measured peak above `peak` where they are larger than what replay adds."""
    cfg = _config(model_name_or_cfg)
    check_gradient_mode(gradient)
    refused = offload_refusal(offload, gradient=gradient, cp=cp)
    if refused:
        raise ValueError(refused)
    if kernels not in KERNELS:
        raise ValueError(f"kernels={kernels!r}; valid: {list(KERNELS)}")
    if kernels == "auto":
        kernels = "gpu" if dtype in ("bfloat16", "float16") else "reference"
    for name, value in (("cp", cp), ("prompt_tokens", prompt_tokens), ("group_size", group_size),
                        ("response_tokens", response_tokens), ("block_size", block_size),
                        ("score_batch", score_batch), ("logprob_chunk", logprob_chunk),
                        ("attention_block", attention_block)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if isinstance(lora_rank, bool) or not isinstance(lora_rank, int) or lora_rank < 0:
        raise ValueError(f"lora_rank must be an int >= 0 (0 = full fine-tuning), got {lora_rank!r}")
    # the training config's own refusals (lora.LoraConfig, config._check_quantize)
    LoraConfig(rank=lora_rank, quantize=quantize)
    refused = dtype_refusal(quantize, dtype)
    if refused:
        raise ValueError(refused)
    s = _itemsize(dtype)
    f = max(s, 4)
    m = _itemsize(moment_dtype or dtype)

    counts = param_counts(cfg, lora_rank)
    trainable = counts["lora"] if lora_rank > 0 else counts["total"]
    weights = (counts["total"] - counts["linears"] + counts["lora"]) * s + linear_bytes(cfg, dtype, quantize)
    dequant = dequant_transient(counts["largest_linear"], dtype) if quantize == "nf4" else 0
    grads = trainable * s
    optimizer = 2 * trainable * m

    # capture keeps prompt_tokens - 1 tokens; cp ranks split them into contiguous pieces
    captured = math.ceil((prompt_tokens - 1) / cp)
    resident = resident_bytes(cfg, captured, dtype)

    num_attn = sum(t == "full_attention" for t in cfg.layer_types)
    # one attention layer's K/V pages (what offload stages, the exact walk's page gradient, a rollout copy)
    layer_pages = resident["kv_pages"] // max(num_attn, 1)
    # offload="cpu": the K/V pages in host memory; on the device the GDN states plus one attention layer's pages
    # staged (capture: its window [0, block end); replay: the forward's layer, or the layer whose backward runs)
    # and the next layer's in flight
    host = resident["kv_pages"] if offload == "cpu" else 0
    on_device = resident["total"] - host + (2 * layer_pages if host else 0)

    block = min(block_size, captured)
    pages = min(attention_block, captured)
    capture_act = _layer_activations(cfg, block, s, f, kernels) + block * cfg.hidden_size * s + max(
        _attention_scores(cfg, 1, block, block, kernels), _attention_scores(cfg, 1, block, pages, kernels))

    R, V = response_tokens, cfg.vocab_size

    def score_activations(batch: int) -> int:
        return max(
            batch * _layer_activations(cfg, R, s, f, kernels)
            + max(_attention_scores(cfg, batch, R, R, kernels), _attention_scores(cfg, batch, R, pages, kernels)),
            batch * min(R, logprob_chunk) * V * LOGIT_BYTES_SCORE + batch * R * cfg.hidden_size * s,
        )

    score_act = score_activations(min(group_size, score_batch))

    graph = response_graph_bytes(cfg, R, dtype, kernels)
    largest_trainable = counts["largest_matrix"] * s if lora_rank == 0 else 0
    replay_transient = min(R, logprob_chunk) * V * LOGIT_BYTES_REPLAY + largest_trainable
    # foreach AdamW: one temporary (sqrt of the second moment) the size of the trainable set
    step_transient = trainable * m

    exact = gradient == "exact"
    carried = resident["recurrent_state"] + resident["conv_state"]
    boundaries = math.ceil(captured / block_size) * carried if exact else 0
    state_grad = (resident["kv_pages"] * f // s + resident["recurrent_state"] + resident["conv_state"] * f // s
                  if exact else 0)
    page_grad_transient = layer_pages if exact else 0
    if exact and walk_checkpoint:
        # every layer's input, then one layer's graph at a time (the largest), recomputed inside the backward
        one_layer = max(block * _attention_graph_per_token(cfg, s, f), _gdn_graph(cfg, block, s, f, kernels)
                        + (_gdn_rule_graph(cfg, block, f) if kernels == "gpu" else 0))
        block_graph = cfg.num_hidden_layers * block * cfg.hidden_size * s + int(one_layer)
    else:
        block_graph = response_graph_bytes(cfg, block, dtype, kernels) if exact else 0

    tail = carried if reuse else 0
    base = weights + optimizer + on_device + boundaries + tail + dequant
    phases = {
        "capture": base + capture_act,
        "score": base + score_act,
        "replay": base + grads + state_grad + graph + replay_transient + page_grad_transient,
        "step": base + grads + step_transient,
    }
    if exact:
        phases["prompt"] = base + grads + state_grad + block_graph + page_grad_transient
    if reuse:
        # the probe scores one response at a time
        probed = min(block, probe_tokens, captured)
        phases["drift"] = (base + max(capture_act, score_activations(1)) + resident["kv_pages"] * probed // captured
                           + carried)
    peak = max(phases.values())
    budget, host_budget = int(gpu_mem_gib * GIB), int(host_mem_gib * GIB)
    # the offloaded rollout: no grads, no graph, no staged layer; the copies of host pages that fit (whole layers)
    rollout_base = weights + optimizer + resident["total"] - host + boundaries + tail + dequant
    copies = 0
    if host:
        room = max(budget - rollout_base, 0) / 1.1
        if offload_copy_gib != "auto":
            room = min(room, offload_copy_gib * GIB)
        copies = min(num_attn, int(room // layer_pages)) * layer_pages
    return {
        "model": model_name_or_cfg if isinstance(model_name_or_cfg, str) else "custom",
        "cp": cp, "prompt_tokens": prompt_tokens, "group_size": group_size, "response_tokens": response_tokens,
        "dtype": dtype, "lora_rank": lora_rank, "block_size": block_size, "score_batch": score_batch,
        "kernels": kernels, "gradient": gradient, "walk_checkpoint": walk_checkpoint, "quantize": quantize,
        "dequant_transient": dequant, "offload": offload, "offload_copy_gib": offload_copy_gib,
        "params": counts["total"], "trainable_params": trainable,
        "weights": weights, "grads": grads, "optimizer": optimizer,
        "resident": resident["total"], "resident_detail": resident, "resident_device": on_device, "host": host,
        "capture_activations": capture_act, "score_activations": score_act,
        "response_graph": graph, "replay_transient": replay_transient, "step_transient": step_transient,
        "boundary_states": boundaries, "tail_states": tail, "state_grad": state_grad, "block_graph": block_graph,
        "page_grad_transient": page_grad_transient,
        "phases": phases, "peak": peak, "rollout_copies": copies, "rollout": rollout_base + copies,
        "bound": (weights + grads + optimizer + on_device + boundaries + tail + state_grad
                  + max(graph, block_graph)),
        "budget": budget, "host_budget": host_budget, "fits": peak <= budget and host <= host_budget,
    }


def max_prompt_tokens(model_name_or_cfg, *, gpu_mem_gib: float = 139.0, limit: int = 2**34, **kwargs) -> int:
    """The longest prompt whose planned peak fits in gpu_mem_gib (0 if not even a 2-token prompt fits)."""
    def fits(n: int) -> bool:
        return plan(model_name_or_cfg, prompt_tokens=n, gpu_mem_gib=gpu_mem_gib, **kwargs)["fits"]

    if not fits(2):
        return 0
    lo, hi = 2, 4
    while hi < limit and fits(hi):
        lo, hi = hi, hi * 2
    if hi >= limit and fits(limit):
        return limit
    # invariant: fits(lo), not fits(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def _tokens(text: str) -> int:
    """'262144', '256K', '2M' -> tokens (K = 1024)."""
    scale = {"K": 2**10, "M": 2**20}.get(text[-1:].upper(), 1)
    try:
        return int(text[:-1] if scale > 1 else text) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a token count: {text!r} (e.g. 65536, 64K, 2M)") from None


def report(cfg: Qwen36Config, title: str, prompts: list[int], **common) -> int:
    """Print the per-rank plan of each prompt length and the longest prompt that fits; 2 on a bad value."""
    columns = ("weights", "grads", "optimizer", "resident", "capture_activations", "score_activations",
               "response_graph", "replay_transient")
    short = ("weights", "grads", "optim", "resident", "capt_act", "score_act", "graph", "repl_tr")
    try:
        plans = [plan(cfg, prompt_tokens=prompt, **common) for prompt in prompts]
        # the trainer refuses a prompt past the model's positions (less the response's), whatever memory allows
        positions = cfg.max_position_embeddings
        cap = positions - common["response_tokens"]
        longest = max_prompt_tokens(cfg, limit=cap, **common)
        # the placements this run may take (offload is refused with exact gradients and under context parallel)
        placements = [o for o in OFFLOAD_NAMES if not offload_refusal(
            o, gradient=common.get("gradient", "response_only"), cp=common.get("cp", 1))]
        per_placement = {o: max_prompt_tokens(cfg, limit=cap, **{**common, "offload": o}) for o in placements}
    except ValueError as e:
        print(f"plan: error: {e}", file=sys.stderr)
        return 2
    print(f"{title} ({cfg.num_hidden_layers} layers), cp={common['cp']}, G={common['group_size']}, "
          f"R={common['response_tokens']}, {common['dtype']}, lora_rank={common['lora_rank']}, "
          f"quantize={common.get('quantize', 'none')}, block={common['block_size']}, kernels={common['kernels']}, "
          f"gradient={common.get('gradient', 'response_only')}"
          f"{', walk_checkpoint' if common.get('walk_checkpoint') else ''}; GiB per rank")
    print(f"{'prompt':>9} " + " ".join(f"{c:>9}" for c in short) + f" {'bound':>9} {'peak':>9} {'phase':>8}  fits")
    for p in plans:
        phase = max(p["phases"], key=p["phases"].get)
        print(f"{p['prompt_tokens']:>9} " + " ".join(f"{p[c] / GIB:>9.2f}" for c in columns)
              + f" {p['bound'] / GIB:>9.2f} {p['peak'] / GIB:>9.2f} {phase:>8}  {'yes' if p['fits'] else 'NO'}")
    for p in plans:
        if p["gradient"] == "exact":
            print(f"{p['prompt_tokens']:>9} exact: boundary states {p['boundary_states'] / GIB:.2f}, state gradient "
                  f"{p['state_grad'] / GIB:.2f}, block graph {p['block_graph'] / GIB:.2f}, page gradient "
                  f"{p['page_grad_transient'] / GIB:.2f}")
    for p in plans:
        if p["offload"] == "cpu":
            print(f"{p['prompt_tokens']:>9} offload=cpu: pages in host memory {p['host'] / GIB:.2f} GiB (of "
                  f"{p['host_budget'] / GIB:g}), on the GPU {p['resident_device'] / GIB:.2f} GiB (GDN states + two "
                  f"attention layers' pages)")
            rest = p["host"] - p["rollout_copies"]
            print(f"{p['prompt_tokens']:>9} offload=cpu rollout: {p['rollout_copies'] / GIB:.2f} GiB of pages copied "
                  f"to the GPU for it (rollout.native.offload_copy_gib={p['offload_copy_gib']}), its peak ~"
                  f"{p['rollout'] / GIB:.2f} GiB" + (f"; {rest / GIB:.2f} GiB read from host memory at every decode "
                                                    f"token" if rest else ""))
    for p in plans:
        if p["prompt_tokens"] > cap:
            print(f"{p['prompt_tokens']:>9} is past the model's positions: with response_tokens="
                  f"{common['response_tokens']} its {positions} positions leave room for {cap} (longstraw train "
                  f"refuses it)")
    capped = (f" (the model's {positions} positions less the response; memory allows more)"
              if longest == cap and plan(cfg, prompt_tokens=cap + 1, **common)["fits"] else "")
    print(f"longest prompt that fits in {common['gpu_mem_gib']:g} GiB: {longest} tokens ({longest / 2**20:.2f}M)"
          + capped)
    host_limit = f"{common.get('host_mem_gib', 128.0):g} GiB host"
    print("longest prompt per placement: " + ", ".join(
        f"offload={o}: {n} tokens ({n / 2**20:.2f}M)" + (f", {host_limit}" if o == "cpu" else "")
        for o, n in per_placement.items()))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m longstraw_cli.plan", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen36_mini", choices=sorted(NAMED_CONFIGS))
    parser.add_argument("--num-layers", type=int, default=None, help="override num_hidden_layers")
    parser.add_argument("--prompts", default="64K,256K,1M,2M", help="comma list of prompt lengths (K/M suffixes)")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--response", type=_tokens, default=1024)
    parser.add_argument("--cp", type=int, default=1)
    parser.add_argument("--dtype", default="bfloat16", choices=DTYPE_NAMES)
    parser.add_argument("--lora-rank", type=int, default=0)
    parser.add_argument("--quantize", default="none", choices=QUANTIZE_CHOICES)
    parser.add_argument("--gpu-mem-gib", type=float, default=139.0)
    parser.add_argument("--block-size", type=int, default=8192)
    parser.add_argument("--score-batch", type=int, default=8)
    parser.add_argument("--kernels", default="auto", choices=KERNELS)
    args = parser.parse_args(argv)
    try:
        prompts = [_tokens(p) for p in args.prompts.split(",") if p]
    except argparse.ArgumentTypeError as e:
        parser.error(str(e))
    cfg = named_config(args.model) if args.num_layers is None else named_config(
        args.model, num_hidden_layers=args.num_layers)
    return report(cfg, args.model, prompts, cp=args.cp, group_size=args.group_size, response_tokens=args.response,
                  dtype=args.dtype, lora_rank=args.lora_rank, quantize=args.quantize, gpu_mem_gib=args.gpu_mem_gib,
                  block_size=args.block_size, score_batch=args.score_batch, kernels=args.kernels)


if __name__ == "__main__":
    sys.exit(main())
