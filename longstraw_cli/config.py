"""The composed Hydra config becomes typed, frozen dataclasses here, once; nothing past the entrypoint sees a
DictConfig. Each component's config is the dataclass its module owns (LossConfig, TaskConfig, SamplingConfig,
LoraConfig, ...), so `GRPOLoss(loss_cfg)`, never `GRPOLoss(cfg)`.

Every value a user can get wrong is checked here and reported as a `ConfigError` naming the value and the
valid choices; the CLI prints it as one line.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from longstraw_cli.compile_cache import check_setting as compile_cache_refusal
from longstraw_cli.distributed.strategy import StrategyConfig
from longstraw_cli.distributed.topology import ParallelDims
from longstraw_cli.lora import LoraConfig
from longstraw_cli.models import MODEL_NAMES, families, family_of, hf_model_config
from longstraw_cli.quantize import dtype_refusal, torchao_nf4
from longstraw_cli.resident.offload import offload_refusal
from longstraw_cli.reuse import ReuseConfig, refusal
from longstraw_cli.rl.advantages import ADVANTAGE_REGISTRY, advantage_kind, min_group_size
from longstraw_cli.rl.losses import LossConfig, get_loss
from longstraw_cli.rl.reward_adapters import REWARD_STYLES
from longstraw_cli.rl.task_base import TaskConfig
from longstraw_cli.rl.tasks import TASKS
from longstraw_cli.rollout.native import NativeConfig, SamplingConfig
from longstraw_cli.rollout.vllm_engine import VllmConfig
from longstraw_cli.safety.typed import mismatch
from longstraw_cli.schedule import SCHEDULES
from longstraw_cli.telemetry.metrics import WandbConfig
from longstraw_cli.tokenizer import resolve_tokenizer
from longstraw_cli.transaction import TransactionConfig
from longstraw_kernels import KernelConfig

DTYPES = ("float32", "bfloat16", "float16", "float64")
# native and vllm sample; data and synthetic give responses without a decode (rollout/given.py)
ENGINES = ("native", "vllm", "data", "synthetic")
BACKENDS = ("console", "jsonl", "wandb", "tensorboard")


class ConfigError(ValueError):
    """A user-facing configuration error: one line, naming the bad value and the valid choices."""


# keys that name a file or directory: `~` and environment variables expanded once, here (task.reward when it is
# path/to/file.py:function; model.chat_template when it is a file, not the template's text)
PATH_KEYS = ("run_dir", "compile_cache_dir", "model.path", "model.tokenizer", "model.chat_template", "task.path",
             "task.val_path", "task.reward", "logger.wandb.dir")
_VARIABLE = re.compile(r"\$(\w+)|\$\{([^}]*)\}")
# a token count's suffixes, as `longstraw plan` has always read them
TOKEN_SUFFIXES = {"K": 2**10, "M": 2**20}


def expand_path(value: Any, key: str) -> Any:
    """A path as a shell expands it: a leading `~` or `~user` is the home directory, `$VAR` and `${VAR}` the
    environment variable (after `~`, so a variable's own `~` stays, as in a shell). An unset variable is an error
    naming it: a path holding '$VAR' would name no file either. Anything but a string is returned as it is."""
    if not isinstance(value, str):
        return value

    def variable(match: re.Match) -> str:
        name = match[1] or match[2]
        if name not in os.environ:
            raise ConfigError(f"{key}={value!r}: the environment variable {name!r} is not set")
        return os.environ[name]

    return _VARIABLE.sub(variable, os.path.expanduser(value))


def parse_tokens(value: Any, key: str) -> int:
    """A token count: an integer, or digits with a K (1024) or M (1048576) suffix ('256K', '2M'), as `train` and
    `plan` take prompt_tokens and response_tokens. Whether the count is in range is the caller's check."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    match = re.fullmatch(r"(\d+)([KkMm]?)", value) if isinstance(value, str) else None
    if match is None:
        raise ConfigError(f"{key}={value!r} is not a token count; e.g. 65536, 64K, 2M (K = 1024, M = 1048576)")
    return int(match[1]) * TOKEN_SUFFIXES.get(match[2].upper(), 1)


def expand_paths(d: dict) -> dict:
    """The composed config with every PATH_KEYS value expanded (nested dicts copied, not changed)."""
    d = dict(d)
    for key in PATH_KEYS:
        *parents, leaf = key.split(".")
        node = d
        for part in parents:
            if not isinstance(node.get(part), dict):
                break
            node[part] = node = dict(node[part])
        else:
            value = node.get(leaf)
            # a chat template given as its text (read_chat_template) is no path: its `$` and `~` are Jinja's
            if key == "model.chat_template" and isinstance(value, str) and ("{%" in value or "{{" in value):
                continue
            if leaf in node:
                node[leaf] = expand_path(value, key)
    return d


@dataclass(frozen=True)
class ModelConfig:
    name: str = "qwen36_tiny"
    path: str | None = None
    dtype: str = "float32"
    # None: the model directory when it holds tokenizer files, else "byte" (resolved here, once)
    tokenizer: str | None = None
    # a Jinja chat template file (or its text) replacing the tokenizer's own
    chat_template: str | None = None
    # fields of the named shape's config replaced (verl's override_config), e.g. {num_hidden_layers: 8}: the shape
    # at a reduced depth, its per-layer patterns repeated
    override_config: dict[str, Any] | None = None

    def __post_init__(self):
        object.__setattr__(self, "tokenizer", resolve_tokenizer(self.tokenizer, self.path))
        if self.path is None and self.name not in MODEL_NAMES:
            raise ConfigError(f"model.name={self.name!r} is not a named model; valid: {MODEL_NAMES}")
        self._check_override()
        if self.path is not None and not (Path(self.path) / "config.json").exists():
            raise ConfigError(f"model.path={self.path!r} is not an HF model directory (no config.json)")
        if self.dtype not in DTYPES:
            raise ConfigError(f"model.dtype={self.dtype!r}; valid: {list(DTYPES)}")
        if self.path is not None:
            try:
                self.family_config()
            except KeyError as e:
                raise ConfigError(f"model.path={self.path!r}: its config.json lacks {e}") from None
            except (ValueError, TypeError) as e:
                raise ConfigError(f"model.path={self.path!r}: cannot use its config.json ({e})") from None

    def _check_override(self) -> None:
        if self.override_config is None:
            object.__setattr__(self, "override_config", {})
        if not isinstance(self.override_config, dict):
            raise ConfigError(f"model.override_config={self.override_config!r} must be a mapping of config fields, "
                              f"e.g. {{num_hidden_layers: 8}}")
        if not self.override_config:
            return
        if self.path is not None:
            raise ConfigError(f"model.override_config replaces fields of a named shape; model.path={self.path!r} "
                              f"is read from its config.json (edit that, or use a model.name)")
        # lists (as YAML gives them) are the configs' tuples
        overrides = {k: tuple(v) if isinstance(v, list) else v for k, v in self.override_config.items()}
        object.__setattr__(self, "override_config", overrides)
        problem = mismatch(type(family_of(self.name).configs[self.name]), overrides, "model.override_config")
        if problem:
            raise ConfigError(problem)
        # the family's named_config names an unknown field and its config checks the values
        try:
            self.family_config()
        except (ValueError, TypeError) as e:
            raise ConfigError(f"model.override_config={dict(overrides)}: {e}") from None

    def family_config(self):
        """(family spec, the family's model config) of the named shape, with model.override_config's fields, or
        of the HF directory's config.json."""
        if self.path is not None:
            return hf_model_config(self.path)
        spec = family_of(self.name)
        if not self.override_config:
            return spec, spec.configs[self.name]
        return spec, spec.named_config(self.name, **self.override_config)

    def max_positions(self) -> int:
        return self.family_config()[1].max_position_embeddings


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 1e-2
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    # the one clipping threshold: the strategy's (make_strategy), which finalizes gradients; None: no clipping
    max_grad_norm: float | None = 1.0
    # schedule.py: linear warmup over warmup_steps, then constant | linear | cosine towards lr * min_lr_ratio,
    # reached after the last step
    warmup_steps: int = 0
    schedule: str = "constant"
    min_lr_ratio: float = 0.0

    def __post_init__(self):
        if not 0 < self.lr < math.inf:
            raise ConfigError(f"optim.lr must be a finite number > 0, got {self.lr}")
        if not 0 <= self.weight_decay < math.inf:
            raise ConfigError(f"optim.weight_decay must be a finite number >= 0, got {self.weight_decay}")
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"optim.schedule={self.schedule!r}; valid: {sorted(SCHEDULES)}")
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ConfigError(f"optim.warmup_steps must be an integer >= 0, got {self.warmup_steps!r}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"optim.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ConfigError(f"optim.betas must be two numbers in [0, 1), got {list(self.betas)}")
        # <= 0 would turn every update around; inf is the same as null (no clipping)
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ConfigError(f"optim.max_grad_norm must be > 0 (null: no clipping), got {self.max_grad_norm}")


@dataclass(frozen=True)
class CheckpointConfig:
    every: int = 10
    keep: int = 2
    # false: no periodic and no final checkpoint (benchmarks); a preemption signal still writes one
    enabled: bool = True

    def __post_init__(self):
        if self.every < 0 or self.keep < 1:
            raise ConfigError(f"checkpoint.every must be >= 0 and keep >= 1, got every={self.every} keep={self.keep}")


REPLAY_ROUTING = ("auto", True, False, "measure")


def replay_routing_for(loss: str, setting: bool | str) -> bool | str:
    """rollout.replay_routing as the run takes it: a loss that reads no old log-probs (algo=sft) has no rollout
    routing to replay, and `auto` is off for it; on is refused in one line."""
    if get_loss(loss).needs_old:
        return setting
    if setting in (True, "measure"):
        raise ConfigError(f"rollout.replay_routing={str(setting).lower()} replays the routing of sampled responses; "
                          f"algo={loss} trains on given ones without old log-probs: use auto or false")
    return False


@dataclass(frozen=True)
class RolloutConfig:
    engine: str
    sampling: SamplingConfig
    vllm: VllmConfig | None = None
    native: NativeConfig = NativeConfig()
    # routing replay (models/glm52/routing.py): each response token's experts and DSA selection recorded at
    # rollout and forced in scoring and replay. auto: on for families that route (MoE, DSA); measure: recorded and
    # the flips counted, nothing forced; false: neither (today's numbers bit for bit)
    replay_routing: bool | str = "auto"

    def __post_init__(self):
        if self.replay_routing not in REPLAY_ROUTING or (self.replay_routing in (0, 1)
                                                         and not isinstance(self.replay_routing, bool)):
            raise ConfigError(f"rollout.replay_routing={self.replay_routing!r}; valid: [auto, true, false, measure]")


@dataclass(frozen=True)
class LoggerConfig:
    backends: tuple[str, ...] = ("console", "jsonl")
    wandb: WandbConfig | None = None
    # rank 0's live display of the step's phases and the ETA; None: when the console is a terminal
    progress: bool | None = None
    # without the live display: a line each heartbeat_s seconds a phase runs (0: none)
    heartbeat_s: float = 60.0
    # responses a step logged with their prompt's tail and reward (telemetry/samples.py; 0: none)
    samples: int = 2


@dataclass(frozen=True)
class TrainConfig:
    model: ModelConfig
    task: TaskConfig
    reward: str | None
    loss: LossConfig
    transaction: TransactionConfig
    rollout: RolloutConfig
    logger: LoggerConfig
    optim: OptimConfig
    lora: LoraConfig
    checkpoint: CheckpointConfig
    strategy: StrategyConfig = StrategyConfig()
    # capture.reuse_steps / max_drift / probe_responses / probe_tokens (reuse.py)
    reuse: ReuseConfig = ReuseConfig()
    # which kernel each op runs (longstraw_kernels/config.py); the trainer puts it in force
    kernels: KernelConfig = KernelConfig()
    cp: int = 1
    ep: int = 1
    group_size: int = 8
    steps: int = 30
    prompt_tokens: int = 1024
    response_tokens: int = 16
    seed: int = 0
    device: str = "cpu"
    run_dir: str = "runs/local"
    # true: continue run_dir's newest checkpoint (run_dir must exist: cli.py); auto: continue where there is one
    resume: bool | Literal["auto"] = False
    export_hf: bool = False
    # rl/reward_adapters.py: how the reward is called (auto | native | verl | trl)
    reward_style: str = "auto"
    # prompts whose gradients accumulate before one optimizer step (per data-parallel rank)
    prompts_per_step: int = 1
    # the run stops when this many steps in a row were not applied (non-finite loss or gradient norm; safety/guard.py)
    max_nonfinite_steps: int = 3
    # how long a collective may wait for the other ranks before the run stops with one line (safety/watchdog.py)
    dist_timeout_s: float = 1800.0
    # Triton's and torch.compile's caches, kept across launches (compile_cache.py): None: $XDG_CACHE_HOME/longstraw
    # (~/.cache/longstraw); a directory; False: left as Triton and torch set them
    compile_cache_dir: str | bool | None = None
    # the keys the user set (cli.py: Hydra's overrides), so that a notice names only what was asked for; not part
    # of the run's config (as_dict leaves it out: a resumed run sets other keys)
    set_keys: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "set_keys"}


