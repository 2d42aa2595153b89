"""glm52's memory plan against the built model's bytes and the graph accounting (CPU), and the command's output."""

import pytest
import torch

from longstraw_cli.distributed.ep import expert_bounds, is_expert_param
from longstraw_cli.lora import LoraConfig, apply_lora
from longstraw_cli.models import build_model
from longstraw_cli.models.glm52.config import named_config
from longstraw_cli.plan import GIB, max_prompt_tokens, plan
from longstraw_cli.plan.glm52 import page_bytes
from longstraw_cli.resident.gradient import StateGrad
from longstraw_cli.telemetry.memory import GraphMemory

SMALL = dict(group_size=2, response_tokens=8)
# the GLM-5 target (#33): CP32/EP32, 2M tokens, G=8, LoRA r16, the training config's other defaults
TARGET = dict(cp=32, ep=32, prompt_tokens=2097152, group_size=8, response_tokens=16, lora_rank=16, block_size=4096,
              logprob_chunk=512, dtype="bfloat16")


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("lora_rank", [0, 4])
def test_weights_equal_the_built_model_and_experts_split_by_ep(dtype, lora_rank):
    """Replicated weights (the fp32 router and indexer weights_proj, the router's bias buffer, adapters included)
    and the routed experts equal the model's bytes; under ep each rank holds its expert_bounds slice."""
    model = build_model("glm52_tiny", dtype=getattr(torch, dtype))
    adapters = apply_lora(model, LoraConfig(rank=lora_rank))
    named = [*model.named_parameters(), *model.named_buffers()]
    experts = [t for n, t in named if is_expert_param(n)]
    replicated = _nbytes(t for n, t in named if not is_expert_param(n))
    num_experts = model.config.n_routed_experts
    for ep in (1, 2, 4, 8):
        p = plan("glm52_tiny", cp=8, ep=ep, prompt_tokens=100, dtype=dtype, lora_rank=lora_rank, **SMALL)
        assert p["weights_replicated"] == replicated
        for rank in range(ep):
            start, end = expert_bounds(num_experts, ep, rank)
            assert p["weights_experts"] == _nbytes(t[start:end] for t in experts)
        assert p["weights"] == p["weights_replicated"] + p["weights_experts"]
    p = plan("glm52_tiny", prompt_tokens=100, dtype=dtype, lora_rank=lora_rank, **SMALL)
    assert p["params"] == sum(t.numel() for t in model.parameters())
    # trainable: the adapters, or every parameter but the DSA indexer's (no gradient reaches it)
    trainable = adapters if lora_rank else [t for n, t in model.named_parameters() if ".indexer." not in n]
    assert p["trainable_params"] == sum(t.numel() for t in trainable)
    assert p["grads"] == _nbytes(trainable) and p["optimizer"] == 2 * _nbytes(trainable)


def test_nf4_counts_the_bytes_torchao_stores_experts_per_expert_matrix():
    """lora.quantize=nf4: the replicated weights and the routed experts equal what the NF4 model of an ep=2 rank
    stores (quantize.NF4Experts: each expert's [2I, C] and [C, I] matrix quantised on its own, as planned)."""
    from longstraw_cli.quantize import storage_bytes

    ep = 2
    model = build_model("glm52_tiny", dtype=torch.bfloat16, seed=0, quantize="nf4",
                        expert_slice=lambda num_experts: expert_bounds(num_experts, ep, 0))
    apply_lora(model, LoraConfig(rank=4, quantize="nf4"))
    named = [*model.named_parameters(), *model.named_buffers()]
    experts = sum(storage_bytes(t) for n, t in named if is_expert_param(n))
    p = plan("glm52_tiny", cp=2, ep=ep, prompt_tokens=100, dtype="bfloat16", lora_rank=4, quantize="nf4", **SMALL)
    assert p["weights_replicated"] == sum(storage_bytes(t) for n, t in named if not is_expert_param(n))
    assert p["weights_experts"] == experts
    full = plan("glm52_tiny", cp=2, ep=ep, prompt_tokens=100, dtype="bfloat16", lora_rank=4, **SMALL)
    assert p["weights_experts"] < full["weights_experts"] / 3


