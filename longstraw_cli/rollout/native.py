"""Native rollout: G responses sampled from the same resident state that the transaction trains on.

All G responses decode as one batch over the shared prompt pages (never copied); each response gets its own copy
of the small recurrent state and its own response keys. The model's `decoder(resident, G, max_new_tokens)` gives a
static-shaped step (allocated buffers, device-side token ids and step counter), which this loop replays as a
CUDA graph on GPU: one launch per token instead of one per kernel. The response keys' buffers start at
`response_chunk` slots and double when the loop's step reaches them (models/slots.py: a response that stops early
neither holds nor reads max_new_tokens slots); the graph is captured again after each growth. The log-probs of
the sampled tokens under the policy (temperature 1, no top-p) come out of the same forward, graph-free: they are
the on-policy old log-probs.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from longstraw_cli.models.slots import response_capacities
from longstraw_cli.resident.offload import side_stream
from longstraw_kernels.sampling import race_sample

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 is greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclass
class Rollout:
    responses: list[torch.Tensor]
    # log p of each sampled token under the policy (temperature 1), graph-free: the on-policy old log-probs; None:
    # the transaction scores them from the resident state (vLLM's responses, responses without a decode: given.py)
    logprobs: list[torch.Tensor] | None
    # entropy of the policy's next-token distribution at each sampled position (None where unknown)
    entropies: list[torch.Tensor] | None = None
    # decode steps run (the longest response, or up to stop_check_every - 1 more)
    decode_steps: int = 0
    # seconds from the decoder's construction to the first step's logits on the device (its buffers, the first
    # step's warm-up run and its CUDA-graph capture): what a rollout pays before its steady steps
    setup_s: float = 0.0
    # routing replay (rollout.replay_routing): what each response token was routed to, recorded by the decode
    # step, in host memory (the family's record, opaque here: models/glm52/routing.py); None where not recorded
    routing: object | None = None
    # the responses' rewards where they come with them (rollout=data's reward column, rollout=synthetic's); None: the
    # task's reward gives them
    rewards: list[float] | None = None


@dataclass(frozen=True)
class NativeConfig:
    """How the native engine runs its decode (not what it samples: that is SamplingConfig)."""

    # replay the static decode step as a CUDA graph on CUDA devices (eager elsewhere, or when capture fails)
    cuda_graph: bool = True
    # look at "have all responses stopped?" every this many tokens: a host synchronisation each time
    stop_check_every: int = 16
    # with cuda_graph: torch.compile the step first (fuses its ~2,000 small kernels; the first rollout of a fresh
    # machine pays the compile, ~20 s on an H200, a later launch loads it from the compile cache)
    compile: bool = True
    # lora.quantize=nf4 only (the trainer sizes it): from the second step on, the rollout decodes from dequantised
    # copies of as many NF4 linears as fit under the highest step peak seen so far (no dequantisation per token
    # for them; the same numbers; the step's peak unchanged); freed when the rollout ends. auto: on exactly when
    # lora.quantize=nf4; true: on (refused without nf4); false: off
    nf4_cache: bool | Literal["auto"] = "auto"
    # capture.offload=cpu only: GiB of the offloaded pages the rollout may copy to the device (whole layers, first
    # layers first) for its duration. auto: as many as the device's free memory holds with 10% to spare (decode as
    # fast as on-device; the rollout's peak rises by the copies); a number caps the copies (0: every paged layer
    # stays in host memory and is read from there at every decode step; the rollout stays under the offload bound)
    offload_copy_gib: float | Literal["auto"] = "auto"
    # response slots the decode starts with, doubled (at most max_new_tokens) each time the response reaches them
    # (models/slots.py). 1,024: a response up to that length never grows (one graph capture, as with all slots
    # preallocated); on CUDA qwen36's step reads only the filled slots, elsewhere it reads and masks all of them
    response_chunk: int = 1024

    def __post_init__(self):
        for name, least in (("stop_check_every", 1), ("response_chunk", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
        for name in ("cuda_graph", "compile"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if not (isinstance(self.nf4_cache, bool) or self.nf4_cache == "auto"):
            raise ValueError(f"nf4_cache must be true, false or auto, got {self.nf4_cache!r}")
        copy = self.offload_copy_gib
        if copy != "auto" and (isinstance(copy, bool) or not isinstance(copy, (int, float)) or not copy >= 0):
            raise ValueError(f"offload_copy_gib must be auto or a number of GiB >= 0, got {copy!r}")

    def page_budget(self) -> int | None:
        """Bytes of offloaded pages a rollout may copy to the device; None: as many as its free memory holds."""
        return None if self.offload_copy_gib == "auto" else int(self.offload_copy_gib * 2**30)

    def caches_nf4(self, quantize: str) -> bool:
        """Whether rollouts hold dequantised copies of NF4 linears, for this `lora.quantize`."""
        return self.nf4_cache is True or (self.nf4_cache == "auto" and quantize == "nf4")


class GraphedStep:
    """`decoder.step()` (compiled when asked: `decoder.compiled()`) replayed as a CUDA graph. The first call runs on a
    side stream (compilation, cuBLAS handles, Triton kernels, lazy allocations) and IS the first step; the graph
    is captured right after (capture records, it does not run), and every later call replays it. After the
    decoder's buffers grow the graph (which reads the old ones) is dropped and the next call does the same again:
    one capture per capacity; the capacity is a dynamic size of the compiled step, so no compilation after the
    first. Falls back to eager if capture fails."""

    def __init__(self, decoder, compile: bool = False, compile_mode: str | None = None):
        self.decoder, self.graph, self.logits_BV, self.eager = decoder, None, None, False
        # the decoder's capacity the graph was captured at
        self.capacity = decoder.capacity
        # compile_mode: torch.compile's mode (None, its default, is the trainer's; benchmarks try others)
        self.step = decoder.compiled(mode=compile_mode) if compile else decoder.step

    def __call__(self) -> torch.Tensor:
        if self.eager:
            return self.step()
        if self.graph is not None and self.capacity != self.decoder.capacity:
            self.graph = self.logits_BV = None
        if self.graph is not None:
            self.graph.replay()
            return self.logits_BV
        # one warm-up stream per device for every rollout (a new one each time held a cuBLAS workspace more)
        side = side_stream(self.decoder.device, "decode warm-up")
        side.wait_stream(torch.cuda.current_stream(self.decoder.device))
        with torch.cuda.stream(side):
            logits_BV = self.step()
        torch.cuda.current_stream(self.decoder.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                self.logits_BV = self.step()
        except RuntimeError as exc:
            log.warning("decode step could not be captured as a CUDA graph (%s); decoding eagerly",
                        str(exc).splitlines()[0][:200])
            self.eager = True
            return logits_BV
        self.graph, self.capacity = graph, self.decoder.capacity
        return logits_BV


@torch.no_grad()
def generate(model, resident, num_responses: int, cfg: SamplingConfig, generator: torch.Generator | None = None,
             native: NativeConfig = NativeConfig(), routing=None,
             on_token: Callable[[int, int], None] | None = None) -> Rollout:
    """Sample `num_responses` continuations of the captured prompt; each ends at its first stop token
    (included, it is a trained token) or at max_new_tokens. No host synchronisation per token: sampled tokens
    go straight back into the decoder's input buffer; stops are looked at every `stop_check_every` tokens.
    on_token(done, max_new_tokens): told after each decode step is launched (progress; host ints only).
    routing: a routing replay (models/glm52/routing.py `RoutingReplay`): the decode steps record each token's
    routing into device buffers (grown with the decoder's), moved to host memory as the decode ends
    (`Rollout.routing`)."""
    record, on_grow = None, None
    if routing is not None:
        first = response_capacities(cfg.max_new_tokens, native.response_chunk)[0]
        record = routing.new_record(model, resident, num_responses, first)
        on_grow = record.grow
    recording = contextlib.nullcontext() if record is None else routing.recording(record, model)
    with recording:
        rollout = _generate(model, resident, num_responses, cfg, generator, native, on_grow, on_token)
    rollout.routing = None if record is None else routing.offload(record, rollout.decode_steps)
    return rollout


def _first_step(model, resident, num_responses: int, cfg: SamplingConfig, native: NativeConfig):
    """The decoder, its step function (a CUDA graph, compiled first, where the decoder allows) and the first step's
    logits. Where the compiled step fails on its first call (the compiler, or what it built), said once with the
    error, the decode starts again uncompiled from a fresh decoder (a failure part-way may have written some
    layers' state), built only after the failed one is let go (its response buffers, state copies and page
    copies would otherwise be held twice); an uncompiled step's own errors raise."""
    def build():
        return model.decoder(resident, num_responses, cfg.max_new_tokens, page_budget=native.page_budget(),
                             response_chunk=native.response_chunk)

    decoder = build()
    use_graph = native.cuda_graph and decoder.device.type == "cuda" and decoder.graph_safe
    compile = use_graph and native.compile and decoder.compile_safe
    step_fn = GraphedStep(decoder, compile) if use_graph else decoder.step
    try:
        return decoder, step_fn, step_fn()
    except Exception as exc:  # noqa: BLE001 - any failure of the compiled step: the same step uncompiled
        if not compile:
            raise
        _say_uncompiled(exc)
    # nothing here holds the failed decoder now (the exception, whose traceback reaches it, is gone)
    del decoder, step_fn
    decoder = build()
    step_fn = GraphedStep(decoder, compile=False)
    return decoder, step_fn, step_fn()


def _say_uncompiled(exc: Exception) -> None:
    inner = getattr(exc, "inner_exception", None) or exc
    log.warning("decode step could not be compiled (%s: %s); decoding uncompiled", type(inner).__name__,
                (str(inner).splitlines() or [""])[0][:200])


def stops(tokens: torch.Tensor, stop_S: torch.Tensor) -> torch.Tensor:
    """Which tokens are stop tokens, as one comparison against all of them: torch.isin may sort instead (for more
    than a few test elements), through a unique() that synchronises the host on CUDA, which a graph cannot hold."""
    return (tokens[..., None] == stop_S).any(-1)


def _generate(model, resident, num_responses: int, cfg: SamplingConfig, generator: torch.Generator | None,
              native: NativeConfig, on_grow: Callable[[int], None] | None = None,
              on_token: Callable[[int, int], None] | None = None) -> Rollout:
    """The decode loop. on_grow(capacity): called after each growth of the decoder's response slots (what else the
    decode writes per slot: the routing record)."""
    start = time.perf_counter()
    decoder, step_fn, first_BV = _first_step(model, resident, num_responses, cfg, native)
    device = decoder.device
    B, R = num_responses, cfg.max_new_tokens
    sampled_BR = torch.empty(B, R, dtype=torch.long, device=device)
    logp_BR = torch.empty(B, R, dtype=torch.promote_types(model.lm_head.weight.dtype, torch.float32), device=device)
    entropy_BR = torch.empty_like(logp_BR)
    stop_S = torch.tensor(cfg.stop_token_ids, dtype=torch.long, device=device)
    # the race's noise, drawn afresh each step into one buffer (none for greedy)
    race_BV = None if cfg.temperature == 0 else torch.empty_like(first_BV)
    done_B = torch.zeros(B, dtype=torch.bool, device=device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    setup_s = time.perf_counter() - start
    steps = R
    for step in range(R):
        # step `step` writes slot `step`: the slots grow first where it has none (a host-side int, no sync)
        if step == decoder.capacity:
            decoder.grow()
            if on_grow is not None:
                on_grow(decoder.capacity)
        logits_BV = first_BV if step == 0 else step_fn()
        tokens_B = sampled_BR[:, step]
        if race_BV is not None:
            race_BV.exponential_(1.0, generator=generator)
        race_sample(logits_BV, race_BV, cfg.temperature, cfg.top_p, tokens_B, logp_BR[:, step], entropy_BR[:, step])
        decoder.tokens_B.copy_(tokens_B)
        done_B |= stops(tokens_B, stop_S)
        if on_token is not None:
            on_token(step + 1, R)
        # "all stopped?" every stop_check_every steps: a host synchronisation
        if (step + 1) % native.stop_check_every == 0 and bool(done_B.all()):
            steps = step + 1
            break
    # each response ends at its first stop token, or at the last step decoded
    stops_BR = stops(sampled_BR[:, :steps], stop_S)
    first_B = stops_BR.int().argmax(-1) + 1
    lengths = torch.where(stops_BR.any(-1), first_B, steps).tolist()

    def split(x_BR: torch.Tensor) -> list[torch.Tensor]:
        return [x_BR[i, :n] for i, n in enumerate(lengths)]

    return Rollout(split(sampled_BR), split(logp_BR), split(entropy_BR), decode_steps=steps, setup_s=setup_s)
