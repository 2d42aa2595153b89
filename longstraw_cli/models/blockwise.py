"""Blockwise response replay (`capture.replay_block`): a response's autograd graph bounded by a block of it.

The whole-response replay (`CausalLM.logprobs(grad=True)`) builds one graph over all R response tokens: its
activation memory grows with R (the 27B qwen36 shape saves ~25 MiB a response token). Here the response is cut
into blocks of `block_size` tokens and treated as exact mode's reverse walk treats the prompt
(resident/gradient.py):

1. Forward without autograd, block by block (`response_forward`): each layer's `replay_block` reads the prompt's
   resident state and what the response's earlier blocks left, the response's own keys (attention K/V; MLA latent,
   rope and indexer keys: small per token, kept whole as the response's pages) or, for carried layers, the state at
   the block's start (GDN conv + recurrent state, kept at every block boundary). The walk's forward stops before
   the last block, which the walk computes first, with autograd: this gives every token's log-prob.
2. The caller's loss is differentiated w.r.t. those log-probs alone (`loss_grad`: a leaf, one backward of the
   loss, no model graph): any per-response loss, normalised over the whole response (GSPO's sequence ratio
   included), gives dL/dlogp per token exactly.
3. The blocks are walked in reverse (`replay_blocks`): block k is recomputed with autograd from leaves (the
   response's pages before it, the carried states at its start), and backpropagated with dL/dlogp of its tokens
   plus the gradient that later blocks sent into its own pages and its end state; what it sends into earlier pages
   and into its start state is kept for the blocks before it. The first block starts from the prompt's state as
   the replay reads it: constants (response_only), or exact mode's leaves draining into the state's gradient.

The same forward, for B responses at once and keeping nothing, is graph-free scoring in bounded memory
(`score_blocks`). Compute: one more forward of all blocks but the last than a whole-response replay (with n blocks,
(n - 1) / n of a forward: at most about 4/3 of the whole replay's FLOPs, 7/6 with two blocks); memory: one
block's graph, plus the response's pages (and, while walking, their gradient) and one carried state per block.
The log-probs the walk recomputes are the forward's, bit for bit (the same functions of the same values), so the
gradient is that of the whole-response replay up to the order of floating-point sums.

Legend: B responses, R response tokens, T tokens of a block, S response tokens before it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from longstraw_cli.models.logprobs import token_logprobs
from longstraw_cli.resident import Resident
from longstraw_cli.resident.gradient import leaves
from longstraw_cli.resident.offload import stage_layers
from longstraw_kernels import compute_dtype


def response_blocks(num_tokens: int, block_size: int) -> list[tuple[int, int]]:
    """[start, end) of a response's replay blocks."""
    if block_size < 1:
        raise ValueError(f"replay block size must be >= 1, got {block_size}")
    return [(s, min(num_tokens, s + block_size)) for s in range(0, num_tokens, block_size)]


def replay_inputs(resident: Resident, response_ids_BR: torch.Tensor) -> torch.Tensor:
    """[p_last, r_0 .. r_{R-2}]: what the replay feeds to predict r_0 .. r_{R-1}."""
    B = response_ids_BR.shape[0]
    last_B1 = torch.full((B, 1), resident.last_token, dtype=response_ids_BR.dtype, device=response_ids_BR.device)
    return torch.cat([last_B1, response_ids_BR[:, :-1]], dim=1)


def batched(state, batch: int):
    """A carried layer state of the prompt ([...] per field) as a batch of `batch` equal states (views)."""
    fields = {f.name: getattr(state, f.name) for f in dataclasses.fields(state)}
    return dataclasses.replace(state, **{name: t[None].expand(batch, *t.shape) for name, t in fields.items()})


def head(state, num: int):
    """A response's paged state (fields [B, R, ...] or None): its first `num` positions, views."""
    return dataclasses.replace(state, **{f.name: None if getattr(state, f.name) is None
                                         else getattr(state, f.name)[:, :num] for f in dataclasses.fields(state)})


