"""The glm52 family's memory plan (FamilySpec.plan): per-rank bytes of one transaction for any cp x ep, from the
config alone. The phases are longstraw_cli.plan's; what they hold for MLA + DSA + MoE (models/glm52/model.py):

- weights, listed apart: `replicated` (embeddings, lm_head, norms, the MLA linears, the DSA indexer with its fp32
  weights_proj, the dense and shared-expert MLPs, the fp32 router weight and bias: every rank holds them whole)
  and `experts` (the routed experts, E / ep per rank: distributed/ep.py's `expert_bounds`). lora.quantize=nf4:
  every decoder linear but the indexer's (lora._candidate_linears) in torchao's NF4 layout (quantize.nf4_bytes),
  and the routed experts likewise, each expert's [2I, C] and [C, I] matrix on its own; plus, in every phase, the
  most one dequantisation holds at once (`dequant_transient`): the largest linear, or the experts the static decode
  step dequantises in one pass (quantize.NF4_EXPERTS_PER_PASS; the routed path takes one expert at a time).
- grads and optimizer: the trainable parameters in their own dtype (the router's fp32), two AdamW moments each.
  Full fine-tuning trains all but the DSA indexer, which never gets a gradient, so AdamW keeps no state for it.
- pages (`resident`): per layer and captured token the MLA latent (kv_lora_rank) and rope key (qk_rope_head_dim),
  and the indexer key (index_head_dim) on "full" indexer layers, in the model dtype; context parallel splits the
  captured tokens (`Glm52ForCausalLM.resident_bytes` of a rank's shard). No carried state: no boundary or tail
  states.
- capture: cp = 1 runs `CausalLM.capture` block by block through every layer: one block's layer activations
  (estimated, as for qwen36, by what the layer would save for backward: everything in it coexists at some point)
  plus the index-score chunk (`_SCORE_ELEMENTS` of the model, ~12 bytes an element with the top-k's
  temporaries). cp > 1 runs `cp_capture_glm52`, one layer over the rank's whole span at a time: the span's hidden
  states ([span, C] copies: the residual, its norm, the attention output's blocks and their concatenation, the
  residual sum), the RMSNorm's fp32 copies of the span, the DSA selection [span, index_topk] int64 (carried to the
  next layer, its blocks and their concatenation), and the layer's pages of every rank all-gathered (the gathered
  shards and their concatenation coexist: twice the prompt's pages of one layer, `cp_gather`).
- blockwise replay (`capture.replay_block` = b > 0, models/blockwise.py): the replay's graph is one block's (b
  queries against the response's R keys), plus the response's keys the last block saves on its new-key axis;
  beside it the response's keys and their gradient (`response_state`); scoring runs in blocks with the batch's keys.
- score: min(G, score_batch) responses without a graph: their layer activations, or one logits chunk (token_logprobs
  chunks the batch's tokens together, so the batch costs one chunk, not one a response).
- replay: one response's graph, term by term from what autograd saves (`_layer_graph`): the norms' fp32 copies,
  the linears' inputs, the absorbed query, per layer its own copy of the DSA selection as the sparse kernel saves
  it ([R, index_topk] int64), the dense attention over the response's own keys ([R, heads, R] fp32 scores and
  probabilities), the LSE merge's fp32 copies, the routed experts' rows (R k / ep pairs per rank under expert
  parallel's replicated mode); under LoRA (and NF4) each layer's folded kv_b weight, twice (absorb and output).
  Then the logits chunk's backward and, with full fine-tuning, one lm_head-sized gradient (as qwen36).
- prompt (capture.gradient=exact): the state gradient (latent and rope pages in the compute dtype), one layer's
  page gradient (the backward's fp32 buffers, Triton's or the torch reference's alike), and one block's graph
  through every layer (or, with walk_checkpoint, every layer's block input plus the largest layer's graph).
- rollout: weights + optimizer + pages + the decode buffers (G responses' latent, rope and index keys per layer,
  `ResponseMLA`) + one step's logits and index scores. The buffers start at rollout.native.response_chunk slots
  and double up to R (models/slots.py): counted at their worst, R slots, plus what the last growth holds besides
  (`growth_transient`: the old copy of one buffer, the largest, at the capacity before R).
- offload=cpu: the rank's pages (its CP shard) in host memory, `host` bytes per rank; on the GPU two layers' pages
  of the shard (one staged, the next in flight; in capture one layer's written, the one before on its way to the
  host). cp = 1: the rollout copies whole layers into free memory, and the index keys of the others move to the
  GPU (glm52/decode.py). cp > 1 decodes by the eager `StepDecoder` (distributed/cp_glm52.py): every paged layer
  is staged at every token, two layers on the GPU, nothing copied for the rollout.
- routing replay (rollout.replay_routing, on by default): the rollout's routing records (models/glm52/routing.py
  `record_bytes`: per response token the top-k expert ids of every MoE layer and the DSA selection of every full
  indexer layer, on every rank). The decode writes all G x R tokens' on the GPU (rollout); from then on they are
  host memory (`routing_records_host`, counted against host_mem_gib) and the GPU holds the rows of the call under
  way: scoring min(G, score_batch) responses', a replay one response's (R tokens; staged per call, so a blockwise
  replay would hold one block's), the exact walk none (the prompt's tokens are routed live).
Left out, as for qwen36: the CUDA context, fragmentation, the collectives' buffers (besides capture's all-gather),
expert imbalance (every rank is planned with the average share of routed pairs), a KL reference's second model.
"""

