"""Host-resident pages under context parallel (`capture.offload=cpu` with cp = 2 and 4; gloo, CPU ranks, fp64), both
families: every rank's offloaded shard, its scores, its response_only log-probs and every parameter gradient of a
replay, a sampled rollout and the reuse drift probe (which re-captures the tail against every rank's pages) equal
those of the same CP run with the pages on the device, bit for bit. glm52 also under expert parallel inside the CP
group (capture's MoE all-to-all between the layer-by-layer page writes). On CPU the "device" and the host are the
same memory, so equality means that staging, the layer writers and the write-backs put every value where the
on-device CP path has it (tests/distributed/test_cp_model.py and test_cp_glm52.py tie that path to one rank).
Exact mode with offloaded pages is refused, at every cp (one line naming the valid choices)."""

import contextlib
import os

import pytest
import torch
import torch.distributed as dist

from conftest import ids, join_gloo, random_model, rank_results, replay_grads
from longstraw_cli.distributed.cp import apply_context_parallel, shard_bounds
from longstraw_cli.distributed.ep import apply_expert_parallel
from longstraw_cli.reuse import PromptReuse, ReuseConfig
from longstraw_cli.rollout.native import SamplingConfig, generate
from longstraw_cli.transaction import TransactionConfig, score

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

# 74 captured tokens: shards of 37 at cp=2, 19, 19, 18, 18 at cp=4; blocks of 16 (capture's MLP blocks, attention
# query blocks) cut across the shards; glm52_tiny's index_topk 16 makes every later query select across shards
PROMPT, RESPONSE, BLOCK, TAIL = 75, 9, 16, 5
# world -> cases (name, model, ep group size); the CP group is the whole world
CASES = {
    2: [("qwen36", "qwen36_tiny", 1), ("glm52", "glm52_tiny", 1), ("glm52_ep2", "glm52_tiny", 2)],
    4: [("qwen36", "qwen36_tiny", 1), ("glm52", "glm52_tiny", 1), ("glm52_ep2", "glm52_tiny", 2)],
}


@contextlib.contextmanager
def nudged(model, scale=0.02):
    """Newer weights for a while: every parameter but the routed experts' (a rank under expert parallel holds a
    slice of those) moved by the same seeded noise on every rank."""
    g = torch.Generator().manual_seed(3)
    saved = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "experts." not in name:
                p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * scale)
    try:
        yield
    finally:
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(saved[name])


def run(model, offload):
    """What one placement gives on this rank: the resident tensors, scores, two response_only replays' log-probs and
    parameter gradients, a sampled rollout, the drift probe's figures and whether it put the state back."""
    g = torch.Generator().manual_seed(11)
    prompt = torch.randint(0, 259, (PROMPT,), generator=g)
    responses = torch.randint(0, 259, (2, RESPONSE), generator=g)
    resident = model.capture(prompt, block_size=BLOCK, offload=offload)
    assert resident.offload == offload
    captured = [t.clone() for t in resident.tensors()]
    scores = model.logprobs(resident, responses)
    logps, grads = replay_grads(model, resident, responses)
    rollout = generate(model, resident, 3, SamplingConfig(max_new_tokens=6), torch.Generator().manual_seed(5))
    # replays and decode read the pages, never write them
    untouched = all(torch.equal(a, b) for a, b in zip(resident.tensors(), captured))
    del resident
    # the drift probe: a capture for reuse, newer weights, the tail re-captured under them and put back
    resident = model.capture(prompt, block_size=BLOCK, offload=offload, tail=TAIL)
    before = [t.clone() for t in resident.tensors()]
    reuse = PromptReuse(ReuseConfig(reuse_steps=2, probe_responses=2, probe_tokens=TAIL))
    reuse.hold(0, resident)
    reuse.advance(captured=True)
    cfg = TransactionConfig(block_size=BLOCK)
    with nudged(model):
        drift = reuse.measure(model, lambda r, rs: score(model, r, rs, cfg), prompt, list(responses))
    return {"tensors": captured, "bytes": resident.nbytes(), "scores": scores, "logps": logps, "grads": grads,
            "responses": rollout.responses, "rollout_logp": rollout.logprobs, "untouched": untouched,
            "drift": (drift.max, drift.mean), "restored": all(torch.equal(a, b)
                                                               for a, b in zip(resident.tensors(), before))}


def _worker(rank, world, port, out_dir):
    pairs = join_gloo(rank, world, port)
    results = {}
    for name, model_name, ep in CASES[world]:
        model = random_model(model_name, torch.float64, seed=3)
        apply_context_parallel(model, dist.group.WORLD)
        if ep > 1:
            apply_expert_parallel(model, pairs[2] if world > 2 else dist.group.WORLD, cp_group=dist.group.WORLD)
        results[name] = {offload: run(model, offload) for offload in (None, "cpu")}
        try:
            model.capture(ids(PROMPT, 1), block_size=BLOCK, offload="cpu", boundaries=True)
            results[name]["exact_refused"] = False
        except ValueError as e:
            results[name]["exact_refused"] = "exact gradients" in str(e)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("world", [2, 4])
def test_offloaded_context_parallel_equals_on_device(tmp_path, world):
    ranks = rank_results(_worker, world, tmp_path, timeout_s=400)
    num_tokens = PROMPT - 1
    for rank, results in enumerate(ranks):
        start, end = shard_bounds(num_tokens, world, rank)
        for name, _, _ in CASES[world]:
            device, host = results[name][None], results[name]["cpu"]
            assert results[name]["exact_refused"], name
            for key in ("tensors", "bytes", "scores", "logps", "grads", "responses", "rollout_logp", "drift"):
                assert _equal(device[key], host[key]), (name, rank, key)
            assert device["grads"] and host["untouched"] and host["restored"] and device["restored"]
            # the probe re-captured the tail under newer weights: a drift to compare, not a zero
            assert host["drift"][0] > 1e-4
            # every rank holds its shard only: the pages of end - start tokens
            paged = {"qwen36": "kv_pages", "glm52": "latent_pages"}[name.split("_")[0]]
            one_token = host["bytes"][paged] // (end - start)
            assert host["bytes"][paged] == one_token * (end - start) > 0
        print(f"cp={world} rank {rank}: offloaded equals on-device for {[c[0] for c in CASES[world]]}")