@dataclasses.dataclass
class ResponseState:
    """What the forward leaves for the walk: per layer the response's pages ([B, R, ...] buffers; None for carried
    layers) and, per block, the carried states at its start (None entries for paged layers)."""

    pages: list
    boundaries: list[list]

    def tensors(self) -> list[torch.Tensor]:
        """The pages and the carried states kept at blocks 1.. (block 0 starts from the prompt's own state)."""
        out = [getattr(p, f.name) for p in self.pages if p is not None for f in dataclasses.fields(p)]
        out = [t for t in out if t is not None]
        return out + [getattr(s, f.name) for block in self.boundaries[1:] for s in block if s is not None
                      for f in dataclasses.fields(s)]

    def nbytes(self) -> int:
        """What the walk holds beside its graph: these tensors and the pages' gradient (in the compute dtype)."""
        grads = sum(getattr(p, n).numel() * compute_dtype(getattr(p, n)).itemsize
                    for p in self.pages if p is not None for n in p.GRAD_FIELDS)
        return sum(t.numel() * t.element_size() for t in self.tensors()) + grads


@torch.no_grad()
def response_forward(model, resident: Resident, response_ids_BR: torch.Tensor, block_size: int,
                     chunk_size: int = 1024, keep: bool = False,
                     skip_last: bool = False) -> tuple[torch.Tensor | None, ResponseState | None]:
    """Log-probs [B, R] of responses to the resident prompt, graph-free, one block at a time through every layer.
    keep=True: also the response's pages and the carried states at each block's start (`ResponseState`).
    skip_last=True (the walk's: it computes the last block with autograd first): the last block is not run; its
    log-probs are left unset (None when it is the only block) and its pages unwritten; its start state is kept."""
    device = model.lm_head.weight.device
    B, R = response_ids_BR.shape
    inputs_BR = replay_inputs(resident, response_ids_BR)
    pages = [None] * len(model.model.layers)
    carried = [batched(state, B) if state.CARRIED else None for state in resident.layers]
    boundaries = []
    logp_BR = None
    blocks = response_blocks(R, block_size)
    for start, end in blocks[: len(blocks) - 1] if skip_last else blocks:
        if keep:
            # the carried states are replaced block by block, never written: references suffice
            boundaries.append(list(carried))
        positions_T = torch.arange(resident.num_tokens + start, resident.num_tokens + end, device=device)
        x_BTC, carry = model.model.embed_tokens(inputs_BR[:, start:end]), None
        with stage_layers(resident, device, grad=False) as stage:
            for i, layer in enumerate(model.model.layers):
                before = carried[i] if resident.layers[i].CARRIED else (None if start == 0 else head(pages[i], start))
                x_BTC, carry, written = layer.replay_block(x_BTC, positions_T, stage(i), before, carry)
                if written.CARRIED:
                    carried[i] = written
                else:
                    pages[i] = _write(pages[i], written, start, R)
        logp_BT = token_logprobs(model.model.norm(x_BTC), model.lm_head.weight, response_ids_BR[:, start:end],
                                 chunk_size)
        if logp_BR is None:
            logp_BR = logp_BT.new_empty((B, R))
        logp_BR[:, start:end] = logp_BT
        del x_BTC, carry
    if keep and skip_last:
        boundaries.append(list(carried))
    return logp_BR, (ResponseState(pages, boundaries) if keep else None)


def _write(buffer, written, start: int, num_tokens: int):
    """The block's pages `written` ([B, T, ...] per field) into the response's buffers (made at the first block)."""
    if buffer is None:
        buffer = dataclasses.replace(written, **{
            f.name: None if getattr(written, f.name) is None
            else getattr(written, f.name).new_empty((getattr(written, f.name).shape[0], num_tokens,
                                                     *getattr(written, f.name).shape[2:]))
            for f in dataclasses.fields(written)})
    for f in dataclasses.fields(written):
        block = getattr(written, f.name)
        if block is not None:
            getattr(buffer, f.name)[:, start : start + block.shape[1]].copy_(block)
    return buffer


