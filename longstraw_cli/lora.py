"""LoRA adapters on a model's nn.Linear layers: the optimizer holds the adapters, the base stays frozen.

A targeted linear becomes a `LoraLinear` that keeps its base `weight` (the same Parameter, under the same name,
so checkpoints and HF names do not change) and adds `lora_A` [r, in] and `lora_B` [out, r]:

    y = x W^T + (alpha / r) * dropout(x) A^T B^T

B starts at zero, so a fresh adapter is an exact no-op. The reference policy is the same module with its adapters
switched off (`adapters_disabled`, `ReferencePolicy`): no second copy of the base weights is held.

Simplifications (peft has them, we do not): no rsLoRA or DoRA, no adapters on biases, embeddings, lm_head or
glm52's routed experts (3-D parameters, not nn.Linear: always frozen under LoRA), one rank and alpha for every
target.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from longstraw_cli.base_weights import NEVER_TARGETED, candidate_linears
from longstraw_cli.quantize import QUANTIZE_CHOICES, dense, linear

# HF's names of a qwen3_5-style layer's linears: qwen36's targets, and a model without a family's
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "out_proj", "gate_proj",
                   "up_proj", "down_proj")
ADAPTER_NAMES = ("lora_A", "lora_B")


def _family_targets() -> dict[str, tuple[str, ...]]:
    # the registry imports this module (qwen36's targets are DEFAULT_TARGETS): ask it at call time
    from longstraw_cli.models.spec import families

    return {spec.name: spec.lora_targets for spec in families()}


def _default_targets(model: nn.Module) -> tuple[str, ...]:
    family = getattr(model, "family", None)
    if family is None:
        return DEFAULT_TARGETS
    targets = _family_targets()
    if family not in targets:
        raise ValueError(f"no default LoRA targets for model family {family!r}; pass lora.target_modules "
                         f"(known families: {sorted(targets)})")
    return targets[family]


@dataclass(frozen=True)
class LoraConfig:
    # 0: LoRA off (full fine-tuning); the paper trains Qwen at 16, GLM at 8
    rank: int = 0
    alpha: float = 16.0
    dropout: float = 0.0
    # matched against the module path: the last component, or a dotted suffix ("mlp.down_proj");
    # None: the model family's `lora_targets` (models/*/spec.py)
    target_modules: tuple[str, ...] | None = None
    # "nf4": the frozen base linears stored 4-bit (QLoRA; quantize.py), "none": in the model dtype
    quantize: str = "none"

    def __post_init__(self):
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0:
            raise ValueError(f"lora rank must be an int >= 0 (0 = LoRA off), got {self.rank!r}")
        if self.quantize not in QUANTIZE_CHOICES:
            raise ValueError(f"lora.quantize={self.quantize!r}; valid: {list(QUANTIZE_CHOICES)}")
        if self.quantize != "none" and self.rank == 0:
            raise ValueError(f"lora.quantize={self.quantize} freezes a quantised base and trains adapters: it needs "
                             f"lora.rank > 0, got lora.rank=0 (full fine-tuning)")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not (
            math.isfinite(self.alpha) and self.alpha > 0
        ):
            raise ValueError(f"lora alpha must be a finite number > 0, got {self.alpha!r}")
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)) or not (
            0 <= self.dropout < 1
        ):
            raise ValueError(f"lora dropout must be in [0, 1), got {self.dropout!r}")
        if self.target_modules is None:
            return
        if isinstance(self.target_modules, str) or not isinstance(self.target_modules, (list, tuple)):
            raise ValueError(
                f"lora target_modules must be a list of module names, got {self.target_modules!r}; "
                f"family defaults: {_family_targets()}"
            )
        # a list from the config composer becomes the tuple a frozen config should hold
        object.__setattr__(self, "target_modules", tuple(self.target_modules))
        for target in self.target_modules:
            if not isinstance(target, str) or not target or target.split(".")[-1] in NEVER_TARGETED:
                raise ValueError(
                    f"lora target {target!r} is not allowed ({list(NEVER_TARGETED)} are never targeted); "
                    f"family defaults: {_family_targets()}"
                )
        duplicates = sorted({t for t in self.target_modules if self.target_modules.count(t) > 1})
        if duplicates:
            raise ValueError(f"lora target_modules lists {duplicates} more than once")
        if self.rank > 0 and not self.target_modules:
            raise ValueError(f"lora rank={self.rank} with no target_modules; family defaults: {_family_targets()}")

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


@torch.no_grad()
def merge_lora(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """W + scale * B @ A (A [r, in], B [out, r]), computed in at least fp32 and rounded once to W's dtype."""
    dtype = torch.promote_types(torch.promote_types(w.dtype, a.dtype), torch.float32)
    return (w.to(dtype) + scale * (b.to(dtype) @ a.to(dtype))).to(w.dtype)


