"""One registry of model families (torchtitan's `TrainSpec` / `register_train_spec`).

Each family registers one `FamilySpec` in its package's `spec.py`: the model class, its named configs, its
Hugging Face adapter, its parallelize hooks, its LoRA targets and its memory plan hook. Code that
needs to know a family asks `family_of(model name | model)` or `get_family(family name)`; nothing else branches
on a family's name.

Parallelize and plan hooks are import paths ("module:function"), resolved when called: the model packages import no
torch.distributed, and building a model imports none of the parallel code.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["FamilySpec", "HFAdapter", "check_sizes", "config_with_overrides", "families", "family_of", "family_of_hf",
           "get_family", "register_family"]


@dataclass(frozen=True)
class HFAdapter:
    """How a family reads and writes Hugging Face directories."""

    # config.json model types it reads
    model_types: tuple[str, ...]
    # config.json dict <-> the family's config
    config_from_hf: Callable[[dict], Any]
    config_to_hf: Callable[[Any], dict]
    # (checkpoint key, config) -> (our parameter/buffer name, index of the part the key fills; () = all), or None
    key_map: Callable[[str, Any], tuple[str, tuple] | None]
    # its inverse, for export_hf and rollout=vllm: (our name, config, (lo, hi) global expert rows the tensor holds,
    # None for a tensor that is not split by experts) -> [(checkpoint key, index of the part of the tensor it takes)]
    local_to_hf: Callable[[str, Any, tuple[int, int] | None], list[tuple[str, tuple]]]


@dataclass(frozen=True, eq=False)
class FamilySpec:
    name: str
    model_cls: type
    # the NAMED_CONFIGS dict, and the function that builds one with keyword overrides
    configs: Mapping[str, Any]
    named_config: Callable[..., Any]
    hf: HFAdapter
    lora_targets: tuple[str, ...]
    # "module:function" hooks: apply_context_parallel(model, group), apply_expert_parallel(model, ep_group, cp_group=)
    context_parallel: str | None = None
    expert_parallel: str | None = None
    # "module:function" hook of `longstraw plan`: plan(model config, plan.common.Run) -> bytes by component and
    # phase (longstraw_cli/plan/); None: the family's memory is not planned
    plan: str | None = None
    # "module:function" hook: flops(model config, captured tokens, **pair counts) -> FLOPs of the prompt capture by
    # term (longstraw_cli/plan/flops.py); None: not counted
    flops: str | None = None
    # the optional packages whose kernels this family's GPU fast path runs (longstraw_kernels.FAST_PATHS): a GPU
    # run without one says once what it costs
    fast_paths: tuple[str, ...] = ()
    # "module:Class" of its routing replay (routed experts or DSA selections recorded at rollout and forced in
    # scoring and replay: `rollout.replay_routing`, models/glm52/routing.py); None: nothing is routed
    routing: str | None = None

    def routing_replay(self, setting):
        """The family's routing replay for `rollout.replay_routing` (auto | true | false | measure), or None (off;
        auto where the family routes nothing). measure: records and counts flips, forces nothing."""
        if setting is False or (setting == "auto" and self.routing is None):
            return None
        if self.routing is None:
            raise ValueError(f"rollout.replay_routing={str(setting).lower()}: model family {self.name!r} routes no "
                             f"token (no MoE, no DSA); valid families: {[s.name for s in families() if s.routing]}")
        return _resolve(self.routing)(force=setting != "measure")

    def apply_context_parallel(self, model, group) -> None:
        if self.context_parallel is None:
            raise ValueError(f"model family {self.name!r} has no context parallel; valid: "
                             f"{[s.name for s in families() if s.context_parallel]}")
        _resolve(self.context_parallel)(model, group)

    def apply_expert_parallel(self, model, ep_group, *, cp_group=None) -> None:
        if self.expert_parallel is None:
            raise ValueError(f"model family {self.name!r} has no routed experts to split; valid: "
                             f"{[s.name for s in families() if s.expert_parallel]}")
        _resolve(self.expert_parallel)(model, ep_group, cp_group=cp_group)


_FAMILIES: dict[str, FamilySpec] = {}


def register_family(spec: FamilySpec) -> FamilySpec:
    if spec.name in _FAMILIES:
        raise ValueError(f"model family {spec.name!r} is registered twice")
    clash = sorted(name for name in spec.configs if any(name in s.configs for s in _FAMILIES.values()))
    if clash:
        raise ValueError(f"model family {spec.name!r} names configs {clash} that another family already names")
    if getattr(spec.model_cls, "family", None) != spec.name:
        raise ValueError(f"{spec.model_cls.__name__}.family must be {spec.name!r}")
    _FAMILIES[spec.name] = spec
    return spec


def families() -> list[FamilySpec]:
    """Every registered family, by name (so messages do not depend on import order)."""
    return [_FAMILIES[name] for name in sorted(_FAMILIES)]


def get_family(name: str) -> FamilySpec:
    if name not in _FAMILIES:
        raise ValueError(f"unknown model family {name!r}; valid: {sorted(_FAMILIES)}")
    return _FAMILIES[name]


def family_of(name_or_model) -> FamilySpec:
    """The family of a named config ("glm52_tiny"), or of a model (its class's `family`; DDP and DeepSpeed
    wrappers are looked through)."""
    if isinstance(name_or_model, str):
        for spec in families():
            if name_or_model in spec.configs:
                return spec
        names = sorted(name for spec in families() for name in spec.configs)
        raise ValueError(f"unknown model {name_or_model!r}; valid: {names}")
    model = name_or_model
    while getattr(model, "family", None) is None and hasattr(model, "module"):
        model = model.module
    return get_family(getattr(model, "family", None))


def family_of_hf(hf_config: dict) -> FamilySpec:
    """The family that reads an HF config.json dict, by its model_type."""
    model_type = hf_config.get("model_type")
    for spec in families():
        if model_type in spec.hf.model_types:
            return spec
    valid = [t for spec in families() for t in spec.hf.model_types]
    raise ValueError(f"model_type {model_type!r} is not a checkpoint LongStraw reads; valid: {valid}")


def check_sizes(cfg, may_be_zero: tuple[str, ...] = ()) -> None:
    """A ValueError naming the first integer field of a model config below 1 (below 0 for `may_be_zero`): a count
    or a width, which a config.json or model.override_config may get wrong."""
    for field in dataclasses.fields(cfg):
        value, least = getattr(cfg, field.name), 0 if field.name in may_be_zero else 1
        if isinstance(value, int) and not isinstance(value, bool) and value < least:
            raise ValueError(f"{field.name}={value} must be >= {least}")


def config_with_overrides(family: str, configs: Mapping[str, Any], name: str, overrides: dict):
    """configs[name] with keyword overrides of its fields; a ValueError names an unknown config or field."""
    if name not in configs:
        raise ValueError(f"unknown {family} config {name!r}; valid: {sorted(configs)}")
    base = configs[name]
    fields = {f.name for f in dataclasses.fields(base)}
    bad = sorted(set(overrides) - fields)
    if bad:
        raise ValueError(f"unknown model override(s) {bad}; valid: {sorted(fields)}")
    return dataclasses.replace(base, **overrides)


def _resolve(path: str) -> Callable:
    module, _, function = path.partition(":")
    return getattr(importlib.import_module(module), function)
