"""The model contract both families share: the layer walks of each named path, prompt checks, log-probs.

A family supplies its decoder layers, `empty_resident` / `resident_bytes` / `start_decode`, and `init_module`
(its own parameter init rules); everything that walks the layers lives here, once.

Named paths, each a method of every decoder layer (and of its token mixer), all taking and returning a `carry`:
what a layer hands the next one (glm52: the DSA selection that IndexShare "shared" layers reuse; qwen36: None).
- `forward(x, positions, carry, grad_prefix)`: the full-sequence reference; positions < grad_prefix carry no
  gradient (the detached prompt of response_only replay, computed by an independent route).
- `capture_block(x, positions, state, start, carry)`: one block of the prompt at positions [start, start + T):
  writes its pages / advances its recurrent state IN PLACE, attends to what is resident up to its end.
- `capture_span(x, positions, state, block_size, carry)`: one layer over a whole span (layer-by-layer capture:
  context parallel runs it per rank's span; offloaded capture writes each layer's pages once).
- `replay(x, positions, state, carry)`: tokens that follow the resident prompt, read-only against `state`
  (scoring and replay; autograd when enabled).
- `decode_step(x, positions, state, cache, carry)`: one token per sequence, `cache` the per-sequence state of
  the tokens generated so far (native rollout).
- `replay_block(x, positions, state, before, carry) -> (x, carry, written)`: one block of the response's tokens
  (blockwise replay and scoring, `capture.replay_block`): like `replay` against the prompt's `state`, and also
  against `before`, what the response's earlier blocks left (a paged layer: their pages, batched [B, S, ...], or
  None for the first block; a carried one: the state at the block's start, batched [B, ...]); `written` is the
  block's own pages (batched) or the state at its end, returned, never written.
- `recompute_block(x, positions, state, carry) -> (x, carry, written)`: exact mode's reverse walk: capture_block's
  function of one prompt block with autograd. `state` is what the block reads (a paged layer: the pages BEFORE the
  block; a carried one: the state at the block's start); `written` is what capture_block writes, in the state's
  own layout (the block's pages, or the state at its end), returned instead of written.
Every layer writes its resident state in place; nothing is returned up to the model to copy.

Legend: B batch, T tokens, C hidden, V vocab, R response tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from longstraw_cli.models import blockwise
from longstraw_cli.models.embedding import Embedding
from longstraw_cli.models.logprobs import token_logprobs
from longstraw_cli.models.slots import ResponseSlots, grown_capacity, response_capacities
from longstraw_cli.resident import Resident
from longstraw_cli.resident.gradient import StateGrad, WholePrompt, leaves
from longstraw_cli.resident.offload import BlockWriter, PageWriter, stage_layers
from longstraw_cli.resident.state import prefix, snapshot
from longstraw_kernels import at_least_fp32
from longstraw_kernels.linear.reference import silu_mul_reference

# a decoder layer's entry points besides forward (FSDP gathers a layer's weights around each)
LAYER_PATHS = ("capture_block", "capture_span", "replay", "decode_step", "recompute_block", "replay_block")


def check_prompt(prompt_ids: torch.Tensor, block_size: int) -> None:
    if prompt_ids.dim() != 1 or prompt_ids.numel() == 0:
        raise ValueError(f"capture takes a non-empty 1-D prompt, got shape {tuple(prompt_ids.shape)}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")


def stop_grad_prefix(x_BT_: torch.Tensor, n: int) -> torch.Tensor:
    """Same values; positions < n carry no gradient (the prompt is a constant in response_only mode)."""
    if n <= 0:
        return x_BT_
    return torch.cat([x_BT_[:, :n].detach(), x_BT_[:, n:]], dim=1)


def capture_blocks(num_tokens: int, block_size: int, tail: int = 0) -> list[tuple[int, int]]:
    """[start, end) of the capture's blocks: block_size tokens each from 0; with tail > 0 the last block's last
    min(tail, its length) tokens are cut off as a block of their own (reuse.py's drift probe re-captures it)."""
    blocks = [(start, min(num_tokens, start + block_size)) for start in range(0, num_tokens, block_size)]
    if tail > 0 and blocks:
        start, end = blocks[-1]
        cut = max(start, end - tail)
        if cut > start:
            blocks[-1:] = [(start, cut), (cut, end)]
    return blocks


def tail_start(num_tokens: int, block_size: int, tail: int) -> int:
    """The first position of the tail that `capture_blocks(..., tail)` cuts (context parallel keeps it too)."""
    return capture_blocks(num_tokens, block_size, tail)[-1][0]


class MLP(nn.Module):
    """SwiGLU: down(silu(gate x) * up x), HF's names. `silu_mul` computes silu(gate) * up (`silu_mul_reference`'s
    contract): qwen36 passes kernels.norm's one launch (longstraw_kernels.norm.silu_mul: a win with its norms, not
    timed apart); glm52 keeps the reference, torch's two kernels, as the launch measured slower in its capture and
    replay (docs/BENCHMARKS.md, variants)."""

    def __init__(self, hidden: int, intermediate: int, silu_mul: Callable = silu_mul_reference):
        super().__init__()
        self.silu_mul = silu_mul
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x):
        return self.swiglu(self.gate_proj(x), self.up_proj(x))

    def swiglu(self, gate, up):
        """The MLP from its gate and up linears' outputs (the decode step computes them as one GEMM)."""
        return self.down_proj(self.silu_mul(gate, up))


