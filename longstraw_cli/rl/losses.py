"""GRPO-family policy losses, and SFT's negative log-likelihood, written as a sum of per-response terms.

LongStraw replays one response at a time with autograd and calls backward per response, so every group
loss here is written as L = sum_i L_i, where L_i reads response i alone plus group constants known before
any replay (`GroupShape`). Each aggregation is then a per-response weight w_i on the token sum:

    token_mean               L_i = sum_t l_it / total_tokens           (DAPO, SFT)
    seq_mean_token_mean      L_i = sum_t l_it / (G * R_i)              (GRPO, GSPO)
    seq_mean_token_sum_norm  L_i = sum_t l_it / (G * max_tokens)       (Dr. GRPO's constant normaliser)

and the KL to the reference, when used, is aggregated with the same weight: L_i += kl_coef * w_i sum_t kl_it.

Variants (registered by name, each with its default clip range and aggregation):
    grpo     per-token PPO clip, -min(rho_t A, clip(rho_t, 1-cl, 1+ch) A), rho_t = exp(logp_t - old_t)
    dr_grpo  the same surrogate, token sum over the constant G * max_response_tokens
    dapo     the same surrogate with clip-higher (0.2 / 0.28) and one token mean over the whole group
    gspo     sequence ratio s_i = exp(mean_t(logp_t - old_t)), token form s_it = sg[s_i] exp(logp_t - sg[logp_t])
             (value s_i, gradient s_i d logp_t), clipped with GSPO's small ranges (3e-4 / 4e-4)
    sft      the negative log-likelihood -w_i logp_t of given responses (no old log-probs, no clip), one token mean
             over the whole group by default (TRL's SFT loss over the completion tokens); the weight w_i is the
             "advantage" slot, filled by a weight estimator (rl/advantages.py: one, reward)

Simplified against verl's core_algos: outcome advantages only (one float per response), no dual-clip
(clip_ratio_c), no entropy bonus, no truncated importance sampling against rollout log-probs; DAPO's
dynamic sampling and overlong shaping live outside the loss. Log-ratios are clamped to +-20 before exp.

Legend: `_R` is one response's token axis.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

# exp() of a larger log-ratio overflows float32 long before it means anything (verl clamps likewise).
MAX_LOG_RATIO = 20.0


@dataclass(frozen=True)
class GroupShape:
    """Group constants the aggregation needs, all known once the rollout has produced the G responses."""

    group_size: int
    total_tokens: int
    max_tokens: int

    def __post_init__(self) -> None:
        for field in ("group_size", "total_tokens", "max_tokens"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GroupShape.{field} must be an int >= 1, got {value!r}")
        if not self.max_tokens <= self.total_tokens <= self.group_size * self.max_tokens:
            raise ValueError(
                f"GroupShape is inconsistent: need max_tokens <= total_tokens <= group_size * max_tokens, "
                f"got group_size={self.group_size}, total_tokens={self.total_tokens}, max_tokens={self.max_tokens}"
            )

    @classmethod
    def from_lengths(cls, lengths: Iterable[int]) -> GroupShape:
        lengths = [int(n) for n in lengths]
        if not lengths or min(lengths) < 1:
            raise ValueError(f"every response needs at least one token, got lengths {lengths}")
        return cls(group_size=len(lengths), total_tokens=sum(lengths), max_tokens=max(lengths))


class Surrogate(NamedTuple):
    loss_R: Tensor  # per-token policy loss, carries the graph
    ratio_R: Tensor  # importance ratio per token, detached
    clipped_R: Tensor  # bool: the clipped branch is the active one


PolicyLossFn = Callable[[Tensor, Tensor, float, float, float], Surrogate]


@dataclass(frozen=True)
class LossVariant:
    fn: PolicyLossFn
    clip_low: float
    clip_high: float
    aggregation: str
    # what fills the advantage slot: "baseline" (group-relative advantages) or "weight" (rl/advantages.py kinds)
    takes: str = "baseline"
    # whether the surrogate reads old log-probs (an importance ratio); without, none are scored
    needs_old: bool = True


LOSS_REGISTRY: dict[str, LossVariant] = {}
AGGREGATION_REGISTRY: dict[str, Callable[[int, GroupShape, LossConfig], float]] = {}
KL_REGISTRY: dict[str, Callable[[Tensor, Tensor], Tensor]] = {}


def _choose(kind: str, value: str, registry: dict) -> object:
    if value not in registry:
        raise ValueError(f"unknown {kind} {value!r}; valid choices: {sorted(registry)}")
    return registry[value]


def register_loss(name: str, *, clip_low: float, clip_high: float, aggregation: str, takes: str = "baseline",
                  needs_old: bool = True):
    """Register a policy-loss function under `name` with the variant's default clip range and aggregation."""

    def decorator(fn: PolicyLossFn) -> PolicyLossFn:
        if name in LOSS_REGISTRY:
            raise ValueError(f"loss {name!r} is already registered")
        LOSS_REGISTRY[name] = LossVariant(fn, clip_low, clip_high, aggregation, takes, needs_old)
        return fn

    return decorator


