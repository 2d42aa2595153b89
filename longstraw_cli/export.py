"""What `export_hf=true` writes at the end of a run, for the tools a verl or TRL user loads it with:

    run_dir/hf/           trained weights (LoRA merged), config.json, the tokenizer's files, generation_config.json:
                          AutoModelForCausalLM / AutoTokenizer / GenerationConfig.from_pretrained, vLLM
    run_dir/hf_adapter/   with LoRA: the adapters in peft's format (adapter_config.json + adapter_model.safetensors),
                          for peft.PeftModel.from_pretrained(base, run_dir/hf_adapter)
    run_dir/hf_base/      with LoRA on a named shape (random weights nobody else has): the base the adapters belong
                          on; with model.path the base is that directory

The tokenizer is saved as it was loaded (an HF tokenizer's own files, a custom chat template included); the
byte tokenizer is written as an equivalent HF byte-level tokenizer (bytes are ids 0..255, then <pad>, <s>,
</s>), so AutoTokenizer gives the same ids. generation_config.json holds every stop token the run stopped at
and its sampling settings.

Weights (`export_hf`) are written as HF's save_pretrained writes them: one `model.safetensors` when everything
fits one file of `max_shard_bytes`, else numbered shards `model-0000i-of-0000n.safetensors` and
`model.safetensors.index.json` naming every key's file. Names are the family's checkpoint keys
(`HFAdapter.local_to_hf`): glm52's 3-D expert tensors become per-expert keys at their global index. Tensors are
formed one at a time (a LoRA weight merged, an NF4 weight dequantised, one expert's matrix cut out and copied) and
held only until their shard is written.

Under expert parallel (`group`, the EP group): the ranks of the EP group holding global rank 0 write, each its own
experts into its own shards; rank 0 also writes the replicated tensors, config.json, the index and `extra`'s
files. The ranks exchange only key names and shard counts (small Python objects), never a tensor: no rank forms
another's experts. Every writer must see the same filesystem (one node, or a shared one). Ranks of other EP
groups (and of data parallelism) hold the same weights and write nothing.

peft names: `base_model.model.<module>.lora_{A,B}.weight`, with `target_modules` the patterns apply_lora used
(its suffix rule is peft's), so peft adapts the same modules; `lora_alpha / r` is our scaling. LoRA adapts no
routed expert, so the adapter file is rank 0's alone.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn

from longstraw_cli.checkpoint.atomic import atomic_directory
from longstraw_cli.lora import ADAPTER_NAMES, LoraConfig, _default_targets, lora_layers
from longstraw_cli.models.loading import INDEX, SINGLE, expert_rows_by_param
from longstraw_cli.models.spec import family_of
from longstraw_cli.quantize import dense
from longstraw_cli.rollout.native import SamplingConfig
from longstraw_cli.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

# save_pretrained's default max_shard_size ("5GB")
MAX_SHARD_BYTES = 5 * 10**9


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in character for each byte (the `tokenizers` ByteLevel pre-tokenizer's alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    chars = {b: chr(b) for b in printable}
    chars.update({b: chr(256 + n) for n, b in enumerate(others)})
    return chars


def write_byte_tokenizer(tokenizer: ByteTokenizer, out: Path) -> None:
    """The byte tokenizer as HF files: a byte-level BPE without merges (one token per byte, id = byte)."""
    try:
        from tokenizers import Tokenizer as RustTokenizer
        from tokenizers import decoders, models, pre_tokenizers
    except ImportError as e:
        raise ImportError("exporting the byte tokenizer as HF files needs the tokenizers package "
                          "(pip install tokenizers; it comes with transformers)") from e
    vocab = {char: byte for byte, char in _bytes_to_unicode().items()}
    rust = RustTokenizer(models.BPE(vocab=vocab, merges=[]))
    rust.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    rust.decoder = decoders.ByteLevel()
    specials = {tokenizer.pad_token_id: "<pad>", tokenizer.bos_token_id: "<s>", tokenizer.eos_token_id: "</s>"}
    rust.add_special_tokens([specials[i] for i in sorted(specials)])
    assert [rust.token_to_id(t) for t in specials.values()] == list(specials), "special ids moved"
    rust.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "pad_token": "<pad>", "bos_token": "<s>",
              "eos_token": "</s>", "add_bos_token": False, "clean_up_tokenization_spaces": False}
    if tokenizer.chat_template is not None:
        config["chat_template"] = tokenizer.chat_template
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def write_tokenizer(tokenizer: Tokenizer, out: Path) -> None:
    if isinstance(tokenizer, HFTokenizer):
        tokenizer.hf.save_pretrained(str(out))
    elif isinstance(tokenizer, ByteTokenizer):
        write_byte_tokenizer(tokenizer, out)
    else:
        raise ValueError(f"cannot export a tokenizer of type {type(tokenizer).__name__}: not an HF or byte tokenizer")


def write_generation_config(tokenizer: Tokenizer, stop_token_ids: tuple[int, ...], sampling: SamplingConfig,
                            out: Path) -> None:
    config = {"bos_token_id": tokenizer.bos_token_id, "pad_token_id": tokenizer.pad_token_id,
              "eos_token_id": list(stop_token_ids) if len(stop_token_ids) > 1 else stop_token_ids[0],
              "do_sample": sampling.temperature > 0, "temperature": sampling.temperature, "top_p": sampling.top_p}
    (out / "generation_config.json").write_text(json.dumps(config, indent=2) + "\n")


def write_peft_adapter(model: nn.Module, lora: LoraConfig, base: str, out_dir: Path) -> Path:
    """The model's LoRA adapters in peft's layout, for `PeftModel.from_pretrained(<base>, out_dir)`."""
    layers = lora_layers(model)
    if not layers:
        raise ValueError("model has no LoRA adapters to export")
    tensors = {}
    for name, layer in layers.items():
        for key in ("lora_A", "lora_B"):
            tensors[f"base_model.model.{name}.{key}.weight"] = getattr(layer, key).detach().to("cpu").contiguous()
    targets = lora.target_modules if lora.target_modules is not None else _default_targets(model)
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base, "r": lora.rank,
              "lora_alpha": lora.alpha, "lora_dropout": lora.dropout, "target_modules": sorted(targets),
              "bias": "none", "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True,
              "use_rslora": False, "use_dora": False, "modules_to_save": None}
    with atomic_directory(out_dir) as tmp:
        save_file(tensors, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
        (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out_dir


# -- weights ------------------------------------------------------------------------------------------------------
def take(tensor: torch.Tensor, index: tuple) -> torch.Tensor:
    """The part `index` of a tensor, in the model dtype: an expert's index is applied first (an NF4 expert tensor
    then dequantises that expert alone), then the rows within it."""
    if index:
        tensor = tensor[index[0]]
    tensor = dense(tensor)
    return tensor[index[1:]] if len(index) > 1 else tensor


@dataclass(frozen=True)
class Part:
    """One checkpoint key to write: its shape and dtype (known before it is formed) and how to form it."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    form: Callable[[], torch.Tensor]

    @property
    def nbytes(self) -> int:
        return torch.Size(self.shape).numel() * self.dtype.itemsize


