"""replay_attention (blockwise, LSE-merged, recomputing backward) against the naive concatenate-and-mask oracle."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import rel_err
from longstraw_kernels.attention.reference import naive_attention, replay_attention


def make_inputs(P, R, S, B, Q, K, D, *, dtype=torch.float64, page_dtype=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    page_dtype = page_dtype or dtype

    def randn(*shape, dt):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dt)

    return dict(
        q_BRQD=randn(B, R, Q, D, dt=dtype),
        k_pages_PKD=randn(P, K, D, dt=page_dtype),
        v_pages_PKD=randn(P, K, D, dt=page_dtype),
        k_new_BSKD=randn(B, S, K, D, dt=dtype),
        v_new_BSKD=randn(B, S, K, D, dt=dtype),
    )


def run_with_grads(fn, inputs, grad_names, dout, dlse, **kwargs):
    """Calls fn on fresh leaves, backprops <out, dout> + <lse, dlse>, returns (out, lse, {name: grad})."""
    leaves = {n: t.detach().clone().requires_grad_(n in grad_names) for n, t in inputs.items()}
    out, lse = fn(**leaves, **kwargs)
    ((out * dout).sum() + (lse * dlse).sum()).backward()
    return out.detach(), lse.detach(), {n: leaves[n].grad for n in grad_names}


def replay_with_lse(**kwargs):
    return replay_attention(**kwargs, return_lse=True)


NEW_NAMES = ("q_BRQD", "k_new_BSKD", "v_new_BSKD")
PAGE_NAMES = ("k_pages_PKD", "v_pages_PKD")

# (P, R, S - R, B, Q, K, D, block_size, pages_need_grad): awkward sizes, blocks that do not divide P.
CASES = [
    (0, 1, 0, 1, 4, 2, 16, 64, False),
    (0, 7, 5, 3, 6, 1, 32, 64, False),
    (0, 65, 0, 1, 2, 2, 16, 100, False),
    (1, 1, 5, 3, 4, 2, 32, 64, True),
    (1, 7, 0, 1, 6, 1, 16, 100, False),
    (1, 65, 5, 1, 2, 2, 32, 64, True),
    (63, 1, 0, 3, 2, 2, 16, 64, False),
    (63, 7, 5, 1, 4, 2, 16, 100, True),
    (63, 65, 0, 3, 6, 1, 32, 64, False),
    (63, 7, 0, 3, 4, 2, 32, 17, True),
    (1000, 1, 5, 3, 4, 2, 16, 64, False),
    (1000, 7, 0, 1, 6, 1, 32, 100, True),
    (1000, 65, 5, 3, 2, 2, 16, 64, True),
    (1000, 65, 0, 1, 4, 2, 32, 100, False),
    (1000, 7, 5, 3, 6, 1, 16, 4096, True),
]


@pytest.mark.parametrize("P,R,extra,B,Q,K,D,block_size,pages_need_grad", CASES)
def test_matches_naive_float64(P, R, extra, B, Q, K, D, block_size, pages_need_grad):
    inputs = make_inputs(P, R, R + extra, B, Q, K, D)
    g = torch.Generator().manual_seed(1)
    dout = torch.randn(B, R, Q, D, generator=g, dtype=torch.float64)
    # A nonzero lse cotangent checks the lse's own gradient (used when partial results are merged outside).
    dlse = torch.randn(B, Q, R, generator=g, dtype=torch.float64)
    names = NEW_NAMES + (PAGE_NAMES if pages_need_grad and P > 0 else ())
    scale = D**-0.5

    out, lse, grads = run_with_grads(replay_with_lse, inputs, names, dout, dlse, scale=scale, block_size=block_size)
    ref_out, ref_lse, ref_grads = run_with_grads(naive_attention, inputs, names, dout, dlse, scale=scale)

    assert out.dtype == torch.float64 and lse.dtype == torch.float64
    assert rel_err(out, ref_out) <= 1e-10
    assert rel_err(lse, ref_lse) <= 1e-10
    for n in names:
        assert grads[n].dtype == inputs[n].dtype
        assert rel_err(grads[n], ref_grads[n]) <= 1e-10, n


# (P, R, B, Q, K, D, block_size, pages_need_grad) with S == 0: pages only, as one context-parallel shard.
PAGES_ONLY_CASES = [
    (1, 1, 1, 4, 2, 16, 64, True),
    (1, 65, 3, 6, 1, 32, 100, False),
    (63, 7, 3, 4, 2, 16, 17, True),
    (63, 1, 1, 2, 2, 32, 64, False),
    (1000, 65, 1, 4, 2, 16, 64, True),
    (1000, 7, 3, 6, 1, 32, 4096, False),
]


@pytest.mark.parametrize("P,R,B,Q,K,D,block_size,pages_need_grad", PAGES_ONLY_CASES)
def test_pages_only_matches_naive_float64(P, R, B, Q, K, D, block_size, pages_need_grad):
    inputs = make_inputs(P, R, 0, B, Q, K, D)
    g = torch.Generator().manual_seed(3)
    dout = torch.randn(B, R, Q, D, generator=g, dtype=torch.float64)
    dlse = torch.randn(B, Q, R, generator=g, dtype=torch.float64)
    # The empty new keys have nothing to compare: q and (optionally) the pages carry the gradients.
    names = ("q_BRQD",) + (PAGE_NAMES if pages_need_grad else ())
    scale = D**-0.5

    out, lse, grads = run_with_grads(replay_with_lse, inputs, names, dout, dlse, scale=scale, block_size=block_size)
    ref_out, ref_lse, ref_grads = run_with_grads(naive_attention, inputs, names, dout, dlse, scale=scale)

    assert torch.isfinite(lse).all()
    assert rel_err(out, ref_out) <= 1e-10
    assert rel_err(lse, ref_lse) <= 1e-10
    for n in names:
        assert rel_err(grads[n], ref_grads[n]) <= 1e-10, n


def test_no_grad_forward_is_bitwise_identical():
    inputs = make_inputs(1000, 7, 12, 3, 4, 2, 32, dtype=torch.float32)
    leaves = {n: t.clone().requires_grad_() for n, t in inputs.items()}
    out, lse = replay_attention(**leaves, scale=0.2, block_size=100, return_lse=True)
    with torch.no_grad():
        out_ng, lse_ng = replay_attention(**inputs, scale=0.2, block_size=100, return_lse=True)
    assert out.requires_grad and not out_ng.requires_grad
    assert torch.equal(out, out_ng) and torch.equal(lse, lse_ng)


def test_bf16_pages_fp32_queries():
    inputs = make_inputs(1000, 7, 12, 3, 6, 2, 32, dtype=torch.float32, page_dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(2)
    dout = torch.randn(3, 7, 6, 32, generator=g)
    dlse = torch.zeros(3, 6, 7)
    names = NEW_NAMES + PAGE_NAMES
    out, lse, grads = run_with_grads(replay_with_lse, inputs, names, dout, dlse, scale=32**-0.5, block_size=64)
    # The oracle sees the same bf16-rounded pages, in float64.
    inputs64 = {n: t.double() for n, t in inputs.items()}
    ref_out, ref_lse, ref_grads = run_with_grads(
        naive_attention, inputs64, names, dout.double(), dlse.double(), scale=32**-0.5
    )

    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    assert rel_err(out, ref_out) <= 1e-5
    assert rel_err(lse, ref_lse) <= 1e-5
    for n in NEW_NAMES:
        assert grads[n].dtype == torch.float32
        assert rel_err(grads[n], ref_grads[n]) <= 1e-5, n
    for n in PAGE_NAMES:
        # Page grads come back in the pages' dtype: bf16 rounding (~2^-9) bounds their error.
        assert grads[n].dtype == torch.bfloat16
        assert rel_err(grads[n], ref_grads[n]) <= 1e-2, n


class _OutputShapes(TorchDispatchMode):
    """Records the shape of every tensor an op produces."""

    def __init__(self):
        super().__init__()
        self.shapes = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.shapes.add(tuple(t.shape))
        return out


@pytest.mark.parametrize("pages_need_grad", [False, True])
def test_frozen_pages_get_no_grad_computed(pages_need_grad):
    P, R, S, B, Q, K, D = 1000, 7, 12, 3, 4, 2, 16
    inputs = make_inputs(P, R, S, B, Q, K, D)
    dout = torch.randn(B, R, Q, D, dtype=torch.float64)
    names = NEW_NAMES + (PAGE_NAMES if pages_need_grad else ())
    leaves = {n: t.clone().requires_grad_(n in names) for n, t in inputs.items()}
    out = replay_attention(**leaves, scale=0.25, block_size=64)
    # Blocks of 64 never span all 1000 pages: a [P, K, D] tensor in the backward can only be a page gradient.
    with _OutputShapes() as seen:
        (out * dout).sum().backward()
    assert ((P, K, D) in seen.shapes) == pages_need_grad
    assert all(leaves[n].grad is None for n in PAGE_NAMES if n not in names)

    dlse = torch.zeros(B, Q, R, dtype=torch.float64)
    _, _, ref_grads = run_with_grads(naive_attention, inputs, names, dout, dlse, scale=0.25)
    for n in names:
        assert rel_err(leaves[n].grad, ref_grads[n]) <= 1e-10, n


def test_score_memory_is_bounded_by_the_block():
    P, R, S, B, Q, K, D, block_size = 1000, 7, 12, 3, 4, 2, 16, 64
    inputs = make_inputs(P, R, S, B, Q, K, D)
    leaves = {n: t.clone().requires_grad_() for n, t in inputs.items()}
    with _OutputShapes() as seen:
        out = replay_attention(**leaves, scale=0.25, block_size=block_size)
        out.sum().backward()
    # Folded scores are [B, K, G*R, N]: no op may produce anything that scales with B * R * P.
    largest = max(torch.Size(s).numel() for s in seen.shapes)
    assert largest <= max(B * Q * R * max(block_size, S), P * K * D)


def test_rejects_bad_shapes():
    inputs = make_inputs(10, 7, 5, 1, 4, 2, 16)
    with pytest.raises(ValueError, match="S=5 < R=7"):
        replay_attention(**inputs, scale=1.0)
    inputs = make_inputs(10, 7, 7, 1, 3, 2, 16)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        replay_attention(**inputs, scale=1.0)
    inputs = make_inputs(0, 7, 0, 1, 4, 2, 16)
    with pytest.raises(ValueError, match="P=0, S=0"):
        replay_attention(**inputs, scale=1.0)