from __future__ import annotations

from longstraw_cli.models.glm52.config import Glm52Config
from longstraw_cli.models.glm52.model import _SCORE_ELEMENTS
from longstraw_cli.models.glm52.routing import SELECTION_DTYPE, expert_id_dtype, record_bytes
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
from longstraw_cli.quantize import NF4_EXPERTS_PER_PASS, nf4_bytes

# bytes per index-score element formed at once: the fp32 score and the top-k's temporaries (models/glm52/model.py)
SCORE_BYTES = 12
# the torch reference's sparse attention gathers this many (query, key) entries at once
# (longstraw_kernels/mla/reference.py)
REFERENCE_GATHER = 1 << 20
INT64 = 8


def _dims(cfg: Glm52Config):
    return (cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.index_topk)


def layer_linears(cfg: Glm52Config, layer: int) -> dict[str, tuple[int, int]]:
    """(in, out) of every nn.Linear of decoder layer `layer` that LoRA may target and NF4 stores 4-bit (the
    indexer's are neither)."""
    C, H = cfg.hidden_size, cfg.num_attention_heads
    mlp = (cfg.intermediate_size if cfg.layer_mlp_types[layer] == "dense"
           else cfg.moe_intermediate_size * cfg.n_shared_experts)
    return {"q_a_proj": (C, cfg.q_lora_rank), "q_b_proj": (cfg.q_lora_rank, H * cfg.qk_head_dim),
            "kv_a_proj_with_mqa": (C, cfg.kv_lora_rank + cfg.qk_rope_head_dim),
            "kv_b_proj": (cfg.kv_lora_rank, H * (cfg.qk_nope_head_dim + cfg.v_head_dim)),
            "o_proj": (H * cfg.v_head_dim, C), "gate_proj": (C, mlp), "up_proj": (C, mlp), "down_proj": (mlp, C)}


