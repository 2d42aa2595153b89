"""The decode's fused router (longstraw_kernels/moe, Triton's interpreter on CPU; on a GPU compiled) against the
model's `TopkRouter` (every group kept): the same experts in the same order, the same weights; glm52's decode through
it (the default where it serves) gives the module path's logits and routing records (kernels.router=torch)."""

import dataclasses
import logging

import pytest
import torch
import torch.nn.functional as F

from conftest import ids, random_model, rel_err
from longstraw_cli.models.glm52 import decode
from longstraw_cli.models.glm52.config import NAMED_CONFIGS
from longstraw_cli.models.glm52.model import TopkRouter
from longstraw_cli.models.glm52.routing import RoutingReplay
from longstraw_cli.rollout.native import NativeConfig, SamplingConfig, generate
from longstraw_kernels import use_kernels

pytest.importorskip("triton")
from longstraw_kernels.moe import route_select, route_serves  # noqa: E402
from longstraw_kernels.moe.triton_route import route_select_triton  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def router(E, k, C=64, norm=True, scaling=2.5, seed=0):
    cfg = dataclasses.replace(NAMED_CONFIGS["glm52_mini"], hidden_size=C, n_routed_experts=E, num_experts_per_tok=k,
                              n_group=1, topk_group=1, norm_topk_prob=norm, routed_scaling_factor=scaling)
    torch.manual_seed(seed)
    gate = TopkRouter(cfg)
    gate.weight.data.normal_(0, 0.5)
    gate.e_score_correction_bias.normal_(0, 0.1)
    return gate.to(DEVICE)


# glm52_mini's 32 experts top-4, GLM-5's 256 top-8, 20 (not a power of two) top-3, k = E; one token to 16
@pytest.mark.parametrize("E,k", [(32, 4), (256, 8), (20, 3), (8, 8)])
@pytest.mark.parametrize("N", [1, 8, 16])
@pytest.mark.parametrize("norm", [True, False])
def test_fused_router_is_the_routers_choice_and_weights(E, k, N, norm):
    gate = router(E, k, norm=norm, seed=E + N)
    x_NC = torch.randn(N, 64, device=DEVICE)
    want_idx, want_w = gate(x_NC)
    logits_NE = F.linear(x_NC, gate.weight)
    idx_Nk, w_Nk = route_select_triton(logits_NE, gate.e_score_correction_bias, k, norm, 2.5)
    assert idx_Nk.dtype == torch.int64 and w_Nk.dtype == torch.float32
    assert torch.equal(idx_Nk, want_idx)
    assert torch.allclose(w_Nk, want_w, rtol=1e-6, atol=1e-7)


def test_ties_take_the_lowest_expert_first_and_bias_chooses_but_does_not_weigh():
    # experts 1, 3 and 6 tie at the top: the lowest first; a bias moves expert 7 into the choice, its weight is its
    # unbiased score
    logits_NE = torch.zeros(1, 8, device=DEVICE)
    logits_NE[0, [1, 3, 6]] = 2.0
    bias_E = torch.zeros(8, device=DEVICE)
    bias_E[7] = 5.0
    idx_Nk, w_Nk = route_select_triton(logits_NE, bias_E, 3, False, 1.0)
    assert idx_Nk.tolist() == [[7, 1, 3]]
    assert torch.allclose(w_Nk, torch.sigmoid(torch.tensor([[0.0, 2.0, 2.0]], device=DEVICE)))
    assert route_select_triton(logits_NE[:0], bias_E, 3, True, 1.0)[0].shape == (0, 3)


def test_serves_fp32_logits_on_cuda_only():
    logits_NE = torch.zeros(8, 32)
    assert not route_serves(logits_NE, 4)  # CPU
    if torch.cuda.is_available():
        assert route_serves(logits_NE.cuda(), 4) and not route_serves(logits_NE.cuda().double(), 4)
        assert not route_serves(torch.zeros(8, 2048, device="cuda"), 4)


