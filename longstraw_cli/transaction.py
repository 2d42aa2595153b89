"""One GRPO (or SFT) transaction for one prompt, model-agnostic:

    capture -> score (old, reference) -> replay x G -> finalize -> step

The prompt is captured once without autograd (`capture`, the one place that captures the policy: the caller
calls it before rollout, or after a rollout that does not need it, and hands the resident state to `run`);
old-policy and reference log-probs are scored graph-free from the resident state (no old ones for a loss without
an importance ratio: algo=sft, rl/losses.py); each response is replayed alone
with autograd and its loss backpropagated at once, so at most one response graph is alive; gradients accumulate
in .grad, are finalized once (the one distributed reduction, a no-op on one rank) and one optimizer step is
taken. A strategy (distributed/strategy.py) owns the replay's forward/backward, the finalization (clipping to
its max_grad_norm included) and the step: `LocalStrategy(model, optimizer, max_grad_norm)` on one rank, `ddp`,
`fsdp2`, `deepspeed`. The phases are timed on the caller's `PhaseClock` (the trainer's, for the whole iteration).

Gradients (`TransactionConfig.gradient`): `response_only` treats the resident state as a constant; `exact` also
sends the replays' gradient back through the prompt (resident/gradient.py): the capture keeps the carried states
at its block boundaries, the replays read the resident state as leaves whose gradients collect in one buffer, and
after the last replay the model walks the prompt in reverse (`prompt_backward`, its own phase "prompt"); the
gradient reduction the strategy does at the last replay then follows the walk instead (`sync_gradients`).

Long responses (`TransactionConfig.replay_block` = n > 0): each response replays in blocks of n tokens
(models/blockwise.py): a graph-free forward in blocks gives its log-probs, the loss (`response_loss`, normalised
over the whole response) is differentiated w.r.t. them alone, and the blocks are walked back with autograd, one
block's graph at a time; scoring runs in blocks too. These backward passes run outside the strategy's replay, so
the strategy reduces once after the step's last response (`sync_gradients`), as after exact mode's walk.

Several prompts may share one optimizer step (`begin`, then `accumulate` once per prompt, then `finish`; `run` is
the one-prompt case): each prompt is still one capture and G replays (and, exact, one walk), its loss is scaled
by 1 / prompts, and the strategy sees the B x G replays as one sequence (no reduction before the last; exact
mode reduces after the last prompt's walk).

Routing replay (`rollout.replay_routing`, models/glm52/routing.py): `routing` is the rollout's record of what each
response token was routed to; scoring (old and reference log-probs) and every replay run inside the family's
routing context for their responses' rows, which forces it (or, `measure`, only counts the flips). Without a record
(a vLLM rollout) the responses' routing is recorded at scoring and the replays force that. The record lives in
host memory; the routing contexts stage to the device only the rows of the call under way (a score batch's, one
response's), so it adds nothing that grows with G to the transaction's peak.

Simplifications: data parallelism across prompts sits above, in the strategy.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from longstraw_cli.distributed.local_strategy import LocalStrategy
from longstraw_cli.resident.gradient import StateGrad, check_gradient_mode
from longstraw_cli.resident.offload import OFFLOAD_NAMES
from longstraw_cli.rl.advantages import get_advantage, min_group_size
from longstraw_cli.rl.losses import GroupShape, LossConfig, get_loss, response_loss, sum_stats, summarize_stats
from longstraw_cli.telemetry.memory import GraphMemory, PhaseClock

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TransactionConfig:
    block_size: int = 4096
    # responses scored together (graph-free) in one batched replay
    score_batch: int = 8
    logprob_chunk: int = 512
    advantage: str = "grpo"
    # response_only: the resident state is a constant; exact: the gradient through the prompt too
    gradient: str = "response_only"
    # exact mode: the walk recomputes each layer's forward inside its backward (a block's graph: one layer's)
    walk_checkpoint: bool = False
    # where capture keeps the pages: none (the compute device) | cpu (pinned host memory, staged a layer at a time)
    offload: str = "none"
    # response tokens per replay block (and per scoring block): 0 replays each response whole, in one graph
    replay_block: int = 0

    def __post_init__(self):
        for name in ("block_size", "score_batch", "logprob_chunk"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if isinstance(self.replay_block, bool) or not isinstance(self.replay_block, int) or self.replay_block < 0:
            raise ValueError(f"replay_block must be an integer >= 0 (0: whole responses), got {self.replay_block!r}")
        get_advantage(self.advantage)
        check_gradient_mode(self.gradient)
        if not isinstance(self.walk_checkpoint, bool):
            raise ValueError(f"walk_checkpoint must be true or false, got {self.walk_checkpoint!r}")
        if self.offload not in OFFLOAD_NAMES:
            raise ValueError(f"offload={self.offload!r}; valid: {list(OFFLOAD_NAMES)}")

    @property
    def exact(self) -> bool:
        return self.gradient == "exact"

    @property
    def placement(self) -> dict:
        """The model's `capture` keywords for `offload`: none with pages on the device (context parallel's capture,
        swapped in from outside, takes the same keyword: each rank's shard in host memory)."""
        return {} if self.offload == "none" else {"offload": self.offload}


