"""Losses and advantages against hand arithmetic, and the sum-of-responses == group-loss property.

The hand examples use a group of two responses whose importance ratios are round numbers:
    response 0: 3 tokens, ratios [1.5, 1.0, 0.7], advantage +1
    response 1: 2 tokens, ratios [1.5, 0.5],      advantage -1
"""

import math

import pytest
import torch

from longstraw_cli.rl.advantages import GRPO_STD_EPS, advantage_kind, get_advantage, min_group_size
from longstraw_cli.rl.losses import (
    KL_REGISTRY,
    GroupShape,
    LossConfig,
    get_loss,
    response_loss,
    sum_stats,
    summarize_stats,
)

LN2 = math.log(2.0)
F64 = torch.float64


def _log(values):
    return torch.tensor(values, dtype=F64).log()


# old probabilities and new = old * ratio, so that exp(logp - old_logp) is the ratio above
OLD_P = ([0.2, 0.5, 0.5], [0.4, 0.6])
NEW_P = ([0.3, 0.5, 0.35], [0.6, 0.3])
ADV = (1.0, -1.0)
GROUP = GroupShape(group_size=2, total_tokens=5, max_tokens=3)


def _run(cfg, refs=(None, None), new_p=NEW_P, old_p=OLD_P, adv=ADV, group=GROUP):
    losses, grads, stats = [], [], []
    for i in range(2):
        logp = _log(new_p[i]).requires_grad_()
        ref = None if refs[i] is None else _log(refs[i])
        loss, s = response_loss(cfg, logp, _log(old_p[i]), adv[i], group, ref_logp_R=ref)
        loss.backward()
        losses.append(loss.item())
        grads.append(logp.grad.tolist())
        stats.append(s)
    return losses, grads, stats


def _close(a, b, tol=1e-12):
    assert a == pytest.approx(b, rel=tol, abs=tol)


# ---------------------------------------------------------------- variants against hand values


def test_grpo_hand_values_and_gradients():
    losses, grads, stats = _run(LossConfig(name="grpo"))
    # A=+1: -min(r, clip(r, 0.8, 1.2)) = [-1.2, -1.0, -0.7]; token mean over 3, then / G=2
    _close(losses[0], (-1.2 - 1.0 - 0.7) / 3 / 2)
    # A=-1: max(r, clip(r)) = [1.5, 0.8]; token mean over 2, then / G=2
    _close(losses[1], (1.5 + 0.8) / 2 / 2)
    _close(sum(losses), (-2.9 / 3 + 2.3 / 2) / 2)
    # d/dlogp_t = weight * (-A) * ratio_t where unclipped, 0 where the clipped branch is active
    _close(grads[0], [0.0, -1.0 / 6, -0.7 / 6])
    _close(grads[1], [1.5 / 4, 0.0])
    assert [s["clipped_tokens"] for s in stats] == [1.0, 1.0]
    assert [s["num_tokens"] for s in stats] == [3.0, 2.0]
    _close(stats[0]["ratio_sum"], 1.5 + 1.0 + 0.7)


def test_dapo_hand_values_and_gradients():
    cfg = LossConfig(name="dapo")
    assert (cfg.clip_low, cfg.clip_high, cfg.aggregation) == (0.2, 0.28, "token_mean")
    losses, grads, _ = _run(cfg)
    # clip-higher: 1.5 clips to 1.28 for A>0; one token mean over the group's 5 tokens
    _close(losses[0], (-1.28 - 1.0 - 0.7) / 5)
    _close(losses[1], (1.5 + 0.8) / 5)
    _close(sum(losses), -0.68 / 5)
    _close(grads[0], [0.0, -1.0 / 5, -0.7 / 5])
    _close(grads[1], [1.5 / 5, 0.0])


def test_dr_grpo_hand_values():
    cfg = LossConfig(name="dr_grpo", max_response_tokens=4)
    assert cfg.aggregation == "seq_mean_token_sum_norm"
    losses, grads, _ = _run(cfg)
    # token sums over the constant G * max_response_tokens = 2 * 4
    _close(losses[0], -2.9 / 8)
    _close(losses[1], 2.3 / 8)
    _close(grads[0], [0.0, -1.0 / 8, -0.7 / 8])
    # without a budget the constant is G * (longest response) = 2 * 3
    losses, _, _ = _run(LossConfig(name="dr_grpo"))
    _close(sum(losses), (-2.9 + 2.3) / 6)