def _take(node: dict, where: str, allowed: set[str]) -> dict:
    unknown = sorted(set(node) - allowed)
    if unknown:
        raise ConfigError(f"unknown key(s) {unknown} in {where}; valid: {sorted(allowed)}")
    return node


def _build(cls, node: dict, where: str, **extra):
    """cls(**node) for a dataclass, with unknown keys and bad values reported as ConfigError."""
    fields = {f.name for f in dataclasses.fields(cls)}
    _take(node, where, fields - set(extra))
    _check_types(cls, node, where)
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in node.items()}
    try:
        return cls(**values, **extra)
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{where}: {e}") from None


def _check_types(cls, node: dict, where: str) -> None:
    problem = mismatch(cls, node, where)
    if problem:
        raise ConfigError(problem)


def _positive(name: str, value: Any, minimum: int = 1) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _check_recomputed(d: dict, strategy: str, world_size: int, setting: str, reduces: str, recomputes: str) -> None:
    """A setting whose backwards run outside the strategy's replay (so gradients are reduced after them: ddp only
    with data parallelism) and which computes something twice (so dropout, a fresh mask each time, must be off):
    capture.gradient=exact (the walk recomputes the prompt) and capture.replay_block (each response block runs
    graph-free, then with autograd). Context and expert parallel run both."""
    if world_size // d["cp"] > 1 and strategy != "ddp":
        raise ConfigError(f"{setting} reduces gradients after {reduces}: strategy=ddp only with data parallelism; "
                          f"got strategy={strategy!r}")
    dropout = d.get("lora", {}).get("dropout", 0.0)
    if dropout:
        raise ConfigError(f"{setting} {recomputes}, which dropout would change: needs lora.dropout=0, got "
                          f"lora.dropout={dropout!r}")


