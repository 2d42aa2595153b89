"""glm52 under context parallel and expert parallel (gloo, 2 and 4 CPU ranks) against one rank: each rank's
pages, the DSA selection of every layer (integer-equal, capture and replay), scores, every parameter gradient
(expert gradients slice-wise under EP), native rollout, per-rank resident bytes."""

import collections
import functools
import os

import pytest
import torch
import torch.distributed as dist

from conftest import join_gloo, random_model, rel_err, run_ranks
from longstraw_cli.distributed import ep as ep_module
from longstraw_cli.distributed.cp import apply_context_parallel, shard_bounds
from longstraw_cli.distributed.ep import apply_expert_parallel, expert_bounds, gather_expert_params, load_expert_params
from longstraw_cli.distributed.topology import ParallelDims
from longstraw_cli.rollout.native import SamplingConfig, generate
from longstraw_kernels.dsa import topk_lowest_position

# index_topk is 16: with 74 captured tokens every query past 16 selects, and selections cross shard boundaries
PROMPT, RESPONSE, BLOCK = 75, 13, 16
EXPERTS = ("experts.gate_up_proj", "experts.down_proj")
# world -> cases (name, ep group size, dtype, prompt length); the CP group is the whole world. "short": fewer
# captured tokens than ranks, so ranks 2 and 3 own no page (and send no token to the experts in capture)
CASES = {
    2: [("cp2", 1, torch.float64, PROMPT), ("cp2_fp32", 1, torch.float32, PROMPT),
        ("cp2_ep2", 2, torch.float64, PROMPT)],
    4: [("cp4", 1, torch.float64, PROMPT), ("cp4_ep2", 2, torch.float64, PROMPT),
        ("cp4_ep2_short", 2, torch.float64, 3)],
    # the paper's layout, CP8 x EP8: the experts split over the whole context-parallel group, one each
    8: [("cp8_ep8", 8, torch.float64, PROMPT)],
}
TOL = {torch.float64: 1e-10, torch.float32: 1e-5}


def problem(prompt_len=PROMPT):
    g = torch.Generator().manual_seed(11)
    prompt = torch.randint(0, 259, (prompt_len,), generator=g)
    responses = torch.randint(0, 259, (2, RESPONSE), generator=g)
    weights = torch.randn(RESPONSE, generator=g, dtype=torch.float64)
    return prompt, responses, weights


def record(model):
    """Logs every layer's DSA selection: capture (capture_span) and replay / scoring (replay). Decode is compared
    by its sampled tokens: one rank decodes by the static-shaped step, context parallel by `decode_step`."""
    log = {"capture": [], "replay": [], "prepared": [], "rows": []}
    # what the capture compiles ahead for (`prepare_capture`) and the keys its selection's rows see
    model.prepare_capture = lambda longest, fn=model.prepare_capture: (log["prepared"].append(longest), fn(longest))[1]
    for layer in model.model.layers:
        attn = layer.self_attn
        attn.topk_fn = lambda scores, k, fn=attn.topk_fn: (log["rows"].append(scores.shape[-1]), fn(scores, k))[1]

        def logged(fn, key):
            def call(*args, **kwargs):
                out = fn(*args, **kwargs)
                log[key].append(out[1].clone())
                return out
            return call

        attn.replay, attn.capture_span = logged(attn.replay, "replay"), logged(attn.capture_span, "capture")
    return log


def run(model, capture, prompt_len=PROMPT):
    """What each rank reports: resident, selections, scores, response_only gradients, a sampled rollout."""
    prompt, responses, weights = problem(prompt_len)
    log = record(model)
    resident = capture(prompt)
    capture_rows = list(log["rows"])
    scores = model.logprobs(resident, responses)
    model.zero_grad(set_to_none=True)
    (weights * model.logprobs(resident, responses[0], grad=True)).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    rollout = generate(model, resident, 3, SamplingConfig(max_new_tokens=6), torch.Generator().manual_seed(5))
    return {"tensors": [t.clone() for t in resident.tensors()], "bytes": resident.nbytes(), "scores": scores,
            "grads": grads, "responses": rollout.responses, "rollout_logp": rollout.logprobs,
            "capture_rows": capture_rows, **log}


