"""glm52 against HF transformers' glm_moe_dsa on a tiny random checkpoint saved with save_pretrained."""

import json

import pytest
import torch

from conftest import capture_error_against_hf, randomize_glm_, saved_hf_model
from longstraw_cli.models import MODEL_NAMES, build_model, from_pretrained
from longstraw_cli.models.glm52.model import topk_lowest_position

transformers = pytest.importorskip("transformers")

# a dense first layer, full and shared indexer layers, grouped routing; index_topk 16 << prompt lengths
TINY = dict(
    vocab_size=300, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
    topk_group=1, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16, v_head_dim=24, qk_nope_head_dim=24,
    index_topk=16, index_head_dim=32, index_n_heads=8, first_k_dense_replace=1,
    indexer_types=["full", "shared", "full", "shared"], max_position_embeddings=4096,
)


class TopkGuard:
    """Wraps every layer's topk_fn: records the smallest relative gap between the k-th and (k+1)-th index score
    (a tie there would make any comparison depend on tie order) and how many rows selected a strict subset."""

    def __init__(self, model):
        self.min_gap, self.strict_rows = float("inf"), 0
        for layer in model.model.layers:
            layer.self_attn.topk_fn = self

    def __call__(self, scores_BTS, k):
        rows = torch.isfinite(scores_BTS).sum(-1) > k
        if rows.any():
            top = scores_BTS[rows].topk(k + 1, dim=-1).values
            gap = (top[:, k - 1] - top[:, k]) / top[:, k - 1].abs().clamp_min(1e-30)
            self.min_gap = min(self.min_gap, gap.min().item())
            self.strict_rows += int(rows.sum())
        return topk_lowest_position(scores_BTS, k)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, one_thread):
    return saved_hf_model(tmp_path_factory, transformers.GlmMoeDsaConfig, transformers.GlmMoeDsaForCausalLM, TINY,
                          randomize_glm_)


def test_checkpoint_stores_experts_per_expert_and_loads(hf_dir):
    path, hf = hf_dir
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    assert "model.layers.1.mlp.experts.7.gate_proj.weight" in keys
    assert not any(k.endswith("experts.gate_up_proj") for k in keys)
    ours = from_pretrained(path)
    assert ours.family == "glm52"
    hf_experts = hf.model.layers[1].mlp.experts
    assert torch.equal(ours.model.layers[1].mlp.experts.gate_up_proj, hf_experts.gate_up_proj)
    assert torch.equal(ours.model.layers[1].mlp.experts.down_proj, hf_experts.down_proj)
    bias = ours.model.layers[2].mlp.gate.e_score_correction_bias
    assert bias.abs().min() > 0 and torch.equal(bias, hf.model.layers[2].mlp.gate.e_score_correction_bias)


def test_full_sequence_logits_match_hf(hf_dir):
    path, hf = hf_dir
    ours = from_pretrained(path)
    guard = TopkGuard(ours)
    ids = torch.randint(0, 300, (1, 200), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits
        got = ours(ids)
    err = (got - ref).abs().max().item()
    print(f"full-sequence logits max abs err {err:.3e} (max |logit| {ref.abs().max().item():.2f}); "
          f"top-k boundary min rel gap {guard.min_gap:.2e}, strict-subset rows {guard.strict_rows}")
    assert guard.strict_rows > 0 and guard.min_gap > 1e-5
    assert err <= 1e-4


@pytest.mark.parametrize("block_size", [48, 100, 7, 4096])
def test_capture_logprobs_match_hf(hf_dir, block_size):
    path, hf = hf_dir
    ours = from_pretrained(path)
    guard = TopkGuard(ours)
    # 192 captured tokens: 48 divides it, 100 and 7 do not
    err = capture_error_against_hf(hf, ours, 193, 40, block_size)
    print(f"capture(block={block_size}) + logprobs max abs err {err:.3e}; top-k min rel gap {guard.min_gap:.2e}")
    assert guard.strict_rows > 0 and guard.min_gap > 1e-5
    assert err <= 1e-4


def test_config_round_trip_and_rejections(hf_dir, tmp_path):
    from longstraw_cli.models.glm52.hf import config_from_hf, config_to_hf

    path, _ = hf_dir
    cfg = config_from_hf(json.loads((path / "config.json").read_text()))
    assert config_from_hf(config_to_hf(cfg)) == cfg
    assert cfg.layer_indexer_types == ("full", "shared", "full", "shared")
    assert cfg.layer_mlp_types == ("dense", "sparse", "sparse", "sparse")
    bad = dict(config_to_hf(cfg), rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0})
    (tmp_path / "config.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="yarn"):
        from_pretrained(tmp_path)


def test_named_shapes():
    assert {"glm52", "glm52_mini", "glm52_tiny"} <= set(MODEL_NAMES)
    tiny = build_model("glm52_tiny")
    assert tiny.config.layer_mlp_types[0] == "dense" and {"full", "shared"} == set(tiny.config.layer_indexer_types)
    assert tiny.config.vocab_size >= 259
    # the real shape only on the meta device: its parameter count, never its memory
    full = build_model("glm52", device="meta", dtype=torch.bfloat16)
    n = sum(p.numel() for p in full.parameters())
    assert 7.0e11 < n < 8.0e11, n
    mini = build_model("glm52_mini", device="meta", dtype=torch.bfloat16)
    assert 1e9 < sum(p.numel() for p in mini.parameters()) < 3e9
    with pytest.raises(ValueError, match="glm52_tiny"):
        build_model("glm53")
