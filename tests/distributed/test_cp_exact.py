"""capture.gradient=exact under context parallel (gloo, 2 and 4 CPU ranks), glm52 also with expert parallel inside
it: G replays plus the reverse walk (distributed/cp_walk.py) give every parameter, on every rank, the gradient
one rank's exact mode gives (fp64, <= 1e-10 relative; one rank's equals full-sequence autograd,
tests/models/test_exact_gradient.py), full fine-tuning and LoRA on k/v. Blocks straddle shard boundaries and do
not divide the shards; at cp=4 a block of 40 spans three shards and one rank holds no block start. The GDN
boundary states are split over the ranks, not replicated. A control that drops the part of a block's page
gradient another rank owns is caught."""

import os

import pytest
import torch
import torch.distributed as dist

from conftest import exact_grads, ids, join_gloo, random_lora_, random_model, rank_results, worst_rank_err
from longstraw_cli.distributed.cp import apply_context_parallel
from longstraw_cli.distributed.cp_walk import ShardedPrompt
from longstraw_cli.distributed.ep import apply_expert_parallel

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

# 74 captured tokens: shards of 37 at cp=2; 19, 19, 18, 18 at cp=4
PROMPT, RESPONSE, GROUP = 75, 9, 2
# world -> cases: (name, model, LoRA targets, ep, block size)
CASES = {
    2: [("qwen36", "qwen36_tiny", None, 1, 16), ("qwen36_lora_kv", "qwen36_tiny", ("k_proj", "v_proj"), 1, 23),
        ("glm52", "glm52_tiny", None, 1, 16), ("glm52_ep2", "glm52_tiny", None, 2, 23)],
    4: [("qwen36", "qwen36_tiny", None, 1, 40), ("glm52_ep2", "glm52_tiny", None, 2, 23)],
}
CONTROL = ("qwen36_tiny", None, 16)
TOL = 1e-10


def problem():
    responses = [ids(RESPONSE, 10 + i) for i in range(GROUP)]
    weights = [torch.randn(RESPONSE, generator=torch.Generator().manual_seed(20 + i), dtype=torch.float64)
               for i in range(GROUP)]
    return ids(PROMPT, 0), responses, weights


def make_model(name, lora):
    model = random_model(name, seed=3)
    if lora is not None:
        random_lora_(model, lora)
    return model


class OwnPartsOnly(ShardedPrompt):
    """Control: a block's page gradient from this rank's own buffer only (zero where another rank owns it)."""

    def block_grads(self, grad, start, end):
        mine_T = (torch.arange(start, end) >= self.first) & (torch.arange(start, end) < self.end)
        return [None if g is None else {n: t * mine_T.view(-1, *[1] * (t.dim() - 1)) for n, t in g.items()}
                for g in super().block_grads(grad, start, end)]


def _worker(rank, world, port, out_dir):
    ep_group = join_gloo(rank, world, port).get(2, dist.group.WORLD)
    results = {}
    for name, model_name, lora, ep, block in CASES[world]:
        model = make_model(model_name, lora)
        apply_context_parallel(model, dist.group.WORLD)
        if ep > 1:
            apply_expert_parallel(model, ep_group, cp_group=dist.group.WORLD)
        results[name] = {"grads": exact_grads(model, *problem(), block),
                         "bytes": model.capture(problem()[0], block_size=block, boundaries=True).nbytes()}
    if world == 2:
        model = make_model(*CONTROL[:2])
        apply_context_parallel(model, dist.group.WORLD)
        model.prompt_placement_fn = lambda resident: OwnPartsOnly(resident, group=dist.group.WORLD)
        results["control"] = {"grads": exact_grads(model, *problem(), CONTROL[2])}
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def one_rank(model_name, lora, block):
    model = make_model(model_name, lora)
    return exact_grads(model, *problem(), block), model.capture(problem()[0], block_size=block,
                                                                 boundaries=True).nbytes()


@pytest.mark.parametrize("world", [2, 4])
def test_exact_gradient_under_context_parallel_equals_one_rank(tmp_path, world):
    results = rank_results(_worker, world, tmp_path, timeout_s=300)
    torch.set_num_threads(1)
    for name, model_name, lora, ep, block in CASES[world]:
        ref, ref_bytes = one_rank(model_name, lora, block)
        if lora is not None:
            assert ref and all("lora_" in n for n in ref)
        for rank in range(world):
            err, where = worst_rank_err(results[rank][name]["grads"], ref, rank, ep)
            print(f"cp={world} {name} block {block} rank {rank}: exact gradient max rel err {err:.2e} ({where})")
            assert err <= TOL
        # the boundary states (qwen36's GDN) are split over the ranks: each keeps those of its own blocks
        split = [results[rank][name]["bytes"].get("boundary_states", 0) for rank in range(world)]
        assert sum(split) == ref_bytes.get("boundary_states", 0)
    if world == 2:
        ref, _ = one_rank(*CONTROL)
        assert all(worst_rank_err(results[rank]["control"]["grads"], ref, rank, 1)[0] > 1e-3 for rank in range(world))
