"""GPU paths against their torch references (skipped without CUDA): flash replay attention (outputs, LSE and
gradients), the decode's response attention, linears and sampling, fla's GDN forward, and the qwen36 model's capture +
logprobs on CUDA in bf16."""

import pytest
import torch

from conftest import randomize_, rel_err
from longstraw_kernels import use_kernels

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def attention_inputs(B, R, S, P, Q, K, D, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g, device="cuda", dtype=torch.float32).to(dtype)

    return randn(B, R, Q, D), randn(P, K, D), randn(P, K, D), randn(B, S, K, D), randn(B, S, K, D)


def check_replay_attention(backend, page_ranges, B, R, S, P, Q, K, D, monkeypatch):
    """Forward through an aten kernel, backward with the global out and lse; all gradients (queries, new keys and
    pages) against the fp64 reference on the same bf16 inputs. -> the pages' backward calls of triton_page_tiles."""
    from longstraw_kernels.attention import flash, replay_attention
    from longstraw_kernels.attention import triton_page_tiles as tpt
    from longstraw_kernels.attention.reference import replay_attention as reference

    original, calls = tpt.page_backward, []

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return original(*args, **kwargs)

    monkeypatch.setattr(tpt, "page_backward", spy)
    monkeypatch.setattr(tpt, "DEFAULT_CHUNK", 1024)  # several chunks of tiles (5,000 pages: 4 and a rest)
    if page_ranges:
        monkeypatch.setattr(flash, "PAGE_SPLIT_MIN_PAGES", 1000)
    use_kernels(attention=backend)
    monkeypatch.setattr(flash, "BACKWARD_PAGE_CHUNK", 1000)  # several page chunks in the kernel's own backward
    flash._warn_cudnn_fallback.cache_clear()
    q, kp, vp, kn, vn = attention_inputs(B, R, S, P, Q, K, D, torch.bfloat16)
    assert flash.flash_supported(q, kp, kn)
    for t in (q, kp, vp, kn, vn):
        t.requires_grad_(True)
    out, lse = replay_attention(q, kp, vp, kn, vn, scale=D**-0.5, return_lse=True)
    # the reference on the same bf16 inputs, computed in fp64
    q64, kp64, vp64, kn64, vn64 = (t.detach().double().requires_grad_(True) for t in (q, kp, vp, kn, vn))
    ref_out, ref_lse = reference(q64, kp64, vp64, kn64, vn64, scale=D**-0.5, return_lse=True)
    assert rel_err(out, ref_out) < 2e-2 and rel_err(lse, ref_lse) < 1e-3
    dout = torch.randn_like(ref_out)
    (out.float() * dout).sum().backward()
    (ref_out * dout).sum().backward()
    # the requested kernels ran, forward and backward: cuDNN did not refuse a shape and fall back
    assert flash._warn_cudnn_fallback.cache_info().misses == 0
    for got, want in ((q.grad, q64.grad), (kp.grad, kp64.grad), (vp.grad, vp64.grad), (kn.grad, kn64.grad),
                      (vn.grad, vn64.grad)):
        if want is not None and want.norm() > 0:
            assert rel_err(got, want) < 3e-2
    return calls


