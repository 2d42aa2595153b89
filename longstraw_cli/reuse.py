"""One capture, several optimizer cycles (`capture.reuse_steps=K`): the resident state of a prompt serves K
consecutive optimizer steps on that prompt.

    capture (cycle 0) -> [rollout -> drift -> reward -> score, replay x G -> finalize, step] x K

Step s trains on the prompt that step s // K would without reuse (the data advances once per K steps, no prompt
skipped; the logged `epoch` counts prompts served). Each cycle samples its own G responses with the CURRENT
weights from the STALE state (captured under the weights of cycle 0); the rollout's log-probs are the old
log-probs, so the ratio and the clip are against exactly what sampled. Responses without a decode (rollout/given.py)
serve each cycle as they come: rollout=data's group again (K epochs on one capture; old log-probs the file's, or
scored from the stale state), rollout=synthetic's fresh random ones. The replays differentiate the responses
only (`capture.gradient=response_only`); `exact` is refused: its walk would differentiate a prompt state that
older weights computed, a gradient of no policy's objective.

Drift, every cycle (metrics `drift`, `drift_mean`, `reuse_cycle`, `captures`): the max (and mean) |delta log-prob|
over the tokens of the cycle's first `capture.probe_responses` responses (default 2) between two states, both read
with the current weights:
- the stale state as the rollout used it, and
- the same state with its last `capture.probe_tokens` positions (default 1,024) re-captured under the current
  weights, starting from the carried states the capture kept there (`Resident.tail`: a capture for reuse cuts its
  last block so that these positions are a block of their own); their pages and the carried states are put back
  afterwards.
Why this probe: a fresh capture of the whole prompt is the capture reuse avoids, and a fresh capture of a short
suffix alone is another prompt (its log-probs differ from the full prompt's by far more than any drift). The
prompt's end is what the responses read most directly (its pages are the nearest keys, its end is the recurrent
state they start from), and at cycle 0 the probe is exactly 0 (the same weights recompute the same positions), so
cycle 0 skips it. Its cost, per cycle: capture.probe_tokens positions of capture and 2 x probe_responses
graph-free scorings, each against the whole prompt (at 1M tokens on an H200 with qwen36_mini, ~0.2 s per 1,024
tokens scored or re-captured); the first version (the whole last block of 8,192 and all 8 responses) took 4.3 s
a cycle there. The responses are exchangeable samples, so the first ones are as good as any; the max over fewer
tokens can only be lower. What it does not see: staleness of the earlier pages and of the tail's input boundary;
it is a lower estimate of the full drift, exact when the prompt fits in probe_tokens and every response is
probed. `capture.max_drift=x`: when a cycle's drift passes x, the next step re-captures (a warning says so), and
its cycles count from 0 again; the data schedule (s // K) is unchanged.

Checkpoints and resume: the resident state is not saved. A run resumed (or preempted) mid-reuse re-captures the
prompt of its first step under the checkpoint's weights and counts cycles from 0; its steps differ from an
uninterrupted run's only through that fresher state (the random streams are restored as always).

Context (and expert) parallel: each rank holds its shard of the state across the cycles, as it would for one
step. The capture for reuse keeps, on the rank whose shard holds the tail's first position, the carried states
there (the GDN span hooks, as exact mode keeps its block boundaries; the tail starts where one device's would, so
the drift is one device's), and the probe re-computes the tail through the exact walk's block path: every rank
computes it against all ranks' pages before it, each writes the rows of its own shard (`_recompute_tail`).
Not built: vLLM rollout (it samples from current weights on a fresh prompt, so there is nothing to reuse;
refused), prompts_per_step > 1 (refused), and reuse of the KL reference's capture (kl_coef > 0 re-captures every
cycle).
Data parallel ranks each hold their own prompt's state; capture runs inside the step's one gather of whole
weights (fsdp2), so a re-capture on one rank and not another needs no collective.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from dataclasses import dataclass

import torch

from longstraw_cli.resident.gradient import WholePrompt
from longstraw_cli.resident.offload import stage_layers
from longstraw_cli.resident.state import prefix, snapshot

log = logging.getLogger("longstraw")


@dataclass(frozen=True)
class ReuseConfig:
    # capture.reuse_steps: optimizer steps one capture serves (1: capture every step)
    reuse_steps: int = 1
    # capture.max_drift: a cycle's drift above this re-captures at the next step (None: never early)
    max_drift: float | None = None
    # capture.probe_responses / probe_tokens: the drift probe scores the first this many responses of a cycle, with
    # the prompt's last this many positions re-captured
    probe_responses: int = 2
    probe_tokens: int = 1024

    def __post_init__(self):
        for name in ("reuse_steps", "probe_responses", "probe_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.max_drift is not None and not 0 <= self.max_drift < math.inf:
            raise ValueError(f"max_drift must be a finite number >= 0 (null: no early re-capture), got "
                             f"{self.max_drift!r}")

    @property
    def active(self) -> bool:
        return self.reuse_steps > 1


def refusal(cfg: ReuseConfig, *, gradient: str, engine: str, prompts_per_step: int) -> str | None:
    """Why this run cannot reuse captures (one line), or None."""
    if not cfg.active:
        return None
    k = cfg.reuse_steps
    if gradient == "exact":
        return (f"capture.reuse_steps={k} with capture.gradient=exact: the prompt's walk would differentiate "
                f"a state computed under older weights; use capture.gradient=response_only or reuse_steps=1")
    if engine == "vllm":
        return (f"capture.reuse_steps={k} with rollout=vllm: vLLM samples from the current weights on a "
                f"fresh prompt, not from the resident state; use rollout=native or reuse_steps=1")
    if prompts_per_step > 1:
        return (f"capture.reuse_steps={k} holds one prompt's state: needs prompts_per_step=1, got "
                f"prompts_per_step={prompts_per_step}")
    return None


@dataclass
class Drift:
    max: float
    mean: float


@contextlib.contextmanager
@torch.no_grad()
def tail_recaptured(model, prompt_ids: torch.Tensor, resident):
    """`resident` with its tail (positions tail_start.. of its captured prompt) re-captured by the model's current
    weights from the carried states kept there; the tail's pages and the carried states are put back on exit.
    On one device through the capture's own block path (offloaded pages too); under context parallel (the model's
    `prompt_placement_fn` is cp_walk.py's) through the exact walk's (`_recompute_tail`, offloaded pages staged a
    layer at a time)."""
    start = resident.tail_start
    placement = model.prompt_placement_fn(resident)
    one_device = isinstance(placement, WholePrompt)
    if start is None or (one_device and resident.tail is None):
        raise ValueError("the drift probe needs a resident state captured with tail > 0 (capture(..., tail=n))")
    # this device's pages of the tail: its local rows from `before` on
    before = placement.num_before(start)
    pages = [None if state.CARRIED else {f.name: getattr(state, f.name)[before:].clone()
                                          for f in dataclasses.fields(state) if getattr(state, f.name) is not None}
             for state in resident.layers]
    ends = snapshot(resident)
    try:
        if one_device:
            _copy_carried(resident.layers, resident.tail)
            model.capture_prompt_block(prompt_ids, resident, start, resident.num_tokens)
        else:
            _recompute_tail(model, prompt_ids, resident, placement, start)
        yield resident
    finally:
        _copy_carried(resident.layers, ends)
        for state, saved in zip(resident.layers, pages):
            for name, t in (saved or {}).items():
                getattr(state, name)[before:].copy_(t)


def _recompute_tail(model, prompt_ids: torch.Tensor, resident, placement, start: int) -> None:
    """Positions [start, num_tokens) through the exact walk's block path (`recompute_block`, layer by layer): every
    rank computes them against every rank's pages before them (its hooks merge the shards) from the carried states
    at `start` (broadcast by `placement` from the rank that kept them), then keeps the rows its own shard holds and
    the carried states at the end."""
    num_tokens = resident.num_tokens
    before, held = placement.num_before(start), placement.num_before(num_tokens)
    # block rows of this rank's pages [before, held)
    rows = slice(placement.first + before - start, placement.first + held - start)
    boundary = placement.carried_at(start, resident.tail)
    device = model.lm_head.weight.device
    positions_T = torch.arange(start, num_tokens, device=device)
    x_BTC, carry = model.model.embed_tokens(prompt_ids[start:num_tokens].to(device))[None], None
    # offloaded pages (capture.offload=cpu): each layer read from a staged device copy, its rows written back to
    # the host pages
    with stage_layers(resident, device, grad=False) as stage:
        for i, (layer, state, carried) in enumerate(zip(model.model.layers, resident.layers, boundary)):
            read = carried if state.CARRIED else prefix(stage(i), before)
            x_BTC, carry, written = layer.recompute_block(x_BTC, positions_T, read, carry)
            for f in dataclasses.fields(state):
                new, target = getattr(written, f.name), getattr(state, f.name)
                if new is None:
                    continue
                if state.CARRIED:
                    target.copy_(new)
                elif held > before:
                    target[before:held].copy_(new[rows])


def _copy_carried(layers: list, source: list) -> None:
    for state, src in zip(layers, source):
        if src is not None:
            for f in dataclasses.fields(state):
                getattr(state, f.name).copy_(getattr(src, f.name))


class PromptReuse:
    """The resident state of the prompt now being reused, its cycle, and the latest drift."""

    def __init__(self, cfg: ReuseConfig):
        self.cfg = cfg
        self.resident, self.group, self.cycle, self.refresh = None, None, 0, False
        self.drift = Drift(0.0, 0.0)
        # the metrics of the latest cycle
        self.last: dict[str, float] = {}

    def prompt_step(self, step: int) -> int:
        """The step whose prompt (without reuse) step `step` trains on."""
        return step // self.cfg.reuse_steps

    def due(self, step: int) -> bool:
        """Whether step `step` captures: the first of its prompt's steps (or of this process), or a drift past
        max_drift at the step before."""
        return self.resident is None or self.group != step // self.cfg.reuse_steps or self.refresh

    def release(self) -> None:
        """Drops the held state before the next capture: one prompt's state is resident at a time."""
        self.resident = None

    def hold(self, step: int, resident) -> None:
        if self.refresh:
            log.warning("step %d re-captures its prompt: the drift %.3g of the step before passed "
                        "capture.max_drift=%s", step, self.drift.max, self.cfg.max_drift)
        self.resident, self.group, self.cycle, self.refresh = resident, step // self.cfg.reuse_steps, 0, False

    def advance(self, captured: bool) -> None:
        """After a cycle (which `captured` or not): its metrics kept in `last`; the next cycle reads the same
        state, one optimizer step staler."""
        self.last = {"reuse_cycle": self.cycle, "captures": int(captured), "drift": self.drift.max,
                     "drift_mean": self.drift.mean}
        self.cycle += 1

    def measure(self, model, score, prompt_ids: torch.Tensor, responses: list[torch.Tensor]) -> Drift:
        """The cycle's drift (module docstring); `score(resident, responses)` is the transaction's graph-free
        scoring, here called one response at a time: the probe's page copies then add to one response's
        scoring, not to a batch's. Sets the refresh when it passes max_drift. Cycle 0 runs no probe: its state
        was captured by the current weights, so the re-captured block is the same, bit for bit (a test checks it
        on CPU; it was 0 at all four cycle-0 steps of the H200 runs at 1M, where the probe took 4.3-5.9 s)."""
        if self.cycle == 0:
            self.drift, self.refresh = Drift(0.0, 0.0), False
            return self.drift
        probed = responses[:self.cfg.probe_responses]
        stale = [score(self.resident, [r])[0] for r in probed]
        with tail_recaptured(model, prompt_ids, self.resident) as probe:
            fresh = [score(probe, [r])[0] for r in probed]
        delta = torch.cat([(s - f).abs() for s, f in zip(stale, fresh)]).double()
        self.drift = Drift(float(delta.max()), float(delta.mean()))
        self.refresh = self.cfg.max_drift is not None and self.drift.max > self.cfg.max_drift
        return self.drift
