"""The decode step's response part (`triton_decode_response.response_partials`, Triton's interpreter on CPU) merged
by log-sum-exp equals attention over the filled slots only, whatever the empty slots hold; ranges past the filled
slots are empty partials (out 0, lse -inf). On CUDA, tests/kernels/test_gpu.py checks the compiled kernel."""

import pytest
import torch

from conftest import rel_err
from longstraw_kernels.attention.decode import merge_partials, response_partials_torch
from longstraw_kernels.attention.reference import naive_attention
from longstraw_kernels.attention.triton_decode_response import response_partials


@pytest.mark.parametrize("dtype, bound", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("B, Q, K, D, S, filled, splits", [
    (2, 4, 2, 16, 200, 130, 3),    # ranges of 128 slots: the second part-filled, the third empty
    (1, 16, 2, 32, 64, 1, 2),      # one filled slot, G = 8 query heads a kv head
    (3, 6, 3, 16, 70, 70, None),   # every slot filled, the default range count
])
def test_response_partials_equal_attention_over_the_filled_slots(dtype, bound, B, Q, K, D, S, filled, splits):
    g = torch.Generator().manual_seed(S + filled)
    q = torch.randn(B, Q, D, generator=g).to(dtype)
    k, v = torch.randn(B, S, K, D, generator=g).to(dtype), torch.randn(B, S, K, D, generator=g).to(dtype)
    k[:, filled:], v[:, filled:] = 1e4, float("nan")  # what the empty slots hold must not matter
    filled_1 = torch.tensor([filled])
    out_N, lse_N = response_partials(q, k, v, filled_1, scale=D**-0.5, splits=splits)
    assert out_N.dtype == lse_N.dtype == torch.float32 and out_N.shape[1:] == q.shape
    empty = torch.isneginf(lse_N).all(-1).all(-1)
    assert torch.equal(out_N[empty], torch.zeros_like(out_N[empty]))
    out, lse = merge_partials(out_N, lse_N, torch.float64)
    no_pages = q.new_empty(0, K, D).double()
    want_out, want_lse = naive_attention(q[:, None].double(), no_pages, no_pages, k[:, :filled].double(),
                                         v[:, :filled].double(), scale=D**-0.5)
    assert rel_err(out, want_out[:, 0]) < bound
    assert rel_err(lse.double(), want_lse[..., 0]) < bound / 10
    # the torch reference (all slots upcast and masked) agrees
    ref_out, ref_lse = response_partials_torch(q.double(), k.double().nan_to_num(0.0), v.double().nan_to_num(0.0),
                                               filled_1, scale=D**-0.5)
    assert rel_err(ref_out[0], want_out[:, 0]) < 1e-12 and rel_err(ref_lse[0], want_lse[..., 0]) < 1e-12


def test_a_decoder_is_told_once_where_the_references_take_its_attention(caplog):
    """On CUDA each part the torch reference will run is said once, with the operands; nothing is said off CUDA,
    nor for the response part under kernels.decode_attention=torch (the run asked for the reference)."""
    import logging

    from longstraw_kernels import say_once, use_kernels
    from longstraw_kernels.attention.decode import say_where_the_references_run

    cuda, bf16, fp32 = torch.device("cuda"), torch.bfloat16, torch.float32

    def said(*args):
        say_once.cache_clear()
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            for _ in range(2):
                say_where_the_references_run(*args)
        return [("pages" if "flash" in r.getMessage() else "response") for r in caplog.records]

    assert said(torch.device("cpu"), fp32, fp32, 256) == []
    assert said(cuda, bf16, bf16, 256) == []
    assert said(cuda, fp32, fp32, 256) == ["pages", "response"]
    assert said(cuda, bf16, fp32, 256) == ["pages", "response"]
    assert said(cuda, bf16, bf16, 512) == ["pages", "response"]
    assert said(cuda, bf16, bf16, 96) == ["response"]
    with use_kernels(decode_attention="torch"):
        assert said(cuda, fp32, fp32, 128) == ["pages"]
    said(cuda, fp32, fp32, 256)
    assert "(queries torch.float32, pages torch.float32, head dim 256;" in caplog.records[0].getMessage()
