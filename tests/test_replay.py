"""Capture + replay against the full-sequence reference; the transaction's gradients, immutability and memory."""

import copy

import pytest
import torch

from conftest import randomize_, rel_err
from longstraw_cli.distributed.strategy import LocalStrategy
from longstraw_cli.models import build_model
from longstraw_cli.rl.losses import GroupShape, LossConfig, response_loss
from longstraw_cli.rl.advantages import get_advantage
from longstraw_cli.telemetry.memory import GraphMemory, PhaseClock
from longstraw_cli.transaction import Transaction, TransactionConfig


def tiny(dtype=torch.float64, seed=0):
    model = build_model("qwen36_tiny", dtype=dtype)
    randomize_(model, seed)
    return model


def reference_logprobs(model, prompt, response, grad_prefix):
    logits = model(torch.cat([prompt, response]), grad_prefix=grad_prefix)
    logp = torch.log_softmax(logits.double(), -1)[prompt.numel() - 1 : -1]
    return logp.gather(-1, response[:, None])[:, 0]


def grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def test_response_only_gradients_match_full_sequence_reference():
    model = tiny()
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 259, (71,), generator=g)
    response = torch.randint(0, 259, (25,), generator=g)
    weights = torch.randn(25, generator=g, dtype=torch.float64)

    (weights * reference_logprobs(model, prompt, response, grad_prefix=prompt.numel() - 1)).sum().backward()
    ref = grads(model)
    model.zero_grad(set_to_none=True)
    resident = model.capture(prompt, block_size=16)
    (weights * model.logprobs(resident, response, grad=True)).sum().backward()
    got = grads(model)

    assert ref.keys() == got.keys() and len(got) == len(list(model.parameters()))
    worst = max(rel_err(got[n], ref[n]) for n in ref)
    print(f"response_only gradient max rel err (fp64) {worst:.3e}")
    assert worst <= 1e-5
    # the check discriminates: the full gradient (prompt not constant) is a different thing
    model.zero_grad(set_to_none=True)
    (weights * reference_logprobs(model, prompt, response, grad_prefix=0)).sum().backward()
    full = grads(model)
    assert rel_err(full["model.layers.3.self_attn.k_proj.weight"], ref["model.layers.3.self_attn.k_proj.weight"]) > 1e-3


@pytest.mark.parametrize("prompt_len", [1, 2, 3, 5])
def test_short_prompts_conv_window(prompt_len):
    model = tiny()
    g = torch.Generator().manual_seed(prompt_len)
    prompt = torch.randint(0, 259, (prompt_len,), generator=g)
    response = torch.randint(0, 259, (9,), generator=g)
    resident = model.capture(prompt, block_size=2)
    with torch.no_grad():
        ref = reference_logprobs(model, prompt, response, 0)
    assert rel_err(model.logprobs(resident, response), ref) < 1e-10


@pytest.mark.parametrize("page_dtype", [None, torch.bfloat16])
def test_resident_bytes_match_analytic_formula(page_dtype):
    model = tiny(torch.float32)
    prompt = torch.randint(0, 259, (130,))
    resident = model.capture(prompt, block_size=50, page_dtype=page_dtype)
    assert resident.nbytes() == model.resident_bytes(129, page_dtype)
    cfg = model.config
    # 2 attention layers x (K + V) x 129 tokens x 2 kv heads x 32 dims; 6 GDN layers x [4, 16, 16] fp32
    page_size = 2 if page_dtype is torch.bfloat16 else 4
    assert resident.nbytes()["kv_pages"] == 2 * 2 * 129 * cfg.num_key_value_heads * cfg.head_dim * page_size
    assert resident.nbytes()["recurrent_state"] == 6 * 4 * 16 * 16 * 4


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
    return tx, tx.run(prompt, responses, rewards, tx.capture(prompt)), (prompt, responses, rewards)


def test_transaction_update_is_sum_of_per_response_updates():
    model = tiny()
    before = copy.deepcopy(model)
    _, result, (prompt, responses, rewards) = run_transaction(model, G=4)

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
            total[n] += p.grad
    after = dict(model.named_parameters())
    worst = max(rel_err(before.get_parameter(n) - after[n], total[n]) for n in total if total[n].norm() > 0)
    print(f"transaction update vs sum of per-response updates, max rel err {worst:.3e}")
    assert worst < 1e-10


