"""Hugging Face `qwen3_5_text` / `qwen3_5` checkpoints <-> qwen36.

Our module tree mirrors HF's text model, so names map one to one; the composite `qwen3_5` checkpoint holds the
text weights under `model.language_model.` beside a vision tower (and `mtp.` heads), which we skip.
"""

from __future__ import annotations

from longstraw_cli.models.qwen36.config import Qwen36Config
from longstraw_cli.models.spec import HFAdapter

MODEL_TYPES = ("qwen3_5_text", "qwen3_5")


def config_from_hf(hf: dict) -> Qwen36Config:
    """Qwen36Config from a config.json dict of model_type qwen3_5_text or qwen3_5 (its text_config)."""
    model_type = hf.get("model_type")
    if model_type == "qwen3_5":
        hf = hf["text_config"]
    elif model_type != "qwen3_5_text":
        raise ValueError(f"model_type {model_type!r} is not a qwen36 checkpoint; valid: {list(MODEL_TYPES)}")
    rope = dict(hf.get("rope_parameters") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"rope_type {rope_type!r} is not supported; valid: ['default']")
    if hf.get("attention_bias", False):
        raise ValueError("attention_bias=True is not a qwen3_5 layout LongStraw supports")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {hf['hidden_act']!r} is not supported; valid: ['silu']")
    num_layers = hf["num_hidden_layers"]
    interval = hf.get("full_attention_interval", 4)
    cfg = Qwen36Config(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_hidden_layers=num_layers,
        num_attention_heads=hf["num_attention_heads"],
        num_key_value_heads=hf["num_key_value_heads"],
        head_dim=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
        linear_num_key_heads=hf["linear_num_key_heads"],
        linear_num_value_heads=hf["linear_num_value_heads"],
        linear_key_head_dim=hf["linear_key_head_dim"],
        linear_value_head_dim=hf["linear_value_head_dim"],
        linear_conv_kernel_dim=hf.get("linear_conv_kernel_dim", 4),
        full_attention_interval=interval,
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10_000_000.0))),
        partial_rotary_factor=float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25))),
        max_position_embeddings=hf.get("max_position_embeddings", 262_144),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
    )
    layer_types = hf.get("layer_types")
    if layer_types is not None and tuple(layer_types) != cfg.layer_types:
        raise ValueError(
            f"layer_types {layer_types} do not follow the 3:1 pattern of full_attention_interval={interval}"
        )
    return cfg


def hf_to_local(key: str, cfg: Qwen36Config) -> tuple[str, tuple] | None:
    """(our parameter name, () = the whole of it) for an HF checkpoint key, or None for weights we do not use.
    Names map one to one, so cfg is not needed; it is the key-map signature every family shares."""
    if key.startswith("model.language_model."):
        return "model." + key[len("model.language_model."):], ()
    if key.startswith(("model.visual.", "mtp.", "visual.")):
        return None
    return key, ()


def config_to_hf(cfg: Qwen36Config) -> dict:
    """config.json dict (model_type qwen3_5_text) of a Qwen36Config: the inverse of `config_from_hf`."""
    same_named = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "linear_num_key_heads", "linear_num_value_heads",
                  "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim", "full_attention_interval")
    return {
        "model_type": "qwen3_5_text",
        "architectures": ["Qwen3_5ForCausalLM"],
        **{name: getattr(cfg, name) for name in same_named},
        "layer_types": list(cfg.layer_types),
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": cfg.rope_theta,
            "partial_rotary_factor": cfg.partial_rotary_factor,
        },
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
    }


def local_to_hf(name: str, cfg: Qwen36Config, rows: tuple[int, int] | None) -> list[tuple[str, tuple]]:
    """The inverse of `hf_to_local` for export: names map one to one, every tensor whole."""
    return [(name, ())]


ADAPTER = HFAdapter(MODEL_TYPES, config_from_hf, config_to_hf, hf_to_local, local_to_hf)
