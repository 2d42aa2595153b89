"""The pages' whole attention backward in tiles (`triton_page_tiles.py`, Triton's interpreter on CPU, fp32): dq, dk
and dv of folded query rows against pages equal autograd's through softmax attention over those pages in fp64, for
page counts that are and are not a multiple of the chunk and of the tile, and rows that are not a multiple of the
row tile; and, given another part's keys in the global lse (the ring identity), the products of that lse. Then the
replay backward's routes for the pages (flash.py) against the reference backward. On CUDA (bf16) tests/kernels/
test_gpu.py checks it through the replay attention against the fp64 reference."""

import pytest
import torch

from conftest import rel_err
from longstraw_kernels.attention.triton_page_dq import DqConfig
from longstraw_kernels.attention.triton_page_tiles import page_backward

CONFIG = DqConfig(16, 16, 4, 1)


def inputs(K, M, P, D, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(K, M, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(P, K, D, generator=g, dtype=torch.float64) for _ in range(2))
    do = torch.randn(K, M, D, generator=g, dtype=torch.float64)
    return q, k, v, do


def autograd_backward(q, k, v, do, scale):
    """fp64 autograd through softmax(scale q k^T) v over the pages alone -> (out, lse, dq, dk, dv)."""
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    s = scale * q @ k.transpose(0, 1).transpose(-1, -2)  # [K, M, P]
    lse = torch.logsumexp(s, -1)
    out = torch.exp(s - lse[..., None]) @ v.transpose(0, 1)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), do)
    return out.detach(), lse.detach(), dq, dk, dv


@pytest.mark.parametrize("K, M, P, D, chunk", [(2, 40, 70, 32, 32), (1, 16, 48, 16, 16), (2, 33, 20, 64, 64)])
def test_tiles_equal_autograd_in_fp64(K, M, P, D, chunk):
    q, k, v, do = inputs(K, M, P, D)
    scale = D**-0.5
    out, lse, dq, dk, dv = autograd_backward(q, k, v, do, scale)
    delta = (do * out).sum(-1)
    got = page_backward(q.float(), do.float(), lse, delta, k.float(), v.float(), scale, chunk=chunk, config=CONFIG)
    assert got[0].dtype == torch.float32 and got[1].dtype == got[2].dtype == torch.float32
    for name, g, want in zip(("dq", "dk", "dv"), got, (dq, dk, dv)):
        assert rel_err(g, want) < 1e-5, name


def test_a_global_lse_gives_this_parts_share():
    """With keys elsewhere too (the replay's new keys, another rank's pages), the lse and out are the whole
    attention's: the pages' dk and dv are those of the whole, and dq is the pages' share of it."""
    K, M, P, E, D = 2, 24, 40, 30, 32
    q, k, v, do = inputs(K, M, P + E, D, seed=1)
    scale = D**-0.5
    out, lse, dq_all, dk, dv = autograd_backward(q, k, v, do, scale)
    delta = (do * out).sum(-1)
    got = page_backward(q.float(), do.float(), lse, delta, k[:P].float(), v[:P].float(), scale, chunk=16,
                        config=CONFIG)
    other = page_backward(q.float(), do.float(), lse, delta, k[P:].float(), v[P:].float(), scale, chunk=16,
                          config=CONFIG)
    assert rel_err(got[1], dk[:P]) < 1e-5 and rel_err(got[2], dv[:P]) < 1e-5
    assert rel_err(got[0] + other[0], dq_all) < 1e-5


def test_no_pages_give_no_gradient():
    q, k, v, do = inputs(2, 8, 0, 16)
    dq, dk, dv = page_backward(q.float(), do.float(), torch.zeros(2, 8), torch.zeros(2, 8), k.float(), v.float(),
                               0.25, config=CONFIG)
    assert dq.shape == (2, 8, 16) and not dq.any() and dk.shape == dv.shape == (0, 2, 16)


def identity_backward(dout, q, k, v, out, lse, causal, scale, backend):
    """aten's attention backward as the replay calls it (one part of the keys, the global out and lse), in torch:
    aten's kernels are CUDA's."""
    p = torch.exp(scale * q @ k.transpose(-1, -2) - lse[..., None])
    ds = p * (dout @ v.transpose(-1, -2) - (dout * out).sum(-1, keepdim=True))
    return scale * ds @ k, scale * ds.transpose(-1, -2) @ q, p.transpose(-1, -2) @ dout


@pytest.mark.parametrize("route, needs", [
    ("tiles", (True, True, True)),     # exact mode's walk
    ("tiles", (False, True, True)),    # pages alone
    ("kernel", (True, True, True)),    # a head dim the Triton page kernels do not take
])
def test_replay_backward_routes_the_pages_and_equals_the_reference(route, needs, monkeypatch):
    """flash.py's replay backward with no new keys (a context-parallel shard's pages), in the interpreter: pages that
    need gradients through page_backward, other head dims through the forward kernel's own backward over page chunks;
    each equal to the reference backward, with None where no gradient is asked. (Frozen pages' route, page_dq, sizes
    its launch from the GPU's SMs: tests/kernels/test_gpu.py covers it.)"""
    from longstraw_kernels.attention import flash, triton_page_dq, triton_page_tiles
    from longstraw_kernels.attention.reference import replay_attention, replay_attention_backward

    calls = []
    for module, name in ((triton_page_tiles, "page_backward"), (triton_page_dq, "page_dq"), (flash, "attend_backward")):
        original = identity_backward if name == "attend_backward" else getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _f=original, _n=name, **kw: calls.append(_n) or _f(*a, **kw))
    monkeypatch.setattr(triton_page_tiles, "DEFAULT_CHUNK", 32)  # 70 pages: tiles of 32, 32 and 6
    if route == "kernel":
        monkeypatch.setattr(flash, "triton_pages_supported", lambda *pages: False)
        monkeypatch.setattr(flash, "BACKWARD_PAGE_CHUNK", 32)
    B, R, Q, K, P, D = 2, 5, 4, 2, 70, 32
    g = torch.Generator().manual_seed(2)
    q, do = (torch.randn(B, R, Q, D, generator=g) for _ in range(2))
    kp, vp = (torch.randn(P, K, D, generator=g) for _ in range(2))
    none = kp.new_empty(B, 0, K, D)
    out, lse = replay_attention(q, kp, vp, none, none, scale=D**-0.5, return_lse=True)
    saved = (q, kp, vp, none, none, out, lse)
    needs = needs + (False, False)
    got = flash.flash_replay_attention_backward(saved, needs, do, None, scale=D**-0.5, block_size=R)
    want = replay_attention_backward(saved, needs, do, None, scale=D**-0.5, block_size=R)
    assert calls == {"tiles": ["page_backward"], "kernel": ["attend_backward"] * 3}[route]
    for need, g_, w in zip(needs, got, want):
        assert (g_ is None) == (w is None) == (not need)
        if need:
            assert rel_err(g_, w) < 1e-5