def score_blocks(model, resident: Resident, response_ids_BR: torch.Tensor, block_size: int,
                 chunk_size: int = 1024) -> torch.Tensor:
    """Graph-free log-probs [B, R] with activations bounded by one block of B responses (scoring)."""
    return response_forward(model, resident, response_ids_BR, block_size, chunk_size)[0]


def replay_blocks(model, resident: Resident, response_ids: torch.Tensor,
                  loss_grad: Callable[[torch.Tensor], torch.Tensor], block_size: int, chunk_size: int = 1024,
                  on_state: Callable[[ResponseState], None] | None = None) -> torch.Tensor:
    """Blockwise replay of one response (1-D ids): the parameters' gradient of the caller's loss added into their
    .grad (and, where `resident` is exact mode's view, the prompt state's gradient into its buffer).
    `loss_grad(logp_R)` -> dL/dlogp_R (the loss of the log-probs, which carry no graph). `on_state` is told the
    forward's ResponseState (memory accounting). -> logp_R, detached."""
    device = model.lm_head.weight.device
    ids_BR = response_ids[None]
    R = ids_BR.shape[1]
    # the last block is the walk's first: computed once, with autograd, it completes the log-probs
    logp_BR, state = response_forward(model, resident, ids_BR, block_size, chunk_size, keep=True, skip_last=True)
    if on_state is not None:
        on_state(state)
    dlogp_BR = None
    inputs_BR = replay_inputs(resident, ids_BR)
    layers = model.model.layers
    # the gradient of the loss w.r.t. the response's pages, completed back to front (what later blocks send)
    page_grads = [None if p is None else {n: torch.zeros_like(getattr(p, n), dtype=compute_dtype(getattr(p, n)))
                                          for n in p.GRAD_FIELDS} for p in state.pages]
    # per carried layer, the gradient w.r.t. the state at the end of the block being walked (none after the last)
    carried_grads = [None] * len(layers)
    blocks = response_blocks(R, block_size)
    for k in reversed(range(len(blocks))):
        start, end = blocks[k]
        positions_T = torch.arange(resident.num_tokens + start, resident.num_tokens + end, device=device)
        x_BTC, carry = model.model.embed_tokens(inputs_BR[:, start:end]), None
        outputs, output_grads, carried_in = [], [], [None] * len(layers)
        with stage_layers(resident, device, grad=True) as stage:
            for i, layer in enumerate(layers):
                if resident.layers[i].CARRIED:
                    if k == 0:
                        # the prompt's state as the replay reads it (exact mode: leaves draining into its gradient)
                        before = batched(resident.layers[i], 1)
                    else:
                        begin = state.boundaries[k][i]
                        carried_in[i] = {name: torch.zeros_like(getattr(begin, name)) for name in begin.GRAD_FIELDS}
                        before = leaves(begin, carried_in[i])
                    grad_out = carried_grads[i]
                else:
                    before = None if start == 0 else leaves(head(state.pages[i], start),
                                                            {n: g[:, :start] for n, g in page_grads[i].items()})
                    # a response of one block has no pages before the walk (its only block is computed here)
                    grad_out = None if page_grads[i] is None else {n: g[:, start:end] for n, g in page_grads[i].items()}
                x_BTC, carry, written = layer.replay_block(x_BTC, positions_T, stage(i), before, carry)
                for name, g in (grad_out or {}).items():
                    out = getattr(written, name)
                    if out.requires_grad:
                        outputs.append(out)
                        output_grads.append(g.to(out.dtype))
            logp_BT = token_logprobs(model.model.norm(x_BTC), model.lm_head.weight, ids_BR[:, start:end], chunk_size)
        if dlogp_BR is None:
            logp_BR = logp_BT.new_empty((1, R)) if logp_BR is None else logp_BR
            logp_BR[:, start:end] = logp_BT.detach()
            dlogp_BR = loss_grad(logp_BR[0]).reshape(1, R)
        outputs.append(logp_BT)
        output_grads.append(dlogp_BR[:, start:end].to(logp_BT.dtype))
        del x_BTC, carry, written, logp_BT
        torch.autograd.backward(outputs, output_grads)
        del outputs, output_grads, before
        carried_grads = carried_in
    return logp_BR[0]
