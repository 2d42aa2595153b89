"""Expert parallel routed experts on 2 and 4 gloo ranks (CPU) against one rank with every expert.

`local_experts` is first checked against HF's GlmMoeDsaExperts. Then every rank builds the same seeded global
problem, takes its experts (and, all-to-all mode, its tokens), runs forward and backward of <y, dy>; the parent
compares outputs and every gradient with the single-rank run: dx, dw on the ranks holding the tokens (all ranks
when replicated), and each rank's expert gradients with the matching slice of the one-rank gradient.
"""

import os

import pytest
import torch
import torch.distributed as dist

from conftest import cached_rank_results, join_gloo, rel_err
from longstraw_cli.distributed.ep import (
    ep_experts_alltoall,
    ep_experts_replicated,
    ep_shard,
    expert_bounds,
    local_experts,
)
from longstraw_kernels import use_kernels

# world size -> name -> (tokens per rank, E, k, C, I, experts that may be chosen (None: all), dtype).
# Replicated mode uses every rank's tokens together on every rank. Fewer token shards than ranks: EP groups of
# consecutive ranks inside the world.
F64, F32 = torch.float64, torch.float32
CASES = {
    2: {
        "random": ((7, 12), 8, 3, 16, 12, None, F64),
        "rank1_idle": ((5, 6), 8, 2, 16, 12, (0, 2, 3), F64),
        "one_token": ((1, 0), 8, 2, 16, 12, None, F64),
        "no_tokens": ((0, 0), 8, 2, 16, 12, None, F64),
        "fp32": ((9, 4), 8, 3, 16, 12, None, F32),
    },
    4: {
        "random": ((5, 0, 9, 3), 8, 2, 16, 12, None, F64),
        "top8": ((6, 11, 2, 7), 16, 8, 16, 12, None, F64),
        # ranks 1 and 3 hold no chosen expert; rank 2 one of its two, and no tokens of its own
        "uneven": ((4, 7, 0, 5), 8, 2, 16, 12, (0, 1, 5), F64),
        "one_token": ((0, 0, 1, 0), 8, 3, 16, 12, None, F64),
        "fp32": ((3, 8, 6, 1), 8, 3, 16, 12, None, F32),
        "ep2_groups": ((6, 5), 8, 3, 16, 12, None, F64),
    },
}
MODES = ("alltoall", "replicated")
INPUTS = ("x_NC", "topk_w_Nk")
PARAMS = ("gate_up_proj", "down_proj")
TOL = {F64: 1e-12, F32: 1e-5}


def problem(tokens_W, E, k, C, I, allowed, dtype, seed):
    """The global problem: every token, the full experts, and the output's cotangent."""
    g = torch.Generator().manual_seed(seed)
    N = sum(tokens_W)
    allowed = torch.tensor(allowed if allowed is not None else range(E))
    topk_idx_Nk = torch.stack([allowed[torch.randperm(len(allowed), generator=g)[:k]] for _ in range(N)]
                              or [torch.zeros(0, k, dtype=torch.long)])
    inputs = dict(
        x_NC=torch.randn(N, C, generator=g, dtype=F64),
        # renormalised sigmoid scores x 2.5 look like this: positive, summing to 2.5
        topk_w_Nk=torch.softmax(torch.randn(N, k, generator=g, dtype=F64), -1) * 2.5,
        gate_up_proj=torch.randn(E, 2 * I, C, generator=g, dtype=F64) * C**-0.5,
        down_proj=torch.randn(E, C, I, generator=g, dtype=F64) * I**-0.5,
    )
    dy_NC = torch.randn(N, C, generator=g, dtype=F64)
    return {n: t.to(dtype) for n, t in inputs.items()}, topk_idx_Nk.reshape(N, k), dy_NC.to(dtype)