@dataclass
class TransactionResult:
    stats: dict[str, float]
    advantages: list[float]
    # the clock's phases: the whole iteration's when the caller passed its clock
    seconds: dict[str, float]
    resident_bytes: dict[str, int]
    # the project's own accounting: peak bytes of autograd-saved storages over all replays (and exact mode's walk;
    # with walk_checkpoint it sees each layer's checkpointed input, not the one layer's graph that
    # torch.utils.checkpoint recomputes inside the backward: the CUDA peak of the "prompt" phase does)
    graph_peak_bytes: int
    # saved storages still alive after the last replay (0 unless a graph leaked)
    graph_live_bytes_after: int
    cuda_peak_bytes: dict[str, int] = field(default_factory=dict)
    # exact mode: the resident state's gradient buffer
    state_grad_bytes: int = 0
    # blockwise replay: the largest response's pages, their gradient and its carried states at block starts
    response_state_bytes: int = 0

    @property
    def accounted_peak_bytes(self) -> int:
        return (self.resident_bytes["total"] + self.state_grad_bytes + self.response_state_bytes
                + self.graph_peak_bytes)


@dataclass
class PromptPart:
    """What one prompt of an optimizer step leaves for `finish`."""

    stats: list[dict[str, float]]
    meter: GraphMemory
    rewards: torch.Tensor
    advantages: list[float]
    resident_bytes: dict[str, int]
    state_grad_bytes: int
    response_state_bytes: int = 0


class Reference:
    """Reference log-probs, graph-free, from the reference policy's own capture of the prompt. `context` puts
    the model into its reference form (with LoRA: the same weights with the adapters disabled)."""

    def __init__(self, model: torch.nn.Module, cfg: TransactionConfig, context: Callable = contextlib.nullcontext):
        self.model, self.cfg, self.context = model, cfg, context

    @torch.no_grad()
    def __call__(self, prompt_ids: torch.Tensor, responses: Sequence[torch.Tensor],
                 routed: Callable | None = None) -> list[torch.Tensor]:
        with self.context():
            resident = self.model.capture(prompt_ids, block_size=self.cfg.block_size, **self.cfg.placement)
            return score(self.model, resident, responses, self.cfg, routed)


@torch.no_grad()
def score(model: torch.nn.Module, resident, responses: Sequence[torch.Tensor],
          cfg: TransactionConfig, routed: Callable | None = None) -> list[torch.Tensor]:
    """Graph-free log-probs of each response, batched with right padding (causal: padding is harmless); with
    `replay_block` a block of the batch's tokens at a time, so activations are bounded by a block, not by R.
    routed(model, rows): the routing context of responses `rows` (routing replay), or None."""
    out = []
    for start in range(0, len(responses), cfg.score_batch):
        batch = responses[start : start + cfg.score_batch]
        padded = torch.nn.utils.rnn.pad_sequence(list(batch), batch_first=True, padding_value=0)
        with _routed(routed, model, slice(start, start + len(batch))):
            if cfg.replay_block:
                logp = model.score_blocks(resident, padded, cfg.replay_block, chunk_size=cfg.logprob_chunk)
            else:
                logp = model.logprobs(resident, padded, grad=False, chunk_size=cfg.logprob_chunk)
        out += [logp[i, : len(r)] for i, r in enumerate(batch)]
    return out


