"""The contract every model family meets, checked for each (qwen36_tiny, glm52_tiny): capture + replay equal the
full-sequence forward, replay gradients equal the full-sequence reference with the prompt detached, replays and
rollouts leave the resident state untouched and no graph outlives a replay, a transaction's accounted memory does
not grow with the group size, and batched scoring equals one response at a time. Checks of one family's own
layout (its resident bytes, offload, router, LoRA targets) stay in that family's file."""

import copy
from dataclasses import dataclass

import pytest
import torch

from conftest import grads, ids, random_model, rel_err
from longstraw_cli.distributed.strategy import LocalStrategy
from longstraw_cli.rl.advantages import get_advantage
from longstraw_cli.rl.losses import GroupShape, LossConfig, response_loss
from longstraw_cli.rollout.native import SamplingConfig, generate
from longstraw_cli.telemetry.memory import GraphMemory
from longstraw_cli.transaction import Transaction, TransactionConfig

pytestmark = pytest.mark.usefixtures("one_thread")


@dataclass(frozen=True)
class Family:
    name: str
    # fp64 RMS-relative error bounds: replay gradients against the full-sequence reference, and capture + replay
    # log-probs against the full forward (qwen36's chunked GDN scan reassociates more than glm52's attention)
    grad_tol: float
    logprob_tol: float
    # a parameter whose gradient changes when the prompt is not detached: the gradient check discriminates
    prompt_sensitive: str
    # parameters that never get a gradient (glm52's indexer only selects keys)
    no_grad: str | None


FAMILIES = [
    Family("qwen36_tiny", grad_tol=1e-5, logprob_tol=1e-10, prompt_sensitive="model.layers.3.self_attn.k_proj.weight",
           no_grad=None),
    Family("glm52_tiny", grad_tol=1e-10, logprob_tol=1e-12,
           prompt_sensitive="model.layers.0.self_attn.kv_a_proj_with_mqa.weight", no_grad=".indexer."),
]


@pytest.fixture(params=FAMILIES, ids=lambda f: f.name)
def family(request):
    return request.param


def reference_logprobs(model, prompt, response, grad_prefix):
    logits = model(torch.cat([prompt, response]), grad_prefix=grad_prefix)
    logp = torch.log_softmax(logits.double(), -1)[prompt.numel() - 1 : -1]
    return logp.gather(-1, response[:, None])[:, 0]


def test_replay_gradients_match_full_sequence_reference_with_prompt_detached(family):
    model = random_model(family.name)
    prompt, response = ids(90, 0), ids(30, 1)
    weights = torch.randn(30, generator=torch.Generator().manual_seed(2), dtype=torch.float64)

    (weights * reference_logprobs(model, prompt, response, grad_prefix=prompt.numel() - 1)).sum().backward()
    ref = grads(model)
    model.zero_grad(set_to_none=True)
    resident = model.capture(prompt, block_size=16)
    (weights * model.logprobs(resident, response, grad=True)).sum().backward()
    got = grads(model)

    frozen = {n for n, _ in model.named_parameters() if family.no_grad and family.no_grad in n}
    if family.no_grad:
        assert frozen and not frozen & (set(ref) | set(got)), f"{family.no_grad} parameters must get no gradient"
    assert got.keys() == ref.keys() == {n for n, _ in model.named_parameters()} - frozen
    worst = max(rel_err(got[n], ref[n]) for n in ref)
    print(f"{family.name} replay gradient max rel err vs full-sequence reference (fp64) {worst:.3e}")
    assert worst <= family.grad_tol
    # the check discriminates: the full gradient (prompt not constant) is a different thing
    model.zero_grad(set_to_none=True)
    (weights * reference_logprobs(model, prompt, response, grad_prefix=0)).sum().backward()
    name = family.prompt_sensitive
    assert rel_err(grads(model)[name], ref[name]) > 1e-3


# prompts of 1-5 tokens are shorter than qwen36's conv window; blocks that divide the captured tokens and not
@pytest.mark.parametrize("prompt_len, block_size", [(1, 4), (2, 1), (3, 2), (5, 2), (17, 16), (150, 40)])
def test_capture_logprobs_match_full_forward(family, prompt_len, block_size):
    model = random_model(family.name)
    prompt, response = ids(prompt_len, prompt_len), ids(25, 100 + prompt_len)
    resident = model.capture(prompt, block_size=block_size)
    with torch.no_grad():
        ref = reference_logprobs(model, prompt, response, 0)
    assert rel_err(model.logprobs(resident, response), ref) < family.logprob_tol


@pytest.mark.parametrize("block_size", [16, 45, 1000])
def test_layer_by_layer_span_capture_equals_block_capture(family, block_size):
    model = random_model(family.name)
    prompt, response = ids(110, 7), ids(15, 8)
    blockwise = model.capture(prompt, block_size=block_size)
    span = model.capture_span(prompt[:-1], start=0, num_tokens=109, last_token=int(prompt[-1]), block_size=block_size)
    assert span.num_tokens == blockwise.num_tokens and span.last_token == blockwise.last_token
    for a, b in zip(span.tensors(), blockwise.tensors()):
        assert rel_err(a, b) < 1e-12
    assert rel_err(model.logprobs(span, response), model.logprobs(blockwise, response)) < 1e-12


def make_group(G, R=12, P=60, seed=0):
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, 259, (P,), generator=g)
    responses = [torch.randint(0, 259, (R,), generator=g) for _ in range(G)]
    rewards = torch.rand(G, generator=g)
    return prompt, responses, rewards


