"""glm52's router (`TopkRouter.choose`): where every group is kept (topk_group = n_group, GLM-5's 1 of 1) it skips the
group selection, which then masks nothing; the choice must be the group-limited rule's, ties included."""

import pytest
import torch

from longstraw_cli.models.glm52.config import named_config
from longstraw_cli.models.glm52.model import TopkRouter


def group_limited(scores_NE, bias_E, n_group, topk_group, k):
    """The rule written out (HF GlmMoeDsa's): the best topk_group groups by their two best biased scores, then the
    k best biased scores within them."""
    N, E = scores_NE.shape
    choice_NE = scores_NE + bias_E
    group_NG = choice_NE.view(N, n_group, E // n_group).topk(min(2, E // n_group), dim=-1).values.sum(-1)
    keep_NG = torch.zeros_like(group_NG, dtype=torch.bool).scatter_(1, group_NG.topk(topk_group, -1).indices, True)
    keep_NE = keep_NG[:, :, None].expand(N, n_group, E // n_group).reshape(N, E)
    return choice_NE.masked_fill(~keep_NE, float("-inf")).topk(k, dim=-1).indices


@pytest.mark.parametrize("n_group, topk_group", [(1, 1), (2, 2), (4, 4), (4, 2), (2, 1)])
def test_choose_is_the_group_limited_rule(n_group, topk_group):
    cfg = named_config("glm52_tiny", n_routed_experts=16, num_experts_per_tok=4, n_group=n_group,
                       topk_group=topk_group)
    router = TopkRouter(cfg)
    g = torch.Generator().manual_seed(n_group * 10 + topk_group)
    router.e_score_correction_bias.copy_(torch.randn(16, generator=g) * 0.1)
    scores = torch.rand(64, 16, generator=g, dtype=router.weight.dtype)
    scores[:8] = 0.5  # rows of ties: the choice among equal scores must be the same too
    router.e_score_correction_bias[:] = torch.where(torch.arange(16) % 3 == 0, 0.0, router.e_score_correction_bias)
    want = group_limited(scores, router.e_score_correction_bias, n_group, topk_group, 4)
    assert torch.equal(router.choose(scores), want)
