"""Native decode on CUDA (skipped without it): the split-KV flash pages attention and the GDN step's two kernels
against their torch references, the CUDA-graph decode against the same decode run eagerly (identical greedy
tokens and log-probs, also across growths of the response slots) and against replay scoring (bf16 noise), for
both families; and `longstraw train device=cuda` end to end for two steps with its importance ratio at 1 on the
first, on-policy step."""

import copy
import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import rel_err
from longstraw_cli.models import build_model
from longstraw_cli.rollout.native import NativeConfig, SamplingConfig, generate
from longstraw_kernels import optional_module
from longstraw_kernels.attention.decode import decode_pages_attention
from longstraw_kernels.gdn import conv_step, gdn_decode
from longstraw_kernels.gdn.reference import conv_step_reference, gdn_decode_reference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def randn(*shape, seed, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(*shape, generator=g, device="cuda").to(dtype)


@pytest.mark.parametrize("varlen", [False, True], ids=["batched", "varlen"])
@pytest.mark.parametrize("B, Q, K, D, P", [(8, 16, 2, 256, 100_003), (3, 24, 4, 256, 5000), (8, 16, 2, 128, 700)])
def test_flash_split_pages_attention_matches_fp64(B, Q, K, D, P, varlen):
    """Both flash forms of the pages' attention (a batch of equal ranges and the rest; the ranges as one varlen
    call, LONGSTRAW_DECODE_PAGES=varlen) against fp64; 100,003 pages leave a rest the last range takes."""
    q, k, v = randn(B, Q, D, seed=0), randn(P, K, D, seed=1), randn(P, K, D, seed=2)
    out, lse = decode_pages_attention(q, k, v, scale=D**-0.5, varlen=varlen)
    ref_out, ref_lse = decode_pages_attention(q.double(), k.double(), v.double(), scale=D**-0.5, num_splits=1)
    assert out.dtype == torch.bfloat16 and rel_err(out.double(), ref_out) < 1e-2
    assert rel_err(lse.double(), ref_lse) < 1e-4


def test_decode_gdn_kernel_matches_the_fp64_recurrence():
    """qwen36's GDN decode shape (8 responses, 16 key heads, 32 value heads of 128 x 128), raw bf16 inputs as the
    conv gives them: our one-launch kernel (it must be the path taken) against the fp64 reference; the state in
    place."""
    kernels = optional_module("longstraw_kernels.gdn.triton_step")
    assert kernels is not None, "the decode's GDN kernels must import"
    B, H, G, Dk, Dv = 8, 16, 32, 128, 128
    q, k = randn(B, 1, H, Dk, seed=0), randn(B, 1, H, Dk, seed=1)
    v, a, b = randn(B, 1, G, Dv, seed=2), randn(B, 1, G, seed=3), randn(B, 1, G, seed=4)
    a_log = torch.empty(G, device="cuda").uniform_(0.01, 16).log().bfloat16()
    dt_bias = randn(G, seed=5)
    s0 = randn(B, G, Dk, Dv, seed=6, dtype=torch.float32)
    assert kernels.supported(q, v, s0)
    state, ref_state = s0.clone(), s0.double()
    o = gdn_decode(q, k, v, a, b, a_log, dt_bias, state)
    o_ref = gdn_decode_reference(*(x.double() for x in (q, k, v, a, b, a_log, dt_bias)), ref_state)
    assert o.dtype == torch.bfloat16 and rel_err(o.double(), o_ref) < 1e-2
    assert rel_err(state.double(), ref_state) < 1e-5 and not torch.equal(state, s0)


def test_decode_conv_step_kernel_matches_the_fp64_conv():
    """qwen36_mini's conv at decode (8 responses, 8,192 channels, 4 taps), bf16, the input a strided slice as the
    fused input GEMM gives it: our kernel (it must be the path taken) against fp64; the window moved on exactly."""
    kernels = optional_module("longstraw_kernels.gdn.triton_step")
    assert kernels is not None, "the decode's GDN kernels must import"
    B, X, K = 8, 8192, 4
    mixed = randn(B, 1, X + 4096, seed=0)[..., :X]
    weight, window = randn(X, 1, K, seed=1), randn(B, X, K - 1, seed=2)
    moved, ref_window = window.clone(), window.double()
    assert kernels.conv_supported(mixed, moved)
    out = conv_step(mixed, moved, weight)
    want = conv_step_reference(mixed.double(), ref_window, weight.double())
    assert out.dtype == torch.bfloat16 and rel_err(out.double(), want) < 1e-2
    assert torch.equal(moved.double(), ref_window)


def reduced(name):
    """The named GPU shape with fewer layers (and glm52 with fewer experts): same widths and kernels."""
    if name == "qwen36_mini":
        return build_model(name, dtype=torch.bfloat16, device="cuda", seed=0, num_hidden_layers=8)
    return build_model(name, dtype=torch.bfloat16, device="cuda", seed=0, num_hidden_layers=4)


@pytest.mark.parametrize("name", ["qwen36_mini", "glm52_mini"])
def test_graph_decode_equals_eager_decode_and_its_logprobs_are_replays(name):
    model = reduced(name)
    prompt = torch.randint(0, 250, (5000,), generator=torch.Generator().manual_seed(0)).cuda()
    resident = model.capture(prompt, block_size=2048)
    if name == "qwen36_mini":  # its linears run through the decode linear kernel, in every path below
        from longstraw_cli.models.qwen36.decode import KernelLinears

        assert all(isinstance(linears, KernelLinears) for linears in model.decoder(resident, 4, 8).linears)
    snapshot = [t.clone() for t in resident.tensors()]
    greedy = SamplingConfig(temperature=0, max_new_tokens=40)
    # the graph replays exactly the eager step's kernels (compiled, the kernels differ: checked below)
    graph = generate(model, resident, 4, greedy, native=NativeConfig(cuda_graph=True, compile=False))
    eager = generate(model, resident, 4, greedy, native=NativeConfig(cuda_graph=False))
    assert all(torch.equal(a, b) for a, b in zip(snapshot, resident.tensors()))
    for a, b, la, lb in zip(graph.responses, eager.responses, graph.logprobs, eager.logprobs):
        assert torch.equal(a, b) and torch.equal(la, lb)
    # the default path (graph, compiled where the family allows it)
    sampled = generate(model, resident, 8, SamplingConfig(max_new_tokens=64), torch.Generator("cuda").manual_seed(0))
    # bf16 noise, measured: the same weights in fp32, replayed, are the reference for both bf16 paths
    exact = copy.deepcopy(model).float()
    exact_resident = exact.capture(prompt, block_size=2048)
    decode_errs, replay_errs = [], []
    for response, logp in zip(sampled.responses, sampled.logprobs):
        ref = exact.logprobs(exact_resident, response)
        replay = model.logprobs(resident, response)
        decode_errs.append(float((logp - ref).abs().mean()))
        replay_errs.append(float((replay - ref).abs().mean()))
    # the rollout's log-probs are as close to exact as replay's own: the on-policy ratio is 1 up to bf16. Over
    # the 8 responses: one response's error hangs on which of its tokens flip an expert (glm52's compiled decode,
    # H200: 0.109 against replay's 0.069 on one response, means 0.0702 and 0.0699)
    decode_err, replay_err = sum(decode_errs) / len(decode_errs), sum(replay_errs) / len(replay_errs)
    print(f"{name}: mean |logp - fp32| decode {decode_err:.4f}, replay {replay_err:.4f}")
    assert decode_err < 1.25 * replay_err + 1e-3, (decode_errs, replay_errs)


@pytest.mark.parametrize("name", ["qwen36_mini", "glm52_mini"])
def test_graph_decode_captures_again_after_each_growth(name):
    """rollout.native.response_chunk=8 over 40 tokens: the slots grow at steps 8, 16 and 32 and the graph is captured
    again at each; the graph decode equals the same decode run eagerly, bit for bit (the same kernels at the same
    capacities), and the compiled one (qwen36) decodes all 40 tokens."""
    model = reduced(name)
    prompt = torch.randint(0, 250, (3000,), generator=torch.Generator().manual_seed(1)).cuda()
    resident = model.capture(prompt, block_size=1024)
    greedy = SamplingConfig(temperature=0, max_new_tokens=40)
    graph = generate(model, resident, 4, greedy, native=NativeConfig(compile=False, response_chunk=8))
    eager = generate(model, resident, 4, greedy, native=NativeConfig(cuda_graph=False, response_chunk=8))
    for a, b, la, lb in zip(graph.responses, eager.responses, graph.logprobs, eager.logprobs):
        assert torch.equal(a, b) and torch.equal(la, lb)
    compiled = generate(model, resident, 4, greedy, native=NativeConfig(response_chunk=8))
    assert compiled.decode_steps == 40 and all(len(r) == 40 for r in compiled.responses)


@pytest.mark.parametrize("compile", [False, True], ids=["graph", "compiled"])
def test_gdn_in_one_launch_decodes_what_two_launches_decode(compile, monkeypatch):
    """LONGSTRAW_DECODE_GDN=fused (qwen36: each GDN layer's conv and recurrence in one launch, the conv's window a
    ring): the same greedy tokens and log-probs as the two launches, bit for bit (the same arithmetic, the conv's
    output rounded to bf16 between them in both; tests/kernels/test_gdn_step.py in Triton's interpreter), over 40
    tokens whose slots grow at 8, 16 and 32."""
    model = reduced("qwen36_mini")
    prompt = torch.randint(0, 250, (3000,), generator=torch.Generator().manual_seed(3)).cuda()
    resident = model.capture(prompt, block_size=1024)
    greedy, native = SamplingConfig(temperature=0, max_new_tokens=40), NativeConfig(compile=compile, response_chunk=8)
    two = generate(model, resident, 4, greedy, native=native)
    monkeypatch.setenv("LONGSTRAW_DECODE_GDN", "fused")
    assert model.decoder(resident, 4, 8).conv_gdn is not None
    one = generate(model, resident, 4, greedy, native=native)
    for a, b, la, lb in zip(one.responses, two.responses, one.logprobs, two.logprobs):
        assert torch.equal(a, b) and torch.equal(la, lb)


@pytest.mark.parametrize("compile", [False, True], ids=["graph", "compiled"])
@pytest.mark.parametrize("name", ["qwen36_mini", "glm52_mini"])
def test_several_steps_as_one_graph_sample_what_single_steps_sample(name, compile, caplog, monkeypatch):
    """rollout.native.steps_per_graph=8: eight whole steps (the model's step, the race's noise from the rollout's
    generator, the sampling, the token fed back, the stop flags) as one CUDA graph, over 40 tokens whose slots grow at
    8, 16 and 32: the same tokens, log-probs and entropies as single steps, bit for bit (the same kernels on the
    same noise: the generator is registered to the graph), with stop tokens too; the graph stood at each call of
    the eight steps (no capture refused)."""
    from longstraw_cli.rollout import native

    model = reduced(name)
    prompt = torch.randint(0, 250, (3000,), generator=torch.Generator().manual_seed(2)).cuda()
    resident = model.capture(prompt, block_size=1024)
    captured, plain = [], native.GraphedSteps._captured

    def counted(self):
        captured.append(plain(self))
        return captured[-1]

    monkeypatch.setattr(native.GraphedSteps, "_captured", counted)
    for stop_token_ids in ((), tuple(range(0, 250, 9))):
        cfg = SamplingConfig(max_new_tokens=40, stop_token_ids=stop_token_ids)
        single, grouped = (generate(model, resident, 4, cfg, torch.Generator("cuda").manual_seed(5),
                                    NativeConfig(compile=compile, response_chunk=8, steps_per_graph=n))
                           for n in (0, 8))
        for field in ("responses", "logprobs", "entropies"):
            assert all(torch.equal(a, b) for a, b in zip(getattr(single, field), getattr(grouped, field))), field
    assert captured and all(captured)
    assert not [r for r in caplog.records if "could not be captured" in r.getMessage()]


@pytest.mark.parametrize("name", ["qwen36_mini", "glm52_mini"])
def test_longstraw_train_on_cuda_two_steps(name, tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "longstraw_cli", "train", f"model={name}", "model.dtype=bfloat16", "device=cuda",
           "task=passkey", "prompt_tokens=4096", "group_size=4", "response_tokens=32", "steps=2",
           "rollout.native.compile=false",
           f"run_dir={run_dir}"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "HYDRA_FULL_ERROR": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(torch.isfinite(torch.tensor(r["loss"])) for r in rows)
    assert abs(rows[0]["ratio_mean"] - 1) < 2e-2 and rows[0]["decode_steps"] > 0


def test_repeated_graph_rollouts_hold_no_memory():
    """Each trainer step's rollout is one `generate`: before the fix every CUDA-graph rollout left 32 MiB behind
    (a new warm-up stream each time, and cuBLAS keeps a workspace per stream), +0.03 GiB a step at 1M tokens."""
    import gc

    model = build_model("qwen36_tiny", dtype=torch.bfloat16, device="cuda", seed=0)
    resident = model.capture(torch.randint(0, 250, (512,), device="cuda"), block_size=256)
    cfg, native = SamplingConfig(max_new_tokens=8), NativeConfig(compile=False)
    allocated = []
    for i in range(3):
        generate(model, resident, 4, cfg, torch.Generator("cuda").manual_seed(i), native)
        gc.collect()
        torch.cuda.synchronize()
        allocated.append(torch.cuda.memory_allocated())
    assert allocated[2] == allocated[1], allocated


def test_compiled_norms_capture_what_the_eager_norms_capture(monkeypatch):
    """LONGSTRAW_NORMS=compiled (qwen36's graph-free CUDA forwards: each norm one torch.compile kernel): the capture's
    pages and recurrent state within bf16's noise of the eager norms' (the same fp32 arithmetic, fused), and the
    norms under autograd stay eager (the replay's graph is torch's own)."""
    from longstraw_cli.models.qwen36 import model as qwen36_model

    model = reduced("qwen36_mini")
    prompt = torch.randint(0, 250, (3000,), generator=torch.Generator().manual_seed(4)).cuda()
    eager = model.capture(prompt, block_size=1024)
    monkeypatch.setenv("LONGSTRAW_NORMS", "compiled")
    calls = []
    plain = qwen36_model._compiled_norm
    monkeypatch.setattr(qwen36_model, "_compiled_norm", lambda fn: calls.append(fn) or plain(fn))
    compiled = model.capture(prompt, block_size=1024)
    assert len(calls) > 0
    for a, b in zip(eager.layers, compiled.layers):
        for name in ("k_PKD", "v_PKD", "conv_CW", "ssm_GKV"):
            if hasattr(a, name):
                assert rel_err(getattr(b, name), getattr(a, name)) < 1e-2, name
    x = torch.randn(2, 5, model.config.hidden_size, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    calls.clear()
    model.model.layers[0].input_layernorm(x).sum().backward()
    assert calls == [] and x.grad is not None
