"""Native decode's pieces against their references (CPU): cascade attention over shared pages (split-KV with a
tail, empty parts), the graph-safe DSA top-k and dense experts, the rollout loop's stop checks, and decoding of
ids the tokenizer does not have."""

import collections
import functools
import time
import types

import pytest
import torch

from conftest import ids, random_model, rel_err
from longstraw_cli.lora import LoraConfig, apply_lora
from longstraw_cli.models import build_model
from longstraw_cli.models.core import StepDecoder
from longstraw_cli.models.glm52.experts import (
    dense_experts,
    grouped_experts,
    local_experts,
    pairs_by_expert,
    skinny_experts,
)
from longstraw_cli.models.projections import EachLinear, InProjections
from longstraw_cli.models.qwen36 import decode as qwen36_decode
from longstraw_cli.rollout.native import NativeConfig, SamplingConfig, generate
from longstraw_cli.tokenizer import ByteTokenizer
from longstraw_kernels import use_kernels
from longstraw_kernels.attention.decode import cascade_decode_attention, decode_pages_attention
from longstraw_kernels.attention.reference import naive_attention
from longstraw_kernels.dsa.topk import topk_lowest_position, topk_lowest_position_static, two_topk_positions
from longstraw_kernels.gdn import fla_gpu, triton_step


def randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.mark.parametrize("P, splits", [(1000, 7), (1000, 1), (63, 4), (5, 8), (0, None)])
def test_pages_attention_with_splits_equals_full_softmax(P, splits):
    B, Q, K, D = 3, 8, 2, 16
    q, k, v = randn(B, Q, D, seed=0), randn(P, K, D, seed=1), randn(P, K, D, seed=2)
    out, lse = decode_pages_attention(q, k, v, scale=D**-0.5, num_splits=splits)
    if P == 0:
        assert torch.equal(out, torch.zeros_like(q)) and torch.isneginf(lse).all()
        return
    no_keys = q.new_empty(B, 0, K, D)
    ref_out, ref_lse = naive_attention(q[:, None], k, v, no_keys, no_keys, scale=D**-0.5)
    assert rel_err(out, ref_out[:, 0]) < 1e-12
    assert rel_err(lse, ref_lse[..., 0]) < 1e-12


@pytest.mark.parametrize("P", [300, 0])
def test_cascade_equals_attention_over_pages_and_filled_response_slots(P):
    """Only the filled slots of the response buffer count; slot 5 onwards holds garbage that must be ignored."""
    B, Q, K, D, S, filled = 2, 4, 2, 8, 9, 5
    q, k, v = randn(B, Q, D, seed=3), randn(P, K, D, seed=4), randn(P, K, D, seed=5)
    k_resp, v_resp = randn(B, S, K, D, seed=6) * 50, randn(B, S, K, D, seed=7) * 50
    out = cascade_decode_attention(q, k, v, k_resp, v_resp, torch.tensor([filled]), scale=0.3)
    ref, _ = naive_attention(q[:, None], k, v, k_resp[:, :filled], v_resp[:, :filled], scale=0.3)
    assert rel_err(out, ref[:, 0]) < 1e-12


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_static_topk_equals_topk_lowest_position_on_ties(dtype):
    """32-bit scores and narrower take one top-k over packed keys, fp64 the two top-k's: the rule's positions either
    way, on exact ties, masked keys, -0.0 beside +0.0 (equal), negatives and infinities."""
    g = torch.Generator().manual_seed(0)
    # few distinct values: many exact ties, as the indexer's sums of ReLUs give (often at 0)
    scores = torch.randint(-2, 4, (3, 5, 300), generator=g).to(dtype)
    scores[0, 0, 100:] = float("-inf")
    scores[1, 0] = 0.0
    scores[1, 0, :5] = 1.0
    scores[1, 0, 10:200:3] = -0.0  # the 64th place falls among the zeros: -0.0 and +0.0 tie
    scores[1, 1] = torch.randn(300, generator=g).to(dtype) * 1e30
    scores[1, 1, ::7] = float("inf")
    scores[2, 2] = float("-inf")
    for k in (1, 7, 64, 150, 250, 300):  # 150, 250: the k-th place among negatives, -inf
        expected = topk_lowest_position(scores, k)
        assert torch.equal(topk_lowest_position_static(scores, k), expected), k
        assert torch.equal(two_topk_positions(scores, k), expected), k