def test_glm52_decode_takes_the_fused_router_where_it_serves(monkeypatch, caplog):
    """By default every MoE layer of the decode routes through `fused_route` where it serves: the same logits as
    the router module's decode (kernels.router=torch; fp32) and the same routing records; not where a group is
    masked (glm52_tiny's own 1 of 2 groups: said on CUDA only, where the kernel would run)."""
    model = random_model("glm52_tiny", torch.float32, topk_group=2)
    resident = model.capture(ids(50, 0), block_size=16)
    assert not model.decoder(resident, 3, 4).router_fused  # the CPU: route_serves says no
    monkeypatch.setattr(decode, "route_serves", lambda *a: True)
    calls = []
    monkeypatch.setattr(decode, "route_select", lambda *a: calls.append(1) or route_select(*a))
    fused = model.decoder(resident, 3, 4)
    assert fused.router_fused
    use_kernels(router="torch")
    plain = model.decoder(resident, 3, 4)
    assert not plain.router_fused
    for _ in range(2):
        want, got = plain.step(), fused.step()
        assert rel_err(got, want) < 1e-6
        for decoder in (plain, fused):
            decoder.tokens_B.copy_(want.argmax(-1))
    moe_layers = sum(hasattr(layer.mlp, "experts_fn") for layer in model.model.layers)
    assert len(calls) == 2 * moe_layers > 0
    # recording through the fused router: the records equal the module's (greedy, eager)
    sampling, native = SamplingConfig(temperature=0, max_new_tokens=6), NativeConfig(cuda_graph=False)
    rollouts = {}
    for choice in ("torch", "auto"):
        use_kernels(router=choice)
        rollouts[choice] = generate(model, resident, 3, sampling, native=native, routing=RoutingReplay())
    for want, got in zip(rollouts["torch"].routing.tensors(), rollouts["auto"].routing.tensors()):
        assert torch.equal(want, got)
    assert len(calls) > 2 * moe_layers
    grouped = random_model("glm52_tiny", torch.float32)
    use_kernels(router="auto")
    decode.say_once.cache_clear()
    assert not grouped.decoder(grouped.capture(ids(50, 0), block_size=16), 3, 4).router_fused
    assert "fused kernel does not serve" not in caplog.text  # on the CPU nothing to say


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_compiled_decode_step_with_the_fused_router(monkeypatch, caplog):
    """glm52_mini at 4 layers, bf16: the decode step compiled and replayed as a CUDA graph with the fused router
    (one opaque op in the graph) gives the router module's step within bf16 noise; the kernel at GLM-5's 256
    experts picks what the router picks."""
    from longstraw_cli.models import build_model
    from longstraw_cli.rollout.native import GraphedStep

    model = build_model("glm52_mini", dtype=torch.bfloat16, device="cuda", seed=0, num_hidden_layers=4)
    prompt = torch.randint(0, 250, (4096,), generator=torch.Generator().manual_seed(0)).cuda()
    resident = model.capture(prompt, block_size=4096)
    logits = {}
    for choice in ("torch", "auto"):
        use_kernels(router=choice)
        decoder = model.decoder(resident, 8, 16)
        assert decoder.router_fused == (choice == "auto")
        decoder.tokens_B.copy_(torch.arange(8, device="cuda") * 7)
        step = GraphedStep(decoder, compile=True)
        with torch.no_grad():  # as the rollout runs it (`generate`)
            step()
            logits[choice] = step().float().clone()
    assert rel_err(logits["auto"], logits["torch"]) < 2e-2
    # a router that masks groups: the module runs, and the decode says so once
    decode.say_once.cache_clear()
    grouped = build_model("glm52_tiny", dtype=torch.bfloat16, device="cuda", seed=0)
    with caplog.at_level(logging.WARNING):
        assert not grouped.decoder(grouped.capture(prompt[:64], block_size=64), 2, 4).router_fused
    assert "decode router: the fused kernel does not serve (it needs every group kept, topk_group=1" in caplog.text
    gate = router(256, 8)
    x_NC = torch.randn(8, 64, device="cuda")
    assert torch.equal(route_select(F.linear(x_NC, gate.weight), gate.e_score_correction_bias, 8, True, 2.5)[0],
                       gate(x_NC)[0])
