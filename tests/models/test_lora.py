"""LoRA: fresh adapters are a no-op, adapted = hand-merged weights, gradients reach adapters only, reference with
adapters off is the base model, and the merged HF export loads (ours and transformers') to the same logits."""

import copy
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import randomize_, rel_err
from longstraw_cli.export import export_hf
from longstraw_cli.lora import (
    DEFAULT_TARGETS,
    LoraConfig,
    LoraLinear,
    ReferencePolicy,
    adapters_disabled,
    apply_lora,
    load_lora_state_dict,
    lora_layers,
    lora_state_dict,
    merged_state_dict,
)
from longstraw_cli.models import build_model, from_pretrained
from longstraw_cli.models.qwen36.hf import config_from_hf, config_to_hf

# tiny: 6 GDN layers x (in_proj_qkv, in_proj_z, out_proj) + 2 attention x (q, k, v, o) + 8 MLPs x 3
NUM_TARGETED = 6 * 3 + 2 * 4 + 8 * 3


def tiny(dtype=torch.float64, seed=0, **overrides):
    model = build_model("qwen36_tiny", dtype=dtype, **overrides)
    randomize_(model, seed)
    return model


def tokens(n, seed):
    return torch.randint(0, 259, (n,), generator=torch.Generator().manual_seed(seed))


