"""Hugging Face `glm_moe_dsa` checkpoints <-> glm52.

Module names mirror HF's, with one difference of layout: in memory the routed experts are 3-D parameters
(`mlp.experts.gate_up_proj` [E, 2I, C], `mlp.experts.down_proj` [E, C, I], as in HF 5.24), while
`save_pretrained` writes (and GLM-5 releases hold) per-expert keys `mlp.experts.{e}.{gate,up,down}_proj.weight`.
`hf_to_local` maps each key to a parameter and the slice of it that the key fills, by global expert index; a
model holding only some experts (`Experts.expert_rows`, expert parallel) reads only their keys, shifted to its
rows (models/loading.py). Layers past num_hidden_layers (GLM-5's MTP layer 78) are skipped, as HF does.
`local_to_hf` is its inverse (export_hf, rollout=vllm): a slice of experts is written as per-expert keys at their
global index, so each expert-parallel rank writes its own experts and no rank forms another's.
"""

from __future__ import annotations

import re

from longstraw_cli.models.glm52.config import Glm52Config
from longstraw_cli.models.spec import HFAdapter

MODEL_TYPES = ("glm_moe_dsa",)

_EXPERT_KEY = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
_EXPERT_PARAM = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")
_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.")


def _indexer_types(hf: dict, num_layers: int) -> tuple[str, ...]:
    """HF's rule: explicit indexer_types, else index_topk_pattern ("FSS..."), else the freq/offset schedule."""
    if hf.get("indexer_types") is not None:
        return tuple(hf["indexer_types"])
    pattern = hf.get("index_topk_pattern")
    if pattern is not None:
        return tuple({"F": "full", "S": "shared"}[c] for c in pattern) if isinstance(pattern, str) else tuple(pattern)
    freq = max(hf.get("index_topk_freq", 1), 1)
    offset = hf.get("index_skip_topk_offset", 2)
    return tuple("full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(num_layers))


def config_from_hf(hf: dict) -> Glm52Config:
    """Glm52Config from a config.json dict of model_type glm_moe_dsa."""
    if hf.get("model_type") != "glm_moe_dsa":
        raise ValueError(f"model_type {hf.get('model_type')!r} is not a glm52 checkpoint; valid: {list(MODEL_TYPES)}")
    rope = dict(hf.get("rope_parameters") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"rope_type {rope_type!r} is not supported; valid: ['default']")
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag, False):
            raise ValueError(f"{flag}=True is not a glm_moe_dsa layout LongStraw supports")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {hf['hidden_act']!r} is not supported; valid: ['silu']")
    heads = hf["num_attention_heads"]
    if hf.get("num_key_value_heads", heads) != heads:
        raise ValueError(f"num_key_value_heads={hf['num_key_value_heads']} != num_attention_heads={heads}: "
                         "MLA expands one latent to every head")
    num_layers = hf["num_hidden_layers"]
    n_dense = min(hf.get("first_k_dense_replace", 3), num_layers)
    mlp_types = hf.get("mlp_layer_types") or ["dense"] * n_dense + ["sparse"] * (num_layers - n_dense)
    return Glm52Config(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        num_hidden_layers=num_layers,
        intermediate_size=hf["intermediate_size"],
        moe_intermediate_size=hf["moe_intermediate_size"],
        num_attention_heads=heads,
        q_lora_rank=hf["q_lora_rank"],
        kv_lora_rank=hf["kv_lora_rank"],
        qk_nope_head_dim=hf["qk_nope_head_dim"],
        qk_rope_head_dim=hf["qk_rope_head_dim"],
        v_head_dim=hf["v_head_dim"],
        n_routed_experts=hf.get("n_routed_experts", hf.get("num_experts", 256)),
        num_experts_per_tok=hf["num_experts_per_tok"],
        n_shared_experts=hf.get("n_shared_experts", 1),
        n_group=hf.get("n_group", 1),
        topk_group=hf.get("topk_group", 1),
        routed_scaling_factor=float(hf.get("routed_scaling_factor", 2.5)),
        norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
        first_k_dense_replace=n_dense,
        index_topk=hf.get("index_topk", 2048),
        index_head_dim=hf.get("index_head_dim", 128),
        index_n_heads=hf.get("index_n_heads", 32),
        mlp_layer_types=tuple(mlp_types),
        indexer_types=_indexer_types(hf, num_layers),
        rms_norm_eps=hf.get("rms_norm_eps", 1e-5),
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10_000.0))),
        max_position_embeddings=hf.get("max_position_embeddings", 202_752),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
    )


