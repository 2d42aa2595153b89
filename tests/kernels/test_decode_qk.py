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
def test_qwen36_decode_through_the_fused_qk_equals_the_modules():
    """The decoder's attention layers prepare q and k through the kernel (Triton's interpreter here: on CPU the
    decoder keeps the modules, so the test hands it the kernel), with the modules' logits over several steps in
    bf16, the kernel called once a layer a step."""
    from conftest import assert_decodes_alike, ids

    model = random_model("qwen36_tiny", torch.bfloat16)
    resident = model.capture(ids(40, 0), block_size=16)
    modules, fused, calls = model.decoder(resident, 2, 4), model.decoder(resident, 2, 4), []
    assert modules.qk is None and fused.qk is None
    fused.qk = lambda *a: calls.append(1) or decode_qk(*a)
    assert_decodes_alike(modules, fused, 3, 2e-2)
    assert len(calls) == 3 * sum(layer.is_attention for layer in model.model.layers)


def test_the_decoder_takes_the_kernel_on_cuda_where_it_serves_and_says_once_where_not(caplog):
    """On CUDA the decoder takes the kernel where it serves (bf16 activations and pages, a power-of-two head dim);
    where it does not (fp32 activations, say) the modules run and the run is told once; kernels.decode_qk=torch
    keeps the modules without a word, and off CUDA nothing is said."""
    import logging
    from types import SimpleNamespace

    from conftest import ids
    from longstraw_cli.models.qwen36.decode import Qwen36Decoder
    from longstraw_kernels import say_once, use_kernels

    model = random_model("qwen36_tiny", torch.bfloat16)
    resident = model.capture(ids(40, 0), block_size=16)

    def on_cuda(dtype):
        return SimpleNamespace(is_cuda=True, dtype=dtype)

    say_once.cache_clear()
    with caplog.at_level(logging.WARNING):
        assert Qwen36Decoder._qk_kernel(model, resident, on_cuda(torch.bfloat16)) is decode_qk
        for _ in range(2):
            assert Qwen36Decoder._qk_kernel(model, resident, on_cuda(torch.float32)) is None
        assert Qwen36Decoder._qk_kernel(model, resident, torch.zeros(1, dtype=torch.bfloat16)) is None
        with use_kernels(decode_qk="torch"):
            assert Qwen36Decoder._qk_kernel(model, resident, on_cuda(torch.bfloat16)) is None
    said = [r.getMessage() for r in caplog.records if "does not serve" in r.getMessage()]
    assert said == ["decode: the fused q / k kernel does not serve here (it needs Triton, bf16/fp16 activations and "
                    "pages alike, and a power-of-two head dim); the modules run"]


@torch.no_grad()
def test_compiled_step_with_the_fused_qk_equals_eager(fresh_dynamo):
    """The kernel is one opaque op writing the slots in place: dynamo and AOTAutograd's functionalization (the
    compiled decode step's path, `aot_eager` here) keep its writes, so the compiled steps equal the eager ones."""
    from conftest import ids

    model = random_model("qwen36_tiny", torch.bfloat16)
    resident = model.capture(ids(40, 0), block_size=16)
    eager, compiled = model.decoder(resident, 2, 4), model.decoder(resident, 2, 4)
    eager.qk = compiled.qk = decode_qk
    assert_compiled_step_equals_eager(eager, compiled)


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
