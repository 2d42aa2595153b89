"""Routing replay under context parallel (cp=2, cp=4) and expert parallel (ep=2) on gloo CPU ranks, against one
rank (glm52_tiny, fp64): the record the eager CP decode writes equals the static one-rank decode's (integer-equal),
and with the routers and the indexer changed after the rollout (so that live routing would differ), the forced
scores, the forced replay's gradients (router included; experts slice-wise under EP) and the flip fractions equal
one rank's."""

import functools
import os

import pytest
import torch
import torch.distributed as dist

from conftest import join_gloo, random_model, rel_err, run_ranks
from longstraw_cli.distributed.cp import apply_context_parallel
from longstraw_cli.distributed.ep import apply_expert_parallel, expert_bounds
from longstraw_cli.models.glm52.model import MoE
from longstraw_cli.models.glm52.routing import RoutingReplay
from longstraw_cli.rollout.native import SamplingConfig, generate

PROMPT, RESPONSE, BLOCK, G = 60, 9, 16, 2
EXPERTS = ("experts.gate_up_proj", "experts.down_proj")
# world -> cases (name, ep group size); the CP group is the whole world
CASES = {2: [("cp2", 1), ("cp2_ep2", 2)], 4: [("cp4_ep2", 2)]}
TOL = 1e-10


def run(model, capture):
    g = torch.Generator().manual_seed(11)
    prompt = torch.randint(0, 259, (PROMPT,), generator=g)
    weights = torch.randn(RESPONSE, generator=g, dtype=torch.float64)
    resident = capture(prompt)
    routing = RoutingReplay(force=True)
    ro = generate(model, resident, G, SamplingConfig(max_new_tokens=RESPONSE), torch.Generator().manual_seed(5),
                  routing=routing)
    # other routers and indexer queries than the rollout's: live routing would now differ from the record
    with torch.no_grad():
        for layer in model.model.layers:
            if isinstance(layer.mlp, MoE):
                layer.mlp.gate.weight.normal_(0, 0.3, generator=torch.Generator().manual_seed(4))
            if layer.self_attn.indexer is not None:
                layer.self_attn.indexer.wq_b.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(9))
    padded = torch.nn.utils.rnn.pad_sequence(ro.responses, batch_first=True)
    with routing.scoring(ro.routing, model, slice(0, G)):
        scores = model.logprobs(resident, padded)
    model.zero_grad(set_to_none=True)
    response = ro.responses[0]
    with routing.replaying(ro.routing, model, slice(0, 1)):
        (weights[: len(response)] * model.logprobs(resident, response, grad=True)).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return {"responses": ro.responses, "experts": ro.routing.experts, "selections": ro.routing.selections,
            "scores": scores, "grads": grads, "flips": routing.metrics()}


def reference():
    model = random_model("glm52_tiny", torch.float64, seed=3)
    return run(model, functools.partial(model.capture, block_size=BLOCK))


def _worker(rank, world, port, out_dir):
    pairs = join_gloo(rank, world, port)
    results = {}
    for name, ep in CASES[world]:
        model = random_model("glm52_tiny", torch.float64, seed=3)
        apply_context_parallel(model, dist.group.WORLD)
        if ep > 1:
            apply_expert_parallel(model, pairs[2] if world > 2 else dist.group.WORLD, cp_group=dist.group.WORLD)
        results[name] = run(model, functools.partial(model.capture, block_size=BLOCK))
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4])
def test_routing_replay_under_context_and_expert_parallel_equals_one_rank(tmp_path, world):
    run_ranks(_worker, world, str(tmp_path), timeout_s=300)
    ref = reference()
    assert ref["flips"]["rollout/expert_flip_frac"] > 0 and ref["flips"]["rollout/dsa_flip_frac"] > 0
    for rank in range(world):
        results = torch.load(tmp_path / f"rank{rank}.pt")
        for name, ep in CASES[world]:
            got = results[name]
            assert all(torch.equal(a, b) for a, b in zip(got["responses"], ref["responses"]))
            for kind in ("experts", "selections"):
                assert got[kind].keys() == ref[kind].keys()
                # slots past a response's stop are written too (every response decodes every step)
                assert all(torch.equal(got[kind][i], ref[kind][i]) for i in ref[kind]), (name, kind)
            assert rel_err(got["scores"], ref["scores"]) <= TOL
            assert got["flips"] == ref["flips"]
            assert got["grads"].keys() == ref["grads"].keys()
            for n, g in ref["grads"].items():
                if ep > 1 and n.endswith(EXPERTS):
                    e0, e1 = expert_bounds(g.shape[0], ep, rank % ep)
                    g = g[e0:e1]
                mine = got["grads"][n]
                assert (rel_err(mine, g) if g.norm() > 0 else float(mine.norm())) <= TOL, (name, n)
