import os
import socket
import sys

import pytest
import torch

# With triton importable, transformers' Qwen3.5 code binds fla and crashes on CPU; keep fla out of CPU tests
# (on a GPU machine fla's forward is one of the paths under test).
if not torch.cuda.is_available():
    sys.modules.setdefault("fla", None)
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """RMS-relative error ||a - b|| / ||b||; fails on NaN/inf and on an all-zero reference."""
    a, b = a.detach().double(), b.detach().double()
    assert a.shape == b.shape, (a.shape, b.shape)
    assert torch.isfinite(a).all() and torch.isfinite(b).all(), "non-finite values"
    ref = b.norm()
    assert ref > 0, "reference is all zeros: the comparison would prove nothing"
    return ((a - b).norm() / ref).item()


def free_port() -> int:
    """A free TCP port on localhost for a gloo rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors: intra-op threads only add synchronisation, which stalls badly on a busy 2-core machine."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)


def randomize_(model: torch.nn.Module, seed: int = 0) -> None:
    """Every parameter random, norms included: zeros or ones would hide a (1 + w) versus w mix-up."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.01, 4, generator=g).log())
            elif "norm" in name:
                p.copy_(0.5 * torch.rand(p.shape, generator=g) + (0.75 if "linear_attn.norm" in name else -0.25))
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.08)
