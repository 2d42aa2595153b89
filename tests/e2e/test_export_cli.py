"""`longstraw train model=glm52_tiny export_hf=true`: the trainer's export of glm52, in one process (LoRA: the
merged weights, the base and peft's adapters, with the tokenizer) and under torchrun with cp=2 ep=2 (each rank its
experts), against the same run resumed at ep=1 (conftest's glm52_ep_runs, shared with test_cli's resume test)."""

import json

import pytest
import torch
from safetensors import safe_open

from longstraw_cli.models import from_pretrained
from longstraw_cli.models.loading import INDEX, weight_map

transformers = pytest.importorskip("transformers")

ARGS = ["model=glm52_tiny", "prompt_tokens=64", "response_tokens=4", "group_size=2", "logger.backends=[jsonl]"]


def tensors(path) -> dict[str, torch.Tensor]:
    found = {}
    for key, file in weight_map(path).items():
        with safe_open(str(path / file), framework="pt") as f:
            found[key] = f.get_tensor(key)
    return found


def hf_agrees(path, dtype=torch.float32):
    """transformers loads the directory, every key used, with our logits (12 tokens: below index_topk, where
    glm52_tiny's top-k has no ties to order; tests/models/test_glm52_export.py compares longer prompts)."""
    hf, info = transformers.GlmMoeDsaForCausalLM.from_pretrained(path, dtype=dtype, output_loading_info=True)
    assert not any(info.values()), info
    ids = torch.randint(0, 259, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        err = (hf.eval()(ids).logits - from_pretrained(path, dtype=dtype)(ids)).abs().max().item()
    assert err <= 1e-5, err


def test_glm52_lora_run_exports_merged_base_adapter_and_tokenizer(train_here, tmp_path):
    run = tmp_path / "run"
    code, _, err = train_here([*ARGS, "steps=1", "lora.rank=4", "export_hf=true", f"run_dir={run}"])
    assert code == 0, err
    assert f"longstraw: exported {run / 'hf'}, {run / 'hf_base'}, {run / 'hf_adapter'}" in err
    for name in ("hf", "hf_base"):
        assert json.loads((run / name / "config.json").read_text())["model_type"] == "glm_moe_dsa"
        hf_agrees(run / name)
    tokenizer = transformers.AutoTokenizer.from_pretrained(run / "hf")
    assert tokenizer.encode("hé", add_special_tokens=False) == list("hé".encode())
    assert (run / "hf" / "generation_config.json").exists()
    assert json.loads((run / "hf_adapter" / "adapter_config.json").read_text())["r"] == 4


@pytest.mark.slow
@pytest.mark.distributed
def test_expert_parallel_run_exports_what_one_rank_would(glm52_ep_runs):
    runs, stderr = glm52_ep_runs
    for name in ("whole", "ep1"):
        assert f"longstraw: exported {runs / name / 'hf'}" in stderr[name]
    ep2, ep1 = runs / "whole" / "hf", runs / "ep1" / "hf"
    # ep=2: two ranks' files (each its experts), so shards and an index
    assert (ep2 / INDEX).exists()
    got, want = tensors(ep2), tensors(ep1)
    assert set(got) == set(want) and "model.layers.3.mlp.experts.7.down_proj.weight" in got
    # the two runs train alike up to the order of floating-point sums (4 steps at cp=2 ep=2 against 2 of them
    # resumed at ep=1: <= 1e-9 in the metrics)
    for key, tensor in want.items():
        assert (got[key] - tensor).abs().max().item() <= 1e-9 * max(1.0, tensor.abs().max().item()), key
    hf_agrees(ep2)
