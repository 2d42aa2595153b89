"""The qwen36 family's memory plan (FamilySpec.plan): per-rank bytes of one transaction, from the config alone.

    capture = weights + optimizer + resident + one capture block's activations
    score   = weights + optimizer + resident + one graph-free scoring batch
    replay  = weights + optimizer + grads + resident + one response graph + the logits chunk's backward
    step    = weights + optimizer + grads + resident + AdamW's foreach temporary
    prompt  = weights + optimizer + grads + resident + state gradient + one block's graph + one layer's page
              gradient (exact mode's reverse walk; `gradient="exact"`)
    drift   = weights + optimizer + resident + one capture block's activations (or one response's scoring) +
              the tail's pages (the last probe_tokens positions) and the carried states, copied (`reuse=True`:
              capture.reuse_steps > 1)
    rollout = weights + optimizer + resident + the decode's buffers + one decode step's logits
    peak    = the largest phase

Exact mode (`capture.gradient=exact`, resident/gradient.py) adds to the resident state the boundary states (the
GDN conv + recurrent state at each capture block's start, kept from capture on), and from the first replay to
the end of the walk the state gradient (the pages' and GDN states' size in the compute dtype) plus, transiently,
one attention layer's page gradient in the page dtype (what a backward produces for one layer's pages before it
is added into the buffer) and, on CUDA at one rank, that backward's P and dS tiles for one chunk of pages
(triton_page_tiles: 2 x query heads x the block's, or the response's, tokens x chunk, in `dtype`). The walk's
graph is one capture block's through every layer: `response_graph_bytes` of block_size tokens (a prompt block
saves per token what a response token saves); with `walk_checkpoint` every layer's block input plus the largest
single layer's graph (the layers are recomputed inside the backward).

Blockwise replay (`capture.replay_block` = b > 0, models/blockwise.py): the replay's graph is one block's,
`response_graph_bytes` of b tokens, plus what the last block's attention saves of the response's earlier keys (its
new-key axis, the response's K/V copied once: R tokens); beside it the walk holds the response's K/V (the model
dtype), their gradient (the compute dtype) and the GDN states at every block start but the first (`response_state`).
Scoring runs in blocks too: min(G, score_batch) responses' activations of one block, and those responses' K/V.

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
  longstraw_kernels/gdn/triton_chunk.py, which saves its inputs only and recomputes the chunked terms in its backward,
  one layer at a time (counted once, as a transient).
- capture activations: one block of `block_size` tokens through the heaviest layer, estimated as what that
  layer would save for backward (everything inside it coexists at some point, graph or not) plus the kernels'
  own buffers. `kernels="gpu"` (CUDA, bf16/fp16): flash attention keeps scores on chip but merges two partial
  outputs in fp32 (FLASH_FP32_COPIES x [heads, block, head dim]); fla's GDN forward holds its fp32 q/k/v
  copies and one state per chunk. `kernels="reference"` (CPU, fp32): the block's queries against its own keys
  form [q heads, block, block] fp32 scores, SCORE_COPIES at once plus a bool mask; against the prompt, pages
  are read `attention_block` at a time, which bounds those scores.
- score: min(G, score_batch) responses at once without a graph: one [chunk, vocab] chunk of fp32 logits plus
  one fp32 temporary (LOGIT_BYTES_SCORE per logit) for the whole batch (token_logprobs chunks the batch's tokens
  together: `common.score_logits_bytes`), or the layers' activations, whichever is larger. The activations are
  the one term that grows with G (up to score_batch).
- rollout: the native decode's buffers (qwen36/decode.py), per response every attention layer's K/V for R slots
  in `dtype` and a copy of every GDN layer's conv and recurrent state; the slots start at
  rollout.native.response_chunk and double up to R (models/slots.py), so R is their worst, and while the last
  growth copies one buffer (one layer's keys or values) its old copy at the capacity before R coexists with it
  (`decode_growth`). Beside them one step's fp32 logits and their softmax over G rows, with the reference
  kernels the pages' scores [G x heads, prompt] (SCORE_COPIES), and the copies of each layer's input linears
  concatenated where none is adapted (`decode_projections`: the whole model's without LoRA; none past a 16th of
  gpu_mem_gib).
  offload=cpu: the phase counts the two staged layers (the decode stages the layers it has not copied, as replay
  does); the copies of host pages that fit (rollout.native.offload_copy_gib) take only free memory and come on
  top, in `rollout`, not in a phase.
- replay transient: the log-prob backward's one chunk of recomputed logits (fp32, turned into the gradient in
  place, plus a bf16 copy: LOGIT_BYTES_REPLAY per logit) plus one weight-sized gradient (the output layer's,
  accumulated over the chunks in one buffer before it is added into .grad).
Left out: the CUDA context and library workspaces (outside the allocator's count), allocator fragmentation,
cp > 1's communication buffers (exact mode: per block walked, the received gradient of the block's pages, every
attention layer's, in the compute dtype; distributed/cp_walk.py), and fla being absent on a GPU (then capture
runs the torch chunked GDN, whose activations are `_gdn_graph`).
"""

