"""glm52's weights for vLLM, without vLLM: `hf_weights` yields the glm_moe_dsa checkpoint's keys and tensors (what
export_hf writes), and a stand-in of vLLM's DeepseekV2 loader (which serves GlmMoeDsaForCausalLM) fills every one
of its parameters from them, fused ones included, exactly once. The stand-in is written here from vLLM's
`DeepseekV2Model.load_weights` (vllm/model_executor/models/deepseek_v2.py): its parameter names and the three
mappings it applies to checkpoint names:
- stacked: gate_proj / up_proj -> gate_up_proj (dense and shared-expert MLPs), q_a_proj / kv_a_proj_with_mqa ->
  fused_qkv_a_proj (q_lora_rank set), the indexer's wk / weights_proj -> wk_weights_proj; shards along rows;
- experts: `experts.{e}.gate_proj.` / `up_proj.` -> `experts.w13_weight` [E, 2I, C] rows [0, I) / [I, 2I) of expert
  e, `experts.{e}.down_proj.` -> `experts.w2_weight` [E, C, I];
- indexer weights of a layer built without an indexer (index_topk_pattern "S") are dropped.
Its router builds `gate.e_score_correction_bias` only with topk_method "noaux_tc", scores with `scoring_func`,
places MoE layers at i >= first_k_dense_replace, and rotates indexer keys interleaved with
indexer_rope_interleave: config.json must say so."""

import json

import pytest
import torch

from conftest import tie_free_glm
from longstraw_cli.export import export_hf
from longstraw_cli.lora import LoraConfig, apply_lora, lora_layers
from longstraw_cli.models.glm52.hf import config_to_hf
from longstraw_cli.rollout.vllm_engine import hf_weights

