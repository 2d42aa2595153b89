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
and its sampling settings. glm52 is refused before the run starts (models/glm52/spec.py: export_refusal).

peft names: `base_model.model.<module>.lora_{A,B}.weight`, with `target_modules` the patterns apply_lora used
(its suffix rule is peft's), so peft adapts the same modules; `lora_alpha / r` is our scaling.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from longstraw_cli.checkpoint.atomic import atomic_directory
from longstraw_cli.lora import LoraConfig, _default_targets, export_hf, lora_layers
from longstraw_cli.rollout.native import SamplingConfig
from longstraw_cli.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer


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


@torch.no_grad()
def export_run(model: nn.Module, run_dir: Path, *, tokenizer: Tokenizer, stop_token_ids: tuple[int, ...],
               sampling: SamplingConfig, lora: LoraConfig, model_path: str | None) -> list[Path]:
    """Everything in the module doc, on the process that holds whole weights; -> the directories written."""
    run_dir = Path(run_dir)

    def with_tokenizer(out: Path) -> None:
        write_tokenizer(tokenizer, out)
        write_generation_config(tokenizer, stop_token_ids, sampling, out)

    written = [export_hf(model, run_dir / "hf", extra=with_tokenizer)]
    if lora.enabled:
        base = model_path
        if base is None:
            base = str(export_hf(model, run_dir / "hf_base", merge=False, extra=with_tokenizer))
            written.append(Path(base))
        written.append(write_peft_adapter(model, lora, str(Path(base).resolve()), run_dir / "hf_adapter"))
    return written
