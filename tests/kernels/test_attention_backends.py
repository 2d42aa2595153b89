"""Choosing the fused attention kernel: the kernels.attention setting, the flash-attn import guard and its
fallback, and the layout plumbing of each kernel's call (checked on CPU through a stand-in flash-attn)."""

import sys
import types

import pytest
import torch

from conftest import rel_err
from longstraw_kernels import KernelConfig, use_kernels
from longstraw_kernels.attention import flash
from longstraw_kernels.attention.reference import naive_attention


@pytest.fixture
def no_flash_attn(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # `import flash_attn` raises ImportError
    flash.flash_attn_func.cache_clear()
    yield
    flash.flash_attn_func.cache_clear()


def test_bad_setting_names_the_choices():
    with pytest.raises(ValueError, match=r"kernels.attention='triton'.*auto.*cudnn.*flash.*flash_attn"):
        KernelConfig(attention="triton")


def test_without_flash_attn_auto_falls_back(no_flash_attn):
    assert flash.flash_attn_func() is None
    assert flash.forward_backend() in ("cudnn", "flash")
    use_kernels(attention="flash_attn")
    with pytest.raises(ImportError, match="pip install flash-attn"):
        flash.forward_backend()


def _fake_flash_attn_func(q_BLHD, k_BMHD, v_BMHD, softmax_scale, causal, return_attn_probs):
    """flash-attn's calling convention ([B, L, H, D] in and out, lse [B, H, L]) computed in plain torch."""
    assert return_attn_probs
    q_BHLD, k_BHMD, v_BHMD = (t.transpose(1, 2) for t in (q_BLHD, k_BMHD, v_BMHD))
    scores = softmax_scale * q_BHLD @ k_BHMD.transpose(-1, -2)
    if causal:  # bottom-right aligned, as flash-attn >= 2.1
        L, M = scores.shape[-2:]
        scores = scores.masked_fill(torch.ones(L, M, dtype=torch.bool).tril(M - L).logical_not(), float("-inf"))
    lse_BHL = torch.logsumexp(scores, -1)
    out_BHLD = torch.softmax(scores, -1) @ v_BHMD
    return out_BHLD.transpose(1, 2), lse_BHL, None


def test_flash_attn_is_used_when_installed(monkeypatch):
    fake = types.ModuleType("flash_attn")
    fake.flash_attn_func = _fake_flash_attn_func
    monkeypatch.setitem(sys.modules, "flash_attn", fake)
    flash.flash_attn_func.cache_clear()
    try:
        assert flash.forward_backend() == "flash_attn"
        g = torch.Generator().manual_seed(0)
        # the pages call: one query block [B, H, L, D] against [B, H, M, D], no mask; then causal with L == M
        q, k, v = (torch.randn(2, 3, n, 16, generator=g, dtype=torch.float64) for n in (5, 9, 9))
        out, lse = flash.attend(q, k, v, False, 0.3, "flash_attn")
        want_out, want_lse = naive_attention(q.transpose(1, 2), k[0].transpose(0, 1), v[0].transpose(0, 1),
                                             k[:, :, :0].transpose(1, 2), v[:, :, :0].transpose(1, 2), scale=0.3)
        assert rel_err(out[0], want_out[0].transpose(0, 1)) < 1e-12
        assert rel_err(lse[0], want_lse[0]) < 1e-6  # the lse comes back in float32
        q = torch.randn(2, 3, 9, 16, generator=g, dtype=torch.float64)
        out, lse = flash.attend(q, k, v, True, 0.3, "flash_attn")
        want_out, want_lse = naive_attention(q.transpose(1, 2), k[0, :, :0].transpose(0, 1),
                                             v[0, :, :0].transpose(0, 1), k.transpose(1, 2), v.transpose(1, 2),
                                             scale=0.3)
        assert rel_err(out, want_out.transpose(1, 2)) < 1e-12 and rel_err(lse, want_lse) < 1e-6
    finally:
        flash.flash_attn_func.cache_clear()
