"""The qwen36 decode's query / key preparation in one launch (`triton_decode_qk.decode_qk`, Triton's interpreter on
CPU) against its contract (`decode_qk_reference`), and the contract against the model's own path (`project_from`
and the cache writes). On CUDA, the `gpu` test below (passed on an H200) and tests/models/test_gpu_decode.py's qwen36
decodes, which take the kernel by default."""

import pytest
import torch

from conftest import assert_compiled_step_equals_eager, random_model, rel_err
from longstraw_kernels.attention.triton_decode_qk import decode_qk, decode_qk_reference


def operands(B, Q, K, D, rot, S, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    out = torch.randn(B, 1, Q * 2 * D + 2 * K * D, generator=g).to(dtype)  # one GEMM's output, split as views
    qg, k, v = out.split([Q * 2 * D, K * D, K * D], dim=-1)
    w_q, w_k = (torch.randn(D, generator=g) * 0.3).to(dtype), (torch.randn(D, generator=g) * 0.3).to(dtype)
    angle = 250_000.0 * torch.rand(rot // 2, generator=g)
    angle = torch.cat([angle, angle])
    cos, sin = angle.cos().to(dtype)[None], angle.sin().to(dtype)[None]
    slots = [torch.randn(B, S, K, D, generator=g).to(dtype) for _ in range(2)]
    return qg, k, v, w_q, w_k, cos, sin, slots


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("B, Q, K, D, rot, S, step", [
    (2, 4, 2, 32, 8, 5, 3),     # partial RoPE (a quarter of the head, as qwen36's)
    (3, 2, 1, 16, 16, 2, 0),    # the whole head rotated, the first slot
])
def test_kernel_equals_its_contract(dtype, B, Q, K, D, rot, S, step):
    qg, k, v, w_q, w_k, cos, sin, slots = operands(B, Q, K, D, rot, S, dtype, seed=B * S + step)
    step_1 = torch.tensor([step])
    want_k, want_v = (t.clone() for t in slots)
    want_q = decode_qk_reference(qg, k, v, w_q, w_k, 1e-6, cos, sin, step_1, want_k, want_v)
    got_k, got_v = (t.clone() for t in slots)
    got_q = decode_qk(qg, k, v, w_q, w_k, 1e-6, cos, sin, step_1, got_k, got_v)
    assert got_q.shape == (B, Q, D) and got_q.dtype == dtype
    # the same roundings; the kernel's sum of squares adds in another order (a last bit, rarely). Triton's
    # interpreter rounds fp32 to bf16 toward zero (tests/kernels/test_decode_linear.py), twice on the way (0.6 of a
    # unit in the last place, RMS, measured), where fp16 rounds to nearest as a GPU does
    ulp = 2 ** -7 if dtype == torch.bfloat16 else 2 ** -10
    bound = ulp if dtype == torch.bfloat16 else ulp / 4
    assert rel_err(got_q.double(), want_q.double()) < bound
    assert rel_err(got_k.double(), want_k.double()) < bound
    assert torch.equal(got_v, want_v)
    # only slot `step` was written
    others = [s for s in range(S) if s != step]
    assert torch.equal(got_k[:, others], slots[0][:, others]) and torch.equal(got_v[:, others], slots[1][:, others])
    assert not torch.equal(got_k[:, step], slots[0][:, step])


@torch.no_grad()
def test_contract_is_the_models_path():
    """In fp32 the contract computes what the model's attention does at decode: `project_from` (q_norm, k_norm,
    partial RoPE of the step's position) and the two index copies."""
    from longstraw_cli.models.qwen36.rope import rope_cos_sin

    model = random_model("qwen36_tiny", torch.float32)
    attn = next(layer.self_attn for layer in model.model.layers if layer.is_attention)
    with torch.no_grad():
        attn.q_norm.weight.normal_(0, 0.3)
        attn.k_norm.weight.normal_(0, 0.3)
    B, S, Q, K, D = 2, 4, attn.num_q, attn.num_kv, attn.head_dim
    g = torch.Generator().manual_seed(0)
    qg, k, v = (torch.randn(B, 1, n, generator=g) for n in (Q * 2 * D, K * D, K * D))
    positions_1, step_1 = torch.tensor([123_457]), torch.tensor([2])
    q_want, k_want, v_want, _ = attn.project_from(qg, k, v, positions_1)
    slots = [torch.zeros(B, S, K, D) for _ in range(2)]
    cos, sin = rope_cos_sin(positions_1, attn.cfg.rotary_dim, attn.cfg.rope_theta, torch.float32)
    q = decode_qk_reference(qg, k, v, attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.eps, cos, sin, step_1,
                            *slots)
    assert rel_err(q, q_want[:, 0]) < 1e-6
    assert rel_err(slots[0][:, 2], k_want[:, 0]) < 1e-6 and torch.equal(slots[1][:, 2], v_want[:, 0])


@torch.no_grad()
def test_qwen36_decode_through_the_fused_qk_equals_the_modules(monkeypatch):
    """LONGSTRAW_DECODE_QK=fused: the decoder's attention layers prepare q and k through the kernel (Triton's
    interpreter here), with the modules' logits over several steps in bf16; another value is refused."""
    from conftest import assert_fused_kernel_decodes, ids

    model = random_model("qwen36_tiny", torch.bfloat16)
    resident = model.capture(ids(40, 0), block_size=16)
    assert_fused_kernel_decodes(monkeypatch, model, resident, "LONGSTRAW_DECODE_QK", "qk", decode_qk,
                                sum(layer.is_attention for layer in model.model.layers), 3, 2e-2)


def test_a_default_kernel_that_does_not_serve_on_cuda_is_said_once(monkeypatch, caplog):
    """LONGSTRAW_DECODE_QK's default is the kernel: on CUDA, where it does not serve (fp32 activations, say), the
    modules run and the run is told once, naming the default, as when the variable asks; off CUDA nothing is said."""
    import logging
    from types import SimpleNamespace

    from longstraw_cli.models.qwen36.decode import QK_CHOICES, Qwen36Decoder
    from longstraw_kernels import say_once

    monkeypatch.delenv("LONGSTRAW_DECODE_QK", raising=False)
    name, needs, cuda = "attention.triton_decode_qk", "bf16/fp16 activations", SimpleNamespace(is_cuda=True)
    say_once.cache_clear()
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            assert Qwen36Decoder._fused("LONGSTRAW_DECODE_QK", name, cuda, lambda m: False, needs, QK_CHOICES) is None
        assert Qwen36Decoder._fused("LONGSTRAW_DECODE_QK", name, torch.zeros(1), lambda m: True, needs,
                                    QK_CHOICES) is None
        monkeypatch.setenv("LONGSTRAW_DECODE_QK", "fused")
        assert Qwen36Decoder._fused("LONGSTRAW_DECODE_QK", name, cuda, lambda m: False, needs, QK_CHOICES) is None
    said = [r.getMessage() for r in caplog.records if "does not serve" in r.getMessage()]
    assert said == ["decode: LONGSTRAW_DECODE_QK=fused (the default) does not serve here (it needs Triton, "
                    "bf16/fp16 activations); the modules run",
                    "decode: LONGSTRAW_DECODE_QK=fused does not serve here (it needs Triton, bf16/fp16 activations); "
                    "the modules run"]


@torch.no_grad()
@pytest.mark.parametrize("merge", ["modules", "fused"])
def test_compiled_step_with_the_fused_qk_equals_eager(fresh_dynamo, monkeypatch, merge):
    """The kernel is one opaque op writing the slots in place: dynamo and AOTAutograd's functionalization (the
    compiled decode step's path, `aot_eager` here) keep its writes, so the compiled steps equal the eager ones; with
    the fused merge (triton_decode_merge.py, another opaque op) too."""
    from conftest import ids

    monkeypatch.setenv("LONGSTRAW_DECODE_QK", "fused")
    monkeypatch.setenv("LONGSTRAW_DECODE_MERGE", merge)
    model = random_model("qwen36_tiny", torch.bfloat16)
    resident = model.capture(ids(40, 0), block_size=16)
    assert_compiled_step_equals_eager(model.decoder(resident, 2, 4), model.decoder(resident, 2, 4))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_kernel_at_qwen36_minis_shape_equals_its_contract():
    """8 responses, 16 query heads and 2 kv heads of 256, a quarter rotated, slot 700 of 1,024, bf16 on the GPU
    (rounding to nearest there: within a quarter of a unit in the last place, RMS)."""
    qg, k, v, w_q, w_k, cos, sin, slots = operands(8, 16, 2, 256, 64, 1024, torch.bfloat16, seed=0)
    qg, k, v, w_q, w_k, cos, sin = (t.cuda() for t in (qg, k, v, w_q, w_k, cos, sin))
    step_1 = torch.tensor([700], device="cuda")
    want_k, want_v = (t.cuda() for t in slots)
    got_k, got_v = want_k.clone(), want_v.clone()
    want_q = decode_qk_reference(qg, k, v, w_q, w_k, 1e-6, cos, sin, step_1, want_k, want_v)
    got_q = decode_qk(qg, k, v, w_q, w_k, 1e-6, cos, sin, step_1, got_k, got_v)
    assert rel_err(got_q.double(), want_q.double()) < 2 ** -9
    assert rel_err(got_k[:, 700].double(), want_k[:, 700].double()) < 2 ** -9 and torch.equal(got_v, want_v)
    assert torch.equal(got_k[:, :700], want_k[:, :700])
