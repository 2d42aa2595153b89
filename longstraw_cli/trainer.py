"""The trainer: one iteration per optimizer step, read like the algorithm.

    (example -> capture -> rollout -> reward -> score, replay x G) x prompts_per_step -> finalize, step
    -> validate every val_every steps -> log, checkpoint

The prompt is captured once per iteration (by the transaction's `capture`) and that one resident state serves
rollout, scoring and replay. With vLLM the rollout runs first, in vLLM (weights pushed first), and the capture
follows the reward. One `PhaseClock` per iteration times every phase (and its CUDA peak memory). Data parallel
ranks take different prompts (example index (step * prompts_per_step + b) * dp + dp_rank) and finalize
gradients once per step through
the configured strategy (`strategy=ddp|fsdp2|deepspeed`, distributed/strategy.py), which also gives and takes
the checkpoint's whole tensors. Every process group comes from `ParallelDims.new_groups`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import resource
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from longstraw_cli.checkpoint import CheckpointManager, capture_rng, restore_rng
from longstraw_cli.config import TrainConfig
from longstraw_cli.distributed import sharded_checkpoint
from longstraw_cli.distributed.strategy import make_strategy
from longstraw_cli.distributed.topology import ParallelDims, env_rank_world
from longstraw_cli.lora import adapters_disabled, apply_lora
from longstraw_cli.models import build_model, from_pretrained
from longstraw_cli.models.spec import family_of
from longstraw_cli.rl.reward_adapters import GroupReward, RewardError
from longstraw_cli.rl.tasks import Example, make_task
from longstraw_cli.rollout.native import Rollout, generate
from longstraw_cli.schedule import lr_factor
from longstraw_cli.telemetry.memory import PhaseClock
from longstraw_cli.telemetry.metrics import MetricsLogger
from longstraw_cli.telemetry.progress import StepProgress, notice
from longstraw_cli.tokenizer import load_tokenizer, read_chat_template, stop_token_ids
from longstraw_cli.transaction import Reference, Transaction

log = logging.getLogger("longstraw")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


class TrainerError(RuntimeError):
    """A problem with the run the user asked for (reported as one line by the CLI)."""


def _rss_peak_bytes() -> int:
    # ru_maxrss is KiB on Linux, bytes on macOS
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


class Trainer:
    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.rank, local_rank, world_size = env_rank_world()
        # validated against the launch's world size when the config was built (config.train_config)
        self.dims = ParallelDims(world_size, cp=cfg.cp, ep=cfg.ep)
        self.dp_rank, _ = self.dims.coords(self.rank)
        self.device = torch.device(cfg.device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", local_rank)
        if world_size > 1 and not dist.is_initialized():
            dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo")
        self.groups = self.dims.new_groups(self.rank)
        self.run_dir = Path(cfg.run_dir)
        self.checkpoints = CheckpointManager(self.run_dir, keep=cfg.checkpoint.keep, rank=self.rank)
        if not cfg.resume and self.checkpoints.latest() is not None:
            raise TrainerError(f"run_dir {self.run_dir} already holds {self.checkpoints.latest().name}; "
                               f"pass resume=true to continue it, or choose another run_dir")

        torch.manual_seed(cfg.seed)
        self.tokenizer = load_tokenizer(cfg.model.tokenizer, read_chat_template(cfg.model.chat_template))
        # the data and the reward are the user's input: checked before the model is built
        self.task = make_task(cfg.task, self.tokenizer)
        self.val_task = None if cfg.task.val_path is None else make_task(
            dataclasses.replace(cfg.task, path=cfg.task.val_path, shuffle=False), self.tokenizer)
        # a file task's first row: its prompt renders, and the reward binds to its columns
        probe = Example("", "") if self.task.uses_prompt_tokens else self.task.example(0)
        if not self.task.uses_prompt_tokens:
            try:
                self.task.prompt_text(probe)
            except ValueError as e:
                raise TrainerError(f"{probe.where}: {e}") from None
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
        self.transaction = Transaction(self.model, self.strategy, cfg.loss, cfg.transaction, reference=reference)
        self.sampling = dataclasses.replace(cfg.rollout.sampling,
                                            stop_token_ids=stop_token_ids(self.tokenizer, cfg.model.path))
        # the ranks of one CP group sample the same responses: they share the generator's seed
        self.generator = torch.Generator(self.device).manual_seed(cfg.seed * 1000 + self.dp_rank)
        self.engine = self._vllm_engine() if cfg.rollout.engine == "vllm" else None
        self.start_step = self._resume() if cfg.resume else 0
        log.info("rank %d of %d (%s, strategy %s), starting at step %d of %d", self.rank, world_size, self.dims,
                 self.strategy.name, self.start_step, cfg.steps)
        self.metrics = MetricsLogger(
            self.run_dir, backends=cfg.logger.backends, rank=self.rank, wandb_cfg=cfg.logger.wandb,
            resume_step=self.start_step if cfg.resume else None, config=cfg.as_dict(),
        )
        self.progress = StepProgress(cfg.steps, self.start_step, enabled=cfg.logger.progress, rank=self.rank)

    def _notices(self) -> None:
        """What the user asked for that does not apply, as one line each (rank 0)."""
        cfg = self.cfg
        if not self.task.uses_prompt_tokens:
            notice(f"prompt_tokens={cfg.prompt_tokens} does not apply to task={cfg.task.name}: its rows are used as "
                   f"written (each prompt + response_tokens must fit the model's positions)", self.rank)
        if cfg.model.path is not None and cfg.model.tokenizer == "byte":
            notice(f"model.path={cfg.model.path} has no tokenizer files: using the byte tokenizer "
                   f"(model.tokenizer=DIR to choose one)", self.rank)

    # -- set-up -----------------------------------------------------------------------------------------------
    def _build_model(self) -> torch.nn.Module:
        m, dtype = self.cfg.model, DTYPES[self.cfg.model.dtype]
        if m.path is not None:
            model = from_pretrained(m.path, dtype=dtype, device=self.device)
        else:
            model = build_model(m.name, dtype=dtype, device=self.device, seed=self.cfg.seed)
        if self.tokenizer.vocab_size > model.config.vocab_size:
            raise TrainerError(f"tokenizer {m.tokenizer!r} has {self.tokenizer.vocab_size} ids but the model's "
                               f"vocab is {model.config.vocab_size}")
        return model

    def _optimizer(self, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        optim = self.cfg.optim
        return torch.optim.AdamW(params, lr=optim.lr, betas=tuple(optim.betas), weight_decay=optim.weight_decay)

    def _reference(self) -> Reference | None:
        """The KL reference: with LoRA the same weights with adapters off, else a frozen copy of the start."""
        if self.cfg.loss.kl_coef == 0:
            return None
        if self.cfg.lora.rank > 0:
            return Reference(self.model, self.cfg.transaction, context=lambda: adapters_disabled(self.model))
        # a second model rather than a deepcopy: the policy's context-parallel hooks hold process groups
        frozen = self._build_model().requires_grad_(False)
        self._parallelize(frozen)
        frozen.load_state_dict(self.model.state_dict())
        return Reference(frozen, self.cfg.transaction)

    def _parallelize(self, model: torch.nn.Module) -> None:
        """Context parallel (pages sharded over the CP group), then expert parallel (experts split over the EP
        group, which lies inside the CP group)."""
        family = family_of(model)
        if self.cfg.cp > 1:
            family.apply_context_parallel(model, self.groups.cp)
        if self.cfg.ep > 1:
            family.apply_expert_parallel(model, self.groups.ep, cp_group=self.groups.cp)

    def _vllm_engine(self):
        from longstraw_cli.lora import export_hf
        from longstraw_cli.rollout.vllm_engine import VllmEngine

        export_dir = self.run_dir / "vllm_init"
        if self.rank == 0:
            export_hf(self.model, export_dir)
        if dist.is_initialized():
            dist.barrier()
        return VllmEngine(str(export_dir), self.cfg.rollout.vllm)

    # -- checkpoints ------------------------------------------------------------------------------------------
    def _save(self, step: int) -> None:
        trainer_state = {"step": step, "rng": capture_rng({"sampling": self.generator})}
        if self.strategy.sharded_checkpoints:
            # each rank writes its shards (a collective)
            sharded_checkpoint.save(self.checkpoints, step, self.strategy, trainer_state)
            return
        # whole tensors, whatever the strategy and ep (a collective under deepspeed / ep: every rank is here)
        model_state, optimizer_state = self.strategy.state_dict()
        self.checkpoints.save(step, model_state=model_state, optimizer_state=optimizer_state,
                              trainer_state=trainer_state)

    def _resume(self) -> int:
        latest = self.checkpoints.latest()
        if latest is None:
            return 0
        if sharded_checkpoint.is_sharded(latest):
            if self.strategy.name == "deepspeed":
                raise TrainerError(f"{latest} is a sharded (fsdp2) checkpoint: it resumes under fsdp2, ddp or one "
                                   f"process, not deepspeed")
            trainer_state = sharded_checkpoint.load(latest, self.strategy)
            restore_rng(trainer_state["rng"], {"sampling": self.generator})
            return int(trainer_state["step"])
        model_state, optimizer_state, trainer_state = self.checkpoints.load(latest, map_location=self.device)
        expected = {n for n, p in self.model.named_parameters() if p.requires_grad}
        if set(model_state) != expected:
            raise TrainerError(f"{latest} does not match this model's trainable parameters "
                               f"(e.g. {sorted(set(model_state) ^ expected)[:3]})")
        self.strategy.load_state_dict(model_state, optimizer_state)
        restore_rng(trainer_state["rng"], {"sampling": self.generator})
        return int(trainer_state["step"])

    # -- one iteration ----------------------------------------------------------------------------------------
    def example(self, step: int, prompt: int = 0):
        """Prompt `prompt` of this rank's share of step `step`, and its token ids."""
        index = (step * self.cfg.prompts_per_step + prompt) * self.dims.dp + self.dp_rank
        example = self.task.example(index)
        return example, self._encode(self.task, example)

    def _encode(self, task, example: Example) -> torch.Tensor:
        where = example.where or f"example {example.meta.get('index', '?')}"
        try:
            ids = self.tokenizer.encode(task.prompt_text(example))
        except ValueError as e:
            raise TrainerError(f"{where}: {e}") from None
        limit = self.model.config.max_position_embeddings - self.cfg.response_tokens
        if not 0 < len(ids) <= limit:
            raise TrainerError(f"{where}: the prompt is {len(ids)} tokens; it must be 1 to {limit} (the model's "
                               f"{self.model.config.max_position_embeddings} positions less response_tokens="
                               f"{self.cfg.response_tokens})")
        return torch.tensor(ids, dtype=torch.long, device=self.device)

    def capture(self, prompt_ids: torch.Tensor):
        return self.transaction.capture(prompt_ids)

    def rollout(self, resident) -> Rollout:
        """G responses sampled from the resident state (native engine); their log-probs are the on-policy scores."""
        return generate(self.model, resident, self.cfg.group_size, self.sampling, self.generator,
                        native=self._native_decode())

    def rollout_vllm(self, prompt_ids: torch.Tensor) -> Rollout:
        """G responses from vLLM, after pushing the policy's weights; no resident state needed."""
        self.engine.update_weights(self.model)
        # vLLM gives response i of a request seed + i: draw request seeds far apart
        seed = int(torch.randint(0, 2**31 - 1, (1,), generator=self.generator, device=self.device)) * 1024 % (2**31)
        rollout = self.engine.generate(prompt_ids.tolist(), self.cfg.group_size, self.sampling, seed)
        # free vLLM's weights and KV cache while the transaction runs (a no-op unless configured)
        self.engine.sleep()
        return Rollout([r.to(self.device) for r in rollout.responses], [l.to(self.device) for l in rollout.logprobs])

    def _native_decode(self):
        """The rollout's decode settings; no CUDA graph where the strategy's hooks run around module calls."""
        native = self.cfg.rollout.native
        if native.cuda_graph and not self.strategy.cuda_graphs:
            native = dataclasses.replace(native, cuda_graph=False)
        return native

    def reward(self, example, rollout: Rollout) -> torch.Tensor:
        ids = [r.tolist() for r in rollout.responses]
        texts = [self.tokenizer.decode(i) for i in ids]
        try:
            return torch.tensor(self.reward_fn(example, texts, ids), dtype=torch.float64)
        except RewardError as e:
            # before any gradient of the step: nothing of it is logged or saved
            raise TrainerError(str(e)) from e

    def set_lr(self, step: int) -> float:
        """The schedule's rate for optimizer step `step` (a function of the step alone: resume needs no state)."""
        optim = self.cfg.optim
        lr = optim.lr * lr_factor(step, total_steps=self.cfg.steps, warmup_steps=optim.warmup_steps,
                                  schedule=optim.schedule, min_lr_ratio=optim.min_lr_ratio)
        for group in self.strategy.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def iteration(self, step: int) -> dict[str, float]:
        clock = PhaseClock(self.device, on_phase=self.progress.phase)
        lr = self.set_lr(step)
        self.transaction.begin()
        prompts, rollouts, parts, num_prompts = [], [], [], self.cfg.prompts_per_step
        for prompt in range(num_prompts):
            self.progress.prompt(prompt, num_prompts)
            prompt_ids, rollout, part = self.prompt(step, prompt, clock)
            prompts.append(prompt_ids.numel())
            rollouts.append(rollout)
            parts.append(part)
        result = self.transaction.finish(parts, clock)
        metrics = self._metrics(sum(prompts), rollouts, result, clock)
        metrics["lr"] = lr
        if self.task.num_examples is not None:
            metrics["epoch"] = (step + 1) * num_prompts * self.dims.dp / self.task.num_examples
        return metrics

    def prompt(self, step: int, prompt: int, clock: PhaseClock):
        """One prompt of the step: capture, rollout, reward, then score and replay x G (gradients accumulate)."""
        example, prompt_ids = self.example(step, prompt)
        if self.engine is None:
            # ranks call the model a data-dependent number of times here: fsdp2 gathers the weights once around it
            with self.strategy.full_weights():
                with clock.phase("capture"):
                    resident = self.capture(prompt_ids)
                with clock.phase("rollout"):
                    rollout = self.rollout(resident)
        else:
            with clock.phase("rollout"):
                rollout = self.rollout_vllm(prompt_ids)
        with clock.phase("reward"):
            rewards = self.reward(example, rollout)
        if self.engine is not None:
            with clock.phase("capture"):
                resident = self.capture(prompt_ids)
        # native rollout's log-probs are the graph-free on-policy scores of the same resident state; vLLM's come
        # from its own kernels and precision, so the transaction re-scores them from our resident state
        old = rollout.logprobs if self.engine is None else None
        part = self.transaction.accumulate(prompt_ids, rollout.responses, rewards, resident, old_logprobs=old,
                                           clock=clock, prompt=prompt, num_prompts=self.cfg.prompts_per_step)
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
                resident = self.capture(self._encode(self.val_task, example))
                rollout = generate(self.model, resident, self.cfg.group_size, self.sampling, generator,
                                   native=self._native_decode())
                rewards = self.reward(example, rollout)
                totals += torch.stack([rewards.sum(), torch.tensor(float(len(rewards)))]).to(totals)
        if self.dims.dp > 1:
            dist.all_reduce(totals, group=self.groups.dp)
        return {"val/reward_mean": float(totals[0] / totals[1]), "val/prompts": count,
                "time/val": clock.seconds["val"]}

    def _metrics(self, prompt_tokens: int, rollouts: list[Rollout], result, clock: PhaseClock) -> dict[str, float]:
        """The step's numbers; token counts are over its prompts."""
        metrics = dict(result.stats)
        if all(r.entropies is not None for r in rollouts):
            metrics["entropy"] = float(torch.cat([e for r in rollouts for e in r.entropies]).mean())
        metrics["prompt_tokens"] = prompt_tokens
        metrics["response_tokens"] = sum(len(response) for r in rollouts for response in r.responses)
        decode_steps = sum(r.decode_steps for r in rollouts)
        if decode_steps:
            metrics["decode_steps"] = decode_steps
            metrics["time/decode_per_token"] = clock.seconds["rollout"] / decode_steps
        metrics.update(clock.time_metrics())
        metrics["mem/resident"] = result.resident_bytes["total"]
        metrics["mem/graph_peak"] = result.graph_peak_bytes
        if result.state_grad_bytes:
            metrics["mem/state_grad"] = result.state_grad_bytes
        metrics["mem/accounted_peak"] = result.accounted_peak_bytes
        metrics.update(clock.memory_metrics())
        metrics["mem/rss_peak"] = _rss_peak_bytes()
        return metrics

    def _across_ranks(self, metrics: dict[str, float]) -> dict[str, float]:
        """Data-parallel runs log the mean over ranks of each number, and the max of times and memory."""
        if self.dims.dp == 1:
            return metrics
        keys = sorted(metrics)
        worst = [k for k in keys if k.startswith(("time/", "mem/"))]
        mean = [k for k in keys if k not in worst]
        values = torch.tensor([float(metrics[k]) for k in mean], dtype=torch.float64, device=self.device)
        peaks = torch.tensor([float(metrics[k]) for k in worst], dtype=torch.float64, device=self.device)
        dist.all_reduce(values)
        dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
        out = {k: v / self.dims.world_size for k, v in zip(mean, values.tolist())}
        out.update(zip(worst, peaks.tolist()))
        return out

    def train(self) -> None:
        every = self.cfg.checkpoint.every
        try:
            val_every = self.cfg.task.val_every
            for step in range(self.start_step, self.cfg.steps):
                metrics = self._across_ranks(self.iteration(step))
                done = step + 1
                if self.val_task is not None and val_every and done % val_every == 0:
                    metrics.update(self.validate(step))
                self.progress.step_done()
                self.metrics.log(step, metrics)
                log.info("rank %d step %d %s", self.rank, step, json.dumps(metrics))
                if (every and done % every == 0) or done == self.cfg.steps:
                    self._save(done)
        finally:
            self.progress.close()
            self.metrics.close()
        if self.cfg.export_hf:
            from longstraw_cli.export import export_run

            with self.strategy.full_weights():
                if self.rank == 0:
                    export_run(self.model, self.run_dir, tokenizer=self.tokenizer,
                               stop_token_ids=self.sampling.stop_token_ids, sampling=self.sampling,
                               lora=self.cfg.lora, model_path=self.cfg.model.path)
        if self.rank == 0 and "jsonl" in self.cfg.logger.backends:
            with contextlib.suppress(ImportError):
                from longstraw_cli.telemetry.plot import plot_memory

                plot_memory(self.metrics.path, self.run_dir / "memory.png")
        if dist.is_initialized():
            dist.destroy_process_group()