@dataclass
class DecodeState:
    """Decode state of a batch of responses: one cache per layer, and how many tokens were fed."""

    layers: list
    step: int = 0


class Decoder:
    """rollout/native.py's decoder interface: `tokens_B` (what the next `step()` feeds), `step()` -> next-token
    logits [B, V], `device`, whether a CUDA graph may replay the step (`graph_safe`) and torch.compile compile it
    (`compile_safe`), and the response slots (models/slots.py): `capacity` of them, `response_chunk` at first (None:
    all max_new_tokens), which `grow()` doubles, at most max_new_tokens, when the rollout's step reaches them."""

    graph_safe = compile_safe = False

    def __init__(self, model, resident: Resident, batch: int, max_new_tokens: int, response_chunk: int | None):
        self.model, self.resident, self.max_new_tokens = model, resident, max_new_tokens
        self.device = model.lm_head.weight.device
        self.tokens_B = torch.full((batch,), resident.last_token, dtype=torch.long, device=self.device)
        self.capacity = response_capacities(max_new_tokens, response_chunk)[0]

    def response_slots(self) -> list[ResponseSlots]:
        """The per-layer buffers that hold the response's tokens (the recurrent states' size does not grow)."""
        raise NotImplementedError

    def grow(self) -> None:
        """Twice the response slots, at most max_new_tokens, the written ones kept (models/slots.py)."""
        self.capacity = grown_capacity(self.capacity, self.max_new_tokens)
        for slots in self.response_slots():
            slots.grow(self.capacity)


class StepDecoder(Decoder):
    """The decoder interface over `start_decode` / `decode_step`: eager, shapes growing with the step, so neither
    graph- nor compile-safe. For hooks that have no static-shaped decode (glm52 under context parallel).
    `page_budget` (the decoders' rollout.native.offload_copy_gib) copies nothing here: decode_step stages offloaded
    pages a layer at a time at every step."""

    def __init__(self, model, resident: Resident, batch: int, max_new_tokens: int, page_budget: int | None = None,
                 response_chunk: int | None = None):
        super().__init__(model, resident, batch, max_new_tokens, response_chunk)
        self.state = model.start_decode(resident, batch, self.capacity)

    def step(self) -> torch.Tensor:
        return self.model.decode_step(self.resident, self.state, self.tokens_B)

    def response_slots(self) -> list[ResponseSlots]:
        return [cache for cache in self.state.layers if isinstance(cache, ResponseSlots)]


