"""vLLM rollout engine: HF-named weights (LoRA merged), request/response mapping, and the engine's call order
against a stand-in `vllm` module. The one test that runs real vLLM skips where vLLM is not importable."""

import dataclasses
import math
import os
import sys
import types
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import randomize_, rel_err
from longstraw_cli.models import build_model
from longstraw_cli.rollout.native import Rollout, SamplingConfig
from longstraw_cli.rollout.vllm_engine import (
    SAMPLING_FIELDS,
    VllmConfig,
    VllmEngine,
    build_requests,
    hf_weights,
    parse_outputs,
)

TINY_HF = dict(
    vocab_size=259, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
    linear_value_head_dim=16,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
)


def tiny_model(seed: int = 0, **overrides) -> nn.Module:
    model = build_model("qwen36_tiny", seed=seed, **overrides)
    randomize_(model, seed=seed)
    return model.eval()


def hf_model(**overrides):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen3_5TextConfig(**{**TINY_HF, **overrides})
    return transformers.Qwen3_5ForCausalLM(cfg).eval()


# -- weights ------------------------------------------------------------------------------------------------------
def test_hf_weights_load_strictly_into_transformers_and_give_the_same_logits():
    ours = tiny_model()
    hf = hf_model()
    weights = dict(hf_weights(ours))
    reference = hf.state_dict()
    assert set(weights) == set(reference)
    for name, tensor in weights.items():
        assert tensor.shape == reference[name].shape, name
    hf.load_state_dict(weights, strict=True)
    ids = torch.randint(0, 259, (1, 97), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        err = (ours(ids) - hf(ids).logits).abs().max().item()
    assert err <= 1e-4


def test_tied_lm_head_is_skipped():
    names = [name for name, _ in hf_weights(tiny_model(tie_word_embeddings=True))]
    assert "lm_head.weight" not in names
    assert set(names) == {name for name, _ in hf_weights(tiny_model())} - {"lm_head.weight"}


class StandInLora(nn.Module):
    """A LoRA-wrapped linear as a trainer might write one: frozen W (own or under `base_layer`), A [r, in],
    B [out, r] as parameters or as Linear modules, and `scaling` or `alpha` (/ rank)."""

    def __init__(self, base: nn.Linear, rank: int, variant: str, generator: torch.Generator):
        super().__init__()
        a = torch.randn(rank, base.in_features, generator=generator) * 0.3
        b = torch.randn(base.out_features, rank, generator=generator) * 0.3
        if variant == "base_layer":
            self.base_layer = base
        else:
            self.weight = base.weight
        if variant == "modules":
            self.lora_A = nn.Linear(base.in_features, rank, bias=False)
            self.lora_B = nn.Linear(rank, base.out_features, bias=False)
            with torch.no_grad():
                self.lora_A.weight.copy_(a)
                self.lora_B.weight.copy_(b)
            self.alpha, self.rank = 8.0, rank
        else:
            self.lora_A, self.lora_B = nn.Parameter(a), nn.Parameter(b)
            self.scaling = 0.7

    def scale(self) -> float:
        return self.scaling if hasattr(self, "scaling") else self.alpha / self.rank

    def matrices(self):
        a = self.lora_A.weight if isinstance(self.lora_A, nn.Module) else self.lora_A
        b = self.lora_B.weight if isinstance(self.lora_B, nn.Module) else self.lora_B
        return a, b

    def forward(self, x):
        w = self.base_layer.weight if hasattr(self, "base_layer") else self.weight
        a, b = self.matrices()
        return F.linear(x, w) + self.scale() * F.linear(F.linear(x, a), b)


WRAPPED = ("model.layers.0.linear_attn.in_proj_qkv", "model.layers.3.self_attn.q_proj", "model.layers.5.mlp.down_proj")


def wrap_lora(model: nn.Module, variant: str) -> dict[str, StandInLora]:
    g = torch.Generator().manual_seed(7)
    wrapped = {}
    for path in WRAPPED:
        parent_path, _, leaf = path.rpartition(".")
        parent = model.get_submodule(parent_path)
        wrapped[path] = StandInLora(getattr(parent, leaf), rank=4, variant=variant, generator=g)
        setattr(parent, leaf, wrapped[path])
    return wrapped


@pytest.mark.parametrize("variant", ["parameters", "modules", "base_layer"])
def test_lora_is_merged_under_the_base_name(variant):
    plain_names = {name for name, _ in hf_weights(tiny_model())}
    model = tiny_model()
    wrapped = wrap_lora(model, variant)
    merged = dict(hf_weights(model))
    assert set(merged) == plain_names
    assert not [n for n in merged if "lora" in n or "base_layer" in n]
    for path, module in wrapped.items():
        a, b = module.matrices()
        w = module.base_layer.weight if variant == "base_layer" else module.weight
        assert rel_err(merged[path + ".weight"], w + module.scale() * b @ a) < 1e-6
    unmerged = dict(hf_weights(model, merge_lora=False))
    assert set(unmerged) == plain_names
    for path, module in wrapped.items():
        w = module.base_layer.weight if variant == "base_layer" else module.weight
        assert torch.equal(unmerged[path + ".weight"], w)


def test_merged_lora_weights_reproduce_the_adapted_model_in_transformers():
    ours = tiny_model()
    wrap_lora(ours, "parameters")
    hf = hf_model()
    hf.load_state_dict(dict(hf_weights(ours)), strict=True)
    ids = torch.randint(0, 259, (1, 64), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        err = (ours(ids) - hf(ids).logits).abs().max().item()
        unadapted = (ours(ids) - tiny_model()(ids)).abs().max().item()
    assert err <= 1e-4
    assert unadapted > 1e-2, "the adapters must change the model, or the comparison proves nothing"


# -- requests -----------------------------------------------------------------------------------------------------
def test_every_sampling_field_has_a_vllm_counterpart():
    assert set(SAMPLING_FIELDS) == {f.name for f in dataclasses.fields(SamplingConfig)}


def test_build_requests_maps_sampling_config():
    sampling = SamplingConfig(temperature=0.7, top_p=0.9, max_new_tokens=33, stop_token_ids=(258, 5))
    prompt, kwargs = build_requests(torch.tensor([3, 1, 4, 1, 5]), 4, sampling, seed=11)
    assert prompt == {"prompt_token_ids": [3, 1, 4, 1, 5]}
    assert all(type(t) is int for t in prompt["prompt_token_ids"])
    assert kwargs == dict(n=4, temperature=0.7, top_p=0.9, max_tokens=33, stop_token_ids=[258, 5], seed=11,
                          logprobs=0, ignore_eos=True, detokenize=False)
    assert build_requests([3, 1, 4, 1, 5], 4, sampling, seed=11) == (prompt, kwargs)


def test_build_requests_greedy():
    _, kwargs = build_requests([1, 2], 8, SamplingConfig(temperature=0.0, top_p=0.5, max_new_tokens=4), seed=0)
    assert kwargs["temperature"] == 0.0 and isinstance(kwargs["temperature"], float)
    # vLLM refuses n > 1 when greedy: one response is asked for, the engine repeats it
    assert kwargs["n"] == 1 and kwargs["top_p"] == 1.0


@pytest.mark.parametrize("prompt, n, match", [([], 2, "empty"), (torch.zeros(2, 3, dtype=torch.long), 2, "1-D"),
                                              ([1], 0, "n must be")])
def test_build_requests_rejects(prompt, n, match):
    with pytest.raises(ValueError, match=match):
        build_requests(prompt, n, SamplingConfig(), seed=0)


# -- outputs ------------------------------------------------------------------------------------------------------
def lp(x: float):
    return SimpleNamespace(logprob=x, rank=1, decoded_token=None)


def completion(index, tokens, logps, extra=None):
    entries = [{t: lp(x)} | ({99: lp(-9.0)} if extra else {}) for t, x in zip(tokens, logps)]
    return SimpleNamespace(index=index, token_ids=tuple(tokens), logprobs=entries, text="")


def test_parse_outputs_orders_truncates_and_types():
    out = SimpleNamespace(outputs=[
        completion(1, [7, 8, 9], [-0.1, -0.2, -0.3]),
        completion(0, [5, 258, 6, 258], [-0.5, -0.25, -1.0, -2.0], extra=True),
    ])
    rollout = parse_outputs(out, stop_token_ids=(258,))
    assert isinstance(rollout, Rollout)
    assert [r.tolist() for r in rollout.responses] == [[5, 258], [7, 8, 9]]
    assert [r.dtype for r in rollout.responses] == [torch.long, torch.long]
    assert [x.dtype for x in rollout.logprobs] == [torch.float32, torch.float32]
    assert torch.allclose(rollout.logprobs[0], torch.tensor([-0.5, -0.25]))
    assert torch.allclose(rollout.logprobs[1], torch.tensor([-0.1, -0.2, -0.3]))


def test_parse_outputs_takes_plain_float_logprobs_and_refuses_missing_ones():
    plain = SimpleNamespace(outputs=[SimpleNamespace(token_ids=[4, 2], logprobs=[{4: -1.5}, {2: -0.5}])])
    assert parse_outputs(plain, ()).logprobs[0].tolist() == [-1.5, -0.5]
    with pytest.raises(ValueError, match="logprobs=0"):
        parse_outputs(SimpleNamespace(outputs=[SimpleNamespace(token_ids=[4], logprobs=None)]), ())
    with pytest.raises(ValueError, match="sampled token 4"):
        parse_outputs(SimpleNamespace(outputs=[SimpleNamespace(token_ids=[4], logprobs=[{3: -1.0}])]), ())


# -- config -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, match", [
    (dict(gpu_memory_utilization=0.0), "gpu_memory_utilization"), (dict(gpu_memory_utilization=1.5), "gpu_memory"),
    (dict(tensor_parallel_size=0), "tensor_parallel_size"), (dict(dtype="fp8"), "bfloat16"),
    (dict(max_model_len=0), "max_model_len"),
])
def test_vllm_config_validates(kwargs, match):
    with pytest.raises(ValueError, match=match):
        VllmConfig(**kwargs)


