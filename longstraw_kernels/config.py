"""Which kernel each op runs: the run's `kernels` config section (conf/config.yaml, `KernelConfig`).

The trainer hands its section to `use_kernels` once, at start; each op's dispatch reads its own field through
`kernel_choice` where it decides (as torch's ops read `torch.backends`), so a choice travels with the run's config
(`--cfg job`, `.hydra/`, its checkpoints) instead of the environment. A script or a test that builds a model
itself calls `use_kernels` the same way; until anything does, every op is on its default.

An op's default is `auto`: its fastest measured kernel where that kernel serves (CUDA, the dtypes and shapes it
takes, Triton installed), the torch reference elsewhere. `torch` runs the reference everywhere: to check a kernel
against it, or an A/B run. `attention` has no `torch` choice: its choices are fused kernels (cuDNN, aten's flash,
flash-attn), and the CPU's path is the reference. docs/guide/kernels.md says what each op's `auto` runs and the
figure that chose it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

AUTO_OR_TORCH = ("auto", "torch")
# the prompt pages' fused attention: auto takes flash_attn where it imports, else cuDNN on sm90+, else aten flash
ATTENTION_CHOICES = ("auto", "cudnn", "flash", "flash_attn")


@dataclass(frozen=True)
class KernelConfig:
    # the replay's and capture's fused attention over prompt pages (attention/flash.py)
    attention: str = "auto"
    # Gated DeltaNet (qwen36): our Triton chunked op where a gradient is needed and the decode step's kernels; torch:
    # their references (graph-free forwards over many tokens keep fla's kernel either way)
    gdn: str = "auto"
    # sparse MLA (glm52), forward and backward (mla/triton_sparse.py)
    mla: str = "auto"
    # the DSA indexer's scores and the decode's top-k (glm52; dsa/)
    dsa: str = "auto"
    # routed experts as grouped GEMMs (glm52; bf16, sm90+); torch: a loop over the experts
    experts: str = "auto"
    # the decode's router choice and weights in one kernel (glm52; moe/); torch: the router module
    router: str = "auto"
    # the decode's linears, one launch each with their norm, silu * up and residual add, glm52's decode experts too
    # (linear/triton_skinny.py); torch: the modules (cuBLAS and the norms' kernels)
    decode_linear: str = "auto"
    # the decode's query / key norms, RoPE and cache writes in one launch a layer (qwen36;
    # attention/triton_decode_qk.py); torch: the modules
    decode_qk: str = "auto"
    # the decode's attention over each response's own keys (attention/triton_decode_response.py)
    decode_attention: str = "auto"
    # the decode's sampling race (sampling/triton_race.py)
    sampling: str = "auto"
    # qwen36's norms (RMSNorm, GDN's gated norm and q / k L2 norm) and its MLP's SiLU(gate) * up, one launch each
    # forward and one backward where a graph is recorded (norm/triton_norm.py); torch: the references' several kernels
    norm: str = "auto"
    # NF4 dequantisation (lora.quantize=nf4; nf4/triton_nf4.py)
    nf4: str = "auto"
    # the autotune choices shipped for this GPU model (autotuned.py); false: each autotuner times its configs
    autotuned: bool = True

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name == "autotuned":
                if not isinstance(value, bool):
                    raise ValueError(f"kernels.autotuned={value!r}; valid: [true, false]")
                continue
            choices = ATTENTION_CHOICES if field.name == "attention" else AUTO_OR_TORCH
            if value not in choices:
                raise ValueError(f"kernels.{field.name}={value!r}; valid: {list(choices)}")


_active = KernelConfig()


def kernels() -> KernelConfig:
    """The kernel choices in force in this process."""
    return _active


def kernel_choice(op: str) -> str:
    """The choice in force for `op` (a KernelConfig field)."""
    return getattr(_active, op)


@contextlib.contextmanager
def _restoring(previous: KernelConfig) -> Iterator[KernelConfig]:
    global _active
    try:
        yield _active
    finally:
        _active = previous


def use_kernels(config: KernelConfig | None = None, **changes):
    """Put `config` (default: the one in force), with `changes` to its fields, in force for this process. As a
    context manager (`with use_kernels(mla="torch"):`) the choices before are back on leaving it."""
    global _active
    previous = _active
    _active = dataclasses.replace(config or _active, **changes)
    return _restoring(previous)
