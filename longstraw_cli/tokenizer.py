"""Tokenizers behind one small interface: a built-in byte tokenizer, or a local Hugging Face tokenizer.

The trainer and the tasks need only `encode` (no special tokens), `decode` (special tokens dropped),
`eos_token_id`, `pad_token_id`, `bos_token_id` and `vocab_size`. The byte tokenizer needs no files, so tests
and tiny random models run without downloading anything.

A model's embedding table is often larger than its tokenizer (Qwen's and GLM's are padded; a random model's
vocabulary is its own), and the policy samples from the whole table, which is also what training scores. So
`decode` never fails on an id the tokenizer lacks: each such id decodes as U+FFFD, the replacement character,
as undecodable bytes do; the reward sees it, and the trained tokens are the sampled ids themselves.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol


class Tokenizer(Protocol):
    eos_token_id: int
    pad_token_id: int
    bos_token_id: int | None
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


REPLACEMENT = "\ufffd"


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; pad, bos and eos follow. One token per byte, so lengths are exact."""

    pad_token_id = 256
    bos_token_id = 257
    eos_token_id = 258
    vocab_size = 259

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        data = bytearray()
        for i in ids:
            i = int(i)
            if 0 <= i < 256:
                data.append(i)
            elif not 0 <= i < self.vocab_size:
                data += REPLACEMENT.encode("utf-8")
        # A sampled response can stop inside a multi-byte character; replace rather than fail.
        return data.decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face tokenizer seen through the `Tokenizer` interface; `hf` is the wrapped object."""

    def __init__(self, hf, name: str = "<hf>"):
        if hf.eos_token_id is None:
            raise ValueError(f"tokenizer {name!r} has no eos token; generation could never stop")
        self.hf = hf
        self.eos_token_id = int(hf.eos_token_id)
        self.pad_token_id = int(hf.pad_token_id if hf.pad_token_id is not None else hf.eos_token_id)
        self.bos_token_id = None if hf.bos_token_id is None else int(hf.bos_token_id)
        # len() counts added tokens; the model's embedding table may be padded beyond it.
        self.vocab_size = len(hf)

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        # runs of known ids decode together (merges across tokens stay intact); unknown ids are U+FFFD
        text, run = [], []
        for i in map(int, ids):
            if 0 <= i < self.vocab_size:
                run.append(i)
                continue
            if run:
                text.append(self.hf.decode(run, skip_special_tokens=True))
                run = []
            text.append(REPLACEMENT)
        if run:
            text.append(self.hf.decode(run, skip_special_tokens=True))
        return "".join(text)


def load_tokenizer(spec: str) -> Tokenizer:
    """'byte' gives the built-in `ByteTokenizer`; anything else is a local Hugging Face tokenizer directory."""
    if spec == "byte":
        return ByteTokenizer()
    path = Path(spec).expanduser()
    if not path.is_dir():
        raise ValueError(
            f"tokenizer {spec!r}: no such directory {str(path)!r}; give a local Hugging Face tokenizer "
            "directory, or 'byte' for the built-in byte tokenizer"
        )
    try:
        from transformers import AutoTokenizer
    except ImportError as e:
        raise ImportError(
            f"loading tokenizer directory {spec!r} needs transformers (pip install transformers); "
            "'byte' is the built-in tokenizer that needs nothing"
        ) from e
    return HFTokenizer(AutoTokenizer.from_pretrained(str(path), local_files_only=True), name=spec)
