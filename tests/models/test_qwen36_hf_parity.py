"""qwen36 against HF transformers' qwen3_5_text on a tiny random checkpoint saved with save_pretrained."""

import json

import pytest
import torch

from conftest import capture_error_against_hf, randomize_, saved_hf_model
from longstraw_cli.models import build_model, from_pretrained

transformers = pytest.importorskip("transformers")

TINY_TEXT = dict(
    vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=8, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
    linear_value_head_dim=16, max_position_embeddings=4096, rope_parameters={"rope_type": "default",
    "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return saved_hf_model(tmp_path_factory, transformers.Qwen3_5TextConfig, transformers.Qwen3_5ForCausalLM,
                          TINY_TEXT, randomize_)


def test_full_sequence_logits_match_hf(hf_dir):
    path, hf = hf_dir
    ours = from_pretrained(path)
    ids = torch.randint(0, 300, (1, 333), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits
        got = ours(ids)
    err = (got - ref).abs().max().item()
    print(f"full-sequence logits max abs err {err:.3e}")
    assert err <= 1e-4


@pytest.mark.parametrize("block_size", [48, 100, 7, 4096])
def test_capture_logprobs_match_hf(hf_dir, block_size):
    path, hf = hf_dir
    ours = from_pretrained(path)
    # 240 captured tokens: 48 divides it, 100 and 7 do not
    err = capture_error_against_hf(hf, ours, 241, 60, block_size)
    print(f"capture(block={block_size}) + logprobs max abs err {err:.3e}")
    assert err <= 1e-4


def test_composite_qwen3_5_checkpoint_loads_text_weights(tmp_path):
    torch.manual_seed(0)
    vision = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=48, out_hidden_size=64, patch_size=4,
                  spatial_merge_size=1, temporal_patch_size=1)
    cfg = transformers.Qwen3_5Config(text_config=TINY_TEXT, vision_config=vision)
    hf = transformers.Qwen3_5ForConditionalGeneration(cfg).eval()
    randomize_(hf, seed=5)
    hf.save_pretrained(tmp_path)
    keys = json.loads((tmp_path / "config.json").read_text())
    assert keys["model_type"] == "qwen3_5"
    ours = from_pretrained(tmp_path)
    ids = torch.randint(0, 300, (1, 50), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        err = (ours(ids) - hf(input_ids=ids).logits).abs().max().item()
    assert err <= 1e-4


def test_from_pretrained_rejects_other_architectures(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="llama.*qwen3_5_text"):
        from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="config.json"):
        from_pretrained(tmp_path / "missing")


def test_build_model_names_and_overrides():
    model = build_model("qwen36_tiny", num_hidden_layers=4)
    assert [layer.layer_type for layer in model.model.layers] == ["linear_attention"] * 3 + ["full_attention"]
    with pytest.raises(ValueError, match="qwen36_tiny"):
        build_model("qwen37")
    with pytest.raises(ValueError, match="unknown model override"):
        build_model("qwen36_tiny", hidden=3)