class StaticDecoder(Decoder):
    """What every static-shaped decode step (models/<family>/decode.py) shares: the token ids fed and the step
    counter live on the device and change in place, the response slots are fixed between growths, so a CUDA graph
    may replay `step()` (captured again after a growth). A subclass's `step()` starts from `embed()` and ends with
    `logits()`; its `layers` hold each layer's buffers."""

    def __init__(self, model, resident: Resident, batch: int, max_new_tokens: int, response_chunk: int | None):
        super().__init__(model, resident, batch, max_new_tokens, response_chunk)
        self.step_1 = torch.zeros(1, dtype=torch.long, device=self.device)
        # the prompt's length as a tensor, not a Python int: a compiled step would specialise on the int (one graph
        # per prompt length, each a miss in the on-disk compile cache)
        self.start_1 = torch.full((1,), resident.num_tokens, dtype=torch.long, device=self.device)
        self.slots_S = self._slots()

    def _slots(self) -> torch.Tensor:
        # a dynamic size of the compiled step, as the buffers' capacity (models/slots.py `slot_buffer`)
        slots_S = torch.arange(self.capacity, device=self.device)
        torch._dynamo.maybe_mark_dynamic(slots_S, 0)
        return slots_S

    def response_slots(self) -> list[ResponseSlots]:
        return [buffers for buffers in self.layers if isinstance(buffers, ResponseSlots)]

    def compiled(self, **options) -> Callable[[], torch.Tensor]:
        """The step compiled by torch.compile (`options`: its keyword arguments), here as one graph. A decoder whose
        layers repeat may compile a layer function instead (glm52's)."""
        return torch.compile(self.step, **options)

    def grow(self) -> None:
        super().grow()
        self.slots_S = self._slots()

    def embed(self):
        """-> (embedded tokens [B, 1, C], their positions [1])."""
        positions_1 = self.step_1 + self.start_1
        return self.model.model.embed_tokens(self.tokens_B[:, None]), positions_1

    def filled(self) -> torch.Tensor:
        """The filled response slots [S] bool. Formed where a layer reads them: a compiled step with graph breaks
        passes its intermediates to the next piece as inputs of a fixed size, which would pin the capacity there."""
        return self.slots_S < self.num_filled()

    def num_filled(self) -> torch.Tensor:
        """The filled response slots' count [1] (slots 0 .. step), on the device: a kernel that reads only those."""
        return self.step_1 + 1

    def logits(self, x_BTC: torch.Tensor) -> torch.Tensor:
        """Next-token logits [B, V] (fp32 or wider) of the last layer's output; the step counter moves on."""
        self.step_1 += 1
        return at_least_fp32(self.model.lm_head(self.model.model.norm(x_BTC))[:, 0])


