"""What every family's memory plan shares: the validated run settings (`Run`), dtype sizes and the logits terms.

A family's plan hook (FamilySpec.plan, "module:function") takes (model config, Run) and returns its components
and phases in bytes per rank; `longstraw_cli.plan.plan` validates the settings once and adds the peak and the
fit (see that module's docstring)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from longstraw_cli.models.projections import FUSED_SHARE
from longstraw_cli.rollout.native import NativeConfig

GIB = 2**30
DTYPE_NAMES = ("float32", "bfloat16", "float16", "float64")
KERNELS = ("auto", "gpu", "reference")
# bytes per logit element: graph-free (fp32 logits + the exp temporary), and the log-prob backward's chunk
# (the fp32 logits it works on in place, plus the bf16 matmul output before it or the bf16 gradient after it)
LOGIT_BYTES_SCORE = 8
LOGIT_BYTES_REPLAY = 6


def itemsize(dtype: str) -> int:
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"dtype={dtype!r}; valid: {list(DTYPE_NAMES)}")
    return getattr(torch, dtype).itemsize


@dataclass(frozen=True)
class Run:
    """The settings of one planned transaction, checked by `longstraw_cli.plan.plan` (the training config's keys:
    cp, ep, prompt_tokens, group_size, response_tokens, model.dtype, lora.rank, lora.quantize, capture.*,
    rollout.native.offload_copy_gib and .response_chunk; plan's own gpu_mem_gib, host_mem_gib, kernels resolved to
    gpu | reference)."""

    cp: int
    ep: int
    prompt_tokens: int
    group_size: int
    response_tokens: int
    dtype: str
    lora_rank: int
    block_size: int
    score_batch: int
    logprob_chunk: int
    attention_block: int
    moment_dtype: str | None
    kernels: str
    gradient: str
    walk_checkpoint: bool
    reuse: bool
    probe_tokens: int
    quantize: str
    offload: str
    gpu_mem_gib: float
    host_mem_gib: float
    offload_copy_gib: float | str
    # rollout.replay_routing (auto | true | false | measure): routing records held from rollout to replay
    replay_routing: bool | str = "auto"
    # capture.replay_block: response tokens per replay (and scoring) block; 0 replays each response whole
    replay_block: int = 0
    # rollout.native.response_chunk: the decode's first response slots, doubled up to response_tokens
    response_chunk: int = NativeConfig.response_chunk
    # whether the score phase runs a forward: the reference's log-probs (algo.kl_coef > 0) or the old log-probs of
    # a rollout that does not give them (rollout=vllm); else the native rollout's own log-probs serve and the
    # phase holds only what the phase before it left (transaction.py `accumulate`)
    scoring: bool = True
    # whether a decode samples the responses (the rollout phase): not with responses given or drawn without one
    # (rollout=data | synthetic, rollout/given.py)
    decode: bool = True

    @property
    def replays_in_blocks(self) -> bool:
        """Whether the longest response replays in blocks: one within a block is the walk's one block, the whole
        response's graph (models/blockwise.py)."""
        return 0 < self.replay_block < self.response_tokens

    @property
    def response_block(self) -> int:
        """Tokens a replay or scoring graph / activation covers at once: the block, or the whole response."""
        return min(self.replay_block, self.response_tokens) if self.replay_block else self.response_tokens

    @property
    def s(self) -> int:
        """Bytes per element of the model dtype (weights, pages, activations)."""
        return itemsize(self.dtype)

    @property
    def f(self) -> int:
        """Bytes per element of the compute dtype (at least fp32)."""
        return max(self.s, 4)

    @property
    def m(self) -> int:
        """Bytes per element of AdamW's moments (the parameter's dtype unless moment_dtype is set)."""
        return itemsize(self.moment_dtype or self.dtype)

    @property
    def captured(self) -> int:
        """Prompt tokens whose pages one rank keeps: capture keeps prompt_tokens - 1, context parallel's ranks
        split them into contiguous pieces (the first ranks one token more)."""
        return math.ceil((self.prompt_tokens - 1) / self.cp)

    @property
    def budget(self) -> int:
        return int(self.gpu_mem_gib * GIB)


def score_logits_bytes(batch: int, tokens: int, chunk: int, vocab: int, hidden: int, s: int) -> int:
    """The graph-free scoring's logits: token_logprobs chunks the batch's tokens together, so one chunk of fp32
    logits (and the exp temporary) serves the whole batch; beside it the batch's final hidden states."""
    return min(batch * tokens, chunk) * vocab * LOGIT_BYTES_SCORE + batch * tokens * hidden * s


def decode_copies(total: int, run: Run) -> int:
    """Bytes of a decoder's concatenated input linears as it makes them (models/projections.py `one_gemm_each`):
    `total`, or none where they would pass FUSED_SHARE of the GPU's memory."""
    return 0 if total > FUSED_SHARE * run.gpu_mem_gib * GIB else total


def rollout_copies(run: Run, rollout_base: int, layer_pages: list[int]) -> int:
    """offload="cpu": bytes of host pages the rollout copies to the device, whole layers, first layers first (a layer
    that does not fit is passed over), into what the GPU leaves free with 10% spare, at most
    rollout.native.offload_copy_gib: `resident.offload.rollout_pages` with the device's free memory."""
    room = max(run.budget - rollout_base, 0) / 1.1
    if run.offload_copy_gib != "auto":
        room = min(room, run.offload_copy_gib * GIB)
    copies = 0
    for nbytes in layer_pages:
        if nbytes <= room:
            copies, room = copies + nbytes, room - nbytes
    return copies
