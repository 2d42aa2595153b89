"""QLoRA on CUDA (skipped without it): the NF4 linear (quantize.linear) forward and backward against a bf16
linear holding the dequantised weight; an NF4 model's logits, capture + log-probs and adapter gradients against
the same model with its weights dequantised, in bf16, for both families; and the decode step replayed as a CUDA
graph on an NF4 model against the same decode run eagerly (equal), and compiled where the family compiles it
(its log-probs against the replay of its responses)."""

import pytest
import torch

from conftest import rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
pytest.importorskip("torchao")

from longstraw_cli.lora import LoraConfig, apply_lora, lora_layers  # noqa: E402
from longstraw_cli.models import build_model  # noqa: E402
from longstraw_cli.quantize import dense, linear, quantized_linears, scaler_block_size, torchao_nf4  # noqa: E402
from longstraw_cli.rollout.native import NativeConfig, SamplingConfig, generate  # noqa: E402

# bf16 noise: the NF4 linear and the plain one read the same bf16 matrix, summed in other orders at most
BF16 = 2e-2


def test_nf4_linear_forward_and_backward_on_cuda():
    nf4 = torchao_nf4()
    g = torch.Generator(device="cuda").manual_seed(0)
    w = (torch.randn(1536, 2048, generator=g, device="cuda") * 0.02).to(torch.bfloat16)
    q = nf4.to_nf4(w, 64, scaler_block_size(w.numel()))
    assert q.device.type == "cuda" and q.quantized_data.device.type == "cuda"
    x = torch.randn(3, 77, 2048, generator=g, device="cuda").to(torch.bfloat16).requires_grad_(True)
    x_ref = x.detach().clone().requires_grad_(True)
    out = linear(x, q)
    ref = torch.nn.functional.linear(x_ref, dense(q))
    assert rel_err(out.float(), ref.float()) <= BF16
    grad = torch.randn(out.shape, generator=g, device="cuda").to(torch.bfloat16)
    out.backward(grad)
    ref.backward(grad)
    assert rel_err(x.grad.float(), x_ref.grad.float()) <= BF16
    # NF4 is lossy: the dequantised matrix is ~10% RMS from the original
    assert 0.02 < rel_err(dense(q).float(), w.float()) < 0.15


def nf4_and_dequantised(name: str):
    model = build_model(name, dtype=torch.bfloat16, device="cuda", seed=0, quantize="nf4")
    apply_lora(model, LoraConfig(rank=4, alpha=8.0, quantize="nf4"))
    with torch.no_grad():
        for layer in lora_layers(model).values():
            layer.lora_B.normal_(0.0, 0.05)
    plain = build_model(name, dtype=torch.bfloat16, device="cuda")
    apply_lora(plain, LoraConfig(rank=4, alpha=8.0))
    plain.load_state_dict({k: dense(v) for k, v in model.state_dict().items()})
    assert quantized_linears(model) > 0 and quantized_linears(plain) == 0
    return model, plain


@pytest.mark.parametrize("name", ["qwen36_tiny", "glm52_tiny"])
def test_nf4_model_equals_dequantised_bf16_on_cuda(name):
    model, plain = nf4_and_dequantised(name)
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randint(0, 259, (200,), generator=g, device="cuda")
    prompt, response = x[:150], x[150:]
    with torch.no_grad():
        assert rel_err(model(x).float(), plain(x).float()) <= BF16
        got = model.logprobs(model.capture(prompt, block_size=64), response)
        want = plain.logprobs(plain.capture(prompt, block_size=64), response)
    assert rel_err(got.float(), want.float()) <= BF16
    grads = []
    for m in (model, plain):
        m.zero_grad(set_to_none=True)
        m.logprobs(m.capture(prompt, block_size=64), response, grad=True).sum().backward()
        grads.append({n: p.grad.float() for n, p in m.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and grads[0]
    assert max(rel_err(grads[0][k], grads[1][k]) for k in grads[1]) <= 5e-2


@pytest.mark.parametrize("name", ["qwen36_tiny", "glm52_tiny"])
def test_nf4_decode_as_cuda_graph_equals_eager(name):
    model, _ = nf4_and_dequantised(name)
    prompt = torch.randint(0, 259, (300,), generator=torch.Generator(device="cuda").manual_seed(2), device="cuda")
    resident = model.capture(prompt, block_size=128)
    greedy = SamplingConfig(max_new_tokens=12, temperature=0.0)
    # the graph replays exactly the eager step's kernels
    eager = generate(model, resident, 4, greedy, native=NativeConfig(cuda_graph=False))
    graphed = generate(model, resident, 4, greedy, native=NativeConfig(cuda_graph=True, compile=False))
    assert [r.tolist() for r in graphed.responses] == [r.tolist() for r in eager.responses]
    assert all(torch.equal(a, b) for a, b in zip(graphed.logprobs, eager.logprobs))
    # the default path (graph, compiled where the family compiles it) fuses other kernels: greedy tokens of a
    # random tiny model (near-uniform logits) may flip, so its log-probs are checked against the replay of its
    # own responses (the on-policy ratio), within bf16 noise
    default = generate(model, resident, 4, greedy)
    with torch.no_grad():
        replayed = [model.logprobs(resident, r) for r in default.responses]
    assert rel_err(torch.cat(default.logprobs).float(), torch.cat(replayed).float()) <= BF16
