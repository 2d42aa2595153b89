"""Model families behind one contract: `model(input_ids)`, `capture`, `logprobs`.

`build_model(name)` makes a randomly initialised model of a named shape; `from_pretrained(path)` loads an HF
directory (config.json + safetensors, sharded or not).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch

from longstraw_cli.models.glm52 import hf as glm52_hf
from longstraw_cli.models.glm52.config import NAMED_CONFIGS as GLM52_CONFIGS
from longstraw_cli.models.glm52.config import named_config as glm52_config
from longstraw_cli.models.glm52.model import Glm52ForCausalLM
from longstraw_cli.models.qwen36 import hf as qwen36_hf
from longstraw_cli.models.qwen36.config import NAMED_CONFIGS as QWEN36_CONFIGS
from longstraw_cli.models.qwen36.config import named_config as qwen36_config
from longstraw_cli.models.qwen36.model import Qwen36ForCausalLM

MODEL_NAMES = sorted([*QWEN36_CONFIGS, *GLM52_CONFIGS])


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def build_model(name: str, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                seed: int | None = None, **overrides) -> torch.nn.Module:
    """A randomly initialised model of a named shape; keyword overrides replace config fields."""
    if name not in MODEL_NAMES:
        raise ValueError(f"unknown model {name!r}; valid: {MODEL_NAMES}")
    if name in GLM52_CONFIGS:
        cfg, cls = glm52_config(name, **overrides), Glm52ForCausalLM
    else:
        cfg, cls = qwen36_config(name, **overrides), Qwen36ForCausalLM
    if seed is not None:
        torch.manual_seed(seed)
    # parameters are born in their dtype and on their device: a 27B shape never exists in fp32 on the host
    with _default_dtype(dtype), torch.device(device):
        model = cls(cfg)
    return model


def config_from_hf(hf_config: dict):
    """The family's config of an HF config.json dict: glm52 for `glm_moe_dsa`, else qwen36 (which names the
    valid model types when it rejects one)."""
    if hf_config.get("model_type") in glm52_hf.MODEL_TYPES:
        return glm52_hf.config_from_hf(hf_config)
    return qwen36_hf.config_from_hf(hf_config)


def _read_safetensors(path: Path):
    from safetensors import safe_open

    index = path / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (path / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        raise ValueError(f"{path} has neither model.safetensors nor model.safetensors.index.json")
    for file in files:
        with safe_open(str(path / file), framework="pt") as f:
            for key in f.keys():
                yield key, f.get_tensor(key)


def from_pretrained(path: str | Path, dtype: torch.dtype = torch.float32,
                    device: str | torch.device = "cpu") -> torch.nn.Module:
    """Load an HF directory of model_type `qwen3_5_text` or `qwen3_5` (its text weights), or `glm_moe_dsa`."""
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.exists():
        raise ValueError(f"{path} is not a Hugging Face model directory (no config.json)")
    hf_config = json.loads(config_file.read_text())
    if hf_config.get("model_type") in glm52_hf.MODEL_TYPES:
        return _load_glm52(path, glm52_hf.config_from_hf(hf_config), dtype, device)
    cfg = qwen36_hf.config_from_hf(hf_config)
    with _default_dtype(dtype), torch.device(device):
        model = Qwen36ForCausalLM(cfg)
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded = set()
    for key, tensor in _read_safetensors(path):
        name = qwen36_hf.hf_to_local_name(key)
        if name is None:
            continue
        if name not in params:
            raise ValueError(f"{path}: checkpoint key {key!r} has no counterpart in the qwen36 model")
        if tuple(params[name].shape) != tuple(tensor.shape):
            raise ValueError(f"{path}: {key} has shape {tuple(tensor.shape)}, expected {tuple(params[name].shape)}")
        with torch.no_grad():
            params[name].copy_(tensor.to(dtype))
        loaded.add(name)
    missing = sorted(set(params) - loaded)
    if cfg.tie_word_embeddings:
        missing = [m for m in missing if m != "lm_head.weight"]
    if missing:
        raise ValueError(f"{path}: checkpoint lacks {len(missing)} weights, e.g. {missing[:5]}")
    return model


def _load_glm52(path: Path, cfg, dtype: torch.dtype, device) -> torch.nn.Module:
    """Per-expert checkpoint keys fill slices of the 3-D expert parameters (glm52/hf.py); fp32-kept tensors
    (router weight and bias, indexer weights_proj) keep their own dtype."""
    with _default_dtype(dtype), torch.device(device):
        model = Glm52ForCausalLM(cfg)
    targets = dict(model.named_parameters(remove_duplicate=False))
    targets.update(model.named_buffers())
    filled = {name: 0 for name in targets}
    for key, tensor in _read_safetensors(path):
        mapped = glm52_hf.hf_to_local(key, cfg)
        if mapped is None:
            continue
        name, index = mapped
        if name not in targets:
            raise ValueError(f"{path}: checkpoint key {key!r} has no counterpart in the glm52 model")
        dest = targets[name][index]
        if tuple(dest.shape) != tuple(tensor.shape):
            raise ValueError(f"{path}: {key} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
        with torch.no_grad():
            dest.copy_(tensor.to(dest.dtype))
        filled[name] += dest.numel()
    missing = sorted(n for n, t in targets.items() if filled[n] < t.numel())
    if cfg.tie_word_embeddings:
        missing = [m for m in missing if m != "lm_head.weight"]
    if missing:
        raise ValueError(f"{path}: checkpoint lacks {len(missing)} weights, e.g. {missing[:5]}")
    return model


__all__ = ["MODEL_NAMES", "build_model", "config_from_hf", "from_pretrained"]
