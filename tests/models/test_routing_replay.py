"""Routing replay (rollout.replay_routing, models/glm52/routing.py) on glm52_tiny, fp64 and bf16: the decode step
records each response token's experts and DSA selection; forced in the replay, its log-probs equal the rollout's
to the dtype's noise even where a router tie at the top-k boundary (or a changed indexer) makes the live routing
differ; the router's gradient at forced ids equals a reference that masks every other expert; `measure` and
`false` give today's numbers bit for bit; a rollout without records (vLLM) records at scoring."""

import contextlib
import logging

import pytest
import torch

from conftest import ids, random_model, rel_err
from longstraw_cli.distributed.strategy import LocalStrategy
from longstraw_cli.models.glm52.model import MoE, live_route, live_selection
from longstraw_cli.models.glm52.routing import RoutingRecord, RoutingReplay, forcing, record_bytes
from longstraw_cli.models.spec import family_of, get_family
from longstraw_cli.rl.losses import LossConfig
from longstraw_cli.rollout.native import NativeConfig, SamplingConfig, generate
from longstraw_cli.transaction import Transaction, TransactionConfig

pytestmark = pytest.mark.usefixtures("one_thread")

# the decode step (dense experts, one token) against the replay (sparse experts, the whole response): rounding only
NOISE = {torch.float64: 1e-10, torch.bfloat16: 5e-3}
PROMPT, RESPONSE, G = 50, 14, 3


def moe_layers(model):
    return [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, MoE)]


def plant_tie(model, loser: int):
    """Experts 0, 1, 2 of group 0 get the same router row and a bias that puts group 0 first: every token's top-2
    is a three-way tie among them, which `loser`'s bias, lowered by a hair (the noise of another kernel), decides
    against it."""
    for mlp in moe_layers(model):
        with torch.no_grad():
            gate = mlp.gate
            gate.weight[1:3] = gate.weight[0]
            gate.e_score_correction_bias.zero_()
            gate.e_score_correction_bias[:3] = 1.0
            gate.e_score_correction_bias[loser] -= 1e-4


def rollout(model, resident, routing):
    return generate(model, resident, G, SamplingConfig(max_new_tokens=RESPONSE), torch.Generator().manual_seed(3),
                    routing=routing)


def replayed(model, resident, ro, routing=None):
    out = []
    for i, response in enumerate(ro.responses):
        routed = contextlib.nullcontext() if routing is None else routing.replaying(ro.routing, model,
                                                                                    slice(i, i + 1))
        with routed:
            out.append(model.logprobs(resident, response))
    return out


def worst(a, b):
    return max(rel_err(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=str)
def test_forced_experts_replay_the_rollout_through_a_planted_router_tie(dtype):
    model = random_model("glm52_tiny", dtype, seed=1)
    resident = model.capture(ids(PROMPT, 2), block_size=16)
    routing = RoutingReplay(force=True)
    plant_tie(model, loser=2)
    ro = rollout(model, resident, routing)
    # the replay's kernels break the tie the other way
    plant_tie(model, loser=0)
    assert worst(replayed(model, resident, ro), ro.logprobs) > 10 * NOISE[dtype]
    assert worst(replayed(model, resident, ro, routing), ro.logprobs) < NOISE[dtype]
    flips = routing.metrics()
    # every token's live top-2 ({1, 2}) differs from the recorded one ({0, 1}) in every MoE layer
    assert flips["rollout/expert_flip_frac"] == flips["rollout/expert_flip_frac_max"] == 1.0
    # the indexer was not touched: in fp64 no selection flips; in bf16 the decode step's and the replay's index
    # scores round apart and a few boundary keys do (the flips routing replay removes)
    assert flips["rollout/dsa_flip_frac"] == 0.0 if dtype == torch.float64 else flips["rollout/dsa_flip_frac"] < 0.1


def test_the_rollout_keeps_the_slots_its_decode_wrote():
    """Every id a stop token, checked every step: the decode runs one step in buffers of 32 slots, and the record
    the rollout keeps (in host memory on a GPU) holds that one slot, as the replay reads it."""
    model = random_model("glm52_tiny", torch.float64, seed=1)
    resident = model.capture(ids(PROMPT, 2), block_size=16)
    routing = RoutingReplay(force=True)
    sampling = SamplingConfig(max_new_tokens=40, stop_token_ids=tuple(range(model.config.vocab_size)))
    ro = generate(model, resident, G, sampling, torch.Generator().manual_seed(3), routing=routing,
                  native=NativeConfig(stop_check_every=1, response_chunk=32))
    assert ro.decode_steps == 1 and {t.shape[1] for t in ro.routing.tensors()} == {1}
    assert worst(replayed(model, resident, ro, routing), ro.logprobs) < NOISE[torch.float64]


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=str)
def test_forced_dsa_selection_replays_the_rollout_when_the_indexer_changes(dtype):
    model = random_model("glm52_tiny", dtype, seed=1)
    resident = model.capture(ids(PROMPT, 2), block_size=16)
    routing = RoutingReplay(force=True)
    ro = rollout(model, resident, routing)
    # the indexer only selects: a changed query projection changes the selection and nothing else (the pages'
    # index keys stay those of the capture)
    with torch.no_grad():
        for layer in model.model.layers:
            if layer.self_attn.indexer is not None:
                layer.self_attn.indexer.wq_b.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(9))
    assert worst(replayed(model, resident, ro), ro.logprobs) > 10 * NOISE[dtype]
    assert worst(replayed(model, resident, ro, routing), ro.logprobs) < NOISE[dtype]
    flips = routing.metrics()
    assert 0 < flips["rollout/dsa_flip_frac"] <= flips["rollout/dsa_flip_frac_max"] <= 1