@pytest.mark.parametrize("page_ranges", [False, True])
@pytest.mark.parametrize("backend", ["flash", "cudnn"])
@pytest.mark.parametrize("B, R, S, P, Q, K, D", [
    (1, 64, 64, 5000, 16, 2, 256),   # replay: one response against the prompt, GQA 8:1, head dim 256
    (3, 33, 33, 777, 4, 2, 128),     # a batch of responses
    (1, 1, 17, 999, 24, 4, 256),     # decode: one query, 17 response keys
    (1, 128, 0, 4096, 16, 2, 256),   # pages only (a context-parallel shard)
    (1, 200, 200, 0, 16, 2, 256),    # first capture block: no pages yet
])
def test_flash_replay_attention_matches_reference(backend, page_ranges, B, R, S, P, Q, K, D, monkeypatch):
    """Each aten kernel's forward; the new keys' backward through the same kernel's backward (cuDNN's, or aten
    flash's) and the pages' through triton_page_tiles (exact mode's walk), against the fp64 reference.
    page_ranges: ranges of at least 1,000 pages, so that the pages' forward runs as a batch of ranges
    (`flash.attend_pages`) wherever the rows give few programs (5,000 pages: 5 ranges; 4,096: 4 and a rest)."""
    calls = check_replay_attention(backend, page_ranges, B, R, S, P, Q, K, D, monkeypatch)
    assert calls == ([(K, B * (Q // K) * R, D)] if P else [])


@pytest.mark.parametrize("backend", ["flash", "cudnn"])
def test_pages_backward_through_the_kernels_own_backward_matches_reference(backend, monkeypatch):
    """Pages of a head dim the Triton page kernels do not take: their backward is the forward kernel's own, over
    chunks of pages (`flash.attend_pages_backward`, here 5 chunks), and matches the fp64 reference as well."""
    from longstraw_kernels.attention import flash

    monkeypatch.setattr(flash, "triton_pages_supported", lambda *pages: False)
    assert check_replay_attention(backend, False, 1, 64, 64, 5000, 16, 2, 256, monkeypatch) == []


@pytest.mark.parametrize("B, R, S, P, Q, K, D", [
    (1, 64, 64, 5000, 16, 2, 256),   # several page ranges (splits) per row block
    (2, 33, 33, 777, 4, 2, 128),     # ragged rows and pages, a batch
    (1, 300, 300, 70000, 24, 4, 256),  # the 27B shape's heads
])
def test_frozen_pages_dq_through_triton_matches_reference(B, R, S, P, Q, K, D, monkeypatch):
    """Pages without a gradient (response-only replay): their share of dq comes from triton_page_dq, and q's and
    the new keys' gradients match the fp64 reference as they do through aten's flash backward."""
    from longstraw_kernels.attention import replay_attention
    from longstraw_kernels.attention import triton_page_dq as tpd
    from longstraw_kernels.attention.reference import replay_attention as reference

    original, calls = tpd.page_dq, []

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return original(*args, **kwargs)

    monkeypatch.setattr(tpd, "page_dq", spy)
    q, kp, vp, kn, vn = attention_inputs(B, R, S, P, Q, K, D, torch.bfloat16, seed=1)
    leaves = [t.requires_grad_(True) for t in (q, kn, vn)]
    out = replay_attention(q, kp, vp, kn, vn, scale=D**-0.5)
    q64, kn64, vn64 = (t.detach().double().requires_grad_(True) for t in leaves)
    ref = reference(q64, kp.double(), vp.double(), kn64, vn64, scale=D**-0.5)
    dout = torch.randn_like(ref)
    got = torch.autograd.grad(out.float(), leaves, dout.float())
    want = torch.autograd.grad(ref, (q64, kn64, vn64), dout)
    assert calls == [(K, B * (Q // K) * R, D)]
    for g, w in zip(got, want):
        assert rel_err(g, w) < 2e-2


def test_flash_replay_attention_lse_cotangent_takes_the_reference_backward():
    """A loss through the lse (as context-parallel merges use it) is differentiated exactly."""
    from longstraw_kernels.attention import replay_attention
    from longstraw_kernels.attention.reference import replay_attention as reference

    q, kp, vp, kn, vn = attention_inputs(2, 16, 16, 300, 8, 2, 128, torch.bfloat16)
    q.requires_grad_(True)
    out, lse = replay_attention(q, kp, vp, kn, vn, scale=0.1, return_lse=True)
    (out.float().sum() + lse.sum()).backward()
    q64 = q.detach().double().requires_grad_(True)
    ref_out, ref_lse = reference(q64, kp.double(), vp.double(), kn.double(), vn.double(), scale=0.1,
                                 return_lse=True)
    (ref_out.sum() + ref_lse.sum()).backward()
    assert rel_err(q.grad, q64.grad) < 3e-2


@pytest.mark.parametrize("filled", [1, 700, 16384])
def test_decode_response_attention_reads_the_filled_slots(filled):
    """The decode step's response part at qwen36_mini's shape (8 responses, 16 query heads on 2 kv heads, head dim
    256, 16,384 slots): the Triton kernel (dispatched on CUDA bf16), compiled with the capacity a dynamic size as
    the decode step compiles it, against the fp64 reference over the filled slots; the empty slots hold garbage."""
    from longstraw_kernels.attention import decode

    B, Q, K, D, S = 8, 16, 2, 256, 16384
    g = torch.Generator(device="cuda").manual_seed(filled)
    q = torch.randn(B, Q, D, device="cuda", generator=g).bfloat16()
    k, v = (torch.randn(B, S, K, D, device="cuda", generator=g).bfloat16() for _ in range(2))
    k[:, filled:], v[:, filled:] = 1e4, float("nan")
    filled_1 = torch.tensor([filled], device="cuda")
    assert decode._response_triton(q, k)

    def attention(q, k, v):  # the response part as the decode step takes it: its partials, merged
        return decode.merge_partials(*decode.response_partials(q, k, v, filled_1, scale=D**-0.5), q.dtype)

    out, lse = attention(q, k, v)
    ref_out, ref_lse = attention(q.double(), k[:, :filled].double(), v[:, :filled].double())
    assert rel_err(out, ref_out) < 1e-2 and rel_err(lse, ref_lse) < 1e-4
    torch._dynamo.mark_dynamic(k, 1)
    torch._dynamo.mark_dynamic(v, 1)
    c_out, c_lse = torch.compile(attention, fullgraph=True)(q, k, v)
    assert rel_err(c_out, ref_out) < 1e-2 and rel_err(c_lse, ref_lse) < 1e-4


@pytest.mark.parametrize("temperature", [1.0, 0.6, 0.0])
def test_decode_sampling_kernel_equals_the_reference(temperature):
    """The decode step's sampling at qwen36_mini's vocabulary (8 responses, 248,320 logits, fp32 as the step gives
    them): the Triton kernel (dispatched on CUDA) picks the reference's token from the same noise and gives its
    log-prob and the entropy, written into a column of [B, R] buffers."""
    from longstraw_kernels import sampling

    B, V = 8, 248_320
    g = torch.Generator(device="cuda").manual_seed(int(temperature * 10))
    logits = torch.randn(B, V, device="cuda", generator=g) * 4
    race = None if temperature == 0 else torch.empty_like(logits).exponential_(generator=g)
    assert sampling._kernel(logits, 1.0) is not None
    outs = []
    for run in (sampling.race_sample, sampling.race_sample_reference):
        tokens, logp, entropy = (torch.zeros(B, 5, device="cuda", dtype=t) for t in (torch.long, torch.float32,
                                                                                      torch.float32))
        run(logits, race, temperature, 1.0, tokens[:, 2], logp[:, 2], entropy[:, 2])
        outs.append((tokens, logp, entropy))
    (tokens, logp, entropy), (want_tokens, want_logp, want_entropy) = outs
    assert torch.equal(tokens, want_tokens)
    assert rel_err(logp[:, 2], want_logp[:, 2]) < 1e-5 and rel_err(entropy[:, 2], want_entropy[:, 2]) < 1e-5


@pytest.mark.parametrize("N, K, norm, glu, residual", [
    (6176, 2048, True, False, False),   # qwen36_mini's GDN input linears, after the input norm
    (2048, 2048, False, False, True),   # GDN's out_proj, then the residual
    (6144, 2048, True, True, False),    # the MLP's gate and up after the norm, silu(gate) * up
    (2048, 6144, False, False, True),   # down, then the residual
    (4096, 5120, True, False, False),   # a 27B-shaped input (K of 5,120: 20 K steps)
])
def test_decode_linear_kernel_is_as_close_to_fp64_as_the_modules(N, K, norm, glu, residual):
    """The fused decode linear (dispatched on CUDA for 8 bf16 rows) against fp64: within the error of the model's
    modules run one after another in bf16 (the reference), and at most one bf16 rounding from it."""
    from longstraw_kernels import linear

    g = torch.Generator(device="cuda").manual_seed(N + K)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device="cuda") * scale).to(torch.bfloat16)

    x, w, up = randn(8, 1, K), randn(N, K, scale=K**-0.5), randn(N, K, scale=K**-0.5) if glu else None
    norm_K, r = randn(K, scale=0.3) if norm else None, randn(8, 1, N) if residual else None
    assert linear.kernel_serves(x, w)
    got = linear.decode_linear(x, w, up_NK=up, norm_K=norm_K, residual=r)
    want = linear.decode_linear_reference(x, w, up_NK=up, norm_K=norm_K, residual_MN=r)

    def double(t):
        return None if t is None else t.double()

    oracle = linear.decode_linear_reference(double(x), double(w), up_NK=double(up), norm_K=double(norm_K),
                                            residual_MN=double(r))
    assert got.shape == want.shape == (8, 1, N)
    assert rel_err(got, oracle) < 1.5 * rel_err(want, oracle) + 1e-3
    assert rel_err(got, want) < 1e-2


@pytest.mark.parametrize("N, K, norm, glu, residual", [
    (2048, 6144, False, False, True),   # down, then the residual
    (6144, 2048, True, True, False),    # gate and up after the norm (its sums of squares split too)
    (6176, 2048, True, False, False),   # the GDN input linears after the norm
])
def test_decode_linear_split_over_k_is_exact_and_the_same_every_launch(N, K, norm, glu, residual):
    """K in 2 to 8 parts, each tile's parts added by the last to arrive (an atomic count): within the modules' error
    of fp64, and bit for bit the same over repeated launches (the parts are added in order, whichever is last)."""
    from longstraw_kernels import linear
    from longstraw_kernels.linear.triton_skinny import decode_linear_triton

    g = torch.Generator(device="cuda").manual_seed(N * K)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device="cuda") * scale).to(torch.bfloat16)

    x, w, up = randn(8, 1, K), randn(N, K, scale=K**-0.5), randn(N, K, scale=K**-0.5) if glu else None
    norm_K, r = randn(K, scale=0.3) if norm else None, randn(8, 1, N) if residual else None
    want = linear.decode_linear_reference(x, w, up_NK=up, norm_K=norm_K, residual_MN=r)
    oracle = linear.decode_linear_reference(*(None if t is None else t.double() for t in (x, w)),
                                            up_NK=None if up is None else up.double(),
                                            norm_K=None if norm_K is None else norm_K.double(),
                                            residual_MN=None if r is None else r.double())
    for split in (2, 3, 4, 8):
        config = (32, 256, 4, 4, split)
        got = decode_linear_triton(x, w, up_NK=up, norm_K=norm_K, residual=r, config=config)
        assert rel_err(got, oracle) < 1.5 * rel_err(want, oracle) + 1e-3, split
        for _ in range(20):
            assert torch.equal(decode_linear_triton(x, w, up_NK=up, norm_K=norm_K, residual=r, config=config), got)


@pytest.mark.parametrize("config", [None, (64, 128, 4, 4, 1)])
def test_decode_linear_gated_norm_prologue_is_as_close_to_fp64_as_the_modules(config):
    """qwen36_mini's GDN output: the gated norm (16 heads of 128) in out_proj's prologue, the residual after, at the
    default launch (K in parts) and unsplit."""
    from longstraw_kernels import linear
    from longstraw_kernels.linear.triton_skinny import decode_linear_triton

    g = torch.Generator(device="cuda").manual_seed(5)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device="cuda") * scale).to(torch.bfloat16)

    x, z, r = randn(8, 1, 2048), randn(8, 1, 4096)[..., 1024:3072], randn(8, 1, 2048)
    w, norm = randn(2048, 2048, scale=2048**-0.5), 1 + randn(128, scale=0.3)
    assert linear.gate_serves(2048, norm, torch.bfloat16)
    got = decode_linear_triton(x, w, gate=z, gate_norm_V=norm, residual=r, config=config)
    want = linear.decode_linear_reference(x, w, gate_MK=z, gate_norm_V=norm, residual_MN=r)
    oracle = linear.decode_linear_reference(x.double(), w.double(), gate_MK=z.double(), gate_norm_V=norm.double(),
                                            residual_MN=r.double())
    assert rel_err(got, oracle) < 1.5 * rel_err(want, oracle) + 1e-3
    assert rel_err(got, want) < 1e-2


@pytest.mark.parametrize("shape", ["glm52_mini", "glm52"])
def test_skinny_experts_are_as_close_to_fp64_as_the_dense_experts(shape):
    """The decode's routed experts through the decode linear kernel with an expert axis (`skinny_experts`) at 8
    tokens of glm52_mini's and GLM-5's expert shapes (GLM-5's first 64 experts: its 256 would be 19 GB of bf16
    weights and 77 GB of fp64 oracle), bf16: within the dense experts' error of the fp64 dense experts, and the same
    compiled and replayed as a CUDA graph (as the decode step runs them), an expert no token chose (NaN there) not
    read."""
    from longstraw_cli.models.glm52.config import NAMED_CONFIGS
    from longstraw_cli.models.glm52.experts import dense_experts, skinny_experts, skinny_serves

    cfg = NAMED_CONFIGS[shape]
    E, k, N = min(cfg.n_routed_experts, 64), cfg.num_experts_per_tok, 8
    C, I = cfg.hidden_size, cfg.moe_intermediate_size
    g = torch.Generator(device="cuda").manual_seed(E)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device="cuda") * scale).to(torch.bfloat16)

    x, gate_up, down = randn(N, C), randn(E, 2 * I, C, scale=C**-0.5), randn(E, C, I, scale=I**-0.5)
    idx = torch.stack([torch.randperm(E - 1, device="cuda", generator=g)[:k] for _ in range(N)])  # the last idle
    w = torch.rand(N, k, device="cuda", generator=g)
    assert skinny_serves(x, gate_up, down)
    want = dense_experts(x, idx, w, gate_up, down)
    oracle = dense_experts(x.double(), idx, w.double(), gate_up.double(), down.double())
    gate_up[-1], down[-1] = float("nan"), float("nan")
    got = skinny_experts(x, idx, w, gate_up, down)
    assert rel_err(got, oracle) < 1.5 * rel_err(want, oracle) + 1e-3 and rel_err(got, want) < 1e-2
    compiled = torch.compile(skinny_experts)
    compiled(x, idx, w, gate_up, down)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = compiled(x, idx, w, gate_up, down)
    graph.replay()
    assert torch.equal(out, got)


