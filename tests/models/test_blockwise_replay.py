"""Blockwise response replay (models/blockwise.py, `capture.replay_block`): the gradient of a response replayed in
blocks equals the whole-response replay's in fp64 (<= 1e-12 relative), for block sizes that divide the response
and that do not, both families, response_only and exact, full fine-tuning and LoRA; the log-probs equal the whole
replay's and the blockwise scoring's (batched, right-padded); the graph the walk keeps does not grow with the
response beyond its pages; a control that drops what later blocks send back is caught."""

import pytest
import torch

from conftest import grads, ids, random_lora_, random_model, rel_err, worst_rel_err
from longstraw_cli.models import blockwise
from longstraw_cli.models.blockwise import replay_blocks, score_blocks
from longstraw_cli.resident.gradient import StateGrad
from longstraw_cli.telemetry.memory import GraphMemory

pytestmark = pytest.mark.usefixtures("one_thread")

FAMILIES = ["qwen36_tiny", "glm52_tiny"]
# the bound
TOL = 1e-12
PROMPT, RESPONSE = 40, 23
# adapters on what the response's keys and the GDN state are made of: gradient through earlier blocks reaches them
LORA_TARGETS = {"qwen36_tiny": ("k_proj", "v_proj", "in_proj_qkv"), "glm52_tiny": ("kv_a_proj_with_mqa", "q_b_proj")}


def loss_of(weights):
    """A per-response loss that is not a token sum alone (a whole-response normaliser, as GRPO's): its gradient
    w.r.t. each log-prob depends on every token, so blocks must receive dL/dlogp of the whole response."""
    def loss(logp_R):
        return (weights * logp_R).sum() / logp_R.numel() + 0.1 * logp_R.mean() ** 2
    return loss


def whole_grads(model, resident, response, loss):
    model.zero_grad(set_to_none=True)
    loss(model.logprobs(resident, response, grad=True)).backward()
    out = grads(model)
    model.zero_grad(set_to_none=True)
    return out


def block_grads(model, resident, response, loss, block, **kw):
    model.zero_grad(set_to_none=True)

    def loss_grad(logp_R):
        leaf = logp_R.detach().requires_grad_()
        loss(leaf).backward()
        return leaf.grad

    replay_blocks(model, resident, response, loss_grad, block, **kw)
    out = grads(model)
    model.zero_grad(set_to_none=True)
    return out