# -- engine -------------------------------------------------------------------------------------------------------
def test_engine_without_vllm_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(ImportError, match=r"pip install longstraw\[vllm\]"):
        VllmEngine("/nonexistent", VllmConfig())


class StandInVllmModel(nn.Module):
    """What vLLM's model runner holds, reduced to `load_weights` over HF names returning the loaded names."""

    def __init__(self, skip: str | None = None):
        super().__init__()
        self.inner = tiny_model(seed=3)
        self.skip = skip

    def named_parameters(self, *args, **kwargs):
        return self.inner.named_parameters(*args, **kwargs)

    @torch.no_grad()
    def load_weights(self, weights):
        params, loaded = dict(self.inner.named_parameters()), set()
        for name, tensor in weights:
            if name != self.skip:
                params[name].copy_(tensor)
                loaded.add(name)
        return loaded


class StandInLLM:
    """Records what VllmEngine asks of vllm.LLM; generates fixed responses."""

    instances: list = []

    def __init__(self, **kwargs):
        self.kwargs, self.calls, self.requests = kwargs, [], []
        self.model = StandInVllmModel()
        worker = SimpleNamespace(model_runner=SimpleNamespace(model=self.model))
        self.llm_engine = SimpleNamespace(model_executor=SimpleNamespace(driver_worker=SimpleNamespace(worker=worker)))
        StandInLLM.instances.append(self)

    def generate(self, prompts, sampling_params, use_tqdm=True):
        self.requests.append((prompts, sampling_params.kwargs))
        n = sampling_params.kwargs["n"]
        return [SimpleNamespace(outputs=[completion(i, [10 + i, 258, 11], [-0.5, -0.1, -0.2]) for i in range(n)])]

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tuple(tags)))

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))


