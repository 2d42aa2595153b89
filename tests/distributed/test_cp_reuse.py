"""capture.reuse_steps' drift probe under context parallel (gloo, 2 and 4 CPU ranks), glm52 also with expert parallel
inside it: captured with a tail, the weights then nudged, every rank's drift (max and mean |delta log-prob| of the
probed responses) equals one rank's (fp64, <= 1e-10), and every rank's shard of the stale state is put back bit for
bit. The tail lies inside the last shard, or spans two shards (cp=2) or three (cp=4: 40 positions over shards of
19, 19, 18, 18); the probe re-captures the tail on every rank against all ranks' pages (reuse.py
`_recompute_tail`). A control that keeps the stale tail (no re-capture) gives a drift far from one rank's."""

import os

import pytest
import torch
import torch.distributed as dist

import longstraw_cli.reuse as reuse_module
from conftest import ids, join_gloo, random_model, rank_results
from longstraw_cli.distributed.cp import apply_context_parallel
from longstraw_cli.distributed.ep import apply_expert_parallel
from longstraw_cli.reuse import PromptReuse, ReuseConfig
from longstraw_cli.transaction import TransactionConfig, score

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

# 74 captured tokens: shards of 37 at cp=2; 19, 19, 18, 18 at cp=4
PROMPT, RESPONSE, GROUP = 75, 6, 3
# world -> cases: (name, model, ep, block size, probe tokens)
# (one block of 80 with a tail of 40: the tail starts at 34, in rank 0's shard at cp=2, rank 1's at cp=4)
CASES = {
    2: [("qwen36", "qwen36_tiny", 1, 16, 5), ("qwen36_span", "qwen36_tiny", 1, 80, 40),
        ("glm52", "glm52_tiny", 1, 16, 5), ("glm52_ep2", "glm52_tiny", 2, 23, 8)],
    4: [("qwen36", "qwen36_tiny", 1, 80, 40), ("glm52_ep2", "glm52_tiny", 2, 80, 40)],
}
TOL = 1e-10


def _nudge_(model, scale=0.02):
    """Newer weights: every parameter but the routed experts' (under expert parallel a rank holds a slice of
    those, so the same noise would not be drawn), the same on every rank and on one rank."""
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "experts." not in name:
                p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * scale)


def drift_of(model, block, tail):
    """-> (drift max, drift mean, tail_start, whether the stale state came back bit for bit)."""
    cfg = TransactionConfig(block_size=block)
    prompt, responses = ids(PROMPT, 0), [ids(RESPONSE, 10 + i) for i in range(GROUP)]
    resident = model.capture(prompt, block_size=block, tail=tail)
    before = [t.clone() for t in resident.tensors()]
    _nudge_(model)
    reuse = PromptReuse(ReuseConfig(reuse_steps=2, probe_responses=GROUP, probe_tokens=tail))
    reuse.hold(0, resident)
    reuse.advance(captured=True)
    drift = reuse.measure(model, lambda r, rs: score(model, r, rs, cfg), prompt, responses)
    restored = all(torch.equal(a, b) for a, b in zip(resident.tensors(), before))
    return drift.max, drift.mean, resident.tail_start, restored


def _worker(rank, world, port, out_dir):
    ep_group = join_gloo(rank, world, port).get(2, dist.group.WORLD)
    results = {}
    for name, model_name, ep, block, tail in CASES[world]:
        model = random_model(model_name, seed=3)
        apply_context_parallel(model, dist.group.WORLD)
        if ep > 1:
            apply_expert_parallel(model, ep_group, cp_group=dist.group.WORLD)
        results[name] = drift_of(model, block, tail)
    if world == 2:
        # control: a probe whose re-capture does nothing measures 0, not one rank's drift
        model = random_model("qwen36_tiny", seed=3)
        apply_context_parallel(model, dist.group.WORLD)
        reuse_module._recompute_tail = lambda *args: None
        results["control"] = drift_of(model, 16, 5)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_drift_under_context_parallel_equals_one_rank(tmp_path, world):
    results = rank_results(_worker, world, tmp_path, timeout_s=300)
    torch.set_num_threads(1)
    for name, model_name, _, block, tail in CASES[world]:
        ref_max, ref_mean, ref_start, ref_restored = drift_of(random_model(model_name, seed=3), block, tail)
        assert ref_restored and ref_max > 1e-4
        for rank in range(world):
            got_max, got_mean, start, restored = results[rank][name]
            print(f"cp={world} {name} rank {rank}: drift {got_max:.6g} / {got_mean:.6g} against one rank's "
                  f"{ref_max:.6g} / {ref_mean:.6g}, tail from {start}")
            assert start == ref_start and restored
            assert abs(got_max - ref_max) <= TOL * ref_max and abs(got_mean - ref_mean) <= TOL * ref_mean
    if world == 2:
        ref_max = drift_of(random_model("qwen36_tiny", seed=3), 16, 5)[0]
        assert all(results[rank]["control"][0] < 0.5 * ref_max for rank in range(world))