def get_loss(name: str) -> LossVariant:
    return _choose("loss", name, LOSS_REGISTRY)


def register_aggregation(name: str):
    def decorator(fn):
        if name in AGGREGATION_REGISTRY:
            raise ValueError(f"aggregation {name!r} is already registered")
        AGGREGATION_REGISTRY[name] = fn
        return fn

    return decorator


def register_kl(name: str):
    def decorator(fn):
        if name in KL_REGISTRY:
            raise ValueError(f"kl_estimator {name!r} is already registered")
        KL_REGISTRY[name] = fn
        return fn

    return decorator


@dataclass(frozen=True)
class LossConfig:
    """Loss settings. `clip_low`, `clip_high`, `aggregation` left None take the variant's defaults and are
    resolved in place at construction (so a logged config shows what ran); `dataclasses.replace` with a new
    `name` therefore keeps the old variant's resolved values unless they are reset to None.
    `max_response_tokens` is Dr. GRPO's constant (the generation budget); None uses the group's longest
    response, which is verl's padded-length default."""

    name: str = "grpo"
    clip_low: float | None = None
    clip_high: float | None = None
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    aggregation: str | None = None
    max_response_tokens: int | None = None

    def __post_init__(self) -> None:
        variant = get_loss(self.name)
        _choose("kl_estimator", self.kl_estimator, KL_REGISTRY)
        for field, default in (
            ("clip_low", variant.clip_low),
            ("clip_high", variant.clip_high),
            ("aggregation", variant.aggregation),
        ):
            if getattr(self, field) is None:
                object.__setattr__(self, field, default)
        _choose("aggregation", self.aggregation, AGGREGATION_REGISTRY)
        # The lower bound 1 - clip_low must stay a positive ratio.
        if not 0.0 <= self.clip_low < 1.0:
            raise ValueError(f"clip_low must be in [0, 1), got {self.clip_low!r}")
        if not self.clip_high >= 0.0:
            raise ValueError(f"clip_high must be >= 0, got {self.clip_high!r}")
        if not self.kl_coef >= 0.0:
            raise ValueError(f"kl_coef must be >= 0, got {self.kl_coef!r}")
        m = self.max_response_tokens
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
            raise ValueError(f"max_response_tokens must be None or an int >= 1, got {m!r}")


# ---------------------------------------------------------------- aggregations: weight of one response


@register_aggregation("token_mean")
def _token_mean(num_tokens: int, group: GroupShape, cfg: LossConfig) -> float:
    return 1.0 / group.total_tokens


@register_aggregation("seq_mean_token_mean")
def _seq_mean_token_mean(num_tokens: int, group: GroupShape, cfg: LossConfig) -> float:
    return 1.0 / (group.group_size * num_tokens)