@pytest.fixture
def stand_in_vllm(monkeypatch):
    module = types.ModuleType("vllm")
    module.LLM = StandInLLM
    module.SamplingParams = lambda **kwargs: SimpleNamespace(kwargs=kwargs)
    monkeypatch.setitem(sys.modules, "vllm", module)
    # the engine sets these process-wide; monkeypatch restores them
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "29555", "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}.items():
        monkeypatch.setenv(key, value)
    StandInLLM.instances.clear()
    return module


def test_engine_call_order_against_a_stand_in_vllm(stand_in_vllm):
    cfg = VllmConfig(gpu_memory_utilization=0.25, max_model_len=4096)
    engine = VllmEngine("/models/tiny", cfg)
    (llm,) = StandInLLM.instances
    assert llm.kwargs == dict(
        model="/models/tiny", dtype="bfloat16", gpu_memory_utilization=0.25, tensor_parallel_size=1,
        enforce_eager=True, max_model_len=4096, enable_sleep_mode=True,
        distributed_executor_backend="external_launcher", seed=0, skip_tokenizer_init=True,
        logprobs_mode="raw_logprobs",
    )
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"

    sampling = SamplingConfig(temperature=1.0, max_new_tokens=3, stop_token_ids=(258,))
    rollout = engine.generate([1, 2, 3], 3, sampling, seed=5)
    assert [r.tolist() for r in rollout.responses] == [[10, 258], [11, 258], [12, 258]]
    assert llm.requests[-1][0] == [{"prompt_token_ids": [1, 2, 3]}] and llm.requests[-1][1]["seed"] == 5

    engine.sleep()
    engine.sleep()  # idempotent
    assert llm.calls == [("sleep", 2)]
    with pytest.raises(RuntimeError, match="update_weights"):
        engine.generate([1, 2, 3], 2, sampling, seed=0)

    trainer = tiny_model(seed=4)
    engine.update_weights(trainer)
    assert llm.calls[1:] == [("wake_up", ("weights",)), ("reset_prefix_cache",)]
    for (name, pushed), (_, held) in zip(trainer.named_parameters(), llm.model.named_parameters()):
        assert torch.equal(pushed, held), name

    greedy_cfg = SamplingConfig(temperature=0.0, max_new_tokens=3, stop_token_ids=(258,))
    greedy = engine.generate([1, 2, 3], 4, greedy_cfg, seed=0)
    assert llm.calls[-1] == ("wake_up", ("kv_cache",))
    assert llm.requests[-1][1]["n"] == 1
    assert [r.tolist() for r in greedy.responses] == [[10, 258]] * 4