def train_config(d: dict, world_size: int | None = None, set_keys: tuple[str, ...] = ()) -> TrainConfig:
    """TrainConfig from the resolved container of the composed config (hydra node removed); `set_keys`: the keys
    the user set."""
    d = expand_paths(d)
    d.pop("hydra", None)
    top = {f.name for f in dataclasses.fields(TrainConfig)} - {"loss", "transaction", "reward", "reward_style",
                                                                "reuse", "set_keys"}
    _take(d, "the config", top | {"algo", "capture"})
    for name in ("prompt_tokens", "response_tokens"):
        d[name] = parse_tokens(d[name], name)
    advantage = d["algo"].get("advantage", "grpo")
    try:
        # a group-relative advantage needs two responses; algo=sft's weights take one
        least_group = min_group_size(advantage)
    except ValueError as e:
        raise ConfigError(f"algo.advantage: {e}") from None
    for name in ("cp", "ep", "group_size", "steps", "prompt_tokens", "response_tokens", "prompts_per_step",
                 "max_nonfinite_steps"):
        _positive(name, d[name], least_group if name == "group_size" else 1)
    _check_types(TrainConfig, {k: v for k, v in d.items() if not isinstance(v, dict)}, "")
    if not 0 < d["dist_timeout_s"] < math.inf:
        raise ConfigError(f"dist_timeout_s must be a finite number of seconds > 0, got {d['dist_timeout_s']}")
    world_size = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size
    try:
        ParallelDims(world_size, cp=d["cp"], ep=d["ep"])
    except ValueError as e:
        raise ConfigError(str(e)) from None
    model_name = str(d["model"].get("name", ""))
    # a model.path's family is known once its config.json is read (ModelConfig below); a bad name is its error
    family = family_of(model_name) if d["model"].get("path") is None and model_name in MODEL_NAMES else None
    if d["ep"] > 1 and family is not None and family.expert_parallel is None:
        with_experts = [spec for spec in families() if spec.expert_parallel is not None]
        raise ConfigError(f"ep={d['ep']} splits routed experts, but model {model_name!r} has none; use ep=1, or a "
                          f"{' / '.join(s.name for s in with_experts)} model "
                          f"({', '.join(name for s in with_experts for name in s.configs)})")
    if d["ep"] > 1 and d["rollout"].get("engine") == "vllm":
        # each rank's engine is pushed every weight (rollout/vllm_engine.py), and a rank holds only its experts
        raise ConfigError(f"rollout=vllm loads every routed expert into each rank's engine, but ep={d['ep']} leaves "
                          f"a rank only its share; use rollout=native (expert parallel decode) or ep=1")
    strategy = d.get("strategy", {}).get("name", "ddp") if isinstance(d.get("strategy"), dict) else "ddp"
    if d["ep"] > 1 and strategy != "ddp":
        raise ConfigError(f"ep={d['ep']} runs with strategy=ddp only (fsdp2 and deepspeed do not know the expert "
                          f"slices); got strategy={strategy!r}")
    device = str(d["device"])
    if device.split(":")[0] not in ("cpu", "cuda"):
        raise ConfigError(f"device={device!r}; valid: ['cpu', 'cuda', 'cuda:N']")
    _check_device(device)
    if d["run_dir"] is not None and Path(d["run_dir"]).exists() and not Path(d["run_dir"]).is_dir():
        raise ConfigError(f"run_dir={d['run_dir']!r} is a file, not a directory")
    refused = compile_cache_refusal(d.get("compile_cache_dir"))
    if refused:
        raise ConfigError(refused)

    model = _build(ModelConfig, d["model"], "model")
    if d["prompt_tokens"] + d["response_tokens"] > model.max_positions():
        raise ConfigError(
            f"prompt_tokens={d['prompt_tokens']} + response_tokens={d['response_tokens']} exceeds the model's "
            f"{model.max_positions()} positions (model={model.path or model.name})"
        )
    lora = _build(LoraConfig, d["lora"], "lora")
    _check_quantize(lora, model)
    task_node = dict(d["task"])
    reward = task_node.pop("reward", None)
    reward_style = task_node.pop("reward_style", "auto")
    if reward_style not in REWARD_STYLES:
        raise ConfigError(f"task.reward_style={reward_style!r}; valid: {list(REWARD_STYLES)}")
    engine = d["rollout"].get("engine")
    if engine not in ENGINES:
        raise ConfigError(f"rollout.engine={engine!r}; valid: {list(ENGINES)}")
    task = _build(TaskConfig, task_node, "task", prompt_tokens=d["prompt_tokens"], seed=d["seed"],
                  given_responses=engine == "data", given_rewards=reward is None)
    algo = dict(d["algo"])
    algo.pop("advantage", None)
    loss = _build(LossConfig, algo, "algo", max_response_tokens=d["response_tokens"])
    _check_pairing(loss.name, advantage, engine, task.name)
    if engine == "data" and reward is not None and task.reward_key is not None:
        raise ConfigError(f"task.reward={reward} computes the rewards and task.reward_key={task.reward_key} reads "
                          f"them from the file: set one (without either, a file's rewards column is read)")
    capture = _take(dict(d["capture"]), "capture", {"block_size", "score_batch", "logprob_chunk", "gradient",
                                                   "walk_checkpoint", "reuse_steps", "max_drift", "probe_responses",
                                                   "probe_tokens", "offload", "replay_block"})
    reuse = _build(ReuseConfig, {k: capture.pop(k) for k in ("reuse_steps", "max_drift", "probe_responses",
                                                             "probe_tokens") if k in capture}, "capture")
    optim = _build(OptimConfig, d["optim"], "optim")
    transaction = _build(TransactionConfig, capture, "capture", advantage=advantage)
    if transaction.exact:
        _check_recomputed(d, strategy, world_size, "capture.gradient=exact", "the prompt's walk",
                          "recomputes the prompt")
    if transaction.replay_block:
        _check_recomputed(d, strategy, world_size, "capture.replay_block", "the blockwise replays",
                          "computes each response block twice")
    refused = refusal(reuse, gradient=transaction.gradient, engine=engine,
                      prompts_per_step=d["prompts_per_step"])
    if refused:
        raise ConfigError(refused)
    refused = offload_refusal(transaction.offload, gradient=transaction.gradient)
    if refused:
        raise ConfigError(refused)

    rollout_node = dict(d["rollout"])
    rollout_node.pop("engine")
    vllm_node = rollout_node.pop("vllm", None)
    native_node = rollout_node.pop("native", None)
    replay_routing = rollout_node.pop("replay_routing", "auto")
    if replay_routing in REPLAY_ROUTING:
        replay_routing = replay_routing_for(loss.name, replay_routing)
    native = _build(NativeConfig, native_node, "rollout.native") if native_node is not None else NativeConfig()
    sampling = _build(SamplingConfig, rollout_node, "rollout", max_new_tokens=d["response_tokens"])
    if native.offload_copy_gib != "auto" and transaction.offload == "none":
        raise ConfigError(f"rollout.native.offload_copy_gib={native.offload_copy_gib} caps the copies of offloaded "
                          f"pages: needs capture.offload=cpu, got capture.offload=none")
    if native.nf4_cache is True and lora.quantize != "nf4":
        raise ConfigError(f"rollout.native.nf4_cache=true caches dequantised NF4 weights: needs lora.quantize=nf4, "
                          f"got lora.quantize={lora.quantize}")
    vllm = _build(VllmConfig, vllm_node, "rollout.vllm") if vllm_node is not None else None
    if engine == "vllm" and vllm is None:
        vllm = VllmConfig()

    logger_node = dict(d["logger"])
    backends = tuple(logger_node.pop("backends", ("console", "jsonl")))
    bad = [b for b in backends if b not in BACKENDS]
    if bad:
        raise ConfigError(f"logger.backends has {bad}; valid: {list(BACKENDS)}")
    wandb_node = logger_node.pop("wandb", None)
    progress = logger_node.pop("progress", None)
    if progress not in (None, True, False):
        raise ConfigError(f"logger.progress={progress!r}; valid: [null (on a terminal), true, false]")
    heartbeat_s = logger_node.pop("heartbeat_s", LoggerConfig.heartbeat_s)
    if isinstance(heartbeat_s, bool) or not isinstance(heartbeat_s, (int, float)) or heartbeat_s < 0:
        raise ConfigError(f"logger.heartbeat_s={heartbeat_s!r}; valid: a number of seconds >= 0 (0: no heartbeat)")
    samples = logger_node.pop("samples", LoggerConfig.samples)
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 0:
        raise ConfigError(f"logger.samples={samples!r}; valid: an integer >= 0 (responses logged a step; 0: none)")
    _take(logger_node, "logger", set())
    wandb = _build(WandbConfig, wandb_node, "logger.wandb") if wandb_node is not None else None

    return TrainConfig(
        model=model, task=task, reward=reward, loss=loss, transaction=transaction,
        rollout=RolloutConfig(engine, sampling, vllm, native, replay_routing),
        logger=LoggerConfig(backends, wandb, progress, float(heartbeat_s), samples),
        optim=optim,
        lora=lora, checkpoint=_build(CheckpointConfig, d["checkpoint"], "checkpoint"),
        strategy=_build(StrategyConfig, d["strategy"], "strategy"), reuse=reuse,
        kernels=_kernels(d.get("kernels", {})),
        cp=d["cp"], ep=d["ep"], group_size=d["group_size"], steps=d["steps"], prompt_tokens=d["prompt_tokens"],
        response_tokens=d["response_tokens"], seed=d["seed"], device=device, run_dir=str(d["run_dir"]),
        resume=d["resume"], export_hf=d["export_hf"], reward_style=reward_style,
        prompts_per_step=d["prompts_per_step"], max_nonfinite_steps=d["max_nonfinite_steps"],
        dist_timeout_s=float(d["dist_timeout_s"]), compile_cache_dir=d.get("compile_cache_dir"),
        set_keys=tuple(set_keys),
    )


