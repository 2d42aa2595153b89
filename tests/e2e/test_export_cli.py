"""`longstraw train model=glm52_tiny export_hf=true`: the trainer's export of glm52, in one process (LoRA: the
merged weights, the base and peft's adapters, with the tokenizer) and under torchrun with cp=2 ep=2 (each rank its
experts), against the same run at ep=1."""

import json

import pytest
import torch
from safetensors import safe_open
from test_cli import torchrun

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
def test_expert_parallel_run_exports_what_one_rank_would(tmp_path):
    args = [*ARGS, "steps=1", "cp=2", "model.dtype=float64", "export_hf=true"]
    for ep in (2, 1):
        out = torchrun([*args, f"ep={ep}", f"run_dir={tmp_path / f'ep{ep}'}"], cwd=tmp_path)
        assert out.returncode == 0, out.stderr[-2000:]
        assert f"longstraw: exported {tmp_path / f'ep{ep}' / 'hf'}" in out.stderr
    ep2, ep1 = tmp_path / "ep2" / "hf", tmp_path / "ep1" / "hf"
    # ep=2: two ranks' files (each its experts), so shards and an index
    assert (ep2 / INDEX).exists()
    got, want = tensors(ep2), tensors(ep1)
    assert set(got) == set(want) and "model.layers.3.mlp.experts.7.down_proj.weight" in got
    # the two runs train alike up to the order of floating-point sums (cp=2 ep=2 vs ep=1: <= 1e-9 in the metrics)
    for key, tensor in want.items():
        assert (got[key] - tensor).abs().max().item() <= 1e-9 * max(1.0, tensor.abs().max().item()), key
    hf_agrees(ep2)
