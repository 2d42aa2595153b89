"""Context-parallel GDN against one rank: the span transition M, prefix composition, and 2/4 gloo ranks on CPU
(uneven spans, an empty span, spans shorter than the conv window, H != G) matching the single-rank scan and the
sliced conv windows."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from conftest import rel_err, run_ranks
from longstraw_cli.distributed.cp_gdn import compose_prefix, cp_conv_window, cp_gdn_scan, gdn_transition, span_affine
from longstraw_kernels.gdn import gdn_chunked, gdn_recurrent

B, H, G, K, V, X, W = 2, 2, 4, 8, 6, 5, 3


pytestmark = pytest.mark.usefixtures("one_thread")


def make_inputs(T, dtype=torch.float64, seed=0):
    """q, k unit-norm; log-decay g in about (-3, 0) but mostly mild, so the state survives a span; beta in (0, 1);
    a random state before the first span and a random conv window before it; pre-conv inputs mixed."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    x = {
        "q": F.normalize(randn(B, T, H, K), dim=-1),
        "k": F.normalize(randn(B, T, H, K), dim=-1),
        "v": randn(B, T, G, V),
        "g": -0.1 * F.softplus(randn(B, T, G)),
        "beta": torch.sigmoid(randn(B, T, G)),
        "state": randn(B, G, K, V) * 0.5,
        "mixed": randn(B, T, X),
        "window": randn(B, X, W),
    }
    return {n: t.to(dtype) for n, t in x.items()}


def scan(x, state, **kwargs):
    return gdn_chunked(x["q"], x["k"], x["v"], x["g"], x["beta"], state, **kwargs)


def split(x, spans):
    """Per-span slices of every time-major input."""
    bounds = torch.tensor([0] + list(spans)).cumsum(0).tolist()
    return [{n: t[:, a:b] if t.dim() > 2 and n not in ("state", "window") else t for n, t in x.items()}
            for a, b in zip(bounds, bounds[1:])]