def test_decode_linear_programmatic_launch_in_a_graph_equals_plain_launches(monkeypatch):
    """A chain of dependent linears (each one's input the last one's output: up then down with the residual, both
    programmatic, so that each lets the next start early; one glu layer, launched plainly, among them; K split and
    not; the weights prefetched before the wait) replayed as a CUDA graph gives the bits that plain launches give,
    eagerly, for each of several inputs in turn: a program reading its input before the previous kernel finished
    would read the previous input's values, left in the graph's buffers."""
    from longstraw_kernels.linear import triton_skinny
    from longstraw_kernels.linear.triton_skinny import decode_linear_triton, launch_config

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs sm90")
    g = torch.Generator(device="cuda").manual_seed(11)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device="cuda") * scale).to(torch.bfloat16)

    C, F = 2048, 6144
    layers = [(randn(F, C, scale=C**-0.5), randn(F, C, scale=C**-0.5) if i == 2 else None,
               randn(C, F, scale=F**-0.5), randn(C, scale=0.3)) for i in range(6)]
    inputs = [randn(8, 1, C) for _ in range(3)]

    def chain(x, prefetch):
        for w, up, down, norm in layers:
            h = decode_linear_triton(x, w, up_NK=up, norm_K=norm,
                                     config=(*launch_config(8, F, C, up is not None)[:5], prefetch))
            x = decode_linear_triton(h, down, residual=x, config=(*launch_config(8, C, F, False)[:5], prefetch))
        return x

    # the plain launches, the reference: programmatic_launch answered False
    monkeypatch.setattr(triton_skinny, "programmatic_launch", lambda device: False)
    try:
        wants = [chain(x, 0) for x in inputs]
        monkeypatch.undo()
        triton_skinny.programmatic_launch.cache_clear()
        assert triton_skinny.programmatic_launch(inputs[0].device)
        for prefetch in (0, 512, 8192):
            for x, want in zip(inputs, wants):
                assert torch.equal(chain(x, prefetch), want), prefetch  # eager, programmatic
            graph, x_static = torch.cuda.CUDAGraph(), inputs[0].clone()
            chain(x_static, prefetch)
            with torch.cuda.graph(graph):
                out = chain(x_static, prefetch)
            for _ in range(3):
                for x, want in zip(inputs, wants):
                    x_static.copy_(x)
                    graph.replay()
                    assert torch.equal(out, want), prefetch
    finally:
        monkeypatch.undo()
        triton_skinny.programmatic_launch.cache_clear()