def _check_pairing(loss: str, advantage: str, engine: str, task: str) -> None:
    """The algorithm, its advantage estimator, the rollout and the task go together (one line where they do not):
    a loss takes advantages of its kind; algo=sft trains on given responses; rollout=data reads a file task's."""
    takes = get_loss(loss).takes
    if advantage_kind(advantage) != takes:
        valid = sorted(n for n in ADVANTAGE_REGISTRY if advantage_kind(n) == takes)
        raise ConfigError(f"algo.advantage={advantage} is a {advantage_kind(advantage)}; algo={loss} takes a {takes}: "
                          f"valid: {valid}")
    if not get_loss(loss).needs_old and engine in ("native", "vllm"):
        raise ConfigError(f"algo={loss} trains on given responses, not sampled ones: needs rollout=data (or "
                          f"rollout=synthetic, for benchmarks); got rollout={engine}")
    if engine == "data" and (task not in TASKS or TASKS[task].uses_prompt_tokens):
        files = sorted(name for name, cls in TASKS.items() if not cls.uses_prompt_tokens)
        raise ConfigError(f"rollout=data reads responses from the task's rows: needs a file task; valid: "
                          f"{[f'task={name}' for name in files]}; got task={task}")


def _kernels(node: dict) -> KernelConfig:
    """The kernels section: its own line for a bad choice (`kernels.mla='cuda'; valid: [...]`)."""
    _take(node, "kernels", {f.name for f in dataclasses.fields(KernelConfig)})
    _check_types(KernelConfig, node, "kernels")
    try:
        return KernelConfig(**node)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _check_quantize(lora: LoraConfig, model: ModelConfig) -> None:
    """lora.quantize=nf4: a dtype it runs in, and torchao importable (one line each)."""
    if lora.quantize == "none":
        return
    refused = dtype_refusal(lora.quantize, model.dtype)
    if refused:
        raise ConfigError(refused)
    try:
        torchao_nf4()
    except ImportError as e:
        raise ConfigError(str(e)) from None


def _check_device(device: str) -> None:
    """A CUDA device this process can use, or a ConfigError naming the choices it has."""
    if not device.startswith("cuda"):
        return
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    valid = ["cpu"] + (["cuda"] + [f"cuda:{i}" for i in range(count)] if count else [])
    index = device.partition(":")[2]
    if count == 0 or (index and not (index.isdigit() and int(index) < count)):
        raise ConfigError(f"device={device!r}, but this process sees {count} CUDA device(s); valid: {valid}")