def reference(dtype, prompt_len):
    model = random_model("glm52_tiny", dtype, seed=3)
    return run(model, lambda p: model.capture_span(p[:-1], start=0, num_tokens=p.numel() - 1,
                                                   last_token=int(p[-1]), block_size=BLOCK), prompt_len)


def _worker(rank, world, port, out_dir):
    pairs = join_gloo(rank, world, port)
    alone = dist.new_subgroups(group_size=1)[0]
    # which EP dispatch each MoE call took, per case
    modes = collections.Counter()
    for mode in ("alltoall", "replicated"):
        fn = getattr(ep_module, f"ep_experts_{mode}")
        setattr(ep_module, f"ep_experts_{mode}",
                lambda *a, fn=fn, mode=mode, **k: (modes.update([mode]), fn(*a, **k))[1])
    results = {}
    for name, ep, dtype, prompt_len in CASES[world]:
        ep_group = pairs[2] if ep == 2 and world > 2 else dist.group.WORLD
        model = random_model("glm52_tiny", dtype, seed=3)
        full = {n: p.detach().clone() for n, p in model.named_parameters() if n.endswith(EXPERTS)}
        apply_context_parallel(model, dist.group.WORLD)
        if ep > 1:
            apply_expert_parallel(model, ep_group, cp_group=dist.group.WORLD)
        modes.clear()
        results[name] = run(model, functools.partial(model.capture, block_size=BLOCK), prompt_len)
        results[name]["modes"] = dict(modes)
        if ep > 1:
            gathered = gather_expert_params(model, ep_group)
            results[name]["gather_ok"] = gathered.keys() == full.keys() and all(
                torch.equal(gathered[n], full[n]) for n in full)
            load_expert_params(model, {n: 2 * t for n, t in full.items()}, ep_group)
            results[name]["load_ok"] = all(torch.equal(gather_expert_params(model, ep_group)[n], 2 * full[n])
                                           for n in full)
    # the EP group outside the CP group (each rank its own CP group) is refused
    try:
        apply_expert_parallel(random_model("glm52_tiny"), dist.group.WORLD, cp_group=alone)
        results["refused"] = False
    except ValueError as e:
        results["refused"] = "within the CP group" in str(e)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4, 8])