def test_gspo_hand_values_and_gradients():
    cfg = LossConfig(name="gspo")
    assert (cfg.clip_low, cfg.clip_high) == (3e-4, 4e-4)
    old = ([-1.0, -2.0, -0.5], [-0.3, -1.2])
    log_ratio = ([2e-4, 4e-4, 0.0], [1e-3, 5e-4])
    adv = (-1.0, 1.0)
    losses, grads, stats = [], [], []
    for i in range(2):
        old_logp = torch.tensor(old[i], dtype=F64)
        logp = (old_logp + torch.tensor(log_ratio[i], dtype=F64)).requires_grad_()
        loss, s = response_loss(cfg, logp, old_logp, adv[i], GROUP)
        loss.backward()
        losses.append(loss.item())
        grads.append(logp.grad.tolist())
        stats.append(s)
    # s_0 = exp(mean [2e-4, 4e-4, 0]) = exp(2e-4), inside [1 - 3e-4, 1 + 4e-4]; A=-1: loss s_0 per token
    s0 = math.exp(2e-4)
    _close(losses[0], s0 / 2)
    # gradient of (1/G)(1/R) sum_t -A s_0t is s_0 / (2 * 3) on every token
    _close(grads[0], [s0 / 6] * 3, tol=1e-10)
    # s_1 = exp(7.5e-4) > 1 + 4e-4 and A=+1: the whole sequence is clipped at 1.0004, no gradient
    _close(losses[1], -1.0004 / 2)
    _close(grads[1], [0.0, 0.0])
    assert [s["clipped_tokens"] for s in stats] == [0.0, 2.0]
    _close(stats[1]["ratio_sum"], 2 * math.exp(7.5e-4))


# ---------------------------------------------------------------- KL


def test_kl_estimators_hand_values():
    # logp - ref = [ln 2, 0, -ln 2]
    logp, ref = _log([0.5, 0.3, 0.2]), _log([0.25, 0.3, 0.4])
    expected = {
        "k1": [LN2, 0.0, -LN2],
        "k2": [0.5 * LN2**2, 0.0, 0.5 * LN2**2],
        # exp(ref - logp) - (ref - logp) - 1 = [0.5 + ln2 - 1, 0, 2 - ln2 - 1]
        "k3": [LN2 - 0.5, 0.0, 1.0 - LN2],
    }
    assert sorted(KL_REGISTRY) == ["k1", "k2", "k3"]
    for name, values in expected.items():
        _close(KL_REGISTRY[name](logp, ref).tolist(), values)


def test_kl_term_in_loss_hand_values():
    # response 0 against ref probs [0.15, 0.5, 0.7]: logp - ref = [ln 2, 0, -ln 2], k3 = [ln2 - .5, 0, 1 - ln2]
    refs = ([0.15, 0.5, 0.7], [0.6, 0.3])
    cfg = LossConfig(name="grpo", kl_coef=0.1, kl_estimator="k3")
    losses, grads, stats = _run(cfg, refs=refs)
    _close(losses[0], -2.9 / 6 + 0.1 * 0.5 / 6)
    _close(stats[0]["kl_sum"], 0.5)
    _close(stats[0]["kl_loss"], 0.5 / 6)
    # d k3 / d logp = 1 - exp(ref - logp) = [0.5, 0, -1]
    _close(grads[0], [0.0 + 0.1 * 0.5 / 6, -1.0 / 6, -0.7 / 6 - 0.1 / 6])
    # response 1 equals its reference: no KL, the policy gradient alone
    _close(losses[1], 2.3 / 4)
    _close(grads[1], [1.5 / 4, 0.0])
    # k1 sums to 0 on response 0; k2 sums to ln2^2
    losses, _, _ = _run(LossConfig(name="grpo", kl_coef=0.1, kl_estimator="k1"), refs=refs)
    _close(losses[0], -2.9 / 6)
    losses, _, _ = _run(LossConfig(name="grpo", kl_coef=0.1, kl_estimator="k2"), refs=refs)
    _close(losses[0], -2.9 / 6 + 0.1 * LN2**2 / 6)


def test_kl_coef_zero_needs_no_reference():
    losses, _, stats = _run(LossConfig(name="grpo", kl_coef=0.0))
    _close(sum(losses), (-2.9 / 3 + 2.3 / 2) / 2)
    assert "kl_sum" not in stats[0]
    # a reference with kl_coef 0 is logged but adds nothing to the loss
    losses, _, stats = _run(LossConfig(name="grpo"), refs=([0.15, 0.5, 0.7], [0.6, 0.3]))
    _close(losses[0], -2.9 / 6)
    _close(stats[0]["kl_sum"], 0.5)


def test_kl_coef_positive_without_reference_raises():
    cfg = LossConfig(name="grpo", kl_coef=0.01)
    with pytest.raises(ValueError, match="ref_logp_R"):
        response_loss(cfg, _log([0.5]), _log([0.5]), 1.0, GROUP)


