"""Responses without a decode: given by the data (`rollout=data`) or drawn at random (`rollout=synthetic`).

Everything after the rollout is unchanged: the same reward, capture, scoring, replay (whole or in blocks, exact mode,
context and expert parallel, offload) and step. What the native rollout gives beside the responses, these give or
leave to the transaction: old log-probs (None: scored graph-free from the resident state, as for vLLM's responses;
algo=sft reads none) and rewards (None: the task's reward is called on the decoded responses).

- `DataResponses`: a file task's group for one prompt (`Example.given`, data.py). A response of token ids is trained
  as given; text or chat messages become the chat template's continuation of the prompt (`Task.response_text`), or
  for a plain-text prompt the text itself, tokenized; either is cut after its first stop token (included), or gets
  EOS appended where it has none: a response ends as a sampled one does. Each group must hold `group_size`
  responses of 1..`response_tokens` tokens, ids below the model's vocabulary; recorded old log-probs one per token.
  A bad one is an `InputError` naming the row (at start for the rows a task checks then).
- `SyntheticResponses`: `group_size` responses of exactly `response_tokens` uniform random token ids and uniform
  random rewards, from the trainer's seeded generator. For benchmarks only: the long-response rows that one decode
  cannot reach in a device call (32,768 decode steps), whose replay fits in minutes. Nothing is learned from them.
"""

from __future__ import annotations

import torch

from longstraw_cli.data import is_ids
from longstraw_cli.rl.task_base import Example, Task
from longstraw_cli.rollout.native import Rollout
from longstraw_cli.safety.inputs import InputError
from longstraw_cli.tokenizer import Tokenizer


class DataResponses:
    """rollout=data (see the module docstring)."""

    def __init__(self, task: Task, tokenizer: Tokenizer, *, group_size: int, response_tokens: int, vocab_size: int,
                 stop_token_ids: tuple[int, ...], device: torch.device):
        self.task, self.tokenizer, self.device = task, tokenizer, device
        self.group_size, self.response_tokens, self.vocab_size = group_size, response_tokens, vocab_size
        self.stop_token_ids = set(stop_token_ids)

    def token_ids(self, example: Example) -> list[list[int]]:
        """The group's responses as token ids, checked; InputError naming the row on a bad one."""
        given = example.given
        if len(given.responses) != self.group_size:
            raise InputError(f"{example.origin}: its prompt's rows give {len(given.responses)} responses; "
                             f"group_size={self.group_size} (every prompt's rows form one group of group_size)")
        out = []
        for n, (response, where) in enumerate(zip(given.responses, given.where)):
            ids = self._tokens(example, response, where)
            if len(ids) > self.response_tokens:
                raise InputError(f"{where}: the response is {len(ids)} tokens, over response_tokens="
                                 f"{self.response_tokens} (raise it, or shorten the response)")
            if max(ids) >= self.vocab_size:
                raise InputError(f"{where}: token id {max(ids)} is outside the model's vocabulary of "
                                 f"{self.vocab_size}")
            if given.logprobs is not None and len(given.logprobs[n]) != len(ids):
                raise InputError(f"{where}: {len(given.logprobs[n])} old log-probs for a response of {len(ids)} "
                                 f"tokens (one per token)")
            out.append(ids)
        return out

    def _tokens(self, example: Example, response, where: str) -> list[int]:
        if is_ids(response):
            return list(response)
        try:
            text = self.task.response_text(example, response)
        except ValueError as e:
            raise InputError(f"{where}: {e}") from None
        ids = self.tokenizer.encode(response if text is None else text)
        stop = next((t for t, i in enumerate(ids) if i in self.stop_token_ids), None)
        if stop is None:
            return ids + [self.tokenizer.eos_token_id]
        # what a template puts after its end of turn (a newline) goes; text past a stop token would be lost unseen
        rest = self.tokenizer.decode(ids[stop + 1:]).strip()
        if rest:
            token = self.tokenizer.decode(ids[stop:stop + 1])
            raise InputError(f"{where}: the response goes on past a stop token ({token!r}) with {rest[:60]!r}; a "
                             f"sampled response ends at its first: cut it there")
        return ids[: stop + 1]

    def __call__(self, example: Example, prompt_ids: torch.Tensor) -> Rollout:
        given = example.given
        responses = [torch.tensor(ids, dtype=torch.long, device=self.device) for ids in self.token_ids(example)]
        logprobs = None if given.logprobs is None else [
            torch.tensor(lp, dtype=torch.float64, device=self.device) for lp in given.logprobs]
        rewards = None if given.rewards is None else list(given.rewards)
        return Rollout(responses, logprobs, rewards=rewards)


class SyntheticResponses:
    """rollout=synthetic (see the module docstring): ids below `vocab_size` (the tokenizer's, so samples decode)."""

    def __init__(self, *, group_size: int, response_tokens: int, vocab_size: int, generator: torch.Generator,
                 device: torch.device):
        self.group_size, self.response_tokens, self.vocab_size = group_size, response_tokens, vocab_size
        self.generator, self.device = generator, device

    def __call__(self, example: Example, prompt_ids: torch.Tensor) -> Rollout:
        ids_GR = torch.randint(0, self.vocab_size, (self.group_size, self.response_tokens), generator=self.generator,
                               device=self.device)
        rewards_G = torch.rand(self.group_size, generator=self.generator, device=self.device, dtype=torch.float64)
        return Rollout(list(ids_GR), None, rewards=rewards_G.tolist())
