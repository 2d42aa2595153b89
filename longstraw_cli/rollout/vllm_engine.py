"""Colocated vLLM rollout: vLLM's offline `LLM` lives in the trainer process, shares its GPU, and gets the
trainer's weights pushed in place before every rollout.

One iteration, as the trainer drives it:
    engine.update_weights(model)           # wakes the weights if asleep, loads hf_weights(model) in place
    rollout = engine.generate(prompt_ids, n, sampling, seed)
    engine.sleep()                         # frees weights + KV cache before capture / replay

What this simplifies, and why:
- The engine runs in-process under vLLM's `external_launcher` executor (what TRL's colocate mode uses): one
  worker per torchrun rank, no engine subprocess, so weights are pushed by a direct `model.load_weights` call
  on the local worker, one tensor at a time, with no copy through IPC. Every rank must build the engine (and
  call update_weights, which gathers DTensors) at the same time; with tensor_parallel_size > 1 all ranks of a
  TP group must also generate the same prompt with the same seed.
- Sleep is level 2: weights and KV cache are discarded rather than backed up in host memory (a 27B bf16 copy
  is 54 GB per rank), since update_weights overwrites every weight anyway. After sleep(), generate() refuses
  to run until update_weights() has been called again.
- The log-probs vLLM returns are those of its own bf16 kernels (engine built with logprobs_mode
  "raw_logprobs": log-softmax of the raw logits, before temperature and top-p, the quantity the native engine
  returns). They are not the trainer's numerics, so by default the trainer re-scores old log-probs graph-free
  from its own resident state and treats vLLM's as a diagnostic.
- Prompt and responses are token ids only; the engine is built with skip_tokenizer_init, so no tokenizer
  files are needed and nothing is detokenized. vLLM stops only at `stop_token_ids` and `max_tokens`
  (ignore_eos=True), the same rule as the native engine.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from longstraw_cli.export import take
from longstraw_cli.lora import merge_lora
from longstraw_cli.models.loading import expert_rows_by_param
from longstraw_cli.models.spec import family_of
from longstraw_cli.quantize import dense
from longstraw_cli.rollout.native import Rollout, SamplingConfig

DTYPES = ("bfloat16", "float16", "float32", "auto")
SLEEP_LEVEL = 2
INSTALL_HINT = "vLLM is an optional extra (GPU only): pip install longstraw[vllm]"

# SamplingConfig field -> vLLM SamplingParams field; a new SamplingConfig field must be mapped here.
SAMPLING_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "max_new_tokens": "max_tokens",
    "stop_token_ids": "stop_token_ids",
}

# Wrappers that insert a name component without changing the checkpoint name (torch.compile, activation
# checkpointing, FSDP1).
_WRAPPER_PARTS = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


@dataclass(frozen=True)
class VllmConfig:
    gpu_memory_utilization: float = 0.3
    tensor_parallel_size: int = 1
    enforce_eager: bool = True
    dtype: str = "bfloat16"
    sleep_between_iterations: bool = True
    max_model_len: int | None = None

    def __post_init__(self):
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if isinstance(self.tensor_parallel_size, bool) or not isinstance(self.tensor_parallel_size, int) \
                or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {self.tensor_parallel_size!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r}; valid: {list(DTYPES)}")
        if self.max_model_len is not None and (isinstance(self.max_model_len, bool)
                                               or not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            raise ValueError(f"max_model_len must be None or an integer >= 2, got {self.max_model_len!r}")


# -- weights ------------------------------------------------------------------------------------------------------
def _is_lora(module: nn.Module) -> bool:
    return hasattr(module, "lora_A") and hasattr(module, "lora_B")


def _only(x):
    """A single-adapter container (PEFT keeps {"default": ...}) -> its one value."""
    if isinstance(x, (dict, nn.ModuleDict)):
        if len(x) != 1:
            raise ValueError(f"cannot merge a LoRA module holding {len(x)} adapters; expected one")
        return next(iter(x.values()))
    return x


def _matrix(x) -> torch.Tensor:
    x = _only(x)
    return x.weight if isinstance(x, nn.Module) else x


def _gathered(t: torch.Tensor) -> torch.Tensor:
    # a sharded (FSDP2) parameter is gathered: a collective, so every rank must iterate together
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _full(t: torch.Tensor) -> torch.Tensor:
    # an NF4 base weight (lora.quantize=nf4) is dequantised
    return dense(_gathered(t))


def _base_owner(module: nn.Module) -> nn.Module:
    """The module holding a LoRA wrapper's frozen W: itself, or its `base_layer` (PEFT) or `base`."""
    for owner in (module, getattr(module, "base_layer", None), getattr(module, "base", None)):
        if owner is not None and isinstance(getattr(owner, "weight", None), torch.Tensor):
            return owner
    raise ValueError(f"LoRA module {type(module).__name__} has no base weight (weight, base_layer.weight, base.weight)")