def run(experts_fn, inputs, topk_idx_Nk, dy_NC, **kwargs):
    """-> {"y": ..., name: grad} after backpropagating <y, dy>; plus y computed without autograd."""
    leaves = {n: t.clone().requires_grad_() for n, t in inputs.items()}
    y_NC = experts_fn(leaves["x_NC"], topk_idx_Nk, leaves["topk_w_Nk"], leaves["gate_up_proj"],
                      leaves["down_proj"], **kwargs)
    (y_NC * dy_NC).sum().backward()
    with torch.no_grad():
        y_no_grad_NC = experts_fn(inputs["x_NC"], topk_idx_Nk, inputs["topk_w_Nk"], inputs["gate_up_proj"],
                                  inputs["down_proj"], **kwargs)
    return {"y": y_NC.detach(), "y_no_grad": y_no_grad_NC, **{n: leaves[n].grad for n in leaves}}


def _shard_case(ep_rank, group, tokens_W, E, k, C, I, allowed, dtype, seed):
    inputs, topk_idx_Nk, dy_NC = problem(tokens_W, E, k, C, I, allowed, dtype, seed)
    for n in PARAMS:
        inputs[n] = ep_shard(inputs[n], group)
    results = {"replicated": run(ep_experts_replicated, inputs, topk_idx_Nk, dy_NC, group=group, num_experts=E)}
    t0, t1 = sum(tokens_W[:ep_rank]), sum(tokens_W[: ep_rank + 1])
    inputs.update({n: inputs[n][t0:t1] for n in INPUTS})
    results["alltoall"] = run(ep_experts_alltoall, inputs, topk_idx_Nk[t0:t1], dy_NC[t0:t1], group=group,
                              num_experts=E)
    return results


def _errors(world_size):
    """ValueErrors raised before any collective, so one rank's mistake cannot hang the others."""
    x_NC, idx_Nk, w_Nk = torch.zeros(3, 4), torch.zeros(3, 2, dtype=torch.long), torch.ones(3, 2)
    calls = {
        "indivisible": lambda: ep_experts_alltoall(x_NC, idx_Nk, w_Nk, torch.zeros(1, 6, 4), torch.zeros(1, 4, 3),
                                                   num_experts=world_size + 1),
        "wrong_local_shape": lambda: ep_experts_replicated(x_NC, idx_Nk, w_Nk, torch.zeros(4, 6, 4),
                                                           torch.zeros(4, 4, 3), num_experts=world_size),
    }
    messages = {}
    for name, call in calls.items():
        try:
            call()
        except ValueError as e:
            messages[name] = str(e)
    return messages


def _worker(rank, world_size, port, out_dir):
    groups = join_gloo(rank, world_size, port)
    results = {"errors": _errors(world_size)}
    for seed, (name, case) in enumerate(CASES[world_size].items()):
        ep = len(case[0])
        results[name] = _shard_case(rank % ep, groups.get(ep), *case, seed)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ep_results(tmp_path_factory):
    """world size -> [rank -> {name: {mode: result}}], spawning each world size once."""
    return cached_rank_results(tmp_path_factory, _worker, "ep")


def assert_close(got, ref, tol, what):
    """rel_err within tol; a reference of zeros (idle experts, no tokens) must be matched by exact zeros."""
    assert got is not None, f"{what}: no gradient"
    if ref.norm() == 0:
        assert got.shape == ref.shape and not got.any(), what
    else:
        assert rel_err(got, ref) <= tol, (what, rel_err(got, ref))