@pytest.mark.parametrize("T, H, G", [(1000, 2, 4), (4096, 16, 48), (77, 8, 16)])
def test_fla_gdn_forward_matches_chunked_reference(T, H, G):
    from longstraw_kernels.gdn import gdn_chunked, gdn_forward
    from longstraw_kernels.gdn.fla_gpu import fla_forward

    # a GPU run is meant to test fla's path: missing, it fails (a skip here once hid fla blocked by a test module)
    assert fla_forward() is not None, "fla is not importable: pip install flash-linear-attention"
    g = torch.Generator(device="cuda").manual_seed(T)
    q = torch.nn.functional.normalize(torch.randn(1, T, H, 128, device="cuda", generator=g), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(1, T, H, 128, device="cuda", generator=g), dim=-1)
    v = torch.randn(1, T, G, 128, device="cuda", generator=g).bfloat16()
    gate = -torch.nn.functional.softplus(torch.randn(1, T, G, device="cuda", generator=g))
    beta = torch.rand(1, T, G, device="cuda", generator=g).bfloat16()
    s0 = torch.randn(1, G, 128, 128, device="cuda", generator=g) * 0.1
    with torch.no_grad():
        o, s = gdn_forward(q, k, v, gate, beta, s0)
        # the reference sees the same bf16-rounded q, k
        o_ref, s_ref = gdn_chunked(q.bfloat16().double(), k.bfloat16().double(), v.double(), gate.double(),
                                   beta.double(), s0.double())
    assert rel_err(o, o_ref) < 2e-2 and rel_err(s, s_ref) < 1e-2


def test_qwen36_capture_and_logprobs_on_cuda_bf16():
    from longstraw_cli.models import build_model

    model = build_model("qwen36_tiny", dtype=torch.float32)
    randomize_(model)
    prompt = torch.randint(0, 259, (3000,), generator=torch.Generator().manual_seed(0))
    response = torch.randint(0, 259, (100,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.cat([prompt, response]))[prompt.numel() - 1 : -1].double(), -1)
    ref = ref.gather(-1, response[:, None])[:, 0]
    gpu = model.to("cuda", torch.bfloat16)
    resident = gpu.capture(prompt.cuda(), block_size=1024)
    logp = gpu.logprobs(resident, response.cuda(), grad=True)
    logp.sum().backward()
    assert rel_err(logp.detach().cpu(), ref) < 3e-2
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in gpu.parameters())