STACKED = [("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1),
           ("wk_weights_proj", "wk", 0), ("wk_weights_proj", "weights_proj", 1),
           ("fused_qkv_a_proj", "q_a_proj", 0), ("fused_qkv_a_proj", "kv_a_proj_with_mqa", 1)]


def vllm_parameters(hf: dict) -> dict[str, tuple[list[int], ...]]:
    """{vLLM parameter name: row sizes of its stacked shards along dim 0 (one for an unfused one), then its other
    dims}, built from config.json as vLLM's DeepseekV2ForCausalLM builds its modules."""
    C, E, I = hf["hidden_size"], hf["n_routed_experts"], hf["moe_intermediate_size"]
    heads, nope, rope, v = hf["num_attention_heads"], hf["qk_nope_head_dim"], hf["qk_rope_head_dim"], hf["v_head_dim"]
    q_lora, kv_lora = hf["q_lora_rank"], hf["kv_lora_rank"]
    index_heads, index_dim = hf["index_n_heads"], hf["index_head_dim"]
    params = {"model.embed_tokens.weight": ([hf["vocab_size"]], C), "model.norm.weight": ([C],),
              "lm_head.weight": ([hf["vocab_size"]], C)}
    for i in range(hf["num_hidden_layers"]):
        a, m = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        params.update({
            f"model.layers.{i}.input_layernorm.weight": ([C],),
            f"model.layers.{i}.post_attention_layernorm.weight": ([C],),
            f"{a}.fused_qkv_a_proj.weight": ([q_lora, kv_lora + rope], C),
            f"{a}.q_a_layernorm.weight": ([q_lora],),
            f"{a}.q_b_proj.weight": ([heads * (nope + rope)], q_lora),
            f"{a}.kv_a_layernorm.weight": ([kv_lora],),
            f"{a}.kv_b_proj.weight": ([heads * (nope + v)], kv_lora),
            f"{a}.o_proj.weight": ([C], heads * v),
        })
        if hf["index_topk_pattern"][i] == "F":
            params.update({f"{a}.indexer.wq_b.weight": ([index_heads * index_dim], q_lora),
                           f"{a}.indexer.wk_weights_proj.weight": ([index_dim, index_heads], C),
                           f"{a}.indexer.k_norm.weight": ([index_dim],), f"{a}.indexer.k_norm.bias": ([index_dim],)})
        if i >= hf["first_k_dense_replace"]:
            shared = I * hf["n_shared_experts"]
            params.update({f"{m}.gate.weight": ([E], C), f"{m}.experts.w13_weight": ([E], 2 * I, C),
                           f"{m}.experts.w2_weight": ([E], C, I),
                           f"{m}.shared_experts.gate_up_proj.weight": ([shared, shared], C),
                           f"{m}.shared_experts.down_proj.weight": ([C], shared)})
            if hf["topk_method"] == "noaux_tc":
                params[f"{m}.gate.e_score_correction_bias"] = ([E],)
        else:
            params.update({f"{m}.gate_up_proj.weight": ([hf["intermediate_size"]] * 2, C),
                           f"{m}.down_proj.weight": ([C], hf["intermediate_size"])})
    return params


class StandInDeepseekV2:
    """vLLM's parameters (NaN until loaded) and a `load_weights` applying its name mappings (module docstring)."""

    def __init__(self, hf: dict):
        self.shards = vllm_parameters(hf)
        self.params = {n: torch.full((sum(s[0]), *s[1:]), float("nan"), dtype=torch.float64)
                       for n, s in self.shards.items()}
        self.num_experts = hf["n_routed_experts"]
        self.loads = dict.fromkeys(self.params, 0)

    def _fill(self, name, rows, tensor):
        target = self.params[name][rows]
        assert target.shape == tensor.shape, (name, target.shape, tensor.shape)
        assert target.isnan().all(), f"{name}[{rows}] loaded twice"
        target.copy_(tensor)
        self.loads[name] += tensor.numel()

    def load_weights(self, weights) -> set[str]:
        loaded = set()
        for name, tensor in weights:
            if ".indexer." in name and name.rsplit(".indexer.", 1)[0] + ".indexer.k_norm.weight" not in self.params:
                continue
            expert = next(((w, e, part) for e in range(self.num_experts) for part in ("gate", "up", "down")
                           for w in [f"experts.{e}.{part}_proj."] if w in name), None)
            if expert is not None:
                w, e, part = expert
                size = tensor.shape[0] if part != "down" else None
                target = name.replace(w, "experts.w2_" if part == "down" else "experts.w13_")
                rows = (e,) if part == "down" else (e, slice(0, size) if part == "gate" else slice(size, 2 * size))
                self._fill(target, rows, tensor)
                loaded.add(target)
                continue
            stacked = next(((p, w, s) for p, w, s in STACKED if w in name), None)
            if stacked is not None:
                param, weight, shard = stacked
                target = name.replace(weight, param)
                start = sum(self.shards[target][0][:shard])
                self._fill(target, slice(start, start + self.shards[target][0][shard]), tensor)
                loaded.add(target)
                continue
            self._fill(name, slice(None), tensor)
            loaded.add(name)
        return loaded


def glm_with_adapters():
    model = tie_free_glm(torch.float64)
    apply_lora(model, LoraConfig(rank=4, alpha=8))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for layer in lora_layers(model).values():
            layer.lora_B.copy_(torch.randn(layer.lora_B.shape, generator=g, dtype=layer.lora_B.dtype) * 0.1)
    return model


def test_config_json_tells_vllm_what_glm_is():
    model = tie_free_glm()
    hf = config_to_hf(model.config)
    cfg = model.config
    assert hf["architectures"] == ["GlmMoeDsaForCausalLM"]
    assert hf["scoring_func"] == "sigmoid" and hf["topk_method"] == "noaux_tc" and hf["indexer_rope_interleave"]
    assert hf["index_topk_pattern"] == "".join({"full": "F", "shared": "S"}[t] for t in cfg.layer_indexer_types)
    assert [i >= hf["first_k_dense_replace"] for i in range(cfg.num_hidden_layers)] == \
        [t == "sparse" for t in cfg.layer_mlp_types]


@pytest.mark.parametrize("lora", [False, True])
def test_every_vllm_parameter_is_loaded_once_from_hf_weights(lora):
    model = glm_with_adapters() if lora else tie_free_glm(torch.float64)
    hf = config_to_hf(model.config)
    vllm = StandInDeepseekV2(hf)
    loaded = vllm.load_weights(hf_weights(model))
    assert loaded == set(vllm.params)
    for name, tensor in vllm.params.items():
        assert vllm.loads[name] == tensor.numel() and not tensor.isnan().any(), name
    # the fused parameters hold ours side by side (LoRA merged into the adapted linears)
    ours = {n: t for n, t in hf_weights(model)}
    layer, moe = "model.layers.1.self_attn", model.model.layers[1].mlp
    assert torch.equal(vllm.params[f"{layer}.fused_qkv_a_proj.weight"],
                       torch.cat([ours[f"{layer}.q_a_proj.weight"], ours[f"{layer}.kv_a_proj_with_mqa.weight"]]))
    assert torch.equal(vllm.params["model.layers.1.mlp.experts.w13_weight"], moe.experts.gate_up_proj)
    assert torch.equal(vllm.params["model.layers.1.mlp.experts.w2_weight"], moe.experts.down_proj)
    assert torch.equal(vllm.params["model.layers.1.mlp.gate.e_score_correction_bias"], moe.gate.e_score_correction_bias)
    if lora:
        merged = lora_layers(model)[f"{layer}.q_a_proj"].merged_weight()
        assert torch.equal(ours[f"{layer}.q_a_proj.weight"], merged)


def test_hf_weights_are_the_exported_checkpoint(tmp_path):
    """What vLLM is pushed each iteration is what it would read from export_hf's directory: same keys, same
    tensors (LoRA merged)."""
    from safetensors import safe_open

    model = glm_with_adapters()
    path = export_hf(model, tmp_path / "hf", max_shard_bytes=300_000)
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    pushed = dict(hf_weights(model))
    assert set(pushed) == set(index)
    for key, file in index.items():
        with safe_open(str(path / file), framework="pt") as f:
            assert torch.equal(f.get_tensor(key), pushed[key]), key