@register_aggregation("seq_mean_token_sum_norm")
def _seq_mean_token_sum_norm(num_tokens: int, group: GroupShape, cfg: LossConfig) -> float:
    norm = cfg.max_response_tokens if cfg.max_response_tokens is not None else group.max_tokens
    if group.max_tokens > norm:
        raise ValueError(
            f"a response of {group.max_tokens} tokens exceeds max_response_tokens={norm}; "
            f"set max_response_tokens to the generation budget"
        )
    return 1.0 / (group.group_size * norm)


# ---------------------------------------------------------------- KL estimators (Schulman's k1, k2, k3)


@register_kl("k1")
def kl_k1(logp_R: Tensor, ref_logp_R: Tensor) -> Tensor:
    return logp_R - ref_logp_R


@register_kl("k2")
def kl_k2(logp_R: Tensor, ref_logp_R: Tensor) -> Tensor:
    return 0.5 * (logp_R - ref_logp_R).square()


@register_kl("k3")
def kl_k3(logp_R: Tensor, ref_logp_R: Tensor) -> Tensor:
    log_ratio_R = ref_logp_R - logp_R
    return torch.exp(log_ratio_R) - log_ratio_R - 1.0


# ---------------------------------------------------------------- policy surrogates


def _clipped_surrogate(ratio_R: Tensor, advantage: float, clip_low: float, clip_high: float) -> Surrogate:
    unclipped_R = -advantage * ratio_R
    clipped_R = -advantage * ratio_R.clamp(1.0 - clip_low, 1.0 + clip_high)
    return Surrogate(torch.maximum(unclipped_R, clipped_R), ratio_R.detach(), clipped_R > unclipped_R)