def weight_parts(cfg: Glm52Config, run: Run) -> dict[str, int]:
    """One rank's weights: bytes `replicated` (the LoRA adapters included) and `experts` (its E / ep routed
    experts), `params` (its parameters, adapters included; buffers not), the adapters' count `lora`, the
    trainable set's `trainable_params`, `grads` and `optimizer` bytes, the largest decoder linear and the
    routed-expert weights the static decode step dequantises in one pass on this rank (`pass_experts`)."""
    from longstraw_cli.models import get_family

    s, f, C = run.s, run.f, cfg.hidden_size
    nf4 = run.quantize == "nf4"
    targets = get_family("glm52").lora_targets
    embeddings = cfg.vocab_size * C * (1 if cfg.tie_word_embeddings else 2)
    # (count, itemsize) of the parameters full fine-tuning trains; bytes and count of the rest
    trained, frozen, frozen_params, lora, largest_linear = [(embeddings + C, s)], 0, 0, 0, 0
    for i, mlp_type in enumerate(cfg.layer_mlp_types):
        trained.append((2 * C + cfg.q_lora_rank + cfg.kv_lora_rank, s))
        for name, (n_in, n_out) in layer_linears(cfg, i).items():
            largest_linear = max(largest_linear, n_in * n_out)
            if nf4:
                frozen, frozen_params = frozen + nf4_bytes(n_in * n_out, s), frozen_params + n_in * n_out
            else:
                trained.append((n_in * n_out, s))
            if run.lora_rank and name in targets:
                lora += run.lora_rank * (n_in + n_out)
        if cfg.layer_indexer_types[i] == "full":
            # no gradient reaches the indexer (it runs under no_grad); weights_proj is fp32
            I, J = cfg.index_head_dim, cfg.index_n_heads
            frozen += (cfg.q_lora_rank * J * I + C * I + 2 * I) * s + C * J * f
            frozen_params += cfg.q_lora_rank * J * I + C * I + 2 * I + C * J
        if mlp_type == "sparse":
            # the router's weight (trained) and its correction bias (a buffer), both fp32
            trained.append((cfg.n_routed_experts * C, f))
            frozen += cfg.n_routed_experts * f
    local, I_e = cfg.n_routed_experts // run.ep, cfg.moe_intermediate_size
    num_moe = sum(t == "sparse" for t in cfg.layer_mlp_types)
    expert_params = num_moe * local * 3 * C * I_e
    replicated = sum(n * size for n, size in trained) + frozen + lora * s
    if nf4:
        experts = num_moe * local * (nf4_bytes(2 * I_e * C, s) + nf4_bytes(C * I_e, s))
        frozen_params += expert_params
    else:
        experts = expert_params * s
        trained.append((expert_params, s))
    out = {"replicated": replicated, "experts": experts, "lora": lora,
           "params": sum(n for n, _ in trained) + frozen_params + lora, "largest_linear": largest_linear,
           "pass_experts": min(local, NF4_EXPERTS_PER_PASS) * 3 * C * I_e}
    if run.lora_rank:
        out.update(trainable_params=lora, grads=lora * s, optimizer=2 * lora * run.m)
    else:
        out.update(trainable_params=sum(n for n, _ in trained), grads=sum(n * size for n, size in trained),
                   optimizer=2 * sum(n * (run.m if run.moment_dtype else size) for n, size in trained))
    return out


def decode_projection_bytes(cfg: Glm52Config, run: Run) -> int:
    """Bytes of the decode's concatenated input linears (glm52/decode.py `input_groups`), copied for the rollout on
    one rank (cp = 1; under cp > 1 the eager step decoder runs the modules): each layer's (q_a_proj,
    kv_a_proj_with_mqa[, the indexer's wk]), (q_b_proj[, wq_b]) and the MLP's or shared experts' (gate_proj,
    up_proj), a group only where no member carries an adapter (LoRA) and none is NF4; nothing where they would pass
    FUSED_SHARE of the GPU's memory."""
    from longstraw_cli.models import get_family

    if run.cp > 1 or run.quantize == "nf4":
        return 0
    targets = get_family("glm52").lora_targets
    total = 0
    for i, indexer in enumerate(cfg.layer_indexer_types):
        linears = layer_linears(cfg, i)
        extra_x = {"wk": (cfg.hidden_size, cfg.index_head_dim)} if indexer == "full" else {}
        extra_q = {"wq_b": (cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim)} if indexer == "full" else {}
        groups = ({**{n: linears[n] for n in ("q_a_proj", "kv_a_proj_with_mqa")}, **extra_x},
                  {"q_b_proj": linears["q_b_proj"], **extra_q},
                  {n: linears[n] for n in ("gate_proj", "up_proj")})
        for group in groups:
            if run.lora_rank == 0 or not any(name in targets for name in group):
                total += sum(n_in * n_out for n_in, n_out in group.values())
    return decode_copies(total * run.s, run)