def _routed(routed: Callable | None, model, rows: slice):
    return contextlib.nullcontext() if routed is None else routed(model, rows)


class Transaction:
    """`strategy`: what finalizes gradients and steps (distributed/strategy.py); on one data-parallel rank
    `LocalStrategy(model, optimizer, max_grad_norm)`."""

    def __init__(self, model: torch.nn.Module, strategy: LocalStrategy, loss_cfg: LossConfig,
                 cfg: TransactionConfig = TransactionConfig(), *, reference: Reference | None = None,
                 routing_replay=None):
        if loss_cfg.kl_coef > 0 and reference is None:
            raise ValueError(f"kl_coef={loss_cfg.kl_coef} needs a reference policy (kl_coef=0 skips it)")
        if cfg.exact and not strategy.exact_gradients:
            raise ValueError(f"gradient='exact' needs a strategy that reduces after the prompt's walk; "
                             f"strategy {strategy.name!r} cannot (valid: local, ddp)")
        if cfg.replay_block and not strategy.exact_gradients:
            raise ValueError(f"replay_block={cfg.replay_block} needs a strategy that reduces after the blockwise "
                             f"replays; strategy {strategy.name!r} cannot (valid: local, ddp)")
        self.model, self.strategy, self.loss_cfg, self.cfg = model, strategy, loss_cfg, cfg
        # kl_coef 0 skips the reference entirely: no capture, no scoring
        self.reference = reference if loss_cfg.kl_coef > 0 else None
        # the family's routing replay (rollout.replay_routing), None when off
        self.routing_replay, self._said_recorded_at_scoring = routing_replay, False

    # -- phases -----------------------------------------------------------------------------------------------
    def capture(self, prompt_ids: torch.Tensor, *, tail: int = 0):
        """The policy's resident state of the prompt, graph-free (whole weights: a collective under fsdp2).
        tail=n > 0: its last n tokens captured as a block of their own, with the carried states at that block's
        start (reuse.py's drift probe)."""
        kept = {"boundaries": True} if self.cfg.exact else {}
        if tail:
            kept["tail"] = tail
        with self.strategy.full_weights():
            return self.model.capture(prompt_ids, block_size=self.cfg.block_size, **self.cfg.placement, **kept)

    def score(self, resident, responses: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return score(self.model, resident, responses, self.cfg)

    def score_recording(self, resident, responses: Sequence[torch.Tensor], old_logprobs=None):
        """Routing replay without a record from the rollout (vLLM's, which gives none): the responses scored
        with their routing recorded, which the replays then force. -> (old log-probs: `old_logprobs` where
        given, else these scores; the record)."""
        if not self._said_recorded_at_scoring:
            log.info("rollout.replay_routing: the rollout recorded no routing (vLLM); the responses' routing is "
                     "recorded at scoring from the resident state and forced in the replays")
            self._said_recorded_at_scoring = True
        # in host memory from the start: each score batch records through its own rows on the device
        record = self.routing_replay.new_record(self.model, resident, len(responses), max(map(len, responses)),
                                                host=True)
        scored = score(self.model, resident, responses, self.cfg, functools.partial(self.routing_replay.recording,
                                                                                     record))
        return (scored if old_logprobs is None else old_logprobs), record

    def replay(self, resident, responses, old_logprobs, ref_logprobs, advantages,
               state_grad: StateGrad | None = None, *, first: int = 0, total: int | None = None,
               scale: float = 1.0, routing=None) -> tuple[list[dict], GraphMemory]:
        """One response at a time: forward with autograd, loss (times `scale`), backward, graph freed. These are
        replays first .. first + G - 1 of the step's `total` (default G). With `state_grad` (exact mode) the
        replays read the resident state as leaves whose gradients collect there, and none of them reduces
        gradients across ranks (the prompt's walk comes after them). `routing`: the responses' routing record,
        forced in each replay's forward and backward (routing replay), or None."""
        group = GroupShape.from_lengths([len(r) for r in responses])
        meter = GraphMemory(exclude=[*self.strategy.weights(), *resident.tensors()])
        view = resident if state_grad is None else state_grad.replay_view(resident)
        if self.cfg.replay_block:
            return self.replay_blocks(view, responses, old_logprobs, ref_logprobs, advantages, group, meter, scale,
                                      routing)
        count = (len(responses) if total is None else total) + (state_grad is not None)
        stats = []
        with meter:
            for i, response in enumerate(responses):
                # the strategy's replay context: no gradient reduction before the step's last replay
                with self._routed_replay(routing, i), self.strategy.replay(first + i, count) as logprobs:
                    logp = logprobs(view, response, chunk_size=self.cfg.logprob_chunk)
                    ref = None if ref_logprobs is None else ref_logprobs[i]
                    old = None if old_logprobs is None else old_logprobs[i]
                    loss, s = response_loss(self.loss_cfg, logp, old, advantages[i], group, ref)
                    self.strategy.backward(loss if scale == 1.0 else loss * scale)
                    del logp, loss
                stats.append(s)
        return stats, meter

    def replay_blocks(self, view, responses, old_logprobs, ref_logprobs, advantages, group: GroupShape,
                      meter: GraphMemory, scale: float, routing=None) -> tuple[list[dict], GraphMemory]:
        """`replay` with each response in blocks of `replay_block` tokens (models/blockwise.py): its loss is
        differentiated w.r.t. its graph-free log-probs, then the model walks its blocks back (the last block, the
        walk's first, computed once: a response within one block costs what a whole replay costs). No reduction
        here (`accumulate` syncs after the step's last prompt). The meter holds the largest response's pages, their
        gradient and its carried states at block starts (`GraphMemory.hold`)."""
        stats = []
        with meter:
            for i, response in enumerate(responses):
                ref = None if ref_logprobs is None else ref_logprobs[i]
                old = None if old_logprobs is None else old_logprobs[i]

                def loss_grad(logp_R: torch.Tensor, i=i, ref=ref, old=old) -> torch.Tensor:
                    leaf = logp_R.detach().requires_grad_()
                    loss, s = response_loss(self.loss_cfg, leaf, old, advantages[i], group, ref)
                    (loss if scale == 1.0 else loss * scale).backward()
                    stats.append(s)
                    return leaf.grad

                # routing replay: the record's row i forced in the graph-free pass and in every block's recompute
                with self._routed_replay(routing, i):
                    self.model.replay_blocks(view, response, loss_grad, self.cfg.replay_block,
                                             chunk_size=self.cfg.logprob_chunk,
                                             on_state=lambda state: meter.hold(state.nbytes()))
        return stats, meter

    def _routed_replay(self, routing, i: int):
        """The routing context of response i's replay: its record forced (routing replay), or nothing."""
        if routing is None:
            return contextlib.nullcontext()
        return self.routing_replay.replaying(routing, self.model, slice(i, i + 1))

    def finalize(self) -> float:
        """The one reduction per optimizer step (where the last backward has not done it) and clipping; returns
        the global gradient norm before clipping."""
        return self.strategy.finalize()

    def step(self) -> None:
        self.strategy.step()

    # -- the transaction ---------------------------------------------------------------------------------------
    def run(self, prompt_ids: torch.Tensor, responses: Sequence[torch.Tensor], rewards: torch.Tensor, resident, *,
            old_logprobs: Sequence[torch.Tensor] | None = None, clock: PhaseClock | None = None,
            routing=None) -> TransactionResult:
        """score -> replay x G -> finalize -> step for `responses` to the prompt whose capture is `resident`.
        `old_logprobs` may come from the rollout that sampled the responses from the same state (else scored
        here), and so may `routing` (its routing record); `clock` is the caller's (the iteration's), a fresh one
        if None."""
        clock = PhaseClock(prompt_ids.device) if clock is None else clock
        self.begin()
        part = self.accumulate(prompt_ids, responses, rewards, resident, old_logprobs=old_logprobs, clock=clock,
                               routing=routing)
        return self.finish([part], clock)

    def begin(self) -> None:
        """Before the first prompt of an optimizer step."""
        self.strategy.zero_grad()

    def accumulate(self, prompt_ids: torch.Tensor, responses: Sequence[torch.Tensor], rewards: torch.Tensor,
                   resident, *, old_logprobs: Sequence[torch.Tensor] | None = None, clock: PhaseClock,
                   prompt: int = 0, num_prompts: int = 1, routing=None) -> PromptPart:
        """score -> replay x G (-> the prompt's walk, exact) for prompt `prompt` of the step's `num_prompts`:
        gradients accumulate in .grad. `routing`: the rollout's routing record (routing replay on), or None."""
        least = min_group_size(self.cfg.advantage)
        if len(responses) < least:
            raise ValueError(f"advantage {self.cfg.advantage!r} needs groups of >= {least} responses, got "
                             f"{len(responses)}")
        if any(len(r) == 0 for r in responses):
            raise ValueError("every response needs at least one token")
        with clock.phase("score"), self.strategy.full_weights():
            # a loss without an importance ratio (sft) scores no old log-probs, and its replays route on their own
            if not get_loss(self.loss_cfg.name).needs_old:
                old_logprobs = None
            elif self.routing_replay is not None and routing is None:
                old_logprobs, routing = self.score_recording(resident, responses, old_logprobs)
            elif old_logprobs is None:
                old_logprobs = self.score(resident, responses)
            routed = None if routing is None else functools.partial(self.routing_replay.scoring, routing)
            ref_logprobs = None if self.reference is None else self.reference(prompt_ids, responses, routed)
        advantages = get_advantage(self.cfg.advantage)(rewards.double()).tolist()
        state_grad = StateGrad(resident) if self.cfg.exact else None
        state_grad_bytes = 0 if state_grad is None else state_grad.nbytes()
        g = len(responses)
        with clock.phase("replay"):
            per_response, meter = self.replay(resident, responses, old_logprobs, ref_logprobs, advantages,
                                              state_grad, first=prompt * g, total=num_prompts * g,
                                              scale=1.0 / num_prompts, routing=routing)
        if state_grad is not None:
            with clock.phase("prompt"), meter:
                self.model.prompt_backward(prompt_ids, resident, state_grad, self.cfg.block_size,
                                           self.cfg.walk_checkpoint)
                del state_grad
                if prompt == num_prompts - 1:
                    self.strategy.sync_gradients()
        elif self.cfg.replay_block and prompt == num_prompts - 1:
            with clock.phase("replay"):
                self.strategy.sync_gradients()
        return PromptPart(per_response, meter, rewards, advantages, resident.nbytes(), state_grad_bytes,
                          meter.held_peak_bytes)

    def finish(self, parts: Sequence[PromptPart], clock: PhaseClock) -> TransactionResult:
        """finalize -> step after the step's last prompt; stats over every prompt (losses: the mean group loss)."""
        with clock.phase("finalize"):
            grad_norm = self.finalize()
        with clock.phase("step"):
            self.step()
        stats = summarize_stats(sum_stats(s for part in parts for s in part.stats))
        for key in ("loss", "pg_loss", "kl_loss"):
            if key in stats and len(parts) > 1:
                stats[key] /= len(parts)
        rewards = torch.cat([part.rewards for part in parts])
        # one response a step (algo=sft, group_size=1) has no spread: 0, not torch's nan and its warning
        stats.update(grad_norm=grad_norm, reward_mean=float(rewards.float().mean()),
                     reward_std=float(rewards.float().std()) if rewards.numel() > 1 else 0.0)
        if self.routing_replay is not None:
            stats.update(self.routing_replay.metrics())
        # one prompt's state is alive at a time: the peak is the largest prompt's
        largest = max(parts, key=lambda part: part.resident_bytes["total"])
        return TransactionResult(
            stats=stats, advantages=[a for part in parts for a in part.advantages], seconds=clock.seconds,
            resident_bytes=largest.resident_bytes, graph_peak_bytes=max(part.meter.peak_bytes for part in parts),
            graph_live_bytes_after=sum(part.meter.live_bytes for part in parts),
            cuda_peak_bytes=clock.cuda_peak_bytes, state_grad_bytes=max(part.state_grad_bytes for part in parts),
            response_state_bytes=max(part.response_state_bytes for part in parts),
        )