def setup(name, lora=False):
    model = random_model(name)
    if lora:
        random_lora_(model, LORA_TARGETS[name])
    prompt, response = ids(PROMPT, 0), ids(RESPONSE, 1)
    weights = torch.randn(RESPONSE, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    return model, prompt, response, loss_of(weights)


def block_vs_whole(model, resident, response, loss, block) -> float:
    """The worst relative error of the blockwise replay's gradients against the whole replay's."""
    blocks = block_grads(model, resident, response, loss, block)
    return worst_rel_err(blocks, whole_grads(model, resident, response, loss))


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize(("lora", "block"), [(False, b) for b in (1, 5, 8, 23, 64)] + [(True, 6), (True, 8)])
def test_response_only_gradient_equals_whole_replay(name, lora, block):
    model, prompt, response, loss = setup(name, lora=lora)
    resident = model.capture(prompt, block_size=16)
    err = block_vs_whole(model, resident, response, loss, block)
    print(f"{name}{' LoRA' if lora else ''} block {block}: max rel err {err:.2e}")
    assert err <= TOL


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("block", [7, 8])
def test_exact_gradient_equals_whole_replay(name, block):
    """Exact mode: the replay reads leaves of the resident state; the blocks send the same gradient into them
    (and so into the prompt's walk) as the whole replay."""
    model, prompt, response, loss = setup(name)
    resident = model.capture(prompt, block_size=16, boundaries=True)

    def run(replay):
        model.zero_grad(set_to_none=True)
        state_grad = StateGrad(resident)
        replay(state_grad.replay_view(resident))
        model.prompt_backward(prompt, resident, state_grad, 16)
        out = grads(model)
        model.zero_grad(set_to_none=True)
        return out

    def whole(view):
        loss(model.logprobs(view, response, grad=True)).backward()

    def blocks(view):
        def loss_grad(logp_R):
            leaf = logp_R.detach().requires_grad_()
            loss(leaf).backward()
            return leaf.grad
        replay_blocks(model, view, response, loss_grad, block)

    err = worst_rel_err(run(blocks), run(whole))
    print(f"{name} exact block {block}: max rel err {err:.2e}")
    assert err <= TOL


@pytest.mark.parametrize("name", FAMILIES)
def test_dropping_what_later_blocks_send_back_is_caught(name):
    """Control: a walk whose later blocks' gradient into earlier pages / states is lost is far off."""
    import longstraw_cli.models.blockwise as blockwise

    model, prompt, response, loss = setup(name)
    resident = model.capture(prompt, block_size=16)
    ref = whole_grads(model, resident, response, loss)
    original = blockwise.leaves
    try:
        blockwise.leaves = lambda state, targets: original(state, {n: t.clone() for n, t in targets.items()})
        assert worst_rel_err(block_grads(model, resident, response, loss, 8), ref) > 1e-4
    finally:
        blockwise.leaves = original


@pytest.mark.parametrize("name", FAMILIES)
def test_blockwise_scoring_equals_whole_scoring(name):
    """Graph-free scoring in blocks, a batch of right-padded responses, equals the whole replay's log-probs."""
    model, prompt, _, _ = setup(name)
    resident = model.capture(prompt, block_size=16)
    responses = [ids(n, 10 + n) for n in (23, 9, 17)]
    padded = torch.nn.utils.rnn.pad_sequence(responses, batch_first=True)
    whole = model.logprobs(resident, padded, grad=False)
    for block in (4, 7, 23):
        got = score_blocks(model, resident, padded, block)
        for i, r in enumerate(responses):
            assert rel_err(got[i, : len(r)], whole[i, : len(r)]) <= TOL


@pytest.mark.parametrize("name", FAMILIES)
def test_walk_graph_does_not_grow_with_the_response(name):
    """The accounted graph (GraphMemory) of the whole replay grows with R; the blockwise walk's stays one block's
    plus the response's keys (a few hundred bytes a token for these configs): growth per token a small fraction."""
    model, prompt, _, _ = setup(name)
    resident = model.capture(prompt, block_size=16)
    block = 8

    def peak(R, blockwise):
        response = ids(R, 3)
        loss = loss_of(torch.ones(R, dtype=torch.float64))
        meter = GraphMemory(exclude=[*model.parameters(), *resident.tensors()])
        with meter:
            (block_grads if blockwise else whole_grads)(model, resident, response, loss, *([block] if blockwise
                                                                                          else []))
        assert meter.live_bytes == 0
        return meter.peak_bytes

    short, long = 2 * block, 8 * block
    whole_growth = (peak(long, False) - peak(short, False)) / (long - short)
    block_growth = (peak(long, True) - peak(short, True)) / (long - short)
    print(f"{name}: graph growth per response token: whole {whole_growth:.0f} B, blockwise {block_growth:.0f} B")
    assert block_growth <= 0.25 * whole_growth


@pytest.mark.parametrize("name", FAMILIES)
def test_response_state_holds_only_what_it_counts(name):
    """What the walk keeps (`ResponseState`: the response's pages, the carried states at block starts) pins no more
    memory than `nbytes` counts, the figure the meter and the plan use: no kept tensor is a view into a larger
    allocation (a GDN conv window sliced from its block's conv input kept the whole block alive per boundary,
    measured on an H200 as 3.7 GiB beyond the plan at R=32K)."""
    model, prompt, _, _ = setup(name)
    resident = model.capture(prompt, block_size=16)
    _, state = blockwise.response_forward(model, resident, ids(40, 3)[None], 8, keep=True)
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in state.tensors()}
    counted = sum(t.numel() * t.element_size() for t in state.tensors())
    assert sum(storages.values()) == counted


def transaction_step(name, replay_block, loss_name, gradient="response_only", kl=0.0):
    """One fp64 transaction (G=3 responses of different lengths, KL to a reference) -> (the update, result)."""
    from longstraw_cli.distributed.local_strategy import LocalStrategy
    from longstraw_cli.rl.losses import LossConfig
    from longstraw_cli.transaction import Reference, Transaction, TransactionConfig

    model = random_model(name)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    g = torch.Generator().manual_seed(4)
    prompt = torch.randint(0, 259, (50,), generator=g)
    responses = [torch.randint(0, 259, (n,), generator=g) for n in (21, 9, 16)]
    rewards = torch.tensor([0.2, 0.9, 0.5])
    cfg = TransactionConfig(block_size=16, replay_block=replay_block, gradient=gradient, score_batch=2)
    strategy = LocalStrategy(model, torch.optim.SGD(model.parameters(), lr=1.0), max_grad_norm=None)
    reference = Reference(random_model(name, seed=1), cfg) if kl else None
    tx = Transaction(model, strategy, LossConfig(name=loss_name, kl_coef=kl), cfg, reference=reference)
    # old log-probs scored by the transaction itself (blockwise scoring when replay_block > 0)
    result = tx.run(prompt, responses, rewards, tx.capture(prompt))
    return {n: p.detach() - before[n] for n, p in model.named_parameters() if p.grad is not None or
            not torch.equal(p.detach(), before[n])}, result


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("loss_name, gradient", [("grpo", "response_only"), ("gspo", "response_only"),
                                                 ("dapo", "exact")])