@register_loss("grpo", clip_low=0.2, clip_high=0.2, aggregation="seq_mean_token_mean")
@register_loss("dr_grpo", clip_low=0.2, clip_high=0.2, aggregation="seq_mean_token_sum_norm")
@register_loss("dapo", clip_low=0.2, clip_high=0.28, aggregation="token_mean")
def token_ppo_surrogate(
    logp_R: Tensor, old_logp_R: Tensor, advantage: float, clip_low: float, clip_high: float
) -> Surrogate:
    ratio_R = torch.exp((logp_R - old_logp_R).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
    return _clipped_surrogate(ratio_R, advantage, clip_low, clip_high)


@register_loss("gspo", clip_low=3e-4, clip_high=4e-4, aggregation="seq_mean_token_mean")
def sequence_ppo_surrogate(
    logp_R: Tensor, old_logp_R: Tensor, advantage: float, clip_low: float, clip_high: float
) -> Surrogate:
    log_seq_ratio = (logp_R - old_logp_R).mean().detach()
    # s_it = sg[s_i] * exp(logp_t - sg[logp_t]): every token has the value s_i, so the clip acts on the
    # sequence, and d s_it / d logp_t = s_i; after the token mean this is GSPO's s_i * mean_t(d logp_t).
    log_ratio_R = (logp_R - logp_R.detach() + log_seq_ratio).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    return _clipped_surrogate(torch.exp(log_ratio_R), advantage, clip_low, clip_high)


@register_loss("sft", clip_low=0.0, clip_high=0.0, aggregation="token_mean", takes="weight", needs_old=False)
def negative_log_likelihood(
    logp_R: Tensor, old_logp_R: Tensor, weight: float, clip_low: float, clip_high: float
) -> Surrogate:
    ones_R = torch.ones_like(logp_R.detach())
    return Surrogate(-weight * logp_R, ones_R, torch.zeros_like(ones_R, dtype=torch.bool))


# ---------------------------------------------------------------- the per-response loss


def response_loss(
    cfg: LossConfig,
    logp_R: Tensor,
    old_logp_R: Tensor | None,
    advantage: float,
    group: GroupShape,
    ref_logp_R: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Loss term of one response; summed over the G responses of `group` it is the variant's group loss.

    logp_R carries the graph; old_logp_R and ref_logp_R are treated as constants (old_logp_R None: a variant that
    reads none, sft, whose ratio is then 1). Math runs in at least
    float32. Stats are sums and counts so that any set of responses (and ranks) aggregates exactly; see
    `sum_stats` and `summarize_stats`. Keys: num_tokens, loss, pg_loss, clipped_tokens, ratio_sum,
    ppo_kl_sum (sum of old - logp), and, when ref_logp_R is given, kl_loss and kl_sum. Here
    loss = pg_loss + kl_coef * kl_loss, each the response's share of the group value.
    """
    variant = get_loss(cfg.name)
    if old_logp_R is None:
        if variant.needs_old:
            raise ValueError(f"loss {cfg.name!r} needs old_logp_R (its importance ratio); got None")
        old_logp_R = logp_R.detach()
    if logp_R.dim() != 1 or old_logp_R.shape != logp_R.shape:
        raise ValueError(
            f"logp_R and old_logp_R must be 1-D of one length, got {tuple(logp_R.shape)} and {tuple(old_logp_R.shape)}"
        )
    num_tokens = logp_R.numel()
    if not 1 <= num_tokens <= group.max_tokens:
        raise ValueError(f"response has {num_tokens} tokens, outside [1, group.max_tokens={group.max_tokens}]")
    if ref_logp_R is None and cfg.kl_coef > 0:
        raise ValueError(f"kl_coef={cfg.kl_coef} needs ref_logp_R; pass reference log-probs or set kl_coef=0")
    if ref_logp_R is not None and ref_logp_R.shape != logp_R.shape:
        raise ValueError(f"ref_logp_R has shape {tuple(ref_logp_R.shape)}, expected {tuple(logp_R.shape)}")

    dtype = torch.promote_types(logp_R.dtype, torch.float32)
    logp_R = logp_R.to(dtype)
    old_logp_R = old_logp_R.detach().to(dtype)
    surrogate = variant.fn(logp_R, old_logp_R, float(advantage), cfg.clip_low, cfg.clip_high)
    weight = AGGREGATION_REGISTRY[cfg.aggregation](num_tokens, group, cfg)
    pg_loss = weight * surrogate.loss_R.sum()
    loss = pg_loss

    names = ["loss", "pg_loss", "clipped_tokens", "ratio_sum", "ppo_kl_sum"]
    values = [
        surrogate.clipped_R.sum().to(dtype),
        surrogate.ratio_R.sum(),
        (old_logp_R - logp_R.detach()).sum(),
    ]
    if ref_logp_R is not None:
        kl_R = KL_REGISTRY[cfg.kl_estimator](logp_R, ref_logp_R.detach().to(dtype))
        kl_loss = weight * kl_R.sum()
        if cfg.kl_coef > 0:
            loss = loss + cfg.kl_coef * kl_loss
        names += ["kl_loss", "kl_sum"]
        values += [kl_loss.detach(), kl_R.detach().sum()]
    # One device sync for all stats instead of one per .item().
    stats = dict(zip(names, torch.stack([loss.detach(), pg_loss.detach(), *values]).tolist()))
    stats["num_tokens"] = float(num_tokens)
    return loss, stats


def sum_stats(per_response: Iterable[dict[str, float]]) -> dict[str, float]:
    """Key-wise sum of response stats; sums from several ranks add the same way before `summarize_stats`."""
    total: dict[str, float] = {}
    for stats in per_response:
        for key, value in stats.items():
            total[key] = total.get(key, 0.0) + value
    return total


def summarize_stats(total: dict[str, float]) -> dict[str, float]:
    """Loggable values from summed stats: losses stay sums (one group -> the group loss), token stats
    become token means (clip_frac, ratio_mean, ppo_kl, kl_mean)."""
    num_tokens = total["num_tokens"]
    out = {
        "loss": total["loss"],
        "pg_loss": total["pg_loss"],
        "clip_frac": total["clipped_tokens"] / num_tokens,
        "ratio_mean": total["ratio_sum"] / num_tokens,
        "ppo_kl": total["ppo_kl_sum"] / num_tokens,
        "num_tokens": num_tokens,
    }
    if "kl_sum" in total:
        out["kl_loss"] = total["kl_loss"]
        out["kl_mean"] = total["kl_sum"] / num_tokens
    return out