@pytest.mark.distributed
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("world_size,name", [(w, n) for w, cases in CASES.items() for n in cases])
def test_matches_one_rank(ep_results, world_size, name, mode):
    tokens_W, E, k, C, I, allowed, dtype = case = CASES[world_size][name]
    seed = list(CASES[world_size]).index(name)
    inputs, topk_idx_Nk, dy_NC = problem(*case, seed)
    ref = run(local_experts, inputs, topk_idx_Nk, dy_NC)
    tol = TOL[dtype]
    num_ranks = len(tokens_W)
    L = E // num_ranks
    for rank, results in enumerate(ep_results(world_size)):
        got, ep_rank = results[name][mode], rank % num_ranks
        assert torch.equal(got["y_no_grad"], got["y"]), rank
        rows = slice(None)
        if mode == "alltoall":
            rows = slice(sum(tokens_W[:ep_rank]), sum(tokens_W[: ep_rank + 1]))
        assert_close(got["y"], ref["y"][rows], tol, (rank, "y"))
        for n in INPUTS:
            assert_close(got[n], ref[n][rows], tol, (rank, n))
        for n in PARAMS:
            assert_close(got[n], ref[n][ep_rank * L:(ep_rank + 1) * L], tol, (rank, n))


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", list(CASES))
def test_errors_before_any_collective(ep_results, world_size):
    for results in ep_results(world_size):
        errors = results["errors"]
        assert f"({world_size + 1}) divisible by the EP group size ({world_size})" in errors["indivisible"]
        assert "this rank's 1 experts" in errors["wrong_local_shape"]


# -- single process -------------------------------------------------------------------------------------------

def test_local_experts_matches_hf():
    """Bit for bit in the forward (HF's row order and accumulation order); gradients up to rounding."""
    from transformers.models.glm_moe_dsa.configuration_glm_moe_dsa import GlmMoeDsaConfig
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaExperts

    E, k, C, I = 8, 3, 16, 12
    config = GlmMoeDsaConfig(n_routed_experts=E, num_experts_per_tok=k, hidden_size=C, moe_intermediate_size=I)
    config._experts_implementation = "eager"
    for dtype, tol in ((F64, 1e-12), (F32, 1e-5), (torch.bfloat16, None)):
        # experts 6 and 7 idle
        inputs, topk_idx_Nk, dy_NC = problem((13,), E, k, C, I, range(6), dtype, seed=0)
        hf = GlmMoeDsaExperts(config).to(dtype)
        with torch.no_grad():
            for n in PARAMS:
                getattr(hf, n).copy_(inputs[n])
        # HF's router hands over fp32 weights
        x_NC = inputs["x_NC"].requires_grad_()
        w_Nk = inputs["topk_w_Nk"].float().requires_grad_()
        leaves = (x_NC, w_Nk, hf.gate_up_proj, hf.down_proj)
        y_hf_NC = hf(x_NC, topk_idx_Nk, w_Nk)
        grads_hf = torch.autograd.grad((y_hf_NC * dy_NC).sum(), leaves)
        y_NC = local_experts(x_NC, topk_idx_Nk, w_Nk, hf.gate_up_proj, hf.down_proj)
        grads = torch.autograd.grad((y_NC * dy_NC).sum(), leaves)
        assert y_NC.dtype == dtype and torch.equal(y_NC, y_hf_NC), dtype
        for got, ref in zip(grads, grads_hf) if tol else ():
            assert_close(got, ref, tol, dtype)