class LoraLinear(nn.Linear):
    """nn.Linear plus a low-rank update; `weight` and `bias` are the wrapped linear's own Parameters."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float = 0.0,
                 dtype: torch.dtype | None = None):
        # nn.Linear.__init__ would allocate a new weight; the base's Parameters are adopted instead
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.register_parameter("bias", base.bias)
        self.rank, self.alpha, self.scaling = rank, float(alpha), alpha / rank
        w = base.weight
        dtype = dtype or w.dtype
        self.lora_A = nn.Parameter(torch.empty(rank, self.in_features, dtype=dtype, device=w.device))
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, rank, dtype=dtype, device=w.device))
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.adapter_enabled = True
        self.train(base.training)
        self.reset_lora_parameters()

    @torch.no_grad()
    def reset_lora_parameters(self) -> None:
        # peft's init: A like nn.Linear's default, B zero, so the update B A starts at exactly zero
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.lora_B.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = linear(x, self.weight, self.bias)
        if not self.adapter_enabled:
            return out
        h = self.lora_dropout(x).to(self.lora_A.dtype)
        delta = F.linear(F.linear(h, self.lora_A), self.lora_B) * self.scaling
        return out + delta.to(out.dtype)

    def folded_weight(self) -> torch.Tensor:
        """W + scale * B @ A, differentiably, for model code that reads the weight as a matrix (glm52's absorbed
        kv_b). The adapter's dropout cannot apply to a folded weight and is ignored."""
        weight = dense(self.weight)
        if not self.adapter_enabled:
            return weight
        return weight + (self.scaling * (self.lora_B @ self.lora_A)).to(weight.dtype)

    def merged_weight(self) -> torch.Tensor:
        return merge_lora(dense(self.weight), self.lora_A, self.lora_B, self.scaling)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.rank}, alpha={self.alpha:g}, adapter_enabled={self.adapter_enabled}"


def lora_layers(model: nn.Module) -> dict[str, LoraLinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLinear)}


def _matches(name: str, target: str) -> bool:
    return name == target or name.endswith("." + target)


def apply_lora(model: nn.Module, cfg: LoraConfig, *, dtype: torch.dtype | None = None) -> list[nn.Parameter]:
    """Swap every targeted nn.Linear for a LoraLinear in place, freeze everything else; -> the parameters to train.

    With cfg.rank > 0 those are the adapters only (build the optimizer from them). With rank 0 (LoRA off) the
    model is left untouched and its trainable parameters are returned: full fine-tuning. Adapters are created on
    each base weight's device, in `dtype` (None: the base weight's dtype; fp32 adapters on a bf16 base as peft's
    default are `dtype=torch.float32`)."""
    if not cfg.enabled:
        return [p for p in model.parameters() if p.requires_grad]
    if lora_layers(model):
        raise ValueError("model already has LoRA adapters; apply_lora once per model")
    candidates = candidate_linears(model)
    targets = cfg.target_modules
    if targets is None:
        targets = _default_targets(model)
    unknown = [t for t in targets if not any(_matches(name, t) for name in candidates)]
    if unknown:
        names = sorted({name.split(".")[-1] for name in candidates})
        raise ValueError(f"lora target_modules {unknown} match no nn.Linear of the model; its linears: {names}")
    targeted = [name for name in candidates if any(_matches(name, t) for t in targets)]
    for name in targeted:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        # setattr on a ModuleList with a digit name replaces that entry
        setattr(parent, child, LoraLinear(candidates[name], cfg.rank, cfg.alpha, cfg.dropout, dtype))
    model.requires_grad_(False)
    adapters = []
    for layer in lora_layers(model).values():
        for p in (layer.lora_A, layer.lora_B):
            p.requires_grad_(True)
            adapters.append(p)
    return adapters


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[nn.Module]:
    """The base model (the reference policy) inside the block; each adapter's flag is restored on exit."""
    layers = list(lora_layers(model).values())
    if not layers:
        # a no-op here would make the "reference" the trained policy itself and every KL silently zero
        raise ValueError("model has no LoRA adapters to disable; a reference policy needs its own model")
    previous = [layer.adapter_enabled for layer in layers]
    for layer in layers:
        layer.adapter_enabled = False
    try:
        yield model
    finally:
        for layer, flag in zip(layers, previous):
            layer.adapter_enabled = flag


