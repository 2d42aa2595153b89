"""The trainer: one iteration per optimizer step, read like the algorithm.

    (example -> capture -> rollout -> reward -> score, replay x G) x prompts_per_step -> finalize, step
    -> validate every val_every steps -> log, checkpoint

The prompt is captured once per iteration (by the transaction's `capture`) and that one resident state serves
rollout, scoring and replay. With vLLM the rollout runs first, in vLLM (weights pushed first), and the capture
follows the reward; so it does with responses that need no decode (rollout=data | synthetic: rollout/given.py).
One `PhaseClock` per iteration times every phase (and its CUDA peak memory). Data parallel ranks take different
prompts (example index (step * prompts_per_step + b) * dp + dp_rank) and finalize gradients once per step through
the configured strategy (`strategy=ddp|fsdp2|deepspeed`, distributed/strategy.py), which also gives and takes
the checkpoint's whole tensors. Every process group comes from `ParallelDims.new_groups`.

Under faults (docs/guide/faults.md):
- a step whose loss or gradient norm is not finite is not applied (safety/guard.py);
- a checkpoint holds every rank's RNG and the config; resume passes over a corrupt one (checkpoint/);
- SIGTERM / SIGUSR1 end the run after the current step, with a checkpoint (safety/preemption.py);
- every collective waits at most dist_timeout_s, then the run stops with one line naming it (safety/watchdog.py);
- prompts and reward values are checked (safety/inputs.py);
- a run that stops early says why in one line (safety/errors.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import resource
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from rich.console import Console

from longstraw_cli import checkpoint, compile_cache
from longstraw_cli.checkpoint import CheckpointManager, trainer_state
from longstraw_cli.config import TrainConfig
from longstraw_cli.distributed.ep import ep_slice
from longstraw_cli.distributed.strategy import make_strategy
from longstraw_cli.distributed.topology import ParallelDims, env_rank_world
from longstraw_cli.lora import adapters_disabled, apply_lora
from longstraw_cli.models import build_model, from_pretrained
from longstraw_cli.models.spec import family_of
from longstraw_cli.plan import whole_response_advice
from longstraw_cli.quantize import DenseCache, dense_copies, nf4_modules
from longstraw_cli.resident.offload import host_available_bytes, host_bytes
from longstraw_cli.reuse import PromptReuse
from longstraw_cli.rl.reward_adapters import GroupReward, Scores
from longstraw_cli.rl.tasks import Example, make_task
from longstraw_cli.rollout.given import DataResponses, SyntheticResponses
from longstraw_cli.rollout.native import Rollout, generate
from longstraw_cli.safety import watchdog
from longstraw_cli.safety.errors import RunError, first_line
from longstraw_cli.safety.guard import NonFiniteGuard
from longstraw_cli.safety.inputs import InputError, check_prompt, check_prompts
from longstraw_cli.safety.preemption import Preempted, Preemption
from longstraw_cli.schedule import lr_factor
from longstraw_cli.telemetry.memory import PhaseClock
from longstraw_cli.telemetry.metrics import MetricsLogger
from longstraw_cli.telemetry.progress import StepProgress, notice
from longstraw_cli.telemetry.samples import StepRecord, extra_means, merge_sums
from longstraw_cli.tokenizer import load_tokenizer, read_chat_template, stop_token_ids
from longstraw_cli.transaction import Reference, Transaction
from longstraw_kernels import missing_fast_paths, use_kernels

log = logging.getLogger("longstraw")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


class TrainerError(RunError):
    """A problem with the run the user asked for (reported as one line by the CLI, exit status 2)."""


def _rss_peak_bytes() -> int:
    # ru_maxrss is KiB on Linux, bytes on macOS
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


class Trainer:
    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.rank, local_rank, world_size = env_rank_world()
        # before anything compiles: Triton's and torch.compile's caches where the next launch finds them
        self.compile_caches = compile_cache.setup(cfg.compile_cache_dir)
        # the ops read their kernel choice from the run's config (as torch's ops read torch.backends)
        use_kernels(cfg.kernels)
        # validated against the launch's world size when the config was built (config.train_config)
        self.dims = ParallelDims(world_size, cp=cfg.cp, ep=cfg.ep)
        self.dp_rank, _ = self.dims.coords(self.rank)
        self.device = torch.device(cfg.device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", local_rank)
        if self.device.type == "cuda":
            # object collectives (every rank's RNG into a checkpoint) run on the current device
            torch.cuda.set_device(self.device)
        if world_size > 1 and not dist.is_initialized():
            watchdog.init_process_group("nccl" if self.device.type == "cuda" else "gloo", cfg.dist_timeout_s)
        self.groups = self.dims.new_groups(self.rank, timeout_s=cfg.dist_timeout_s)
        self.run_dir = Path(cfg.run_dir)
        self.checkpoints = CheckpointManager(self.run_dir, keep=cfg.checkpoint.keep, rank=self.rank)
        if not cfg.resume and self.checkpoints.latest() is not None:
            raise TrainerError(f"run_dir {self.run_dir} already holds {self.checkpoints.latest().name}; "
                               f"pass resume=true to continue it, or choose another run_dir")

        torch.manual_seed(cfg.seed)
        self.tokenizer = load_tokenizer(cfg.model.tokenizer, read_chat_template(cfg.model.chat_template))
        # the data and the reward are the user's input: checked before the model is built
        self.task = make_task(cfg.task, self.tokenizer)
        # validation samples its own responses: its rows are not read for given ones
        self.val_task = None if cfg.task.val_path is None else make_task(
            dataclasses.replace(cfg.task, path=cfg.task.val_path, shuffle=False, given_responses=False),
            self.tokenizer)
        self.stop_token_ids = stop_token_ids(self.tokenizer, cfg.model.path)
        # rollout=data: the responses of the groups a file task checks at start, tokenized and checked with them
        self.data_responses = None if not cfg.task.given_responses else DataResponses(
            self.task, self.tokenizer, group_size=cfg.group_size, response_tokens=cfg.response_tokens,
            vocab_size=cfg.model.family_config()[1].vocab_size, stop_token_ids=self.stop_token_ids,
            device=self.device)
        # the prompts a file task checks at start render, and fit with response_tokens in the model's positions
        self.max_positions = cfg.model.max_positions()
        check_prompts(self._checked_at_start(), self.prompt_ids, self.max_positions, cfg.response_tokens)
        # the reward binds to a file task's first row's columns; a synthetic task's first prompt is built here
        # (under a second at 1M tokens) so that fixed text longer than prompt_tokens is one line now, not at step 0
        first = self.task.example(0)
        probe = Example("", "") if self.task.uses_prompt_tokens else first
        self.reward_fn = GroupReward(cfg.reward or self.task.default_reward, cfg.reward_style, probe)
        self._notices()
        self.model = self._build_model()
        self._parallelize(self.model)
        if cfg.lora.rank > 0:
            apply_lora(self.model, cfg.lora)
        # the reference copies the policy's weights before a strategy may shard them
        reference = self._reference()
        self.strategy = make_strategy(cfg.strategy, self.model, self._optimizer, self.groups,
                                      max_grad_norm=cfg.optim.max_grad_norm,
                                      num_replays=cfg.group_size * cfg.prompts_per_step)
        self.guard = NonFiniteGuard(cfg.max_nonfinite_steps)
        # rollout.replay_routing: the family's routing replay (models/glm52/routing.py), None when off
        try:
            self.routing_replay = family_of(self.model).routing_replay(cfg.rollout.replay_routing)
        except ValueError as e:
            raise TrainerError(str(e)) from None
        self.transaction = Transaction(self.model, self.guard.around(self.strategy), cfg.loss, cfg.transaction,
                                       reference=reference, routing_replay=self.routing_replay)
        self.sampling = dataclasses.replace(cfg.rollout.sampling, stop_token_ids=self.stop_token_ids)
        # the ranks of one CP group sample the same responses: they share the generator's seed
        self.generator = torch.Generator(self.device).manual_seed(cfg.seed * 1000 + self.dp_rank)
        self.engine = self._vllm_engine() if cfg.rollout.engine == "vllm" else None
        # what gives a prompt's responses where the native rollout does not (None: it does)
        self.source = self._sources()[cfg.rollout.engine]()
        # capture.reuse_steps > 1: one prompt's resident state held across steps (reuse.py); not checkpointed
        self.reuse = PromptReuse(cfg.reuse) if cfg.reuse.active else None
        # capture.offload=cpu: host bytes of pages already checked against the host's memory
        self.host_checked = 0
        # rollout.native.nf4_cache: the highest phase peak of the steps so far, the rollout's own memory above its
        # start, how many NF4 linears the rollouts hold dequantised (fixed once chosen) and their bytes
        self.peak_seen, self.rollout_overhead, self.nf4_cache, self.nf4_cache_bytes = 0, 0, DenseCache(), 0
        self.nf4_cache_on = cfg.rollout.native.caches_nf4(cfg.lora.quantize)
        if self.task.uses_prompt_tokens:
            self._check_host_memory(cfg.prompt_tokens)
        # where an error inside `train` came from: "iteration" (then the clock's phase) or a step's later part
        self.clock, self.section = PhaseClock(self.device), "set-up"
        # what the step under way keeps for the user (its samples, its rewards' extra figures); one a step
        self.record = StepRecord(0)
        self.last_checkpoint: Path | None = None
        # resume=true: what it found, one line at the start of train
        self.resumed: str | None = None
        self.start_step = self._resume() if cfg.resume else 0
        log.info("rank %d of %d (%s, strategy %s), starting at step %d of %d", self.rank, world_size, self.dims,
                 self.strategy.name, self.start_step, cfg.steps)
        # one console for the step lines and the live line (rich prints the one above the other); the logger
        # first: its set-up may fail (logger=wandb without wandb) before a live line or a heartbeat has started
        console = Console(highlight=False)
        self.metrics = MetricsLogger(
            self.run_dir, backends=cfg.logger.backends, rank=self.rank, wandb_cfg=cfg.logger.wandb,
            resume_step=self.start_step if cfg.resume else None, config=cfg.as_dict(), console=console,
        )
        self.progress = StepProgress(cfg.steps, self.start_step, enabled=cfg.logger.progress, rank=self.rank,
                                     console=console, heartbeat_s=cfg.logger.heartbeat_s)

    def _notices(self) -> None:
        """What the user asked for that does not apply, as one line each (rank 0)."""
        cfg = self.cfg
        if not self.task.uses_prompt_tokens and "prompt_tokens" in cfg.set_keys:
            notice(f"prompt_tokens={cfg.prompt_tokens} does not apply to task={cfg.task.name}: its rows are used as "
                   f"written (each prompt + response_tokens must fit the model's positions)", self.rank)
        if cfg.transaction.offload != "none" and self.device.type == "cpu":
            notice("capture.offload=cpu on device=cpu: the pages go to a second buffer in the same memory, staged "
                   "by plain copies (the host path runs, for testing; nothing is saved)", self.rank)
        if cfg.rollout.native.nf4_cache is True and self.device.type == "cpu":
            notice("rollout.native.nf4_cache=true on device=cpu: it is sized from CUDA memory peaks, so it holds "
                   "nothing here", self.rank)
        if cfg.model.path is not None and cfg.model.tokenizer == "byte":
            notice(f"model.path={cfg.model.path} has no tokenizer files: using the byte tokenizer "
                   f"(model.tokenizer=DIR to choose one)", self.rank)

    def _speed_notices(self) -> None:
        """Where the compile caches are, and each fast path a GPU run goes without, with its cost (rank 0)."""
        if self.compile_caches is not None:
            notice(self.compile_caches.describe(), self.rank)
        for line in missing_fast_paths(family_of(self.model).fast_paths, self.device):
            notice(line, self.rank)

    # -- set-up -----------------------------------------------------------------------------------------------
    def _build_model(self) -> torch.nn.Module:
        m, dtype = self.cfg.model, DTYPES[self.cfg.model.dtype]
        # lora.quantize=nf4: the base linears quantised layer by layer as the model is built or loaded
        quantize = self.cfg.lora.quantize
        # ep > 1: this rank builds (loads) only its own routed experts; `_parallelize` keeps them as they are
        expert_slice = ep_slice(self.groups.ep)
        if m.path is not None:
            model = from_pretrained(m.path, dtype=dtype, device=self.device, quantize=quantize,
                                    expert_slice=expert_slice)
        else:
            model = build_model(m.name, dtype=dtype, device=self.device, seed=self.cfg.seed, quantize=quantize,
                                expert_slice=expert_slice, **m.override_config)
        if self.tokenizer.vocab_size > model.config.vocab_size:
            raise TrainerError(f"tokenizer {m.tokenizer!r} has {self.tokenizer.vocab_size} ids but the model's "
                               f"vocab is {model.config.vocab_size}")
        return model

    def _hyperparameters(self) -> dict:
        optim = self.cfg.optim
        return {"lr": optim.lr, "betas": tuple(optim.betas), "weight_decay": optim.weight_decay}

    def _optimizer(self, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, **self._hyperparameters())

    def _reference(self) -> Reference | None:
        """The KL reference: with LoRA the same weights with adapters off, else a frozen copy of the start."""
        if self.cfg.loss.kl_coef == 0:
            return None
        if self.cfg.lora.rank > 0:
            return Reference(self.model, self.cfg.transaction, context=lambda: adapters_disabled(self.model))
        # a second model rather than a deepcopy: the policy's context-parallel hooks hold process groups; built
        # as the policy is (this rank's experts only), then given the policy's weights
        frozen = self._build_model().requires_grad_(False)
        self._parallelize(frozen)
        frozen.load_state_dict(self.model.state_dict())
        return Reference(frozen, self.cfg.transaction)

    def _parallelize(self, model: torch.nn.Module) -> None:
        """Context parallel (pages sharded over the CP group), then expert parallel (the EP group, which lies
        inside the CP group, routes tokens to the experts' ranks; `_build_model` already built each rank's
        slice)."""
        family = family_of(model)
        if self.cfg.cp > 1:
            family.apply_context_parallel(model, self.groups.cp)
        if self.cfg.ep > 1:
            family.apply_expert_parallel(model, self.groups.ep, cp_group=self.groups.cp)

    def _vllm_engine(self):
        from longstraw_cli.export import export_hf
        from longstraw_cli.rollout.vllm_engine import VllmEngine

        export_dir = self.run_dir / "vllm_init"
        if self.rank == 0:
            export_hf(self.model, export_dir)
        if dist.is_initialized():
            dist.barrier()
        return VllmEngine(str(export_dir), self.cfg.rollout.vllm)

    def _checked_at_start(self):
        """The examples the file tasks check at start, each group's given responses tokenized and checked on the
        way (one pass over them)."""
        for task in [self.task] + ([] if self.val_task is None else [self.val_task]):
            for example in task.examples_checked_at_start():
                if task is self.task and self.data_responses is not None:
                    self.data_responses.token_ids(example)
                yield example

    def _sources(self) -> dict:
        """rollout.engine -> a builder of what gives a prompt's responses (example, prompt ids) -> Rollout without
        the resident state, or None for the native rollout, which decodes from it."""
        return {
            "native": lambda: None,
            "vllm": lambda: self.rollout_vllm,
            "data": lambda: self.data_responses,
            "synthetic": lambda: SyntheticResponses(
                group_size=self.cfg.group_size, response_tokens=self.cfg.response_tokens,
                vocab_size=self.tokenizer.vocab_size, generator=self.generator, device=self.device),
        }

    # -- checkpoints ------------------------------------------------------------------------------------------
    def _save(self, step: int) -> None:
        state = {"step": step, "rng_by_rank": trainer_state.gather_rng({"sampling": self.generator}),
                 "dims": {"world_size": self.dims.world_size, "cp": self.dims.cp},
                 "config": trainer_state.config_json(self.cfg.as_dict()), "guard": self.guard.state_dict()}
        # the strategy's format: whole tensors written by rank 0, or every rank's shards (collectives)
        path = checkpoint.save(self.checkpoints, step, self.strategy, state)
        self.last_checkpoint = path
        notice(f"checkpoint {path.resolve() if path else self.checkpoints.dir / f'step_{step:08d}'} written "
               f"(after step {step - 1})", self.rank)

    def _resume(self) -> int:
        """The newest intact checkpoint of either format into the strategy (checkpoint/) -> the step to start at."""
        found = checkpoint.resume(self.checkpoints, self.strategy, self.cfg.as_dict(), map_location=self.device)
        if found is None:
            # a requeued job whose first launch saved nothing yet, or resume=auto's first launch: said at the start
            # of train
            value = "auto" if self.cfg.resume == "auto" else "true"
            self.resumed = (f"resume={value}: {self.checkpoints.dir.resolve()} holds no checkpoint yet; starting at "
                            f"step 0")
            return 0
        path, state = found
        self.resumed = f"resumed from {Path(path).resolve()} at step {int(state['step'])} of {self.cfg.steps}"
        trainer_state.optimizer_hyperparameters(self.strategy.optimizer, self._hyperparameters())
        trainer_state.restore_own_rng(state, self.rank, self.dims, {"sampling": self.generator})
        if "guard" in state:
            self.guard.load_state_dict(state["guard"])
        return int(state["step"])

    # -- one iteration ----------------------------------------------------------------------------------------
    def example(self, step: int, prompt: int = 0):
        """Prompt `prompt` of this rank's share of step `step`, and its token ids."""
        index = (step * self.cfg.prompts_per_step + prompt) * self.dims.dp + self.dp_rank
        example = self.task.example(index)
        return example, self._encode(example)

    def prompt_ids(self, example: Example) -> list[int]:
        """The prompt's token ids as the model reads it (chat messages, or a string asked to, through the chat
        template); the check at start (inputs.check_prompts) tokenizes through here too."""
        try:
            return self.tokenizer.encode(self.task.prompt_text(example))
        except ValueError as e:
            raise InputError(f"{example.origin}: {e}") from None

    def _encode(self, example: Example) -> torch.Tensor:
        """A prompt as the model's input, checked as at start: a row served later (a dataset's, a validation one)
        was not tokenized then."""
        ids = self.prompt_ids(example)
        check_prompt(example, len(ids), self.max_positions, self.cfg.response_tokens)
        return torch.tensor(ids, dtype=torch.long, device=self.device)

    def capture(self, prompt_ids: torch.Tensor, tail: int = 0):
        """The prompt's resident state (tail > 0: its last `tail` tokens a block of their own, whose carried states
        are kept for reuse's drift probe);
        with capture.offload=cpu, the host's memory is checked first."""
        self._check_host_memory(prompt_ids.numel())
        return self.transaction.capture(prompt_ids, tail=tail)

    def _check_host_memory(self, prompt_tokens: int) -> None:
        """capture.offload=cpu: a prompt whose pages (twice with a KL reference, whose capture lives beside the
        policy's) do not fit in the host's available memory stops the run with one line, before its capture. Pinned
        pages freed by an earlier capture stay in torch's host cache (not available to the OS, reused by the next
        capture), so only the growth over the largest prompt checked so far is checked again. Every rank on this
        host (torchrun's LOCAL_WORLD_SIZE) keeps its pages in the same memory: its context-parallel shard of the
        prompt (the first ranks' shards are the largest, one token more), so the need is that shard's pages times
        the local ranks."""
        if self.cfg.transaction.offload == "none":
            return
        copies = 2 if self.cfg.loss.kl_coef > 0 else 1
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        shard = -(-(prompt_tokens - 1) // self.cfg.cp)
        need = copies * local * host_bytes(self.model.resident_bytes(shard))
        if need <= self.host_checked:
            return
        available = host_available_bytes()
        if available is not None and need - self.host_checked > available:
            both = " (policy and KL reference)" if copies > 1 else ""
            ranks = f" ({local} ranks' shards of {shard} tokens on this host)" if local > 1 or self.cfg.cp > 1 else ""
            raise TrainerError(f"capture.offload=cpu: a {prompt_tokens}-token prompt's pages need "
                               f"{need / 2**30:.2f} GiB of host memory{both}{ranks}, "
                               f"{(available + self.host_checked) / 2**30:.2f} GiB available; use a shorter prompt "
                               f"or capture.offload=none")
        self.host_checked = need

    def rollout(self, resident) -> Rollout:
        """G responses sampled from the resident state (native engine); their log-probs are the on-policy scores.
        With rollout.native.nf4_cache, from dequantised copies of some NF4 linears (`_nf4_cache_count`)."""
        cuda = self.device.type == "cuda"
        start = torch.cuda.memory_allocated(self.device) if cuda else 0
        with dense_copies(self.model, self._nf4_cache_count()):
            self.nf4_cache_bytes = torch.cuda.memory_allocated(self.device) - start if cuda else 0
            rollout = generate(self.model, resident, self.cfg.group_size, self.sampling, self.generator,
                               native=self._native_decode(), routing=self.routing_replay,
                               on_token=self.progress.count)
        if cuda:
            # the phase clock reset the peak as the rollout phase began: what decoding itself took
            peak = torch.cuda.max_memory_allocated(self.device)
            self.rollout_overhead = max(self.rollout_overhead, peak - start - self.nf4_cache_bytes)
        return rollout

    def _nf4_cache_count(self) -> int:
        """How many NF4 linears the next rollout holds dequantised (rollout.native.nf4_cache): as many as fit
        between the memory in use now plus what decoding takes (the most it took so far) and the highest phase
        peak of the steps so far; 0 at the first step (no peak known yet) and on CPU. Kept once chosen, so the
        compiled decode step sees the same weights every rollout (`DenseCache`)."""
        if not self.nf4_cache_on or self.device.type != "cuda" or not self.peak_seen:
            return 0
        budget = self.peak_seen - torch.cuda.memory_allocated(self.device) - self.rollout_overhead
        before = self.nf4_cache.count
        count, held, changed = self.nf4_cache.size(self.model, budget)
        if changed and before is not None:
            log.warning("rollout.native.nf4_cache: %d dequantised linears no longer fit under the step's peak; %d "
                        "from now on (the decode step compiles again)", before, count)
        elif changed:
            log.info("rollout.native.nf4_cache: rollouts hold %d of %d NF4 linears dequantised (%.2f GiB, under the "
                     "highest step peak so far, %.2f GiB)", count, len(nf4_modules(self.model)), held / 2**30,
                     self.peak_seen / 2**30)
        return count

    def rollout_vllm(self, example: Example, prompt_ids: torch.Tensor) -> Rollout:
        """G responses from vLLM, after pushing the policy's weights; no resident state needed. vLLM's log-probs come
        from its own kernels and precision: the transaction re-scores them from our resident state."""
        self.engine.update_weights(self.model)
        # vLLM gives response i of a request seed + i: draw request seeds far apart
        seed = int(torch.randint(0, 2**31 - 1, (1,), generator=self.generator, device=self.device)) * 1024 % (2**31)
        rollout = self.engine.generate(prompt_ids.tolist(), self.cfg.group_size, self.sampling, seed)
        # free vLLM's weights and KV cache while the transaction runs (a no-op unless configured)
        self.engine.sleep()
        return Rollout([r.to(self.device) for r in rollout.responses], None)

    def _native_decode(self):
        """The rollout's decode settings; no CUDA graph where the strategy's hooks run around module calls."""
        native = self.cfg.rollout.native
        if native.cuda_graph and not self.strategy.cuda_graphs:
            native = dataclasses.replace(native, cuda_graph=False)
        return native

    def reward(self, example, rollout: Rollout) -> torch.Tensor:
        """A training prompt's G rewards; the step's record keeps its samples and the reward's extra figures."""
        texts, scores = self.reward_scores(example, rollout)
        self.record.add(example, lambda: self.task.prompt_text(example), texts,
                        [len(r) for r in rollout.responses], scores)
        return torch.tensor(scores.values, dtype=torch.float64)

    def reward_scores(self, example, rollout: Rollout) -> tuple[list[str], Scores]:
        """The decoded responses and what the reward gave for them (the rewards the rollout came with, rollout=data
        or synthetic: the reward not called). A reward that fails or returns what is not a finite number
        (RewardError) stops the run before any gradient of the step: nothing of it is logged or saved."""
        ids = [r.tolist() for r in rollout.responses]
        texts = [self.tokenizer.decode(i) for i in ids]
        given = rollout.rewards
        return texts, Scores(given) if given is not None else self.reward_fn.score(example, texts, ids)

    def set_lr(self, step: int) -> float:
        """The schedule's rate for optimizer step `step`: a function of the steps applied before it, which are the
        steps before it less those the non-finite guard skipped (a skipped step does not advance the schedule;
        the guard's counts are in the checkpoint, so resume needs no other state)."""
        optim = self.cfg.optim
        lr = optim.lr * lr_factor(step - self.guard.total, total_steps=self.cfg.steps,
                                  warmup_steps=optim.warmup_steps, schedule=optim.schedule,
                                  min_lr_ratio=optim.min_lr_ratio)
        for group in self.strategy.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def iteration(self, step: int) -> dict[str, float]:
        clock = self.clock = PhaseClock(self.device, on_phase=self.progress.phase)
        # rank 0 keeps the step's samples for the user; every rank the sums of its rewards' extra figures
        self.record = StepRecord(self.cfg.logger.samples if self.rank == 0 else 0)
        lr = self.set_lr(step)
        self.transaction.begin()
        prompts, rollouts, parts, num_prompts = [], [], [], self.cfg.prompts_per_step
        # reuse: one prompt per step (config.py), its captured state held across steps
        prompt_fn = self.prompt if self.reuse is None else self.prompt_reused
        for prompt in range(num_prompts):
            self.progress.prompt(prompt, num_prompts)
            prompt_ids, rollout, part = prompt_fn(step, prompt, clock)
            prompts.append(prompt_ids.numel())
            rollouts.append(rollout)
            parts.append(part)
        result = self.transaction.finish(parts, clock)
        self.peak_seen = max(self.peak_seen, *clock.cuda_peak_bytes.values(), 0)
        metrics = self._metrics(sum(prompts), rollouts, result, clock)
        if self.nf4_cache_on:
            metrics["mem/nf4_cache"] = self.nf4_cache_bytes
        metrics["lr"] = lr
        if self.reuse is not None:
            metrics.update(self.reuse.last)
        if self.task.num_examples is not None:
            served = step + 1 if self.reuse is None else self.reuse.prompt_step(step) + 1
            metrics["epoch"] = served * num_prompts * self.dims.dp / self.task.num_examples
        return metrics

    def prompt(self, step: int, prompt: int, clock: PhaseClock):
        """One prompt of the step: capture, rollout, reward, then score and replay x G (gradients accumulate)."""
        example, prompt_ids = self.example(step, prompt)
        if self.source is None:
            # ranks call the model a data-dependent number of times here: fsdp2 gathers the weights once around it
            with self.strategy.full_weights():
                with clock.phase("capture"):
                    resident = self.capture(prompt_ids)
                with clock.phase("rollout"):
                    rollout = self.rollout(resident)
        else:
            # vLLM, or responses without a decode (rollout=data | synthetic): the capture follows the reward
            with clock.phase("rollout"):
                rollout = self.source(example, prompt_ids)
        with clock.phase("reward"):
            rewards = self.reward(example, rollout)
        if self.source is not None:
            with clock.phase("capture"):
                resident = self.capture(prompt_ids)
        # the native rollout's log-probs are the graph-free on-policy scores of the same resident state; None (vLLM's
        # responses, given ones without recorded log-probs): the transaction scores them from the resident state
        part = self.transaction.accumulate(prompt_ids, rollout.responses, rewards, resident,
                                           old_logprobs=rollout.logprobs, clock=clock, prompt=prompt,
                                           num_prompts=self.cfg.prompts_per_step, routing=rollout.routing)
        self._release_routing(rollout)
        return prompt_ids, rollout, part

    def _release_routing(self, rollout: Rollout) -> None:
        """The routing records (host memory since the rollout) served scoring and the replays: let go before the
        step, their pinned buffers kept for the next rollout's records (`RoutingReplay.release`)."""
        if rollout.routing is not None:
            self.routing_replay.release(rollout.routing)
        rollout.routing = None

    def prompt_reused(self, step: int, prompt: int, clock: PhaseClock):
        """`prompt` under capture.reuse_steps=K (reuse.py): the prompt step // K of the data, captured at its
        first step (or after its drift passed capture.max_drift); every step rolls out from that resident state
        with the current weights (or takes the responses a source gives), measures the drift, and scores and
        replays as `prompt` does."""
        example, prompt_ids = self.example(self.reuse.prompt_step(step), prompt)
        captured = self.reuse.due(step)
        with self.strategy.full_weights():
            if captured:
                self.reuse.release()
                with clock.phase("capture"):
                    self.reuse.hold(step, self.capture(prompt_ids, tail=self.reuse.cfg.probe_tokens))
            resident = self.reuse.resident
            with clock.phase("rollout"):
                rollout = self.rollout(resident) if self.source is None else self.source(example, prompt_ids)
            with clock.phase("drift"):
                self.reuse.measure(self.model, self.transaction.score, prompt_ids, rollout.responses)
        with clock.phase("reward"):
            rewards = self.reward(example, rollout)
        part = self.transaction.accumulate(prompt_ids, rollout.responses, rewards, resident,
                                           old_logprobs=rollout.logprobs, clock=clock, prompt=prompt,
                                           num_prompts=self.cfg.prompts_per_step, routing=rollout.routing)
        self._release_routing(rollout)
        self.reuse.advance(captured)
        return prompt_ids, rollout, part

    @torch.no_grad()
    def validate(self, step: int) -> dict[str, float]:
        """Mean reward of G native samples per validation prompt, the prompts split over the data-parallel ranks.
        Its own generator (seeded by the step): the training run's random streams are untouched."""
        clock = PhaseClock(self.device, on_phase=self.progress.phase)
        count = len(self.val_task) if not self.cfg.task.val_examples else min(self.cfg.task.val_examples,
                                                                               len(self.val_task))
        generator = torch.Generator(self.device).manual_seed(self.cfg.seed * 1000 + self.dp_rank + 7919 * (step + 1))
        totals = torch.zeros(2, dtype=torch.float64, device=self.device)
        with clock.phase("val"), self.strategy.full_weights():
            for i in range(self.dp_rank, count, self.dims.dp):
                example = self.val_task.example(i)
                resident = self.capture(self._encode(example))
                rollout = generate(self.model, resident, self.cfg.group_size, self.sampling, generator,
                                   native=self._native_decode())
                rewards = torch.tensor(self.reward_scores(example, rollout)[1].values, dtype=torch.float64)
                totals += torch.stack([rewards.sum(), torch.tensor(float(len(rewards)))]).to(totals)
        if self.dims.dp > 1:
            dist.all_reduce(totals, group=self.groups.dp)
        return {"val/reward_mean": float(totals[0] / totals[1]), "val/prompts": count,
                "time/val": clock.seconds["val"]}

    def _metrics(self, prompt_tokens: int, rollouts: list[Rollout], result, clock: PhaseClock) -> dict[str, float]:
        """The step's numbers. Token counts are the step's totals on this rank (all its prompts, all their
        responses), named `step_*` apart from the config keys prompt_tokens / response_tokens (per prompt, per
        response); `time/decode_step` is one decode step of all G responses together, not one token's time."""
        metrics = dict(result.stats)
        if all(r.entropies is not None for r in rollouts):
            metrics["entropy"] = float(torch.cat([e for r in rollouts for e in r.entropies]).mean())
        metrics["step_prompt_tokens"] = prompt_tokens
        metrics["step_response_tokens"] = sum(len(response) for r in rollouts for response in r.responses)
        decode_steps = sum(r.decode_steps for r in rollouts)
        if decode_steps:
            metrics["decode_steps"] = decode_steps
            metrics["time/decode_step"] = clock.seconds["rollout"] / decode_steps
            # of the rollout's time, what its decoders paid before their first steps (native rollout; 0 for vLLM)
            metrics["time/decode_setup"] = sum(r.setup_s for r in rollouts)
        metrics.update(clock.time_metrics())
        metrics["mem/resident"] = result.resident_bytes["total"]
        if self.cfg.transaction.offload != "none":
            metrics["mem/host_pages"] = host_bytes(result.resident_bytes)
        metrics["mem/graph_peak"] = result.graph_peak_bytes
        if self.cfg.transaction.exact:
            # every rank logs the same keys (the metrics all-reduce reduces them in order), 0 or not
            metrics["mem/state_grad"] = result.state_grad_bytes
        if self.cfg.transaction.replay_block:
            metrics["mem/response_state"] = result.response_state_bytes
        metrics["mem/accounted_peak"] = result.accounted_peak_bytes
        metrics.update(clock.memory_metrics())
        metrics["mem/rss_peak"] = _rss_peak_bytes()
        return metrics

    @contextlib.contextmanager
    def _named_failures(self, step: int):
        """A collective whose peer stopped answering, or memory running out, as one line naming where it was."""
        try:
            yield
        except RunError:
            raise
        except RuntimeError as e:
            phase = f"phase {self.clock.last}" if self.section == "iteration" else self.section
            where = f"step {step}, {phase}"
            timeout = watchdog.explain(e, rank=self.rank, where=where, timeout_s=self.cfg.dist_timeout_s)
            if timeout is not None:
                raise timeout from e
            if isinstance(e, torch.OutOfMemoryError) or "can't allocate memory" in str(e):
                raise TrainerError(f"out of memory at {where} ({first_line(e)}); "
                                   f"{self._memory_advice(self.clock.last if self.section == 'iteration' else None)} "
                                   f"(`longstraw plan` shows the memory by phase)") from e
            raise

    def _memory_advice(self, phase: str | None) -> str:
        """What to change after running out of memory in `phase`: capture.replay_block first where whole responses
        were replayed or scored (`whole_response_advice`), else the sizes to lower."""
        lower = f"lower group_size={self.cfg.group_size}, response_tokens, prompt_tokens or capture.block_size"
        blocks = whole_response_advice(phase, self.cfg.transaction.replay_block, self.cfg.response_tokens)
        return lower if blocks is None else f"{blocks}, or {lower}"

    def _preempted(self, signal_name: str, done: int) -> None:
        # rank 0 writes the checkpoint: no rank exits (and ends the launch) before it is whole
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
        raise Preempted(f"{signal_name} received: stopped after step {done - 1} with checkpoint step_{done:08d} in "
                        f"{self.checkpoints.dir}; resume=true continues from step {done}")

    def run_step(self, step: int, preemption: Preemption) -> str | None:
        """Step `step` and what follows it: validation when due, the metrics row, the guard's verdict, and a
        checkpoint when due or on a signal; -> the signal's name when the run is to stop after it."""
        done, every, val_every = step + 1, self.cfg.checkpoint.every, self.cfg.task.val_every
        self.section = "iteration"
        own = self.iteration(step)
        self.guard.after_step(step)
        own["nonfinite_steps"] = self.guard.total
        self.section = "the metrics all-reduce"
        metrics = self._across_ranks(own)
        own.update(extra_means(self.record.extra_sums))
        metrics.update(self._reward_extras())
        if self.val_task is not None and val_every and done % val_every == 0:
            self.section = "validation"
            val = self.validate(step)
            metrics.update(val)
            own.update(val)
        self.progress.step_done()
        self.metrics.log(step, metrics)
        self.metrics.log_samples(step, self.record.samples)
        # each rank's log keeps its own times and peaks (metrics.jsonl has the worst rank's)
        log.info("rank %d step %d %s", self.rank, step, json.dumps(own))
        self.guard.stop_if_due(step)
        self.section = "the preemption check"
        stop = preemption.agreed(self.device)
        self.section = "the checkpoint"
        due = (every and done % every == 0) or done == self.cfg.steps
        if (due and self.cfg.checkpoint.enabled) or stop:
            self._save(done)
        return stop

    def _reward_extras(self) -> dict[str, float]:
        """`reward/<key>`: the mean of each extra figure the step's rewards gave (samples.py), over every response
        that gave it on any data-parallel rank (where the reward gives any, `GroupReward.gives_extras`); the
        ranks' sums and counts are gathered over the data-parallel group (the ranks of a context-parallel group hold
        the same), not all-reduced key by key: ranks may meet rows whose reward gives other keys."""
        sums = self.record.extra_sums
        if self.dims.dp > 1 and self.reward_fn.gives_extras:
            parts = [None] * self.dims.dp
            dist.all_gather_object(parts, sums, group=self.groups.dp)
            sums = merge_sums(parts)
        return extra_means(sums)

    def _across_ranks(self, metrics: dict[str, float]) -> dict[str, float]:
        """A new dict: over all ranks, the max of times and memory (the worst rank's, under context and expert
        parallel too); data-parallel runs also log the mean over ranks of every other number (the ranks of one
        context-parallel group compute the same ones)."""
        out = dict(metrics)
        if self.dims.world_size == 1:
            return out
        keys = sorted(metrics)
        worst = [k for k in keys if k.startswith(("time/", "mem/"))]
        peaks = torch.tensor([float(metrics[k]) for k in worst], dtype=torch.float64, device=self.device)
        dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
        if self.dims.dp > 1:
            mean = [k for k in keys if k not in worst]
            values = torch.tensor([float(metrics[k]) for k in mean], dtype=torch.float64, device=self.device)
            dist.all_reduce(values)
            out.update((k, v / self.dims.world_size) for k, v in zip(mean, values.tolist()))
        out.update(zip(worst, peaks.tolist()))
        return out

    def train(self) -> None:
        # said once the set-up has passed (bad input or a refused resume stays one line)
        self._speed_notices()
        for line in self.metrics.destinations(self.cfg.logger.samples):
            notice(line, self.rank)
        if self.resumed:
            notice(self.resumed, self.rank)
        try:
            with Preemption() as preemption:
                for step in range(self.start_step, self.cfg.steps):
                    with self._named_failures(step):
                        stop = self.run_step(step, preemption)
                    if stop and step + 1 < self.cfg.steps:
                        self._preempted(stop, step + 1)
        finally:
            self.progress.close()
            self.metrics.close()
        if self.cfg.export_hf:
            from longstraw_cli.export import export_run

            # under expert parallel the EP group holding rank 0 writes, each rank its own experts
            with self.strategy.full_weights():
                written = export_run(self.model, self.run_dir, tokenizer=self.tokenizer,
                                     stop_token_ids=self.sampling.stop_token_ids, sampling=self.sampling,
                                     lora=self.cfg.lora, model_path=self.cfg.model.path, group=self.groups.ep)
            if written:
                notice(f"exported {', '.join(str(Path(w).resolve()) for w in written)}", self.rank)
        if self.rank == 0 and "jsonl" in self.cfg.logger.backends:
            with contextlib.suppress(ImportError):
                from longstraw_cli.telemetry.plot import plot_memory

                plot_memory(self.metrics.path, self.run_dir / "memory.png")
        last = f"; last checkpoint {self.last_checkpoint.resolve()}" if self.last_checkpoint else ""
        notice(f"finished {self.cfg.steps} step{'s' * (self.cfg.steps != 1)} in {self.run_dir.resolve()}{last}",
               self.rank)
        if dist.is_initialized():
            dist.destroy_process_group()