def test_resident_is_untouched_by_replays_and_no_graph_outlives_a_replay():
    model = tiny(torch.float32)
    prompt, responses, rewards = make_group(4)
    resident = model.capture(prompt, block_size=16)
    snapshot = [t.clone() for t in resident.tensors()]
    strategy = LocalStrategy(model, torch.optim.SGD(model.parameters(), lr=0.0), max_grad_norm=1.0)
    tx = Transaction(model, strategy, LossConfig(name="grpo"), TransactionConfig(block_size=16))
    result = tx.run(prompt, responses, rewards, resident)
    assert all(torch.equal(a, b) for a, b in zip(snapshot, resident.tensors()))
    assert result.graph_peak_bytes > 0
    assert result.graph_live_bytes_after == 0

    # per replay: the graph lives until its backward, then nothing remains
    meter = GraphMemory(exclude=[*model.parameters(), *resident.tensors()])
    with meter:
        logp = model.logprobs(resident, responses[0], grad=True)
        assert meter.live_bytes > 0
        logp.sum().backward()
        del logp
    assert meter.live_bytes == 0 and meter.live_tensors == 0


def test_accounted_peak_memory_does_not_grow_with_group_size():
    peaks = {}
    for G in (2, 8):
        _, result, _ = run_transaction(tiny(torch.float32), G=G, lr=0.0)
        peaks[G] = result.accounted_peak_bytes
        assert result.graph_live_bytes_after == 0
    print(f"accounted peak bytes G=2 {peaks[2]}, G=8 {peaks[8]}")
    assert peaks[2] == peaks[8]

    # the accounting does see graphs that are kept alive: holding all G graphs grows with G
    model = tiny(torch.float32)
    prompt, responses, _ = make_group(8)
    resident = model.capture(prompt, block_size=16)
    held = {}
    for G in (2, 8):
        with GraphMemory(exclude=[*model.parameters(), *resident.tensors()]) as meter:
            kept = [model.logprobs(resident, r, grad=True) for r in responses[:G]]
            held[G] = meter.peak_bytes
            del kept
    assert held[8] > 3 * held[2]


def test_transaction_rejects_bad_groups():
    model = tiny(torch.float32)
    strategy = LocalStrategy(model, torch.optim.SGD(model.parameters(), lr=0.0), max_grad_norm=1.0)
    tx = Transaction(model, strategy, LossConfig())
    prompt, responses, rewards = make_group(2)
    with pytest.raises(ValueError, match=">= 2 responses"):
        tx.run(prompt, responses[:1], rewards[:1], tx.capture(prompt))
    with pytest.raises(ValueError, match="kl_coef"):
        Transaction(model, strategy, LossConfig(kl_coef=0.1))


def test_transaction_times_its_phases_on_the_callers_clock():
    """One clock per iteration: the caller's phases (here the capture) and the transaction's land on it, in order;
    a repeated phase accumulates. On CPU the clock records time only (no allocator peak)."""
    model = tiny(torch.float32)
    prompt, responses, rewards = make_group(2)
    tx = Transaction(model, LocalStrategy(model, torch.optim.SGD(model.parameters(), lr=0.0), max_grad_norm=1.0),
                     LossConfig())
    clock = PhaseClock("cpu")
    with clock.phase("capture"):
        resident = tx.capture(prompt)
    result = tx.run(prompt, responses, rewards, resident, clock=clock)
    assert list(clock.time_metrics()) == ["time/capture", "time/score", "time/replay", "time/finalize", "time/step"]
    assert result.seconds is clock.seconds and all(s > 0 for s in clock.seconds.values())
    assert clock.memory_metrics() == {} and result.cuda_peak_bytes == {}
    replay = clock.seconds["replay"]
    with clock.phase("replay"):
        pass
    assert clock.seconds["replay"] >= replay and len(clock.seconds) == 5


@pytest.mark.parametrize("block_size", [16, 25, 1000])
def test_layer_by_layer_span_capture_equals_block_capture(block_size):
    model = tiny()
    prompt = torch.randint(0, 259, (83,), generator=torch.Generator().manual_seed(9))
    blockwise = model.capture(prompt, block_size=block_size)
    span = model.capture_span(prompt[:-1], start=0, num_tokens=82, last_token=int(prompt[-1]), block_size=block_size)
    assert span.num_tokens == blockwise.num_tokens and span.last_token == blockwise.last_token
    for a, b in zip(span.tensors(), blockwise.tensors()):
        assert rel_err(a, b) < 1e-12
    response = torch.randint(0, 259, (7,), generator=torch.Generator().manual_seed(10))
    assert rel_err(model.logprobs(span, response), model.logprobs(blockwise, response)) < 1e-12