def page_bytes(cfg: Glm52Config, num_tokens: int, dtype: str = "bfloat16") -> dict[str, int]:
    """What `Glm52ForCausalLM.resident_bytes(num_tokens)` reports for pages in `dtype`."""
    s = itemsize(dtype)
    num_full = sum(t == "full" for t in cfg.layer_indexer_types)
    out = {"latent_pages": cfg.num_hidden_layers * num_tokens * cfg.kv_lora_rank * s,
           "rope_pages": cfg.num_hidden_layers * num_tokens * cfg.qk_rope_head_dim * s,
           "index_pages": num_full * num_tokens * cfg.index_head_dim * s}
    out["total"] = sum(out.values())
    return out


def layer_page_bytes(cfg: Glm52Config, num_tokens: int, s: int) -> list[int]:
    """Each layer's pages of num_tokens tokens (latent + rope, + index keys on full indexer layers)."""
    return [num_tokens * (cfg.kv_lora_rank + cfg.qk_rope_head_dim + (cfg.index_head_dim if kind == "full" else 0)) * s
            for kind in cfg.layer_indexer_types]


def _attention_per_token(cfg: Glm52Config, new_keys: int, run: Run, *, full: bool, across_ranks: bool) -> float:
    """Saved bytes per token of a layer's input norm and attention (see `_layer_graph`)."""
    s, f = run.s, run.f
    C, H, L, R, K = _dims(cfg)
    Q, A = cfg.q_lora_rank, L + R
    upcast = f if f != s else 0
    # the input RMSNorm and the q_a / kv_a norms: fp32 input, and the normalised value when the norm weight trains
    total = (C + Q + L) * (f + (s if full else 0)) + (
        C * s + Q * s  # inputs of q_a / kv_a (one tensor) and q_b
        + H * cfg.qk_head_dim * s  # q_b's output, which the absorption's einsum saves (q_nope is a view)
        + H * A * s  # the absorbed query [q_nope W_uk | q_rope]
        + K * INT64 + H * L * s + H * f  # the sparse kernel: its copy of the selection, out, lse
        + H * L * s + H * cfg.v_head_dim * s  # inputs of the output einsum and of o_proj
        + (run.lora_rank * 8 * s if run.lora_rank else 0)  # each adapter's A output
    )
    if across_ranks:
        # context parallel's page attention (cp_pages_attention): the query and the rank's partial output in the
        # compute dtype, and the merged output MergeAcrossRanks saves (counted, not measured: no multi-rank meter)
        total += H * A * f + 2 * H * L * f
    if new_keys:
        # the dense attention over the response's own keys: fp32 scores and probabilities [H, S], the mask; the
        # LSE merge with the pages' part: fp32 copies of both partial outputs
        total += H * new_keys * 2 * f + new_keys + H * A * upcast + A * upcast + 2 * H * L * f
    return total


def _mlp_per_token(cfg: Glm52Config, layer: int, run: Run, *, full: bool, pairs: float) -> float:
    """Saved bytes per token of a layer's post-attention norm and MLP; `pairs`: routed (token, expert) pairs
    computed on this rank per token (see `_layer_graph`)."""
    s, f, C = run.s, run.f, cfg.hidden_size
    norm = C * (f + (s if full else 0))
    if cfg.layer_mlp_types[layer] == "dense":
        return norm + C * s + 4 * cfg.intermediate_size * s
    # the gathered rows, the experts' SwiGLU, the outputs the routing weights multiply; the shared experts'
    # SwiGLU; the router's fp32 input (when it trains) and scores
    return (norm + C * s + pairs * (2 * C * s + 4 * cfg.moe_intermediate_size * s + f + INT64)
            + 4 * cfg.moe_intermediate_size * cfg.n_shared_experts * s + (C * f if full and f != s else 0)
            + cfg.n_routed_experts * f)


