import os
import sys

import torch

# With triton importable, transformers' Qwen3.5 code binds fla and crashes on CPU; keep fla out of CPU tests
# (on a GPU machine fla's forward is one of the paths under test).
if not torch.cuda.is_available():
    sys.modules.setdefault("fla", None)
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """RMS-relative error of a against reference b; inf on NaN/inf, and the reference must be non-zero."""
    a, b = a.detach().double(), b.detach().double()
    assert a.shape == b.shape, (a.shape, b.shape)
    ref = b.norm().item()
    assert ref > 0, "reference is all zeros: the comparison would prove nothing"
    if not torch.isfinite(a).all():
        return float("inf")
    return (a - b).norm().item() / ref


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
