"""The model-family registry: every named config and HF model type maps to one family; unknown names are
ValueErrors naming the valid choices; the hooks a family names resolve."""

import dataclasses
import json

import pytest
import torch

from longstraw_cli.models import (
    MODEL_NAMES,
    build_model,
    config_from_hf,
    from_pretrained,
    hf_model_config,
)
from longstraw_cli.models.spec import (
    _resolve,
    config_with_overrides,
    families,
    family_of,
    family_of_hf,
    get_family,
    register_family,
)


def test_both_families_are_registered_by_name():
    assert [spec.name for spec in families()] == ["glm52", "qwen36"]
    assert MODEL_NAMES == sorted(name for spec in families() for name in spec.configs)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_every_named_config_maps_to_its_family(name):
    spec = family_of(name)
    assert name.startswith(spec.name) and spec.model_cls.family == spec.name
    assert spec.named_config(name) == spec.configs[name]


@pytest.mark.parametrize("name, field, least", [
    ("qwen36_tiny", "num_hidden_layers", 1), ("qwen36_tiny", "num_key_value_heads", 1), ("glm52_tiny", "index_topk", 1),
    ("glm52_tiny", "n_shared_experts", 0), ("glm52_tiny", "first_k_dense_replace", 0)])
def test_a_config_refuses_a_count_or_width_below_its_least(name, field, least):
    """Every integer field of a family config is a count or a width: >= 1, or >= 0 where none is a choice (glm52
    without shared experts or dense layers); a config.json or model.override_config may get one wrong."""
    spec = family_of(name)
    assert getattr(spec.named_config(name, **{field: least}), field) == least
    with pytest.raises(ValueError, match=f"^{field}={least - 1} must be >= {least}$"):
        spec.named_config(name, **{field: least - 1})


def test_a_model_maps_to_its_family_through_wrappers():
    model = build_model("glm52_tiny", seed=0)
    assert family_of(model) is get_family("glm52")
    wrapper = torch.nn.Module()
    wrapper.module = model
    assert family_of(wrapper) is get_family("glm52")


@pytest.mark.parametrize("call, message", [
    (lambda: family_of("qwen99"), "unknown model 'qwen99'; valid: ['glm52', 'glm52_mini'"),
    (lambda: get_family("llama"), "unknown model family 'llama'; valid: ['glm52', 'qwen36']"),
    (lambda: family_of(torch.nn.Linear(2, 2)), "unknown model family None; valid: ['glm52', 'qwen36']"),
    (lambda: build_model("glm53_tiny"), "unknown model 'glm53_tiny'; valid: "),
    (lambda: family_of_hf({"model_type": "llama"}),
     "model_type 'llama' is not a checkpoint LongStraw reads; valid: ['glm_moe_dsa', 'qwen3_5_text', 'qwen3_5']"),
    (lambda: config_with_overrides("qwen36", get_family("qwen36").configs, "qwen36_tiny", {"width": 3}),
     "unknown model override(s) ['width']"),
])
def test_unknown_names_are_value_errors_naming_the_valid_choices(call, message):
    with pytest.raises(ValueError) as e:
        call()
    assert message in str(e.value)


def test_hf_model_types_map_to_their_family():
    for spec in families():
        cfg = next(iter(spec.configs.values()))
        hf = spec.hf.config_to_hf(cfg)
        assert hf["model_type"] in spec.hf.model_types
        assert family_of_hf(hf) is spec and config_from_hf(hf) == spec.hf.config_from_hf(hf)


def test_registering_a_family_or_config_name_twice_is_refused():
    spec = get_family("qwen36")
    with pytest.raises(ValueError, match="registered twice"):
        register_family(spec)
    with pytest.raises(ValueError, match="names configs \\['qwen36', 'qwen36_mini', 'qwen36_tiny'\\]"):
        register_family(dataclasses.replace(spec, name="qwen37"))
    assert [s.name for s in families()] == ["glm52", "qwen36"]


def test_parallel_hooks_resolve_and_missing_ones_are_refused():
    for spec in families():
        for hook in (spec.context_parallel, spec.expert_parallel):
            if hook is not None:
                assert callable(_resolve(hook))
    qwen = get_family("qwen36")
    assert qwen.expert_parallel is None
    with pytest.raises(ValueError, match="no routed experts to split; valid: \\['glm52'\\]"):
        qwen.apply_expert_parallel(build_model("qwen36_tiny"), None)


def test_plan_and_export_are_declared_per_family():
    assert [spec.name for spec in families() if spec.plan] == ["glm52", "qwen36"]
    # both write their HF directories (export_hf, rollout=vllm): a tensor of ours to its checkpoint keys
    assert get_family("qwen36").hf.local_to_hf("lm_head.weight", None, None) == [("lm_head.weight", ())]
    glm = get_family("glm52")
    cfg = glm.named_config("glm52_tiny")
    keys = glm.hf.local_to_hf("model.layers.1.mlp.experts.gate_up_proj", cfg, (2, 4))
    assert [k for k, _ in keys] == [f"model.layers.1.mlp.experts.{e}.{p}_proj.weight" for e in (2, 3)
                                    for p in ("gate", "up")]
    # the inverse of the reader's key map, rows shifted by the slice's first expert
    for key, index in keys:
        name, global_index = glm.hf.key_map(key, cfg)
        assert name == "model.layers.1.mlp.experts.gate_up_proj"
        assert (global_index[0] - 2, *global_index[1:]) == index


def test_config_json_is_read_once_until_it_changes(tmp_path):
    model = build_model("qwen36_tiny", seed=0)
    (tmp_path / "config.json").write_text(json.dumps(get_family("qwen36").hf.config_to_hf(model.config)))
    first = hf_model_config(tmp_path)
    assert hf_model_config(tmp_path) is first
    hf = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**hf, "num_hidden_layers": 4, "layer_types": None}) + "\n")
    spec, cfg = hf_model_config(tmp_path)
    assert spec.name == "qwen36" and cfg.num_hidden_layers == 4
    with pytest.raises(ValueError, match="no config.json"):
        from_pretrained(tmp_path / "missing")

