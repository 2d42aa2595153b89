"""Reading an HF checkpoint directory into a model built on the meta device, part by part, each process only
its own tensors.

`CheckpointReader(path, model, key_map, cfg)` plans once: `model.safetensors.index.json` (or the one
`model.safetensors`) names every key's file; the family's key map names the parameter or buffer each key fills
and the part of it (glm52's per-expert keys `...experts.{e}.{gate,up,down}_proj.weight` fill rows of its 3-D
expert parameters). A module declaring `expert_rows = (lo, hi)` holds only those rows of its parameters' first
axis: keys of other experts are dropped from the plan, and a kept key's expert index is shifted by lo. Keys the
key map skips (layers past num_hidden_layers: GLM-5's MTP layer) are dropped too. `fill(part name, part)` (the
`fill` of models._by_parts) then opens the files holding that part's planned keys, reads exactly those tensors
and closes the files: a process opens only files that hold its tensors, reads only its tensors, and holds no
file mapping beyond the part being filled.

FP8 block-quantised checkpoints (config.json `quantization_config` {"quant_method": "fp8", "weight_block_size":
[128, 128]}, as DeepSeek-V3 and GLM-5-FP8 ship them): a float8_e4m3fn `X.weight` with its fp32
`X.weight_scale_inv` [ceil(rows / b0), ceil(cols / b1)] is dequantised on load, w = fp8 * scale_inv of its block,
in fp32, then cast to the parameter's dtype. All blocks of one tensor are scaled in one broadcast multiply
(one fp32 temporary of the tensor), not a Python loop over blocks. The frozen experts are not kept in FP8:
they load as the model dtype.

Why not torch.distributed.checkpoint's HuggingFaceStorageReader / QuantizedHuggingFaceStorageReader (torch 2.11
and 2.13): their `read_metadata` lists and opens every *.safetensors file in the directory (the index is not
consulted for that), once per `load` call, and `load` wants one state dict of whole target tensors keyed by the
checkpoint's names per call. Loading part by part (the peak bound: one layer in flight) would then open every
file once per part (~80 parts x ~140 files for GLM-5), and the quantized reader re-opens the scale's file for
every tensor whose scale lives elsewhere. This reader is small, reads the index once and opens only the files the
index names for this process's keys.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
SCALE_SUFFIX = "_scale_inv"
QUANT_METHODS = ("fp8",)


@dataclass(frozen=True)
class Planned:
    """One checkpoint key to read: its file, the target's name, the index of the part of it the key fills."""

    key: str
    file: str
    name: str
    index: tuple


def weight_map(path: Path) -> dict[str, str]:
    """{checkpoint key: file name} from the index, or of the one model.safetensors (its header read)."""
    index = path / INDEX
    if index.exists():
        return dict(json.loads(index.read_text())["weight_map"])
    if not (path / SINGLE).exists():
        raise ValueError(f"{path} has neither {SINGLE} nor {INDEX}")
    with _open(path, SINGLE) as handle:
        return dict.fromkeys(handle.keys(), SINGLE)


def fp8_block_size(path: Path) -> tuple[int, int]:
    """(rows, cols) of a quantisation block: config.json's quantization_config.weight_block_size, else 128 x 128."""
    quant = json.loads((path / "config.json").read_text()).get("quantization_config") or {}
    method = quant.get("quant_method", "fp8")
    if method not in QUANT_METHODS:
        raise ValueError(f"{path}: quantization_config.quant_method={method!r}; valid: {list(QUANT_METHODS)}")
    rows, cols = quant.get("weight_block_size", (128, 128))
    return int(rows), int(cols)