from __future__ import annotations

import math

from longstraw_cli.lora import DEFAULT_TARGETS
from longstraw_cli.models.qwen36.config import Qwen36Config
from longstraw_cli.models.qwen36.decode import INPUT_GROUPS
from longstraw_cli.models.slots import response_capacities
from longstraw_cli.plan.common import (
    GIB,
    LOGIT_BYTES_REPLAY,
    Run,
    decode_copies,
    itemsize,
    rollout_copies,
    score_logits_bytes,
)
from longstraw_cli.quantize import nf4_bytes
from longstraw_kernels.attention.triton_page_tiles import DEFAULT_CHUNK as PAGE_TILES_CHUNK

# the chunk length of longstraw_kernels/gdn's chunked form
GDN_CHUNK = 64
# fp32 copies of a [heads, queries, keys] score block the reference attention holds at once
SCORE_COPIES = 3
# fp32 [heads, queries, head dim] buffers of the flash path's LSE merge (two partial outputs, their weighted
# copies, the sum) on top of its bf16 copies of q and the expanded new keys
FLASH_FP32_COPIES = 6


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


def decode_projection_bytes(cfg: Qwen36Config, dtype: str, lora_rank: int = 0, quantize: str = "none",
                            lora_targets=DEFAULT_TARGETS) -> int:
    """Bytes of the decode's concatenated input linears, copied for the rollout: every group of a layer's linears
    that read one input (qwen36/decode.py `INPUT_GROUPS`) where none carries an adapter (LoRA) and the weights are
    not NF4."""
    if quantize == "nf4":
        return 0
    total = 0
    for layer_type in cfg.layer_types:
        linears = _layer_linears(cfg, layer_type)
        for group in INPUT_GROUPS[layer_type]:
            if lora_rank == 0 or not any(name in lora_targets for name in group):
                total += sum(linears[name][0] * linears[name][1] for name in group)
    return total * itemsize(dtype)


def linear_bytes(cfg: Qwen36Config, dtype: str, quantize: str = "none") -> int:
    """Bytes of the decoder layers' linear weights: NF4 storage (quantize.nf4_bytes, linear by linear) or dtype's."""
    s = itemsize(dtype)
    return sum(nf4_bytes(i * o, s) if quantize == "nf4" else i * o * s
               for layer_type in cfg.layer_types for i, o in _layer_linears(cfg, layer_type).values())


def dequant_transient(numel: int, dtype: str) -> int:
    """Live bytes while one NF4 weight of `numel` is dequantised for its product: on a GPU the Triton kernel
    (longstraw_kernels.nf4) writes the weight in `dtype` directly and nothing else. (The torch reference that
    CPUs run forms int64 codes and half-size intermediates besides: ~3x this, not planned.)"""
    return numel * itemsize(dtype)