def test_grouped_gemm_path_is_the_loop_and_serves_only_where_it_should(monkeypatch):
    """`grouped_expert_ffn` (torch._grouped_mm) gives the per-expert loop's rows and gradients, idle experts
    included (exactly so on the CPU, where torch runs it a group at a time); `expert_ffn` takes it only on a
    CUDA device (bf16, sm90+), never on the CPU or with kernels.experts=torch."""
    from longstraw_cli.models.glm52.experts import expert_ffn, grouped_expert_ffn, grouped_mm_serves

    inputs, _, _ = problem((13,), 5, 1, 16, 8, None, F32, seed=2)
    x_MC = inputs["x_NC"].requires_grad_()
    gate_up, down = inputs["gate_up_proj"][:5].requires_grad_(), inputs["down_proj"][:5].requires_grad_()
    counts = [4, 0, 6, 3, 0]
    dy_MC = torch.randn(13, 16, generator=torch.Generator().manual_seed(3))
    loop_MC = expert_ffn(x_MC, counts, gate_up, down)
    assert not grouped_mm_serves(x_MC, gate_up, down)
    try:
        grouped_MC = grouped_expert_ffn(x_MC, torch.tensor(counts), gate_up, down)
    except (AttributeError, NotImplementedError, RuntimeError) as e:
        pytest.skip(f"this torch has no CPU torch._grouped_mm for fp32: {e}")
    assert torch.equal(grouped_MC, loop_MC)
    leaves = (x_MC, gate_up, down)
    for got, ref in zip(torch.autograd.grad((grouped_MC * dy_MC).sum(), leaves),
                        torch.autograd.grad((loop_MC * dy_MC).sum(), leaves)):
        assert torch.equal(got, ref)
    # a tensor of counts is taken as the list is
    assert torch.equal(expert_ffn(x_MC, torch.tensor(counts), gate_up, down), loop_MC)
    use_kernels(experts="torch")
    assert not grouped_mm_serves(x_MC.bfloat16(), gate_up.bfloat16(), down.bfloat16())


def test_a_gpu_without_grouped_gemms_says_so_once(caplog):
    """Where a GPU cannot take the grouped GEMMs (before sm90, or a torch without torch._grouped_mm) the loop runs,
    and the run is told why, once per reason."""
    import logging

    from longstraw_cli.models.glm52 import experts

    assert experts.grouped_mm_blocker((9, 0), True) is None and experts.grouped_mm_blocker((10, 0), True) is None
    assert experts.grouped_mm_blocker((8, 0), True) == "compute capability 8.0 < 9.0"
    assert "has no torch._grouped_mm" in experts.grouped_mm_blocker((9, 0), False)
    experts._loop_on_this_gpu.cache_clear()
    with caplog.at_level(logging.WARNING, logger=experts.__name__):
        for _ in range(3):
            experts._loop_on_this_gpu("compute capability 8.0 < 9.0")
    said = [r.getMessage() for r in caplog.records if "one matmul pair per expert" in r.getMessage()]
    assert len(said) == 1 and "(compute capability 8.0 < 9.0)" in said[0]


def test_partials_over_expert_ranges_add_up():
    inputs, topk_idx_Nk, _ = problem((10,), 8, 3, 16, 12, None, F64, seed=1)
    full_NC = local_experts(inputs["x_NC"], topk_idx_Nk, inputs["topk_w_Nk"], inputs["gate_up_proj"],
                            inputs["down_proj"])
    sum_NC = sum(local_experts(inputs["x_NC"], topk_idx_Nk, inputs["topk_w_Nk"], inputs["gate_up_proj"][e:e + 2],
                               inputs["down_proj"][e:e + 2], first_expert=e) for e in range(0, 8, 2))
    assert rel_err(sum_NC, full_NC) <= 1e-14


def test_shard_bounds_and_errors():
    assert [expert_bounds(256, 8, r) for r in (0, 7)] == [(0, 32), (224, 256)]
    with pytest.raises(ValueError, match=r"\(256\) divisible by the EP group size \(3\)"):
        expert_bounds(256, 3, 0)
    with pytest.raises(ValueError, match="rank 4 outside"):
        expert_bounds(8, 4, 4)
    full = torch.randn(4, 3, 2)
    # one rank without a process group holds every expert, as a copy
    shard = ep_shard(full)
    assert torch.equal(shard, full) and shard.data_ptr() != full.data_ptr()
    inputs, topk_idx_Nk, _ = problem((3,), 4, 2, 16, 12, None, F64, seed=2)
    topk_idx_Nk[1, 0] = 4
    with pytest.raises(ValueError, match=r"expert ids must lie in \[0, 4\), got \[0, 4\]"):
        ep_experts_alltoall(inputs["x_NC"], topk_idx_Nk, inputs["topk_w_Nk"], inputs["gate_up_proj"],
                            inputs["down_proj"], num_experts=4)