def test_dense_experts_equal_the_chosen_experts_loop():
    E, C, I, N, k = 6, 16, 8, 5, 2
    x, gate_up, down = randn(N, C, seed=0), randn(E, 2 * I, C, seed=1), randn(E, C, I, seed=2)
    idx = torch.stack([torch.randperm(E, generator=torch.Generator().manual_seed(n))[:k] for n in range(N)])
    w = randn(N, k, seed=3).abs()
    assert rel_err(dense_experts(x, idx, w, gate_up, down), local_experts(x, idx, w, gate_up, down)) < 1e-12


def test_grouped_experts_are_the_chosen_experts_loop():
    """The static decode step's grouped experts (`grouped_experts`: every pair, no filter, counts by comparison)
    give `local_experts`' output exactly, an expert chosen by no token included (CPU fp32, where torch runs the
    grouped GEMM a group at a time)."""
    E, C, I, N, k = 6, 16, 8, 5, 2
    f32 = functools.partial(torch.randn, generator=torch.Generator().manual_seed(0))
    x, gate_up, down = f32(N, C), f32(E, 2 * I, C), f32(E, C, I)
    idx = torch.tensor([[0, 2], [2, 0], [3, 5], [5, 2], [0, 3]])  # expert 1 and 4 idle, 2 thrice
    w = f32(N, k).abs()
    assert torch.equal(pairs_by_expert(idx, 0, E, every_pair_local=True)[0], pairs_by_expert(idx, 0, E)[0])
    assert torch.equal(pairs_by_expert(idx, 0, E, every_pair_local=True)[1], pairs_by_expert(idx, 0, E)[1])
    try:
        grouped = grouped_experts(x, idx, w, gate_up, down)
    except (AttributeError, NotImplementedError, RuntimeError) as e:
        pytest.skip(f"this torch has no CPU torch._grouped_mm for fp32: {e}")
    assert torch.equal(grouped, local_experts(x, idx, w, gate_up, down))


def test_glm52_decode_takes_the_grouped_experts_where_they_serve(monkeypatch):
    """Where the grouped GEMMs serve (`experts_grouped`: bf16 on sm90+, B x k < E), every MoE layer of the static
    step goes through them, and the step's logits are the dense experts' (fp32, CPU)."""
    from longstraw_cli.models.glm52 import decode

    model = random_model("glm52_tiny", torch.float32)
    resident = model.capture(ids(50, 0), block_size=16)
    dense, grouped = model.decoder(resident, 2, 4), model.decoder(resident, 2, 4)
    assert not dense.experts_grouped  # CPU
    # on a GPU that takes them, only where the batch's pairs are fewer than the experts (glm52_tiny: k = 2 of 8)
    monkeypatch.setattr(decode, "grouped_mm_serves", lambda *a: True)
    assert [model.decoder(resident, B, 4).experts_grouped for B in (2, 3, 4, 5)] == [True, True, False, False]
    grouped.experts_grouped, calls = True, []
    monkeypatch.setattr(decode, "grouped_experts", lambda *a: calls.append(1) or grouped_experts(*a))
    try:
        logits = grouped.step()
    except (AttributeError, NotImplementedError, RuntimeError) as e:
        pytest.skip(f"this torch has no CPU torch._grouped_mm for fp32: {e}")
    moe_layers = sum(hasattr(layer.mlp, "experts_fn") for layer in model.model.layers)
    assert len(calls) == moe_layers > 0
    assert rel_err(logits, dense.step()) < 1e-5


# small blocks: I = 24 in two column tiles of 16, C = 80 in three K steps of 32 (the last ragged), and C's 5 tiles
SKINNY_SMALL = (16, 32, 4, 1)