def randomize_adapters_(model, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in lora_layers(model).values():
            layer.lora_A.copy_(torch.randn(layer.lora_A.shape, generator=g) * 0.1)
            layer.lora_B.copy_(torch.randn(layer.lora_B.shape, generator=g) * 0.1)


def hand_merged(base, adapted):
    """A copy of `base` whose targeted weights are W + alpha/r * B @ A, written out here, not by lora.py."""
    merged = copy.deepcopy(base)
    params = dict(merged.named_parameters())
    with torch.no_grad():
        for name, layer in lora_layers(adapted).items():
            params[f"{name}.weight"] += (layer.alpha / layer.rank) * layer.lora_B @ layer.lora_A
    return merged


def test_fresh_adapters_are_an_exact_noop():
    base = tiny(torch.float32)
    model = copy.deepcopy(base)
    apply_lora(model, LoraConfig(rank=16))
    ids, prompt, response = tokens(40, 0), tokens(33, 1), tokens(12, 2)
    with torch.no_grad():
        assert torch.equal(model(ids), base(ids))
    got = model.logprobs(model.capture(prompt, block_size=8), response)
    assert torch.equal(got, base.logprobs(base.capture(prompt, block_size=8), response))


def test_swap_targets_keeps_names_and_freezes_base():
    model = tiny()
    names_before = {n: p for n, p in model.named_parameters()}
    params = apply_lora(model, LoraConfig(rank=4, alpha=8))
    layers = lora_layers(model)
    assert len(layers) == NUM_TARGETED and len(params) == 2 * NUM_TARGETED
    assert {name.split(".")[-1] for name in layers} == set(DEFAULT_TARGETS)
    # base weights: same Parameter objects under the same names, frozen
    after = dict(model.named_parameters())
    assert all(after[n] is p for n, p in names_before.items())
    assert set(after) - set(names_before) == {f"{n}.{k}" for n in layers for k in ("lora_A", "lora_B")}
    assert {id(p) for p in after.values() if p.requires_grad} == {id(p) for p in params}
    assert type(model.lm_head) is torch.nn.Linear
    assert type(model.model.layers[0].linear_attn.in_proj_a) is torch.nn.Linear
    layer = model.model.layers[3].self_attn.q_proj
    assert isinstance(layer, LoraLinear) and layer.lora_A.shape == (4, 64) and layer.lora_B.shape == (256, 4)
    assert layer.scaling == 2.0 and not layer.lora_B.any() and layer.lora_A.abs().sum() > 0


def test_adapted_model_equals_hand_merged_weights():
    base = tiny()
    model = copy.deepcopy(base)
    apply_lora(model, LoraConfig(rank=4, alpha=8))
    randomize_adapters_(model)
    merged = hand_merged(base, model)
    ids, prompt, response = tokens(50, 3), tokens(41, 4), tokens(15, 5)
    with torch.no_grad():
        got, ref = model(ids), merged(ids)
        assert rel_err(got, ref) < 1e-10
        # the adapters do something: far from the base model
        assert rel_err(base(ids), ref) > 1e-2
    got = model.logprobs(model.capture(prompt, block_size=16), response)
    ref = merged.logprobs(merged.capture(prompt, block_size=16), response)
    assert rel_err(got, ref) < 1e-10
    # merged_state_dict: the model's own names, no lora keys, the hand-merged weights
    sd = merged_state_dict(model)
    assert set(sd) == set(base.state_dict())
    ref_sd = merged.state_dict()
    assert max(rel_err(sd[k], ref_sd[k]) for k in sd) < 1e-14


def test_gradients_reach_adapters_only_and_optimizer_holds_adapters():
    model = tiny()
    params = apply_lora(model, LoraConfig(rank=4))
    randomize_adapters_(model)
    base_before = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n}
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    prompt, response = tokens(37, 6), tokens(11, 7)
    weights = torch.randn(11, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    (weights * model.logprobs(model.capture(prompt, block_size=8), response, grad=True)).sum().backward()
    for name, p in model.named_parameters():
        if "lora_" in name:
            assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name
        else:
            assert p.grad is None and not p.requires_grad, name
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    adapter_ids = {id(p) for n, p in model.named_parameters() if "lora_" in n}
    assert held == adapter_ids
    optimizer.step()
    for name, p in model.named_parameters():
        if "lora_" not in name:
            assert torch.equal(p, base_before[name]), name


def test_adapters_disabled_is_the_base_model():
    base = tiny(torch.float32)
    model = copy.deepcopy(base)
    apply_lora(model, LoraConfig(rank=8))
    randomize_adapters_(model)
    ids, prompt, response = tokens(30, 9), tokens(25, 10), tokens(9, 11)
    with torch.no_grad():
        adapted = model(ids)
        with adapters_disabled(model):
            assert torch.equal(model(ids), base(ids))
        assert torch.equal(model(ids), adapted)
        with pytest.raises(RuntimeError, match="boom"), adapters_disabled(model):
            raise RuntimeError("boom")
        assert all(layer.adapter_enabled for layer in lora_layers(model).values())
    ref = ReferencePolicy(model)
    got = ref.logprobs(ref.capture(prompt, block_size=8), response)
    assert torch.equal(got, base.logprobs(base.capture(prompt, block_size=8), response))
    with pytest.raises(ValueError, match="no LoRA adapters"), adapters_disabled(base):
        pass


@pytest.mark.parametrize("tie", [False, True])
def test_export_hf_round_trip(tmp_path, tie):
    model = tiny(torch.float32, tie_word_embeddings=tie)
    apply_lora(model, LoraConfig(rank=4, alpha=8))
    randomize_adapters_(model)
    out = tmp_path / "export"
    out.mkdir()
    (out / "stale.txt").write_text("replaced")
    assert export_hf(model, out) == out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    saved = load_file(out / "model.safetensors")
    assert not any("lora" in k for k in saved) and ("lm_head.weight" in saved) != tie
    hf_config = json.loads((out / "config.json").read_text())
    assert hf_config["model_type"] == "qwen3_5_text" and hf_config["architectures"] == ["Qwen3_5ForCausalLM"]
    assert config_from_hf(hf_config) == model.config

    ids = tokens(45, 12)
    merged = build_model("qwen36_tiny", tie_word_embeddings=tie)
    merged.load_state_dict(merged_state_dict(model))
    loaded = from_pretrained(out)
    with torch.no_grad():
        ref = merged(ids)
        assert torch.equal(loaded(ids), ref)
        assert rel_err(model(ids), ref) < 1e-5

    transformers = pytest.importorskip("transformers")
    hf = transformers.Qwen3_5ForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        err = (hf(ids[None]).logits[0] - ref).abs().max().item()
    assert err <= 1e-4


def test_config_to_hf_inverts_config_from_hf():
    for overrides in ({}, {"tie_word_embeddings": True, "partial_rotary_factor": 0.5, "full_attention_interval": 2}):
        cfg = build_model("qwen36_tiny", device="meta", **overrides).config
        assert config_from_hf(json.loads(json.dumps(config_to_hf(cfg)))) == cfg


def test_lora_state_dict_round_trip(tmp_path):
    base = tiny()
    model = copy.deepcopy(base)
    apply_lora(model, LoraConfig(rank=4))
    randomize_adapters_(model)
    sd = lora_state_dict(model)
    assert len(sd) == 2 * NUM_TARGETED and all(k.endswith((".lora_A", ".lora_B")) for k in sd)
    save_file({k: v.contiguous() for k, v in sd.items()}, str(tmp_path / "adapter.safetensors"))

    other = copy.deepcopy(base)
    apply_lora(other, LoraConfig(rank=4))
    load_lora_state_dict(other, load_file(tmp_path / "adapter.safetensors"))
    ids = tokens(30, 13)
    with torch.no_grad():
        assert torch.equal(other(ids), model(ids))

    key = "model.layers.0.mlp.up_proj.lora_A"
    with pytest.raises(ValueError, match="missing.*up_proj.lora_A"):
        load_lora_state_dict(other, {k: v for k, v in sd.items() if k != key})
    with pytest.raises(ValueError, match="unexpected.*extra.lora_A"):
        load_lora_state_dict(other, {**sd, "extra.lora_A": sd[key]})
    with pytest.raises(ValueError, match=r"up_proj.lora_A has shape \(2, 64\)"):
        load_lora_state_dict(other, {**sd, key: sd[key][:2]})


@pytest.mark.parametrize("kwargs, match", [
    (dict(rank=-1), "rank.*-1"),
    (dict(rank=2.0), "rank.*2.0"),
    (dict(rank=True), "rank.*True"),
    (dict(rank=4, alpha=0), "alpha.*0"),
    (dict(rank=4, alpha=float("nan")), "alpha.*nan"),
    (dict(rank=4, dropout=1.0), "dropout.*1.0"),
    (dict(rank=4, dropout=-0.1), r"dropout.*-0.1"),
    (dict(rank=4, target_modules="q_proj"), "target_modules.*'q_proj'.*in_proj_qkv"),
    (dict(rank=4, target_modules=("q_proj", "lm_head")), "'lm_head'.*never targeted"),
    (dict(rank=4, target_modules=("model.embed_tokens",)), "embed_tokens.*never targeted"),
    (dict(rank=4, target_modules=("q_proj", "q_proj")), r"\['q_proj'\] more than once"),
    (dict(rank=4, target_modules=()), "no target_modules"),
])
def test_bad_config_values_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LoraConfig(**kwargs)


def test_unknown_target_lists_the_linears_and_leaves_model_untouched():
    model = tiny()
    with pytest.raises(ValueError, match=r"\['qkv_proj'\].*in_proj_a.*in_proj_qkv"):
        apply_lora(model, LoraConfig(rank=2, target_modules=["q_proj", "qkv_proj"]))
    assert not lora_layers(model) and all(p.requires_grad for p in model.parameters())
    # a dotted suffix selects by path
    apply_lora(model, LoraConfig(rank=2, target_modules=["mlp.down_proj"]))
    assert len(lora_layers(model)) == 8
    with pytest.raises(ValueError, match="already has LoRA"):
        apply_lora(model, LoraConfig(rank=2))


def test_rank_zero_is_full_fine_tuning():
    model = tiny()
    params = apply_lora(model, LoraConfig())
    assert not lora_layers(model) and len(params) == len(list(model.parameters()))


def test_meta_device_and_fp32_adapters_on_bf16_base():
    meta = build_model("qwen36_tiny", device="meta")
    params = apply_lora(meta, LoraConfig(rank=16))
    assert all(p.is_meta for p in params)

    base = tiny(torch.bfloat16)
    model = copy.deepcopy(base)
    params = apply_lora(model, LoraConfig(rank=8), dtype=torch.float32)
    assert all(p.dtype == torch.float32 for p in params)
    ids = tokens(20, 14)
    with torch.no_grad():
        assert torch.equal(model(ids), base(ids))
    randomize_adapters_(model)
    model(ids).float().square().mean().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in params)