def hf_parts(model: nn.Module, *, merge: bool, replicated: bool = True) -> list[Part]:
    """This process's checkpoint keys, in state-dict order: every entry under the family's HF names, adapters
    merged (merge=False: the base weights), no lora_* keys, a tied lm_head left out (HF ties it on load). Expert
    tensors give their held experts at their global index; replicated=False leaves out everything else."""
    spec = family_of(model)
    cfg = model.config
    layers = lora_layers(model)
    rows = expert_rows_by_param(model)
    parts = []
    for name, tensor in model.state_dict(keep_vars=True).items():
        module_name, _, leaf = name.rpartition(".")
        if module_name in layers and leaf in ADAPTER_NAMES:
            continue
        if cfg.tie_word_embeddings and name == "lm_head.weight":
            continue
        if name not in rows and not replicated:
            continue
        merged = layers[module_name].merged_weight if merge and leaf == "weight" and module_name in layers else None
        for key, index in spec.hf.local_to_hf(name, cfg, rows.get(name)):
            shape = tuple(torch.empty(tensor.shape, device="meta")[index].shape)
            parts.append(Part(key, shape, tensor.dtype, _former(tensor, index, merged)))
    return parts


def _former(tensor: torch.Tensor, index: tuple, merged: Callable[[], torch.Tensor] | None):
    def form() -> torch.Tensor:
        if merged is not None:
            return dense(merged()).detach().to("cpu").contiguous()
        part = take(tensor.detach(), index).to("cpu")
        # a part of a larger tensor (one expert's gate or up rows) is copied: safetensors refuses tensors that
        # share storage, and the copy is that part alone
        return part.clone() if index else part.contiguous()

    return form


def _shards(parts: list[Part], max_bytes: int) -> list[list[Part]]:
    """Consecutive parts packed into files of at most max_bytes (a larger part gets a file of its own)."""
    shards, size = [], 0
    for part in parts:
        if not shards or (size + part.nbytes > max_bytes and shards[-1]):
            shards.append([])
            size = 0
        shards[-1].append(part)
        size += part.nbytes
    return shards


def _writers(group) -> tuple[bool, object]:
    """(whether this process writes, the group of writers or None for one writer). With an EP group of several
    ranks: its ranks write if it holds global rank 0; without one: global rank 0 alone (or the one process)."""
    if group is not None and dist.get_world_size(group) > 1:
        return 0 in dist.get_process_group_ranks(group), group
    return not dist.is_initialized() or dist.get_rank() == 0, None