# -- single process -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("chunk_size", [2, 64])
def test_transition_is_the_product_of_token_maps(chunk_size):
    x = make_inputs(T=5, seed=1)
    x["g"] = -F.softplus(torch.randn(B, 5, G, generator=torch.Generator().manual_seed(2), dtype=torch.float64))
    M_BGKK = gdn_transition(x["k"], x["g"], x["beta"], chunk_size=chunk_size)
    k_BTGK = x["k"].repeat_interleave(G // H, dim=2)
    expected_BGKK = torch.eye(K, dtype=torch.float64).expand(B, G, K, K)
    for t in range(5):
        kk_BGKK = k_BTGK[:, t, :, :, None] * k_BTGK[:, t, :, None, :]
        A_BGKK = x["g"][:, t, :, None, None].exp() * (torch.eye(K, dtype=torch.float64)
                                                       - x["beta"][:, t, :, None, None] * kk_BGKK)
        expected_BGKK = A_BGKK @ expected_BGKK
    assert M_BGKK.dtype == torch.float64
    assert rel_err(M_BGKK, expected_BGKK) <= 1e-10
    # orientation: final = M @ S_in + S_ext with S as [K, V]
    _, final_BGKV = scan(x, x["state"])
    _, S_ext_BGKV = scan(x, None)
    assert rel_err(M_BGKK @ x["state"] + S_ext_BGKV, final_BGKV) <= 1e-10


def test_span_affine_matches_transition_and_zero_state_scan():
    x = make_inputs(T=23, seed=3)
    M_BGKK, S_ext_BGKV = span_affine(x["k"], x["v"], x["g"], x["beta"], chunk_size=8)
    assert rel_err(M_BGKK, gdn_transition(x["k"], x["g"], x["beta"], chunk_size=8)) <= 1e-12
    assert rel_err(S_ext_BGKV, scan(x, None)[1]) <= 1e-12
    empty = split(x, [0, 23])[0]
    M0_BGKK, S0_BGKV = span_affine(empty["k"], empty["v"], empty["g"], empty["beta"])
    assert torch.equal(M0_BGKK, torch.eye(K, dtype=torch.float64).expand(B, G, K, K)) and not S0_BGKV.any()


@pytest.mark.parametrize("spans", [[37], [10, 0, 20, 7], [0, 1, 36], [36, 1, 0]])
def test_composed_spans_equal_one_scan(spans):
    x = make_inputs(T=sum(spans), seed=len(spans))
    o_ref, final_ref = scan(x, x["state"])
    parts = split(x, spans)
    affine = [span_affine(p["k"], p["v"], p["g"], p["beta"], chunk_size=8) for p in parts]
    S_in_NBGKV, final_BGKV = compose_prefix(torch.stack([m for m, _ in affine]), torch.stack([s for _, s in affine]),
                                            x["state"])
    assert rel_err(final_BGKV, final_ref) <= 1e-10
    outputs = [scan(p, S_in_NBGKV[i], chunk_size=8)[0] for i, p in enumerate(parts)]
    assert rel_err(torch.cat(outputs, dim=1), o_ref) <= 1e-10
    start = 0
    for i, n in enumerate(spans):
        # S_in of span i is the state after the tokens before it
        expected_BGKV = gdn_recurrent(*(x[k][:, :start] for k in ("q", "k", "v", "g", "beta")), x["state"])[1]
        assert rel_err(S_in_NBGKV[i], expected_BGKV) <= 1e-10
        start += n


def test_single_rank_without_process_group():
    x = make_inputs(T=19, seed=4)
    with torch.no_grad():
        o, final = cp_gdn_scan(x["q"], x["k"], x["v"], x["g"], x["beta"], x["state"], chunk_size=8)
    o_ref, final_ref = scan(x, x["state"])
    assert rel_err(o, o_ref) <= 1e-10 and rel_err(final, final_ref) <= 1e-10
    window_in, window_out = cp_conv_window(x["mixed"], x["window"])
    assert torch.equal(window_in, x["window"]) and torch.equal(window_out, x["mixed"][:, -W:].transpose(1, 2))
    with pytest.raises(ValueError, match="capture-only"):
        cp_gdn_scan(x["q"], x["k"], x["v"].requires_grad_(), x["g"], x["beta"])


# -- gloo ranks -----------------------------------------------------------------------------------------------

def _worker(rank, world, port, spans, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        results = {}
        for dtype in (torch.float64, torch.float32, torch.bfloat16):
            part = split(make_inputs(sum(spans), dtype=dtype, seed=world), spans)[rank]
            with torch.no_grad():
                results[f"o_{dtype}"], results[f"final_{dtype}"] = cp_gdn_scan(
                    part["q"], part["k"], part["v"], part["g"], part["beta"], part["state"], chunk_size=8)
            results[f"window_in_{dtype}"], results[f"window_out_{dtype}"] = cp_conv_window(part["mixed"],
                                                                                           part["window"])
        torch.save(results, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


# world 2: rank 1's conv window reaches into the window before rank 0; world 4: an empty span and spans shorter
# than W in the middle, uneven everywhere.
@pytest.mark.distributed
@pytest.mark.parametrize("spans", [[2, 35], [11, 0, 2, 24]], ids=["world2", "world4"])
def test_cp_ranks_match_one_rank(spans, tmp_path):
    world = len(spans)
    run_ranks(_worker, world, spans, str(tmp_path))
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    tolerances = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 1e-2}
    for dtype, tol in tolerances.items():
        x = make_inputs(sum(spans), dtype=dtype, seed=world)
        # the reference: one rank, fp64 from the same (rounded) inputs
        x64 = {n: t.double() for n, t in x.items()}
        o_ref, final_ref = scan(x64, x64["state"])
        parts_ref = split({"o": o_ref}, spans)
        full_BXS = torch.cat([x["window"], x["mixed"].transpose(1, 2)], dim=-1)
        start = 0
        for rank, res in enumerate(results):
            state_dtype = torch.float64 if dtype == torch.float64 else torch.float32
            assert res[f"final_{dtype}"].dtype == state_dtype and res[f"o_{dtype}"].dtype == dtype
            assert rel_err(res[f"final_{dtype}"], final_ref) <= tol, (dtype, rank)
            if spans[rank]:
                assert rel_err(res[f"o_{dtype}"], parts_ref[rank]["o"]) <= tol, (dtype, rank)
            else:
                assert res[f"o_{dtype}"].shape == (B, 0, G, V)
            # windows are pure copies: exact
            assert torch.equal(res[f"window_in_{dtype}"], full_BXS[..., start:start + W]), (dtype, rank)
            assert torch.equal(res[f"window_out_{dtype}"], full_BXS[..., -W:]), (dtype, rank)
            start += spans[rank]
        errs = [rel_err(r[f"o_{dtype}"], p["o"]) for r, p in zip(results, parts_ref) if p["o"].shape[1]]
        print(f"world={world} {dtype}: max output rel err {max(errs):.1e}, "
              f"final state {rel_err(results[-1][f'final_{dtype}'], final_ref):.1e}")
