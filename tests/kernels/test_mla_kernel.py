"""Sparse absorbed-MLA attention (kernels/mla) against a naive autograd oracle: outputs, LSE and gradients."""

import pytest
import torch

from conftest import rel_err
from longstraw_kernels.mla import reference as mla


def make_case(B=2, T=13, H=3, L=24, R=8, P=63, K=10, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, L + R, generator=g, dtype=dtype)
    latent = torch.randn(P, L, generator=g, dtype=dtype)
    rope = torch.randn(P, R, generator=g, dtype=dtype)
    idx = torch.stack([torch.randperm(P, generator=g)[:K] for _ in range(B * T)]).view(B, T, K)
    # some entries absent, one row with none at all (its lse must be -inf, its gradient zero, nothing NaN)
    idx = idx.masked_fill(torch.rand(B, T, K, generator=g) < 0.3, -1)
    idx[0, 3] = -1
    return q, latent, rope, idx


def loss_of(out, lse, g):
    # a finite weighting of out and lse (lse -inf rows excluded): both cotangents are exercised
    w_out = torch.randn(out.shape, generator=g, dtype=out.dtype)
    finite = torch.isfinite(lse)
    w_lse = torch.randn(lse.shape, generator=g, dtype=lse.dtype)
    return (w_out * out).sum() + (w_lse * torch.where(finite, lse, torch.zeros_like(lse))).sum()


@pytest.mark.parametrize("chunk", [1 << 20, 7])
def test_sparse_mla_matches_naive_outputs_lse_and_grads(monkeypatch, chunk):
    # a small chunk forces several recompute chunks per call (awkward sizes: T=13 rows, 7 entries per chunk)
    monkeypatch.setattr(mla, "_CHUNK_ENTRIES", chunk)
    q, latent, rope, idx = make_case()
    scale = 0.17
    results = []
    for fn in (mla.sparse_mla_attention, mla.naive_sparse_mla_attention):
        leaves = [t.clone().requires_grad_() for t in (q, latent, rope)]
        out, lse = fn(*leaves, idx, scale=scale)
        loss_of(out, lse, torch.Generator().manual_seed(5)).backward()
        results.append((out.detach(), lse.detach(), [t.grad for t in leaves]))
    (out, lse, grads), (out_ref, lse_ref, grads_ref) = results
    assert torch.isinf(lse[0, 3]).all() and (out[0, 3] == 0).all()
    finite = torch.isfinite(lse_ref)
    assert torch.equal(finite, torch.isfinite(lse))
    errs = [rel_err(out, out_ref), rel_err(lse[finite], lse_ref[finite])]
    errs += [rel_err(a, b) for a, b in zip(grads, grads_ref)]
    print(f"sparse MLA vs naive (fp64): out, lse, dq, dlatent, drope rel errs {[f'{e:.1e}' for e in errs]}")
    assert max(errs) < 1e-12
    assert torch.isfinite(grads[0]).all() and (grads[0][0, 3] == 0).all()


def test_merge_with_dense_new_keys_equals_attention_over_all_keys():
    q, latent, rope, idx = make_case(seed=1)
    B, T = q.shape[:2]
    P = latent.shape[0]
    g = torch.Generator().manual_seed(2)
    # new keys per sequence, selected by a mask; together with idx, one naive attention over [pages | new]
    S = T
    new_lat = torch.randn(B, S, latent.shape[1], generator=g, dtype=q.dtype)
    new_rope = torch.randn(B, S, rope.shape[1], generator=g, dtype=q.dtype)
    allowed = (torch.rand(B, T, S, generator=g) < 0.5) & torch.ones(T, S, dtype=torch.bool).tril()
    allowed[:, :, 0] = True  # every row sees something in total
    leaves = [t.clone().requires_grad_() for t in (q, new_lat, new_rope)]
    out_a, lse_a = mla.sparse_mla_attention(leaves[0], latent, rope, idx, scale=0.2)
    out_b, lse_b = mla.dense_mla_attention(leaves[0], leaves[1], leaves[2], allowed, scale=0.2)
    out, lse = mla.merge_lse(out_a, lse_a, out_b, lse_b)
    loss_of(out, lse, torch.Generator().manual_seed(3)).backward()
    got = [out.detach(), lse.detach()] + [t.grad for t in leaves]

    # oracle: per sequence, pages become extra "new" keys selected by idx, one dense masked attention
    leaves_ref = [t.clone().requires_grad_() for t in (q, new_lat, new_rope)]
    all_lat = torch.cat([latent.expand(B, -1, -1), leaves_ref[1]], dim=1)
    all_rope = torch.cat([rope.expand(B, -1, -1), leaves_ref[2]], dim=1)
    sel = torch.zeros(B, T, P + 1, dtype=torch.bool).scatter_(-1, idx.clamp(min=0).where(idx >= 0, P), True)[..., :P]
    out_r, lse_r = mla.dense_mla_attention(leaves_ref[0], all_lat, all_rope, torch.cat([sel, allowed], -1), scale=0.2)
    loss_of(out_r, lse_r, torch.Generator().manual_seed(3)).backward()
    ref = [out_r.detach(), lse_r.detach()] + [t.grad for t in leaves_ref]
    worst = max(rel_err(a, b) for a, b in zip(got, ref))
    print(f"LSE merge of sparse pages + dense new keys vs one attention (fp64): max rel err {worst:.1e}")
    assert worst < 1e-12


def test_backward_saves_no_gathered_pages():
    q, latent, rope, idx = make_case(T=40, K=30, P=200)
    q.requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out, lse = mla.sparse_mla_attention(q, latent, rope, idx, scale=0.1)
    assert len(saved) == 6  # q, latent, rope, idx, out, lse
    page_ptrs = {latent.data_ptr(), rope.data_ptr()}
    own = sum(t.numel() * t.element_size() for t in saved if t.data_ptr() not in page_ptrs)
    gathered = idx.numel() * (latent.shape[1] + rope.shape[1]) * latent.element_size()
    budget = sum(t.numel() * t.element_size() for t in (q, idx, out, lse))
    assert own <= budget < gathered


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_compiled_graph_op_checks(dtype):
    """`longstraw::sparse_mla_forward` (what a compiled graph calls): schema, fake shapes and dtypes of (out, lse),
    and the eager result, by torch.library.opcheck; -1 entries included."""
    from longstraw_kernels.mla.dispatch import _forward_op

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, 4, 24, generator=g).to(dtype)
    latent, rope = torch.randn(50, 16, generator=g).to(dtype), torch.randn(50, 8, generator=g).to(dtype)
    idx = torch.randint(-1, 50, (2, 3, 6), generator=g)
    torch.library.opcheck(_forward_op, (q, latent, rope, idx, 0.3))