def test_sft_is_the_token_mean_nll_of_the_group_and_reads_no_old_logprobs():
    """algo=sft: L = -sum_i w_i sum_t logp_it / (tokens of the group), old log-probs None (ratio 1, nothing
    clipped); a weight scales its response's share; a policy-gradient loss refuses None."""
    cfg = LossConfig(name="sft")
    assert (cfg.aggregation, cfg.clip_low, cfg.clip_high) == ("token_mean", 0.0, 0.0)
    new_p = ([0.5, 0.25, 0.5], [0.125, 0.5])
    losses, grads, stats = [], [], []
    for i, weight in enumerate((1.0, 2.0)):
        logp = _log(new_p[i]).requires_grad_()
        loss, st = response_loss(cfg, logp, None, weight, GROUP)
        loss.backward()
        losses.append(loss.item())
        grads.append(logp.grad.tolist())
        stats.append(st)
    _close(losses, [4 * LN2 / 5, 2.0 * 4 * LN2 / 5])
    _close(grads[0] + grads[1], [-1 / 5] * 3 + [-2 / 5] * 2)
    summary = summarize_stats(sum_stats(stats))
    assert (summary["clip_frac"], summary["ratio_mean"], summary["ppo_kl"]) == (0.0, 1.0, 0.0)
    with pytest.raises(ValueError, match="'grpo' needs old_logp_R"):
        response_loss(LossConfig(name="grpo"), _log([0.5]), None, 1.0, GROUP)


def test_weight_estimators_take_groups_of_one():
    rewards = torch.tensor([0.0, 1.0, 0.5])
    assert get_advantage("one")(rewards).tolist() == [1.0, 1.0, 1.0]
    assert get_advantage("reward")(rewards).tolist() == [0.0, 1.0, 0.5]
    assert get_advantage("one")(torch.tensor([3.0])).tolist() == [1.0]
    assert [min_group_size(n) for n in ("grpo", "dr_grpo", "one", "reward")] == [2, 2, 1, 1]
    assert (get_loss("sft").takes, get_loss("grpo").takes) == (advantage_kind("one"), advantage_kind("grpo"))
    with pytest.raises(ValueError, match="finite"):
        get_advantage("reward")(torch.tensor([float("inf")]))


# ---------------------------------------------------------------- sum over responses == group loss