def resident_bytes(cfg: Qwen36Config, num_tokens: int, dtype: str = "bfloat16") -> dict[str, int]:
    """What `Qwen36ForCausalLM.resident_bytes(num_tokens)` reports for a model in `dtype`."""
    s = itemsize(dtype)
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
    """Saved bytes of the gated delta rule itself in longstraw_kernels/gdn's torch chunked form over `tokens` (also,
    as a transient, what the Triton op's backward recomputes for one layer)."""
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
    (longstraw_kernels/gdn/triton_chunk.py), which saves its inputs only (fp32 q and k, v, fp32 g and beta)."""
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
    s = itemsize(dtype)
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


def plan(cfg: Qwen36Config, run: Run) -> dict:
    """Per-rank bytes of one transaction by component and by phase (see the module docstring); the hook
    `longstraw_cli.plan.plan` calls with the validated settings."""
    s, f, m, kernels = run.s, run.f, run.m, run.kernels
    counts = param_counts(cfg, run.lora_rank)
    trainable = counts["lora"] if run.lora_rank > 0 else counts["total"]
    weights = (counts["total"] - counts["linears"] + counts["lora"]) * s + linear_bytes(cfg, run.dtype, run.quantize)
    dequant = dequant_transient(counts["largest_linear"], run.dtype) if run.quantize == "nf4" else 0
    grads = trainable * s
    optimizer = 2 * trainable * m

    captured = run.captured
    resident = resident_bytes(cfg, captured, run.dtype)

    num_attn = sum(t == "full_attention" for t in cfg.layer_types)
    # one attention layer's K/V pages (what offload stages, the exact walk's page gradient, a rollout copy)
    layer_pages = resident["kv_pages"] // max(num_attn, 1)
    # offload="cpu": the K/V pages (under cp > 1 this rank's shard) in host memory; on the device the GDN states
    # plus one attention layer's pages staged (capture: its window [0, block end), or under cp > 1 the layer's shard
    # being written while the one before goes to the host; replay: the forward's layer, or the layer whose backward
    # runs) and the next layer's in flight
    host = resident["kv_pages"] if run.offload == "cpu" else 0
    on_device = resident["total"] - host + (2 * layer_pages if host else 0)

    block = min(run.block_size, captured)
    pages = min(run.attention_block, captured)
    capture_act = _layer_activations(cfg, block, s, f, kernels) + block * cfg.hidden_size * s + max(
        _attention_scores(cfg, 1, block, block, kernels), _attention_scores(cfg, 1, block, pages, kernels))

    R, V, G = run.response_tokens, cfg.vocab_size, run.group_size

    def score_activations(batch: int) -> int:
        return max(
            batch * _layer_activations(cfg, R, s, f, kernels)
            + max(_attention_scores(cfg, batch, R, R, kernels), _attention_scores(cfg, batch, R, pages, kernels)),
            score_logits_bytes(batch, R, run.logprob_chunk, V, cfg.hidden_size, s),
        )

    # the response's own K/V, per token (every attention layer's keys and values)
    response_kv = num_attn * 2 * cfg.num_key_value_heads * cfg.head_dim
    if run.replay_block:
        b = run.response_block

        def score_activations(batch: int) -> int:
            return max(
                batch * _layer_activations(cfg, b, s, f, kernels) + batch * R * response_kv * s
                + max(_attention_scores(cfg, batch, b, R, kernels), _attention_scores(cfg, batch, b, pages, kernels)),
                score_logits_bytes(batch, b, run.logprob_chunk, V, cfg.hidden_size, s),
            )

    score_act = score_activations(min(run.group_size, run.score_batch)) if run.scoring else 0

    carried = resident["recurrent_state"] + resident["conv_state"]
    if run.replays_in_blocks:
        b = run.response_block
        graph = response_graph_bytes(cfg, b, run.dtype, kernels) + R * response_kv * s
        response_state = R * response_kv * (s + f) + (math.ceil(R / b) - 1) * carried
    else:
        graph = response_graph_bytes(cfg, R, run.dtype, kernels)
        response_state = 0
    largest_trainable = counts["largest_matrix"] * s if run.lora_rank == 0 else 0
    replay_transient = min(run.response_block, run.logprob_chunk) * V * LOGIT_BYTES_REPLAY + largest_trainable
    # foreach AdamW: one temporary (sqrt of the second moment) the size of the trainable set
    step_transient = trainable * m

    exact = run.gradient == "exact"
    boundaries = math.ceil(captured / run.block_size) * carried if exact else 0
    state_grad = (resident["kv_pages"] * f // s + resident["recurrent_state"] + resident["conv_state"] * f // s
                  if exact else 0)
    page_grad_transient = layer_pages if exact else 0

    def page_tiles(rows: int) -> int:
        """Exact mode on CUDA, one rank, a power-of-two head dim: the pages' backward (triton_page_tiles) holds P and
        dS of one chunk of pages, 2 K M chunk elements in `dtype` for M = rows x the kv group's query heads."""
        D = cfg.head_dim
        if not (exact and kernels == "gpu" and run.cp == 1 and D & (D - 1) == 0):
            return 0
        return 2 * cfg.num_attention_heads * rows * min(PAGE_TILES_CHUNK, captured) * s

    if exact and run.walk_checkpoint:
        # every layer's input, then one layer's graph at a time (the largest), recomputed inside the backward
        one_layer = max(block * _attention_graph_per_token(cfg, s, f), _gdn_graph(cfg, block, s, f, kernels)
                        + (_gdn_rule_graph(cfg, block, f) if kernels == "gpu" else 0))
        block_graph = cfg.num_hidden_layers * block * cfg.hidden_size * s + int(one_layer)
    else:
        block_graph = response_graph_bytes(cfg, block, run.dtype, kernels) if exact else 0

    tail = carried if run.reuse else 0
    base = weights + optimizer + on_device + boundaries + tail + dequant
    phases = {
        "capture": base + capture_act,
        "score": base + score_act,
        "replay": base + grads + state_grad + response_state + graph + replay_transient + page_grad_transient
        + page_tiles(run.response_block if run.replays_in_blocks else R),
        # the prompt's pages and boundary states are released before the optimizer step unless reuse keeps them
        "step": base - (0 if run.reuse else on_device + boundaries) + grads + step_transient,
    }
    if exact:
        phases["prompt"] = base + grads + state_grad + block_graph + page_grad_transient + page_tiles(block)
    if run.reuse:
        # the probe scores one response at a time
        probed = min(block, run.probe_tokens, captured)
        phases["drift"] = (base + max(capture_act, score_activations(1)) + resident["kv_pages"] * probed // captured
                           + carried)
    # the rollout's decode (qwen36/decode.py): per response every attention layer's K/V for R slots (they start at
    # rollout.native.response_chunk and double up to R, models/slots.py: R at worst) and a copy of every GDN layer's
    # states; while the last growth copies one layer's keys (or values), their old copy too; one step's logits and
    # their softmax, and the reference attention's scores against the pages
    decode = G * (R * response_kv * s + carried)
    capacities = response_capacities(R, run.response_chunk)
    decode_growth = G * capacities[-2] * cfg.num_key_value_heads * cfg.head_dim * s if len(capacities) > 1 else 0
    decode_step = 2 * G * V * f + _attention_scores(cfg, G, 1, captured, kernels)
    # none past FUSED_SHARE of the GPU's memory (qwen36/decode.py)
    projections = decode_copies(decode_projection_bytes(cfg, run.dtype, run.lora_rank, run.quantize), run)
    decoding = decode + decode_growth + decode_step + projections
    if run.decode:
        phases["rollout"] = weights + optimizer + on_device + boundaries + tail + dequant + decoding
    # the offloaded rollout: no staged layer; the copies of host pages that fit (whole layers)
    rollout_base = weights + optimizer + resident["total"] - host + boundaries + tail + dequant + decoding
    copies = rollout_copies(run, rollout_base, [layer_pages] * num_attn) if host else 0
    notes = [f"rollout decode buffers {decode / GIB:.2f} GiB (K/V of {R} slots and GDN states per response; + "
             f"{decode_growth / GIB:.2f} while the last growth copies one layer's), input linears concatenated "
             f"{projections / GIB:.2f} GiB"] if run.decode else []
    if exact:
        notes.append(f"exact: boundary states {boundaries / GIB:.2f}, state gradient {state_grad / GIB:.2f}, block "
                     f"graph {block_graph / GIB:.2f}, page gradient {page_grad_transient / GIB:.2f}, its tiles "
                     f"{page_tiles(block) / GIB:.2f}")
    if run.replay_block:
        notes.append(f"replay_block={run.replay_block}: block graph {graph / GIB:.2f} (of it the response's K/V "
                     f"{R * response_kv * s / GIB:.2f}), response state {response_state / GIB:.2f} (K/V, their "
                     f"gradient, GDN states at {math.ceil(R / run.response_block) - 1} block starts)")
    if host:
        shard = f"this rank's shard ({captured} tokens) " if run.cp > 1 else ""
        notes.append(f"offload=cpu: {shard}pages in host memory {host / GIB:.2f} GiB per rank (of "
                     f"{run.host_mem_gib:g}), on the GPU {on_device / GIB:.2f} GiB (GDN states + two attention "
                     f"layers' pages)")
        rest = host - copies
        notes.append(f"offload=cpu rollout: {copies / GIB:.2f} GiB of pages copied to the GPU for it "
                     f"(rollout.native.offload_copy_gib={run.offload_copy_gib}), its peak ~"
                     f"{(rollout_base + copies) / GIB:.2f} GiB"
                     + (f"; {rest / GIB:.2f} GiB read from host memory at every decode token" if rest else ""))
    return {
        "params": counts["total"], "trainable_params": trainable, "dequant_transient": dequant,
        "weights": weights, "grads": grads, "optimizer": optimizer,
        "resident": resident["total"], "resident_detail": resident, "resident_device": on_device, "host": host,
        "capture_activations": capture_act, "score_activations": score_act,
        "response_graph": graph, "replay_transient": replay_transient, "step_transient": step_transient,
        "boundary_states": boundaries, "tail_states": tail, "state_grad": state_grad, "block_graph": block_graph,
        "page_grad_transient": page_grad_transient, "page_tiles": page_tiles(block), "response_state": response_state,
        "decode_buffers": decode, "decode_growth": decode_growth, "decode_step": decode_step,
        "decode_projections": projections,
        "phases": phases, "rollout_copies": copies, "rollout": rollout_base + copies,
        "bound": (weights + grads + optimizer + on_device + boundaries + tail + state_grad + response_state
                  + max(graph, block_graph)),
        "notes": notes,
    }
