"""Routing replay on CUDA (skipped without it), glm52_mini at 4 layers, bf16: the decode step replayed as a CUDA
graph records the same experts and DSA selections as the same decode run eagerly, the forced replay's log-probs
stay within bf16 noise of the rollout's, recording costs the decode step at most 5%, and a released record's pinned
buffers take the next offload."""

import time

import pytest
import torch

from conftest import rel_err
from longstraw_cli.models import build_model
from longstraw_cli.models.glm52.routing import RoutingRecord, RoutingReplay, host_buffers, to_host
from longstraw_cli.rollout.native import NativeConfig, SamplingConfig, generate

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPT, RESPONSE, G = 20_000, 64, 8


@pytest.fixture(scope="module")
def setup():
    # a fresh dynamo: the GPU suite's earlier tests compile glm52's decode layer function (one code object) for
    # their own models; past dynamo's recompile limit (8 graphs a function, hit twice here on an H200) the
    # recording's graphs ran eagerly inside the CUDA graph while the plain ones, compiled earlier, matched, and the
    # cost test timed that: 0.29-0.30 ms a step added after test_gpu_decode.py, 0.064-0.076 without (2026-12-04)
    torch._dynamo.reset()
    model = build_model("glm52_mini", dtype=torch.bfloat16, device="cuda", seed=0, num_hidden_layers=4)
    prompt = torch.randint(0, 150_000, (PROMPT,), generator=torch.Generator().manual_seed(0)).cuda()
    return model, model.capture(prompt, block_size=8192)


def sample(model, resident, routing, cuda_graph=True, compile=False, tokens=RESPONSE):
    # greedy: the graphed and the eager decode must meet the same tokens (test_gpu_decode.py checks they do)
    return generate(model, resident, G, SamplingConfig(temperature=0, max_new_tokens=tokens),
                    torch.Generator("cuda").manual_seed(1),
                    native=NativeConfig(cuda_graph=cuda_graph, compile=compile), routing=routing)


def test_graph_records_what_eager_records_and_forced_replay_is_on_policy(setup):
    model, resident = setup
    routing = RoutingReplay(force=True)
    graphed, eager = sample(model, resident, routing), sample(model, resident, routing, cuda_graph=False)
    assert all(torch.equal(a, b) for a, b in zip(graphed.responses, eager.responses))
    steps = graphed.decode_steps
    for kind in ("experts", "selections"):
        for i, t in getattr(graphed.routing, kind).items():
            assert torch.equal(t[:, :steps], getattr(eager.routing, kind)[i][:, :steps]), (kind, i)
    for i, (response, logp) in enumerate(zip(graphed.responses, graphed.logprobs)):
        with routing.replaying(graphed.routing, model, slice(i, i + 1)):
            assert rel_err(model.logprobs(resident, response), logp) < 2e-2
    flips = routing.metrics()
    print(f"flips at {PROMPT} tokens, bf16: {flips}")
    assert set(flips) == {f"rollout/{k}_flip_frac{m}" for k in ("expert", "dsa") for m in ("", "_max")}


def test_compiled_decode_records_the_routing_it_took(setup):
    """The default decode (compiled by torch.compile, then a CUDA graph) with recording: its fused kernels round
    differently from eager, so its tokens are not compared with eager's; what it recorded is what it routed: the
    replay forced to the record gives the rollout's log-probs within bf16 noise, which a wrong record would not."""
    model, resident = setup
    routing = RoutingReplay(force=True)
    sampling, generator = SamplingConfig(max_new_tokens=RESPONSE), torch.Generator("cuda").manual_seed(2)
    rollout = generate(model, resident, G, sampling, generator, native=NativeConfig(), routing=routing)
    steps = rollout.decode_steps
    for t in rollout.routing.selections.values():
        assert (t[:, :steps] > 0).any(-1).all()  # every step's selection written
    for i, (response, logp) in enumerate(zip(rollout.responses, rollout.logprobs)):
        with routing.replaying(rollout.routing, model, slice(i, i + 1)):
            assert rel_err(model.logprobs(resident, response), logp) < 2e-2


