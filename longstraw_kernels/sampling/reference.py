"""The torch reference of a decode step's sampling: each row's token by the exponential race, and the sampled
token's log-prob and the distribution's entropy at temperature 1 (the on-policy old log-probs)."""

from __future__ import annotations

import torch


def race_tokens(logits_BV: torch.Tensor, race_BV: torch.Tensor | None, temperature: float,
                top_p: float = 1.0) -> torch.Tensor:
    """Each row's token: argmax p_i / E_i, p the tempered softmax (cut to its top_p mass), E_i = race_BV ~ Exp(1)
    independent, which picks i with probability p_i / sum p (the minimum of independent exponentials of rates p_i):
    one elementwise pass and an argmax, no per-row scan. race_BV None: greedy (argmax of the logits). E is kept
    above 0 so that p = 0 never wins."""
    if race_BV is None:
        return logits_BV.argmax(-1)
    probs_BV = torch.softmax(logits_BV / temperature, dim=-1)
    if top_p < 1:
        sorted_BV, order_BV = probs_BV.sort(dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        drop_BV = sorted_BV.cumsum(-1) - sorted_BV >= top_p
        sorted_BV = sorted_BV.masked_fill(drop_BV, 0.0)
        probs_BV = torch.zeros_like(probs_BV).scatter(-1, order_BV, sorted_BV)
    return (probs_BV / race_BV.clamp_min(torch.finfo(race_BV.dtype).tiny)).argmax(-1)


def token_scores(logits_BV: torch.Tensor, tokens_B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p of each row's token, the row's entropy), both at temperature 1, in the logits' dtype."""
    logp_BV = torch.log_softmax(logits_BV, -1)
    p_BV = logp_BV.exp()
    # a token of probability 0 (a logit of -inf) adds nothing (not 0 * -inf)
    plogp_BV = torch.where(p_BV > 0, p_BV * logp_BV, 0.0)
    return logp_BV.gather(-1, tokens_B[:, None])[:, 0], -plogp_BV.sum(-1)


def race_sample_reference(logits_BV, race_BV, temperature, top_p, tokens_B, logp_B, entropy_B) -> None:
    """`race_tokens` and `token_scores` written into the given rows (views of the rollout's [B, R] buffers)."""
    tokens_B.copy_(race_tokens(logits_BV, race_BV, temperature, top_p))
    logp, entropy = token_scores(logits_BV, tokens_B)
    logp_B.copy_(logp)
    entropy_B.copy_(entropy)
