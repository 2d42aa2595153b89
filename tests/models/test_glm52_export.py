"""glm52 out of the trainer: `export_hf` writes a glm_moe_dsa directory (per-expert keys, shards + index) that
transformers' GlmMoeDsaForCausalLM loads with our logits, LoRA merged and NF4 experts dequantised; the trainer's
`export_hf=true` writes it with the tokenizer. Under expert parallel: tests/distributed/test_ep_export.py."""

import json

import pytest
import torch
from safetensors import safe_open

from conftest import tie_free_glm
from longstraw_cli.export import export_hf
from longstraw_cli.lora import LoraConfig, apply_lora, lora_layers
from longstraw_cli.models import from_pretrained
from longstraw_cli.models.loading import INDEX

transformers = pytest.importorskip("transformers")

# the model in fp32 is ~0.6 MB: 150 KB a shard gives several shards
SHARD_BYTES = 150_000


def glm_model(seed=0, dtype=torch.float32):
    return tie_free_glm(dtype, seed)


def hf_logits(path, ids, dtype=torch.float32):
    hf, info = transformers.GlmMoeDsaForCausalLM.from_pretrained(path, dtype=dtype, output_loading_info=True)
    assert not any(info.values()), info
    with torch.no_grad():
        return hf.eval()(ids[None]).logits[0]


def checkpoint_keys(path) -> dict[str, str]:
    """{key: file} of an HF directory, every file opened and its keys read (not only the index believed)."""
    index = json.loads((path / INDEX).read_text())["weight_map"]
    found = {}
    for file in sorted(set(index.values())):
        with safe_open(str(path / file), framework="pt") as f:
            found.update(dict.fromkeys(f.keys(), file))
    assert found == index
    return found


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    model = glm_model()
    path = export_hf(model, tmp_path_factory.mktemp("glm52") / "hf", max_shard_bytes=SHARD_BYTES)
    return model, path


def test_the_directory_is_glm_moe_dsa_with_per_expert_keys_in_shards(exported):
    model, path = exported
    files = sorted(p.name for p in path.iterdir())
    shards = [f for f in files if f.endswith(".safetensors")]
    assert files == sorted(["config.json", INDEX, *shards]) and len(shards) > 2
    assert shards == [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    keys = checkpoint_keys(path)
    cfg = model.config
    assert "model.layers.1.mlp.experts.7.gate_proj.weight" in keys and not any("gate_up_proj" in k for k in keys)
    per_expert = [k for k in keys if ".mlp.experts." in k]
    assert len(per_expert) == 3 * cfg.n_routed_experts * 3  # 3 MoE layers x 8 experts x gate, up, down
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "glm_moe_dsa" and config["architectures"] == ["GlmMoeDsaForCausalLM"]
    assert config["dtype"] == "float32"
    total = json.loads((path / INDEX).read_text())["metadata"]["total_size"]
    assert total == sum(t.numel() * t.element_size() for t in model.state_dict().values())


def test_transformers_loads_it_with_our_logits_and_we_read_it_back_bit_exactly(exported):
    model, path = exported
    ids = torch.randint(0, 259, (90,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(ids[None])[0]
    err = (hf_logits(path, ids) - ours).abs().max().item()
    print(f"glm52_tiny fp32, 90 tokens (index_topk 16): HF logits vs ours max abs err {err:.2e}")
    assert err <= 1e-4
    back = from_pretrained(path)
    for name, tensor in model.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor), name


def test_one_file_when_it_fits_and_fp64_read_back_bit_exactly(tmp_path):
    model = glm_model(dtype=torch.float64)
    path = export_hf(model, tmp_path / "hf")
    assert sorted(p.name for p in path.iterdir()) == ["config.json", "model.safetensors"]
    assert json.loads((path / "config.json").read_text())["dtype"] == "float64"
    back = from_pretrained(path, dtype=torch.float64)
    for name, tensor in model.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor), name


def test_lora_is_merged_into_the_export(tmp_path):
    model = glm_model()
    apply_lora(model, LoraConfig(rank=4, alpha=8))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for layer in lora_layers(model).values():
            layer.lora_B.copy_(torch.randn(layer.lora_B.shape, generator=g, dtype=layer.lora_B.dtype) * 0.1)
    path = export_hf(model, tmp_path / "hf", max_shard_bytes=SHARD_BYTES)
    assert not any("lora" in k for k in checkpoint_keys(path))
    ids = torch.randint(0, 259, (60,), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ours = model(ids[None])[0]
    assert (hf_logits(path, ids) - ours).abs().max().item() <= 1e-4
    base = export_hf(model, tmp_path / "base", merge=False)
    with torch.no_grad():
        for layer in lora_layers(model).values():
            layer.lora_B.zero_()
        bare = model(ids[None])[0]
    assert (hf_logits(base, ids) - bare).abs().max().item() <= 1e-4


def test_nf4_experts_are_written_dequantised_expert_by_expert(tmp_path):
    """A QLoRA model (lora.quantize=nf4: every routed expert an NF4 matrix) exports its weights as it computes
    with them: dequantised, in the model dtype, each expert from its own NF4 matrix."""
    from longstraw_cli.quantize import dense

    plain = export_hf(glm_model(), tmp_path / "plain")
    quantized = from_pretrained(plain, quantize="nf4")
    path = export_hf(quantized, tmp_path / "hf", max_shard_bytes=SHARD_BYTES)
    back = from_pretrained(path)
    experts = quantized.model.layers[2].mlp.experts
    assert torch.equal(back.model.layers[2].mlp.experts.gate_up_proj, torch.stack([dense(w) for w in
                                                                                  experts.gate_up_proj.unbind(0)]))
    for name, tensor in quantized.state_dict().items():
        assert torch.equal(back.state_dict()[name], dense(tensor)), name