def _all_gather(obj, group) -> list:
    if group is None:
        return [obj]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


@torch.no_grad()
def export_hf(model: nn.Module, out_dir: str | Path, *, merge: bool = True,
              extra: Callable[[Path], None] | None = None, group=None,
              max_shard_bytes: int = MAX_SHARD_BYTES) -> Path | None:
    """Write a model, adapters merged (merge=False: its base weights), as an HF directory of its family's model
    type (module docstring: files, names, who writes under expert parallel). `extra` writes more files into the
    directory before it appears (export_run: tokenizer, generation config). Every rank of `group` calls it.

    The directory appears whole or not at all (`checkpoint.atomic_directory`, on rank 0); an existing out_dir is
    replaced. -> out_dir on the writers, None on ranks that write nothing."""
    writes, group = _writers(group)
    if not writes:
        return None
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"export target {out} exists and is not a directory")
    if any(p.is_meta for p in model.parameters()):
        raise ValueError("export_hf needs materialised weights; the model has meta parameters")
    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be >= 1, got {max_shard_bytes}")
    first = group is None or dist.get_rank(group) == 0
    if not first:
        _write_weights(model, _received_dir(group), merge=merge, first=False, group=group, max_bytes=max_shard_bytes)
        return out
    spec = family_of(model)
    hf_config = spec.hf.config_to_hf(model.config)
    hf_config["dtype"] = str(model.state_dict()["model.embed_tokens.weight"].dtype).removeprefix("torch.")
    with atomic_directory(out) as tmp:
        if group is not None:
            dist.broadcast_object_list([str(tmp)], group_src=0, group=group)
        _write_weights(model, tmp, merge=merge, first=True, group=group, max_bytes=max_shard_bytes)
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
        if extra is not None:
            extra(tmp)
    return out


def _received_dir(group) -> Path:
    box = [None]
    dist.broadcast_object_list(box, group_src=0, group=group)
    return Path(box[0])


def _write_weights(model: nn.Module, tmp: Path, *, merge: bool, first: bool, group, max_bytes: int) -> list[str]:
    """This rank's shards into tmp (the first rank: the replicated tensors and its experts, the others their
    experts), then, on the first rank, the index of every rank's keys. -> the files this rank wrote."""
    shards = _shards(hf_parts(model, merge=merge, replicated=first), max_bytes)
    counts = _all_gather(len(shards), group)
    rank = 0 if group is None else dist.get_rank(group)
    start, total = sum(counts[:rank]), sum(counts)
    weight_map, files, total_bytes = {}, [], 0
    for i, shard in enumerate(shards):
        file = SINGLE if total == 1 else f"model-{start + i + 1:05d}-of-{total:05d}.safetensors"
        tensors = {part.key: part.form() for part in shard}
        save_file(tensors, str(tmp / file), metadata={"format": "pt"})
        del tensors
        weight_map.update(dict.fromkeys((part.key for part in shard), file))
        total_bytes += sum(part.nbytes for part in shard)
        files.append(file)
    # a barrier too: every rank's files are written before the first rank lets the directory appear
    maps = _all_gather((weight_map, total_bytes), group)
    if first and total > 1:
        merged_map = {}
        for rank_map, _ in maps:
            clash = sorted(set(merged_map) & set(rank_map))
            assert not clash, f"keys written by two ranks: {clash[:4]}"
            merged_map.update(rank_map)
        index = {"metadata": {"total_size": sum(b for _, b in maps)}, "weight_map": dict(sorted(merged_map.items()))}
        (tmp / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return files


@torch.no_grad()
def export_run(model: nn.Module, run_dir: Path, *, tokenizer: Tokenizer, stop_token_ids: tuple[int, ...],
               sampling: SamplingConfig, lora: LoraConfig, model_path: str | None, group=None) -> list[Path]:
    """Everything in the module doc; every rank of `group` (the EP group, or None) calls it. -> the directories
    written (empty on a rank that writes nothing)."""
    run_dir = Path(run_dir)

    def with_tokenizer(out: Path) -> None:
        write_tokenizer(tokenizer, out)
        write_generation_config(tokenizer, stop_token_ids, sampling, out)

    merged = export_hf(model, run_dir / "hf", extra=with_tokenizer, group=group)
    if merged is None:
        return []
    written = [merged]
    if lora.enabled:
        base = model_path
        if base is None:
            base = str(export_hf(model, run_dir / "hf_base", merge=False, extra=with_tokenizer, group=group))
            written.append(Path(base))
        first = group is None or dist.get_world_size(group) == 1 or dist.get_rank(group) == 0
        if first:
            written.append(write_peft_adapter(model, lora, str(Path(base).resolve()), run_dir / "hf_adapter"))
    return written
