"""The GLM-5 shape at a reduced depth (4 layers: 3 dense, 1 MoE of 256 experts; 25 GB in bf16) built and loaded
onto one GPU as EP ranks would (skipped without CUDA): each rank's CUDA peak stays within 1.1x its share plus one
of its layers, and its loader opens only the files holding its tensors. The checkpoint is written here from a
built model, per-expert keys in GLM-5's order over ~4 GB files."""

import gc
import json
import re

import pytest
import torch
from safetensors.torch import save_file

from longstraw_cli.distributed.ep import expert_bounds
from longstraw_cli.models import build_model, from_pretrained, loading
from longstraw_cli.models.glm52.hf import config_to_hf

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

LAYERS = 4
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_EXPERT = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.(\d+)\.")


def hf_tensors(model) -> dict[str, torch.Tensor]:
    """The model's tensors under HF's names, routed experts per expert (the inverse of glm52's hf_to_local)."""
    size, out = model.config.moe_intermediate_size, {}
    for name, t in model.state_dict().items():
        prefix = name.rsplit(".", 1)[0] + "."
        if name.endswith("mlp.experts.gate_up_proj"):
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.gate_proj.weight"], out[f"{prefix}{e}.up_proj.weight"] = t[e, :size], t[e, size:]
        elif name.endswith("mlp.experts.down_proj"):
            out.update((f"{prefix}{e}.down_proj.weight", t[e]) for e in range(t.shape[0]))
        else:
            out[name] = t
    return out


def key_order(key: str):
    layer, expert = _LAYER.match(key), _EXPERT.match(key)
    return (int(layer.group(1)) if layer else -1, int(expert.group(1)) if expert else -1, key)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("glm52_4layers")
    model = build_model("glm52", dtype=torch.bfloat16, device="cuda", seed=0, num_hidden_layers=LAYERS)
    tensors, files, chunk, size = hf_tensors(model), [], [], 0
    for key in sorted(tensors, key=key_order):
        chunk.append(key)
        size += tensors[key].numel() * tensors[key].element_size()
        if size > 4e9:
            files.append(chunk)
            chunk, size = [], 0
    files.append(chunk)
    weight_map = {}
    for i, keys in enumerate(files):
        file = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        save_file({k: tensors[k].contiguous().cpu() for k in keys}, path / file)
        weight_map.update(dict.fromkeys(keys, file))
    (path / loading.INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps(config_to_hf(model.config)))
    return path


def measured(make):
    """(model, CUDA peak bytes above what was allocated before, its bytes, its largest layer's bytes). Garbage of
    earlier tests first (a failed test's traceback holds its frames' tensors in cycles): freed by the collector
    during `make`, it would lower the peak below what the model allocated."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    model = make()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    share = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    layer = max(sum(p.numel() * p.element_size() for p in layer.parameters()) for layer in model.model.layers)
    return model, peak, share, layer


@pytest.mark.parametrize("ep, rank", [(8, 0), (8, 7), (32, 5)])
def test_rank_builds_and_loads_its_share_on_the_gpu(checkpoint, monkeypatch, ep, rank):
    def expert_slice(num_experts):
        return expert_bounds(num_experts, ep, rank)

    opened, real = set(), loading.safe_open

    def counting_open(filename, framework):
        opened.add(filename)
        return real(filename, framework=framework)

    monkeypatch.setattr(loading, "safe_open", counting_open)
    for source, make in (
        ("build", lambda: build_model("glm52", dtype=torch.bfloat16, device="cuda", seed=0,
                                      num_hidden_layers=LAYERS, expert_slice=expert_slice)),
        ("load", lambda: from_pretrained(checkpoint, dtype=torch.bfloat16, device="cuda",
                                         expert_slice=expert_slice)),
    ):
        model, peak, share, layer = measured(make)
        print(f"ep={ep} rank={rank} {source}: share {share / 2**30:.2f} GiB, CUDA peak {peak / 2**30:.2f} GiB "
              f"({peak / share:.4f}x), bound {(1.1 * share + layer) / 2**30:.2f} GiB")
        assert share <= peak <= 1.1 * share + layer
        del model
    files = set(json.loads((checkpoint / loading.INDEX).read_text())["weight_map"].values())
    assert len(opened) < len(files)