class ReferencePolicy:
    """A LoRA model seen with its adapters off: pass as Transaction(ref_model=...), it shares every weight."""

    def __init__(self, model: nn.Module):
        if not lora_layers(model):
            raise ValueError("ReferencePolicy needs a model with LoRA adapters (apply_lora with rank > 0)")
        self.model = model

    def __call__(self, *args, **kwargs):
        with adapters_disabled(self.model):
            return self.model(*args, **kwargs)

    def capture(self, *args, **kwargs):
        with adapters_disabled(self.model):
            return self.model.capture(*args, **kwargs)

    def logprobs(self, *args, **kwargs):
        with adapters_disabled(self.model):
            return self.model.logprobs(*args, **kwargs)


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Adapter tensors only, by full name (`...q_proj.lora_A`); detached, sharing storage like state_dict()."""
    layers = lora_layers(model)
    if not layers:
        raise ValueError("model has no LoRA adapters (apply_lora with rank > 0 first)")
    return {f"{name}.{key}": getattr(layer, key).detach() for name, layer in layers.items() for key in ADAPTER_NAMES}


@torch.no_grad()
def load_lora_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """Copy adapter tensors in; the key sets must match exactly and every shape must agree."""
    own = lora_state_dict(model)
    missing = sorted(set(own) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(own))
    if missing or unexpected:
        raise ValueError(
            f"lora state dict does not fit the model: {len(missing)} missing, e.g. {missing[:3]}; "
            f"{len(unexpected)} unexpected, e.g. {unexpected[:3]}"
        )
    for key, tensor in state_dict.items():
        if tuple(tensor.shape) != tuple(own[key].shape):
            raise ValueError(
                f"lora tensor {key} has shape {tuple(tensor.shape)}, the model's is {tuple(own[key].shape)}"
            )
    for key, tensor in state_dict.items():
        own[key].copy_(tensor)


@torch.no_grad()
def merged_state_dict(model: nn.Module, device: str | torch.device | None = None, *,
                      merge: bool = True) -> dict[str, torch.Tensor]:
    """Every state_dict entry under its normal (HF) name, adapters merged into `weight` (merge=False: the base
    weights as they are), no lora_* keys.

    device: where each tensor goes right after it is formed ("cpu" keeps the accelerator's extra memory to one
    merged weight at a time); None leaves tensors where they are."""
    layers = lora_layers(model)
    out = {}
    for key, tensor in model.state_dict().items():
        module_name, _, leaf = key.rpartition(".")
        if leaf in ADAPTER_NAMES and module_name in layers:
            continue
        if merge and leaf == "weight" and module_name in layers:
            tensor = layers[module_name].merged_weight()
        # a quantised base (lora.quantize=nf4) is written dequantised, in the model dtype
        tensor = dense(tensor)
        out[key] = tensor if device is None else tensor.to(device)
    return out


__all__ = [
    "DEFAULT_TARGETS", "LoraConfig", "LoraLinear", "ReferencePolicy", "adapters_disabled", "apply_lora",
    "load_lora_state_dict", "lora_layers", "lora_state_dict", "merge_lora", "merged_state_dict",
]