def _lora_scale(module: nn.Module, rank: int) -> float:
    scaling = getattr(module, "scaling", None)
    if scaling is not None:
        return float(_only(scaling))
    alpha = getattr(module, "alpha", getattr(module, "lora_alpha", None))
    if alpha is None:
        raise ValueError(f"LoRA module {type(module).__name__} has neither `scaling` nor `alpha`")
    return float(_only(alpha)) / getattr(module, "rank", rank)


def merged_lora_weight(module: nn.Module) -> torch.Tensor:
    """W + scale * B @ A of a LoRA-wrapped linear (ours or PEFT's), in W's dtype (`lora.merge_lora`)."""
    w = _full(_base_owner(module).weight).detach()
    a, b = _full(_matrix(module.lora_A)).detach(), _full(_matrix(module.lora_B)).detach()
    return merge_lora(w, a, b, _lora_scale(module, a.shape[0]))


def hf_weights(model: nn.Module, *, merge_lora: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """The trainer's weights as (HF checkpoint name, tensor), one at a time, what vLLM's loader for the family's
    architecture reads (Qwen3.5 for qwen36, DeepseekV2's GlmMoeDsaForCausalLM for glm52).

    Names are the family's checkpoint keys (`HFAdapter.local_to_hf`) of ours with wrapper components removed (a
    DDP or DeepSpeed wrapper is looked through): qwen36's map one to one; glm52's 3-D expert tensors are cut into
    per-expert `mlp.experts.{e}.{gate,up,down}_proj.weight`, which vLLM's expert mapping stacks into its fused
    w13 / w2 (it also fuses q_a_proj + kv_a_proj_with_mqa, the MLPs' gate + up and the indexer's wk +
    weights_proj itself, from these names). Persistent buffers the checkpoint holds (glm52's router
    e_score_correction_bias, a vLLM parameter) are yielded too. A LoRA-wrapped linear (a module with
    `lora_A`/`lora_B`) yields one tensor under its base name `<prefix>.weight`: the merged W + scale * B @ A, or
    with merge_lora=False the base W; no `lora_*` name is ever yielded. A tied lm_head is skipped (vLLM ties it to
    embed_tokens itself). Tensors are detached views on the model's device, except merged ones and NF4 ones
    (dequantised; an expert tensor one expert at a time), which are computed one at a time.
    """
    # DDP and DeepSpeed engines hold the model as `.module`
    while isinstance(getattr(model, "module", None), nn.Module):
        model = model.module
    spec = family_of(model)
    config = model.config
    rows = {_clean(name): r for name, r in expert_rows_by_param(model).items()}
    tied = bool(getattr(config, "tie_word_embeddings", False))
    lora = {prefix: m for prefix, m in model.named_modules() if prefix and _is_lora(m)}
    done: set[str] = set()
    for raw_name, param in model.named_parameters():
        owner = next((p for p in lora if raw_name.startswith(p + ".")), None)
        if owner is None:
            name = _clean(raw_name)
            if tied and name == "lm_head.weight":
                continue
            for key, index in spec.hf.local_to_hf(name, config, rows.get(name)):
                yield key, take(_gathered(param), index).detach()
            continue
        if owner in done:
            continue
        done.add(owner)
        module, base = lora[owner], _base_owner(lora[owner])
        weight = merged_lora_weight(module) if merge_lora else _full(base.weight).detach()
        yield _clean(owner) + ".weight", weight
        if isinstance(getattr(base, "bias", None), torch.Tensor):
            yield _clean(owner) + ".bias", _full(base.bias).detach()
    persistent = set(model.state_dict())
    for raw_name, buffer in model.named_buffers():
        if raw_name in persistent:
            yield _clean(raw_name), buffer.detach()


def _clean(name: str) -> str:
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    return name


# -- requests and outputs -----------------------------------------------------------------------------------------
def build_requests(prompt_ids: list[int] | torch.Tensor, n: int, sampling: SamplingConfig,
                   seed: int) -> tuple[dict, dict]:
    """(token prompt, SamplingParams kwargs) for `n` responses to one prompt.

    logprobs=0 makes vLLM return the sampled token's log-prob only. With the engine's logprobs_mode
    "raw_logprobs" (vLLM V1's default) that is log-softmax of the raw logits, before temperature and top-p; a
    "processed_logprobs" engine would return it after them. Either way these are vLLM's numerics, so the
    trainer re-scores old log-probs graph-free from its own resident state by default.
    Temperature 0 is greedy (vLLM's temperature=0.0); vLLM refuses n > 1 with greedy sampling, so greedy asks
    for n=1 and VllmEngine.generate repeats the one response. With a seed, vLLM seeds child i with seed + i, so
    seeds of different prompts should be at least n apart.
    """
    if isinstance(prompt_ids, torch.Tensor):
        if prompt_ids.dim() != 1:
            raise ValueError(f"prompt_ids must be 1-D, got shape {tuple(prompt_ids.shape)}")
        prompt_ids = prompt_ids.tolist()
    prompt = [int(t) for t in prompt_ids]
    if not prompt:
        raise ValueError("prompt_ids is empty")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be an integer >= 1, got {n!r}")
    unmapped = {f.name for f in dataclasses.fields(sampling)} - set(SAMPLING_FIELDS)
    assert not unmapped, f"SamplingConfig fields {sorted(unmapped)} have no vLLM counterpart in SAMPLING_FIELDS"
    greedy = sampling.temperature == 0
    kwargs = {
        "n": 1 if greedy else n,
        "temperature": float(sampling.temperature),
        # greedy ignores top_p; some vLLM versions reject top_p < 1 with temperature 0
        "top_p": 1.0 if greedy else float(sampling.top_p),
        "max_tokens": int(sampling.max_new_tokens),
        "stop_token_ids": [int(t) for t in sampling.stop_token_ids],
        "seed": int(seed),
        "logprobs": 0,
        "ignore_eos": True,
        "detokenize": False,
    }
    return {"prompt_token_ids": prompt}, kwargs


def _sampled_logprob(entry, token: int) -> float:
    if token not in entry:
        raise ValueError(f"vLLM returned no log-prob for the sampled token {token} (has {list(entry)[:4]})")
    value = entry[token]
    return float(getattr(value, "logprob", value))


def parse_outputs(request_output, stop_token_ids) -> Rollout:
    """A vLLM RequestOutput (anything with `.outputs[i].token_ids` and `.outputs[i].logprobs`, a list of
    {token_id: Logprob}) -> Rollout; each response is cut after its first stop token (kept: it is trained)."""
    completions = list(request_output.outputs)
    completions.sort(key=lambda c: getattr(c, "index", 0))
    stops = {int(t) for t in stop_token_ids}
    responses, logprobs = [], []
    for completion in completions:
        tokens = [int(t) for t in completion.token_ids]
        cut = next((i + 1 for i, t in enumerate(tokens) if t in stops), len(tokens))
        tokens = tokens[:cut]
        if completion.logprobs is None:
            raise ValueError("vLLM returned no log-probs; the request must set logprobs=0 (see build_requests)")
        entries = list(completion.logprobs)[:cut]
        if len(entries) != len(tokens):
            raise ValueError(f"vLLM returned {len(entries)} log-probs for {len(tokens)} tokens")
        responses.append(torch.tensor(tokens, dtype=torch.long))
        logprobs.append(torch.tensor([_sampled_logprob(e, t) for e, t in zip(entries, tokens)], dtype=torch.float32))
    return Rollout(responses, logprobs)


# -- engine -------------------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launcher_env() -> dict[str, str]:
    """torchrun's variables that external_launcher reads, for a plain single-process run that lacks them."""
    defaults = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
    env = {k: v for k, v in defaults.items() if k not in os.environ}
    if "MASTER_PORT" not in os.environ:
        env["MASTER_PORT"] = str(_free_port())
    return env


def _runner_model(worker) -> nn.Module:
    # verl reaches it as driver_worker.worker.model_runner.model, TRL as driver_worker.model_runner.model (the
    # wrapper forwards attributes to its worker); both exist only when the engine core is in this process
    worker = getattr(worker, "worker", worker)
    return worker.model_runner.model


class VllmEngine:
    """vLLM's offline engine, colocated with the trainer; see the module docstring for the call order."""

    def __init__(self, model_dir: str, cfg: VllmConfig):
        try:
            import vllm
        except ImportError as e:
            raise ImportError(f"rollout.engine=vllm needs vLLM, which is not importable ({e}). {INSTALL_HINT}") from e
        self.cfg = cfg
        self._vllm = vllm
        os.environ.update(_launcher_env())
        # external_launcher runs the engine core in this process; it asserts multiprocessing is off
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        self._llm = vllm.LLM(
            model=str(model_dir),
            dtype=cfg.dtype,
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            tensor_parallel_size=cfg.tensor_parallel_size,
            enforce_eager=cfg.enforce_eager,
            max_model_len=cfg.max_model_len,
            enable_sleep_mode=cfg.sleep_between_iterations,
            distributed_executor_backend="external_launcher",
            # one seed for every rank: the ranks of a TP group must sample identically
            seed=0,
            skip_tokenizer_init=True,
            logprobs_mode="raw_logprobs",
        )
        self._asleep = {"weights": False, "kv_cache": False}
        # the engine starts with model_dir's weights; level-2 sleep discards them
        self._weights_valid = True

    def _wake(self, tags: list[str]) -> None:
        tags = [t for t in tags if self._asleep[t]]
        if not tags:
            return
        if torch.cuda.is_available():
            # the trainer's cached blocks are not vLLM's pool: return them before vLLM maps its memory
            torch.cuda.empty_cache()
        self._llm.wake_up(tags=tags)
        for t in tags:
            self._asleep[t] = False

    def wake_up(self) -> None:
        """Map weights and KV cache again. After sleep() the weights are garbage until update_weights()."""
        self._wake(["weights", "kv_cache"])

    def sleep(self) -> None:
        """Discard weights and KV cache (level 2) so capture and replay get the memory; a no-op when
        cfg.sleep_between_iterations is off (the engine then has no sleep mode)."""
        if not self.cfg.sleep_between_iterations or all(self._asleep.values()):
            return
        # vLLM sleeps every tagged allocation: map what a partial wake left unmapped before releasing it all
        self.wake_up()
        self._llm.sleep(level=SLEEP_LEVEL)
        self._asleep = {"weights": True, "kv_cache": True}
        self._weights_valid = False

    @torch.no_grad()
    def update_weights(self, model: nn.Module) -> None:
        """Load the trainer's weights (LoRA merged) into the running engine, in place, one tensor at a time."""
        # only the weights: the KV cache is mapped by generate(), once the trainer's transfer buffers are gone
        self._wake(["weights"])
        target = _runner_model(self._llm.llm_engine.model_executor.driver_worker)
        loaded = target.load_weights(hf_weights(model))
        # vLLM's Qwen3.5 loader skips unknown names with a warning: a name mismatch must not leave stale weights
        if loaded is not None:
            missing = sorted({name for name, _ in target.named_parameters()} - set(loaded))
            if missing:
                raise RuntimeError(f"update_weights left {len(missing)} vLLM parameters unloaded, e.g. {missing[:4]}")
        self._weights_valid = True
        # prefix-cache blocks computed with the old weights must not be reused
        self._llm.reset_prefix_cache()

    def generate(self, prompt_ids: list[int] | torch.Tensor, n: int, sampling: SamplingConfig,
                 seed: int) -> Rollout:
        """`n` responses to one prompt, each cut after its first stop token; CPU tensors."""
        if not self._weights_valid:
            raise RuntimeError("the engine slept at level 2 and discarded its weights; call update_weights(model) "
                               "before generate()")
        prompt, kwargs = build_requests(prompt_ids, n, sampling, seed)
        self._wake(["weights", "kv_cache"])
        (output,) = self._llm.generate([prompt], self._vllm.SamplingParams(**kwargs), use_tqdm=False)
        rollout = parse_outputs(output, sampling.stop_token_ids)
        if kwargs["n"] < n:
            # greedy: vLLM samples one response, all n are that response
            rollout = Rollout([rollout.responses[0].clone() for _ in range(n)],
                              [rollout.logprobs[0].clone() for _ in range(n)])
        if len(rollout.responses) != n:
            raise RuntimeError(f"vLLM returned {len(rollout.responses)} responses, asked for {n}")
        return rollout