def test_engine_refuses_a_partial_weight_push(stand_in_vllm):
    engine = VllmEngine("/models/tiny", VllmConfig())
    StandInLLM.instances[0].model.skip = "model.norm.weight"
    with pytest.raises(RuntimeError, match="model.norm.weight"):
        engine.update_weights(tiny_model())


def test_engine_without_sleep_never_sleeps(stand_in_vllm):
    engine = VllmEngine("/models/tiny", VllmConfig(sleep_between_iterations=False))
    engine.sleep()
    (llm,) = StandInLLM.instances
    assert llm.kwargs["enable_sleep_mode"] is False and llm.calls == []
    engine.generate([1, 2], 2, SamplingConfig(max_new_tokens=3), seed=0)


# -- real vLLM (GPU machines with the extra installed) ------------------------------------------------------------
@pytest.mark.gpu
def test_real_vllm_engine_generates_and_takes_pushed_weights(tmp_path):
    pytest.importorskip("vllm")
    if not torch.cuda.is_available():
        pytest.skip("vLLM needs a GPU")
    ours = tiny_model()
    hf = hf_model(max_position_embeddings=4096)
    hf.load_state_dict(dict(hf_weights(ours)), strict=True)
    hf.save_pretrained(tmp_path)
    engine = VllmEngine(str(tmp_path), VllmConfig(gpu_memory_utilization=0.2, max_model_len=1024))
    prompt = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(0))
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=12, stop_token_ids=(258,))
    rollout = engine.generate(prompt, 4, sampling, seed=1)
    assert len(rollout.responses) == 4
    for response, logp in zip(rollout.responses, rollout.logprobs):
        assert 1 <= response.numel() <= 12 and logp.shape == response.shape
        assert torch.isfinite(logp).all() and (logp <= 0).all()
        # vLLM's bf16 log-probs track the trainer's own scoring of the same tokens
        ref = ours.logprobs(ours.capture(prompt), response)
        assert (logp - ref).abs().mean().item() < 0.1

    # a zero lm_head makes every token equally likely: the pushed weights must be the ones vLLM samples from
    engine.sleep()
    with torch.no_grad():
        ours.lm_head.weight.zero_()
    engine.update_weights(ours)
    rollout = engine.generate(prompt, 2, sampling, seed=2)
    for logp in rollout.logprobs:
        assert torch.allclose(logp, torch.full_like(logp, -math.log(259)), atol=1e-2)