def test_router_gradient_at_forced_ids_equals_a_reference_masking_the_other_experts():
    model = random_model("glm52_tiny", torch.float64, seed=1)
    resident = model.capture(ids(PROMPT, 2), block_size=16)
    routing = RoutingReplay(force=True)
    ro = rollout(model, resident, routing)
    # other routers than the rollout's, so that forced and live choices differ
    with torch.no_grad():
        for mlp in moe_layers(model):
            mlp.gate.weight.normal_(0, 0.3, generator=torch.Generator().manual_seed(4))
    response, weights = ro.responses[1], torch.randn(len(ro.responses[1]), dtype=torch.float64)
    part = ro.routing.rows(slice(1, 2))

    def router_grads(context):
        model.zero_grad(set_to_none=True)
        with context:
            (weights * model.logprobs(resident, response, grad=True)).sum().backward()
        return [mlp.gate.weight.grad.clone() for mlp in moe_layers(model)]

    forced = router_grads(forcing(model, part))

    def masked_route(layer, gate, x_NC, positions_T):
        """The reference: the router's own top-k over its scores with every expert but the recorded ones masked."""
        recorded_Nk = part.experts[layer].index_select(1, positions_T - part.first).reshape(x_NC.shape[0], -1)
        scores_NE = gate.scores(x_NC)
        keep_NE = torch.zeros_like(scores_NE, dtype=torch.bool).scatter_(1, recorded_Nk.long(), True)
        chosen_Nk = scores_NE.detach().masked_fill(~keep_NE, float("-inf")).topk(recorded_Nk.shape[1]).indices
        return chosen_Nk, gate.weights(scores_NE, chosen_Nk)

    @contextlib.contextmanager
    def masked():
        # the recorded DSA selections forced as in `forcing`, the experts chosen by `masked_route`
        with forcing(model, part):
            for i, layer in enumerate(model.model.layers):
                if isinstance(layer.mlp, MoE):
                    layer.mlp.route_fn = lambda *a, i=i: masked_route(i, *a)
            yield

    reference = router_grads(masked())
    live = router_grads(contextlib.nullcontext())
    assert all(mlp.route_fn is live_route for mlp in moe_layers(model))
    for got, want, other in zip(forced, reference, live):
        assert want.norm() > 0
        assert rel_err(got, want) < 1e-12
        assert rel_err(other, want) > 1e-3


def transaction_step(model, routing_replay, ro, resident, prompt, vllm=False, replay_block=0):
    """One transaction -> (stats, every trainable parameter's gradient): the strategy's step clears .grad, so the
    gradient is read as plain SGD's update at lr 1 (no clipping), and the weights are put back after it."""
    model.zero_grad(set_to_none=True)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    strategy = LocalStrategy(model, torch.optim.SGD(model.parameters(), lr=1.0), None)
    tx = Transaction(model, strategy, LossConfig(), TransactionConfig(score_batch=2, replay_block=replay_block),
                     routing_replay=routing_replay)
    rewards = torch.arange(G, dtype=torch.float64)
    result = tx.run(prompt, ro.responses, rewards, resident, old_logprobs=None if vllm else ro.logprobs,
                    routing=None if vllm else ro.routing)
    grads = {}
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n in before:
                grads[n] = before[n] - p
                p.copy_(before[n])
    assert any(g.norm() > 0 for g in grads.values())
    return result.stats, grads


def assert_grads_close(got: dict, want: dict, tol: float) -> None:
    """Every parameter's gradient within `tol` (relative); those with none (experts no token chose, the indexer)
    zero in both."""
    assert got.keys() == want.keys()
    for name, ref in want.items():
        if ref.norm() > 0:
            assert rel_err(got[name], ref) < tol, name
        else:
            assert got[name].norm() == 0, name


