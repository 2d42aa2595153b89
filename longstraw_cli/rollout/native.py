"""Native rollout: G responses sampled from the same resident state that the transaction trains on.

All G responses decode as one batch over the shared prompt pages (never copied); each response gets its own copy
of the small GDN state and its own response K/V. The log-probs of the sampled tokens under the policy
(temperature 1, no top-p) come out of the same forward, graph-free: they are the on-policy old log-probs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 is greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclass
class Rollout:
    responses: list[torch.Tensor]
    # log p of each sampled token under the policy (temperature 1), graph-free: the on-policy old log-probs
    logprobs: list[torch.Tensor]
    # entropy of the policy's next-token distribution at each sampled position (None where unknown)
    entropies: list[torch.Tensor] | None = None


def _sample(logits_BV: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator | None) -> torch.Tensor:
    if cfg.temperature == 0:
        return logits_BV.argmax(-1)
    probs_BV = torch.softmax(logits_BV / cfg.temperature, dim=-1)
    if cfg.top_p < 1:
        sorted_BV, order_BV = probs_BV.sort(dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        drop_BV = sorted_BV.cumsum(-1) - sorted_BV >= cfg.top_p
        sorted_BV = sorted_BV.masked_fill(drop_BV, 0.0)
        probs_BV = torch.zeros_like(probs_BV).scatter(-1, order_BV, sorted_BV)
    return torch.multinomial(probs_BV, 1, generator=generator)[:, 0]


@torch.no_grad()
def generate(model, resident, num_responses: int, cfg: SamplingConfig,
             generator: torch.Generator | None = None) -> Rollout:
    """Sample `num_responses` continuations of the captured prompt; each ends at its first stop token
    (included, it is a trained token) or at max_new_tokens."""
    device = model.lm_head.weight.device
    decode = model.start_decode(resident, num_responses, cfg.max_new_tokens)
    tokens_B = torch.full((num_responses,), resident.last_token, dtype=torch.long, device=device)
    stop_S = torch.tensor(cfg.stop_token_ids, dtype=torch.long, device=device)
    done_B = torch.zeros(num_responses, dtype=torch.bool, device=device)
    lengths_B = torch.full((num_responses,), cfg.max_new_tokens, dtype=torch.long, device=device)
    sampled, logps, entropies = [], [], []
    for step in range(cfg.max_new_tokens):
        logits_BV = model.decode_step(resident, decode, tokens_B)
        tokens_B = _sample(logits_BV, cfg, generator)
        logp_BV = torch.log_softmax(logits_BV, -1)
        logps.append(logp_BV.gather(-1, tokens_B[:, None])[:, 0])
        entropies.append(-(logp_BV.exp() * logp_BV).sum(-1))
        sampled.append(tokens_B)
        stopped_B = torch.isin(tokens_B, stop_S) & ~done_B
        lengths_B = torch.where(stopped_B, step + 1, lengths_B)
        done_B |= stopped_B
        if bool(done_B.all()):
            break
    lengths = lengths_B.clamp(max=len(sampled)).tolist()

    def split(steps: list[torch.Tensor]) -> list[torch.Tensor]:
        stacked_BR = torch.stack(steps, 1)
        return [stacked_BR[i, :n] for i, n in enumerate(lengths)]

    return Rollout(split(sampled), split(logps), split(entropies))