def _padded_group_loss(cfg, logp_GL, old_GL, ref_GL, adv_G, mask_GL):
    """The group loss written directly over padded [G, L] tensors, verl-style."""
    num_G = mask_GL.sum(-1)
    A_G1 = adv_G[:, None]
    if cfg.name == "gspo":
        seq_log_ratio_G = ((logp_GL - old_GL) * mask_GL).sum(-1) / num_G
        ratio_GL = torch.exp(logp_GL - logp_GL.detach() + seq_log_ratio_G.detach()[:, None])
    else:
        ratio_GL = torch.exp(logp_GL - old_GL)
    pg_GL = torch.maximum(-A_G1 * ratio_GL, -A_G1 * ratio_GL.clamp(1 - cfg.clip_low, 1 + cfg.clip_high))

    def aggregate(x_GL):
        sums_G = (x_GL * mask_GL).sum(-1)
        if cfg.aggregation == "token_mean":
            return sums_G.sum() / mask_GL.sum()
        if cfg.aggregation == "seq_mean_token_mean":
            return (sums_G / num_G).mean()
        norm = cfg.max_response_tokens or int(num_G.max())
        return (sums_G / norm).mean()

    loss = aggregate(pg_GL)
    if cfg.kl_coef > 0:
        d_GL = ref_GL - logp_GL
        kl_GL = {"k1": -d_GL, "k2": 0.5 * d_GL**2, "k3": torch.exp(d_GL) - d_GL - 1}[cfg.kl_estimator]
        loss = loss + cfg.kl_coef * aggregate(kl_GL)
    return loss


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "dapo", "gspo"])
@pytest.mark.parametrize("aggregation", [None, "token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
@pytest.mark.parametrize("kl", [None, "k1", "k2", "k3"])
def test_sum_of_responses_is_group_loss(name, aggregation, kl):
    gen = torch.Generator().manual_seed(0)
    lengths = [3, 7, 1, 5]
    G, L = len(lengths), max(lengths)
    mask_GL = (torch.arange(L)[None, :] < torch.tensor(lengths)[:, None]).to(F64)
    logp_GL = (-3 * torch.rand(G, L, generator=gen, dtype=F64)).requires_grad_()
    # GSPO's ranges are ~1e-4 wide: scale the policy drift so both clipped and unclipped sequences occur
    drift = 1e-3 if name == "gspo" else 0.4
    old_GL = logp_GL.detach() + drift * torch.randn(G, L, generator=gen, dtype=F64)
    ref_GL = logp_GL.detach() + 0.3 * torch.randn(G, L, generator=gen, dtype=F64)
    adv_G = torch.tensor([1.2, -0.7, 0.4, -1.1], dtype=F64)
    cfg = LossConfig(
        name=name,
        aggregation=aggregation,
        kl_coef=0.0 if kl is None else 0.05,
        kl_estimator=kl or "k3",
        max_response_tokens=9 if name == "dr_grpo" else None,
    )

    expected = _padded_group_loss(cfg, logp_GL, old_GL, ref_GL, adv_G, mask_GL)
    (grad_expected_GL,) = torch.autograd.grad(expected, logp_GL)

    group = GroupShape.from_lengths(lengths)
    total = 0.0
    for i, n in enumerate(lengths):
        ref = None if kl is None else ref_GL[i, :n]
        loss, _ = response_loss(cfg, logp_GL[i, :n], old_GL[i, :n], adv_G[i].item(), group, ref_logp_R=ref)
        loss.backward()
        total += loss.item()
    _close(total, expected.item(), tol=1e-10)
    torch.testing.assert_close(logp_GL.grad, grad_expected_GL, rtol=1e-10, atol=1e-12)


def test_stats_aggregate_exactly():
    _, _, stats = _run(LossConfig(name="grpo"))
    summary = summarize_stats(sum_stats(stats))
    _close(summary["loss"], (-2.9 / 3 + 2.3 / 2) / 2)
    _close(summary["clip_frac"], 2 / 5)
    _close(summary["ratio_mean"], (1.5 + 1.0 + 0.7 + 1.5 + 0.5) / 5)
    _close(summary["ppo_kl"], -(math.log(1.5) + math.log(0.7) + math.log(1.5) + math.log(0.5)) / 5)
    assert summary["num_tokens"] == 5.0
    assert "kl_mean" not in summary


# ---------------------------------------------------------------- advantages


def test_advantages_hand_values():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    # mean 0.5; unbiased std = sqrt(4 * 0.25 / 3) = sqrt(1/3)
    expected = [0.5 / (math.sqrt(1 / 3) + GRPO_STD_EPS) * s for s in (1, -1, -1, 1)]
    _close(get_advantage("grpo")(rewards).tolist(), expected, tol=1e-6)
    _close(get_advantage("dr_grpo")(rewards).tolist(), [0.5, -0.5, -0.5, 0.5])
    # equal rewards carry no signal
    assert get_advantage("grpo")(torch.full((4,), 0.3)).abs().max().item() < 1e-5


# ---------------------------------------------------------------- errors


def test_config_defaults_resolve():
    assert LossConfig().aggregation == "seq_mean_token_mean"
    assert (LossConfig(name="grpo").clip_low, LossConfig(name="grpo").clip_high) == (0.2, 0.2)
    assert LossConfig(name="dapo", clip_high=0.3).clip_high == 0.3
    assert LossConfig(name="gspo").aggregation == "seq_mean_token_mean"


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"name": "ppo"}, r"'ppo'.*dapo.*dr_grpo.*grpo.*gspo"),
        ({"aggregation": "token-mean"}, r"'token-mean'.*seq_mean_token_mean"),
        ({"kl_estimator": "k4"}, r"'k4'.*k1.*k2.*k3"),
        ({"clip_low": 1.0}, r"clip_low.*1\.0"),
        ({"clip_low": -0.1}, r"clip_low"),
        ({"clip_high": -0.1}, r"clip_high"),
        ({"kl_coef": -1.0}, r"kl_coef"),
        ({"kl_coef": float("nan")}, r"kl_coef"),
        ({"max_response_tokens": 0}, r"max_response_tokens"),
    ],
)
def test_bad_config_raises(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LossConfig(**kwargs)


def test_bad_names_raise():
    with pytest.raises(ValueError, match=r"'ppo'.*gspo"):
        get_loss("ppo")
    with pytest.raises(ValueError, match=r"'rloo'.*dr_grpo.*grpo"):
        get_advantage("rloo")
    with pytest.raises(ValueError, match="at least 2"):
        get_advantage("grpo")(torch.tensor([1.0]))
    with pytest.raises(ValueError, match="finite"):
        get_advantage("dr_grpo")(torch.tensor([1.0, float("nan")]))


def test_bad_shapes_raise():
    cfg = LossConfig()
    with pytest.raises(ValueError, match="GroupShape"):
        GroupShape(group_size=2, total_tokens=7, max_tokens=3)
    with pytest.raises(ValueError, match="group_size"):
        GroupShape(group_size=0, total_tokens=1, max_tokens=1)
    with pytest.raises(ValueError, match="one length"):
        response_loss(cfg, _log([0.5, 0.5]), _log([0.5]), 1.0, GROUP)
    with pytest.raises(ValueError, match="max_tokens=3"):
        response_loss(cfg, _log([0.5] * 4), _log([0.5] * 4), 1.0, GROUP)
    with pytest.raises(ValueError, match="max_response_tokens=2"):
        response_loss(LossConfig(name="dr_grpo", max_response_tokens=2), _log([0.5]), _log([0.5]), 1.0, GROUP)