@pytest.mark.parametrize("num_tokens", [1, 129, 4000])
def test_pages_equal_the_model_accounting_and_cp_splits_them(num_tokens):
    model = build_model("glm52_tiny", dtype=torch.bfloat16)
    p = plan("glm52_tiny", prompt_tokens=num_tokens + 1, dtype="bfloat16", **SMALL)
    assert p["resident_detail"] == model.resident_bytes(num_tokens)
    # the cp ranks' contiguous shards: the first ranks one token more
    four = plan("glm52_tiny", cp=4, prompt_tokens=num_tokens + 1, dtype="bfloat16", **SMALL)
    assert four["resident_detail"] == model.resident_bytes(-(-num_tokens // 4))


def test_captured_pages_decode_buffers_and_state_gradient_are_the_tensors_built():
    torch.manual_seed(0)
    model = build_model("glm52_tiny")
    prompt = torch.randint(0, model.config.vocab_size, (301,))
    resident = model.capture(prompt, block_size=64, boundaries=True)
    p = plan(model.config, prompt_tokens=301, group_size=3, response_tokens=8, dtype="float32", block_size=64,
             gradient="exact")
    assert p["resident"] == resident.nbytes()["total"] and p["boundary_states"] == 0
    assert p["state_grad"] == StateGrad(resident).nbytes()
    decoder = model.decoder(resident, 3, 8)
    assert p["decode_buffers"] == _nbytes(t for layer in decoder.layers for t in (layer.latent_BSL, layer.rope_BSR,
                                                                                   layer.index_BSI) if t is not None)


@pytest.mark.parametrize("name, dtype, overrides, tokens, lora_rank", [
    ("glm52_tiny", torch.float32, {}, 200, 0),
    ("glm52_tiny", torch.float32, {}, 200, 4),
    # the mini shape's widths (index_topk 2048, 512 + 64 latent), a dense and a MoE layer, a small vocab
    pytest.param("glm52_mini", torch.bfloat16, dict(num_hidden_layers=2, vocab_size=512, n_routed_experts=8,
                                                    num_experts_per_tok=4), 128, 4, marks=pytest.mark.slow),
])
def test_response_graph_matches_graph_accounting(name, dtype, overrides, tokens, lora_rank):
    """The replay's saved bytes (GraphMemory's peak) within 5% of the plan's count (measured: 0.97-1.04)."""
    torch.manual_seed(0)
    model = build_model(name, dtype=dtype, **overrides)
    apply_lora(model, LoraConfig(rank=lora_rank))
    prompt = torch.randint(0, model.config.vocab_size, (100,))
    resident = model.capture(prompt, block_size=64)
    response = torch.randint(0, model.config.vocab_size, (tokens,))
    with GraphMemory(exclude=[*model.parameters(), *resident.tensors()]) as meter:
        model.logprobs(resident, response, grad=True)
    p = plan(model.config, prompt_tokens=100, group_size=2, response_tokens=tokens, lora_rank=lora_rank,
             dtype=str(dtype).removeprefix("torch."), kernels="reference")
    assert abs(p["response_graph"] / meter.peak_bytes - 1) < 0.05


def test_exact_walk_graph_matches_graph_accounting():
    torch.manual_seed(0)
    model = build_model("glm52_tiny")
    prompt, block = torch.randint(0, model.config.vocab_size, (301,)), 128
    resident = model.capture(prompt, block_size=block, boundaries=True)
    with GraphMemory(exclude=[*model.parameters(), *resident.tensors()]) as meter:
        model.prompt_backward(prompt, resident, StateGrad(resident), block)
    p = plan(model.config, prompt_tokens=301, group_size=2, response_tokens=8, block_size=block, dtype="float32",
             gradient="exact", kernels="reference")
    # measured 1.056: the block's own pages are counted apart from the layer outputs that hold them
    assert abs(p["block_graph"] / meter.peak_bytes - 1) < 0.08
    assert p["phases"]["prompt"] > p["phases"]["step"]


def test_glm5_target_lists_every_phase_and_parts_that_scale_as_they_should():
    """The issue's GLM-5 run: bf16 experts, then NF4; phases sum their parts; more ranks, fewer bytes."""
    p, q = plan("glm52", **TARGET), plan("glm52", quantize="nf4", **TARGET)
    assert set(p["phases"]) == {"capture", "score", "replay", "step", "rollout"}
    assert p["phases"]["replay"] == (p["weights"] + p["optimizer"] + p["resident"] + p["grads"] + p["response_graph"]
                                     + p["replay_transient"] + p["routing_records_replay"])
    # routing replay (on by default): per response token 8 expert ids (int16) in each of 75 MoE layers and a
    # 2,048-key selection (int32) in each of the 78 full indexer layers; replay_routing=false holds none
    per_token = 75 * 8 * 2 + 78 * 2048 * 4
    assert p["routing_records"] == TARGET["group_size"] * TARGET["response_tokens"] * per_token
    off = plan("glm52", replay_routing=False, **TARGET)
    assert off["routing_records"] == off["routing_records_replay"] == 0
    assert off["phases"]["replay"] == p["phases"]["replay"] - p["routing_records_replay"]
    # 256 / 32 = 8 experts per MoE layer: 75 MoE layers x 8 x 3 x 6144 x 2048 bf16
    assert p["weights_experts"] == 75 * 8 * 3 * 6144 * 2048 * 2
    assert q["weights_experts"] < p["weights_experts"] / 3.5 and q["peak"] < p["peak"]
    assert p["resident_detail"] == page_bytes(named_config("glm52"), -(-(2097152 - 1) // 32))
    # the CP capture gathers one full-indexer layer's pages of the whole prompt, twice
    assert p["cp_gather"] == 2 * (2097152 - 1) * (512 + 64 + 128) * 2
    half = plan("glm52", **{**TARGET, "cp": 16, "ep": 16})
    assert half["weights_experts"] == 2 * p["weights_experts"] and half["resident"] > 1.9 * p["resident"]
    with pytest.raises(ValueError, match="ep=3 does not divide the 256 routed experts"):
        plan("glm52", **{**TARGET, "cp": 3, "ep": 3})


def test_routing_records_live_on_the_host_and_only_the_rollout_grows_with_the_group():
    """The decode writes all G x R records on the device; after the rollout they are host memory, and scoring holds
    score_batch responses' rows on the device, a replay one response's, the exact walk none: past the rollout no
    phase grows with G."""
    per_token = 75 * 8 * 2 + 78 * 2048 * 4
    R = TARGET["response_tokens"]
    small, large = (plan("glm52", **{**TARGET, "group_size": g, "gradient": "exact"}) for g in (8, 64))
    off = plan("glm52", replay_routing=False, **{**TARGET, "group_size": 64, "gradient": "exact"})
    for phase in ("capture", "score", "replay", "prompt", "step"):
        assert large["phases"][phase] == small["phases"][phase], phase
    assert large["routing_records_host"] == large["routing_records"] == 64 * R * per_token
    assert large["routing_records_score"] == 8 * R * per_token and large["routing_records_replay"] == R * per_token
    assert large["phases"]["score"] - off["phases"]["score"] == 8 * R * per_token
    assert large["phases"]["replay"] - off["phases"]["replay"] == R * per_token
    assert large["phases"]["prompt"] == off["phases"]["prompt"]
    assert large["phases"]["rollout"] - off["phases"]["rollout"] == 64 * R * per_token
    assert f"routing records in host memory {large['routing_records_host'] / GIB:.3f} GiB" in " ".join(large["notes"])
    # the records' host bytes count against host_mem_gib
    assert plan("glm52", host_mem_gib=large["routing_records_host"] / GIB * 0.99,
                **{**TARGET, "group_size": 64})["fits"] is False


def test_longstraw_plan_glm52_prints_every_phase_and_the_split(capsys):
    from longstraw_cli.__main__ import main as longstraw

    args = ["plan", "model=glm52", "cp=32", "ep=32", "prompt_tokens=256K,2M", "group_size=8", "lora.rank=16",
            "gpu_mem_gib=131.3"]
    assert longstraw(args) == 0
    out = capsys.readouterr().out
    # the native rollout's log-probs serve as the old ones and kl_coef is 0: nothing is scored
    want = plan("glm52", gpu_mem_gib=131.3, scoring=False, **TARGET)
    assert want["score_activations"] == 0 and want["phases"]["score"] < plan("glm52", **TARGET)["phases"]["score"]
    assert f"{want['peak'] / GIB:.2f}" in out and "cp=32, ep=32" in out
    assert (f"phases: capture {want['phases']['capture'] / GIB:.2f}, score {want['phases']['score'] / GIB:.2f}, "
            f"replay {want['phases']['replay'] / GIB:.2f}") in out
    assert f"routed experts {want['weights_experts'] / GIB:.2f} GiB (8 of 256 per layer on this rank" in out
    longest = max_prompt_tokens("glm52", limit=8_388_608 - 16, gpu_mem_gib=131.3, scoring=False,
                                **{k: v for k, v in TARGET.items() if k != "prompt_tokens"})
    assert f"longest prompt that fits in 131.3 GiB: {longest} tokens" in out
    assert longstraw([*args, "lora.quantize=nf4"]) == 0
    assert "routed experts and decoder linears quantised to NF4" in capsys.readouterr().out


def test_offload_under_context_parallel_keeps_each_ranks_shard_on_the_host(capsys):
    """The paper's GLM layout: CP32/EP32 with capture.offload=cpu. Each rank's host holds its shard of the latent,
    rope and index pages (`host`, per rank); its GPU two layers' pages of the shard (one staged, the next in
    flight), so every training phase drops by the shard's pages less those two layers. The CP decode is eager
    (`StepDecoder`): it stages whole layers at every token and copies nothing for the rollout."""
    from longstraw_cli.__main__ import main as longstraw
    from longstraw_cli.plan.glm52 import layer_page_bytes

    on, off = (plan("glm52", offload=o, **TARGET) for o in ("none", "cpu"))
    cfg = named_config("glm52")
    shard = -(-(TARGET["prompt_tokens"] - 1) // 32)
    pages = page_bytes(cfg, shard)["total"]
    two_layers = 2 * max(layer_page_bytes(cfg, shard, 2))
    assert off["host"] == pages == on["resident"] and on["host"] == 0
    assert off["resident_device"] == two_layers
    for phase, nbytes in on["phases"].items():
        # the optimizer step holds no pages either way (dropped after the replays)
        assert off["phases"][phase] == nbytes - (0 if phase == "step" else pages - two_layers), phase
    assert off["rollout_copies"] == 0 and off["rollout"] == off["phases"]["rollout"]
    # one rank (cp = 1) copies whole layers for its rollout where the GPU has room; cp > 1 none
    mini = dict(prompt_tokens=65536, group_size=8, response_tokens=16, lora_rank=16, offload="cpu")
    assert plan("glm52_mini", **mini)["rollout_copies"] > 0 == plan("glm52_mini", cp=2, **mini)["rollout_copies"]
    assert plan("glm52", offload="cpu", host_mem_gib=pages / GIB * 0.99, **TARGET)["fits"] is False
    assert longstraw(["plan", "model=glm52", "cp=32", "ep=32", "prompt_tokens=2M", "group_size=8", "lora.rank=16",
                      "capture.offload=cpu"]) == 0
    out = capsys.readouterr().out
    assert f"offload=cpu: this rank's shard ({shard} tokens) in host memory {pages / GIB:.2f} GiB per rank" in out
    assert "longest prompt per placement: offload=none: " in out and ", offload=cpu: " in out


@pytest.mark.parametrize("model", ["glm52_mini", "qwen36_mini"])
def test_the_optimizer_step_holds_the_pages_only_when_reuse_keeps_them(model):
    """The trainer drops the prompt's resident state before the optimizer step (measured on the H200: the GLM-5 shape
    at 1M, 116.49 GiB at the step against 133.17 at the replay); capture.reuse_steps keeps it across steps."""
    common = dict(cp=1, prompt_tokens=65536, group_size=8, response_tokens=256, dtype="bfloat16")
    plain, reused = plan(model, **common), plan(model, reuse=True, **common)
    assert plain["phases"]["step"] == (plain["weights"] + plain["grads"] + plain["optimizer"]
                                       + plain["step_transient"] + plain.get("dequant", 0))
    assert reused["phases"]["step"] - plain["phases"]["step"] >= plain["resident"] > 0


@pytest.mark.parametrize("extra, scoring", [([], False), (["algo.kl_coef=0.01"], True), (["rollout=vllm"], True)])
def test_longstraw_plan_scores_only_what_the_trainer_scores(capsys, extra, scoring):
    """The score phase runs a forward for a KL reference or a rollout without our log-probs (vLLM); the native
    rollout's own log-probs otherwise serve as the old ones and the phase holds no activations."""
    from longstraw_cli.__main__ import main as longstraw

    assert longstraw(["plan", "model=glm52_mini", "prompt_tokens=64K", "group_size=8", "lora.rank=16", *extra]) == 0
    want = plan("glm52_mini", prompt_tokens=65536, group_size=8, response_tokens=16, lora_rank=16, scoring=scoring)
    assert (want["score_activations"] > 0) == scoring
    assert f"score {want['phases']['score'] / GIB:.2f}," in capsys.readouterr().out


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_plan_counts_the_decodes_concatenated_input_linears(lora_rank):
    """`decode_projections` is what glm52's decoder copies (its grouped input GEMMs): every layer's input
    groups without LoRA, the indexer's wk and wq_b with them on "full" layers; under LoRA's default targets only the
    groups none of whose linears is adapted; none under cp > 1 (the eager step decoder) or past a 16th of the GPU."""
    from longstraw_cli.models.projections import InProjections

    model = build_model("glm52_tiny", dtype=torch.bfloat16, device="cpu", seed=0)
    if lora_rank:
        apply_lora(model, LoraConfig(rank=lora_rank))
    resident = model.capture(torch.arange(40) % 200, block_size=16)
    decoder = model.decoder(resident, 2, 4)
    copied = sum(p.weight_NC.nbytes for proj in decoder.projections for p in (proj.x_in, proj.q_in, proj.mlp_in)
                 if isinstance(p, InProjections))
    planned = plan("glm52_tiny", prompt_tokens=40, group_size=2, response_tokens=4, lora_rank=lora_rank)
    assert planned["decode_projections"] == copied and (copied > 0) == (lora_rank == 0)
    assert plan("glm52_tiny", prompt_tokens=40, group_size=2, response_tokens=4, lora_rank=lora_rank,
                cp=2)["decode_projections"] == 0
    if copied:
        for sixteenths, planned_copies in ((16.0, copied), (15.9, 0)):
            assert plan("glm52_tiny", prompt_tokens=40, group_size=2, response_tokens=4, lora_rank=lora_rank,
                        gpu_mem_gib=sixteenths * copied / GIB)["decode_projections"] == planned_copies