def hf_to_local(key: str, cfg: Glm52Config) -> tuple[str, tuple] | None:
    """(our parameter/buffer name, index of the part this key fills; () = all of it), or None to skip."""
    layer = _LAYER_KEY.match(key)
    if layer is not None and int(layer.group(1)) >= cfg.num_hidden_layers:
        return None
    expert = _EXPERT_KEY.match(key)
    if expert is None:
        return key, ()
    prefix, e, part = expert.group(1), int(expert.group(2)), expert.group(3)
    if part == "down":
        return f"{prefix}.down_proj", (e,)
    size = cfg.moe_intermediate_size
    rows = slice(0, size) if part == "gate" else slice(size, 2 * size)
    return f"{prefix}.gate_up_proj", (e, rows)


def config_to_hf(cfg: Glm52Config) -> dict:
    """config.json dict (model_type glm_moe_dsa) of a Glm52Config: the inverse of `config_from_hf`."""
    same_named = ("vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size", "moe_intermediate_size",
                  "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                  "v_head_dim", "n_routed_experts", "num_experts_per_tok", "n_shared_experts", "n_group", "topk_group",
                  "routed_scaling_factor", "norm_topk_prob", "first_k_dense_replace")
    return {
        "model_type": "glm_moe_dsa",
        "architectures": ["GlmMoeDsaForCausalLM"],
        **{name: getattr(cfg, name) for name in same_named},
        "num_key_value_heads": cfg.num_attention_heads,
        "mlp_layer_types": list(cfg.layer_mlp_types),
        "indexer_types": list(cfg.layer_indexer_types),
        "index_topk": cfg.index_topk,
        "index_head_dim": cfg.index_head_dim,
        "index_n_heads": cfg.index_n_heads,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        # what vLLM's DeepseekV2 code (which serves glm_moe_dsa) reads in place of HF's fields: its router scores
        # with softmax and builds no e_score_correction_bias unless told; it places indexers by
        # index_topk_pattern, not indexer_types; and it rotates indexer keys in NeoX halves unless
        # indexer_rope_interleave (HF's GLM indexer rotates interleaved pairs). transformers ignores them.
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "index_topk_pattern": "".join("F" if t == "full" else "S" for t in cfg.layer_indexer_types),
        "indexer_rope_interleave": True,
    }


def local_to_hf(name: str, cfg: Glm52Config, rows: tuple[int, int] | None) -> list[tuple[str, tuple]]:
    """The inverse of `hf_to_local`: the checkpoint keys a tensor of ours is written as, each with the part of the
    tensor it takes. A 3-D expert tensor holding global experts [lo, hi) (`rows`; None: all of them) becomes
    per-expert keys at their global index: gate_up_proj[e - lo] splits into gate (its first I rows) and up (the
    rest), down_proj[e - lo] is down. Every other tensor is one key of its own name."""
    expert = _EXPERT_PARAM.match(name)
    if expert is None:
        return [(name, ())]
    prefix, param = expert.groups()
    lo, hi = (0, cfg.n_routed_experts) if rows is None else rows
    size = cfg.moe_intermediate_size
    keys = []
    for e in range(lo, hi):
        if param == "down_proj":
            keys.append((f"{prefix}.{e}.down_proj.weight", (e - lo,)))
        else:
            keys += [(f"{prefix}.{e}.gate_proj.weight", (e - lo, slice(0, size))),
                     (f"{prefix}.{e}.up_proj.weight", (e - lo, slice(size, 2 * size)))]
    return keys


ADAPTER = HFAdapter(MODEL_TYPES, config_from_hf, config_to_hf, hf_to_local, local_to_hf)