def dequantize_fp8(weight_RC: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """fp32 weight of a float8 [R, C] tensor and its per-block scales [ceil(R / b0), ceil(C / b1)]."""
    R, C = weight_RC.shape
    b0, b1 = block
    nr, nc = -(-R // b0), -(-C // b1)
    if tuple(scale_inv.shape) != (nr, nc):
        raise ValueError(f"scale_inv of shape {tuple(scale_inv.shape)} for a [{R}, {C}] weight in {b0}x{b1} "
                         f"blocks; expected ({nr}, {nc})")
    w = weight_RC.to(torch.float32)
    if R % b0 or C % b1:
        # partial edge blocks: pad to whole blocks, scale, cut back
        w = torch.nn.functional.pad(w, (0, nc * b1 - C, 0, nr * b0 - R))
    w = w.view(nr, b0, nc, b1).mul_(scale_inv.to(torch.float32)[:, None, :, None]).view(nr * b0, nc * b1)
    return w[:R, :C]


def _open(path: Path, file: str):
    try:
        return safe_open(str(path / file), framework="pt")
    except Exception as e:  # noqa: BLE001 - safetensors' own error type: a truncated or foreign file
        raise ValueError(f"{path / file}: not a readable safetensors file ({e})") from None


def expert_rows_by_param(model: torch.nn.Module) -> dict[str, tuple[int, int]]:
    """{parameter name: (lo, hi)} of every parameter of a module that holds a slice of experts."""
    rows = {}
    for module_name, module in model.named_modules():
        if getattr(module, "expert_rows", None) is not None:
            for name, _ in module.named_parameters(recurse=False):
                rows[f"{module_name}.{name}"] = module.expert_rows
    return rows


class CheckpointReader:
    """A model's reads from one HF directory, planned by part (see the module docstring)."""

    def __init__(self, path: str | Path, model: torch.nn.Module, key_map, cfg, parts: list[str]):
        self.path = Path(path)
        targets = dict(model.named_parameters(remove_duplicate=False))
        targets.update(model.named_buffers())
        self.sizes = {name: t.numel() for name, t in targets.items()}
        self.filled = dict.fromkeys(targets, 0)
        files = weight_map(self.path)
        rows = expert_rows_by_param(model)
        self.plan: dict[str, list[Planned]] = {part: [] for part in parts}
        self.fp8 = any(key.endswith(SCALE_SUFFIX) for key in files)
        self.block = fp8_block_size(self.path) if self.fp8 else None
        self.files = files
        for key, file in files.items():
            if key.endswith(SCALE_SUFFIX):
                continue
            mapped = key_map(key, cfg)
            if mapped is None:
                continue
            name, index = mapped
            if name not in targets:
                raise ValueError(f"{self.path}: checkpoint key {key!r} has no counterpart in the model")
            if name in rows:
                lo, hi = rows[name]
                if not lo <= index[0] < hi:
                    continue
                index = (index[0] - lo, *index[1:])
            part = next(p for p in parts if name.startswith(p + "."))
            self.plan[part].append(Planned(key, file, name, index))

    @torch.no_grad()
    def fill(self, part_name: str, part: torch.nn.Module) -> None:
        """Copy the part's planned keys into its (just materialised) tensors, one file at a time."""
        own = {f"{part_name}.{n}": t for n, t in part.named_parameters(remove_duplicate=False)}
        own.update((f"{part_name}.{n}", t) for n, t in part.named_buffers())
        by_file: dict[str, list[Planned]] = {}
        for item in self.plan[part_name]:
            by_file.setdefault(item.file, []).append(item)
        for file, items in by_file.items():
            with _open(self.path, file) as handle:
                for item in items:
                    dest = own[item.name][item.index]
                    tensor = self._read(handle, file, item.key)
                    if tuple(dest.shape) != tuple(tensor.shape):
                        raise ValueError(f"{self.path}: {item.key} has shape {tuple(tensor.shape)}, expected "
                                         f"{tuple(dest.shape)}")
                    dest.copy_(tensor)
                    del tensor
                    self.filled[item.name] += dest.numel()

    def _read(self, handle, file: str, key: str) -> torch.Tensor:
        tensor = handle.get_tensor(key)
        if tensor.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
            return tensor
        scale_key = key + SCALE_SUFFIX
        scale_file = self.files.get(scale_key)
        if scale_file is None:
            raise ValueError(f"{self.path}: {key} is {tensor.dtype} but the checkpoint has no {scale_key}")
        if scale_file == file:
            scale = handle.get_tensor(scale_key)
        else:
            with _open(self.path, scale_file) as other:
                scale = other.get_tensor(scale_key)
        return dequantize_fp8(tensor, scale, self.block)

    def missing(self, tied: tuple[str, ...] = ()) -> list[str]:
        """Names of targets the checkpoint did not fill completely (tied names excepted)."""
        return sorted(n for n, size in self.sizes.items() if self.filled[n] < size and n not in tied)
