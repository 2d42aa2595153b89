"""`dispatch.split_new_keys`: a response block's queries (the last R of S > R new keys) against the pages and the new
keys, as two attentions flash attention serves (pages + the block's own keys, causal; the earlier blocks' keys, no
mask) merged by LSE, equals one call, outputs, lse and every gradient (fp64, the torch reference as the inner
attention; on CUDA the dispatcher runs the same split over flash attention)."""

import pytest
import torch

from conftest import rel_err
from longstraw_kernels.attention.dispatch import split_new_keys
from longstraw_kernels.attention.reference import replay_attention, replay_attention_backward


@pytest.mark.parametrize("with_lse", [True, False])
@pytest.mark.parametrize("B, P, R, S", [(1, 37, 5, 17), (2, 0, 7, 9), (3, 63, 4, 100)])
def test_split_new_keys_equals_one_call(B, P, R, S, with_lse):
    """with_lse=False: only the output is used (a replay), so no lse cotangent reaches the backward."""
    g = torch.Generator().manual_seed(P + R + S)
    Q, K, D = 4, 2, 8

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_()

    inputs = [randn(B, R, Q, D), randn(P, K, D), randn(P, K, D), randn(B, S, K, D), randn(B, S, K, D)]
    dout, dlse = torch.randn(B, R, Q, D, generator=g, dtype=torch.float64), torch.randn(B, Q, R, generator=g,
                                                                                           dtype=torch.float64)

    def run(fn):
        out, lse = fn(*inputs, scale=D**-0.5, block_size=16, return_lse=True)
        grads = torch.autograd.grad((out * dout).sum() + ((lse * dlse).sum() if with_lse else 0), inputs)
        return [out, lse, *grads]

    lse_cotangents = []

    def backward(saved, needs_grad, dout_BRQD, dlse_BQR, **kw):
        lse_cotangents.append(dlse_BQR is not None)
        return replay_attention_backward(saved, needs_grad, dout_BRQD, dlse_BQR, **kw)

    got = run(lambda *a, **kw: split_new_keys(replay_attention, backward, *a, **kw))
    want = run(replay_attention)
    errs = [rel_err(a, b) for a, b in zip(got, want) if b.numel()]
    print(f"B={B} P={P} R={R} S={S}: max rel err {max(errs):.1e}")
    assert max(errs) <= 1e-12
    # an unused lse reaches the inner backwards as None (a zero tensor would send flash's to the fp32 reference)
    assert lse_cotangents == [with_lse] * (1 + B)