def test_recording_costs_the_decode_step_at_most_five_percent(setup):
    """Issue #30's bound: the decode step with recording <= 1.05x without, as the trainer decodes (compiled, then a
    CUDA graph) and over a response long enough that a rollout's fixed costs (the record's allocation, its copy to
    the host) are spread as in the trainer (1,024 tokens by default) rather than over a few steps: each rollout's
    wall time less its setup (the first step, with the CUDA graph's capture: `setup_s`), over the steps it decoded.
    Five rollouts each, after one to warm up (and compile), each record released before the next as the trainer
    does. History: at 64 tokens the bound became 0.075 ms added a step when the decode's Triton top-k made the step
    1.50 -> 1.20 ms (recording added 0.064-0.070 ms); this test then measured 1.053x (0.064 ms added) and failed.
    The cost was pinning new host memory for every record's offload; with the buffers reused (`release`) it
    measured 0.9783 vs 0.9854 ms, 1.007x (H200, 2026-12-04)."""
    model, resident = setup
    tokens = 512

    def per_step(routing, reps=5):
        # each rollout's record let go before the next, as the trainer does (its pinned buffers reused)
        release = (lambda rollout: None) if routing is None else (lambda rollout: routing.release(rollout.routing))
        release(sample(model, resident, routing, compile=True, tokens=tokens))
        total, steps = 0.0, 0
        for _ in range(reps):
            torch.cuda.synchronize()
            start = time.perf_counter()
            rollout = sample(model, resident, routing, compile=True, tokens=tokens)
            torch.cuda.synchronize()
            total += time.perf_counter() - start - rollout.setup_s
            steps += rollout.decode_steps
            release(rollout)
        return total / steps

    plain, recorded = per_step(None), per_step(RoutingReplay(force=True))
    print(f"decode of {G} x {tokens} tokens at {PROMPT}, a step less setup: {1e3 * plain:.4f} ms plain, "
          f"{1e3 * recorded:.4f} ms recording ({recorded / plain:.3f}x, {1e3 * (recorded - plain):.4f} ms added)")
    assert recorded / plain <= 1.05


def test_offload_writes_into_the_pinned_buffers_of_the_record_released(setup):
    """`RoutingReplay.release` hands a host record's pinned buffers to the next `offload`, which writes the new
    record there (no new pinned memory) and exactly; a buffer of another dtype or too small is not taken; the
    buffers serve one offload only."""
    model, _ = setup
    routing = RoutingReplay()

    def filled(capacity, seed):
        record = RoutingRecord.empty(model, G, capacity, PROMPT)
        generator = torch.Generator("cuda").manual_seed(seed)
        for t in record.tensors():
            t.copy_(torch.randint(0, 1000, t.shape, device="cuda", generator=generator))
        return record

    first = routing.offload(filled(32, 0))
    assert all(t.is_pinned() for t in first.tensors())
    routing.release(first)
    pointers = {key: t.data_ptr() for key, t in routing.spare.items()}
    device = filled(32, 1)
    second = routing.offload(device, 20)
    assert routing.spare == {}
    for key, t in zip(pointers, second.tensors()):
        assert t.is_pinned() and t.data_ptr() == pointers[key] and t.shape[1] == 20
    for got, want in zip(second.tensors(), device.tensors()):
        assert torch.equal(got, want[:, :20].cpu())
    # the buffers whole again (32 slots' worth, though the record held 20); too small (16) or of another dtype: new
    # pinned memory
    whole = host_buffers(second)
    assert all(t.numel() == want.numel() for t, want in zip(whole.values(), device.tensors()))
    small = {key: t[:t.numel() // 2] for key, t in whole.items()}
    wrong = {key: t.view(torch.uint8) for key, t in whole.items()}
    for spare in (small, wrong):
        third = to_host(filled(32, 2), spare=spare)
        assert all(t.data_ptr() != pointers[key] and t.is_pinned() for key, t in zip(pointers, third.tensors()))