def run_transaction(model, G, lr=1.0, **kw):
    prompt, responses, rewards = make_group(G, **kw)
    strategy = LocalStrategy(model, torch.optim.SGD(model.parameters(), lr=lr), max_grad_norm=None)
    tx = Transaction(model, strategy, LossConfig(name="grpo"), TransactionConfig(block_size=16))
    return tx.run(prompt, responses, rewards, tx.capture(prompt)), (prompt, responses, rewards)


def test_resident_is_untouched_by_replays_and_no_graph_outlives_a_replay(family):
    model = random_model(family.name, torch.float32)
    prompt, responses, rewards = make_group(4)
    resident = model.capture(prompt, block_size=16)
    snapshot = [t.clone() for t in resident.tensors()]
    strategy = LocalStrategy(model, torch.optim.SGD(model.parameters(), lr=0.0), max_grad_norm=1.0)
    tx = Transaction(model, strategy, LossConfig(name="grpo"), TransactionConfig(block_size=16))
    result = tx.run(prompt, responses, rewards, resident)
    assert all(torch.equal(a, b) for a, b in zip(snapshot, resident.tensors()))
    assert result.graph_peak_bytes > 0
    assert result.graph_live_bytes_after == 0

    # per replay: the graph lives until its backward, then nothing remains; batched scoring keeps no graph
    meter = GraphMemory(exclude=[*model.parameters(), *resident.tensors()])
    with meter:
        logp = model.logprobs(resident, responses[0], grad=True)
        assert meter.live_bytes > 0
        logp.sum().backward()
        del logp
        model.logprobs(resident, torch.stack(responses[:2]))
    assert meter.live_bytes == 0 and meter.live_tensors == 0
    assert all(torch.equal(a, b) for a, b in zip(snapshot, resident.tensors()))


def test_transaction_update_is_sum_of_per_response_updates(family):
    model = random_model(family.name)
    before = copy.deepcopy(model)
    _, (prompt, responses, rewards) = run_transaction(model, G=4)

    # each response's update alone, from its own capture, on an untouched copy
    adv = get_advantage("grpo")(rewards.double()).tolist()
    group = GroupShape.from_lengths([len(r) for r in responses])
    total = {n: torch.zeros_like(p) for n, p in before.named_parameters()}
    for i, r in enumerate(responses):
        before.zero_grad(set_to_none=True)
        resident = before.capture(prompt, block_size=64)
        old = before.logprobs(resident, r).detach()
        loss, _ = response_loss(LossConfig(name="grpo"), before.logprobs(resident, r, grad=True), old, adv[i], group)
        loss.backward()
        for n, p in before.named_parameters():
            if p.grad is not None:
                total[n] += p.grad
    after = dict(model.named_parameters())
    worst = max(rel_err(before.get_parameter(n) - after[n], total[n]) for n in total if total[n].norm() > 0)
    print(f"{family.name} transaction update vs sum of per-response updates, max rel err {worst:.3e}")
    assert worst < 1e-10


def test_accounted_peak_memory_does_not_grow_with_group_size(family):
    peaks = {}
    for G in (2, 8):
        result, _ = run_transaction(random_model(family.name, torch.float32), G=G, lr=0.0)
        peaks[G] = result.accounted_peak_bytes
        assert result.graph_live_bytes_after == 0
    print(f"{family.name} accounted peak bytes G=2 {peaks[2]}, G=8 {peaks[8]}")
    assert peaks[2] == peaks[8]

    # the accounting does see graphs that are kept alive: holding all G graphs grows with G
    model = random_model(family.name, torch.float32)
    prompt, responses, _ = make_group(8)
    resident = model.capture(prompt, block_size=16)
    held = {}
    for G in (2, 8):
        with GraphMemory(exclude=[*model.parameters(), *resident.tensors()]) as meter:
            kept = [model.logprobs(resident, r, grad=True) for r in responses[:G]]
            held[G] = meter.peak_bytes
            del kept
    assert held[8] > 3 * held[2]


def test_batched_scoring_equals_single(family):
    model = random_model(family.name, torch.float32)
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 259, (90,), generator=g)
    responses = torch.randint(0, 259, (3, 20), generator=g)
    resident = model.capture(prompt, block_size=32)
    batched = model.logprobs(resident, responses)
    for i in range(3):
        assert rel_err(batched[i], model.logprobs(resident, responses[i])) < 1e-6


def test_native_rollout_equals_replay_and_greedy_full_forward(family):
    model = random_model(family.name)
    prompt = ids(70, 9)
    for offload in ({}, {"offload": "cpu"}):
        resident = model.capture(prompt, block_size=16, **offload)
        snapshot = [t.clone() for t in resident.tensors()]
        rollout = generate(model, resident, 3, SamplingConfig(max_new_tokens=20), torch.Generator().manual_seed(1))
        assert all(torch.equal(a, b) for a, b in zip(snapshot, resident.tensors()))
        for response, logp in zip(rollout.responses, rollout.logprobs):
            assert rel_err(logp, model.logprobs(resident, response)) < 1e-10

    # from the last resident state: offloaded
    greedy = generate(model, resident, 2, SamplingConfig(temperature=0, max_new_tokens=20)).responses[0]
    with torch.no_grad():
        seq = prompt
        for _ in range(20):
            seq = torch.cat([seq, model(seq)[-1].argmax()[None]])
    assert torch.equal(greedy, seq[prompt.numel() :])
