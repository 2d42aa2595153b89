"""Model families behind one contract: `model(input_ids)`, `capture`, `logprobs`.

Each family registers a `FamilySpec` (models/spec.py) from its package's `spec.py`; everything here goes
through that registry. `build_model(name)` makes a randomly initialised model of a named shape;
`from_pretrained(path)` loads an HF directory (config.json + safetensors, sharded or not).
"""

from __future__ import annotations

import contextlib
import functools
import json
from pathlib import Path

import torch

# each family's spec.py registers it on import
import longstraw_cli.models.glm52.spec
import longstraw_cli.models.qwen36.spec  # noqa: F401
from longstraw_cli.models.spec import (
    FamilySpec,
    families,
    family_of,
    family_of_hf,
    get_family,
)

MODEL_NAMES = sorted(name for spec in families() for name in spec.configs)


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
    spec = family_of(name)
    cfg = spec.named_config(name, **overrides)
    if seed is not None:
        torch.manual_seed(seed)
    # parameters are born in their dtype and on their device: a 27B shape never exists in fp32 on the host
    with _default_dtype(dtype), torch.device(device):
        model = spec.model_cls(cfg)
    return model


def config_from_hf(hf_config: dict):
    """The family's config of an HF config.json dict, chosen by its model_type."""
    return family_of_hf(hf_config).hf.config_from_hf(hf_config)


def hf_model_config(path: str | Path) -> tuple[FamilySpec, object]:
    """(family, family config) of an HF model directory. config.json is read once per process (and again only if
    it changes): config checks, `longstraw plan` and `from_pretrained` all ask here."""
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise ValueError(f"{path} is not a Hugging Face model directory (no config.json)")
    stat = config_file.stat()
    return _read_hf_config(str(config_file.resolve()), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=16)
def _read_hf_config(config_file: str, mtime_ns: int, size: int) -> tuple[FamilySpec, object]:
    hf_config = json.loads(Path(config_file).read_text())
    spec = family_of_hf(hf_config)
    return spec, spec.hf.config_from_hf(hf_config)


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
        try:
            handle = safe_open(str(path / file), framework="pt")
        except Exception as e:  # noqa: BLE001 - safetensors' own error type: a truncated or foreign file
            raise ValueError(f"{path / file}: not a readable safetensors file ({e})") from None
        with handle as f:
            for key in f.keys():
                yield key, f.get_tensor(key)


def from_pretrained(path: str | Path, dtype: torch.dtype = torch.float32,
                    device: str | torch.device = "cpu") -> torch.nn.Module:
    """Load an HF directory of any registered family's model types (`qwen3_5_text`, `qwen3_5`'s text weights,
    `glm_moe_dsa`).

    The family's key map names the parameter or buffer each checkpoint key fills, and the part of it (glm52's
    per-expert keys fill slices of its 3-D expert parameters). Tensors keep their target's dtype (glm52 keeps
    the router weight and bias and the indexer's weights_proj in fp32)."""
    path = Path(path)
    spec, cfg = hf_model_config(path)
    with _default_dtype(dtype), torch.device(device):
        model = spec.model_cls(cfg)
    targets = dict(model.named_parameters(remove_duplicate=False))
    targets.update(model.named_buffers())
    filled = {name: 0 for name in targets}
    for key, tensor in _read_safetensors(path):
        mapped = spec.hf.key_map(key, cfg)
        if mapped is None:
            continue
        name, index = mapped
        if name not in targets:
            raise ValueError(f"{path}: checkpoint key {key!r} has no counterpart in the {spec.name} model")
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


__all__ = ["MODEL_NAMES", "build_model", "config_from_hf", "families", "family_of", "from_pretrained",
           "get_family", "hf_model_config"]