def _layer_graph(cfg: Glm52Config, layer: int, T: int, new_keys: int, run: Run, *, full: bool,
                 folded: bool, across_ranks: bool = False) -> int:
    """Saved-for-backward bytes of one layer's replay over T tokens of one sequence whose own `new_keys` keys
    the dense part attends to (0: pages only, as capture). full: the base weights take gradients (their
    inputs are saved); folded: kv_b is read as a computed weight (LoRA or NF4), saved by both of its einsums;
    across_ranks: the pages' attention is context parallel's (replay, scoring, the exact walk under cp > 1; the
    CP capture attends to its gathered pages locally). Tokens are replicated over the EP group: each rank
    computes its experts' share of the routed pairs, k / ep a token on average."""
    per_token = (_attention_per_token(cfg, new_keys, run, full=full, across_ranks=across_ranks)
                 + _mlp_per_token(cfg, layer, run, full=full, pairs=cfg.num_experts_per_tok / run.ep))
    weight = 2 * cfg.kv_lora_rank * cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim) * run.s
    return int(T * per_token) + (weight if folded else 0)


def response_graph_bytes(cfg: Glm52Config, run: Run, tokens: int | None = None, new_keys: int | None = None) -> int:
    """Saved-for-backward bytes of one replayed response (what GraphMemory counts at its peak); tokens, new_keys:
    a block of a response (blockwise replay), its queries and the response keys they see."""
    R = run.response_tokens if tokens is None else tokens
    S = R if new_keys is None else new_keys
    full, folded = run.lora_rank == 0, run.lora_rank > 0
    # final norm, the checkpointed logits input, the token ids
    total = R * (2 * cfg.hidden_size * run.f + cfg.hidden_size * run.s + INT64)
    return total + sum(_layer_graph(cfg, i, R, S, run, full=full, folded=folded, across_ranks=run.cp > 1)
                       for i in range(cfg.num_hidden_layers))


def walk_graph_bytes(cfg: Glm52Config, run: Run, block: int) -> int:
    """Exact mode: one block's graph through every layer (`recompute_block`: a second sparse call over the
    block's own keys, its pages written); with walk_checkpoint every layer's block input plus the largest layer."""
    full, folded = run.lora_rank == 0, run.lora_rank > 0
    C, H, L, R, K = _dims(cfg)
    # the second sparse call (the block's own keys: its selection copy, out, lse), the LSE merge's fp32 copies,
    # the block's pages
    extra = block * (K * INT64 + H * L * run.s + H * run.f + 2 * H * L * run.f + (L + R) * run.s)
    layers = [_layer_graph(cfg, i, block, 0, run, full=full, folded=folded, across_ranks=run.cp > 1) + extra
              for i in range(cfg.num_hidden_layers)]
    if run.walk_checkpoint:
        return cfg.num_hidden_layers * block * C * run.s + max(layers)
    return sum(layers)


def _scores(queries: int, keys: int, run: Run) -> int:
    """The index-score chunk: [rows, keys] with rows x keys bounded by the model's _SCORE_ELEMENTS."""
    cap = _SCORE_ELEMENTS["cuda" if run.kernels == "gpu" else "cpu"]
    return min(queries * keys, max(cap, keys)) * SCORE_BYTES


def growth_transient(cfg: Glm52Config, run: Run, routed: bool) -> int:
    """What the decode's last growth holds beyond its final buffers (models/slots.py): the old copy of one buffer,
    at most the largest, one layer's latent keys or (routing replay) one full layer's DSA selections, at the
    capacity before the last (0: the slots never grow)."""
    capacities = response_capacities(run.response_tokens, run.response_chunk)
    if len(capacities) == 1:
        return 0
    full, sparse = "full" in cfg.layer_indexer_types, "sparse" in cfg.layer_mlp_types
    rows = [cfg.kv_lora_rank * run.s, cfg.qk_rope_head_dim * run.s, cfg.index_head_dim * run.s if full else 0]
    if routed:
        rows += [cfg.index_topk * SELECTION_DTYPE.itemsize if full else 0,
                 cfg.num_experts_per_tok * expert_id_dtype(cfg.n_routed_experts).itemsize if sparse else 0]
    return run.group_size * capacities[-2] * max(rows)


def _gather(cfg: Glm52Config, queries: int, run: Run) -> int:
    """The torch reference's gathered [entries, L + R] pages in the compute dtype (the Triton kernel gathers on
    chip); kernels=gpu: none."""
    if run.kernels == "gpu":
        return 0
    return min(queries * cfg.index_topk, REFERENCE_GATHER) * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * run.f