class DecoderLayer(nn.Module):
    """Pre-norm residual around a token mixer, then around the MLP. Subclasses set input_layernorm, the mixer,
    post_attention_layernorm and mlp (HF's names)."""

    def mlp_residual(self, x_BTC: torch.Tensor, mixed_BTC: torch.Tensor) -> torch.Tensor:
        x_BTC = x_BTC + mixed_BTC
        return x_BTC + self.mlp(self.post_attention_layernorm(x_BTC))

    def mlp_residual_blocks(self, x_BTC: torch.Tensor, mixed_BTC: torch.Tensor, block_size: int,
                            num_blocks: int | None = None) -> torch.Tensor:
        """The same over a whole span, the MLP in blocks so that [T, FFN] never exists. `num_blocks` (at least
        the span's) lets every rank run the same number of MLP calls when the MLP holds collectives."""
        x_BTC = x_BTC + mixed_BTC
        num_blocks = -(-x_BTC.shape[1] // block_size) if num_blocks is None else num_blocks
        for b in range(num_blocks):
            block = x_BTC[:, b * block_size : (b + 1) * block_size]
            block += self.mlp(self.post_attention_layernorm(block))
        return x_BTC


class Backbone(nn.Module):
    """HF's `model`: embed_tokens, layers, norm (created in that order)."""

    def __init__(self, vocab_size: int, hidden_size: int, layers, norm_cls, eps: float):
        super().__init__()
        self.embed_tokens = Embedding(vocab_size, hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = norm_cls(hidden_size, eps)


def units(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """A model's parts in the order of its modules: embed_tokens, each decoder layer, norm, lm_head (by name).
    A model is materialised, loaded or quantised one part at a time (models.build_model, from_pretrained)."""
    backbone = model.model
    layers = [(f"model.layers.{i}", layer) for i, layer in enumerate(backbone.layers)]
    return [("model.embed_tokens", backbone.embed_tokens), *layers, ("model.norm", backbone.norm),
            ("lm_head", model.lm_head)]


class CausalLM(nn.Module):
    """`model` (a Backbone) and `lm_head`; the reference forward, capture, replay, log-probs and decode walks."""

    def __init__(self, cfg, backbone: Backbone):
        super().__init__()
        self.config = cfg
        self.model = backbone
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # exact mode's reverse walk: where the prompt's pages and block boundaries are (swapped from outside:
        # context parallel splits them over its ranks)
        self.prompt_placement_fn = WholePrompt
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02, root: nn.Module | None = None):
        """HF-style init: normal(0, std) linears and embeddings; the family's rules (`init_module`) for the rest.
        root: only that submodule (a model materialised one unit at a time, models.build_model)."""
        for module in (self if root is None else root).modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                module.weight.normal_(0.0, std)
            else:
                self.init_module(module, std)

    def init_module(self, module: nn.Module, std: float) -> None:
        raise NotImplementedError

    # -- reference path ---------------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, grad_prefix: int = 0) -> torch.Tensor:
        """Logits [B, T, V] of a plain full-sequence forward. grad_prefix=n makes positions < n a constant
        (what response_only replay computes, by an independent route)."""
        ids_BT = input_ids[None] if input_ids.dim() == 1 else input_ids
        positions_T = torch.arange(ids_BT.shape[1], device=ids_BT.device)
        x_BTC, carry = self.model.embed_tokens(ids_BT), None
        for layer in self.model.layers:
            x_BTC, carry = layer(x_BTC, positions_T, carry, grad_prefix=grad_prefix)
        logits = self.lm_head(self.model.norm(x_BTC))
        return logits[0] if input_ids.dim() == 1 else logits

    # -- capture ----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def capture(self, prompt_ids: torch.Tensor, block_size: int = 4096, page_dtype: torch.dtype | None = None,
                offload: str | None = None, boundaries: bool = False, tail: int = 0) -> Resident:
        """Resident state of a 1-D prompt: its first P-1 tokens; the last token is kept for replay.
        Block by block through all layers (activations bounded by one block). offload="cpu": the pages live in host
        memory; per block each layer's earlier pages are staged to the device (the next layer's while this one
        computes) and the block's pages are copied back (`BlockWriter`), so the values are those of an on-device
        capture, bit for bit. Host->device traffic: per layer, sum over blocks of the pages before the block, about
        prompt^2 / (2 block_size) page rows; `capture_span(offload="cpu")` moves each layer's pages once instead
        but holds the whole prompt's hidden states.
        boundaries=True (exact mode): also keep the carried states at each block's start (`Resident.boundaries`).
        tail=n > 0 (capture.reuse_steps > 1): the last block is cut so that its last min(n, its length) tokens are a
        block of their own, and the carried states at that block's start are kept (`Resident.tail`, `tail_start`),
        from which reuse.py's drift probe re-captures it under newer weights."""
        check_prompt(prompt_ids, block_size)
        num_tokens = prompt_ids.numel() - 1
        if offload is not None and boundaries:
            raise ValueError(f"exact gradients (boundaries=True) need the resident state on the device; got "
                             f"offload={offload!r}")
        self.prepare_capture(num_tokens)
        resident = self.empty_resident(num_tokens, page_dtype, offload)
        resident.last_token = int(prompt_ids[-1])
        resident.boundaries = [] if boundaries else None
        for start, end in capture_blocks(num_tokens, block_size, tail):
            if boundaries:
                resident.boundaries.append(snapshot(resident))
            if tail and end == num_tokens:
                resident.tail, resident.tail_start = snapshot(resident), start
            self.capture_prompt_block(prompt_ids, resident, start, end)
        return resident

    def prepare_capture(self, longest: int) -> None:
        """Before a capture whose last queries see `longest` keys (a prompt's captured tokens, or the end of a
        context-parallel span): what a family compiles ahead for its longer blocks (glm52: the DSA selection's
        kernels); nothing by default."""

    @torch.no_grad()
    def capture_prompt_block(self, prompt_ids: torch.Tensor, resident: Resident, start: int, end: int) -> None:
        """Prompt tokens [start, end) through every layer: their pages written, the carried states advanced
        (offloaded pages: `BlockWriter` stages each layer's earlier pages and copies the block's back)."""
        device = self.lm_head.weight.device
        positions_T = torch.arange(start, end, device=device)
        x_BTC, carry = self.model.embed_tokens(prompt_ids[start:end].to(device))[None], None
        states = BlockWriter(resident, device, start, end)
        for i, layer in enumerate(self.model.layers):
            x_BTC, carry = layer.capture_block(x_BTC, positions_T, states.get(i), start, carry)
            states.done(i)
        states.finish()

    @torch.no_grad()
    def capture_span(self, span_ids: torch.Tensor, *, start: int, num_tokens: int, last_token: int,
                     block_size: int = 4096, page_dtype: torch.dtype | None = None,
                     offload: str | None = None) -> Resident:
        """Layer-by-layer capture of prompt tokens [start, start + len(span_ids)) of a prompt whose captured part
        has `num_tokens` tokens: one layer over the whole span at a time; offloaded pages are written on the device,
        then copied to the host while the next layer computes. Context parallel runs it on each rank's span with
        the span hooks swapped; on one device (start 0, the whole prompt) it equals `capture`. Activations are one
        span's hidden states; attention scores and MLP intermediates stay block-sized."""
        if span_ids.dim() != 1 or block_size < 1:
            raise ValueError(f"capture_span takes a 1-D span and block_size >= 1, got shape "
                             f"{tuple(span_ids.shape)}, block_size {block_size}")
        self.prepare_capture(start + span_ids.numel())
        resident = self.empty_resident(span_ids.numel(), page_dtype, offload)
        resident.num_tokens, resident.last_token = num_tokens, last_token
        device = self.lm_head.weight.device
        positions_T = torch.arange(start, start + span_ids.numel(), device=device)
        x_BTC, carry = self.model.embed_tokens(span_ids.to(device))[None], None
        pages = PageWriter(resident, device)
        for i, layer in enumerate(self.model.layers):
            x_BTC, carry = layer.capture_span(x_BTC, positions_T, pages.get(i), block_size, carry)
            pages.done(i)
        pages.finish()
        return resident

    # -- replay / scoring -------------------------------------------------------------------------------------
    def replay_hidden(self, resident: Resident, input_ids_BT: torch.Tensor) -> torch.Tensor:
        """Final-norm hidden states of tokens that follow the captured span, read against the resident state."""
        start = resident.num_tokens
        positions_T = torch.arange(start, start + input_ids_BT.shape[1], device=input_ids_BT.device)
        x_BTC, carry = self.model.embed_tokens(input_ids_BT), None
        with stage_layers(resident, self.lm_head.weight.device, grad=torch.is_grad_enabled()) as stage:
            for i, layer in enumerate(self.model.layers):
                x_BTC, carry = layer.replay(x_BTC, positions_T, stage(i), carry)
        return self.model.norm(x_BTC)

    def logprobs(self, resident: Resident, response_ids: torch.Tensor, grad: bool = False,
                 chunk_size: int = 1024) -> torch.Tensor:
        """log p(r_i | prompt, r_<i) for each response token: [R] for a 1-D response, [B, R] for a batch of
        equal-length responses (right padding is harmless: every position only sees earlier ones).
        grad=True: differentiable w.r.t. the parameters, the resident state being a constant (response_only)."""
        ids_BR = response_ids[None] if response_ids.dim() == 1 else response_ids
        B = ids_BR.shape[0]
        last_B1 = torch.full((B, 1), resident.last_token, dtype=ids_BR.dtype, device=ids_BR.device)
        # replay [p_last, r_0 .. r_{R-2}] predicting r_0 .. r_{R-1}
        inputs_BR = torch.cat([last_B1, ids_BR[:, :-1]], dim=1)
        with torch.set_grad_enabled(grad):
            h_BRC = self.replay_hidden(resident, inputs_BR)
            # [R] for a 1-D response: shaped by token_logprobs itself, not a view of row 0 (FSDP2 warns on views)
            return token_logprobs(h_BRC, self.lm_head.weight, response_ids, chunk_size)

    # -- blockwise response replay (models/blockwise.py) -------------------------------------------------------
    def replay_blocks(self, resident: Resident, response_ids: torch.Tensor, loss_grad, block_size: int,
                      chunk_size: int = 1024, on_state=None) -> torch.Tensor:
        """One response (1-D) replayed in blocks of `block_size` tokens, its loss's gradient added into .grad:
        `loss_grad(logp_R)` -> dL/dlogp_R. The graph alive is one block's. -> logp_R, detached."""
        return blockwise.replay_blocks(self, resident, response_ids, loss_grad, block_size, chunk_size, on_state)

    @torch.no_grad()
    def score_blocks(self, resident: Resident, response_ids: torch.Tensor, block_size: int,
                     chunk_size: int = 1024) -> torch.Tensor:
        """`logprobs(grad=False)` of a batch [B, R] computed a block of `block_size` tokens at a time."""
        return blockwise.score_blocks(self, resident, response_ids, block_size, chunk_size)

    # -- exact mode ---------------------------------------------------------------------------------------------
    def prompt_backward(self, prompt_ids: torch.Tensor, resident: Resident, grad: StateGrad, block_size: int,
                        checkpoint_layers: bool = False) -> None:
        """Exact mode's reverse walk (resident/gradient.py): the parameters' gradient through the prompt, added
        into their .grad. `grad` holds what the replays sent into the resident state; `resident` must have been
        captured with boundaries=True and the same block_size. Consumes `grad` (its page buffers are completed
        block by block, back to front). `prompt_placement_fn` says where pages and boundaries are: under context
        parallel every rank walks every block (see distributed/cp_walk.py).
        checkpoint_layers: each layer's block forward runs again inside the backward (torch.utils.checkpoint), so
        a block's graph is every layer's input plus one layer's graph, for one more forward over the prompt."""
        if resident.boundaries is None:
            raise ValueError("prompt_backward needs a capture with boundaries=True (exact mode)")
        starts = list(range(0, resident.num_tokens, block_size))
        if len(starts) != len(resident.boundaries):
            raise ValueError(f"the capture kept {len(resident.boundaries)} block boundaries; block_size={block_size} "
                             f"gives {len(starts)} blocks of {resident.num_tokens} tokens")
        device = self.lm_head.weight.device
        placement = self.prompt_placement_fn(resident)
        # the carried states' gradient at the end of the block being walked: the replays' to start with
        carried = [grads if state.CARRIED else None for state, grads in zip(resident.layers, grad.layers)]
        for b in reversed(range(len(starts))):
            start, end = starts[b], min(resident.num_tokens, starts[b] + block_size)
            boundary, written_grads = placement.boundary(b, start), placement.block_grads(grad, start, end)
            num_before = placement.num_before(start)
            positions_T = torch.arange(start, end, device=device)
            x_BTC, carry = self.model.embed_tokens(prompt_ids[start:end].to(device))[None], None
            outputs, output_grads, carried_in = [], [], []
            for i, (layer, state) in enumerate(zip(self.model.layers, resident.layers)):
                if state.CARRIED:
                    targets = {name: torch.zeros_like(t) for name, t in carried[i].items()}
                    read, grad_out = leaves(boundary[i], targets), carried[i]
                else:
                    targets = {name: t[:num_before] for name, t in grad.layers[i].items()}
                    read, grad_out = leaves(prefix(state, num_before), targets), written_grads[i]
                carried_in.append(targets if state.CARRIED else None)
                if checkpoint_layers:
                    x_BTC, carry, written = checkpoint(layer.recompute_block, x_BTC, positions_T, read, carry,
                                                       use_reentrant=False)
                else:
                    x_BTC, carry, written = layer.recompute_block(x_BTC, positions_T, read, carry)
                for name, g in grad_out.items():
                    out = getattr(written, name)
                    if out.requires_grad:
                        outputs.append(out)
                        output_grads.append(g.to(out.dtype))
            del x_BTC, carry, written
            if outputs:
                torch.autograd.backward(outputs, output_grads)
            del outputs, output_grads, written_grads, boundary
            carried = carried_in

    # -- native rollout ---------------------------------------------------------------------------------------
    @torch.no_grad()
    def decode_step(self, resident: Resident, decode: DecodeState, tokens_B: torch.Tensor) -> torch.Tensor:
        """Feed one token per sequence (the first is the prompt's last token); next-token logits [B, V]."""
        position = resident.num_tokens + decode.step
        positions_T = torch.arange(position, position + 1, device=tokens_B.device)
        x_BTC, carry = self.model.embed_tokens(tokens_B[:, None]), None
        with stage_layers(resident, self.lm_head.weight.device, grad=False) as stage:
            for i, (layer, cache) in enumerate(zip(self.model.layers, decode.layers)):
                x_BTC, carry = layer.decode_step(x_BTC, positions_T, stage(i), cache, carry)
        decode.step += 1
        return at_least_fp32(self.lm_head(self.model.norm(x_BTC))[:, 0])