def test_transaction_with_replay_block_equals_whole_replay(name, loss_name, gradient):
    """The transaction's update and stats with replay_block (7: it divides none of the responses) equal the
    whole-response replay's: the loss normalised over each whole response (GSPO's sequence ratio too), the KL to a
    reference scored in blocks, exact mode's walk after the blockwise replays."""
    whole, whole_result = transaction_step(name, 0, loss_name, gradient, kl=0.1)
    blocks, block_result = transaction_step(name, 7, loss_name, gradient, kl=0.1)
    assert blocks.keys() == whole.keys() and whole
    err = max(rel_err(blocks[n], whole[n]) for n in whole if whole[n].norm() > 0)
    print(f"{name} {loss_name} {gradient}: the step's update, max rel err {err:.2e}")
    assert err <= TOL
    for key in ("loss", "pg_loss", "kl_loss", "grad_norm"):
        assert block_result.stats[key] == pytest.approx(whole_result.stats[key], rel=1e-12, abs=1e-15)
    assert block_result.graph_live_bytes_after == 0
    assert block_result.response_state_bytes > 0 and whole_result.response_state_bytes == 0


@pytest.mark.parametrize("name", FAMILIES)
def test_offloaded_pages_give_the_same_blockwise_gradient(name):
    """capture.offload=cpu: each block stages the pages (graph-free forward and walk alike); the gradient is the
    on-device one, bit for bit."""
    model, prompt, response, loss = setup(name, lora=True)
    on_device = block_grads(model, model.capture(prompt, block_size=16), response, loss, 6)
    offloaded = block_grads(model, model.capture(prompt, block_size=16, offload="cpu"), response, loss, 6)
    assert all(torch.equal(offloaded[n], on_device[n]) for n in on_device)


@pytest.mark.parametrize("name", FAMILIES)
def test_qlora_blockwise_gradient_equals_whole_replay(name):
    """QLoRA (NF4 base, fp64 adapters): blockwise equals the whole replay on the same NF4 model."""
    pytest.importorskip("torchao")
    from longstraw_cli.lora import LoraConfig, apply_lora, lora_layers
    from longstraw_cli.models import build_model

    model = build_model(name, dtype=torch.float64, seed=3, quantize="nf4")
    apply_lora(model, LoraConfig(rank=2, alpha=4.0, quantize="nf4"))
    with torch.no_grad():
        for layer in lora_layers(model).values():
            layer.lora_B.copy_(torch.randn(layer.lora_B.shape, generator=torch.Generator().manual_seed(7)) * 0.05)
    prompt, response = ids(PROMPT, 0), ids(RESPONSE, 1)
    loss = loss_of(torch.randn(RESPONSE, generator=torch.Generator().manual_seed(2), dtype=torch.float64))
    resident = model.capture(prompt, block_size=16)
    err = block_vs_whole(model, resident, response, loss, 8)
    print(f"{name} QLoRA block 8: max rel err {err:.2e}")
    assert err <= TOL


@pytest.mark.parametrize("name", FAMILIES)
def test_responses_within_a_block_replay_whole(name):
    """replay_block=16 over responses of 21, 9 and 16 tokens: the two within a block are one block each (no graph-free
    pass), the 21-token one in blocks; the update and stats equal the whole replay's. A control: a block of 21
    takes none of them blockwise, so no response state is held."""
    whole, whole_result = transaction_step(name, 0, "grpo", kl=0.1)
    mixed, mixed_result = transaction_step(name, 16, "grpo", kl=0.1)
    _, within_result = transaction_step(name, 21, "grpo", kl=0.1)
    err = max(rel_err(mixed[n], whole[n]) for n in whole if whole[n].norm() > 0)
    assert mixed.keys() == whole.keys() and err <= TOL
    for key in ("loss", "pg_loss", "kl_loss", "grad_norm"):
        assert mixed_result.stats[key] == pytest.approx(whole_result.stats[key], rel=1e-12, abs=1e-15)
    assert mixed_result.response_state_bytes > 0 and within_result.response_state_bytes == 0