def _block_activations(cfg: Glm52Config, block: int, keys: int, run: Run) -> int:
    """Live bytes of one block of queries through the heaviest layer, graph-free (cp = 1's capture): what that
    layer would save, the index scores, the reference kernel's gather."""
    layer = max(_layer_graph(cfg, i, block, 0, run, full=True, folded=False) for i in range(cfg.num_hidden_layers))
    return layer + _scores(block, keys, run) + _gather(cfg, block, run)


def cp_capture_bytes(cfg: Glm52Config, run: Run) -> tuple[int, int]:
    """(live bytes, of which the all-gather of one layer's pages) of `cp_capture_glm52` on the rank with the
    most keys to see (the last): the largest of its steps (see the module docstring) through one layer."""
    s, f, C, K = run.s, run.f, cfg.hidden_size, cfg.index_topk
    T, P = run.captured, run.prompt_tokens - 1
    block = min(run.block_size, T)
    span_C, span_K = T * C * s, T * K * INT64
    # the layer's pages of every rank: the gathered shards and their concatenation (the largest, a full layer)
    seen = max(layer_page_bytes(cfg, P, s))
    gather = 2 * seen
    carried = span_C + span_K  # the residual stream and the previous layer's selection
    norm = carried + T * C * (2 * f + s)
    gathering = carried + span_C + gather
    # the attention's blocks: the span's norm, the gathered pages, the outputs and selections so far, then their
    # concatenation; one block's attention, index scores and reference gather
    attention = int(block * _attention_per_token(cfg, 0, run, full=True, across_ranks=False)) + _scores(
        block, P, run) + _gather(cfg, block, run)
    blocks = carried + span_C + seen + span_C + span_K + max(attention, span_C + span_K)
    # the MLP in blocks over the residual sum (the old residual, the attention output, the sum, both
    # selections): tokens are sharded, so each rank's experts compute its tokens' share, k pairs a token, plus
    # the all-to-all's received rows and their regrouped copy
    moe = max(_mlp_per_token(cfg, i, run, full=True, pairs=cfg.num_experts_per_tok)
              for i in range(cfg.num_hidden_layers))
    routed = 2 * block * cfg.num_experts_per_tok * C * s if run.ep > 1 else 0
    mlp = carried + 2 * span_C + span_K + int(block * moe) + routed
    return max(norm, gathering, blocks, mlp), gather