@pytest.mark.parametrize("dtype, bound", [(torch.float32, 2e-6), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("N", [3, 8])
@pytest.mark.parametrize("config", [SKINNY_SMALL, None], ids=["small", "default"])
def test_skinny_experts_are_the_dense_experts(dtype, bound, N, config):
    """The decode linear kernel with an expert axis (`skinny_experts`, Triton's interpreter) gives `dense_experts`'
    output: fp32 to its rounding, bf16 against the fp64 dense experts to bf16's (the interpreter rounds to bf16
    toward zero: tests/kernels/test_decode_linear.py). Experts 1, 4 and 6 are chosen by no token."""
    E, C, I, k = 8, 80, 24, 2
    f32 = functools.partial(torch.randn, generator=torch.Generator().manual_seed(N))
    x, gate_up, down = f32(N, C), f32(E, 2 * I, C) / C**0.5, f32(E, C, I) / I**0.5
    chosen = torch.tensor([0, 2, 3, 5, 7])
    idx = torch.stack([chosen[torch.randperm(5, generator=torch.Generator().manual_seed(n))[:k]] for n in range(N)])
    w = f32(N, k).abs()
    got = skinny_experts(x.to(dtype), idx, w, gate_up.to(dtype), down.to(dtype), config=config)
    to = torch.float64 if dtype == torch.bfloat16 else dtype
    want = dense_experts(*(t.to(dtype).to(to) for t in (x,)), idx, w.to(to), *(t.to(dtype).to(to) for t in (gate_up,
                                                                                                           down)))
    assert got.dtype == dtype and got.shape == (N, C)
    assert rel_err(got, want) < bound


def test_skinny_experts_read_no_weight_of_an_expert_no_token_chose():
    """An expert no token chose is skipped before any of its weights is read: NaN there leaves the output finite
    and equal to the output with those weights zero, and its rows of the per-expert outputs are zeros."""
    from longstraw_kernels.linear.triton_skinny import decode_experts_triton

    E, C, I, N = 6, 48, 16, 4
    f32 = functools.partial(torch.randn, generator=torch.Generator().manual_seed(0))
    x, gate_up, down = f32(N, C), f32(E, 2 * I, C), f32(E, C, I)
    idx, w = torch.tensor([[0, 2], [2, 5], [5, 0], [2, 0]]), f32(N, 2).abs()
    clean = skinny_experts(x, idx, w, gate_up, down, config=SKINNY_SMALL)
    for t in (gate_up, down):
        t[[1, 3, 4]] = float("nan")
    assert torch.equal(skinny_experts(x, idx, w, gate_up, down, config=SKINNY_SMALL), clean)
    active = torch.tensor([1, 0, 1, 0, 0, 1], dtype=torch.int32)
    y_ENC = decode_experts_triton(x, gate_up, down, active, SKINNY_SMALL)
    assert torch.equal(y_ENC[[1, 3, 4]], torch.zeros(3, N, C)) and torch.isfinite(y_ENC).all()


def test_glm52_decode_takes_the_skinny_experts_where_they_serve(monkeypatch):
    """By default every MoE layer of the step goes through `skinny_experts` where it serves, with the dense experts'
    logits (fp32; Triton's interpreter); where it does not serve (CPU), or under kernels.decode_linear=torch, the
    grouped-or-dense rule stands."""
    from longstraw_cli.models.glm52 import decode
    from longstraw_kernels.linear import kernel_module

    pytest.importorskip("triton")
    model = random_model("glm52_tiny", torch.float32)
    resident = model.capture(ids(50, 0), block_size=16)
    assert not model.decoder(resident, 3, 4).experts_skinny  # CPU: the kernel does not serve
    # the CPU let through; the kernel's choice still checked (`kernel_module`: None under decode_linear=torch)
    monkeypatch.setattr(decode, "skinny_serves", lambda *a: kernel_module() is not None)
    skinny, calls = model.decoder(resident, 3, 4), []
    assert skinny.experts_skinny
    use_kernels(decode_linear="torch")
    dense = model.decoder(resident, 3, 4)
    assert not dense.experts_skinny
    monkeypatch.setattr(decode, "skinny_experts", lambda *a: calls.append(1) or skinny_experts(*a))
    for _ in range(2):
        want, got = dense.step(), skinny.step()
        assert rel_err(got, want) < 1e-5
        for decoder in (dense, skinny):
            decoder.tokens_B.copy_(want.argmax(-1))
    assert len(calls) == 2 * sum(hasattr(layer.mlp, "experts_fn") for layer in model.model.layers) > 0


def test_glm52_decode_attends_to_the_pages_and_the_response_keys_in_one_kernel(monkeypatch):
    """By default each layer of the step attends to the prompt's pages and the responses' own keys in one sparse
    attention (`sparse_mla_two_sources`; here the Triton kernel in Triton's interpreter): the logits of each source
    apart, merged (each layer's hook swapped for the same kernel per source), with every key selected (index_topk
    above the prompt's 40: the filled response slots too). A layer whose sparse attention hook is swapped attends
    through its hook, each source apart."""
    from longstraw_kernels.mla import dispatch, triton_sparse

    model = random_model("glm52_tiny", torch.float32, index_topk=64)
    resident = model.capture(ids(40, 3), block_size=16)
    monkeypatch.setattr(dispatch, "use_triton", lambda *a: True)
    launched = []
    forward = triton_sparse.sparse_mla_forward
    monkeypatch.setattr(triton_sparse, "sparse_mla_forward",
                        lambda *a, **kw: (launched.append("new" in kw), forward(*a, **kw))[1])
    fused, split = model.decoder(resident, 2, 6), model.decoder(resident, 2, 6)
    attentions = [layer.self_attn for layer in model.model.layers]

    def each_source_apart():
        """`split`'s step with every layer's hook swapped (the same kernel, called per source)."""
        for attn in attentions:
            attn.sparse_attention_fn = lambda *a, **kw: dispatch.sparse_mla_attention(*a, **kw)
        try:
            return split.step()
        finally:
            for attn in attentions:
                attn.sparse_attention_fn = dispatch.sparse_mla_attention

    for decoder in (split, fused):
        decoder.tokens_B.copy_(torch.tensor([5, 77]))  # the two responses differ from their first token on
    for step in range(4):
        with torch.no_grad():  # as the rollout runs it (a gradient asked takes each source apart)
            want, got = each_source_apart(), fused.step()
        assert rel_err(got, want) < 1e-5
        if step == 0:
            fused_first = got.clone()
        for decoder in (split, fused):
            decoder.tokens_B.copy_(want.argmax(-1))
    layers = len(model.model.layers)
    assert launched.count(True) == 4 * layers and launched.count(False) == 2 * 4 * layers
    hooked = []
    model.model.layers[1].self_attn.sparse_attention_fn = lambda *a, **kw: (
        hooked.append(1), dispatch.reference.sparse_mla_attention(*a, **kw))[1]
    launched.clear()
    hooked_decoder = model.decoder(resident, 2, 6)
    hooked_decoder.tokens_B.copy_(torch.tensor([5, 77]))
    with torch.no_grad():
        assert rel_err(hooked_decoder.step(), fused_first) < 1e-5
    assert len(hooked) == 2 and launched.count(True) == layers - 1


@torch.no_grad()
def test_glm52_decode_groups_the_linears_that_read_one_input(monkeypatch):
    """Each layer's attention input linears with the indexer's wk, q_b_proj with the indexer's wq_b, and the MLP's
    (or shared experts') gate and up as one GEMM each: the logits of every linear its own GEMM (fp64); one by one
    where LoRA wraps them or the copies would pass a 16th of the device's memory."""
    from longstraw_cli.models.glm52 import decode

    model = random_model("glm52_tiny", torch.float64)
    resident = model.capture(ids(50, 0), block_size=16)
    grouped = model.decoder(resident, 2, 5)
    monkeypatch.setattr(decode, "device_total_bytes", lambda device: 0)
    each = model.decoder(resident, 2, 5)
    monkeypatch.undo()
    assert all(isinstance(p, EachLinear) for proj in each.projections for p in (proj.x_in, proj.q_in, proj.mlp_in))
    sizes = []
    for layer, proj in zip(model.model.layers, grouped.projections):
        assert all(isinstance(p, InProjections) for p in (proj.x_in, proj.q_in, proj.mlp_in))
        sizes.append(len(proj.x_in.sizes))
        assert len(proj.x_in.sizes) == (3 if layer.self_attn.indexer is not None else 2)
    assert 3 in sizes and 2 in sizes  # "full" and "shared" indexer layers
    for decoder in (each, grouped):
        decoder.tokens_B.copy_(torch.tensor([5, 77]))
    for _ in range(4):
        want, got = each.step(), grouped.step()
        assert rel_err(got, want) < 1e-12
        for decoder in (each, grouped):
            decoder.tokens_B.copy_(want.argmax(-1))
    nbytes = sum(p.weight_NC.nbytes for proj in grouped.projections for p in (proj.x_in, proj.q_in, proj.mlp_in))
    for total, kind in ((16 * nbytes, InProjections), (16 * nbytes - 1, EachLinear)):
        monkeypatch.setattr(decode, "device_total_bytes", lambda device, total=total: total)
        assert all(isinstance(proj.x_in, kind) for proj in model.decoder(resident, 2, 5).projections)
    monkeypatch.undo()
    apply_lora(model, LoraConfig(rank=2))
    lora = model.decoder(resident, 2, 5)
    assert all(isinstance(proj.x_in, EachLinear) for proj in lora.projections)


@pytest.mark.parametrize("name", ["qwen36_tiny", "glm52_tiny"])
def test_stop_checks_every_k_tokens_give_the_same_rollout(name):
    """Looking at the stops every token or every 16 tokens changes when the loop ends, never the responses."""
    model = build_model(name, seed=0)
    resident = model.capture(torch.randint(0, 259, (40,), generator=torch.Generator().manual_seed(2)), block_size=16)
    cfg = SamplingConfig(max_new_tokens=30, stop_token_ids=tuple(range(0, 259, 5)))
    a = generate(model, resident, 4, cfg, torch.Generator().manual_seed(3), NativeConfig(stop_check_every=1))
    b = generate(model, resident, 4, cfg, torch.Generator().manual_seed(3), NativeConfig(stop_check_every=16))
    assert [r.tolist() for r in a.responses] == [r.tolist() for r in b.responses]
    assert all(torch.equal(x, y) for x, y in zip(a.logprobs, b.logprobs))
    assert a.decode_steps == max(len(r) for r in a.responses) <= b.decode_steps


def test_setup_time_covers_the_decoders_first_step(monkeypatch):
    """Rollout.setup_s (the trainer's time/decode_setup: compilation, graph capture) includes the first step's
    time and not the steps after it: a first step made 0.3 s slower shows in it, a later one does not."""
    model = build_model("qwen36_tiny", seed=0)
    resident = model.capture(torch.randint(0, 259, (40,), generator=torch.Generator().manual_seed(2)), block_size=16)
    build = model.decoder

    def slow_decoder(*args, **kwargs):
        decoder = build(*args, **kwargs)
        step, calls = decoder.step, []

        def step_once_slow():
            calls.append(None)
            if len(calls) in (1, 3):
                time.sleep(0.3)
            return step()
        decoder.step = step_once_slow
        return decoder

    monkeypatch.setattr(model, "decoder", slow_decoder)
    start = time.perf_counter()
    out = generate(model, resident, 2, SamplingConfig(max_new_tokens=6), torch.Generator().manual_seed(0))
    wall = time.perf_counter() - start
    assert out.decode_steps == 6 and 0.3 <= out.setup_s < 0.6 <= wall


@pytest.mark.parametrize("bad", [0, -3, 1.5, True])
def test_native_config_rejects_bad_stop_check(bad):
    with pytest.raises(ValueError, match="stop_check_every"):
        NativeConfig(stop_check_every=bad)


def test_ids_beyond_the_tokenizer_decode_as_replacement_characters():
    """A model's vocabulary may exceed its tokenizer's (padded embedding tables, random models): the policy can
    sample such ids, and decoding them must not crash the reward."""
    tok = ByteTokenizer()
    assert tok.decode([104, 105, 53224, 33, tok.eos_token_id, -1]) == "hi\ufffd!\ufffd"


@torch.no_grad()
def test_qwen36_decode_runs_each_layers_input_linears_as_one_gemm_where_they_are_plain(monkeypatch):
    """Plain linears: each layer's mixer inputs and the MLP's gate and up are one product over concatenated weights,
    equal to the linears one by one (the whole decode against the layers' own paths: the test below). LoRA's
    wrapped linears, and all where the copies would pass a 16th of the device's memory, run one by one."""
    model = random_model("qwen36_tiny", torch.float64)
    resident = model.capture(ids(50, 0), block_size=16)
    decoder = model.decoder(resident, 2, 4)
    x = torch.randn(2, 1, model.config.hidden_size, dtype=torch.float64)
    for mixer_in, mlp_in in decoder.projections:
        for fused in (mixer_in, mlp_in):
            assert isinstance(fused, InProjections)
            assert len(fused.sizes) in (2, 3, 4) and fused.weight_NC.shape[0] == sum(fused.sizes)
    for layer, (mixer_in, mlp_in) in zip(model.model.layers, decoder.projections):
        gate, up = mlp_in(x)
        assert rel_err(gate, layer.mlp.gate_proj(x)) < 1e-14 and rel_err(up, layer.mlp.up_proj(x)) < 1e-14
        first = layer.self_attn.q_proj if layer.is_attention else layer.linear_attn.in_proj_qkv
        assert rel_err(mixer_in(x)[0], first(x)) < 1e-14
    # over offloaded pages too (an offloaded run equals an on-device one bit for bit: tests/e2e/test_offload_cli.py)
    offloaded = model.decoder(model.capture(ids(50, 0), block_size=16, offload="cpu"), 2, 4)
    assert all(isinstance(p, InProjections) for pair in offloaded.projections for p in pair)
    # copies past a 16th of the device's memory: none made (a CPU device has no limit of its own)
    nbytes = qwen36_decode.fused_bytes(model)
    assert nbytes == sum(p.weight_NC.nbytes for pair in decoder.projections for p in pair)
    for total, fused in ((16 * nbytes, InProjections), (16 * nbytes - 1, EachLinear)):
        monkeypatch.setattr(qwen36_decode, "device_total_bytes", lambda device, total=total: total)
        assert all(isinstance(p, fused) for pair in model.decoder(resident, 2, 4).projections for p in pair)
    apply_lora(model, LoraConfig(rank=2))
    decoder = model.decoder(resident, 2, 4)
    assert all(isinstance(p, EachLinear) for pair in decoder.projections for p in pair)


@pytest.mark.parametrize("name", ["qwen36_tiny", "glm52_tiny"])
def test_static_decoder_equals_the_layer_paths_decode(name):
    """The static-shaped decoder (rollout's default) and the eager decode through each layer's `decode_step`
    path (what glm52 under context parallel uses) sample the same tokens with the same log-probs (fp64)."""
    model = random_model(name, torch.float64)
    resident = model.capture(ids(50, 0), block_size=16)
    cfg = SamplingConfig(max_new_tokens=12)
    static = generate(model, resident, 3, cfg, torch.Generator().manual_seed(4))
    model.decoder = functools.partial(StepDecoder, model)
    eager = generate(model, resident, 3, cfg, torch.Generator().manual_seed(4))
    assert [r.tolist() for r in static.responses] == [r.tolist() for r in eager.responses]
    for a, b in zip(static.logprobs, eager.logprobs):
        assert rel_err(a, b) < 1e-10


def test_qwen36_decode_through_the_gdn_step_kernels_equals_the_references(monkeypatch):
    """qwen36's decoder with GDN's two decode kernels (`triton_step.py`, Triton's interpreter on CPU: the dispatch
    takes them as on CUDA), fed the model's own views (the fused input GEMM's split, the conv's split into heads,
    the parameters), against the same decoder on the torch references: the same logits over a few steps (fp32),
    and every kernel called once a GDN layer and step."""
    model = random_model("qwen36_tiny", torch.float32)
    resident = model.capture(ids(50, 0), block_size=16)
    reference, kernels = model.decoder(resident, 3, 4), model.decoder(resident, 3, 4)
    calls = collections.Counter()

    def counted(name):
        fn = getattr(triton_step, name)
        return lambda *args, **kwargs: calls.update([name]) or fn(*args, **kwargs)

    taking = types.SimpleNamespace(**{n: getattr(triton_step, n) for n in ("supported", "conv_supported")},
                                   **{n: counted(n) for n in ("gdn_decode_triton", "conv_step_triton")})
    steps, gdn_layers = 3, sum(not layer.is_attention for layer in model.model.layers)
    for _ in range(steps):
        want = reference.step()
        with monkeypatch.context() as patch:
            patch.setattr(fla_gpu, "_step_module", lambda x: taking)
            got = kernels.step()
        assert rel_err(got, want) < 1e-5
        for decoder in (reference, kernels):
            decoder.tokens_B.copy_(want.argmax(-1))
    assert calls == {"gdn_decode_triton": steps * gdn_layers, "conv_step_triton": steps * gdn_layers}


@pytest.mark.parametrize("copies", [True, False])
def test_qwen36_decode_through_the_linear_kernel_equals_the_modules(monkeypatch, copies):
    """qwen36's decoder with every layer's linears through the decode linear kernel (`linear/triton_skinny.py`,
    Triton's interpreter on CPU, taken as on CUDA: norms in the input linears, silu * up and the residual adds in
    their epilogues, GDN's gated output norm in its out_proj's prologue), against the same decoder on the modules:
    the same logits over a few steps (fp32); four launches a layer where the input groups are concatenated copies,
    and where they are not, one per input linear (GDN 4, attention 3) and three more."""
    from longstraw_cli.models.qwen36 import decode as qwen36_decode
    from longstraw_kernels.linear import triton_skinny

    model = random_model("qwen36_tiny", torch.float32)
    resident = model.capture(ids(50, 0), block_size=16)
    if not copies:  # past FUSED_SHARE: each input linear reads its own weight
        monkeypatch.setattr(qwen36_decode, "device_total_bytes", lambda device: 1)
    reference = model.decoder(resident, 3, 4)
    calls = collections.Counter()

    def counted(x, w, **kwargs):
        calls.update([tuple(k for k, v in kwargs.items() if v is not None and k != "eps")])
        return triton_skinny.decode_linear_triton(x, w, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(qwen36_decode, "kernel_entry", lambda x, *weights: counted)
        kernels = model.decoder(resident, 3, 4)
    assert all(isinstance(linears, qwen36_decode.KernelLinears) for linears in kernels.linears)
    assert all(isinstance(linears, qwen36_decode.ModuleLinears) for linears in reference.linears)
    steps = 3
    for _ in range(steps):
        want, got = reference.step(), kernels.step()
        assert rel_err(got, want) < 1e-5
        for decoder in (reference, kernels):
            decoder.tokens_B.copy_(want.argmax(-1))
    layers = len(model.model.layers)
    gdn = sum(not layer.is_attention for layer in model.model.layers)
    inputs = layers if copies else 4 * gdn + 3 * (layers - gdn)
    # GDN's output norm in its out_proj's prologue (heads of 16 at qwen36_tiny)
    assert all(linears.gated is not layer.is_attention for linears, layer in zip(kernels.linears, model.model.layers))
    assert calls == {("norm_K",): steps * inputs, ("residual",): steps * (2 * layers - gdn),
                     ("gate", "gate_norm_V", "residual"): steps * gdn, ("up_NK", "norm_K"): steps * layers}


def test_offloaded_decode_keeps_latent_pages_on_the_host_and_moves_index_keys_once():
    """Decode over offloaded pages never stages whole layers: the decoder holds device copies of the index keys
    (made once) and the host's own latent and rope pages, from which sparse attention gathers selected rows."""
    model = random_model("glm52_tiny")
    resident = model.capture(ids(70, 9), block_size=16, offload="cpu")
    decoder = model.decoder(resident, 2, 8)
    assert not decoder.graph_safe
    for host, used in zip(resident.layers, decoder.pages):
        assert used.latent_PL is host.latent_PL and used.rope_PR is host.rope_PR
        if host.index_PI is None:
            assert used.index_PI is None
        else:
            assert used.index_PI is not host.index_PI and torch.equal(used.index_PI, host.index_PI)