def test_glm52_context_and_expert_parallel_equal_one_rank(tmp_path, world):
    run_ranks(_worker, world, str(tmp_path), timeout_s=300)
    refs = {c[2:]: reference(*c[2:]) for c in CASES[world]}
    for rank in range(world):
        results = torch.load(tmp_path / f"rank{rank}.pt")
        assert results["refused"]
        for name, ep, dtype, prompt_len in CASES[world]:
            got, ref, tol = results[name], refs[dtype, prompt_len], TOL[dtype]
            num_tokens = prompt_len - 1
            bounds = [shard_bounds(num_tokens, world, r) for r in range(world)]
            start, end = bounds[rank]
            # pages: this rank's shard of the one-rank pages, up to the rounding of projections over fewer rows
            assert len(got["tensors"]) == len(ref["tensors"])
            for mine, full in zip(got["tensors"], ref["tensors"]):
                assert mine.shape == full[start:end].shape
                assert mine.numel() == 0 or rel_err(mine, full[start:end]) <= tol
            assert got["bytes"]["total"] * num_tokens == ref["bytes"]["total"] * (end - start)
            # DSA selections, every layer: capture rows of this shard, then every replay / decode call
            assert len(got["capture"]) == len(ref["capture"])
            for mine, full in zip(got["capture"], ref["capture"]):
                assert torch.equal(mine, full[:, start:end])
            # the capture compiled ahead for its longest rows, this span's end (one rank: the captured tokens)
            assert ref["prepared"] == [num_tokens] and max(ref["capture_rows"]) == num_tokens
            # (a rank that owns no page, the "short" case, selects nothing in the capture)
            assert got["prepared"] == [end]
            assert max(got["capture_rows"]) == end if end > start else got["capture_rows"] == []
            assert len(got["replay"]) == len(ref["replay"])
            assert all(torch.equal(a, b) for a, b in zip(got["replay"], ref["replay"]))
            assert rel_err(got["scores"], ref["scores"]) <= tol
            # gradients: all of one rank's (the indexer gets none); expert tensors slice-wise under EP
            assert got["grads"].keys() == ref["grads"].keys()
            errs, mine_all, ref_all = {}, [], []
            for n, g in ref["grads"].items():
                if ep > 1 and n.endswith(EXPERTS):
                    e0, e1 = expert_bounds(g.shape[0], ep, rank % ep)
                    g = g[e0:e1]
                mine_all.append(got["grads"][n].flatten())
                ref_all.append(g.flatten())
                # an expert slice that received no token has zero gradient on one rank too
                errs[n] = rel_err(got["grads"][n], g) if g.norm() > 0 else float(got["grads"][n].norm())
            overall = rel_err(torch.cat(mine_all), torch.cat(ref_all))
            worst = max(errs.values())
            print(f"{name} rank {rank}: scores rel err {rel_err(got['scores'], ref['scores']):.2e}, gradients "
                  f"rel err {overall:.2e} overall, {worst:.2e} worst tensor ({max(errs, key=errs.get)})")
            assert overall <= tol
            # fp32: one rank's own fp32 gradient is ~1e-5 from the truth for small tensors; bar per tensor 1e-4
            assert worst <= (tol if dtype == torch.float64 else 1e-4)
            assert all(torch.equal(a, b) for a, b in zip(got["responses"], ref["responses"]))
            assert all(rel_err(a, b) <= tol for a, b in zip(got["rollout_logp"], ref["rollout_logp"]))
            if ep > 1:
                assert got["gather_ok"] and got["load_ok"]
                # capture dispatched sharded tokens by all-to-all, replay / scoring / decode replicated
                num_moe = sum(".mlp.gate." in n for n in ref["grads"])
                assert got["modes"]["alltoall"] == num_moe * -(-max(e - s for s, e in bounds) // BLOCK)
                assert got["modes"]["replicated"] > 0
    # the check discriminates: selections cross shard boundaries, so per-shard top-k would differ (k=16 is less
    # than every shard here); capture rows of higher shards select lower shards' keys
    bounds = [shard_bounds(PROMPT - 1, world, r) for r in range(world)]
    shard_of = torch.tensor([r for r in range(world) for _ in range(bounds[r][1] - bounds[r][0])] + [world] * 64)
    for idx in refs[torch.float64, PROMPT]["replay"][:4]:
        sel = shard_of[idx.clamp(min=0)].masked_fill(idx < 0, -1)
        spans = torch.stack([(sel == r).any(-1) for r in range(world)]).sum(0)
        assert (spans >= 2).any()


def test_ep_must_divide_cp():
    dims = ParallelDims(8, cp=4, ep=2)
    assert dims.ep_group_ranks(1, 1) == [6, 7] and set(dims.ep_group_ranks(1, 0)) <= set(dims.cp_group_ranks(1))
    for cp, ep in ((1, 2), (2, 4), (4, 8)):
        with pytest.raises(ValueError, match="must divide cp"):
            ParallelDims(8, cp=cp, ep=ep)


def test_topk_on_batched_rows_is_the_stable_sort():
    """The one top-k (model and CP merge) on the model's [B, T, S] layout: the set a stable descending sort takes
    first, ascending, ties at 0 and masked keys included."""
    g = torch.Generator().manual_seed(0)
    scores = torch.relu(torch.randn(3, 40, 50, generator=g, dtype=torch.float64)).round(decimals=1)
    scores[:, :, 35:] = float("-inf")
    for k in (1, 7, 16, 36, 50):
        expected = scores.sort(dim=-1, descending=True, stable=True).indices[..., :k].sort(dim=-1).values
        assert torch.equal(topk_lowest_position(scores, k), expected)