def plan(cfg: Glm52Config, run: Run) -> dict:
    """Per-rank bytes of one transaction by component and phase (the module docstring); the hook that
    `longstraw_cli.plan.plan` calls with the validated settings."""
    if cfg.n_routed_experts % run.ep:
        raise ValueError(f"ep={run.ep} does not divide the {cfg.n_routed_experts} routed experts; valid ep: "
                         f"{[n for n in range(1, cfg.n_routed_experts + 1) if cfg.n_routed_experts % n == 0]}")
    s, f, m = run.s, run.f, run.m
    parts = weight_parts(cfg, run)
    weights = parts["replicated"] + parts["experts"]
    dequant = max(parts["largest_linear"], parts["pass_experts"]) * s if run.quantize == "nf4" else 0
    grads, optimizer = parts["grads"], parts["optimizer"]

    captured = run.captured
    pages = page_bytes(cfg, captured, run.dtype)
    per_layer = layer_page_bytes(cfg, captured, s)
    host = pages["total"] if run.offload == "cpu" else 0
    # offload: one layer staged, the next in flight
    on_device = pages["total"] - host + (2 * max(per_layer) if host else 0)

    block = min(run.block_size, captured)
    if run.cp > 1:
        capture_act, gathered = cp_capture_bytes(cfg, run)
    else:
        capture_act = block * cfg.hidden_size * s + _block_activations(cfg, block, captured, run)
        gathered = 0

    R, V, G = run.response_tokens, cfg.vocab_size, run.group_size
    full, folded = run.lora_rank == 0, run.lora_rank > 0

    def score_activations(batch: int) -> int:
        layer = max(_layer_graph(cfg, i, R, R, run, full=True, folded=folded, across_ranks=run.cp > 1)
                    for i in range(cfg.num_hidden_layers))
        return max(batch * layer + _scores(batch * R, captured + R, run) + _gather(cfg, batch * R, run),
                   score_logits_bytes(batch, R, run.logprob_chunk, V, cfg.hidden_size, s))

    # blockwise replay (capture.replay_block): one block's graph plus the response's keys its last block saves (the
    # new-key axis: latent, rope and index keys of R tokens); beside it the response's keys and their gradient
    response_keys = sum(layer_page_bytes(cfg, R, s))
    response_state = 0
    if run.replay_block:
        b = run.response_block

        def score_activations(batch: int) -> int:
            layer = max(_layer_graph(cfg, i, b, R, run, full=True, folded=folded, across_ranks=run.cp > 1)
                        for i in range(cfg.num_hidden_layers))
            return max(batch * layer + batch * response_keys + _scores(batch * b, captured + R, run)
                       + _gather(cfg, batch * b, run),
                       score_logits_bytes(batch, b, run.logprob_chunk, V, cfg.hidden_size, s))

    if run.replays_in_blocks:
        response_state = response_keys + cfg.num_hidden_layers * R * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * f

    score_act = score_activations(min(G, run.score_batch)) if run.scoring else 0
    graph = response_graph_bytes(cfg, run, run.response_block, R) + (response_keys if run.replays_in_blocks else 0)
    largest_trainable = V * cfg.hidden_size * s if full else 0
    replay_transient = min(run.response_block, run.logprob_chunk) * V * LOGIT_BYTES_REPLAY + largest_trainable
    step_transient = parts["trainable_params"] * m

    exact = run.gradient == "exact"
    latent_rope = pages["latent_pages"] + pages["rope_pages"]
    state_grad = latent_rope * f // s if exact else 0
    page_grad = captured * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * f if exact else 0
    block_graph = walk_graph_bytes(cfg, run, block) if exact else 0

    # the decode: per layer and response latent, rope and index keys for R tokens (its slots grow in doublings up to
    # R, models/slots.py: R at worst); one step's logits (and their softmax) and index scores against the prompt
    decode = G * sum(layer_page_bytes(cfg, R, s))
    decode_step = 2 * G * V * f + _scores(G, captured + R, run)
    # offloaded: the index keys of layers left on the host move to the GPU for the rollout (cp = 1); under cp > 1 the
    # eager decode stages whole layers at every token, as the replay does
    rollout_device = (on_device if run.cp > 1 else pages["index_pages"]) if host else on_device

    # routing replay: the records of all G x R tokens, written by the decode on the GPU (grown with its slots), then
    # kept in host memory; scoring and each replay stage the rows of their call
    routed = run.replay_routing in ("auto", True, "measure")
    records = record_bytes(cfg, G, R) if routed else 0
    decode_growth = growth_transient(cfg, run, routed)
    # staged on the device only for the positions a forward names: a score batch's responses, one response (with
    # capture.replay_block, one block of them)
    records_score = record_bytes(cfg, min(G, run.score_batch), run.response_block) if routed and run.scoring else 0
    records_replay = record_bytes(cfg, 1, run.response_block) if routed else 0

    base = weights + optimizer + on_device + dequant
    phases = {
        "capture": base + capture_act,
        "score": base + score_act + records_score,
        "replay": base + grads + state_grad + response_state + graph + replay_transient + page_grad + records_replay,
        # the prompt's pages are released before the optimizer step unless capture.reuse_steps keeps them
        "step": base - (0 if run.reuse else on_device) + grads + step_transient,
    }
    if exact:
        phases["prompt"] = base + grads + state_grad + block_graph + page_grad
    if run.reuse:
        probed = min(block, run.probe_tokens, captured)
        phases["drift"] = base + max(capture_act, score_activations(1)) + pages["total"] * probed // captured
    projections = decode_projection_bytes(cfg, run)
    rollout_base = (weights + optimizer + dequant + rollout_device + decode + decode_step + records + decode_growth
                    + projections)
    if run.decode:
        phases["rollout"] = rollout_base
    copies = rollout_copies(run, rollout_base, per_layer) if host and run.cp == 1 else 0

    notes = [f"weights: replicated {parts['replicated'] / GIB:.2f} GiB, routed experts {parts['experts'] / GIB:.2f} "
             f"GiB ({cfg.n_routed_experts // run.ep} of {cfg.n_routed_experts} per layer on this rank, "
             f"{'NF4' if run.quantize == 'nf4' else run.dtype})"
             + (f"; routed experts and decoder linears quantised to NF4, at most {dequant / GIB:.2f} GiB dequantised "
                f"at once" if run.quantize == "nf4" else ""),
             f"pages {pages['total'] / GIB:.2f} GiB ({captured} tokens per rank: latent "
             f"{pages['latent_pages'] / GIB:.2f}, rope {pages['rope_pages'] / GIB:.2f}, index keys "
             f"{pages['index_pages'] / GIB:.2f})"
             + (f"; rollout decode buffers {decode / GIB:.2f} GiB (+ {decode_growth / GIB:.2f} while the last growth "
                f"copies one), input linears concatenated {projections / GIB:.2f} GiB" if run.decode else "")
             + (f"; routing records in host memory {records / GIB:.3f} GiB (on the GPU: the rollout's decode "
                f"{records / GIB:.3f}, scoring {records_score / GIB:.3f}, a replay {records_replay / GIB:.3f})"
                if records else "")]
    if gathered:
        notes.append(f"cp capture: one layer's pages of every rank gathered {gathered / GIB:.2f} GiB (shards + "
                     f"concatenation), in capture_act")
    if exact:
        notes.append(f"exact: state gradient {state_grad / GIB:.2f}, block graph {block_graph / GIB:.2f}, page "
                     f"gradient {page_grad / GIB:.2f}")
    if run.replay_block:
        notes.append(f"replay_block={run.replay_block}: block graph {graph / GIB:.2f} (of it the response's keys "
                     f"{response_keys / GIB:.2f}), response state {response_state / GIB:.2f} (its keys and their "
                     f"gradient)")
    if run.reuse:
        notes.append(f"reuse: drift probe {phases['drift'] / GIB:.2f} GiB")
    if host and run.cp > 1:
        notes.append(f"offload=cpu: this rank's shard ({captured} tokens) in host memory {host / GIB:.2f} GiB per rank "
                     f"(of {run.host_mem_gib:g}), on the GPU {on_device / GIB:.2f} GiB (two layers' pages); the "
                     f"eager CP decode stages every layer at every token (nothing copied for the rollout)")
    elif host:
        notes.append(f"offload=cpu: pages in host memory {host / GIB:.2f} GiB (of {run.host_mem_gib:g}), on the GPU "
                     f"{on_device / GIB:.2f} GiB (two layers' pages); rollout copies {copies / GIB:.2f} GiB of them "
                     f"(rollout.native.offload_copy_gib={run.offload_copy_gib})")
    return {
        "params": parts["params"], "trainable_params": parts["trainable_params"], "dequant_transient": dequant,
        "weights": weights, "weights_replicated": parts["replicated"], "weights_experts": parts["experts"],
        "grads": grads, "optimizer": optimizer,
        "resident": pages["total"], "resident_detail": pages, "resident_device": on_device, "host": host,
        "capture_activations": capture_act, "cp_gather": gathered, "score_activations": score_act,
        "response_graph": graph, "replay_transient": replay_transient, "step_transient": step_transient,
        "boundary_states": 0, "tail_states": 0, "state_grad": state_grad, "block_graph": block_graph,
        "page_grad_transient": page_grad, "decode_buffers": decode, "decode_growth": decode_growth,
        "decode_step": decode_step, "decode_projections": projections, "routing_records": records,
        "response_state": response_state,
        "routing_records_host": records, "routing_records_score": records_score,
        "routing_records_replay": records_replay,
        "phases": phases, "rollout_copies": copies, "rollout": rollout_base + copies,
        "bound": weights + grads + optimizer + on_device + state_grad + response_state + max(graph, block_graph),
        "notes": notes,
    }
