"""`flash.attend_pages`: the pages' forward of a replay as a batch of page ranges merged by LSE (when the folded
query rows alone leave SMs idle) equals one call over all pages, fp64, with a torch attention in place of the CUDA
kernels (on CUDA, tests/kernels/test_gpu.py runs the same path through cuDNN and aten flash); and `page_splits`
chooses ranges only for calls with few programs."""

from types import SimpleNamespace

import pytest
import torch

from conftest import rel_err
from longstraw_kernels.attention import flash


def torch_attend(q_BHLD, k_BHMD, v_BHMD, causal, scale, backend):
    assert not causal
    s_BHLM = scale * q_BHLD @ k_BHMD.transpose(-1, -2)
    lse_BHL = torch.logsumexp(s_BHLM, dim=-1)
    return torch.softmax(s_BHLM, dim=-1) @ v_BHMD, lse_BHL


@pytest.mark.parametrize("P", [1001, 1024])
@pytest.mark.parametrize("splits", [2, 3, 8])
def test_page_ranges_equal_one_call(P, splits, monkeypatch):
    monkeypatch.setattr(flash, "attend", torch_attend)
    g = torch.Generator().manual_seed(P + splits)
    K, M, D = 2, 24, 16
    q_1KMD = torch.randn(1, K, M, D, generator=g, dtype=torch.float64)
    k_PKD, v_PKD = (torch.randn(P, K, D, generator=g, dtype=torch.float64) for _ in range(2))
    want = flash.attend_pages(q_1KMD, k_PKD, v_PKD, D**-0.5, "flash", splits=1)
    got = flash.attend_pages(q_1KMD, k_PKD, v_PKD, D**-0.5, "flash", splits=splits)
    assert got[0].shape == want[0].shape == (1, K, M, D) and got[1].shape == want[1].shape == (1, K, M)
    assert rel_err(got[0], want[0]) <= 1e-13 and rel_err(got[1], want[1]) <= 1e-13


@pytest.mark.parametrize("K, rows, pages, expected", [
    (2, 8192, 262144, 1),    # qwen36_mini, a whole 1,024-token response: 128 programs, nearly every SM
    (2, 4096, 262144, 3),    # the same in replay blocks of 512: 64 programs
    (4, 1536, 262144, 3),    # the 27B shape in replay blocks of 256: 48 programs
    (2, 8, 262144, 8),       # one decode token: at most PAGE_SPLITS_MAX
    (2, 4096, 40000, 2),     # short prompt: each range at least PAGE_SPLIT_MIN_PAGES pages
    (2, 4096, 5000, 1),
])
def test_page_splits_only_where_programs_are_few(K, rows, pages, expected, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(multi_processor_count=132))
    assert flash.page_splits(K, rows, pages, torch.device("cpu")) == expected
