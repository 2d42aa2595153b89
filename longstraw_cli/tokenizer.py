"""Tokenizers behind one small interface: a built-in byte tokenizer, or a local Hugging Face tokenizer.

The trainer and the tasks need only `encode` (no special tokens), `decode` (special tokens dropped),
`eos_token_id`, `pad_token_id`, `bos_token_id`, `vocab_size`, `stop_token_ids` and `apply_chat_template`. The
byte tokenizer needs no files, so tests and tiny random models run without downloading anything.

The tokenizer follows the model: `model.tokenizer` unset means `model.path` when that directory holds tokenizer
files (`resolve_tokenizer`), else the byte tokenizer. Chat prompts (a list of {"role", "content"} messages) go
through the tokenizer's chat template with the generation prompt added (`render_prompt`); a custom template (a
file or the template text) replaces the tokenizer's, and gives the byte tokenizer one. Generation stops at any of
`stop_token_ids`: EOS, the chat template's end-of-turn token (found by rendering a probe conversation: the first
special token after the assistant's text) and the model directory's generation_config.json `eos_token_id`s. A
response given as text (rollout=data) is rendered as the template's continuation of its prompt (`render_response`).

A model's embedding table is often larger than its tokenizer (Qwen's and GLM's are padded; a random model's
vocabulary is its own), and the policy samples from the whole table, which is also what training scores. So
`decode` never fails on an id the tokenizer lacks: each such id decodes as U+FFFD, the replacement character,
as undecodable bytes do; the reward sees it, and the trained tokens are the sampled ids themselves.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

# files that make a directory a Hugging Face tokenizer (tokenizer_config.json alone names a class to load)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# the assistant's text in the probe conversation that finds a chat template's end-of-turn token
_PROBE = "longstraw-probe"


class Tokenizer(Protocol):
    eos_token_id: int
    pad_token_id: int
    bos_token_id: int | None
    vocab_size: int
    # generation stops at any of these (EOS first)
    stop_token_ids: tuple[int, ...]

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str: ...


REPLACEMENT = "\ufffd"


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; pad, bos and eos follow. One token per byte, so lengths are exact."""

    pad_token_id = 256
    bos_token_id = 257
    eos_token_id = 258
    vocab_size = 259
    stop_token_ids = (258,)

    def __init__(self, chat_template: str | None = None):
        self.chat_template = chat_template

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """Renders a custom template (model.chat_template): the byte tokenizer has none of its own."""
        if self.chat_template is None:
            raise ValueError("the byte tokenizer has no chat template: give model.tokenizer=<an HF tokenizer "
                             "directory> or model.chat_template=<a Jinja template file>, or plain string prompts")
        return _render_jinja(self.chat_template, messages, add_generation_prompt=add_generation_prompt,
                             eos_token="", bos_token="", **kwargs)

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

    def __init__(self, hf, name: str = "<hf>", chat_template: str | None = None):
        if hf.eos_token_id is None:
            raise ValueError(f"tokenizer {name!r} has no eos token; generation could never stop")
        self.hf, self.name = hf, name
        if chat_template is not None:
            hf.chat_template = chat_template
        self.eos_token_id = int(hf.eos_token_id)
        self.pad_token_id = int(hf.pad_token_id if hf.pad_token_id is not None else hf.eos_token_id)
        self.bos_token_id = None if hf.bos_token_id is None else int(hf.bos_token_id)
        # len() counts added tokens; the model's embedding table may be padded beyond it.
        self.vocab_size = len(hf)
        end_of_turn = self._end_of_turn()
        self.stop_token_ids = (self.eos_token_id, *([end_of_turn] if end_of_turn not in (None, self.eos_token_id)
                                                     else []))

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        if getattr(self.hf, "chat_template", None) is None:
            raise ValueError(f"tokenizer {self.name!r} has no chat template: give model.chat_template=<a Jinja "
                             "template file>, or plain string prompts")
        return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                           **kwargs)

    def _end_of_turn(self) -> int | None:
        """The first special token the template puts after an assistant's text (ChatML's <|im_end|>)."""
        if getattr(self.hf, "chat_template", None) is None:
            return None
        try:
            text = self.hf.apply_chat_template([{"role": "user", "content": "hi"},
                                                {"role": "assistant", "content": _PROBE}], tokenize=False)
        except Exception:  # noqa: BLE001 - a template that cannot render this probe just has no end-of-turn here
            return None
        after = text.rpartition(_PROBE)[2]
        special = set(self.hf.all_special_ids) | {i for i, t in self.hf.added_tokens_decoder.items() if t.special}
        ids = self.hf.encode(after, add_special_tokens=False)[:2]
        return next((i for i in ids if i in special), None)

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