def test_off_and_measure_keep_todays_numbers_bit_for_bit():
    model = random_model("glm52_tiny", torch.float64, seed=1)
    prompt = ids(PROMPT, 2)
    resident = model.capture(prompt, block_size=16)
    plain = rollout(model, resident, None)
    measured = rollout(model, resident, RoutingReplay(force=False))
    assert plain.routing is None and measured.routing is not None
    assert all(torch.equal(a, b) for a, b in zip(plain.responses, measured.responses))
    assert all(torch.equal(a, b) for a, b in zip(plain.logprobs, measured.logprobs))
    off_stats, off_grads = transaction_step(model, None, plain, resident, prompt)
    stats, grads = transaction_step(model, RoutingReplay(force=False), measured, resident, prompt)
    assert all(torch.equal(off_grads[n], grads[n]) for n in off_grads) and off_grads.keys() == grads.keys()
    assert {k: v for k, v in stats.items() if "flip" not in k} == off_stats
    assert stats["rollout/expert_flip_frac"] == stats["rollout/dsa_flip_frac"] == 0.0
    # the hooks are the live ones again after every context
    assert all(mlp.route_fn is live_route for mlp in moe_layers(model))
    assert all(layer.self_attn.select_fn is live_selection for layer in model.model.layers)
    # auto: on for glm52, off for qwen36 (which routes nothing); true on qwen36 is refused
    assert isinstance(family_of(model).routing_replay("auto"), RoutingReplay)
    assert family_of(model).routing_replay(False) is None
    assert get_family("qwen36").routing_replay("auto") is None
    with pytest.raises(ValueError, match="routes no token"):
        get_family("qwen36").routing_replay(True)


def test_without_a_rollout_record_the_routing_is_recorded_at_scoring_and_said_once(caplog):
    model = random_model("glm52_tiny", torch.float64, seed=1)
    prompt = ids(PROMPT, 2)
    resident = model.capture(prompt, block_size=16)
    routing = RoutingReplay(force=True)
    ro = rollout(model, resident, routing)
    with caplog.at_level(logging.INFO):
        stats, grads = transaction_step(model, routing, ro, resident, prompt, vllm=True)
    # scored from the same resident state as the replays: no token flips
    assert stats["rollout/expert_flip_frac_max"] == stats["rollout/dsa_flip_frac_max"] == 0.0
    stats_native, grads_native = transaction_step(model, routing, ro, resident, prompt)
    assert_grads_close(grads, grads_native, 1e-10)
    assert sum("recorded at scoring" in r.getMessage() for r in caplog.records) == 1


def test_record_bytes_match_the_records():
    model = random_model("glm52_tiny", torch.float64, seed=1)
    record = RoutingRecord.empty(model, G, RESPONSE, first=PROMPT - 1)
    assert record.nbytes() == record_bytes(model.config, G, RESPONSE) > 0


def test_replay_routing_setting_is_checked():
    from longstraw_cli.config import ConfigError, RolloutConfig

    for good in ("auto", True, False, "measure"):
        assert RolloutConfig("native", SamplingConfig(), replay_routing=good).replay_routing == good
    for bad in ("on", 1, None):
        with pytest.raises(ConfigError, match="replay_routing"):
            RolloutConfig("native", SamplingConfig(), replay_routing=bad)


def test_blockwise_replay_forces_the_record_as_the_whole_replay_does():
    """capture.replay_block: the graph-free pass and every block's recompute run inside the response's routing
    context, so through a planted tie broken the other way after the rollout the blockwise step (blocks of 5 over
    14 tokens) gives the whole forced replay's gradients and stats (fp64), and the unforced (measure) blockwise
    step does not."""
    model = random_model("glm52_tiny", torch.float64, seed=1)
    prompt = ids(PROMPT, 2)
    resident = model.capture(prompt, block_size=16)
    plant_tie(model, loser=2)
    ro = rollout(model, resident, RoutingReplay(force=True))
    plant_tie(model, loser=0)
    whole_stats, whole = transaction_step(model, RoutingReplay(force=True), ro, resident, prompt)
    block_stats, blocks = transaction_step(model, RoutingReplay(force=True), ro, resident, prompt, replay_block=5)
    assert_grads_close(blocks, whole, 1e-12)
    for key in ("loss", "ppo_kl", "ratio_mean", "rollout/expert_flip_frac"):
        assert block_stats[key] == pytest.approx(whole_stats[key], rel=1e-12, abs=1e-15), key
    _, unforced = transaction_step(model, RoutingReplay(force=False), ro, resident, prompt, replay_block=5)
    assert max(rel_err(unforced[n], whole[n]) for n in whole if whole[n].norm() > 0) > 1e-6
