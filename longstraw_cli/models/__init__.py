"""Model families behind one contract: `model(input_ids)`, `capture`, `logprobs`.

Each family registers a `FamilySpec` (models/spec.py) from its package's `spec.py`; everything here goes
through that registry. `build_model(name)` makes a randomly initialised model of a named shape;
`from_pretrained(path)` loads an HF directory (config.json + safetensors, sharded or not, bf16 or FP8
block-quantised; models/loading.py). Both take `expert_slice` to hold only some routed experts (expert parallel).
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
from longstraw_cli.models.core import units
from longstraw_cli.models.loading import CheckpointReader
from longstraw_cli.models.spec import (
    FamilySpec,
    families,
    family_of,
    family_of_hf,
    get_family,
)
from longstraw_cli.quantize import QUANTIZE_CHOICES, quantize_linears, torchao_nf4

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
                seed: int | None = None, quantize: str = "none", expert_slice=None, **overrides) -> torch.nn.Module:
    """A randomly initialised model of a named shape; keyword overrides replace config fields.

    expert_slice (families with routed experts): a function num_experts -> (lo, hi), the rows of the routed
    experts to hold (distributed/ep.py's `ep_slice` gives an EP rank its own); the model then holds only those
    experts and every replicated part, and nothing else is ever allocated. A named config's routed experts are
    drawn expert by expert (glm52 `Experts.reset_parameters`: expert e from a generator seeded by the layer's base
    seed and e), so expert e has the same weights whichever slice holds it, and every replicated part the same
    numbers whatever the slice: a model built expert-parallel equals the one built whole.

    quantize="nf4" (quantize.py): built on the meta device, then part by part (embeddings, each decoder layer,
    norm, lm_head) materialised, initialised and its base linears quantised before the next part, so the model
    never exists whole in `dtype`. Its random weights are drawn part by part: the plain build's distributions,
    not its numbers (that build draws every module's construction-time init first)."""
    spec = family_of(name)
    cfg = spec.named_config(name, **overrides)
    if seed is not None:
        torch.manual_seed(seed)
    if quantize != "none":
        model = _on_meta(spec, cfg, dtype, quantize, expert_slice)
        with _default_dtype(dtype):
            return _by_parts(model, device, lambda _, part: model.reset_parameters(root=part), quantize)
    # parameters are born in their dtype and on their device (only this process's experts): a 27B shape never
    # exists in fp32 on the host
    with _default_dtype(dtype), torch.device(device):
        model = spec.model_cls(cfg, **_slice_kwargs(spec, expert_slice))
    return model


def _slice_kwargs(spec: FamilySpec, expert_slice) -> dict:
    if expert_slice is None:
        return {}
    if spec.expert_parallel is None:
        raise ValueError(f"expert_slice given for model family {spec.name!r}, which has no routed experts; valid "
                         f"families: {[s.name for s in families() if s.expert_parallel]}")
    return {"expert_slice": expert_slice}


def _on_meta(spec: FamilySpec, cfg, dtype: torch.dtype, quantize: str, expert_slice=None) -> torch.nn.Module:
    """The model's structure without storage (of its own experts only, with expert_slice); checks the quantize
    choice (and that torchao imports) first."""
    if quantize not in QUANTIZE_CHOICES:
        raise ValueError(f"quantize={quantize!r}; valid: {list(QUANTIZE_CHOICES)}")
    if quantize == "nf4":
        torchao_nf4()
    with _default_dtype(dtype), torch.device("meta"):
        return spec.model_cls(cfg, **_slice_kwargs(spec, expert_slice))


def _by_parts(model: torch.nn.Module, device, fill, quantize: str) -> torch.nn.Module:
    """A meta model materialised on `device` one part at a time (`core.units`): each part allocated, filled by
    `fill(part name, part)`, and, for a decoder layer under quantize="nf4", its base linears quantised. The peak
    is what the model holds plus what filling one part needs."""
    layers = {id(layer) for layer in model.model.layers}
    for name, part in units(model):
        part.to_empty(device=device)
        fill(name, part)
        if quantize == "nf4" and id(part) in layers:
            quantize_linears(part)
    if model.config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
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


def from_pretrained(path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                    quantize: str = "none", expert_slice=None) -> torch.nn.Module:
    """Load an HF directory of any registered family's model types (`qwen3_5_text`, `qwen3_5`'s text weights,
    `glm_moe_dsa`).

    The model is built on the meta device and loaded one part at a time (`core.units`) by
    `loading.CheckpointReader`: model.safetensors.index.json decides which files are opened, and only the keys
    this process holds are read. The family's key map names the parameter or buffer each checkpoint key fills,
    and the part of it (glm52's per-expert keys fill rows of its 3-D expert parameters; with `expert_slice`, as in
    `build_model`, only this process's experts are allocated and read). FP8 block-quantised weights
    (`weight_scale_inv`) are dequantised to `dtype` on load. Tensors keep their target's dtype (glm52 keeps the
    router weight and bias and the indexer's weights_proj in fp32). quantize="nf4" quantises each decoder layer's
    base linears as soon as it is loaded (quantize.py)."""
    path = Path(path)
    spec, cfg = hf_model_config(path)
    model = _on_meta(spec, cfg, dtype, quantize, expert_slice)
    reader = CheckpointReader(path, model, spec.hf.key_map, cfg, [name for name, _ in units(model)])
    _by_parts(model, device, reader.fill, quantize)
    missing = reader.missing(tied=("lm_head.weight",) if cfg.tie_word_embeddings else ())
    if missing:
        raise ValueError(f"{path}: checkpoint lacks {len(missing)} weights, e.g. {missing[:5]}")
    return model


__all__ = ["MODEL_NAMES", "build_model", "config_from_hf", "families", "family_of", "from_pretrained",
           "get_family", "hf_model_config"]