def _render_jinja(template: str, messages: list[dict], add_generation_prompt: bool, **context) -> str:
    # transformers renders chat templates the same way: a sandbox, trimmed blocks, raise_exception
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise ValueError(f"chat template: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                            **context)


def read_chat_template(spec: str | None) -> str | None:
    """model.chat_template: a file holding a Jinja template (`.jinja`, or a tokenizer_config-style `.json` with a
    "chat_template" key), or the template text itself."""
    if spec is None:
        return None
    path = Path(spec)
    if path.is_file():
        text = path.read_text()
        return json.loads(text)["chat_template"] if path.suffix == ".json" else text
    if "{%" in spec or "{{" in spec:
        return spec
    raise ValueError(f"model.chat_template={spec!r} is neither a file nor a Jinja template ('{{{{' or '{{%')")


def has_tokenizer_files(path: str | Path) -> bool:
    return any((Path(path) / name).is_file() for name in TOKENIZER_FILES)


def resolve_tokenizer(tokenizer: str | None, model_path: str | None) -> str:
    """model.tokenizer as given; unset: the model directory when it holds tokenizer files, else 'byte'."""
    if tokenizer is not None:
        return tokenizer
    return model_path if model_path is not None and has_tokenizer_files(model_path) else "byte"


def generation_eos_ids(model_path: str | None) -> tuple[int, ...]:
    """The `eos_token_id`s (one or a list) of model_path/generation_config.json; () without one."""
    path = None if model_path is None else Path(model_path) / "generation_config.json"
    if path is None or not path.is_file():
        return ()
    eos = json.loads(path.read_text()).get("eos_token_id")
    return tuple(int(i) for i in (eos if isinstance(eos, list) else [] if eos is None else [eos]))


def stop_token_ids(tokenizer: Tokenizer, model_path: str | None) -> tuple[int, ...]:
    """The tokenizer's stop tokens, then the generation config's, each once."""
    return tuple(dict.fromkeys([*tokenizer.stop_token_ids, *generation_eos_ids(model_path)]))


def render_prompt(tokenizer: Tokenizer, prompt: str | list[dict], chat_template: bool | None,
                  kwargs: dict | None = None) -> str:
    """The prompt's text as the model reads it. Messages always go through the chat template (generation prompt
    added); a string does when chat_template is true (as one user message). chat_template false refuses
    messages: there is no faithful plain rendering of a conversation."""
    if isinstance(prompt, str):
        if not chat_template:
            return prompt
        prompt = [{"role": "user", "content": prompt}]
    elif chat_template is False:
        raise ValueError("task.chat_template=false, but the prompt is a list of chat messages")
    return tokenizer.apply_chat_template(prompt, **(kwargs or {}))


def render_response(tokenizer: Tokenizer, prompt: str | list[dict], response: str | list[dict],
                    chat_template: bool | None, kwargs: dict | None = None) -> str | None:
    """The text that follows the rendered prompt (`render_prompt`) when `response` answers it, or None where the
    prompt is plain text (no template: the response is its own text). Through the chat template: the conversation
    with the response as its last turn(s) (a string is one assistant message), rendered without a generation
    prompt, less the rendered prompt: the template's own continuation, its end-of-turn included. A template whose
    conversation does not begin with the rendered prompt has no such continuation: a ValueError."""
    templated = not isinstance(prompt, str) or chat_template
    if not templated:
        if not isinstance(response, str):
            raise ValueError("a response of chat messages needs a prompt that goes through the chat template "
                             "(chat messages, or task.chat_template=true)")
        return None
    asked = render_prompt(tokenizer, prompt, chat_template, kwargs)
    turns = [{"role": "assistant", "content": response}] if isinstance(response, str) else list(response)
    messages = ([{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)) + turns
    whole = tokenizer.apply_chat_template(messages, add_generation_prompt=False, **(kwargs or {}))
    if not whole.startswith(asked):
        raise ValueError("the chat template renders the conversation with its response differently from the prompt "
                         "with its generation prompt: the response's tokens cannot be told apart")
    return whole[len(asked):]


def load_tokenizer(spec: str, chat_template: str | None = None) -> Tokenizer:
    """'byte' gives the built-in `ByteTokenizer`; anything else is a local Hugging Face tokenizer directory.
    `chat_template` (the template's text) replaces the tokenizer's own."""
    if spec == "byte":
        return ByteTokenizer(chat_template)
    path = Path(spec)
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
    return HFTokenizer(AutoTokenizer.from_pretrained(str(path), local_files_only=True), name=spec,
                       chat_template=chat_template)
